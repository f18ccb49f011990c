"""What an install command would download from PyPI alone, for the install page.

    python scripts/install_sizes.py -e '.[test]'
    python scripts/install_sizes.py 'torch==2.13.0'

Runs ``pip install --dry-run --report`` in a fresh virtual environment against
PyPI only (``--index-url https://pypi.org/simple``, no pip configuration, no
``--find-links``), so a machine's local indexes or wheels do not hide what a user
elsewhere would get, then asks for each file's size with an HTTP HEAD request.
Prints one line per package, largest first, and the total. Nothing is installed.
Needs the network to reach PyPI.
"""

import json
import os
import subprocess
import sys
import tempfile
import urllib.request

PYPI = "https://pypi.org/simple"


def _pip_env():
    """The environment for a pip that sees PyPI and nothing else."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env["PIP_CONFIG_FILE"] = os.devnull          # no local indexes, find-links or constraints
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return env


def resolve(requirements, timeout=600):
    """The packages pip would install for ``requirements``: [(name, version, url)]."""
    with tempfile.TemporaryDirectory() as tmp:
        venv = os.path.join(tmp, "venv")
        subprocess.run([sys.executable, "-m", "venv", venv], check=True, timeout=timeout)
        report = os.path.join(tmp, "report.json")
        subprocess.run([os.path.join(venv, "bin", "pip"), "install", "--quiet", "--dry-run", "--ignore-installed",
                        "--index-url", PYPI, "--report", report, *requirements],
                       check=True, timeout=timeout, env=_pip_env())
        with open(report, encoding="utf-8") as f:
            found = json.load(f)["install"]
    return [(p["metadata"]["name"], p["metadata"]["version"], p["download_info"]["url"]) for p in found]


def size_of(url, timeout=60):
    """Bytes of the file at ``url`` (0 for a local directory, such as ``-e .``)."""
    if not url.startswith("http"):
        return 0
    request = urllib.request.Request(url, method="HEAD")
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return int(response.headers.get("Content-Length", 0))


def main(argv=None):
    requirements = sys.argv[1:] if argv is None else argv   # as given to pip install, -e and all
    if not requirements or requirements[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if requirements else 2
    packages = resolve(requirements)
    sized = sorted(((size_of(url), name, version) for name, version, url in packages), reverse=True)
    for size, name, version in sized:
        print(f"{size / 1e6:10.1f} MB  {name} {version}")
    total = sum(size for size, _, _ in sized)
    print(f"{total / 1e6:10.1f} MB  in all, {len(sized)} packages, from PyPI for "
          f"Python {sys.version_info.major}.{sys.version_info.minor} on {sys.platform}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
