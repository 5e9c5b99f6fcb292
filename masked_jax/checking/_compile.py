"""The compiled check: one jit-compiled program per function and input pattern (numerical and
analytical Jacobians of every input, the probes), its cache, the lifting of a function's
constants so that new code with the same structure finds the same program, and the compiles
run in the background for interactive sessions.
"""

from __future__ import annotations

import atexit
import collections
import dataclasses
import functools
import hashlib
import os
import sys
import threading

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jcore

from masked_jax import _jaxpr
from masked_jax.checking._finite_diff import _run
from masked_jax.checking._inputs import is_leaf, output_vectors, random_draws, with_extra

_CACHE: collections.OrderedDict = collections.OrderedDict()

# A check's programs run once or a few times, on inputs the size of a test's: XLA's costlier
# optimisations take more compile time than they save (a flax MLP's check compiles in about two
# thirds of the time, and runs as fast). On the CPU, XLA's fusion emitters (MLIR kernels for each
# fusion) take most of the rest: without them the flax MLP's check compiles in a third of the time.
FAST_COMPILE = {
    "xla_backend_optimization_level": 0,
    "xla_llvm_disable_expensive_passes": True,
    "xla_cpu_use_fusion_emitters": False,
}


def fast_jit(fn, **kwargs):
    """``jax.jit(fn, **kwargs)`` compiled with :data:`FAST_COMPILE`."""
    return jax.jit(fn, compiler_options=FAST_COMPILE, **kwargs)


_CACHE_SIZE = 64


def _output_names(call, values, consts, n):
    found = []

    def probe(vals, cs):
        names, skipped = output_vectors(call([v.ravel() for v in vals], [None] * n, cs), names_only=True)
        found.append((names, skipped))
        return jnp.zeros(())

    jax.eval_shape(probe, values, consts)
    return found[0]


class _Entry:
    """One check, traced for one function structure and input pattern (``compile=None``).

    Compiling the whole check takes much longer than running it eagerly, op by op, once jax has
    compiled its primitives for these shapes (by an eager check of the same input and output
    shapes earlier), and running it eagerly with cold shapes takes longer still. So the first call of a check
    runs eagerly when its shapes are warm and compiles the check in a background thread for the
    calls that follow; with cold shapes it compiles in the foreground and runs the check eagerly
    in the background, which warms the shapes for the next new function. Later calls run the
    compiled check (one XLA call) once it is ready, eagerly until then. A check that does not
    compile (``f`` branches on values in Python) stays eager.
    """

    def __init__(self, run, names, skipped, shapes, draws):
        self.run, self.names, self.skipped, self.shapes = run, names, skipped, shapes
        self.draws = draws  # seed -> the check's random numbers (:func:`random_draws`)
        self.jitted = fast_jit(run)
        self.ready = threading.Event()
        self.thread = None
        self.compilable = True

    def __call__(self, operands, seed, compile):
        draws = self.draws(seed)
        if compile or (compile is None and self.compilable and (self.ready.is_set() or self.shapes not in _WARM)):
            raw = self.jitted(operands, draws)
            self.ready.set()
            return raw
        raw = self.run(operands, draws)
        _WARM.add(self.shapes)  # jax has compiled the primitives of these shapes
        return raw

    def background(self, operands, seed, compile):
        """Start what the foreground did not do: the compile, or the eager run that warms the shapes.
        Called once the check has been reported (both need the GIL)."""
        if compile is not None or not self.compilable or self.thread is not None or not background_enabled():
            return
        if self.ready.is_set() and self.shapes in _WARM:
            return
        self.thread = threading.Thread(
            target=self._work, args=(operands, self.draws(seed)), daemon=True, name="masked_jax check_jacobian"
        )
        _PENDING.add(self.thread)
        self.thread.start()

    def _work(self, operands, draws):
        try:
            if self.ready.is_set():
                jax.block_until_ready(self.run(operands, draws))
                _WARM.add(self.shapes)
            else:
                jax.block_until_ready(self.jitted(operands, draws))  # fills jit's own cache
        except Exception:  # noqa: BLE001 - the foreground reports f's errors; this check stays eager
            self.compilable = self.ready.is_set()
        finally:
            self.ready.set()
            _PENDING.discard(threading.current_thread())


_WARM: set = set()  # shapes of the checks that have run eagerly in this process


def background_enabled() -> bool:
    """Whether checks work in a background thread: set by ``MJ_CHECK_BACKGROUND`` (``1`` or ``0``);
    by default in interactive sessions (Jupyter, IPython, ``python -i``), where the thread works
    while the user reads the report, and not in scripts and test suites, where it would compete
    with what runs next."""
    flag = os.environ.get("MJ_CHECK_BACKGROUND", "")
    if flag in ("0", "1"):
        return flag == "1"
    return "ipykernel" in sys.modules or hasattr(sys, "ps1") or bool(sys.flags.interactive)


_PENDING: set = set()


@atexit.register
def wait_for_compiles():
    """Wait until the checks compiling in the background are compiled (also at exit, so that no
    thread is cut off inside XLA while the interpreter shuts down)."""
    for thread in list(_PENDING):
        thread.join()


def _compiled(
    f,
    call,
    treedef,
    leaves,
    static,
    sems,
    modes,
    fast,
    eps,
    values,
    consts,
    probes=True,
    richardson=False,
    leak_map: bool | str = False,
):
    """The cached :class:`_Entry` of this check and the operands to call it with.

    Two keys find it: the function object with the input pattern (no tracing: a repeated check),
    and the function's *structure*. For inputs that are arrays and ``MaskedArray`` objects the
    structure is the jaxpr of ``f`` with the masks as inputs and every captured constant, array
    or Python number, lifted out as an input too (:func:`_lifted`): a new function with the same
    code (a re-run notebook cell, a new lambda, other captured values, another mask pattern of the
    same shapes) reuses the traced and compiled check, run on its own constants and masks. For
    sparse inputs it is the jaxpr of the function's value and VJP with the values of its constants
    (:func:`_structure_key`). Either way a different custom derivative rule shows in the VJP's
    jaxpr, so it does not share a check.
    """
    config = (treedef, tuple(leaves), sems, modes, fast, eps, probes, richardson, leak_map)
    try:
        key = (f, tuple(static)) + config
        hash(key)
    except TypeError:  # an unhashable static argument: compile without caching
        key = None
    if key is not None and key in _CACHE:
        _CACHE.move_to_end(key)
        entry, lifted = _CACHE[key]
        return entry, _operands(leaves, values, consts, lifted)
    traced = _lifted(call, leaves, values, consts) if all(lf.kind in ("array", "masked") for lf in leaves) else None
    lifted = None  # the lifted constants' values, for a lifted check
    jaxpr = plain = found = None
    names: list = []
    skipped: list = []
    if traced is not None:
        jaxpr, lifted, skey, (names, skipped, plain) = traced
        pattern = tuple((lf.name, lf.kind, lf.shape, lf.dtype, bool(lf.spec.all())) for lf in leaves)
        skey = (skey, pattern) + config[:1] + config[2:]
    else:
        skey, found = _structure_key(call, values, consts, len(leaves))
        skey = None if skey is None else (skey,) + config
    if skey is not None and skey in _CACHE:
        entry = _CACHE[skey][0]
        _CACHE.move_to_end(skey)
    else:
        if traced is None:
            names, skipped = found if found else _output_names(call, values, consts, len(leaves))
            if not names:
                raise TypeError(
                    "check_jacobian: f returned no float output to differentiate"
                    + (f" (only {', '.join(skipped)})." if skipped else ".")
                )
        specified = all(lf.spec.all() for lf in leaves)
        shapes = (tuple((lf.kind, lf.shape, lf.dtype) for lf in leaves), tuple(names)) + config[2:]
        # the check's leaves keep no pattern when it is lifted: the pattern is an operand (``_run``
        # reads ``specs``)
        generic = [dataclasses.replace(lf, spec_bytes=None) for lf in leaves] if traced is not None else leaves

        def run(ops, draws):
            if traced is not None:  # (the values, the constants, the lifted values, the patterns)
                vals, cs, lv, specs = ops
                evaluate = _jaxpr_evaluator(jaxpr, lv, specs, cs, plain)
            else:  # (the values, the constants)
                (vals, cs), specs = ops, None
                evaluate = _evaluator(call, names, cs)
            return _run(
                evaluate,
                generic,
                names,
                sems,
                modes,
                fast,
                eps,
                vals,
                specs,
                specified,
                draws,
                probes,
                richardson,
                leak_map,
            )

        out_size = sum(int(np.prod(shape)) for _, shape in names)
        entry = _Entry(
            run,
            names,
            skipped,
            shapes,
            functools.partial(random_draws, sizes=[lf.size for lf in leaves], out_size=out_size, fast=fast),
        )
    for k in (key, skey):
        if k is not None:
            _CACHE[k] = (entry, lifted)
    while len(_CACHE) > _CACHE_SIZE:
        _CACHE.popitem(last=False)
    return entry, _operands(leaves, values, consts, lifted)


def _operands(leaves, values, consts, lifted):
    """What an entry is called with: the values and constant inputs, and for a lifted check the
    lifted constants and the input patterns."""
    if lifted is None:
        return values, consts
    return values, consts, lifted, [_pattern(leaf) for leaf in leaves]


@functools.lru_cache(maxsize=256)
def _pattern(leaf):
    """``leaf``'s pattern of specified elements as a device array (kept: a repeated check sends none;
    a transfer, where ``jnp.asarray`` would compile a program for each new shape)."""
    return jax.device_put(leaf.spec)


def _evaluator(call, names, consts):
    """``evaluate(values, extras) -> ((filled, raw, mask), plain)``: ``f`` at the built inputs, its
    outputs flattened; ``plain``: no output is a masked or sparse array."""

    def evaluate(vs, extras):
        out = call(vs, extras, consts)
        got = output_vectors(out, names_only=True)[0]
        if got != names:
            raise TypeError(
                f"check_jacobian: f's outputs changed structure between evaluations ({names} at the "
                f"given inputs, {got} at a perturbed or re-specified input); every evaluation must "
                "return the same pytree of the same shapes."
            )
        return output_vectors(out), _plain(out)

    return evaluate


def _plain(out) -> bool:
    """No leaf of ``f``'s output ``out`` is a masked or sparse array."""
    return not any(is_leaf(o) for o in jax.tree_util.tree_leaves(out, is_leaf=is_leaf))


def _jaxpr_evaluator(jaxpr, lifted, specs, consts, plain):
    """:func:`_evaluator` for a lifted check: the jaxpr of ``f`` (see :func:`_lifted`) evaluated at
    its lifted constants, with each ``MaskedArray`` input's mask made from its pattern and
    ``extra`` as :meth:`Leaf.build` makes it."""

    def evaluate(vs, extras):
        patterns = [with_extra(jnp.asarray(s), e) for s, e in zip(specs, extras)]
        args = jax.tree_util.tree_leaves((list(lifted), list(vs), patterns, list(consts)))
        return tuple(jcore.jaxpr_as_fun(jaxpr)(*args)), plain

    return evaluate


def _lifted(call, leaves, values, consts):
    """``(jaxpr, lifted, key, (names, skipped, plain))`` for a check of array and ``MaskedArray``
    inputs, or ``None`` when ``f`` does not trace with its masks as inputs (it reads them in
    Python; the check then keys on its values).

    ``jaxpr`` (closed, no constants) maps ``(lifted, values, patterns, consts)`` to the flat
    ``(filled, raw, mask)`` outputs: ``f`` traced once with every ``MaskedArray``'s mask an input,
    and with every constant it captured (arrays, and the Python numbers that appear as literals)
    lifted out into the inputs ``lifted``. ``key``: its printed text and the shapes and dtypes of
    ``lifted``; when ``f`` has custom derivative rules of its own (not this library's, which the
    primal jaxpr determines), also the printed VJP (where the rules show, linearised and
    transposed) with a digest of the VJP's own constants.
    """
    n = len(leaves)
    found = []

    def h(vals, patterns, cs):
        out = call(vals, [None] * n, cs, patterns)
        found.append(output_vectors(out, names_only=True) + (_plain(out),))
        return output_vectors(out)

    # traced on shapes alone: no eager op (each compiles a program for its new shapes)
    vals = [jax.ShapeDtypeStruct((leaf.size,), np.dtype(leaf.dtype)) for leaf in leaves]
    patterns = [jax.ShapeDtypeStruct((leaf.size,), np.dtype(bool)) for leaf in leaves]
    try:
        closed = jax.make_jaxpr(h)(vals, patterns, list(consts))
    except Exception:  # noqa: BLE001 - f reads its masks' values (or fails; the other path reports why)
        return None
    if not found[0][0]:
        return None  # no float output: the other path raises its error
    jaxpr, lifted = _lift_constants(closed)
    # host callbacks print by name only (their closures are invisible): the function itself keys them
    avals = (tuple((np.shape(v), str(v.dtype)) for v in lifted), tuple(_callbacks(jaxpr.jaxpr)))
    if not _has_own_rules(jaxpr.jaxpr):
        return jaxpr, lifted, (str(jaxpr.jaxpr), avals), found[0]

    def gradient(lv, vs, ps, cs):
        evaluate = _jaxpr_evaluator(jaxpr, lv, ps, cs, found[0][2])
        out, pull = jax.vjp(lambda v: evaluate(v, [None] * n)[0][1], vs)
        return pull(jnp.ones_like(out))

    try:
        vjp = jax.make_jaxpr(gradient)(lifted, vals, patterns, list(consts))
    except Exception:  # noqa: BLE001 - e.g. no reverse mode: key on values instead
        return None
    return jaxpr, lifted, (str(jaxpr.jaxpr), avals, str(vjp.jaxpr), _digest(vjp.consts)), found[0]


_TRUSTED = tuple(
    " at " + os.path.dirname(os.path.abspath(str(m.__file__))) + os.sep for m in (sys.modules["masked_jax"], jax)
)  # rules the primal jaxpr determines


def _has_own_rules(jaxpr) -> bool:
    """Whether ``jaxpr`` (or one nested in it) calls a custom JVP or VJP rule that is not this
    library's or jax's: its printed text shows such a rule only by name."""
    for eqn in _jaxpr.equations(jaxpr):
        if not eqn.primitive.name.startswith("custom_"):
            continue
        for v in eqn.params.values():
            info = getattr(v, "debug_info", None)
            if isinstance(v, jcore.ClosedJaxpr) or (info is None and not callable(v)):
                continue
            if info is None:  # a plain function: jax's or this library's bookkeeping, or a rule we cannot place
                if getattr(v, "__module__", "").split(".")[0] not in ("jax", "masked_jax"):
                    return True
            elif not (info.func_src_info or "").count(" at ") or not any(t in info.func_src_info for t in _TRUSTED):
                return True
    return False


def _callbacks(jaxpr):
    """The host functions that ``jaxpr`` (or one nested in it) calls back (``pure_callback``,
    ``io_callback``, ``jax.debug.callback``), not custom derivative rules."""
    for eqn in _jaxpr.equations(jaxpr):
        if not eqn.primitive.name.startswith("custom_"):
            for v in eqn.params.values():
                fn = getattr(v, "callback_func", v)
                if (
                    callable(fn)
                    and not isinstance(v, (jcore.ClosedJaxpr, jcore.Jaxpr))
                    and getattr(fn, "__module__", "").split(".")[0] not in ("jax", "jaxlib")
                ):
                    yield fn


def _lift_constants(closed):
    """``closed`` with its constants and the literals of its top-level equations made leading inputs:
    ``(jaxpr, values)``. Two functions that differ only in the values they captured then have the
    same jaxpr."""
    jaxpr = closed.jaxpr
    lifted_vars, values = list(jaxpr.constvars), list(closed.consts)

    def lift(v):
        if not isinstance(v, jcore.Literal):
            return v
        var = jcore.Var(v.aval)
        lifted_vars.append(var)
        values.append(np.asarray(v.val, getattr(v.aval, "dtype", None)))
        return var

    eqns = [eqn.replace(invars=[lift(v) for v in eqn.invars]) for eqn in jaxpr.eqns]
    outvars = [lift(v) for v in jaxpr.outvars]
    info = jaxpr.debug_info
    if info.arg_names is not None:
        info = info._replace(arg_names=("lifted",) * len(lifted_vars) + tuple(info.arg_names))
    new = jaxpr.replace(
        constvars=[], invars=lifted_vars + list(jaxpr.invars), eqns=eqns, outvars=outvars, debug_info=info
    )
    return jcore.ClosedJaxpr(new, []), values


def _digest(arrays):
    """A digest of the values of ``arrays``."""
    digest = hashlib.blake2b(digest_size=16)
    for c in arrays:
        a = np.asarray(c)
        digest.update(f"{a.dtype}{a.shape}".encode())
        digest.update(np.ascontiguousarray(a).tobytes())
    return digest.hexdigest()


def _structure_key(call, values, consts, n):
    """``(key, (output names, skipped outputs))``: the key, a hashable summary of everything the
    check computes from ``f``: the printed jaxpr of its outputs and their VJP at the given input
    pattern (custom JVP and VJP rules show in it, linearised and transposed) and a digest of the
    constants it captures. The key is ``None`` when tracing fails (the check reports why)."""

    found = []

    def traced(vals, cs):
        def g(vs):
            out = call(vs, [None] * n, cs)
            found.append(output_vectors(out, names_only=True))
            return output_vectors(out)[1]

        out, pull = jax.vjp(g, vals)  # holds the linearised JVP rules too, transposed
        return out, pull(jnp.ones_like(jnp.asarray(out)))

    try:
        closed = jax.make_jaxpr(traced)([jnp.asarray(v).ravel() for v in values], consts)
    except Exception:  # noqa: BLE001 - a function the check will reject with its own message
        return None, found[0] if found else None
    return (str(closed.jaxpr), _digest(closed.consts), tuple(_callbacks(closed.jaxpr))), found[0]
