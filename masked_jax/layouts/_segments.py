"""Reductions and normalizations of BCOO-backed masked arrays along axes, in O(stored entries).

A reduction along ``axes`` groups the stored entries by their remaining coordinates: every
group (a *segment*) is one output element, valid because it holds at least one valid entry.
The result is again BCOO-backed, with one entry per segment (static nse: the input's, freed
slots are padding), so reducing a 10^6 x 10^6 matrix with 10^4 entries along an axis costs
O(10^4), never O(10^6). Normalizations (the softmax family, ``normalize``) along an axis group
the entries the same way and keep the input's entries.

The input is first brought to the flat layout (no batch or dense dimensions: one entry per
stored element) and coalesced, so that duplicate entries count once, as one summed element.
Padding entries and masked data never reach a result: their values are replaced by zeros
before any arithmetic (no NaN in values or gradients).

The kernels themselves are attached to the ops' specs (``OpSpec.segment``, beside each rule in
:mod:`masked_jax.ops`); an op without one falls back to the dense layout.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import sparse as jsparse

from masked_jax.ops._base import accumulation_dtype, highest, lowest, normalize_axis


def segment_total(values, segments, num_segments: int, **kwargs):
    """``jax.ops.segment_sum`` that accumulates float16 and bfloat16 in float32, as ``jnp.sum``
    does (a bfloat16 sum of 600 ones is 600, not 256), and returns the values' dtype."""
    acc = accumulation_dtype(values.dtype)
    return jax.ops.segment_sum(values.astype(acc), segments, num_segments, **kwargs).astype(values.dtype)


def row_totals(values, segments, num_segments: int):
    """:func:`segment_total` of rows (duplicate rows of a row-sparse array summed), without a
    scatter-add whose indices repeat on accelerators. XLA:GPU compiles a float scatter-add with
    repeating indices to atomics, a compare-and-swap loop in some jaxlib versions (0.10.2 to
    0.11.0) that is hundreds of times slower; there the rows are sorted by segment, each run of a
    segment summed by a segmented scan, and the run's total written once per segment
    (:func:`unique_targets`: a scatter with unique indices, plain stores). On the CPU,
    ``segment_sum``. Chosen when the program is lowered (``lax.platform_dependent``).

    >>> import jax.numpy as jnp
    >>> row_totals(jnp.array([[1.0], [2.0], [4.0]]), jnp.array([1, 0, 1]), 3)[:, 0]
    Array([2., 5., 0.], dtype=float32)
    """
    return jax.lax.platform_dependent(
        values,
        segments,
        cpu=lambda v, s: segment_total(v, s, num_segments),
        default=lambda v, s: sorted_totals(v, s, num_segments),
    )


def sorted_totals(values, segments, num_segments: int):
    """:func:`segment_total` by sorting: the rows ordered by segment (stable), a segmented
    inclusive scan of each run (exact per run, log-depth), each run's total written at its segment
    by a scatter with unique indices. Segments out of ``[0, num_segments)`` are dropped."""
    k = segments.shape[0]
    acc = accumulation_dtype(values.dtype)
    if k == 0:
        return jnp.zeros((num_segments,) + values.shape[1:], values.dtype)
    order = jnp.argsort(segments, stable=True)
    seg, rows = segments[order], values[order].astype(acc)
    change = seg[1:] != seg[:-1]
    starts = jnp.concatenate([jnp.ones(1, bool), change])
    ends = jnp.concatenate([change, jnp.ones(1, bool)])

    def combine(a, b):  # (run starts here, running sum): a run's sum restarts at its first row
        fresh = b[0].reshape(b[0].shape + (1,) * (b[1].ndim - b[0].ndim))
        return a[0] | b[0], jnp.where(fresh, b[1], a[1] + b[1])

    _, running = jax.lax.associative_scan(combine, (starts, rows))
    keep = ends & (seg >= 0) & (seg < num_segments)
    target, unique = unique_targets(jnp.where(keep, seg, num_segments), num_segments)
    out = jnp.zeros((num_segments,) + values.shape[1:], acc)
    return out.at[target].set(running, mode="drop", unique_indices=unique).astype(values.dtype)


def unique_targets(indices, n: int):
    """``(targets, unique)``: scatter targets for ``indices`` that are distinct where they are
    below ``n`` (the rows written) and at ``n`` or past it otherwise (padding, dropped): the padding
    moved to distinct positions past the end (``n + position``), so that the scatter may be told
    its indices are unique (``unique_indices=True``: plain stores on a GPU, no atomics). ``unique``
    is False, and the indices unchanged, when those positions would not fit in the index dtype."""
    k = indices.shape[0]
    if n + k >= np.iinfo(np.dtype(indices.dtype)).max:
        return indices, False
    return jnp.where(indices < n, indices, n + jnp.arange(k, dtype=indices.dtype)), True


def sorted_search(sorted_values, queries):
    """``jnp.searchsorted(sorted_values, queries)`` (left side), by the fastest method per backend.

    On XLA:CPU the default method, a ``while`` loop of log2(n) trips, is the fastest. On XLA:GPU
    each trip of that loop is a kernel plus a read of the loop predicate by the host, so there the
    search is unrolled into one straight-line program (``benchmarks/optim.py`` times both on a
    row-sparse step). The choice is made
    when the program is lowered (``lax.platform_dependent``), not traced. One or no value: a
    single comparison (an unrolled search of zero trips would still be a loop).
    """
    if sorted_values.shape[-1] <= 1:
        return jnp.searchsorted(sorted_values, queries, method="compare_all")
    return jax.lax.platform_dependent(
        sorted_values,
        queries,
        cpu=lambda v, q: jnp.searchsorted(v, q, method="scan"),
        default=lambda v, q: jnp.searchsorted(v, q, method="scan_unrolled"),
    )


def unique_ids(ids, sentinel: int):
    """``(uniq, seg)``: the sorted distinct values of ``ids`` padded with ``sentinel`` to
    ``len(ids)`` (static), and each id's position in ``uniq``.

    Sort + first-of-run + ``searchsorted``: about a third of ``jnp.unique(size=...)``'s time on
    CPU. ``sentinel`` must be larger than every real id; ids equal to it are padding.
    """
    k = ids.shape[0]
    if k == 0:
        return ids, ids
    ordered = jnp.sort(ids)
    first = jnp.concatenate([jnp.ones(1, bool), ordered[1:] != ordered[:-1]])
    # each run's first (smallest) value at the run's rank: one write per rank, unique targets
    rank, unique = unique_targets(jnp.where(first, jnp.cumsum(first) - 1, k), k)
    uniq = jnp.full(k, sentinel, ids.dtype).at[rank].set(ordered, mode="drop", unique_indices=unique)
    return uniq, sorted_search(uniq, ids)


_INT32_MAX = int(np.iinfo(np.int32).max)


def tuple_ids(coords, shape, valid):
    """``(ids, bound, decode)``: an int32 id per entry whose index tuple is a row of ``coords``
    (``(k, len(shape))``), equal for equal tuples and ordered as the tuples are (row-major), with
    ``bound`` (larger than every id) for the entries that ``valid`` marks as padding; ``decode``
    maps ids back to index tuples (``bound`` to some in-range tuple: mask it).

    The id is the linear index while ``shape`` holds fewer than 2**31 - 1 elements. Past that (a
    70,000 x 70,000 x 2 sparse array has 9.8e9), it is the tuple's rank among the entries'
    distinct tuples: a lexicographic sort of the ``k`` entries, so the work stays O(k log k) at any
    logical size and no id needs 64 bits."""
    k = coords.shape[0]
    size = int(np.prod(shape))
    if size < _INT32_MAX:
        lin = jnp.ravel_multi_index(tuple(coords.T), shape, mode="clip") if shape else jnp.zeros(k, jnp.int32)
        ids = jnp.where(valid, lin, size).astype(jnp.int32)

        def decode(u):
            if not shape:
                return jnp.zeros((u.shape[0], 0), coords.dtype)
            return jnp.stack(jnp.unravel_index(jnp.minimum(u, size - 1), shape), -1).astype(coords.dtype)

        return ids, size, decode
    order = jnp.lexsort([coords[:, j] for j in reversed(range(len(shape)))] + [~valid])  # padding last
    tuples, kept = coords[order], valid[order]
    new = jnp.concatenate([jnp.ones(1, bool), jnp.any(tuples[1:] != tuples[:-1], axis=1) | (kept[1:] != kept[:-1])])
    rank = jnp.where(kept, jnp.cumsum(new, dtype=jnp.int32) - 1, k)
    ids = jnp.zeros(k, jnp.int32).at[order].set(rank)
    table = jnp.zeros((k + 1, len(shape)), coords.dtype).at[rank].set(tuples)  # rank -> tuple
    return ids, k, lambda u: table[jnp.minimum(u, k)]


def first_copies(ids):
    """Per position: True where ``ids`` holds its value for the first time (by position), False at
    the later copies of a value. A stable sort of the ``k`` ids, O(k log k).

    >>> import jax.numpy as jnp
    >>> first_copies(jnp.array([3, 1, 3, 3, 1]))
    Array([ True,  True, False, False, False], dtype=bool)
    """
    k = ids.shape[0]
    if k == 0:
        return jnp.zeros(0, bool)
    order = jnp.argsort(ids, stable=True)
    ordered = ids[order]
    first = jnp.concatenate([jnp.ones(1, bool), ordered[1:] != ordered[:-1]])
    return jnp.zeros(k, bool).at[order].set(first, unique_indices=True)


def distinct_ids(ids, sentinel: int):
    """``(uniq, seg)`` as :func:`unique_ids`, in whatever order is fastest: the distinct values of
    ``ids`` first (sorted or in order of first appearance), then ``sentinel`` padding up to
    ``len(ids)``; ``seg`` is each id's position in ``uniq``, and ``len(ids)`` (past the end:
    segment sums drop it) for ids equal to ``sentinel``.

    Without a sort when ``sentinel`` (the number of rows) is at most 64x ``len(ids)``: each id
    scatter-mins its position into a row-sized array, so the first occurrence of each id is
    found, and a cumulative sum numbers those: faster than sort and search at the recommender
    benchmark's sizes. Past 64x, clearing the row-sized array costs more than the sort.
    """
    k = ids.shape[0]
    if k == 0:
        return ids, ids
    if sentinel > 64 * k:
        uniq, seg = unique_ids(ids, sentinel)
        return uniq, jnp.where(ids < sentinel, seg, k).astype(seg.dtype)
    position = jnp.arange(k, dtype=jnp.int32)
    first = jnp.full(sentinel + 1, k, jnp.int32).at[ids].min(position, mode="drop")[ids]
    is_first = (first == position) & (ids < sentinel)
    rank = jnp.cumsum(is_first, dtype=jnp.int32) - 1
    uniq = jnp.full(k, sentinel, ids.dtype).at[jnp.where(is_first, rank, k)].set(ids, mode="drop")
    return uniq, jnp.where(ids < sentinel, rank[first], k)


class Segments:
    """Stored entries of a flat, coalesced BCOO-backed masked array grouped by ``keep`` axes."""

    def __init__(self, x, keep: tuple[int, ...]):
        self.valid = x.entry_valid()
        self.index_dtype = x.indices.dtype
        self.k = x.nse
        self.out_shape = tuple(x.shape[a] for a in keep)
        coords = x.indices[:, list(keep)]
        lin, n_out, self.decode = tuple_ids(coords, self.out_shape, self.valid)
        if n_out < self.k:
            # Fewer outputs than entries: one segment per output element (and one for padding),
            # no sort. The result stores n_out + 1 entries, fewer than the input's nse.
            self.n_seg = n_out + 1
            self.uniq, self.seg = jnp.arange(self.n_seg, dtype=jnp.int32), lin
        else:  # one segment per distinct output element present: sort the entries' outputs
            self.n_seg = self.k
            self.uniq, self.seg = unique_ids(lin, n_out)
        self.count = self.sum(self.valid.astype(jnp.int32))
        self.out_valid = (self.uniq < n_out) & (self.count > 0)

    def clean(self, values, fill_value: Any = 0):
        """Values with padding entries replaced by ``fill_value``."""
        return jnp.where(self.valid, values, jnp.asarray(fill_value, values.dtype))

    def sum(self, v):
        """Sum per segment; float16/bfloat16 accumulate in float32, as ``jnp.sum`` does."""
        return segment_total(self.clean(v), self.seg, self.n_seg)

    def max(self, v):
        init = lowest(v.dtype)
        return jax.ops.segment_max(self.clean(v, init), self.seg, self.n_seg, indices_are_sorted=False)

    def min(self, v):
        init = highest(v.dtype)
        return jax.ops.segment_min(self.clean(v, init), self.seg, self.n_seg, indices_are_sorted=False)

    def prod(self, v):
        """Product per segment by a segmented scan over entries sorted by segment (differentiable,
        unlike ``segment_prod``'s scatter-multiply)."""
        if self.k == 0:
            return jnp.ones(self.n_seg, v.dtype)
        order = jnp.argsort(self.seg)
        seg, vals = self.seg[order], self.clean(v, 1)[order]
        start = jnp.concatenate([jnp.ones(1, bool), seg[1:] != seg[:-1]])

        def combine(a, b):
            (va, sa), (vb, sb) = a, b
            return jnp.where(sb, vb, va * vb), sa | sb

        run, _ = jax.lax.associative_scan(combine, (vals, start))
        last = jnp.concatenate([seg[1:] != seg[:-1], jnp.ones(1, bool)])
        slot = jnp.where(last, seg, self.n_seg)  # write each run's total once, drop the rest
        return jnp.ones(self.n_seg, vals.dtype).at[slot].set(run, mode="drop")

    def back(self, per_segment):
        """Per-segment values broadcast back to the entries."""
        return per_segment[self.seg]

    def output_indices(self, keepdims_axes=()):
        """BCOO indices (k, n_out) of the segments; padding segments hold index 0 (mask them)."""
        cols = self.decode(jnp.where(self.out_valid, self.uniq, 0))
        for a in keepdims_axes:  # a size-1 dimension: index 0 (axes ascending)
            cols = jnp.insert(cols, a, 0, axis=1)
        return cols.astype(self.index_dtype)


def flat(x):
    """``x`` in the flat layout (no batch or dense dimensions), coalesced."""
    if x.n_batch or x.n_dense:
        x = type(x).from_bcoo(jsparse.bcoo_update_layout(x.to_bcoo(), n_batch=0, n_dense=0))
    return x.coalesce()


def reduce(spec, x, axis=None, keepdims=False, **kwargs):
    """Op ``spec`` over ``axis`` of a BCOO-backed masked array with its segment kernel: a
    BCOO-backed result (``NotImplemented`` for matrix norms over two axes)."""
    if spec.name == "norm" and not _one_axis(axis):
        return NotImplemented
    axes = normalize_axis(axis, x.ndim)
    x = flat(x)
    g = Segments(x, tuple(a for a in range(x.ndim) if a not in axes))
    out = spec.segment(g, g.clean(x.data), **kwargs)
    out, extra = out if isinstance(out, tuple) else (out, None)
    valid = g.out_valid if extra is None else g.out_valid & extra
    shape = tuple(1 if a in axes else d for a, d in enumerate(x.shape) if keepdims or a not in axes)
    indices = g.output_indices(axes if keepdims else ())
    end = jnp.array(shape, indices.dtype)  # padding: one past the end in every dimension
    data = jnp.where(valid, out, jnp.zeros((), out.dtype))
    return type(x).tree_unflatten(shape, (data, jnp.where(valid[:, None], indices, end)))


def normalize_along(spec, x, axis=-1, **kwargs):
    """Op ``spec`` (softmax family, ``normalize``) along ``axis`` with its segment kernel: same
    entries, new values."""
    if spec.name == "normalize" and not _one_axis(axis):
        return NotImplemented  # the dense rule takes a matrix norm over two axes
    axes = normalize_axis(axis, x.ndim)
    x = flat(x)
    g = Segments(x, tuple(a for a in range(x.ndim) if a not in axes))
    out = spec.segment(g, g.clean(x.data), **kwargs)
    return x.with_data(g.clean(out))


def _one_axis(axis):
    return isinstance(axis, (int, np.integer)) or (isinstance(axis, (tuple, list)) and len(axis) == 1)
