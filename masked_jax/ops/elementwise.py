"""Unary elementwise rules: ``f(x)`` keeps the mask and applies ``f`` to sanitised data."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from masked_jax.ops._base import Pair, fill


def unary(fn, safe=1):
    """Rule for an elementwise ``fn``: masked-out inputs become ``safe`` first.

    ``safe`` is a point where ``fn`` and its derivative are finite, so that
    neither the value nor a gradient at a masked-out element can be NaN/inf.
    ``safe=None`` marks a linear ``fn`` that needs no sanitising.
    """

    def rule(x: Pair, *args, **kwargs) -> Pair:
        data = x.data if safe is None else fill(x.data, x.mask, safe)
        return Pair(fn(data, *args, **kwargs), x.mask)

    rule.__name__ = getattr(fn, "__name__", "unary")
    rule.fn = fn
    return rule


def astype(x: Pair, dtype) -> Pair:
    """Change the data dtype; the mask is unchanged."""
    return Pair(jnp.asarray(x.data).astype(dtype), x.mask)


# name -> (jax function, safe value). Domain-limited functions get a safe
# point inside their domain with a finite derivative.
UNARY = {
    "abs": (jnp.abs, 1),
    "absolute": (jnp.abs, 1),
    "negative": (jnp.negative, None),
    "positive": (jnp.positive, None),
    "sign": (jnp.sign, 1),
    "exp": (jnp.exp, 0),
    "exp2": (jnp.exp2, 0),
    "expm1": (jnp.expm1, 0),
    "log": (jnp.log, 1),
    "log1p": (jnp.log1p, 0),
    "log2": (jnp.log2, 1),
    "log10": (jnp.log10, 1),
    "sqrt": (jnp.sqrt, 1),
    "cbrt": (jnp.cbrt, 1),
    "square": (jnp.square, 0),
    "reciprocal": (jnp.reciprocal, 1),
    "sin": (jnp.sin, 0),
    "cos": (jnp.cos, 0),
    "tan": (jnp.tan, 0),
    "arcsin": (jnp.arcsin, 0),
    "arccos": (jnp.arccos, 0),
    "arctan": (jnp.arctan, 0),
    "sinh": (jnp.sinh, 0),
    "cosh": (jnp.cosh, 0),
    "tanh": (jnp.tanh, 0),
    "arcsinh": (jnp.arcsinh, 0),
    "arccosh": (jnp.arccosh, 2),
    "arctanh": (jnp.arctanh, 0),
    "floor": (jnp.floor, 0),
    "ceil": (jnp.ceil, 0),
    "round": (jnp.round, 0),
    "trunc": (jnp.trunc, 0),
    "nan_to_num": (jnp.nan_to_num, 0),
    "isnan": (jnp.isnan, 0),
    "isinf": (jnp.isinf, 0),
    "isfinite": (jnp.isfinite, 0),
    "logical_not": (jnp.logical_not, 0),
    "bitwise_not": (jnp.bitwise_not, 0),
    "invert": (jnp.invert, 0),
    "deg2rad": (jnp.deg2rad, None),
    "rad2deg": (jnp.rad2deg, None),
    "conj": (jnp.conj, None),
    "real": (jnp.real, None),
    "imag": (jnp.imag, None),
    # jax.nn activations
    "relu": (jax.nn.relu, 1),
    "gelu": (jax.nn.gelu, 0),
    "silu": (jax.nn.silu, 0),
    "sigmoid": (jax.nn.sigmoid, 0),
    "softplus": (jax.nn.softplus, 0),
    "log_sigmoid": (jax.nn.log_sigmoid, 0),
}

RULES = {name: unary(fn, safe) for name, (fn, safe) in UNARY.items()}
RULES["astype"] = astype
