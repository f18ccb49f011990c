"""One rank of a ringtrain.torch job in which one rank fails, leaves or lags (tests/cli/test_torch_failures.py).

    python hvd_failures.py CASE

CASE is what rank 1 does while the others submit the op ``loss``:

* ``raise``: raises an uncaught exception;
* ``exit``: calls ``sys.exit(3)``;
* ``kill``: kills itself with SIGKILL;
* ``shutdown``: calls ``hvd.shutdown()`` and then waits for word from rank 0 (every rank first submits
  ``mine``, an op no other rank submits, and synchronizes it after its own shutdown);
* ``stall``: arrives 20 s late (Horovod's test_stall: check 2 s, shut down 5 s);
* ``bound``: never arrives (the job runs under ``RINGTRAIN_TIMEOUT``);
* ``set-stall``: ranks 1 and 2 make a process set, and rank 2 is 4 s late to its op (check 1 s);
* ``exit-helpers``: every rank builds a ``DistributedOptimizer``; rank 1 calls ``sys.exit(3)`` inside
  its backward, while rank 2 is in its own backward (in the gradient reduction, a collective that runs
  around the engine); rank 0 waits for an op rank 1 never submits, then calls ``broadcast_parameters``;
* ``bound-optimizer``: rank 1 sleeps two minutes before its backward (under ``RINGTRAIN_TIMEOUT``);
* ``exit-elastic``: an ``hvd.elastic.run`` loop in which rank 1 calls ``sys.exit(3)`` at step 2;
* ``shutdown-race``: nobody fails: a loop of small ops whose data comes with their announcements, then
  each rank shuts down as soon as its last op is done, while rank 2's announcements reach rank 1 late
  (rank 1 must still complete its last op, though ranks 0 and 2 have shut down).

Every other rank prints one line per op: ``<op> failed: <message>`` or
``<op> ok``. In ``stall`` each waiting rank, once its op has failed, tells
rank 1 over MPI; rank 1 prints whether that word came before it arrived.
"""

import os
import signal
import sys
import time

import torch
from mpi4py import MPI

import ringtrain.torch as hvd
from ringtrain import engine

from late_sends import LateTo  # this directory is on sys.path: it is the script's

WORD = 77  # the tag of the waiting ranks' word to rank 1


def attempt(what, fn):
    try:
        fn()
        print(f"rank {hvd.rank()}: {what} ok", flush=True)
        return True
    except hvd.HorovodInternalError as exc:
        print(f"rank {hvd.rank()}: {what} failed: {exc}", flush=True)
        return False


def late_rank(case):
    if case == "raise":
        raise RuntimeError("boom on purpose")
    if case == "exit":
        sys.exit(3)
    if case == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if case == "shutdown":
        hvd.shutdown()
        report_mine()
        MPI.COMM_WORLD.recv(source=0, tag=WORD)  # stays alive until rank 0 has seen its ops fail
        return
    if case == "stall":
        comm = MPI.COMM_WORLD
        early = comm.Iprobe(source=MPI.ANY_SOURCE, tag=WORD)
        deadline = time.monotonic() + 20
        while not early and time.monotonic() < deadline:
            time.sleep(0.1)
            early = comm.Iprobe(source=MPI.ANY_SOURCE, tag=WORD)
        attempt("loss", lambda: hvd.allreduce(torch.ones(2), name="loss"))
        # Every waiting rank's word is received (MPICH ends a job whose ranks exit with a probed message unread).
        words = [comm.recv(source=r, tag=WORD) for r in range(comm.Get_size()) if r != 1]
        print(f"rank 1: {'a peer failed before I arrived' if early and all(words) else 'no word before I arrived'}",
              flush=True)
        return
    time.sleep(120)  # bound: never arrives


MINE = []


def report_mine():
    """``mine`` was pending when this rank shut down (or a peer did): synchronizing it must raise, not wait."""
    rank = MPI.COMM_WORLD.Get_rank()
    try:
        hvd.synchronize(MINE[0])
        print(f"rank {rank}: mine ok", flush=True)
    except hvd.HorovodInternalError as exc:
        print(f"rank {rank}: mine failed: {exc}", flush=True)


def set_stall():
    """Ranks 1 and 2 form a set; rank 2 comes 4 s late; rank 0, outside it, waits for word in plain MPI."""
    subset = hvd.add_process_set([1, 2])
    if hvd.rank() == 0:
        MPI.COMM_WORLD.recv(source=1, tag=WORD)
        return
    if hvd.rank() == 2:
        time.sleep(4)
    attempt("in-set", lambda: hvd.allreduce(torch.ones(2), name="in-set", process_set=subset))
    if hvd.rank() == 1:
        MPI.COMM_WORLD.send(True, dest=0, tag=WORD)


def model_and_optimizer():
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)])
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                         named_parameters=model.named_parameters())
    return model, optimizer


def train_step(model, optimizer, pause=0.0):
    optimizer.zero_grad()
    loss = model(torch.randn(8, 64)).sum()
    time.sleep(pause)  # before backward: its hooks would start this rank's reductions
    loss.backward()
    optimizer.step()


def exit_helpers():
    model, optimizer = model_and_optimizer()
    if hvd.rank() == 1:
        model[1].weight.register_hook(lambda grad: sys.exit(3))
    if hvd.rank() == 0:  # hears of rank 1's exit, then calls a helper: it must fail, not wait
        attempt("probe", lambda: hvd.allreduce(torch.ones(2), name="probe"))
        attempt("broadcast_parameters", lambda: hvd.broadcast_parameters(model.state_dict(), root_rank=0))
        time.sleep(60)  # the job ends with rank 2, which cannot leave its collective
    train_step(model, optimizer)


def exit_elastic():
    model, optimizer = model_and_optimizer()
    state = hvd.elastic.TorchState(model, optimizer, step=0)

    @hvd.elastic.run
    def train(state):
        while state.step < 5:
            if hvd.rank() == 1 and state.step == 2:
                sys.exit(3)
            hvd.allreduce(torch.ones(1), name="metric")  # rank 0 waits here when rank 1 exits
            train_step(model, optimizer)
            state.step += 1
            state.commit()

    train(state)


def shutdown_race():
    if hvd.rank() == 2:
        protocol = engine.current().engine.channels[0].protocol
        protocol.control = LateTo(protocol.control, 1, 0.002)

    def loop():
        for step in range(12):
            hvd.allreduce_(torch.ones(2), name=f"n{step % 2}")
    attempt("loop", loop)
    hvd.shutdown()


def alone(case):
    """A loop of blocking small ops, each run alone (the engine's fast path), then rank 1 fails its next one."""
    for _ in range(20):
        hvd.allreduce_(torch.ones(2), name="loss")
    if hvd.rank() == 1:
        if case == "rename":  # a name as long as "loss", of the same record: it must never pair with it
            attempt("lost", lambda: hvd.allreduce_(torch.ones(2), name="lost"))
            return
        late_rank(case)
        return
    attempt("loss", lambda: hvd.allreduce_(torch.ones(2), name="loss"))


def main(case):
    if case == "stall":
        os.environ.update(HOROVOD_STALL_CHECK_TIME_SECONDS="2", HOROVOD_STALL_SHUTDOWN_TIME_SECONDS="5")
    if case == "set-stall":
        os.environ.update(HOROVOD_STALL_CHECK_TIME_SECONDS="1")
    hvd.init()
    if case == "set-stall":
        return set_stall()
    if case == "exit-helpers":
        return exit_helpers()
    if case == "exit-elastic":
        return exit_elastic()
    if case == "shutdown-race":
        return shutdown_race()
    if case == "bound-optimizer":
        model, optimizer = model_and_optimizer()
        return train_step(model, optimizer, pause=120 if hvd.rank() == 1 else 0)
    if case.startswith("alone-"):
        return alone(case[len("alone-"):])
    hvd.allreduce(torch.ones(2), name="warm-up")
    if case == "shutdown":  # a name of each rank's own: it never completes
        MINE.append(hvd.allreduce_async(torch.ones(2), name=f"mine.{hvd.rank()}"))
    if hvd.rank() == 1:
        late_rank(case)
        return
    pending = hvd.allreduce_async(torch.ones(2), name="pending")  # rank 1 never submits this one
    failed = not attempt("loss", lambda: hvd.allreduce(torch.ones(2), name="loss"))
    attempt("pending", lambda: hvd.synchronize(pending))
    attempt("later", lambda: hvd.allreduce(torch.ones(2), name="later"))
    if case == "stall":
        MPI.COMM_WORLD.send(failed, dest=1, tag=WORD)
    if case == "shutdown":
        if hvd.rank() == 0:
            MPI.COMM_WORLD.send(True, dest=1, tag=WORD)
        hvd.shutdown()
        report_mine()


if __name__ == "__main__":
    main(sys.argv[1])
