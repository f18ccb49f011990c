"""Forwarding names lazily, so the package imports before every ringtrain.torch module exists."""

import importlib

__all__ = ["forward_missing"]


def forward_missing(modules, name):
    """A module ``__getattr__`` that looks ``attr`` up in ``modules`` (imported on first use), in order."""

    def __getattr__(attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        for module in modules:
            try:
                found = importlib.import_module(module)
            except ImportError:
                continue
            if hasattr(found, attr):
                return getattr(found, attr)
        raise AttributeError(f"module {name!r} has no attribute {attr!r} (ringtrain.torch does not provide it)")

    return __getattr__
