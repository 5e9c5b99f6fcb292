"""Data type functions: a masked array stands for its dtype."""

from __future__ import annotations

import builtins

import jax.numpy as jnp

from masked_jax.numpy._common import dtype_of


def can_cast(from_, to, /) -> builtins.bool:
    """``jax.numpy.can_cast``; ``from_`` may be a dtype or an array.

    Examples:
        >>> import masked_jax.numpy as mnp
        >>> mnp.can_cast(mnp.asarray([1], dtype=mnp.int8), mnp.int32)
        True
    """
    return jnp.can_cast(dtype_of(from_), to)


def finfo(type, /):  # the standard's parameter name
    """``jax.numpy.finfo`` of a float dtype or array.

    Examples:
        >>> import masked_jax.numpy as mnp
        >>> mnp.finfo(mnp.float32).bits
        32
    """
    return jnp.finfo(dtype_of(type))


def iinfo(type, /):  # the standard's parameter name
    """``jax.numpy.iinfo`` of an integer dtype or array.

    Examples:
        >>> import masked_jax.numpy as mnp
        >>> int(mnp.iinfo(mnp.int8).max)
        127
    """
    return jnp.iinfo(dtype_of(type))


def isdtype(dtype, kind) -> builtins.bool:
    """``jax.numpy.isdtype``.

    Examples:
        >>> import masked_jax.numpy as mnp
        >>> mnp.isdtype(mnp.float32, "real floating")
        True
    """
    return jnp.isdtype(dtype, kind)


def result_type(*arrays_and_dtypes):
    """``jax.numpy.result_type``; masked arrays stand for their dtypes.

    Examples:
        >>> import masked_jax.numpy as mnp
        >>> mnp.result_type(mnp.asarray([1], dtype=mnp.int8), mnp.float32)
        dtype('float32')
    """
    return jnp.result_type(*(dtype_of(a) for a in arrays_and_dtypes))


__all__ = ["can_cast", "finfo", "iinfo", "isdtype", "result_type"]
