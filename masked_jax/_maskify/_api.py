"""``maskify(fun)``: trace ``fun`` on the data of its arguments, then interpret the jaxpr on
``(data, mask)`` pairs; programs of calls with no masked operand are run eagerly as compiled once.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from typing import cast

import jax
import jax.numpy as jnp
import numpy as np

from masked_jax._core import MaskedArray, SparseMasked, from_pair
from masked_jax._maskify import _coords, _positions
from masked_jax._maskify._constants import _is_concrete, _kept
from masked_jax._maskify._errors import MaskifyError
from masked_jax._maskify._interpreter import _Interpreter
from masked_jax.ops._base import Pair


def maskify(fun, *, positions: str = "unpadded"):
    """``fun`` with masked semantics: it accepts masked arrays wherever it accepted arrays.

    ``fun`` is ordinary ``jax.numpy`` / ``jax.nn`` / ``lax`` code. Its arguments may be
    ``MaskedArray`` objects, sparse layouts (densified to ``MaskedArray``), arrays, and pytrees of them;
    non-array arguments (Python numbers, strings) and keyword arguments are static, except the
    masked arrays among the keyword arguments, which are operands as positional ones are. Outputs that
    depend on a masked input are ``MaskedArray`` objects; the others are plain arrays. Composes with
    ``jit``, ``vmap`` and ``mj.grad``; for ``static_argnums``-like use, close over the static
    values (``maskify(lambda x: f(x, axis))``).

    Reductions see only valid elements, so ``jax.nn.softmax``, ``jax.nn.logsumexp`` and
    ``jnp.mean`` / ``jnp.var`` become their masked versions. A primitive without a masked rule
    raises :class:`MaskifyError` naming it and ``fun``.

    Called outside ``jit`` (no argument is a tracer), ``fun`` is traced on every call, as
    eagerly, and its masked program runs as one compiled program, kept for any later call that
    traces to the same program (the same jaxpr, constants and output structure; a new ``lambda``
    written the same way included), instead of operation by operation. Under ``jit``, ``vmap``
    or a gradient the masked program is traced into the caller's.

    **Positions.** A masked input's *token axis* is the axis its mask varies along (the only one, or
    the one after the batch axis: a ``(B, L, 1)`` mask of ``(B, L, D)`` activations, a ``(B, L)``
    mask of token ids). With ``positions="unpadded"`` (the default) every position the program
    builds along a token axis means what it means in the example without its padding: the ranks
    among the valid tokens. ``x[:, -1]`` is each example's last valid token, ``x[:, ::-1]`` reverses
    the valid tokens, ``pos_emb[jnp.arange(L)]`` gives each valid token its rank's embedding, a
    causal ``jnp.pad`` before a convolution pads before the first valid token, and ``jnp.argsort``
    returns positions among the valid tokens. Arrays passed in (lengths, positions, indices) are
    taken as given, in padded coordinates. With ``positions="padded"`` the positions are the
    stored ones, as in ``masked_jax.numpy`` (a mask that marks missing entries of a matrix, not
    padding).

    Examples:
        >>> import jax, jax.numpy as jnp, masked_jax as mj
        >>> x = mj.masked_array(jnp.array([1.0, 2.0, 100.0]), jnp.array([True, True, False]))
        >>> mj.maskify(jnp.mean)(x)
        MaskedArray(1.5, dtype=float32)
        >>> mj.maskify(jax.nn.softmax)(x).mask
        Array([ True,  True, False], dtype=bool)
        >>> mj.maskify(lambda v: v[-1])(x)  # the last valid entry
        MaskedArray(2.0, dtype=float32)
    """
    if not callable(fun):
        raise TypeError(f"maskify: fun must be callable; got {type(fun).__name__}.")
    if positions not in ("unpadded", "padded"):
        raise ValueError(f"maskify: positions must be 'unpadded' or 'padded'; got {positions!r}.")
    unpadded = positions == "unpadded"
    name = getattr(fun, "__name__", repr(fun))

    @functools.wraps(fun)
    def wrapped(*args, **kwargs):
        # masked arrays among the keyword arguments are operands too; their other values are static
        flat, tree = jax.tree_util.tree_flatten((args, kwargs), is_leaf=_is_masked_leaf)
        positional = len(jax.tree_util.tree_leaves(args, is_leaf=_is_masked_leaf))
        pairs, statics, dyn_pos = [], {}, []
        for i, leaf in enumerate(flat):
            if i >= positional and not _is_masked_leaf(leaf):
                statics[i] = leaf
                continue
            if isinstance(leaf, SparseMasked):
                leaf = leaf.todense()
            if isinstance(leaf, MaskedArray):
                mask = leaf.compact_mask
                if mask is None and leaf.size == 0:
                    # an empty masked array is masked, statically valid: a mean of nothing is masked
                    # as in masked_jax.numpy, where a plain array's is jnp's NaN
                    mask = np.ones((1,) * leaf.ndim, bool)
                pairs.append(Pair(leaf.data, mask))
                dyn_pos.append(i)
            elif isinstance(leaf, (jax.Array, np.ndarray, np.generic)):
                pairs.append(Pair(jnp.asarray(leaf), None))
                dyn_pos.append(i)
            else:
                statics[i] = leaf

        def on_data(*datas):
            leaves = [statics.get(i) for i in range(len(flat))]
            for i, d in zip(dyn_pos, datas):
                leaves[i] = d
            positional, keywords = jax.tree_util.tree_unflatten(tree, leaves)
            return fun(*positional, **keywords)

        traces = _REUSED.get()
        key = None if traces is None else _trace_key(wrapped, tree, pairs, statics)
        if traces is not None and key in traces:
            closed, out_tree, program, rel = traces[key]
        else:
            closed, out_shape = _traced(name, on_data, pairs)
            out_tree = jax.tree_util.tree_structure(out_shape)
            rel = _relativity(closed, on_data, pairs) if unpadded else None
            program = _eager_program(closed, out_tree, pairs, rel)
            if traces is not None and key is not None and program is not None:  # (eager, concrete constants)
                traces[key] = (closed, out_tree, program, rel)
        if program is not None:
            token = _CALLED.set(name)  # a program is shared by the functions that trace to it
            try:
                outs = program([p.data for p in pairs], [p.mask for p in pairs])
            finally:
                _CALLED.reset(token)
        else:
            outs = _interpret(name, closed, pairs, rel)
        return jax.tree_util.tree_unflatten(out_tree, outs)

    return wrapped


# Inside :func:`reusing_traces`: the eager calls' traces, by function and input structure.
_REUSED: contextvars.ContextVar[dict | None] = contextvars.ContextVar("masked_jax_maskify_traces", default=None)


@contextlib.contextmanager
def reusing_traces():
    """Within the block, an eager call of a maskify'd function whose arguments have the shapes,
    dtypes, masks' layout and static values of an earlier call in the block reuses that call's
    trace. maskify traces abstractly (on shapes, never on values), so such a call would trace to
    the same program; a checker that calls one function on many contents of the same inputs
    (``check_invariance``'s eager cases) pays for one trace. Python state that ``fun`` reads and
    that changes inside the block is not seen again: meant for the library's checkers, not for
    user code."""
    token = _REUSED.set({})
    try:
        yield
    finally:
        _REUSED.reset(token)


def _traced(name, on_data, pairs):
    """``jax.make_jaxpr(on_data, return_shape=True)`` on the arguments' data; the errors of code
    that needs a concrete value, and of masked arrays reaching jax functions by closure, as a
    :class:`MaskifyError` that says why and what to write instead."""
    try:
        return jax.make_jaxpr(on_data, return_shape=True)(*(p.data for p in pairs))
    except _NEEDS_VALUE as err:
        first = str(err).strip().splitlines()[0]
        raise MaskifyError(
            f"maskify({name}): {name} needs the value of an array while it is traced "
            f"({type(err).__name__}: {first}). maskify traces the function on abstract arrays, as "
            "jax.jit does, also when it is called eagerly: give data-dependent sizes statically "
            "(size= of jnp.nonzero, jnp.argwhere, jnp.unique; jnp.where(mask, x, fill) instead of "
            "x[mask]), use lax.cond or jnp.where instead of a Python if on an array, or compute the "
            "value outside the function and pass it in."
        ) from err
    except TypeError as err:
        if "MaskedArray" not in str(err) and "SparseMasked" not in str(err):
            raise
        raise MaskifyError(
            f"maskify({name}): a masked array reached a jax function inside {name} without being an "
            "argument of the maskify'd function (a closed-over value): jax functions do not take "
            "masked arrays. Pass it as an argument (maskify(lambda x, m: ...)(x, m)), where maskify "
            f"gives it its masked meaning. ({err})"
        ) from err


_NEEDS_VALUE = (
    jax.errors.ConcretizationTypeError,
    jax.errors.TracerIntegerConversionError,
    jax.errors.TracerArrayConversionError,
    jax.errors.NonConcreteBooleanIndexError,
)


def _trace_key(fn, tree, pairs, statics):
    """What a trace of ``fn`` depends on: the arguments' structure, each array's shape, dtype and
    weak type, each mask's shape and dtype, and the static values; ``None`` when a static value
    cannot be hashed or an argument is a tracer (a call inside a transformation)."""
    parts = []
    for p in pairs:
        if not _eager(p.data) or (p.mask is not None and not _eager(p.mask)):
            return None
        mask = None if p.mask is None else (np.shape(p.mask), str(jnp.result_type(p.mask)))
        parts.append((np.shape(p.data), str(jnp.result_type(p.data)), bool(getattr(p.data, "weak_type", False)), mask))
    key = (fn, tree, tuple(parts), tuple(sorted(statics.items())))
    try:
        hash(key)
    except TypeError:
        return None
    return key


def _interpret(name, closed, pairs, rel):
    """The masked outputs of ``closed`` (``fun``'s jaxpr) on ``pairs``; ``rel``: the program's
    :class:`~._positions.Relativity`, ``None`` for positions as stored (no token axes)."""
    infos = [
        None if p.mask is None or rel is None else _coords.input_info(np.shape(p.mask), np.ndim(p.data), k)
        for k, p in enumerate(pairs)
    ]
    outs = _Interpreter(name, rel).run(closed.jaxpr, closed.consts, pairs, infos=infos)
    return [_wrap(o) for o in outs]


def _relativity(closed, on_data, pairs) -> _positions.Relativity:
    """Which static positions of the program count from the end of a token axis (see
    :class:`~._positions.Relativity`): read off a second trace with every token axis one longer,
    made only when the program slices or reads an axis as long as a token axis."""
    axes = [None if p.mask is None else _coords.ragged_axis(np.shape(p.mask), np.ndim(p.data)) for p in pairs]
    lengths = {np.shape(p.data)[a] for p, a in zip(pairs, axes) if a is not None}
    if not lengths or not _positions.positional(closed.jaxpr, lengths):
        return _positions.Relativity()
    growth = _positions.growth(lengths)

    def longer(plain_too):
        structs = []
        for p, a in zip(pairs, axes):
            shape = list(np.shape(p.data))
            if a is not None:
                shape[a] += growth[shape[a]]
            elif plain_too and p.mask is None:  # (labels of the tokens, given beside them)
                shape = [n + growth[n] if n in growth else n for n in shape]
            weak = bool(getattr(p.data, "weak_type", False))
            structs.append(jax.ShapeDtypeStruct(tuple(shape), jnp.result_type(p.data), weak_type=weak))
        return jax.make_jaxpr(on_data)(*structs)

    extended = None
    for plain_too in (True, False):  # plain arrays as long as a token axis grow with it, if they can
        try:
            extended = longer(plain_too)
            break
        except Exception:  # noqa: BLE001 - a program that does not trace at another length
            continue
    return _positions.relativity(closed, extended, lengths)


_EAGER_PROGRAMS: dict = {}

# The name of the function whose call runs an eager program: the program is traced (and raises its
# errors) inside that call, and kept for every function that traces to the same jaxpr.
_CALLED: contextvars.ContextVar[str] = contextvars.ContextVar("masked_jax_maskify_called", default="fun")

_SMALL_CONSTANT = 4096  # bytes: constants up to this size are part of the key by value


def _eager_program(closed, out_tree, pairs, rel):
    """For a call outside any trace (no argument is a tracer, or only eager autodiff's, see
    :func:`_eager`): the masked program of ``closed``,
    jitted, so that the call compiles one program instead of one per operation. Programs are kept
    by the jaxpr's text, its constants' values, the output structure and the masks' types: a later
    call that traces to the same program (the same function, or another one written the same way,
    even a new ``lambda``) reuses it, and one whose Python values changed traces to another. ``None``
    (the program then runs operation by operation) under a trace, or for a constant larger than
    :data:`_SMALL_CONSTANT` bytes (it would be kept alive by the program)."""
    if not all(_eager(x) for p in pairs for x in (p.data, p.mask)):
        return None
    consts = []
    for c in closed.consts:
        if not isinstance(c, (jax.Array, np.ndarray, np.generic)) or not _is_concrete(c):
            return None
        keys = jnp.issubdtype(c.dtype, jax.dtypes.extended)  # PRNG keys: their key data
        a = np.asarray(jax.random.key_data(cast(jax.Array, c)) if keys else c)
        if a.nbytes > _SMALL_CONSTANT or a.dtype == object:
            return None
        consts.append((str(c.dtype), a.shape, a.tobytes()))
    masks = tuple(None if p.mask is None else (tuple(np.shape(p.mask)), str(jnp.result_type(p.mask))) for p in pairs)
    rel_key = None if rel is None else rel.key()
    key = (str(closed.jaxpr), tuple(consts), out_tree, masks, rel_key)  # (the name only enters error messages)

    def run(datas, masks):  # errors name the function being called, not the first one kept here
        return _interpret(_CALLED.get(), closed, [Pair(d, m) for d, m in zip(datas, masks)], rel)

    return _kept(_EAGER_PROGRAMS, key, lambda: jax.jit(run), 256)


def _eager(x) -> bool:
    """Whether ``x`` is a value of an eager computation: concrete, or the tracer of an eager
    ``jax.grad`` / ``jax.jvp`` (an autodiff tracer whose primal is, at the bottom, concrete). The
    jitted program then serves the call too: jax differentiates the jitted call, compiling its
    derivative once, where the masked operations one by one would each compile their own."""
    while hasattr(x, "primal") and not _is_concrete(x):  # JVP and linearize tracers carry their primal
        x = x.primal
    return _is_concrete(x)


def _is_masked_leaf(x):
    return isinstance(x, (MaskedArray, SparseMasked))


def _wrap(p: Pair):
    # a plain output is a jax array, as jax's own functions return (a literal output is a numpy value)
    return jnp.asarray(p.data) if p.mask is None else from_pair(p.data, p.mask)
