"""``python -m ringtrain`` is the ``ringtrain`` command."""

from .cli import console

console()
