"""Masked rules keyed by JAX primitive, for :func:`masked_jax.maskify`.

Each entry adapts a primitive to the op rules of :mod:`masked_jax.ops`: the *data* is computed by
binding the primitive itself (so values match ``jax.numpy`` exactly), while the *semantics* (which
inputs are sanitised and with what, how masks combine) come from the same helpers and tables the
``masked_jax.numpy`` functions and ``MaskedArray`` operators use (``unary``, ``nary``, ``where``,
``clip``, ``contraction``, ``passthrough``, the reductions). One op, one semantics, whichever
front end calls it.

A rule takes ``(invals: list[Pair], **params)`` and returns a ``Pair`` (or a list for primitives
with several results). Rules run only when some operand is masked; otherwise the interpreter binds
the primitive directly.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from masked_jax.ops import binary, elementwise, linalg, reductions, shape
from masked_jax.ops._base import Pair, and_masks, fill, highest, lowest, materialize

RULES: dict = {}  # primitive name -> rule(invals, **params)


def _bound(prim, params):
    return lambda *datas: prim.bind(*datas, **params)


def _register_unary(prim_name, safe):
    def rule(prim, invals, **params):
        return elementwise.unary(_bound(prim, params), safe)(invals[0])
    RULES[prim_name] = rule


def _register_nary(prim_name, safe):
    def rule(prim, invals, **params):
        return binary.nary(_bound(prim, params), safe)(*invals)
    RULES[prim_name] = rule


# -- elementwise: primitive -> the masked_jax.numpy op whose sanitising value it shares ------------
UNARY = {
    "exp": "exp", "exp2": "exp2", "log": "log", "log2": "log2", "log1p": "log1p", "expm1": "expm1", "sin": "sin", "cos": "cos",
    "tan": "tan", "asin": "arcsin", "acos": "arccos", "atan": "arctan", "sinh": "sinh", "cosh": "cosh",
    "tanh": "tanh", "asinh": "arcsinh", "acosh": "arccosh", "atanh": "arctanh", "sqrt": "sqrt", "cbrt": "cbrt",
    "abs": "abs", "sign": "sign", "floor": "floor", "ceil": "ceil", "round": "round", "neg": "negative",
    "not": "logical_not", "is_finite": "isfinite", "logistic": "sigmoid", "real": "real", "imag": "imag",
    "conj": "conj", "square": "square",
}
EXTRA_UNARY_SAFE = {  # primitives with no masked_jax.numpy twin: a point inside their domain
    "rsqrt": 1, "erf": 0, "erfc": 0, "erf_inv": 0, "lgamma": 1, "digamma": 1, "integer_pow": 1,
    "convert_element_type": None, "reduce_precision": None, "stop_gradient": None, "copy": None,
    "copy_p": None, "population_count": 0, "clz": 0, "imag": None,
}
BINARY = {
    "add": "add", "sub": "subtract", "mul": "multiply", "div": "divide", "rem": "remainder", "pow": "power",
    "max": "maximum", "min": "minimum", "atan2": "arctan2", "eq": "equal", "ne": "not_equal", "lt": "less",
    "le": "less_equal", "gt": "greater", "ge": "greater_equal", "and": "logical_and", "or": "logical_or",
    "xor": "logical_xor", "shift_left": "left_shift", "shift_right_logical": "right_shift",
    "shift_right_arithmetic": "right_shift", "nextafter": "copysign", "add_any": "add",
}

for _prim, _name in UNARY.items():
    _register_unary(_prim, elementwise.UNARY[_name][1])
for _prim, _safe in EXTRA_UNARY_SAFE.items():
    _register_unary(_prim, _safe)
for _prim, _name in BINARY.items():
    _register_nary(_prim, binary.BINARY[_name][1])


def _select_n(prim, invals, **params):
    """``select_n(pred, *cases)``: data and mask selected together (``where``'s rule)."""
    pred, *cases = invals
    if len(cases) == 2:  # select_n(p, false_case, true_case) is where(p, true_case, false_case)
        return binary.where(pred, cases[1], cases[0])
    data = prim.bind(pred.data, *(c.data for c in cases))
    masks = [materialize(c.mask, jnp.shape(c.data)) for c in cases]
    return Pair(data, and_masks(pred.mask, prim.bind(pred.data, *masks)))


def _clamp(prim, invals, **params):
    lo, x, hi = invals
    return binary.clip(x, lo, hi)


RULES.update(select_n=_select_n, clamp=_clamp)


# -- reductions ------------------------------------------------------------------------------------
def _reduction(name):
    def rule(prim, invals, axes, **params):
        out = reductions.RULES[name](invals[0], axis=tuple(axes))
        dtype = params.get("out_dtype") or jnp.result_type(invals[0].data)
        return Pair(out.data.astype(dtype) if name not in ("any", "all") else out.data, out.mask)
    return rule


def _arg_reduction(name):
    def rule(prim, invals, axes, index_dtype):
        out = reductions.RULES[name](invals[0], axis=int(axes[0]))
        return Pair(out.data.astype(index_dtype), out.mask)
    return rule


def _cumulative(identity):
    def rule(prim, invals, axis, reverse):
        (x,) = invals
        init = identity(jnp.result_type(x.data)) if callable(identity) else identity
        bound = lambda d, axis=None, dtype=None: prim.bind(d, axis=axis, reverse=reverse)  # noqa: E731
        return reductions._cumulative(bound, init, prim.name)(x, axis=axis)
    return rule


RULES.update({
    "reduce_sum": _reduction("sum"), "reduce_prod": _reduction("prod"), "reduce_max": _reduction("max"),
    "reduce_min": _reduction("min"), "reduce_and": _reduction("all"), "reduce_or": _reduction("any"),
    "argmax": _arg_reduction("argmax"), "argmin": _arg_reduction("argmin"),
    "cumsum": _cumulative(0), "cumprod": _cumulative(1), "cummax": _cumulative(lowest),
    "cummin": _cumulative(highest), "cumlogsumexp": _cumulative(-np.inf),
})


# -- contraction -----------------------------------------------------------------------------------
def _dot_general(prim, invals, **params):
    return linalg.contraction(_bound(prim, params))(*invals)


RULES["dot_general"] = _dot_general


# -- shape and indexing: the mask moves with the data ---------------------------------------------
def _passthrough(prim, invals, **params):
    """A shape op of one array operand (reshape, transpose, broadcast_in_dim, slice, rev, ...);
    further operands (dynamic sizes, start indices) must be unmasked and are passed to both."""
    x, *rest = invals
    _require_valid(prim, rest)
    extra = [r.data for r in rest]
    return shape.passthrough(lambda d: prim.bind(d, *extra, **params))(x)


def _require_valid(prim, operands, what="index"):
    if any(o.mask is not None for o in operands):
        raise TypeError(f"maskify: the {what} operands of '{prim.name}' must not be masked (a masked index "
                        "has no defined result).")


def _concatenate(prim, invals, dimension):
    return shape.concatenate(invals, axis=dimension)


def _stack(prim, invals, axis):
    return shape.stack(invals, axis=axis)


def _pad(prim, invals, padding_config):
    x, value = invals
    data = prim.bind(x.data, value.data, padding_config=padding_config)
    if x.mask is None and value.mask is None:
        return Pair(data, None)
    m = materialize(x.mask, jnp.shape(x.data))
    fill_valid = jnp.asarray(True) if value.mask is None else value.mask
    return Pair(data, prim.bind(m, fill_valid, padding_config=padding_config))  # constant padding: valid


def _gather(prim, invals, **params):
    x, idx = invals
    _require_valid(prim, [idx])
    data = prim.bind(x.data, idx.data, **params)
    if x.mask is None and params.get("mode") != lax.GatherScatterMode.FILL_OR_DROP:
        return Pair(data, None)
    m = materialize(x.mask, jnp.shape(x.data))
    return Pair(data, prim.bind(m, idx.data, **{**params, "fill_value": False}))  # out of range: masked


def _dynamic_update_slice(prim, invals):
    x, upd, *idx = invals
    _require_valid(prim, idx)
    data = prim.bind(x.data, upd.data, *(i.data for i in idx))
    if x.mask is None and upd.mask is None:
        return Pair(data, None)
    m = prim.bind(materialize(x.mask, jnp.shape(x.data)), materialize(upd.mask, jnp.shape(upd.data)),
                  *(i.data for i in idx))
    return Pair(data, m)  # as .at[].set: the update's validity is copied


def _scatter(prim, invals, **params):
    """``scatter`` copies the updates' validity (``.at[].set``); scatter-add/mul/min/max AND it with
    the operand's, as ``.at[].add`` does. Masked-out data enters as the op's identity."""
    x, idx, upd = invals
    _require_valid(prim, [idx])
    kind = prim.name
    identity = {"scatter-add": 0, "scatter_add": 0, "scatter-mul": 1, "scatter_mul": 1}.get(kind)
    if kind in ("scatter-min", "scatter_min"):
        identity = highest(jnp.result_type(upd.data))
    if kind in ("scatter-max", "scatter_max"):
        identity = lowest(jnp.result_type(upd.data))
    upd_data = upd.data if identity is None else fill(upd.data, upd.mask, identity)
    data = prim.bind(x.data, idx.data, upd_data, **params)
    if x.mask is None and upd.mask is None:
        return Pair(data, None)
    xm = materialize(x.mask, jnp.shape(x.data))
    um = materialize(upd.mask, jnp.shape(upd.data))
    set_params = {k: v for k, v in params.items() if k != "update_jaxpr"}
    if identity is None:  # plain scatter: validity of the written value
        return Pair(data, lax.scatter_p.bind(xm, idx.data, um, update_jaxpr=None, **_scatter_params(set_params)))
    bad = lax.scatter_add_p.bind(jnp.zeros(xm.shape, jnp.int32), idx.data, (~um).astype(jnp.int32),
                                 update_jaxpr=None, **_scatter_params(set_params))
    return Pair(data, xm & (bad == 0))


def _scatter_params(params):
    return {k: v for k, v in params.items() if k in ("dimension_numbers", "indices_are_sorted", "unique_indices",
                                                     "mode", "update_consts")}


def _sort(prim, invals, dimension, is_stable, num_keys):
    """Masked elements of the first key go last (as ``mnp.sort``); the other operands (argsort's
    iota) follow their keys, masks too."""
    if num_keys != 1:
        raise TypeError("maskify: 'sort' with several keys (lexsort) has no masked rule.")
    key = invals[0]
    m = materialize(key.mask, jnp.shape(key.data))
    masks = [materialize(o.mask, jnp.shape(o.data)) for o in invals]
    outs = lax.sort([~m, *(o.data for o in invals), *masks], dimension=dimension, is_stable=True, num_keys=2)
    n = len(invals)
    return [Pair(d, mk) for d, mk in zip(outs[1:1 + n], outs[1 + n:])]


def _top_k(prim, invals, k, **params):
    (x,) = invals
    m = materialize(x.mask, jnp.shape(x.data))
    vals, idx = prim.bind(fill(x.data, m, lowest(jnp.result_type(x.data))), k=k, **params)
    valid = jnp.take_along_axis(m, idx, axis=-1)
    return [Pair(vals, valid), Pair(idx, valid)]


def _split(prim, invals, sizes, axis):
    (x,) = invals
    datas = prim.bind(x.data, sizes=sizes, axis=axis)
    if x.mask is None:
        return [Pair(d, None) for d in datas]
    masks = prim.bind(materialize(x.mask, jnp.shape(x.data)), sizes=sizes, axis=axis)
    return [Pair(d, mk) for d, mk in zip(datas, masks)]


RULES.update({
    name: _passthrough for name in ("reshape", "transpose", "broadcast_in_dim", "squeeze", "expand_dims", "rev",
                                    "slice", "dynamic_slice", "tile")
})
RULES.update(concatenate=_concatenate, stack=_stack, pad=_pad, gather=_gather, dynamic_update_slice=_dynamic_update_slice,
             sort=_sort, top_k=_top_k, split=_split)
for _name in ("scatter", "scatter-add", "scatter_add", "scatter-mul", "scatter_mul", "scatter-min",
              "scatter_min", "scatter-max", "scatter_max"):
    RULES[_name] = _scatter

# Not supported, with the reason (listed in the README and in the error message).
UNSUPPORTED = {
    "fft": "an FFT mixes every element; masked-out elements have no defined contribution",
    "conv_general_dilated": "not written yet; express the convolution with dot_general, or fill first",
    "reduce_window_sum": "pooling windows are not written yet", "reduce_window_max": "pooling windows are not written yet",
    "reduce_window": "pooling windows are not written yet",
    "cholesky": "matrix decompositions of partly missing matrices are undefined; fill the matrix first",
    "eigh": "matrix decompositions of partly missing matrices are undefined; fill the matrix first",
    "lu": "matrix decompositions of partly missing matrices are undefined; fill the matrix first",
    "qr": "matrix decompositions of partly missing matrices are undefined; fill the matrix first",
    "svd": "matrix decompositions of partly missing matrices are undefined; fill the matrix first",
    "triangular_solve": "solves with partly missing matrices are undefined; fill the matrix first",
    "custom_linear_solve": "solves with partly missing matrices are undefined; fill the matrix first",
    "psum": "collectives: use the sharding support of masked arrays instead",
    "all_gather": "collectives: use the sharding support of masked arrays instead",
}

del _prim, _name, _safe
