"""A fused row-sparse Adam step for GPUs, as a measured prototype (not part of masked_jax).

The library's lazy Adam, given ids with duplicates, first sums each row's duplicates into a
coalesced gradient and then updates the coalesced rows: two programs, and the coalesced gradient
is written by the first and read by the second. This step does it in one Pallas (Triton) kernel
after a sort: the ids are sorted with their positions, each distinct row's run of duplicates is
found from the sorted ids, and one kernel program per block of distinct rows sums its rows'
gradients (gathered through the sort's permutation), reads their parameter and moments, and
writes them back updated. No coalesced gradient is stored.

``recsys.py`` times it beside ``lazy(adam)`` in its optimizer sweep on a GPU. Run alone, this
module checks it against plain lazy Adam on a small table, in Pallas' interpreter (any machine):

    .venv/bin/python benchmarks/fused_rows.py
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from optim import LR, adam_rows

BLOCK = 64  # distinct rows per kernel program


def _adam_rows(rows, live, g, step_ref, p_ref, m_ref, v_ref):
    """Adam (``optim.adam_rows``) on the rows ``rows`` where ``live``, with their summed gradients
    ``g``: read, updated, written back."""
    # lanes not live point past the table: their masked loads and stores touch nothing (in Pallas'
    # interpreter too, which drops the store instead of writing back what it read)
    at = (jnp.where(live, rows, p_ref.shape[0])[:, None], jnp.arange(g.shape[1])[None, :])
    p, m, v = (plgpu.load(ref.at[at], mask=live[:, None], other=0.0) for ref in (p_ref, m_ref, v_ref))
    step, m, v = adam_rows(m, v, g, step_ref[0])
    for ref, new in ((p_ref, p + step), (m_ref, m), (v_ref, v)):
        plgpu.store(ref.at[at], new, mask=live[:, None])


def _gradient_rows(perm_ref, g_ref, where, take):
    """The gradient rows at sorted positions ``where`` (through the sort's permutation), 0 where
    not ``take``."""
    at = plgpu.load(perm_ref.at[jnp.where(take, where, 0)], mask=take, other=0)
    cols = jnp.arange(g_ref.shape[1])
    return plgpu.load(g_ref.at[at[:, None], cols[None, :]], mask=take[:, None], other=0.0)


def _runs_kernel(rows_ref, starts_ref, counts_ref, perm_ref, g_ref, step_ref, p_in, m_in, v_in,
                 p_ref, m_ref, v_ref):
    """One program per ``BLOCK`` distinct rows, given where each one's run starts and its length."""
    del p_in, m_in, v_in  # aliased to the outputs
    rows, starts, counts = rows_ref[...], starts_ref[...], counts_ref[...]

    def add(t, acc):
        return acc + _gradient_rows(perm_ref, g_ref, starts + t, t < counts)

    g = jax.lax.fori_loop(0, jnp.max(counts), add, jnp.zeros((rows.shape[0], g_ref.shape[1]), jnp.float32))
    _adam_rows(rows, counts > 0, g, step_ref, p_ref, m_ref, v_ref)


def _sorted_kernel(ids_ref, perm_ref, g_ref, step_ref, p_in, m_in, v_in, p_ref, m_ref, v_ref):
    """One program per ``BLOCK`` sorted positions; a position that starts a run (its id differs
    from the one before; -1 pads) sums the run by reading on until the id changes."""
    del p_in, m_in, v_in
    k = ids_ref.shape[0]
    j = pl.program_id(0) * BLOCK + jnp.arange(BLOCK)
    ids = plgpu.load(ids_ref.at[j])
    before = plgpu.load(ids_ref.at[jnp.maximum(j - 1, 0)])
    lead = (ids >= 0) & ((j == 0) | (ids != before))

    def more(carry):
        return jnp.max(carry[2].astype(jnp.int32)) > 0  # (Triton lowers no reduce_or)

    def add(carry):
        t, acc, going = carry
        acc = acc + _gradient_rows(perm_ref, g_ref, j + t, going)
        nxt = jnp.where(going & (j + t + 1 < k), j + t + 1, 0)
        going = going & (j + t + 1 < k) & (plgpu.load(ids_ref.at[nxt], mask=going, other=-1) == ids)
        return t + 1, acc, going

    _, g, _ = jax.lax.while_loop(more, add, (0, jnp.zeros((BLOCK, g_ref.shape[1]), jnp.float32), lead))
    _adam_rows(ids, lead, g, step_ref, p_ref, m_ref, v_ref)


def runs(ids):
    """``(rows, starts, counts, perm)`` of ``ids`` (K,): sorted with their positions ``perm``, the
    distinct ids ``rows``, where each one's run starts in the sorted order and how long it is, padded
    to a multiple of ``BLOCK`` with empty runs (count 0)."""
    k = ids.shape[0]
    sorted_ids, perm = jax.lax.sort_key_val(ids, jnp.arange(k, dtype=jnp.int32))
    first = jnp.concatenate([jnp.ones((1,), bool), sorted_ids[1:] != sorted_ids[:-1]])
    size = -(-k // BLOCK) * BLOCK
    (starts,) = jnp.nonzero(first, size=size, fill_value=k)
    starts = starts.astype(jnp.int32)
    ends = jnp.concatenate([starts[1:], jnp.full((1,), k, jnp.int32)])
    ends = jnp.where(starts < k, jnp.minimum(ends, k), k)
    rows = jnp.take(sorted_ids, starts, mode="fill", fill_value=0)
    return rows, starts, ends - starts, perm


@functools.partial(jax.jit, static_argnames=("compact", "interpret"), donate_argnums=(0, 1, 2))
def fused_adam_step(p, m, v, count, ids, g, *, compact=True, interpret=False):
    """Lazy Adam (``optim.adam_rows``, learning rate ``optim.LR``) on the rows ``ids`` (duplicates
    summed) of ``p`` and its moments ``m``, ``v``: the new ``(p, m, v, count)``. ``count`` is the step count before this step. ``compact``: the
    distinct rows' runs are listed first (``runs``) and each kernel program takes ``BLOCK`` of
    them; else each program takes ``BLOCK`` sorted positions and finds the runs that start there
    (no listing, idle lanes where duplicates are)."""
    count = count + 1
    step = jnp.reshape(count, (1,)).astype(jnp.float32)
    n, d = p.shape
    k = g.shape[0]
    whole = lambda shape: pl.BlockSpec(shape, lambda i: (0,) * len(shape))  # noqa: E731
    tables = [whole((n, d))] * 3
    if compact:
        rows, starts, counts, perm = runs(ids)
        kernel, grid = _runs_kernel, rows.shape[0] // BLOCK
        operands = (rows, starts, counts, perm)
        specs = [pl.BlockSpec((BLOCK,), lambda i: (i,))] * 3 + [whole((k,))]
    else:
        sorted_ids, perm = jax.lax.sort_key_val(ids, jnp.arange(k, dtype=jnp.int32))
        size = -(-k // BLOCK) * BLOCK
        sorted_ids = jnp.concatenate([sorted_ids, jnp.full((size - k,), -1, sorted_ids.dtype)])
        kernel, grid = _sorted_kernel, size // BLOCK
        operands = (sorted_ids, perm)
        specs = [whole((size,)), whole((k,))]
    first_table = len(operands) + 2
    out = pl.pallas_call(
        kernel,
        out_shape=[jax.ShapeDtypeStruct((n, d), p.dtype)] * 3,
        grid=(grid,),
        in_specs=specs + [whole((k, d)), whole((1,))] + tables,
        out_specs=tables,
        input_output_aliases={first_table: 0, first_table + 1: 1, first_table + 2: 2},
        interpret=interpret,
        compiler_params=None if interpret else plgpu.CompilerParams(num_warps=4),
    )(*operands, g, step, p, m, v)
    return (*out, count)


def check(n=1000, k=700, dim=32, seed=0, interpret=True):
    """The fused step equals plain lazy Adam (duplicates summed, untouched rows bit-identical) over
    two steps, in Pallas' interpreter (``interpret=False``: compiled, on a GPU)."""
    import optax

    from masked_jax import optim
    import masked_jax as mj

    rng = np.random.default_rng(seed)
    table = rng.normal(size=(n, dim)).astype(np.float32)
    opt = optim.lazy(optax.adam(LR))
    want_p, state = jnp.asarray(table), opt.init(jnp.asarray(table))
    fused = {compact: (jnp.asarray(table), jnp.zeros((n, dim)), jnp.zeros((n, dim)), jnp.zeros((), jnp.int32))
             for compact in (True, False)}  # each form donates its own buffers
    for _ in range(2):
        ids = rng.integers(0, n // 3, size=k).astype(np.int32)  # many duplicates
        g = rng.normal(size=(k, dim)).astype(np.float32)
        u, state = opt.update(mj.row_sparse(jnp.asarray(g), jnp.asarray(ids), (n, dim)), state, want_p)
        want_p = optim.apply_updates(want_p, u)
        fused = {compact: fused_adam_step(*carry, jnp.asarray(ids), jnp.asarray(g), compact=compact,
                                          interpret=interpret) for compact, carry in fused.items()}
    untouched = np.setdiff1d(np.arange(n), np.arange(n // 3))
    for p, *_ in fused.values():
        np.testing.assert_allclose(np.asarray(p), np.asarray(want_p), rtol=1e-5, atol=1e-6)
        assert (np.asarray(p)[untouched] == table[untouched]).all()
    print(f"fused steps (both forms) equal lazy(adam) on a {n} x {dim} table, {k} ids with duplicates, two steps"
          f"{' (Pallas interpreter)' if interpret else ''}")


if __name__ == "__main__":
    check()
