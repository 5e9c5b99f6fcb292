"""``check_jacobian``: finite differences against ``jax.jacfwd`` / ``jax.jacrev``, under dense and
masked semantics, as one jit-compiled XLA computation.

Dense semantics (``jax.experimental.sparse`` and gradcheck's default): an unspecified element
is 0. Every element is perturbed; perturbing an unspecified element makes it specified (a
masked element becomes valid, a sparse array gains an entry). The analytical Jacobian is taken
at the original pattern for masked layouts (specifying a masked-out element moves the point, so
a function with masked semantics fails here, as ``torch.sparse.mm`` does in PyTorch's gradcheck discussion) and at the fully
specified equivalent for a jax BCOO (whose unspecified elements are zeros). Outputs are compared
everywhere, unspecified outputs read as 0.

Masked semantics: an unspecified element does not exist. Only specified elements are
perturbed and only valid outputs compared, and the check also verifies that the function *has*
masked semantics, so that a function reading masked-out data cannot pass by accident:

* the data under an input's mask is replaced by random values (twice, differently): the valid
  outputs and the output mask must not change;
* leak probes: the data under every mask is set to NaN, +inf, -inf and a huge value in turn; the
  valid outputs, the output mask and the VJP to valid inputs must stay what they are at a
  finite fill, and the VJP to masked-out inputs must stay 0 (with ``modes=("fwd",)``, the JVP of
  valid outputs along valid inputs instead) (``jnp.where(m, log(x), 0)``, ``0 * x``
  and a stabiliser taken over masked-out data all fail here); a sparse input gets one padding
  slot holding the probe value too, so reading a sparse array's padding data fails as well;
* perturbing masked-out data must not change any valid output (numerical leak), where the masked
  tables are taken on their own (:func:`_shares_tables`);
* analytical Jacobian entries at masked-out inputs, and tangents of masked-out outputs, are 0.

All perturbations of one input are batched with ``vmap``; numerical and analytical Jacobians of
every input are computed inside one ``jit``-compiled function, cached per function and input
pattern, and judged by a second small program where they are (:func:`_judge`), so a repeated
check costs two XLA calls on CPU, GPU or TPU and copies back numbers, not tables.
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
from masked_jax._core import MaskedArray
from masked_jax.checking._inputs import ALL, PADDED, SPARSE_KINDS, describe, is_leaf, output_vectors
from masked_jax.checking._report import Check, JacobianError, JacobianReport

SEMANTICS = ("dense", "masked")
MODES = ("fwd", "rev")
FULL_MAX_ELEMENTS = 1024  # fast=None: full Jacobian tables up to this many input elements in all
N_DIRECTIONS = 4  # random directions per input in fast mode
NEAR_MISS = 100.0  # a mismatch within this many tolerances is re-checked with the finite differences' error
_CACHE: collections.OrderedDict = collections.OrderedDict()
_CACHE_SIZE = 64


def default_tolerances(dtype):
    """``(eps, atol, rtol)`` for central differences in ``dtype``."""
    dtype = np.dtype(dtype)
    if dtype == np.float64:
        return 1e-6, 1e-5, 1e-3
    if dtype == np.float32:
        return 1e-3, 1e-2, 1e-2
    return 3e-2, 1e-1, 1e-1  # float16 / bfloat16 (the check itself runs their inputs in float32)


def check_jacobian(
    f,
    args,
    *,
    semantics="both",
    modes=("fwd", "rev"),
    eps=None,
    atol=None,
    rtol=None,
    fast=None,
    raise_exception=True,
    seed=0,
    leak_probes=True,
    compile=None,
    order=1,
) -> JacobianReport:
    """Compare finite-difference Jacobians of ``f`` with ``jax.jacfwd``/``jax.jacrev``.

    Inputs (the array leaves of ``args``) and outputs may be pytrees of float arrays,
    ``MaskedArray`` objects, BCOO-backed masked arrays, row-sparse arrays and
    ``jax.experimental.sparse.BCOO`` objects. Integer and bool leaves (masks, indices) are constants,
    other Python values are static.

    * ``semantics="dense"`` perturbs every element (unspecified = 0) and compares every output.
    * ``semantics="masked"`` perturbs specified elements only, compares valid outputs, and checks
      that the function implements masked semantics: changing masked-out data changes no valid
      output, and analytical entries at masked-out inputs and outputs are 0.
    * ``semantics="both"`` runs both; :attr:`JacobianReport.satisfies` names the semantics the
      function implements, and the report is truthy when it implements at least one.

    Args:
        f: the function, called as ``f(*args)``.
        args: a tuple of arguments (a single non-tuple argument is wrapped).
        semantics: ``"dense"``, ``"masked"`` or ``"both"``.
        modes: any of ``"fwd"`` (``jacfwd``/``jvp``) and ``"rev"`` (``jacrev``/``vjp``). A
            function with a ``custom_vjp`` has its forward check skipped, with a note.
        eps: finite-difference step; default by dtype (1e-6 for float64, 1e-3 for float32).
        atol, rtol: tolerances, ``|num - an| <= atol + rtol * |num|``; default by dtype.
        fast: ``True`` compares random projections ``v^T J u`` (cost independent of the
            Jacobian's size), ``False`` full Jacobian tables, ``None`` chooses by size (full up
            to 1024 input elements).
        raise_exception: raise :class:`JacobianError` (carrying the report) on failure.
        seed: seed of the random fill under masks and of the random directions.
        leak_probes: under masked semantics, also set the data under the masks to NaN, +-inf
            and a huge value and check that nothing valid changes (the default). ``False``
            skips them (a faster first call); the finite-fill checks remain.
        order: ``2`` checks second derivatives, as torch's ``gradgradcheck``: the Jacobian of
            the gradient of ``f`` (its VJP with a fixed random cotangent on the valid outputs;
            a ``MaskedArray`` input's gradient keeps its mask), by ``jacfwd`` of it
            (forward-over-reverse) and ``jacrev`` (reverse-over-reverse), against finite
            differences of the gradient. Inputs: arrays and ``MaskedArray`` objects.
        compile: ``None`` (default) compiles the whole check with ``jit`` (one XLA call per
            later check of the same function), except that a new function whose input and
            output shapes have been checked eagerly before runs eagerly, op by op, at once (jax's
            compiled primitives serve it); in interactive sessions the check then compiles in a
            background thread (``MJ_CHECK_BACKGROUND=1`` or ``0`` decides elsewhere). ``True``
            always compiles, ``False`` always runs eagerly. A function with the same code as one
            checked before (a re-run notebook cell, other captured arrays or numbers, another
            mask of the same shapes) finds that one's check and runs it on its own constants
            (for sparse inputs: only with the same captured values).

    Returns:
        A :class:`JacobianReport`, truthy when the check passed.

    Examples:
        >>> import jax.numpy as jnp, masked_jax as mj, masked_jax.numpy as mnp
        >>> x = mj.masked_array(jnp.array([1.0, 2.0, 3.0]), jnp.array([True, False, True]))
        >>> report = mj.check_jacobian(lambda v: mnp.sum(mnp.exp(v)), (x,), raise_exception=False)
        >>> report.satisfies
        ('masked',)
        >>> bool(mj.check_jacobian(lambda v: jnp.sum(v.data ** 2), (x,), semantics="dense"))
        True
    """
    if not callable(f):
        raise TypeError(f"check_jacobian: f must be callable; got {type(f).__name__}.")
    if order not in (1, 2):
        raise ValueError(f"check_jacobian: order must be 1 or 2; got {order!r}.")
    if order == 2:
        report = check_jacobian(
            _gradient_of(f, seed),
            args,
            semantics=semantics,
            modes=modes,
            eps=eps,
            atol=atol,
            rtol=rtol,
            fast=fast,
            raise_exception=False,
            seed=seed,
            leak_probes=leak_probes,
            compile=compile,
        )
        report.notes.insert(
            0,
            "second order: the Jacobian of f's gradient (its VJP with a fixed random cotangent "
            "on the valid outputs): forward-over-reverse (fwd), reverse-over-reverse (rev)",
        )
        if raise_exception and not report:
            raise JacobianError(report)
        return report
    if semantics not in ("dense", "masked", "both"):
        raise ValueError(f"semantics must be 'dense', 'masked' or 'both'; got {semantics!r}.")
    modes = (modes,) if isinstance(modes, str) else tuple(modes)
    if not modes or any(m not in MODES for m in modes):
        raise ValueError(f"modes must be a non-empty sequence of 'fwd' and 'rev'; got {modes!r}.")
    if compile not in (None, True, False):
        raise ValueError(f"check_jacobian: compile must be None, True or False; got {compile!r}.")
    sems = SEMANTICS if semantics == "both" else (semantics,)
    args = tuple(args) if isinstance(args, (tuple, list)) else (args,)

    flat, treedef = jax.tree_util.tree_flatten_with_path(args, is_leaf=is_leaf)
    x64 = bool(jax.config.jax_enable_x64)
    leaves, positions, values, consts, const_pos, static = [], [], [], [], [], []
    for pos, (path, x) in enumerate(flat):
        name = "args" + jax.tree_util.keystr(path)
        if is_leaf(x) or isinstance(x, (jax.Array, np.ndarray)):
            d = describe(name, x, "float64" if x64 else None)
            if d is not None:
                leaves.append(d[0])
                positions.append(pos)
                values.append(d[1])
                continue
            consts.append(x)
            const_pos.append(pos)
        else:
            static.append((pos, x))
    if not leaves:
        raise TypeError(
            "check_jacobian: no differentiable input: every array leaf of args has an integer "
            "or bool dtype. Pass float arrays (or masked / sparse arrays with float data)."
        )
    dtype = min((np.dtype(leaf.dtype) for leaf in leaves), key=lambda d: d.itemsize)
    d_eps, d_atol, d_rtol = default_tolerances(dtype)
    eps = d_eps if eps is None else _positive(eps, "eps", strict=True)
    atol = d_atol if atol is None else _positive(atol, "atol")
    rtol = d_rtol if rtol is None else _positive(rtol, "rtol")
    tol = (atol, rtol, _roundoff(dtype, eps))  # operands of the program that takes the verdict
    total = sum(leaf.size for leaf in leaves)
    fast = total > FULL_MAX_ELEMENTS if fast is None else bool(fast)

    def call(vals, extras, const_vals, patterns=None):
        objs = [None] * len(flat)
        for k, (leaf, pos, v, e) in enumerate(zip(leaves, positions, vals, extras)):
            objs[pos] = leaf.build(v, e, None if patterns is None else patterns[k])
        for pos, c in zip(const_pos, const_vals):
            objs[pos] = c
        for pos, s in static:
            objs[pos] = s
        return f(*jax.tree_util.tree_unflatten(treedef, objs))

    notes = []
    run_modes = modes
    try:
        entry, operands = _compiled(
            f, call, treedef, leaves, static, sems, run_modes, fast, eps, values, consts, leak_probes
        )
        raw = entry(operands, seed, compile)
    except TypeError as err:
        if "fwd" not in modes or "custom_vjp" not in str(err):
            raise
        run_modes = tuple(m for m in modes if m != "fwd")
        notes.append("forward mode skipped: f uses a jax.custom_vjp function, which has no JVP rule")
        if not run_modes:
            raise TypeError(
                "check_jacobian: f uses a jax.custom_vjp function, so forward mode cannot be "
                "checked; ask for modes=('rev',)."
            ) from None
        entry, operands = _compiled(
            f, call, treedef, leaves, static, sems, run_modes, fast, eps, values, consts, leak_probes
        )
        raw = entry(operands, seed, compile)
    names = entry.names
    notes += [f"output {s} skipped" for s in entry.skipped]
    raw = _fetch(raw, fast, tol, names, sems, run_modes, compile)
    checks = _compare(raw, leaves, names, sems, run_modes, fast, *tol, probes=leak_probes)
    # A second run where the first one calls for it: for a derivative just off the finite differences,
    # their error estimate (steps eps and 2 eps: twice the work, so only where a check would fail
    # without it, by at most NEAR_MISS times its tolerance; no step error of a smooth function is
    # larger); for a failed masked check in full mode, the leak map that locates the leak (an
    # evaluation and a Jacobian per input element, paid by failing checks only: the probes, the
    # random fills and the perturbed masked-out elements have already found the leak).
    near = any(c.near_miss for c in checks)
    locate = (
        not fast
        and leak_probes
        and "masked" in sems
        and not all(lf.spec.all() for lf in leaves)
        and any(c.semantics == "masked" and not c.passed for c in checks)
    )
    if near or locate:  # the map alone is a small program; with the estimate, the whole check again
        second, second_operands = _compiled(
            f,
            call,
            treedef,
            leaves,
            static,
            sems,
            run_modes,
            fast,
            eps,
            values,
            consts,
            leak_probes,
            richardson=near,
            leak_map="only" if locate and not near else locate,
        )
        raw = {**raw, **_fetch(second(second_operands, seed, compile), fast, tol, names, sems, run_modes, compile)}
        checks = _compare(raw, leaves, names, sems, run_modes, fast, *tol, probes=leak_probes)
    report = JacobianReport(
        checks=checks,
        semantics=sems,
        backend=jax.default_backend(),
        dtype=dtype.name,
        eps=eps,
        atol=atol,
        rtol=rtol,
        fast=fast,
        notes=notes,
    )
    entry.background(operands, seed, compile)
    if raise_exception and not report:
        raise JacobianError(report)
    return report


def _fetch(raw, fast, tol, names, sems, modes, compile):
    """``raw`` copied to the host, except the full tables (``"<input>/<semantics>"``), which are
    judged where they are (:func:`_judge`) and read by a report on demand."""
    tables = set() if fast else {k for k in raw if k.split("/")[0].isdigit()}
    rest = {k: v for k, v in raw.items() if k not in tables}
    if not tables:
        return jax.device_get(rest)
    needs = {k: raw[k] for k in (*tables, "valid", "specs", *(f"scale/{s}" for s in sems))}
    del rest["specs"]  # the host has them
    if compile is False:  # no program to compile: numpy judges them on the host
        needs = jax.device_get(needs)
        judged = _judge(needs, tol, tuple(names), sems, modes, xp=np)
        return {**jax.device_get(rest), "judged": judged, **{k: needs[k] for k in tables}}
    leaves, treedef = jax.tree_util.tree_flatten(rest)
    judged, flat = _judged(needs, tol, leaves, names=tuple(names), sems=sems, modes=modes)
    got = np.split(np.asarray(flat), np.cumsum([np.size(x) for x in leaves])[:-1]) if leaves else []
    rest = jax.tree_util.tree_unflatten(treedef, [g.reshape(np.shape(x)).astype(x.dtype) for g, x in zip(got, leaves)])
    return {**rest, "judged": np.asarray(judged), **{k: needs[k] for k in tables}}


def _gradient_of(f, seed):
    """``f``'s gradient as a function of the same arguments: the VJP of its raw outputs with a fixed
    random cotangent on the valid ones, per float array (a plain array) or ``MaskedArray`` input
    (a ``MaskedArray`` with the input's mask); other leaves are constants."""

    def grad(*args):
        leaves, treedef = jax.tree_util.tree_flatten(args, is_leaf=is_leaf)
        idx = []
        for i, x in enumerate(leaves):
            if is_leaf(x) and not isinstance(x, MaskedArray):
                raise TypeError(
                    f"check_jacobian(order=2): input {type(x).__name__} is not supported; second-order "
                    "checks take float arrays and MaskedArrays."
                )
            data = x.data if isinstance(x, MaskedArray) else x
            if hasattr(data, "dtype") and jnp.issubdtype(data.dtype, jnp.floating):
                idx.append(i)

        def inner(*datas):
            ls = list(leaves)
            for i, d in zip(idx, datas):
                ls[i] = (
                    MaskedArray.tree_unflatten(None, (d, leaves[i].mask)) if isinstance(leaves[i], MaskedArray) else d
                )
            _, raw, mask = output_vectors(f(*jax.tree_util.tree_unflatten(treedef, ls)))
            return raw, mask

        datas = [leaves[i].data if isinstance(leaves[i], MaskedArray) else leaves[i] for i in idx]
        raw, pull, mask = jax.vjp(inner, *datas, has_aux=True)
        cotangent = jax.random.normal(jax.random.PRNGKey(seed + 1), raw.shape, raw.dtype) * mask
        grads = pull(cotangent)
        return tuple(
            MaskedArray.tree_unflatten(None, (g, leaves[i].mask)) if isinstance(leaves[i], MaskedArray) else g
            for i, g in zip(idx, grads)
        )

    return grad


def _positive(value, name, strict=False):
    """``value`` as a float that is > 0 (``strict``) or >= 0 and finite; a ``ValueError`` otherwise."""
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise TypeError(f"check_jacobian: {name} must be a number; got {type(value).__name__}.") from None
    if not np.isfinite(v) or v < 0 or (strict and v == 0):
        raise ValueError(
            f"check_jacobian: {name} must be a finite number {'> 0' if strict else '>= 0'}; got {value!r}."
        )
    return v


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

    Compiling the whole check takes 0.2-0.7 s on a CPU; running it eagerly, op by op, takes
    10-100 ms once jax has compiled its primitives for these shapes (by an eager check of the
    same input and output shapes before), and seconds before that. So the first call of a check
    runs eagerly when its shapes are warm and compiles the check in a background thread for the
    calls that follow; with cold shapes it compiles in the foreground and runs the check eagerly
    in the background, which warms the shapes for the next new function. Later calls run the
    compiled check (one XLA call) once it is ready, eagerly until then. A check that does not
    compile (``f`` branches on values in Python) stays eager.
    """

    def __init__(self, run, names, skipped, shapes):
        self.run, self.names, self.skipped, self.shapes = run, names, skipped, shapes
        self.jitted = jax.jit(run)
        self.ready = threading.Event()
        self.thread = None
        self.compilable = True

    def __call__(self, operands, seed, compile):
        if compile or (compile is None and self.compilable and (self.ready.is_set() or self.shapes not in _WARM)):
            raw = self.jitted(operands, seed)
            self.ready.set()
            return raw
        raw = self.run(operands, seed)
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
            target=self._work, args=(operands, seed), daemon=True, name="masked_jax check_jacobian"
        )
        _PENDING.add(self.thread)
        self.thread.start()

    def _work(self, operands, seed):
        try:
            if self.ready.is_set():
                jax.block_until_ready(self.run(operands, seed))
                _WARM.add(self.shapes)
            else:
                jax.block_until_ready(self.jitted(operands, seed))  # fills jit's own cache
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
    leak_map=False,
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
        if traced is not None:
            # the check's leaves keep no pattern: the pattern is an operand (``_run`` reads ``specs``)
            generic = [dataclasses.replace(lf, spec_bytes=None) for lf in leaves]

            def run(ops, seed, jaxpr=jaxpr, plain=plain):
                vals, cs, lv, specs = ops
                return _run(
                    _jaxpr_evaluator(jaxpr, lv, specs, cs, plain),
                    generic,
                    names,
                    sems,
                    modes,
                    fast,
                    eps,
                    vals,
                    specs,
                    specified,
                    seed,
                    probes,
                    richardson,
                    leak_map,
                )
        else:

            def run(ops, seed):
                vals, cs = ops
                return _run(
                    _evaluator(call, names, cs),
                    leaves,
                    names,
                    sems,
                    modes,
                    fast,
                    eps,
                    vals,
                    None,
                    specified,
                    seed,
                    probes,
                    richardson,
                    leak_map,
                )

        entry = _Entry(run, names, skipped, shapes)
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
    """``leaf``'s pattern of specified elements as a device array (kept: a repeated check sends none)."""
    return jnp.asarray(leaf.spec)


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
        patterns = [_with_extra(jnp.asarray(s), e) for s, e in zip(specs, extras)]
        args = jax.tree_util.tree_leaves((list(lifted), list(vs), patterns, list(consts)))
        return tuple(jcore.jaxpr_as_fun(jaxpr)(*args)), plain

    return evaluate


def _with_extra(spec, extra):
    """The mask :meth:`Leaf.build` gives a ``MaskedArray`` input with pattern ``spec`` and ``extra``."""
    if extra is ALL:
        return jnp.ones_like(spec)
    if extra is None or extra is PADDED or spec.size == 0:  # an empty input has no entry to set
        return spec
    return spec.at[extra].set(True, mode="drop")


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

    vals = [jnp.asarray(v).astype(leaf.dtype).ravel() for leaf, v in zip(leaves, values)]
    patterns = [jnp.asarray(leaf.spec) for leaf in leaves]
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
    " at " + os.path.dirname(os.path.abspath(m.__file__)) + os.sep for m in (sys.modules["masked_jax"], jax)
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
            if info is None:  # a plain function: jax's own bookkeeping, or a rule we cannot place
                if getattr(v, "__module__", "").split(".")[0] != "jax":
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
        values.append(np.asarray(v.val, v.aval.dtype))
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
        return out, pull(jnp.ones_like(out))

    try:
        closed = jax.make_jaxpr(traced)([jnp.asarray(v).ravel() for v in values], consts)
    except Exception:  # noqa: BLE001 - a function the check will reject with its own message
        return None, found[0] if found else None
    return (str(closed.jaxpr), _digest(closed.consts), tuple(_callbacks(closed.jaxpr))), found[0]


def _random_fills(specs, values, key, lo, hi):
    """``values`` with the unspecified elements replaced by uniform random values in [lo, hi)."""
    keys = jax.random.split(key, len(specs))
    return [jnp.where(s, v, jax.random.uniform(k, v.shape, v.dtype, lo, hi)) for s, v, k in zip(specs, values, keys)]


def _run(
    evaluate,
    leaves,
    names,
    sems,
    modes,
    fast,
    eps,
    vals,
    specs,
    specified,
    seed,
    probes=True,
    richardson=False,
    leak_map=False,
):
    """Everything numerical and analytical, as arrays (traced once under jit).

    ``evaluate(values, extras)``: ``f``'s flat outputs and whether they are plain arrays (see
    :func:`_evaluator`). ``specs``: the inputs' patterns of specified elements (operands of a lifted
    check, whose ``leaves`` hold none), or ``None`` for the leaves' own. ``specified``: every
    element of every input is specified. ``richardson``: the finite differences' error estimate;
    ``leak_map``: the leak map (full mode, masked semantics with probes), ``"only"``: nothing else;
    both for a second run.
    """
    n = len(leaves)
    specs = [jnp.asarray(leaf.spec) for leaf in leaves] if specs is None else [jnp.asarray(s) for s in specs]
    # the dense-semantics point: unspecified elements 0 (a masked input's data, as given, may hold anything)
    vals = [jnp.where(s, v.astype(leaf.dtype).ravel(), 0) for leaf, v, s in zip(leaves, vals, specs)]
    k_fill, k_alt, rng = jax.random.split(jax.random.PRNGKey(seed), 3)
    fills = _random_fills(specs, vals, k_fill, 0.5, 1.5)  # masked semantics: data under masks is random
    alts = _random_fills(specs, vals, k_alt, -2.0, -1.0)  # ... and different: valid outputs must not move
    out = {}
    # Nothing unspecified in the inputs (``specified``): masked semantics perturbs what dense
    # semantics perturbs at the same point, no fill or probe can move anything, and with plain
    # array outputs the masked tables are the dense ones.
    plain = []

    def outputs(vs, extras):
        vectors, is_plain = evaluate(vs, extras)
        plain.append(is_plain)
        return vectors

    if leak_map == "only":  # at the fills, as in the whole check (the same seed)
        base = [e[0] for e in jax.vmap(lambda vs: outputs(vs, [None] * n))([f[None] for f in fills])]
        return {"leak_map": [_leak_map(outputs, specs, fills, base, modes, i) for i in range(n)]}
    points = [fills] if specified else [fills, alts] + ([vals] if "dense" in sems else [])
    evals = jax.vmap(lambda vs: outputs(vs, [None] * n))([jnp.stack(p) for p in zip(*points)])  # one batch
    base_m, alt_m = ([e[min(j, len(points) - 1)] for e in evals] for j in (0, 1))
    out["valid"] = base_m[2]
    out["scale/masked"] = jnp.abs(base_m[0])  # output magnitudes, for the rounding tolerance
    out["scale/dense"] = jnp.abs(evals[0][-1]) if "dense" in sems else out["scale/masked"]
    out["value_leak"] = jnp.where(base_m[2] & alt_m[2], jnp.abs(base_m[0] - alt_m[0]), 0)
    out["mask_changed"] = jnp.any(base_m[2] != alt_m[2])
    if "masked" in sems and probes and not specified:
        out["probes"] = _probes(outputs, leaves, specs, fills, base_m, modes, jax.random.fold_in(rng, n + 1))
        if leak_map and not fast:
            out["leak_map"] = [_leak_map(outputs, specs, fills, base_m, modes, i) for i in range(n)]
    for i, leaf in enumerate(leaves):
        for sem in sems:
            base = vals if sem == "dense" else fills
            which = 0 if sem == "dense" else 1  # analytical: filled outputs (dense) or raw data (masked)

            def F(v, extra, which, base=base):
                vs = list(base)
                vs[i] = v
                extras = [None] * n
                extras[i] = extra
                return outputs(vs, extras)[which]

            x0 = base[i]
            same = specified and plain[0] and not fast and "dense" in sems  # the two semantics: one check
            shared = not same and _shares_tables(leaf, sems, fast, probes)
            if sem == "masked" and same:
                out[f"{i}/masked"] = out[f"{i}/dense"]
            elif sem == "masked" and shared:
                out[f"{i}/masked"] = _masked_share(out[f"{i}/dense"], specs[i], modes)
            elif fast:
                out[f"{i}/{sem}"] = _projections(
                    F,
                    x0,
                    leaf,
                    specs[i],
                    sem,
                    modes,
                    eps,
                    out["valid"],
                    jax.random.fold_in(rng, i),
                    richardson,
                    out[f"scale/{sem}"],
                )
            else:
                out[f"{i}/{sem}"] = _tables(F, x0, leaf, sem, modes, eps, which, richardson, keep_raw=shared)
    out["specs"] = specs
    return out


JUDGED = (
    "passed",
    "max_abs",
    "near_miss",
    "max_rel",
    "fd_error",
    "numerical, masked-out inputs",
    "analytical, masked-out inputs",
    "analytical, masked-out outputs",
)


@functools.lru_cache(maxsize=256)
def _row_blocks(names):
    """The rows of each output in the flat output vector (``names``: a tuple)."""
    offsets = np.cumsum([0] + [int(np.prod(s, dtype=np.int64)) for _, s in names])
    return [slice(int(a), int(b)) for a, b in zip(offsets[:-1], offsets[1:])]


def _judge(out, tol, names, sems, modes, xp=jnp):
    """What decides every full-table check: one row of :data:`JUDGED` per input x semantics x output
    x mode (the order :func:`_compare` reads them in), in the array namespace ``xp``.

    With ``jnp`` it is a program of its own (:func:`_judged`), compiled once per table shape and
    run where the tables are; the host copies them only for the details a report shows on demand.
    Inside the check's program XLA would fuse the tables' computation into every reduction of them
    and compute each table many times; and all checks of one input and output take one (variadic)
    reduction, as many small reductions compile slowly.
    """
    atol, rtol, roundoff = tol
    judged = {}
    for i, spec in enumerate(out["specs"]):
        for j, rows in enumerate(_row_blocks(tuple(names))):
            terms, where = [], []  # per check: the entries whose largest values decide it
            for sem in sems:
                res = out[f"{i}/{sem}"]
                num = res["num"][rows]
                fd = res["fd_err"][rows] if "fd_err" in res else None
                scale = out[f"scale/{sem}"][rows].astype(num.dtype) * roundoff
                masked = sem == "masked"
                ok = (out["valid"][rows] if masked else xp.ones(num.shape[0], bool))[:, None]
                cols = (spec if masked else xp.ones(num.shape[1], bool))[None, :]
                compared = ok & cols
                abs_num = xp.abs(num)
                big = compared & (abs_num > atol)
                for mode in modes:
                    an = res[mode][rows]
                    err, allowed, excess = _errors(xp, num, an, 0 if fd is None else fd, scale, atol, rtol)
                    where.append((i, sem, j, mode))
                    terms.append(
                        [
                            compared & ~(excess <= 0),
                            xp.where(compared, err, 0),  # a NaN fails
                            compared & ~(err <= NEAR_MISS * allowed),
                            xp.where(big, err / xp.where(big, abs_num, 1), 0),
                            None if fd is None else xp.where(compared & ~xp.isnan(fd), fd, 0),
                            # perturbing a masked-out input moves a valid output more than rounding explains
                            xp.where(ok & ~cols, abs_num - scale[:, None], 0) if masked else None,
                            xp.where(~cols, xp.abs(an), 0) if masked else None,
                            xp.where(~ok, xp.abs(an), 0) if masked else None,
                        ]
                    )
            dtype = terms[0][1].dtype
            peaks = iter(_maxima(xp, [xp.asarray(t, dtype) for ts in terms for t in ts if t is not None]))
            for key, ts in zip(where, terms):
                fail, top, far, rel, fd_max, moved, leak_in, leak_out = (
                    xp.zeros((), dtype) if t is None else next(peaks) for t in ts
                )
                # a NaN among the entries is an infinite error (the relative one: where the absolute one is)
                inf = lambda v, nan: xp.where(xp.isnan(nan), xp.inf, v)  # noqa: E731
                judged[key] = xp.stack(
                    [
                        fail == 0,
                        inf(top, top),
                        (fail > 0) & (far == 0),
                        inf(rel, top),
                        fd_max,
                        inf(moved, moved),
                        inf(leak_in, leak_in),
                        inf(leak_out, leak_out),
                    ]
                ).astype(dtype)
    return xp.stack(
        [
            judged[(i, sem, j, mode)]
            for i in range(len(out["specs"]))
            for sem in sems
            for j in range(len(names))
            for mode in modes
        ]
    )


@functools.partial(jax.jit, static_argnames=("names", "sems", "modes"))
def _judged(out, tol, rest, names, sems, modes):
    """:func:`_judge` where the tables are, and the check's other (small) results ``rest`` as one
    float64 vector, so that one copy brings everything the host needs."""
    flat = [jnp.ravel(x).astype(jnp.float64 if jax.config.jax_enable_x64 else jnp.float32) for x in rest]
    return _judge(out, tol, names, sems, modes), jnp.concatenate(flat) if flat else jnp.zeros(0)


def _maxima(xp, arrays):
    """The largest entry (at least 0, NaN if one is NaN) of each of ``arrays``, all of one shape:
    one variadic reduction under ``jnp``."""
    if xp is np:
        return [np.max(a, initial=0) for a in arrays]
    return jax.lax.reduce(
        arrays,
        [jnp.zeros((), a.dtype) for a in arrays],
        lambda a, b: [jnp.maximum(x, y) for x, y in zip(a, b)],
        tuple(range(arrays[0].ndim)),
    )


def _errors(xp, num, an, fd, scale, atol, rtol):
    """``(|num - an|, tolerance, excess)`` of a full table, in the array namespace ``xp`` (``jnp``
    where the tables are, ``np`` on the host for an eager check and a report's details). The tolerance is
    ``atol + rtol |num|``, plus the outputs' rounding per row (``scale``) and twice the finite
    differences' estimated error ``fd``; an entry fails where ``excess`` is > 0 or NaN."""
    err = xp.abs(num - an)
    allowed = atol + rtol * xp.abs(num) + scale[:, None] + 2 * fd
    return err, allowed, err - allowed


def _leak(a, b):
    """``|a - b|``, infinite where either is NaN or infinite and they differ."""
    same = (a == b) | (jnp.isnan(a) & jnp.isnan(b))
    return jnp.where(same, 0, jnp.where(jnp.isfinite(a) & jnp.isfinite(b), jnp.abs(a - b), jnp.inf))


def _probes(outputs, leaves, specs, fills, base, modes, rng):
    """Leak probes: every masked-out element set to NaN, +inf, -inf and a huge value in turn (one
    ``vmap`` over the probes). A function with masked semantics gives the same valid outputs, the
    same output mask, the same tangents of valid outputs along valid inputs (JVP) and the same
    cotangents of valid inputs (VJP) as at the finite fill, and no cotangent (a NaN included) at
    masked-out inputs. Returns, per probe, the leak of each
    output element (values and JVP) and of each input element (VJP)."""
    n = len(leaves)
    valid = base[2]
    keys = jax.random.split(rng, 2 * n)
    tangents = [jax.random.normal(keys[i], f.shape, f.dtype) * s for i, (f, s) in enumerate(zip(fills, specs))]
    cotangent = jax.random.normal(keys[n], valid.shape, base[1].dtype) * valid

    # sparse inputs get one padding slot holding the probe value too (its data: a masked-out
    # element's), so that a function reading padding data is caught as one reading masked data
    padded = [PADDED] * n

    def raw(vs):
        return outputs(vs, padded)[1]

    # With reverse mode the VJP probes see every leak a JVP probe would (J^T v at valid and at
    # masked-out inputs covers every entry of J a NaN could sit in); the JVP probe runs alone.
    forward = "fwd" in modes and "rev" not in modes

    def derivatives(vs):
        jvp = jax.jvp(raw, (vs,), (tangents,))[1] if forward else jnp.zeros_like(valid, base[1].dtype)
        vjp = jax.vjp(raw, vs)[1](cotangent)[0] if "rev" in modes else [jnp.zeros_like(v) for v in vs]
        return jvp, vjp

    jvp0, vjp0 = derivatives(fills)

    def one(value):
        vs = [jnp.where(s, f, value.astype(f.dtype)) for f, s in zip(fills, specs)]
        o = outputs(vs, padded)
        jvp, vjp = derivatives(vs)
        return {
            "value": jnp.where(valid, _leak(o[0], base[0]), 0),
            "mask": jnp.any(o[2] != valid),
            "jvp": jnp.where(valid, _leak(jvp, jvp0), 0),
            "vjp": [jnp.where(s, _leak(a, b), 0) for a, b, s in zip(vjp, vjp0, specs)],
            # and no cotangent, not even a NaN, reaches the masked-out elements
            "vjp_off": [jnp.where(s, 0, _leak(a, jnp.zeros_like(a))) for a, s in zip(vjp, specs)],
        }

    dtype = min((np.dtype(leaf.dtype) for leaf in leaves), key=lambda d: d.itemsize)
    values = jnp.array([np.nan, np.inf, -np.inf, float(np.sqrt(float(jnp.finfo(dtype).max)))], dtype)
    return jax.vmap(one)(values)


PROBE_NAMES = ("NaN", "+inf", "-inf", "a huge value")


def _leak_map(outputs, specs, fills, base, modes, i):
    """How much the masked-out elements of input ``i`` reach the valid outputs (full mode; past
    ``atol`` it is a leak): ``value`` (outputs x elements): how far the output moves when that
    element alone holds NaN (infinite when it turns NaN); ``gradient``: the Jacobian entry, taken
    with NaN under every mask (infinite when NaN). Valid elements' columns are 0."""
    n = len(specs)
    spec, valid = specs[i], base[2]
    nan = jnp.asarray(np.nan, fills[i].dtype)

    def one(k):  # every element in turn (the pattern may be an operand); valid ones keep their fill
        vs = list(fills)
        vs[i] = fills[i].at[k].set(jnp.where(spec[k], fills[i][k], nan))
        return jnp.where(valid & ~spec[k], _leak(outputs(vs, [None] * n)[0], base[0]), 0)

    value = jax.vmap(one)(jnp.arange(spec.shape[0])).T
    poisoned = [jnp.where(s, f, nan) for s, f in zip(specs, fills)]

    def raw(v):
        vs = list(poisoned)
        vs[i] = v
        return outputs(vs, [None] * n)[1]

    jac = (jax.jacrev if "rev" in modes else jax.jacfwd)(raw)(poisoned[i])
    gradient = jnp.where(valid[:, None] & ~spec, jnp.where(jnp.isnan(jac), jnp.inf, jnp.abs(jac)), 0)
    return {"value": value, "gradient": gradient}  # sizes of the leaks; past atol they are leaks


def analytic_pattern(leaf, sem):
    """The pattern the analytical Jacobian is taken at: the original one, except for a jax BCOO under
    dense semantics, whose unspecified elements *are* zeros (so all are specified, as explicit 0s).
    A masked layout keeps its pattern: specifying a masked-out element would move the point."""
    return ALL if sem == "dense" and leaf.kind == "bcoo" else None


def _shares_tables(leaf, sems, fast, probes) -> bool:
    """Whether the masked-semantics tables of ``leaf`` are taken from the dense-semantics ones:
    full tables under both semantics, with leak probes, for an array or ``MaskedArray`` input.

    Both are then taken at the dense point (0 under the masks), where perturbing a valid element
    is the same evaluation under both semantics (specifying an element that is already specified
    changes nothing), and the Jacobian of the raw outputs gives both analytical tables (the dense
    one is zero on the masked-out outputs). The masked-out inputs are not perturbed: the random
    fills and the leak probes (NaN, +-inf and a huge value under every mask, with their VJPs)
    decide whether masked-out data reaches anything, and the leak map of a failed check locates
    it. Half the work of two separate sets of tables; sparse inputs keep them separate (their
    re-specified element is a padding slot, not the same evaluation).
    """
    return bool(not fast and probes and "dense" in sems and "masked" in sems and leaf.kind in ("array", "masked"))


def _masked_share(dense, spec, modes):
    """The masked-semantics tables from the dense ones (see :func:`_shares_tables`): the valid
    inputs' columns of the numerical table (the others 0, not perturbed) and the raw outputs'
    Jacobians, which :func:`_tables` kept aside (``keep_raw``)."""
    res = {"num": jnp.where(spec, dense["num"], 0)}
    if "fd_err" in dense:
        res["fd_err"] = jnp.where(spec, dense["fd_err"], 0)
    for mode in modes:
        res[mode] = dense.pop(f"raw/{mode}")
    return res


def _tables(F, x0, leaf, sem, modes, eps, which, richardson=False, keep_raw=False):
    """Full numerical and analytical Jacobians (outputs x input elements), and with ``richardson``
    the finite differences' estimated error. ``keep_raw``: the Jacobians are taken of the raw
    outputs (kept as ``"raw/<mode>"``), and the analytical tables are those with the outputs'
    masked-out rows zeroed (the Jacobians of the filled outputs)."""
    size = leaf.size
    dense = sem == "dense"

    # All perturbed points (steps eps, and 2 eps with ``richardson``) in one batch: one large
    # evaluation (e.g. one matmul) beats several.
    steps = jnp.eye(size, dtype=x0.dtype) * eps
    points = [x0 + steps, x0 - steps] + ([x0 + 2 * steps, x0 - 2 * steps] if richardson else [])
    ks = jnp.tile(jnp.arange(size), len(points))
    evals = jax.vmap(lambda v, k: F(v, k if dense else None, 0))(jnp.concatenate(points), ks)
    d1 = (evals[:size] - evals[size : 2 * size]) / (2 * eps)
    res = {"num": d1.T}
    if richardson:
        res["fd_err"] = _richardson(d1, (evals[2 * size : 3 * size] - evals[3 * size :]) / (4 * eps)).T
    pattern = analytic_pattern(leaf, sem)
    g = lambda v: F(v, pattern, 1 if keep_raw else which)  # noqa: E731
    for mode, jac in (("fwd", jax.jacfwd), ("rev", jax.jacrev)):
        if mode in modes:
            res[mode] = jac(g)(x0)
            if keep_raw:
                res[f"raw/{mode}"] = res[mode]
                res[mode] = jnp.where(F(x0, pattern, 2)[:, None], res[mode], 0)
    return res


def _richardson(d1, d2):
    """The error of the central difference ``d1`` (step h), estimated from ``d2`` (step 2h):
    their truncation errors are c h^2 and 4 c h^2, so ``|d1 - d2| / 3`` (Richardson's estimate,
    as numdifftools and scipy.differentiate use), which also picks up their rounding noise."""
    return jnp.abs(d1 - d2) / 3


def _projections(F, x0, leaf, spec, sem, modes, eps, valid, rng, richardson=False, scale=None):
    """Random-direction checks ``v^T J u`` (and, under masked semantics, the leaks). ``scale``: the
    outputs' magnitudes; ``res["scale"]`` is ``|v| . scale`` per direction, what the rounding of the
    outputs can move a projected central difference by (times :func:`_roundoff`)."""
    spec = spec.astype(x0.dtype)
    ku, kv = jax.random.split(rng)
    size = leaf.size
    out_size = valid.shape[0]
    U = jax.random.normal(ku, (N_DIRECTIONS, size), x0.dtype)
    V = jax.random.normal(kv, (N_DIRECTIONS, out_size), x0.dtype)
    dense = sem == "dense"
    extra = ALL if dense else None
    if not dense:
        V_out = V * ~valid
        V = V * valid
        U_off = U * (1 - spec)
        U = U * spec

    def num(u, v, h=eps):
        return jnp.dot(v, (F(x0 + h * u, extra, 0) - F(x0 - h * u, extra, 0))) / (2 * h)

    which = 0 if dense else 1
    g = lambda w: F(w, analytic_pattern(leaf, sem), which)  # noqa: E731
    d1 = jax.vmap(num)(U, V)
    res = {"num": d1}
    if scale is not None:
        res["scale"] = jnp.abs(V) @ scale.astype(V.dtype)
    if richardson:
        res["fd_err"] = _richardson(d1, jax.vmap(lambda u, v: num(u, v, 2 * eps))(U, V))
    if "fwd" in modes:
        jvp = jax.vmap(lambda u: jax.jvp(g, (x0,), (u,))[1])
        t = jvp(U)
        res["fwd"] = jnp.sum(t * V, axis=1)
        if not dense:
            res["fwd_leak_in"] = jnp.max(jnp.abs(jnp.sum(jvp(U_off) * V, axis=1)), initial=0)
            res["fwd_leak_out"] = jnp.max(jnp.abs(t * ~valid), initial=0)
    if "rev" in modes:
        _, pull = jax.vjp(g, x0)
        back = jax.vmap(lambda v: pull(v)[0])
        c = back(V)
        res["rev"] = jnp.sum(c * U, axis=1)
        if not dense:
            res["rev_leak_in"] = jnp.max(jnp.abs(c * (1 - spec)), initial=0)
            res["rev_leak_out"] = jnp.max(jnp.abs(back(V_out)), initial=0)
    if not dense:
        res["num_off"] = jax.vmap(num)(U_off, V)  # per direction; the leak is what rounding cannot explain
    return res


def _roundoff(dtype, eps) -> float:
    """Per unit of output magnitude, the rounding error a central difference with step ``eps``
    can carry in ``dtype`` (each evaluation is off by about one ulp of the output; the difference
    of two divided by ``2 eps``), with a safety factor of 4: an output of magnitude ``F`` gets
    ``F * roundoff`` more tolerance, so ``var(30 * x)`` in float32 is not failed for rounding."""
    return 4.0 * float(jnp.finfo(dtype).eps) / float(eps)


def _compare(raw, leaves, names, sems, modes, fast, atol, rtol, roundoff=0.0, probes=True):
    padded_inputs = ", ".join(lf.name for lf in leaves if lf.kind in SPARSE_KINDS and not lf.spec.all())
    valid = np.asarray(raw["valid"], bool)
    value_leak = np.asarray(raw["value_leak"])
    judged = None if fast else iter(np.asarray(raw["judged"], np.float64).tolist())
    checks = []
    for i, leaf in enumerate(leaves):
        spec = leaf.spec
        for sem in sems:
            res = raw[f"{i}/{sem}"]
            for (oname, oshape), rows in zip(names, _row_blocks(tuple(names))):
                leaks = {}
                if sem == "masked":
                    leaks["valid outputs vs masked-out data"] = float(np.max(value_leak[rows], initial=0))
                    if raw["mask_changed"]:
                        leaks["output mask depends on masked-out data"] = float("inf")
                    probes = raw.get("probes")
                    for p, pname in enumerate(PROBE_NAMES if probes is not None else ()):
                        under = f"{pname} under the masks"
                        if padded_inputs:  # a leak here may come from a padding slot as well
                            under += f" and in the padding slots of {padded_inputs}"
                        leaks[f"valid outputs with {under}"] = float(
                            np.max(np.asarray(probes["value"][p])[rows], initial=0)
                        )
                        if bool(probes["mask"][p]):
                            leaks[f"output mask with {under}"] = float("inf")
                        if "fwd" in modes and "rev" not in modes:
                            leaks[f"JVP of valid outputs with {under}"] = float(
                                np.max(np.asarray(probes["jvp"][p])[rows], initial=0)
                            )
                        if "rev" in modes:
                            leaks[f"VJP to valid inputs with {under}"] = float(
                                np.max(np.asarray(probes["vjp"][i][p]), initial=0)
                            )
                            leaks[f"VJP to masked-out inputs with {under}"] = float(
                                np.max(np.asarray(probes["vjp_off"][i][p]), initial=0)
                            )
                cells = None
                if sem == "masked" and raw.get("leak_map") is not None:
                    lm = raw["leak_map"][i]
                    over = lambda a: ~(np.asarray(a)[rows] <= atol)  # noqa: E731 - past atol, or NaN
                    cells = over(lm["value"]).astype(np.uint8) | (over(lm["gradient"]).astype(np.uint8) << 1)
                    leaks["masked-out inputs reaching valid outputs (leak map cells)"] = float(np.count_nonzero(cells))
                for mode in modes:
                    if fast:
                        c = _fast_check(res, mode, sem, leaks, atol, rtol, roundoff)
                    else:
                        table = _Table(
                            res,
                            mode,
                            sem,
                            rows,
                            valid[rows] if sem == "masked" else None,
                            spec,
                            cells,
                            raw[f"scale/{sem}"],
                            oshape,
                            leaf.shape,
                            (atol, rtol, roundoff),
                        )
                        c = _full_check(next(judged), table, leaks, atol, _shares_tables(leaf, sems, fast, probes))
                    checks.append(Check(input=leaf.name, output=oname, mode=mode, semantics=sem, **c))
    return checks


LEAK_KINDS = ((1, "value"), (2, "gradient"), (4, "numerical"))


def _leak_cells(cells, num, ok_rows, spec, atol):
    """(outputs x input elements) bit set: 1 value, 2 gradient (the NaN probes of the leak map), 4
    numerical (perturbing the masked-out element moves the valid output by more than ``atol``)."""
    out = np.zeros(num.shape, np.uint8) if cells is None else cells.copy()
    off = ~spec
    moved = np.zeros(num.shape, bool)
    moved[np.ix_(ok_rows, off)] = ~(np.abs(num[np.ix_(ok_rows, off)]) <= atol)
    out |= moved.astype(np.uint8) << 2
    return out


def _leak_entries(full, oshape, ishape, limit=12):
    """The leak map ``full`` (see :func:`_leak_cells`) as ``[(input index, output index, kinds)]``,
    at most ``limit`` entries."""
    entries = []
    for r, k in zip(*np.nonzero(full)):
        kinds = tuple(name for bit, name in LEAK_KINDS if full[r, k] & bit)
        entries.append((_unravel(int(k), ishape), _unravel(int(r), oshape), kinds))
        if len(entries) == limit:
            break
    return entries


def _leak_passed(leaks, atol):
    return all(np.isfinite(v) and v <= atol for v in leaks.values())


def _full_check(judged, table, leaks, atol, shared):
    """One full-table check from its row of :data:`JUDGED` (the verdict, taken where the check ran);
    the details a report shows (worst entries, tables, leak map) come from ``table`` when first
    read. ``shared``: the masked-out inputs were not perturbed (see :func:`_shares_tables`)."""
    row = dict(zip(JUDGED, judged))
    leaks = dict(leaks)
    if table.sem == "masked":
        leaks.update((k, row[k]) for k in (JUDGED[6:] if shared else JUDGED[5:]))  # shared: no numerical leak taken
    matched = bool(row["passed"])
    fd_max = row["fd_error"] if "fd_err" in table.res else None
    return dict(
        passed=matched and _leak_passed(leaks, atol),
        max_abs=row["max_abs"],
        max_rel=row["max_rel"],
        leaks=leaks,
        fd_error=fd_max,
        mismatch=not matched,
        near_miss=bool(row["near_miss"]),
        reason=_reason(matched, leaks, atol, table.mode, table.sem, row["max_abs"], fd_max),
        details=table.details,
    )


@dataclasses.dataclass
class _Table:
    """One full-table check's tables, still on the device, and what :meth:`details` needs to show
    them: ``ok`` the valid rows (``None``: all), ``cells`` the leak map's value and gradient bits."""

    res: dict
    mode: str
    sem: str
    rows: slice
    ok: object
    spec: np.ndarray
    cells: object
    scale: object
    oshape: tuple
    ishape: tuple
    tol: tuple  # (atol, rtol, roundoff), as check_jacobian passes them

    def details(self) -> dict:
        """The worst entries, ``|numerical - analytical|`` (NaN where not compared), both tables and
        the leak map, read from the device."""
        num = np.asarray(self.res["num"])[self.rows]
        an = np.asarray(self.res[self.mode])[self.rows]
        masked = self.sem == "masked"
        ok = np.ones(num.shape[0], bool) if self.ok is None else self.ok
        cols = self.spec if masked else np.ones(num.shape[1], bool)
        r_idx, c_idx = np.flatnonzero(ok), np.flatnonzero(cols)
        block = (lambda a: a) if ok.all() and cols.all() else (lambda a: a[np.ix_(r_idx, c_idx)])  # noqa: E731
        fd = block(np.asarray(self.res["fd_err"])[self.rows]) if "fd_err" in self.res else 0
        atol, rtol, roundoff = self.tol
        scale = np.asarray(self.scale)[self.rows][r_idx] * roundoff
        n_blk, a_blk = block(num), block(an)
        err, _, excess = _errors(np, n_blk, a_blk, fd, scale, atol, rtol)
        worst = []
        for flat_pos in _largest(excess.ravel(), 5):
            r, c = _unravel(flat_pos, excess.shape)
            worst.append(
                (
                    _unravel(int(r_idx[r]), self.oshape),
                    _unravel(int(c_idx[c]), self.ishape),
                    float(n_blk[r, c]),
                    float(a_blk[r, c]),
                    bool(not excess[r, c] <= 0),
                )
            )
        diff = np.full(num.shape, np.nan, err.dtype)
        diff[np.ix_(r_idx, c_idx)] = err
        cells = _leak_cells(self.cells, num, ok, self.spec, atol) if masked else None
        return dict(
            worst=worst,
            diff=diff,
            numerical=num,
            analytical=an,
            leak_cells=cells,
            leak_map=[] if cells is None else _leak_entries(cells, self.oshape, self.ishape),
        )


def _unravel(i, shape):
    """``np.unravel_index(i, shape)`` as a tuple of ints, without numpy's per-call overhead."""
    out = []
    for d in reversed(shape):
        i, r = divmod(i, d)
        out.append(r)
    return tuple(reversed(out))


def _largest(a, k):
    """Flat positions of the ``k`` largest entries of 1-d ``a``, largest first, ties by position, NaN
    before all (``np.argmax`` returns the first NaN).

    ``k`` argmax passes: linear, and unlike a sort or ``argpartition`` (6-9 ms on a 400 x 400
    table whose off-diagonal entries all tie) not slowed by ties. Picked entries are set to -inf
    during the search and restored after it, so ``a`` (writable) is left as it was.
    """
    picks, saved = [], []
    for _ in range(min(k, a.size)):
        picks.append(int(np.argmax(a)))
        saved.append(a[picks[-1]])
        a[picks[-1]] = -np.inf
    for p, v in zip(reversed(picks), reversed(saved)):  # reversed: a position picked twice keeps its value
        a[p] = v
    return picks


def _fast_check(res, mode, sem, leaks, atol, rtol, roundoff=0.0):
    num, an = np.asarray(res["num"]), np.asarray(res[mode])
    leaks = dict(leaks)
    # the outputs' rounding through each direction's projection: two evaluations of a large
    # output can differ by an ulp even where nothing depends on the perturbed elements
    rounding = roundoff * np.asarray(res["scale"]) if "scale" in res else np.zeros(num.shape)
    if sem == "masked":
        leaks["numerical, masked-out inputs"] = _beyond(np.asarray(res["num_off"]), rounding)
        leaks["analytical, masked-out inputs"] = float(res[f"{mode}_leak_in"])
        leaks["analytical, masked-out outputs"] = float(res[f"{mode}_leak_out"])
    err = np.abs(num - an)
    abs_num = np.abs(num)
    fd = np.asarray(res["fd_err"]) if "fd_err" in res else np.zeros(num.shape)
    tol = atol + rtol * abs_num + 2 * fd + rounding
    bad = ~(err <= tol)
    has_nan = bool(np.isnan(err).any())
    worst = [(f"direction {d}", "", float(num[d]), float(an[d]), bool(bad[d])) for d in np.argsort(-err)]
    fd_max = float(np.nanmax(fd, initial=0))
    shown = dict(worst=worst, diff=None, numerical=num, analytical=an, leak_map=[], leak_cells=None)
    return dict(
        passed=bool(not bad.any()) and _leak_passed(leaks, atol),
        max_abs=_max_of(err, has_nan),
        max_rel=_max_of(_relative(err, abs_num, atol), has_nan),
        leaks=leaks,
        details=lambda: shown,
        fd_error=fd_max if "fd_err" in res else None,
        mismatch=bool(bad.any()),
        near_miss=bool(bad.any()) and bool(np.all(err <= NEAR_MISS * tol)),
        reason=_reason(
            not bad.any(), leaks, atol, mode, sem, _max_of(err, has_nan), fd_max if "fd_err" in res else None
        ),
    )


def _reason(matched, leaks, atol, mode, sem, top, fd_max):
    """Why a check failed, in words: the derivative against the finite differences' estimated
    error, and the leaks with the semantics they break (empty when it passed)."""
    why = []
    if not matched:
        what = "jacfwd / JVP" if mode == "fwd" else "jacrev / VJP"
        estimate = "" if fd_max is None else f" and beyond their estimated error ({fd_max:.2g}, Richardson)"
        why.append(
            f"the {what} derivative differs from finite differences by {top:.3g}, beyond the tolerance"
            f"{estimate}: a wrong derivative under {sem} semantics"
        )
    bad = [k for k, v in leaks.items() if not (np.isfinite(v) and v <= atol)]
    if bad:
        why.append(
            f"masked-out data reaches what it must not ({'; '.join(bad[:3])}"
            f"{'; ...' if len(bad) > 3 else ''}): it breaks masked semantics"
        )
    return "; ".join(why)


def _relative(err, abs_num, atol):
    """``err / |num|`` where ``|num| > atol`` (elsewhere the absolute error is what counts), else 0."""
    return np.divide(err, abs_num, out=np.zeros_like(err), where=abs_num > atol)


def _beyond(moved, allowed):
    """How far ``|moved|`` goes past ``allowed`` (what the outputs' rounding can explain) at most;
    infinity if it holds a NaN."""
    return _max_of(np.abs(moved) - allowed, bool(np.isnan(moved).any()))


def _max_of(a, has_nan):
    """Largest entry of ``a``; infinity when the errors it came from hold a NaN; 0 when empty."""
    if has_nan:
        return float("inf")
    return float(np.max(a, initial=0))
