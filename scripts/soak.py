"""Soak test: many thousands of training steps, and resident memory must not grow.

    mpirun -np 4 python scripts/soak.py --steps 20000
    mpirun -np 4 python scripts/soak.py --steps 100000 --tolerance-mb 4 --json

Not a CI test (it runs for minutes). Every rank trains a small MLP on the
synthetic dataset through :func:`ringtrain.train`, with everything a long run
does switched on: evaluation every epoch, a checkpoint every epoch (keeping
3), metrics every 100 steps. A thin model wrapper samples this process's
resident set (``/proc/self/statm``) as training goes; the first sample that
counts is taken after ``--warmup`` steps, once every buffer, cache and the
first checkpoint exist. Rank 0 gathers every rank's samples and prints one
row per rank: resident MiB after warm-up, at the end, the growth, and the
peak (``ru_maxrss``). Exit status 1 if any rank grew by more than
``--tolerance-mb``.
"""

import argparse
import json
import os
import resource
import sys
import tempfile
import time

from mpi4py import MPI

import ringtrain.training.loop
import ringtrain.training.startup
from ringtrain import TrainConfig

PAGE = os.sysconf("SC_PAGE_SIZE")


def resident_mib():
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * PAGE / 2**20


def sampled(model, every, samples):
    """Make ``model`` record resident memory every ``every`` steps into ``samples``.

    Its ``loss_and_grad`` is wrapped on the instance, so the model keeps its
    type (a FlatModel keeps the fast paths the trainer would take without it).
    """
    inner, calls = model.loss_and_grad, [0]

    def loss_and_grad(x, y, on_grad=None):
        if calls[0] % every == 0:
            samples.append((calls[0], resident_mib()))
        calls[0] += 1
        return inner(x, y, on_grad=on_grad)

    model.loss_and_grad = loss_and_grad
    return model


def main(argv=None):
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20_000, help="optimizer steps in all")
    parser.add_argument("--warmup", type=int, default=500, help="steps before the first sample that counts")
    parser.add_argument("--tolerance-mb", type=float, default=4.0, help="allowed growth per rank, MiB")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    args = parser.parse_args(argv)
    if not 0 <= args.warmup < args.steps:  # every rank sees the same flags, so all stop; rank 0 says why
        if MPI.COMM_WORLD.Get_rank() == 0:
            print(f"soak: --warmup {args.warmup} must be at least 0 and below --steps {args.steps}, "
                  "or no sample would count; raise --steps", file=sys.stderr)
        return 2
    comm = MPI.COMM_WORLD
    size = comm.Get_size()

    # 100 steps per epoch at any rank count: 800 training rows per rank, batch 8.
    samples = 1000 * size
    every = max(1, args.steps // 40)
    build = ringtrain.training.startup.build_model
    samples_taken = []
    ringtrain.training.startup.build_model = lambda *a, **kw: sampled(build(*a, **kw), every, samples_taken)
    run_dir = comm.bcast(tempfile.mkdtemp(prefix="ringtrain-soak-") if comm.Get_rank() == 0 else None)
    cfg = TrainConfig(dataset="synthetic", samples=samples, features=16, classes=4, hidden=(32,),
                      batch_size=8, epochs=-(-args.steps // 100), max_steps=args.steps, lr=0.01,
                      log_every=100, eval_every=1, keep=3, run_dir=run_dir, resume="none", progress=False)
    start = time.perf_counter()
    with ringtrain.abort_on_error(comm):
        result = ringtrain.training.loop.train(cfg, comm, stream=open(os.devnull, "w"))
    seconds = time.perf_counter() - start
    samples_taken.append((result.step, resident_mib()))
    counted = [(s, m) for s, m in samples_taken if s >= args.warmup]
    mine = {"rank": comm.Get_rank(), "start_mib": counted[0][1], "end_mib": counted[-1][1],
            "first_step": counted[0][0], "last_step": counted[-1][0],
            "max_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "curve": samples_taken}
    everyone = comm.gather(mine, root=0)
    if comm.Get_rank() != 0:
        return 0
    grew = [r for r in everyone if r["end_mib"] - r["start_mib"] > args.tolerance_mb]
    if args.json:
        print(json.dumps({"steps": result.step, "ranks": size, "seconds": seconds, "per_rank": everyone}))
    else:
        print(f"soak: {result.step} steps on {size} ranks in {seconds:.0f}s "
              f"({result.step / seconds:,.0f} steps/s); test accuracy {result.eval.get('accuracy', 0):.2%}")
        print(f"resident memory, MiB (first sample at step {everyone[0]['first_step']}, "
              f"last at step {everyone[0]['last_step']})")
        print(f"{'rank':>4} {'start':>9} {'end':>9} {'growth':>8} {'peak':>9}")
        for r in everyone:
            print(f"{r['rank']:>4} {r['start_mib']:>9.1f} {r['end_mib']:>9.1f} "
                  f"{r['end_mib'] - r['start_mib']:>+8.2f} {r['max_rss_mib']:>9.1f}")
        print("verdict: " + ("memory grew on rank(s) " + ", ".join(str(r["rank"]) for r in grew)
                             if grew else f"no growth beyond {args.tolerance_mb:g} MiB"))
    import shutil

    shutil.rmtree(run_dir, ignore_errors=True)
    return 1 if grew else 0


if __name__ == "__main__":
    sys.exit(main())
