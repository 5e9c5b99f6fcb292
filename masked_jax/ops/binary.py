"""Binary (and n-ary) elementwise ops: valid where every operand is valid."""

from __future__ import annotations

import inspect
from typing import Any

import jax
import jax.extend.core.primitives as P
import jax.numpy as jnp
import numpy as np
from jax import lax

from masked_jax._validate import is_tracer
from masked_jax.ops import _factors
from masked_jax.ops._base import Pair, and_masks, fill
from masked_jax.ops._factors import NO_FACTS, Facts
from masked_jax.ops._registry import MASKIFY_ONLY, OpSpec, register, signature_of

_POS = inspect.Parameter.POSITIONAL_ONLY
_KW = inspect.Parameter.POSITIONAL_OR_KEYWORD
_X1X2 = inspect.Signature([inspect.Parameter("x1", _POS), inspect.Parameter("x2", _POS)])


def nary(fn, safe=1, preserves=()):
    """Rule for an elementwise ``fn`` of several operands.

    Operands broadcast as in ``jax.numpy``; the result is valid where all
    operands are valid. Every operand is set to ``safe`` wherever the *result*
    is masked, so a masked-out value in one operand cannot turn a valid value
    of another operand's gradient into NaN (``d(a*b)/db = a``). ``safe=None``
    marks functions whose derivatives never read operand values (add,
    comparisons, selections) or read them only through comparisons, which give
    a multiplier of 0, 0.5 or 1 at any operands, NaN and inf included
    (maximum, minimum: a maskify'd ``relu`` then needs no select).

    ``preserves`` names the operands in which ``fn`` keeps a non-finite entry non-finite when the
    others are finite constants (``x * 0.5``, ``x / 8.0``, ``x + 1.0``): under ``maskify`` a
    conditional record of such an operand (see :class:`masked_jax.ops._factors.Known`) carries over
    to the result. ``fn`` is linear in those operands: when the one masked operand is such an
    operand with unknown values where masked and the others are finite constants, no derivative
    reads the masked values, and nothing is filled.
    """

    def rule(*operands: Pair, _facts: Facts = NO_FACTS, **kwargs) -> Any:  # a Pair (a tuple of them for divmod)
        check_broadcast(getattr(fn, "__name__", "operation"), operands)
        facts = _facts
        mask = and_masks(*(o.mask for o in operands), facts=facts)
        if mask is None:
            return _result(fn(*(o.data for o in operands), **kwargs), None)
        if not facts.active:
            datas = [o.data for o in operands] if safe is None else [fill(o.data, mask, safe) for o in operands]
            return _result(fn(*datas, **kwargs), mask)
        # under maskify: what each operand holds where the result is masked (a recorded value, or
        # a 0-d constant's); those at which fn and its derivatives are finite are not filled
        f = fn if not kwargs else (lambda *d: fn(*d, **kwargs))
        dtypes = tuple(jnp.result_type(o.data) for o in operands)
        held = [_held(o, mask, facts) for o in operands]
        conditional = _conditional(operands, held, mask, preserves, facts)
        if conditional is not None:
            held[conditional[0]] = conditional[1]
        elif safe is not None and _linear_in_unknown(operands, held, preserves, f, safe, dtypes):
            # x * 0.125, x / 8.0: the derivative in x is the constant's, whatever x holds where
            # masked, and no other operand has a derivative: nothing to fill, nothing known there
            return Pair(fn(*(o.data for o in operands), **kwargs), mask)
        if safe is None:
            datas, values = [o.data for o in operands], held
        else:
            values = [safe if v is None else v for v in held]
            if all(v is None for v in held) or _factors.evaluate(f, tuple(values), dtypes)[1]:
                datas = [
                    o.data if v is not None else fill(o.data, mask, safe, facts=facts) for o, v in zip(operands, held)
                ]
            else:
                datas, values = [fill(o.data, mask, safe, facts=facts) for o in operands], [safe] * len(operands)
        out = fn(*datas, **kwargs)
        if isinstance(out, tuple):
            return _result(out, mask)
        if all(v is not None for v in values):
            at_safe = safe is not None and all(v == safe for v in values)
            facts.record_value(
                out,
                mask,
                _factors.evaluate(f, tuple(values), dtypes, not at_safe)[0],
                False,
                conditional=conditional is not None,
            )
        return Pair(out, mask)

    rule.__name__ = getattr(fn, "__name__", "nary")
    rule.__dict__["fn"] = fn  # the function the rule applies, for maskify's recognisers
    return rule


def _result(out, mask):
    """``out`` with ``mask``; each part of a tuple result (``divmod``) valid where the operands are."""
    return tuple(Pair(o, mask) for o in out) if isinstance(out, tuple) else Pair(out, mask)


def _held(p: Pair, mask, facts: Facts):
    """What ``p`` holds wherever ``mask`` (the result's) is False, if known: a 0-d constant's value,
    or a value recorded for a masked operand under the same or a larger masked set."""
    if p.mask is None:
        if np.ndim(p.data) == 0 and _finite_constant(p):
            return np.asarray(p.data).item()
        return None
    k = facts.known(p.data, mask)
    return None if k is None else k.value


def _conditional(operands, held, mask, preserves, facts: Facts):
    """``(i, value)`` when operand ``i`` is the one masked operand, in a position ``fn`` preserves,
    holding ``value`` by a conditional record, and every other operand is a finite 0-d constant."""
    masked = [i for i, o in enumerate(operands) if o.mask is not None]
    if (
        len(masked) != 1
        or masked[0] not in preserves
        or held[masked[0]] is not None
        or any(v is None for i, v in enumerate(held) if i != masked[0])
    ):
        return None
    k = facts.known(operands[masked[0]].data, mask, conditional=True)
    return None if k is None else (masked[0], k.value)


def _linear_in_unknown(operands, held, preserves, f, safe, dtypes) -> bool:
    """Whether the one masked operand, holding unknown values where masked, is one ``fn`` is linear
    in (``preserves``) and every other operand a finite 0-d constant at which ``fn`` and its
    derivatives are finite (not a divisor of 0): then no derivative reads the masked values."""
    masked = [i for i, o in enumerate(operands) if o.mask is not None]
    if len(masked) != 1 or masked[0] not in preserves or held[masked[0]] is not None:
        return False
    if any(v is None for i, v in enumerate(held) if i != masked[0]):
        return False
    values = tuple(safe if i == masked[0] else v for i, v in enumerate(held))
    return bool(_factors.evaluate(f, values, dtypes)[1])


def _finite_constant(p: Pair) -> bool:
    """A plain operand whose value is known when the program is traced and finite everywhere (a
    Python scalar, a numpy constant)."""
    if p.mask is not None or is_tracer(p.data):
        return False
    try:
        values = np.asarray(p.data)
    except Exception:  # noqa: BLE001 - an array not on the host: treat as unknown
        return False
    return values.dtype.kind in "biu" or (values.dtype.kind in "fc" and bool(np.isfinite(values).all()))


def check_broadcast(name, operands):
    """Operands must broadcast together: a ``ValueError`` naming the op and the shapes otherwise."""
    shapes = [np.shape(o.data) for o in operands]
    try:
        np.broadcast_shapes(*shapes)
    except ValueError:
        raise ValueError(
            f"{name}: operands could not be broadcast together; got shapes {', '.join(map(str, shapes))}."
        ) from None


def is_constant(p: Pair) -> bool:
    """A fill value: a plain (unmasked) 0-d operand, such as a Python scalar."""
    return p.mask is None and np.ndim(p.data) == 0


def where(condition: Pair, x: Pair, y: Pair, _facts: Facts = NO_FACTS) -> Pair:
    """Select data *and* mask: valid where ``condition`` and the chosen operand are valid.

    A constant never makes a masked position valid: a 0-d plain operand (a Python scalar, a
    0-d array) takes, at each position, the validity of the masked operands it is combined
    with. So ``where(keep, x, 0.0)`` keeps x's masked positions masked, while two arrays
    with complementary masks merged by ``where`` are valid where the chosen one is.
    """
    cond = jnp.asarray(condition.data)
    if cond.dtype != jnp.bool_:
        cond = cond != 0
    data = jnp.where(cond, x.data, y.data)
    if x.mask is None and y.mask is None:
        return Pair(data, condition.mask)
    xm = and_masks(condition.mask, y.mask, facts=_facts) if is_constant(x) else x.mask
    ym = and_masks(condition.mask, x.mask, facts=_facts) if is_constant(y) else y.mask
    xm = True if xm is None else xm
    ym = True if ym is None else ym
    return Pair(data, and_masks(condition.mask, jnp.where(cond, xm, ym), facts=_facts))


def clip(x: Pair, min: Pair | None = None, max: Pair | None = None) -> Pair:
    """``clip(x, min, max)``; bounds that are given must be valid too."""
    present = [p for p in (min, max) if p is not None]
    mask = and_masks(x.mask, *(p.mask for p in present))
    data = fill(x.data, mask, 0)
    lo = None if min is None else fill(min.data, mask, 0)
    hi = None if max is None else fill(max.data, mask, 0)
    return Pair(jnp.clip(data, lo, hi), mask)


def _ops(*dunders):
    """Operator methods: ``__add__`` with its reflected ``__radd__``."""
    out = []
    for d in dunders:
        out += [f"__{d}__", f"__r{d}__"]
    return tuple(out)


def _magnitudes(x1, x2):
    """``|x1|``, ``|x2|`` in the unsigned integer type of their (promoted) width, where ``|INT_MIN|``
    is representable, and the signed type to return to."""
    dtype = jnp.result_type(x1, x2)
    if not jnp.issubdtype(dtype, jnp.integer):
        raise ValueError(f"gcd and lcm take integers; got dtype {dtype}.")
    x1, x2 = jnp.broadcast_arrays(jnp.asarray(x1, dtype), jnp.asarray(x2, dtype))
    if jnp.issubdtype(dtype, jnp.unsignedinteger):
        return x1, x2, dtype
    unsigned = jnp.dtype(f"uint{jnp.iinfo(dtype).bits}")
    mag = [
        jnp.where(x < 0, 0 - lax.bitcast_convert_type(x, unsigned), lax.bitcast_convert_type(x, unsigned))
        for x in (x1, x2)
    ]
    return mag[0], mag[1], dtype


def _signed(x, dtype):
    return x if x.dtype == dtype else lax.bitcast_convert_type(x, dtype)


def _euclid(a, b):
    def body(ab):
        a, b = ab
        a, b = jnp.where(b != 0, b, a), jnp.where(b != 0, lax.rem(a, jnp.where(b != 0, b, 1)), 0)
        return jnp.maximum(a, b), jnp.minimum(a, b)

    return lax.while_loop(lambda ab: jnp.any(ab[1] != 0), body, (jnp.maximum(a, b), jnp.minimum(a, b)))[0]


@jax.jit
def gcd(x1, x2):
    """``jnp.gcd``, computed on magnitudes in the unsigned type of the same width: jnp's loop runs
    forever on ``INT_MIN`` (whose absolute value is negative); here ``gcd(INT_MIN, 0)`` wraps to
    ``INT_MIN``, as in numpy, and every other result equals jnp's."""
    a, b, dtype = _magnitudes(x1, x2)
    return _signed(_euclid(a, b), dtype)


@jax.jit
def lcm(x1, x2):
    """``jnp.lcm`` on magnitudes as :func:`gcd` (the product wraps as jnp's does)."""
    a, b, dtype = _magnitudes(x1, x2)
    d = _euclid(a, b)
    return _signed(jnp.where(d == 0, 0, a * (b // jnp.where(d == 0, 1, d))).astype(a.dtype), dtype)


# name, jax function, safe value, primitives, MaskedArray operators
BINARY = [
    ("add", jnp.add, None, (P.add_p, P.add_jaxvals_p), _ops("add")),
    ("subtract", jnp.subtract, None, (P.sub_p,), _ops("sub")),
    ("multiply", jnp.multiply, 1, (P.mul_p,), _ops("mul")),
    ("divide", jnp.divide, 1, (P.div_p,), ()),
    ("true_divide", jnp.true_divide, 1, (), _ops("truediv")),
    ("floor_divide", jnp.floor_divide, 1, (), _ops("floordiv")),
    ("mod", jnp.mod, 1, (), _ops("mod")),
    ("remainder", jnp.remainder, 1, (P.rem_p,), ()),
    ("power", jnp.power, 1, (P.pow_p,), _ops("pow")),
    ("float_power", jnp.float_power, 1, (), ()),
    ("maximum", jnp.maximum, None, (P.max_p,), ()),
    ("minimum", jnp.minimum, None, (P.min_p,), ()),
    ("fmax", jnp.fmax, 1, (), ()),
    ("fmin", jnp.fmin, 1, (), ()),
    ("arctan2", jnp.arctan2, 1, (P.atan2_p,), ()),
    ("hypot", jnp.hypot, 1, (), ()),
    ("logaddexp", jnp.logaddexp, 1, (), ()),
    ("copysign", jnp.copysign, 1, (), ()),
    ("nextafter", jnp.nextafter, 1, (P.nextafter_p,), ()),
    ("fmod", jnp.fmod, 1, (), ()),
    ("divmod", jnp.divmod, 1, (), _ops("divmod")),
    ("heaviside", jnp.heaviside, 1, (), ()),
    ("logaddexp2", jnp.logaddexp2, 1, (), ()),
    ("ldexp", jnp.ldexp, 1, (), ()),
    ("gcd", gcd, 1, (), ()),
    ("lcm", lcm, 1, (), ()),
    ("equal", jnp.equal, None, (P.eq_p,), ("__eq__",)),
    ("not_equal", jnp.not_equal, None, (P.ne_p,), ("__ne__",)),
    ("less", jnp.less, None, (P.lt_p,), ("__lt__",)),
    ("less_equal", jnp.less_equal, None, (P.le_p,), ("__le__",)),
    ("greater", jnp.greater, None, (P.gt_p,), ("__gt__",)),
    ("greater_equal", jnp.greater_equal, None, (P.ge_p,), ("__ge__",)),
    ("logical_and", jnp.logical_and, None, (), ()),
    ("logical_or", jnp.logical_or, None, (), ()),
    ("logical_xor", jnp.logical_xor, None, (), ()),
    ("bitwise_and", jnp.bitwise_and, None, (P.and_p,), _ops("and")),
    ("bitwise_or", jnp.bitwise_or, None, (P.or_p,), _ops("or")),
    ("bitwise_xor", jnp.bitwise_xor, None, (P.xor_p,), _ops("xor")),
    ("left_shift", jnp.left_shift, 0, (P.shift_left_p,), _ops("lshift")),
    ("right_shift", jnp.right_shift, 0, (P.shift_right_arithmetic_p, P.shift_right_logical_p), _ops("rshift")),
]

# Ops whose output (or operands) are not floats have no Jacobian to check.
_NO_JACOBIAN = {
    **dict.fromkeys(
        (
            "equal",
            "not_equal",
            "less",
            "less_equal",
            "greater",
            "greater_equal",
            "logical_and",
            "logical_or",
            "logical_xor",
        ),
        "bool output: no derivative",
    ),
    **dict.fromkeys(
        ("bitwise_and", "bitwise_or", "bitwise_xor", "left_shift", "right_shift"), "integer operands: no derivative"
    ),
    "nextafter": "steps to the next float: its finite difference is not a derivative",
    "heaviside": "a step function: no derivative where it jumps, zero elsewhere",
    "divmod": "the quotient is a step function of the operands",
    "ldexp": "the exponent operand is an integer: no derivative in it",
    **dict.fromkeys(("gcd", "lcm"), "integer operands: no derivative"),
    "isclose": "bool output: no derivative",
}

# Binary lax functions that have no jax.numpy name: reached through ``maskify`` only.
# name, lax function, safe value (valid for both operands), primitive
LAX_ONLY = [
    ("igamma", lax.igamma, 1, P.igamma_p),
    ("igammac", lax.igammac, 1, P.igammac_p),
    ("polygamma", lax.polygamma, 1, P.polygamma_p),
    ("zeta", lax.zeta, 2, P.zeta_p),
    ("complex", lax.complex, None, P.complex_p),
]
_NO_JACOBIAN.update(
    {
        "polygamma": "the order operand is an integer: no derivative in it (jax defines none)",
        "zeta": "jax defines no derivative in the exponent operand",
        "complex": "complex output: the harness differentiates real functions",
    }
)


# the operands each op keeps non-finite when the others are finite constants
PRESERVES = {"add": (0, 1), "subtract": (0, 1), "multiply": (0, 1), "divide": (0,), "true_divide": (0,)}


_DIVMOD = (
    "x = mj.masked_array(jnp.array([7.0, 9.0]), jnp.array([True, False]))",
    "{mod}.divmod(x, 2.0)",
    "(MaskedArray([3.0 --], dtype=float32), MaskedArray([1.0 --], dtype=float32))",
)


def _binary_spec(name, fn, safe, prims, methods=(), modules=("numpy",), jax_name=None, signature=_X1X2):
    operands = tuple(signature.parameters)[:2]
    return OpSpec(
        name=name,
        family="binary",
        rule=nary(fn, safe, PRESERVES.get(name, ())),
        signature=signature,
        operands=operands,
        methods=methods,
        primitives=prims,
        safe=safe,
        fn=fn,
        modules=modules,
        jax_name=jax_name or f"jnp.{name}",
        returns="pair" if name == "divmod" else "masked",
        example=_DIVMOD if name == "divmod" else None,
        excluded={
            **(MASKIFY_ONLY if not modules else {}),
            **({"jacobians": _NO_JACOBIAN[name]} if name in _NO_JACOBIAN else {}),
        },
    )


for _name, _fn, _safe, _prims, _methods in BINARY:
    register(_binary_spec(_name, _fn, _safe, _prims, _methods))
for _name, _fn, _safe, _prim in LAX_ONLY:
    register(_binary_spec(_name, _fn, _safe, (_prim,), modules=(), jax_name=f"lax.{_name}"))
# isclose(a, b, rtol, atol, equal_nan): the tolerances are parameters, not operands
register(_binary_spec("isclose", jnp.isclose, None, (), signature=signature_of(jnp.isclose)))

register(
    OpSpec(
        name="where",
        family="binary",
        rule=where,
        fn=jnp.where,
        jax_name="jnp.where",
        signature=inspect.Signature([inspect.Parameter(n, _POS) for n in ("condition", "x", "y")]),
        operands=("condition", "x", "y"),
        example=(
            "x = mj.masked_array(jnp.array([1.0, 2.0]), jnp.array([True, False]))",
            "{mod}.where(jnp.array([False, True]), x, 0.0)",
            "MaskedArray([0.0 --], dtype=float32)",
        ),
    )
)
register(
    OpSpec(
        name="clip",
        family="binary",
        rule=clip,
        fn=jnp.clip,
        jax_name="jnp.clip",
        methods=("clip",),
        signature=inspect.Signature(
            [
                inspect.Parameter("arr", _POS),
                inspect.Parameter("min", _KW, default=None),
                inspect.Parameter("max", _KW, default=None),
            ]
        ),
        operands=("arr",),
        optional_operands=("min", "max"),
        example=(
            "x = mj.masked_array(jnp.array([-2.0, 0.5, 9.0]), jnp.array([True, True, False]))",
            "{mod}.clip(x, 0.0, 1.0)",
            "MaskedArray([0.0 0.5 --], dtype=float32)",
        ),
    )
)
