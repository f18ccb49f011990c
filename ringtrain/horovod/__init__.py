"""Unmodified Horovod scripts on ringtrain: ``python -m ringtrain.horovod SCRIPT [ARGS]``.

``import horovod``, ``import horovod.torch as hvd`` and ``horovod.run(fn,
np=N)`` work in the process the runner starts, and only there; a real Horovod
installed beside ringtrain is never shadowed. :mod:`.imports` serves the
names, :mod:`.runner` is ``horovod.run``; ``__main__`` runs the script.
"""

from .imports import HOROVOD_VERSION, install, installed, uninstall
from .runner import run

__all__ = ["HOROVOD_VERSION", "install", "installed", "uninstall", "run"]
