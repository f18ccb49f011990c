"""ringtrain: data-parallel training under MPI with a ring allreduce.

The public API; see README.md for the commands.
"""

__version__ = "0.1.0"

from .checkpoint import CheckpointError, load_checkpoint
from .errors import MismatchError, UsageError
from .failure import abort_on_error, agree
from .models import Model, build_model, register_model
from .optim import build_optimizer, learning_rate, scaled_lr
from .topology import TaskSpec

__all__ = [
    "__version__",
    "TaskSpec",
    "UsageError",
    "MismatchError",
    "abort_on_error",
    "agree",
    "CheckpointError",
    "load_checkpoint",
    "Model",
    "build_model",
    "register_model",
    "build_optimizer",
    "learning_rate",
    "scaled_lr",
]
