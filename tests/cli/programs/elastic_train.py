"""An ``hvd.elastic`` training program for the elastic launch tests.

Usage::

    python elastic_train.py REPORT [--epochs E] [--samples N] [--batch B] [--sleep S]
                                   [--kill START:N:RANK] [--interrupt START:N] [--hosts FILE --set START:N:LINES]

A linear model learns a fixed target from N samples through an
:class:`ElasticSampler`, committing after every step. Each step's sample
indices, gathered from every rank, are kept in the state (so the committed
record says which samples were trained, and a test can check that none was
skipped or taken twice), and so are the size and the hosts of every entry
into the training function.

Events happen after the N-th step (and its commit) of start START of the job
(``$RINGTRAIN_ELASTIC_JOB``), so they do not depend on timing:
``--kill START:N:RANK``: rank RANK SIGKILLs itself; ``--interrupt START:N``:
every rank raises ``HostsUpdatedInterrupt``; ``--set START:N:LINES``: rank 0
writes LINES (``;`` between lines) to FILE, which the launcher's discovery
script prints, and every rank calls ``check_host_updates`` until the
launcher's notice stops the job. At the end rank 0 writes REPORT (JSON): the state's record,
the sizes the reset callbacks saw, and every rank's digest of the parameters.
"""

import argparse
import hashlib
import json
import os
import signal
import socket
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
    parser.add_argument("--kill", action="append", default=[])
    parser.add_argument("--interrupt", action="append", default=[])
    parser.add_argument("--hosts")
    parser.add_argument("--set", action="append", default=[])
    return parser.parse_args(argv)


def events(args, start):
    """``{n: [(what, argument), ...]}``: what happens after this start's n-th step."""
    found = {}
    for what, specs in (("kill", args.kill), ("interrupt", args.interrupt), ("set", args.set)):
        for spec in specs:
            at, n, *rest = spec.split(":", 2)
            if int(at) == start:
                found.setdefault(int(n), []).append((what, rest[0] if rest else None))
    return found


def digest(model):
    h = hashlib.sha256()
    for tensor in model.state_dict().values():
        h.update(tensor.detach().numpy().tobytes())
    return h.hexdigest()


def wait_for_the_launcher(state, seconds=120):
    """Check for host updates until the launcher's notice arrives (it raises HostsUpdatedInterrupt).

    The training would otherwise go on, and might end before the notice
    comes. The same number of checks on every rank: the check is collective.
    """
    for _ in range(int(seconds / 0.1)):
        state.check_host_updates()
        time.sleep(0.1)
    raise RuntimeError(f"no notice from the launcher within {seconds}s of changing its hosts")


def main(argv):
    args = parse(argv)
    hvd.init()
    start = int(os.environ.get("RINGTRAIN_ELASTIC_JOB", "0"))
    happen = events(args, start)
    generator = torch.Generator().manual_seed(7)
    inputs = torch.randn(args.samples, 4, generator=generator)
    targets = inputs @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]])
    torch.manual_seed(hvd.rank())  # differing starts: the first sync must make them equal
    model = torch.nn.Linear(4, 1)
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.5),
                                         named_parameters=model.named_parameters())
    sampler = hvd.elastic.ElasticSampler(list(range(args.samples)), shuffle=True, seed=3)
    state = hvd.elastic.TorchState(model, optimizer, sampler=sampler, epoch=0, steps=0, seen={}, sizes=[],
                                   hosts=[])
    resets = []
    state.register_reset_callbacks([lambda: resets.append(hvd.size())])
    stepped = [0]  # steps this start has taken

    @hvd.elastic.run
    def train(state):
        state.sizes = state.sizes + [hvd.size()]
        state.hosts = state.hosts + [hvd.allgather_object(socket.gethostname())]
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
                stepped[0] += 1
                for what, argument in happen.get(stepped[0], []):
                    if what == "kill" and hvd.rank() == int(argument):
                        os.kill(os.getpid(), signal.SIGKILL)
                    if what == "set":
                        if hvd.rank() == 0:
                            with open(args.hosts, "w") as fh:
                                fh.write(argument.replace(";", "\n") + "\n")
                        wait_for_the_launcher(state)
                    if what == "interrupt":
                        raise hvd.HostsUpdatedInterrupt(False)
                time.sleep(args.sleep)
            sampler.set_epoch(state.epoch + 1)
        return state.steps

    steps = train(state)
    digests = hvd.allgather_object(digest(model))
    if hvd.rank() == 0:
        report = {"steps": steps, "epoch": state.epoch, "seen": state.seen, "sizes": state.sizes,
                  "hosts": state.hosts, "resets": resets, "digests": digests, "size": hvd.size(), "start": start}
        with open(args.report, "w") as fh:
            json.dump(report, fh)


if __name__ == "__main__":
    main(sys.argv[1:])
