"""Masked semantics: every op declared once in the registry, its rule grouped by family.

Importing this package registers every op (:data:`REGISTRY`, see :mod:`._registry`). Rules work
on :class:`~masked_jax.ops._base.Pair` values; ``masked_jax.numpy``, ``masked_jax.nn``, the
``MaskedArray`` methods and operators, ``maskify`` and the sparse layouts are derived from the
specs, so each op's semantics lives in exactly one place. A new op is one
``register(OpSpec(..., signature=rule_signature(rule)))`` with the names exported here (see
``docs/adding_ops.md``).
"""

from masked_jax.ops import binary, elementwise, linalg, normalization, reductions, shape, statistics  # noqa: F401
from masked_jax.ops._base import Pair
from masked_jax.ops._registry import FAMILIES, REGISTRY, OpSpec, register, rule_signature, unregister

__all__ = ["FAMILIES", "OpSpec", "Pair", "REGISTRY", "register", "rule_signature", "unregister"]
