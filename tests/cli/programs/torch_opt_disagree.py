"""One rank of an MPMD job whose ranks build their optimizers differently (tests/cli/test_torch_opt_mpmd.py).

    python torch_opt_disagree.py SIDE OUTDIR

SIDE ``a`` is rank 0's program, ``b`` every other rank's. For each case the
two sides build a ``DistributedOptimizer`` (or call
``broadcast_optimizer_state``) in a way that cannot be matched, or (case
``options``) with options the broadcast must make equal. Each rank writes
``OUTDIR/rank-R.json``: per case what happened (``ok``, or the exception's
type and message) and whether one more collective found the ranks still in
step (``level``).
"""

import json
import os
import sys

import torch

import ringtrain.torch as hvd


def net(extra=False, head=2):
    torch.manual_seed(0)
    layers = {"body": torch.nn.Linear(4, 3), "head": torch.nn.Linear(3, head)}
    if extra:
        layers["extra"] = torch.nn.Linear(2, 2)
    return torch.nn.ModuleDict(layers)


class Custom(hvd.Compression.none):
    """A compressor of the user's own, which ringtrain's optimizer refuses."""


def positions(b):
    # No names: matched by position, and side b lists the parameters the other way round.
    params = list(net().parameters())
    return hvd.DistributedOptimizer(torch.optim.SGD(params[::-1] if b else params, lr=0.1))


def named(model, **kwargs):
    return hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                    named_parameters=model.named_parameters(), **kwargs)


def unnamed(b):
    # Side b leaves a parameter out of the names: Horovod's ValueError there, and no rank left waiting.
    model = net()
    names = list(model.named_parameters())[: -1 if b else None]
    return hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=names)


def groups_optimizer(b, lr=0.1, momentum=0.9, split=False):
    model = net()
    if split:  # two groups where the root has one
        groups = [{"params": model["body"].parameters()}, {"params": model["head"].parameters(), "lr": lr / 10}]
        return torch.optim.SGD(groups, lr=lr, momentum=momentum)
    return torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)


def options(b):
    opt = groups_optimizer(b, lr=0.5 if b else 0.1, momentum=0.1 if b else 0.9)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    return [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]


CASES = {
    "positions": positions,
    "names": lambda b: named(net(extra=b)),
    "shapes": lambda b: named(net(head=5 if b else 2)),
    "reduction": lambda b: named(net(), op=hvd.Sum if b else hvd.Average),
    "refused": lambda b: named(net(), compression=Custom if b else hvd.Compression.none),
    "unnamed": unnamed,
    "groups": lambda b: hvd.broadcast_optimizer_state(groups_optimizer(b, split=b), root_rank=0),
    "options": options,
}


def main(side, outdir):
    hvd.init()
    b = side == "b"
    results = {}
    for case, build in CASES.items():
        try:
            got = build(b)
            result = {"outcome": "ok", "value": got if case == "options" else None}
        except Exception as exc:  # every outcome is recorded; the test judges them after the job
            result = {"outcome": type(exc).__name__, "message": str(exc), "runtime": isinstance(exc, RuntimeError),
                      "everywhere": getattr(exc, "everywhere", False)}
        total = hvd.allreduce(torch.ones(1), op=hvd.Sum, name=f"level.{case}")
        result["level"] = total.item() == hvd.size()
        results[case] = result
    with open(os.path.join(outdir, f"rank-{hvd.rank()}.json"), "w") as fh:
        json.dump(results, fh)


if __name__ == "__main__":
    main(*sys.argv[1:3])
