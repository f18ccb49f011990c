"""ringtrain's NumPy CNN against the same network in PyTorch, one process, on the CPU.

    OMP_NUM_THREADS=1 python scripts/bench_cnn.py              # 1 thread, 5 repeats
    OMP_NUM_THREADS=2 python scripts/bench_cnn.py --threads 2 --repeats 7

The network is ``ringtrain train --model cnn``'s default on ``mnist5k``:
conv 5x5 (1 -> 16) -> ReLU -> 2x2 max-pool -> conv 5x5 (16 -> 32) -> ReLU ->
2x2 max-pool -> dense 1568 -> 128 -> ReLU -> 10, softmax cross-entropy, SGD
with momentum, float32, batches of 64. One step is forward, backward and the
optimizer update, as one rank of ``ringtrain train`` computes it (no
communication). Both sides run on the same thread count: NumPy's BLAS through
``threadpoolctl`` and ``torch.set_num_threads``. Set ``OMP_NUM_THREADS`` as
well, so neither library starts threads it then leaves idle.

Each repeat times a block of steps for each contestant in turn (interleaved,
so that background load hits both alike) after a few warm-up steps; the
figures printed are medians over the repeats, and the ratio is ringtrain's
samples/s over torch's from the same repeat. PyTorch is optional: without it
only ringtrain's figure is printed. Keep torch at 2.13.0+cpu in this
project's environment.
"""

import argparse
import statistics
import sys
import time

import numpy as np

BATCH, LR, MOMENTUM = 64, 0.05, 0.9
CHANNELS, KERNEL, HIDDEN = (16, 32), 5, (128,)


def _ringtrain_step(x, y):
    from ringtrain.models.registry import build_model
    from ringtrain.optim import build_optimizer

    model = build_model("cnn", x.shape[1], 10, hidden=HIDDEN, seed=0, input_shape=(1, 28, 28),
                        channels=CHANNELS, kernel=KERNEL)
    opt = build_optimizer("sgd", model.params, lr=LR, momentum=MOMENTUM)

    def step(rows):
        _, grads, _ = model.loss_and_grad(x[rows], y[rows])
        opt.step(model.params, grads, LR)

    return step, model.param_buffer.size


def _torch_step(x, y, threads):
    import torch

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    pad = KERNEL // 2
    layers, c, side = [], 1, 28
    for f in CHANNELS:
        layers += [torch.nn.Conv2d(c, f, KERNEL, padding=pad), torch.nn.ReLU(), torch.nn.MaxPool2d(2)]
        c, side = f, side // 2
    widths = (c * side * side, *HIDDEN, 10)
    layers.append(torch.nn.Flatten())
    for i, (fan_in, fan_out) in enumerate(zip(widths, widths[1:])):
        layers.append(torch.nn.Linear(fan_in, fan_out))
        if i < len(widths) - 2:
            layers.append(torch.nn.ReLU())
    model = torch.nn.Sequential(*layers)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    loss_fn = torch.nn.CrossEntropyLoss()
    xt, yt = torch.from_numpy(x.reshape(-1, 1, 28, 28)), torch.from_numpy(y)

    def step(rows):
        index = torch.from_numpy(rows)
        opt.zero_grad(set_to_none=False)
        loss_fn(model(xt[index]), yt[index]).backward()
        opt.step()

    return step, sum(p.numel() for p in model.parameters())


def _time(step, batches):
    start = time.perf_counter()
    for rows in batches:
        step(rows)
    return len(batches) * BATCH / (time.perf_counter() - start)


def main(argv=None):
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1, help="BLAS / torch threads (default 1)")
    parser.add_argument("--repeats", type=int, default=5, help="timed blocks per contestant (default 5)")
    parser.add_argument("--steps", type=int, default=30, help="steps per timed block (default 30)")
    args = parser.parse_args(argv)

    from threadpoolctl import threadpool_limits
    from mpi4py import MPI

    from ringtrain.data.load import load_sharded

    threadpool_limits(args.threads)
    data = load_sharded("mnist5k", MPI.COMM_SELF, seed=0)
    x, y = data.x, data.y
    rng = np.random.default_rng(0)
    contestants, sizes = {}, {}
    contestants["ringtrain"], sizes["ringtrain"] = _ringtrain_step(x, y)
    try:
        contestants["torch"], sizes["torch"] = _torch_step(x, y, args.threads)
    except ImportError:
        print("torch is not installed: timing ringtrain alone (pip install torch==2.13.0 to compare)")
    if len(set(sizes.values())) != 1:
        raise SystemExit(f"the two networks differ: {sizes} parameters")
    warm = [rng.integers(0, len(y), BATCH) for _ in range(5)]
    for step in contestants.values():
        _time(step, warm)

    rates = {name: [] for name in contestants}
    for _ in range(args.repeats):
        batches = [rng.integers(0, len(y), BATCH) for _ in range(args.steps)]
        for name, step in contestants.items():
            rates[name].append(_time(step, batches))

    print(f"CNN {CHANNELS} k={KERNEL} hidden={HIDDEN} ({sizes['ringtrain']:,} parameters), mnist5k batches of "
          f"{BATCH}, {args.threads} thread(s), median of {args.repeats} x {args.steps} steps")
    for name, values in rates.items():
        print(f"  {name:<10} {statistics.median(values):8.0f} samples/s")
    if "torch" in rates:
        ratios = [a / b for a, b in zip(rates["ringtrain"], rates["torch"])]
        print(f"  ringtrain / torch: {statistics.median(ratios):.2f} (per repeat: "
              f"{', '.join(f'{r:.2f}' for r in ratios)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
