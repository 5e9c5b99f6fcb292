"""Row-sharded tables: a lazy optimizer step in which every device updates its own rows.

A table of shape (N, ...) sharded by rows over a mesh axis of D devices holds rows
``[d * N / D, (d + 1) * N / D)`` on device ``d``. Its row-sparse gradient (K rows,
replicated: every device computed the same loss) is routed inside a ``shard_map``:
each device keeps the ids it owns (an O(K) scan), compacts them into a static
``capacity`` of rows, and runs the optimizer and :func:`apply_updates` on those rows
of its own shard of the parameters and optimizer state. No table, parameter or
state shard ever leaves its device, and per-device work is O(K + capacity x dim),
with ``capacity`` about ``2 K / D``. A device that owns more ids than ``capacity``
(ids concentrated in one shard) instead takes an exact path that scans all K stored
rows (O(K x dim) on that device, still in place), so the capacity decides the speed,
never the result.

Running the optimizer per shard is exact when it acts entry by entry (sgd,
momentum, adam, adamw, adagrad, rmsprop, lion, schedules, ``add_decayed_weights``)
or row by row (``rowwise_adagrad``, whose per-row sums are sharded with their rows):
rows of different shards never meet. Transformations that combine entries
(``clip_by_global_norm``, trust ratios) would see only their shard's rows; they are
detected by a probe and rejected.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from masked_jax._core import SparseMasked, from_pair, is_masked, is_masked_leaf
from masked_jax.layouts import RowSparseArray, rows_from_parts, take_rows
from masked_jax.optim._apply import apply_updates
from masked_jax.optim._lazy import check_transformation
from masked_jax.optim._state import _local_from, _map_local, _Reference


class _Spec:
    """A PartitionSpec or sharding placed at a leaf of the state tree (apart from the state's leaves)."""

    def __init__(self, spec):
        self.spec = spec


def _check_entrywise(optimizer) -> None:
    """Reject transformations whose update of one row depends on another row.

    Probe: a 2 x 2 parameter; row 1 of the gradient, parameter and per-entry state
    is poisoned (huge, then NaN); row 0 of the update must not move.
    """
    with jax.ensure_compile_time_eval():
        params = jnp.array([[0.5, -0.25], [0.75, 1.5]], jnp.float32)
        grad = jnp.array([[0.3, -0.7], [0.2, 0.1]], jnp.float32)
        state = optimizer.init(params)
        ref = _Reference.of(params)
        base, _ = optimizer.update(grad, state, params)
        for poison in (1e30, float("nan")):
            spoil = lambda x, poison=poison: x.at[1].set(poison) if jnp.issubdtype(x.dtype, jnp.inexact) else x  # noqa: E731
            bad_state = _map_local(ref, lambda leaves, _, spoil=spoil: [spoil(x) for x in leaves], state)
            moved, _ = optimizer.update(spoil(grad), bad_state, spoil(params))
            if not np.allclose(np.asarray(moved[0]), np.asarray(base[0]), rtol=1e-6, atol=0):
                raise ValueError(
                    "sharded_update cannot run this optimizer shard by shard: the update of one row "
                    "depends on other rows (probe: poisoning row 1 changed row 0). Transformations "
                    "that combine entries, such as optax.clip_by_global_norm or trust ratios "
                    "(LARS/LAMB), need every touched row on one device: use the unsharded step, or "
                    "clip per entry (optax.clip) instead."
                )


def default_capacity(k: int, d: int) -> int:
    """Rows each device processes on the fast path: twice its fair share ``K / D`` (at least 16)."""
    return min(k, max(2 * math.ceil(k / d), 16))


def _own(g: RowSparseArray, device, n_local: int):
    """Per stored row of ``g``: is it on this device, and its index within the shard."""
    valid = (g.indices >= 0) & (g.indices < g.shape[0])
    local = g.indices - device * n_local
    own = valid & (local >= 0) & (local < n_local)
    return own, jnp.where(own, local, n_local).astype(jnp.int32)


def _route(g: RowSparseArray, selected, local, n_local: int, capacity: int) -> RowSparseArray:
    """The ``selected`` rows of ``g`` (owned by this device) as a row-sparse array of its shard,
    compacted into ``capacity`` rows (O(K) to find them, O(capacity x dim) to move them)."""
    shape = (n_local,) + tuple(g.shape[1:])
    if capacity >= g.nse:  # every stored row; rows not selected become padding (index n_local)
        return rows_from_parts(shape, g.data, jnp.where(selected, local, n_local))
    pos = jnp.nonzero(selected, size=capacity, fill_value=g.nse)[0]
    data = take_rows(g.data, pos)
    return rows_from_parts(shape, data, take_rows(local, pos, n_local))


def _only_if(g, take):
    """A dense or masked gradient that is valid only when ``take`` (traced bool): absent otherwise."""
    if take is True:
        return g
    if isinstance(g, SparseMasked):
        g = g.todense()
    if is_masked(g):
        return from_pair(g.data, g.mask & take)
    g = jnp.asarray(g)
    return from_pair(g, jnp.broadcast_to(take, g.shape))


def sharded_update(
    optimizer: optax.GradientTransformation,
    grads,
    opt_state,
    params,
    *,
    mesh: Mesh,
    axis: str,
    capacity: int | None = None,
):
    """One optimizer step on tables sharded by rows: ``(new_params, new_opt_state)``.

    Parameters whose gradient is a :class:`RowSparseArray` are tables sharded by rows
    over the mesh axis ``axis`` (their first dimension must divide evenly), as are
    their per-entry and per-row optimizer state leaves (adam's ``mu`` and ``nu``,
    ``rowwise_adagrad``'s one sum per row). Every device
    updates the rows it owns, in place when the caller donates, with O(K + capacity x
    dim) work and no communication: the gradient (K rows) is replicated, ids are
    routed to their owning shard, and no table is ever gathered. Other parameters
    (dense or masked gradients) and global state (step counts) are treated as
    replicated and updated identically on every device.

    Use it inside ``jit``, or through :func:`make_train_step` with ``mesh=``.
    The optimizer must handle row-sparse gradients (:func:`lazy` or
    :func:`masked_adagrad`, :func:`rowwise_adagrad`) and act entry by entry or row by
    row (see the module notes); one that
    combines rows is rejected with a ``ValueError``. The mesh should have ``Auto``
    axis types (``jax.sharding.Mesh(devices, names)``).

    Args:
        optimizer: the transformation (``lazy(inner)``, ``masked_adagrad``, ...).
        grads, opt_state, params: as for ``optimizer.update`` and :func:`apply_updates`.
        mesh: the device mesh; axis: the mesh axis the tables' rows are sharded over.
        capacity: ids one device processes on its fast path (default: ``2 K / D``,
            at least 16). A device owning more ids takes the exact path over all K rows.

    Examples:
        >>> import numpy as np, jax, jax.numpy as jnp, optax, masked_jax as mj
        >>> from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
        >>> from masked_jax import optim
        >>> mesh = Mesh(np.array(jax.devices()), ("rows",))
        >>> table = jax.device_put(jnp.zeros((8, 2)), NamedSharding(mesh, P("rows")))
        >>> opt = optim.lazy(optax.sgd(1.0))
        >>> g = mj.row_sparse(jnp.ones((2, 2)), jnp.array([5, 5]), (8, 2))
        >>> step = jax.jit(lambda g, s, p: optim.sharded_update(opt, g, s, p, mesh=mesh, axis="rows"))
        >>> table, _ = step(g, opt.init(table), table)
        >>> table[5]
        Array([-2., -2.], dtype=float32)
    """
    check_transformation(optimizer, "optimizer")
    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh must be a jax.sharding.Mesh; got {type(mesh).__name__}.")
    if axis not in mesh.shape:
        raise ValueError(f"axis {axis!r} is not an axis of the mesh (axes: {tuple(mesh.shape)}).")
    n_dev = mesh.shape[axis]
    g_leaves, treedef = jax.tree_util.tree_flatten(grads, is_leaf=is_masked_leaf)
    p_leaves = treedef.flatten_up_to(params)
    rows = [isinstance(g, RowSparseArray) for g in g_leaves]
    for g, p, r in zip(g_leaves, p_leaves, rows):
        if r and (is_masked_leaf(p) or np.shape(p) != tuple(g.shape)):
            raise ValueError(
                f"sharded_update: a row-sparse gradient of shape {tuple(g.shape)} needs a plain "
                f"array parameter of the same shape (the table); got {type(p).__name__} of "
                f"shape {np.shape(p)}."
            )
        if r and g.shape[0] % n_dev:
            raise ValueError(
                f"sharded_update: a table of {g.shape[0]} rows cannot be split evenly over the "
                f"{n_dev} devices of mesh axis {axis!r}; pad it to a multiple of {n_dev} rows."
            )
    _check_entrywise(optimizer)

    p_specs = [P(axis) if r else P() for r in rows]
    marked = _map_local(
        _Reference.of(grads), lambda _, per_row: [_Spec(P(*s[:1]) if per_row else s) for s in p_specs], opt_state
    )
    state_specs = jax.tree_util.tree_map(
        lambda x: x.spec if isinstance(x, _Spec) else P(), marked, is_leaf=lambda x: isinstance(x, _Spec)
    )
    caps = [
        (default_capacity(g.nse, n_dev) if capacity is None else min(int(capacity), g.nse)) if r else 0
        for g, r in zip(g_leaves, rows)
    ]

    def local_step(grads, state, params):
        device = jax.lax.axis_index(axis)
        leaves = treedef.flatten_up_to(grads)
        owned: list[Any] = [_own(g, device, g.shape[0] // n_dev) if r else None for g, r in zip(leaves, rows)]
        capped = [jnp.sum(o[0]) <= c for o, r, c, g in zip(owned, rows, caps, leaves) if r and c < g.nse]
        ref = _Reference.of(params)

        def run(params, carry_state, full, take):
            """Update with every owned row (``full``: all K stored rows scanned) or the owned rows
            compacted into ``capacity``; nothing is touched where ``take`` is False."""
            local = [
                _route(g, o[0] & take, o[1], g.shape[0] // n_dev, g.nse if full else c) if r else _only_if(g, take)
                for g, o, r, c in zip(leaves, owned, rows, caps)
            ]
            # per-entry and per-row state from the carry, global state (step counts) from the step's input
            st = _local_from(ref, carry_state, state)
            updates, new_state = optimizer.update(treedef.unflatten(local), st, params)
            return apply_updates(params, updates), new_state

        if not capped:  # capacity covers every stored row
            return run(params, state, True, True)
        fits = jnp.all(jnp.stack(capped))
        new_params, new_state = run(params, state, False, fits)
        # A device owning more ids than its capacity runs the exact all-rows path instead: a
        # while_loop of zero or one trips (a loop, unlike lax.cond, keeps the update in place).
        _, new_params, new_state = jax.lax.while_loop(
            lambda c: c[0], lambda c: (jnp.bool_(False), *run(c[1], c[2], True, True)), (~fits, new_params, new_state)
        )
        return new_params, new_state

    param_specs = treedef.unflatten(p_specs)
    return jax.shard_map(
        local_step,
        mesh=mesh,
        in_specs=(P(), state_specs, param_specs),
        out_specs=(param_specs, state_specs),
        check_vma=False,
    )(grads, opt_state, params)


def init_sharded(optimizer: optax.GradientTransformation, params):
    """``optimizer.init(params)`` with each per-entry state leaf placed like its parameter.

    ``jax.jit(optimizer.init)`` creates its zeros without looking at where the
    parameters live, so adam's ``mu`` and ``nu`` of a row-sharded table would land
    whole on one device. Here every parameter-shaped state leaf gets its
    parameter's sharding, every row-shaped one (``rowwise_adagrad``'s sums) its
    parameter's sharding of rows, and global state (step counts) is replicated over the
    same mesh; the state is created in place, shard by shard. Parameters that are not
    sharded give the plain ``optimizer.init(params)``.

    Examples:
        >>> import numpy as np, jax, jax.numpy as jnp, optax
        >>> from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
        >>> from masked_jax import optim
        >>> mesh = Mesh(np.array(jax.devices()), ("rows",))
        >>> table = jax.device_put(jnp.zeros((8, 2)), NamedSharding(mesh, P("rows")))
        >>> state = optim.init_sharded(optim.lazy(optax.adam(0.1)), table)
        >>> state[0].mu.sharding.spec
        P('rows',)
    """
    check_transformation(optimizer, "optimizer")
    leaves = jax.tree_util.tree_leaves(params, is_leaf=is_masked_leaf)
    data = [x.data if is_masked(x) else x for x in leaves]
    named = [getattr(x, "sharding", None) for x in data]
    named = [sh if isinstance(sh, NamedSharding) else None for sh in named]
    mesh = next((sh.mesh for sh in named if sh is not None), None)
    if mesh is None:
        return optimizer.init(params)
    replicated = NamedSharding(mesh, P())
    placed = [sh if sh is not None else replicated for sh in named]
    shapes = jax.eval_shape(optimizer.init, params)
    marked = _map_local(
        _Reference.of(params),
        lambda _, per_row: [_Spec(NamedSharding(mesh, P(*sh.spec[:1])) if per_row else sh) for sh in placed],
        shapes,
    )
    out = jax.tree_util.tree_map(
        lambda x: x.spec if isinstance(x, _Spec) else replicated, marked, is_leaf=lambda x: isinstance(x, _Spec)
    )
    return jax.jit(optimizer.init, out_shardings=out)(params)
