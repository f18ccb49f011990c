"""Head-to-head on the CPU: the same torch network trained with DDP (gloo), Horovod and ringtrain.

    python scripts/bench_torch.py --suite horovod --horovod-python HVD_VENV/bin/python
                                                   # ringtrain.torch, DDP-gloo, Horovod at 2 ranks: MLP, CNN,
                                                   # ResNet, then allreduce_async_+synchronize at 4 KiB and 4 MiB
    python scripts/bench_torch.py --suite small-ops  # a 4 KiB op through ringtrain.torch's engine against a
                                                   # direct ringtrain.allreduce_ and the engine's MPI steps
                                                   # alone; reducescatter against allreduce
    python scripts/bench_torch.py --model cnn      # the CNN, every contestant at 1 and 2 ranks, 3 repeats
    python scripts/bench_torch.py                  # the MLP
    python scripts/bench_torch.py --repeats 5 --ranks 1,2 --only ddp-gloo,ringtrain-adapter

The models (``--model``), trained on ``mnist5k`` from
:func:`ringtrain.data.load.load_sharded` (the same shards for everyone), batch
64 per rank, SGD with momentum, one thread per rank
(``torch.set_num_threads(1)``, ``OMP_NUM_THREADS=1``):

* ``mlp``: PyTorch's 784-512-512-10 MLP (ReLU, cross-entropy);
* ``cnn``: scripts/train_torch.py's CNN (= scripts/bench_cnn.py's): two 5x5
  conv -> ReLU -> 2x2 max-pool blocks of 16 and 32 channels, a 128-unit
  dense layer, 10 classes (215k parameters);
* ``resnet``: a small ResNet: a 3x3 stem, three basic blocks of 16, 32 and
  64 channels (BatchNorm), global average pooling, 10 classes.

Contestants:

* ``ddp-gloo``: ``torch.nn.parallel.DistributedDataParallel`` over gloo
  (``gradient_as_bucket_view=True``), its process group started from the
  MPI rank and size with ``MASTER_ADDR=127.0.0.1``.
* ``ringtrain-hvd``: a Horovod-style script on ``import ringtrain.torch as
  hvd``: ``hvd.DistributedOptimizer`` over the torch optimizer, the same
  code as ``horovod`` but for the import;
* ``horovod``: ``hvd.DistributedOptimizer`` (opt-in: measured only if
  ``import horovod.torch`` works, in this interpreter or the one given with
  ``--horovod-python``; otherwise the table says "horovod not installed").
* ``ringtrain-torch``: the same torch model and torch optimizer, its
  gradients averaged by :func:`ringtrain.interop.average_gradients_` through
  zero-copy NumPy views of the CPU tensors (one flat buffer,
  :func:`ringtrain.interop.bucket_view_`).
* ``ringtrain-adapter``: the same torch model through
  :class:`ringtrain.torch.TorchModel`, stepped by the trainer's own
  strategy object (:func:`ringtrain.training.strategy.choose_strategy`, as
  ``ringtrain.train`` chooses it: the sharded optimizer step over the
  shared-memory window at 2+ ranks), with ringtrain's optimizer.
* ``ringtrain-numpy``: ringtrain's own NumPy model of the same shape
  (``--model mlp`` or ``--model cnn``), stepped the same way.

Each contestant runs under ``mpirun -np N`` (interleaved over repeats so that
background load hits all alike). In each process, blocks of 20 steps
alternate between the real data-parallel step and the same step without any
communication; ``comm share = 1 - compute-only step time / step time`` is the
part of a step spent communicating or waiting for the other rank (for the
sharded ringtrain contestants the compute-only step updates only its own
shard, as the real one does). samples/s = ranks x 64 / median step time;
scaling efficiency = samples/s at N ranks / (N x samples/s at 1 rank).
Figures are medians over repeats; the ratios printed under the table divide
figures of this one run.

Horovod (optional, about 5 minutes to build on 2 cores; never in CI).
Horovod 0.28.1 does not build against torch 2.13 as released: its C++ must be
compiled as C++17. Recipe::

    pip download --no-deps --no-binary :all: horovod==0.28.1 && tar xzf horovod-0.28.1.tar.gz
    sed -i 's/set(CMAKE_CXX_STANDARD 14)/set(CMAKE_CXX_STANDARD 17)/' \\
        horovod-0.28.1/CMakeLists.txt horovod-0.28.1/horovod/torch/CMakeLists.txt
    HOROVOD_WITH_MPI=1 HOROVOD_WITH_PYTORCH=1 HOROVOD_WITHOUT_TENSORFLOW=1 \\
        HOROVOD_WITHOUT_MXNET=1 HOROVOD_WITHOUT_GLOO=1 pip install --no-build-isolation ./horovod-0.28.1

(with the virtual environment's ``bin`` on ``PATH``, so that the build finds
the ``mpich`` wheel's ``mpicc``; without gloo it builds in about half the time).

Run it under plain ``mpirun`` (this script does); keep torch at 2.13.0+cpu.
"""

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import time

CONTESTANTS = ("ringtrain-hvd", "ddp-gloo", "horovod", "ringtrain-torch", "ringtrain-adapter", "ringtrain-numpy")
PEERS = ("ddp-gloo", "horovod")
# The same Horovod-style script, with `import horovod.torch as hvd` or `import ringtrain.torch as hvd`.
HOROVOD_STYLE = {"horovod": "horovod.torch", "ringtrain-hvd": "ringtrain.torch"}
MODELS = ("mlp", "cnn", "resnet")
LATENCY_BYTES = (4 << 10, 4 << 20)
SIZES = (784, 512, 512, 10)  # the MLP
CHANNELS, KERNEL, HIDDEN = (16, 32), 5, 128  # the CNN
BATCH, LR, MOMENTUM = 64, 0.05, 0.9
BLOCK = 20  # steps per timed block


# -- one worker (inside mpirun) ------------------------------------------------

def _resnet():
    """A small ResNet for 28x28 images: a 3x3 stem, three stages of one basic block (16, 32, 64 channels)."""
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self, cin, cout, stride):
            super().__init__()
            self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
            self.bn1 = nn.BatchNorm2d(cout)
            self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
            self.bn2 = nn.BatchNorm2d(cout)
            self.skip = (nn.Sequential() if stride == 1 and cin == cout else
                         nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout)))

        def forward(self, x):
            out = torch.relu(self.bn1(self.conv1(x)))
            return torch.relu(self.bn2(self.conv2(out)) + self.skip(x))

    return nn.Sequential(nn.Conv2d(1, 16, 3, 1, 1, bias=False), nn.BatchNorm2d(16), nn.ReLU(),
                         Block(16, 16, 1), Block(16, 32, 2), Block(32, 64, 2),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10))


def _torch_model(kind):
    import torch

    torch.manual_seed(0)
    if kind == "resnet":
        return _resnet()
    if kind == "cnn":
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from train_torch import cnn

        return cnn(CHANNELS, KERNEL, HIDDEN)
    layers = []
    for i, (fan_in, fan_out) in enumerate(zip(SIZES, SIZES[1:])):
        layers.append(torch.nn.Linear(fan_in, fan_out))
        if i < len(SIZES) - 2:
            layers.append(torch.nn.ReLU())
    return torch.nn.Sequential(*layers)


def _ringtrain_steps(model, comm, data):
    """``step(rows, communicate)`` for a ringtrain model, stepped by the trainer's own strategy object."""
    import numpy as np

    from ringtrain import TrainConfig, broadcast_, build_optimizer
    from ringtrain.models import flat_layout
    from ringtrain.training.strategy import STOP_REQUESTS, Metric, Phases, ShardedUpdate, choose_strategy
    from ringtrain.training.timeline import Timeline
    from ringtrain.watchdog import Watchdog, left_neighbour

    cfg = TrainConfig(dataset="mnist5k", batch_size=BATCH, lr=LR, momentum=MOMENTUM)  # the trainer's defaults
    opt = build_optimizer("sgd", model.params, lr=LR, momentum=MOMENTUM, weight_decay=0.0,
                          order=flat_layout(model).order)
    broadcast_(model.param_buffer, comm=comm)  # the parameters are views into it
    rank, size = comm.Get_rank(), comm.Get_size()
    phases = Phases(Timeline(rank, enabled=False), Watchdog(comm, cfg.timeout), left_neighbour(rank, size))
    strategy, _ = choose_strategy(cfg, model, opt, comm, phases)  # may move the buffers into shared memory
    sharded = strategy.sharded if isinstance(strategy, ShardedUpdate) else None
    metrics = np.zeros(len(Metric))
    go_on = np.zeros(len(STOP_REQUESTS))  # no stop requests: the trainer's "keep going"
    count = [0]

    def step(rows, communicate):
        xb, yb = data.x[rows], data.y[rows]  # as the trainer's data phase: a fancy-indexed copy
        if communicate:
            strategy.step(count[0], xb, yb, LR, lambda: go_on, metrics)
        else:  # the same arithmetic, no collective: the whole update, or this rank's shard of it
            _, grads, _ = model.loss_and_grad(xb, yb)
            opt.step(model.params, grads, LR) if sharded is None else sharded.update(LR)
        count[0] += 1

    return step


def _steps(contestant, kind, comm, data):
    """Return ``step(rows, communicate)`` for one contestant."""
    if contestant == "ringtrain-numpy":
        from ringtrain import build_model

        if kind == "cnn":
            model = build_model("cnn", data.num_features, data.num_classes, hidden=(HIDDEN,), seed=0,
                                input_shape=data.image_shape, channels=CHANNELS, kernel=KERNEL)
        else:
            model = build_model("mlp", SIZES[0], SIZES[-1], hidden=SIZES[1:-1], seed=0)
        return _ringtrain_steps(model, comm, data)

    import torch

    torch.set_num_threads(1)
    if contestant == "ringtrain-adapter":
        from ringtrain.torch import TorchModel

        shape = data.image_shape if kind in ("cnn", "resnet") else None
        return _ringtrain_steps(TorchModel(_torch_model(kind), input_shape=shape), comm, data)

    x, y = torch.from_numpy(data.x), torch.from_numpy(data.y)
    if kind in ("cnn", "resnet"):
        x = x.reshape(len(x), *data.image_shape)
    model = _torch_model(kind)
    loss_fn = torch.nn.CrossEntropyLoss()
    local = model
    if contestant == "ddp-gloo":
        import torch.distributed as dist

        port = comm.bcast(_free_port() if comm.Get_rank() == 0 else None)
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=comm.Get_rank(), world_size=comm.Get_size())
        model = torch.nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=True)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    if contestant in HOROVOD_STYLE:
        import importlib

        hvd = importlib.import_module(HOROVOD_STYLE[contestant])
        hvd.init()
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        # Horovod has no no_sync(): at 2+ ranks its hooks on the parameters' gradient
        # accumulators allreduce on every backward. The compute-only step runs a twin
        # whose parameters share the storage but are other autograd leaves (no hooks).
        local = copy.deepcopy(model)
        for twin, p in zip(local.parameters(), model.parameters()):
            twin.data = p.data
        plain_opt = torch.optim.SGD(local.parameters(), lr=LR, momentum=MOMENTUM)
        opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    if contestant == "ringtrain-torch":
        from ringtrain.torch.interop import average_gradients_, broadcast_parameters_, bucket_view_

        broadcast_parameters_(model, comm=comm)
        bucket_view_(model)

    def step(rows, communicate):
        index = torch.from_numpy(rows)
        xb, yb = x[index], y[index]
        if contestant == "ddp-gloo" and not communicate:
            with model.no_sync():  # DDP's own switch for "no allreduce this step"
                opt.zero_grad(set_to_none=False)
                loss_fn(model(xb), yb).backward()
            opt.step()
            return
        if contestant in HOROVOD_STYLE and not communicate:
            plain_opt.zero_grad(set_to_none=False)
            loss_fn(local(xb), yb).backward()
            plain_opt.step()
            return
        if contestant in HOROVOD_STYLE:
            opt.zero_grad()  # Horovod 0.28's zero_grad() takes no set_to_none
        else:
            opt.zero_grad(set_to_none=False)
        loss_fn(model(xb), yb).backward()
        if contestant == "ringtrain-torch" and communicate:
            average_gradients_(model, comm=comm)
        opt.step()

    return step


def _free_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker(contestant, kind, blocks):
    from mpi4py import MPI

    from ringtrain.data.sharding import EpochPlan
    from ringtrain.data.load import load_sharded

    comm = MPI.COMM_WORLD
    data = load_sharded("mnist5k", comm, seed=0)
    plan = EpochPlan.for_shard(data, comm, batch_size=BATCH, seed=0)
    step = _steps(contestant, kind, comm, data)
    batches = ((e, i) for e in range(10 ** 6) for i in range(plan.steps_per_epoch))

    def block(communicate):
        comm.Barrier()
        start = time.perf_counter()
        for _ in range(BLOCK):
            step(plan.batch_indices(*next(batches)), communicate)
        comm.Barrier()  # both ranks' blocks end together: time the slower one
        return (time.perf_counter() - start) / BLOCK

    block(True), block(False)  # warm-up: buffers, process group, caches
    real, alone = [], []
    for _ in range(blocks):
        real.append(block(True))
        alone.append(block(False))
    result = {"step": statistics.median(real), "compute": statistics.median(alone),
              "ranks": comm.Get_size()}
    if comm.Get_rank() == 0:
        print("RESULT " + json.dumps(result), flush=True)


def latency_worker(contestant, repeats):
    """Median seconds of ``allreduce_async_`` + ``synchronize`` on float32 tensors of LATENCY_BYTES (rank 0 prints)."""
    import importlib

    import torch
    from mpi4py import MPI

    torch.set_num_threads(1)
    hvd = importlib.import_module(HOROVOD_STYLE[contestant])
    hvd.init()
    comm = MPI.COMM_WORLD
    result = {}
    for nbytes in LATENCY_BYTES:
        tensor = torch.ones(nbytes // 4)
        calls = max(20, repeats * (4096 // max(1, nbytes >> 10)))  # many small calls, fewer big ones
        for _ in range(10):  # warm-up: buffers, plans, fusion
            hvd.synchronize(hvd.allreduce_async_(tensor, name=f"lat.{nbytes}"))
        times = []
        comm.Barrier()
        for _ in range(min(calls, 2000)):
            start = time.perf_counter()
            hvd.synchronize(hvd.allreduce_async_(tensor, name=f"lat.{nbytes}"))
            times.append(time.perf_counter() - start)
        # Every rank's median; the slower rank's is the one a step waits for.
        result[str(nbytes)] = max(comm.allgather(statistics.median(times)))
    if comm.Get_rank() == 0:
        print("RESULT " + json.dumps(result), flush=True)


SMALL_BYTES = 4 << 10          # the small op of the small-ops suite
SCATTER_BYTES = 4 << 20        # the size reducescatter is compared with allreduce at
SMALL_CALLS = 200              # calls per timed block of a small op


def small_ops_worker(rounds):
    """Interleaved blocks of small ops, and reducescatter against allreduce (rank 0 prints medians per call).

    Each round times one block of each contestant in turn, so background load
    falls on all of them alike; a block's time is the slower rank's (the
    ranks pass a barrier at both ends).
    """
    import numpy as np
    import torch
    from mpi4py import MPI

    import ringtrain
    import ringtrain.torch as hvd

    torch.set_num_threads(1)
    hvd.init()
    comm = MPI.COMM_WORLD
    tensor = torch.ones(SMALL_BYTES // 4)
    array = np.ones(SMALL_BYTES // 4, np.float32)
    big = torch.ones(SCATTER_BYTES // 4)
    big_in_place = torch.ones(SCATTER_BYTES // 4)
    small = {
        "ringtrain.allreduce_": lambda: ringtrain.allreduce_(array, op="mean", comm=comm),
        "its messages alone (floor)": _messages_alone(comm, array),
        "hvd.allreduce_async_+synchronize": lambda: hvd.synchronize(hvd.allreduce_async_(tensor, name="async")),
        "hvd.allreduce_": lambda: hvd.allreduce_(tensor, name="blocking"),
    }
    large = {
        "hvd.allreduce (4 MiB)": lambda: hvd.allreduce(big, name="big"),
        "hvd.allreduce_ (4 MiB, in place)": lambda: hvd.allreduce_(big_in_place, name="big_"),
        "hvd.reducescatter (4 MiB)": lambda: hvd.reducescatter(big, name="scatter"),
    }

    def block(fn, calls):
        comm.Barrier()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        comm.Barrier()
        return (time.perf_counter() - start) / calls

    for fn in list(small.values()) + list(large.values()):  # warm-up: buffers, plans, threads
        block(fn, 20)
    calls = {name: _python_calls(fn, comm) for name, fn in small.items()}
    times = {name: [] for name in list(small) + list(large)}
    for _ in range(rounds):
        for name, fn in small.items():
            times[name].append(block(fn, SMALL_CALLS))
        for name, fn in large.items():
            times[name].append(block(fn, 10))
    if comm.Get_rank() == 0:
        print("RESULT " + json.dumps({name: statistics.median(t) for name, t in times.items()}), flush=True)
        print("CALLS " + json.dumps(calls), flush=True)


def _messages_alone(comm, array):
    """A mean of ``array`` by the MPI steps of the engine's lone lane and nothing else: the lane's floor.

    Each call writes a header and the data into one buffer, sends it to every
    other rank (``Isend``), probes for and receives each peer's (``improbe``,
    ``Recv``), compares the peer's header bytes, adds and divides, and waits
    for its sends: what any small op that carries its data with its
    announcement must do, without a name, a record, a lock, a check or a
    fallback. On a communicator of its own, so no message meets the engine's.
    For the suite's 2 ranks: with more, a fast peer's next call could be read in place of a slow one's.
    """
    import numpy as np
    from mpi4py import MPI

    own = comm.Dup()
    rank, size = own.Get_rank(), own.Get_size()
    peers = [r for r in range(size) if r != rank]
    header = 16  # (the lone lane's fields and a short name, rounded up to its data's alignment)
    mine = bytearray(header + array.nbytes)
    mine[:header] = b"op.%d" % rank + bytes(header - len(b"op.%d" % rank))
    data = np.frombuffer(mine, array.dtype, offset=header)
    theirs = {p: bytearray(len(mine)) for p in peers}
    expected = {p: b"op.%d" % p for p in peers}
    their_data = [np.frombuffer(theirs[p], array.dtype, offset=header) for p in peers]
    out, status, byte, divisor = np.empty_like(array), MPI.Status(), MPI.BYTE, array.dtype.type(size)

    def exchange():
        np.copyto(data, array)
        sends = [own.Isend([mine, byte], dest=p, tag=8) for p in peers]
        for _ in peers:
            message = own.improbe(MPI.ANY_SOURCE, MPI.ANY_TAG, status)
            while message is None:
                message = own.improbe(MPI.ANY_SOURCE, MPI.ANY_TAG, status)
            source = status.Get_source()
            message.Recv([theirs[source], byte])
            if not theirs[source].startswith(expected[source]):
                raise RuntimeError(f"rank {source} sent another op")
        np.add(data, their_data[0], out=out)
        for other in their_data[1:]:
            np.add(out, other, out=out)
        np.divide(out, divisor, out=out)
        MPI.Request.Waitall(sends)
        return out
    return exchange


def _python_calls(fn, comm, ops=50):
    """The fewest Python function calls one op took on this rank's thread, of ``ops`` (a count, not a time).

    An op that waits for a peer polls, and each poll adds calls, so the fewest is the op's own work: what
    it costs when its peer's message is already there. The channel's thread's calls are not counted.
    """
    count = [0]

    def profile(frame, event, arg):
        if event == "call":
            count[0] += 1

    fewest = None
    for _ in range(ops):
        comm.Barrier()
        count[0] = 0
        sys.setprofile(profile)
        try:
            fn()
        finally:
            sys.setprofile(None)
        fewest = count[0] if fewest is None else min(fewest, count[0])
    comm.Barrier()
    return fewest


def small_ops_suite(args):
    """The cost of one small op through ringtrain.torch's engine against a direct ringtrain.allreduce_, at 2 ranks."""
    from ringtrain.cluster.launch import mpirun_command

    print(f"small ops at 2 ranks, float32, medians per call of {args.repeats} launches x {args.blocks} interleaved "
          f"blocks; {_uptime()} (before)")
    runs = []
    for _ in range(args.repeats):
        command = [sys.executable, os.path.abspath(__file__), "--small-ops-worker", "--blocks", str(args.blocks)]
        done = subprocess.run(mpirun_command(2, command), env=_env(), capture_output=True, text=True, timeout=900)
        line = next((ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")), None)
        if done.returncode != 0 or line is None:
            sys.exit(f"bench_torch: the small-ops worker failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
        runs.append(json.loads(line[len("RESULT "):]))
        counts = next((ln for ln in done.stdout.splitlines() if ln.startswith("CALLS ")), None)
    medians = {name: statistics.median(r[name] for r in runs) for name in runs[0]}
    direct = medians["ringtrain.allreduce_"]
    print(f"{'op':<36} {'per call':>10} {'ratio':>8}")
    for name, seconds in medians.items():
        against = direct if "4 MiB" not in name else medians["hvd.allreduce (4 MiB)"]
        print(f"{name:<36} {seconds * 1e6:>8.1f}us {seconds / against:>7.2f}x")
    if counts:
        print("Python calls of one 4 KiB op on rank 0's thread (the fewest of 50): " + ", ".join(
            f"{name} {n:.0f}" for name, n in json.loads(counts[len("CALLS "):]).items()))
    print(f"(4 KiB ops against ringtrain.allreduce_ of the same bytes, and the floor: the MPI steps of the engine's "
          f"lone lane alone, on the same bytes; the 4 MiB ops against hvd.allreduce of the same tensor into a new "
          f"one, as reducescatter's result is)\n{_uptime()} (after)")
    return 0


# -- the driver ----------------------------------------------------------------

def _python(contestant, horovod_python):
    """The interpreter for a contestant: Horovod may live in a virtual environment of its own."""
    return horovod_python if contestant == "horovod" and horovod_python else sys.executable


def _available(contestant, horovod_python=None):
    module = {"ddp-gloo": "torch.distributed", "horovod": "horovod.torch", "ringtrain-torch": "torch",
              "ringtrain-adapter": "torch", "ringtrain-hvd": "torch"}.get(contestant)
    if module is None:
        return True
    probe = f"import {module}"
    return subprocess.run([_python(contestant, horovod_python), "-c", probe], capture_output=True,
                          env=_env()).returncode == 0


def _env():
    from ringtrain.cluster.launch import detect_flavour, find_mpirun, mpi_env

    env = mpi_env(detect_flavour(find_mpirun()))
    env.update(OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
    # Another environment's interpreter (Horovod's) reads ringtrain from this checkout.
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def launch(contestant, kind, ranks, blocks, horovod_python=None, latency=False):
    from ringtrain.cluster.launch import mpirun_command

    command = [_python(contestant, horovod_python), os.path.abspath(__file__),
               "--latency-worker" if latency else "--worker", contestant, "--model", kind, "--blocks", str(blocks)]
    done = subprocess.run(mpirun_command(ranks, command), env=_env(), capture_output=True, text=True, timeout=600)
    line = next((ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if done.returncode != 0 or line is None:
        sys.exit(f"bench_torch: {contestant} at {ranks} rank(s) failed (exit {done.returncode}):\n"
                 f"{done.stderr[-3000:]}")
    return json.loads(line[len("RESULT "):])


def _speed(results, contestant, n):
    """samples/s over all ranks from the median step time of every launch."""
    return n * BATCH / statistics.median(r["step"] for r in results[(contestant, n)])


def table(results, ranks, missing, contestants=CONTESTANTS):
    lines = [f"{'contestant':<18} {'ranks':>5} {'images/s':>10} {'step ms':>8} {'comm share':>10} "
             f"{'scaling':>8}"]
    for contestant in contestants:
        if contestant in missing:
            lines.append(f"{contestant:<18} {missing[contestant]}")
            continue
        base = None
        for n in ranks:
            runs = results[(contestant, n)]
            step = statistics.median(r["step"] for r in runs)
            compute = statistics.median(r["compute"] for r in runs)
            speed = _speed(results, contestant, n)
            base = speed if n == 1 else base
            scaling = f"{speed / (n * base):.0%}" if base and n > 1 else "-"
            share = max(0.0, 1 - compute / step) if n > 1 else 0.0
            lines.append(f"{contestant:<18} {n:>5} {speed:>10,.0f} {step * 1e3:>8.2f} {share:>10.0%} "
                         f"{scaling:>8}")
    return "\n".join(lines)


def ratios(results, ranks, missing, contestants=CONTESTANTS):
    """Each ringtrain contestant's images/s over each peer's, at the same rank count, from this run."""
    peers = [p for p in PEERS if p not in missing and p in contestants]
    lines = []
    for contestant in contestants:
        if contestant in PEERS or contestant in missing or not peers:
            continue
        for n in ranks:
            mine = _speed(results, contestant, n)
            against = ", ".join(f"{mine / _speed(results, p, n):.2f}x {p}" for p in peers)
            lines.append(f"{contestant} at {n} rank(s): {against}")
    return "\n".join(lines)


def _uptime():
    return "load average: " + ", ".join(f"{x:.2f}" for x in os.getloadavg())


def horovod_suite(args):
    """ringtrain.torch against DDP-gloo and Horovod at 2 ranks: every model, then the latency of one op."""
    contestants = ("ringtrain-hvd", "ddp-gloo", "horovod")
    missing = {}
    for c in contestants:
        if not _available(c, args.horovod_python):
            missing[c] = "horovod not installed (see --horovod-python)" if c == "horovod" else "torch not installed"
    running = [c for c in contestants if c not in missing]
    print(f"ringtrain.torch against its peers at 2 ranks, CPU, 1 thread per rank; {_uptime()} (before)")
    for kind in MODELS:
        results = {(c, 2): [] for c in running}
        for _ in range(args.repeats):
            for c in running:  # interleaved, so background load hits every contestant alike
                results[(c, 2)].append(launch(c, kind, 2, args.blocks, args.horovod_python))
        print(f"\n{_network(kind)}, mnist5k, batch {BATCH} per rank, medians of {args.repeats} launches x "
              f"{args.blocks} blocks of {BLOCK} steps")
        print(table(results, [2], missing, contestants))
        print(ratios(results, [2], missing, contestants))
    latency = [c for c in running if c in HOROVOD_STYLE]
    runs = {c: [] for c in latency}
    for _ in range(args.repeats):
        for c in latency:
            runs[c].append(launch(c, "mlp", 2, args.blocks, args.horovod_python, latency=True))
    print(f"\nallreduce_async_ + synchronize on float32, 2 ranks, median per call (the slower rank), "
          f"median of {args.repeats} launches")
    print(f"{'contestant':<18} " + " ".join(f"{_size(b):>10}" for b in LATENCY_BYTES))
    medians = {c: [statistics.median(r[str(b)] for r in runs[c]) for b in LATENCY_BYTES] for c in latency}
    for c in latency:
        print(f"{c:<18} " + " ".join(f"{t * 1e6:>8.0f}us" for t in medians[c]))
    if "horovod" in medians and "ringtrain-hvd" in medians:
        print("horovod / ringtrain-hvd (above 1: ringtrain faster): " +
              ", ".join(f"{_size(b)} {h / r:.2f}x" for b, h, r in zip(LATENCY_BYTES, medians["horovod"],
                                                                     medians["ringtrain-hvd"])))
    for c, why in missing.items():
        print(f"{c}: {why}")
    print(f"\n{_uptime()} (after)")
    return 0


def _size(nbytes):
    return f"{nbytes >> 20} MiB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KiB"


def _network(kind):
    return {"mlp": f"MLP {'-'.join(map(str, SIZES))}", "cnn": f"CNN {CHANNELS} k={KERNEL} hidden={HIDDEN}",
            "resnet": "ResNet (stem + 3 basic blocks, 16/32/64 channels)"}[kind]


def main(argv=None):
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3, help="launches per contestant and size (default 3)")
    parser.add_argument("--blocks", type=int, default=5, help=f"timed blocks of {BLOCK} steps per launch")
    parser.add_argument("--ranks", default="1,2", help="rank counts (default 1,2)")
    parser.add_argument("--model", choices=MODELS, default="mlp", help="the network (default mlp)")
    parser.add_argument("--only", default=",".join(CONTESTANTS), help="comma-separated contestants")
    parser.add_argument("--suite", choices=["horovod", "small-ops"], help="horovod: ringtrain.torch, DDP-gloo and "
                        "Horovod at 2 ranks on every model, and allreduce latency; small-ops: a 4 KiB op through "
                        "ringtrain.torch against a direct ringtrain.allreduce_, and reducescatter against allreduce")
    parser.add_argument("--horovod-python", help="the interpreter of a virtual environment with Horovod installed")
    parser.add_argument("--json", action="store_true", help="also print the raw results as JSON")
    parser.add_argument("--worker", choices=CONTESTANTS, help=argparse.SUPPRESS)
    parser.add_argument("--latency-worker", choices=sorted(HOROVOD_STYLE), help=argparse.SUPPRESS)
    parser.add_argument("--small-ops-worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.small_ops_worker:
        small_ops_worker(args.blocks)
        return 0
    if args.suite == "small-ops":
        return small_ops_suite(args)
    if args.worker:
        worker(args.worker, args.model, args.blocks)
        return 0
    if args.latency_worker:
        latency_worker(args.latency_worker, args.blocks)
        return 0
    if args.suite == "horovod":
        return horovod_suite(args)
    ranks = [int(n) for n in args.ranks.split(",")]
    chosen = [c for c in CONTESTANTS if c in args.only.split(",")]
    missing = {c: "not selected" for c in CONTESTANTS if c not in chosen}
    for c in chosen:
        if not _available(c, args.horovod_python):
            missing[c] = "horovod not installed" if c == "horovod" else "torch not installed"
    if args.model == "resnet" and "ringtrain-numpy" in chosen:
        missing["ringtrain-numpy"] = "no NumPy ResNet"
    running = [c for c in chosen if c not in missing]
    load = os.getloadavg()[0]
    results = {(c, n): [] for c in running for n in ranks}
    for _ in range(args.repeats):
        for n in ranks:
            for c in running:
                results[(c, n)].append(launch(c, args.model, n, args.blocks, args.horovod_python))
    print(f"{_network(args.model)}, mnist5k, batch {BATCH} per rank, 1 thread per rank, "
          f"medians of {args.repeats} launches x {args.blocks} blocks of {BLOCK} steps")
    print(table(results, ranks, missing))
    if ratios(results, ranks, missing):
        print("images/s against the peers, same run:")
        print(ratios(results, ranks, missing))
    print(f"load average: {load:.2f} before, {os.getloadavg()[0]:.2f} after")
    if args.json:
        print(json.dumps({f"{c}@{n}": v for (c, n), v in results.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
