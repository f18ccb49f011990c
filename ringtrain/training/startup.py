"""Everything before the first step: device, data, model, optimizer, run directory, resume.

:func:`start` is collective: every rank calls it once, after the settings
agreement, and every collective in it is watched (a rank that stalls ends
the job within ``--timeout``, naming the operation). It returns one
:class:`Start` record that the loop trains from.
"""

import dataclasses
import math

import numpy as np

from .. import backend
from ..data.fingerprint import dataset_fingerprint
from ..data.load import load_sharded
from ..data.sharding import EpochPlan
from ..data.standardize import standardize
from ..errors import UsageError
from ..failure import agree
from ..io.checkpoint import list_checkpoints
from ..models.base import flat_layout
from ..models.registry import build_model, takes_option
from ..optim import build_optimizer, scaled_lr
from ..watchdog import WatchedComm
from .config import MODEL_OPTIONS, TrainConfig, to_json
from .replicas import check_same_params
from .resume import resume, write_lineage
from .runlog import RunLog, default_run_dir

__all__ = ["Start", "start", "starting", "usable_timeout", "model_name"]


@dataclasses.dataclass
class Start:
    """What one :func:`ringtrain.training.train` call trains from, as start-up left it."""

    cfg: TrainConfig
    comm: object          # the communicator every collective runs on
    spec: object          # this rank's :class:`~ringtrain.cluster.topology.TaskSpec`
    data: object          # this rank's :class:`~ringtrain.data.load.Shard`
    plan: EpochPlan
    model: object
    opt: object
    lr: float             # the base learning rate, scaled for the rank count
    log: RunLog
    xp: object            # numpy or cupy
    position: object      # the :class:`~ringtrain.training.resume.Position` to continue from
    dog: object           # the :class:`~ringtrain.watchdog.Watchdog`
    lineage: object = None       # rank 0: the lineage every checkpoint of this run is stamped with
    resumed_from: str = None     # rank 0: the checkpoint resumed from, None for a fresh start
    fingerprint: dict = None     # rank 0: the dataset's resolved path and content hash (None for built-ins)
    model_name: str = None       # what is trained, in words: "mlp 256-128", "torch Net", "custom MyModel"
    schedule: object = None      # the resumed epoch's :class:`~ringtrain.data.sharding.EpochSchedule`


def usable_timeout(value):
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


def starting(dog, what):
    """A start-up collective, watched."""
    return dog.watch(f"start-up: {what}")


def start(cfg, comm, spec, model, stream, threads, dog):
    """Everything before the first step (collective); returns the :class:`Start`."""
    problem = None
    try:
        xp = backend.xp_for(cfg.device)
    except ValueError as exc:
        problem = str(exc)
    with starting(dog, "device agreement"):
        agree(comm, problem)
    backend.use_device(spec.device)
    # Only its collectives are watched, not the reading between them.
    data = load_sharded(cfg.dataset, WatchedComm(comm, dog, "start-up: data loading"), seed=cfg.seed,
                        test_fraction=cfg.test_fraction, samples=cfg.samples, features=cfg.features,
                        classes=cfg.classes)
    data = standardize(data, WatchedComm(comm, dog, "start-up: feature statistics"), cfg.standardize)
    plan = EpochPlan.for_shard(data, comm, batch_size=cfg.batch_size, seed=cfg.seed, drop_last=cfg.drop_last)
    name = model_name(cfg, model)
    model = model if model is not None else _build_model(cfg, data, xp)
    with starting(dog, "model check"):
        check_same_params(comm, model.params)
    lr = scaled_lr(cfg.lr, comm.Get_size(), cfg.scale_lr)
    try:
        layout = flat_layout(model)
    except ValueError as exc:  # a FlatModel that broke its contract: every rank built the same model
        raise UsageError(f"the model's flat buffers: {exc}", everywhere=True) from None
    # State laid out like the model's flat buffers, so a rank can update just its shard.
    opt = build_optimizer(cfg.optimizer, model.params, lr=lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay,
                          order=layout.order if layout is not None else None)
    log, run_dir = _open_log(cfg, comm, spec, stream, dog)
    if xp is not np and backend.kernel_cache_cold():
        log.print("ringtrain: compiling GPU kernels for the first run on this machine (CuPy caches them; later "
                  "runs start in seconds)")
    if threads is not None:
        log.print(f"ringtrain: {threads} BLAS thread(s) per rank ({spec.local_size} rank(s) on this host; "
                  "set OMP_NUM_THREADS to choose)")
    fingerprint = dataset_fingerprint(cfg.dataset) if spec.is_master else None
    position, lineage, resumed_from = resume(comm, cfg, run_dir, model.params, opt, log, dog, fingerprint)
    try:  # every rank holds the same position and plan: the same verdict everywhere, before anything is written
        schedule = plan.schedule(position.epoch, position.parts)
    except ValueError as exc:
        raise UsageError(f"the checkpoint resumed from: damaged data position ({exc}); give another --resume "
                         "PATH, or --resume none", everywhere=True) from None
    problem = None
    try:
        log.open(dict(to_json(dataclasses.replace(cfg, run_dir=run_dir)), model_name=name))
        if spec.is_master:
            _new_lineage_notice(cfg, run_dir, resumed_from, log)
            write_lineage(run_dir, lineage)  # before the first checkpoint of the lineage can exist
    except OSError as exc:  # only rank 0 writes, so the others must hear of it before the first step
        problem = f"--run-dir {run_dir}: cannot write there ({exc.strerror or exc})"
    except UsageError as exc:  # another job took the directory after claim()
        problem = str(exc)
    with starting(dog, "run directory agreement"):
        agree(comm, problem)
    return Start(cfg, comm, spec, data, plan, model, opt, lr, log, xp, position, dog, lineage, resumed_from,
                 fingerprint, name, schedule)


def _open_log(cfg, comm, spec, stream, dog):
    """Rank 0's run directory, known to every rank, and claimed before it is read or written."""
    with starting(dog, "run directory broadcast"):
        run_dir = comm.bcast(cfg.run_dir or default_run_dir() if comm.Get_rank() == 0 else None, root=0)
    log = RunLog(run_dir, spec.is_master, stream=stream, tensorboard=cfg.tensorboard, log_every=cfg.log_every)
    with starting(dog, "run directory agreement"):
        agree(comm, log.claim())  # a directory another live job holds: refused before it is read or written
    return log, run_dir


def _new_lineage_notice(cfg, run_dir, resumed_from, log):
    """Say so when a run starts afresh in a directory that holds an earlier run's checkpoints."""
    if resumed_from is None and list_checkpoints(log.checkpoint_dir):
        log.print(f"ringtrain: starting a new run in {run_dir}" + (" (--resume none)" if cfg.resume == "none" else "")
                  + "; --resume auto will follow it, not the earlier run's checkpoints, which it replaces "
                    "as it writes its own")


def _build_model(cfg, data, xp):
    # Model-specific settings (the cnn's channels and kernel) go to the builders that take them.
    options = {name: getattr(cfg, name) for name in MODEL_OPTIONS if takes_option(cfg.model, name)}
    try:
        return build_model(cfg.model, data.num_features, data.num_classes, hidden=cfg.hidden, xp=xp, seed=cfg.seed,
                           input_shape=data.image_shape, **options)
    except ValueError as exc:
        raise UsageError(str(exc), everywhere=True) from None



def model_name(cfg, custom=None):
    """What a run trains, in words, for its records and plots (pure).

    ``mlp 256-128`` or ``cnn 16-32`` for a built-in model; for a model the
    caller passed in, what it is: ``torch Net`` (a TorchModel's module) or
    ``custom MyModel``, never the built-in settings it did not use.
    """
    if custom is not None:
        module = getattr(custom, "module", None)
        return f"torch {type(module).__name__}" if module is not None else f"custom {type(custom).__name__}"
    sizes = cfg.hidden if cfg.model == "mlp" else cfg.channels if cfg.model == "cnn" else ()
    return cfg.model + (" " + "-".join(map(str, sizes)) if sizes else "")
