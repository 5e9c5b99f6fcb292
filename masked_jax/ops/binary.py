"""Binary (and n-ary) elementwise rules: valid where every operand is valid."""

from __future__ import annotations

import jax.numpy as jnp

from masked_jax.ops._base import Pair, and_masks, fill


def nary(fn, safe=1):
    """Rule for an elementwise ``fn`` of several operands.

    Operands broadcast as in ``jax.numpy``; the result is valid where all
    operands are valid. Every operand is set to ``safe`` wherever the *result*
    is masked, so a masked-out value in one operand cannot turn a valid value
    of another operand's gradient into NaN (``d(a*b)/db = a``). ``safe=None``
    marks functions (add, comparisons, selections) whose derivatives never
    read operand values.
    """

    def rule(*operands: Pair, **kwargs) -> Pair:
        mask = and_masks(*(o.mask for o in operands))
        if safe is None or mask is None:
            datas = [o.data for o in operands]
        else:
            datas = [fill(o.data, mask, safe) for o in operands]
        return Pair(fn(*datas, **kwargs), mask)

    rule.__name__ = getattr(fn, "__name__", "nary")
    rule.fn = fn
    return rule


def where(condition: Pair, x: Pair, y: Pair) -> Pair:
    """Select data *and* mask: ``where(c, x, y)`` is valid where ``c`` and the chosen operand are."""
    cond = jnp.asarray(condition.data)
    if cond.dtype != jnp.bool_:
        cond = cond != 0
    data = jnp.where(cond, x.data, y.data)
    if x.mask is None and y.mask is None:
        mask = condition.mask
    else:
        xm = True if x.mask is None else x.mask
        ym = True if y.mask is None else y.mask
        mask = and_masks(condition.mask, jnp.where(cond, xm, ym))
    return Pair(data, mask)


BINARY = {
    "add": (jnp.add, None),
    "subtract": (jnp.subtract, None),
    "multiply": (jnp.multiply, 1),
    "divide": (jnp.divide, 1),
    "true_divide": (jnp.true_divide, 1),
    "floor_divide": (jnp.floor_divide, 1),
    "mod": (jnp.mod, 1),
    "remainder": (jnp.remainder, 1),
    "power": (jnp.power, 1),
    "float_power": (jnp.float_power, 1),
    "maximum": (jnp.maximum, 1),
    "minimum": (jnp.minimum, 1),
    "fmax": (jnp.fmax, 1),
    "fmin": (jnp.fmin, 1),
    "arctan2": (jnp.arctan2, 1),
    "hypot": (jnp.hypot, 1),
    "logaddexp": (jnp.logaddexp, 1),
    "copysign": (jnp.copysign, 1),
    "equal": (jnp.equal, None),
    "not_equal": (jnp.not_equal, None),
    "less": (jnp.less, None),
    "less_equal": (jnp.less_equal, None),
    "greater": (jnp.greater, None),
    "greater_equal": (jnp.greater_equal, None),
    "logical_and": (jnp.logical_and, None),
    "logical_or": (jnp.logical_or, None),
    "logical_xor": (jnp.logical_xor, None),
    "bitwise_and": (jnp.bitwise_and, None),
    "bitwise_or": (jnp.bitwise_or, None),
    "bitwise_xor": (jnp.bitwise_xor, None),
    "left_shift": (jnp.left_shift, 0),
    "right_shift": (jnp.right_shift, 0),
}

def clip(x: Pair, lo: Pair | None = None, hi: Pair | None = None) -> Pair:
    """``clip(x, lo, hi)``; bounds that are given must be valid too."""
    present = [p for p in (lo, hi) if p is not None]
    mask = and_masks(x.mask, *(p.mask for p in present))
    data = fill(x.data, mask, 0)
    lo_d = None if lo is None else fill(lo.data, mask, 0)
    hi_d = None if hi is None else fill(hi.data, mask, 0)
    return Pair(jnp.clip(data, lo_d, hi_d), mask)


RULES = {name: nary(fn, safe) for name, (fn, safe) in BINARY.items()}
RULES["where"] = where
RULES["clip"] = clip
