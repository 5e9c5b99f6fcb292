"""One row per registered op: how the conformance harness draws its arguments, and the reference.

A row says what is special about an op; everything else comes from its family's defaults:

* ``ref``: the reference on ``numpy.ma`` operands (``numpy.ma``'s mask is True = *invalid*); it
  returns a ``numpy.ma`` array, a ``(data, valid)`` pair, or a plain array (always valid);
* ``cases``: keyword arguments, one case each (axis, keepdims, ddof, ...);
* ``dtypes``: dtypes the reference check runs over (the other checks use the first);
* ``domain``: where the op is finite and smooth, per operand;
* ``make``: the operands, when not the family's default;
* ``call``: how the operands and a case are passed, when not ``fn(*operands, **case)``;
* ``jax``: the plain jax function ``maskify`` must turn into the op, when not ``spec.fn``.

Adding an op to the registry needs one row here (the harness fails for an op without one).
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import scipy.special
from jax import lax

F64, F32, I32, B = np.float64, np.float32, np.int32, np.bool_


@dataclasses.dataclass
class Row:
    ref: Callable[..., Any] | None = None
    cases: tuple = ({},)
    dtypes: tuple = (F64,)
    domain: tuple = ((-3.0, 3.0),)
    make: Callable[..., Any] | None = None
    call: Callable[..., Any] | None = None
    jax: Callable[..., Any] | None = None
    smooth: bool = True  # the Jacobian is compared with central differences
    rtol: float = 1e-9


def quiet(fn):
    def wrapped(*args, **kwargs):
        with warnings.catch_warnings(), np.errstate(all="ignore"):
            warnings.simplefilter("ignore")
            return fn(*args, **kwargs)

    return wrapped


def data(a):
    return np.ma.getdata(a)


def valid(a):
    return ~np.ma.getmaskarray(a)


def elementwise(np_fn):
    """Apply ``np_fn`` to the data; the mask is unchanged (or the and of the operands' masks)."""

    def ref(*arrays, **kw):
        out = np_fn(*(data(a) for a in arrays), **kw)
        ok = np.logical_and.reduce(np.broadcast_arrays(*(valid(a) for a in arrays)))
        return out, np.broadcast_to(ok, np.shape(out))

    return quiet(ref)


def elementwise_pair(np_fn):
    """An op with two results (``modf``, ``divmod``): each valid where every operand is."""

    def ref(*arrays, **kw):
        outs = np_fn(*(data(a) for a in arrays), **kw)
        ok = np.logical_and.reduce(np.broadcast_arrays(*(valid(a) for a in arrays)))
        return list(outs), [np.broadcast_to(ok, np.shape(o)) for o in outs]

    return quiet(ref)


def _ldexp_make(rng, dtype, masks):
    """ldexp(x, n): a float mantissa and an integer exponent."""
    from harness import masked

    return [masked(rng, dtype, masks[0], (-3.0, 3.0)), masked(rng, I32, masks[1], (-4, 4))]


def passthrough(np_fn):
    """A shape op: the same function of the data and of the mask."""
    return quiet(lambda a, *args, **kw: (np_fn(data(a), *args, **kw), np_fn(valid(a), *args, **kw)))


def over_valid(np_fn):
    """A reduction numpy.ma lacks: ``np_fn`` with NaN for masked elements (nan-aware functions)."""

    def ref(a, axis=None, keepdims=False, **kw):
        d = np.where(valid(a), data(a).astype(np.float64), np.nan)
        out = np_fn(d, axis=axis, keepdims=keepdims, **kw)
        cnt = np.sum(valid(a), axis=axis, keepdims=keepdims)
        return out, np.broadcast_to(cnt > 0, np.shape(out))

    return quiet(ref)


def contraction(np_fn):
    """``sum_k a b`` over the ``k`` where both are valid: the contraction of the zero-filled
    operands, valid where the contraction of the masks (as numbers) is positive."""

    def ref(*arrays, **kw):
        out = np_fn(*(np.where(valid(a), data(a), 0) for a in arrays), **kw)
        cnt = np_fn(*(valid(a).astype(np.float64) for a in arrays), **kw)
        return out, cnt > 0

    return quiet(ref)


def _softmax(d, axis):
    top = np.nanmax(d, axis=axis, keepdims=True)
    e = np.exp(d - np.where(np.isfinite(top), top, 0))
    return e / np.nansum(e, axis=axis, keepdims=True)


def normalization(fn):
    def ref(a, axis=-1, **kw):
        d = np.where(valid(a), data(a).astype(np.float64), np.nan)
        return fn(d, axis, **kw), valid(a)

    return quiet(ref)


def _logsumexp(d, axis=None, keepdims=False):
    top = np.nanmax(d, axis=axis, keepdims=True)
    out = np.log(np.nansum(np.exp(d - np.where(np.isfinite(top), top, 0)), axis=axis, keepdims=True)) + top
    return out if keepdims else np.squeeze(out, axis=axis)


def _logmeanexp(d, axis=None, keepdims=False):
    n = np.sum(~np.isnan(d), axis=axis, keepdims=keepdims)
    return _logsumexp(d, axis=axis, keepdims=keepdims) - np.log(np.maximum(n, 1))


def _norm(d, ord=None, axis=None, keepdims=False):
    a = np.abs(np.nan_to_num(d))
    if ord in (None, 2):
        return np.sqrt(np.sum(a * a, axis=axis, keepdims=keepdims))
    if ord == 1:
        return np.sum(a, axis=axis, keepdims=keepdims)
    if ord == np.inf:
        return np.nanmax(np.where(np.isnan(d), np.nan, a), axis=axis, keepdims=keepdims)
    return np.sum(a**ord, axis=axis, keepdims=keepdims) ** (1 / ord)


def _arg(np_fn):
    def ref(a, axis=None, keepdims=False):
        out = np_fn(a, axis=axis, keepdims=keepdims)
        cnt = np.sum(valid(a), axis=axis, keepdims=keepdims)
        return np.asarray(out), cnt > 0

    return quiet(ref)


@quiet
def _quantile(a, q, axis=None, keepdims=False, method="linear"):
    d = np.where(valid(a), data(a).astype(np.float64), np.nan)
    out = np.nanquantile(d, q, axis=axis, keepdims=keepdims, method=method)
    cnt = np.sum(valid(a), axis=axis, keepdims=keepdims)
    return out, np.broadcast_to(cnt > 0, np.shape(out))


def _ma_reduce(name):
    return quiet(lambda a, **kw: getattr(np.ma, name)(a, **kw))


AXES = ({}, {"axis": 1}, {"axis": (0, 1), "keepdims": True})
AXIS1 = ({}, {"axis": 1}, {"axis": 0, "keepdims": True})
POS, UNIT, NONZERO = ((0.2, 3.0),), ((-0.9, 0.9),), ((0.5, 3.0),)
IDX = jnp.array([[0, 2, 1], [1, 1, 0], [2, 0, 0], [0, 1, 2]])


def _where_make(rng, dtype, masks):
    from harness import masked

    cond = masked(rng, B, masks[1], None)
    return [cond, masked(rng, dtype, masks[0], (-3.0, 3.0)), masked(rng, dtype, masks[1], (-3.0, 3.0))]


def _polygamma_make(rng, dtype, masks):
    """polygamma(m, x): the order m a whole number (0..3), x positive."""
    from harness import masked

    import masked_jax as mj

    m = masked(rng, dtype, masks[0], (0.0, 3.0))
    return [mj.masked_array(jnp.round(m.data), m.mask), masked(rng, dtype, masks[1], (0.5, 3.0))]


def _linalg_make(shape_b):
    def make(rng, dtype, masks):
        from harness import masked

        b_mask = np.asarray(masks[1]).T.reshape(-1)[: int(np.prod(shape_b))].reshape(shape_b)
        return [masked(rng, dtype, masks[0], (-2.0, 2.0)), masked(rng, dtype, b_mask, (-2.0, 2.0))]

    return make


def _average_make(rng, dtype, masks):
    from harness import masked

    return [masked(rng, dtype, masks[0], (-3.0, 3.0)), masked(rng, dtype, masks[1], (0.5, 2.0))]


UNARY = {
    "abs": Row(elementwise(np.abs), dtypes=(F64, I32), smooth=False),
    "absolute": Row(elementwise(np.abs), dtypes=(F64, I32), smooth=False),
    "negative": Row(elementwise(np.negative), dtypes=(F64, I32)),
    "positive": Row(elementwise(np.positive), dtypes=(F64, I32)),
    "sign": Row(elementwise(np.sign), dtypes=(F64, I32)),
    "exp": Row(elementwise(np.exp)),
    "exp2": Row(elementwise(np.exp2)),
    "expm1": Row(elementwise(np.expm1)),
    "log": Row(elementwise(np.log), domain=POS),
    "log1p": Row(elementwise(np.log1p), domain=POS),
    "log2": Row(elementwise(np.log2), domain=POS),
    "log10": Row(elementwise(np.log10), domain=POS),
    "sqrt": Row(elementwise(np.sqrt), domain=POS),
    "cbrt": Row(elementwise(np.cbrt), domain=POS),
    "square": Row(elementwise(np.square), dtypes=(F64, I32)),
    "reciprocal": Row(elementwise(np.reciprocal), domain=NONZERO),
    "sin": Row(elementwise(np.sin)),
    "cos": Row(elementwise(np.cos)),
    "tan": Row(elementwise(np.tan), domain=((-1.2, 1.2),)),
    "arcsin": Row(elementwise(np.arcsin), domain=UNIT),
    "arccos": Row(elementwise(np.arccos), domain=UNIT),
    "arctan": Row(elementwise(np.arctan)),
    "sinh": Row(elementwise(np.sinh)),
    "cosh": Row(elementwise(np.cosh)),
    "tanh": Row(elementwise(np.tanh)),
    "arcsinh": Row(elementwise(np.arcsinh)),
    "arccosh": Row(elementwise(np.arccosh), domain=((1.1, 3.0),)),
    "arctanh": Row(elementwise(np.arctanh), domain=UNIT),
    "floor": Row(elementwise(np.floor)),
    "ceil": Row(elementwise(np.ceil)),
    "round": Row(elementwise(np.round), cases=({}, {"decimals": 1})),
    "trunc": Row(elementwise(np.trunc)),
    "nan_to_num": Row(elementwise(np.nan_to_num)),
    "isnan": Row(elementwise(np.isnan)),
    "isinf": Row(elementwise(np.isinf)),
    "isfinite": Row(elementwise(np.isfinite)),
    "signbit": Row(elementwise(np.signbit)),
    "logical_not": Row(elementwise(np.logical_not), dtypes=(F64, I32, B)),
    "bitwise_not": Row(elementwise(np.bitwise_not), dtypes=(I32, B)),
    "invert": Row(elementwise(np.invert), dtypes=(I32, B)),
    "deg2rad": Row(elementwise(np.deg2rad)),
    "rad2deg": Row(elementwise(np.rad2deg)),
    "conj": Row(elementwise(np.conj)),
    "real": Row(elementwise(np.real)),
    "imag": Row(elementwise(np.imag)),
    "fabs": Row(elementwise(np.fabs), smooth=False),
    "rint": Row(elementwise(np.rint)),
    "sinc": Row(elementwise(np.sinc)),
    "i0": Row(elementwise(np.i0), rtol=1e-7),
    "spacing": Row(elementwise(np.spacing)),
    "angle": Row(elementwise(np.angle), cases=({}, {"deg": True})),
    **{n: Row(elementwise(getattr(np, n))) for n in ("isneginf", "isposinf", "iscomplex", "isreal")},
    "bitwise_count": Row(elementwise(np.bitwise_count), dtypes=(I32,), domain=((-100, 100),)),
    "modf": Row(elementwise_pair(np.modf)),
    "frexp": Row(elementwise_pair(np.frexp)),
    "relu": Row(elementwise(lambda x: np.maximum(x, 0)), smooth=False),
    "gelu": Row(elementwise(lambda x: 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3)))), rtol=1e-6),
    "silu": Row(elementwise(lambda x: x / (1 + np.exp(-x)))),
    "sigmoid": Row(elementwise(lambda x: 1 / (1 + np.exp(-x)))),
    "softplus": Row(elementwise(lambda x: np.logaddexp(x, 0))),
    "log_sigmoid": Row(elementwise(lambda x: -np.logaddexp(-x, 0))),
    "rsqrt": Row(elementwise(lambda x: 1 / np.sqrt(x)), domain=POS),
    "erf": Row(elementwise(lambda x: np.vectorize(__import__("math").erf)(x))),
    "erfc": Row(elementwise(lambda x: np.vectorize(__import__("math").erfc)(x))),
    "erf_inv": Row(elementwise(lambda x: np.asarray(jax.scipy.special.erfinv(x))), domain=UNIT, rtol=1e-6),
    "lgamma": Row(elementwise(lambda x: np.vectorize(__import__("math").lgamma)(x)), domain=POS),
    "digamma": Row(elementwise(lambda x: np.asarray(jax.scipy.special.digamma(x))), domain=POS),
    "bessel_i0e": Row(elementwise(lambda x: np.asarray(jax.scipy.special.i0e(x)))),
    "bessel_i1e": Row(elementwise(lambda x: np.asarray(jax.scipy.special.i1e(x)))),
    "integer_pow": Row(elementwise(lambda x, y=2: x**y), cases=({"y": 3},), jax=lambda x, y=2: lax.integer_pow(x, y)),
    "convert_element_type": Row(
        elementwise(lambda x, new_dtype=None: x.astype(np.float32)),
        cases=({"new_dtype": jnp.float32},),
        rtol=1e-6,
        smooth=False,
    ),
    "reduce_precision": Row(elementwise(lambda x, **kw: x), cases=({"exponent_bits": 11, "mantissa_bits": 52},)),
    "stop_gradient": Row(elementwise(lambda x: x)),
    "copy": Row(elementwise(lambda x: x), jax=lambda x: lax.copy_p.bind(x) if hasattr(lax, "copy_p") else x + 0),
    "population_count": Row(
        elementwise(lambda x: np.vectorize(lambda v: bin(int(v) & 0xFFFFFFFF).count("1"))(x)),
        dtypes=(I32,),
        domain=((0, 100),),
    ),
    "bitcast_convert_type": Row(
        elementwise(lambda x, new_dtype=None: x.view(np.int64)), cases=({"new_dtype": jnp.int64},), smooth=False
    ),
    "clz": Row(elementwise(lambda x: np.asarray(lax.clz(jnp.asarray(x)))), dtypes=(I32,), domain=((0, 100),)),
    "astype": Row(
        elementwise(lambda x, dtype: x.astype(dtype)),
        cases=({"dtype": jnp.float32},),
        rtol=1e-6,
        smooth=False,
        call=lambda f, ops, dtype, **kw: f(ops[0], dtype, **kw),
    ),
}

_B2 = dict(domain=((-3.0, 3.0), (-3.0, 3.0)))
BINARY = {
    "add": Row(elementwise(np.add), dtypes=(F64, I32)),
    "subtract": Row(elementwise(np.subtract), dtypes=(F64, I32)),
    "multiply": Row(elementwise(np.multiply), dtypes=(F64, I32, B)),
    "divide": Row(elementwise(np.divide), domain=((-3.0, 3.0), (0.5, 3.0))),
    "true_divide": Row(elementwise(np.true_divide), domain=((-3.0, 3.0), (0.5, 3.0))),
    "floor_divide": Row(elementwise(np.floor_divide), domain=((-3.0, 3.0), (0.5, 3.0))),
    "mod": Row(elementwise(np.mod), domain=((-3.0, 3.0), (0.5, 3.0))),
    "remainder": Row(elementwise(np.remainder), domain=((-3.0, 3.0), (0.5, 3.0))),
    "power": Row(elementwise(np.power), domain=((0.5, 2.0), (-2.0, 2.0))),
    "float_power": Row(elementwise(np.float_power), domain=((0.5, 2.0), (-2.0, 2.0))),
    "maximum": Row(elementwise(np.maximum), dtypes=(F64, I32), smooth=False),
    "minimum": Row(elementwise(np.minimum), dtypes=(F64, I32), smooth=False),
    "fmax": Row(elementwise(np.fmax), smooth=False),
    "fmin": Row(elementwise(np.fmin), smooth=False),
    "arctan2": Row(elementwise(np.arctan2)),
    "hypot": Row(elementwise(np.hypot)),
    "logaddexp": Row(elementwise(np.logaddexp)),
    "copysign": Row(elementwise(np.copysign), smooth=False),
    "nextafter": Row(elementwise(np.nextafter)),
    "fmod": Row(elementwise(np.fmod), domain=((-3.0, 3.0), (0.5, 3.0)), dtypes=(F64, I32)),
    "divmod": Row(elementwise_pair(np.divmod), domain=((-3.0, 3.0), (0.5, 3.0)), dtypes=(F64, I32), smooth=False),
    "heaviside": Row(elementwise(np.heaviside), smooth=False),
    "logaddexp2": Row(elementwise(np.logaddexp2)),
    "ldexp": Row(elementwise(np.ldexp), make=_ldexp_make),
    **{
        n: Row(elementwise(getattr(np, n)), dtypes=(I32,), domain=((-12, 12), (-12, 12)), jax=getattr(jnp, n))
        for n in ("gcd", "lcm")
    },
    "isclose": Row(elementwise(np.isclose), cases=({}, {"rtol": 0.5, "atol": 0.1})),
    "igamma": Row(elementwise(scipy.special.gammainc), domain=((0.5, 3.0), (0.1, 3.0)), rtol=1e-7),
    "igammac": Row(elementwise(scipy.special.gammaincc), domain=((0.5, 3.0), (0.1, 3.0)), rtol=1e-7),
    "polygamma": Row(elementwise(scipy.special.polygamma), make=_polygamma_make, rtol=1e-7),
    "zeta": Row(elementwise(scipy.special.zeta), domain=((1.5, 4.0), (0.5, 3.0)), rtol=1e-7),
    "complex": Row(elementwise(lambda x, y: x + 1j * y)),
    **{
        n: Row(elementwise(getattr(np, n)), dtypes=(F64, I32))
        for n in ("equal", "not_equal", "less", "less_equal", "greater", "greater_equal")
    },
    **{n: Row(elementwise(getattr(np, n)), dtypes=(F64, B)) for n in ("logical_and", "logical_or", "logical_xor")},
    **{n: Row(elementwise(getattr(np, n)), dtypes=(I32, B)) for n in ("bitwise_and", "bitwise_or", "bitwise_xor")},
    "left_shift": Row(elementwise(np.left_shift), dtypes=(I32,), domain=((0, 3), (0, 3))),
    "right_shift": Row(elementwise(np.right_shift), dtypes=(I32,), domain=((0, 30), (0, 3))),
    "where": Row(
        quiet(lambda c, x, y: (np.where(data(c), data(x), data(y)), valid(c) & np.where(data(c), valid(x), valid(y)))),
        make=_where_make,
        smooth=False,
    ),
    "clip": Row(
        elementwise(lambda x, min=None, max=None: np.clip(x, min, max)),
        make=lambda rng, dtype, masks: [__import__("harness").masked(rng, dtype, masks[0], (-3.0, 3.0))],
        cases=({"min": -1.0, "max": 1.5},),
        smooth=False,
    ),
}


def _degrees_of_freedom(a, rowvar=True, bias=False, ddof=None):
    """Pairwise valid observations minus ddof (where numpy.ma.cov divides by zero or less, the
    masked covariance is masked: no degrees of freedom are left)."""
    v = np.atleast_2d(valid(a)).astype(float)
    v = v if rowvar else v.T
    return np.squeeze(v @ v.T - ((0 if bias else 1) if ddof is None else ddof))


@quiet
def _cov(a, rowvar=True, bias=False, ddof=None):
    c = np.ma.cov(a, rowvar=rowvar, bias=bias, ddof=ddof)
    return data(c), valid(c) & (_degrees_of_freedom(a, rowvar, bias, ddof) > 0)


@quiet
def _corrcoef(a, rowvar=True):
    c = np.ma.corrcoef(a, rowvar=rowvar)
    ok = valid(c) & (_degrees_of_freedom(a, rowvar) > 0)
    d = np.diagonal(np.where(ok, data(c), 0))
    return data(c), ok & np.isfinite(data(c)) & (d[:, None] > 0) & (d[None, :] > 0)


REDUCTIONS = {
    "count": Row(quiet(lambda a, **kw: np.ma.count(a, **kw)), cases=AXES, dtypes=(F64, I32, B)),
    "sum": Row(_ma_reduce("sum"), cases=AXES, dtypes=(F64, I32, B)),
    "prod": Row(_ma_reduce("prod"), cases=AXES, domain=((0.5, 1.5),)),
    "mean": Row(_ma_reduce("mean"), cases=AXES, dtypes=(F64, I32)),
    "var": Row(_ma_reduce("var"), cases=AXES + ({"axis": 1, "ddof": 1},)),
    "std": Row(_ma_reduce("std"), cases=AXES + ({"axis": 0, "ddof": 1},)),
    "max": Row(_ma_reduce("max"), cases=AXES, dtypes=(F64, I32), smooth=False),
    "min": Row(_ma_reduce("min"), cases=AXES, dtypes=(F64, I32), smooth=False),
    "ptp": Row(_ma_reduce("ptp"), cases=AXIS1, smooth=False),
    "argmax": Row(_arg(np.ma.argmax), cases=({}, {"axis": 1}, {"axis": 0, "keepdims": True}), dtypes=(F64, I32)),
    "argmin": Row(_arg(np.ma.argmin), cases=({}, {"axis": 1}), dtypes=(F64, I32)),
    "any": Row(_ma_reduce("any"), cases=AXES, dtypes=(F64, B)),
    "all": Row(_ma_reduce("all"), cases=AXES, dtypes=(F64, B)),
    "logsumexp": Row(over_valid(_logsumexp), cases=AXES),
    "logmeanexp": Row(over_valid(_logmeanexp), cases=AXES),
    "cumsum": Row(_ma_reduce("cumsum"), cases=({}, {"axis": 1}, {"axis": 0}), dtypes=(F64, I32)),
    "cumprod": Row(_ma_reduce("cumprod"), cases=({"axis": 1},), domain=((0.5, 1.5),)),
    "average": Row(
        quiet(lambda a, w, **kw: np.ma.average(a, weights=w, **kw)),
        make=_average_make,
        cases=({}, {"axis": 1}),
        call=lambda f, ops, **kw: f(ops[0], weights=ops[1], **kw),
    ),
    "quantile": Row(
        _quantile,
        cases=({"q": 0.3}, {"q": 0.75, "axis": 1}, {"q": 0.5, "axis": 0, "method": "lower"}),
        call=lambda f, ops, q, **kw: f(ops[0], q, **kw),
        smooth=False,
    ),
    "percentile": Row(
        lambda a, q, **kw: _quantile(a, q / 100, **kw),
        cases=({"q": 30.0}, {"q": 80.0, "axis": 1}),
        call=lambda f, ops, q, **kw: f(ops[0], q, **kw),
        smooth=False,
    ),
    "median": Row(quiet(lambda a, **kw: np.ma.median(a, **kw)), cases=({}, {"axis": 1}), smooth=False),
    "cov": Row(_cov, cases=({}, {"rowvar": False, "ddof": 0}, {"bias": True})),
    "corrcoef": Row(_corrcoef, cases=({}, {"rowvar": False})),
    "norm": Row(
        over_valid(_norm),
        cases=({}, {"axis": 1}, {"axis": 0, "ord": 1}, {"axis": 1, "ord": np.inf}, {"axis": 0, "ord": 3}),
        smooth=False,
    ),
}

NORMALIZATIONS = {
    "softmax": Row(normalization(_softmax), cases=({}, {"axis": 0})),
    "log_softmax": Row(normalization(lambda d, axis: np.log(_softmax(d, axis))), cases=({}, {"axis": 0})),
    "softmin": Row(normalization(lambda d, axis: _softmax(-d, axis)), cases=({}, {"axis": 0})),
    "normalize": Row(
        normalization(lambda d, axis: d / np.maximum(np.sqrt(np.nansum(d * d, axis=axis, keepdims=True)), 1e-12)),
        cases=({}, {"axis": 0}),
    ),
}


def _take_ref(a, indices, axis=None):
    """``take``: an out-of-range index gives a masked element."""
    idx = np.asarray(indices)
    inside = (idx >= 0) & (idx < np.shape(a)[axis])
    d = np.take(data(a), np.clip(idx, 0, np.shape(a)[axis] - 1), axis=axis)
    v = np.take(valid(a), np.clip(idx, 0, np.shape(a)[axis] - 1), axis=axis)
    shape = [1] * np.ndim(a)
    shape[axis] = -1
    return d, v & inside.reshape(shape)


def _join(np_fn):
    """concatenate / stack: the data and the masks joined alike."""
    return quiet(lambda a, b, axis=0: (np_fn([data(a), data(b)], axis), np_fn([valid(a), valid(b)], axis)))


SHAPE = {
    "reshape": Row(passthrough(np.reshape), cases=({"shape": (3, 4)}, {"shape": (12,)})),
    "ravel": Row(passthrough(np.ravel)),
    "transpose": Row(passthrough(np.transpose)),
    "swapaxes": Row(passthrough(np.swapaxes), cases=({"axis1": 0, "axis2": 1},)),
    "moveaxis": Row(passthrough(np.moveaxis), cases=({"source": 0, "destination": 1},)),
    "expand_dims": Row(passthrough(np.expand_dims), cases=({"axis": 1},)),
    "squeeze": Row(passthrough(np.squeeze)),
    "broadcast_to": Row(passthrough(np.broadcast_to), cases=({"shape": (2, 4, 3)},)),
    "flip": Row(passthrough(np.flip), cases=({}, {"axis": 1})),
    "roll": Row(passthrough(np.roll), cases=({"shift": 1, "axis": 0},)),
    "tile": Row(passthrough(np.tile), cases=({"reps": (1, 2)},)),
    "repeat": Row(passthrough(np.repeat), cases=({"repeats": 2, "axis": 0},)),
    "fliplr": Row(passthrough(np.fliplr)),
    "flipud": Row(passthrough(np.flipud)),
    "rot90": Row(passthrough(np.rot90), cases=({}, {"k": 3}, {"k": 2, "axes": (1, 0)})),
    "rollaxis": Row(passthrough(np.rollaxis), cases=({"axis": 1},)),
    "delete": Row(
        passthrough(np.delete), cases=({"obj": 1, "axis": 0}, {"obj": np.array([0, 2]), "axis": 1}, {"obj": 5})
    ),
    "resize": Row(passthrough(np.resize), cases=({"new_shape": (5, 4)}, {"new_shape": (2, 2)})),
    "take_along_axis": Row(
        passthrough(lambda a, indices, axis: np.take_along_axis(a, np.asarray(indices), axis)),
        cases=({"indices": IDX, "axis": 1},),
    ),
    "atleast_1d": Row(passthrough(np.atleast_1d)),
    "atleast_2d": Row(passthrough(np.atleast_2d)),
    "atleast_3d": Row(passthrough(np.atleast_3d)),
    "split": Row(
        quiet(
            lambda a, indices_or_sections: (
                np.split(data(a), indices_or_sections),
                np.split(valid(a), indices_or_sections),
            )
        ),
        cases=({"indices_or_sections": 2},),
    ),
    "concatenate": Row(
        _join(np.concatenate),
        make=_linalg_make((4, 3)),
        cases=({}, {"axis": 1}),
        call=lambda f, ops, **kw: f([ops[0], ops[1]], **kw),
    ),
    "stack": Row(
        _join(np.stack),
        make=_linalg_make((4, 3)),
        cases=({}, {"axis": 2}),
        call=lambda f, ops, **kw: f([ops[0], ops[1]], **kw),
    ),
    "pad": Row(
        quiet(
            lambda a, pad_width: (
                np.pad(np.where(valid(a), data(a), 0), pad_width),
                np.pad(valid(a), pad_width, constant_values=True),
            )
        ),
        cases=({"pad_width": 1},),
    ),
    "take": Row(
        _take_ref, cases=({"indices": jnp.array([2, 0, 3, 7]), "axis": 0}, {"indices": jnp.array([1, 2]), "axis": 1})
    ),
    "sort": Row(
        quiet(
            lambda a, axis=-1, descending=False: -np.ma.sort(-a, axis=axis) if descending else np.ma.sort(a, axis=axis)
        ),
        cases=({}, {"axis": 0}, {"descending": True}),
        smooth=False,
    ),
    "argsort": Row(
        quiet(lambda a, axis=-1, descending=False: np.ma.argsort(-a if descending else a, axis=axis)),
        cases=({}, {"axis": 0}, {"axis": 0, "descending": True}),
    ),
    # the masked partition is the sorted array (a partition in which every position is in order)
    "partition": Row(
        quiet(lambda a, kth, axis=-1: np.ma.sort(a, axis=axis)),
        cases=({"kth": 1}, {"kth": 2, "axis": 0}),
        call=lambda f, ops, kth, **kw: f(ops[0], kth, **kw),
        smooth=False,
    ),
    "argpartition": Row(
        quiet(lambda a, kth, axis=-1: np.ma.argsort(a, axis=axis)),
        cases=({"kth": 1},),
        call=lambda f, ops, kth, **kw: f(ops[0], kth, **kw),
    ),
    "getitem": Row(
        passthrough(lambda a, index: a[index]),
        cases=({"index": (slice(1, 3), np.array([0, 2]))}, {"index": 2}),
        call=lambda f, ops, index: f(ops[0], index),
        jax=lambda a, index: a[index],
    ),
}

LINALG = {
    "matmul": Row(contraction(np.matmul), make=_linalg_make((3, 2))),
    "dot": Row(contraction(np.dot), make=_linalg_make((3, 2))),
    "vdot": Row(contraction(np.vdot), make=_linalg_make((4, 3))),
    "inner": Row(contraction(np.inner), make=_linalg_make((2, 3))),
    "outer": Row(contraction(np.outer), make=_linalg_make((2, 3))),
    "tensordot": Row(contraction(np.tensordot), make=_linalg_make((3, 2)), cases=({"axes": 1},)),
    "einsum": Row(
        contraction(lambda a, b: np.einsum("ij,jk->ik", a, b)),
        make=_linalg_make((3, 2)),
        call=lambda f, ops: f("ij,jk->ik", *ops),
    ),
}

ROWS: dict[str, Row] = {**UNARY, **BINARY, **REDUCTIONS, **NORMALIZATIONS, **SHAPE, **LINALG}


@dataclasses.dataclass
class Oracle:
    """How the jnp-oracle check (``tests/oracle.py``) treats an op, when not by its family's default.

    * ``make(dtype, values, masks, poison)``: the operands;
    * ``partial(name, ops, case)``: the partial-mask reference, ``(want, valid)``; ``None`` uses the
      family's (``oracle.CHECK_PARTIAL``); ``False`` (with ``why``) has none;
    * ``cases``: the cases, when not the row's;
    * ``jax``: the oracle function, when not the op's own jnp function;
    * ``why``: the reason for a difference from jnp or a missing reference (``oracle.DIFFERENCES``
      lists them all, and the docs quote that list).
    """

    make: Callable[..., Any] | None = None
    partial: Any = None
    cases: tuple | None = None
    jax: Callable[..., Any] | None = None
    why: str = ""
    undefined: str = ""  # what jnp computes as NaN or inf that the masked op masks (and why)
    complex_specials: bool = True  # False: complex operands draw ordinary values only (see why)
    skip_dtypes: tuple = ()  # dtypes whose jnp result is undefined behaviour (see why)


_COMPLEX_NAN = (
    "with a complex NaN among the valid entries jnp's own max depends on where the NaN sits (its "
    "complex order is not total with NaN), so a masked slice, with fills where masked entries sit, "
    "may differ: complex operands draw ordinary values"
)
_UNSIGNED_SHIFT = (
    "jax.nn shifts by max(x, initial=-inf): -inf cast to an unsigned dtype is undefined (numpy "
    "warns 'invalid value encountered in cast'), and float8_e4m3fn holds no inf (it casts to NaN, "
    "so jnp's softmax is NaN everywhere), so jnp's results there are not an oracle"
)
_NO_INF = ("uint8", "uint16", "uint32", "uint64", "float8_e4m3fn")  # -inf does not survive the cast
_DOF = "no degrees of freedom left (jnp divides by n - ddof <= 0) is masked"
_INT_MIN = (
    "jnp's loop never ends on the integer minimum (its absolute value is negative), so the special "
    "values leave it out; masked_jax computes magnitudes unsigned (tests/test_regressions.py)"
)


def _without_int_min(dtype, values, masks, poison):
    """gcd/lcm operands: the family's, with the signed minimum (on which jnp.gcd hangs) one above it."""
    import ml_dtypes
    import oracle

    import masked_jax as mj

    ops = [oracle.draw(dtype, values, masks[i], (-12, 12), seed=i, poison=poison) for i in range(2)]
    if oracle.kind(np.dtype(dtype)) != "i":
        return ops
    low = ml_dtypes.iinfo(dtype).min
    return [mj.masked_array(jnp.where(o.data == low, low + 1, o.data).astype(o.dtype), o.mask) for o in ops]


def _oracle_refs():
    import oracle

    slices = oracle.by_slice
    in_range = ({"indices": jnp.array([2, 0, 3, 1]), "axis": 0}, {"indices": jnp.array([1, 2]), "axis": 1})
    return {
        "argmax": Oracle(partial=slices(positions=True)),
        "argmin": Oracle(partial=slices(positions=True)),
        "cumsum": Oracle(partial=slices(keeps_shape=True)),
        "cumprod": Oracle(partial=slices(keeps_shape=True)),
        "sort": Oracle(partial=slices(-1, to_front=True)),
        "argsort": Oracle(partial=slices(-1, to_front=True, positions=True)),
        "partition": Oracle(
            partial=slices(-1, to_front=True),
            jax=lambda a, kth, axis=-1: jnp.sort(a, axis=axis),
            why="any partition around kth is jnp.partition's; the masked one is the sorted "
            "array (a partition, with jnp's element at kth), so the oracle is jnp.sort",
        ),
        "argpartition": Oracle(
            partial=slices(-1, to_front=True, positions=True),
            jax=lambda a, kth, axis=-1: jnp.argsort(a, axis=axis).astype(jnp.int32),
            why="as partition: the indices of the sorted array (jnp.argsort, in jnp.argpartition's int32)",
        ),
        "var": Oracle(undefined=_DOF),
        "std": Oracle(undefined=_DOF),
        "cov": Oracle(
            undefined=_DOF,
            partial=False,
            why="pairwise valid observations (numpy.ma.cov) are not one compacted "
            "slice: the partial-mask reference is numpy.ma's (reference check)",
        ),
        "corrcoef": Oracle(
            partial=False,
            why="as cov: numpy.ma.corrcoef is the partial-mask reference",
            undefined="a correlation with a zero variance (jnp: 0/0) is masked",
        ),
        **{
            n: Oracle(complex_specials=False, why=_COMPLEX_NAN)
            for n in ("max", "min", "ptp", "logsumexp", "logmeanexp")
        },
        **{n: Oracle(skip_dtypes=_NO_INF, why=_UNSIGNED_SHIFT) for n in ("softmax", "log_softmax")},
        # operands as the row makes them: two of different shapes, a bool condition, one operand
        **{
            n: Oracle(make=functools.partial(oracle.row_shaped, n))
            for n in ("matmul", "dot", "vdot", "inner", "outer", "tensordot", "einsum", "where", "clip")
        },
        **{
            n: Oracle(make=functools.partial(oracle.row_shaped, n), partial=oracle.joined)
            for n in ("concatenate", "stack")
        },
        "average": Oracle(
            make=functools.partial(oracle.row_shaped, "average"),
            undefined="a slice whose valid weights sum to zero (jnp: 0 / 0) is masked",
        ),
        # masked_jax's own functions, against the jax.nn / jnp expression they stand for
        "softmin": Oracle(
            jax=lambda x, axis=-1: jax.nn.softmax(-x, axis=axis), skip_dtypes=_NO_INF, why=_UNSIGNED_SHIFT
        ),
        "normalize": Oracle(
            jax=lambda x, ord=2, axis=-1, eps=1e-12: (
                x / jnp.maximum(jnp.linalg.norm(x, ord=ord, axis=axis, keepdims=True), eps)
            )
        ),
        "count": Oracle(
            jax=lambda x, axis=None, keepdims=False: jnp.count_nonzero(
                jnp.ones(jnp.shape(x), bool), axis=axis, keepdims=keepdims
            )
        ),
        # 32-bit as well as 64-bit: a bitcast to another width reshapes, which jnp refuses at (4, 3)
        "bitcast_convert_type": Oracle(cases=({"new_dtype": jnp.int32}, {"new_dtype": jnp.int64})),
        **{n: Oracle(make=_without_int_min, why=_INT_MIN) for n in ("gcd", "lcm")},
        "take": Oracle(
            cases=in_range,
            why="an out-of-range index gives a masked element, where jnp.take "
            "returns a fill value (NaN, or the integer minimum)",
        ),
    }


ORACLE: dict[str, Oracle] = {}


def oracle_rows() -> dict[str, Oracle]:
    """The oracle table (built on first use: its references live in ``tests/oracle.py``)."""
    if not ORACLE:
        ORACLE.update(_oracle_refs())
    return ORACLE
