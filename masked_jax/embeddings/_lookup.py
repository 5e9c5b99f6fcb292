"""``mj.lookup``: rows of a table by id, padding ids (out of range) reading zeros, as
``jnp.take(..., mode="fill")`` does, with ids of any integer dtype.
"""

from __future__ import annotations

from typing import cast

import jax.numpy as jnp

from masked_jax._core import MaskedArray, SparseMasked, from_pair, is_masked, is_masked_leaf
from masked_jax.layouts import check_integer_indices, take_rows


def _normalize_ids(ids, n: int):
    """Integer ids in ``[-n, n)`` with negatives wrapped as numpy does; every other id becomes ``n``
    (out of range: it reads zeros and gets no gradient), also below ``-n``."""
    ids = check_integer_indices(ids, "ids")
    wrapped = jnp.where(ids < 0, ids + n, ids)
    return jnp.where((wrapped >= 0) & (wrapped < n), wrapped, n).astype(jnp.int32)


def _read(table, ids):
    """``table[ids]`` with out-of-range ids reading zeros (and, in a gradient, receiving nothing)."""
    return take_rows(table, ids)


def lookup(table, ids):
    """Rows ``table[ids]`` of a table of shape (N, ...); shape ``ids.shape + table.shape[1:]``.

    Negative ids count from the end as in numpy; ids still out of range read zeros
    and get no gradient. Masked ids (a ``MaskedArray``) read nothing: their rows are
    masked and get no gradient. On a plain array this is a gather. Inside a function
    differentiated by ``mj.grad`` / ``mj.value_and_grad`` with ``row_sparse=...``,
    the table's gradient is a :class:`RowSparseArray` of the rows read, without a dense
    ``N x dim`` gradient ever being built; ``table[ids]`` and ``jnp.take(table, ids,
    axis=0)`` do the same there.

    Examples:
        >>> import jax.numpy as jnp, masked_jax as mj
        >>> table = jnp.arange(12.0).reshape(6, 2)
        >>> mj.lookup(table, jnp.array([5, 0]))
        Array([[10., 11.],
               [ 0.,  1.]], dtype=float32)
        >>> mj.lookup(table, mj.masked_array(jnp.array([5, 0]), jnp.array([True, False])))
        MaskedArray([[10.0 11.0]
                     [-- --]], dtype=float32)
        >>> loss = lambda t, ids: jnp.sum(mj.lookup(t, ids) ** 2)
        >>> g = mj.grad(loss, row_sparse=True)(table, jnp.array([5, 0]))
        >>> g, g.indices
        (RowSparseArray(float32[6, 2], rows=2), Array([5, 0], dtype=int32))
    """
    if isinstance(table, SparseMasked):
        table = table.todense()
    if not is_masked(table):
        table = jnp.asarray(table)
    if table.ndim == 0:
        raise ValueError("lookup needs a table with at least one dimension (the rows).")
    n, trailing = table.shape[0], (1,) * (table.ndim - 1)
    id_mask = None
    if is_masked_leaf(ids):
        ids = ids.todense() if isinstance(ids, SparseMasked) else ids
        id_mask = ids.mask
        ids = ids.data
    ids = _normalize_ids(ids, n)
    if id_mask is not None:
        ids = jnp.where(id_mask, ids, n)  # a masked id reads nothing: a masked row, no gradient
    if not is_masked(table):
        rows = _read(table, ids)
        if id_mask is None:
            return rows
        # a masked id read row n: zeros, with no gradient
        return from_pair(rows, id_mask.reshape(ids.shape + trailing), zeroed=True)
    table = cast(MaskedArray, table)
    mask = _read(table.mask, ids) & (ids < n).reshape(ids.shape + trailing)
    return from_pair(_read(table.data, ids), mask)


__all__ = ["lookup"]
