"""``ArrayMethods``: the methods and operators every masked array class gets from the op registry.

At runtime the class body is empty: :mod:`masked_jax._frontend` binds each registered op's
``methods`` (``sum``, ``reshape``, ``__add__``, ``__radd__``, ...) here, so ``MaskedArray`` and the
sparse layouts, which subclass it, have them. ``_methods.pyi`` beside this file declares them for
static type checkers; it is generated from the registry (``python -m masked_jax._stubgen``) and a
test keeps it in sync.
"""


class ArrayMethods:
    """Base of the masked array classes: methods and operators derived from the op registry."""

    __slots__ = ()
