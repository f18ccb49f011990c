"""ringtrain: data-parallel training under MPI with a ring allreduce.

The public API; the documentation is in docs/ (docs/library.md, docs/api/ringtrain.md).
"""

__version__ = "0.3.0"

from .comm import allreduce, allreduce_, allreduce_many_, broadcast_
from .io.checkpoint import CheckpointError, load_checkpoint
from .data.sharding import EpochPlan, shard_bounds
from .data.load import Shard, load_sharded
from .errors import MismatchError, UsageError
from .failure import abort_on_error, agree
from .models import FlatModel, Model, build_model, flat_layout, register_model
from .optim import build_optimizer, learning_rate, scaled_lr
from .cluster.topology import TaskSpec
from .training import EvalTotals, ShardedStep, TrainConfig, TrainResult, reduce_eval, sum_eval, train

__all__ = [
    "__version__",
    "TaskSpec",
    "UsageError",
    "MismatchError",
    "abort_on_error",
    "agree",
    "allreduce",
    "allreduce_",
    "allreduce_many_",
    "broadcast_",
    "CheckpointError",
    "load_checkpoint",
    "EpochPlan",
    "shard_bounds",
    "Shard",
    "load_sharded",
    "EvalTotals",
    "reduce_eval",
    "sum_eval",
    "Model",
    "FlatModel",
    "flat_layout",
    "build_model",
    "register_model",
    "build_optimizer",
    "learning_rate",
    "scaled_lr",
    "TrainConfig",
    "TrainResult",
    "train",
    "ShardedStep",
    "interop",
]


def __getattr__(name):
    # The PyTorch side on first use (ringtrain.interop, ringtrain.TorchModel):
    # they need torch (ringtrain.torch says how to install it when it is
    # missing), and loading them lazily keeps `import ringtrain` torch-free.
    import importlib

    if name == "interop":
        return importlib.import_module(".torch.interop", __name__)
    if name == "TorchModel":
        return importlib.import_module(".torch.model", __name__).TorchModel
    raise AttributeError(f"module 'ringtrain' has no attribute {name!r}")
