"""The engine's settings: every variable it reads, read once at ``init``, validated, into one record.

Nothing is read at import: :func:`ringtrain.engine.init` calls
:meth:`Settings.from_env`, every rank agrees on the answer (a bad value on
any rank ends the job on every rank with one line and status 2, never a
bound switched off in silence), and the engine keeps the record. Numbers
are parsed by :mod:`ringtrain.environment`, the one parser for them.

=====================================  ================  ==========================================
variable                               default           what it sets
=====================================  ================  ==========================================
``HOROVOD_CYCLE_TIME``                 1 (ms)            how long a channel's thread leaves an op
                                                         for the caller's thread before it runs it
``HOROVOD_FUSION_THRESHOLD``           64 MiB            the most bytes of reductions fused into one
``RINGTRAIN_HVD_LOCAL_BYTES``          16 KiB            the largest CPU allreduce or broadcast whose
                                                         data goes with its announcement
``HOROVOD_STALL_CHECK_TIME_SECONDS``   60                when a leader warns of a stalled op
``HOROVOD_STALL_SHUTDOWN_TIME_SECONDS``  0 (off)         when a stall shuts the engine down
``HOROVOD_STALL_CHECK_DISABLE``        0                 1 turns both stall checks off
``RINGTRAIN_TIMEOUT``                  unset (no bound)  ringtrain's bound on every op
=====================================  ================  ==========================================

The fusion default is half Horovod's 128 MiB on purpose: Horovod fuses into
one buffer it keeps for the whole job, while the engine concatenates a fused
run into a buffer made for it, so the threshold is also the memory a fused
run may take beside the tensors themselves; at that size one op's fixed
cost is already a small part of its transfer, which is what fusing saves.
"""

import dataclasses
import os

from ..comm.guard import timeout_from_env
from ..environment import env_flag, env_int, env_seconds

__all__ = ["Settings", "DEFAULT_FUSION_BYTES", "DEFAULT_LOCAL_BYTES"]

DEFAULT_FUSION_BYTES = 64 << 20
DEFAULT_LOCAL_BYTES = 16 << 10
_LESS = ("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS is less than HOROVOD_STALL_CHECK_TIME_SECONDS, will not "
         "shutdown.")


@dataclasses.dataclass(frozen=True)
class Settings:
    """What the engine's variables set (see the module docstring for each one and its default)."""

    cycle_s: float = 0.001
    fusion_bytes: int = DEFAULT_FUSION_BYTES
    local_bytes: int = DEFAULT_LOCAL_BYTES
    stall_warn_s: float | None = 60.0   # None: the stall checks are off
    stall_shutdown_s: float = 0.0       # 0: a stall never shuts the engine down
    timeout_s: float | None = None      # ringtrain's bound as RINGTRAIN_TIMEOUT set it (None: no bound)
    notes: tuple = ()                   # warnings to print once (Horovod's, for a moot shutdown time)

    @classmethod
    def from_env(cls, env=None):
        """The settings ``env`` (default ``os.environ``) holds (pure, given ``env``).

        Every variable is read even when another makes it moot: a misspelt
        value is refused, never ignored.

        Raises:
            EnvironmentValueError: (a UsageError) naming the variable, its value and the fix.
        """
        env = os.environ if env is None else env
        # Horovod's cycle is in milliseconds; beyond 10 s every op would wait that long for company.
        cycle_ms = env_seconds(env, "HOROVOD_CYCLE_TIME", 1.0, hi=10_000, everywhere=True, unit="milliseconds")
        fusion = env_int(env, "HOROVOD_FUSION_THRESHOLD", DEFAULT_FUSION_BYTES, unit=" of bytes", everywhere=True)
        local = env_int(env, "RINGTRAIN_HVD_LOCAL_BYTES", DEFAULT_LOCAL_BYTES, hi=1 << 30, unit=" of bytes",
                        everywhere=True)
        disabled = env_flag(env, "HOROVOD_STALL_CHECK_DISABLE", everywhere=True)
        warn = env_seconds(env, "HOROVOD_STALL_CHECK_TIME_SECONDS", 60.0, everywhere=True)
        shutdown = env_seconds(env, "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", 0.0, everywhere=True)
        timeout = timeout_from_env(env)
        notes = ()
        if disabled:
            warn, shutdown = None, 0.0
        elif shutdown and shutdown < warn:
            shutdown, notes = 0.0, (_LESS,)
        return cls(cycle_ms / 1000.0, fusion, local, warn, shutdown, timeout, notes)

    @property
    def stall_times(self):
        """``(warn after, shut down after)`` in seconds; ``(None, 0)`` when the checks are off."""
        return self.stall_warn_s, self.stall_shutdown_s
