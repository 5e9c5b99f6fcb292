"""Unary elementwise ops: ``f(x)`` keeps the mask and applies ``f`` to sanitised data."""

from __future__ import annotations

import inspect
from typing import Any, cast

import jax
import jax.extend.core.primitives as P
import jax.numpy as jnp
import numpy as np
from jax import lax

from masked_jax.ops import _factors
from masked_jax.ops._base import Pair, fill, ranked
from masked_jax.ops._factors import NO_FACTS, Facts
from masked_jax.ops._registry import MASKIFY_ONLY, OpSpec, register, signature_of

_X = inspect.Signature([inspect.Parameter("x", inspect.Parameter.POSITIONAL_ONLY)])


def unary(fn, safe=1):
    """Rule for an elementwise ``fn``: masked-out inputs become ``safe`` first.

    ``safe`` is a point where ``fn`` and its derivative are finite, so that
    neither the value nor a gradient at a masked-out element can be NaN/inf.
    ``safe=None`` marks a linear ``fn`` that needs no sanitising.
    """

    def rule(x: Pair, *args, _facts: Facts = NO_FACTS, **kwargs) -> Any:  # a Pair (a tuple: modf, frexp)
        facts = _facts
        if x.mask is None or not facts.active:
            data = x.data if safe is None else fill(x.data, x.mask, safe)
            out = fn(data, *args, **kwargs)
            if isinstance(out, tuple):  # modf, frexp: each part valid where x is
                return tuple(Pair(o, x.mask) for o in out)
            return Pair(out, _width_mask(x, out))
        # under maskify: data already holding a value at which fn and its derivative are finite
        # (recorded where the mask is False) need no fill; the output's value there is recorded
        f = _with_args(fn, args, kwargs)
        dtype = jnp.result_type(x.data)
        k = facts.known(x.data, x.mask)
        if safe is None or (k is not None and _factors.evaluate(f, (k.value,), (dtype,))[1]):
            data, value = x.data, None if k is None else k.value
        else:
            data, value = fill(x.data, x.mask, safe, facts=facts), safe
        out = fn(data, *args, **kwargs)
        if isinstance(out, tuple):
            return tuple(Pair(o, x.mask) for o in out)
        if np.ndim(out) != np.ndim(x.data):
            return Pair(out, _width_mask(x, out))
        if value is not None:
            at_safe = safe is not None and value == safe
            facts.record_value(out, x.mask, _factors.evaluate(f, (value,), (dtype,), not at_safe)[0], False)
        return Pair(out, x.mask)

    rule.__name__ = getattr(fn, "__name__", "unary")
    rule.__dict__["fn"] = fn  # the function the rule applies, for maskify's recognisers
    return rule


def _width_mask(x: Pair, out):
    """``x``'s mask for ``out``, the one elementwise op that changes the rank being a bitcast to
    another width: to a narrower dtype each element becomes a trailing axis of parts, each part
    valid where the element is; to a wider one a trailing axis of parts becomes one element, valid
    where every part is."""
    extra = np.ndim(out) - np.ndim(x.data)
    if x.mask is None or extra == 0:
        return x.mask
    m = ranked(x.mask, np.ndim(x.data))
    if extra == 1:
        return m[..., None]
    return m[..., 0] if m.shape[-1] == 1 else jnp.all(m, axis=-1)


def _with_args(fn, args, kwargs):
    """``fn`` of its first operand alone, keyed for the value cache when it takes nothing else."""
    if not args and not kwargs:
        return fn
    return lambda d: fn(d, *args, **kwargs)


def unary_spec(
    name,
    fn,
    safe=1,
    *,
    modules=("numpy",),
    methods=(),
    primitives=(),
    jax_name=None,
    signature=None,
    example=None,
    excluded=None,
    returns="masked",
) -> OpSpec:
    """The spec of an elementwise op ``fn`` with sanitising value ``safe``.

    The public signature is ``fn``'s own where it has one (``round(a, decimals=0, out=None)``),
    else ``(x, /)``.
    """
    if signature is None:
        try:
            signature = signature_of(fn, drop=("out_sharding",))
        except (TypeError, ValueError):
            signature = _X
        first = next(iter(signature.parameters.values()), None)
        if first is None or first.kind is inspect.Parameter.VAR_POSITIONAL:  # a jnp ufunc: (x, /)
            signature = _X
    first = next(iter(signature.parameters))
    return OpSpec(
        name=name,
        family="elementwise",
        rule=unary(fn, safe),
        signature=signature,
        operands=(first,),
        modules=modules,
        methods=methods,
        primitives=tuple(primitives),
        safe=safe,
        fn=fn,
        jax_name=jax_name or f"jnp.{name}",
        example=example,
        excluded=excluded or {},
        returns=returns,
    )


def astype(x: Pair, dtype, copy=False, device=None) -> Pair:
    """Change the data dtype (and, with ``device``, move data and mask); the mask is unchanged."""
    data = jnp.asarray(x.data).astype(dtype)
    if device is None:
        return Pair(data, x.mask)
    return Pair(jax.device_put(data, device), None if x.mask is None else jax.device_put(x.mask, device))


_INT = (
    "x = mj.masked_array(jnp.array([1, 2]), jnp.array([True, False]))",
    "{mod}.{name}(x).mask",
    "Array([ True, False], dtype=bool)",
)

# name, jax function, safe value, primitives it answers to in maskify, MaskedArray methods.
# Domain-limited functions get a safe point inside their domain with a finite derivative.
UNARY = [
    ("abs", jnp.abs, 1, (P.abs_p,), ("__abs__",)),
    ("absolute", jnp.absolute, 1, (), ()),
    ("negative", jnp.negative, None, (P.neg_p,), ("__neg__",)),
    ("positive", jnp.positive, None, (), ("__pos__",)),
    ("sign", jnp.sign, 1, (P.sign_p,), ()),
    ("exp", jnp.exp, 0, (P.exp_p,), ()),
    ("exp2", jnp.exp2, 0, (P.exp2_p,), ()),
    ("expm1", jnp.expm1, 0, (P.expm1_p,), ()),
    ("log", jnp.log, 1, (P.log_p,), ()),
    ("log1p", jnp.log1p, 0, (P.log1p_p,), ()),
    ("log2", jnp.log2, 1, tuple(p for p in (getattr(lax, "log2_p", None),) if p is not None), ()),
    ("log10", jnp.log10, 1, (), ()),
    ("sqrt", jnp.sqrt, 1, (P.sqrt_p,), ()),
    ("cbrt", jnp.cbrt, 1, (P.cbrt_p,), ()),
    ("square", jnp.square, 0, (P.square_p,), ()),
    ("reciprocal", jnp.reciprocal, 1, (), ()),
    ("sin", jnp.sin, 0, (P.sin_p,), ()),
    ("cos", jnp.cos, 0, (P.cos_p,), ()),
    ("tan", jnp.tan, 0, (P.tan_p,), ()),
    ("arcsin", jnp.arcsin, 0, (P.asin_p,), ()),
    ("arccos", jnp.arccos, 0, (P.acos_p,), ()),
    ("arctan", jnp.arctan, 0, (P.atan_p,), ()),
    ("sinh", jnp.sinh, 0, (P.sinh_p,), ()),
    ("cosh", jnp.cosh, 0, (P.cosh_p,), ()),
    ("tanh", jnp.tanh, 0, (P.tanh_p,), ()),
    ("arcsinh", jnp.arcsinh, 0, (P.asinh_p,), ()),
    ("arccosh", jnp.arccosh, 2, (P.acosh_p,), ()),
    ("arctanh", jnp.arctanh, 0, (P.atanh_p,), ()),
    ("floor", jnp.floor, 0, (P.floor_p,), ()),
    ("ceil", jnp.ceil, 0, (P.ceil_p,), ()),
    ("round", jnp.round, 0, (P.round_p,), ("round",)),
    ("trunc", jnp.trunc, 0, (), ()),
    ("nan_to_num", jnp.nan_to_num, 0, (), ()),
    ("isnan", jnp.isnan, 0, (), ()),
    ("isinf", jnp.isinf, 0, (), ()),
    ("isfinite", jnp.isfinite, 0, (P.is_finite_p,), ()),
    ("signbit", jnp.signbit, 0, (), ()),
    ("logical_not", jnp.logical_not, 0, (P.not_p,), ()),
    ("bitwise_not", jnp.bitwise_not, 0, (), ()),
    ("invert", jnp.invert, 0, (), ("__invert__",)),
    ("deg2rad", jnp.deg2rad, None, (), ()),
    ("rad2deg", jnp.rad2deg, None, (), ()),
    ("conj", jnp.conj, None, (P.conj_p,), ("conj",)),
    ("real", jnp.real, None, (P.real_p,), ()),
    ("imag", jnp.imag, None, (P.imag_p,), ()),
    ("fabs", jnp.fabs, 1, (), ()),
    ("rint", jnp.rint, 0, (), ()),
    ("sinc", jnp.sinc, 1, (), ()),
    ("i0", jnp.i0, 0, (), ()),
    ("spacing", jnp.spacing, 1, (), ()),
    ("angle", jnp.angle, 1, (), ()),
    ("isneginf", jnp.isneginf, 0, (), ()),
    ("isposinf", jnp.isposinf, 0, (), ()),
    ("iscomplex", jnp.iscomplex, 0, (), ()),
    ("isreal", jnp.isreal, 0, (), ()),
    ("bitwise_count", jnp.bitwise_count, 0, (), ()),
    ("modf", jnp.modf, 0, (), ()),
    ("frexp", jnp.frexp, 1, (), ()),
]

# Two results, each valid where the operand is: ``(fractional, integral)``, ``(mantissa, exponent)``.
PAIRS = {
    "modf": (
        "x = mj.masked_array(jnp.array([1.5, -2.25]), jnp.array([True, False]))",
        "{mod}.modf(x)",
        "(MaskedArray([0.5 --], dtype=float32), MaskedArray([1.0 --], dtype=float32))",
    ),
    "frexp": (
        "x = mj.masked_array(jnp.array([3.0, 8.0]), jnp.array([True, False]))",
        "{mod}.frexp(x)",
        "(MaskedArray([0.75 --], dtype=float32), MaskedArray([2 --], dtype=int32))",
    ),
}

# jax.nn activations: public in masked_jax.nn.
ACTIVATIONS = [
    ("relu", jax.nn.relu, 1, ()),
    ("gelu", jax.nn.gelu, 0, ()),
    ("silu", jax.nn.silu, 0, ()),
    ("sigmoid", jax.nn.sigmoid, 0, (P.logistic_p,)),
    ("softplus", jax.nn.softplus, 0, ()),
    ("log_sigmoid", jax.nn.log_sigmoid, 0, ()),
]

# Primitives with no masked_jax.numpy twin, reached through maskify only: a point inside
# their domain, or None for linear / value-preserving ones.
LAX_ONLY = [
    ("rsqrt", lax.rsqrt, 1, (P.rsqrt_p,)),
    ("erf", lax.erf, 0, (P.erf_p,)),
    ("erfc", lax.erfc, 0, (P.erfc_p,)),
    ("erf_inv", lax.erf_inv, 0, (P.erf_inv_p,)),
    ("lgamma", lax.lgamma, 1, (P.lgamma_p,)),
    ("digamma", lax.digamma, 1, (P.digamma_p,)),
    ("bessel_i0e", lax.bessel_i0e, 0, (P.bessel_i0e_p,)),
    ("bessel_i1e", lax.bessel_i1e, 0, (P.bessel_i1e_p,)),
    ("integer_pow", lambda x, y=2: lax.integer_pow(x, y), 1, (P.integer_pow_p,)),
    (
        "convert_element_type",
        lambda x, new_dtype=None: lax.convert_element_type(x, cast(Any, new_dtype)),
        None,
        (P.convert_element_type_p,),
    ),
    (
        "reduce_precision",
        lambda x, exponent_bits=8, mantissa_bits=7: lax.reduce_precision(x, exponent_bits, mantissa_bits),
        None,
        (P.reduce_precision_p,),
    ),
    ("stop_gradient", lax.stop_gradient, None, (P.stop_gradient_p,)),
    ("copy", jnp.array, None, (P.copy_p,)),
    ("population_count", lax.population_count, 0, (P.population_count_p,)),
    (
        "bitcast_convert_type",
        lambda x, new_dtype=None: lax.bitcast_convert_type(x, cast(Any, new_dtype)),
        None,
        (P.bitcast_convert_type_p,),
    ),
    ("clz", lax.clz, 0, (P.clz_p,)),
]

# Ops whose output (or input) is not a float have no Jacobian to check.
NO_JACOBIAN = {
    **dict.fromkeys(
        ("isnan", "isinf", "isfinite", "signbit", "logical_not", "isneginf", "isposinf", "iscomplex", "isreal"),
        "bool output: no derivative",
    ),
    **dict.fromkeys(
        ("bitwise_not", "invert", "population_count", "clz", "bitwise_count"), "integer input: no derivative"
    ),
    "spacing": "the distance to the next float: a step function, its finite difference is not a derivative",
    "frexp": "an integer exponent and a mantissa that jumps where the exponent does",
    "stop_gradient": "its derivative is zero by definition, not the finite difference",
    "copy": "the identity; checked as a value only",
    "bitcast_convert_type": "reinterprets bits: an integer result has no derivative",
}

_LAX_PARAMS = ("integer_pow", "convert_element_type", "reduce_precision", "bitcast_convert_type")

_CONSTANT = "of a real array is a constant array: it does not depend on the input, so maskify has no mask to give it"
_NOT_INTERPRETED = {name: {"maskify": f"jnp.{name} {_CONSTANT}"} for name in ("imag", "iscomplex", "isreal")}

for _name, _fn, _safe, _prims, _methods in UNARY:
    register(
        unary_spec(
            _name,
            _fn,
            _safe,
            primitives=_prims,
            methods=_methods,
            example=_INT if _name in ("bitwise_not", "invert", "bitwise_count") else PAIRS.get(_name),
            returns="pair" if _name in PAIRS else "masked",
            excluded={
                **({"jacobians": NO_JACOBIAN[_name]} if _name in NO_JACOBIAN else {}),
                **_NOT_INTERPRETED.get(_name, {}),
            },
        )
    )
for _name, _fn, _safe, _prims in ACTIVATIONS:
    register(unary_spec(_name, _fn, _safe, modules=("nn",), primitives=_prims, jax_name=f"jax.nn.{_name}"))
for _name, _fn, _safe, _prims in LAX_ONLY:
    register(
        unary_spec(
            _name,
            _fn,
            _safe,
            modules=(),
            primitives=_prims,
            jax_name=f"lax.{_name}",
            signature=inspect.signature(_fn) if _name in _LAX_PARAMS else _X,
            excluded={**MASKIFY_ONLY, **({"jacobians": NO_JACOBIAN[_name]} if _name in NO_JACOBIAN else {})},
        )
    )

register(
    OpSpec(
        name="astype",
        family="elementwise",
        rule=astype,
        signature=signature_of(jnp.astype),
        operands=("x",),
        methods=("astype",),
        fn=jnp.astype,
        jax_name="jnp.astype",
        example=(
            "x = mj.masked_array(jnp.array([1.5, 2.5]), jnp.array([True, False]))",
            "{mod}.astype(x, jnp.int32).dtype",
            "dtype('int32')",
        ),
    )
)
