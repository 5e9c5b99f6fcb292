"""Asking the mask inside a maskified function: :func:`mask_of` and :func:`lengths`.

Inside :func:`masked_jax.maskify` the function sees plain arrays; a call of :func:`mask_of` on one
of them is a named ``jit`` call that the interpreter answers with that value's validity (a plain
boolean array, in the padded coordinates the value is stored in). Outside ``maskify`` the same
call returns a :class:`~masked_jax.MaskedArray`'s mask, and all ``True`` for a plain array, so the
function keeps working unmasked.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from masked_jax._core import as_masked, is_masked

NAME = "masked_jax_mask_of"  # the name of the jit call the interpreter answers


def masked_jax_mask_of(x):
    # all True, computed from ``x`` so that ``vmap`` batches it with ``x``
    return jnp.logical_or(True, jnp.asarray(x) != jnp.asarray(x))


_ASK = jax.jit(masked_jax_mask_of)


def mask_of(x) -> jax.Array:
    """The validity of ``x`` as a plain boolean array of ``x``'s shape (``True`` = valid).

    Inside a function run by :func:`masked_jax.maskify` it reads the mask of the value it is given
    (an input, or anything computed from one), so code that needs positions or counts from the
    mask stays inside the function. The answer is in the coordinates the value is stored in: entry
    ``i`` of the result says whether entry ``i`` of ``x`` is valid. Outside ``maskify`` it returns
    a :class:`~masked_jax.MaskedArray`'s mask broadcast to its shape, and all ``True`` for a plain
    array.

    Examples:
        >>> import jax.numpy as jnp, masked_jax as mj
        >>> x = mj.masked_array(jnp.arange(4.0), jnp.array([True, False, True, True]))
        >>> mj.maskify(lambda v: mj.mask_of(v))(x)
        Array([ True, False,  True,  True], dtype=bool)
        >>> mj.mask_of(jnp.zeros(2))
        Array([ True,  True], dtype=bool)

        Positions among the valid tokens, from the mask (each valid token's rank):

        >>> pos = mj.maskify(lambda v: jnp.cumsum(mj.mask_of(v)) - 1)(x)
        >>> pos[jnp.array([0, 2, 3])]
        Array([0, 1, 2], dtype=int32)
    """
    if is_masked(x):
        m = as_masked(x)
        return jnp.broadcast_to(m.mask, m.shape)
    return _ASK(x)


def lengths(x, axis: int = 1) -> jax.Array:
    """The number of valid entries of ``x`` along ``axis`` (a token axis), per entry of the axes
    before it: an entry counts when any of its values (along the axes after ``axis``, the
    features) is valid. For ``(batch, tokens, features)`` input and ``axis=1``, each example's
    length, ``(batch,)``.

    Works inside :func:`masked_jax.maskify` (see :func:`mask_of`) and outside it.

    Examples:
        >>> import jax.numpy as jnp, masked_jax as mj
        >>> x = mj.masked_array(jnp.ones((2, 3, 4)), jnp.array([[1, 1, 0], [0, 1, 1]], bool)[..., None])
        >>> mj.maskify(lambda v: mj.lengths(v))(x)
        Array([2, 2], dtype=int32)
        >>> mj.lengths(jnp.ones((2, 3, 4)))
        Array([3, 3], dtype=int32)
    """
    if isinstance(axis, bool) or not isinstance(axis, (int, np.integer)):
        raise TypeError(f"lengths: axis must be an int, got {type(axis).__name__} {axis!r}.")
    m = mask_of(x)
    n = np.ndim(m)
    if not -n <= axis < n:
        raise ValueError(f"lengths: axis {axis} is out of range for an array of {n} dimensions.")
    axis %= n
    after = tuple(range(axis + 1, n))
    tokens = jnp.any(m, axis=after) if after else m
    return jnp.sum(tokens, axis=axis, dtype=jnp.int32)
