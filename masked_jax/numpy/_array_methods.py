"""The methods of ``jax.Array`` that are not one op of the registry, installed on every array class.

Each calls the ``masked_jax.numpy`` function of the same name, which dispatches on the layout.
:func:`install` puts them on :class:`~masked_jax._core.ArrayMethods` (the base of ``MaskedArray``
and of the sparse layouts) once ``masked_jax.numpy`` is built, as ``jax.numpy`` installs
``jax.Array``'s methods; and ``MaskedArray.__array_namespace__``, which returns the namespace
``install`` is handed, so that the array types never import the package built on them.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from jax import Array

from masked_jax._core import ArrayMethods, MaskedArray, method_example
from masked_jax.numpy import _contractions, _frontend, _searching


def __round__(self, ndigits: int | None = None) -> MaskedArray:
    return _frontend.function("round")(self, 0 if ndigits is None else ndigits)


def _real(self) -> MaskedArray:
    return _frontend.function("real")(self)


def _imag(self) -> MaskedArray:
    return _frontend.function("imag")(self)


def conjugate(self) -> MaskedArray:
    return _frontend.function("conj")(self)


def diagonal(self, offset: int = 0, axis1: int = 0, axis2: int = 1) -> MaskedArray:
    return _contractions.diagonal(self, offset, axis1, axis2)


def trace(self, offset: int = 0, axis1: int = 0, axis2: int = 1, dtype: Any = None) -> MaskedArray:
    return _contractions.trace(self, offset, axis1, axis2, dtype)


def nonzero(self) -> tuple[Array, ...]:
    return _searching.nonzero(self)


def searchsorted(self, v: Any, side: str = "left", sorter: Any = None) -> MaskedArray:
    return _searching.searchsorted(self, v, side=side, sorter=sorter)


_real.__doc__ = "The real part; the mask unchanged." + method_example("x.real.mask.sum()", "Array(3, dtype=int32)")
_imag.__doc__ = "The imaginary part; the mask unchanged." + method_example("x.imag.mask.sum()", "Array(3, dtype=int32)")
conjugate.__doc__ = "The complex conjugate; the mask unchanged." + method_example(
    "x.conjugate().mask.sum()", "Array(3, dtype=int32)"
)
diagonal.__doc__ = "``masked_jax.numpy.diagonal(x, offset, axis1, axis2)``: valid where the entry is." + method_example(
    "x.diagonal()", "MaskedArray([1.5 4.5], dtype=float32)"
)
trace.__doc__ = "``masked_jax.numpy.trace(x, ...)``: the sum of the valid diagonal entries." + method_example(
    "x.trace()", "MaskedArray(6.0, dtype=float32)"
)
nonzero.__doc__ = "``masked_jax.numpy.nonzero(x)``: the indices of the valid nonzero entries." + method_example(
    "x.nonzero()[1]", "Array([0, 0, 1], dtype=int32)"
)
searchsorted.__doc__ = (
    "``masked_jax.numpy.searchsorted(x, v, ...)``: insertion positions among the valid "
    "entries of the sorted 1-d ``x``." + method_example("x[1].searchsorted(4.0)", "MaskedArray(1, dtype=int32)")
)

API_VERSIONS = (None, "2024.12", "2023.12", "2022.12", "2021.12")


def _namespace_method(namespace: ModuleType):
    def __array_namespace__(self, *, api_version: str | None = None) -> ModuleType:
        """``masked_jax.numpy``: the Array API namespace with masked semantics.

        Examples:
            >>> import jax.numpy as jnp, masked_jax as mj
            >>> xp = mj.masked_array(jnp.array([1.0, 5.0]), jnp.array([True, False])).__array_namespace__()
            >>> xp.mean(xp.asarray([1.0, 3.0]))
            MaskedArray(2.0, dtype=float32)
        """
        if api_version not in API_VERSIONS:
            raise ValueError(
                f"masked_jax.numpy implements the Array API 2024.12 (and the versions before it); "
                f"got api_version={api_version!r}."
            )
        return namespace

    __array_namespace__.__qualname__ = "MaskedArray.__array_namespace__"
    return __array_namespace__


_METHODS = {
    "__round__": __round__,
    "conjugate": conjugate,
    "diagonal": diagonal,
    "trace": trace,
    "nonzero": nonzero,
    "searchsorted": searchsorted,
}
_PROPERTIES = {"real": _real, "imag": _imag}


def install(namespace: ModuleType) -> None:
    """Put these methods (and the ``real``/``imag`` properties) on every masked array class, and
    ``__array_namespace__`` (returning ``namespace``, the ``masked_jax.numpy`` module) on ``MaskedArray``."""
    MaskedArray.__array_namespace__ = _namespace_method(namespace)
    for name, fn in _METHODS.items():
        fn.__qualname__ = f"ArrayMethods.{name}"
        setattr(ArrayMethods, name, fn)
    for name, fn in _PROPERTIES.items():
        fn.__name__, fn.__qualname__ = name, f"ArrayMethods.{name}"
        setattr(ArrayMethods, name, property(fn, doc=fn.__doc__))
