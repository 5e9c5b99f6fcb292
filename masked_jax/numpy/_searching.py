"""Searching, binning and selecting over the valid entries: ``nonzero``, ``argwhere``,
``flatnonzero``, ``searchsorted``, ``digitize``, ``bincount``, ``histogram``, ``interp``, ``select``.
"""

from __future__ import annotations

import builtins

import jax
import jax.numpy as jnp
import numpy as np

from masked_jax._core import MaskedArray, from_pair
from masked_jax.numpy._common import as_dense_masked, fully_valid, op
from masked_jax.ops._base import highest, lowest


def nonzero(x, /) -> tuple[jax.Array, ...]:
    """Indices of the valid nonzero entries (plain arrays: an index is always defined).

    Examples:
        >>> import jax.numpy as jnp, masked_jax as mj, masked_jax.numpy as mnp
        >>> mnp.nonzero(mj.masked_array(jnp.array([0.0, 2.0, 3.0]), jnp.array([True, True, False])))
        (Array([1], dtype=int32),)
    """
    x = as_dense_masked(x)
    if x.ndim == 0:
        raise ValueError("nonzero of a 0-d array is not defined by the standard; use x[None].")
    return jnp.nonzero(x.mask & (x.data != 0))


def searchsorted(x1, x2, /, *, side: str = "left", sorter=None) -> MaskedArray:
    """Insertion positions of the queries ``x2`` among the **valid** entries of the sorted 1-d
    ``x1`` (masked entries of ``x1`` are absent, wherever they sit); masked where a query is masked.
    Each position is a count of valid entries below the query: exact for any mask under ``jit``, at
    ``len(x1) * x2.size`` comparisons.

    Examples:
        >>> import jax.numpy as jnp, masked_jax as mj, masked_jax.numpy as mnp
        >>> x1 = mj.masked_array(jnp.array([1.0, 99.0, 3.0, 5.0]), jnp.array([True, False, True, True]))
        >>> q = mj.masked_array(jnp.array([0.0, 4.0, 9.0]), jnp.array([True, True, False]))
        >>> mnp.searchsorted(x1, q)
        MaskedArray([0 2 --], dtype=int32)
    """
    a, q = as_dense_masked(x1), as_dense_masked(x2)
    if a.ndim != 1:
        raise ValueError(f"searchsorted: x1 must be 1-d; got shape {a.shape}.")
    if side not in ("left", "right"):
        raise ValueError(f"searchsorted: side must be 'left' or 'right'; got {side!r}.")
    if sorter is not None:
        a = op("take")(a, jnp.asarray(sorter))
    v, w = a.data[None, :], q.data.reshape(-1, 1)
    below = (v < w) if side == "left" else (v <= w)
    if jnp.issubdtype(jnp.result_type(v, w), jnp.inexact):  # sort order, as jnp: NaN after every number
        below = (below | (~jnp.isnan(v) & jnp.isnan(w))) if side == "left" else (below | jnp.isnan(w))
    out_dtype = jax.eval_shape(jnp.searchsorted, a.data, q.data).dtype
    pos = jnp.sum(below & a.mask[None, :], axis=1, dtype=out_dtype).reshape(q.shape)
    return from_pair(pos, q.compact_mask)


def digitize(x, bins, right: bool = False) -> MaskedArray:
    """``jax.numpy.digitize`` of the valid entries of ``x`` (masked where ``x`` is); ``bins`` must
    be fully valid.

    Examples:
        >>> import jax.numpy as jnp, masked_jax as mj, masked_jax.numpy as mnp
        >>> mnp.digitize(mj.masked_array(jnp.array([0.5, 2.5, 9.0]), jnp.array([True, True, False])),
        ...              jnp.array([1.0, 2.0, 3.0]))
        MaskedArray([0 2 --], dtype=int32)
    """
    x = as_dense_masked(x)
    out = jnp.digitize(x.data, fully_valid(bins, "digitize's bins"), right=right)
    return from_pair(out, x.compact_mask)


def bincount(x, weights=None, minlength: int = 0, *, length: int | None = None) -> jax.Array:
    """Counts (or summed ``weights``) of the valid entries of the non-negative integer ``x``;
    masked entries and masked weights count nothing. A plain array: a count is always defined.

    Examples:
        >>> import jax.numpy as jnp, masked_jax as mj, masked_jax.numpy as mnp
        >>> mnp.bincount(mj.masked_array(jnp.array([0, 1, 1, 3]), jnp.array([True, True, True, False])))
        Array([1, 2], dtype=int32)
    """
    x = as_dense_masked(x)
    valid = x.mask
    if weights is None:  # counts in the dtype jnp.bincount counts in
        w = valid.astype(jax.eval_shape(lambda d: jnp.bincount(d, length=1), x.data).dtype)
    else:
        wm = as_dense_masked(weights)
        valid = valid & wm.mask
        w = jnp.where(valid, wm.data, 0)
    if length is None:
        try:
            length = builtins.max(
                int(np.max(np.where(np.asarray(valid), np.asarray(x.data), -1), initial=-1)) + 1, minlength
            )
        except jax.errors.TracerArrayConversionError as err:
            raise TypeError("bincount under jit needs length= (its output size depends on the data)") from err
    return jnp.bincount(jnp.where(valid, x.data, 0), weights=w, minlength=minlength, length=length)


def histogram(a, bins=10, range=None, weights=None, density=None):  # numpy's names
    """``jax.numpy.histogram`` of the valid entries (masked entries and masked weights count
    nothing); the default range is that of the valid entries.

    Examples:
        >>> import jax.numpy as jnp, masked_jax as mj, masked_jax.numpy as mnp
        >>> x = mj.masked_array(jnp.array([0.0, 1.0, 1.0, 99.0]), jnp.array([True, True, True, False]))
        >>> counts, edges = mnp.histogram(x, bins=2)
        >>> counts.tolist(), edges.tolist()
        ([1.0, 2.0], [0.0, 0.5, 1.0])
    """
    x = as_dense_masked(a)
    valid = x.mask
    w = valid.astype(x.dtype if jnp.issubdtype(x.dtype, jnp.inexact) else jnp.float32)
    if weights is not None:
        wm = as_dense_masked(weights)
        valid = valid & wm.mask
        w = jnp.where(valid, wm.data, 0)
    if range is None and np.ndim(bins) == 0:
        lo = jnp.min(jnp.where(valid, x.data, highest(x.dtype)))  # not inf: float8_e4m3fn has none
        hi = jnp.max(jnp.where(valid, x.data, lowest(x.dtype)))
        any_valid = jnp.any(valid)
        range = (jnp.where(any_valid, lo, 0), jnp.where(any_valid, hi, 1))
    return jnp.histogram(
        jnp.where(valid, x.data, range[0] if range is not None else 0),
        bins=bins,
        range=range,
        weights=w,
        density=density,
    )


def interp(x, xp, fp, left=None, right=None, period=None) -> MaskedArray:
    """``jax.numpy.interp`` through the **valid** sample points ``(xp, fp)`` (a point is valid
    where both are); masked where the query ``x`` is masked or no sample point is valid.

    Examples:
        >>> import jax.numpy as jnp, masked_jax as mj, masked_jax.numpy as mnp
        >>> xp = mj.masked_array(jnp.array([0.0, 1.0, 2.0]), jnp.array([True, False, True]))
        >>> mnp.interp(jnp.array([0.5, 1.0]), xp, jnp.array([0.0, 100.0, 2.0]))
        MaskedArray([0.5 1.0], dtype=float32)
    """
    q, sx, sf = as_dense_masked(x), as_dense_masked(xp), as_dense_masked(fp)
    if sx.ndim != 1 or sf.shape != sx.shape:
        raise ValueError(f"interp: xp and fp must be 1-d of one length; got shapes {sx.shape} and {sf.shape}.")
    ok = sx.mask & sf.mask
    # Each masked sample point takes the previous valid one's values (the first valid one's before
    # it): repeated points change nothing, and the shapes stay static.
    idx = jnp.where(ok, jnp.arange(ok.shape[0]), -1)
    prev = jax.lax.cummax(idx)
    take = jnp.where(prev < 0, jnp.argmax(ok), prev)
    # sanitised on entry: NaN under a mask reaches neither the values nor the gradients
    xs, fs = jnp.where(ok, sx.data, 0)[take], jnp.where(ok, sf.data, 0)[take]
    out = jnp.interp(jnp.where(q.mask, q.data, xs[0]), xs, fs, left=left, right=right, period=period)
    return from_pair(out, q.mask & jnp.any(ok))


def select(condlist, choicelist, default=0) -> MaskedArray:
    """``jax.numpy.select``: at each position the choice of the first true condition, else ``default``.
    A masked condition leaves the position masked (whether it holds is unknown); so does a masked
    chosen value. A constant ``default`` never makes a masked position valid (as in ``where``).

    Examples:
        >>> import jax.numpy as jnp, masked_jax as mj, masked_jax.numpy as mnp
        >>> x = mj.masked_array(jnp.array([-2.0, 0.5, 3.0, 9.0]), jnp.array([True, True, True, False]))
        >>> mnp.select([x < 0, x < 1], [-x, x * 10], default=x)
        MaskedArray([2.0 5.0 3.0 --], dtype=float32)
    """
    if len(condlist) != len(choicelist):
        raise ValueError(
            f"select: condlist and choicelist must have the same length; got {len(condlist)} and {len(choicelist)}."
        )
    if not condlist:
        raise ValueError("select: condlist must not be empty.")
    where = op("where")
    out = default
    for cond, choice in zip(reversed(condlist), reversed(choicelist)):
        c = as_dense_masked(cond)
        if c.dtype != jnp.bool_:
            raise TypeError(f"select: each condition must be a bool array; got dtype {c.dtype}.")
        # known true: the choice; known false: what comes after; masked condition: masked
        out = where(c, choice, out)
    return as_dense_masked(out)


def _valid_nonzero(a):
    x = as_dense_masked(a)
    return x.mask & (x.data != 0)


def argwhere(a, *, size: int | None = None, fill_value=None) -> jax.Array:
    """Indices of the valid nonzero entries, one row each (``jax.numpy.argwhere``; a plain array:
    an index is always defined). Without ``size`` it needs a concrete array, as in jax.numpy.

    Examples:
        >>> import jax.numpy as jnp, masked_jax as mj, masked_jax.numpy as mnp
        >>> mnp.argwhere(mj.masked_array(jnp.array([0.0, 2.0, 3.0]), jnp.array([True, True, False])))
        Array([[1]], dtype=int32)
    """
    return jnp.argwhere(_valid_nonzero(a), size=size, fill_value=fill_value)


def flatnonzero(a, *, size: int | None = None, fill_value=None) -> jax.Array:
    """Flat indices of the valid nonzero entries (``jax.numpy.flatnonzero``; a plain array).

    Examples:
        >>> import jax.numpy as jnp, masked_jax as mj, masked_jax.numpy as mnp
        >>> mnp.flatnonzero(mj.masked_array(jnp.array([0.0, 2.0, 3.0]), jnp.array([True, True, False])))
        Array([1], dtype=int32)
    """
    return jnp.flatnonzero(_valid_nonzero(a), size=size, fill_value=fill_value)


__all__ = [
    "nonzero",
    "searchsorted",
    "digitize",
    "bincount",
    "histogram",
    "interp",
    "select",
    "argwhere",
    "flatnonzero",
]
