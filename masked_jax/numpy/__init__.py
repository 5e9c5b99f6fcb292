"""``jax.numpy`` with masked semantics (mask ``True`` = valid).

Every function accepts ``MaskedArray`` objects, sparse masked arrays and plain arrays alike (a plain
array is fully valid) and returns a ``MaskedArray`` (``count`` and ``argsort`` return plain
arrays: a count and a permutation are always defined). The functions are built from the op
registry (:mod:`masked_jax.ops`): each has ``jax.numpy``'s signature and a docstring with an
example. Family by family:

* elementwise ``f(x)``: data ``f(data)``, mask unchanged;
* binary ``a op b``: valid where both are valid;
* reductions: over valid elements only; fully masked slices are masked;
* shape ops and indexing: the mask moves with the data;
* ``matmul``/``dot``/``einsum``: sum over indices where both operands are valid.

A ``where=`` argument of a reduction excludes elements as the mask does. A ``jax.numpy``
parameter without a masked meaning (``out``, ``initial``, ...) is accepted at its default only.
Unlike ``numpy.ma``, out-of-domain results (``log(-1)``, ``1/0``) are *not* masked: they are
``nan``/``inf`` at valid positions, as in ``jax.numpy``.

Examples:
    >>> import jax.numpy as jnp, masked_jax as mj, masked_jax.numpy as mnp
    >>> x = mj.masked_array(jnp.array([1.0, jnp.nan, 3.0]), jnp.array([True, False, True]))
    >>> mnp.mean(x)
    MaskedArray(2.0, dtype=float32)
"""

from __future__ import annotations

from masked_jax._core import as_masked, masked_array
from masked_jax.numpy import _frontend

__all__ = ["as_masked", "masked_array"]
_frontend.attach("numpy", globals())

amax, amin = max, min  # installed by attach
__all__ += ["amax", "amin"]

# The functions whose masked meaning is a composition of registered ops (the Array API's and
# jax.numpy's), by topic, and the standard's constants and dtypes.
from masked_jax.numpy import (
    _contractions,
    _creation,
    _dtypes,
    _metadata,
    _misc,
    _reductions,
    _searching,
    _setops,
    _stacking,
)
from masked_jax.numpy._contractions import convolve as convolve
from masked_jax.numpy._contractions import correlate as correlate
from masked_jax.numpy._contractions import cross as cross
from masked_jax.numpy._contractions import diagonal as diagonal
from masked_jax.numpy._contractions import kron as kron
from masked_jax.numpy._contractions import matrix_transpose as matrix_transpose
from masked_jax.numpy._contractions import matvec as matvec
from masked_jax.numpy._contractions import trace as trace
from masked_jax.numpy._contractions import vecdot as vecdot
from masked_jax.numpy._contractions import vecmat as vecmat
from masked_jax.numpy._creation import arange as arange
from masked_jax.numpy._creation import asarray as asarray
from masked_jax.numpy._creation import copy as copy
from masked_jax.numpy._creation import diag as diag
from masked_jax.numpy._creation import diagflat as diagflat
from masked_jax.numpy._creation import empty as empty
from masked_jax.numpy._creation import empty_like as empty_like
from masked_jax.numpy._creation import eye as eye
from masked_jax.numpy._creation import from_dlpack as from_dlpack
from masked_jax.numpy._creation import full as full
from masked_jax.numpy._creation import full_like as full_like
from masked_jax.numpy._creation import linspace as linspace
from masked_jax.numpy._creation import meshgrid as meshgrid
from masked_jax.numpy._creation import ones as ones
from masked_jax.numpy._creation import ones_like as ones_like
from masked_jax.numpy._creation import tril as tril
from masked_jax.numpy._creation import triu as triu
from masked_jax.numpy._creation import zeros as zeros
from masked_jax.numpy._creation import zeros_like as zeros_like
from masked_jax.numpy._dtypes import can_cast as can_cast
from masked_jax.numpy._dtypes import finfo as finfo
from masked_jax.numpy._dtypes import iinfo as iinfo
from masked_jax.numpy._dtypes import isdtype as isdtype
from masked_jax.numpy._dtypes import result_type as result_type
from masked_jax.numpy._metadata import __array_namespace_info__ as __array_namespace_info__
from masked_jax.numpy._metadata import bool as bool
from masked_jax.numpy._metadata import complex64 as complex64
from masked_jax.numpy._metadata import complex128 as complex128
from masked_jax.numpy._metadata import e as e
from masked_jax.numpy._metadata import float32 as float32
from masked_jax.numpy._metadata import float64 as float64
from masked_jax.numpy._metadata import inf as inf
from masked_jax.numpy._metadata import int8 as int8
from masked_jax.numpy._metadata import int16 as int16
from masked_jax.numpy._metadata import int32 as int32
from masked_jax.numpy._metadata import int64 as int64
from masked_jax.numpy._metadata import nan as nan
from masked_jax.numpy._metadata import newaxis as newaxis
from masked_jax.numpy._metadata import pi as pi
from masked_jax.numpy._metadata import uint8 as uint8
from masked_jax.numpy._metadata import uint16 as uint16
from masked_jax.numpy._metadata import uint32 as uint32
from masked_jax.numpy._metadata import uint64 as uint64
from masked_jax.numpy._misc import ndim as ndim
from masked_jax.numpy._misc import shape as shape
from masked_jax.numpy._misc import size as size
from masked_jax.numpy._reductions import allclose as allclose
from masked_jax.numpy._reductions import count_nonzero as count_nonzero
from masked_jax.numpy._reductions import cumulative_prod as cumulative_prod
from masked_jax.numpy._reductions import cumulative_sum as cumulative_sum
from masked_jax.numpy._reductions import diff as diff
from masked_jax.numpy._reductions import ediff1d as ediff1d
from masked_jax.numpy._reductions import nanargmax as nanargmax
from masked_jax.numpy._reductions import nanargmin as nanargmin
from masked_jax.numpy._reductions import nancumprod as nancumprod
from masked_jax.numpy._reductions import nancumsum as nancumsum
from masked_jax.numpy._reductions import nanmax as nanmax
from masked_jax.numpy._reductions import nanmean as nanmean
from masked_jax.numpy._reductions import nanmedian as nanmedian
from masked_jax.numpy._reductions import nanmin as nanmin
from masked_jax.numpy._reductions import nanpercentile as nanpercentile
from masked_jax.numpy._reductions import nanprod as nanprod
from masked_jax.numpy._reductions import nanquantile as nanquantile
from masked_jax.numpy._reductions import nanstd as nanstd
from masked_jax.numpy._reductions import nansum as nansum
from masked_jax.numpy._reductions import nanvar as nanvar
from masked_jax.numpy._searching import argwhere as argwhere
from masked_jax.numpy._searching import bincount as bincount
from masked_jax.numpy._searching import digitize as digitize
from masked_jax.numpy._searching import flatnonzero as flatnonzero
from masked_jax.numpy._searching import histogram as histogram
from masked_jax.numpy._searching import interp as interp
from masked_jax.numpy._searching import nonzero as nonzero
from masked_jax.numpy._searching import searchsorted as searchsorted
from masked_jax.numpy._searching import select as select
from masked_jax.numpy._setops import isin as isin
from masked_jax.numpy._setops import unique as unique
from masked_jax.numpy._setops import unique_all as unique_all
from masked_jax.numpy._setops import unique_counts as unique_counts
from masked_jax.numpy._setops import unique_inverse as unique_inverse
from masked_jax.numpy._setops import unique_values as unique_values
from masked_jax.numpy._stacking import append as append
from masked_jax.numpy._stacking import array_split as array_split
from masked_jax.numpy._stacking import broadcast_arrays as broadcast_arrays
from masked_jax.numpy._stacking import column_stack as column_stack
from masked_jax.numpy._stacking import dsplit as dsplit
from masked_jax.numpy._stacking import dstack as dstack
from masked_jax.numpy._stacking import hsplit as hsplit
from masked_jax.numpy._stacking import hstack as hstack
from masked_jax.numpy._stacking import unstack as unstack
from masked_jax.numpy._stacking import vsplit as vsplit
from masked_jax.numpy._stacking import vstack as vstack

__array_api_version__ = _metadata.API_VERSION
# the standard's and jax.numpy's other names for functions of the registry (the same functions)
for _standard, _ours in {**_metadata.ALIASES, **_metadata.JNP_ALIASES}.items():
    globals()[_standard] = globals()[_ours]
__all__ += [
    name
    for topic in (_metadata, _creation, _dtypes, _contractions, _stacking, _reductions, _setops, _searching, _misc)
    for name in topic.__all__
]
__all__ += [*_metadata.ALIASES, *_metadata.JNP_ALIASES]

# The extensions, as real submodules (``import masked_jax.numpy.linalg`` works as for jax.numpy).
from masked_jax.numpy import fft as fft
from masked_jax.numpy import linalg as linalg

__all__ += ["fft", "linalg"]

# jax.Array's methods that are not one op of the registry, on every masked array class; and
# MaskedArray.__array_namespace__, this module (handed down: the array types never import it)
import sys as _sys

from masked_jax.numpy import _array_methods

_array_methods.install(_sys.modules[__name__])
