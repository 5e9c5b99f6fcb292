"""``ArrayMethods``: the methods and operators every masked array class gets from the op registry.

:mod:`masked_jax.numpy` installs the methods here once it is built, as ``jax.numpy`` installs
``jax.Array``'s: each registered op's ``methods`` (``sum``, ``reshape``, ``__add__``, ``__radd__``,
...), and the few methods of ``jax.Array`` that are not one op of the registry, each of which calls
the public function of the same name (which dispatches on the layout). ``MaskedArray`` and the
sparse layouts subclass it, so they all have them. The class body holds the methods that need no
``masked_jax.numpy`` function.

``_methods.pyi`` beside this file declares them all for static type checkers; it is generated
(``python -m masked_jax._stubgen``) and a test keeps it in sync.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, TypeVar

import jax
import jax.numpy as jnp

if TYPE_CHECKING:
    from masked_jax._core import MaskedArray


_X = (
    ">>> import jax.numpy as jnp, masked_jax as mj\n"
    "            >>> x = mj.masked_array(jnp.array([[1.5, 2.0], [3.0, 4.5]]), jnp.array([[True, False], [True, True]]))"
)


def method_example(call: str, result: str) -> str:
    """An Examples section for a method's docstring: ``x.<call>`` on a small 2x2 array, and what it prints."""
    return f"\n\n        Examples:\n            {_X}\n            >>> {call}\n            {result}\n        "


_Self = TypeVar("_Self")


class ArrayMethods:
    """Base of the masked array classes: methods and operators derived from the op registry."""

    __slots__ = ()

    def copy(self) -> MaskedArray:
        return jax.tree_util.tree_map(lambda v: jnp.array(v, copy=True), self)

    copy.__doc__ = (
        "A copy of the data and mask (jax arrays are immutable: it matters only for buffer donation)."
        + method_example("x.copy().mask.sum()", "Array(3, dtype=int32)")
    )

    def block_until_ready(self: _Self) -> _Self:
        jax.block_until_ready(jax.tree_util.tree_leaves(self))
        return self

    block_until_ready.__doc__ = (
        "Wait until data and mask are computed (for timing); returns ``self``."
        + method_example("x.block_until_ready() is x", "True")
    )
