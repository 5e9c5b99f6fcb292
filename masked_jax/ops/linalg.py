"""Contractions (matmul, dot, einsum, ...) over the indices where both operands are valid.

``out[i, j] = sum_k a[i, k] b[k, j]`` over the ``k`` where ``a[i, k]`` and
``b[k, j]`` are both valid; ``out[i, j]`` is valid iff one such ``k`` exists.
Because masked-out entries are replaced by 0 before contracting, the data is
the contraction of the filled operands, and the mask is the same contraction
applied to the masks as 0/1 numbers, compared with 0.
"""

from __future__ import annotations

import jax.numpy as jnp

from masked_jax.ops._base import Pair, fill


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


def einsum(subscripts: str, *operands: Pair, **kwargs) -> Pair:
    return contraction(lambda *ops, **kw: jnp.einsum(subscripts, *ops, **kw))(*operands, **kwargs)



CONTRACTIONS = {
    "matmul": jnp.matmul,
    "dot": jnp.dot,
    "vdot": jnp.vdot,
    "inner": jnp.inner,
    "outer": jnp.outer,
    "tensordot": jnp.tensordot,
}

RULES = {name: contraction(fn) for name, fn in CONTRACTIONS.items()}
RULES["einsum"] = einsum
