"""Row lookups into tables, and row-sparse gradients of them.

``jax.grad`` of a loss that reads ``table[ids]`` returns a dense ``N x dim``
gradient: XLA builds a zero table and scatter-adds the row cotangents into it,
every step. ``mj.value_and_grad(..., row_sparse=...)`` avoids that by
differentiating with respect to the *rows that were read* instead of the table:

1. ``fun`` is traced once to a jaxpr, the selected tables among its inputs;
2. a first evaluation of that jaxpr records the ids of every read of a table's rows
   (a row gather, ``dynamic_slice`` or ``slice`` along axis 0: ``mj.lookup``, ``jnp.take``,
   ``table[ids]``, ``flax.linen.Embed``, ``equinox.nn.Embedding`` under ``vmap``), also inside
   ``jit``, ``scan`` and ``checkpoint`` bodies (a scan returns its bodies' ids stacked). Under
   ``jit`` everything but the ids is dead code that XLA removes;
3. the rows are gathered once, outside differentiation;
4. a second evaluation, differentiated with respect to those rows, hands each read its rows
   (a scan takes its bodies' rows as one more scanned input, a checkpoint as one more argument).

The gradient of a table is therefore a ``RowSparseArray`` of ``K = number of ids read`` rows
(duplicates not yet summed: the optimizers coalesce). Any other use of a selected table (a
matmul, a column slice, a ``while_loop`` or ``cond`` body that reads it) is a ``TypeError`` that
names the operation.
"""

from __future__ import annotations

import math
from typing import Any, cast

import jax
import jax.extend.core.primitives as P
import jax.numpy as jnp
import numpy as np
from jax import lax

from masked_jax import _jaxpr
from masked_jax._core import is_masked_leaf
from masked_jax.embeddings._lookup import _read
from masked_jax.layouts import RowSparseArray, pad_indices, rows_from_parts

_INLINE = (P.jit_p, P.closed_call_p)  # calls whose body is evaluated in place

_PASS = (P.copy_p, P.device_put_p)  # identity-like ops a table may go through


def _misuse(what: str) -> TypeError:
    return TypeError(
        f"a table differentiated with row_sparse=... can only be read by rows (mj.lookup(table, ids), "
        f"table[ids], jnp.take(table, ids, axis=0)); here it is {what}. Such a use would need the "
        "table's dense gradient: leave the table out of row_sparse to get one."
    )


class _Ref:
    """A selected table inside the evaluated program: which table, and the dtype it was cast to."""

    __slots__ = ("k", "dtype")

    def __init__(self, k: int, dtype):
        self.k, self.dtype = k, dtype


def _fill_value(dtype, value):
    """The value a gather in fill mode gives out of range (jax's defaults when ``value`` is None)."""
    if value is not None:
        return jnp.asarray(value, dtype)
    if jnp.issubdtype(dtype, jnp.inexact):
        return jnp.asarray(jnp.nan, dtype)
    if jnp.issubdtype(dtype, jnp.bool_):
        return jnp.asarray(True)
    info = jnp.iinfo(dtype)
    return jnp.asarray(info.min if jnp.issubdtype(dtype, jnp.signedinteger) else info.max, dtype)


def _row_read(eqn, shape, invals):
    """``(ids, valid, arrange, clamped)`` for an equation that reads whole rows of a table of
    ``shape``: the row ids read (any shape ``S``; ``n`` where nothing is read), which ids are in
    range (``None``: all are, after clamping), how rows of shape ``S + shape[1:]`` become the
    equation's output, and the clamped ids whose rows ``promise_in_bounds`` gives out of range.
    ``None`` for other uses."""
    prim, params, n, row = eqn.primitive, eqn.params, shape[0], tuple(shape[1:])
    if prim is P.gather_p:
        dn, sizes = params["dimension_numbers"], tuple(params["slice_sizes"])
        if dn.operand_batching_dims or sizes[1:] != row or 0 not in dn.start_index_map:
            return None
        size, idx, mode = sizes[0], invals[1], params["mode"]
        starts = [idx[..., j] for j in range(idx.shape[-1])]
        first = starts[dn.start_index_map.index(0)].astype(jnp.int32)
        window = jnp.arange(size, dtype=jnp.int32)
        # a window of rows is in range from start 0 to n - size; a full slice along the other
        # dims only from start 0
        valid = (first >= 0) & (first <= n - size)
        for j, d in enumerate(dn.start_index_map):
            if d != 0:
                valid = valid & (starts[j] == 0)
        if mode == lax.GatherScatterMode.CLIP:
            ids, valid = jnp.clip(first, 0, n - size)[..., None] + window, None
        elif mode in (lax.GatherScatterMode.FILL_OR_DROP, lax.GatherScatterMode.PROMISE_IN_BOUNDS):
            # out of range, fill mode gives its fill value; promise_in_bounds reads the clamped
            # rows, but the scatter that is its gradient drops them: neither is a row read
            ids = jnp.where(valid[..., None], first[..., None] + window, n)
            valid = jnp.broadcast_to(valid[..., None], ids.shape)
        else:
            return None
        batch = first.shape
        kept = [sizes[d] for d in range(len(shape)) if d not in dn.collapsed_slice_dims]
        batch_axes = iter(range(len(batch)))
        perm = [
            len(batch) + dn.offset_dims.index(a) if a in dn.offset_dims else next(batch_axes)
            for a in range(len(batch) + len(kept))
        ]

        def arrange(rows):
            return jnp.transpose(rows.reshape(batch + tuple(kept)), perm)

        def clamped():
            return jnp.clip(first, 0, n - size)[..., None] + window

        return ids, valid, arrange, clamped
    if prim is P.dynamic_slice_p:
        size = params["slice_sizes"][0]
        if tuple(params["slice_sizes"][1:]) != row:
            return None
        start = jnp.clip(invals[1], 0, n - size).astype(jnp.int32)
        return start + jnp.arange(size, dtype=jnp.int32), None, lambda rows: rows, None
    if prim is P.slice_p:
        starts, limits = params["start_indices"], params["limit_indices"]
        strides = params["strides"] or (1,) * len(shape)
        if tuple(starts[1:]) != (0,) * len(row) or tuple(limits[1:]) != row or any(s != 1 for s in strides[1:]):
            return None
        return jnp.arange(starts[0], limits[0], strides[0], dtype=jnp.int32), None, lambda rows: rows, None
    return None


class _Run:
    """One evaluation of the traced program. ``collect``: reads the tables and records the ids of
    every row read (``items``: arrays, and lists for scan and checkpoint bodies; ``ks``: which
    table, in the same structure). Otherwise: hands each read the next rows of ``queue`` (the
    same structure, rows in place of ids)."""

    def __init__(self, tables, collect: bool, queue=None):
        self.tables, self.collect = tables, collect
        self.items, self.ks = [], []
        self.queue: list = list(queue) if queue is not None else []  # what a replaying run hands out

    def child(self, queue=None):
        return _Run(self.tables, self.collect, queue)

    def eval(self, jaxpr, consts, args):
        env: dict[Any, Any] = dict(zip(jaxpr.constvars, consts))
        env.update(zip(jaxpr.invars, args))
        for eqn in jaxpr.eqns:
            invals = [_jaxpr.read(env, v) for v in eqn.invars]
            if any(isinstance(x, _Ref) for x in invals):
                outs = self.table_use(eqn, invals)
                outs = outs if eqn.primitive.multiple_results else [outs]
            else:
                with eqn.ctx.manager:
                    outs = _jaxpr.bind(eqn, invals)
            env.update(zip(eqn.outvars, cast(list, outs)))
        return [_jaxpr.read(env, v) for v in jaxpr.outvars]

    # -- an equation that uses a table -------------------------------------------------------------
    def table_use(self, eqn, invals):
        prim, params = eqn.primitive, eqn.params
        refs = [isinstance(x, _Ref) for x in invals]
        if refs[0] and not any(refs[1:]) and prim in (P.gather_p, P.dynamic_slice_p, P.slice_p):
            return self.read_rows(eqn, invals)
        if prim is P.convert_element_type_p:
            return _Ref(invals[0].k, params["new_dtype"])
        if prim in _PASS:
            return list(invals) if prim.multiple_results else invals[0]
        if prim in _INLINE:
            closed = params.get("jaxpr") or params.get("call_jaxpr")
            return self.eval(closed.jaxpr, closed.consts, invals)
        if prim is P.scan_p:
            return self.scan(params, invals)
        if prim is _jaxpr.REMAT_P:
            return self.checkpoint(params, invals)
        if prim is P.while_p:
            raise _misuse(
                "read inside a lax.while_loop (or fori_loop with traced bounds), whose number of "
                "reads is not known; use lax.scan or read the rows before the loop"
            )
        if prim is P.cond_p:
            raise _misuse("read inside a lax.cond / lax.switch branch; read the rows before the branch")
        if prim in (P.custom_jvp_call_p, P.custom_vjp_call_p):
            raise _misuse(
                "an argument of a function with a custom_jvp / custom_vjp rule; read the rows "
                "outside it and pass them in"
            )
        if prim in (P.gather_p, P.dynamic_slice_p, P.slice_p):
            raise _misuse(f"read by a {prim.name} that does not take whole rows along axis 0")
        raise _misuse(f"used by '{prim.name}'")

    def read_rows(self, eqn, invals):
        ref = invals[0]
        table = self.tables[ref.k]
        found = _row_read(eqn, table.shape, invals)
        if found is None:
            raise _misuse(f"read by a {eqn.primitive.name} that does not take whole rows along axis 0")
        ids, valid, arrange, clamped = found
        if self.collect:
            self.items.append(ids)
            self.ks.append(ref.k)
            rows = _read(table, ids)
        else:
            rows = self.queue.pop(0)
        rows = rows.astype(ref.dtype)
        if valid is not None:  # what the gather gives out of range: its fill, or a clamped row
            if eqn.params["mode"] == lax.GatherScatterMode.FILL_OR_DROP:
                fill = _fill_value(ref.dtype, eqn.params["fill_value"])
            else:
                assert clamped is not None  # a clamping gather says which row it read
                fill = lax.stop_gradient(_read(table, clamped()).astype(ref.dtype))
            rows = jnp.where(valid.reshape(valid.shape + (1,) * (rows.ndim - valid.ndim)), rows, fill)
        return arrange(rows)

    def body(self, jaxpr, consts, refs_in, group, run_args):
        """Evaluate a body with its table arguments put back; a child run records into / reads
        from ``group``. Returns ``(outs, child)``."""
        sub = self.child(None if self.collect else group)
        args = iter(run_args)
        outs = sub.eval(jaxpr, consts, [r if r is not None else next(args) for r in refs_in])
        if any(isinstance(o, _Ref) for o in outs):
            raise _misuse("returned from a scan, checkpoint or jit body")
        return outs, sub

    def scan(self, params, invals):
        nconsts, ncarry = params["num_consts"], params["num_carry"]
        if any(isinstance(x, _Ref) for x in invals[nconsts:]):
            raise _misuse(
                "a carry or scanned input of lax.scan; close over it (or pass it as a constant) "
                "and read its rows inside the body"
            )
        consts, carry, xs = invals[:nconsts], invals[nconsts : nconsts + ncarry], invals[nconsts + ncarry :]
        refs_in = [x if isinstance(x, _Ref) else None for x in consts] + [None] * (len(invals) - nconsts)
        plain = [x for x in consts if not isinstance(x, _Ref)]
        group = None if self.collect else self.queue.pop(0)
        ks = []

        def step(c, x):
            xs_t, rows_t = x
            body = params["jaxpr"]
            outs, sub = self.body(body.jaxpr, body.consts, refs_in, rows_t, plain + list(c) + list(xs_t))
            ks[:] = [sub.ks]
            return outs[:ncarry], (outs[ncarry:], sub.items if self.collect else None)

        carry, (ys, recorded) = lax.scan(
            step,
            list(carry),
            (list(xs), group),
            length=params["length"],
            reverse=params["reverse"],
            unroll=params["unroll"],
        )
        if self.collect:
            self.items.append(recorded)
            self.ks.append(ks[0])
        return list(carry) + list(ys)

    def checkpoint(self, params, invals):
        refs_in = [x if isinstance(x, _Ref) else None for x in invals]
        plain = [x for x in invals if not isinstance(x, _Ref)]
        jaxpr = params["jaxpr"]
        if self.collect:
            outs, sub = self.body(jaxpr, (), refs_in, None, plain)
            self.items.append(sub.items)
            self.ks.append(sub.ks)
            return outs

        def fn(group, *args):
            return self.body(jaxpr, (), refs_in, group, args)[0]

        return jax.checkpoint(fn, prevent_cse=params["prevent_cse"], policy=params["policy"])(self.queue.pop(0), *plain)


def _is_array(x) -> bool:
    return isinstance(x, (jax.Array, np.ndarray, np.generic))


class _Slot:
    """Marks where a selected table sits in the arguments while they are flattened."""

    def __init__(self, k: int):
        self.k = k


@jax.tree_util.register_pytree_node_class
class _LookupRows(RowSparseArray):
    """The rows a function read from a table, in the order it read them; what the differentiated
    evaluation takes in place of the table."""

    __slots__ = ()

    def tree_flatten(self):
        return (self.data, self.indices), self.shape

    @classmethod
    def tree_unflatten(cls, aux, children):
        return super().tree_unflatten((aux, False), children)

    def with_data(self, data) -> _LookupRows:
        return cast(_LookupRows, _LookupRows.tree_unflatten(self.shape, (data, self.indices)))

    def as_row_sparse(self) -> RowSparseArray:
        return rows_from_parts(self.shape, self.data, self.indices, False)

    def first_copies(self):
        """Every stored row counts: each is one read of the table, whose gradients add up."""
        return self.row_valid()


def _flags(spec, arg):
    """Per-leaf bools from ``spec`` (True, a prefix tree of bools, or a callable on ``arg``)."""
    if callable(spec):
        spec = spec(arg)
    if isinstance(spec, bool):
        return jax.tree_util.tree_map(lambda _: spec, arg, is_leaf=is_masked_leaf)
    try:
        return jax.tree_util.tree_map(
            lambda flag, sub: jax.tree_util.tree_map(lambda _: bool(flag), sub, is_leaf=is_masked_leaf),
            spec,
            arg,
            is_leaf=is_masked_leaf,
        )
    except ValueError as err:
        raise ValueError(
            f"row_sparse must be a bool, a callable, or a prefix of the argument's "
            f"pytree structure with bool leaves: {err}"
        ) from None


def _mark(args, nums, spec):
    """``args`` with each selected table replaced by a :class:`_Slot`, and the tables."""
    specs = spec if len(nums) > 1 and isinstance(spec, tuple) else (spec,) * len(nums)
    out, tables = list(args), []
    for i, s in zip(nums, specs):
        flags = jax.tree_util.tree_leaves(_flags(s, args[i]))  # bools: one per container leaf
        leaves, treedef = jax.tree_util.tree_flatten(args[i], is_leaf=is_masked_leaf)
        for j, (flag, leaf) in enumerate(zip(flags, leaves)):
            if flag:
                if not isinstance(leaf, (jax.Array, np.ndarray)) or np.ndim(leaf) == 0:
                    raise TypeError(
                        f"row_sparse must select plain arrays of shape (N, ...) (the "
                        f"tables); got {type(leaf).__name__} of shape {np.shape(leaf)}."
                    )
                tables.append(jnp.asarray(leaf))
                leaves[j] = _Slot(len(tables) - 1)
        out[i] = jax.tree_util.tree_unflatten(treedef, leaves)
    return out, tables


def _leaves_per_table(items, ks, n_tables):
    """Flatten the recorded structure: per table, its arrays in order."""
    per = [[] for _ in range(n_tables)]
    for item, k in zip(items, ks):
        if isinstance(k, list):
            for t, arrays in enumerate(_leaves_per_table(item, k, n_tables)):
                per[t].extend(arrays)
        else:
            per[k].append(item)
    return per


def _rows_like(items, ks, rows, row_shape):
    """``items`` with each ids array replaced by its rows, taken in order from ``rows[k]``."""
    out = []
    for item, k in zip(items, ks):
        if isinstance(k, list):
            out.append(_rows_like(item, k, rows, row_shape))
        else:
            size = math.prod(item.shape)
            out.append(rows[k][0][rows[k][1] : rows[k][1] + size].reshape(item.shape + row_shape[k]))
            rows[k][1] += size
    return out


def substitute_rows(fun, args, kwargs, nums, spec):
    """``(fun2, args2)``: ``args`` with the selected tables replaced by the rows ``fun`` reads from
    them, and the function of those arguments that gives ``fun``'s result, each row read taking
    its rows (see the module docstring)."""
    marked, tables = _mark(args, nums, spec)
    leaves, treedef = jax.tree_util.tree_flatten((tuple(marked), kwargs))
    # traced: arrays, the tables, and numbers in the differentiated arguments; the rest (flags,
    # sizes, functions) stays as the function saw it
    starts = np.cumsum([0] + [len(jax.tree_util.tree_leaves(a)) for a in marked])
    differentiated = {j for i in nums for j in range(starts[i], starts[i + 1])}
    dyn = [
        i
        for i, leaf in enumerate(leaves)
        if isinstance(leaf, _Slot) or _is_array(leaf) or (i in differentiated and isinstance(leaf, (float, complex)))
    ]
    out_info = {}

    def flat_fun(*values):
        full = list(leaves)
        for i, v in zip(dyn, values):
            full[i] = v
        a, kw = jax.tree_util.tree_unflatten(treedef, full)
        out_leaves, out_tree = jax.tree_util.tree_flatten(fun(*a, **kw))
        out_info["tree"] = out_tree
        out_info["static"] = [None if _is_array(o) else o for o in out_leaves]
        return [o for o in out_leaves if _is_array(o)]

    values = [tables[leaves[i].k] if isinstance(leaves[i], _Slot) else leaves[i] for i in dyn]
    closed = jax.make_jaxpr(flat_fun)(*values)

    def ref_values(values):
        return [
            _Ref(leaves[i].k, tables[leaves[i].k].dtype) if isinstance(leaves[i], _Slot) else v
            for i, v in zip(dyn, values)
        ]

    run = _Run(tables, collect=True)
    if any(isinstance(o, _Ref) for o in run.eval(closed.jaxpr, closed.consts, ref_values(values))):
        raise _misuse("returned by the function (as its output or aux)")
    rows_args = list(args)
    all_ids = []
    for k, arrays in enumerate(_leaves_per_table(run.items, run.ks, len(tables))):
        ids = jnp.concatenate([a.reshape(-1) for a in arrays]) if arrays else jnp.zeros((0,), jnp.int32)
        all_ids.append(pad_indices(ids, tables[k].shape[0]) if ids.shape[0] == 1 else ids)
    for i in nums:
        rows_args[i] = jax.tree_util.tree_map(
            lambda x: (
                _LookupRows.tree_unflatten(tables[x.k].shape, (_read(tables[x.k], all_ids[x.k]), all_ids[x.k]))
                if isinstance(x, _Slot)
                else x
            ),
            marked[i],
            is_leaf=lambda x: isinstance(x, _Slot),
        )

    def fun2(*a, **kw):
        flat, tree2 = jax.tree_util.tree_flatten((tuple(a), kw), is_leaf=lambda x: isinstance(x, _LookupRows))
        if tree2 != treedef:
            raise ValueError(
                "row_sparse: the function was called with arguments of another structure "
                "than the ones its lookups were recorded with."
            )
        rows: list[Any] = [None] * len(tables)
        for i in dyn:
            if isinstance(leaves[i], _Slot):
                rows[leaves[i].k] = [flat[i].data, 0]
        queue = _rows_like(run.items, run.ks, rows, [t.shape[1:] for t in tables])
        outs = iter(
            _Run(tables, collect=False, queue=queue).eval(
                closed.jaxpr, closed.consts, ref_values([flat[i] for i in dyn])
            )
        )
        out_leaves = [next(outs) if s is None else s for s in out_info["static"]]
        return jax.tree_util.tree_unflatten(out_info["tree"], out_leaves)

    return fun2, rows_args


def as_row_sparse(grads):
    """Gradients with every replayed table turned into a plain :class:`RowSparseArray`."""
    return jax.tree_util.tree_map(
        lambda g: g.as_row_sparse() if isinstance(g, _LookupRows) else g,
        grads,
        is_leaf=lambda g: isinstance(g, _LookupRows),
    )
