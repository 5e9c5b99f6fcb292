"""Several embedding tables stacked into one array: one gather, one row-sparse gradient, one
optimizer step for all of them (FBGEMM's table-batched embeddings, SparseCore's table stacking).

The tables' rows are concatenated into one ``(sum of N_t, ...)`` array; table ``t`` starts at row
``offsets[t]``. Lookups and bags for several tables shift each table's ids by its offset and read
all rows with one :func:`~masked_jax.lookup`. The stacked array is an ordinary parameter: a
row-sparse gradient, a lazy optimizer, donation and sharding by rows apply to it as to one table.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from masked_jax._core import from_pair, is_masked_leaf
from masked_jax.embeddings._bags import Bag
from masked_jax.embeddings._lookup import _normalize_ids, _read


def _pairs(requests):
    """``(list of (name, value), rebuild)``: a mapping or a sequence of pairs, and how to give the
    results back in the same form."""
    if isinstance(requests, Mapping):
        names = list(requests)
        return [(k, requests[k]) for k in names], lambda outs: dict(zip(names, outs))
    pairs = [tuple(p) for p in requests]
    if any(len(p) != 2 for p in pairs):
        raise TypeError("requests must be a mapping {table name: ids} or a sequence of (table name, ids) pairs.")
    return pairs, list


class TableStack:
    """The layout of tables stacked into one array: their names, row counts and offsets.

    Build it with :func:`stack_tables`. It holds no arrays (it is static: close over it or
    pass it as a static argument); the stacked array is a parameter like any other.

    Examples:
        >>> import jax.numpy as jnp, masked_jax as mj
        >>> stack, table = mj.stack_tables({"user": jnp.zeros((3, 2)), "item": jnp.ones((2, 2))})
        >>> stack
        TableStack(user: 3 rows at 0, item: 2 rows at 3; row shape (2,))
        >>> rows = stack.lookup(table, {"user": jnp.array([2]), "item": jnp.array([1, 0])})
        >>> rows["item"]
        Array([[1., 1.],
               [1., 1.]], dtype=float32)
    """

    def __init__(self, rows: Mapping[str, int], row_shape: tuple):
        if not rows:
            raise ValueError("a table stack needs at least one table.")
        self.rows = {str(k): int(v) for k, v in rows.items()}
        if any(v < 0 for v in self.rows.values()):
            raise ValueError(f"row counts must be >= 0; got {self.rows}.")  # a table of 0 rows: every id is padding
        self.row_shape = tuple(int(d) for d in row_shape)
        starts = np.cumsum([0] + list(self.rows.values()))
        self.offsets = dict(zip(self.rows, (int(s) for s in starts[:-1])))
        self.num_rows = int(starts[-1])

    def __repr__(self):
        tables = ", ".join(f"{k}: {n} rows at {self.offsets[k]}" for k, n in self.rows.items())
        return f"TableStack({tables}; row shape {self.row_shape})"

    def __eq__(self, other):
        return isinstance(other, TableStack) and (self.rows, self.row_shape) == (other.rows, other.row_shape)

    def __hash__(self):
        return hash((tuple(self.rows.items()), self.row_shape))

    @property
    def shape(self) -> tuple:
        """The stacked array's shape, ``(num_rows, *row_shape)``."""
        return (self.num_rows,) + self.row_shape

    def _check(self, table, name=None):
        if is_masked_leaf(table):
            raise TypeError("a stacked table is a plain array; got a masked array.")
        table = jnp.asarray(table) if not isinstance(table, jax.Array) else table
        if tuple(table.shape) != self.shape:
            raise ValueError(f"the stacked table must have shape {self.shape} for {self!r}; got {tuple(table.shape)}.")
        if name is not None and name not in self.rows:
            raise KeyError(f"no table named {name!r} in this stack; it has {list(self.rows)}.")
        return table

    def stack(self, tables: Mapping[str, jax.Array]) -> jax.Array:
        """One array from the tables, in this stack's order (the inverse of :meth:`unstack`)."""
        if set(tables) != set(self.rows):
            raise ValueError(f"stack needs exactly the tables {list(self.rows)}; got {list(tables)}.")
        for k, t in tables.items():
            if tuple(np.shape(t)) != (self.rows[k],) + self.row_shape:
                raise ValueError(f"table {k!r} must have shape {(self.rows[k],) + self.row_shape}; got {np.shape(t)}.")
        return jnp.concatenate([jnp.asarray(tables[k]) for k in self.rows], axis=0)

    def unstack(self, table) -> dict:
        """The tables, as slices of the stacked array (a dict in this stack's order)."""
        table = self._check(table)
        return {k: table[self.offsets[k] : self.offsets[k] + n] for k, n in self.rows.items()}

    def global_ids(self, name: str, ids):
        """Row ids of table ``name`` as rows of the stacked array, with :func:`~masked_jax.lookup`'s
        rule per table: negative ids count from the end of *that* table; ids out of its range (and
        masked ids) become ``num_rows``, which reads zeros and gets no gradient."""
        if name not in self.rows:
            raise KeyError(f"no table named {name!r} in this stack; it has {list(self.rows)}.")
        mask = None
        if is_masked_leaf(ids):
            ids, mask = ids.data, ids.mask
        local = _normalize_ids(ids, self.rows[name])
        valid = local < self.rows[name]
        if mask is not None:
            valid = valid & mask
        return jnp.where(valid, local + self.offsets[name], self.num_rows), mask

    def _read(self, table, flat_ids):
        """The rows of each flat id array, read by one gather and cut apart by one ``split``
        (whose transpose is one concatenate, where slices would each pad a full-size cotangent).
        The ids are :meth:`global_ids` (``num_rows`` for padding), so they are not wrapped again."""
        if not flat_ids:
            return []
        rows = _read(table, jnp.concatenate(flat_ids))  # global ids, already in [0, num_rows]
        return jnp.split(rows, np.cumsum([f.shape[0] for f in flat_ids])[:-1].tolist(), axis=0)

    def lookup(self, table, requests):
        """Rows of several tables with one gather.

        ``requests`` maps table names to ids (or is a sequence of ``(name, ids)`` pairs, for
        several lookups into one table); the result has the same form, each entry
        ``mj.lookup(that_table, ids)``: per-table negative ids count from the end, ids out of range
        read zeros, masked ids give masked rows. Under ``mj.grad(..., row_sparse=...)`` the stacked
        array's gradient is one :class:`RowSparseArray` over all tables' rows read.
        """
        table = self._check(table)
        pairs, rebuild = _pairs(requests)
        shifted = [self.global_ids(name, ids) for name, ids in pairs]
        flat = [g.reshape(-1) for g, _ in shifted]
        outs = []
        for (g, mask), part in zip(shifted, self._read(table, flat)):
            part = part.reshape(g.shape + self.row_shape)
            mask = None if mask is None else jnp.reshape(mask, g.shape + (1,) * len(self.row_shape))
            # masked ids read row num_rows: zeros
            outs.append(part if mask is None else from_pair(part, mask, zeroed=True))
        return rebuild(outs)

    def embedding_bag(self, table, requests):
        """Bags of several tables pooled with one gather.

        ``requests`` maps table names (or is a sequence of ``(name, spec)`` pairs) to the
        arguments of :func:`~masked_jax.embedding_bag` for that table: ids alone, or a dict with
        ``ids`` and any of ``offsets``, ``lengths``, ``weights``, ``combiner``. The result has the
        same form, each entry what ``mj.embedding_bag(that_table, **spec)`` gives.
        """
        table = self._check(table)
        pairs, rebuild = _pairs(requests)
        bags = []
        for name, spec in pairs:
            if name not in self.rows:
                raise KeyError(f"no table named {name!r} in this stack; it has {list(self.rows)}.")
            spec = dict(spec) if isinstance(spec, Mapping) else {"ids": spec}
            ids = spec.pop("ids")
            bag = Bag.prepare(self.rows[name], table.dtype, ids, **spec)
            bags.append((bag, jnp.where(bag.read < self.rows[name], bag.read + self.offsets[name], self.num_rows)))
        # bags that pool alike are read next to each other and pooled by one weighted sum
        groups = {}
        for i, (bag, _) in enumerate(bags):
            key = bag.group_key()
            groups.setdefault(("group", key) if key is not None else ("alone", i), []).append(i)
        order = list(groups.values())
        parts = self._read(table, [jnp.concatenate([bags[i][1].reshape(-1) for i in members]) for members in order])
        outs: list[Any] = [None] * len(bags)
        for members, part in zip(order, parts):
            shape = bags[members[0]][1].shape + self.row_shape
            if len(members) == 1:
                outs[members[0]] = bags[members[0]][0].combine(part.reshape(shape))
                continue
            pooled = Bag.combine_group([bags[i][0] for i in members], part.reshape((len(members),) + shape))
            for i, out in zip(members, pooled):
                outs[i] = out
        return rebuild(outs)


def stack_tables(tables: Mapping[str, jax.Array]) -> tuple[TableStack, jax.Array]:
    """Stack tables of one row shape into one array: ``(layout, stacked array)``.

    Several tables then take one gather per step (:meth:`TableStack.lookup`,
    :meth:`TableStack.embedding_bag`), one row-sparse gradient and one optimizer update, and shard
    by rows as one table does. Tables of different row shapes go into different stacks.

    Examples:
        >>> import jax, jax.numpy as jnp, optax, masked_jax as mj
        >>> from masked_jax import optim
        >>> stack, table = mj.stack_tables({"a": jnp.zeros((4, 2)), "b": jnp.zeros((6, 2))})
        >>> def loss(table, ids_a, ids_b):
        ...     rows = stack.lookup(table, {"a": ids_a, "b": ids_b})
        ...     return jnp.sum(rows["a"]) + jnp.sum(rows["b"])
        >>> g = mj.grad(loss, row_sparse=True)(table, jnp.array([1]), jnp.array([0, 5]))
        >>> g.indices  # b's rows 0 and 5 are rows 4 and 9 of the stack
        Array([1, 4, 9], dtype=int32)
        >>> stack.unstack(optim.apply_updates(table, g))["b"][:, 0]
        Array([1., 0., 0., 0., 0., 1.], dtype=float32)
    """
    if not isinstance(tables, Mapping) or not tables:
        raise TypeError("stack_tables takes a non-empty mapping {name: table of shape (N, ...)}.")
    tables = {k: t if isinstance(t, (jax.Array, np.ndarray)) else jnp.asarray(t) for k, t in tables.items()}
    shapes = {k: tuple(np.shape(t)) for k, t in tables.items()}
    for k, s in shapes.items():
        if len(s) < 1:
            raise ValueError(f"table {k!r} needs at least one dimension (the rows); got shape {s}.")
    row_shapes = {s[1:] for s in shapes.values()}
    if len(row_shapes) != 1:
        raise ValueError(
            f"stacked tables must share one row shape; got {shapes}. Stack tables of each row shape separately."
        )
    dtypes = {jnp.result_type(t) for t in tables.values()}
    if len(dtypes) != 1:
        raise ValueError(f"stacked tables must share one dtype; got {sorted(map(str, dtypes))}.")
    stack = TableStack({k: s[0] for k, s in shapes.items()}, row_shapes.pop())
    return stack, stack.stack(tables)


__all__ = ["TableStack", "stack_tables"]
