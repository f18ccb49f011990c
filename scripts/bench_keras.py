"""Keras on the CPU at 2 ranks: ``ringtrain.keras`` against ``tf.distribute.MultiWorkerMirroredStrategy``.

    python scripts/bench_keras.py                       # the MLP and the CNN, 3 launches of each contestant
    python scripts/bench_keras.py --models mlp --repeats 5 --blocks 7

The same Keras 2 model (``tf-keras``, ``TF_USE_LEGACY_KERAS=1``: Keras 3.15's
``model.fit`` fails under MWMS at 2 workers, see below), data and global
batch both ways, ``model.fit`` on a
repeated ``tf.data`` pipeline of each rank's shard of ``mnist5k`` (the
4,000 training images ringtrain ships, 2,000 per rank), batch 64 per rank
(128 global), SGD with momentum 0.9, sparse cross-entropy on the logits:

* ``mlp``: 784-512-512-10, ReLU (669k parameters);
* ``cnn``: scripts/bench_torch.py's CNN: two 5x5 conv -> ReLU -> 2x2
  max-pool blocks of 16 and 32 channels, a 128-unit dense layer, 10 classes.

Contestants, each a fresh launch of this script:

* ``ringtrain-keras``: under ``mpirun -np 2``: ``import ringtrain.keras as
  hvd``, ``hvd.DistributedOptimizer`` over the optimizer and
  ``hvd.callbacks.BroadcastGlobalVariablesCallback(0)``, Horovod's recipe;
* ``mwms``: two plain processes, each with a ``TF_CONFIG`` naming both
  workers on ``127.0.0.1`` (free ports chosen here), the model built and
  compiled in ``MultiWorkerMirroredStrategy().scope()``, each worker's
  shard batched at the global batch with auto-sharding off (the strategy
  splits it into the 64 rows each replica takes per step); its gradients go
  over TensorFlow's collective ring (gRPC on the CPU).

Both pin TensorFlow to one intra-op and two inter-op threads per process
(two processes on the two cores of the machine this was written on;
``--threads N`` sets the intra-op threads, 0 leaves TensorFlow's defaults). In each
process a callback notes the time (and the process's CPU time, whose
share of the time is printed: how many cores it kept busy) at the end of
every step; after WARMUP
steps, blocks of STEPS steps are timed, a block's time is the slower
worker's, samples/s = 128 x STEPS / block time, and a launch's figure is the
median over its blocks. Launches alternate (ringtrain, MWMS, ringtrain, ...)
so that background load hits both alike; the table gives the median over
launches and the ratio ringtrain.keras / MWMS, with the load average before
and after. ``--alone`` adds a third launch: the same ``fit`` on each rank of
``mpirun -np 2`` with the plain optimizer, no communication at all (the
speed both contestants would have if communicating cost nothing). Every
launch is bounded (``--launch-timeout``): a launch that runs over, fails
or prints no result is killed with its process group and the script stops
with one line saying which, and exit status 1.

Why Keras 2: with Keras 3.15 on TensorFlow 2.21, ``model.fit`` under MWMS
with 2 workers fails before its first step: the model is built from a
batch averaged with ``strategy.reduce("MEAN", (x, y))`` ("Attempt to
convert a value (PerReplica...) to a Tensor"), and, past that, each step's
scalar loss is averaged with ``strategy.reduce("MEAN", loss, axis=0)``
("Invalid reduction dimension 0 for input with 0 dimensions").
"""

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time

BATCH = 64                  # per rank; 128 global at 2 ranks
RANKS = 2
LR, MOMENTUM = 0.01, 0.9
CONTESTANTS = ("ringtrain-keras", "mwms")
ALONE = "alone"             # --alone: the same fit on each rank with no communication at all (the ceiling)
MODELS = ("mlp", "cnn")
RESULT = "RESULT "


# In a worker process.

def _model(kind, keras):
    layers = keras.layers
    if kind == "mlp":
        body = [keras.Input((784,)), layers.Dense(512, activation="relu"), layers.Dense(512, activation="relu")]
    else:
        body = [keras.Input((28, 28, 1)), layers.Conv2D(16, 5, activation="relu"), layers.MaxPooling2D(2),
                layers.Conv2D(32, 5, activation="relu"), layers.MaxPooling2D(2), layers.Flatten(),
                layers.Dense(128, activation="relu")]
    keras.utils.set_random_seed(0)
    return keras.Sequential(body + [layers.Dense(10)])


def _shard(kind, rank, size):
    """This rank's rows of mnist5k's training part (images in [0, 1]) and its labels."""
    from ringtrain.data.sharding import shard_bounds
    from ringtrain.data.sources import open_source, read_rows

    source = open_source("mnist5k", seed=0, test_fraction=0.2, num_classes=None, samples=0, features=0,
                         classes=0, separation=1.0)
    x, y = read_rows(source, source.train, shard_bounds(source.train.count, size, rank))
    x = x.reshape(len(x), -1)
    x = x / max(float(x.max()), 1.0)
    return (x if kind == "mlp" else x.reshape(-1, 28, 28, 1)).astype("float32"), y.astype("int64")


def _dataset(tf, x, y, batch):
    return tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(batch, drop_remainder=True).prefetch(2)


def _compile(model, keras, optimizer):
    model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))


def worker(contestant, kind, warmup, blocks, steps, threads):
    """Train ``kind`` as ``contestant`` does; print this process's block times (seconds) as one line."""
    import tensorflow as tf

    if threads:
        tf.config.threading.set_intra_op_parallelism_threads(threads)
        tf.config.threading.set_inter_op_parallelism_threads(2)
    keras = tf.keras
    stamps, cpu = [], []

    class Stamps(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            stamps.append(time.perf_counter())
            cpu.append(time.process_time())  # every thread's CPU time: how many cores the process kept busy

    callbacks = [Stamps()]
    total = warmup + blocks * steps
    if contestant in ("ringtrain-keras", ALONE):
        import ringtrain.keras as hvd

        hvd.init()
        rank, size = hvd.rank(), hvd.size()
        data = _dataset(tf, *_shard(kind, rank, size), BATCH)
        model = _model(kind, keras)
        optimizer = keras.optimizers.SGD(LR, momentum=MOMENTUM)
        if contestant == ALONE:
            _compile(model, keras, optimizer)
        else:
            _compile(model, keras, hvd.DistributedOptimizer(optimizer))
            callbacks.insert(0, hvd.callbacks.BroadcastGlobalVariablesCallback(0))
    else:
        strategy = tf.distribute.MultiWorkerMirroredStrategy()
        rank = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
        size = strategy.num_replicas_in_sync

        # Each worker its own shard, batched at the global batch, which the strategy splits into each replica's.
        data = _dataset(tf, *_shard(kind, rank, size), BATCH * size)
        options = tf.data.Options()
        options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
        data = data.with_options(options)
        with strategy.scope():
            model = _model(kind, keras)
            _compile(model, keras, keras.optimizers.SGD(LR, momentum=MOMENTUM))
    model.fit(data, steps_per_epoch=total, epochs=1, verbose=0, callbacks=callbacks)
    times = [stamps[warmup - 1 + (b + 1) * steps] - stamps[warmup - 1 + b * steps] for b in range(blocks)]
    timed = slice(warmup - 1, None, len(stamps) - warmup)  # the first and last stamps of the timed blocks
    cores = (cpu[timed][1] - cpu[timed][0]) / (stamps[timed][1] - stamps[timed][0])
    print(RESULT + json.dumps({"rank": rank, "size": size, "blocks": times, "cores": cores}), flush=True)


# In the parent: launches, bounded.

def _free_ports(n):
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _env(**extra):
    env = dict(os.environ)
    env.pop("TF_CONFIG", None)  # only the MWMS workers get one
    env.update(TF_CPP_MIN_LOG_LEVEL="2", OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", TF_USE_LEGACY_KERAS="1",
               **extra)
    return env


def _kill(procs):
    """End each launched process group: TERM, then KILL after a grace of 5 s."""
    for sig, grace in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
        alive = [p for p in procs if p.poll() is None]
        for p in alive:
            try:
                os.killpg(p.pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace
        for p in alive:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass


def _run_all(commands, envs, timeout):
    """Start every command in its own process group; their outputs, or a line saying what went wrong."""
    procs = [subprocess.Popen(c, env=e, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              start_new_session=True) for c, e in zip(commands, envs)]
    deadline = time.monotonic() + timeout
    outputs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=max(0.1, deadline - time.monotonic()))
            outputs.append((p.returncode, out, err))
    except subprocess.TimeoutExpired:
        return None, f"ran past its bound of {timeout:.0f} s and was killed"
    finally:
        _kill(procs)
    for rc, _out, err in outputs:
        if rc != 0:
            last = [line for line in err.splitlines() if line.strip()][-1:] or ["(no error output)"]
            return None, f"exited with status {rc}: {last[0][:300]}"
    return [o for _, o, _ in outputs], None


def launch(contestant, kind, args):
    """One launch of ``contestant`` training ``kind``: samples/s (median over its blocks); SystemExit on failure."""
    me = [sys.executable, os.path.abspath(__file__), "--worker", contestant, "--models", kind,
          "--warmup", str(args.warmup), "--blocks", str(args.blocks), "--steps", str(args.steps),
          "--threads", str(args.threads)]
    if contestant != "mwms":
        from ringtrain.cluster.launch import mpirun_command

        commands, envs = [mpirun_command(RANKS, me)], [_env()]
    else:
        workers = [f"127.0.0.1:{p}" for p in _free_ports(RANKS)]
        commands = [me] * RANKS
        envs = [_env(TF_CONFIG=json.dumps({"cluster": {"worker": workers}, "task": {"type": "worker", "index": i}}))
                for i in range(RANKS)]
    outputs, problem = _run_all(commands, envs, args.launch_timeout)
    results = [] if outputs is None else [r for out in outputs for r in _results(out)]
    if problem is None and len(results) != RANKS:
        problem = f"printed {len(results)} results, expected {RANKS}"
    if problem is not None:
        raise SystemExit(f"bench_keras.py: the {contestant} launch training the {kind} {problem}")
    slowest = [max(block) for block in zip(*(r["blocks"] for r in results))]
    cores = ", ".join(f"{r['cores']:.2f}" for r in sorted(results, key=lambda r: r["rank"]))
    return statistics.median(BATCH * RANKS * args.steps / t for t in slowest), cores


def _results(output):
    """Every ``RESULT {...}`` in ``output``, even two ranks' lines that reached mpirun's output joined."""
    decoder, found, at = json.JSONDecoder(), [], output.find(RESULT)
    while at >= 0:
        result, end = decoder.raw_decode(output, at + len(RESULT))
        found.append(result)
        at = output.find(RESULT, end)
    return found


def _load():
    return ", ".join(f"{x:.2f}" for x in os.getloadavg())


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated: mlp, cnn (default both)")
    parser.add_argument("--repeats", type=int, default=3, help="launches of each contestant per model (default 3)")
    parser.add_argument("--warmup", type=int, default=20, help="steps before timing (default 20)")
    parser.add_argument("--blocks", type=int, default=5, help="timed blocks per launch (default 5)")
    parser.add_argument("--steps", type=int, default=20, help="steps per timed block (default 20)")
    parser.add_argument("--launch-timeout", type=float, default=600.0,
                        help="seconds one launch may take before it is killed (default 600)")
    parser.add_argument("--threads", type=int, default=1,
                        help="TensorFlow's intra-op threads per process, 0 for its default (default 1)")
    parser.add_argument("--alone", action="store_true",
                        help="also time the same fit on each rank without communication (the ceiling)")
    parser.add_argument("--worker", choices=CONTESTANTS + (ALONE,), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    models = [m for m in args.models.split(",") if m]
    bad = [m for m in models if m not in MODELS]
    if bad or not models:
        parser.exit(2, f"bench_keras.py: unknown model {','.join(bad) or '(none)'}; choose from {', '.join(MODELS)}\n")
    if min(args.repeats, args.warmup, args.blocks, args.steps) < 1 or args.launch_timeout <= 0 or args.threads < 0:
        parser.exit(2, "bench_keras.py: --repeats, --warmup, --blocks, --steps and --launch-timeout must be "
                       "positive, --threads at least 0\n")
    if args.worker:
        return worker(args.worker, models[0], args.warmup, args.blocks, args.steps, args.threads)
    before = _load()
    print(f"load average before: {before}", flush=True)
    rows = []
    contestants = CONTESTANTS + ((ALONE,) if args.alone else ())
    for kind in models:
        speeds = {c: [] for c in contestants}
        for _ in range(args.repeats):
            for contestant in contestants:  # interleaved, so that the load hits both alike
                speed, cores = launch(contestant, kind, args)
                speeds[contestant].append(speed)
                print(f"  {kind} {contestant}: {speed:,.0f} samples/s, cores busy per process {cores} "
                      f"(load {_load()})", flush=True)
        medians = {c: statistics.median(v) for c, v in speeds.items()}
        rows.append((kind, medians, medians["ringtrain-keras"] / medians["mwms"]))
        if args.alone:
            print(f"  {kind} alone (no communication): {medians[ALONE]:,.0f} samples/s", flush=True)
    print(f"\n{RANKS} ranks, batch {BATCH} per rank, medians of {args.repeats} launches of {args.blocks} blocks "
          f"of {args.steps} steps")
    print("| model | ringtrain.keras samples/s | MWMS samples/s | ringtrain.keras / MWMS |")
    print("|---|---:|---:|---:|")
    for kind, medians, ratio in rows:
        print(f"| {kind} | {medians['ringtrain-keras']:,.0f} | {medians['mwms']:,.0f} | {ratio:.2f}x |")
    print(f"load average: {before} before, {_load()} after")


if __name__ == "__main__":
    main()
