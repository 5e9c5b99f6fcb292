"""Masked semantics, one rule per op, grouped by family.

Each family module exposes ``RULES``: a mapping from op name to a rule working
on :class:`~masked_jax.ops._base.Pair` values. ``masked_jax.numpy``,
``masked_jax.nn`` and the ``MaskedArray`` operators are thin wrappers over
these rules, so each op's semantics lives in exactly one place.
"""

from masked_jax.ops import binary, elementwise, linalg, normalization, reductions, shape
from masked_jax.ops._base import Pair

FAMILIES = {
    "elementwise": elementwise.RULES,
    "binary": binary.RULES,
    "reductions": reductions.RULES,
    "normalization": normalization.RULES,
    "shape": shape.RULES,
    "linalg": linalg.RULES,
}

RULES = {name: rule for family in FAMILIES.values() for name, rule in family.items()}

__all__ = ["FAMILIES", "Pair", "RULES"]
