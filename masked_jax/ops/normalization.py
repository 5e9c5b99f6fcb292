"""Normalizations along an axis, over valid elements only (softmax family, L_p normalize).

Masked inputs stay masked; a fully masked slice stays fully masked and its
data is 0, never NaN.
"""

from __future__ import annotations

import jax.numpy as jnp

from masked_jax.ops._base import Pair, fill, materialize
from masked_jax.ops import reductions


def _shifted(x: Pair, axis):
    z, m, _ = reductions.shifted_by_max(x, axis)
    return z, m


def softmax(x: Pair, axis=-1) -> Pair:
    z, m = _shifted(x, axis)
    e = jnp.where(m, jnp.exp(z), 0)
    total = jnp.sum(e, axis=axis, keepdims=True)
    return Pair(e / jnp.where(total > 0, total, 1), m)


def log_softmax(x: Pair, axis=-1) -> Pair:
    z, m = _shifted(x, axis)
    total = jnp.sum(jnp.where(m, jnp.exp(z), 0), axis=axis, keepdims=True)
    out = z - jnp.log(jnp.where(total > 0, total, 1))
    return Pair(jnp.where(m, out, 0), m)


def softmin(x: Pair, axis=-1) -> Pair:
    return softmax(Pair(-jnp.asarray(x.data), x.mask), axis=axis)


def normalize(x: Pair, ord=2, axis=-1, eps=1e-12) -> Pair:
    """``x / max(||x||_ord, eps)`` with the norm over valid elements of ``axis``."""
    m = materialize(x.mask, jnp.shape(x.data))
    n = reductions.norm(Pair(x.data, m), ord=ord, axis=axis, keepdims=True)
    data = fill(x.data, m, 0)
    return Pair(data / jnp.maximum(n.data, eps), m)


RULES = {f.__name__: f for f in (softmax, log_softmax, softmin, normalize)}
