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
from masked_jax._core import MaskedArray, unwrap, wrap
from masked_jax.numpy import _frontend

__all__ = ["one_hot"]
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
