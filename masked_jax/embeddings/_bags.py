"""Bags of ids pooled into one row each: ``embedding_bag``.

A bag is a set of ids whose rows are combined (summed, averaged, ...) into one vector, as
torch's ``EmbeddingBag`` and TensorFlow's ``safe_embedding_lookup_sparse`` do for multi-hot
features. Bags come padded (an id array of shape ``(..., L)``, padding masked or negative) or
ragged (flat ids with ``offsets`` or ``lengths``). The rows are read by one
:func:`~masked_jax.lookup`, so ``mj.grad(..., row_sparse=...)`` gives the table a row-sparse
gradient holding the rows read, and nothing for padding.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from masked_jax._core import SparseMasked, from_pair, is_masked_leaf
from masked_jax.embeddings._lookup import _read
from masked_jax.layouts import check_integer_indices, segment_total
from masked_jax.ops._base import lowest

COMBINERS = ("sum", "mean", "sqrtn", "max")


def _split_masked(x):
    """``(data, mask or None)`` of a plain or masked array."""
    if isinstance(x, SparseMasked):
        x = x.todense()
    if is_masked_leaf(x):
        return x.data, x.mask
    if x is None:
        return None, None
    return jnp.asarray(x), None


def _concrete(x):
    try:
        return np.asarray(x)
    except jax.errors.TracerArrayConversionError:
        return None


def _ragged_segments(n_ids: int, offsets, lengths):
    """``(bag of each id, number of bags)`` from torch-style start ``offsets`` or bag ``lengths``;
    ids past the last bag belong to none (bag ``n_bags``, dropped)."""
    if (offsets is None) == (lengths is None):
        raise ValueError(
            "ragged bags need exactly one of offsets= (the start of each bag in ids) or "
            "lengths= (the size of each bag)."
        )
    name = "offsets" if lengths is None else "lengths"
    given = check_integer_indices(offsets if lengths is None else lengths, name)
    if given.ndim != 1:
        raise ValueError(f"{name} must be one-dimensional (one entry per bag); got shape {given.shape}.")
    host = _concrete(given)
    if lengths is None:
        if host is not None and host.size and (host[0] != 0 or np.any(np.diff(host) < 0) or host[-1] > n_ids):
            raise ValueError(
                f"offsets must start at 0, never decrease and stay <= len(ids) = {n_ids}; got {host.tolist()}."
            )
        starts = ends = given
        ok = (jnp.all(given[1:] >= given[:-1]) & (given[0] == 0) & (given[-1] <= n_ids)) if given.size else True
    else:
        if host is not None and (np.any(host < 0) or host.sum() > n_ids):
            raise ValueError(f"lengths must be >= 0 and sum to at most len(ids) = {n_ids}; got {host.tolist()}.")
        starts = jnp.cumsum(given) - given
        ends = jnp.cumsum(given)
        ok = jnp.all(given >= 0) & (jnp.sum(given) <= n_ids)
    n_bags = given.shape[0]
    position = jnp.arange(n_ids)
    bag = jnp.searchsorted(starts, position, side="right").astype(jnp.int32) - 1
    if lengths is not None:  # ids past the end of their bag (past sum(lengths)) belong to none
        bag = jnp.where(position < ends[jnp.clip(bag, 0, n_bags - 1)], bag, n_bags)
    # offsets or lengths that break the rules (traced, so unchecked above): every bag is empty
    return jnp.where((bag < 0) | ~ok, n_bags, bag), n_bags


def embedding_bag(table, ids, *, offsets=None, lengths=None, weights=None, combiner: str = "sum"):
    """Rows of ``table`` read by bags of ids and combined into one row per bag.

    Bags are given either

    * **padded**: ``ids`` of shape ``(..., L)``, one bag per leading index; or
    * **ragged**: ``ids`` of shape ``(nnz,)`` with ``offsets`` (the start of each bag, torch's
      convention: ``offsets[0] == 0``, non-decreasing) or ``lengths`` (the size of each bag; ids
      past ``sum(lengths)`` belong to no bag).

    **Which ids count.** An id counts iff it lies in ``[0, N)`` and is not masked (``ids`` may be
    a ``MaskedArray``). Negative ids and ids ``>= N`` are padding, eagerly and under ``jit``
    alike: ``-1`` never reads row ``N - 1`` here (unlike :func:`~masked_jax.lookup`, which
    counts negative ids from the end as numpy indexing does). Padding reads nothing and gets no
    gradient, also as a row-sparse gradient.

    ``weights`` (same shape as ``ids``) scale each id's row; a masked weight makes its id padding.
    The result has the dtype of ``weights * row`` as jnp promotes it (float weights on an integer
    table pool in float; float32 weights on a bfloat16 table in float32).
    ``combiner``, over the ids that count, with weights ``w`` (1 without ``weights``):

    * ``"sum"``: ``sum(w * row)``;
    * ``"mean"``: ``sum(w * row) / sum(w)``;
    * ``"sqrtn"``: ``sum(w * row) / sqrt(sum(w ** 2))``;
    * ``"max"``: the elementwise maximum of the rows (no ``weights``).

    Returns a ``MaskedArray`` of shape ``bags + table.shape[1:]``, where ``bags`` is ``ids.shape[:-1]``
    (padded) or ``(len(offsets or lengths),)`` (ragged). A bag with no id that counts is masked
    (for ``mean``/``sqrtn``, also one whose weights sum to 0); its data is 0. The rows are read by
    one :func:`~masked_jax.lookup`, so under ``mj.grad(..., row_sparse=...)`` the table's gradient
    holds only the rows the bags read.

    Bad input raises: non-integer ids, offsets or lengths, weights of another shape, an unknown
    combiner, weights with ``max``, and (when they are concrete, as eagerly) offsets that do not
    start at 0, decrease or pass the end, or negative lengths. Under ``jit``, where they cannot
    raise, such offsets or lengths give every bag masked: no row is read and none gets a gradient.

    Examples:
        >>> import jax.numpy as jnp, masked_jax as mj
        >>> table = jnp.arange(8.0).reshape(4, 2)
        >>> mj.embedding_bag(table, jnp.array([[0, 2, -1], [-1, -1, -1]]), combiner="mean")
        MaskedArray([[2.0 3.0]
                     [-- --]], dtype=float32)
        >>> mj.embedding_bag(table, jnp.array([1, 3, 3]), offsets=jnp.array([0, 1]),
        ...                  weights=jnp.array([1.0, 0.5, 0.5]))
        MaskedArray([[2.0 3.0]
                     [6.0 7.0]], dtype=float32)
    """
    if is_masked_leaf(table):
        raise TypeError("embedding_bag reads a plain table (an array of shape (N, ...)); got a masked array.")
    table = jnp.asarray(table)
    if table.ndim == 0:
        raise ValueError("embedding_bag needs a table with at least one dimension (the rows).")
    bag = Bag.prepare(
        table.shape[0], table.dtype, ids, offsets=offsets, lengths=lengths, weights=weights, combiner=combiner
    )
    return bag.combine(_read(table, bag.read))  # ids in [0, N]; padding reads N: zeros, no gradient


class Bag:
    """Bags of ids checked and prepared for one table of ``n`` rows: the ids to read (``n`` for
    padding), their weights (0 for padding) and how the rows read combine. Shared by
    :func:`embedding_bag` and stacked tables, which read many bags' rows with one lookup."""

    def __init__(self, read, weights, counts, combiner, pool, ragged=False):
        self.read, self.weights, self.counts, self.combiner, self.pool = read, weights, counts, combiner, pool
        self.ragged = ragged

    def group_key(self):
        """Padded bags of one id shape and dtype combined by sum, mean or sqrtn pool together
        (:meth:`combine_group`); ``None`` for bags that pool alone (ragged, or ``max``)."""
        if self.ragged or self.combiner == "max":
            return None
        return (self.read.shape, self.weights.dtype)

    @staticmethod
    def combine_group(bags, rows):
        """The pooled rows of several padded bags sharing a :meth:`group_key`, from ``rows`` of
        shape ``(len(bags), *ids shape, *row shape)``: one weighted sum for all of them, each
        bag's own normalisation after it. The same arithmetic as :meth:`combine` bag by bag."""
        w = jnp.stack([b.weights for b in bags])
        counts = jnp.stack([b.counts for b in bags])
        axis = w.ndim - 1
        row_ndim = rows.ndim - w.ndim
        expand = (...,) + (None,) * row_ndim
        valid = jnp.sum(counts.astype(jnp.int32), axis=axis) > 0
        if row_ndim == 1 and jnp.issubdtype(rows.dtype, jnp.inexact):
            # a batched vector-matrix product: each weight is read (and, with its id's validity,
            # computed) once per id, where a broadcast product recomputes it for every element
            # of the row (3x the gradient's time for 8 stacked tables of 32 columns on CPU)
            pooled = jnp.einsum("...l,...ld->...d", w, rows, precision=jax.lax.Precision.HIGHEST)
        else:
            pooled = jnp.sum(rows * w[expand], axis=axis)
        kinds = [b.combiner for b in bags]
        if any(k != "sum" for k in kinds):
            shape = (-1,) + (1,) * (w.ndim - 2)  # per bag of the group, over its ids' batch dims
            norms = {"mean": lambda: jnp.sum(w, axis=axis), "sqrtn": lambda: jnp.sqrt(jnp.sum(w * w, axis=axis))}
            norm = jnp.ones(w.shape[:-1], w.dtype)  # picked per bag by one where (a stack of slices is slow)
            for kind in (k for k in norms if k in kinds):
                norm = jnp.where(np.array([k == kind for k in kinds]).reshape(shape), norms[kind](), norm)
            needs = np.array([k != "sum" for k in kinds]).reshape(shape)
            valid = valid & ((norm != 0) | ~needs)
            pooled = pooled / jnp.where(valid, norm, 1)[expand]
        pooled = jnp.where(valid[expand], pooled, 0)
        mask = valid.reshape(valid.shape + (1,) * row_ndim)
        return [
            from_pair(p[0], m[0], zeroed=True) for p, m in zip(jnp.split(pooled, len(bags)), jnp.split(mask, len(bags)))
        ]

    @classmethod
    def prepare(cls, n: int, dtype, ids, *, offsets=None, lengths=None, weights=None, combiner="sum"):
        if combiner not in COMBINERS:
            raise ValueError(f"combiner must be one of {COMBINERS}; got {combiner!r}.")
        id_data, id_mask = _split_masked(ids)
        id_data = check_integer_indices(id_data, "ids")
        w, w_mask = _split_masked(weights)
        if w is not None:
            if combiner == "max":
                raise ValueError("combiner='max' takes no weights.")
            if w.shape != id_data.shape:
                raise ValueError(f"weights must have the shape of ids, {id_data.shape}; got {w.shape}.")
        counts = (id_data >= 0) & (id_data < n)
        for m in (id_mask, w_mask):
            if m is not None:
                counts = counts & jnp.broadcast_to(m, id_data.shape)
        ragged = offsets is not None or lengths is not None
        if ragged:
            if id_data.ndim != 1:
                raise ValueError(
                    f"ragged bags (offsets= or lengths=) take one-dimensional ids; got shape {id_data.shape}."
                )
            bag, n_bags = _ragged_segments(id_data.shape[0], offsets, lengths)
            counts = counts & (bag < n_bags)  # an id in no bag is padding: not read, no gradient

            def pool_ragged(x, op=segment_total):  # sums accumulate half precision in float32
                return op(x, bag, num_segments=n_bags)

            pool = pool_ragged
        else:
            if id_data.ndim == 0:
                raise ValueError("padded bags take ids of shape (..., L) (the last axis holds a bag); got a scalar.")
            axis = id_data.ndim - 1

            def pool(x, op=segment_total):
                return jnp.max(x, axis=axis) if op is jax.ops.segment_max else jnp.sum(x, axis=axis)

        # weights promote with the table as jnp's w * row does (an int table with float weights
        # pools in float, a bfloat16 table with float32 weights in float32)
        w = jnp.ones(id_data.shape, dtype) if w is None else w.astype(jnp.result_type(dtype, w.dtype))
        w = jnp.where(counts, w, 0)
        return cls(jnp.where(counts, id_data, n), w, counts, combiner, pool, ragged=ragged)

    def combine(self, rows):
        """The bags' pooled rows (a ``MaskedArray``, empty bags masked) from the rows read at ``read``."""
        if self.group_key() is not None:
            return Bag.combine_group([self], rows[None])[0]
        pool, counts, w = self.pool, self.counts, self.weights
        row_ndim = rows.ndim - counts.ndim
        expand = (...,) + (None,) * row_ndim
        count = pool(counts.astype(jnp.int32))
        if self.combiner == "max":
            low = jnp.asarray(lowest(rows.dtype), rows.dtype)
            pooled = pool(jnp.where(counts[expand], rows, low), jax.ops.segment_max)
            valid = count > 0
        else:
            pooled = pool(rows * w[expand])
            if self.combiner == "sum":
                valid = count > 0
            else:
                norm = pool(w) if self.combiner == "mean" else jnp.sqrt(pool(w * w))
                valid = (count > 0) & (norm != 0)
                pooled = pooled / jnp.where(valid, norm, 1)[expand]
        pooled = jnp.where(valid[expand], pooled, 0)
        return from_pair(pooled, valid.reshape(valid.shape + (1,) * row_ndim), zeroed=True)


__all__ = ["embedding_bag"]
