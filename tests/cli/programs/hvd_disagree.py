"""One rank of an MPMD job whose ranks call a ringtrain.torch collective differently (tests/cli/test_hvd_mpmd.py).

    python hvd_disagree.py CASE SIDE

CASE names what the two programs disagree on (shape, dtype, op, root,
trailing); SIDE (``a`` or ``b``) is which of the two this rank is. Every
rank prints one line: ``mismatch: <message>`` if the collective raised a
RuntimeError, ``ok`` if it did not; then one more collective shows the
ranks are still in step (``level``).
"""

import sys

import torch

import ringtrain.torch as hvd


def call(case, side):
    b = side == "b"
    if case == "shape":
        return hvd.allreduce(torch.ones(3 + b), name="x")
    if case == "dtype":
        return hvd.allreduce(torch.ones(3, dtype=torch.float64 if b else torch.float32), name="x")
    if case == "op":
        return hvd.allreduce(torch.ones(3), op=hvd.Max if b else hvd.Sum, name="x")
    if case == "root":
        return hvd.broadcast(torch.ones(3), root_rank=int(b), name="x")
    if case == "trailing":
        return hvd.allgather(torch.ones(2, 3 + b), name="x")
    raise SystemExit(f"unknown case {case!r}")


def main(case, side):
    hvd.init()
    try:
        call(case, side)
        print("ok", flush=True)
    except RuntimeError as exc:
        print(f"mismatch: {exc}", flush=True)
    total = hvd.allreduce(torch.ones(1), op=hvd.Sum, name="after")
    print("level" if total.item() == hvd.size() else "out of step", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:3])
