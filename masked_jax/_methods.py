"""``ArrayMethods``: the methods and operators every masked array class gets from the op registry.

:mod:`masked_jax._frontend` binds each registered op's ``methods`` (``sum``, ``reshape``,
``__add__``, ``__radd__``, ...) here at runtime, so ``MaskedArray`` and the sparse layouts, which
subclass it, have them. The class body holds the few methods of ``jax.Array`` that are not one op
of the registry: each calls the public function of the same name (which dispatches on the layout).

``_methods.pyi`` beside this file declares them all for static type checkers; it is generated
(``python -m masked_jax._stubgen``) and a test keeps it in sync.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp

if TYPE_CHECKING:
    from jax import Array

    from masked_jax._core import MaskedArray


def _mnp():
    from masked_jax import numpy

    return numpy


_X = (">>> import jax.numpy as jnp, masked_jax as mj\n"
      "            >>> x = mj.masked_array(jnp.array([[1.5, 2.0], [3.0, 4.5]]), jnp.array([[True, False], [True, True]]))")


def _example(call, result):
    return f"\n\n        Examples:\n            {_X}\n            >>> {call}\n            {result}\n        "


class ArrayMethods:
    """Base of the masked array classes: methods and operators derived from the op registry."""

    __slots__ = ()

    def __round__(self, ndigits: int | None = None) -> MaskedArray:
        return _mnp().round(self, 0 if ndigits is None else ndigits)

    def copy(self) -> MaskedArray:
        return jax.tree_util.tree_map(lambda v: jnp.array(v, copy=True), self)

    copy.__doc__ = ("A copy of the data and mask (jax arrays are immutable: it matters only for buffer donation)."
                    + _example("x.copy().mask.sum()", "Array(3, dtype=int32)"))

    def block_until_ready(self) -> MaskedArray:
        jax.block_until_ready(jax.tree_util.tree_leaves(self))
        return self

    block_until_ready.__doc__ = ("Wait until data and mask are computed (for timing); returns ``self``."
                                 + _example("x.block_until_ready() is x", "True"))

    @property
    def real(self) -> MaskedArray:
        return _mnp().real(self)

    @property
    def imag(self) -> MaskedArray:
        return _mnp().imag(self)

    def conjugate(self) -> MaskedArray:
        return _mnp().conj(self)

    def diagonal(self, offset: int = 0, axis1: int = 0, axis2: int = 1) -> MaskedArray:
        return _mnp().diagonal(self, offset, axis1, axis2)

    diagonal.__doc__ = ("``masked_jax.numpy.diagonal(x, offset, axis1, axis2)``: valid where the entry is."
                        + _example("x.diagonal()", "MaskedArray([1.5 4.5], dtype=float32)"))

    def trace(self, offset: int = 0, axis1: int = 0, axis2: int = 1, dtype: Any = None) -> MaskedArray:
        return _mnp().trace(self, offset, axis1, axis2, dtype)

    trace.__doc__ = ("``masked_jax.numpy.trace(x, ...)``: the sum of the valid diagonal entries."
                     + _example("x.trace()", "MaskedArray(6.0, dtype=float32)"))

    def nonzero(self) -> tuple[Array, ...]:
        return _mnp().nonzero(self)

    nonzero.__doc__ = ("``masked_jax.numpy.nonzero(x)``: the indices of the valid nonzero entries."
                       + _example("x.nonzero()[1]", "Array([0, 0, 1], dtype=int32)"))

    def searchsorted(self, v: Any, side: str = "left", sorter: Any = None) -> MaskedArray:
        return _mnp().searchsorted(self, v, side=side, sorter=sorter)

    searchsorted.__doc__ = ("``masked_jax.numpy.searchsorted(x, v, ...)``: insertion positions among the valid "
                            "entries of the sorted 1-d ``x``." + _example("x[1].searchsorted(4.0)",
                                                                       "MaskedArray(1, dtype=int32)"))


ArrayMethods.real.__doc__ = "The real part; the mask unchanged." + _example("x.real.mask.sum()", "Array(3, dtype=int32)")
ArrayMethods.imag.__doc__ = "The imaginary part; the mask unchanged." + _example("x.imag.mask.sum()", "Array(3, dtype=int32)")
ArrayMethods.conjugate.__doc__ = "The complex conjugate; the mask unchanged." + _example(
    "x.conjugate().mask.sum()", "Array(3, dtype=int32)")
