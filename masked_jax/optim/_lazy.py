"""``lazy(inner)``: any optax transformation, updating only where the gradient is valid."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

from masked_jax._core import is_masked_leaf
from masked_jax.optim import _catch_up
from masked_jax.optim._accumulate import lazy_multi_steps, lazy_multi_steps_rows
from masked_jax.optim._state import ScaleByRowwiseRssState, _map_param_shaped, _Reference, declare_lazy
from masked_jax.optim._views import data_of, view


def _check_liftable(ref: _Reference, state) -> None:
    """Reject state a row or mask cannot be cut out of: non-scalar float state that is not shaped
    like the parameters (factored second moments, per-row statistics). A leaf of one element is
    global state, as a scalar is: adafactor's placeholders for the factors of a parameter it does
    not factor are shape-(1,) zeros, and its second moment of such a parameter is per entry."""

    def check(path, node):
        if ref.matches(node):
            return
        if jnp.issubdtype(jnp.result_type(node), jnp.inexact) and np.ndim(node) > 0 and np.size(node) != 1:
            if tuple(np.shape(node)) in ref.shapes:
                raise ValueError(
                    f"lazy() cannot lift this transformation: its state leaf {jax.tree_util.keystr(path)} has "
                    f"a parameter's shape {np.shape(node)} but sits in a subtree that is not shaped like the "
                    "parameter tree (as in optax.masked or optax.multi_transform, whose inner states cover "
                    "only some parameters), so it cannot be matched to its parameter. Lift the inner "
                    "transformations instead: optax.masked(lazy(inner), mask), "
                    "optax.multi_transform({label: lazy(tx), ...}, labels)."
                )
            raise ValueError(
                f"lazy() cannot lift this transformation: its state leaf "
                f"{jax.tree_util.keystr(path)} has shape {np.shape(node)}, which is neither a "
                f"parameter's shape (per-entry state, updated where the gradient is valid) nor a "
                f"scalar or one element (global state, e.g. a step count). State that mixes entries "
                f"(factored moments as in adafactor, for parameters it factors; per-row norms) cannot "
                f"be updated lazily."
                + (
                    " One value per row, as rowwise_adagrad's sums, is updated only at the rows a "
                    "row-sparse gradient touches by rowwise_adagrad itself: use it without lazy() "
                    "(and without MultiSteps, which would need a lazy lift around it)."
                    if _rowwise(state)
                    else ""
                )
            )

    jax.tree_util.tree_map_with_path(check, state, is_leaf=ref.matches)


def _rowwise(state) -> bool:
    """Does ``state`` hold row-wise Adagrad's state?"""
    row_state = lambda x: isinstance(x, ScaleByRowwiseRssState)  # noqa: E731
    return any(map(row_state, jax.tree_util.tree_leaves(state, is_leaf=row_state)))


def _shapes(tree):
    leaves, treedef = jax.tree_util.tree_flatten(tree, is_leaf=is_masked_leaf)
    return treedef, [tuple(np.shape(x)) if not is_masked_leaf(x) else tuple(x.shape) for x in leaves]


def check_update_arguments(inner, updates, state, params) -> None:
    """Gradient, parameter and state trees must agree: checked from shapes alone, when the step is
    traced (nothing runs under ``jit``). A ``ValueError`` names what disagrees."""
    g_def, g_shapes = _shapes(updates)
    if params is not None:
        p_def, p_shapes = _shapes(params)
        if p_def != g_def:
            raise ValueError(f"lazy: the gradient tree {g_def} does not match the parameter tree {p_def}.")
        for i, (g, p) in enumerate(zip(g_shapes, p_shapes)):
            if g != p:
                raise ValueError(
                    f"lazy: gradient leaf {i} has shape {g} but its parameter has shape {p}; "
                    "a gradient must have its parameter's shape (row-sparse: the full table shape)."
                )
    like = jax.tree_util.tree_map(
        lambda x: (
            jax.ShapeDtypeStruct(tuple(x.shape), data_of(x).dtype)
            if is_masked_leaf(x)
            else jax.ShapeDtypeStruct(np.shape(x), jnp.result_type(x))
        ),
        updates,
        is_leaf=is_masked_leaf,
    )
    expected = jax.eval_shape(inner.init, like)
    e_def, e_shapes = jax.tree_util.tree_structure(expected), [np.shape(x) for x in jax.tree_util.tree_leaves(expected)]
    s_def, s_shapes = jax.tree_util.tree_structure(state), [np.shape(x) for x in jax.tree_util.tree_leaves(state)]
    if e_def != s_def or e_shapes != s_shapes:
        raise ValueError(
            f"lazy: the optimizer state does not belong to these gradients: inner.init of parameters shaped "
            f"like the gradients gives {e_def} with shapes {e_shapes}; got {s_def} with shapes {s_shapes}. "
            "Pass the state this optimizer's init returned for these parameters."
        )


def check_transformation(obj, argname: str) -> None:
    if not (callable(getattr(obj, "init", None)) and callable(getattr(obj, "update", None))):
        raise TypeError(
            f"{argname} must be an optax.GradientTransformation (with init and update); got {type(obj).__name__}."
        )


def lazy(inner: optax.GradientTransformation, *, catch_up: bool = False, capacity=None) -> optax.GradientTransformation:
    """Lift an optax transformation to lazy masked / row-sparse semantics.

    Gradient leaves may be plain arrays (every entry valid), ``MaskedArray`` objects
    (valid where the mask is True) or :class:`RowSparseArray` objects (valid on the stored
    rows; duplicates are summed first). Parameters and every parameter-shaped state
    leaf (adam's ``mu`` and ``nu``, momentum traces, adagrad sums) change only where
    the gradient is valid and stay bit-identical elsewhere; global state (step
    counts, schedules) advances as in ``inner``.

    For row-sparse gradients the touched rows of the parameters and state are
    gathered, ``inner.update`` runs on those ``K`` rows only, and the result is
    scattered back: O(K x dim) work and memory (torch ``SparseAdam``, MXNet
    ``lazy_update``). ``inner`` sees untouched entries as absent, so norms (as in
    ``optax.clip_by_global_norm``) are over valid entries only. Updates come back in
    the gradient's storage: apply them with :func:`apply_updates`.

    With plain-array gradients ``lazy(inner)`` is ``inner``, exactly (``MultiSteps`` aside: its
    lift below gives the same parameters). It is a ``GradientTransformationExtraArgs``: optax's extra
    arguments (``value=`` for ``polyak_sgd`` and ``reduce_on_plateau``) reach ``inner`` when it
    takes them, as in ``optax.chain``.

    ``lazy(optax.MultiSteps(inner, k))`` accumulates exactly per entry: the gradients of
    ``k`` micro-steps are summed (or averaged) into a parameter-shaped accumulator, and at
    the ``k``-th step every entry touched in the window is updated with ``lazy(inner)``;
    its updates are masked arrays (dense storage), and its state is ``MultiSteps``' state
    plus the parameter-shaped mask of the entries touched in the window. Like
    ``optax.MultiSteps``, every micro-step costs O(parameter size). With ``capacity=C`` (an int,
    or a prefix tree of ints and ``None`` over the parameters) a table's accumulator instead
    holds at most ``C`` coalesced rows (a ``RowSparseArray``), so a micro-step costs O(C x dim);
    leaves given ``None`` keep a dense accumulator. **When a micro-step's rows would not fit**,
    the window ends early, before that micro-step: the rows accumulated so far are applied as
    the window's (mean or sum) gradient, and the micro-step starts the next window; nothing is
    dropped, and the state counts such windows in ``early_flushes``. With ``C`` at least the
    rows one window can touch (``k`` times a micro-step's rows) no window ends early and the
    parameters equal the dense accumulator's. Wrap the lazy lift *around* optax's
    wrappers (``lazy(optax.apply_if_finite(adam, n))`` checks finiteness over the valid
    entries only): optax's own wrappers see a masked or row-sparse gradient's leaves
    (masked-out data, row indices) as if they were parameters.

    Rejected (``ValueError`` when the first masked or row-sparse gradient is traced):
    transformations whose state mixes entries (float state of more than one element not shaped
    like the parameters, e.g. adafactor's factors of a parameter it factors; its shape-(1,)
    placeholders for the others are global state, as scalars are), and state that covers only some parameters
    (``optax.masked``, ``optax.multi_transform``: lift their inner transformations instead).
    With plain gradients every transformation is accepted, as ``inner`` itself.
    Stateless transformations that mix entries of one parameter (trust ratios as in
    LARS/LAMB) are accepted but then see only the touched rows.

    **Catch-up** (``catch_up=True``). A lazy update leaves an untouched row's state alone, where
    the dense optimizer would decay it every step (momentum, Adam's ``b1``/``b2``, decoupled
    weight decay). With ``catch_up`` the state holds per-row counters, and a row touched after
    ``k`` untouched steps is first brought to what ``inner`` would hold after ``k`` zero-gradient
    steps, in closed form: state ``s * c**k``, parameter ``p * r**k`` plus the momentum's drift
    where it is linear in the state (SGD with momentum or Nesterov: then the result equals dense
    optax exactly). Adam's drift on untouched rows, ``m / (sqrt(v) + eps)`` per step, has no
    closed form and is left out; its moments and decoupled weight decay are caught up exactly.
    The closed forms are read off ``inner`` by a zero-gradient probe when the update is traced;
    a transformation whose zero-gradient step is not of that form (L2 decay added to the gradient
    before a momentum, adamax's floored ``nu``, amsgrad's running maximum) is rejected with a
    ``ValueError``. Rows are the leading axis; a masked
    gradient touches a row where any entry is valid (exact when rows are valid or masked whole).
    Schedules are read at step 0.

    Args:
        inner: the optax transformation to lift.
        catch_up: bring a row's state (and parameter) over the steps it was not touched, when it
            is touched again.
        capacity: for ``optax.MultiSteps`` only: the rows each table's accumulator holds
            (``None``: a dense accumulator).

    Returns:
        An ``optax.GradientTransformation`` with the same state as ``inner`` (for
        ``optax.MultiSteps``, that state and the touched mask; with ``catch_up``, a
        ``LazyCatchUpState`` of that state, the update count and the per-row counters).

    Examples:
        >>> import jax.numpy as jnp, optax, masked_jax as mj
        >>> from masked_jax import optim
        >>> params = jnp.zeros((4, 2))
        >>> opt = optim.lazy(optax.adam(0.1))
        >>> state = opt.init(params)
        >>> g = mj.row_sparse(jnp.ones((1, 2)), jnp.array([2]), (4, 2))
        >>> updates, state = opt.update(g, state, params)
        >>> updates
        RowSparseArray(float32[4, 2], rows=1)
        >>> optim.apply_updates(params, updates).round(3)
        Array([[ 0. ,  0. ],
               [ 0. ,  0. ],
               [-0.1, -0.1],
               [ 0. ,  0. ]], dtype=float32)
    """

    check_transformation(inner, "inner")
    if capacity is not None and not isinstance(inner, optax.MultiSteps):
        raise ValueError("lazy(..., capacity=...) applies to optax.MultiSteps (the rows its accumulator holds).")
    if isinstance(inner, optax.MultiSteps):
        if catch_up:
            raise ValueError(
                "lazy(optax.MultiSteps(...), catch_up=True) is not supported: lift the inner "
                "transformation with catch_up inside MultiSteps' accumulation instead."
            )
        if capacity is not None:
            return lazy_multi_steps_rows(inner, lazy, capacity)
        return lazy_multi_steps(inner, lazy)

    def init_fn(params):
        params = jax.tree_util.tree_map(data_of, params, is_leaf=is_masked_leaf)
        if catch_up:
            return _catch_up.LazyCatchUpState(
                inner.init(params), jnp.zeros((), jnp.int32), _catch_up.init_counters(params)
            )
        return inner.init(params)

    takes_extra = isinstance(inner, optax.GradientTransformationExtraArgs)

    def inner_update(updates, state, params, extra_args):
        # optax's own rule (``with_extra_args_support``): extra arguments reach an inner
        # transformation that declares it takes them, and no other
        return (
            inner.update(updates, state, params, **extra_args) if takes_extra else inner.update(updates, state, params)
        )

    def update_fn(updates, state, params=None, **extra_args):
        if params is not None:
            params = jax.tree_util.tree_map(data_of, params, is_leaf=is_masked_leaf)
        if catch_up:
            if not isinstance(state, _catch_up.LazyCatchUpState):
                raise ValueError(
                    f"lazy(catch_up=True): state must be the LazyCatchUpState its init returned; got "
                    f"{type(state).__name__}."
                )
            state, step, last = state
        else:
            step = last = None  # no catch-up: no counters
        check_update_arguments(inner, updates, state, params)
        leaves, treedef = jax.tree_util.tree_flatten(updates, is_leaf=is_masked_leaf)
        if not catch_up and not any(is_masked_leaf(g) for g in leaves):
            return inner_update(updates, state, params, extra_args)
        ref = _Reference.of(updates)
        _check_liftable(ref, state)
        views, gathered = [], []
        for g in leaves:
            v, data = view(g)
            views.append(v)
            gathered.append(data)

        def gather(xs):
            return [v.gather(x) for v, x in zip(views, xs)]

        p_rows = gather(treedef.flatten_up_to(params)) if params is not None else None
        inner_state = _map_param_shaped(ref, gather, state)
        caught = p_rows
        last_leaves: list = []
        if catch_up:
            like = jax.tree_util.tree_unflatten(
                treedef, [jax.ShapeDtypeStruct(v.shape, d.dtype) for v, d in zip(views, gathered)]
            )
            coeffs = _catch_up.probe(inner, like)
            if params is None and _catch_up.needs_params(coeffs):
                raise ValueError(
                    "lazy(catch_up=True): this optimizer moves untouched parameters (weight decay or "
                    "momentum drift), so update needs params=."
                )
            last_leaves = treedef.flatten_up_to(last)
            ks = [_catch_up.rows_since(v, c, step) for v, c in zip(views, last_leaves)]
            rows_ref = _Reference(treedef, tuple(np.shape(d) for d in gathered))  # the state as gathered
            subtrees = []
            _map_param_shaped(rows_ref, lambda ls: subtrees.append(ls) or ls, inner_state)
            moved = [
                _catch_up.catch_up_rows(
                    coeffs, i, ks[i], None if p_rows is None else p_rows[i], [sub[i] for sub in subtrees]
                )
                for i in range(len(views))
            ]
            caught = None if p_rows is None else [m[0] for m in moved]
            which = iter(range(len(subtrees)))
            inner_state = _map_param_shaped(
                rows_ref, lambda ls: (lambda l: [m[1][l] for m in moved])(next(which)), inner_state
            )
        u, new_inner_state = inner_update(
            jax.tree_util.tree_unflatten(treedef, gathered),
            inner_state,
            None if caught is None else jax.tree_util.tree_unflatten(treedef, caught),
            extra_args,
        )
        new_state = _map_param_shaped(
            ref, lambda old, new: [v.scatter(o, n) for v, o, n in zip(views, old, new)], state, new_inner_state
        )
        u_leaves = treedef.flatten_up_to(u)
        if catch_up and caught is not None and p_rows is not None:  # each row carried over its skipped steps
            u_leaves = [x + (c - p).astype(x.dtype) for x, c, p in zip(u_leaves, caught, p_rows)]
        out = jax.tree_util.tree_unflatten(treedef, [v.wrap(x) for v, x in zip(views, u_leaves)])
        if catch_up:
            new_last = jax.tree_util.tree_unflatten(
                treedef, [_catch_up.touch(v, c, step) for v, c in zip(views, last_leaves)]
            )
            new_state = _catch_up.LazyCatchUpState(new_state, jnp.asarray(step) + 1, new_last)
        return out, new_state

    return declare_lazy(optax.GradientTransformationExtraArgs(init_fn, update_fn), inner)
