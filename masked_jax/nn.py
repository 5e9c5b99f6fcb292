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
    return_residual: bool = False,
) -> Any:
    """``jax.nn.dot_product_attention`` of masked queries, keys and values (``(B, T, N, H)`` and
    ``(B, S, K, H)``, grouped-query heads included; ``(T, N, H)`` without a batch).

    A masked array's mask says which tokens are there: a token is valid where its mask is True
    for every head and feature (a ``(B, T, 1, 1)`` token mask is the usual form); a key is
    valid where its key and its value are. Each valid query attends to the valid keys only, and
    its output equals attention over its sequence with the padding removed, wherever the padding
    sits. The output is masked at a masked query and at a query that sees no valid key (none at
    all, none before it under ``is_causal``, none its ``mask`` row or ``local_window_size`` lets
    through; data 0, never NaN, where jax would spread its weights over every key, the padding
    included); masked-out data never reaches a valid output or a gradient.

    How the padding reaches jax's call depends on the implementation:

    * ``implementation=None`` or ``"xla"`` (jax's XLA path, which computes the ``T x S`` scores
      anyway): the keys' padding goes as a ``(B, 1, 1, S)`` mask beside the user's ``mask``, the
      padded tokens staying in place; the program is the one a user writes with
      ``mask=tokens[:, None, None, :]``.
    * ``implementation="cudnn"`` (cuDNN's flash attention on a GPU, O(L) memory, no ``T x S``
      array): the padding goes as ``key_value_seq_lengths``. The valid keys and values of every
      sequence move to its front (a stable gather; the queries too under ``is_causal``, and their
      outputs move back). Moving tokens keeps the order of the valid ones, so ``is_causal``
      self-attention takes this path when queries and keys are masked alike (one mask array; for
      separate arrays the call checks on the device that they are equal, a ``lax.cond``). A
      ``bias``, a ``mask`` or a ``local_window_size`` depend on the tokens' places: the padding
      then goes as a mask, as on the XLA path.

    Sequence lengths given as arguments mask the tokens past them, as jax does. The queries'
    padding is not passed on: their outputs are masked here, and a query mask would add to the
    call's ``T x S`` work. A ``bias`` at a masked output's row or a padded key's column goes to
    jax's call as 0: a -inf or NaN there (``where(q_valid & k_valid, 0, -inf)``) sends no NaN into
    the gradients of the valid tokens, which equal the unpadded run's.

    ``return_residual=True`` returns ``(output, residual)`` as jax does: the residual is the
    logsumexp of each query's logits over the keys it sees, ``(B, T, N)`` (``(T, N)`` without a
    batch), masked where the output is (data 0).

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
        bias, mask = (jnp.asarray(a)[None] if a is not None and jnp.ndim(a) == 3 else a for a in (bias, mask))
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
    options = {"scale": scale, "implementation": implementation, "return_residual": bool(return_residual)}
    if q_valid is None and kv_valid is None:  # nothing masked: jax's call as it is
        out = jax.nn.dot_product_attention(
            q, k, v, bias, mask, is_causal=is_causal, local_window_size=local_window_size, **options
        )
        return jax.tree_util.tree_map(lambda a: a[0], out) if unbatched else out
    q_valid = jnp.ones((b, t), bool) if q_valid is None else q_valid
    kv_valid = jnp.ones((b, s), bool) if kv_valid is None else kv_valid
    # one token mask for queries and keys (self-attention): moving the tokens keeps causal order
    shared = (
        query_seq_lengths is None
        and key_value_seq_lengths is None
        and _same_tokens(query, key)
        and (not isinstance(value, MaskedArray) or value.compact_mask is None or _same_tokens(key, value))
    )
    fused = implementation == "cudnn" and bias is None and mask is None and local_window_size is None

    # a query attends to something: a valid key that the call lets it see (jax would spread an
    # unseeing query's weights evenly over every key, the padding included)
    if mask is not None or local_window_size is not None:
        valid = q_valid[:, :, None, None] & _seen(kv_valid, mask, is_causal, local_window_size, t, s)
    else:
        if is_causal:
            cs = jnp.cumsum(kv_valid, axis=1)
            reach = cs[:, jnp.minimum(jnp.arange(t), s - 1)] > 0 if s else jnp.zeros((b, t), bool)
        else:
            reach = jnp.broadcast_to(jnp.any(kv_valid, axis=1, keepdims=True), (b, t))
        valid = (q_valid & reach)[:, :, None, None]  # a (B, T, 1, 1) token mask
    if bias is not None:
        # The bias of a masked output's row and of a padded key's column reaches nothing the
        # unpadded run computes, but a -inf or NaN there (a bias built as ``where(q_valid &
        # k_valid, 0, -inf)``) makes that row's softmax NaN, and its backward pass sends the NaN to
        # every key and value: those entries go as 0 (no gradient reaches them either).
        bias = jnp.asarray(bias)
        seen = jnp.swapaxes(valid, 1, 2) & kv_valid[:, None, None, :]  # (B, N or 1, T, S)
        bias = jnp.where(seen, bias, jnp.zeros((), bias.dtype))

    def by_position():  # the keys' padding as a (B, 1, 1, S) mask beside the user's
        pad = kv_valid[:, None, None, :]
        both = pad if mask is None else jnp.asarray(mask, bool) & pad
        return jax.nn.dot_product_attention(
            q, k, v, bias, both, is_causal=is_causal, local_window_size=local_window_size, **options
        )

    def by_lengths():  # the valid keys to the front of each sequence, the padding as lengths
        kv_order = jnp.argsort(~kv_valid, axis=1, stable=True)
        # a query's place matters only under is_causal: the queries then move with the keys
        moved = jax.nn.dot_product_attention(
            _gather(q, kv_order) if is_causal else q,
            _gather(k, kv_order),
            _gather(v, kv_order),
            is_causal=is_causal,
            key_value_seq_lengths=jnp.sum(kv_valid, axis=1, dtype=jnp.int32),
            **options,
        )
        if not is_causal:
            return moved
        back = jnp.argsort(kv_order, axis=1)  # back in place
        return jax.tree_util.tree_map(lambda a: _gather(a, back), moved)

    if not fused or (is_causal and not shared and t != s):
        out = by_position()
    elif not is_causal or shared:
        out = by_lengths()
    else:  # causal, queries and keys masked by separate arrays: by lengths where they are one mask
        out = jax.lax.cond(jnp.array_equal(q_valid, kv_valid), by_lengths, by_position)
    if return_residual:
        out, residual = out
        res_valid = jnp.broadcast_to(valid[..., 0], residual.shape)  # (B, T, N): where the output is valid
        residual = wrap(ops.Pair(jnp.where(res_valid, residual, jnp.zeros((), residual.dtype)), res_valid))
    out = wrap(ops.Pair(jnp.where(valid, out, jnp.zeros((), out.dtype)), valid))
    if return_residual:
        return (out[0], residual[0]) if unbatched else (out, residual)
    return out[0] if unbatched else out


def _seen(kv_valid, mask, is_causal, window, t, s):
    """``(B, T, N or 1, 1)``: whether a query sees a valid key through the user's ``mask``, under
    ``is_causal`` (key ``j <= i``) and inside a ``local_window_size`` (``i - left <= j <= i +
    right``), as jax's call combines them."""
    allowed = kv_valid[:, None, None, :]
    if mask is not None:
        allowed = allowed & jnp.asarray(mask, bool)
    i, j = jnp.arange(t)[:, None], jnp.arange(s)[None, :]
    if is_causal:
        allowed = allowed & (j <= i)
    if window is not None:
        left, right = (window, window) if isinstance(window, int) else window
        allowed = allowed & (i <= j + left) & (i >= j - right)
    return jnp.moveaxis(jnp.any(allowed, axis=-1), 1, 2)[..., None]


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
