"""``apply_updates`` for dense, masked and row-sparse updates."""

from __future__ import annotations

from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np

from masked_jax._core import from_pair, is_masked, is_masked_leaf
from masked_jax.ops._base import accumulation_dtype
from masked_jax.optim._views import data_of, view


def apply_updates(params, updates):
    """``params + updates`` where each update is valid; parameters keep their dtype and storage.

    Update leaves may be plain arrays (added everywhere), ``MaskedArray`` objects (added
    where valid: other entries stay bit-identical) or :class:`RowSparseArray` objects
    (scatter-added into the stored rows; duplicate rows add up, those of float16 and bfloat16
    in float32, as ``jnp.sum`` adds; O(K x dim)).
    ``None`` leaves leave the parameter alone. A ``MaskedArray`` parameter keeps its
    mask. Inside a jitted step that donates ``params`` the scatter is in place.

    Examples:
        >>> import jax.numpy as jnp, masked_jax as mj
        >>> from masked_jax import optim
        >>> table = jnp.zeros((4, 2))
        >>> up = mj.row_sparse(jnp.ones((2, 2)), jnp.array([3, 3]), (4, 2))
        >>> optim.apply_updates(table, up)[3]
        Array([2., 2.], dtype=float32)
    """
    return add_updates(params, updates, coalesced=False)


def add_updates(params, updates, *, coalesced: bool):
    """:func:`apply_updates`; ``coalesced=True`` promises that no row-sparse update stores a row
    twice (the library's lazy optimizers coalesce their updates), which spares float16 and
    bfloat16 updates the coalescing that adds up their duplicates in float32."""

    def one(p, u):
        if u is None:
            return p
        if not (is_masked_leaf(u) or isinstance(u, (jax.Array, np.ndarray, np.generic, float, int))):
            raise TypeError(
                f"apply_updates: updates must be arrays, MaskedArrays or row-sparse arrays "
                f"(or None); got {type(u).__name__}."
            )
        indices = getattr(u, "indices", None)  # a sparse update's index leaf
        if indices is not None and not jnp.issubdtype(indices.dtype, jnp.integer):
            raise TypeError(
                f"apply_updates: a {type(u).__name__} update holds {indices.dtype} indices: a "
                "transformation that updates every leaf it is handed (a plain optax optimizer) "
                "also changed the indices of a row-sparse gradient. Wrap the optimizer in "
                "optim.lazy(...), which updates only the rows stored."
            )
        data = data_of(p)
        u = cast(Any, u)  # an update leaf: an array, a MaskedArray or a sparse layout
        if tuple(u.shape) != tuple(data.shape):
            raise ValueError(
                f"apply_updates: an update of shape {tuple(u.shape)} for a parameter of "
                f"shape {tuple(data.shape)}; they must match."
            )
        # a plain scatter-add, unless float16/bfloat16 duplicates must first add up in float32
        v, values = view(u, coalesce=not coalesced and accumulation_dtype(u.dtype) != u.dtype)
        new = v.add(data, values)
        return from_pair(new, p.compact_mask) if is_masked(p) else new

    return jax.tree_util.tree_map(one, params, updates, is_leaf=lambda x: x is None or is_masked_leaf(x))
