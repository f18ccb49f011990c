"""Where arrays lie in one flat buffer: the address arithmetic every fast path shares.

Averaging a model's gradients is fastest when they already lie back to back
in one buffer: a bucket is then a slice, reduced in place, with no fusion
copy in and out, and a rank can update just its shard of the parameters.
This module holds the arithmetic that needs: :class:`FlatLayout`, which
element range of the flat buffers holds which parameter. It is pure: no MPI,
no model, no CuPy import. (Where arrays lie in memory, :func:`address` and
:func:`contiguous_span`, is the array backend's: :mod:`ringtrain.backend`.)

Models opt in to the layout by subclassing :class:`ringtrain.models.FlatModel`.
"""

import dataclasses

import numpy as np

__all__ = ["FlatLayout"]


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
