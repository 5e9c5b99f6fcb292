"""How a gradient leaf sees a parameter-shaped array: all of it, its valid entries, or its rows.

One ``_View`` per gradient leaf, shared by :func:`lazy` (which gathers parameters
and optimizer state through it and scatters the results back) and
:func:`apply_updates` (which adds an update through it).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from masked_jax._core import SparseMasked, from_pair, is_masked
from masked_jax.layouts import RowSparseArray, at_least_two_rows, rows_from_parts, take_rows


def data_of(x):
    """The array an optimizer works on: a masked parameter's data, or the array itself."""
    return x.data if is_masked(x) else x


@dataclasses.dataclass(frozen=True)
class _View:
    kind: str  # "dense" | "masked" | "rows"
    shape: tuple
    mask: jax.Array | None = None  # "masked": same shape as the parameter
    indices: jax.Array | None = None  # "rows": (K,) unique row indices, padding = shape[0]
    stored: tuple = (0, False)  # "rows": the gradient's own (K, unique_indices), kept by ``wrap``

    def _row_mask(self, ndim):
        valid = self.indices < self.shape[0]
        return valid.reshape((-1,) + (1,) * (ndim - 1))

    def gather(self, x):
        """The part of a parameter-shaped array this gradient touches (zeros where it does not)."""
        if self.kind == "dense":
            return x
        if self.kind == "masked":
            return jnp.where(self.mask, x, jnp.zeros((), x.dtype))
        return take_rows(x, self.indices)

    def scatter(self, old, new):
        """``old`` with the touched part replaced by ``new`` (as gathered); the rest bit-identical."""
        new = new.astype(old.dtype)
        if self.kind == "dense":
            return new
        if self.kind == "masked":
            return jnp.where(self.mask, new, old)
        return jnp.asarray(old).at[self.indices].set(new, mode="drop")  # numpy too (a restored checkpoint)

    def add(self, param, update):
        """``param + update`` on the touched part only; dtype of ``param`` kept."""
        update = update.astype(param.dtype)
        if self.kind == "dense":
            return param + update
        if self.kind == "masked":
            return jnp.where(self.mask, param + update, param)
        return jnp.asarray(param).at[self.indices].add(update, mode="drop")

    def wrap(self, u):
        """An update (as gathered) in the storage of the gradient it came from."""
        zero = jnp.zeros((), u.dtype)
        if self.kind == "dense":
            return u
        if self.kind == "masked":
            return from_pair(jnp.where(self.mask, u, zero), self.mask)
        u = jnp.where(self._row_mask(u.ndim), u, zero)
        # the gradient's own K and flags, so that an update has the gradient's pytree structure
        # (optax wrappers select between the two under lax.cond); slots past K are padding
        k, unique = self.stored
        return rows_from_parts(self.shape, u[:k], self.indices[:k], unique)


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
        v = _View("rows", g.shape, indices=jnp.where(g.row_valid(), g.indices, g.shape[0]), stored=stored)
        return v, jnp.where(v._row_mask(g.ndim), g.data, jnp.zeros((), g.dtype))
    if is_masked(g):
        return _View("masked", g.shape, mask=g.mask), g.filled(0)
    g = jnp.asarray(g)
    return _View("dense", g.shape), g
