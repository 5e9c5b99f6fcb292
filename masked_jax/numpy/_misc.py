"""``shape``, ``ndim`` and ``size`` of any array, masked or not."""

from __future__ import annotations

import math

import numpy as np

from masked_jax.ops._base import normalize_axis


def shape(a) -> tuple[int, ...]:
    """The shape (``jax.numpy.shape``).

    Examples:
        >>> import masked_jax.numpy as mnp
        >>> mnp.shape(mnp.zeros((2, 3)))
        (2, 3)
    """
    return tuple(a.shape) if hasattr(a, "shape") else np.shape(a)


def ndim(a) -> int:
    """The number of dimensions (``jax.numpy.ndim``).

    Examples:
        >>> import masked_jax.numpy as mnp
        >>> mnp.ndim(mnp.zeros((2, 3)))
        2
    """
    return len(shape(a))


def size(a, axis: int | None = None) -> int:
    """The number of elements, or the length of ``axis`` (``jax.numpy.size``).

    Examples:
        >>> import masked_jax.numpy as mnp
        >>> mnp.size(mnp.zeros((2, 3))), mnp.size(mnp.zeros((2, 3)), 1)
        (6, 3)
    """
    dims = shape(a)
    return math.prod(dims) if axis is None else dims[normalize_axis(axis, len(dims))[0]]


__all__ = ["shape", "ndim", "size"]
