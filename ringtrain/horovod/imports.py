"""``import horovod`` served by ringtrain, inside one process, without shadowing an installed Horovod.

:func:`install` puts :class:`HorovodFinder` first on ``sys.meta_path`` of the
calling process. From then on every ``horovod`` or ``horovod.*`` import in that
process resolves to ringtrain: ``horovod.torch`` *is* :mod:`ringtrain.torch`
(the same module object, so a class or a patched function is the same under
either name), ``horovod.torch.X`` is ``ringtrain.torch.X`` wherever ringtrain
has a module of that name (``elastic`` included, once it exists), and the few
packages ringtrain has no module for (``horovod``, ``horovod.common``,
``horovod.runner``) are small modules built here. ``horovod.tensorflow`` is
:mod:`ringtrain.tensorflow`; ``horovod.tensorflow.keras`` and
``horovod.keras`` are both :mod:`ringtrain.keras`. A name ringtrain does not
serve (``horovod.spark``, ``horovod.mxnet``) fails as a plain
``ModuleNotFoundError`` that says which names are served.

Nothing here touches ``sys.path`` or any file, so a real Horovod installed in
the same environment is untouched: other processes, and this one before
:func:`install` or after :func:`uninstall`, import it as usual.
:mod:`ringtrain.horovod` (``python -m ringtrain.horovod script.py``) installs
the finder before it runs the script.
"""

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import threading
import types

__all__ = ["HOROVOD_VERSION", "HorovodFinder", "install", "uninstall", "installed", "served_name", "in_thread",
           "is_version_greater_equal_than", "split_list"]

# The Horovod release whose PyTorch API ringtrain.torch follows; what
# ``horovod.__version__`` says, for scripts that check it.
HOROVOD_VERSION = "0.28.1"

# Horovod modules that live under another name in ringtrain.
RENAMED = {
    "horovod.torch": "ringtrain.torch",
    # Horovod's ops module; ringtrain.torch exports every op it holds.
    "horovod.torch.mpi_ops": "ringtrain.torch",
    # Horovod's compressors live beside the distributed optimizer that uses them.
    "horovod.torch.compression": "ringtrain.torch.optimizer",
    "horovod.common.exceptions": "ringtrain.engine.errors",  # torch-free: served with TensorFlow alone too
    "horovod.tensorflow": "ringtrain.tensorflow",
    # Horovod's two Keras packages share one implementation (as its horovod/_keras does).
    "horovod.tensorflow.keras": "ringtrain.keras",
    "horovod.keras": "ringtrain.keras",
    "horovod._keras": "ringtrain.keras",
}
# Horovod's module prefixes served by a ringtrain package of another name: ``horovod.keras.callbacks`` is
# ``ringtrain.keras.callbacks``. Longest first, so ``horovod.tensorflow.keras.`` wins over ``horovod.tensorflow.``.
PREFIXES = (("horovod.tensorflow.keras.", "ringtrain.keras."), ("horovod.tensorflow.", "ringtrain.tensorflow."),
            ("horovod.keras.", "ringtrain.keras."), ("horovod.torch.", "ringtrain.torch."))
# Packages of Horovod's that ringtrain has no module for: built here.
BUILT = ("horovod", "horovod.common", "horovod.common.util", "horovod.runner", "horovod.runner.util",
         "horovod.runner.util.threads")


def served_name(fullname):
    """The ringtrain module that serves Horovod's module ``fullname``, or None (pure).

    ``horovod.torch.X`` maps to ``ringtrain.torch.X`` by name, at any depth
    (Horovod's ``horovod.torch.elastic.sampler``), so a module added to
    ringtrain.torch is served without a change here. The modules in
    :data:`BUILT` map to themselves (they are made by :func:`_build`).
    """
    if fullname in RENAMED:
        return RENAMED[fullname]
    if fullname in BUILT:
        return fullname
    for prefix, target in PREFIXES:
        if fullname.startswith(prefix):
            return target + fullname[len(prefix):]
    return None


def in_thread(target, args=(), name=None, daemon=True, silent=False):
    """Start ``target(*args)`` on a new thread and return the thread (``horovod.runner.util.threads``).

    Args:
        args: a tuple (a single argument is ``(arg,)``).
        daemon: do not keep the process alive for it.
        silent: swallow any exception ``target`` raises.
    """
    if not isinstance(args, tuple):
        raise ValueError(f"args must be a tuple, not {type(args).__name__}; for one argument use (arg,)")

    def body(*a):
        try:
            target(*a)
        except Exception:  # noqa: BLE001 - silent means silent
            if not silent:
                raise

    thread = threading.Thread(target=body, args=args, name=name, daemon=daemon)
    thread.start()
    return thread


LEAVES = ("horovod.runner.util.threads", "horovod.common.util")  # built modules that are not packages


def is_version_greater_equal_than(ver, target):
    """True when version ``ver`` is at least ``target`` (``horovod.common.util``; pure)."""
    from packaging import version

    return version.parse(ver) >= version.parse(target)


def split_list(items, parts):
    """``items`` cut into ``parts`` consecutive lists of nearly equal length (``horovod.common.util``; pure)."""
    size, extra = divmod(len(items), parts)
    out, start = [], 0
    for i in range(parts):
        stop = start + size + (1 if i < extra else 0)
        out.append(items[start:stop])
        start = stop
    return out


def _run(*args, **kwargs):
    from .runner import run  # the runner imports subprocess and pickle: only when a script calls it

    return run(*args, **kwargs)


_run.__doc__ = "``horovod.run``: see :func:`ringtrain.horovod.runner.run`."
_run.__name__ = "run"


def _build(fullname):
    """A new module for one of :data:`BUILT`."""
    module = types.ModuleType(fullname, f"``{fullname}`` as served by ringtrain (see ringtrain.horovod.imports).")
    if fullname not in LEAVES:
        module.__path__ = []  # a package: its submodules come through the finder, never from disk
    if fullname == "horovod":
        module.__version__ = HOROVOD_VERSION
        module.run = _run
    elif fullname == "horovod.runner":
        module.run = _run
    elif fullname == "horovod.runner.util.threads":
        module.in_thread = in_thread
    elif fullname == "horovod.common.util":
        module.is_version_greater_equal_than = is_version_greater_equal_than
        module.split_list = split_list
    return module


class _Loader(importlib.abc.Loader):
    """Puts the serving module in ``sys.modules`` under Horovod's name.

    The import system returns whatever ``sys.modules[name]`` holds once
    ``exec_module`` is done, so replacing the placeholder there hands back
    ringtrain's own module object, its ``__name__`` and ``__spec__`` intact.
    """

    def __init__(self, target):
        self.target = target

    def create_module(self, spec):
        return _build(spec.name) if spec.name in BUILT else None

    def exec_module(self, module):
        if module.__name__ in BUILT:
            return
        sys.modules[module.__name__] = importlib.import_module(self.target)


class HorovodFinder(importlib.abc.MetaPathFinder):
    """A meta-path finder that serves ``horovod`` and ``horovod.*`` from ringtrain."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "horovod" and not fullname.startswith("horovod."):
            return None
        served = served_name(fullname)
        if served is not None and served not in BUILT and importlib.util.find_spec(served) is None:
            served = None
        if served is None:
            raise ModuleNotFoundError(
                f"No module named {fullname!r}: python -m ringtrain.horovod serves horovod, horovod.torch, "
                "horovod.tensorflow, horovod.tensorflow.keras, horovod.keras and their submodules, "
                "horovod.common.exceptions and horovod.run, not this one", name=fullname)
        package = fullname in BUILT and fullname not in LEAVES
        return importlib.machinery.ModuleSpec(fullname, _Loader(served), is_package=package)


def installed():
    """True when this process serves ``horovod`` from ringtrain."""
    return any(isinstance(finder, HorovodFinder) for finder in sys.meta_path)


def install():
    """Serve ``horovod`` from ringtrain in this process (idempotent).

    Raises:
        RuntimeError: a real ``horovod`` is already imported in this process;
            serving ringtrain beside it would mix the two.
    """
    if installed():
        return
    loaded = sys.modules.get("horovod")
    if loaded is not None and not isinstance(loaded.__spec__.loader if loaded.__spec__ else None, _Loader):
        raise RuntimeError("horovod is already imported in this process; serve it from ringtrain before "
                           "anything imports it (python -m ringtrain.horovod script.py)")
    sys.meta_path.insert(0, HorovodFinder())


def uninstall():
    """Stop serving ``horovod`` and forget the modules served so far (ringtrain's own stay loaded)."""
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, HorovodFinder)]
    for name in [n for n in sys.modules if n == "horovod" or n.startswith("horovod.")]:
        del sys.modules[name]
