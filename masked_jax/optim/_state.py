"""The optimizer state as seen through the parameters: its parameter-shaped subtrees (adam's
``mu`` and ``nu``, momentum traces, adagrad sums) and its global leaves (step counts)."""

from __future__ import annotations

from typing import NamedTuple

import jax
import numpy as np
import optax

from masked_jax._core import is_masked_leaf


class _Reference(NamedTuple):
    """The parameters' tree structure and leaf shapes, read off the gradient (or the parameters)."""

    treedef: object
    shapes: tuple

    @classmethod
    def of(cls, tree):
        leaves, treedef = jax.tree_util.tree_flatten(tree, is_leaf=is_masked_leaf)
        return cls(treedef, tuple(np.shape(x) if not is_masked_leaf(x) else x.shape for x in leaves))

    def rows(self) -> _Reference:
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


class ScaleByRowwiseRssState(NamedTuple):
    """State of :func:`scale_by_rowwise_rss`: per leaf, one running sum per row (shape ``(N,)``)
    for a table of shape ``(N, ...)``, one per entry for scalars and vectors.

    Examples:
        >>> import jax.numpy as jnp
        >>> from masked_jax import optim
        >>> state = optim.scale_by_rowwise_rss().init({"table": jnp.zeros((1000, 64)), "bias": jnp.zeros(3)})
        >>> state.sum_of_squares["table"].shape, state.sum_of_squares["bias"].shape
        ((1000,), (3,))
    """

    sum_of_squares: optax.Params


# What make_train_step needs to know of a transformation, declared by the factory that builds it
# as attributes of its ``update`` function (optax's GradientTransformation is a NamedTuple of two
# functions: it has no room for more):
# * ``lazy(inner)`` declares ``inner``, so that a table can be updated in chunks of rows, or by
#   the fused kernel, with ``inner``'s own update;
# * a transformation that updates each row of a table from that row alone (its gradient, its
#   parameter, its parameter- or row-shaped state) and scalar global state declares itself
#   row-local (``rowwise_adagrad``): a table may be updated a block of rows at a time.
_LAZY_INNER = "_masked_jax_lazy_inner"
_ROW_LOCAL = "_masked_jax_row_local"


def declare_lazy(opt, inner):
    """Mark ``opt`` (a ``GradientTransformation``) as the lazy lift of ``inner``; returns ``opt``."""
    setattr(opt.update, _LAZY_INNER, inner)
    return opt


def lazy_inner(opt):
    """The transformation that ``opt`` lifts, if :func:`declare_lazy` marked it; else ``None``."""
    return getattr(getattr(opt, "update", None), _LAZY_INNER, None)


def declare_row_local(opt):
    """Mark ``opt`` as updating each row of a table from that row alone; returns ``opt``."""
    setattr(opt.update, _ROW_LOCAL, True)
    return opt


def is_row_local(opt) -> bool:
    """Did :func:`declare_row_local` mark ``opt``?"""
    return getattr(getattr(opt, "update", None), _ROW_LOCAL, False)
