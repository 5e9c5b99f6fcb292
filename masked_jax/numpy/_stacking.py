"""Stacking and splitting: the ``*stack`` family, ``array_split`` and its axis variants,
``append``, ``broadcast_arrays``, ``unstack``.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from masked_jax._core import MaskedArray
from masked_jax.numpy._common import as_dense_masked, document, op


def broadcast_arrays(*arrays) -> list[MaskedArray]:
    """The arrays broadcast to one shape, masks with data.

    Examples:
        >>> import masked_jax.numpy as mnp
        >>> [a.shape for a in mnp.broadcast_arrays(mnp.zeros((2, 1)), mnp.zeros(3))]
        [(2, 3), (2, 3)]
    """
    shape = jnp.broadcast_shapes(*(np.shape(a) for a in arrays))
    return [op("broadcast_to")(as_dense_masked(a), shape) for a in arrays]


def unstack(x, /, *, axis: int = 0) -> tuple[MaskedArray, ...]:
    """The slices of ``x`` along ``axis``, masks with data.

    Examples:
        >>> import masked_jax.numpy as mnp
        >>> len(mnp.unstack(mnp.zeros((3, 2))))
        3
    """
    x = op("moveaxis")(as_dense_masked(x), axis, 0)
    return tuple(x[i] for i in range(x.shape[0]))


def _at_least(x, ndim):
    x = as_dense_masked(x)
    if x.ndim >= ndim:
        return x
    shape = {
        0: {1: (1,), 2: (1, 1), 3: (1, 1, 1)},
        1: {2: (1,) + x.shape, 3: (1,) + x.shape + (1,)},
        2: {3: x.shape + (1,)},
    }[x.ndim][ndim]
    return op("reshape")(x, shape)


def hstack(tup, *, dtype=None) -> MaskedArray:
    """Join along the second axis (the first for 1-d arrays), masks with data.

    Examples:
        >>> import masked_jax.numpy as mnp
        >>> mnp.hstack([mnp.zeros(2), mnp.ones(3)]).shape
        (5,)
    """
    arrs = [_at_least(t, 1) for t in tup]
    return op("concatenate")(arrs, axis=0 if arrs[0].ndim == 1 else 1, dtype=dtype)


def vstack(tup, *, dtype=None) -> MaskedArray:
    """Join along the first axis after making every array at least 2-d, masks with data.

    Examples:
        >>> import masked_jax.numpy as mnp
        >>> mnp.vstack([mnp.zeros(2), mnp.ones(2)]).shape
        (2, 2)
    """
    return op("concatenate")([_at_least(t, 2) for t in tup], axis=0, dtype=dtype)


def dstack(tup, *, dtype=None) -> MaskedArray:
    """Join along the third axis after making every array at least 3-d, masks with data.

    Examples:
        >>> import masked_jax.numpy as mnp
        >>> mnp.dstack([mnp.zeros(2), mnp.ones(2)]).shape
        (1, 2, 2)
    """
    return op("concatenate")([_at_least(t, 3) for t in tup], axis=2, dtype=dtype)


def column_stack(tup) -> MaskedArray:
    """1-d arrays as columns, 2-d arrays as they are, joined along the second axis.

    Examples:
        >>> import masked_jax.numpy as mnp
        >>> mnp.column_stack([mnp.zeros(3), mnp.ones(3)]).shape
        (3, 2)
    """
    cols = [op("reshape")(as_dense_masked(t), (-1, 1)) if np.ndim(t) < 2 else as_dense_masked(t) for t in tup]
    return op("concatenate")(cols, axis=1)


def array_split(ary, indices_or_sections, axis: int = 0) -> list[MaskedArray]:
    """``jax.numpy.array_split``: like ``split``, but the sections may differ in size by one.

    Examples:
        >>> import masked_jax.numpy as mnp
        >>> [p.shape for p in mnp.array_split(mnp.zeros(5), 2)]
        [(3,), (2,)]
    """
    x = as_dense_masked(ary)
    if isinstance(indices_or_sections, int):
        sections = indices_or_sections
        if sections <= 0:
            raise ValueError(f"array_split: the number of sections must be > 0; got {sections}.")
        each, extra = divmod(x.shape[axis], sections)
        sizes = [each + 1] * extra + [each] * (sections - extra)
        indices_or_sections = list(np.cumsum(sizes)[:-1])
    return list(op("split")(x, indices_or_sections, axis=axis))


def _split_along(axis_of, name):
    def split_fn(ary, indices_or_sections) -> list[MaskedArray]:
        x = as_dense_masked(ary)
        return list(op("split")(x, indices_or_sections, axis=axis_of(x)))

    return document(
        split_fn,
        name,
        f"``jax.numpy.{name}``: ``split`` along its axis, masks with data.",
        ">>> import masked_jax.numpy as mnp",
        f">>> len(mnp.{name}(mnp.zeros((2, 2, 2)), 2))",
        "2",
    )


hsplit = _split_along(lambda x: 1 if x.ndim > 1 else 0, "hsplit")

vsplit = _split_along(lambda x: 0, "vsplit")

dsplit = _split_along(lambda x: 2, "dsplit")


def append(arr, values, axis: int | None = None) -> MaskedArray:
    """``values`` joined to the end of ``arr`` (both flattened when ``axis`` is ``None``), masks with data.

    Examples:
        >>> import jax.numpy as jnp, masked_jax as mj, masked_jax.numpy as mnp
        >>> mnp.append(mj.masked_array(jnp.array([1.0, 2.0]), jnp.array([True, False])), 3.0)
        MaskedArray([1.0 -- 3.0], dtype=float32)
    """
    a, b = as_dense_masked(arr), as_dense_masked(values)
    if axis is None:
        a, b = op("ravel")(a), op("ravel")(b)
        axis = 0
    return op("concatenate")([a, b], axis=axis)


__all__ = [
    "broadcast_arrays",
    "unstack",
    "hstack",
    "vstack",
    "dstack",
    "column_stack",
    "array_split",
    "hsplit",
    "vsplit",
    "dsplit",
    "append",
]
