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
import optax

from masked_jax._core import MaskedArray, is_container
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
        raise ValueError("lazy(optax.MultiSteps(...)): this optax version's MultiSteps does not expose its inner "
                         "transformation and schedule; use optax.MultiSteps(lazy(inner), k) with plain "
                         "gradients instead.") from None


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
        params = jax.tree_util.tree_map(data_of, params, is_leaf=is_container)
        touched = jax.tree_util.tree_map(lambda p: jnp.zeros(jnp.shape(p), bool), params)
        return LazyMultiStepsState(ms.init(params), touched)

    def update_fn(updates, state, params=None):
        if params is not None:
            params = jax.tree_util.tree_map(data_of, params, is_leaf=is_container)
        st = state.multi_steps
        leaves, treedef = jax.tree_util.tree_flatten(updates, is_leaf=is_container)
        dense = [_dense(g) for g in leaves]
        grads = treedef.unflatten([d for d, _ in dense])
        valid = treedef.unflatten([m for _, m in dense])
        k = every_k(st.gradient_step)
        skip, skip_state = should_skip(grads, st.gradient_step, params)

        acc = jax.tree_util.tree_map(lambda g, a: acc_update(g, a, n_acc=st.mini_step).astype(acc_dtype),
                                     grads, st.acc_grads)
        touched = jax.tree_util.tree_map(jnp.logical_or, state.touched, valid)
        emit = st.mini_step == k - 1
        masked_acc = jax.tree_util.tree_map(lambda a, t, g: MaskedArray._from_pair(a.astype(g.dtype), t),
                                            acc, touched, grads)
        u, new_inner = lazy_inner.update(masked_acc, st.inner_opt_state, params)
        u = jax.tree_util.tree_map(lambda x: MaskedArray._from_pair(jnp.where(emit, x.data, 0), x.mask & emit),
                                   u, is_leaf=is_container)
        stepped = optax.MultiStepsState(
            mini_step=(st.mini_step + 1) % k,
            gradient_step=jnp.where(emit, st.gradient_step + 1, st.gradient_step),
            inner_opt_state=jax.tree_util.tree_map(lambda new, old: jnp.where(emit, new, old),
                                                   new_inner, st.inner_opt_state),
            acc_grads=jax.tree_util.tree_map(lambda a: jnp.where(emit, jnp.zeros_like(a), a), acc),
            skip_state=skip_state)
        touched = jax.tree_util.tree_map(lambda t: t & ~emit, touched)
        # a skipped micro-step (should_skip_update_fn) leaves everything as it was
        new_state = jax.tree_util.tree_map(lambda old, new: jnp.where(skip, old, new),
                                           LazyMultiStepsState(st._replace(skip_state=skip_state), state.touched),
                                           LazyMultiStepsState(stepped, touched))
        u = jax.tree_util.tree_map(lambda x: MaskedArray._from_pair(jnp.where(skip, 0, x.data), x.mask & ~skip),
                                   u, is_leaf=is_container)
        return u, new_state

    return optax.GradientTransformation(init_fn, update_fn)
