"""``jax.nn`` with masked semantics: normalizations over valid elements only.

``softmax``, ``log_softmax``, ``softmin`` and ``normalize`` work along
``axis`` over valid elements; masked inputs stay masked, fully masked slices
stay masked (data 0, never NaN). Activations are elementwise and keep the mask.
The functions are built from the op registry (:mod:`masked_jax.ops`).

Examples:
    >>> import jax.numpy as jnp, masked_jax as mj, masked_jax.nn as mnn
    >>> x = mj.masked_array(jnp.array([0.0, 50.0, 0.0]), jnp.array([True, False, True]))
    >>> mnn.softmax(x)
    MaskedArray([0.5 -- 0.5], dtype=float32)
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from masked_jax import _validate, ops
from masked_jax._core import MaskedArray, SparseMasked, unwrap, wrap
from masked_jax.numpy import _frontend

__all__ = ["dot_product_attention", "one_hot"]
_frontend.attach("nn", globals())


def one_hot(x: Any, num_classes: int, *, dtype: Any = None, axis: int = -1) -> MaskedArray:
    """One-hot encode integer ``x``; the encoding of a masked index is masked (all classes).

    Args:
        x: integer array or ``MaskedArray`` of class indices.
        num_classes: number of classes (static).
        dtype: dtype of the encoding (``None``: ``jax.nn.one_hot``'s default float).
        axis: where the class axis goes.

    Examples:
        >>> import jax.numpy as jnp, masked_jax as mj, masked_jax.nn as mnn
        >>> ids = mj.masked_array(jnp.array([2, 0]), jnp.array([True, False]))
        >>> mnn.one_hot(ids, 3)
        MaskedArray([[0.0 0.0 1.0]
                     [-- -- --]], dtype=float32)
    """
    p = unwrap(x, "x")
    num_classes = _validate.count(num_classes, "one_hot: num_classes")
    if not jnp.issubdtype(jnp.result_type(p.data), jnp.integer):
        raise TypeError(f"one_hot needs integer class indices; got dtype {jnp.result_type(p.data)}.")
    data = jax.nn.one_hot(
        p.data if p.mask is None else jnp.where(p.mask, p.data, 0),
        num_classes,
        axis=axis,
        **({} if dtype is None else {"dtype": dtype}),
    )
    if p.mask is None:
        return wrap(ops.Pair(data, None))
    mask = jnp.broadcast_to(jnp.expand_dims(p.mask, axis), data.shape)
    return wrap(ops.Pair(data, mask))


def dot_product_attention(
    query: Any,
    key: Any,
    value: Any,
    bias: Any = None,
    mask: Any = None,
    *,
    scale: float | None = None,
    is_causal: bool = False,
    query_seq_lengths: Any = None,
    key_value_seq_lengths: Any = None,
    local_window_size: Any = None,
    implementation: Any = None,
) -> Any:
    """``jax.nn.dot_product_attention`` of masked queries, keys and values (``(B, T, N, H)`` and
    ``(B, S, K, H)``, grouped-query heads included; ``(T, N, H)`` without a batch).

    A masked array's mask says which tokens are there: a token is valid where its mask is True
    for every head and feature (a ``(B, T, 1, 1)`` token mask is the usual form); a key is
    valid where its key and its value are. Each valid query attends to the valid keys only, and
    its output equals attention over its sequence with the padding removed, wherever the padding
    sits. The output is masked at a masked query and at a query that has no valid key to attend
    to (data 0, never NaN); masked-out data never reaches a valid output or a gradient.

    The padding goes to jax's fused call as sequence lengths: the valid tokens of every sequence
    are moved to its front (a stable gather, no ``T x S`` array), the call runs with
    ``key_value_seq_lengths`` (cuDNN's flash attention on a GPU, O(L) memory, with
    ``implementation=None`` or ``"cudnn"``), and the outputs are gathered back.
    Moving tokens keeps the order of the valid ones, so ``is_causal`` self-attention (query and
    key the same array, or sharing one mask) takes this path too. A ``bias``, a ``mask``, a
    ``local_window_size`` or causal attention between differently masked queries and keys depend
    on the tokens' positions: the padding then joins ``mask`` as a ``(B, 1, T, S)`` array.
    Sequence lengths given as arguments mask the tokens past them, as jax does. (The queries'
    padding is not passed on: their outputs are masked here, and it would add a query mask to the
    call's ``T x S`` work on the XLA path.)

    Examples:
        >>> import jax, jax.numpy as jnp, masked_jax as mj, masked_jax.nn as mnn
        >>> x = jax.random.normal(jax.random.key(0), (1, 4, 2, 8))
        >>> tokens = jnp.array([[True, True, False, True]])[:, :, None, None]
        >>> q = mj.masked_array(x, tokens)
        >>> out = mnn.dot_product_attention(q, q, q)
        >>> out.mask[0, :, 0, 0]
        Array([ True,  True, False,  True], dtype=bool)
        >>> alone = jax.nn.dot_product_attention(x[:, [0, 1, 3]], x[:, [0, 1, 3]], x[:, [0, 1, 3]])
        >>> bool(jnp.allclose(out.data[:, [0, 1, 3]], alone, atol=1e-6))
        True
    """
    q, q_valid = _tokens(query, "query")
    k, k_valid = _tokens(key, "key")
    v, v_valid = _tokens(value, "value")
    unbatched = q.ndim == 3
    if unbatched:
        q, k, v = q[None], k[None], v[None]
        q_valid, k_valid, v_valid = (None if t is None else t[None] for t in (q_valid, k_valid, v_valid))
    if not (q.ndim == k.ndim == v.ndim == 4):
        raise ValueError(
            "dot_product_attention: query, key and value must be (B, T, N, H) arrays (or (T, N, H)); "
            f"got shapes {q.shape}, {k.shape}, {v.shape}."
        )
    (b, t), s = q.shape[:2], k.shape[1]
    kv_valid = _both(k_valid, v_valid)
    if query_seq_lengths is not None:  # jax's lengths mask the tokens past them, as a mask does
        q_valid = _both(q_valid, jnp.arange(t) < _lengths(query_seq_lengths, b, "query_seq_lengths")[:, None])
    if key_value_seq_lengths is not None:
        kv_valid = _both(kv_valid, jnp.arange(s) < _lengths(key_value_seq_lengths, b, "key_value_seq_lengths")[:, None])
    options = {"scale": scale, "implementation": implementation}
    if q_valid is None and kv_valid is None:  # nothing masked: jax's call as it is
        out = jax.nn.dot_product_attention(
            q, k, v, bias, mask, is_causal=is_causal, local_window_size=local_window_size, **options
        )
        return out[0] if unbatched else out
    q_valid = jnp.ones((b, t), bool) if q_valid is None else q_valid
    kv_valid = jnp.ones((b, s), bool) if kv_valid is None else kv_valid
    # one token mask for queries and keys (self-attention): moving the tokens keeps causal order
    shared = (
        query_seq_lengths is None
        and key_value_seq_lengths is None
        and _same_tokens(query, key)
        and (not isinstance(value, MaskedArray) or value.compact_mask is None or _same_tokens(key, value))
    )
    positional = bias is not None or mask is not None or local_window_size is not None or (is_causal and not shared)
    if positional:  # the padding as a mask beside the user's
        pad = q_valid[:, None, :, None] & kv_valid[:, None, None, :]
        mask = pad if mask is None else jnp.asarray(mask, bool) & pad
        out = jax.nn.dot_product_attention(
            q, k, v, bias, mask, is_causal=is_causal, local_window_size=local_window_size, **options
        )
    else:  # the valid tokens to the front of each sequence, the padding as lengths
        q_order = jnp.argsort(~q_valid, axis=1, stable=True)
        kv_order = q_order if is_causal else jnp.argsort(~kv_valid, axis=1, stable=True)
        out = jax.nn.dot_product_attention(
            _gather(q, q_order),
            _gather(k, kv_order),
            _gather(v, kv_order),
            is_causal=is_causal,
            key_value_seq_lengths=jnp.sum(kv_valid, axis=1, dtype=jnp.int32),
            **options,
        )
        out = _gather(out, jnp.argsort(q_order, axis=1))  # back to each query's place
    # a query attends to something: a valid key (before it, or itself, under is_causal)
    if is_causal:
        reach = jnp.cumsum(kv_valid, axis=1)[:, jnp.minimum(jnp.arange(t), s - 1)] > 0 if s else jnp.zeros((b, t), bool)
    else:
        reach = jnp.broadcast_to(jnp.any(kv_valid, axis=1, keepdims=True), (b, t))
    valid = (q_valid & reach)[:, :, None, None]
    out = wrap(ops.Pair(jnp.where(valid, out, jnp.zeros((), out.dtype)), valid))  # a (B, T, 1, 1) token mask
    return out[0] if unbatched else out


def _tokens(x, name):
    """``(data, token validity)`` of an attention input: the data with masked entries set to 0
    (so that nothing masked reaches a sum), and per token (all axes but the first two) whether
    every entry is valid; ``None`` for a plain array."""
    if isinstance(x, SparseMasked):
        x = x.todense()
    if not isinstance(x, MaskedArray):
        return jnp.asarray(x), None
    if x.ndim not in (3, 4):
        raise ValueError(f"dot_product_attention: {name} must be (B, T, N, H) or (T, N, H); got shape {x.shape}.")
    if x.compact_mask is None:
        return x.data, None
    token_axes = tuple(range(x.ndim - 2, x.ndim))
    valid = jnp.all(jnp.broadcast_to(x.mask, x.shape), axis=token_axes)
    return jnp.where(x.mask, x.data, jnp.zeros((), x.dtype)), valid


def _lengths(x, batch, name):
    """Sequence lengths ``x``: one integer per sequence of the batch."""
    x = jnp.asarray(x)
    if x.shape != (batch,) or not jnp.issubdtype(x.dtype, jnp.integer):
        raise ValueError(
            f"dot_product_attention: {name} must hold one integer per sequence, shape ({batch},); "
            f"got {x.dtype} of shape {x.shape}."
        )
    return x


def _same_tokens(a, b) -> bool:
    """Whether ``a`` and ``b`` are one array, or masked arrays holding one mask object."""
    return a is b or (isinstance(a, MaskedArray) and isinstance(b, MaskedArray) and a.compact_mask is b.compact_mask)


def _both(a, b):
    return b if a is None else a if b is None else a & b


def _gather(x, order):
    """``x`` (``(B, L, ...)``) with each sequence's tokens taken in ``order`` (``(B, L)``)."""
    return jnp.take_along_axis(x, order.reshape(order.shape + (1,) * (x.ndim - 2)), axis=1)
