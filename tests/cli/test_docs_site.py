"""The documentation site builds in strict mode, with every page in it and docs/incoming/ left out,
and the API reference shows the docstrings' Sphinx roles as links, never as raw text.

mkdocs comes with the [docs] extra; without it the test skips, saying why, except under CI, which
installs it (tests/markdown_pages.require), so CI always builds the site.
"""

import glob
import os
import re
import subprocess
import sys

from markdown_pages import PAGES, require
from mpirun import ROOT

require("mkdocs", "pip install -e '.[docs]'")

# A role as the docstrings write it, and as Markdown renders one that nothing rewrote.
RAW_ROLE = re.compile(r":(?:class|func|mod|meth|data|attr|exc|obj):(?:`|<code>)")


def test_mkdocs_builds_strictly_every_page_and_not_incoming(tmp_path):
    site = tmp_path / "site"
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
                            cwd=ROOT, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert result.returncode == 0, result.stdout + result.stderr
    for page in PAGES:
        if page.startswith("docs" + os.sep):
            name = os.path.splitext(os.path.relpath(page, "docs"))[0]
            built = site / ("index.html" if name == "index" else os.path.join(name, "index.html"))
            assert built.is_file(), f"{page} is not in the site (add it to mkdocs.yml's nav)"
    assert os.path.isdir(os.path.join(ROOT, "docs", "incoming")) and not (site / "incoming").exists()
    api = (site / "api" / "ringtrain" / "index.html").read_text(encoding="utf-8")
    assert 'id="ringtrain.allreduce_"' in api and 'id="ringtrain.TaskSpec.from_mpi"' in api
    _no_raw_roles_and_links_where_they_were(site)


def _no_raw_roles_and_links_where_they_were(site):
    raw = {}
    for path in glob.glob(str(site / "**" / "*.html"), recursive=True):
        with open(path, encoding="utf-8") as f:
            found = RAW_ROLE.findall(f.read())
        if found:
            raw[os.path.relpath(path, site)] = len(found)
    assert raw == {}, f"raw Sphinx roles in the built site (docs/hooks/sphinx_roles.py should rewrite them): {raw}"
    torch_api = (site / "api" / "torch" / "index.html").read_text(encoding="utf-8")
    # ringtrain.torch's module docstring: "* :class:`ringtrain.torch.TorchModel`: ..." links to its entry.
    assert re.search(r'<a class="autorefs autorefs-internal"[^>]* href="#ringtrain\.torch\.TorchModel"', torch_api)
    api = (site / "api" / "ringtrain" / "index.html").read_text(encoding="utf-8")
    # ShardedStep's docstring: "Build with :meth:`create`", a name found in the class's own scope.
    assert re.search(r'<a class="autorefs autorefs-internal"[^>]* href="#ringtrain\.ShardedStep\.create"', api)


def test_a_role_becomes_an_optional_autoref_of_its_resolved_name():
    sys.path.insert(0, os.path.join(ROOT, "docs", "hooks"))
    try:
        import sphinx_roles
    finally:
        sys.path.pop(0)

    class Scope:        # the part of a Griffe object the rewrite uses: resolve a name, or say it cannot
        parent = None
        is_class = False
        modules_collection = {}

        def resolve(self, name):
            if name != "TaskSpec":
                raise KeyError(name)
            return "ringtrain.cluster.topology.TaskSpec"

    assert sphinx_roles.rewrite("see :class:`TaskSpec` and :func:`~ringtrain.comm.allreduce`", Scope()) == (
        'see <autoref identifier="ringtrain.cluster.topology.TaskSpec" optional><code>TaskSpec</code></autoref> '
        'and <autoref identifier="ringtrain.comm.allreduce" optional><code>allreduce</code></autoref>')
