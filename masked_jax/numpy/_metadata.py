"""The Array API's constants, dtypes and inspection namespace, and the other names ``jax.numpy``
and the standard give to functions of the registry.
"""

from __future__ import annotations

import jax.numpy as jnp

API_VERSION = "2024.12"

# Constants and dtypes: jax.numpy's.
e, pi, inf, nan, newaxis = jnp.e, jnp.pi, jnp.inf, jnp.nan, jnp.newaxis

bool = jnp.bool_  # the standard's name

int8, int16, int32, int64 = jnp.int8, jnp.int16, jnp.int32, jnp.int64

uint8, uint16, uint32, uint64 = jnp.uint8, jnp.uint16, jnp.uint32, jnp.uint64

float32, float64, complex64, complex128 = jnp.float32, jnp.float64, jnp.complex64, jnp.complex128

CONSTANTS = ["e", "pi", "inf", "nan", "newaxis"]

DTYPES = [
    "bool",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint8",
    "uint16",
    "uint32",
    "uint64",
    "float32",
    "float64",
    "complex64",
    "complex128",
]

# The standard's names for ops of the registry (the same functions, not copies).
ALIASES = {
    "acos": "arccos",
    "acosh": "arccosh",
    "asin": "arcsin",
    "asinh": "arcsinh",
    "atan": "arctan",
    "atanh": "arctanh",
    "atan2": "arctan2",
    "pow": "power",
    "bitwise_invert": "invert",
    "bitwise_left_shift": "left_shift",
    "bitwise_right_shift": "right_shift",
    "concat": "concatenate",
    "permute_dims": "transpose",
}


def __array_namespace_info__():
    """jax.numpy's inspection namespace (devices, default and supported dtypes); the capabilities
    say that boolean-mask indexing and data-dependent shapes need concrete arrays, as in jax.

    Examples:
        >>> import masked_jax.numpy as mnp
        >>> mnp.__array_namespace_info__().default_dtypes()["indexing"]
        dtype('int32')
    """
    return jnp.__array_namespace_info__()


# jax.numpy's other names for functions of the registry (the same functions, not copies)
JNP_ALIASES = {"around": "round", "conjugate": "conj", "degrees": "rad2deg", "radians": "deg2rad"}


__all__ = CONSTANTS + DTYPES
