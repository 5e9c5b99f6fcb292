"""Reductions beyond the registry's: the ``nan*`` family (NaN counts as masked), cumulative sums and
products, ``count_nonzero``, differences (``diff``, ``ediff1d``) and ``allclose``.
"""

from __future__ import annotations

import builtins

import jax
import jax.numpy as jnp
import numpy as np

from masked_jax._core import MaskedArray, from_pair
from masked_jax.numpy._common import as_dense_masked, document, op
from masked_jax.ops._base import normalize_axis, result_dtype


def _cumulative(name, x, axis, dtype, include_initial):
    x = as_dense_masked(x)
    if axis is None:
        if x.ndim != 1:
            raise ValueError(
                f"cumulative_{name}: axis is required for a {x.ndim}-d array (the standard "
                "leaves it optional for 1-d arrays only)."
            )
        axis = 0
    # the standard's cumulative_sum promotes as sum does (int8 -> the default int), jnp.cumsum does not
    dtype = result_dtype(getattr(jnp, f"cumulative_{name}"), x.dtype, dtype=dtype)
    out = op(f"cum{name}")(x, axis=axis, dtype=dtype)
    if not include_initial:
        return out
    axis = axis % x.ndim
    shape = out.shape[:axis] + (1,) + out.shape[axis + 1 :]
    initial = jnp.zeros(shape, out.dtype) if name == "sum" else jnp.ones(shape, out.dtype)
    return op("concatenate")([as_dense_masked(initial), out], axis=axis)


def cumulative_sum(x, /, *, axis: int | None = None, dtype=None, include_initial: builtins.bool = False) -> MaskedArray:
    """Running sum over the valid entries; a masked entry is masked in the output and adds nothing
    (``numpy.ma.cumsum``). ``include_initial`` prepends a valid 0.

    Examples:
        >>> import jax.numpy as jnp, masked_jax as mj, masked_jax.numpy as mnp
        >>> x = mj.masked_array(jnp.array([1.0, 9.0, 3.0]), jnp.array([True, False, True]))
        >>> mnp.cumulative_sum(x)
        MaskedArray([1.0 -- 4.0], dtype=float32)
    """
    return _cumulative("sum", x, axis, dtype, include_initial)


def cumulative_prod(
    x, /, *, axis: int | None = None, dtype=None, include_initial: builtins.bool = False
) -> MaskedArray:
    """Running product over the valid entries (Array API 2024.12); a masked entry is masked in the
    output and multiplies by nothing (``numpy.ma.cumprod``). ``include_initial`` prepends a valid 1.

    Examples:
        >>> import jax.numpy as jnp, masked_jax as mj, masked_jax.numpy as mnp
        >>> x = mj.masked_array(jnp.array([2.0, 9.0, 3.0]), jnp.array([True, False, True]))
        >>> mnp.cumulative_prod(x)
        MaskedArray([2.0 -- 6.0], dtype=float32)
    """
    return _cumulative("prod", x, axis, dtype, include_initial)


def count_nonzero(x, /, *, axis=None, keepdims: builtins.bool = False) -> jax.Array:
    """How many valid entries are nonzero (Array API 2024.12): a plain array, as a count is
    always defined.

    Examples:
        >>> import jax.numpy as jnp, masked_jax as mj, masked_jax.numpy as mnp
        >>> mnp.count_nonzero(mj.masked_array(jnp.array([0.0, 2.0, 3.0]), jnp.array([True, True, False])))
        Array(1, dtype=int32)
    """
    x = as_dense_masked(x)
    return jnp.count_nonzero(x.mask & (x.data != 0), axis=axis, keepdims=keepdims)


def _nan_masked(x):
    x = as_dense_masked(x)
    if not jnp.issubdtype(x.dtype, jnp.inexact):
        return x
    return from_pair(x.data, x.mask & ~jnp.isnan(x.data))


def _nan_reduction(name):
    def reduce(a, *args, **kwargs):
        if name in ("cumsum", "cumprod"):  # as jnp: a NaN adds (multiplies) nothing, its position stays
            x = as_dense_masked(a)
            if jnp.issubdtype(x.dtype, jnp.inexact):
                x = from_pair(jnp.where(jnp.isnan(x.data), 0 if name == "cumsum" else 1, x.data), x.compact_mask)
            return op(name)(x, *args, **kwargs)
        return op(name)(_nan_masked(a), *args, **kwargs)

    args = {"quantile": ", 0.5", "percentile": ", 50.0"}.get(name, "")
    return document(
        reduce,
        f"nan{name}",
        f"``{name}`` with NaN treated as masked (``jax.numpy.nan{name}``'s "
        "meaning, on the valid entries); a slice with no valid non-NaN entry is masked.",
        ">>> import jax.numpy as jnp, masked_jax as mj, masked_jax.numpy as mnp",
        ">>> x = mj.masked_array(jnp.array([1.0, jnp.nan, 3.0, 7.0]), jnp.array([True, True, True, False]))",
        f">>> bool(jnp.isnan(mnp.nan{name}(x{args}).filled(0)).any())",
        "False",
    )


NAN_REDUCTIONS = [
    "sum",
    "prod",
    "mean",
    "max",
    "min",
    "std",
    "var",
    "argmax",
    "argmin",
    "cumsum",
    "cumprod",
    "median",
    "quantile",
    "percentile",
]

nansum = _nan_reduction("sum")
nanprod = _nan_reduction("prod")
nanmean = _nan_reduction("mean")
nanmax = _nan_reduction("max")
nanmin = _nan_reduction("min")
nanstd = _nan_reduction("std")
nanvar = _nan_reduction("var")
nanargmax = _nan_reduction("argmax")
nanargmin = _nan_reduction("argmin")
nancumsum = _nan_reduction("cumsum")
nancumprod = _nan_reduction("cumprod")
nanmedian = _nan_reduction("median")
nanquantile = _nan_reduction("quantile")
nanpercentile = _nan_reduction("percentile")

NAN = {f"nan{n}": globals()[f"nan{n}"] for n in NAN_REDUCTIONS}


def diff(a, n: int = 1, axis: int = -1, prepend=None, append=None) -> MaskedArray:
    """``a[1:] - a[:-1]`` along ``axis``, ``n`` times: valid where both neighbours are
    (``numpy.ma.diff``).

    Examples:
        >>> import jax.numpy as jnp, masked_jax as mj, masked_jax.numpy as mnp
        >>> mnp.diff(mj.masked_array(jnp.array([1.0, 4.0, 9.0, 16.0]), jnp.array([True, True, False, True])))
        MaskedArray([3.0 -- --], dtype=float32)
    """
    x = as_dense_masked(a)
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0:
        raise ValueError(f"diff: n must be an int >= 0; got {n!r}.")
    if x.ndim == 0:
        raise ValueError("diff: a must be at least 1-d (a 0-d array has no neighbours); got a 0-d array.")
    (axis,) = normalize_axis(axis, x.ndim)
    parts = [p for p in (prepend, x, append) if p is not None]
    if len(parts) > 1:
        shape = list(x.shape)
        shape[axis] = 1
        parts = [
            p if p is x or np.ndim(p) == x.ndim else op("broadcast_to")(as_dense_masked(p), tuple(shape)) for p in parts
        ]
        x = op("concatenate")([as_dense_masked(p) for p in parts], axis=axis)
    for _ in range(n):
        hi = tuple(slice(1, None) if d == axis else slice(None) for d in range(x.ndim))
        lo = tuple(slice(None, -1) if d == axis else slice(None) for d in range(x.ndim))
        # as jnp.diff: bool neighbours differ where they are not equal
        x = op("not_equal" if x.dtype == jnp.bool_ else "subtract")(x[hi], x[lo])
    return x


def allclose(a, b, rtol=1e-05, atol=1e-08, equal_nan: bool = False) -> MaskedArray:
    """Whether every jointly valid pair is close (``isclose``), reduced as ``all``: a 0-d bool array,
    masked when no pair is jointly valid (masked entries are never compared).

    Examples:
        >>> import jax.numpy as jnp, masked_jax as mj, masked_jax.numpy as mnp
        >>> a = mj.masked_array(jnp.array([1.0, 5.0]), jnp.array([True, False]))
        >>> mnp.allclose(a, jnp.array([1.0, 2.0]))
        MaskedArray(True, dtype=bool)
    """
    return op("all")(op("isclose")(a, b, rtol=rtol, atol=atol, equal_nan=equal_nan))


def ediff1d(ary, to_end=None, to_begin=None) -> MaskedArray:
    """Differences of consecutive entries of ``ary`` flattened, valid where both are
    (``numpy.ma.ediff1d``), with ``to_begin``/``to_end`` joined on.

    Examples:
        >>> import jax.numpy as jnp, masked_jax as mj, masked_jax.numpy as mnp
        >>> mnp.ediff1d(mj.masked_array(jnp.array([1.0, 4.0, 9.0, 16.0]), jnp.array([True, True, False, True])))
        MaskedArray([3.0 -- --], dtype=float32)
    """
    x = diff(op("ravel")(as_dense_masked(ary)))
    parts = [op("ravel")(as_dense_masked(p)).astype(x.dtype) for p in (to_begin,) if p is not None]
    parts += [x] + [op("ravel")(as_dense_masked(p)).astype(x.dtype) for p in (to_end,) if p is not None]
    return op("concatenate")(parts) if len(parts) > 1 else x


__all__ = [
    "nansum",
    "nanprod",
    "nanmean",
    "nanmax",
    "nanmin",
    "nanstd",
    "nanvar",
    "nanargmax",
    "nanargmin",
    "nancumsum",
    "nancumprod",
    "nanmedian",
    "nanquantile",
    "nanpercentile",
    "cumulative_sum",
    "cumulative_prod",
    "count_nonzero",
    "diff",
    "allclose",
    "ediff1d",
]
