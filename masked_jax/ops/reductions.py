"""Reductions over valid elements only.

An output element is valid iff its slice has at least one valid element (for
``var``/``std``: more valid elements than ``ddof``, as ``numpy.ma``). Fully
masked slices are masked and hold a documented fill value, never NaN: the
identity of the reduction (0 for ``sum``, 1 for ``prod``, -inf/+inf or the
integer extremes for ``max``/``min``, -inf for ``logsumexp``) and 0 for
``mean``, ``var``, ``std`` and ``ptp``.

Each op is registered once (bottom of the module) with its rule, its public signature
(``jax.numpy``'s), the lax primitives it answers to in ``maskify`` and, where it has one, its
segment kernel: the same reduction over groups of stored entries of a BCOO-backed array
(``fn(segments, values, **params)``, see ``masked_jax.layouts._segments``). Order statistics,
weighted averages and norms are in :mod:`masked_jax.ops.statistics`.
"""

from __future__ import annotations

import builtins
import functools

import jax
import jax.extend.core.primitives as P
import jax.numpy as jnp
import numpy as np

from masked_jax.ops._base import (
    Pair,
    accumulation_dtype,
    any_valid,
    candidate_axes,
    compact_or_ones,
    count_valid,
    fill,
    highest,
    lowest,
    materialize,
    normalize_axis,
    result_dtype,
    uniform_along,
)
from masked_jax.ops._factors import NO_FACTS, Facts
from masked_jax.ops._registry import OpSpec, register, rule_signature, signature_of


def _mask(x: Pair):
    return materialize(x.mask, jnp.shape(x.data))


def _compact(x: Pair, facts: Facts = NO_FACTS):
    """The mask at the data's rank, compact (``None``: a (1, ..., 1) True)."""
    return compact_or_ones(x.mask, jnp.shape(x.data), facts)


def sum_count(data, mask, axes):
    """``(sum(data), count(mask))`` over ``axes``; ``data`` is 0 where ``mask`` is False. A mask at
    the data's shape takes the one-pass :func:`sum_and_count`; a compact one sums the data and counts
    the compact mask (at the compact shape)."""
    if jnp.shape(mask) == jnp.shape(data):
        return sum_and_count(data, mask, axes)
    return _accumulated_sum(data, axes), count_valid(mask, jnp.shape(data), axes)


def _accumulated_sum(data, axes):
    """``sum(data)`` over ``axes``, float16/bfloat16 accumulated in float32 as ``jnp.sum`` does."""
    acc = accumulation_dtype(data.dtype)
    return jnp.sum(data.astype(acc), axis=axes).astype(data.dtype)


def _float_dtype(dtype):
    """The dtype ``jnp.mean`` returns for ``dtype`` data: the inexact dtype jnp computes a bool or
    integer input in (float32 up to 32-bit integers, float64 for 64-bit ones)."""
    return result_dtype(jnp.mean, dtype)


def _safe_div(num, den, valid):
    """``num / den`` where ``valid``, 0 elsewhere, with no NaN in value or gradient."""
    return jnp.where(valid, num / jnp.where(valid, den, 1), 0)


def safe_sqrt(x):
    """``sqrt`` with value and derivative 0 at ``x == 0`` (no inf gradient at 0); NaN where ``x`` is
    NaN or negative, as ``jnp.sqrt`` (a variance of valid infinities is NaN, so is its std)."""
    positive = x > 0
    return jnp.where(positive, jnp.sqrt(jnp.where(positive, x, 1)), jnp.where(x == 0, 0, jnp.nan).astype(x.dtype))


def _add_pairs(a, b):
    return a[0] + b[0], a[1] + b[1]


@functools.partial(jax.custom_jvp, nondiff_argnums=(2,))
def sum_and_count(data, mask, axes):
    """``(sum(data), count(mask))`` over ``axes`` in one pass over memory.

    ``data`` must already be 0 where ``mask`` is False. A single variadic
    reduction keeps XLA from materialising the filled data, which two
    separate reductions over the same input do on CPU (the hand-written masked mean of
    ``benchmarks/ops.py``). ``lax.reduce`` with two operands has
    no derivative rule, hence the JVP below (the sum is linear, the count is
    an integer). float16 and bfloat16 data accumulate in float32, as ``jnp.sum`` does; the total
    comes back in ``data``'s dtype.
    """
    acc = accumulation_dtype(data.dtype)
    zero = jnp.zeros((), acc)
    total, n = jax.lax.reduce((data.astype(acc), mask.astype(jnp.int32)), (zero, jnp.int32(0)), _add_pairs, axes)
    return total.astype(data.dtype), n


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


# valid over a zero-size slice, with jnp's value: the identity (see empty_slices, identity_over_empty)
IDENTITY_REDUCTIONS = ("sum", "prod", "any", "all", "count", "logsumexp", "norm")


def identity_over_empty(name, params, ndim) -> bool:
    """Whether the reduction ``name`` with ``params`` (of an array of ``ndim`` dims) has a value over
    a slice with no element: its identity, ``jax.numpy``'s result (a sum 0, a product 1, ``any``
    False, ``all`` True, a count 0, ``logsumexp`` ``-inf``, a norm 0). A reduction with no identity (a mean,
    var or std: 0 / 0; a maximum, a median, an ``inf``-norm) is masked there instead.

    >>> identity_over_empty("sum", {}, 2), identity_over_empty("mean", {}, 2)
    (True, False)
    """
    if name != "norm":
        return name in IDENTITY_REDUCTIONS
    ord, axis = params.get("ord"), params.get("axis")
    vector = (
        (axis is None and (ord is None or ndim == 1))
        or isinstance(axis, (int, np.integer))
        or (isinstance(axis, (tuple, list)) and len(axis) == 1)
    )
    if vector:  # (sum of |x| ** p) ** (1 / p), and ord=0 (a count of nonzeros): 0
        return ord is None or (isinstance(ord, (int, float)) and not isinstance(ord, bool) and 0 <= ord < np.inf)
    return ord == "fro"  # a matrix's Frobenius norm; the others are extrema of sums


def empty_slices(shape, axes) -> bool:
    """Whether the reduced axes of an array of ``shape`` have no element at all (a static,
    zero-size slice): nothing in it is masked, so a reduction with an identity gives
    ``jax.numpy``'s valid result (a sum of nothing is 0, ``all`` of nothing True), where a slice
    whose entries are all *masked* stays masked. Applied by the public functions to the array the
    user passed (a sparse layout's stored block may be empty while the array is not)."""
    return builtins.any(shape[a] == 0 for a in axes)


def _keep(x, axes, keepdims):
    return jnp.expand_dims(x, axes) if keepdims else x


def count(x: Pair, axis=None, keepdims=False):
    """Number of valid elements (a plain array: a count is always defined), in jax's default integer
    dtype, as ``jnp.count_nonzero`` counts (int64 with ``jax_enable_x64``, else int32)."""
    shape = jnp.shape(x.data)
    axes = normalize_axis(axis, len(shape))
    n = count_valid(_compact(x), shape, axes, keepdims=True)  # a plain array: at the output's shape
    n = n.astype(jax.dtypes.canonicalize_dtype(jnp.int64))
    n = jnp.broadcast_to(n, [1 if a in axes else d for a, d in enumerate(shape)])
    return n if keepdims else jnp.squeeze(n, axis=axes)


def _sum_dtype(dtype, requested):
    """The dtype ``jnp.sum`` returns for ``dtype`` data and a ``dtype=`` argument."""
    return jax.eval_shape(lambda d: jnp.sum(d, dtype=requested), jax.ShapeDtypeStruct((), dtype)).dtype


def sum(x: Pair, axis=None, dtype=None, keepdims=False, _facts: Facts = NO_FACTS) -> Pair:
    facts = _facts
    m = _compact(x, facts)
    data = jnp.asarray(x.data)
    axes = normalize_axis(axis, m.ndim)
    if uniform_along(m, axes) and not empty_slices(data.shape, axes):
        # the mask does not vary along the axes: a slice is valid iff its mask is (no count), and
        # a masked slice reaches a masked output only (the fill keeps its derivative finite)
        filled = fill(data, m, 0, finite=True, facts=facts)
        total = _keep(_accumulated_sum(filled.astype(_sum_dtype(data.dtype, dtype)), axes), axes, keepdims)
        valid = any_valid(m, data.shape, axes, keepdims, facts)
        if facts.holds_zero(filled, m):  # a masked slice sums zeros
            facts.record_value(total, valid, 0, True)
        return Pair(total, valid)
    filled = fill(data, m, 0, facts=facts).astype(_sum_dtype(data.dtype, dtype))
    if m.shape != data.shape:  # a compact mask: whether a slice has a valid entry, not how many
        total = _keep(_accumulated_sum(filled, axes), axes, keepdims)
        valid = any_valid(m, data.shape, axes, keepdims, facts)
    else:
        total, n = sum_count(filled, m, axes)
        total, valid = _keep(total, axes, keepdims), _keep(n > 0, axes, keepdims)
    facts.record_value(total, valid, 0, True)  # a masked slice sums filled zeros only
    return Pair(total, valid)


def prod(x: Pair, axis=None, dtype=None, keepdims=False, _facts: Facts = NO_FACTS) -> Pair:
    m = _compact(x, _facts)
    axes = normalize_axis(axis, m.ndim)
    data = jnp.prod(fill(x.data, m, 1, facts=_facts), axis=axes, keepdims=keepdims, dtype=dtype)
    return Pair(data, any_valid(m, jnp.shape(x.data), axes, keepdims, _facts))


def mean(x: Pair, axis=None, dtype=None, keepdims=False) -> Pair:
    m = _compact(x)
    dtype = result_dtype(jnp.mean, jnp.result_type(x.data), dtype=dtype)
    acc = accumulation_dtype(dtype)  # float16/bfloat16: the sum and the quotient in float32, as jnp
    axes = normalize_axis(axis, m.ndim)
    total, n = sum_count(fill(x.data, m, 0).astype(acc), m, axes)
    valid = n > 0
    out = _safe_div(total, n.astype(acc), valid).astype(dtype)
    return Pair(_keep(out, axes, keepdims), _keep(valid, axes, keepdims))


def var(x: Pair, axis=None, dtype=None, ddof=0, keepdims=False, *, correction=None) -> Pair:
    if correction is not None:
        ddof = correction
    m = _compact(x)
    out_dtype = result_dtype(jnp.var, jnp.result_type(x.data), dtype=dtype)
    # jnp.var computes in the input's inexact dtype (float32 for float16/bfloat16), or in ``dtype``
    work = accumulation_dtype(dtype or (x.data.dtype if jnp.issubdtype(x.data.dtype, jnp.inexact) else out_dtype))
    data = fill(x.data, m, 0).astype(work)
    axes = normalize_axis(axis, m.ndim)
    total, n = sum_count(data, m, axes)
    centre = jnp.expand_dims(total / jnp.maximum(n, 1).astype(work), axes)
    dev = jnp.where(m, data - centre, 0)
    sq = jnp.real(dev * jnp.conj(dev)) if jnp.iscomplexobj(dev) else dev * dev
    ss = jnp.sum(sq, axis=axes)
    dof = n - ddof
    valid = dof > 0
    out = _safe_div(ss, dof.astype(ss.dtype), valid).astype(out_dtype)
    return Pair(_keep(out, axes, keepdims), _keep(valid, axes, keepdims))


def std(x: Pair, axis=None, dtype=None, ddof=0, keepdims=False, *, correction=None) -> Pair:
    v = var(x, axis=axis, dtype=dtype, ddof=ddof, keepdims=keepdims, correction=correction)
    return Pair(safe_sqrt(v.data), v.mask)


def max(x: Pair, axis=None, keepdims=False, _facts: Facts = NO_FACTS) -> Pair:
    m = _compact(x, _facts)
    axes = normalize_axis(axis, m.ndim)
    init = lowest(jnp.result_type(x.data))
    data = jnp.max(fill(x.data, m, init, facts=_facts), axis=axes, keepdims=keepdims, initial=init)
    return Pair(data, any_valid(m, jnp.shape(x.data), axes, keepdims, _facts))


def min(x: Pair, axis=None, keepdims=False, _facts: Facts = NO_FACTS) -> Pair:
    m = _compact(x, _facts)
    axes = normalize_axis(axis, m.ndim)
    init = highest(jnp.result_type(x.data))
    data = jnp.min(fill(x.data, m, init, facts=_facts), axis=axes, keepdims=keepdims, initial=init)
    return Pair(data, any_valid(m, jnp.shape(x.data), axes, keepdims, _facts))


def ptp(x: Pair, axis=None, keepdims=False) -> Pair:
    hi, lo = max(x, axis=axis, keepdims=keepdims), min(x, axis=axis, keepdims=keepdims)
    return Pair(jnp.where(hi.mask, hi.data - jnp.where(hi.mask, lo.data, 0), 0), hi.mask)


def _arg_extreme(x: Pair, axis, keepdims, largest: bool) -> Pair:
    keepdims = bool(keepdims)
    data = jnp.asarray(x.data)
    m = _mask(x)
    if axis is None:
        data, m = data.ravel(), m.ravel()
        axis_, out_keep = 0, False
    else:
        if not isinstance(axis, (int, np.integer)):
            raise TypeError(f"axis must be an int or None for argmax/argmin; got {axis!r}.")
        (axis_,) = normalize_axis(axis, data.ndim)
        out_keep = keepdims
    if data.shape[axis_] == 0:  # jnp refuses; the masked result is masked (no element to point to)
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


def argmax(x: Pair, axis=None, keepdims=None) -> Pair:
    return _arg_extreme(x, axis, keepdims, largest=True)


def argmin(x: Pair, axis=None, keepdims=None) -> Pair:
    return _arg_extreme(x, axis, keepdims, largest=False)


def any(x: Pair, axis=None, keepdims=False, _facts: Facts = NO_FACTS) -> Pair:
    m = _compact(x, _facts)
    axes = normalize_axis(axis, m.ndim)
    data = jnp.any(fill(x.data, m, 0, facts=_facts), axis=axes, keepdims=keepdims)
    return Pair(data, any_valid(m, jnp.shape(x.data), axes, keepdims, _facts))


def all(x: Pair, axis=None, keepdims=False, _facts: Facts = NO_FACTS) -> Pair:
    m = _compact(x, _facts)
    axes = normalize_axis(axis, m.ndim)
    data = jnp.all(fill(x.data, m, 1, facts=_facts), axis=axes, keepdims=keepdims)
    return Pair(data, any_valid(m, jnp.shape(x.data), axes, keepdims, _facts))


def shifted_by_max(x: Pair, axis):
    """``(data - max, mask, max)`` over valid elements of ``axis``: the stable shift of the exp family.

    Masked data is 0 before shifting; the max is a constant for autodiff and 0
    where a slice has no (finite) valid maximum.
    """
    m = _compact(x)
    data = fill(x.data, m, 0)
    if not jnp.issubdtype(data.dtype, jnp.inexact):
        data = data.astype(_float_dtype(data.dtype))
    top = jax.lax.stop_gradient(max(Pair(data, m), axis=axis, keepdims=True).data)
    top = jnp.where(jnp.isfinite(top), top, 0)
    return data - top, m, top


def logsumexp(x: Pair, axis=None, keepdims=False) -> Pair:
    z, m, top = shifted_by_max(x, axis)
    axes = normalize_axis(axis, z.ndim)
    total = jnp.sum(jnp.where(m, jnp.exp(z), 0), axis=axes, keepdims=keepdims)
    valid = any_valid(m, jnp.shape(z), axes, keepdims)
    top = top if keepdims else jnp.squeeze(top, axis=axes)
    # as jax.nn.logsumexp: log of the sum plus the shift, NaN in, NaN out (a fully masked slice: -inf)
    out = jnp.log(jnp.where(valid, total, 1)) + top
    return Pair(jnp.where(valid, out, -jnp.inf), valid)


def logmeanexp(x: Pair, axis=None, keepdims=False) -> Pair:
    """``log(mean(exp(x)))`` over the valid elements: ``logsumexp`` minus the log of the *valid*
    count (``jax.nn.logmeanexp`` divides by the static length); a fully masked slice is masked
    (fill -inf, as ``logsumexp``)."""
    lse = logsumexp(x, axis=axis, keepdims=keepdims)
    shape = jnp.shape(x.data)
    n = count_valid(_compact(x), shape, normalize_axis(axis, len(shape)), keepdims)
    valid = lse.mask
    out = lse.data - jnp.log(jnp.where(valid, n, 1).astype(lse.data.dtype))
    return Pair(jnp.where(valid, out, -jnp.inf), valid)


def _logmeanexp_static(body, a):
    return [dict(axis=ax, keepdims=k) for ax in candidate_axes(a) for k in (False, True)]


def cumulative(fn, identity, what):
    """Rule for a running reduction ``fn(data, axis=...)``: masked elements enter as ``identity``
    (a value, or a function of the dtype); the mask is unchanged (as ``numpy.ma``)."""

    def rule(x: Pair, axis=None, dtype=None) -> Pair:
        m = _mask(x)
        init = identity(jnp.result_type(x.data)) if callable(identity) else identity
        data = fill(x.data, m, init)
        if axis is None:
            data, m = data.ravel(), m.ravel()
        out = fn(data, axis=axis) if dtype is None else fn(data, axis=axis, dtype=dtype)
        return Pair(out, m)

    rule.__name__ = getattr(fn, "__name__", "cumulative")
    rule.__doc__ = f"Running {what} where masked elements count as the identity; the mask is unchanged."
    return rule


cumsum = cumulative(jnp.cumsum, 0, "sum")
cumprod = cumulative(jnp.cumprod, 1, "product")


# -- segment kernels: the same reductions over groups of stored entries (BCOO, along axes) -------
def _float(v):
    return v if jnp.issubdtype(v.dtype, jnp.inexact) else v.astype(_float_dtype(v.dtype))


def _seg_var(g, v, ddof=0, dtype=None, correction=None):
    if correction is not None:
        ddof = correction
    v = v.astype(dtype) if dtype else _float(v)
    n = g.count
    centre = g.sum(v) / jnp.maximum(n, 1).astype(v.dtype)
    dev = g.clean(v - g.back(centre))
    dof = n - ddof
    return jnp.where(dof > 0, g.sum(dev * dev) / jnp.where(dof > 0, dof, 1).astype(v.dtype), 0), dof > 0


def _seg_std(g, v, ddof=0, dtype=None, correction=None):
    out, valid = _seg_var(g, v, ddof, dtype, correction)
    return safe_sqrt(out), valid


def _seg_logsumexp(g, v):
    v = _float(v)
    top = jax.lax.stop_gradient(g.max(v))
    top = jnp.where(jnp.isfinite(top), top, 0)
    total = g.sum(jnp.where(g.valid, jnp.exp(g.clean(v - g.back(top))), 0))
    valid = g.count > 0
    return jnp.where(valid, jnp.log(jnp.where(valid, total, 1)) + top, -jnp.inf)


def _seg_logmeanexp(g, v):
    lse = _seg_logsumexp(g, v)
    valid = g.count > 0
    return jnp.where(valid, lse - jnp.log(jnp.maximum(g.count, 1).astype(lse.dtype)), -jnp.inf)


def _seg_mean(g, v, dtype=None):
    w = v.astype(dtype) if dtype else _float(v)
    return g.sum(w) / jnp.maximum(g.count, 1).astype(w.dtype)


# -- registry -----------------------------------------------------------------------------------
def _static_valid(rule):
    """``rule`` for an op whose output is valid iff its slice has a valid entry: a statically valid
    operand (no mask) with no zero-size axis (so no empty slice) gives a statically valid output."""

    @functools.wraps(rule)
    def wrapped(x: Pair, *args, **kwargs) -> Pair:
        out = rule(x, *args, **kwargs)
        return Pair(out.data, None) if x.mask is None and jnp.size(x.data) > 0 else out

    return wrapped


def _fn(name, jax_fn, rule, *, methods=(), primitives=(), segment=None, signature=None, **kw):
    sig = signature or signature_of(jax_fn, drop=("out_sharding",))
    if name in _SLICE_VALID:
        rule = _static_valid(rule)
    return register(
        OpSpec(
            name=name,
            family="reductions",
            rule=rule,
            signature=sig,
            operands=(next(iter(sig.parameters)),),
            methods=methods,
            primitives=primitives,
            segment=segment,
            fn=jax_fn,
            jax_name=kw.pop("jax_name", f"jnp.{name}"),
            **kw,
        )
    )


_SLICE_VALID = {
    "sum",
    "prod",
    "mean",
    "max",
    "min",
    "ptp",
    "argmax",
    "argmin",
    "any",
    "all",
    "logsumexp",
    "logmeanexp",
    "cumsum",
    "cumprod",
}
_fn(
    "count",
    None,
    count,
    returns="array",
    signature=rule_signature(count),
    methods=("count",),
    jax_name="numpy.ma.count",
    summary="Number of valid elements (a plain integer array).",
    example=(
        "x = mj.masked_array(jnp.ones((2, 2)), jnp.array([[True, False], [True, True]]))",
        "{mod}.count(x, axis=1)",
        "Array([1, 2], dtype=int32)",
    ),
    excluded={"jacobians": "integer output: no derivative", "maskify": "no jax function to interpret"},
)
_fn(
    "sum",
    jnp.sum,
    sum,
    methods=("sum",),
    primitives=(P.reduce_sum_p,),
    segment=lambda g, v, dtype=None: g.sum(v.astype(_sum_dtype(v.dtype, dtype))),
)
_fn(
    "prod",
    jnp.prod,
    prod,
    methods=("prod",),
    primitives=(P.reduce_prod_p,),
    segment=lambda g, v, dtype=None: g.prod(v.astype(_sum_dtype(v.dtype, dtype))),
)
_fn("mean", jnp.mean, mean, methods=("mean",), segment=_seg_mean)
_fn("var", jnp.var, var, methods=("var",), segment=_seg_var)
_fn("std", jnp.std, std, methods=("std",), segment=_seg_std)
_fn("max", jnp.max, max, methods=("max",), primitives=(P.reduce_max_p,), segment=lambda g, v: g.max(v))
_fn("min", jnp.min, min, methods=("min",), primitives=(P.reduce_min_p,), segment=lambda g, v: g.min(v))
_fn("ptp", jnp.ptp, ptp, methods=("ptp",), segment=lambda g, v: g.max(v) - g.min(v))
_INDEX = {"jacobians": "integer output: no derivative"}
_BOOL = {"jacobians": "bool output: no derivative"}
_fn("argmax", jnp.argmax, argmax, methods=("argmax",), primitives=(P.argmax_p,), excluded=_INDEX)
_fn("argmin", jnp.argmin, argmin, methods=("argmin",), primitives=(P.argmin_p,), excluded=_INDEX)
_fn(
    "any",
    jnp.any,
    any,
    methods=("any",),
    primitives=(P.reduce_or_p,),
    segment=lambda g, v: g.max(v.astype(bool)),
    excluded=_BOOL,
)
_fn(
    "all",
    jnp.all,
    all,
    methods=("all",),
    primitives=(P.reduce_and_p,),
    segment=lambda g, v: g.min(v.astype(bool)),
    excluded=_BOOL,
)
_fn(
    "logsumexp",
    jax.nn.logsumexp,
    logsumexp,
    modules=("numpy", "nn"),
    segment=_seg_logsumexp,
    jax_name="jax.nn.logsumexp",
)
_fn(
    "logmeanexp",
    jax.nn.logmeanexp,
    logmeanexp,
    modules=("numpy", "nn"),
    jax_name="jax.nn.logmeanexp",
    static=_logmeanexp_static,
    segment=_seg_logmeanexp,
    example=(
        "x = mj.masked_array(jnp.array([0.0, 0.0, 9.0]), jnp.array([True, True, False]))",
        "{mod}.logmeanexp(x)",
        "MaskedArray(0.0, dtype=float32)",
    ),
)
_fn(
    "cumsum",
    jnp.cumsum,
    cumsum,
    methods=("cumsum",),
    primitives=(P.cumsum_p,),
    example=(
        "x = mj.masked_array(jnp.array([1.0, 2.0, 3.0]), jnp.array([True, False, True]))",
        "{mod}.cumsum(x)",
        "MaskedArray([1.0 -- 4.0], dtype=float32)",
    ),
)
_fn(
    "cumprod",
    jnp.cumprod,
    cumprod,
    methods=("cumprod",),
    primitives=(P.cumprod_p,),
    example=(
        "x = mj.masked_array(jnp.array([1.0, 2.0, 3.0]), jnp.array([True, False, True]))",
        "{mod}.cumprod(x)",
        "MaskedArray([1.0 -- 3.0], dtype=float32)",
    ),
)
