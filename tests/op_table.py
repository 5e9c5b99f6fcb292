"""One table of masked ops and their numpy.ma references, shared by every op test.

Each entry knows how to draw valid inputs (dtypes and a domain where the op is
finite), the keyword arguments to draw (axis, keepdims, ddof, ...), and a
reference computed with ``numpy.ma`` (or numpy on the data with numpy.ma's mask
rule where numpy.ma has no such function). Mask conventions differ: the
reference masks are numpy.ma's (True = invalid) and the helpers invert them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np
from conformance_table import quiet  # re-exported for the numpy.ma tests
from hypothesis import strategies as st
from strategies import ALL, FLOATS, NUMERIC, axes

import masked_jax.nn as mnn
import masked_jax.numpy as mnp

INT_BOOL = (np.int32, np.bool_)


@dataclasses.dataclass(frozen=True)
class Op:
    name: str
    fn: Callable
    reference: Callable  # numpy.ma arrays (and kwargs) -> numpy.ma array
    family: str
    dtypes: tuple = NUMERIC
    domain: tuple = (-3.0, 3.0)
    domain2: tuple | None = None  # second operand's domain (binary)
    kwargs: Callable | None = None  # (draw, ndim) -> dict
    min_valid: int = 1  # an output is valid iff its slice has >= min_valid(kwargs) valid elements

    def __repr__(self):
        return self.name


# numpy.ma's shift functions do not broadcast their masks: use numpy with numpy.ma's mask rule.
_MA_BROKEN = {"left_shift", "right_shift"}


def _ma_or_np(name):
    ma_fn = getattr(np.ma, name, None)
    if callable(ma_fn) and name not in _MA_BROKEN:
        return ma_fn
    np_fn = getattr(np, name)

    def ref(*arrays, **kwargs):
        masks = [np.ma.getmaskarray(a) for a in arrays]
        data = np_fn(*(np.ma.getdata(a) for a in arrays), **kwargs)
        mask = np.logical_or.reduce(np.broadcast_arrays(*masks)) if len(masks) > 1 else masks[0]
        return np.ma.masked_array(data, mask=np.broadcast_to(mask, np.shape(data)))

    return ref


# -- elementwise ------------------------------------------------------------------------------
POS = (0.1, 3.0)
UNIT = (-0.9, 0.9)
UNARY_SPECS = {
    "abs": {},
    "negative": {},
    "positive": {},
    "sign": {},
    "square": {},
    "exp": dict(dtypes=FLOATS),
    "exp2": dict(dtypes=FLOATS),
    "expm1": dict(dtypes=FLOATS),
    "log": dict(dtypes=FLOATS, domain=POS),
    "log1p": dict(dtypes=FLOATS, domain=POS),
    "log2": dict(dtypes=FLOATS, domain=POS),
    "log10": dict(dtypes=FLOATS, domain=POS),
    "sqrt": dict(dtypes=FLOATS, domain=POS),
    "cbrt": dict(dtypes=FLOATS),
    "reciprocal": dict(dtypes=FLOATS, domain=(0.5, 3.0)),
    "sin": dict(dtypes=FLOATS),
    "cos": dict(dtypes=FLOATS),
    "tan": dict(dtypes=FLOATS, domain=(-1.2, 1.2)),
    "arcsin": dict(dtypes=FLOATS, domain=UNIT),
    "arccos": dict(dtypes=FLOATS, domain=UNIT),
    "arctan": dict(dtypes=FLOATS),
    "sinh": dict(dtypes=FLOATS),
    "cosh": dict(dtypes=FLOATS),
    "tanh": dict(dtypes=FLOATS),
    "arcsinh": dict(dtypes=FLOATS),
    "arccosh": dict(dtypes=FLOATS, domain=(1.1, 3.0)),
    "arctanh": dict(dtypes=FLOATS, domain=UNIT),
    "floor": dict(dtypes=FLOATS),
    "ceil": dict(dtypes=FLOATS),
    "round": dict(dtypes=FLOATS),
    "trunc": dict(dtypes=FLOATS),
    "deg2rad": dict(dtypes=FLOATS),
    "rad2deg": dict(dtypes=FLOATS),
    "isnan": dict(dtypes=FLOATS),
    "isinf": dict(dtypes=FLOATS),
    "isfinite": dict(dtypes=FLOATS),
    "nan_to_num": dict(dtypes=FLOATS),
    "logical_not": dict(dtypes=ALL),
    "bitwise_not": dict(dtypes=INT_BOOL),
    "invert": dict(dtypes=INT_BOOL),
}


def _nn_ref(fn):
    def ref(a):
        return np.ma.masked_array(fn(np.ma.getdata(a).astype(np.float64)), mask=np.ma.getmaskarray(a))

    return ref


NN_UNARY = {
    "relu": lambda x: np.maximum(x, 0),
    "sigmoid": lambda x: 1 / (1 + np.exp(-x)),
    "silu": lambda x: x / (1 + np.exp(-x)),
    "softplus": lambda x: np.logaddexp(x, 0),
    "log_sigmoid": lambda x: -np.logaddexp(-x, 0),
    "gelu": lambda x: 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3))),
}

# -- binary -----------------------------------------------------------------------------------
NONZERO = (0.5, 3.0)
BINARY_SPECS = {
    "add": dict(dtypes=ALL[:-1]),
    "subtract": {},
    "multiply": dict(dtypes=ALL),
    "divide": dict(domain2=NONZERO),
    "true_divide": dict(domain2=NONZERO),
    "floor_divide": dict(domain2=NONZERO),
    "mod": dict(domain2=NONZERO),
    "remainder": dict(domain2=NONZERO),
    "power": dict(dtypes=FLOATS, domain=(0.5, 2.0)),
    "float_power": dict(dtypes=FLOATS, domain=(0.5, 2.0)),
    "maximum": dict(dtypes=ALL),
    "minimum": dict(dtypes=ALL),
    "fmax": {},
    "fmin": {},
    "arctan2": dict(dtypes=FLOATS),
    "hypot": dict(dtypes=FLOATS),
    "logaddexp": dict(dtypes=FLOATS),
    "copysign": dict(dtypes=FLOATS),
    "equal": dict(dtypes=ALL),
    "not_equal": dict(dtypes=ALL),
    "less": {},
    "less_equal": {},
    "greater": {},
    "greater_equal": {},
    "logical_and": dict(dtypes=ALL),
    "logical_or": dict(dtypes=ALL),
    "logical_xor": dict(dtypes=ALL),
    "bitwise_and": dict(dtypes=INT_BOOL),
    "bitwise_or": dict(dtypes=INT_BOOL),
    "bitwise_xor": dict(dtypes=INT_BOOL),
    "left_shift": dict(dtypes=(np.int32,), domain=(0, 3), domain2=(0, 3)),
    "right_shift": dict(dtypes=(np.int32,), domain=(0, 3), domain2=(0, 3)),
}


# -- reductions -------------------------------------------------------------------------------
def axis_kwargs(allow_tuple=True, keepdims=True, ddof=False, max_tuple=None):
    def draw_kwargs(draw, ndim):
        kw = {"axis": draw(axes(ndim, allow_tuple=allow_tuple, max_tuple=max_tuple))}
        if keepdims:
            kw["keepdims"] = draw(st.booleans())
        if ddof:
            kw["ddof"] = draw(st.integers(0, 1))
        return kw

    return draw_kwargs


def _np_reduce(fn, pre=None):
    """A reference for reductions numpy.ma lacks: ``fn`` over the valid elements, via NaN."""

    def ref(a, axis=None, keepdims=False, **kw):
        data = np.ma.filled(np.ma.asarray(a).astype(np.float64), np.nan)
        if pre is not None:
            data = pre(data)
        out = fn(data, axis=axis, keepdims=keepdims, **kw)
        return np.ma.masked_invalid(out)

    return ref


def _logsumexp(d, axis=None, keepdims=False):
    top = np.nanmax(d, axis=axis, keepdims=True)
    top = np.where(np.isfinite(top), top, 0)
    s = np.nansum(np.exp(d - top), axis=axis, keepdims=True)
    out = np.log(s) + top
    cnt = np.sum(~np.isnan(d), axis=axis, keepdims=True)
    out = np.where(cnt > 0, out, np.nan)
    return out if keepdims else np.squeeze(out, axis=axis if axis is not None else None)


def _norm2(d, axis=None, keepdims=False):
    out = np.sqrt(np.nansum(d * d, axis=axis, keepdims=keepdims))
    cnt = np.sum(~np.isnan(d), axis=axis, keepdims=keepdims)
    return np.where(cnt > 0, out, np.nan)


def _median_ref(a, axis=None, keepdims=False):
    if a.size == 0:
        return np.ma.masked_all(np.shape(np.sum(np.zeros(a.shape), axis=axis, keepdims=keepdims)))
    return np.ma.median(a, axis=axis, keepdims=keepdims)


def _quantile_kwargs(draw, ndim):
    return {
        "q": draw(st.sampled_from([0.0, 0.25, 0.5, 0.9, 1.0])),
        "axis": draw(axes(ndim, allow_tuple=False)),
        "keepdims": draw(st.booleans()),
    }


def _quantile_ref(a, q, axis=None, keepdims=False):
    data = np.ma.filled(np.ma.asarray(a).astype(np.float64), np.nan)
    if data.size == 0:
        shape = np.shape(np.sum(data, axis=axis, keepdims=keepdims))
        return np.ma.masked_all(shape)
    out = np.nanquantile(data, q, axis=axis, keepdims=keepdims)
    return np.ma.masked_invalid(out)


def _percentile_kwargs(draw, ndim):
    kw = _quantile_kwargs(draw, ndim)
    kw["q"] = kw["q"] * 100
    return kw


def _percentile_ref(a, q, axis=None, keepdims=False):
    return _quantile_ref(a, q / 100, axis=axis, keepdims=keepdims)


def _average_kwargs(draw, ndim):
    return {"axis": draw(axes(ndim, allow_tuple=False)), "weights_seed": draw(st.integers(0, 99))}


REDUCTIONS = {
    "sum": dict(ref=np.ma.sum, dtypes=ALL),
    "prod": dict(ref=np.ma.prod, domain=(0.5, 1.5)),
    "mean": dict(ref=np.ma.mean, dtypes=ALL),
    "var": dict(ref=np.ma.var, kwargs=axis_kwargs(ddof=True)),
    "std": dict(ref=np.ma.std, kwargs=axis_kwargs(ddof=True)),
    "max": dict(ref=np.ma.max, dtypes=ALL),
    "min": dict(ref=np.ma.min, dtypes=ALL),
    "ptp": dict(ref=np.ma.ptp),
    "argmax": dict(ref=np.ma.argmax, kwargs=axis_kwargs(allow_tuple=False), dtypes=ALL),
    "argmin": dict(ref=np.ma.argmin, kwargs=axis_kwargs(allow_tuple=False), dtypes=ALL),
    "any": dict(ref=np.ma.any, dtypes=ALL),
    "all": dict(ref=np.ma.all, dtypes=ALL),
    "median": dict(ref=_median_ref, kwargs=axis_kwargs(allow_tuple=False)),
    "logsumexp": dict(ref=_np_reduce(_logsumexp), dtypes=FLOATS),
    # jnp.linalg.norm takes an int or a pair of axes (a pair: the Frobenius norm, _norm2's)
    "norm": dict(ref=_np_reduce(_norm2), dtypes=FLOATS, kwargs=axis_kwargs(max_tuple=2)),
    "quantile": dict(ref=_quantile_ref, kwargs=_quantile_kwargs, dtypes=FLOATS),
    "percentile": dict(ref=_percentile_ref, kwargs=_percentile_kwargs, dtypes=FLOATS),
}


def _build():
    table = []
    for name, spec in UNARY_SPECS.items():
        table.append(Op(name, getattr(mnp, name), quiet(_ma_or_np(name)), "elementwise", **spec))
    for name, ref in NN_UNARY.items():
        table.append(Op(name, getattr(mnn, name), quiet(_nn_ref(ref)), "elementwise", dtypes=FLOATS))
    for name, spec in BINARY_SPECS.items():
        table.append(Op(name, getattr(mnp, name), quiet(_ma_or_np(name)), "binary", **spec))
    for name, spec in REDUCTIONS.items():
        spec = dict(spec)
        ref = spec.pop("ref")
        spec.setdefault("kwargs", axis_kwargs())
        table.append(Op(name, getattr(mnp, name), quiet(ref), "reductions", **spec))
    return table


OPS = _build()
BY_FAMILY = {f: [op for op in OPS if op.family == f] for f in ("elementwise", "binary", "reductions")}
