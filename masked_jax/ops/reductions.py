"""Reductions over valid elements only.

An output element is valid iff its slice has at least one valid element (for
``var``/``std``: more valid elements than ``ddof``, as ``numpy.ma``). Fully
masked slices are masked and hold a documented fill value, never NaN: the
identity of the reduction (0 for ``sum``, 1 for ``prod``, -inf/+inf or the
integer extremes for ``max``/``min``, -inf for ``logsumexp``) and 0 for
``mean``, ``var``, ``std``, ``median``, ``quantile``, ``average`` and ``norm``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from masked_jax.ops._base import Pair, fill, highest, lowest, materialize, normalize_axis


def _mask(x: Pair):
    return materialize(x.mask, jnp.shape(x.data))


def _float_dtype(dtype):
    """The dtype ``jnp.mean`` computes in for ``dtype``."""
    if jnp.issubdtype(dtype, jnp.inexact):
        return dtype
    return jnp.result_type(float)


def _safe_div(num, den, valid):
    """``num / den`` where ``valid``, 0 elsewhere, with no NaN in value or gradient."""
    return jnp.where(valid, num / jnp.where(valid, den, 1), 0)


def safe_sqrt(x):
    """``sqrt`` with value and derivative 0 at ``x <= 0`` (no inf gradient at 0)."""
    positive = x > 0
    return jnp.where(positive, jnp.sqrt(jnp.where(positive, x, 1)), 0)


def _add_pairs(a, b):
    return a[0] + b[0], a[1] + b[1]


@functools.partial(jax.custom_jvp, nondiff_argnums=(2,))
def sum_and_count(data, mask, axes):
    """``(sum(data), count(mask))`` over ``axes`` in one pass over memory.

    ``data`` must already be 0 where ``mask`` is False. A single variadic
    reduction keeps XLA from materialising the filled data, which two
    separate reductions over the same input do on CPU (measured 1.2 ms against
    15 ms for a (4096, 1024) masked mean). ``lax.reduce`` with two operands has
    no derivative rule, hence the JVP below (the sum is linear, the count is
    an integer).
    """
    zero = jnp.zeros((), data.dtype)
    return jax.lax.reduce(
        (data, mask.astype(jnp.int32)), (zero, jnp.int32(0)), _add_pairs, axes
    )


@sum_and_count.defjvp
def _sum_and_count_jvp(axes, primals, tangents):
    data, mask = primals
    t_data, _ = tangents
    total, n = sum_and_count(data, mask, axes)
    if t_data.dtype == jax.dtypes.float0:  # integer data has no tangent
        t_total = np.zeros(total.shape, jax.dtypes.float0)
    else:
        t_total = jnp.sum(t_data, axis=axes)
    return (total, n), (t_total, np.zeros(n.shape, jax.dtypes.float0))


def _keep(x, axes, keepdims):
    return jnp.expand_dims(x, axes) if keepdims else x


def count(x: Pair, axis=None, keepdims=False):
    """Number of valid elements (a plain array: a count is always defined)."""
    return jnp.sum(_mask(x), axis=axis, keepdims=keepdims)


def sum(x: Pair, axis=None, keepdims=False, dtype=None) -> Pair:  # noqa: A001
    m = _mask(x)
    data = jnp.asarray(x.data)
    out_dtype = jax.eval_shape(lambda d: jnp.sum(d, dtype=dtype), jax.ShapeDtypeStruct((), data.dtype)).dtype
    axes = normalize_axis(axis, m.ndim)
    total, n = sum_and_count(fill(data, m, 0).astype(out_dtype), m, axes)
    return Pair(_keep(total, axes, keepdims), _keep(n > 0, axes, keepdims))


def prod(x: Pair, axis=None, keepdims=False, dtype=None) -> Pair:
    m = _mask(x)
    data = jnp.prod(fill(x.data, m, 1), axis=axis, keepdims=keepdims, dtype=dtype)
    return Pair(data, jnp.any(m, axis=axis, keepdims=keepdims))


def mean(x: Pair, axis=None, keepdims=False, dtype=None) -> Pair:
    m = _mask(x)
    dtype = dtype or _float_dtype(jnp.result_type(x.data))
    axes = normalize_axis(axis, m.ndim)
    total, n = sum_and_count(fill(x.data, m, 0).astype(dtype), m, axes)
    valid = n > 0
    out = _safe_div(total, n.astype(dtype), valid).astype(dtype)
    return Pair(_keep(out, axes, keepdims), _keep(valid, axes, keepdims))


def var(x: Pair, axis=None, keepdims=False, ddof=0, dtype=None) -> Pair:
    m = _mask(x)
    dtype = dtype or _float_dtype(jnp.result_type(x.data))
    data = fill(x.data, m, 0).astype(dtype)
    axes = normalize_axis(axis, m.ndim)
    total, n = sum_and_count(data, m, axes)
    centre = jnp.expand_dims(total / jnp.maximum(n, 1).astype(dtype), axes)
    dev = jnp.where(m, data - centre, 0)
    sq = jnp.real(dev * jnp.conj(dev)) if jnp.iscomplexobj(dev) else dev * dev
    ss = jnp.sum(sq, axis=axes)
    dof = n - ddof
    valid = dof > 0
    out = _safe_div(ss, dof.astype(ss.dtype), valid)
    return Pair(_keep(out, axes, keepdims), _keep(valid, axes, keepdims))


def std(x: Pair, axis=None, keepdims=False, ddof=0, dtype=None) -> Pair:
    v = var(x, axis=axis, keepdims=keepdims, ddof=ddof, dtype=dtype)
    return Pair(safe_sqrt(v.data), v.mask)


def max(x: Pair, axis=None, keepdims=False) -> Pair:  # noqa: A001
    m = _mask(x)
    init = lowest(jnp.result_type(x.data))
    data = jnp.max(fill(x.data, m, init), axis=axis, keepdims=keepdims, initial=init)
    return Pair(data, jnp.any(m, axis=axis, keepdims=keepdims))


def min(x: Pair, axis=None, keepdims=False) -> Pair:  # noqa: A001
    m = _mask(x)
    init = highest(jnp.result_type(x.data))
    data = jnp.min(fill(x.data, m, init), axis=axis, keepdims=keepdims, initial=init)
    return Pair(data, jnp.any(m, axis=axis, keepdims=keepdims))


def ptp(x: Pair, axis=None, keepdims=False) -> Pair:
    hi, lo = max(x, axis, keepdims), min(x, axis, keepdims)
    return Pair(jnp.where(hi.mask, hi.data - jnp.where(hi.mask, lo.data, 0), 0), hi.mask)


def _arg_extreme(x: Pair, axis, keepdims, largest: bool) -> Pair:
    data = jnp.asarray(x.data)
    m = _mask(x)
    if axis is None:
        data, m = data.ravel(), m.ravel()
        axis_, out_keep = 0, False
    else:
        (axis_,) = normalize_axis(axis, data.ndim)
        out_keep = keepdims
    if data.shape[axis_] == 0:
        shape = list(data.shape)
        if out_keep:
            shape[axis_] = 1
        else:
            del shape[axis_]
        if axis is None and keepdims:
            shape = [1] * np.ndim(x.data)
        zeros = jnp.zeros(shape, dtype=jnp.result_type(int))
        return Pair(zeros, jnp.zeros(shape, dtype=bool))
    ext = (max if largest else min)(Pair(data, m), axis=axis_, keepdims=True).data
    hit = m & (data == ext)
    if jnp.issubdtype(data.dtype, jnp.inexact):
        # jnp semantics: a NaN among the valid elements wins, first one first.
        hit = hit | (m & jnp.isnan(data))
    idx = jnp.argmax(hit, axis=axis_, keepdims=out_keep)
    valid = jnp.any(m, axis=axis_, keepdims=out_keep)
    if axis is None and keepdims:
        idx, valid = idx.reshape((1,) * np.ndim(x.data)), valid.reshape((1,) * np.ndim(x.data))
    return Pair(idx, valid)


def argmax(x: Pair, axis=None, keepdims=False) -> Pair:
    return _arg_extreme(x, axis, keepdims, largest=True)


def argmin(x: Pair, axis=None, keepdims=False) -> Pair:
    return _arg_extreme(x, axis, keepdims, largest=False)


def any(x: Pair, axis=None, keepdims=False) -> Pair:  # noqa: A001
    m = _mask(x)
    data = jnp.any(fill(x.data, m, 0), axis=axis, keepdims=keepdims)
    return Pair(data, jnp.any(m, axis=axis, keepdims=keepdims))


def all(x: Pair, axis=None, keepdims=False) -> Pair:  # noqa: A001
    m = _mask(x)
    data = jnp.all(fill(x.data, m, 1), axis=axis, keepdims=keepdims)
    return Pair(data, jnp.any(m, axis=axis, keepdims=keepdims))


def shifted_by_max(x: Pair, axis):
    """``(data - max, mask)`` over valid elements of ``axis``: the stable shift of the exp family.

    Masked data is 0 before shifting; the max is a constant for autodiff and 0
    where a slice has no (finite) valid maximum.
    """
    m = _mask(x)
    data = fill(x.data, m, 0)
    if not jnp.issubdtype(data.dtype, jnp.inexact):
        data = data.astype(jnp.result_type(float))
    top = jax.lax.stop_gradient(max(Pair(data, m), axis=axis, keepdims=True).data)
    top = jnp.where(jnp.isfinite(top), top, 0)
    return data - top, m, top


def logsumexp(x: Pair, axis=None, keepdims=False) -> Pair:
    z, m, top = shifted_by_max(x, axis)
    total = jnp.sum(jnp.where(m, jnp.exp(z), 0), axis=axis, keepdims=keepdims)
    valid = jnp.any(m, axis=axis, keepdims=keepdims)
    top = top if keepdims else jnp.squeeze(top, axis=normalize_axis(axis, z.ndim))
    has_mass = valid & (total > 0)
    out = jnp.log(jnp.where(has_mass, total, 1)) + top
    return Pair(jnp.where(has_mass, out, -jnp.inf), valid)


def _cumulative(fn, identity, what):
    def rule(x: Pair, axis=None, dtype=None) -> Pair:
        m = _mask(x)
        data = fill(x.data, m, identity)
        if axis is None:
            data, m = data.ravel(), m.ravel()
        return Pair(fn(data, axis=axis, dtype=dtype), m)

    rule.__name__ = fn.__name__
    rule.__doc__ = f"Running {what} where masked elements count as {identity}; the mask is unchanged (as numpy.ma)."
    return rule


cumsum = _cumulative(jnp.cumsum, 0, "sum")
cumprod = _cumulative(jnp.cumprod, 1, "product")


def average(x: Pair, axis=None, weights: Pair | None = None, keepdims=False) -> Pair:
    """Weighted mean over elements where both ``x`` and ``weights`` are valid."""
    if weights is None:
        return mean(x, axis=axis, keepdims=keepdims)
    data = jnp.asarray(x.data)
    w = jnp.asarray(weights.data)
    if w.shape != data.shape:
        if axis is None or w.ndim != 1 or not isinstance(axis, (int, np.integer)):
            raise ValueError(
                f"weights must have the shape of a ({data.shape}), or be 1-D along an int "
                f"axis; got weights of shape {w.shape} with axis={axis}."
            )
        ax = normalize_axis(axis, data.ndim)[0]
        if w.shape[0] != data.shape[ax]:
            raise ValueError(
                f"weights must have length {data.shape[ax]} along axis {axis}; got {w.shape[0]}."
            )
        shape = [1] * data.ndim
        shape[ax] = -1
        w = w.reshape(shape)
        wm = None if weights.mask is None else weights.mask.reshape(shape)
    else:
        wm = weights.mask
    m = materialize(x.mask, data.shape)
    if wm is not None:
        m = m & wm
    dtype = _float_dtype(jnp.result_type(data, w))
    w = fill(jnp.broadcast_to(w, data.shape), m, 0).astype(dtype)
    num = jnp.sum(fill(data, m, 0) * w, axis=axis, keepdims=keepdims)
    den = jnp.sum(w, axis=axis, keepdims=keepdims)
    valid = jnp.any(m, axis=axis, keepdims=keepdims)
    return Pair(_safe_div(num, den, valid & (den != 0)), valid)


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


def quantile(x: Pair, q, axis=None, keepdims=False, method="linear") -> Pair:
    """Quantiles of the valid elements (``method`` as numpy's linear family)."""
    methods = ("linear", "lower", "higher", "nearest", "midpoint")
    if method not in methods:
        raise ValueError(f"method must be one of {methods}; got {method!r}.")
    data, m, axes = _move_to_end(x, axis)
    dtype = _float_dtype(data.dtype)
    data = data.astype(dtype)
    # Sort valid values first (ascending), masked ones last.
    invalid = (~m).astype(jnp.int8)
    _, srt = jax.lax.sort((invalid, fill(data, m, 0)), dimension=data.ndim - 1, num_keys=2)
    n = jnp.sum(m, axis=-1, keepdims=True)
    q = jnp.asarray(q, dtype=dtype)
    qs = q.reshape(q.shape + (1,) * data.ndim)
    pos = qs * jnp.maximum(n - 1, 0).astype(dtype)
    lo = jnp.floor(pos)
    hi = jnp.ceil(pos)
    if method == "lower":
        hi = lo
    elif method == "higher":
        lo = hi
    elif method == "nearest":
        lo = hi = jnp.round(pos)
    top = jnp.maximum(n - 1, 0)
    lo_i = jnp.clip(lo.astype(jnp.int32), 0, top)
    hi_i = jnp.clip(hi.astype(jnp.int32), 0, top)
    srt_b = jnp.broadcast_to(srt, q.shape + srt.shape)
    if srt.shape[-1] == 0:
        v_lo = v_hi = jnp.zeros(q.shape + srt.shape[:-1] + (1,), dtype)
    else:
        v_lo = jnp.take_along_axis(srt_b, lo_i, -1)
        v_hi = jnp.take_along_axis(srt_b, hi_i, -1)
    frac = 0.5 if method == "midpoint" else pos - lo
    out = (v_lo + (v_hi - v_lo) * frac)[..., 0]
    valid = jnp.broadcast_to(n[..., 0] > 0, out.shape)
    out = jnp.where(valid, out, 0)
    if keepdims:
        shape = list(q.shape) + [1 if a in axes else s for a, s in enumerate(np.shape(x.data))]
        out, valid = out.reshape(shape), valid.reshape(shape)
    return Pair(out, valid)


def median(x: Pair, axis=None, keepdims=False) -> Pair:
    return quantile(x, 0.5, axis=axis, keepdims=keepdims)


def percentile(x: Pair, q, axis=None, keepdims=False, method="linear") -> Pair:
    return quantile(x, jnp.asarray(q) / 100, axis=axis, keepdims=keepdims, method=method)


def _vector_norm(x: Pair, ord, axis, keepdims) -> Pair:
    a = Pair(jnp.abs(fill(x.data, x.mask, 0)), x.mask)
    if ord is None or ord == 2:
        s = sum(Pair(a.data * a.data, a.mask), axis, keepdims)
        return Pair(safe_sqrt(s.data), s.mask)
    if ord == np.inf:
        return max(a, axis, keepdims)
    if ord == -np.inf:
        return min(a, axis, keepdims)
    if ord == 0:
        s = sum(Pair((a.data != 0).astype(a.data.dtype), a.mask), axis, keepdims)
        return s
    if ord == 1:
        return sum(a, axis, keepdims)
    s = sum(Pair(a.data**ord, a.mask), axis, keepdims)
    pos = s.data > 0
    return Pair(jnp.where(pos, jnp.where(pos, s.data, 1) ** (1.0 / ord), 0), s.mask)


def _matrix_norm(x: Pair, ord, axes, keepdims) -> Pair:
    r, c = axes
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
    if ord in (2, -2, "nuc"):
        # Spectral norms: masked entries count as zero (documented choice).
        mat = jnp.moveaxis(a.data if x.mask is None else fill(x.data, x.mask, 0), (r, c), (-2, -1))
        sv = jnp.linalg.svd(mat, compute_uv=False)
        val = {2: lambda s: s[..., 0], -2: lambda s: s[..., -1], "nuc": lambda s: s.sum(-1)}[ord](sv)
        valid = jnp.any(_mask(x), axis=(r, c), keepdims=keepdims)
        if keepdims:
            val = jnp.expand_dims(val, (r, c))
        return Pair(jnp.where(valid, val, 0), valid)
    raise ValueError(f"ord {ord!r} is not a supported matrix norm.")


def norm(x: Pair, ord=None, axis=None, keepdims=False) -> Pair:
    """Vector or matrix norm over valid elements (same ``ord``/``axis`` rules as jnp)."""
    ndim = np.ndim(x.data)
    if axis is None:
        if ord is None:
            return _vector_norm(x, 2, None, keepdims)
        axis = tuple(range(ndim))
        if ndim not in (1, 2):
            raise ValueError(f"norm with ord={ord!r} and axis=None needs a 1-D or 2-D input; got {ndim}-D.")
    axes = normalize_axis(axis, ndim)
    if isinstance(axis, (int, np.integer)) or len(axes) == 1:
        if isinstance(ord, str):
            raise ValueError(f"ord {ord!r} is a matrix norm; it needs two axes.")
        return _vector_norm(x, ord, axes, keepdims)
    if len(axes) == 2:
        given = tuple(a % ndim for a in axis)
        return _matrix_norm(x, ord, given, keepdims)
    raise ValueError(f"norm takes one or two axes; got axis={axis}.")


RULES = {
    name: globals()[name]
    for name in (
        "count sum prod mean var std max min ptp argmax argmin any all logsumexp cumsum "
        "cumprod average quantile median percentile norm"
    ).split()
}
