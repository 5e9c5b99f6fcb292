"""Order statistics, weighted averages and norms over valid elements (the reductions family).

Fully masked slices are masked and hold 0. What is undefined on the valid entries is masked
too: a weighted average whose valid weights sum to 0 is masked, never a valid number.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from masked_jax._validate import dtype_kind, is_tracer
from masked_jax.ops._base import Pair, candidate_axes, fill, materialize, normalize_axis, result_dtype
from masked_jax.ops._registry import OpSpec, register, signature_of
from masked_jax.ops.reductions import (
    _float,
    _float_dtype,
    _mask,
    _safe_div,
    empty_slices,
    max,
    mean,
    min,
    safe_sqrt,
    sum,
)


def average(x: Pair, axis=None, weights: Pair | None = None, returned=False, keepdims=False):
    """Weighted mean over elements where both ``x`` and ``weights`` are valid; masked where no
    valid element has a nonzero weight sum. ``weights`` have ``x``'s shape, or the shape of the
    averaged axes (in the order ``axis`` names them: 1-D along an int axis). With ``returned``,
    also the sum of the weights that counted (of the valid elements: their number without
    weights), valid everywhere (0 where nothing counted), as numpy.ma returns it."""
    data = jnp.asarray(x.data)
    if weights is None:
        avg = mean(x, axis=axis, keepdims=keepdims)
        if not returned:
            return avg
        m = materialize(x.mask, data.shape)
        count = jnp.sum(m, axis=normalize_axis(axis, data.ndim), keepdims=keepdims).astype(avg.data.dtype)
        return avg, Pair(jnp.broadcast_to(count, jnp.shape(avg.data)), None)
    w, wm = _weights_like(data, jnp.asarray(weights.data), weights.mask, axis)
    m = materialize(x.mask, data.shape)
    if wm is not None:
        m = m & wm
    axes = normalize_axis(axis, data.ndim)
    dtype = _float_dtype(jnp.result_type(data, w))
    w = fill(jnp.broadcast_to(w, data.shape), m, 0).astype(dtype)
    num = jnp.sum(fill(data, m, 0).astype(dtype) * w, axis=axes, keepdims=keepdims)  # int4: no implicit promotion
    den = jnp.sum(w, axis=axes, keepdims=keepdims)
    has = jnp.any(m, axis=axes, keepdims=keepdims)
    valid = has & (den != 0)
    avg = Pair(_safe_div(num, den, valid), valid)
    if not returned:
        return avg
    # the weights' sum is a masked sum: masked where no element counted (a slice of no element at
    # all sums to 0, valid)
    return avg, Pair(den, has | empty_slices(data.shape, axes))


def _weights_like(data, w, wm, axis):
    """``(weights, their mask)`` at ``data``'s rank: as they are when they have its shape; laid
    along the averaged axes when they have those axes' shape (in ``axis``'s order)."""
    if w.shape == data.shape:
        return w, wm
    named = (
        [axis]
        if isinstance(axis, (int, np.integer))
        else list(axis)
        if isinstance(axis, (tuple, list)) and axis
        else None
    )
    if named is None:
        raise ValueError(
            f"weights must have the shape of a ({data.shape}) when axis is None; got weights of shape {w.shape}."
        )
    order = [int(a) % data.ndim for a in named]
    want = tuple(data.shape[a] for a in order)
    if w.shape != want:
        raise ValueError(
            f"weights must have the shape of a ({data.shape}) or of the averaged axes {tuple(named)} "
            f"({want}); got weights of shape {w.shape}."
        )
    perm = list(np.argsort(order))  # the weights' axes in the data's order
    shape = [data.shape[a] if a in order else 1 for a in range(data.ndim)]
    w = jnp.transpose(w, perm).reshape(shape)
    return w, None if wm is None else jnp.transpose(jnp.broadcast_to(wm, want), perm).reshape(shape)


def _move_to_end(x: Pair, axis):
    """Move the reduced axes to the end and flatten them into one."""
    data = jnp.asarray(x.data)
    m = _mask(x)
    axes = normalize_axis(axis, data.ndim)
    keep = [a for a in range(data.ndim) if a not in axes]
    perm = keep + list(axes)
    lead = tuple(data.shape[a] for a in keep)
    flat = int(np.prod([data.shape[a] for a in axes]))
    data = jnp.transpose(data, perm).reshape(lead + (flat,))
    m = jnp.transpose(m, perm).reshape(data.shape)
    return data, m, axes


QUANTILE_METHODS = ("linear", "lower", "higher", "nearest", "midpoint")


def _check_q(q, lo=0.0, hi=1.0, name="q"):
    """``q`` must lie in [lo, hi]; checked when concrete (under ``jit`` it cannot be)."""
    if is_tracer(q):
        return
    arr = np.asarray(q)
    if dtype_kind(arr.dtype) not in "iuf" or arr.size and not (np.all(arr >= lo) and np.all(arr <= hi)):
        raise ValueError(f"{name} must be numbers in [{lo:g}, {hi:g}]; got {q!r}.")


def quantile(x: Pair, q, axis=None, method="linear", keepdims=False) -> Pair:
    """Quantiles of the valid elements, by ``jnp.quantile``'s own arithmetic on each slice's valid
    entries: a valid NaN makes its slice's quantile NaN, the interpolation weights are
    ``q * (n - 1)``'s fractional parts, and ``lower``/``higher``/``nearest`` pick an element without
    arithmetic (so a valid ``inf`` is returned as it is, never as ``inf - inf``)."""
    if method not in QUANTILE_METHODS:
        raise ValueError(f"method must be one of {QUANTILE_METHODS}; got {method!r}.")
    _check_q(q)
    data, m, axes = _move_to_end(x, axis)
    dtype = result_dtype(jnp.quantile, data.dtype, q=0.5)
    data = data.astype(dtype)
    if jnp.issubdtype(dtype, jnp.inexact):  # as jnp: a NaN among the valid entries poisons its slice
        data = jnp.where(jnp.any(m & jnp.isnan(data), axis=-1, keepdims=True), jnp.nan, data)
    # Sort valid values first (ascending), masked ones last.
    invalid = (~m).astype(jnp.int8)
    _, srt = jax.lax.sort((invalid, fill(data, m, 0)), dimension=data.ndim - 1, num_keys=2)
    n = jnp.sum(m, axis=-1, keepdims=True)
    q = jnp.asarray(q)
    q = q.astype(jnp.result_type(q, 1.0))  # as jnp: positions and weights in q's own inexact dtype
    qs = q.reshape(q.shape + (1,) * data.ndim)
    pos = qs * (n.astype(q.dtype) - 1)
    lo, hi = jnp.floor(pos), jnp.ceil(pos)
    high_weight = pos - lo
    low_weight = 1 - high_weight
    top = jnp.maximum(n - 1, 0)
    lo_i = jnp.clip(lo.astype(jnp.int32), 0, top)
    hi_i = jnp.clip(hi.astype(jnp.int32), 0, top)
    srt_b = jnp.broadcast_to(srt, q.shape + srt.shape)
    if srt.shape[-1] == 0:
        v_lo = v_hi = jnp.zeros(q.shape + srt.shape[:-1] + (1,), dtype)
    else:
        v_lo = jnp.take_along_axis(srt_b, lo_i, -1)
        v_hi = jnp.take_along_axis(srt_b, hi_i, -1)
    valid = n > 0
    if method == "linear":  # the weights only where the slice has entries (no 0 * inf at empty ones)
        out = (
            jnp.where(valid, v_lo, 0).astype(q.dtype) * jnp.where(valid, low_weight, 1)
            + jnp.where(valid, v_hi, 0).astype(q.dtype) * jnp.where(valid, high_weight, 0)
        ).astype(dtype)
    elif method == "lower":
        out = v_lo
    elif method == "higher":
        out = v_hi
    elif method == "nearest":
        out = jnp.where(high_weight <= 0.5, v_lo, v_hi)
    else:  # midpoint
        out = (v_lo + v_hi) * jnp.asarray(0.5, dtype)
    out = out[..., 0].astype(dtype)
    valid = jnp.broadcast_to(valid[..., 0], out.shape)
    out = jnp.where(valid, out, 0)
    if keepdims:
        shape = list(q.shape) + [1 if a in axes else s for a, s in enumerate(np.shape(x.data))]
        out, valid = out.reshape(shape), valid.reshape(shape)
    return Pair(out, valid)


def median(x: Pair, axis=None, keepdims=False) -> Pair:
    """``jnp.median``: the midpoint quantile at 0.5 of the valid elements."""
    return quantile(x, 0.5, axis=axis, keepdims=keepdims, method="midpoint")


def percentile(x: Pair, q, axis=None, method="linear", keepdims=False) -> Pair:
    _check_q(q, 0.0, 100.0)
    return quantile(x, jnp.asarray(q) / 100, axis=axis, keepdims=keepdims, method=method)


def _variables(x: Pair, rowvar):
    """``(data, valid)`` as a 2-D (variables, observations) matrix, data float."""
    data = jnp.asarray(x.data)
    if data.ndim > 2:
        raise ValueError(f"cov: the input must be 1-D or 2-D; got shape {data.shape}.")
    m = materialize(x.mask, data.shape)
    data, m = jnp.atleast_2d(data), jnp.atleast_2d(m)
    if not rowvar and data.shape[0] != 1:
        data, m = data.T, m.T
    return data.astype(_float_dtype(data.dtype)), m


def cov(m: Pair, y: Pair | None = None, rowvar=True, bias=False, ddof=None) -> Pair:
    """Covariance matrix over valid observations, as ``numpy.ma.cov``: each variable is centred on
    the mean of its own valid observations, and entry ``(i, j)`` divides the sum over the
    observations valid in both ``i`` and ``j`` by their number minus ``ddof`` (1, or 0 with
    ``bias=True``). An entry with no degrees of freedom left is masked. ``y``: more variables,
    stacked after those of ``m``; when it has ``m``'s shape, an observation masked in either is
    masked in both (numpy.ma's common mask)."""
    if ddof is not None and (isinstance(ddof, bool) or not isinstance(ddof, (int, np.integer))):
        raise TypeError(f"cov: ddof must be an int or None; got {ddof!r}.")
    data, valid = _variables(m, rowvar)
    if y is not None:
        more, more_valid = _variables(y, rowvar)
        if np.shape(y.data) == np.shape(m.data):  # one observation mask for both
            valid = more_valid = valid & more_valid
        if more.shape[1] != data.shape[1]:
            raise ValueError(f"cov: y must have as many observations as m ({data.shape[1]}); got {more.shape[1]}.")
        dtype = jnp.result_type(data, more)
        data = jnp.concatenate([data.astype(dtype), more.astype(dtype)])
        valid = jnp.concatenate([valid, more_valid])
    ddof = (0 if bias else 1) if ddof is None else ddof
    n = jnp.sum(valid, axis=1, keepdims=True)
    mean = jnp.sum(fill(data, valid, 0), axis=1, keepdims=True) / jnp.maximum(n, 1).astype(data.dtype)
    centred = jnp.where(valid, data - mean, 0)
    w = valid.astype(data.dtype)
    fact = jnp.matmul(w, w.T, precision="highest") - ddof
    ok = fact > 0
    out = jnp.matmul(centred, jnp.conj(centred).T, precision="highest") / jnp.where(ok, fact, 1)
    return Pair(jnp.squeeze(jnp.where(ok, out, 0)), jnp.squeeze(ok))


def corrcoef(x: Pair, y: Pair | None = None, rowvar=True) -> Pair:
    """Correlation coefficients over valid observations, as ``numpy.ma.corrcoef``: :func:`cov`
    divided by the outer product of the square roots of its diagonal; masked where a variance
    is masked or 0. ``y`` as in :func:`cov`."""
    c = cov(x, y, rowvar=rowvar)
    if np.ndim(c.data) == 0:
        ok = c.mask & (c.data != 0)
        return Pair(jnp.where(ok, 1, 0).astype(c.data.dtype), ok)
    d = jnp.diagonal(c.data)
    dv = jnp.diagonal(c.mask) & (d > 0)
    std = safe_sqrt(jnp.where(dv, d, 0))
    ok = c.mask & dv[:, None] & dv[None, :]
    return Pair(_safe_div(c.data, std[:, None] * std[None, :], ok), ok)


VECTOR_ORDS = "None, 0, 1, 2, inf, -inf or any other number"
MATRIX_ORDS = (None, "fro", "nuc", 1, -1, 2, -2, np.inf, -np.inf)


def safe_root(s, ord):
    """``s ** (1 / ord)`` with value and derivative 0 at ``s == 0``; NaN stays NaN (as jnp)."""
    pos = s > 0
    return jnp.where(pos, jnp.where(pos, s, 1) ** (1.0 / ord), jnp.where(s == 0, 0, jnp.nan).astype(s.dtype))


def _vector_norm(x: Pair, ord, axis, keepdims) -> Pair:
    if isinstance(ord, str):
        raise ValueError(f"ord={ord!r} is a matrix norm: it needs two axes (axis=(r, c)).")
    if not (ord is None or np.ndim(ord) == 0):
        raise ValueError(f"ord must be {VECTOR_ORDS} for a vector norm; got {ord!r}.")
    a = Pair(jnp.abs(fill(x.data, x.mask, 0)), x.mask)
    if ord is None or ord == 2:
        s = sum(Pair(a.data * a.data, a.mask), axis=axis, keepdims=keepdims)
        return Pair(safe_sqrt(s.data), s.mask)
    if ord == np.inf:
        return max(a, axis=axis, keepdims=keepdims)
    if ord == -np.inf:
        return min(a, axis=axis, keepdims=keepdims)
    if ord == 0:
        return sum(Pair((a.data != 0).astype(a.data.dtype), a.mask), axis=axis, keepdims=keepdims)
    if ord == 1:
        return sum(a, axis=axis, keepdims=keepdims)
    s = sum(Pair(a.data**ord, a.mask), axis=axis, keepdims=keepdims)
    return Pair(safe_root(s.data, ord), s.mask)


def _matrix_norm(x: Pair, ord, axes, keepdims) -> Pair:
    r, c = axes
    if not any(ord is o or (not isinstance(ord, str) and not isinstance(o, str) and ord == o) for o in MATRIX_ORDS):
        raise ValueError(f"ord must be one of {MATRIX_ORDS} for a matrix norm; got {ord!r}.")
    a = Pair(jnp.abs(fill(x.data, x.mask, 0)), x.mask)
    if ord in (None, "fro"):
        return _vector_norm(x, 2, axes, keepdims)
    if ord in (1, -1, np.inf, -np.inf):
        inner, outer = (r, c) if ord in (1, -1) else (c, r)
        sums = sum(a, axis=inner, keepdims=True)
        pick = max if ord in (1, np.inf) else min
        out = pick(sums, axis=outer, keepdims=True)
        if not keepdims:
            out = Pair(jnp.squeeze(out.data, (r, c)), jnp.squeeze(out.mask, (r, c)))
        return out
    # Spectral norms (2, -2, "nuc"): masked entries count as zero (documented choice).
    mat = jnp.moveaxis(fill(x.data, x.mask, 0), (r, c), (-2, -1))
    sv = jnp.linalg.svd(mat, compute_uv=False)
    val = {2: lambda s: s[..., 0], -2: lambda s: s[..., -1], "nuc": lambda s: s.sum(-1)}[ord](sv)
    valid = jnp.any(_mask(x), axis=(r, c), keepdims=keepdims)
    if keepdims:
        val = jnp.expand_dims(val, (r, c))
    return Pair(jnp.where(valid, val, 0), valid)


def norm(x: Pair, ord=None, axis=None, keepdims=False) -> Pair:
    """Vector or matrix norm over valid elements (same ``ord``/``axis`` rules as jnp)."""
    x = Pair(jnp.asarray(x.data).astype(_float_dtype(jnp.result_type(x.data))), x.mask)  # as jnp: inexact first
    ndim = np.ndim(x.data)
    if axis is None:
        if ord is None:
            return _vector_norm(x, 2, None, keepdims)
        axis = tuple(range(ndim))
        if ndim not in (1, 2):
            raise ValueError(f"norm with ord={ord!r} and axis=None needs a 1-D or 2-D input; got {ndim}-D.")
    axes = normalize_axis(axis, ndim)
    if isinstance(axis, (int, np.integer)) or len(axes) == 1:
        return _vector_norm(x, ord, axes, keepdims)
    if len(axes) == 2:
        given = tuple(int(a) % ndim for a in axis)
        return _matrix_norm(x, ord, given, keepdims)
    raise ValueError(  # jnp's own words
        f"Improper number of axes for norm: axis={axis}. Pass one axis to compute a vector-norm, "
        "or two axes to compute a matrix-norm."
    )


def _seg_norm(g, v, ord=None):
    """Vector norms over groups of stored entries (matrix norms are not segment reductions)."""
    a = jnp.abs(v)
    if ord is None or ord == 2:
        return safe_sqrt(g.sum(a * a))
    if ord == np.inf:
        return g.max(a)
    if ord == -np.inf:
        return g.min(a)
    if ord == 0:
        return g.sum((a != 0).astype(a.dtype))
    if ord == 1:
        return g.sum(a)
    return safe_root(g.sum(_float(a) ** ord), ord)


_Q = (
    "x = mj.masked_array(jnp.array([1.0, 2.0, 3.0, 100.0]), jnp.array([True, True, True, False]))",
    "{mod}.{name}(x, {q})",
    "MaskedArray(2.0, dtype=float32)",
)


def _stat(name, jax_fn, rule, **kw):
    sig = signature_of(jax_fn, drop=("out_sharding",))
    return register(
        OpSpec(
            name=name,
            family="reductions",
            rule=rule,
            signature=sig,
            operands=(next(iter(sig.parameters)),),
            fn=jax_fn,
            jax_name=kw.pop("jax_name", f"jnp.{name}"),
            **kw,
        )
    )


_stat(
    "average",
    jnp.average,
    average,
    optional_operands=("weights",),
    excluded={
        "maskify": "jnp.average divides by the sum of every weight, which maskify cannot tell from an "
        "ordinary division yet: use masked_jax.numpy.average"
    },
    example=(
        "x = mj.masked_array(jnp.array([1.0, 2.0, 50.0]), jnp.array([True, True, False]))",
        "{mod}.average(x, weights=jnp.array([3.0, 1.0, 1.0]))",
        "MaskedArray(1.25, dtype=float32)",
    ),
)


def _quantile_static(body, a, q=()):
    return [
        dict(axis=ax, method=me, keepdims=k)
        for ax in candidate_axes(a)
        for me in QUANTILE_METHODS
        for k in (False, True)
    ]


def _median_static(body, a):
    return [dict(axis=ax, keepdims=k) for ax in candidate_axes(a) for k in (False, True)]


def _cov_static(body, m, y=None):
    return [dict(rowvar=r, bias=b, ddof=d) for r in (True, False) for b in (False, True) for d in (None, 0, 1, 2)]


def _corrcoef_static(body, x, y=None):
    return [dict(rowvar=r) for r in (True, False)]


_stat("quantile", jnp.quantile, quantile, static=_quantile_static, example=(_Q[0], _Q[1].replace("{q}", "0.5"), _Q[2]))
_stat(
    "percentile",
    jnp.percentile,
    percentile,
    static=_quantile_static,
    example=(_Q[0], _Q[1].replace("{q}", "50"), _Q[2]),
)
_stat("median", jnp.median, median, static=_median_static)
_COV = (
    "x = mj.masked_array(jnp.array([[1.0, 2.0, 3.0, 9.0], [2.0, 4.0, 7.0, 0.0]]), "
    "jnp.array([[1, 1, 1, 0], [1, 1, 1, 1]], bool))"
)
_stat(
    "cov",
    jnp.cov,
    cov,
    optional_operands=("y",),
    static=_cov_static,
    example=(_COV, "{mod}.cov(x).round(2)", "MaskedArray([[1.0 2.5]\n             [2.5 8.92]], dtype=float32)"),
)
_stat(
    "corrcoef",
    jnp.corrcoef,
    corrcoef,
    optional_operands=("y",),
    static=_corrcoef_static,
    example=(_COV, "{mod}.corrcoef(x)[0, 1].round(3)", "MaskedArray(0.837, dtype=float32)"),
)
_stat("norm", jnp.linalg.norm, norm, segment=_seg_norm, jax_name="jnp.linalg.norm")
