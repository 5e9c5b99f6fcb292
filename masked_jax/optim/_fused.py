"""A row-sparse lazy update in one GPU kernel per table, duplicates summed inside it.

The one-call lazy update of a row-sparse table with duplicate ids runs two programs: the
duplicates are summed into a coalesced gradient, which the update then reads. Here the ids are
sorted with their positions, and one Pallas (Triton) kernel program per block of sorted positions
finds the distinct rows that start there, sums each one's duplicate gradient rows (read through
the sort's permutation), reads the row's parameter and state, runs the inner transformation on
them and writes them back in place: no coalesced gradient is stored or read. A program reads a
run of one id only up to the end of its block; the rest of a longer run (a hot id, over many
blocks) is summed beforehand, in parallel: a light carry kernel sums each block's share of it,
a segment sum adds the shares of each run, and the run's first program adds one row. Exact for inner
transformations that work entry by entry (:func:`~masked_jax.optim._chunked.entrywise`), whose
global state is scalars; the global state (step counts) then advances once, as in the one-call
update.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from masked_jax import _jaxpr
from masked_jax._core import is_masked_leaf
from masked_jax.layouts import sorted_totals
from masked_jax.optim._catch_up import LazyCatchUpState
from masked_jax.optim._chunked import empty_leaf, entrywise, row_sparse_leaves
from masked_jax.optim._lazy import check_update_arguments
from masked_jax.optim._state import _map_param_shaped, _Reference, lazy_inner

MAX_ENTRIES = 2**31  # the kernel addresses a table's entries with 32-bit offsets


class KernelConfig(NamedTuple):
    """How the kernel is cut: each program holds up to ``max_block_rows`` sorted positions, and up
    to ``block_elements`` entries (rows x padded row width); ``num_warps`` per program."""

    block_elements: int = 2048
    max_block_rows: int = 64
    num_warps: int = 4


DEFAULT_CONFIG = KernelConfig()  # one immutable value, the default of every `config=`


def _owners(ref, state):
    """Per flat leaf of ``state``: the index of the parameter leaf it is shaped like (an int), or
    the leaf itself where it is global state (step counts)."""
    return jax.tree_util.tree_leaves(_map_param_shaped(ref, lambda leaves: list(range(len(leaves))), state))


def _owned(owners, i):
    """The positions of the state leaves shaped like parameter leaf ``i``."""
    return [k for k, o in enumerate(owners) if isinstance(o, int) and o == i]


def fused_tables(optimizer, grads, state, params) -> list:
    """The gradient leaves :func:`fused_update` updates in a kernel (decided at trace time): none
    unless ``optimizer`` is a plain lazy lift (no catch-up, not ``MultiSteps``) whose inner
    transformation works entry by entry with scalar global state; then the row-sparse leaves whose
    table is a plain array of fewer than 2**31 entries (the kernel's offsets are 32-bit)."""
    inner = lazy_inner(optimizer)
    leaves, treedef = jax.tree_util.tree_flatten(grads, is_leaf=is_masked_leaf)
    tables = row_sparse_leaves(leaves, 0)
    if (
        inner is None
        or params is None
        or isinstance(state, LazyCatchUpState)
        or not tables
        or any(not (is_masked_leaf(g) or isinstance(g, jax.Array)) for g in leaves)
    ):
        return []
    check_update_arguments(inner, grads, state, params)
    p_leaves = treedef.flatten_up_to(params)
    owners = _owners(_Reference.of(grads), state)
    if any(not isinstance(o, int) and np.ndim(o) != 0 for o in owners) or not entrywise(inner, grads, state, params):
        return []
    state_leaves, state_def = jax.tree_util.tree_flatten(state)

    def plans(i):  # the kernel program can be planned (shapes only)
        try:
            jax.eval_shape(
                lambda s: _prepare(inner, i, treedef, state_def, owners, leaves, s, p_leaves)[1], state_leaves
            )
        except ValueError:
            return False
        return True

    return [
        i
        for i in tables
        if not is_masked_leaf(p_leaves[i])  # masked tables: the one-call update
        and 0 < np.prod(p_leaves[i].shape)  # an empty table (no rows, or rows of no entries) has nothing to update
        and max(np.prod(p_leaves[i].shape), np.prod(leaves[i].data.shape)) < MAX_ENTRIES
        and plans(i)
    ]


def fusable(optimizer, grads, state, params) -> bool:
    """Does :func:`fused_update` update some table of this step in a kernel (:func:`fused_tables`)?"""
    return bool(fused_tables(optimizer, grads, state, params))


def _pow2(x: int) -> int:
    return 1 << max(0, int(x) - 1).bit_length()


_NARROW = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def _widen(x):
    return x.astype(jnp.float32) if jnp.result_type(x) in _NARROW else x


def _bind_widened(eqn, ins):
    """The outputs of ``eqn`` on ``ins``, 16-bit floats computed in float32 and rounded back after
    the op (what XLA's GPU backend does too): Triton lowers little arithmetic on them."""
    if eqn.primitive.name == "convert_element_type" or not any(jnp.result_type(x) in _NARROW for x in ins):
        return _jaxpr.bind(eqn, ins)
    outs = _jaxpr.bind(eqn, [_widen(x) for x in ins])
    return [o.astype(v.aval.dtype) if v.aval.dtype in _NARROW else o for o, v in zip(outs, eqn.outvars)]


class _Plan:
    """The inner update of one table's block of rows as a flat program, split in two: the scalar
    work that reads no row (step counts, bias corrections, schedules), run outside the kernel, and
    the rest, run in the kernel on the rows with the scalars it needs (``hoisted``) loaded."""

    def __init__(self, inner, i, treedef, state_def, owners, block_avals, known_avals):
        n_leaves = treedef.num_leaves

        def update(*flat):  # flat: gradient leaves, state leaves, parameter leaves
            g = jax.tree_util.tree_unflatten(treedef, flat[:n_leaves])
            state = jax.tree_util.tree_unflatten(state_def, flat[n_leaves : n_leaves + len(owners)])
            p = jax.tree_util.tree_unflatten(treedef, flat[n_leaves + len(owners) :])
            u, new_state = inner.update(g, state, p)
            new_leaves = jax.tree_util.tree_leaves(new_state)
            return [treedef.flatten_up_to(u)[i]] + [new_leaves[k] for k in _owned(owners, i)]

        # the inputs: this table's rows as (block, width) blocks; everything else is known outside
        # (other leaves as scalar stand-ins, which an entrywise update computes nothing of this
        # table from, and the global state)
        self.rows_at = [i, *(n_leaves + k for k in _owned(owners, i)), n_leaves + len(owners) + i]
        avals = list(known_avals)
        for pos, aval in zip(self.rows_at, block_avals):
            avals[pos] = aval
        closed = jax.make_jaxpr(update)(*avals)
        self.flat = jax.make_jaxpr(lambda *a: _jaxpr.inline(closed.jaxpr, closed.consts, a))(*avals)

    def split(self, known_values):
        """Run the scalar work on ``known_values`` (per input, ``None`` at the rows' positions):
        ``(hoisted_values, in_kernel)``, where ``in_kernel(hoisted, rows)`` runs the rest."""
        jaxpr = self.flat.jaxpr
        env = dict(zip(jaxpr.constvars, self.flat.consts))
        env.update((v, x) for v, x in zip(jaxpr.invars, known_values) if x is not None)
        rest = []
        for eqn in jaxpr.eqns:
            if all(_jaxpr.is_literal(v) or v in env for v in eqn.invars) and all(
                np.ndim(v.aval) == 0 for v in eqn.outvars
            ):
                env.update(zip(eqn.outvars, _jaxpr.bind(eqn, [_jaxpr.read(env, v) for v in eqn.invars])))
            else:
                rest.append(eqn)
        needed = {v for eqn in rest for v in eqn.invars if not _jaxpr.is_literal(v)} | {
            v for v in jaxpr.outvars if not _jaxpr.is_literal(v)
        }
        hoisted = [v for v in env if v in needed]
        if any(np.ndim(env[v]) != 0 for v in hoisted):
            raise ValueError(
                "lazy: this transformation's update reads a non-scalar constant in every row; "
                "it cannot run in the fused kernel."
            )
        rows_vars = [jaxpr.invars[pos] for pos in self.rows_at]

        def in_kernel(hoisted_values, rows):
            local = dict(zip(hoisted, hoisted_values))
            local.update(zip(rows_vars, rows))
            for eqn in rest:
                local.update(zip(eqn.outvars, _bind_widened(eqn, [_jaxpr.read(local, v) for v in eqn.invars])))
            return [_jaxpr.read(local, v) for v in jaxpr.outvars]

        return [env[v] for v in hoisted], in_kernel


def _gradient_rows(perm_ref, g_ref, at, take, cols, in_row):
    """The gradient rows (as float32) at sorted positions ``at``, 0 where not ``take``."""
    from jax.experimental.pallas import triton as plgpu

    src = plgpu.load(perm_ref.at[jnp.where(take, at, 0)], mask=take, other=0)
    return plgpu.load(g_ref.at[src[:, None], cols[None, :]], mask=take[:, None] & in_row[None, :], other=0).astype(
        jnp.float32
    )


def _one(i):
    """A traced scalar index as a ``(1,)`` vector, the form Triton loads and stores take."""
    return i + jnp.zeros((1,), jnp.int32)


def _carry_kernel(n, d, block):
    """The kernel that sums, per block of sorted positions, the gradient rows at its start that
    continue the previous block's last run (a ``(1, width)`` row, 0 if none). It reads that
    run's id itself: passed in, ``_onward``'s slice of the ids would cost one more XLA kernel."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    def kernel(ids_ref, perm_ref, g_ref, carry_ref):
        here = _one(pl.program_id(0))
        j = here * block + jnp.arange(block)
        cols = jnp.arange(_pow2(d))
        prev = jnp.where(here == 0, n, plgpu.load(ids_ref.at[jnp.maximum(here * block - 1, 0)]))
        going = (plgpu.load(ids_ref.at[j]) == prev) & (prev < n)
        rows = _gradient_rows(perm_ref, g_ref, j, going, cols, cols < d)
        plgpu.store(carry_ref.at[here[:, None], cols[None, :]], jnp.sum(rows, axis=0, keepdims=True))

    return kernel


def _whole_call(kernel, operands, out_shape, grid, interpret, config, aliases=None):
    """``kernel`` over ``grid`` programs, each seeing every operand and output whole."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    whole = lambda x: pl.BlockSpec(x.shape, lambda b: (0,) * len(x.shape))  # noqa: E731
    return pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=grid,
        in_specs=[whole(x) for x in operands],
        out_specs=[whole(x) for x in out_shape],
        input_output_aliases=aliases or {},
        interpret=interpret,
        compiler_params=None if interpret else plgpu.CompilerParams(num_warps=config.num_warps),
    )(*operands)


def _onward(ids, perm, g, n, d, block, interpret, config):
    """``(blocks + 1, width)`` float32: row ``b`` is the sum of the gradient rows, in block ``b``
    and after it, of the run that starts in block ``b - 1`` and goes on past its end (0 if none).
    The carry kernel sums each block's share of the run it continues, all blocks in parallel;
    a segment sum adds up the shares of each run, keyed by the block after the one the run starts
    in (a running maximum over the blocks not filled by a run), so that no run, however long,
    costs one program serial work."""
    blocks, width = (ids.shape[0] - 1) // block, _pow2(d)
    last = ids[block - 1 : -1 : block]  # each block's last id
    prev = jnp.concatenate([jnp.full((1,), n, ids.dtype), last[:-1]])  # the run each block continues
    carry = _whole_call(
        _carry_kernel(n, d, block),
        [ids, perm, g],
        [jax.ShapeDtypeStruct((blocks, width), jnp.float32)],
        (blocks,),
        interpret,
        config,
    )[0]
    filled = (last == prev) & (prev < n)  # the block holds nothing else
    # a run starts in the last block before this one that it does not fill
    starts = jax.lax.cummax(jnp.where(filled, 0, jnp.arange(blocks)))
    key = jnp.where(prev < n, jnp.concatenate([jnp.zeros((1,), starts.dtype), starts[:-1]]) + 1, blocks)
    # (sorted keys summed by a segmented scan, one write per key: no scatter-add of repeated indices)
    return sorted_totals(carry, key, blocks + 1)


def _table_kernel(in_kernel, n_hoisted, hoisted_dtypes, n_rows_refs, n, d, block, unique):
    """The kernel for one ``n x d`` table (as flattened rows): see the module."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    def kernel(ids_ref, perm_ref, g_ref, *refs):
        onward_ref, refs = (None, refs) if unique else (refs[0], refs[1:])
        scalar_refs, out_refs = refs[:n_hoisted], refs[n_hoisted + n_rows_refs :]  # inputs aliased to outputs
        b = pl.program_id(0)
        j = b * block + jnp.arange(block)
        cols = jnp.arange(_pow2(d))
        in_row = cols < d
        ids = plgpu.load(ids_ref.at[j])
        lead = (ids < n) & ((j == 0) | (ids != plgpu.load(ids_ref.at[jnp.maximum(j - 1, 0)])))
        # the rows' parameter and state, loaded first: their reads overlap the gradient's. Lanes
        # that start no run point past the table: their masked loads and stores touch nothing (in
        # Pallas' interpreter too, which drops such a store)
        at = (jnp.where(lead, ids, n)[:, None], cols[None, :])
        live = lead[:, None] & in_row[None, :]
        rows = [plgpu.load(r.at[at], mask=live, other=0) for r in out_refs]  # parameter, then state
        acc = _gradient_rows(perm_ref, g_ref, j, lead, cols, in_row)
        if not unique:  # a position that starts a run reads on to the end of the run or of the block
            end = (b + 1) * block

            def more(carry):
                return jnp.max(carry[2].astype(jnp.int32)) > 0  # (Triton lowers no reduce_or)

            def add(carry):
                t, acc, going = carry
                nxt = j + t
                going = going & (nxt < end)
                going = going & (plgpu.load(ids_ref.at[jnp.where(going, nxt, 0)], mask=going, other=n) == ids)
                return t + 1, acc + _gradient_rows(perm_ref, g_ref, nxt, going, cols, in_row), going

            _, acc, _ = jax.lax.while_loop(more, add, (1, acc, lead))
            # the block's last run, if it goes on: its rows in the next blocks
            onward = lead & (ids == plgpu.load(ids_ref.at[_one(end)]))
            assert onward_ref is not None  # (a run goes on only when ids repeat)
            rest = plgpu.load(onward_ref.at[_one(b + 1)[:, None], cols[None, :]])
            acc = jnp.where(onward[:, None], acc + rest, acc)
        scalars = [r[0].astype(dt) for r, dt in zip(scalar_refs, hoisted_dtypes)]
        u, *new_state = in_kernel(scalars, [acc.astype(g_ref.dtype), *rows[1:], rows[0]])
        p = rows[0]
        plgpu.store(out_refs[0].at[at], (_widen(p) + _widen(u.astype(p.dtype))).astype(p.dtype), mask=live)
        for r, new in zip(out_refs[1:], new_state):
            plgpu.store(r.at[at], new.astype(r.dtype), mask=live)

    return kernel


def _prepare(inner, i, treedef, state_def, owners, leaves, state_leaves, p_leaves, config=DEFAULT_CONFIG):
    """``(block, hoisted, in_kernel)`` for table ``i``: the rows a kernel program holds, and its
    :class:`_Plan` split (the scalars it needs, computed here, and the in-kernel update)."""
    shape = p_leaves[i].shape
    width = _pow2(int(np.prod(shape[1:], dtype=int)))
    block = max(1, min(config.max_block_rows, config.block_elements // width))
    mine = [state_leaves[k] for k in _owned(owners, i)]
    block_avals = [jax.ShapeDtypeStruct((block, width), x.dtype) for x in (leaves[i], *mine, p_leaves[i])]
    scalar = lambda x: jnp.zeros((), x.dtype if hasattr(x, "dtype") else jnp.result_type(x))  # noqa: E731
    known: list[Any] = (
        [scalar(x) for x in leaves]
        + [scalar(x) if isinstance(o, int) else x for x, o in zip(state_leaves, owners)]
        + [scalar(x) for x in p_leaves]
    )  # other leaves: stand-ins
    plan = _Plan(
        inner,
        i,
        treedef,
        state_def,
        owners,
        block_avals,
        [jax.ShapeDtypeStruct(np.shape(x), jnp.result_type(x)) for x in known],
    )
    for pos in plan.rows_at:
        known[pos] = None
    return (block, *plan.split(known))


def _update_table(inner, i, treedef, state_def, owners, leaves, state_leaves, p_leaves, interpret, config):
    """``(p, rows)``: table ``i`` and its state rows after the lazy update by its gradient, in one
    kernel."""
    g, p = leaves[i], p_leaves[i]
    rows = [state_leaves[k] for k in _owned(owners, i)]
    shape, n, k = p.shape, p.shape[0], g.nse
    d = int(np.prod(shape[1:], dtype=int))
    block, hoisted, in_kernel = _prepare(inner, i, treedef, state_def, owners, leaves, state_leaves, p_leaves, config)
    hoisted_dtypes = [jnp.result_type(x) for x in hoisted]
    # scalars reach the kernel as (1,) arrays; bools as int32
    hoisted = [jnp.reshape(x.astype(jnp.int32) if x.dtype == jnp.bool_ else x, (1,)) for x in hoisted]

    ids = jnp.where(g.row_valid(), g.indices, n).astype(jnp.int32)  # padding rows at N
    perm = jnp.arange(k, dtype=jnp.int32)
    if not g.unique_indices:
        ids, perm = jax.lax.sort_key_val(ids, perm)
    size = -(-k // block) * block
    ids = jnp.pad(ids, (0, size + 1 - k), constant_values=n)  # one more: the id after each block
    g_rows = g.data.reshape(k, d)
    onward = [] if g.unique_indices else [_onward(ids, perm, g_rows, n, d, block, interpret, config)]
    tables = [p.reshape(n, d)] + [r.reshape(n, d) for r in rows]  # entry by entry: a row's shape does not matter
    operands = [ids, perm, g_rows, *onward, *hoisted, *tables]
    first = len(operands) - len(tables)
    out = _whole_call(
        _table_kernel(in_kernel, len(hoisted), hoisted_dtypes, len(tables), n, d, block, g.unique_indices),
        operands,
        [jax.ShapeDtypeStruct(t.shape, t.dtype) for t in tables],
        (size // block,),
        interpret,
        config,
        aliases={first + t: t for t in range(len(tables))},
    )
    return out[0].reshape(shape), [o.reshape(r.shape) for o, r in zip(out[1:], rows)]


def fused_update(
    optimizer,
    grads,
    state,
    params,
    apply,
    *,
    tables=None,
    interpret: bool = False,
    config: KernelConfig = DEFAULT_CONFIG,
):
    """``(params, state)`` after one step of the lazy lift ``optimizer`` (see :func:`fusable`): each
    table of :func:`fused_tables` updated by one kernel, then the other leaves (the one-call lazy
    update) and the global state.
    ``tables``: those leaves, when the caller has them already. ``interpret`` runs the kernels in
    Pallas' interpreter (any backend, slowly); ``config`` cuts them (:class:`KernelConfig`)."""
    inner = lazy_inner(optimizer)
    leaves, treedef = jax.tree_util.tree_flatten(grads, is_leaf=is_masked_leaf)
    ref = _Reference.of(grads)
    state_leaves, state_def = jax.tree_util.tree_flatten(state)
    owners = _owners(ref, state)
    p_leaves = treedef.flatten_up_to(params)
    tables = fused_tables(optimizer, grads, state, params) if tables is None else tables
    for i in tables:
        p, rows = _update_table(inner, i, treedef, state_def, owners, leaves, state_leaves, p_leaves, interpret, config)
        p_leaves[i] = p
        for k, r in zip(_owned(owners, i), rows):
            state_leaves[k] = r
    params = jax.tree_util.tree_unflatten(treedef, p_leaves)
    state = jax.tree_util.tree_unflatten(state_def, state_leaves)
    rest = [empty_leaf(g) if j in tables else g for j, g in enumerate(leaves)]  # the other leaves; global state
    u, state = optimizer.update(jax.tree_util.tree_unflatten(treedef, rest), state, params)
    return apply(params, u), state
