"""Creating arrays: the standard's creation functions (fully valid results), ``asarray``,
``from_dlpack``, the ``*_like`` family, triangles, ``meshgrid``, ``diag``, ``diagflat``, ``copy``.
"""

from __future__ import annotations

import builtins

import jax
import jax.numpy as jnp
import numpy as np

from masked_jax._core import MaskedArray, SparseMasked, from_pair
from masked_jax.numpy._common import as_dense_masked, document, dtype_of, is_masked_value, op
from masked_jax.numpy._contractions import diagonal_of


def _valid(make):
    """A creation function of ``jax.numpy`` whose result is fully valid."""

    def created(*args, **kwargs):
        return as_dense_masked(make(*args, **kwargs))

    return document(
        created,
        make.__name__,
        f"``jax.numpy.{make.__name__}``, fully valid.",
        ">>> import masked_jax.numpy as mnp",
        f">>> bool(mnp.{make.__name__}({_EXAMPLE_ARGS[make.__name__]}).mask.all())",
        "True",
        signature_of=make,
    )


_EXAMPLE_ARGS = {
    "arange": "3",
    "empty": "(2,)",
    "eye": "2",
    "full": "(2,), 7.0",
    "linspace": "0.0, 1.0, 5",
    "ones": "(2,)",
    "zeros": "(2,)",
}

arange, empty, eye, full, linspace, ones, zeros = (
    _valid(f) for f in (jnp.arange, jnp.empty, jnp.eye, jnp.full, jnp.linspace, jnp.ones, jnp.zeros)
)


def asarray(obj, /, *, dtype=None, device=None, copy=None) -> MaskedArray:
    """``obj`` as a :class:`MaskedArray`: a masked array keeps its mask, anything else is fully valid.

    Examples:
        >>> import masked_jax.numpy as mnp
        >>> mnp.asarray([1, 2], dtype=mnp.float32)
        MaskedArray([1.0 2.0], dtype=float32)
    """
    if isinstance(obj, MaskedArray):
        data = jnp.asarray(obj.data, dtype=dtype, device=device, copy=copy)
        return from_pair(data, jnp.asarray(obj.mask, device=device, copy=copy))
    if isinstance(obj, SparseMasked):
        return asarray(obj.todense(), dtype=dtype, device=device, copy=copy)
    if isinstance(obj, (list, tuple)):
        leaves = jax.tree_util.tree_leaves(obj, is_leaf=is_masked_value)
        if builtins.any(is_masked_value(v) for v in leaves):
            # a nested sequence with masked elements: their data and masks, stacked alike
            dense = jax.tree_util.tree_map(
                lambda v: v.todense() if isinstance(v, SparseMasked) else v, obj, is_leaf=is_masked_value
            )
            data = jax.tree_util.tree_map(lambda v: v.data if is_masked_value(v) else v, dense, is_leaf=is_masked_value)
            mask = jax.tree_util.tree_map(
                lambda v: v.mask if is_masked_value(v) else np.ones(np.shape(v), np.bool_),
                dense,
                is_leaf=is_masked_value,
            )
            return from_pair(jnp.asarray(data, dtype=dtype, device=device, copy=copy), jnp.asarray(mask, device=device))
    return as_dense_masked(jnp.asarray(obj, dtype=dtype, device=device, copy=copy))


def from_dlpack(x, /, *, device=None, copy=None) -> MaskedArray:
    """An array exported through DLPack (by any library), fully valid.

    Examples:
        >>> import numpy as np, masked_jax.numpy as mnp
        >>> mnp.from_dlpack(np.arange(3, dtype=np.float32))
        MaskedArray([0.0 1.0 2.0], dtype=float32)
    """
    return as_dense_masked(jnp.from_dlpack(x, device=device, copy=copy))


def _like(make):
    def created(x, /, *args, **kwargs):
        return as_dense_masked(make(jnp.empty(x.shape, dtype_of(x)), *args, **kwargs))

    fill = ", 5.0" if make is jnp.full_like else ""
    return document(
        created,
        make.__name__,
        f"``jax.numpy.{make.__name__}`` of ``x``'s shape and dtype, fully valid (whatever ``x``'s mask).",
        ">>> import jax.numpy as jnp, masked_jax as mj, masked_jax.numpy as mnp",
        ">>> x = mj.masked_array(jnp.array([1.0, 2.0]), jnp.array([True, False]))",
        f">>> bool(mnp.{make.__name__}(x{fill}).mask.all())",
        "True",
        signature_of=make,
    )


empty_like, full_like, ones_like, zeros_like = (
    _like(f) for f in (jnp.empty_like, jnp.full_like, jnp.ones_like, jnp.zeros_like)
)


def _triangle(keep, example_mask):
    def tri(x, /, k: int = 0) -> MaskedArray:
        x = as_dense_masked(x)
        if x.ndim < 2:
            raise ValueError(f"{keep.__name__} needs at least 2 dimensions; got shape {x.shape}.")
        return from_pair(keep(x.data, k=k), x.compact_mask)

    return document(
        tri,
        keep.__name__,
        f"``jax.numpy.{keep.__name__}``: zeros outside the kept triangle; the "
        "mask is unchanged (a written zero is valid where the entry was: a constant never makes a "
        "masked entry valid, as under ``maskify``).",
        ">>> import jax.numpy as jnp, masked_jax as mj, masked_jax.numpy as mnp",
        ">>> x = mj.masked_array(jnp.ones((2, 2)), jnp.array([[False, False], [True, True]]))",
        f">>> mnp.{keep.__name__}(x).mask.tolist()",
        example_mask,
    )


tril = _triangle(jnp.tril, "[[False, False], [True, True]]")

triu = _triangle(jnp.triu, "[[False, False], [True, True]]")


def meshgrid(*arrays, indexing: str = "xy") -> list[MaskedArray]:
    """``jax.numpy.meshgrid`` of data and of masks: each output is valid where its input is.

    Examples:
        >>> import jax.numpy as jnp, masked_jax as mj, masked_jax.numpy as mnp
        >>> xs, ys = mnp.meshgrid(mj.masked_array(jnp.array([0.0, 1.0]), jnp.array([True, False])),
        ...                       mnp.asarray([5.0, 6.0, 7.0]))
        >>> xs.shape, xs.mask[:, 1].tolist()
        ((3, 2), [False, False, False])
    """
    arrays = [as_dense_masked(a) for a in arrays]
    data = jnp.meshgrid(*(a.data for a in arrays), indexing=indexing)
    masks = jnp.meshgrid(*(a.mask for a in arrays), indexing=indexing)
    return [from_pair(d, m) for d, m in zip(data, masks)]


def diag(v, k: int = 0) -> MaskedArray:
    """``jax.numpy.diag``: of a 1-d array, a matrix with ``v`` on diagonal ``k`` (masked where ``v``
    is) and valid zeros elsewhere, as ``numpy.ma.diag`` and as ``pad`` writes constants; of a 2-d
    array, its diagonal ``k``.

    Examples:
        >>> import jax.numpy as jnp, masked_jax as mj, masked_jax.numpy as mnp
        >>> mnp.diag(mj.masked_array(jnp.array([1.0, 2.0]), jnp.array([True, False])))
        MaskedArray([[1.0 0.0]
                     [0.0 --]], dtype=float32)
    """
    x = as_dense_masked(v)
    if x.ndim == 2:
        return diagonal_of(x, k, 0, 1)
    if x.ndim != 1:
        raise ValueError(f"diag: the input must be 1-d or 2-d; got shape {x.shape}.")
    return from_pair(jnp.diag(x.filled(0), k), ~jnp.diag(~x.mask, k))


def diagflat(v, k: int = 0) -> MaskedArray:
    """``diag`` of ``v`` flattened (``jax.numpy.diagflat``).

    Examples:
        >>> import jax.numpy as jnp, masked_jax as mj, masked_jax.numpy as mnp
        >>> mnp.diagflat(mj.masked_array(jnp.array([[1.0], [2.0]]), jnp.array([[True], [False]]))).mask
        Array([[ True,  True],
               [ True, False]], dtype=bool)
    """
    return diag(op("ravel")(as_dense_masked(v)), k)


def copy(a, order=None) -> MaskedArray:
    """A copy of data and mask (``jax.numpy.copy``).

    Examples:
        >>> import jax.numpy as jnp, masked_jax as mj, masked_jax.numpy as mnp
        >>> mnp.copy(mj.masked_array(jnp.array([1.0, 2.0]), jnp.array([True, False])))
        MaskedArray([1.0 --], dtype=float32)
    """
    if order not in (None, "K", "C"):
        raise ValueError(f"copy: only order='K' (or 'C', None) is supported, as in jax.numpy; got {order!r}.")
    return as_dense_masked(a).copy()


__all__ = [
    "arange",
    "empty",
    "eye",
    "full",
    "linspace",
    "ones",
    "zeros",
    "asarray",
    "from_dlpack",
    "empty_like",
    "full_like",
    "ones_like",
    "zeros_like",
    "tril",
    "triu",
    "meshgrid",
    "diag",
    "diagflat",
    "copy",
]
