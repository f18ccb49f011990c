"""The example programs in scripts/ run as documented and learn."""

import os
import re
import sys

import pytest

from mpirun import ROOT, mpirun, show


@pytest.mark.parametrize("script,pattern", [
    ("train_library.py", r"epoch 20: test accuracy ([\d.]+)%"),
    ("custom_model.py", r"custom model: test accuracy ([\d.]+)%"),
])
def test_example_script_trains(tmp_path, script, pattern):
    result = mpirun(2, [sys.executable, os.path.join(ROOT, "scripts", script)], timeout=120, cwd=str(tmp_path))
    assert result.returncode == 0, show(result)
    found = re.search(pattern, result.stdout)
    assert found and float(found.group(1)) >= 95.0, show(result)
