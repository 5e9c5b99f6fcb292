"""How a gradient leaf sees a parameter-shaped array: all of it, its valid entries, or its rows.

One view per gradient leaf, of the class of its storage: :class:`DenseView` for a plain array,
:class:`MaskedView` for a ``MaskedArray`` (and a BCOO-backed array, densified), :class:`RowsView`
for a ``RowSparseArray``. Each class holds everything the optimizers do differently by storage:
gathering what the gradient touches and scattering results back (:func:`lazy`), adding an update
(:func:`apply_updates`), growing per-row sums (row-wise Adagrad), and the counters of lazy
catch-up. :func:`view` is the one place that looks at a gradient's type.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax.numpy as jnp

from masked_jax._core import SparseMasked, from_pair, is_masked
from masked_jax.layouts import RowSparseArray, at_least_two_rows, rows_from_parts, take_rows, unique_targets


def data_of(x):
    """The array an optimizer works on: a masked parameter's data, or the array itself."""
    return x.data if is_masked(x) else x


@dataclasses.dataclass(frozen=True)
class DenseView:
    """A plain gradient: it touches every entry of its parameter."""

    shape: tuple

    def gather(self, x):
        """The part of a parameter-shaped array this gradient touches (zeros where it does not)."""
        return x

    def scatter(self, old, new):
        """``old`` with the touched part replaced by ``new`` (as gathered); the rest bit-identical."""
        return new.astype(old.dtype)

    def add(self, param, update):
        """``param + update`` on the touched part only; dtype of ``param`` kept."""
        return param + update.astype(param.dtype)

    def wrap(self, u):
        """An update (as gathered) in the storage of the gradient it came from."""
        return u

    def grow_rows(self, sums, grow, per_row: bool):
        """Per-row (or per-entry) running sums plus ``grow`` where touched: ``(new sums, the sums
        of the touched rows, as gathered)``. ``per_row``: ``grow`` holds one value per row."""
        del per_row
        sums = sums + grow.astype(sums.dtype)
        return sums, sums

    def steps_since(self, last, step):
        """Per touched row (or entry): steps since it was last current (0 for padding rows)."""
        return step - last

    def touch(self, last, step):
        """The catch-up counters after this update: what this gradient touches is current as of
        ``step + 1``."""
        return jnp.full_like(last, step + 1)

    def rows(self, data, shape):
        """The gradient as coalesced rows ``(indices (K,), data (K, ...))``, padding ``N``."""
        return jnp.arange(shape[0], dtype=jnp.int32), data


@dataclasses.dataclass(frozen=True)
class MaskedView(DenseView):
    """A masked gradient: it touches its valid entries."""

    mask: Any = None  # same shape as the parameter

    def gather(self, x):
        return jnp.where(self.mask, x, jnp.zeros((), x.dtype))

    def scatter(self, old, new):
        return jnp.where(self.mask, new.astype(old.dtype), old)

    def add(self, param, update):
        return jnp.where(self.mask, param + update.astype(param.dtype), param)

    def wrap(self, u):
        return from_pair(jnp.where(self.mask, u, jnp.zeros((), u.dtype)), self.mask)

    def grow_rows(self, sums, grow, per_row: bool):
        sums = sums + grow.astype(sums.dtype) if per_row else self.add(sums, grow)
        return sums, sums

    def touch(self, last, step):
        now = step + 1
        if last.ndim:  # one counter per row: touched where the row has a valid entry
            touched = jnp.any(self.mask.reshape(self.mask.shape[:1] + (math.prod(self.mask.shape[1:]),)), axis=1)
            return jnp.where(touched, now, last)
        return jnp.where(jnp.any(self.mask), now, last)

    def rows(self, data, shape):
        raise TypeError(
            "lazy(MultiSteps, capacity=...): a leaf with a row capacity takes row-sparse (or dense) "
            "gradients; got a masked array. Give it capacity None."
        )


@dataclasses.dataclass(frozen=True)
class RowsView(DenseView):
    """A row-sparse gradient: it touches its stored rows."""

    indices: Any = None  # (K,) unique row indices, padding = shape[0]
    stored: tuple = (0, False)  # the gradient's own (K, unique_indices), kept by ``wrap``

    def row_mask(self, ndim):
        valid = self.indices < self.shape[0]
        return valid.reshape((-1,) + (1,) * (ndim - 1))

    def gather(self, x):
        return take_rows(x, self.indices)

    def targets(self):
        """The rows written, told unique to the scatter (padding moved past the end): on a GPU a
        scatter with unique indices is plain stores, where one that may repeat is atomics."""
        return unique_targets(self.indices, self.shape[0])

    def scatter(self, old, new):
        # numpy too (a restored checkpoint)
        at, unique = self.targets()
        return jnp.asarray(old).at[at].set(new.astype(old.dtype), mode="drop", unique_indices=unique)

    def add(self, param, update):
        at, unique = self.targets()
        return jnp.asarray(param).at[at].add(update.astype(param.dtype), mode="drop", unique_indices=unique)

    def wrap(self, u):
        u = jnp.where(self.row_mask(u.ndim), u, jnp.zeros((), u.dtype))
        # the gradient's own K and flags, so that an update has the gradient's pytree structure
        # (optax wrappers select between the two under lax.cond); slots past K are padding
        k, unique = self.stored
        return rows_from_parts(self.shape, u[:k], self.indices[:k], unique)

    def grow_rows(self, sums, grow, per_row: bool):
        at, unique = self.targets()
        sums = jnp.asarray(sums).at[at].add(grow.astype(sums.dtype), mode="drop", unique_indices=unique)
        return sums, take_rows(sums, self.indices)

    def steps_since(self, last, step):
        seen = take_rows(last, self.indices)
        return jnp.where(self.indices < last.shape[0], step - seen, 0)

    def touch(self, last, step):
        at, unique = self.targets()
        return jnp.asarray(last).at[at].set(step + 1, mode="drop", unique_indices=unique)

    def rows(self, data, shape):
        return self.indices, data


def view(g, *, coalesce: bool = True):
    """``(view, data)`` for a gradient leaf: how it touches its parameter, and its values as gathered.

    Row-sparse gradients are coalesced (duplicate rows summed: the update is nonlinear)
    unless ``coalesce=False`` (a plain sum, as in :func:`apply_updates`).
    """
    if isinstance(g, SparseMasked) and not isinstance(g, RowSparseArray):
        g = g.todense()  # BCOO: entry sets are not row sets; work on the dense-storage mask
    if isinstance(g, RowSparseArray):
        stored = (g.nse, g.unique_indices)
        if coalesce:
            g = g.sum_duplicates()
        g = at_least_two_rows(g)
        v = RowsView(g.shape, indices=jnp.where(g.row_valid(), g.indices, g.shape[0]), stored=stored)
        return v, jnp.where(v.row_mask(g.ndim), g.data, jnp.zeros((), g.dtype))
    if is_masked(g):
        return MaskedView(g.shape, mask=g.mask), g.filled(0)
    g = jnp.asarray(g)
    return DenseView(g.shape), g
