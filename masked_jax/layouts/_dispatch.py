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

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from masked_jax._core import STATE, MaskedArray, SparseMasked, from_pair, is_masked_leaf, unwrap, wrap
from masked_jax.layouts import _segments as segments
from masked_jax.layouts._bcoo import BCOOMaskedArray
from masked_jax.layouts._rows import RowSparseArray, rows_from_parts, take_rows
from masked_jax.ops._base import Pair, normalize_axis

# Their result along the stored axis would index the block, not the array.
_ROW_REDUCE_ALONG_ROWS_UNSUPPORTED = {"argmax", "argmin", "cumsum", "cumprod", "count"}


def is_sparse(x) -> bool:
    return isinstance(x, SparseMasked)


def _is_scalar(x) -> bool:
    return not is_masked_leaf(x) and np.ndim(x) == 0


def apply(spec, operands, params, dense):
    """Run op ``spec`` on ``operands`` (some sparse) by the first sparse operand's layout rule table;
    ``dense(operands, params)`` is the dense-storage path (densifying through the storage fallback)."""
    if spec.returns == "pair":  # divmod, modf, frexp: each part by the layout's rule for one result
        return tuple(apply(_part(spec, i), operands, params, lambda o, p, i=i: dense(o, p)[i]) for i in range(2))
    layout = type(next(o for o in operands if is_sparse(o)))
    rule = layout.rules.get(spec.family)
    out = NotImplemented if rule is None else rule(spec, operands, params)
    if out is not NotImplemented:
        return out
    return dense(operands, params)


def _part(spec, i):
    """``spec`` with result ``i`` of its pair of results as its one result."""
    return dataclasses.replace(spec, rule=lambda *args, **kwargs: spec.rule(*args, **kwargs)[i], returns="masked")


def densify(values, name: str):
    """``values`` with every sparse operand (also inside lists/tuples) converted to dense storage,
    through the storage fallback (warns once per op ``name``, raises under strict storage)."""

    def one(v):
        if is_sparse(v):
            STATE.fallback(name, v.storage)
            return v.todense()
        if isinstance(v, (list, tuple)):
            return type(v)(one(x) for x in v)
        return v

    return [one(v) for v in values]


# -- rules shared by the layouts -------------------------------------------------------------------
def on_block(spec, operands, params):
    """Unary elementwise ops: the op's rule on the stored block, same indices."""
    if len(operands) != 1:
        return NotImplemented
    x = operands[0].coalesce()
    return x.with_data(spec.rule(x.block(), **params).data)


def _binary_with_scalar(spec, operands, params):
    a, b = operands
    if is_sparse(a) and _is_scalar(b):
        x = a.coalesce()
        return x.with_data(spec.rule(x.block(), unwrap(b), **params).data)
    if is_sparse(b) and _is_scalar(a):
        x = b.coalesce()
        return x.with_data(spec.rule(unwrap(a), x.block(), **params).data)
    return NotImplemented


def _binary_rule(intersect, compatible, with_dense=None):
    """A layout's binary rule: with a scalar on the stored block; with an operand of the same layout
    (``compatible``) by ``intersect``; with a dense array by ``with_dense`` where the layout has one."""

    def rule(spec, operands, params):
        if len(operands) != 2 or spec.name in ("where", "clip"):
            return NotImplemented
        out = _binary_with_scalar(spec, operands, params)
        if out is not NotImplemented:
            return out
        a, b = operands
        if compatible(a, b):
            return intersect(spec.rule, a, b, params)
        return NotImplemented if with_dense is None else with_dense(spec, a, b, params)

    return rule


def _rows_with_dense(spec, a, b, params):
    """Row-sparse ∘ dense array: the dense rows at the stored indices are gathered."""
    for pos, (x, other) in enumerate(((a, b), (b, a))):
        if isinstance(x, RowSparseArray) and not is_sparse(other) and not isinstance(other, MaskedArray):
            other = jnp.asarray(other)
            x = x.coalesce()
            if np.ndim(other) == x.ndim and other.shape[0] == x.shape[0] and x.shape[0] != 1:
                other = take_rows(other, x.clean_indices())
            elif np.broadcast_shapes(other.shape, x.shape) != x.shape:
                return NotImplemented
            pair = (x.block(), Pair(other, None)) if pos == 0 else (Pair(other, None), x.block())
            return x.with_data(spec.rule(*pair, **params).data)
    return NotImplemented


def _rows_intersect(rule, a, b, kwargs):
    """Row-sparse ∘ row-sparse: valid on rows both store; K of ``a``, rows only in ``a`` become padding."""
    promised = b.unique_indices  # indices promised unique to row_sparse come in any order;
    a, b = a.coalesce(), b.coalesce()  # coalescing sorts the others
    n = a.shape[0]
    if b.nse == 0:
        return rows_from_parts(a.shape, a.data, jnp.full_like(a.indices, n), True)
    order = jnp.argsort(b.indices) if promised else jnp.arange(b.nse)
    pos = order[jnp.clip(segments.sorted_search(b.indices[order], a.indices), 0, b.nse - 1)]
    hit = (b.indices[pos] == a.indices) & (a.indices < n)
    hit_rows = hit.reshape((-1,) + (1,) * (a.ndim - 1))
    # Rows a stores and b does not are padding of the result: masked in both operands' blocks, so
    # no value of b's (or a's) reaches them, nor does a gradient come back through them.
    left = Pair(a.data, a.block().mask & hit_rows)
    right = Pair(b.clean_data()[pos], jnp.broadcast_to(hit_rows, a.data.shape))
    out = rule(left, right, **kwargs).data
    return rows_from_parts(a.shape, out, jnp.where(hit, a.indices, n), True)


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
    sparse_shape = a.shape[: a.n_sparse]

    # ids of both operands' index tuples, from one numbering (padding -1)
    valid = jnp.concatenate([a.entry_valid(), b.entry_valid()])
    ids, _, _ = segments.tuple_ids(jnp.concatenate([a.indices, b.indices]), sparse_shape, valid)
    ids = jnp.where(valid, ids, -1)
    lin_a, lin_b = ids[: a.nse], ids[a.nse :]
    padding = jnp.array(sparse_shape, a.indices.dtype)  # one past the end in every sparse dim
    if b.nse == 0 or a.nse == 0:
        return BCOOMaskedArray.tree_unflatten(a.shape, (a.data, jnp.broadcast_to(padding, a.indices.shape)))
    order = jnp.argsort(lin_b)
    pos = jnp.clip(segments.sorted_search(lin_b[order], lin_a), 0, b.nse - 1)
    partner = order[pos]
    hit = (lin_b[partner] == lin_a) & (lin_a >= 0)
    hit_b = jnp.broadcast_to(hit.reshape(hit.shape + (1,) * a.n_dense), a.data.shape)
    # Entries a stores and b does not become padding: masked on both sides (exact zero gradients).
    out = rule(Pair(a.data, a.block().mask & hit_b), Pair(b.clean_data()[partner], hit_b), **kwargs).data
    return BCOOMaskedArray.tree_unflatten(a.shape, (out, jnp.where(hit[:, None], a.indices, padding)))


def rows_reduce(spec, operands, params):
    """Row-sparse reductions and normalizations: across rows a dense result, within rows (or a
    normalization) still row-sparse."""
    x = operands[0]
    if len(operands) != 1 or not isinstance(x, RowSparseArray) or spec.optional_operands or not _along_axes(spec):
        return NotImplemented
    x = x.coalesce()
    if spec.family == "normalization":
        return x.with_data(spec.rule(x.block(), **params).data)
    if params.get("axis") is None and spec.name in ("cumsum", "cumprod") or _matrix_norm(spec, params, x.ndim):
        return NotImplemented
    if 0 in normalize_axis(params.get("axis"), x.ndim):  # across rows: a dense result
        if spec.name in _ROW_REDUCE_ALONG_ROWS_UNSUPPORTED:
            return NotImplemented
        return wrap(spec.rule(x.block(), **params))
    if spec.name == "count":
        return NotImplemented
    return x.with_data(spec.rule(x.block(), **params).data)  # within rows: still row-sparse


def bcoo_reduce(spec, operands, params):
    """BCOO reductions: a whole-array reduction on the stored block; along axes by segments of
    entries (the op's segment kernel), keeping BCOO storage."""
    x = operands[0]
    if len(operands) != 1 or not isinstance(x, BCOOMaskedArray) or spec.optional_operands or not _along_axes(spec):
        return NotImplemented
    if spec.family == "normalization":
        if spec.segment is None:
            return NotImplemented
        return segments.normalize_along(spec, x, **params)
    if _matrix_norm(spec, params, x.ndim):
        return NotImplemented
    if params.get("axis") is None and not params.get("keepdims"):  # whole array: a dense scalar
        if spec.name in _ROW_REDUCE_ALONG_ROWS_UNSUPPORTED:
            return NotImplemented
        return wrap(spec.rule(x.coalesce().block(), **params))
    if spec.segment is None:
        return NotImplemented
    return segments.reduce(spec, x, **params)


def _along_axes(spec):
    """A reduction along ``axis`` (not one that combines whole rows or columns, as cov does)."""
    return "axis" in spec.signature.parameters


def _matrix_norm(spec, params, ndim):
    """A matrix norm (two axes, or a 2-D array with ``ord`` and no axis): it mixes rows and
    columns, so it runs on the dense layout, never on the stored block."""
    if spec.name != "norm":
        return False
    axis = params.get("axis")
    if axis is None:
        return params.get("ord") is not None and ndim == 2
    return isinstance(axis, (tuple, list)) and len(axis) == 2


def bcoo_permute(spec, operands, params):
    """``transpose``, ``swapaxes`` and ``moveaxis`` of a BCOO-backed array: its stored entries'
    indices permuted (``jax.experimental.sparse.bcoo_transpose``), as the ``.transpose`` method
    does. Hybrid dense dimensions are made sparse first; batch dimensions must stay in front
    (BCOO's rule), else the dense path."""
    if len(operands) != 1 or not isinstance(operands[0], BCOOMaskedArray):
        return NotImplemented
    x = operands[0]
    perm = _permutation(spec.name, params, x.ndim)
    if perm is None:
        return NotImplemented
    x = x.flatten_dense()
    if tuple(perm[: x.n_batch]) != tuple(range(x.n_batch)):
        return NotImplemented
    return x.transpose(perm)


def _permutation(name, params, ndim):
    """The axis permutation a shape op ``name`` with ``params`` makes, or ``None`` for another op."""
    order = np.arange(ndim)
    if name == "transpose":
        axes = params.get("axes")
        return tuple(order[::-1]) if axes is None else tuple(int(a) % ndim for a in axes)
    if name == "swapaxes":
        i, j = int(params["axis1"]) % ndim, int(params["axis2"]) % ndim
        order[[i, j]] = order[[j, i]]
        return tuple(int(a) for a in order)
    if name == "moveaxis":  # numpy's construction: the other axes in order, the moved ones inserted
        source = [int(a) % ndim for a in np.atleast_1d(params["source"])]
        destination = [int(a) % ndim for a in np.atleast_1d(params["destination"])]
        rest = [a for a in range(ndim) if a not in source]
        for d, a in sorted(zip(destination, source)):
            rest.insert(d, a)
        return tuple(rest)
    return None


def matmul_dense(spec, operands, params):
    if spec.name not in ("matmul", "dot") or len(operands) != 2 or params:
        return NotImplemented
    x, w = operands
    if not is_sparse(x) or is_sparse(w) or isinstance(w, MaskedArray):
        return NotImplemented
    return _matmul_dense(x, jnp.asarray(w))


def _matmul_dense(x, w):
    if w.ndim != 2 or x.ndim != 2 or x.shape[1] != w.shape[0]:
        return NotImplemented
    if isinstance(x, RowSparseArray):
        x = x.coalesce()
        return x.with_data(x.clean_data() @ w)  # each valid row: a full row of products
    x = x.flatten_dense()  # BCOO cannot contract over hybrid dense dimensions
    data = x.to_bcoo() @ w
    counts = x.with_data(jnp.ones(x.data.shape, w.dtype)).to_bcoo() @ jnp.ones(w.shape, w.dtype)
    return from_pair(data, counts > 0)


RowSparseArray.rules = {
    "elementwise": on_block,
    "reductions": rows_reduce,
    "normalization": rows_reduce,
    "linalg": matmul_dense,
    "binary": _binary_rule(
        _rows_intersect,
        lambda a, b: isinstance(a, RowSparseArray) and isinstance(b, RowSparseArray) and a.shape == b.shape,
        _rows_with_dense,
    ),
}
BCOOMaskedArray.rules = {
    "elementwise": on_block,
    "shape": bcoo_permute,
    "reductions": bcoo_reduce,
    "normalization": bcoo_reduce,
    "linalg": matmul_dense,
    "binary": _binary_rule(
        _bcoo_intersect,
        lambda a, b: (
            isinstance(a, BCOOMaskedArray)
            and isinstance(b, BCOOMaskedArray)
            and (a.shape, a.n_batch, a.n_dense) == (b.shape, b.n_batch, b.n_dense)
        ),
    ),
}
