"""What ringtrain reads and writes on disk.

* :mod:`~ringtrain.io.checkpoint`: whole-or-absent checkpoints, checked before they are trusted;
* :mod:`~ringtrain.io.safeio`: opening users' files safely (regular files only, bounded sizes, one-line errors),
  and printing their text escaped;
* :mod:`~ringtrain.io.rundir`: the run directory's lock, config.json and metrics.jsonl, never through a link;
* :mod:`~ringtrain.io.console`: where rank 0's lines go, so a closed or full output never ends a run.
"""

from .checkpoint import CheckpointError, list_checkpoints, load_checkpoint, save_checkpoint

__all__ = ["CheckpointError", "list_checkpoints", "load_checkpoint", "save_checkpoint"]
