"""Contractions and diagonals: ``vecdot``, ``matvec``, ``vecmat``, ``kron``, ``cross``, the diagonal and
the trace, and 1-d convolutions with ``numpy.ma``'s mask propagation.
"""

from __future__ import annotations

import builtins

import jax
import jax.numpy as jnp

from masked_jax._core import MaskedArray, from_pair
from masked_jax.numpy._common import as_dense_masked, document, op


def matrix_transpose(x, /) -> MaskedArray:
    """The last two axes swapped, mask with data.

    Examples:
        >>> import masked_jax.numpy as mnp
        >>> mnp.matrix_transpose(mnp.zeros((2, 3))).shape
        (3, 2)
    """
    return as_dense_masked(x).mT


def vecdot(x1, x2, /, *, axis: int = -1) -> MaskedArray:
    """``sum(conj(x1) * x2, axis)`` over the positions where both are valid; masked where none is.

    Examples:
        >>> import jax.numpy as jnp, masked_jax as mj, masked_jax.numpy as mnp
        >>> a = mj.masked_array(jnp.array([1.0, 2.0, 3.0]), jnp.array([True, False, True]))
        >>> mnp.vecdot(a, mnp.asarray([1.0, 1.0, 1.0]))
        MaskedArray(4.0, dtype=float32)
    """
    a, b = as_dense_masked(x1), as_dense_masked(x2)
    if a.shape[axis] != b.shape[axis]:
        raise ValueError(
            f"vecdot: the contracted axis {axis} has size {a.shape[axis]} in x1 and "
            f"{b.shape[axis]} in x2; they must match."
        )
    out_dtype = jax.eval_shape(lambda u, v: jnp.vecdot(u, v, axis=axis), a.data, b.data).dtype
    if jnp.issubdtype(out_dtype, jnp.integer) and jnp.iinfo(out_dtype).bits < 8:
        # int4 and narrower: jnp sums none of them, but its vecdot does; integer sums wrap alike in
        # 32 bits and in the narrow type, so the sum is taken in 32 bits and cast back
        wide = jnp.int32 if jnp.issubdtype(out_dtype, jnp.signedinteger) else jnp.uint32
        a, b = op("astype")(a, wide), op("astype")(b, wide)
    return op("astype")(op("sum")(op("multiply")(op("conj")(a), b), axis=axis), out_dtype)


def diagonal_of(x, offset, axis1, axis2):
    x = as_dense_masked(x)
    return from_pair(jnp.diagonal(x.data, offset, axis1, axis2), jnp.diagonal(x.mask, offset, axis1, axis2))


def trace_of(x, offset, axis1, axis2, dtype):
    return op("sum")(diagonal_of(x, offset, axis1, axis2), axis=-1, dtype=dtype)


def cross_last(x1, x2, /, *, axis: int = -1) -> MaskedArray:
    """The cross product of 3-vectors along ``axis`` (``masked_jax.numpy.linalg.cross``)."""
    a, b = as_dense_masked(x1), as_dense_masked(x2)
    if a.shape[axis] != 3 or b.shape[axis] != 3:
        raise ValueError(
            f"cross: the vectors along axis {axis} must have 3 components; got shapes {a.shape} and {b.shape}."
        )
    valid = jnp.all(a.mask, axis=axis, keepdims=True) & jnp.all(b.mask, axis=axis, keepdims=True)
    data = jnp.cross(jnp.where(a.mask, a.data, 0), jnp.where(b.mask, b.data, 0), axis=axis)
    return from_pair(data, jnp.broadcast_to(valid, data.shape))


def diagonal(a, offset: int = 0, axis1: int = 0, axis2: int = 1) -> MaskedArray:
    """``jax.numpy.diagonal``: the mask moves with the data.

    Examples:
        >>> import jax.numpy as jnp, masked_jax as mj, masked_jax.numpy as mnp
        >>> mnp.diagonal(mj.masked_array(jnp.eye(2), jnp.array([[True, True], [True, False]])))
        MaskedArray([1.0 --], dtype=float32)
    """
    return diagonal_of(a, offset, axis1, axis2)


def trace(a, offset: int = 0, axis1: int = 0, axis2: int = 1, dtype=None) -> MaskedArray:
    """Sum of the valid diagonal entries (``numpy.ma.trace``); masked where none is valid.

    Examples:
        >>> import jax.numpy as jnp, masked_jax as mj, masked_jax.numpy as mnp
        >>> mnp.trace(mj.masked_array(jnp.array([[1.0, 2.0], [3.0, 9.0]]), jnp.array([[True, True], [True, False]])))
        MaskedArray(1.0, dtype=float32)
    """
    return trace_of(a, offset, axis1, axis2, dtype)


def cross(a, b, axisa: int = -1, axisb: int = -1, axisc: int = -1, axis: int | None = None) -> MaskedArray:
    """``jax.numpy.cross`` of 3-vectors: a vector is valid where all components of both operands are.

    Examples:
        >>> import masked_jax.numpy as mnp
        >>> mnp.cross(mnp.asarray([1.0, 0.0, 0.0]), mnp.asarray([0.0, 1.0, 0.0]))
        MaskedArray([0.0 0.0 1.0], dtype=float32)
    """
    if axis is not None:
        axisa = axisb = axisc = axis
    a = op("moveaxis")(as_dense_masked(a), axisa, -1)
    b = op("moveaxis")(as_dense_masked(b), axisb, -1)
    return op("moveaxis")(cross_last(a, b), -1, axisc)


def _convolution(fn, name):
    def conv(a, v, mode: str = "full", propagate_mask: bool = True) -> MaskedArray:
        x, k = as_dense_masked(a), as_dense_masked(v)
        if x.ndim != 1 or k.ndim != 1:
            raise ValueError(f"{name}: a and v must be 1-d; got shapes {x.shape} and {k.shape}.")
        zero = lambda m: jnp.where(m.mask, m.data, jnp.zeros((), m.dtype))  # noqa: E731 (keeps the dtype)
        data = fn(zero(x), zero(k), mode=mode)
        xm, km = x.mask.astype(jnp.float32), k.mask.astype(jnp.float32)
        if propagate_mask:  # masked where any masked entry takes part
            touched = fn(1 - xm, jnp.ones_like(km), mode=mode) + fn(jnp.ones_like(xm), 1 - km, mode=mode)
            valid = touched < 0.5
        else:  # masked where no pair of valid entries takes part
            valid = fn(xm, km, mode=mode) > 0.5
        return from_pair(data, valid)

    return document(
        conv,
        name,
        f"``jax.numpy.{name}`` with ``numpy.ma.{name}``'s masks: with ``propagate_mask`` "
        "an output is masked when any masked entry takes part in it, without it only when no pair of "
        "valid entries does (masked entries then count as 0).",
        ">>> import jax.numpy as jnp, masked_jax as mj, masked_jax.numpy as mnp",
        ">>> a = mj.masked_array(jnp.array([1.0, 2.0, 3.0]), jnp.array([True, False, True]))",
        f">>> mnp.{name}(a, jnp.array([1.0, 1.0]), mode='valid').mask.tolist()",
        "[False, False]",
    )


convolve = _convolution(jnp.convolve, "convolve")

correlate = _convolution(jnp.correlate, "correlate")


def matvec(x1, x2) -> MaskedArray:
    """Batched matrix-vector product ``x1 @ x2`` (``jax.numpy.matvec``): sums over jointly valid terms, as ``matmul``.

    Examples:
        >>> import jax.numpy as jnp, masked_jax as mj, masked_jax.numpy as mnp
        >>> m = mj.masked_array(jnp.array([[1.0, 2.0], [3.0, 4.0]]), jnp.array([[True, False], [False, False]]))
        >>> mnp.matvec(m, jnp.array([10.0, 20.0]))
        MaskedArray([10.0 --], dtype=float32)
    """
    return op("matmul")(x1, op("expand_dims")(as_dense_masked(x2), -1))[..., 0]


def vecmat(x1, x2) -> MaskedArray:
    """Batched vector-matrix product ``conj(x1) @ x2`` (``jax.numpy.vecmat``), as ``matmul``.

    Examples:
        >>> import jax.numpy as jnp, masked_jax as mj, masked_jax.numpy as mnp
        >>> v = mj.masked_array(jnp.array([1.0, 2.0]), jnp.array([True, False]))
        >>> mnp.vecmat(v, jnp.array([[1.0, 2.0], [3.0, 4.0]]))
        MaskedArray([1.0 2.0], dtype=float32)
    """
    return op("matmul")(op("expand_dims")(op("conj")(x1), -2), x2)[..., 0, :]


def kron(a, b) -> MaskedArray:
    """Kronecker product (``jax.numpy.kron``): each entry valid where both of its factors are.

    Examples:
        >>> import jax.numpy as jnp, masked_jax as mj, masked_jax.numpy as mnp
        >>> mnp.kron(mj.masked_array(jnp.array([1.0, 2.0]), jnp.array([True, False])), jnp.array([1.0, 10.0]))
        MaskedArray([1.0 10.0 -- --], dtype=float32)
    """
    x, y = as_dense_masked(a), as_dense_masked(b)
    n = builtins.max(x.ndim, y.ndim)
    x, y = (op("reshape")(v, (1,) * (n - v.ndim) + v.shape) for v in (x, y))
    spread_x = op("reshape")(x, tuple(d for s in x.shape for d in (s, 1)))  # (a0, 1, a1, 1, ...)
    spread_y = op("reshape")(y, tuple(d for s in y.shape for d in (1, s)))  # (1, b0, 1, b1, ...)
    return op("reshape")(op("multiply")(spread_x, spread_y), tuple(p * q for p, q in zip(x.shape, y.shape)))


__all__ = [
    "matrix_transpose",
    "vecdot",
    "diagonal",
    "trace",
    "cross",
    "convolve",
    "correlate",
    "matvec",
    "vecmat",
    "kron",
]
