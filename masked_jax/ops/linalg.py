"""Contractions (matmul, dot, einsum, ...) over the indices where both operands are valid.

``out[i, j] = sum_k a[i, k] b[k, j]`` over the ``k`` where ``a[i, k]`` and
``b[k, j]`` are both valid; ``out[i, j]`` is valid iff one such ``k`` exists.
Because masked-out entries are replaced by 0 before contracting, the data is
the contraction of the filled operands, and the mask is the same contraction
applied to the masks as 0/1 numbers, compared with 0.
"""

from __future__ import annotations

import jax.numpy as jnp

import inspect

import jax.extend.core.primitives as P

from masked_jax.ops._base import Pair, fill
from masked_jax.ops._registry import OpSpec, register, signature_of


def contraction(fn):
    """Rule for a multilinear ``fn(*operands, **kwargs)`` such as ``jnp.matmul``."""

    def rule(*operands: Pair, **kwargs) -> Pair:
        data = fn(*(fill(o.data, o.mask, 0) for o in operands), **kwargs)
        if all(o.mask is None for o in operands):
            return Pair(data, None)
        counts = [
            jnp.ones(jnp.shape(o.data), jnp.float32)
            if o.mask is None
            else jnp.broadcast_to(o.mask, jnp.shape(o.data)).astype(jnp.float32)
            for o in operands
        ]
        return Pair(data, fn(*counts, **kwargs) > 0)

    rule.__name__ = getattr(fn, "__name__", "contraction")
    rule.fn = fn
    return rule


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
