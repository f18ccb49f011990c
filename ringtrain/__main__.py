"""``python -m ringtrain`` is the ``ringtrain`` command."""

from .cli import _console

_console()
