"""Build user-facing functions (``masked_jax.numpy``, ``masked_jax.nn``) from the rules.

Each public function is a thin wrapper that unwraps ``MaskedArray``/array
operands into pairs, calls the op's rule, and wraps the result. The docstring
(summary, semantics of the family, a runnable example) is generated here so
that every function documents itself in the same shape.
"""

from __future__ import annotations

from masked_jax import ops
from masked_jax._core import _unwrap, _wrap
from masked_jax.layouts import dispatch

_SEMANTICS = {
    "elementwise": "applied to the data; the mask is unchanged.",
    "binary": "operands broadcast as in ``jax.numpy``; the result is valid where all operands are.",
    "reductions": (
        "computed over valid elements only; an output element is valid iff its slice has a valid "
        "element, and fully masked slices hold a documented fill, never NaN."
    ),
    "normalization": "over the valid elements of ``axis``; masked inputs stay masked.",
    "shape": "applied to data and mask alike: the mask moves with the data.",
    "linalg": (
        "sums over the contracted indices where both operands are valid; an output is valid iff "
        "at least one such index exists."
    ),
}

_EXAMPLES = {
    "elementwise": (
        "x = mj.masked_array(jnp.array([0.5, 2.0]), jnp.array([True, False]))",
        "{mod}.{name}(x).mask",
        "Array([ True, False], dtype=bool)",
    ),
    "binary": (
        "x = mj.masked_array(jnp.array([1, 2]), jnp.array([True, False]))",
        "{mod}.{name}(x, jnp.array([3, 4])).mask",
        "Array([ True, False], dtype=bool)",
    ),
    "reductions": (
        "x = mj.masked_array(jnp.array([[1.0, 2.0], [3.0, 4.0]]), jnp.array([[True, False], [False, False]]))",
        "{mod}.{name}(x, axis=1).mask",
        "Array([ True, False], dtype=bool)",
    ),
    "normalization": (
        "x = mj.masked_array(jnp.array([[1.0, 2.0], [3.0, 4.0]]), jnp.array([[True, False], [False, False]]))",
        "{mod}.{name}(x, axis=1).mask",
        "Array([[ True, False],\n       [False, False]], dtype=bool)",
    ),
    "linalg": (
        "a = mj.masked_array(jnp.array([[1.0, 2.0], [3.0, 4.0]]), jnp.array([[True, False], [False, False]]))",
        "{mod}.{name}(a, jnp.ones((2, 2))).mask",
        "Array([[ True,  True],\n       [False, False]], dtype=bool)",
    ),
}


def family_of(name: str) -> str:
    for family, rules in ops.FAMILIES.items():
        if name in rules:
            return family
    raise KeyError(name)


def docstring(name, family, module, jax_name, example=None) -> str:
    setup, call, result = example or _EXAMPLES[family]
    return (
        f"Masked ``{jax_name}``: {_SEMANTICS[family]}\n\n"
        "Accepts ``MaskedArray``s and plain arrays (fully valid) alike and returns a\n"
        f"``MaskedArray``; other arguments are those of ``{jax_name}``.\n\n"
        "Examples:\n"
        "    >>> import jax.numpy as jnp, masked_jax as mj\n"
        f"    >>> import {module} as m\n"
        f"    >>> {setup}\n"
        f"    >>> {call.format(mod='m', name=name)}\n"
        + "".join(f"    {line}\n" for line in result.split("\n"))
    )


def first_operand(name, module, jax_name=None, rule=None, example=None):
    """A function whose first argument is a (masked) operand; the rest are passed through."""
    rule = rule or ops.RULES[name]
    family = family_of(name)

    def fn(x, *args, **kwargs):
        if dispatch.is_sparse(x):
            return dispatch.apply(name, family, rule, (x,), args, kwargs, fn)
        return _wrap(rule(_unwrap(x, "x"), *args, **kwargs))

    return _finish(fn, name, module, jax_name, example)


def all_operands(name, module, jax_name=None, rule=None, example=None):
    """A function whose positional arguments are all (masked) operands."""
    rule = rule or ops.RULES[name]
    family = family_of(name)

    def fn(*operands, **kwargs):
        if any(dispatch.is_sparse(o) for o in operands):
            return dispatch.apply(name, family, rule, operands, (), kwargs, fn)
        return _wrap(rule(*(_unwrap(o, f"operand {i}") for i, o in enumerate(operands)), **kwargs))

    return _finish(fn, name, module, jax_name, example)


def custom(name, module, impl, jax_name=None, example=None):
    """Document a hand-written function (operands in a list, a leading subscripts string...);
    sparse operands anywhere in its positional arguments densify through the storage fallback."""

    def fn(*args, **kwargs):
        return impl(*dispatch.densify(args, name), **kwargs)

    return _finish(fn, name, module, jax_name, example)


def _finish(fn, name, module, jax_name, example):
    family = family_of(name)
    fn.__name__ = fn.__qualname__ = name
    fn.__module__ = module
    fn.__doc__ = docstring(name, family, module, jax_name or f"jnp.{name}", example)
    return fn
