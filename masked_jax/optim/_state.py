"""The optimizer state as seen through the parameters: its parameter-shaped subtrees (adam's
``mu`` and ``nu``, momentum traces, adagrad sums) and its global leaves (step counts)."""

from __future__ import annotations

import weakref
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

    def rows(self) -> "_Reference":
        """The reference for row-shaped state: one value per row of each leaf (``(N,)`` for an
        ``(N, ...)`` leaf; vectors and scalars keep their shape), as row-wise Adagrad's sums."""
        return _Reference(self.treedef, tuple(s[:1] if len(s) >= 2 else s for s in self.shapes))

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


def _map_local(ref: _Reference, fn, state):
    """``_map_param_shaped`` over the parameter-shaped subtrees of ``state`` and then its
    row-shaped ones (:meth:`_Reference.rows`): ``fn(leaves, per_row)``, ``per_row`` telling which."""
    marked = _map_param_shaped(ref, lambda leaves: fn(leaves, False), state)
    return _map_param_shaped(ref.rows(), lambda leaves: fn(leaves, True), marked)


def _local_from(ref: _Reference, new, old):
    """The state with its per-entry and per-row subtrees (parameter- and row-shaped) from ``new``
    and its global leaves (step counts) from ``old``."""
    mine = lambda new_leaves, old_leaves: new_leaves  # noqa: E731
    return _map_param_shaped(ref.rows(), mine, new, _map_param_shaped(ref, mine, new, old))


# update functions of transformations that update each row of a table from that row alone (its
# gradient, its parameter, its parameter- or row-shaped state) and scalar global state: a table
# may be updated a block of rows at a time (``rowwise_adagrad``)
ROW_LOCAL: "weakref.WeakSet" = weakref.WeakSet()
