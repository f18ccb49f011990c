"""Where arrays lie in one flat buffer: the address arithmetic every fast path shares.

Averaging a model's gradients is fastest when they already lie back to back
in one buffer: a bucket is then a slice, reduced in place, with no fusion
copy in and out, and a rank can update just its shard of the parameters.
This module holds the two pieces of arithmetic that need: :class:`FlatLayout`
(which element range of the flat buffers holds which parameter) and
:func:`contiguous_span` (a 1-D view over arrays that tile one allocation, or
None). Both are pure: no MPI, no model, no CuPy import.

Models opt in to the layout by subclassing :class:`ringtrain.models.FlatModel`.
"""

import dataclasses

import numpy as np

__all__ = ["FlatLayout", "contiguous_span", "address"]


def address(a):
    """The data address of a NumPy or CuPy array (CuPy through ``__cuda_array_interface__``)."""
    interface = getattr(a, "__cuda_array_interface__", None) or a.__array_interface__
    return interface["data"][0]


@dataclasses.dataclass(frozen=True)
class FlatLayout:
    """Which element range of a model's flat buffers holds which parameter.

    Attributes:
        order: parameter names in buffer order (the order backward finishes them).
        bounds: name -> ``(start, stop)`` element offsets into the flat buffers.
        size: elements in each flat buffer.
    """

    order: tuple
    bounds: dict
    size: int

    @classmethod
    def from_shapes(cls, shapes, order):
        """The layout of ``shapes`` (name -> shape) laid out back to back in ``order`` (pure)."""
        bounds, offset = {}, 0
        for name in order:
            n = int(np.prod(shapes[name], dtype=np.int64))
            bounds[name] = (offset, offset + n)
            offset += n
        return cls(tuple(order), bounds, offset)

    def views(self, flat, shapes):
        """name -> view of ``flat`` shaped as ``shapes[name]``, in the order of ``shapes``."""
        return {name: flat[slice(*self.bounds[name])].reshape(shapes[name]) for name in shapes}

    def cut(self, groups):
        """``(start, stop)`` element ranges, one per group of consecutive names (buckets)."""
        return [(self.bounds[g[0]][0], self.bounds[g[-1]][1]) for g in groups]


def contiguous_span(arrays, within=None):
    """A 1-D view over ``arrays`` when they tile one allocation back to back, else None.

    The arrays must be C-contiguous, of one dtype, each starting where the
    previous one ends, all inside one writeable base array: ``within`` if
    given (a 1-D array over the whole allocation, e.g. a torch storage),
    else the base of the first array. Being adjacent is not enough: two
    separate allocations can sit side by side, so the whole span must lie
    inside that one base.
    """
    kind = np.ndarray if within is None else type(within)  # CuPy arrays, over a torch CUDA storage
    if not arrays or any(type(a) is not kind for a in arrays):
        return None
    first = arrays[0]
    base = within
    if base is None:
        base = first
        while isinstance(base.base, np.ndarray):
            base = base.base
    if not (base.flags.c_contiguous and getattr(base.flags, "writeable", True)):
        return None
    start = end = address(first)
    for a in arrays:
        if not a.flags.c_contiguous or a.dtype != first.dtype or address(a) != end:
            return None
        end += a.nbytes
    lo, hi = start - address(base), end - address(base)
    if lo < 0 or hi > base.nbytes:
        return None
    return base.reshape(-1).view(np.uint8)[lo:hi].view(first.dtype)
