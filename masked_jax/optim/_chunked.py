"""A lazy update of row-sparse tables in chunks of rows, with the parameter update folded in.

``make_train_step`` with a :func:`lazy` optimizer updates each row-sparse table (that stores
more rows than a chunk) in a
``while_loop`` over chunks of its coalesced rows: gather ``chunk`` rows of the parameters and
state, run the inner update on them, scatter the state and add the update, and stop at the
last chunk that holds a touched row. Every temporary is ``chunk x dim`` (it stays in cache),
and the padding slots past the touched rows are never visited. Exact only for an inner
transformation that works entry by entry; :func:`entrywise` decides that from its jaxpr, and
any other transformation keeps the one-call update.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from masked_jax import _jaxpr
from masked_jax._core import from_pair, is_masked_leaf
from masked_jax.layouts import RowSparseArray, rows_from_parts
from masked_jax.optim._catch_up import LazyCatchUpState
from masked_jax.optim._lazy import check_update_arguments
from masked_jax.optim._state import _local_from, _map_param_shaped, _Reference, is_row_local, lazy_inner
from masked_jax.optim._views import data_of

# primitives that compute each output entry from the same entry of their operands
_ENTRYWISE = frozenset(
    """
    abs acos acosh add and asin asinh atan atan2 atanh cbrt ceil clamp convert_element_type copy
    copy_p cos cosh digamma div eq erf erf_inv erfc exp exp2 expm1 floor ge gt imag integer_pow
    is_finite le lgamma log log1p logistic lt max min mul ne neg nextafter not or pow real
    reduce_precision rem round rsqrt select_n sign sin sinh sqrt square sub tan tanh xor
""".split()
)
_KEEPS_ENTRIES = _ENTRYWISE | {"broadcast_in_dim"}  # broadcast_in_dim: where it keeps the shape


class _Mixes(Exception):
    """The transformation combines different entries (or leaves) somewhere."""


def _walk(jaxpr, tags):
    """Propagate tags through ``jaxpr``: ``("e", j)`` for values computed entry by entry from
    parameter leaf ``j`` (same shape), ``("u",)`` for values equal at every entry (scalars and
    their broadcasts), ``("g",)`` for other values that depend on no entry. Raises
    :class:`_Mixes` where entries meet in any other way."""
    env: dict[Any, tuple[Any, ...]] = {v: ("u",) if np.ndim(v.aval) == 0 else ("g",) for v in jaxpr.constvars}
    env.update(zip(jaxpr.invars, tags))

    def tag(v) -> tuple[Any, ...]:
        if _jaxpr.is_literal(v):
            return ("u",) if np.ndim(v.val) == 0 else ("g",)
        return env[v]

    for eqn in jaxpr.eqns:
        ins = [tag(v) for v in eqn.invars]
        shapes = [tuple(getattr(v.aval, "shape", ())) for v in eqn.invars]
        sub = _jaxpr.call_body(eqn)
        entries = {t[1] for t in ins if t[0] == "e"}
        if sub is not None:
            outs = _walk(sub[0], ins)
        elif not entries:  # equal at every entry if its operands are, and it keeps that (or gives scalars)
            scalar = all(np.ndim(o.aval) == 0 for o in eqn.outvars if hasattr(o.aval, "shape"))
            uniform = all(t[0] == "u" for t in ins) and (eqn.primitive.name in _KEEPS_ENTRIES or scalar)
            outs = [("u",) if uniform else ("g",)] * len(eqn.outvars)
        else:
            out_shape = tuple(eqn.outvars[0].aval.shape)
            ok = (
                len(entries) == 1
                and eqn.primitive.name in _KEEPS_ENTRIES
                and all((t[0] == "e" and s == out_shape) or t[0] == "u" for t, s in zip(ins, shapes))
            )
            if not ok:
                raise _Mixes(eqn.primitive.name)
            outs = [("e", entries.pop())] * len(eqn.outvars)
        env.update(zip(eqn.outvars, outs))
    return [tag(v) for v in jaxpr.outvars]


def entrywise(inner, updates, state, params) -> bool:
    """Does ``inner.update`` compute every entry of every update and parameter-shaped state leaf
    from that entry alone (adam, sgd, momentum, adagrad, rmsprop, weight decay: yes; global-norm
    clipping, trust ratios, finiteness checks: no), with global state that depends on no entry?
    Read off its jaxpr at the parameters' shapes; ``False`` where unsure."""
    ref = _Reference.of(updates)
    like = lambda x: (  # noqa: E731
        jax.ShapeDtypeStruct(tuple(x.shape), data_of(x).dtype)
        if is_masked_leaf(x)
        else (jax.ShapeDtypeStruct(np.shape(x), jnp.result_type(x)))
    )
    u_like, s_like, p_like = (jax.tree_util.tree_map(like, t, is_leaf=is_masked_leaf) for t in (updates, state, params))
    try:
        closed = jax.make_jaxpr(lambda u, s, p: inner.update(u, s, p))(u_like, s_like, p_like)
    except Exception:  # noqa: BLE001 - whatever fails here runs the one-call update, which reports it
        return False
    n = len(ref.shapes)
    owner = jax.tree_util.tree_leaves(_map_param_shaped(ref, lambda leaves: list(range(len(leaves))), state))
    state_tags: list[tuple[Any, ...]] = [
        ("e", j) if isinstance(j, int) else (("u",) if np.ndim(j) == 0 else ("g",)) for j in owner
    ]
    tags = [("e", j) for j in range(n)] + state_tags + [("e", j) for j in range(n)]
    try:
        outs = _walk(closed.jaxpr, tags)
    except (_Mixes, KeyError, AttributeError, TypeError):  # a form this reading does not know: unsure
        return False
    u_tags: list[tuple[Any, ...]] = outs[:n]
    s_tags: list[tuple[Any, ...]] = outs[n:]
    if any(t[0] == "g" or (t[0] == "e" and t[1] != j) for j, t in enumerate(u_tags)):
        return False
    for t, j in zip(s_tags, owner):
        if isinstance(j, int) and (t[0] == "g" or (t[0] == "e" and t[1] != j)):
            return False
        if not isinstance(j, int) and t[0] == "e":
            return False
    return True


def empty_leaf(g):
    """A gradient leaf that touches nothing, at O(1) cost: a row-sparse leaf with no stored rows
    (a scalar: masked out)."""
    shape = tuple(g.shape) if is_masked_leaf(g) else np.shape(g)
    dtype = data_of(g).dtype if is_masked_leaf(g) else jnp.result_type(g)
    if not shape:
        return from_pair(jnp.zeros((), dtype), jnp.zeros((), bool))
    return rows_from_parts(shape, jnp.zeros((0,) + shape[1:], dtype), jnp.zeros((0,), jnp.int32), True)


def row_sparse_leaves(leaves, more_than: int):
    """The positions of the row-sparse gradient leaves that store more than ``more_than`` rows."""
    return [i for i, g in enumerate(leaves) if isinstance(g, RowSparseArray) and g.ndim >= 1 and g.nse > more_than]


def _tables(grads, chunk):
    """Flat gradient leaves, their tree, and the positions of the row-sparse leaves that store more
    than ``chunk`` rows (smaller ones gain nothing from a loop: one update of theirs is one chunk)."""
    leaves, treedef = jax.tree_util.tree_flatten(grads, is_leaf=is_masked_leaf)
    return leaves, treedef, row_sparse_leaves(leaves, chunk)


def chunkable(optimizer, grads, state, params, chunk: int) -> bool:
    """Can :func:`chunked_update` run this step: some gradient leaf is row-sparse with more than
    ``chunk`` stored rows, and ``optimizer`` is a plain lazy lift whose inner transformation works
    entry by entry (decided at trace time), or updates each row from that row alone by
    construction (``rowwise_adagrad``)?"""
    leaves, _, tables = _tables(grads, chunk)
    if not tables or any(not (is_masked_leaf(g) or isinstance(g, jax.Array)) for g in leaves):
        return False
    if is_row_local(optimizer):  # row by row by construction (rowwise_adagrad)
        return True
    inner = lazy_inner(optimizer)
    if inner is None:
        return False
    if isinstance(state, LazyCatchUpState):  # catch-up works row by row around ``inner``
        state = state.inner
    check_update_arguments(inner, grads, state, params)
    return entrywise(inner, grads, state, params)


def chunked_update(optimizer, grads, state, params, apply, chunk: int):
    """``(params, state)`` after one step of the lazy lift ``optimizer`` (see :func:`chunkable`),
    each row-sparse table updated chunk by chunk, then the other leaves and the global state."""
    leaves, treedef, tables = _tables(grads, chunk)
    ref = _Reference.of(grads)
    empty = [empty_leaf(g) for g in leaves]

    def old_globals(new, old):  # per-entry and per-row state from ``new``, global state (counts) from ``old``
        if isinstance(old, LazyCatchUpState):  # and the rows' catch-up counters from ``new``
            return LazyCatchUpState(old_globals(new.inner, old.inner), old.step, new.last)
        return _local_from(ref, new, old)

    for i in tables:  # every table in a loop over its touched rows, against the step's old global state
        g = leaves[i].sum_duplicates()  # distinct rows first, then padding
        pad = -g.nse % chunk  # padding slots up to whole chunks
        data = jnp.pad(g.data, [(0, pad)] + [(0, 0)] * (g.ndim - 1))
        idx = jnp.pad(jnp.where(g.row_valid(), g.indices, g.shape[0]), (0, pad), constant_values=g.shape[0])
        # slots up to the last touched one (the distinct rows come first after a coalesce; a
        # gradient whose indices are known to be unique may hold padding anywhere)
        touched = jnp.max(jnp.where(idx < g.shape[0], jnp.arange(1, idx.shape[0] + 1), 0))

        def body(carry, i=i, g=g, data=data, idx=idx):
            c, p, s = carry
            rows = rows_from_parts(
                g.shape,
                jax.lax.dynamic_slice_in_dim(data, c * chunk, chunk),
                jax.lax.dynamic_slice_in_dim(idx, c * chunk, chunk),
                True,
            )
            tree = jax.tree_util.tree_unflatten(treedef, empty[:i] + [rows] + empty[i + 1 :])
            u, new = optimizer.update(tree, s, p)
            return c + 1, apply(p, u), old_globals(new, s)

        _, params, state = jax.lax.while_loop(  # c * chunk < touched also ends it within the slots
            lambda carry, touched=touched: carry[0] * chunk < touched, body, (jnp.zeros((), jnp.int32), params, state)
        )
    rest = [empty[j] if j in tables else g for j, g in enumerate(leaves)]  # the other leaves; global state
    u, state = optimizer.update(jax.tree_util.tree_unflatten(treedef, rest), state, params)
    return apply(params, u), state
