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

import jax.numpy as jnp

from masked_jax.numpy import _array_api, _frontend

# masked: the registry's contractions and norms, and the standard's compositions of them
matmul = _frontend.function("matmul")
tensordot = _frontend.function("tensordot")
outer = _frontend.function("outer")
norm = _frontend.function("norm")
vecdot = _array_api.vecdot
matrix_transpose = _array_api.matrix_transpose
diagonal = _array_api.diagonal
trace = _array_api.trace
matrix_norm = _array_api.matrix_norm
vector_norm = _array_api.vector_norm
cross = _array_api.cross

# no masked meaning: fully valid arrays only
cholesky = _array_api.dense_only(jnp.linalg.cholesky, "linalg.cholesky")
det = _array_api.dense_only(jnp.linalg.det, "linalg.det")
eigh = _array_api.dense_only(jnp.linalg.eigh, "linalg.eigh")
eigvalsh = _array_api.dense_only(jnp.linalg.eigvalsh, "linalg.eigvalsh")
inv = _array_api.dense_only(jnp.linalg.inv, "linalg.inv")
matrix_power = _array_api.dense_only(jnp.linalg.matrix_power, "linalg.matrix_power")
matrix_rank = _array_api.dense_only(jnp.linalg.matrix_rank, "linalg.matrix_rank")
pinv = _array_api.dense_only(jnp.linalg.pinv, "linalg.pinv")
qr = _array_api.dense_only(jnp.linalg.qr, "linalg.qr")
slogdet = _array_api.dense_only(jnp.linalg.slogdet, "linalg.slogdet")
solve = _array_api.dense_only(jnp.linalg.solve, "linalg.solve")
svd = _array_api.dense_only(jnp.linalg.svd, "linalg.svd")
svdvals = _array_api.dense_only(jnp.linalg.svdvals, "linalg.svdvals")

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
