"""One parser for every number a process reads from its environment.

ringtrain's own variables, Horovod's, Slurm's, torchrun's and MPI's all come
through here, so each one gets the same treatment: ASCII digits only (``²``
passes ``str.isdigit()`` but is no number), a bounded length (a 400-digit
value is refused, not expanded or overflowed), a range, and on anything else
one line that names the variable, the value and the fix, raised as a
:class:`~ringtrain.errors.UsageError` (status 2, no traceback). A bad value
never switches a bound off in silence.

The functions are pure given ``env``; callers pass ``os.environ`` at the edge.
"""

import re

from .errors import UsageError

__all__ = ["EnvironmentValueError", "parse_int", "parse_seconds", "env_int", "env_seconds", "env_flag",
           "MAX_DIGITS"]

# No count, rank or port ringtrain reads needs more digits; a longer value is garbage or an attack.
MAX_DIGITS = 12

_INT = re.compile(r"-?[0-9]{1,%d}" % MAX_DIGITS)
_DECIMAL = re.compile(r"[0-9]{1,%d}(\.[0-9]{1,9})?|\.[0-9]{1,9}" % MAX_DIGITS)
_FLAGS = {"": None, "0": False, "1": True, "false": False, "true": True, "no": False, "yes": True,
          "off": False, "on": True}


class EnvironmentValueError(UsageError):
    """An environment variable holds a value that is not what it must be."""


def _refuse(name, text, wanted, fix, everywhere):
    shown = text if len(text) <= 40 else text[:37] + "..."
    raise EnvironmentValueError(f"{name}={shown!r}: must be {wanted}; {fix}", everywhere=everywhere)


def _range_words(lo, hi, unit):
    if hi is None:
        return f"a whole number{unit} >= {lo}"
    return f"a whole number{unit} from {lo} to {hi}"


def parse_int(text, name, lo=0, hi=None, fix="unset it for the default", everywhere=False, unit=""):
    """``text`` as an int in ``[lo, hi]``, or EnvironmentValueError naming ``name`` (pure).

    Args:
        text: the value as read (surrounding blanks are ignored).
        name: what to call it in the error (the variable's name).
        lo, hi: the inclusive range; ``hi=None`` for no upper bound beyond the digit limit.
        fix: the end of the error line: what the user should do.
        everywhere: passed to the UsageError (True where every rank reads the same value).
        unit: words after "a whole number" in the error, e.g. " of seconds".
    """
    stripped = str(text).strip()
    if not _INT.fullmatch(stripped):
        _refuse(name, str(text), _range_words(lo, hi, unit), fix, everywhere)
    value = int(stripped)
    if value < lo or (hi is not None and value > hi):
        _refuse(name, str(text), _range_words(lo, hi, unit), fix, everywhere)
    return value


def parse_seconds(text, name, lo=0.0, hi=None, positive=False, fix="unset it for the default",
                  everywhere=False, unit="seconds"):
    """``text`` as a finite number of seconds (plain decimal, no sign or exponent), checked (pure).

    ``positive=True`` refuses 0 as well (a bound of 0 s would fire at once, or mean "off": neither is
    what a user who typed it wants to be guessed). ``unit`` names what the number counts in the error
    (Horovod's cycle time is in milliseconds).
    """
    stripped = str(text).strip()
    wanted = f"a number of {unit} " + ("> 0" if positive else f">= {_shown(lo)}")
    if hi is not None:
        wanted += f" and <= {_shown(hi)}"
    if not _DECIMAL.fullmatch(stripped):
        _refuse(name, str(text), wanted, fix, everywhere)
    value = float(stripped)
    if value < lo or (positive and value <= 0) or (hi is not None and value > hi):
        _refuse(name, str(text), wanted, fix, everywhere)
    return value


def _shown(number):
    return str(int(number)) if float(number).is_integer() else f"{number:g}"


def env_int(env, name, default=None, **limits):
    """The int ``env[name]`` holds, or ``default`` when it is unset or blank; see :func:`parse_int`."""
    text = env.get(name, "")
    if not text.strip():
        return default
    return parse_int(text, name, **limits)


def env_seconds(env, name, default=None, **limits):
    """The seconds ``env[name]`` holds, or ``default`` when unset or blank; see :func:`parse_seconds`."""
    text = env.get(name, "")
    if not text.strip():
        return default
    return parse_seconds(text, name, **limits)


def env_flag(env, name, default=False, everywhere=False):
    """``env[name]`` as a switch (0/1, true/false, yes/no, on/off; blank is ``default``)."""
    text = env.get(name, "")
    value = _FLAGS.get(text.strip().lower(), "?")
    if value == "?":
        _refuse(name, text, "0 or 1 (or true/false, yes/no, on/off)", "unset it for the default", everywhere)
    return default if value is None else value
