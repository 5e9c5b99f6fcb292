"""Ops on sparse layouts: keep sparse storage where the op allows it, else densify with a warning.

The sparse rules do not re-implement any op. A layout exposes its stored
values as a dense masked *block* (``block()``: (K, ...) rows, or BCOO's
(batch..., nse, dense...) values, padding masked), and the op's ordinary rule
from :mod:`masked_jax.ops` runs on that block. Cost is O(stored entries):

* unary elementwise ops, and binary ops with a scalar: on the block, same indices;
* row-sparse: binary ops with a dense array (rows gathered), with another
  row-sparse array (same or different rows: the result keeps the rows both have);
  reductions (across rows → dense result; within rows → row-sparse); softmax
  family along any axis; ``matmul``/``dot`` with a dense right operand;
* BCOO: binary ops with another BCOO of the same layout (same or different entries: the result
  keeps the entries both have; batch dimensions mapped over); reductions, whole or along axes,
  and the softmax family along an axis (by segments of entries, :mod:`.segments`);
  ``matmul``/``dot`` with a dense right operand.

Everything else densifies the sparse operands (warning once per op, or
``StorageFallbackError`` under :func:`strict_storage`) and runs the dense rule.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from masked_jax._core import MaskedArray, _unwrap, _wrap, is_container
from masked_jax._storage import SparseMasked, fallback
from masked_jax.layouts.bcoo import BCOOMaskedArray
from masked_jax.layouts import segments
from masked_jax.layouts.rows import RowSparseArray
from masked_jax.ops._base import Pair, normalize_axis

# Their result along the stored axis would index the block, not the array.
_ROW_REDUCE_ALONG_ROWS_UNSUPPORTED = {"argmax", "argmin", "cumsum", "cumprod", "count"}


def is_sparse(x) -> bool:
    return isinstance(x, SparseMasked)


def _is_scalar(x) -> bool:
    return not is_container(x) and np.ndim(x) == 0


def apply(name: str, family: str, rule, operands, args, kwargs, dense_call):
    """Run op ``name`` on ``operands`` (some sparse); ``dense_call`` is the dense-storage path."""
    out = _sparse_rule(name, family, rule, operands, args, kwargs)
    if out is not NotImplemented:
        return out
    return dense_call(*densify(operands, name), *args, **kwargs)


def densify(values, name: str):
    """``values`` with every sparse operand (also inside lists/tuples) converted to dense storage,
    through the storage fallback (warns once per op ``name``, raises under strict storage)."""
    def one(v):
        if is_sparse(v):
            fallback(name, v.storage)
            return v.todense()
        if isinstance(v, (list, tuple)):
            return type(v)(one(x) for x in v)
        return v

    return [one(v) for v in values]


def _sparse_rule(name, family, rule, operands, args, kwargs):
    first = operands[0]
    if family == "elementwise" and len(operands) == 1:
        x = first.coalesce()
        return x.with_data(rule(x.block(), *args, **kwargs).data)
    if family == "binary" and len(operands) == 2 and not args:
        return _binary(rule, operands, kwargs)
    if family in ("reductions", "normalization") and len(operands) == 1 and is_sparse(first):
        return _reduce(name, family, rule, first, args, kwargs)
    if family == "linalg" and name in ("matmul", "dot") and len(operands) == 2 and is_sparse(first) \
            and not is_sparse(operands[1]) and not isinstance(operands[1], MaskedArray) and not args:
        return _matmul_dense(first, jnp.asarray(operands[1]))
    return NotImplemented


def _binary(rule, operands, kwargs):
    a, b = operands
    if is_sparse(a) and _is_scalar(b):
        x = a.coalesce()
        return x.with_data(rule(x.block(), _unwrap(b), **kwargs).data)
    if is_sparse(b) and _is_scalar(a):
        x = b.coalesce()
        return x.with_data(rule(_unwrap(a), x.block(), **kwargs).data)
    if isinstance(a, RowSparseArray) and isinstance(b, RowSparseArray) and a.shape == b.shape:
        return _rows_intersect(rule, a, b, kwargs)
    if isinstance(a, BCOOMaskedArray) and isinstance(b, BCOOMaskedArray) and a.shape == b.shape \
            and a.n_batch == b.n_batch and a.n_dense == b.n_dense:
        return _bcoo_intersect(rule, a, b, kwargs)
    for pos, (x, other) in enumerate(((a, b), (b, a))):
        if isinstance(x, RowSparseArray) and not is_sparse(other) and not isinstance(other, MaskedArray):
            other = jnp.asarray(other)
            x = x.coalesce()
            if np.ndim(other) == x.ndim and other.shape[0] == x.shape[0] and x.shape[0] != 1:
                other = jnp.take(other, x.indices, axis=0, mode="fill", fill_value=0)
            elif np.broadcast_shapes(other.shape, x.shape) != x.shape:
                return NotImplemented
            pair = (x.block(), Pair(other, None)) if pos == 0 else (Pair(other, None), x.block())
            return x.with_data(rule(*pair, **kwargs).data)
    return NotImplemented


def _rows_intersect(rule, a, b, kwargs):
    """Row-sparse ∘ row-sparse: valid on rows both store; K of ``a``, rows only in ``a`` become padding."""
    a, b = a.coalesce(), b.coalesce()
    n = a.shape[0]
    pos = jnp.clip(segments.sorted_search(b.indices, a.indices), 0, max(b.nse - 1, 0))
    if b.nse == 0:
        return RowSparseArray._make(a.shape, a.data, jnp.full_like(a.indices, n), True)
    hit = (b.indices[pos] == a.indices) & (a.indices < n)
    out = rule(a.block(), Pair(b.data[pos], None), **kwargs).data
    return RowSparseArray._make(a.shape, out, jnp.where(hit, a.indices, n), True)


def _bcoo_intersect(rule, a, b, kwargs):
    """BCOO ∘ BCOO: valid on entries both store; ``a``'s nse, its entries missing from ``b`` become
    padding. Sparse coordinates are compared as linear indices (O(nse log nse)); batch dimensions
    are mapped over, one batch element at a time."""
    if a.n_batch:
        batch = a.shape[:1]

        def unbatch(x):  # leading batch dim as a vmapped axis (BCOO may broadcast size-1 batches)
            leaves = [jnp.broadcast_to(v, batch + v.shape[1:]) for v in (x.data, x.indices)]
            return BCOOMaskedArray.tree_unflatten(x.shape[1:], leaves)

        out = jax.vmap(lambda u, v: _bcoo_intersect(rule, u, v, kwargs))(unbatch(a), unbatch(b))
        return BCOOMaskedArray.tree_unflatten(a.shape, (out.data, out.indices))
    a, b = a.coalesce(), b.coalesce()
    sparse_shape = a.shape[:a.n_sparse]

    def linear(x):
        lin = jnp.ravel_multi_index(tuple(x.indices.T), sparse_shape, mode="clip")
        return jnp.where(x.entry_valid(), lin, -1)

    lin_a, lin_b = linear(a), linear(b)
    padding = jnp.array(sparse_shape, a.indices.dtype)  # one past the end in every sparse dim
    if b.nse == 0 or a.nse == 0:
        return BCOOMaskedArray.tree_unflatten(a.shape, (a.data, jnp.broadcast_to(padding, a.indices.shape)))
    order = jnp.argsort(lin_b)
    pos = jnp.clip(segments.sorted_search(lin_b[order], lin_a), 0, b.nse - 1)
    partner = order[pos]
    hit = (lin_b[partner] == lin_a) & (lin_a >= 0)
    out = rule(a.block(), Pair(b.data[partner], None), **kwargs).data
    return BCOOMaskedArray.tree_unflatten(a.shape, (out, jnp.where(hit[:, None], a.indices, padding)))


def _reduce(name, family, rule, x, args, kwargs):
    quantile = name in ("quantile", "percentile")
    if args and not (quantile and len(args) == 1 and np.ndim(args[0]) == 0):
        return NotImplemented  # axis given positionally or an array of quantiles: dense path
    if isinstance(x, RowSparseArray):
        x = x.coalesce()
        if family == "normalization":
            return x.with_data(rule(x.block(), *args, **kwargs).data)
        if kwargs.get("axis") is None and name in ("cumsum", "cumprod"):
            return NotImplemented
        if 0 in normalize_axis(kwargs.get("axis"), x.ndim):  # across rows: a dense result
            if name in _ROW_REDUCE_ALONG_ROWS_UNSUPPORTED:
                return NotImplemented
            return _wrap(rule(x.block(), *args, **kwargs))
        if name == "count":
            return NotImplemented
        return x.with_data(rule(x.block(), *args, **kwargs).data)  # within rows: still row-sparse
    if family == "normalization":
        return segments.normalize_along(name, x, **kwargs)
    if kwargs.get("axis") is None and not kwargs.get("keepdims"):  # whole array: a dense scalar
        if name in _ROW_REDUCE_ALONG_ROWS_UNSUPPORTED:
            return NotImplemented
        return _wrap(rule(x.coalesce().block(), *args, **kwargs))
    return NotImplemented if args else segments.reduce(name, x, **kwargs)


def _matmul_dense(x, w):
    if w.ndim != 2 or x.ndim != 2 or x.shape[1] != w.shape[0]:
        return NotImplemented
    if isinstance(x, RowSparseArray):
        x = x.coalesce()
        return x.with_data(x.data @ w)  # each valid row: a full row of products
    x = x.flatten_dense()  # BCOO cannot contract over hybrid dense dimensions
    data = x.to_bcoo() @ w
    counts = x.with_data(jnp.ones(x.data.shape, w.dtype)).to_bcoo() @ jnp.ones(w.shape, w.dtype)
    return MaskedArray._from_pair(data, counts > 0)

