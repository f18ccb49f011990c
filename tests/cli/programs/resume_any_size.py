"""Train part of an epoch on N ranks, resume the rest on M, and record every row each rank trained on.

Usage (under ``mpirun -np 4``)::

    python resume_any_size.py DATA.npz OUT_DIR BATCH N:M[@last] [N:M[@last] ...]

For each ``N:M``, world ranks ``0..N-1`` train (through :func:`ringtrain.train`
on a communicator of their own) the first steps of epoch 1 and stop
mid-epoch with a checkpoint (with ``@last``, just before the epoch's last,
partial batch); then ranks ``0..M-1`` resume from it
(``--resume auto`` on the same run directory) and finish the epoch. The
dataset's first feature is each row's number, so a model that notes its
batches' first column records which rows were trained on. World rank 0
writes ``OUT_DIR/records.json``: for each pair, the rows before and after
the resume and the final checkpoint's metadata.
"""

import json
import os
import sys

import numpy as np
from mpi4py import MPI

from ringtrain import EpochPlan, TrainConfig, build_model, train
from ringtrain.io.checkpoint import list_checkpoints, read_checkpoint


def recording(model, seen):
    """``model`` with its loss_and_grad noting each batch's row numbers in ``seen``."""
    inner = model.loss_and_grad

    def loss_and_grad(x, y, on_grad=None):
        seen.extend(int(v) for v in np.asarray(x)[:, 0])
        return inner(x, y) if on_grad is None else inner(x, y, on_grad=on_grad)

    model.loss_and_grad = loss_and_grad
    return model


def part(world, ranks, cfg, features, classes):
    """Train ``cfg`` on world ranks ``0..ranks-1``; every world rank returns the rows all of them trained on."""
    mine = []
    sub = world.Split(0 if world.Get_rank() < ranks else MPI.UNDEFINED, world.Get_rank())
    if sub != MPI.COMM_NULL:
        model = recording(build_model("mlp", features, classes, hidden=cfg.hidden, seed=cfg.seed), mine)
        train(cfg, comm=sub, model=model)
        sub.Free()
    return [row for rows in world.allgather(mine) for row in rows]


def main():
    data, out, batch = sys.argv[1], sys.argv[2], int(sys.argv[3])
    world = MPI.COMM_WORLD
    with np.load(data) as arrays:
        rows, features, classes = arrays["x"].shape[0], arrays["x"].shape[1], int(arrays["y"].max()) + 1
    records = {}
    for pair in sys.argv[4:]:
        ranks, _, where = pair.partition("@")
        n, m = map(int, ranks.split(":"))
        run_dir = os.path.join(out, f"{n}to{m}{where}")
        steps = EpochPlan(rows, n, 0, batch).steps_per_epoch
        cut = steps - 1 if where == "last" else steps * 2 // 5  # before the last (partial) batch, or mid-epoch
        base = dict(dataset=data, hidden=(8,), batch_size=batch, epochs=1, run_dir=run_dir, progress=False,
                    log_every=1000)
        before = part(world, n, TrainConfig(**base, max_steps=cut), features, classes)
        after = part(world, m, TrainConfig(**base), features, classes)
        if world.Get_rank() == 0:
            _, meta = read_checkpoint(list_checkpoints(os.path.join(run_dir, "checkpoints"))[0])
            records[pair] = {"before": before, "after": after, "cut": cut, "final": {
                k: meta[k] for k in ("step", "epoch", "step_in_epoch", "world_size", "data_position")}}
    if world.Get_rank() == 0:
        with open(os.path.join(out, "records.json"), "w") as f:
            json.dump(records, f)


if __name__ == "__main__":
    main()
