"""``MaskifyError``, and the message for a primitive without a masked meaning met inside a public
``jax.numpy`` / ``jax.nn`` function: that function first, the masked function to call instead.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from masked_jax import nn as mnn
from masked_jax import numpy as mnp


class MaskifyError(NotImplementedError):
    """A primitive reached by a masked operand has no masked rule (see ``primitives.UNSUPPORTED``).

    Examples:
        >>> import jax.numpy as jnp, masked_jax as mj
        >>> x = mj.masked_array(jnp.eye(2), jnp.array([[True, False], [True, True]]))
        >>> try:
        ...     mj.maskify(jnp.linalg.cholesky)(x)
        ... except mj.MaskifyError as err:
        ...     print("cholesky" in str(err))
        True
    """

    detail: str | None = None  # the primitive's own message, when raised inside a public function


def _public_name(name):
    """``"jnp.searchsorted"`` for the jit call of a public ``jax.numpy`` / ``jax.nn`` function, else
    ``None`` (jax's internal helpers start with ``_``)."""
    if not name or name.startswith("_"):
        return None
    for label, module in (("jnp", jnp), ("jax.nn", jax.nn)):
        if callable(getattr(module, name, None)):
            return f"{label}.{name}"
    return None


def _inside_public_call(fun_name, user, err):
    """The message for a primitive without a masked meaning met inside ``user`` (a jax function):
    the user-level function first, the masked function to call instead where there is one, the
    primitive's detail last."""
    short = user.split(".")[-1]
    module = mnn if user.startswith("jax.nn") else mnp
    instead = (
        f" Call masked_jax.{module.__name__.split('.')[-1]}.{short}, its masked version, directly"
        + (
            " (jnp.interp and jnp.histogram call jnp.searchsorted: masked_jax.numpy.interp and "
            "masked_jax.numpy.histogram are theirs)."
            if short == "searchsorted"
            else "."
        )
        if hasattr(module, short)
        else " Fill the operand first (x.filled(...))."
    )
    detail = getattr(err, "detail", None) or str(err).split(": ", 1)[-1]
    return (
        f"maskify({fun_name}): {user} is not supported on a masked operand; its implementation "
        f"reads elements in a way that has no masked meaning.{instead} (Inside {user}: {detail})"
    )
