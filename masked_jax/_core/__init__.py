"""The array types: ``MaskedArray``, the sparse-layout protocol, the methods every array class has.

Layer 2, above the op rules (:mod:`masked_jax.ops`). Everything above imports these names from
here, never from the private modules:

* ``_masked``: ``MaskedArray``, its constructors and mask checks, the bridge between arrays and the
  rules' ``Pair`` (:func:`unwrap`, :func:`wrap`, :func:`from_pair`), tree utilities;
* ``_sparse``: :class:`SparseMasked` (the abstract base of every sparse layout), conversions by
  storage name, the storage-fallback state;
* ``_methods``: :class:`ArrayMethods`, the base class whose methods ``masked_jax.numpy`` installs.
"""

from masked_jax._core._masked import MaskedArray as MaskedArray
from masked_jax._core._masked import as_masked as as_masked
from masked_jax._core._masked import check_data as check_data
from masked_jax._core._masked import check_index as check_index
from masked_jax._core._masked import from_numpy_ma as from_numpy_ma
from masked_jax._core._masked import from_pair as from_pair
from masked_jax._core._masked import fully_valid_data as fully_valid_data
from masked_jax._core._masked import is_masked as is_masked
from masked_jax._core._masked import is_masked_leaf as is_masked_leaf
from masked_jax._core._masked import is_operand as is_operand
from masked_jax._core._masked import masked_array as masked_array
from masked_jax._core._masked import tree_map_data as tree_map_data
from masked_jax._core._masked import unwrap as unwrap
from masked_jax._core._masked import wrap as wrap
from masked_jax._core._methods import ArrayMethods as ArrayMethods
from masked_jax._core._methods import method_example as method_example
from masked_jax._core._sparse import STATE as STATE
from masked_jax._core._sparse import SparseMasked as SparseMasked
from masked_jax._core._sparse import StorageFallbackError as StorageFallbackError
from masked_jax._core._sparse import StorageFallbackWarning as StorageFallbackWarning
from masked_jax._core._sparse import strict_storage as strict_storage
from masked_jax._core._sparse import tostype as tostype
from masked_jax._validate import is_tracer as is_tracer
