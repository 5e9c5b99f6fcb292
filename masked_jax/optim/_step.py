"""A jitted training step that donates parameters and optimizer state."""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import jax
import optax

from masked_jax._ad import value_and_grad
from masked_jax._core import SparseMasked, is_masked_leaf
from masked_jax.optim._apply import add_updates
from masked_jax.optim._chunked import chunkable, chunked_update
from masked_jax.optim._fused import fused_tables, fused_update
from masked_jax.optim._lazy import check_transformation
from masked_jax.optim._sharded import sharded_update
from masked_jax.optim._state import is_row_local, lazy_inner


def make_train_step(
    loss_fn: Callable,
    optimizer: optax.GradientTransformation,
    *,
    has_aux: bool = False,
    row_sparse=None,
    donate: bool = True,
    mesh=None,
    axis: str | None = None,
    capacity: int | None = None,
    chunk_rows: int | None = 8192,
    fused_rows: bool = False,
) -> Callable:
    """``step(params, opt_state, *batch) -> (params, opt_state, loss)``, jitted with donation.

    The step differentiates ``loss_fn(params, *batch)`` with :func:`mj.value_and_grad
    <masked_jax.value_and_grad>` (``row_sparse`` selects tables whose gradient is
    row-sparse, read with :func:`mj.lookup <masked_jax.lookup>`), runs
    ``optimizer.update`` and :func:`apply_updates`. ``params`` and ``opt_state`` are
    donated, so XLA updates them in place: without donation every step copies the
    whole table (``benchmarks/README.md`` has the cost). The
    arrays passed in are consumed: always continue with the returned ones.
    With ``has_aux=True`` the loss is ``(loss, aux)``.

    With a :func:`lazy` optimizer whose inner transformation works entry by entry (adam, sgd,
    momentum, adagrad, rmsprop, decoupled weight decay; read off its jaxpr when the step is
    traced), each row-sparse table whose gradient stores more than ``chunk_rows`` rows is updated
    in chunks of ``chunk_rows`` of its distinct touched rows, on the CPU: a loop gathers a chunk of
    the table and its state, updates it and scatters it back, and stops after the last touched
    row. Every temporary is then a ``chunk_rows x dim`` block that stays in cache, and the padding
    slots of the gradient are never visited (faster than one update of all slots for large
    gradients: ``benchmarks/README.md``), with ``catch_up`` as well, and with
    :func:`rowwise_adagrad` (which updates each row from that row alone). The result is the
    one-call update's up to rounding. Transformations that combine entries (global-norm clipping, trust
    ratios, finiteness checks), ``MultiSteps`` and other optimizers get the one-call update;
    ``chunk_rows=None`` asks for it always.

    With ``fused_rows=True``, on an NVIDIA GPU (CUDA), each row-sparse table of such an optimizer
    is instead updated by one Pallas (Triton) kernel that also sums its duplicate rows: the ids
    are sorted with their positions, and each kernel program sums the gradient rows of the
    distinct rows that start in its block of sorted positions, reads their parameters and state,
    runs the inner transformation and writes them back in place, so no coalesced gradient is
    stored and read again. Exact for the same optimizers, whose global state must be scalars
    (step counts), without ``catch_up``; for each table that is a plain array of fewer than 2**31
    entries (the kernel's offsets are 32-bit), other tables getting the one-call update beside it.
    Elsewhere (the CPU, other accelerators, other optimizers, ``mesh``) the step is the one it
    would be without it.

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
    check_transformation(optimizer, "optimizer")
    if (mesh is None) != (axis is None):
        raise ValueError(
            "make_train_step: give both mesh and axis (the mesh axis the tables' rows are sharded over), or neither."
        )
    if chunk_rows is not None and (isinstance(chunk_rows, bool) or not isinstance(chunk_rows, int) or chunk_rows < 1):
        raise ValueError(f"make_train_step: chunk_rows must be a positive int or None; got {chunk_rows!r}.")
    if not isinstance(fused_rows, bool):
        raise ValueError(f"make_train_step: fused_rows must be a bool; got {fused_rows!r}.")
    loss_and_grad = value_and_grad(loss_fn, has_aux=has_aux, row_sparse=row_sparse)
    # the library's lazy optimizers store each row of an update once: no duplicates to add up
    coalesced = lazy_inner(optimizer) is not None or is_row_local(optimizer)

    def apply_updates(params, updates):
        return add_updates(params, updates, coalesced=coalesced)

    def step(params, opt_state, *batch, **kwargs):
        value, grads = loss_and_grad(params, *batch, **kwargs)
        if mesh is not None:
            params, opt_state = sharded_update(
                optimizer, grads, opt_state, params, mesh=mesh, axis=cast(str, axis), capacity=capacity
            )
            return params, opt_state, value
        branches = {}
        if chunk_rows is not None and chunkable(optimizer, grads, opt_state, params, chunk_rows):
            # on the CPU only: on a GPU each trip of the loop waits for the host to read its predicate
            rows = chunk_rows
            branches["cpu"] = lambda p, s, g: chunked_update(optimizer, g, s, p, apply_updates, rows)
        tables = fused_tables(optimizer, grads, opt_state, params) if fused_rows else []
        if tables:
            branches["cuda"] = lambda p, s, g: fused_update(optimizer, g, s, p, apply_updates, tables=tables)
        if branches:
            params, opt_state = jax.lax.platform_dependent(
                params, opt_state, grads, default=lambda p, s, g: one_call(g, s, p), **branches
            )
            return params, opt_state, value
        return *one_call(grads, opt_state, params), value

    def one_call(grads, opt_state, params):
        try:
            updates, opt_state = optimizer.update(grads, opt_state, params)
        except (TypeError, ValueError) as error:
            sparse = [
                type(g).__name__
                for g in jax.tree_util.tree_leaves(grads, is_leaf=is_masked_leaf)
                if isinstance(g, SparseMasked)
            ]
            if sparse and not coalesced:  # a plain optax optimizer meets a row-sparse gradient
                raise TypeError(
                    f"make_train_step: the optimizer failed on {sparse[0]} gradients (row_sparse=...): "
                    "a plain optax optimizer treats every leaf of a gradient as values, the row "
                    "indices too. Wrap it in optim.lazy(...), which updates only the rows "
                    f"stored. The optimizer's error: {error}"
                ) from error
            raise
        return apply_updates(params, updates), opt_state

    return jax.jit(step, donate_argnums=(0, 1) if donate else ())
