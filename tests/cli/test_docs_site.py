"""The documentation site builds in strict mode, with every page in it and docs/incoming/ left out.

mkdocs comes with the [docs] extra; without it the test skips, saying why, except under CI, which
installs it (tests/markdown_pages.require), so CI always builds the site.
"""

import os
import subprocess
import sys

from markdown_pages import PAGES, require
from mpirun import ROOT

require("mkdocs", "pip install -e '.[docs]'")


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
