"""Sparse storage with masked semantics: BCOO-backed masked arrays and row-sparse arrays.

Storage and semantics are separate. ``jax.experimental.sparse.BCOO`` keeps dense
semantics (an unspecified entry is 0). The layouts here have **masked**
semantics: the specified entries are exactly the valid ones, an explicitly
stored zero is valid, and an unspecified entry does not exist.
"""

from masked_jax._storage import SparseMasked, StorageFallbackWarning, StorageFallbackError
from masked_jax._storage import strict_storage
from masked_jax.layouts.bcoo import BCOOMaskedArray, from_bcoo
from masked_jax.layouts.rows import RowSparseArray, row_sparse

__all__ = [
    "BCOOMaskedArray", "RowSparseArray", "SparseMasked", "StorageFallbackError",
    "StorageFallbackWarning", "from_bcoo", "row_sparse", "strict_storage",
]
