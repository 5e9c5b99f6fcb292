"""Argument validation by *kind*: one checker per kind of argument, used by every public callable.

Each checker takes the value and the argument's name, and returns the value normalised (a shape as
a tuple of ints, a count as an int) or raises a ``TypeError`` (wrong type) or ``ValueError`` (right
type, value out of range) whose message names the argument, says what was expected and shows what
came. The test suite generates its bad-input table from :data:`KINDS`: for every kind, the bad
values below, fed to every public parameter of that kind.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy  # jax.numpy.dtype
import numpy as np
from jax import core as jax_core


def dtype_kind(dtype) -> str:
    """numpy's one-letter kind of ``dtype`` ("b", "i", "u", "f", "c"), also for the ml_dtypes types jax
    adds (bfloat16, the float8 types, int4, uint2 ...), which numpy files under "V" (void); "V", "S",
    "U" or "O" for what is not a number.

    Examples:
        >>> import jax.numpy as jnp
        >>> dtype_kind(jnp.int4), dtype_kind(jnp.bfloat16), dtype_kind(jnp.uint8)
        ('i', 'f', 'u')
    """
    dtype = np.dtype(dtype)
    if dtype.kind != "V":
        return dtype.kind
    for kind, family in (
        ("b", jax.numpy.bool_),
        ("u", jax.numpy.unsignedinteger),
        ("i", jax.numpy.signedinteger),
        ("f", jax.numpy.floating),
        ("c", jax.numpy.complexfloating),
    ):
        if jax.numpy.issubdtype(dtype, family):
            return kind
    return "V"


def _is_int(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def is_tracer(value) -> bool:
    """Is ``value`` a tracer (an abstract value under ``jit``, ``grad``, ``vmap``, ...)?"""
    return isinstance(value, jax_core.Tracer)


def shape(value, argname: str = "shape") -> tuple[int, ...]:
    """A shape: a tuple (or list) of ints >= 0; a single int is a 1-d shape.

    Examples:
        >>> from masked_jax import _validate
        >>> _validate.shape([3, 2])
        (3, 2)
    """
    if _is_int(value):
        value = (value,)
    if not isinstance(value, (tuple, list)) or not all(_is_int(d) for d in value):
        raise TypeError(f"{argname} must be a tuple of ints; got {value!r}.")
    if any(int(d) < 0 for d in value):
        raise ValueError(f"{argname} must have no negative dimension; got {tuple(int(d) for d in value)}.")
    return tuple(int(d) for d in value)


def count(value, argname: str, *, minimum: int = 0) -> int:
    """A whole number ``>= minimum`` (a number of classes, of rows, a capacity)."""
    if not _is_int(value):
        raise TypeError(f"{argname} must be an int; got {value!r} ({type(value).__name__}).")
    if int(value) < minimum:
        raise ValueError(f"{argname} must be an int >= {minimum}; got {int(value)}.")
    return int(value)


def nonnegative(value, argname: str) -> Any:
    """A real number ``>= 0`` (an accumulator's initial value, an epsilon); traced values pass."""
    if is_tracer(value):
        return value
    arr = np.asarray(value) if not isinstance(value, (str, bytes)) else None
    if arr is None or dtype_kind(arr.dtype) not in "iuf" or arr.ndim:
        raise TypeError(f"{argname} must be a real number; got {value!r}.")
    if not float(arr) >= 0:  # NaN fails too
        raise ValueError(f"{argname} must be >= 0; got {value!r}.")
    return value


def learning_rate(value, argname: str = "learning_rate") -> Any:
    """A learning rate: a real number or a schedule (a callable of the step count), as optax takes."""
    if callable(value) or is_tracer(value):
        return value
    arr = np.asarray(value) if not isinstance(value, (str, bytes)) else None
    if arr is None or dtype_kind(arr.dtype) not in "iuf" or arr.ndim:
        raise TypeError(
            f"{argname} must be a number or an optax schedule (a function of the step count); got {value!r}."
        )
    if not np.isfinite(float(arr)):
        raise ValueError(f"{argname} must be finite; got {value!r}.")
    return value


def axis(value, argname: str = "axis") -> Any:
    """An axis argument's kind: ``None``, an int or a tuple (list) of ints. Its range is checked
    where the array's rank is known (``ops._base.normalize_axis``)."""
    if value is None or _is_int(value):
        return value
    if isinstance(value, (tuple, list)) and all(_is_int(a) for a in value):
        return value
    raise TypeError(f"{argname} must be None, an int or a tuple of ints; got {value!r}.")


def dtype(value, argname: str = "dtype") -> Any:
    """A dtype (a numpy or jax dtype, a scalar type or a dtype's name) or ``None``."""
    if value is None:
        return value
    try:
        jax.numpy.dtype(value)
    except (TypeError, ValueError):
        raise TypeError(f"{argname} must be a dtype (such as jnp.float32 or 'int8'); got {value!r}.") from None
    return value


# Checked at every public function of the op registry, by parameter name.
BY_NAME = {"axis": axis, "dtype": dtype}

# kind -> (checker, bad values with the exception each must raise)
KINDS = {
    "shape": (shape, [(3.5, TypeError), ((-3, 2), ValueError), ("3", TypeError), ((2.0, 2), TypeError)]),
    "count": (count, [(-2, ValueError), (2.5, TypeError), ("3", TypeError), (True, TypeError)]),
    "nonnegative": (nonnegative, [(-1.0, ValueError), ("x", TypeError), (float("nan"), ValueError)]),
    "learning_rate": (learning_rate, [("x", TypeError), (None, TypeError), (float("inf"), ValueError)]),
    "axis": (axis, [(1.5, TypeError), ("0", TypeError), (5, ValueError)]),
    "dtype": (dtype, [("not-a-dtype", TypeError), (3.5, TypeError)]),
}
