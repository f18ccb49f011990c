"""One rank of an MPMD job whose ranks call a ringtrain.torch collective differently (tests/cli/test_torch_ops_mpmd.py).

    python hvd_disagree.py CASE SIDE

CASE names what the two programs disagree on (shape, dtype, op, root,
trailing, kind, set, grouped, splits, large; nan is a case where they agree
on a NaN factor); SIDE (``a`` or ``b``) is which of the two this rank is.
Every rank prints one line: ``mismatch: <message>`` if the collective raised
a RuntimeError or ValueError, ``ok`` if it did not; then one more collective
of the same name shows the ranks are still in step (``level``).
"""

import sys

import torch

import ringtrain.torch as hvd


def call(case, side, ps):
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
    if case == "kind":  # one name, two kinds
        return (hvd.allgather if b else hvd.allreduce)(torch.ones(3), name="x")
    if case == "set":  # one name, two process sets (of the same ranks)
        return hvd.allreduce(torch.ones(3), name="x", process_set=ps if b else hvd.global_process_set)
    if case == "grouped":
        return hvd.grouped_allreduce([torch.ones(2)] * (3 if b else 2), name="g")
    if case == "splits":  # one rank's splits ask for more rows than it has: it refuses, its peer must hear of it
        return hvd.alltoall(torch.ones(2, 2), torch.tensor([1, 5] if b else [1, 1], dtype=torch.int32), name="x")
    if case == "large":  # a collective (too large to travel with the announcement), of two shapes
        return hvd.allreduce(torch.ones(20000 + b), name="x")
    if case == "nan":  # the same NaN factor on every rank: they agree
        return hvd.allreduce(torch.ones(3), name="x", prescale_factor=float("nan"))
    raise SystemExit(f"unknown case {case!r}")


def main(case, side):
    hvd.init()
    ps = hvd.add_process_set(list(range(hvd.size())))
    try:
        call(case, side, ps)
        print("ok", flush=True)
    except (RuntimeError, ValueError) as exc:
        print(f"mismatch: {exc}", flush=True)
    # The same name again: an op left waiting on one rank would pair with this one, a step off.
    total = hvd.allreduce(torch.ones(1), op=hvd.Sum, name="x")
    print("level" if total.item() == hvd.size() else "out of step", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:3])
