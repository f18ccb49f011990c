"""What the install promises: one version, torch pinned and kept out of [test], a suite that runs without it, and
CI with every extra."""

import configparser
import importlib.util
import os
import re
import subprocess
import sys

import pytest

import ringtrain
from mpirun import ROOT


def _extras():
    cfg = configparser.ConfigParser()
    cfg.read(os.path.join(ROOT, "setup.cfg"), encoding="utf-8")
    return {name: value.split() for name, value in cfg["options.extras_require"].items()}


def test_one_version_in_the_package_setup_cfg_and_the_changelog():
    cfg = configparser.ConfigParser()
    cfg.read(os.path.join(ROOT, "setup.cfg"), encoding="utf-8")
    assert cfg["metadata"]["version"] == "attr: ringtrain.__version__"
    with open(os.path.join(ROOT, "CHANGELOG.md"), encoding="utf-8") as f:
        newest = re.search(r"^## (\d+\.\d+\.\d+)", f.read(), re.M).group(1)
    assert newest == ringtrain.__version__


def test_torch_is_pinned_and_only_where_asked_for():
    extras = _extras()
    assert extras["torch"] == ["torch==2.13.0"]
    assert not any(req.startswith("torch") for req in extras["test"]), "[test] must stay quick: no torch"
    assert "mlxtend" in extras["test"] and "markdown-it-py" in extras["test"]


def test_every_test_module_loads_without_torch_as_the_readmes_test_command_installs_it():
    # The README's `pip install -e '.[test]' && python -m pytest` has no torch: one module that imports
    # it unguarded is a collection error, and pytest then runs nothing at all.
    hide_torch = ("import sys; sys.modules['torch'] = None; import pytest; "
                  "sys.exit(pytest.main(['--collect-only', '-q', '-p', 'no:cacheprovider', 'tests']))")
    done = subprocess.run([sys.executable, "-c", hide_torch], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, (done.stdout[-3000:], done.stderr[-2000:])
    assert "torch is not installed (pip install torch==2.13.0)" in done.stdout, done.stdout[-3000:]


def test_a_missing_matplotlib_says_how_a_clone_installs_it(monkeypatch):
    # ringtrain is not on PyPI: "pip install 'ringtrain[plot]'" would fail; the clone's form must be given.
    from ringtrain.commands import plot
    from ringtrain.errors import UsageError

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(UsageError) as caught:
        plot._pyplot()
    assert str(caught.value) == ("ringtrain plot needs matplotlib, which is not installed: pip install matplotlib "
                                 "(or, in ringtrain's clone, pip install -e '.[plot]')")
    assert "ringtrain[plot]" not in str(caught.value)


@pytest.mark.skipif(not os.environ.get("CI"), reason="only CI promises every extra (.ci/run installs them)")
@pytest.mark.parametrize("module", ["torch", "mlxtend", "mkdocs", "mkdocstrings", "markdown_it", "matplotlib"])
def test_ci_has_every_extra_so_no_test_skips_for_want_of_one(module):
    assert importlib.util.find_spec(module) is not None, f"CI's install lacks {module}"


def test_install_sizes_asks_pypi_alone(monkeypatch):
    """scripts/install_sizes.py: no local index, find-links or constraint of this machine leaks into its pip."""
    spec = importlib.util.spec_from_file_location("install_sizes", os.path.join(ROOT, "scripts", "install_sizes.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setenv("PIP_FIND_LINKS", "/opt/wheels")
    monkeypatch.setenv("PIP_EXTRA_INDEX_URL", "file:///opt/pypi/simple")
    env = module._pip_env()
    assert env["PIP_CONFIG_FILE"] == os.devnull and "PIP_FIND_LINKS" not in env and "PIP_EXTRA_INDEX_URL" not in env
    assert module.PYPI == "https://pypi.org/simple" and module.size_of("/work/main") == 0
