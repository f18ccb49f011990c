"""``import ringtrain.torch as hvd; hvd.init()`` once per case, each in a fresh child, torch imported once.

Usage: python hvd_environment.py CASES.json: a list of ``{"VARIABLE": "value", ...}``. Prints one JSON
line: for each case, ``[exit status, what the child wrote to stderr, what it wrote to stdout]``.

Torch is the slow import, so the parent imports it (and not MPI); each child sets its case's
variables, then does what a Horovod script does, as a world of one. A child that gets through prints
``initialised`` and exits 0. The cases before the first ``"imported"`` (a string, not a case) are the
ones whose variables ringtrain.torch reads at import: for those the child imports it afresh; from there
on the parent has imported it once (with none of the cases' variables set), to save each child the time.
"""

import json
import os
import sys
import tempfile

import torch  # noqa: F401 - imported before the fork, once for every case


def child(case, out, err):
    os.dup2(out, 1)
    os.dup2(err, 2)
    os.environ.update(case)
    status = 0
    try:
        import ringtrain.torch as hvd

        hvd.init()
        print("initialised", flush=True)
    except SystemExit as exc:
        status = exc.code if isinstance(exc.code, int) else 1
    except BaseException:  # noqa: BLE001 - a traceback is what the test looks for
        import traceback

        traceback.print_exc()
        status = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def main(path):
    with open(path) as fh:
        cases = json.load(fh)
    results = []
    for case in cases:
        if case == "imported":
            import ringtrain.torch  # noqa: F401 - see the module's docstring
            continue
        with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
            pid = os.fork()
            if pid == 0:
                child(case, out.fileno(), err.fileno())
            _, status = os.waitpid(pid, 0)
            texts = []
            for fh in (err, out):
                fh.seek(0)
                texts.append(fh.read().decode("utf-8", "replace"))
            results.append([os.waitstatus_to_exitcode(status), *texts])
    print(json.dumps(results))


if __name__ == "__main__":
    main(sys.argv[1])
