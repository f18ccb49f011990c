"""Horovod's own elastic test and elastic examples, unmodified, through scripts/horovod_elastic.py.

Needs a checkout of Horovod v0.28.1 named by HOROVOD_CHECKOUT (its code is
never copied here) and the examples' packages (torchvision, pillow, filelock,
mlxtend); skipped, saying which is missing, without them.
"""

import importlib.util
import os
import subprocess
import sys

import pytest

from mpirun import ROOT
from mpirun import test_env as job_env

CHECKOUT = os.environ.get("HOROVOD_CHECKOUT", "")


def missing():
    if not os.path.isfile(os.path.join(CHECKOUT, "test", "single", "test_torch_elastic.py")):
        return "set HOROVOD_CHECKOUT to a checkout of horovod v0.28.1"
    for package in ("torchvision", "PIL", "filelock", "mlxtend"):
        if importlib.util.find_spec(package) is None:
            return f"{package} is not installed"
    return None


@pytest.mark.skipif(missing() is not None, reason=str(missing()))
def test_horovods_elastic_test_and_examples_pass_and_the_examples_survive_a_killed_worker():
    done = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "horovod_elastic.py"), CHECKOUT],
                          capture_output=True, text=True, timeout=1500, env=job_env(), cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert [line.split()[:2] for line in done.stdout.splitlines()] == [
        ["PASS", "test"], ["PASS", "synthetic"], ["PASS", "mnist"]], done.stdout
