"""Normalizations along an axis, over valid elements only (softmax family, L_p normalize).

Masked inputs stay masked; a fully masked slice stays fully masked and its
data is 0, never NaN. Each op carries its segment kernel for BCOO-backed arrays.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from masked_jax.ops import reductions
from masked_jax.ops._base import Pair, any_valid, fill, materialize, ranked
from masked_jax.ops._factors import Facts
from masked_jax.ops._registry import OpSpec, register, rule_signature, signature_of
from masked_jax.ops.statistics import _seg_norm, norm


def _shifted(x: Pair, axis):
    """``(x - max, mask, has)`` over the valid elements of ``axis``, as ``jax.nn.softmax`` shifts: by
    the valid maximum as it is (a valid ``inf`` gives ``inf - inf = NaN``, as in jax), integers
    subtracted in their own dtype before ``exp`` promotes them. Masked entries hold 0; a slice with
    no valid element is shifted by 0 (``has`` False)."""
    m = materialize(x.mask, jnp.shape(x.data))
    data = fill(x.data, m, 0)
    has = jnp.any(m, axis=axis, keepdims=True)
    top = jnp.where(has, reductions.max(Pair(data, m), axis=axis, keepdims=True).data, 0)
    z = jnp.where(m, data - jax.lax.stop_gradient(top).astype(data.dtype), 0)
    if not jnp.issubdtype(z.dtype, jnp.inexact):
        z = z.astype(reductions._float_dtype(z.dtype))
    return z, m, has


def softmax(x: Pair, axis=-1) -> Pair:
    z, m, has = _shifted(x, axis)
    e = jnp.where(m, jnp.exp(z), 0)
    total = jnp.sum(e, axis=axis, keepdims=True)
    return Pair(e / jnp.where(has, total, 1), x.mask)  # the input's mask, compact (or None)


def compact_softmax(x: Pair, axes, facts: Facts) -> Pair:
    """``jax.nn.softmax`` along ``axes`` over the valid elements, for ``maskify``: the masked entries
    enter as ``-inf``, so their exponentials are exactly 0 (one select at the data's shape; the mask
    stays compact), and the steps after it are jax's own (max, shift, exp, sum, divide), which XLA
    fuses into one loop. A slice with no valid element enters as zeros instead: its data are the
    uniform ``1 / n``, finite and all masked. The data are recorded as 0 under the mask: they are,
    except in such a slice and in a slice whose valid maximum is NaN or ``-inf`` (every valid element
    ``-inf``), where every valid value of the slice is NaN too, as in jax: a record ``along`` the
    axes, which only a contraction along them reads (attention's weights times values), whose
    outputs from such a slice are masked or NaN as in jax."""
    data = jnp.asarray(x.data)
    m = ranked(x.mask, data.ndim, facts)
    has = any_valid(m, data.shape, axes, keepdims=True, facts=facts)
    # the fill at the compact shape of ``has``: -inf beside valid elements, 0 in an empty slice
    entered = jnp.where(m, data, jnp.where(has, -jnp.inf, 0).astype(data.dtype))
    empty = any(data.shape[a] == 0 for a in axes)  # nothing to normalise: jnp.max needs an initial
    top = jnp.max(entered, axis=axes, keepdims=True, initial=-jnp.inf if empty else None)
    e = jnp.exp(entered - jax.lax.stop_gradient(top))
    out = e / jnp.sum(e, axis=axes, keepdims=True)
    return Pair(facts.record_value(out, x.mask, 0, True, along=axes), x.mask)


def compact_log_softmax(x: Pair, axes, facts: Facts) -> Pair:
    """``jax.nn.log_softmax`` along ``axes`` over the valid elements, for ``maskify``, as
    :func:`compact_softmax`: one select (the masked entries enter as ``-inf``, so their exponentials
    are exactly 0). The data under the mask are ``-inf`` (NaN in a slice with no valid element):
    not recorded, so any op that reads them fills them first."""
    shifted, _ = _minus_inf_shifted(x, axes, facts)
    total = jnp.sum(jnp.exp(shifted), axis=axes, keepdims=True)
    return Pair(shifted - jnp.log(total), x.mask)


def _minus_inf_shifted(x: Pair, axes, facts: Facts):
    """``(x - max(x), has)`` along ``axes`` with the masked entries at ``-inf``: shifted by the valid
    maximum (a stopped gradient, as ``jax.nn.softmax``), by 0 in a slice with no valid element
    (``has`` False, at the compact mask's shape)."""
    data = jnp.asarray(x.data)
    m = ranked(x.mask, data.ndim, facts)
    entered = jnp.where(m, data, -jnp.inf)
    has = any_valid(m, data.shape, axes, keepdims=True, facts=facts)
    top = jnp.where(has, jnp.max(entered, axis=axes, keepdims=True, initial=-jnp.inf), 0)
    return entered - jax.lax.stop_gradient(top), has


def log_softmax(x: Pair, axis=-1) -> Pair:
    z, m, has = _shifted(x, axis)
    total = jnp.sum(jnp.where(m, jnp.exp(z), 0), axis=axis, keepdims=True)
    out = z - jnp.log(jnp.where(has, total, 1))
    return Pair(jnp.where(m, out, 0), x.mask)


def softmin(x: Pair, axis=-1) -> Pair:
    return softmax(Pair(-jnp.asarray(x.data), x.mask), axis=axis)


def normalize(x: Pair, ord=2, axis=-1, eps=1e-12) -> Pair:
    """``x / max(||x||_ord, eps)`` with the norm over valid elements of ``axis``."""
    m = materialize(x.mask, jnp.shape(x.data))
    n = norm(Pair(x.data, m), ord=ord, axis=axis, keepdims=True)
    data = fill(x.data, m, 0)
    return Pair(data / jnp.maximum(n.data, eps), x.mask)


# -- segment kernels (BCOO-backed arrays, along an axis) -------------------------------------------
def _softmax_parts(g, v):
    """The stored entries' shift, exponentials and totals, as :func:`_shifted` (per segment)."""
    has = g.count > 0
    top = jax.lax.stop_gradient(jnp.where(has, g.max(v), 0))
    z = g.clean(v - g.back(top).astype(v.dtype))
    z = reductions._float(z)
    e = jnp.where(g.valid, jnp.exp(z), 0)
    total = g.back(jnp.where(has, g.sum(e), 1))
    return z, e, total


def _seg_softmax(g, v):
    _, e, t = _softmax_parts(g, v)
    return e / t


def _seg_log_softmax(g, v):
    z, _, t = _softmax_parts(g, v)
    return g.clean(z - jnp.log(t))


def _seg_normalize(g, v, ord=2, eps=1e-12):
    return v / jnp.maximum(g.back(_seg_norm(g, v, ord)), eps)


def _normalization(name, rule, segment, jax_fn=None):
    sig = signature_of(jax_fn) if jax_fn is not None else rule_signature(rule)
    return register(
        OpSpec(
            name=name,
            family="normalization",
            rule=rule,
            signature=sig,
            operands=("x",),
            modules=("nn",),
            segment=segment,
            fn=jax_fn,
            jax_name=f"jax.nn.{name}" if jax_fn is not None else name,
            excluded={} if jax_fn is not None else {"maskify": "no jax function to interpret"},
        )
    )


_normalization("softmax", softmax, _seg_softmax, jax.nn.softmax)
_normalization("log_softmax", log_softmax, _seg_log_softmax, jax.nn.log_softmax)
_normalization("softmin", softmin, lambda g, v: _seg_softmax(g, -v))
_normalization("normalize", normalize, _seg_normalize)
