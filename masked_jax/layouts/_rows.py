"""Row-sparse arrays (MXNet ``row_sparse``): K stored rows of an (N, ...) array.

``data[i]`` is row ``indices[i]``; rows not listed do not exist (masked). K is
static. Duplicate indices are summed (coalesced) before any nonlinear op.
Out-of-range indices raise ``ValueError`` when the indices are concrete; under
``jit`` they cannot be checked and are treated as padding: they are dropped
everywhere (never valid, never written), like padding entries of jax's BCOO.
"""

from __future__ import annotations

import math
from typing import cast

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import sparse as jsparse

from masked_jax import _validate
from masked_jax._core import MaskedArray, SparseMasked, check_data, from_pair, is_tracer
from masked_jax.layouts._bcoo import DATA_KEY, INDICES_KEY, BCOOMaskedArray, basic_index
from masked_jax.layouts._segments import distinct_ids, first_copies, row_totals, sorted_search, unique_ids
from masked_jax.ops._base import Pair, accumulation_dtype, widened_indices


@jax.tree_util.register_pytree_with_keys_class
class RowSparseArray(SparseMasked, storage="row_sparse"):
    """K stored rows of an array of shape ``(N, ...)``; build with :func:`row_sparse`.

    Examples:
        >>> import jax.numpy as jnp, masked_jax as mj
        >>> x = mj.row_sparse(jnp.ones((2, 3)), jnp.array([4, 1]), (6, 3))
        >>> x
        RowSparseArray(float32[6, 3], rows=2)
        >>> x.todense().mask.any(axis=1)
        Array([False,  True, False, False,  True, False], dtype=bool)
    """

    __slots__ = ("data", "indices", "shape", "unique_indices")

    def tree_flatten(self):
        return (self.data, self.indices), (self.shape, self.unique_indices)

    def tree_flatten_with_keys(self):
        """Children with their names: paths read ``.data`` and ``.indices``."""
        return ((DATA_KEY, self.data), (INDICES_KEY, self.indices)), (self.shape, self.unique_indices)

    @classmethod
    def tree_unflatten(cls, aux, children):
        data, indices = children
        if getattr(indices, "ndim", 1) > 1:
            # Stacked by vmap or scan: one row set per batch element. That is the BCOO layout with
            # batch dimensions (the stored rows as dense blocks), which every rule handles.
            return _batched_rows(aux[0], data, indices)
        obj = object.__new__(cls)
        obj.data, obj.indices = children
        obj.shape, obj.unique_indices = aux
        return obj

    _label = "row"
    dtype = property(lambda self: self.data.dtype)

    @property
    def nse(self) -> int:
        """K, the static number of stored rows."""
        return self.data.shape[0]

    def __repr__(self):
        return f"RowSparseArray({self._repr_shape()}, rows={self.nse})"

    # -- validity and conversions ------------------------------------------------------------
    def row_valid(self):
        """Per stored row: True where the index is in range (padding rows are False)."""
        return (self.indices >= 0) & (self.indices < self.shape[0])

    def block(self) -> Pair:
        """The stored rows as a dense masked block of shape (K, ...): the rules run on this."""
        valid = self.row_valid().reshape((-1,) + (1,) * (self.ndim - 1))
        return Pair(self.data, jnp.broadcast_to(valid, self.data.shape))

    def with_data(self, data) -> RowSparseArray:
        shape = self.shape[:1] + tuple(data.shape[1:])
        return rows_from_parts(shape, data, self.indices, self.unique_indices)

    def clean_indices(self):
        """The row indices with every padding row at ``N`` (negative indices are padding too, never
        wrapped): the one index convention of every rule and of :meth:`todense`."""
        return jnp.where(self.row_valid(), self.indices, self.shape[0])

    def clean_data(self):
        """The stored rows with padding rows set to 0."""
        return jnp.where(self.block().mask, self.data, jnp.zeros((), self.dtype))

    def todense(self) -> MaskedArray:
        """Dense-storage MaskedArray: stored rows valid (duplicates summed), the rest masked."""
        acc = accumulation_dtype(self.dtype)  # duplicates of float16/bfloat16 add up in float32
        idx = self.clean_indices()
        at = jnp.zeros(self.shape, acc).at[idx]
        data = self.clean_data().astype(acc)
        data = (at.max(data, mode="drop") if self.dtype == jnp.bool_ else at.add(data, mode="drop")).astype(self.dtype)
        rows = jnp.zeros(self.shape[0], bool).at[idx].set(True, mode="drop")
        mask = jnp.broadcast_to(rows.reshape((-1,) + (1,) * (self.ndim - 1)), self.shape)
        return from_pair(data, mask)

    def first_copies(self):
        """Per stored row: True at the first stored copy of its row, False at later duplicates
        and at padding rows. A gradient keeps each row's cotangent in its first copy only, so that
        the duplicates, summed, read as the dense gradient once.

        Examples:
            >>> import jax.numpy as jnp, masked_jax as mj
            >>> mj.row_sparse(jnp.ones((4, 1)), jnp.array([2, 0, 2, 5]), (5, 1)).first_copies()
            Array([ True,  True, False, False], dtype=bool)
        """
        return first_copies(self.clean_indices()) & self.row_valid()

    def coalesce(self) -> RowSparseArray:
        """Sum duplicate rows; indices become sorted and unique, padding (index N) last. Static K.

        A no-op when the indices are known to be unique (``unique_indices``: set by
        ``coalesce`` itself, by conversions and reads, or promised to :func:`row_sparse`); such
        indices keep their order, which need not be sorted.

        Examples:
            >>> import jax.numpy as jnp, masked_jax as mj
            >>> x = mj.row_sparse(jnp.array([[1.0], [2.0], [5.0]]), jnp.array([3, 0, 3]), (4, 1)).coalesce()
            >>> x.indices, x.data[:, 0]
            (Array([0, 3, 4], dtype=int32), Array([2., 6., 0.], dtype=float32))
        """
        return self.sum_duplicates(unique_ids)

    def sum_duplicates(self, method=distinct_ids) -> RowSparseArray:
        """Duplicate rows summed, each distinct row stored once, in whatever order is fastest to find.

        The optimizers' path: they gather and scatter by index, in any order. :meth:`coalesce`
        also sorts the rows. ``method`` finds the distinct ids and each stored row's segment.

        Examples:
            >>> import jax.numpy as jnp, masked_jax as mj
            >>> x = mj.row_sparse(jnp.array([[1.0], [2.0], [5.0]]), jnp.array([3, 0, 3]), (4, 1))
            >>> x.sum_duplicates().todense().data[:, 0]
            Array([2., 0., 0., 6.], dtype=float32)
        """
        if self.unique_indices:
            return self
        n, k = self.shape[0], self.nse
        idx = jnp.where(self.row_valid(), self.indices, n).astype(jnp.int32)
        if k == 0:
            return rows_from_parts(self.shape, self.data, idx, True)
        uniq, seg = method(idx, n)
        if self.dtype == jnp.bool_:  # duplicates of a bool are or-ed
            data = jax.ops.segment_max(self.data, seg, num_segments=k)
        else:
            data = row_totals(self.data, seg, k)  # float32 accumulation for half precision; no atomics on a GPU
        return rows_from_parts(self.shape, data, uniq, True)

    def retain(self, rows) -> RowSparseArray:
        """Keep only the stored rows whose index is in ``rows`` (MXNet ``retain``); K is unchanged,
        dropped rows become padding.

        Examples:
            >>> import jax.numpy as jnp, masked_jax as mj
            >>> x = mj.row_sparse(jnp.ones((3, 2)), jnp.array([0, 2, 5]), (6, 2))
            >>> x.retain(jnp.array([2, 5])).todense().mask[:, 0]
            Array([False, False,  True, False, False,  True], dtype=bool)
        """
        rows = jnp.asarray(rows)
        keep = jnp.isin(self.indices, rows)
        return rows_from_parts(self.shape, self.data, jnp.where(keep, self.indices, self.shape[0]), self.unique_indices)

    def to_bcoo(self) -> jsparse.BCOO:
        """The stored rows as a ``jax.experimental.sparse.BCOO`` (1 sparse + ndim-1 dense dims)."""
        return jsparse.BCOO(
            (self.clean_data(), self.clean_indices()[:, None]),
            shape=self.shape,
            indices_sorted=False,
            unique_indices=False,
        )

    def __getitem__(self, index):
        """Basic indexing (ints, slices, ``...``, ``None``) on the stored rows, as BCOO indexes
        them: slices give a BCOO-backed result built from the stored rows inside them; a row
        (an int) is a dense MaskedArray, masked where the row is not stored.

        Examples:
            >>> import jax.numpy as jnp, masked_jax as mj
            >>> grad = mj.row_sparse(jnp.array([[1.0, 2.0]]), jnp.array([3]), (5, 2))
            >>> grad[3], grad[0]
            (MaskedArray([1.0 2.0], dtype=float32), MaskedArray([-- --], dtype=float32))
        """
        return basic_index(self, self.to_bcoo(), index)

    def take_rows(self, ids, valid=None) -> RowSparseArray:
        """``x[ids]`` for a 1-d integer array ``ids``: row ``j`` of the result is row ``ids[j]``,
        stored where that row is stored and ``valid[j]`` (a masked id gives a masked row), as a
        row-sparse array of ``len(ids)`` rows. O(len(ids) x row size): the stored rows are found by
        a sorted search, no array of the logical shape is built. Negative ids count from the end;
        a valid id out of range raises ``IndexError`` when the ids are known, and gives a masked
        row under a trace.

        Examples:
            >>> import jax.numpy as jnp, masked_jax as mj
            >>> table = mj.row_sparse(jnp.array([[1.0, 2.0], [3.0, 4.0]]), jnp.array([4, 1]), (6, 2))
            >>> table[jnp.array([1, 0, 4, 1])].todense()
            MaskedArray([[3.0 4.0]
                         [-- --]
                         [1.0 2.0]
                         [3.0 4.0]], dtype=float32)
        """
        n = self.shape[0]
        ids = jnp.asarray(ids)
        if ids.ndim != 1 or not jnp.issubdtype(ids.dtype, jnp.integer):
            raise TypeError(f"take_rows: ids must be a 1-d integer array; got {ids.dtype} of shape {ids.shape}.")
        valid = jnp.ones(ids.shape, bool) if valid is None else jnp.asarray(valid)
        if not (is_tracer(ids) or is_tracer(valid)):
            known = np.asarray(ids)[np.asarray(valid)]
            bad = known[(known < -n) | (known >= n)]
            if bad.size:
                raise IndexError(f"index {int(bad[0])} is out of bounds for axis 0 with size {n}.")
        ids = jnp.where(ids < 0, ids + n, ids)
        x = self.coalesce()  # unique rows; sorted unless they were already unique
        if x.nse == 0:
            return rows_from_parts(
                (ids.shape[0],) + self.shape[1:],
                jnp.zeros((0,) + self.shape[1:], self.dtype),
                jnp.zeros(0, jnp.int32),
                True,
            )
        stored = x.clean_indices()
        if self.unique_indices:  # unique already (a read, a conversion, a promise): in any order, so sort them
            order = jnp.argsort(stored)
            at = order[jnp.clip(sorted_search(stored[order], ids), 0, x.nse - 1)]
        else:  # coalesced: sorted, padding (index n) last
            at = jnp.clip(sorted_search(stored, ids), 0, x.nse - 1)
        hit = (stored[at] == ids) & valid & (ids >= 0) & (ids < n)
        m = ids.shape[0]
        rows = jnp.where(hit, jnp.arange(m), m).astype(jnp.int32)
        return rows_from_parts((m,) + self.shape[1:], x.clean_data()[at], rows, True)

    def to_bcoo_masked(self):
        """The same stored rows as a BCOO-backed masked array (no densifying)."""
        return SparseMasked.LAYOUTS["bcoo"].from_masked(self)

    @property
    def T(self):
        """Transpose as a BCOO-backed masked array (each stored element becomes one entry)."""
        return SparseMasked.LAYOUTS["bcoo"].from_masked(self).flatten_dense().transpose()

    @classmethod
    def from_masked(cls, x, nse=None) -> RowSparseArray:
        """Row-sparse storage of ``x``: a row is stored iff it has any valid element (its masked
        elements must be absent: rows are all-or-nothing, so a partly valid row raises eagerly)."""
        if hasattr(x, "to_row_sparse"):
            return x.to_row_sparse()
        dense = x if isinstance(x, MaskedArray) else x.todense()
        if not dense.ndim:
            raise ValueError("row-sparse storage needs at least one dimension.")
        flat = dense.mask.reshape(dense.shape[0], math.prod(dense.shape[1:]))
        rows = jnp.any(flat, axis=1)  # a row of no entries is not stored
        if nse is None:
            if is_tracer(rows):
                raise ValueError("tostype('row_sparse') under jit needs a static nse (number of stored rows).")
            full = jnp.all(flat, axis=1) & (flat.shape[1] > 0)
            if not bool(jnp.all(full == rows)):
                raise ValueError("row-sparse storage needs each row fully valid or fully masked.")
            nse = int(jnp.sum(rows))
        idx = jnp.nonzero(rows, size=nse, fill_value=dense.shape[0])[0].astype(jnp.int32)
        data = take_rows(dense.data, idx)
        return rows_from_parts(dense.shape, data, idx, True)


def rows_from_parts(shape, data, indices, unique_indices: bool = False) -> RowSparseArray:
    """The trusted constructor: a RowSparseArray of parts that the caller built, with no checks.

    For library code that made ``data`` (K, ...) and int32 ``indices`` (K,) itself; users call
    :func:`row_sparse`, which validates them.
    """
    return cast(RowSparseArray, RowSparseArray.tree_unflatten((tuple(shape), bool(unique_indices)), (data, indices)))


def take_rows(x, ids, fill_value=0):
    """``x[ids]`` along axis 0, ids out of range reading ``fill_value``, also where ``x`` has no rows
    (every id is then out of range; ``jnp.take`` refuses to read an empty axis)."""
    if x.shape[0] == 0:
        return jnp.full(jnp.shape(ids) + x.shape[1:], fill_value, x.dtype)
    return jnp.take(x, ids, axis=0, mode="fill", fill_value=fill_value)


def pad_indices(indices, n: int, min_rows: int = 2):
    """``indices`` with padding rows (index ``n``) appended up to ``min_rows``.

    With a single index XLA rewrites gather and scatter as dynamic slices, and a
    read-then-write of the same table then copies the whole table, with or without
    donation. Two indices
    keep it an in-place scatter. Used by the optimizers and by row-sparse lookups.
    """
    pad = min_rows - indices.shape[0]
    if pad <= 0:
        return indices
    return jnp.concatenate([indices, jnp.full((pad,), n, indices.dtype)])


def at_least_two_rows(x: RowSparseArray) -> RowSparseArray:
    """``x`` with a zero padding row appended if it stores a single row (see :func:`pad_indices`)."""
    indices = pad_indices(x.indices, x.shape[0])
    if indices is x.indices:
        return x
    pad = jnp.zeros((indices.shape[0] - x.nse,) + x.data.shape[1:], x.dtype)
    return rows_from_parts(x.shape, jnp.concatenate([x.data, pad]), indices, x.unique_indices)


def check_integer_indices(indices, argname: str = "indices"):
    """``indices`` as a jax integer array of at least 32 bits (narrower ones widened to int32); a
    ``TypeError`` for non-integers and a ``ValueError`` for concrete values that would not survive
    the conversion (int64 values past int32 with x64 off)."""
    if not isinstance(indices, jax.Array) and not is_tracer(indices):
        host = np.asarray(indices)
        if _validate.dtype_kind(host.dtype) not in "iu":
            raise TypeError(f"{argname} must be integers; got dtype {host.dtype}.")
        if host.size and not jax.config.read("jax_enable_x64"):
            lo, hi = np.iinfo(np.int32).min, np.iinfo(np.int32).max
            if host.min() < lo or host.max() > hi:
                raise ValueError(
                    f"{argname} holds values outside int32 ([{host.min()}, {host.max()}]) and "
                    "jax_enable_x64 is off, so they would wrap silently; enable x64 or pass "
                    "indices in int32 range."
                )
        indices = host
    indices = jnp.asarray(indices)
    if not jnp.issubdtype(indices.dtype, jnp.integer):
        raise TypeError(f"{argname} must be integers; got dtype {indices.dtype}.")
    return widened_indices(indices)


def _batched_rows(shape, data, indices):
    """Row sets stacked along leading batch dimensions, as a batched BCOO-backed masked array of
    shape ``batch + shape`` (row ``indices[b, i]`` of batch element ``b`` holds ``data[b, i]``)."""
    n_batch = indices.ndim - 1
    out_shape = tuple(indices.shape[:n_batch]) + tuple(shape)
    return BCOOMaskedArray.tree_unflatten(out_shape, (data, indices[..., None]))


def row_sparse(data, indices, shape, *, unique_indices: bool = False) -> RowSparseArray:
    """Row-sparse array of ``shape`` with rows ``data[i]`` at row ``indices[i]``.

    Duplicate indices are summed. ``K = len(indices)`` is static. Index ``N = shape[0]`` is
    the padding index: a padding row holds nothing, is skipped by every op, optimizer and
    ``apply_updates``, and is what the library's own row-sparse gradients use to pad. Other
    indices outside ``[0, N)`` raise ``ValueError`` here when concrete; under ``jit`` (where
    they cannot be checked) they are padding too.

    Args:
        data: ``(K, *shape[1:])`` array of row values.
        indices: (K,) integer row indices.
        shape: the full shape ``(N, *shape[1:])``.
        unique_indices: promise that ``indices`` has no duplicates (as BCOO's flag), so that ops
            skip coalescing. Checked when the indices are concrete.

    Examples:
        >>> import jax.numpy as jnp, masked_jax as mj, masked_jax.numpy as mnp
        >>> g = mj.row_sparse(jnp.array([[1.0, 2.0], [3.0, 4.0]]), jnp.array([0, 3]), (5, 2))
        >>> mnp.sum(g, axis=0)
        MaskedArray([4.0 6.0], dtype=float32)
    """
    data = check_data(data)
    shape = _validate.shape(shape, "row_sparse: shape")
    indices = check_integer_indices(indices)
    if indices.ndim != 1:
        raise ValueError(f"indices must be 1-D (one row index per stored row); got shape {indices.shape}.")
    if not shape:
        raise ValueError("shape must have at least one dimension (the rows).")
    if shape[0] > np.iinfo(np.int32).max:
        raise ValueError(
            f"a row-sparse array holds at most {np.iinfo(np.int32).max} rows (int32 row indices, the "
            f"padding index {shape[0]} included); got {shape[0]}. Use a BCOO-backed array (mj.from_bcoo), "
            "whose indices widen to hold any length."
        )
    if data.shape != (indices.shape[0],) + shape[1:]:
        raise ValueError(
            f"data must have shape {(indices.shape[0],) + shape[1:]} (K={indices.shape[0]} rows of "
            f"shape {shape[1:]}); got {data.shape}."
        )
    if not is_tracer(indices) and indices.size:
        host = np.asarray(indices)
        bad = host[(host < 0) | (host > shape[0])]
        if bad.size:
            raise ValueError(
                f"indices must be in [0, {shape[0]}) (or {shape[0]}, the padding index); got {bad[:5].tolist()}."
            )
        stored = host[host < shape[0]]
        if unique_indices and np.unique(stored).size != stored.size:
            raise ValueError("unique_indices=True but indices has duplicates.")
    return rows_from_parts(shape, data, indices.astype(jnp.int32), unique_indices)
