"""``lazy(optax.MultiSteps(inner, k))``: gradient accumulation that is exact per entry.

``optax.MultiSteps`` sums (or averages) ``k`` micro-batch gradients and applies ``inner`` to the
total every ``k``-th step. Lifted naively, the lazy update would run ``MultiSteps`` on the rows of
the *current* micro-step only, and the accumulated gradient of a row touched earlier in the window
but not at the ``k``-th step would never be applied. Here the accumulator stays parameter-shaped
(dense), a parameter-shaped ``touched`` mask records which entries had a valid gradient in the
window, and at the ``k``-th step ``lazy(inner)`` receives the accumulated gradient as a masked
array valid where touched: every touched entry is updated with its exact accumulated gradient, the
others (and their optimizer state) stay bit-identical.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from masked_jax._core import from_pair, is_masked_leaf
from masked_jax.layouts import RowSparseArray, distinct_ids, rows_from_parts
from masked_jax.optim._views import data_of, view


class LazyMultiStepsState(NamedTuple):
    """``optax.MultiStepsState`` (its inner state is ``lazy(inner)``'s) and the entries touched in
    the current window of micro-steps."""

    multi_steps: optax.MultiStepsState
    touched: Any


def _configuration(ms):
    try:
        return ms._opt, ms._every_k_schedule, ms._acc_update, ms._should_skip_update_fn, ms._accumulator_dtype
    except AttributeError:  # pragma: no cover - an optax whose MultiSteps keeps its settings elsewhere
        raise ValueError(
            "lazy(optax.MultiSteps(...)): this optax version's MultiSteps does not expose its inner "
            "transformation and schedule; use optax.MultiSteps(lazy(inner), k) with plain "
            "gradients instead."
        ) from None


def _dense(g):
    """A gradient leaf as ``(values, valid)`` of the parameter's shape (zeros where not valid)."""
    v, data = view(g)
    zeros = jnp.zeros(v.shape, data.dtype)
    return v.scatter(zeros, data), v.scatter(jnp.zeros(v.shape, bool), jnp.ones(data.shape, bool))


def lazy_multi_steps(ms, lift) -> optax.GradientTransformation:
    """The lazy lift of an ``optax.MultiSteps`` (``lift`` is :func:`lazy`, applied to its inner
    transformation)."""
    inner, every_k, acc_update, should_skip, acc_dtype = _configuration(ms)
    lazy_inner = lift(inner)

    def init_fn(params):
        params = jax.tree_util.tree_map(data_of, params, is_leaf=is_masked_leaf)
        touched = jax.tree_util.tree_map(lambda p: jnp.zeros(jnp.shape(p), bool), params)
        return LazyMultiStepsState(ms.init(params), touched)

    def update_fn(updates, state, params=None, **extra_args):
        # extra arguments (value=, ...) go to the inner transformation's update, as in optax.MultiSteps
        if params is not None:
            params = jax.tree_util.tree_map(data_of, params, is_leaf=is_masked_leaf)
        st = state.multi_steps
        leaves, treedef = jax.tree_util.tree_flatten(updates, is_leaf=is_masked_leaf)
        dense = [_dense(g) for g in leaves]
        grads = treedef.unflatten([d for d, _ in dense])
        valid = treedef.unflatten([m for _, m in dense])
        k = every_k(st.gradient_step)
        skip, skip_state = should_skip(grads, st.gradient_step, params)

        acc = jax.tree_util.tree_map(
            lambda g, a: acc_update(g, a, n_acc=st.mini_step).astype(acc_dtype), grads, st.acc_grads
        )
        touched = jax.tree_util.tree_map(jnp.logical_or, state.touched, valid)
        emit = st.mini_step == k - 1
        masked_acc = jax.tree_util.tree_map(lambda a, t, g: from_pair(a.astype(g.dtype), t), acc, touched, grads)
        u, new_inner = lazy_inner.update(masked_acc, st.inner_opt_state, params, **extra_args)
        u = jax.tree_util.tree_map(
            lambda x: from_pair(jnp.where(emit, x.data, 0), x.mask & emit), u, is_leaf=is_masked_leaf
        )
        stepped = optax.MultiStepsState(
            mini_step=(st.mini_step + 1) % k,
            gradient_step=jnp.where(emit, st.gradient_step + 1, st.gradient_step),
            inner_opt_state=jax.tree_util.tree_map(
                lambda new, old: jnp.where(emit, new, old), new_inner, st.inner_opt_state
            ),
            acc_grads=jax.tree_util.tree_map(lambda a: jnp.where(emit, jnp.zeros_like(a), a), acc),
            skip_state=skip_state,
        )
        touched = jax.tree_util.tree_map(lambda t: t & ~emit, touched)
        # a skipped micro-step (should_skip_update_fn) leaves everything as it was
        new_state = jax.tree_util.tree_map(
            lambda old, new: jnp.where(skip, old, new),
            LazyMultiStepsState(st._replace(skip_state=skip_state), state.touched),
            LazyMultiStepsState(stepped, touched),
        )
        u = jax.tree_util.tree_map(
            lambda x: from_pair(jnp.where(skip, 0, x.data), x.mask & ~skip), u, is_leaf=is_masked_leaf
        )
        return u, new_state

    return optax.GradientTransformation(init_fn, update_fn)


class RowMultiStepsState(NamedTuple):
    """``lazy(optax.MultiSteps(inner, k), capacity=...)``'s state: per parameter leaf, an
    accumulator of at most ``capacity`` rows (a coalesced :class:`RowSparseArray`) or, for leaves
    without a capacity, a dense one with its touched mask; and how many windows ended early
    because their rows did not fit."""

    mini_step: jax.Array
    gradient_step: jax.Array
    inner_opt_state: Any
    acc: Any
    touched: Any
    skip_state: Any
    early_flushes: jax.Array


def _capacities(capacity, params):
    """Per parameter leaf: the accumulator's row capacity, or None (dense)."""
    if callable(capacity):
        capacity = capacity(params)
    if capacity is None or isinstance(capacity, int):
        return [capacity if np.ndim(p) >= 1 else None for p in jax.tree_util.tree_leaves(params)]
    try:
        per_leaf = jax.tree_util.tree_map(
            lambda c, sub: jax.tree_util.tree_map(lambda _: c, sub),
            capacity,
            params,
            is_leaf=lambda c: c is None or isinstance(c, int),
        )
    except ValueError as err:
        raise ValueError(
            f"capacity must be an int, None, a callable, or a prefix of the parameters' pytree with "
            f"int or None leaves: {err}"
        ) from None
    out = jax.tree_util.tree_leaves(per_leaf, is_leaf=lambda c: c is None)
    for c in out:
        if c is not None and (not isinstance(c, int) or c < 2):
            raise ValueError(f"capacity must be an int >= 2 (rows) or None; got {c!r}.")
    return out


def _empty_rows(shape, capacity, dtype):
    return rows_from_parts(
        shape, jnp.zeros((capacity,) + tuple(shape[1:]), dtype), jnp.full((capacity,), shape[0], jnp.int32), True
    )


def _as_rows(g, shape):
    """A gradient leaf as coalesced rows ``(indices (K,), data (K, ...))``, padding ``N``."""
    v, data = view(g)
    return v.rows(data, shape)


def _merge(acc, idx, data, n, capacity, acc_update, n_acc):
    """The accumulator after adding rows ``(idx, data)``: ``(merged rows, fits)``."""
    both = jnp.concatenate([acc.indices, idx])
    uniq, seg = distinct_ids(both, n)
    c = acc.indices.shape[0]
    old = jax.ops.segment_sum(acc.data, seg[:c], num_segments=both.shape[0])
    new = jax.ops.segment_sum(data.astype(acc.data.dtype), seg[c:], num_segments=both.shape[0])
    merged = acc_update(new, old, n_acc=n_acc)
    fits = uniq[capacity] >= n if both.shape[0] > capacity else jnp.asarray(True)  # no distinct row past it
    keep = jnp.where(uniq[:capacity] < n, uniq[:capacity], n)
    return rows_from_parts(acc.shape, merged[:capacity].astype(acc.data.dtype), keep, True), fits


def lazy_multi_steps_rows(ms, lift, capacity) -> optax.GradientTransformation:
    """``lazy(optax.MultiSteps(inner, k), capacity=...)``: accumulators of at most ``capacity``
    rows (see :func:`~masked_jax.optim.lazy`)."""
    inner, every_k, acc_update, should_skip, acc_dtype = _configuration(ms)
    lazy_inner = lift(inner)

    def init_fn(params):
        params = jax.tree_util.tree_map(data_of, params, is_leaf=is_masked_leaf)
        leaves, treedef = jax.tree_util.tree_flatten(params)
        caps = _capacities(capacity, params)
        acc = [
            jnp.zeros(np.shape(p), acc_dtype or jnp.result_type(p))
            if c is None
            else _empty_rows(np.shape(p), c, acc_dtype or jnp.result_type(p))
            for p, c in zip(leaves, caps)
        ]
        touched = [jnp.zeros(np.shape(p), bool) if c is None else jnp.zeros((0,), bool) for p, c in zip(leaves, caps)]
        base = ms.init(params)
        return RowMultiStepsState(
            base.mini_step,
            base.gradient_step,
            lazy_inner.init(params),
            treedef.unflatten(acc),
            treedef.unflatten(touched),
            base.skip_state,
            jnp.zeros((), jnp.int32),
        )

    def update_fn(updates, state, params=None, **extra_args):
        # extra arguments (value=, ...) go to the inner transformation's update, as in optax.MultiSteps
        if not isinstance(state, RowMultiStepsState):
            raise ValueError(
                f"lazy(MultiSteps, capacity=...): state must be the RowMultiStepsState its init "
                f"returned; got {type(state).__name__}."
            )
        if params is not None:
            params = jax.tree_util.tree_map(data_of, params, is_leaf=is_masked_leaf)
        leaves, treedef = jax.tree_util.tree_flatten(updates, is_leaf=is_masked_leaf)
        accs = treedef.flatten_up_to(state.acc)
        touched = treedef.flatten_up_to(state.touched)
        k = every_k(state.gradient_step)
        last = state.mini_step == k - 1
        merged, fits, restart, plain = [], jnp.asarray(True), [], []
        for g, a, _t in zip(leaves, accs, touched):
            shape = tuple(g.shape) if is_masked_leaf(g) else np.shape(g)
            if isinstance(a, RowSparseArray):
                idx, data = _as_rows(g, shape)
                if idx.shape[0] > a.nse:
                    raise ValueError(
                        f"lazy(MultiSteps, capacity={a.nse}): a gradient of {idx.shape[0]} rows cannot fit "
                        f"an accumulator of {a.nse} rows; raise the capacity to at least the rows of one "
                        "micro-step's gradient."
                    )
                m, ok = _merge(a, idx, data, shape[0], a.nse, acc_update, state.mini_step)
                fits = fits & ok
                merged.append(m)
                alone, _ = _merge(_empty_rows(shape, a.nse, a.dtype), idx, data, shape[0], a.nse, acc_update, 0)
                restart.append(alone)
                plain.append(g)
            else:
                values, valid = _dense(g)
                merged.append(acc_update(values, a, n_acc=state.mini_step).astype(a.dtype))
                restart.append(acc_update(values, jnp.zeros_like(a), n_acc=0).astype(a.dtype))
                plain.append((values, valid))
        # the window ends at its k-th micro-step, or early, before a micro-step whose rows would not
        # fit: then the accumulated gradient is applied and this micro-step starts the next window
        early = ~fits
        emit = last | early
        emitted, new_acc, new_touched = [], [], []
        for a, t, m, r, p in zip(accs, touched, merged, restart, plain):
            if isinstance(a, RowSparseArray):
                out = jax.tree_util.tree_map(lambda old, new: jnp.where(early, old, new), a, m)
                emitted.append(out)
                zero = _empty_rows(a.shape, a.nse, a.dtype)
                new_acc.append(
                    jax.tree_util.tree_map(lambda z, rr, mm: jnp.where(early, rr, jnp.where(last, z, mm)), zero, r, m)
                )
                new_touched.append(t)
            else:
                values, valid = p
                now = t | valid
                acc_rows = jnp.where(early, a, m)
                emitted.append(from_pair(acc_rows.astype(values.dtype), jnp.where(early, t, now)))
                new_acc.append(jnp.where(early, r, jnp.where(last, jnp.zeros_like(m), m)))
                new_touched.append(jnp.where(early, valid, jnp.where(last, jnp.zeros_like(now), now)))
        # optax's skip rules (skip_not_finite, skip_large_updates) see this micro-step's values
        skip, skip_state = should_skip(treedef.unflatten([view(g)[1] for g in leaves]), state.gradient_step, params)
        u, new_inner = lazy_inner.update(treedef.unflatten(emitted), state.inner_opt_state, params, **extra_args)

        def gate(x):
            if isinstance(x, RowSparseArray):
                return rows_from_parts(
                    x.shape, jnp.where(emit, x.data, 0), jnp.where(emit, x.indices, x.shape[0]), x.unique_indices
                )
            return from_pair(jnp.where(emit, x.data, 0), x.mask & emit)

        u = jax.tree_util.tree_map(gate, u, is_leaf=is_masked_leaf)
        stepped = RowMultiStepsState(
            mini_step=jnp.where(early, 1, (state.mini_step + 1) % k).astype(state.mini_step.dtype),
            gradient_step=jnp.where(emit, state.gradient_step + 1, state.gradient_step),
            inner_opt_state=jax.tree_util.tree_map(
                lambda new, old: jnp.where(emit, new, old), new_inner, state.inner_opt_state
            ),
            acc=treedef.unflatten(new_acc),
            touched=treedef.unflatten(new_touched),
            skip_state=skip_state,
            early_flushes=state.early_flushes + early.astype(jnp.int32),
        )
        new_state = jax.tree_util.tree_map(
            lambda old, new: jnp.where(skip, old, new), state._replace(skip_state=skip_state), stepped
        )

        def unskip(x):
            if isinstance(x, RowSparseArray):
                return rows_from_parts(
                    x.shape, jnp.where(skip, 0, x.data), jnp.where(skip, x.shape[0], x.indices), x.unique_indices
                )
            return from_pair(jnp.where(skip, 0, x.data), x.mask & ~skip)

        return jax.tree_util.tree_map(unskip, u, is_leaf=is_masked_leaf), new_state

    return optax.GradientTransformation(init_fn, update_fn)
