"""``horovod.runner.util.threads.in_thread``: run a function on a background thread."""

import threading

__all__ = ["in_thread"]


def in_thread(target, args=(), name=None, daemon=True, silent=False):
    """Start ``target(*args)`` on a new thread and return the thread.

    Args:
        args: a tuple (a single argument is ``(arg,)``).
        daemon: do not keep the process alive for it.
        silent: swallow any exception ``target`` raises.
    """
    if not isinstance(args, tuple):
        raise ValueError(f"args must be a tuple, not {type(args).__name__}; for one argument use (arg,)")

    def run(*a):
        try:
            target(*a)
        except Exception:  # noqa: BLE001 - silent means silent
            if not silent:
                raise

    thread = threading.Thread(target=run, args=args, name=name, daemon=daemon)
    thread.start()
    return thread
