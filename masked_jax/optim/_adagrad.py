"""Masked Adagrad: optax's adagrad as a chain of small transforms that update only valid entries.

``scale_by_rss`` reads masked and row-sparse gradients itself: its sums of squares only grow,
so they are updated by adding ``g**2`` where the gradient is valid (a scatter-add into the
stored rows, in place under donation). ``masked_adagrad`` nevertheless runs it inside
:func:`lazy` (gather, update, scatter of the touched rows), the faster of the two on XLA:CPU
(``benchmarks/README.md``). The values are the same up to one rounding (XLA may fuse
``g * g + s`` into an FMA in one program and not the other).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

from masked_jax import _validate
from masked_jax._core import is_masked_leaf
from masked_jax.ops._base import accumulation_dtype
from masked_jax.optim._lazy import lazy
from masked_jax.optim._state import ScaleByRowwiseRssState, declare_row_local
from masked_jax.optim._views import data_of, view

_PLACEMENTS = ("inside", "outside")


def _inverse_root(name, initial_accumulator_value, eps, eps_placement):
    """Check the arguments shared by the sums-of-squares transforms; ``t -> 1 / root(t)`` with eps
    inside or outside the root, 0 where the sum is 0."""
    _validate.nonnegative(initial_accumulator_value, f"{name}: initial_accumulator_value")
    _validate.nonnegative(eps, f"{name}: eps")
    if eps_placement not in _PLACEMENTS:
        raise ValueError(f"eps_placement must be one of {_PLACEMENTS}; got {eps_placement!r}.")

    def inverse_root(t):
        if eps_placement == "inside":
            return jnp.where(t > 0, jax.lax.rsqrt(t + eps), 0.0)
        return jnp.where(t > 0, 1.0 / (jnp.sqrt(t) + eps), 0.0)

    return inverse_root


def scale_by_rss(
    initial_accumulator_value: float = 0.1, eps: float = 1e-7, eps_placement: str = "inside"
) -> optax.GradientTransformation:
    """Scale updates by the inverse root of the running sum of squared gradients.

    .. math::
        s_t = s_{t-1} + g_t^2, \\qquad
        u_t = g_t / \\sqrt{s_t + \\epsilon} \\;(\\text{inside}) \\quad\\text{or}\\quad
        u_t = g_t / (\\sqrt{s_t} + \\epsilon) \\;(\\text{outside})

    ``"inside"`` is optax's ``scale_by_rss`` (bit for bit, including its zero update
    where the sum is 0); ``"outside"`` is torch's and TensorFlow's Adagrad. The state
    is optax's ``ScaleByRssState``.

    Gradient leaves may also be ``MaskedArray`` objects or :class:`RowSparseArray` objects: the sums
    change only where the gradient is valid (for row-sparse gradients by a scatter-add
    of ``g**2`` into the K stored rows, duplicates summed first), and the updates come
    back in the gradient's storage. Masked parameters are read through their data.

    Args:
        initial_accumulator_value: starting value of the sums, >= 0.
        eps: small constant keeping the denominator away from 0.
        eps_placement: ``"inside"`` or ``"outside"`` the square root.

    Examples:
        >>> import jax.numpy as jnp
        >>> from masked_jax import optim
        >>> t = optim.scale_by_rss(initial_accumulator_value=0.0, eps_placement="outside")
        >>> t.update(jnp.array([3.0]), t.init(jnp.zeros(1)))[0]
        Array([1.], dtype=float32)
        >>> import masked_jax as mj
        >>> g = mj.row_sparse(jnp.array([[3.0], [4.0]]), jnp.array([2, 2]), (4, 1))  # rows summed
        >>> u, state = t.update(g, t.init(jnp.zeros((4, 1))))
        >>> u.todense().filled(0)[:, 0], state.sum_of_squares[:, 0]
        (Array([0., 0., 1., 0.], dtype=float32), Array([ 0.,  0., 49.,  0.], dtype=float32))
    """
    inverse_root = _inverse_root("scale_by_rss", initial_accumulator_value, eps, eps_placement)

    def init_fn(params):
        params = jax.tree_util.tree_map(data_of, params, is_leaf=is_masked_leaf)
        return optax.ScaleByRssState(
            sum_of_squares=jax.tree_util.tree_map(lambda p: jnp.full_like(p, initial_accumulator_value), params)
        )

    def update_fn(updates, state, params=None):
        del params
        if not isinstance(state, optax.ScaleByRssState):
            raise ValueError(
                f"scale_by_rss: state must be the ScaleByRssState its init returned; got {type(state).__name__}."
            )
        leaves, treedef = jax.tree_util.tree_flatten(updates, is_leaf=is_masked_leaf)
        sums = jax.tree_util.tree_leaves(state.sum_of_squares)
        if len(sums) != len(leaves) or any(
            tuple(np.shape(t)) != tuple(g.shape if is_masked_leaf(g) else np.shape(g)) for g, t in zip(leaves, sums)
        ):
            raise ValueError(
                "scale_by_rss: the state's sums of squares have shapes "
                f"{[tuple(np.shape(t)) for t in sums]} but the gradients "
                f"{[tuple(g.shape if is_masked_leaf(g) else np.shape(g)) for g in leaves]}; pass the state "
                "init returned for these parameters."
            )
        new_updates, new_sums = [], []
        for g, t in zip(leaves, treedef.flatten_up_to(state.sum_of_squares)):
            v, data = view(g)  # plain: all of it; masked: valid entries; row-sparse: coalesced rows
            t = v.add(t, (data.conj() * data).real)  # only valid entries grow
            new_sums.append(t)
            new_updates.append(v.wrap(inverse_root(v.gather(t)).astype(data.dtype) * data))
        return (
            jax.tree_util.tree_unflatten(treedef, new_updates),
            optax.ScaleByRssState(sum_of_squares=jax.tree_util.tree_unflatten(treedef, new_sums)),
        )

    return optax.GradientTransformation(init_fn, update_fn)


def masked_adagrad(
    learning_rate: optax.ScalarOrSchedule,
    initial_accumulator_value: float = 0.1,
    eps: float = 1e-7,
    *,
    eps_placement: str = "inside",
) -> optax.GradientTransformation:
    """Adagrad that updates the accumulator and the parameters only where the gradient is valid.

    ``lazy(chain(scale_by_rss(...), scale_by_learning_rate(learning_rate)))``: the same
    state as ``optax.adagrad``, and the same path as ``lazy(optax.adagrad(...))`` (one
    coalesce, one gather and one scatter of the touched rows). With a plain-array gradient it is ``optax.adagrad`` (with the default
    ``eps_placement="inside"``). With a ``MaskedArray`` or :class:`RowSparseArray`
    gradient, entries where it is not valid keep their accumulator and parameter
    bit-identical; for row-sparse gradients the work is O(rows touched).
    ``eps_placement="outside"`` gives torch's ``Adagrad`` (``lr_decay=0``) and the
    MaskedTensor seed's numbers.

    Args:
        learning_rate: a float or an optax schedule.
        initial_accumulator_value: starting value of the sums of squares.
        eps: small constant in the denominator.
        eps_placement: ``"inside"`` (optax) or ``"outside"`` (torch, TensorFlow) the square root.

    Examples:
        >>> import jax.numpy as jnp, masked_jax as mj
        >>> from masked_jax import optim
        >>> param = jnp.arange(4.0)
        >>> grad = mj.masked_array(jnp.array([3.0, 0.0, 5.0, 0.0]), jnp.array([True, False, True, False]))
        >>> opt = optim.masked_adagrad(0.1, initial_accumulator_value=0.5, eps=1e-10,
        ...                            eps_placement="outside")
        >>> state = opt.init(param)
        >>> updates, state = opt.update(grad, state)
        >>> optim.apply_updates(param, updates)
        Array([-0.09733285,  1.        ,  1.9009852 ,  3.        ], dtype=float32)

    References:
        Duchi, Hazan and Singer, Adaptive Subgradient Methods for Online Learning and
        Stochastic Optimization, JMLR 2011.
    """
    _validate.learning_rate(learning_rate, "masked_adagrad: learning_rate")
    return lazy(
        optax.chain(
            scale_by_rss(initial_accumulator_value, eps, eps_placement),
            optax.scale_by_learning_rate(learning_rate),
        )
    )


def _row_axes(ndim: int) -> tuple:
    return tuple(range(1, ndim)) if ndim >= 2 else ()


def scale_by_rowwise_rss(
    initial_accumulator_value: float = 0.0, eps: float = 1e-8, eps_placement: str = "outside"
) -> optax.GradientTransformation:
    """Scale each row of a table by the inverse root of one running sum per row.

    .. math::
        s_{t,r} = s_{t-1,r} + \\operatorname{mean}_j g_{t,rj}^2, \\qquad
        u_{t,rj} = g_{t,rj} / (\\sqrt{s_{t,r}} + \\epsilon)

    FBGEMM's ``EXACT_ROWWISE_ADAGRAD``: a leaf of shape ``(N, ...)`` keeps ``N`` sums, the mean
    square of each row's gradient added per step, so its state is ``prod(shape[1:])`` times
    smaller than Adagrad's. Leaves with fewer than two dimensions keep one sum per entry
    (plain Adagrad). The sums of bfloat16 and float16 leaves are float32 (a bfloat16 sum stops
    growing at 256). ``eps_placement="inside"`` takes ``1 / sqrt(s + eps)`` instead.

    Gradient leaves may be ``MaskedArray`` objects (a row's sum grows by the mean over the row of
    the valid entries' squares, counting masked entries as 0; only valid entries are updated) or
    :class:`RowSparseArray` objects (duplicates summed first; only the stored rows' sums change,
    by a scatter-add, O(rows touched)).

    Args:
        initial_accumulator_value: starting value of the sums, >= 0.
        eps: small constant keeping the denominator away from 0.
        eps_placement: ``"outside"`` (FBGEMM, torch) or ``"inside"`` the square root.

    Examples:
        >>> import jax.numpy as jnp, masked_jax as mj
        >>> from masked_jax import optim
        >>> t = optim.scale_by_rowwise_rss()
        >>> state = t.init(jnp.zeros((5, 2)))
        >>> state.sum_of_squares.shape
        (5,)
        >>> g = mj.row_sparse(jnp.array([[3.0, 4.0]]), jnp.array([1]), (5, 2))
        >>> u, state = t.update(g, state)
        >>> u.todense().filled(0)[1], state.sum_of_squares
        (Array([0.84852815, 1.1313709 ], dtype=float32), Array([ 0. , 12.5,  0. ,  0. ,  0. ], dtype=float32))
    """
    inverse_root = _inverse_root("scale_by_rowwise_rss", initial_accumulator_value, eps, eps_placement)

    def init_fn(params):
        params = jax.tree_util.tree_map(data_of, params, is_leaf=is_masked_leaf)
        return ScaleByRowwiseRssState(
            sum_of_squares=jax.tree_util.tree_map(
                lambda p: jnp.full(
                    np.shape(p)[:1] if np.ndim(p) >= 2 else np.shape(p),
                    initial_accumulator_value,
                    accumulation_dtype(jnp.result_type(p)),
                ),
                params,
            )
        )

    def update_fn(updates, state, params=None):
        del params
        if not isinstance(state, ScaleByRowwiseRssState):
            raise ValueError(
                f"scale_by_rowwise_rss: state must be the ScaleByRowwiseRssState its init returned; "
                f"got {type(state).__name__}."
            )
        leaves, treedef = jax.tree_util.tree_flatten(updates, is_leaf=is_masked_leaf)
        sums = jax.tree_util.tree_leaves(state.sum_of_squares)
        shapes = [tuple(g.shape if is_masked_leaf(g) else np.shape(g)) for g in leaves]
        expected = [s[:1] if len(s) >= 2 else s for s in shapes]
        if [tuple(np.shape(t)) for t in sums] != expected:
            raise ValueError(
                f"scale_by_rowwise_rss: the state's sums have shapes {[tuple(np.shape(t)) for t in sums]} "
                f"but gradients of shapes {shapes} need {expected}; pass the state init returned for "
                "these parameters."
            )
        new_updates, new_sums = [], []
        for g, t in zip(leaves, treedef.flatten_up_to(state.sum_of_squares)):
            v, data = view(g)  # zeros where the gradient is not valid
            axes = _row_axes(data.ndim)
            square = (data.conj() * data).real
            grow = jnp.mean(square, axis=axes) if axes else square
            t, rows = v.grow_rows(t, grow, per_row=bool(axes))
            scale = inverse_root(rows).astype(data.dtype)
            new_sums.append(t)
            new_updates.append(v.wrap(scale.reshape(scale.shape + (1,) * len(axes)) * data))
        return (
            jax.tree_util.tree_unflatten(treedef, new_updates),
            ScaleByRowwiseRssState(sum_of_squares=jax.tree_util.tree_unflatten(treedef, new_sums)),
        )

    return optax.GradientTransformation(init_fn, update_fn)


def rowwise_adagrad(
    learning_rate: optax.ScalarOrSchedule,
    initial_accumulator_value: float = 0.0,
    eps: float = 1e-8,
    *,
    eps_placement: str = "outside",
) -> optax.GradientTransformation:
    """Row-wise Adagrad (FBGEMM's ``EXACT_ROWWISE_ADAGRAD``): one accumulator per table row.

    ``chain(scale_by_rowwise_rss(...), lazy(scale_by_learning_rate(learning_rate)))``. For a table
    of shape ``(N, dim)`` the state is ``N`` numbers instead of Adagrad's ``N x dim``; each row
    moves by ``lr * g / (sqrt(s) + eps)`` with ``s`` the running sum of its gradients' mean
    squares. With masked or row-sparse gradients only the valid entries (stored rows) and their
    rows' sums change; the rest stays bit-identical. Since each row is updated from that row
    alone, :func:`make_train_step` updates its row-sparse tables in chunks of rows on the CPU, as
    it does for entry-by-entry :func:`lazy` optimizers. The sums of a bfloat16 or float16 table
    are float32 (as FBGEMM keeps them).

    Args:
        learning_rate: a float or an optax schedule.
        initial_accumulator_value: starting value of the sums, >= 0.
        eps: small constant in the denominator.
        eps_placement: ``"outside"`` (FBGEMM) or ``"inside"`` the square root.

    Examples:
        >>> import jax.numpy as jnp, masked_jax as mj
        >>> from masked_jax import optim
        >>> table = jnp.zeros((4, 2))
        >>> opt = optim.rowwise_adagrad(0.1)
        >>> g = mj.row_sparse(jnp.array([[3.0, 4.0]]), jnp.array([2]), (4, 2))
        >>> updates, state = opt.update(g, opt.init(table))
        >>> optim.apply_updates(table, updates)[2]
        Array([-0.08485281, -0.11313709], dtype=float32)
    """
    _validate.learning_rate(learning_rate, "rowwise_adagrad: learning_rate")
    opt = optax.chain(
        scale_by_rowwise_rss(initial_accumulator_value, eps, eps_placement),
        lazy(optax.scale_by_learning_rate(learning_rate)),
    )
    return declare_row_local(opt)  # make_train_step may update a table in chunks of rows
