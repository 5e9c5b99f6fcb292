"""Helpers shared by the topic modules of ``masked_jax.numpy``: the public function of a registered
op, docstrings for generated functions, and the check of a fully valid operand.
"""

from __future__ import annotations

import builtins
import inspect
from collections.abc import Callable
from typing import Any

import jax

from masked_jax._core import MaskedArray, SparseMasked, fully_valid_data
from masked_jax._core import as_masked as _as_masked
from masked_jax.numpy import _frontend


def as_dense_masked(x) -> MaskedArray:
    """``x`` as a ``MaskedArray``; a sparse layout is densified (these functions have no sparse rule)."""
    return x.todense() if isinstance(x, SparseMasked) else _as_masked(x)


def op(name: str) -> Callable[..., Any]:
    """The public function of a registered op (signature binding included)."""
    return _frontend.function(name)


def document(fn, name, summary, *example, signature_of=None):
    """Name a generated function and give it a docstring: ``summary``, then an Examples block whose
    lines are ``example`` (``>>>``/``...`` lines and the outputs they print). ``signature_of``: the
    ``jax.numpy`` function it wraps, whose signature (parameter names, defaults, keyword-only
    markers) it reports to ``inspect.signature``, as the Array API requires."""
    fn.__name__ = fn.__qualname__ = name
    if signature_of is not None:
        params = list(inspect.signature(signature_of).parameters.values())
        own = list(inspect.signature(fn).parameters.values())
        if own and own[0].kind is inspect.Parameter.POSITIONAL_ONLY:  # the array: ours is positional-only
            params[0] = own[0]
        fn.__signature__ = inspect.Signature(params)
    fn.__doc__ = summary + "\n\n    Examples:\n" + "".join(f"        {line}\n" for line in example) + "    "
    return fn


def dtype_of(x):
    return x.dtype if isinstance(x, MaskedArray) else x


def is_masked_value(v) -> builtins.bool:
    return isinstance(v, (MaskedArray, SparseMasked))


def fully_valid(x, name):
    """The data of ``x`` when it is a plain array or a ``MaskedArray`` whose mask is concretely all
    True; otherwise a ``TypeError`` that says why."""
    return fully_valid_data(
        x,
        name,
        "it has no masked meaning: a decomposition or transform of an array with "
        "masked entries is not defined by its valid entries alone; for the dense meaning call "
        "it on x.filled(value).",
    )


def dense_only(fn, name):
    def dense(x, /, *args, **kwargs):
        out = fn(
            fully_valid(x, name),
            *(fully_valid(a, name) for a in args),
            **{k: fully_valid(v, f"{name}'s {k}") for k, v in kwargs.items()},
        )
        return jax.tree_util.tree_map(as_dense_masked, out)

    return document(
        dense,
        name.rsplit(".", 1)[-1],
        f"``jax.numpy.{name}`` of fully valid arrays, with a fully valid result. An array with masked "
        f"entries (or a traced mask) raises ``TypeError``: {name} has no masked meaning.",
        ">>> import jax.numpy as jnp, masked_jax as mj, masked_jax.numpy as mnp",
        ">>> mnp.linalg.det(mnp.eye(2))",
        "MaskedArray(1.0, dtype=float32)",
        ">>> mnp.linalg.det(mj.masked_array(jnp.eye(2), jnp.eye(2) > 0))",
        "Traceback (most recent call last):",
        "TypeError: linalg.det must be fully valid (a concrete all-True mask): it has no masked meaning: ...",
        signature_of=fn,
    )
