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

from masked_jax._core import as_masked, masked_array  # noqa: F401
from masked_jax.numpy import _frontend

__all__ = ["as_masked", "masked_array"]
_frontend.attach("numpy", globals())

amax, amin = max, min  # noqa: F821  (installed by attach)
__all__ += ["amax", "amin"]

# The Array API standard: constants, dtypes, creation and dtype functions, the standard's names for
# the registry's ops, and the compositions with a masked meaning.
# Beyond the standard: jax.numpy functions whose masked meaning is a composition.
from masked_jax.numpy import (
    _array_api,  # noqa: E402
    _compositions,  # noqa: E402
)
from masked_jax.numpy._array_api import *  # noqa: E402, F403
from masked_jax.numpy._array_api import __array_namespace_info__  # noqa: E402, F401
from masked_jax.numpy._compositions import *  # noqa: E402, F403

__array_api_version__ = _array_api.API_VERSION
for _standard, _ours in {**_array_api.ALIASES, **_compositions.ALIASES}.items():
    globals()[_standard] = globals()[_ours]
__all__ += _array_api.__all__ + list(_array_api.ALIASES) + list(_compositions.ALIASES) + _compositions.__all__

# The extensions, as real submodules (``import masked_jax.numpy.linalg`` works as for jax.numpy).
from masked_jax.numpy import fft as fft  # noqa: E402
from masked_jax.numpy import linalg as linalg  # noqa: E402

__all__ += ["fft", "linalg"]

# jax.Array's methods that are not one op of the registry, on every masked array class
from masked_jax.numpy import _array_methods  # noqa: E402

_array_methods.install()
