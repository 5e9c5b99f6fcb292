"""masked_jax: masked and sparse arrays as first-class JAX pytrees.

Mask convention: ``True`` = valid (the opposite of ``numpy.ma``).
"""

from masked_jax import _serialization
from masked_jax import nn as nn
from masked_jax import numpy as numpy
from masked_jax import optim as optim
from masked_jax._ad import grad as grad
from masked_jax._ad import hessian as hessian
from masked_jax._ad import jacfwd as jacfwd
from masked_jax._ad import jacrev as jacrev
from masked_jax._ad import tangent as tangent
from masked_jax._ad import value_and_grad as value_and_grad
from masked_jax._core import MaskedArray as MaskedArray
from masked_jax._core import as_masked as as_masked
from masked_jax._core import from_numpy_ma as from_numpy_ma
from masked_jax._core import is_masked as is_masked
from masked_jax._core import is_masked_leaf as is_masked_leaf
from masked_jax._core import masked_array as masked_array
from masked_jax._core import tree_map_data as tree_map_data
from masked_jax._maskify import MaskifyError as MaskifyError
from masked_jax._maskify import lengths as lengths
from masked_jax._maskify import mask_of as mask_of
from masked_jax._maskify import maskify as maskify
from masked_jax.checking import InvarianceError as InvarianceError
from masked_jax.checking import InvarianceReport as InvarianceReport
from masked_jax.checking import JacobianError as JacobianError
from masked_jax.checking import JacobianReport as JacobianReport
from masked_jax.checking import check_invariance as check_invariance
from masked_jax.checking import check_jacobian as check_jacobian
from masked_jax.embeddings import TableStack as TableStack
from masked_jax.embeddings import embedding_bag as embedding_bag
from masked_jax.embeddings import lookup as lookup
from masked_jax.embeddings import stack_tables as stack_tables
from masked_jax.layouts import BCOOMaskedArray as BCOOMaskedArray
from masked_jax.layouts import RowSparseArray as RowSparseArray
from masked_jax.layouts import StorageFallbackError as StorageFallbackError
from masked_jax.layouts import StorageFallbackWarning as StorageFallbackWarning
from masked_jax.layouts import from_bcoo as from_bcoo
from masked_jax.layouts import row_sparse as row_sparse
from masked_jax.layouts import strict_storage as strict_storage

_serialization.install()  # flax.serialization knows the array classes once flax is imported
del _serialization

__version__ = "0.1.0"
