"""A jitted training step that donates parameters and optimizer state."""

from __future__ import annotations

from typing import Callable

import jax
import optax

from masked_jax._ad import value_and_grad
from masked_jax.optim._apply import apply_updates
from masked_jax.optim._lazy import _check_transformation
from masked_jax.optim._sharded import sharded_update


def make_train_step(loss_fn: Callable, optimizer: optax.GradientTransformation, *,
                    has_aux: bool = False, row_sparse=None, donate: bool = True, mesh=None,
                    axis: str | None = None, capacity: int | None = None) -> Callable:
    """``step(params, opt_state, *batch) -> (params, opt_state, loss)``, jitted with donation.

    The step differentiates ``loss_fn(params, *batch)`` with :func:`mj.value_and_grad
    <masked_jax.value_and_grad>` (``row_sparse`` selects tables whose gradient is
    row-sparse, read with :func:`mj.lookup <masked_jax.lookup>`), runs
    ``optimizer.update`` and :func:`apply_updates`. ``params`` and ``opt_state`` are
    donated, so XLA updates them in place: without donation every step copies the
    whole table (measured 659 ms against 0.89 ms per step on a 2M x 64 table). The
    arrays passed in are consumed: always continue with the returned ones.
    With ``has_aux=True`` the loss is ``(loss, aux)``.

    With ``mesh`` and ``axis``, tables sharded by rows over that mesh axis are
    updated shard by shard (:func:`sharded_update`: every device updates the rows it
    owns, no table is gathered); create their state with :func:`init_sharded`.

    Examples:
        >>> import jax.numpy as jnp, optax, masked_jax as mj
        >>> from masked_jax import optim
        >>> loss = lambda p, ids: jnp.sum((mj.lookup(p["emb"], ids) - 1.0) ** 2)
        >>> step = optim.make_train_step(loss, optim.lazy(optax.sgd(0.25)), row_sparse=True)
        >>> params = {"emb": jnp.zeros((1000, 2))}
        >>> state = optim.lazy(optax.sgd(0.25)).init(params)
        >>> params, state, value = step(params, state, jnp.array([7, 3]))
        >>> params["emb"][7], value
        (Array([0.5, 0.5], dtype=float32), Array(4., dtype=float32))
    """

    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable as loss_fn(params, *batch); got {type(loss_fn).__name__}.")
    _check_transformation(optimizer, "optimizer")
    if (mesh is None) != (axis is None):
        raise ValueError("make_train_step: give both mesh and axis (the mesh axis the tables' rows are "
                         "sharded over), or neither.")
    loss_and_grad = value_and_grad(loss_fn, has_aux=has_aux, row_sparse=row_sparse)

    def step(params, opt_state, *batch, **kwargs):
        value, grads = loss_and_grad(params, *batch, **kwargs)
        if mesh is not None:
            params, opt_state = sharded_update(optimizer, grads, opt_state, params, mesh=mesh, axis=axis,
                                               capacity=capacity)
            return params, opt_state, value
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return apply_updates(params, updates), opt_state, value

    return jax.jit(step, donate_argnums=(0, 1) if donate else ())
