"""What ringtrain reads and writes on disk.

* :mod:`~ringtrain.io.checkpoint`: whole-or-absent checkpoints, checked before they are trusted;
* :mod:`~ringtrain.io.safeio`: opening users' files safely (regular files only, bounded sizes, one-line errors).
"""

from .checkpoint import CheckpointError, list_checkpoints, load_checkpoint, save_checkpoint

__all__ = ["CheckpointError", "list_checkpoints", "load_checkpoint", "save_checkpoint"]
