"""Differentiation with respect to the *data* of masked arguments.

``jax.grad`` refuses pytrees with bool leaves (a mask) unless ``allow_int=True``,
and even then returns a float0 "gradient" for the mask. The functions here
split every ``MaskedArray`` argument into its data (differentiated) and its
mask (held fixed), differentiate, and hand gradients back as ``MaskedArray`` objects
that carry the primal mask, with data exactly 0 at masked-out elements.
Masked outputs are read through ``filled(0)``: a masked output contributes
nothing, so its cotangent is dropped.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np

from masked_jax import embeddings
from masked_jax._core import MaskedArray, SparseMasked, is_masked, is_masked_leaf


class _NoMask:
    """The meta of a statically valid MaskedArray (no mask stored): its gradient stores none either."""


_NO_MASK = _NoMask()


def _split(tree, static: bool = False):
    """Leaves of ``tree`` as differentiable data + what holds them fixed.

    For a MaskedArray that is its mask (``_NO_MASK`` for a statically valid one when ``static``,
    so that its gradient keeps its pytree structure; Jacobians take the all-True mask); for a
    sparse layout, the layout itself (its indices and shape); ``None`` for a plain array.
    """
    leaves, treedef = jax.tree_util.tree_flatten(tree, is_leaf=is_masked_leaf)
    datas = [leaf.data if is_masked_leaf(leaf) else leaf for leaf in leaves]

    def meta(leaf):
        if is_masked(leaf):
            return _NO_MASK if static and leaf.compact_mask is None else leaf.mask
        return leaf if is_masked_leaf(leaf) else None

    return datas, [meta(leaf) for leaf in leaves], treedef


def _rebuild(data, meta):
    if meta is None:
        return data
    if meta is _NO_MASK:
        return MaskedArray.tree_unflatten(None, (data, None))
    if isinstance(meta, SparseMasked):
        return meta.with_data(data)
    return MaskedArray.tree_unflatten(None, (data, meta))


def _join(datas, masks, treedef):
    return jax.tree_util.tree_unflatten(treedef, [_rebuild(d, m) for d, m in zip(datas, masks)])


def _as_gradient(g, meta):
    """A gradient leaf carrying the primal's mask (or sparse indices), exactly 0 where masked."""
    if meta is None:
        return g
    if meta is _NO_MASK:
        return MaskedArray.tree_unflatten(None, (g, None))
    zero = jnp.zeros((), g.dtype)
    if isinstance(meta, SparseMasked):
        # Duplicates are one logical entry: its cotangent is kept in its first stored copy and the
        # later copies hold 0, so the gradient read as an array (duplicates summed) is the dense one.
        first = meta.first_copies()
        first = jnp.broadcast_to(first.reshape(first.shape + (1,) * (g.ndim - first.ndim)), g.shape)
        return meta.with_data(jnp.where(meta.block().mask & first, g, zero))
    return MaskedArray.tree_unflatten(None, (jnp.where(jnp.broadcast_to(meta, g.shape), g, zero), meta))


def _argnums_tuple(argnums, nargs):
    nums = (argnums,) if isinstance(argnums, int) else tuple(argnums)
    for a in nums:
        if not -nargs <= a < nargs:
            raise ValueError(
                f"argnums {argnums} is out of range for a function called with {nargs} positional arguments."
            )
    return tuple(a % nargs for a in nums)


def _reader(fun, args, kwargs, argnums, static: bool = False):
    """Data-only view of ``fun``: returns (g, diff_datas, masks, treedefs)."""
    nums = _argnums_tuple(argnums, len(args))
    split = [_split(args[i], static) for i in nums]

    def g(diff_datas):
        new_args = list(args)
        for i, (datas, (_, masks, treedef)) in zip(nums, zip(diff_datas, split)):
            new_args[i] = _join(datas, masks, treedef)
        return fun(*new_args, **kwargs)

    return g, [s[0] for s in split], [s[1] for s in split], [s[2] for s in split]


def _scalar_output(out):
    if is_masked_leaf(out):
        return out.filled(0)
    return out


def _grad_tree(grads, masks, treedefs, argnums):
    per_arg = [
        jax.tree_util.tree_unflatten(td, [_as_gradient(g, m) for g, m in zip(gs, ms)])
        for gs, ms, td in zip(grads, masks, treedefs)
    ]
    return per_arg[0] if isinstance(argnums, int) else tuple(per_arg)


def value_and_grad(
    fun: Callable,
    argnums: int | Sequence[int] = 0,
    has_aux: bool = False,
    holomorphic: bool = False,
    *,
    row_sparse=None,
) -> Callable:
    """``jax.value_and_grad`` that differentiates the data of masked arguments.

    ``fun`` returns a scalar array or a 0-d ``MaskedArray`` (a masked loss
    counts as 0). Gradients of ``MaskedArray`` arguments (also inside pytrees)
    are ``MaskedArray`` objects with the argument's mask and data exactly 0 where masked.

    ``row_sparse`` selects tables (plain arrays of shape (N, ...)) whose gradient
    should be a :class:`RowSparseArray` of the rows ``fun`` reads with
    :func:`mj.lookup <masked_jax.lookup>` or ``table[ids]``, instead of a dense
    array: ``True`` (every array of the differentiated argument), a prefix pytree
    of bools (as ``optax.masked`` takes), or a callable returning one (a tuple of
    those for several ``argnums``). The dense ``N x dim`` gradient is never built.
    Rows are read by ``mj.lookup``, ``table[ids]`` or ``jnp.take(table, ids, axis=0)``,
    also inside ``jit``, ``vmap``, ``lax.scan`` and ``jax.checkpoint``; any other use of a
    selected table is a ``TypeError``.

    Examples:
        >>> import jax.numpy as jnp, masked_jax as mj, masked_jax.numpy as mnp
        >>> x = mj.masked_array(jnp.array([2.0, 0.0]), jnp.array([True, False]))
        >>> value, g = mj.value_and_grad(lambda x: mnp.sum(mnp.log(x)))(x)
        >>> g
        MaskedArray([0.5 --], dtype=float32)
    """

    @functools.wraps(fun)
    def wrapped(*args, **kwargs):
        if row_sparse is not None and row_sparse is not False:
            read, args = embeddings.substitute_rows(fun, args, kwargs, _argnums_tuple(argnums, len(args)), row_sparse)
        else:
            read = fun
        g, diff, masks, treedefs = _reader(read, args, kwargs, argnums, static=True)
        (_, (value, aux)), grads = jax.value_and_grad(
            lambda d: _loss(_with_aux(g(d), has_aux)), has_aux=True, holomorphic=holomorphic
        )(diff)
        grads = embeddings.as_row_sparse(_grad_tree(grads, masks, treedefs, argnums))
        return ((value, aux), grads) if has_aux else (value, grads)

    return wrapped


def _with_aux(out, has_aux):
    if has_aux:
        if not (isinstance(out, tuple) and len(out) == 2):
            raise TypeError("with has_aux=True, fun must return a pair (output, aux).")
        return out
    return out, None


def _loss(pair):
    out, aux = pair
    loss = _scalar_output(out)
    if np.shape(loss) != ():
        raise TypeError(f"grad needs a scalar output; got shape {np.shape(loss)}. Reduce it (e.g. mnp.sum) first.")
    return loss, (out, aux)


def grad(
    fun: Callable,
    argnums: int | Sequence[int] = 0,
    has_aux: bool = False,
    holomorphic: bool = False,
    *,
    row_sparse=None,
) -> Callable:
    """``jax.grad`` with respect to the data of masked arguments; gradients carry the primal mask.

    ``row_sparse`` asks for row-sparse gradients of tables read by lookups, as in
    :func:`value_and_grad`.

    Examples:
        >>> import jax.numpy as jnp, masked_jax as mj, masked_jax.numpy as mnp
        >>> x = mj.masked_array(jnp.array([1.0, jnp.nan, 3.0]), jnp.array([True, False, True]))
        >>> mj.grad(lambda x: mnp.sum(x ** 2))(x)
        MaskedArray([2.0 -- 6.0], dtype=float32)
    """
    vg = value_and_grad(fun, argnums=argnums, has_aux=has_aux, holomorphic=holomorphic, row_sparse=row_sparse)

    @functools.wraps(fun)
    def wrapped(*args, **kwargs):
        out, grads = vg(*args, **kwargs)
        return (grads, out[1]) if has_aux else grads

    return wrapped


def _jacobian(jax_jac, fun, argnums, has_aux, holomorphic):
    @functools.wraps(fun)
    def wrapped(*args, **kwargs):
        g, diff, in_masks, in_treedefs = _reader(fun, args, kwargs, argnums)
        out_info = {}

        def h(d):
            out, aux = _with_aux(g(d), has_aux)
            out = jax.tree_util.tree_map(  # Jacobians are laid out densely
                lambda o: o.todense() if isinstance(o, SparseMasked) else o, out, is_leaf=is_masked_leaf
            )
            datas, masks, treedef = _split(out)
            out_info["masks"], out_info["treedef"] = masks, treedef
            filled = [
                x if m is None else jnp.where(cast(Any, m), x, jnp.zeros((), x.dtype)) for x, m in zip(datas, masks)
            ]
            return filled, (aux, [m for m in masks if m is not None])

        jac, (aux, present) = jax_jac(h, has_aux=True, holomorphic=holomorphic)(diff)
        it = iter(present)
        out_masks = [None if m is None else next(it) for m in out_info["masks"]]
        rows = []
        for j_out, m_out in zip(jac, out_masks):
            per_arg = []
            for j_arg, ms, td in zip(j_out, in_masks, in_treedefs):
                leaves = [_jac_block(j, m_out, m_in) for j, m_in in zip(j_arg, ms)]
                per_arg.append(jax.tree_util.tree_unflatten(td, leaves))
            rows.append(per_arg[0] if isinstance(argnums, int) else tuple(per_arg))
        result = jax.tree_util.tree_unflatten(out_info["treedef"], rows)
        return (result, aux) if has_aux else result

    return wrapped


def _jac_block(j, m_out, m_in):
    """d out / d in as a MaskedArray valid where both the output and the input element are.

    For a sparse input the input axes are those of its stored values.
    """
    if isinstance(m_in, SparseMasked):
        m_in = m_in.block().mask
    if m_out is None and m_in is None:
        return j
    out_nd = j.ndim - (0 if m_in is None else m_in.ndim)
    mo = jnp.ones(j.shape[:out_nd], bool) if m_out is None else m_out
    mi = jnp.ones(j.shape[out_nd:], bool) if m_in is None else m_in
    mask = jnp.reshape(mo, mo.shape + (1,) * mi.ndim) & jnp.reshape(mi, (1,) * mo.ndim + mi.shape)
    return _as_gradient(j, mask)


def jacfwd(
    fun: Callable, argnums: int | Sequence[int] = 0, has_aux: bool = False, holomorphic: bool = False
) -> Callable:
    """``jax.jacfwd`` over masked data: block ``[out..., in...]`` is valid where both are valid.

    Examples:
        >>> import jax.numpy as jnp, masked_jax as mj
        >>> x = mj.masked_array(jnp.array([1.0, 2.0]), jnp.array([True, False]))
        >>> mj.jacfwd(lambda x: x * 3.0)(x)
        MaskedArray([[3.0 --]
                     [-- --]], dtype=float32)
    """
    return _jacobian(jax.jacfwd, fun, argnums, has_aux, holomorphic)


def jacrev(
    fun: Callable, argnums: int | Sequence[int] = 0, has_aux: bool = False, holomorphic: bool = False
) -> Callable:
    """``jax.jacrev`` over masked data; same layout and masks as :func:`jacfwd`.

    Examples:
        >>> import jax.numpy as jnp, masked_jax as mj, masked_jax.nn as mnn
        >>> x = mj.masked_array(jnp.array([0.0, 9.0, 0.0]), jnp.array([True, False, True]))
        >>> mj.jacrev(mnn.softmax)(x).mask
        Array([[ True, False,  True],
               [False, False, False],
               [ True, False,  True]], dtype=bool)
    """
    return _jacobian(jax.jacrev, fun, argnums, has_aux, holomorphic)


def hessian(
    fun: Callable, argnums: int | Sequence[int] = 0, has_aux: bool = False, holomorphic: bool = False
) -> Callable:
    """Second derivatives over masked data (``jacfwd(jacrev(fun))``), valid on the valid subspace.

    Examples:
        >>> import jax.numpy as jnp, masked_jax as mj, masked_jax.numpy as mnp
        >>> x = mj.masked_array(jnp.array([1.0, 2.0]), jnp.array([True, False]))
        >>> mj.hessian(lambda x: mnp.sum(x ** 3))(x)
        MaskedArray([[6.0 --]
                     [-- --]], dtype=float32)
    """
    return jacfwd(jacrev(fun, argnums, has_aux, holomorphic), argnums, has_aux, holomorphic)


def tangent(x: MaskedArray, data_tangent) -> MaskedArray:
    """A tangent/cotangent for ``x`` to hand to ``jax.jvp``/``jax.vjp``/``jax.linearize``.

    JAX wants a float0 tangent for the bool mask; this builds it.

    Examples:
        >>> import jax, jax.numpy as jnp, masked_jax as mj, masked_jax.numpy as mnp
        >>> x = mj.masked_array(jnp.array([1.0, 2.0]), jnp.array([True, False]))
        >>> _, t = jax.jvp(lambda x: mnp.sum(x * x), (x,), (mj.tangent(x, jnp.ones(2)),))
        >>> t.data
        Array(2., dtype=float32)
    """
    if not is_masked(x):
        raise TypeError(f"x must be a MaskedArray; got {type(x).__name__}.")
    data_tangent = jnp.asarray(data_tangent, dtype=x.dtype)
    if data_tangent.shape != x.shape:
        raise ValueError(f"data_tangent must have shape {x.shape}; got {data_tangent.shape}.")
    return MaskedArray.tree_unflatten(None, (data_tangent, np.zeros(x.shape, jax.dtypes.float0)))


__all__ = ["grad", "hessian", "jacfwd", "jacrev", "tangent", "value_and_grad"]
