"""Row lookups into tables, and row-sparse gradients of them.

``jax.grad`` of a loss that reads ``table[ids]`` returns a dense ``N x dim``
gradient: XLA builds a zero table and scatter-adds the row cotangents into it,
every step. ``mj.value_and_grad(..., row_sparse=...)`` avoids that by
differentiating with respect to the *rows that were read* instead of the table:

1. a discovery run of ``fun`` with each selected table replaced by a recorder
   notes the ids of every lookup (under ``jit`` this run is dead code: only its
   ids are used, so XLA removes the rest);
2. the rows are gathered once, outside differentiation;
3. ``fun`` runs again with each table replaced by a :class:`RowSparseArray` of
   those rows, whose lookups hand back the gathered rows in the same order,
   and is differentiated with respect to them.

The gradient of a table is therefore a ``RowSparseArray`` of ``K = number of
ids read`` rows (duplicates not yet summed: the optimizers coalesce).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from masked_jax._core import MaskedArray, is_container, is_masked
from masked_jax._storage import SparseMasked
from masked_jax.layouts.rows import RowSparseArray, check_integer_indices, pad_indices


def _normalize_ids(ids, n: int):
    """Integer ids in ``[-n, n)`` with negatives wrapped as numpy does; every other id becomes ``n``
    (out of range: it reads zeros and gets no gradient), also below ``-n``."""
    if is_container(ids):
        raise TypeError("lookup ids must be a plain integer array, not a masked array.")
    ids = check_integer_indices(ids, "ids")
    wrapped = jnp.where(ids < 0, ids + n, ids)
    return jnp.where((wrapped >= 0) & (wrapped < n), wrapped, n).astype(jnp.int32)


def _read(table, ids):
    """``table[ids]`` with out-of-range ids reading zeros (and, in a gradient, receiving nothing)."""
    return jnp.take(table, ids, axis=0, mode="fill", fill_value=0)


def _not_an_array(self):
    raise TypeError(
        "a table differentiated with row_sparse=... can only be read through mj.lookup(table, ids) "
        "or table[ids] (integer ids); other uses would need its dense gradient. Leave it out of "
        "row_sparse to get a dense gradient instead."
    )


class _Recorder:
    """Stands in for a table during the discovery run: reads rows and records the ids."""

    def __init__(self, table):
        self.table = table
        self.ids = []

    shape = property(lambda self: self.table.shape)
    dtype = property(lambda self: self.table.dtype)
    ndim = property(lambda self: self.table.ndim)

    def _lookup(self, ids):
        ids = _normalize_ids(ids, self.shape[0])
        self.ids.append(ids)
        return _read(self.table, ids)

    __jax_array__ = _not_an_array


@jax.tree_util.register_pytree_node_class
class _LookupRows(RowSparseArray):
    """The rows a function read from a table, replayed to it in the order it read them."""

    __slots__ = ("segments", "_cursor")

    def tree_flatten(self):
        return (self.data, self.indices), (self.shape, self.segments)

    @classmethod
    def tree_unflatten(cls, aux, children):
        shape, segments = aux
        obj = super().tree_unflatten((shape, False), children)
        obj.segments, obj._cursor = segments, 0
        return obj

    def with_data(self, data):
        return _LookupRows.tree_unflatten((self.shape, self.segments), (data, self.indices))

    def as_row_sparse(self) -> RowSparseArray:
        return RowSparseArray._make(self.shape, self.data, self.indices, False)

    def _lookup(self, ids):
        ids = _normalize_ids(ids, self.shape[0])
        if self._cursor >= len(self.segments):
            raise ValueError(
                f"this table was read {len(self.segments)} times in the discovery run of the "
                "function but more often now: with row_sparse=..., the lookups must not depend on "
                "the values read."
            )
        if ids.shape != self.segments[self._cursor]:
            raise ValueError(
                f"lookup {self._cursor} of this table had ids of shape "
                f"{self.segments[self._cursor]} in the discovery run but {ids.shape} now."
            )
        start = sum(math.prod(s) for s in self.segments[: self._cursor])
        size = math.prod(ids.shape)
        self._cursor += 1
        rows = jax.lax.slice_in_dim(self.data, start, start + size, axis=0)
        return rows.reshape(ids.shape + self.shape[1:])

    __jax_array__ = _not_an_array


class Table:
    """What a function differentiated with ``row_sparse=...`` sees in place of a selected table.

    An opaque leaf, not a pytree node: trees that hold it still line up with trees that hold
    ``None`` or an array at the same place (``eqx.combine(params, static)``, ``optax``-style
    masks). It is read through :func:`lookup` or ``table[ids]`` only.
    """

    __slots__ = ("rows",)

    def __init__(self, rows: _LookupRows):
        self.rows = rows

    shape = property(lambda self: self.rows.shape)
    dtype = property(lambda self: self.rows.dtype)
    ndim = property(lambda self: self.rows.ndim)

    def _lookup(self, ids):
        return self.rows._lookup(ids)

    def __repr__(self):
        return f"Table({self.rows.dtype}{list(self.shape)}, rows read={self.rows.indices.shape[0]})"

    __jax_array__ = _not_an_array


def _getitem(self, key):
    if isinstance(key, tuple) or isinstance(key, slice) or key is None or key is Ellipsis:
        raise TypeError(
            f"a table differentiated with row_sparse=... can only be indexed by integer ids "
            f"(table[ids]); got {key!r}."
        )
    return self._lookup(key)


_Recorder.__getitem__ = _getitem
_LookupRows.__getitem__ = _getitem
Table.__getitem__ = _getitem


def lookup(table, ids):
    """Rows ``table[ids]`` of a table of shape (N, ...); shape ``ids.shape + table.shape[1:]``.

    Negative ids count from the end as in numpy; ids still out of range read zeros
    and get no gradient. On a plain array this is a gather. Inside a function
    differentiated by ``mj.grad`` / ``mj.value_and_grad`` with ``row_sparse=...``
    it is what makes the table's gradient a :class:`RowSparseArray` of the rows read,
    without a dense ``N x dim`` gradient ever being built. ``table[ids]`` does the same.

    Examples:
        >>> import jax.numpy as jnp, masked_jax as mj
        >>> table = jnp.arange(12.0).reshape(6, 2)
        >>> mj.lookup(table, jnp.array([5, 0]))
        Array([[10., 11.],
               [ 0.,  1.]], dtype=float32)
        >>> loss = lambda t, ids: jnp.sum(mj.lookup(t, ids) ** 2)
        >>> g = mj.grad(loss, row_sparse=True)(table, jnp.array([5, 0]))
        >>> g, g.indices
        (RowSparseArray(float32[6, 2], rows=2), Array([5, 0], dtype=int32))
    """
    if isinstance(table, (_Recorder, _LookupRows, Table)):
        return table._lookup(ids)
    if isinstance(table, SparseMasked):
        table = table.todense()
    if is_masked(table):
        ids = _normalize_ids(ids, table.shape[0])
        valid = (ids >= 0) & (ids < table.shape[0])
        mask = _read(table.mask, ids) & valid.reshape(ids.shape + (1,) * (table.ndim - 1))
        return MaskedArray._from_pair(_read(table.data, ids), mask)
    table = jnp.asarray(table)
    if table.ndim == 0:
        raise ValueError("lookup needs a table with at least one dimension (the rows).")
    return _read(table, _normalize_ids(ids, table.shape[0]))


def _flags(spec, arg):
    """Per-leaf bools from ``spec`` (True, a prefix tree of bools, or a callable on ``arg``)."""
    if callable(spec):
        spec = spec(arg)
    if isinstance(spec, bool):
        return jax.tree_util.tree_map(lambda _: spec, arg, is_leaf=is_container)
    try:
        return jax.tree_util.tree_map(
            lambda flag, sub: jax.tree_util.tree_map(lambda _: bool(flag), sub, is_leaf=is_container),
            spec, arg, is_leaf=is_container)
    except ValueError as err:
        raise ValueError(f"row_sparse must be a bool, a callable, or a prefix of the argument's "
                         f"pytree structure with bool leaves: {err}") from None


def substitute(fun, args, kwargs, nums, spec):
    """Return ``args`` with the selected tables replaced by the rows ``fun`` reads from them."""
    specs = spec if len(nums) > 1 and isinstance(spec, tuple) else (spec,) * len(nums)
    flat = {}  # argnum -> (leaves, treedef), the selected tables replaced by recorders
    for i, s in zip(nums, specs):
        flags = jax.tree_util.tree_leaves(_flags(s, args[i]))  # bools: one per container leaf
        leaves, treedef = jax.tree_util.tree_flatten(args[i], is_leaf=is_container)
        for j, (flag, leaf) in enumerate(zip(flags, leaves)):
            if flag:
                if not isinstance(leaf, (jax.Array, np.ndarray)) or np.ndim(leaf) == 0:
                    raise TypeError(f"row_sparse must select plain arrays of shape (N, ...) (the "
                                    f"tables); got {type(leaf).__name__} of shape {np.shape(leaf)}.")
                leaves[j] = _Recorder(jnp.asarray(leaf))
        flat[i] = (leaves, treedef)

    def with_leaves(replace):
        out = list(args)
        for i, (leaves, treedef) in flat.items():
            out[i] = jax.tree_util.tree_unflatten(treedef, [replace(x) for x in leaves])
        return out

    fun(*with_leaves(lambda x: x), **kwargs)  # the discovery run: the recorders note the ids

    def replay(x):
        if not isinstance(x, _Recorder):
            return x
        ids = jnp.concatenate([r.reshape(-1) for r in x.ids]) if x.ids else jnp.zeros((0,), jnp.int32)
        ids = pad_indices(ids, x.shape[0]) if ids.shape[0] == 1 else ids
        return _LookupRows.tree_unflatten((x.shape, tuple(r.shape for r in x.ids)), (_read(x.table, ids), ids))

    return with_leaves(replay)


def as_row_sparse(grads):
    """Gradients with every replayed table turned into a plain :class:`RowSparseArray`."""
    return jax.tree_util.tree_map(
        lambda g: g.as_row_sparse() if isinstance(g, _LookupRows) else g, grads,
        is_leaf=lambda g: isinstance(g, _LookupRows))


__all__ = ["lookup"]
