"""hvd.elastic under real mpirun: resets in the process, commits on disk, a resume from them.

Each test trains a small model through an ElasticSampler, committing after
every step, and compares the result with a straight run of the same code
(no reset, no commit on disk) computed in the same job: a reset after a
commit, a restore after HorovodInternalError and a resume from the last
commit on disk all lead to bitwise the same parameters. Assertions come
after the last collective. Skipped where torch is not installed.
"""

import os
import shutil
import tempfile

import pytest
from mpi4py import MPI

try:
    import torch

    import ringtrain.torch as hvd
    from ringtrain.torch.elastic.commits import CommitStore
except ImportError:  # collected and skipped, so the suite still sees this file's tests
    torch = None

pytestmark = pytest.mark.skipif(torch is None, reason="torch is not installed")

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
SAMPLES, BATCH, EPOCHS = 48, 2, 2  # no padding at any of the sizes 1 to 4, so a reset changes nothing


def setup_module():
    hvd.init()


class Crash(Exception):
    """A failure the program does not expect: it leaves hvd.elastic.run."""


def make(seed):
    torch.manual_seed(seed)
    model = torch.nn.Linear(3, 1)
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                         named_parameters=model.named_parameters())
    sampler = hvd.elastic.ElasticSampler(list(range(SAMPLES)), shuffle=True, seed=5)
    state = hvd.elastic.TorchState(model, optimizer, sampler=sampler, epoch=0, steps=0, seen=[])
    resets = []
    state.register_reset_callbacks([lambda: resets.append(state.steps)])
    return state, resets


def trainer(events):
    """A training function; ``events[step]`` says what happens after that step: "interrupt", "internal", "crash"."""
    generator = torch.Generator().manual_seed(11)
    inputs = torch.randn(SAMPLES, 3, generator=generator)
    targets = inputs.sum(dim=1, keepdim=True)
    done = set()

    def train(state):
        for epoch in range(state.epoch, EPOCHS):
            state.epoch = epoch
            indices = list(state.sampler)
            for first in range(0, len(indices), BATCH):
                batch = indices[first:first + BATCH]
                state.optimizer.zero_grad()
                torch.nn.functional.mse_loss(state.model(inputs[batch]), targets[batch]).backward()
                state.optimizer.step()
                state.sampler.record_batch(0, len(batch))
                state.steps += 1
                state.seen = state.seen + sorted(i for part in hvd.allgather_object(batch) for i in part)
                event = events.get(state.steps)
                if event == "internal" and event not in done:  # a failed collective, before the commit
                    done.add(event)
                    raise hvd.HorovodInternalError("a peer went away")
                state.commit()
                if event == "interrupt" and event not in done:
                    done.add(event)
                    raise hvd.HostsUpdatedInterrupt(False)
                if event == "crash":
                    raise Crash()
            state.sampler.set_epoch(state.epoch + 1)
        return state.steps
    return train


def params(state):
    return [p.detach().clone() for p in state.model.parameters()]


def shared_dir():
    """A fresh directory every rank names the same (rank 0 makes it)."""
    path = tempfile.mkdtemp(prefix="ringtrain-elastic-test-") if rank == 0 else None
    return comm.bcast(path)


def run_straight(seed):
    """The reference: the same training from rank 0's start (``seed``), with no reset and no commit on disk."""
    state, _ = make(seed)
    steps = hvd.elastic.run(trainer({}))(state)
    return state, steps


@pytest.mark.mpi
def test_resets_in_the_process_end_like_a_straight_run_and_the_commit_on_disk_is_the_end(monkeypatch):
    reference, want_steps = run_straight(seed=2)
    directory = shared_dir()
    monkeypatch.setenv("RINGTRAIN_ELASTIC_DIR", directory)
    state, resets = make(seed=2 + rank)  # every rank starts elsewhere: the first sync gives rank 0's
    steps = hvd.elastic.run(trainer({3: "interrupt", 6: "internal"}))(state)
    comm.Barrier()
    found = CommitStore(directory).latest() if rank == 0 else None
    comm.Barrier()
    if rank == 0:
        shutil.rmtree(directory)
    assert steps == want_steps
    assert all(torch.equal(a, b) for a, b in zip(params(state), params(reference)))
    # The reset after the interrupt (step 3) and the restore after the failed collective (back to step 5).
    assert resets == [3, 5]
    # Every epoch's samples once, whatever the padding: the record of what was trained is the straight run's.
    assert state.seen == reference.seen
    assert set(state.seen[:len(state.seen) // EPOCHS]) == set(range(SAMPLES))
    if rank == 0:
        sequence, snapshot, meta = found
        assert meta["finished"] and snapshot["result"] == want_steps and meta["size"] == size
        saved = snapshot["state"]
        assert saved["objects"]["steps"] == want_steps and saved["objects"]["seen"] == reference.seen
        weights = saved["handlers"]["model"]
        assert all(torch.equal(weights[name], p) for (name, _), p in
                   zip(state.model.named_parameters(), params(reference)))


@pytest.mark.mpi
def test_a_run_that_crashed_resumes_from_its_last_commit_and_ends_like_a_straight_run(monkeypatch):
    reference, want_steps = run_straight(seed=3)
    directory = shared_dir()
    monkeypatch.setenv("RINGTRAIN_ELASTIC_DIR", directory)
    first, _ = make(seed=3)
    crashed = False
    try:
        hvd.elastic.run(trainer({7: "crash"}))(first)
    except Crash:
        crashed = True
    # As a restarted job would: a fresh state, another start, the same commit directory.
    second, resets = make(seed=4 + rank)
    steps = hvd.elastic.run(trainer({}))(second)
    # A third start finds the run finished: it is not run again.
    third, third_resets = make(seed=5)
    again = hvd.elastic.run(trainer({1: "crash"}))(third)
    comm.Barrier()
    if rank == 0:
        shutil.rmtree(directory)
    assert crashed and steps == want_steps == again
    # The reset callbacks ran once, after rank 0 restored commit 7 and before the sync gave it to every
    # rank (Horovod's order: callbacks, then sync).
    assert resets == [7 if rank == 0 else 0]
    assert third_resets == []
    for state in (second, third):
        assert all(torch.equal(a, b) for a, b in zip(params(state), params(reference)))
        assert state.seen == reference.seen


@pytest.mark.mpi
def test_a_commit_rank_0_cannot_write_fails_on_every_rank(monkeypatch):
    directory = shared_dir()
    if rank == 0:
        with open(os.path.join(directory, "commits"), "w") as fh:
            fh.write("a file where the commits directory should be")
    comm.Barrier()
    monkeypatch.setenv("RINGTRAIN_ELASTIC_DIR", directory)
    state, _ = make(seed=6)
    failed = None
    try:
        hvd.elastic.run(trainer({}))(state)
    except hvd.elastic.CommitFailed as exc:
        failed = str(exc)
    everyone = comm.allgather(failed)
    if rank == 0:
        shutil.rmtree(directory)
    assert all(f is not None and f.startswith("rank 0 could not write the commit: could not write checkpoint")
               for f in everyone), everyone
