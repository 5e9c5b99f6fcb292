"""The optimizer state as seen through the parameters: its parameter-shaped subtrees (adam's
``mu`` and ``nu``, momentum traces, adagrad sums) and its global leaves (step counts)."""

from __future__ import annotations

from typing import NamedTuple

import jax
import numpy as np

from masked_jax._core import is_container


class _Reference(NamedTuple):
    """The parameters' tree structure and leaf shapes, read off the gradient (or the parameters)."""

    treedef: object
    shapes: tuple

    @classmethod
    def of(cls, tree):
        leaves, treedef = jax.tree_util.tree_flatten(tree, is_leaf=is_container)
        return cls(treedef, tuple(np.shape(x) if not is_container(x) else x.shape for x in leaves))

    def matches(self, node) -> bool:
        """Is ``node`` a parameter-shaped subtree of the optimizer state (e.g. adam's ``mu``)?"""
        leaves, treedef = jax.tree_util.tree_flatten(node)
        return treedef == self.treedef and tuple(np.shape(x) for x in leaves) == self.shapes


def _map_param_shaped(ref: _Reference, fn, state, *rest):
    """Apply ``fn(leaves_of_state_subtree, *leaves_of_rest_subtrees) -> leaves`` to every
    parameter-shaped subtree of ``state``; global leaves (step counts, keys) come from the last tree."""

    def one(node, *others):
        if not ref.matches(node):
            return others[-1] if others else node
        leaves, treedef = jax.tree_util.tree_flatten(node)
        other_leaves = [jax.tree_util.tree_leaves(o) for o in others]
        return jax.tree_util.tree_unflatten(treedef, fn(leaves, *other_leaves))

    return jax.tree_util.tree_map(one, state, *rest, is_leaf=ref.matches)
