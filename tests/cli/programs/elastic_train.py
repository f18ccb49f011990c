"""An ``hvd.elastic`` training program for the elastic launch tests.

Usage::

    python elastic_train.py REPORT [--epochs E] [--samples N] [--batch B] [--sleep S] [--pids DIR]
                                   [--interrupt-at STEP] [--kill RANK:STEP]

A linear model learns a fixed target from N samples through an
:class:`ElasticSampler`, committing after every step. Each step's sample
indices, gathered from every rank, are kept in the state (so the committed
record says which samples were trained, and a test can check that none was
skipped or taken twice), and so is the size of every start. ``--pids DIR``:
each rank writes ``DIR/<start>-<rank>`` with its pid, for a test to kill it.
``--interrupt-at STEP``: every rank raises ``HostsUpdatedInterrupt`` once,
after step STEP's commit. ``--kill RANK:STEP``: on the first
start, rank RANK SIGKILLs itself after step STEP's commit. At the end rank 0
writes REPORT (JSON): the state's record, the number of reset callbacks, and
every rank's digest of the parameters.
"""

import argparse
import hashlib
import json
import os
import signal
import sys
import time

import torch

import ringtrain.torch as hvd


def parse(argv):
    parser = argparse.ArgumentParser()
    parser.add_argument("report")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--samples", type=int, default=48)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--sleep", type=float, default=0.0)
    parser.add_argument("--pids")
    parser.add_argument("--interrupt-at", type=int)
    parser.add_argument("--kill")
    return parser.parse_args(argv)


def digest(model):
    h = hashlib.sha256()
    for tensor in model.state_dict().values():
        h.update(tensor.detach().numpy().tobytes())
    return h.hexdigest()


def main(argv):
    args = parse(argv)
    hvd.init()
    start = int(os.environ.get("RINGTRAIN_ELASTIC_JOB", "0"))
    if args.pids:
        with open(os.path.join(args.pids, f"{start}-{hvd.rank()}"), "w") as fh:
            fh.write(str(os.getpid()))
    generator = torch.Generator().manual_seed(7)
    inputs = torch.randn(args.samples, 4, generator=generator)
    targets = inputs @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]])
    torch.manual_seed(hvd.rank())  # differing starts: the first sync must make them equal
    model = torch.nn.Linear(4, 1)
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.5),
                                         named_parameters=model.named_parameters())
    sampler = hvd.elastic.ElasticSampler(list(range(args.samples)), shuffle=True, seed=3)
    state = hvd.elastic.TorchState(model, optimizer, sampler=sampler, epoch=0, steps=0, seen={}, sizes=[],
                                   interrupted=False)
    resets = []
    state.register_reset_callbacks([lambda: resets.append(hvd.size())])
    kill_rank, kill_step = (int(x) for x in args.kill.split(":")) if args.kill else (None, None)

    @hvd.elastic.run
    def train(state):
        state.sizes = state.sizes + [hvd.size()]
        for epoch in range(state.epoch, args.epochs):
            state.epoch = epoch
            indices = list(sampler)
            for first in range(0, len(indices), args.batch):
                batch = indices[first:first + args.batch]
                optimizer.zero_grad()
                loss = torch.nn.functional.mse_loss(model(inputs[batch]), targets[batch])
                loss.backward()
                optimizer.step()
                taken = sorted(i for part in hvd.allgather_object(batch) for i in part)
                state.seen = dict(state.seen, **{str(state.epoch): state.seen.get(str(state.epoch), []) + taken})
                sampler.record_batch(0, len(batch))
                state.steps += 1
                state.commit()
                if state.steps == args.interrupt_at and not state.interrupted:
                    state.interrupted = True
                    state.save()
                    raise hvd.HostsUpdatedInterrupt(False)
                if start == 0 and hvd.rank() == kill_rank and state.steps == kill_step:
                    os.kill(os.getpid(), signal.SIGKILL)
                time.sleep(args.sleep)
            sampler.set_epoch(state.epoch + 1)
        return state.steps

    steps = train(state)
    digests = hvd.allgather_object(digest(model))
    if hvd.rank() == 0:
        report = {"steps": steps, "epoch": state.epoch, "seen": state.seen, "sizes": state.sizes,
                  "resets": resets, "digests": digests, "size": hvd.size(), "start": start,
                  "interrupted": state.interrupted}
        with open(args.report, "w") as fh:
            json.dump(report, fh)


if __name__ == "__main__":
    main(sys.argv[1:])
