"""The training configuration: one dataclass, three sources, checked before any collective.

Precedence is the usual one: defaults < ``--config FILE`` (TOML or YAML) <
command-line flags. Every value is validated here, on every rank, before the
first collective, so a bad value is one line and exit status 2 everywhere,
and nothing (not even the run directory) is written.
"""

import dataclasses
import difflib
import json
import math
import os

import numpy as np

from ..comm.policy import ALGORITHMS
from ..errors import UsageError
from ..models.registry import MODELS
from ..io import tensorboard
from ..io.safeio import MiB, TiB, file_kind, human_bytes, one_line, os_reason, read_regular

__all__ = ["TrainConfig", "load_config_file", "resolve", "validate", "MUST_MATCH", "MODEL_OPTIONS", "FIELDS", "LIMITS",
           "type_name", "flag_name", "parse_ints", "to_json", "RESUME_RULES", "resume_differences", "timeline_problem"]

# Bounds a real run stays far inside, checked before anything is allocated so
# that a typo (an extra zero, 1e10 for 1e1) is one line, not an out-of-memory
# kill after the run directory was written. Each is (largest value, why).
LIMITS = {
    "hidden": (1 << 20, "a wider layer of an MLP would not fit in memory with its neighbours"),
    "features": (1 << 20, "one float32 row would be over 4 MiB"),
    "samples": (1 << 31, "2^31 rows; the shard and batch arithmetic keeps row numbers within 32-bit counts"),
    "classes": (100_000, "the output layer has one unit (and a weight per hidden unit) per class"),
    "bucket_mb": (1 << 20, "1 TiB; a bucket larger than the model is one bucket anyway"),
}
CONFIG_MAX_BYTES = 1 * MiB  # a configuration is a few hundred bytes; anything near this is not one
SYNTHETIC_MAX_BYTES = 1 * TiB  # samples x features x 4 bytes, over all ranks together


def _f(default, help, **kw):
    return dataclasses.field(default=default, metadata={"help": help, **kw})


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Everything ``ringtrain train`` needs; the fields are the flags and the config file's keys."""

    dataset: str = _f("digits", "digits, mnist5k, synthetic, PATH.npz, or a directory with x.npy and y.npy")
    model: str = _f("mlp", "mlp, softmax, cnn (conv blocks, then dense layers; needs image data), or a model "
                           "added with ringtrain.register_model")
    # None until __post_init__: the default depends on the model.
    hidden: tuple = _f(None, "hidden layer sizes, comma-separated: the mlp's layers, or the cnn's dense layers "
                             "after its conv blocks, 128 for the cnn unless given (its blocks extract the "
                             "features; 256,128 would put most of its weights in the first dense layer)",
                       parse="ints")
    channels: tuple = _f((16, 32), "cnn: output channels of each conv -> ReLU -> 2x2 max-pool block, "
                                   "comma-separated", parse="ints")
    kernel: int = _f(5, "cnn: convolution kernel size, odd ('same' padding)")
    epochs: int = _f(30, "passes over the training set")
    batch_size: int = _f(32, "samples per step on each rank (global batch = this x ranks)")
    lr: float = _f(0.1, "base learning rate")
    optimizer: str = _f("sgd", "sgd (with momentum) or adam", choices=("sgd", "adam"))
    momentum: float = _f(0.9, "SGD momentum (0 for plain SGD)")
    weight_decay: float = _f(0.0, "L2 weight decay (decoupled for adam)")
    warmup_steps: int = _f(0, "linear learning-rate warmup over this many steps")
    scale_lr: bool = _f(False, "multiply the learning rate by the number of ranks (Goyal et al.)")
    seed: int = _f(0, "seed for initial weights, shuffles and synthetic data")
    device: str = _f("cpu", "cpu (NumPy) or gpu (CuPy; rank uses GPU local_rank %% count)", choices=("cpu", "gpu"))
    drop_last: bool = _f(False, "cut every rank to the shortest shard instead of padding short shards")
    test_fraction: float = _f(0.2, "held-out fraction when a dataset has no test split")
    standardize: bool = _f(False, "scale each feature by the training rows' mean and standard deviation (exact "
                                  "global statistics, stored in the checkpoints)")
    samples: int = _f(10000, "synthetic: number of samples")
    features: int = _f(32, "synthetic: number of features")
    classes: int = _f(10, "synthetic: number of classes")
    run_dir: str = _f(None, "where config, metrics and checkpoints go (default runs/<timestamp>)")
    checkpoint_every: int = _f(0, "also checkpoint every this many steps (0: only at each epoch's end)")
    keep: int = _f(3, "checkpoints to keep")
    resume: str = _f("auto", "auto (newest valid checkpoint in the run directory), none, or a checkpoint PATH")
    max_time: float = _f(None, "stop after this many seconds, with a final checkpoint", kind="float")
    stop_before_time_limit: bool = _f(True, "in a Slurm job with a time limit, stop with a checkpoint before it "
                                            "(exit status 75), leaving twice the slowest step, evaluation and "
                                            "checkpoint plus 15 s")
    eval_every: int = _f(1, "evaluate on the test set every this many epochs (0: only at the end)")
    log_every: int = _f(50, "record a train event every this many steps")
    max_steps: int = _f(None, "stop after this many steps in all (for tests and smoke runs)", kind="int")
    timeout: float = _f(300.0, "abort if a collective takes longer than this many seconds")
    nonfinite: str = _f("skip", "on NaN/Inf gradients: skip the step, or abort", choices=("skip", "abort"))
    max_nonfinite: int = _f(5, "with skip: abort after this many non-finite steps in a row")
    bucket_mb: float = _f(4.0, "gradient fusion bucket size in MiB")
    overlap: bool = _f(True, "reduce gradient buckets while backward is still running")
    fp16_allreduce: bool = _f(False, "send gradients as float16 on the wire (halves traffic)")
    shard_optimizer: bool = _f(True, "split the optimizer step across ranks (ZeRO stage 1): reduce-scatter the "
                                     "gradients, update this rank's shard, allgather the parameters")
    allreduce: str = _f("auto", "gradient allreduce: auto, ring, mpi, hierarchical (within hosts, then across), "
                        "or shm (the peer window: shared memory, or CUDA IPC on GPUs; every rank on one host)",
                        choices=ALGORITHMS)
    timeline: str = _f(None, "write a Chrome-trace timeline of each step's phases to this file")
    tensorboard: str = _f(None, "write TensorBoard scalars (loss, accuracy, samples/s, learning rate) to this "
                                "directory from rank 0; needs tensorboardX (pip install tensorboardX)")
    progress: bool = _f(True, "show progress on rank 0: a bar when stderr is a terminal, else a line every "
                              "--progress-every seconds")
    progress_every: float = _f(30.0, "seconds between progress lines when stderr is not a terminal (the first "
                                     "after 10 s at most)")

    def __post_init__(self):
        _check_types(self)
        if self.hidden is None:  # unset: the model's own default, so every reader sees a tuple
            object.__setattr__(self, "hidden", DEFAULT_HIDDEN.get(self.model, DEFAULT_HIDDEN["mlp"]))


# Settings only some models take; the trainer passes each to the builders that declare it.
MODEL_OPTIONS = ("channels", "kernel")

# --hidden when none is given, by model.
DEFAULT_HIDDEN = {"mlp": (256, 128), "cnn": (128,), "softmax": ()}


# The settings that every rank must share; a difference is an error on every rank.
MUST_MATCH = ("dataset", "model", "hidden", "channels", "kernel", "epochs", "batch_size", "lr", "optimizer", "momentum",
              "weight_decay", "warmup_steps", "scale_lr", "seed", "drop_last", "test_fraction", "standardize",
              "samples", "features", "classes", "checkpoint_every", "max_steps", "nonfinite", "bucket_mb", "overlap",
              "fp16_allreduce", "shard_optimizer", "allreduce", "device", "resume", "eval_every", "log_every")

FIELDS = {f.name: f for f in dataclasses.fields(TrainConfig)}

# What a resumed run may change. Each setting is one of:
#   "match":  it shapes the model, the data, the data order or the optimizer
#             state the checkpoint holds; a difference is refused, since the
#             run would go on from a state that is not its own.
#   "future": it only steers what happens from here on; a difference is
#             allowed and listed in one notice line.
#   "where":  where this run lives or how it was started; never compared.
RESUME_RULES = {
    "dataset": ("match", "the data itself"),
    "model": ("match", "the parameters' shapes and meaning"),
    "hidden": ("match", "the parameters' shapes"),
    "channels": ("match", "the cnn's parameters' shapes"),
    "kernel": ("match", "the cnn's parameters' shapes"),
    "standardize": ("match", "the features the model has learned from"),
    "seed": ("match", "the held-out rows, the synthetic data and every epoch's shuffle"),
    "batch_size": ("match", "the data order and the position within an epoch"),
    "samples": ("match", "the synthetic data (and so the steps per epoch)"),
    "features": ("match", "the synthetic data and the input layer"),
    "classes": ("match", "the synthetic data and the output layer"),
    "test_fraction": ("match", "which rows are trained on"),
    "drop_last": ("match", "the shards' contents and the steps per epoch"),
    "optimizer": ("match", "the optimizer state's kind"),
    "momentum": ("match", "the velocity held in the optimizer state is an average under this momentum"),
    "weight_decay": ("match", "the optimizer state was accumulated under it"),
    # Only the learning rate follows from it, and the learning rate may change.
    "scale_lr": ("future", "the learning rate from here on"),
    "epochs": ("future", "how long the run goes on"),
    "max_steps": ("future", "how long the run goes on"),
    "max_time": ("future", "how long this job goes on"),
    "stop_before_time_limit": ("future", "how long this job goes on"),
    "lr": ("future", "the step size from here on"),
    "warmup_steps": ("future", "the learning rate from here on"),
    "log_every": ("future", "logging"),
    "eval_every": ("future", "evaluation"),
    "checkpoint_every": ("future", "when checkpoints are written"),
    "keep": ("future", "how many checkpoints are kept"),
    "timeout": ("future", "the watchdog"),
    "nonfinite": ("future", "what a non-finite step does"),
    "max_nonfinite": ("future", "what a non-finite step does"),
    # How gradients are averaged: the state is the same; the arithmetic of
    # later steps may differ in the last bits (fp16 on the wire, another order).
    "overlap": ("future", "how gradients are averaged"),
    "allreduce": ("future", "how gradients are averaged"),
    "shard_optimizer": ("future", "how the optimizer step is split across ranks"),
    "bucket_mb": ("future", "how gradients are averaged"),
    "fp16_allreduce": ("future", "how gradients are averaged"),
    "device": ("future", "where the arithmetic runs; checkpoints hold host arrays"),
    "timeline": ("future", "a trace of this job"),
    "tensorboard": ("future", "where this job's TensorBoard scalars go"),
    "run_dir": ("where", "where this run lives"),
    "resume": ("where", "how this run was started"),
    "progress_every": ("future", "how often rank 0 prints progress"),
    "progress": ("where", "the terminal display"),
}


def resume_differences(saved, cfg):
    """Compare a checkpoint's configuration with this run's (pure).

    Args:
        saved: the checkpoint's ``meta["config"]`` (JSON: lists for tuples).
            A setting it lacks (an older ringtrain) is not compared.
        cfg: this run's :class:`TrainConfig`.

    Returns:
        ``(refused, changed)``: the first "match" setting that differs as
        ``(name, saved value, this run's value, why)`` or None, and the list
        of ``(name, saved value, this run's value)`` for "future" settings.
    """
    now = to_json(cfg)
    refused, changed = None, []
    for name, (rule, why) in RESUME_RULES.items():
        if rule == "where" or name not in saved or saved[name] == now[name]:
            continue
        if rule == "match" and refused is None:
            refused = (name, saved[name], now[name], why)
        elif rule == "future":
            changed.append((name, saved[name], now[name]))
    return refused, changed


_KIND_WORDS = {"int": "an integer", "float": "a number", "bool": "True or False", "str": "a string",
               "ints": "a tuple of integers like (128, 64)"}


def _is_int(value):
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _check_types(cfg):
    """Raise the CLI's one-line UsageError for a value of the wrong type, e.g. ``TrainConfig(epochs="3")``.

    Values of the right kind are normalised in place: a list of ints to a
    tuple, an int to a float where a number is expected, a path to a string.
    """
    for name, field in FIELDS.items():
        value = getattr(cfg, name)
        if value is None and field.default is None:  # unset optional (or model-dependent) setting
            continue
        kind = type_name(field)
        fixed = _normalised(kind, value)
        if fixed is None:
            raise UsageError(f"{flag_name(name)}: must be {_KIND_WORDS[kind]}, got {value!r} "
                             f"({type(value).__name__})", everywhere=True)
        if fixed is not value:
            object.__setattr__(cfg, name, fixed)


def _normalised(kind, value):
    """``value`` as the field's kind wants it, or None when it is of the wrong type."""
    if kind == "ints":
        if isinstance(value, (tuple, list)) and all(_is_int(v) for v in value):
            return value if isinstance(value, tuple) and all(type(v) is int for v in value) else \
                tuple(int(v) for v in value)
        return None
    if kind == "int":
        return (value if type(value) is int else int(value)) if _is_int(value) else None
    if kind == "float":
        if _is_int(value) or isinstance(value, (float, np.floating)):
            return value if type(value) is float else float(value)
        return None
    if kind == "bool":
        return bool(value) if isinstance(value, (bool, np.bool_)) else None
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    return value if isinstance(value, str) else None


def type_name(field):
    """The kind of value a field takes: "ints", "bool", "int", "float" or "str"."""
    if field.metadata.get("parse") == "ints":
        return "ints"
    if "kind" in field.metadata:  # fields whose default (None) does not show their type
        return field.metadata["kind"]
    default = field.default
    return {bool: "bool", int: "int", float: "float"}.get(type(default), "str")


def flag_name(name):
    """The command-line flag of a field: ``batch_size`` -> ``--batch-size``."""
    return "--" + name.replace("_", "-")


def parse_ints(text, name="hidden"):
    """``"128,64"`` -> ``(128, 64)``; ``""`` -> ``()``."""
    if isinstance(text, (list, tuple)):
        items = list(text)
    else:
        items = [t for t in str(text).replace(" ", "").split(",") if t]
    try:
        # From a file, each item must already be an integer: int(8.5) would silently make it 8.
        if any(not isinstance(t, str) and not _is_int(t) for t in items):
            raise ValueError
        return tuple(int(t) for t in items)
    except (TypeError, ValueError):
        raise UsageError(f"--{name.replace('_', '-')}: expected comma-separated integers like 128,64, got {text!r}",
                         everywhere=True) from None


def closest_setting(name):
    """The setting a mistyped ``name`` most likely meant, or None (pure).

    The same words spelled another way first (``batch-size``, ``batchsize``),
    then the nearest name by spelling (``epoch`` -> ``epochs``, ``learning_rate`` is too far from ``lr``).
    """
    if not isinstance(name, str):
        return None
    squeezed = name.replace("-", "").replace("_", "").lower()
    same = [n for n in FIELDS if n.replace("_", "") == squeezed]
    if same:
        return same[0]
    near = difflib.get_close_matches(name.replace("-", "_").lower(), list(FIELDS), n=1, cutoff=0.75)
    return near[0] if near else None


def coerce(name, value, source):
    """Convert a value from a config file to the field's type, or raise a one-line UsageError."""
    if name not in FIELDS:
        close = closest_setting(name)
        hint = f"; did you mean {close!r}?" if close else ""
        raise UsageError(f"{source}: unknown setting {name!r}{hint}", everywhere=True)
    field = FIELDS[name]
    kind = type_name(field)
    bad = UsageError(f"{source}: setting {name!r} must be {kind}, got {value!r}", everywhere=True)
    if value is None:
        if field.default is None:  # an optional setting (run_dir, max_steps, ...): null means unset
            return None
        raise bad
    if kind == "ints":
        return parse_ints(value, name)
    if kind == "bool":
        if isinstance(value, bool):
            return value
        raise bad
    if kind == "int":
        if isinstance(value, bool) or not isinstance(value, int):
            raise bad
        return value
    if kind == "float":
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise bad
        return float(value)
    if not isinstance(value, str):
        raise bad
    return value


# Keys a run directory's config.json records beside the settings.
RECORD_ONLY = ("model_name",)


def load_config_file(path):
    """Read a TOML (``.toml``), YAML (``.yaml``/``.yml``) or JSON file into a dict of settings.

    JSON is what a run directory's ``config.json`` holds: every setting of
    that run, so ``--config RUN_DIR/config.json`` runs it again without
    retyping a command line. Keys may be written with dashes or underscores.
    Raises a one-line UsageError for a missing, unreadable or malformed file.
    """
    ext = os.path.splitext(path)[1].lower()
    if ext not in (".toml", ".yaml", ".yml", ".json"):
        raise UsageError(f"--config {path}: expected a .toml, .yaml, .yml or .json file", everywhere=True)
    # A FIFO, a device or a directory is refused without blocking; so is a huge file.
    raw = read_regular(path, "--config", CONFIG_MAX_BYTES, "config files", error=_everywhere)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UsageError(f"--config {path}: not UTF-8 text (byte 0x{raw[exc.start]:02x} at offset {exc.start})",
                         everywhere=True) from None
    try:
        if ext == ".toml":
            import tomllib

            data = tomllib.loads(text)
        elif ext == ".json":
            data = json.loads(text)
        else:
            data = _load_yaml(text, path)
    except UsageError:
        raise
    except Exception as exc:  # noqa: BLE001 - every parser error (RecursionError included) becomes one line
        raise UsageError(one_line(f"--config {path}: not valid {ext.lstrip('.').upper()}: {exc}"),
                         everywhere=True) from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise UsageError(f"--config {path}: expected a table of settings, got {type(data).__name__}",
                         everywhere=True)
    if "train" in data and isinstance(data["train"], dict) and len(data) == 1:
        data = data["train"]  # allow a [train] table
    out = {}
    for key, value in data.items():
        name = str(key).replace("-", "_")
        if name in RECORD_ONLY and ext == ".json":  # a run directory's config.json: what was trained, not a setting
            continue
        out[name] = coerce(name, value, f"--config {path}")
    return out


def _everywhere(message):
    # Every rank reads the same file the same way, so every rank raises this.
    return UsageError(message, everywhere=True)


def _load_yaml(text, path):
    """``yaml.safe_load`` without anchors and aliases.

    Nested aliases expand exponentially ("billion laughs": a 370-byte file
    runs for minutes), and a settings file has no need of them.
    """
    try:
        import yaml
    except ImportError:
        raise UsageError(f"--config {path}: YAML needs PyYAML; pip install pyyaml, or use TOML",
                         everywhere=True) from None

    class NoAliasLoader(yaml.SafeLoader):
        def compose_node(self, parent, index):
            if self.check_event(yaml.AliasEvent) or getattr(self.peek_event(), "anchor", None) is not None:
                raise UsageError(f"--config {path}: YAML aliases (*name) and anchors (&name) are not supported; "
                                 "write the values out", everywhere=True)
            return super().compose_node(parent, index)

    return yaml.load(text, Loader=NoAliasLoader)  # noqa: S506 - a SafeLoader subclass


def resolve(flags, file_settings=None):
    """Merge defaults < file < flags (flags given as a dict of explicitly set values)."""
    values = {}
    values.update(file_settings or {})
    values.update({k: v for k, v in flags.items() if v is not None})
    values = {k: v for k, v in values.items() if k in FIELDS}
    return TrainConfig(**values)


def validate(cfg, root=True):
    """Raise a one-line UsageError for the first bad value in ``cfg``.

    Args:
        cfg: the configuration.
        root: also check the paths only rank 0 touches (``--resume``,
            ``--run-dir``, ``--timeline``); pass False on the other ranks,
            whose file systems may not have them.
    """

    def bad(name, problem):
        raise UsageError(f"{flag_name(name)}: {problem}", everywhere=True)

    def positive(name, allow_zero=False):
        value = getattr(cfg, name)
        if value is None:
            return
        if isinstance(value, float) and not math.isfinite(value):
            bad(name, f"must be a finite number, got {value}")
        if value < 0 or (value == 0 and not allow_zero):
            bad(name, f"must be {'>= 0' if allow_zero else '> 0'}, got {value}")

    for name in ("epochs", "batch_size", "keep", "log_every", "samples", "features", "timeout", "bucket_mb",
                 "progress_every"):
        positive(name)
    for name in ("lr",):
        positive(name)
    for name in ("weight_decay", "warmup_steps", "checkpoint_every", "eval_every", "max_nonfinite", "momentum"):
        positive(name, allow_zero=True)
    if cfg.max_time is not None:
        positive("max_time")
    if cfg.max_steps is not None:
        positive("max_steps")
    _check_text(cfg, bad)
    if cfg.classes < 2:
        bad("classes", f"must be at least 2, got {cfg.classes}")
    if cfg.momentum >= 1:
        bad("momentum", f"must be in [0, 1), got {cfg.momentum}")
    if not 0 < cfg.test_fraction < 1:
        bad("test_fraction", f"must be between 0 and 1, got {cfg.test_fraction}")
    if cfg.model not in MODELS:
        bad("model", f"unknown model {cfg.model!r}; choose one of {', '.join(sorted(MODELS))}")
    if cfg.model == "mlp" and not cfg.hidden:
        bad("hidden", "the mlp needs at least one hidden layer, e.g. --hidden 128")
    if any(h <= 0 for h in cfg.hidden):
        bad("hidden", f"layer sizes must be > 0, got {','.join(map(str, cfg.hidden))}")
    _check_sizes(cfg, bad)
    if int(cfg.bucket_mb * MiB) < 1:  # the bucket size the strategy takes, in whole bytes
        bad("bucket_mb", f"must be at least 1 byte ({1 / MiB:.2g} MiB), got {cfg.bucket_mb:g}")
    if not 1 <= len(cfg.channels) <= 8 or not all(1 <= c <= 1024 for c in cfg.channels):
        bad("channels", f"expected 1 to 8 conv blocks of 1 to 1024 channels each, e.g. 16,32; "
                        f"got {','.join(map(str, cfg.channels)) or 'none'}")
    if not (1 <= cfg.kernel <= 15 and cfg.kernel % 2 == 1):
        bad("kernel", f"must be odd, from 1 to 15 ('same' padding), got {cfg.kernel}")
    for name in ("optimizer", "device", "nonfinite", "allreduce"):
        choices = FIELDS[name].metadata["choices"]
        if getattr(cfg, name) not in choices:
            bad(name, f"unknown value {getattr(cfg, name)!r}; choose one of {', '.join(choices)}")
    if root:
        _check_root_paths(cfg, bad)
    return cfg


def _check_text(cfg, bad):
    """Every string setting must be text a JSON record can hold: a path that is not UTF-8 is refused up front.

    Python hands a file name that is not UTF-8 over as lone surrogates; the
    run would train, then fail at its first checkpoint, whose metadata is
    JSON. Said now, it costs nothing.
    """
    for name in FIELDS:
        value = getattr(cfg, name)
        if value == "":  # from a config file; the flags refuse it themselves
            bad(name, "an empty value; give one, or leave it out for the default")
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                shown = os.fsencode(value) if name in _PATHS else value.encode("utf-8", "backslashreplace")
                bad(name, f"{shown!r} is not UTF-8 text; ringtrain records it in JSON, so rename it "
                          "(or give another)")


# The settings that name files or directories.
_PATHS = ("dataset", "run_dir", "resume", "timeline", "tensorboard")


def _check_root_paths(cfg, bad):
    """The paths only rank 0 reads or writes: checked there alone, and the verdict shared."""
    if cfg.resume not in ("auto", "none") and not os.path.exists(cfg.resume):
        bad("resume", f"no checkpoint at {cfg.resume!r}; give a checkpoint file, a run directory, auto or none")
    if cfg.run_dir is not None and os.path.exists(cfg.run_dir) and not os.path.isdir(cfg.run_dir):
        bad("run_dir", f"{cfg.run_dir!r} exists and is not a directory")
    if cfg.timeline is not None:
        problem = timeline_problem(cfg.timeline)
        if problem:
            bad("timeline", problem)
    if cfg.tensorboard is not None:
        problem = tensorboard.missing_problem() or tensorboard.folder_problem(cfg.tensorboard)
        if problem:
            bad("tensorboard", problem)


def timeline_problem(path):
    """Why the timeline could not be written to ``path`` at the end of the run, or None.

    Checked at the start so that a typo costs nothing, not a whole run's
    timeline: the path, if it exists, must be a regular file (a FIFO would
    block the write at the end), and its directory must be writable, or be
    creatable in the nearest directory that exists (a timeline inside a run
    directory the run is about to make is fine: the write makes the parents).
    """
    try:
        kind = file_kind(os.stat(path).st_mode)
    except FileNotFoundError:
        kind = None
    except OSError as exc:
        return f"{path}: {os_reason(exc)}"
    if kind is not None:
        return f"{path} is {kind}; give a file name"
    directory = os.path.dirname(os.path.abspath(path))
    existing = directory
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        return f"{path}: {existing} is {file_kind(os.stat(existing).st_mode)}, so {directory} cannot be made"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"{path}: cannot write in {existing} (permission denied)"
    return None


def _check_sizes(cfg, bad):
    """Refuse sizes far beyond any real run, saying the limit and why (see LIMITS)."""
    for name in ("hidden", "features", "samples", "classes", "bucket_mb"):
        values = getattr(cfg, name)
        limit, why = LIMITS[name]
        for value in values if isinstance(values, tuple) else (values,):
            if value > limit:
                shown = f"{value:g}" if isinstance(value, float) else f"{value:,}"
                bad(name, f"{shown} is too large; ringtrain allows at most {limit:,} ({why})")
    if cfg.dataset == "synthetic":
        nbytes = cfg.samples * cfg.features * 4
        if nbytes > SYNTHETIC_MAX_BYTES:
            bad("samples", f"{cfg.samples:,} rows of {cfg.features:,} features would be {human_bytes(nbytes)} "
                f"of float32; ringtrain generates synthetic datasets of at most {human_bytes(SYNTHETIC_MAX_BYTES)}")


def to_json(cfg):
    """The resolved configuration as a JSON-able dict (tuples as lists)."""
    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in dataclasses.asdict(cfg).items()}
