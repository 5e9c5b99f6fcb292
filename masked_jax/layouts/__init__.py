"""Sparse storage with masked semantics: BCOO-backed masked arrays and row-sparse arrays.

Storage and semantics are separate. ``jax.experimental.sparse.BCOO`` keeps dense
semantics (an unspecified entry is 0). The layouts here have **masked**
semantics: the specified entries are exactly the valid ones, an explicitly
stored zero is valid, and an unspecified entry does not exist.

Layer 3, above the array types (:mod:`masked_jax._core`). Each layout is a
:class:`SparseMasked` subclass in its own module; its rule table (``rules``: op family to rule)
is assigned in ``_dispatch``, beside the rules the layouts share. The names below the first group are for the
layers above (embeddings, optimizers, checking): trusted constructors and row helpers.
"""

from masked_jax._core import SparseMasked as SparseMasked
from masked_jax._core import StorageFallbackError as StorageFallbackError
from masked_jax._core import StorageFallbackWarning as StorageFallbackWarning
from masked_jax._core import strict_storage as strict_storage
from masked_jax.layouts._bcoo import BCOOMaskedArray as BCOOMaskedArray
from masked_jax.layouts._bcoo import from_bcoo as from_bcoo
from masked_jax.layouts._dispatch import apply as apply
from masked_jax.layouts._dispatch import densify as densify
from masked_jax.layouts._rows import RowSparseArray as RowSparseArray

# for the layers above
from masked_jax.layouts._rows import at_least_two_rows as at_least_two_rows
from masked_jax.layouts._rows import check_integer_indices as check_integer_indices
from masked_jax.layouts._rows import pad_indices as pad_indices
from masked_jax.layouts._rows import row_sparse as row_sparse
from masked_jax.layouts._rows import rows_from_parts as rows_from_parts
from masked_jax.layouts._rows import take_rows as take_rows
from masked_jax.layouts._segments import distinct_ids as distinct_ids
from masked_jax.layouts._segments import segment_total as segment_total
from masked_jax.layouts._segments import sorted_totals as sorted_totals
from masked_jax.layouts._segments import unique_targets as unique_targets

__all__ = [
    "BCOOMaskedArray",
    "RowSparseArray",
    "SparseMasked",
    "StorageFallbackError",
    "StorageFallbackWarning",
    "from_bcoo",
    "row_sparse",
    "strict_storage",
]
