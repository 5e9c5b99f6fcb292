"""``jax.numpy`` with masked semantics (mask ``True`` = valid).

Every function accepts ``MaskedArray``s and plain arrays alike (a plain array
is fully valid) and returns a ``MaskedArray`` (``count`` and ``argsort``
return plain arrays: a count and a permutation are always defined). The
semantics of each op family are in ``../shared/DESIGN.md`` and in the rule
modules of :mod:`masked_jax.ops`:

* elementwise ``f(x)``: data ``f(data)``, mask unchanged;
* binary ``a op b``: valid where both are valid;
* reductions: over valid elements only; fully masked slices are masked;
* shape ops and indexing: the mask moves with the data;
* ``matmul``/``dot``/``einsum``: sum over indices where both operands are valid.

Unlike ``numpy.ma``, out-of-domain results (``log(-1)``, ``1/0``) are *not*
masked: they are ``nan``/``inf`` at valid positions, as in ``jax.numpy``.

Examples:
    >>> import jax.numpy as jnp, masked_jax as mj, masked_jax.numpy as mnp
    >>> x = mj.masked_array(jnp.array([1.0, jnp.nan, 3.0]), jnp.array([True, False, True]))
    >>> mnp.mean(x)
    MaskedArray(2.0, dtype=float32)
"""

from __future__ import annotations

import types

from masked_jax import ops
from masked_jax._core import _unwrap, _wrap, as_masked, masked_array  # noqa: F401
from masked_jax._frontend import all_operands, custom, first_operand
from masked_jax import _storage as _layout_base

_M = __name__

_UNARY = [n for n in ops.elementwise.RULES if n not in ("relu", "gelu", "silu", "sigmoid",
                                                          "softplus", "log_sigmoid")]
_INT_EXAMPLE = (
    "x = mj.masked_array(jnp.array([1, 2]), jnp.array([True, False]))",
    "{mod}.{name}(x).mask",
    "Array([ True, False], dtype=bool)",
)
for _n in _UNARY:
    if _n == "astype":
        continue
    globals()[_n] = first_operand(
        _n, _M, example=_INT_EXAMPLE if _n in ("bitwise_not", "invert") else None
    )

astype = first_operand(
    "astype", _M,
    example=(
        "x = mj.masked_array(jnp.array([1.5, 2.5]), jnp.array([True, False]))",
        "{mod}.astype(x, jnp.int32).dtype",
        "dtype('int32')",
    ),
)

for _n in ops.binary.BINARY:
    globals()[_n] = all_operands(_n, _M)

clip = first_operand(
    "clip", _M,
    rule=lambda x, min=None, max=None: ops.RULES["clip"](
        x, None if min is None else _unwrap(min, "min"), None if max is None else _unwrap(max, "max")
    ),
    example=(
        "x = mj.masked_array(jnp.array([-2.0, 0.5, 9.0]), jnp.array([True, True, False]))",
        "{mod}.clip(x, 0.0, 1.0)",
        "MaskedArray([0.0 0.5 --], dtype=float32)",
    ),
)

where = all_operands(
    "where", _M,
    example=(
        "x = mj.masked_array(jnp.array([1.0, 2.0]), jnp.array([True, False]))",
        "{mod}.where(jnp.array([False, True]), x, 0.0)",
        "MaskedArray([0.0 --], dtype=float32)",
    ),
)

for _n in "sum prod mean var std max min ptp argmax argmin any all logsumexp median norm".split():
    globals()[_n] = first_operand(_n, _M)

for _n, _shown in (("cumsum", "[1.0 -- 4.0]"), ("cumprod", "[1.0 -- 3.0]")):
    globals()[_n] = first_operand(
        _n, _M,
        example=(
            "x = mj.masked_array(jnp.array([1.0, 2.0, 3.0]), jnp.array([True, False, True]))",
            "{mod}.{name}(x)",
            f"MaskedArray({_shown}, dtype=float32)",
        ),
    )

amax, amin = max, min  # noqa: F821

count = first_operand(
    "count", _M,
    example=(
        "x = mj.masked_array(jnp.ones((2, 2)), jnp.array([[True, False], [True, True]]))",
        "{mod}.count(x, axis=1)",
        "Array([1, 2], dtype=int32)",
    ),
)

_Q_EXAMPLE = (
    "x = mj.masked_array(jnp.array([1.0, 2.0, 3.0, 100.0]), jnp.array([True, True, True, False]))",
    "{mod}.{name}(x, {q})",
    "MaskedArray(2.0, dtype=float32)",
)
quantile = first_operand("quantile", _M, example=(_Q_EXAMPLE[0], _Q_EXAMPLE[1].replace("{q}", "0.5"), _Q_EXAMPLE[2]))
percentile = first_operand("percentile", _M, example=(_Q_EXAMPLE[0], _Q_EXAMPLE[1].replace("{q}", "50"), _Q_EXAMPLE[2]))


def _average_rule(x, axis=None, weights=None, keepdims=False):
    w = None if weights is None else _unwrap(weights, "weights")
    return ops.RULES["average"](x, axis=axis, weights=w, keepdims=keepdims)


average = first_operand(
    "average", _M, rule=_average_rule,
    example=(
        "x = mj.masked_array(jnp.array([1.0, 2.0, 50.0]), jnp.array([True, True, False]))",
        "{mod}.average(x, weights=jnp.array([3.0, 1.0, 1.0]))",
        "MaskedArray(1.25, dtype=float32)",
    ),
)

_SHAPE_EXAMPLES = {
    "reshape": ("(4,)",), "ravel": (), "transpose": (), "swapaxes": ("0", "1"),
    "moveaxis": ("0", "1"), "expand_dims": ("0",), "squeeze": (), "broadcast_to": ("(3, 2, 2)",),
    "flip": ("0",), "roll": ("1", "0"), "tile": ("2",), "repeat": ("2",),
    "take_along_axis": ("jnp.array([[0], [1]])", "1"), "atleast_1d": (), "atleast_2d": (),
}
for _n, _args in _SHAPE_EXAMPLES.items():
    _call = "{mod}.{name}(" + ", ".join(("x",) + _args) + ").mask.sum()"
    globals()[_n] = first_operand(
        _n, _M,
        example=(
            "x = mj.masked_array(jnp.array([[1.0, 2.0], [3.0, 4.0]]), jnp.array([[True, False], [True, True]]))",
            _call,
            "Array(" + {"tile": "6", "repeat": "6", "broadcast_to": "9", "take_along_axis": "2"}.get(_n, "3") + ", dtype=int32)",
        ),
    )

_X22 = "x = mj.masked_array(jnp.array([[1.0, 2.0], [3.0, 4.0]]), jnp.array([[True, False], [True, True]]))"
split = first_operand(
    "split", _M,
    example=(_X22, "[p.mask.tolist() for p in {mod}.split(x, 2)]", "[[[True, False]], [[True, True]]]"),
)
pad = first_operand(
    "pad", _M,
    example=(
        "x = mj.masked_array(jnp.array([1.0, 2.0]), jnp.array([True, False]))",
        "{mod}.pad(x, 1)",
        "MaskedArray([0.0 1.0 -- 0.0], dtype=float32)",
    ),
)
take = first_operand(
    "take", _M,
    example=(
        "x = mj.masked_array(jnp.array([1.0, 2.0]), jnp.array([True, False]))",
        "{mod}.take(x, jnp.array([1, 0, 5]))",
        "MaskedArray([-- 1.0 --], dtype=float32)",
    ),
)
sort = first_operand(
    "sort", _M,
    example=(
        "x = mj.masked_array(jnp.array([3.0, 1.0, 2.0]), jnp.array([True, False, True]))",
        "{mod}.sort(x)",
        "MaskedArray([2.0 3.0 --], dtype=float32)",
    ),
)
argsort = first_operand(
    "argsort", _M,
    example=(
        "x = mj.masked_array(jnp.array([3.0, 1.0, 2.0]), jnp.array([True, False, True]))",
        "{mod}.argsort(x)",
        "Array([2, 0, 1], dtype=int32)",
    ),
)


def _join(name):
    def impl(arrays, *args, **kwargs):
        if not isinstance(arrays, (list, tuple)):
            raise TypeError(f"{name} takes a sequence of arrays; got {type(arrays).__name__}.")
        pairs = [_unwrap(a, f"arrays[{i}]") for i, a in enumerate(arrays)]
        return _wrap(ops.RULES[name](pairs, *args, **kwargs))

    return custom(
        name, _M, impl,
        example=(
            "x = mj.masked_array(jnp.array([1.0, 2.0]), jnp.array([True, False]))",
            "{mod}.{name}([x, jnp.array([3.0, 4.0])]).mask.sum()",
            "Array(3, dtype=int32)",
        ),
    )


concatenate = _join("concatenate")
stack = _join("stack")

for _n in ops.linalg.CONTRACTIONS:
    globals()[_n] = all_operands(
        _n, _M,
        example={
            "vdot": (
                "a = mj.masked_array(jnp.array([1.0, 2.0]), jnp.array([True, False]))",
                "{mod}.vdot(a, jnp.array([10.0, 10.0]))",
                "MaskedArray(10.0, dtype=float32)",
            ),
            "inner": (
                "a = mj.masked_array(jnp.array([1.0, 2.0]), jnp.array([True, False]))",
                "{mod}.inner(a, jnp.array([10.0, 10.0]))",
                "MaskedArray(10.0, dtype=float32)",
            ),
            "tensordot": (
                "a = mj.masked_array(jnp.array([[1.0, 2.0], [3.0, 4.0]]), jnp.array([[True, False], [False, False]]))",
                "{mod}.tensordot(a, jnp.ones((2, 2)), axes=1).mask",
                "Array([[ True,  True],\n       [False, False]], dtype=bool)",
            ),
            "outer": (
                "a = mj.masked_array(jnp.array([1.0, 2.0]), jnp.array([True, False]))",
                "{mod}.outer(a, jnp.array([1.0, 1.0])).mask.sum()",
                "Array(2, dtype=int32)",
            ),
        }.get(_n),
    )


def _einsum(subscripts, *operands, **kwargs):
    pairs = [_unwrap(o, f"operand {i}") for i, o in enumerate(operands)]
    return _wrap(ops.RULES["einsum"](subscripts, *pairs, **kwargs))


einsum = custom(
    "einsum", _M, _einsum,
    example=(
        "a = mj.masked_array(jnp.array([[1.0, 2.0], [3.0, 4.0]]), jnp.array([[True, False], [False, False]]))",
        "{mod}.einsum('ij,jk->ik', a, jnp.ones((2, 2))).mask",
        "Array([[ True,  True],\n       [False, False]], dtype=bool)",
    ),
)

_layout_base.OPERATORS.update(
    add=add, subtract=subtract, multiply=multiply, true_divide=true_divide,  # noqa: F821
    power=power, matmul=matmul, negative=negative, greater=greater, less=less,  # noqa: F821
    greater_equal=greater_equal, less_equal=less_equal,  # noqa: F821
)

linalg = types.SimpleNamespace(norm=norm, matmul=matmul, vecdot=vdot)  # noqa: F821

__all__ = sorted(
    n for n, v in globals().items() if callable(v) and not n.startswith("_") and n not in (
        "annotations", "types", "ops", "all_operands", "custom", "first_operand"
    )
)
