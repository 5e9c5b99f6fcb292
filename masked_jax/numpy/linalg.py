"""``masked_jax.numpy.linalg``: the linear-algebra extension, with masked semantics where it has them.

Contractions and norms are masked (a contraction sums over the indices where both operands are
valid; a norm reads the valid entries). Factorizations and solvers have no masked meaning: they
take fully valid arrays (a concrete all-True mask) and raise ``TypeError`` on any other.

Examples:
    >>> import jax.numpy as jnp, masked_jax as mj, masked_jax.numpy as mnp
    >>> x = mj.masked_array(jnp.array([[3.0, 9.0], [4.0, 1.0]]), jnp.array([[True, False], [True, True]]))
    >>> mnp.linalg.vector_norm(x, axis=0)
    MaskedArray([5.0 1.0], dtype=float32)
"""

import builtins

import jax
import jax.numpy as jnp
import numpy as np

from masked_jax._core import MaskedArray
from masked_jax.numpy import _contractions, _frontend
from masked_jax.numpy._common import as_dense_masked, dense_only, op
from masked_jax.numpy._contractions import diagonal_of, trace_of
from masked_jax.ops._base import normalize_axis

# masked: the registry's contractions and norms, and the standard's compositions of them
matmul = _frontend.function("matmul")
tensordot = _frontend.function("tensordot")
outer = _frontend.function("outer")
norm = _frontend.function("norm")
vecdot = _contractions.vecdot
matrix_transpose = _contractions.matrix_transpose

# no masked meaning: fully valid arrays only
cholesky = dense_only(jnp.linalg.cholesky, "linalg.cholesky")
det = dense_only(jnp.linalg.det, "linalg.det")
eigh = dense_only(jnp.linalg.eigh, "linalg.eigh")
eigvalsh = dense_only(jnp.linalg.eigvalsh, "linalg.eigvalsh")
inv = dense_only(jnp.linalg.inv, "linalg.inv")
matrix_power = dense_only(jnp.linalg.matrix_power, "linalg.matrix_power")
matrix_rank = dense_only(jnp.linalg.matrix_rank, "linalg.matrix_rank")
pinv = dense_only(jnp.linalg.pinv, "linalg.pinv")
qr = dense_only(jnp.linalg.qr, "linalg.qr")
slogdet = dense_only(jnp.linalg.slogdet, "linalg.slogdet")
solve = dense_only(jnp.linalg.solve, "linalg.solve")
svd = dense_only(jnp.linalg.svd, "linalg.svd")
svdvals = dense_only(jnp.linalg.svdvals, "linalg.svdvals")

__all__ = [
    "cross",
    "diagonal",
    "matmul",
    "matrix_norm",
    "matrix_transpose",
    "norm",
    "outer",
    "tensordot",
    "trace",
    "vecdot",
    "vector_norm",
    "cholesky",
    "det",
    "eigh",
    "eigvalsh",
    "inv",
    "matrix_power",
    "matrix_rank",
    "pinv",
    "qr",
    "slogdet",
    "solve",
    "svd",
    "svdvals",
]


# the standard's linalg functions with a masked meaning
def diagonal(x, /, *, offset: int = 0) -> MaskedArray:
    """The diagonals of the last two axes, mask with data (``linalg.diagonal``).

    Examples:
        >>> import jax.numpy as jnp, masked_jax as mj, masked_jax.numpy as mnp
        >>> mnp.linalg.diagonal(mj.masked_array(jnp.eye(2), jnp.array([[True, True], [True, False]])))
        MaskedArray([1.0 --], dtype=float32)
    """
    return diagonal_of(x, offset, -2, -1)


def trace(x, /, *, offset: int = 0, dtype=None) -> MaskedArray:
    """Sum of the valid diagonal entries of the last two axes; masked where none is valid.

    Examples:
        >>> import jax.numpy as jnp, masked_jax as mj, masked_jax.numpy as mnp
        >>> mnp.linalg.trace(mj.masked_array(jnp.array([[1.0, 2.0], [3.0, 9.0]]), jnp.array([[True, True], [True, False]])))
        MaskedArray(1.0, dtype=float32)
    """
    return trace_of(x, offset, -2, -1, dtype)


def matrix_norm(x, /, *, keepdims: builtins.bool = False, ord="fro") -> MaskedArray:
    """The norm of each matrix (last two axes) over its valid entries.

    Examples:
        >>> import jax.numpy as jnp, masked_jax as mj, masked_jax.numpy as mnp
        >>> mnp.linalg.matrix_norm(mj.masked_array(jnp.array([[3.0, 9.0], [4.0, 0.0]]), jnp.array([[True, False], [True, True]])))
        MaskedArray(5.0, dtype=float32)
    """
    return op("norm")(x, ord=ord, axis=(-2, -1), keepdims=keepdims)


def vector_norm(x, /, *, axis=None, keepdims: builtins.bool = False, ord=2) -> MaskedArray:
    """The vector norm over the valid entries of ``axis`` (``None``: every axis, the array taken as
    one vector; a tuple: those axes taken as one vector), by ``jnp.linalg.vector_norm``'s own
    arithmetic (integers square and sum in their dtype, as jnp's).

    Examples:
        >>> import jax.numpy as jnp, masked_jax as mj, masked_jax.numpy as mnp
        >>> x = mj.masked_array(jnp.array([[1.0, 2.0], [3.0, 9.0]]), jnp.array([[True, True], [True, False]]))
        >>> mnp.linalg.vector_norm(x, ord=1)
        MaskedArray(6.0, dtype=float32)
    """
    x = as_dense_masked(x)
    if isinstance(ord, str) or not (ord is None or np.ndim(ord) == 0):
        raise ValueError(f"vector_norm: ord must be a number (or inf, -inf); got {ord!r}.")
    axes = tuple(range(x.ndim)) if axis is None else (axis,) if isinstance(axis, (int, np.integer)) else tuple(axis)
    axes = normalize_axis(axes, x.ndim)
    rest = [a for a in range(x.ndim) if a not in axes]
    flat = op("reshape")(op("transpose")(x, rest + list(axes)), tuple(x.shape[a] for a in rest) + (-1,))
    total = lambda v, **kw: op("sum")(v, axis=-1, **kw)  # noqa: E731
    if ord is None or ord == 2:
        out = op("sqrt")(total(op("real")(op("multiply")(flat, op("conj")(flat)))))
    elif ord == np.inf:
        out = op("max")(op("abs")(flat), axis=-1)
    elif ord == -np.inf:
        out = op("min")(op("abs")(flat), axis=-1)
    elif ord == 0:
        out = total(op("not_equal")(flat, 0), dtype=jnp.finfo(jnp.result_type(float)).dtype)
    elif ord == 1:
        out = total(op("abs")(flat))
    else:
        a = op("abs")(flat)
        out = op("power")(total(op("power")(a, jnp.asarray(ord, a.dtype))), jnp.asarray(1.0 / ord, a.dtype))
    out_dtype = jax.eval_shape(lambda d: jnp.linalg.vector_norm(d, ord=ord), x.data).dtype
    out = op("astype")(out, out_dtype)
    if keepdims:
        out = op("reshape")(out, tuple(1 if a in axes else d for a, d in enumerate(x.shape)))
    return out


def cross(x1, x2, /, *, axis: int = -1) -> MaskedArray:
    """The cross product of 3-vectors along ``axis``: a vector is valid where all three components
    of both operands are (each component of the result reads the other two).

    Examples:
        >>> import jax.numpy as jnp, masked_jax as mj, masked_jax.numpy as mnp
        >>> mnp.linalg.cross(mnp.asarray([1.0, 0.0, 0.0]), mnp.asarray([0.0, 1.0, 0.0]))
        MaskedArray([0.0 0.0 1.0], dtype=float32)
    """
    return _contractions.cross_last(x1, x2, axis=axis)
