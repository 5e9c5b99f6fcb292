"""Set operations over the valid entries: the ``unique_*`` family, ``unique``, ``isin``. Their output
size depends on the data, so they need concrete inputs, as in ``jax.numpy``.
"""

from __future__ import annotations

import builtins
import operator
from typing import Any, NamedTuple, cast

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from masked_jax._core import MaskedArray, from_pair
from masked_jax.numpy._common import as_dense_masked
from masked_jax.ops._base import Pair


def valid_values(x):
    x = as_dense_masked(x)
    try:
        return np.asarray(x.data)[np.asarray(x.mask)], x
    except jax.errors.TracerArrayConversionError as err:
        raise TypeError(
            "this function's output size depends on the data: it needs concrete arrays, "
            "not traced ones (call it outside jit, as jax.numpy's)"
        ) from err


class UniqueAllResult(NamedTuple):
    values: MaskedArray
    indices: jax.Array
    inverse_indices: MaskedArray
    counts: jax.Array


class UniqueCountsResult(NamedTuple):
    values: MaskedArray
    counts: jax.Array


class UniqueInverseResult(NamedTuple):
    values: MaskedArray
    inverse_indices: MaskedArray


def unique_all(x, /) -> UniqueAllResult:
    """The distinct valid values (sorted), the flat index of each one's first occurrence, the
    inverse (masked where ``x`` is) and the counts. NaN values are distinct, as in the standard.

    Examples:
        >>> import jax.numpy as jnp, masked_jax as mj, masked_jax.numpy as mnp
        >>> x = mj.masked_array(jnp.array([3, 1, 3, 7]), jnp.array([True, True, True, False]))
        >>> r = mnp.unique_all(x)
        >>> r.values, r.indices.tolist(), r.counts.tolist()
        (MaskedArray([1 3], dtype=int32), [1, 0], [1, 2])
        >>> r.inverse_indices
        MaskedArray([1 0 1 --], dtype=int32)
    """
    return unique_of_valid(x, equal_nan=False)


def unique_of_valid(x, *, equal_nan: builtins.bool, index=True, inverse=True, counts=True) -> UniqueAllResult:
    """``jnp.unique`` of the valid entries alone (with ``equal_nan``), its indices and inverse
    mapped back to ``x``'s positions; the inverse is masked where ``x`` is. Only the parts asked
    for are computed (each is a separate compilation); the others are ``None``."""
    vals, x = valid_values(x)
    flat = np.flatnonzero(np.asarray(x.mask))
    out = jnp.unique(
        jnp.asarray(vals), return_index=index, return_inverse=inverse, return_counts=counts, equal_nan=equal_nan
    )
    out = list(out) if isinstance(out, (tuple, list)) else [out]
    values = out.pop(0)
    first = out.pop(0) if index else None
    inv = out.pop(0) if inverse else None
    count = out.pop(0) if counts else None
    if inv is not None:
        full_inverse = np.zeros(x.size, np.asarray(inv).dtype)
        full_inverse[flat] = np.asarray(inv).ravel()
        inv = from_pair(jnp.asarray(full_inverse.reshape(x.shape)), x.compact_mask)
    if first is not None:
        first = jnp.asarray(flat[np.asarray(first)], first.dtype)
    return UniqueAllResult(
        as_dense_masked(values), cast(Any, first), cast(Any, inv), cast(Any, count)
    )  # None: not asked for


def unique_counts(x, /) -> UniqueCountsResult:
    """The distinct valid values (sorted) and how often each occurs.

    Examples:
        >>> import jax.numpy as jnp, masked_jax as mj, masked_jax.numpy as mnp
        >>> r = mnp.unique_counts(mj.masked_array(jnp.array([2, 2, 5]), jnp.array([True, True, False])))
        >>> r.values, r.counts.tolist()
        (MaskedArray([2], dtype=int32), [2])
    """
    r = unique_of_valid(x, equal_nan=False, index=False, inverse=False)
    return UniqueCountsResult(r.values, r.counts)


def unique_inverse(x, /) -> UniqueInverseResult:
    """The distinct valid values (sorted) and, for each entry of ``x``, the index of its value
    (masked where ``x`` is masked).

    Examples:
        >>> import jax.numpy as jnp, masked_jax as mj, masked_jax.numpy as mnp
        >>> mnp.unique_inverse(mj.masked_array(jnp.array([5, 2, 5]), jnp.array([True, True, False]))).inverse_indices
        MaskedArray([1 0 --], dtype=int32)
    """
    r = unique_of_valid(x, equal_nan=False, index=False, counts=False)
    return UniqueInverseResult(r.values, r.inverse_indices)


def unique_values(x, /) -> MaskedArray:
    """The distinct valid values, sorted.

    Examples:
        >>> import jax.numpy as jnp, masked_jax as mj, masked_jax.numpy as mnp
        >>> mnp.unique_values(mj.masked_array(jnp.array([5, 2, 5, 9]), jnp.array([True, True, True, False])))
        MaskedArray([2 5], dtype=int32)
    """
    return unique_of_valid(x, equal_nan=False, index=False, inverse=False, counts=False).values


def isin(element, test_elements, invert: bool = False) -> MaskedArray:
    """Whether each valid entry of ``element`` equals a **valid** entry of ``test_elements``;
    masked where ``element`` is masked.

    Examples:
        >>> import jax.numpy as jnp, masked_jax as mj, masked_jax.numpy as mnp
        >>> tests = mj.masked_array(jnp.array([2, 5]), jnp.array([True, False]))
        >>> mnp.isin(mj.masked_array(jnp.array([2, 5, 9]), jnp.array([True, True, False])), tests)
        MaskedArray([True False --], dtype=bool)
    """
    e, t = as_dense_masked(element), as_dense_masked(test_elements)
    hit = jnp.any((e.data[..., None] == t.data.ravel()) & t.mask.ravel(), axis=-1)
    return from_pair(~hit if invert else hit, e.compact_mask)


def unique(
    ar,
    return_index: bool = False,
    return_inverse: bool = False,
    return_counts: bool = False,
    axis: int | None = None,
    *,
    equal_nan: bool = True,
    size: int | None = None,
    fill_value=None,
):
    """The sorted distinct valid values of ``ar`` (and, as in ``numpy.unique``, the first indices,
    the inverse and the counts, over the flattened array). Needs concrete arrays, unless ``size``
    is given.

    With ``size`` (``jax.numpy.unique``'s form for ``jit``), the result has ``size`` entries: the
    distinct valid values in order, then fill entries, as ``jnp.unique`` gives for the valid
    entries alone: ``fill_value``, or the smallest valid value where it is ``None``. The fill
    entries are valid (they are the result's own values, not padding); where ``ar`` has no valid
    entry and ``fill_value`` is ``None`` there is no value to fill with, and they are masked. The
    first indices (positions in ``ar``, flattened) are then a masked array too, valid where ``ar``
    has a valid entry; the counts of fill entries are 0.

    Examples:
        >>> import jax.numpy as jnp, masked_jax as mj, masked_jax.numpy as mnp
        >>> x = mj.masked_array(jnp.array([3, 1, 3, 8]), jnp.array([True, True, True, False]))
        >>> mnp.unique(x)
        MaskedArray([1 3], dtype=int32)
        >>> mnp.unique(x, size=4, fill_value=0)
        MaskedArray([1 3 0 0], dtype=int32)
    """
    if axis is not None:
        raise ValueError(
            "unique: axis= has no masked meaning (rows with masked entries are not values); pass axis=None"
        )
    if size is not None:
        x = as_dense_masked(ar)
        values, first, inverse, counts = sized_unique(
            x.data, x.compact_mask, size=size, fill_value=fill_value, equal_nan=equal_nan
        )
        extra = [from_pair(*first)] * return_index + [from_pair(*inverse)] * return_inverse
        extra += [counts.data] * return_counts
        return (from_pair(*values), *extra) if extra else from_pair(*values)
    r = unique_of_valid(ar, equal_nan=equal_nan, index=return_index, inverse=return_inverse, counts=return_counts)
    extra = [r.indices] * return_index + [r.inverse_indices] * return_inverse + [r.counts] * return_counts
    return (r.values, *extra) if extra else r.values


def sized_unique(data, mask, *, size: int, fill_value=None, equal_nan: builtins.bool = True):
    """``jnp.unique(data, size=size, fill_value=fill_value, equal_nan=equal_nan)`` over the valid
    entries of the flattened ``data`` (``mask``: broadcastable to it, ``None`` for all valid), as
    ``(values, first indices, inverse, counts)``, each a :class:`~masked_jax.ops._base.Pair` (see
    :func:`unique`; the inverse is masked where ``data`` is, the counts are always valid). Traceable:
    one sort with the masked entries last, then ``jnp.unique``'s own steps on the valid ones."""
    size = operator.index(size)
    shape = jnp.shape(data)
    flat = jnp.ravel(data)
    n = flat.shape[0]
    valid = jnp.ones((n,), bool) if mask is None else jnp.ravel(jnp.broadcast_to(mask, shape))
    if n == 0 and size and fill_value is None:
        raise ValueError("unique: for zero-sized input with nonzero size argument, fill_value must be specified")
    if jnp.issubdtype(flat.dtype, jnp.complexfloating):  # as jnp.unique: any NaN part is one NaN
        flat = jnp.where(jnp.isnan(flat), jnp.array(jnp.nan, flat.dtype), flat)
    index_dtype = jax.dtypes.canonicalize_dtype(int)
    masked_first, aux, order = lax.sort(
        (~valid, flat, lax.iota(index_dtype, n)), dimension=0, is_stable=True, num_keys=2
    )  # the valid entries first, sorted; then the masked ones
    if n:
        same = aux[1:] == aux[:-1]
        if equal_nan and jnp.issubdtype(flat.dtype, jnp.inexact):
            same = same | (jnp.isnan(aux[1:]) & jnp.isnan(aux[:-1]))
        first = ~masked_first & jnp.concatenate([jnp.ones((1,), bool), ~same])
    else:
        first = jnp.zeros((0,), bool)
    num, num_valid = jnp.sum(first), jnp.sum(valid)
    anything = jnp.reshape(num > 0, (1,))
    if n:
        ind = jnp.nonzero(first, size=size, fill_value=0)[0]
        values, starts = aux[ind], order[ind]
    else:
        values, starts = jnp.zeros((size,), flat.dtype), jnp.zeros((size,), index_dtype)
    if fill_value is not None:
        fill = jnp.asarray(fill_value).astype(values.dtype)
        values = jnp.where(jnp.arange(size) < num, values, fill)
    values_valid = jnp.ones((1,), bool) if fill_value is not None else anything
    rank = jnp.cumsum(first, dtype=index_dtype) - 1
    inverse = jnp.zeros((n,), index_dtype).at[order].set(rank).reshape(shape)
    idx = jnp.nonzero(first, size=size + 1, fill_value=0)[0] if n else jnp.zeros((size + 1,), index_dtype)
    idx = idx.at[1:].set(jnp.where(idx[1:], idx[1:], num_valid))
    counts = jnp.diff(idx).astype(index_dtype)
    return (
        Pair(values, values_valid),
        Pair(starts.astype(index_dtype), anything),
        Pair(inverse, mask),
        Pair(counts, None),
    )


__all__ = ["unique_all", "unique_counts", "unique_inverse", "unique_values", "isin", "unique"]
