"""Contractions (matmul, dot, einsum, ...) over the indices where both operands are valid.

``out[i, j] = sum_k a[i, k] b[k, j]`` over the ``k`` where ``a[i, k]`` and
``b[k, j]`` are both valid; ``out[i, j]`` is valid iff one such ``k`` exists.
Because masked-out entries are replaced by 0 before contracting, the data is
the contraction of the filled operands, and the mask is the same contraction
applied to the masks as 0/1 numbers, compared with 0.

A masked term never contributes, whatever it holds, and a *valid* ``inf`` or NaN is a value as
in ``jax.numpy``. Zero-filling alone breaks the second rule: a valid ``inf`` meeting a masked
entry would form ``inf * 0 = NaN``. So when a valid operand entry is not finite (checked at run
time: ``lax.cond`` under a transform, a Python branch eagerly), the finite terms are contracted
as above and the non-finite ones are counted by sign (one batched contraction of indicator
arrays; it costs about 0.2 s more compile time per program on CPU, paid under ``jit``): an output
with a NaN term (a valid NaN, or a valid ``inf`` times a valid 0) or with both ``+inf`` and
``-inf`` terms is NaN, else one with an infinite term is that infinity, as IEEE sums are.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

import inspect

import jax.extend.core.primitives as P

from masked_jax.ops._base import Pair, fill
from masked_jax.ops._registry import OpSpec, register, signature_of


def contraction(fn):
    """Rule for a multilinear ``fn(*operands, **kwargs)`` such as ``jnp.matmul``."""

    def rule(*operands: Pair, **kwargs) -> Pair:
        if all(o.mask is None for o in operands):
            return Pair(fn(*(o.data for o in operands), **kwargs), None)
        valid = [jnp.broadcast_to(True if o.mask is None else o.mask, jnp.shape(o.data)) for o in operands]
        counts = [v.astype(jnp.float32) for v in valid]
        mask = fn(*counts, **kwargs) > 0
        filled = [fill(o.data, o.mask, 0) for o in operands]
        if len(operands) != 2 or not all(jnp.issubdtype(jnp.result_type(o.data), jnp.floating) for o in operands):
            return Pair(fn(*filled, **kwargs), mask)
        (a, b), (va, vb) = [jnp.asarray(o.data) for o in operands], valid
        nonfinite = jnp.any(va & ~jnp.isfinite(a)) | jnp.any(vb & ~jnp.isfinite(b))
        if not any(isinstance(v, jax.core.Tracer) for v in (a, b, va, vb)):
            # eagerly the branch is known: only the program that runs is built (no compile of the other)
            return Pair(_with_nonfinite(fn, kwargs, a, b, va, vb) if bool(nonfinite) else fn(*filled, **kwargs), mask)
        data = jax.lax.cond(nonfinite, lambda: _with_nonfinite(fn, kwargs, a, b, va, vb),
                            lambda: fn(*filled, **kwargs))
        return Pair(data, mask)

    rule.__name__ = getattr(fn, "__name__", "contraction")
    rule.fn = fn
    return rule


def _with_nonfinite(fn, kwargs, a, b, va, vb):
    """``fn(a, b)`` over jointly valid terms when valid entries may be ``inf`` or NaN: the finite
    terms contracted, the non-finite ones counted by sign (see the module docstring)."""
    finite = fn(jnp.where(va & jnp.isfinite(a), a, 0), jnp.where(vb & jnp.isfinite(b), b, 0), **kwargs)

    def kinds(x, v):
        inf, nan = v & jnp.isinf(x), v & jnp.isnan(x)
        pos, neg = v & (x > 0), v & (x < 0)
        return dict(v=v, pi=pos & inf, ni=neg & inf, pf=pos & ~inf, nf=neg & ~inf, p=pos, n=neg,
                    i=inf, z=v & (x == 0), nan=nan)

    ka, kb = kinds(a, va), kinds(b, vb)
    pairs = [("pi", "p"), ("pf", "pi"), ("ni", "n"), ("nf", "ni"),    # +inf terms
             ("pi", "n"), ("pf", "ni"), ("ni", "p"), ("nf", "pi"),    # -inf terms
             ("nan", "v"), ("v", "nan"), ("i", "z"), ("z", "i")]      # NaN terms
    left = jnp.stack([ka[p] for p, _ in pairs]).astype(jnp.float32)
    right = jnp.stack([kb[q] for _, q in pairs]).astype(jnp.float32)
    counts = jax.vmap(lambda u, w: fn(u, w, **kwargs))(left, right) > 0
    pos, neg, nan = (jnp.any(counts[i:i + 4], axis=0) for i in (0, 4, 8))
    out = jnp.where(pos, jnp.inf, jnp.where(neg, -jnp.inf, finite))
    return jnp.where(nan | (pos & neg), jnp.nan, out).astype(finite.dtype)


def einsum(*operands: Pair, subscripts: str, **kwargs) -> Pair:
    """``jnp.einsum(subscripts, *operands)``: the subscripts come as a keyword (operands first)."""
    if not isinstance(subscripts, str):
        raise TypeError(f"subscripts must be an einsum string such as 'ij,jk->ik'; got {type(subscripts).__name__}.")
    return contraction(lambda *ops, **kw: jnp.einsum(subscripts, *ops, **kw))(*operands, **kwargs)



_A = "a = mj.masked_array(jnp.array([[1.0, 2.0], [3.0, 4.0]]), jnp.array([[True, False], [False, False]]))"
_V = "a = mj.masked_array(jnp.array([1.0, 2.0]), jnp.array([True, False]))"
_ROWS = "Array([[ True,  True],\n       [False, False]], dtype=bool)"
# name, jax function, methods, primitives, example
CONTRACTIONS = [
    ("matmul", jnp.matmul, ("__matmul__", "__rmatmul__"), (P.dot_general_p,),
     (_A, "{mod}.matmul(a, jnp.ones((2, 2))).mask", _ROWS)),
    ("dot", jnp.dot, ("dot",), (), (_A, "{mod}.dot(a, jnp.ones((2, 2))).mask", _ROWS)),
    ("vdot", jnp.vdot, (), (), (_V, "{mod}.vdot(a, jnp.array([10.0, 10.0]))", "MaskedArray(10.0, dtype=float32)")),
    ("inner", jnp.inner, (), (), (_V, "{mod}.inner(a, jnp.array([10.0, 10.0]))", "MaskedArray(10.0, dtype=float32)")),
    ("outer", jnp.outer, (), (), (_V, "{mod}.outer(a, jnp.array([1.0, 1.0])).mask.sum()", "Array(2, dtype=int32)")),
    ("tensordot", jnp.tensordot, (), (), (_A, "{mod}.tensordot(a, jnp.ones((2, 2)), axes=1).mask", _ROWS)),
]
for _name, _fn, _methods, _prims, _example in CONTRACTIONS:
    register(OpSpec(name=_name, family="linalg", rule=contraction(_fn), operands=("a", "b"), methods=_methods,
                    signature=signature_of(_fn, drop=("out_sharding",)), primitives=_prims, fn=_fn,
                    jax_name=f"jnp.{_name}", example=_example))

_POS = inspect.Parameter.POSITIONAL_ONLY
register(OpSpec(
    name="einsum", family="linalg", rule=einsum, fn=jnp.einsum, jax_name="jnp.einsum",
    signature=signature_of(jnp.einsum, drop=("out_sharding",)), operands=("*operands",),
    example=(_A, "{mod}.einsum('ij,jk->ik', a, jnp.ones((2, 2))).mask", _ROWS),
))
del _name, _fn, _methods, _prims, _example
