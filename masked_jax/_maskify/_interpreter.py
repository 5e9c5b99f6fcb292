"""``maskify``: run ordinary ``jax.numpy`` code with masked semantics, by interpreting its jaxpr.

``maskify(fun)(*args)`` traces ``fun`` on the data of its arguments, then evaluates the jaxpr with
values that are :class:`~masked_jax.ops._base.Pair` ``(data, mask)``: an equation none of whose
operands is masked binds its primitive as usual; otherwise the primitive's masked rule from
:mod:`masked_jax._maskify._rules` runs (the same semantics as ``masked_jax.numpy``). Control flow
(``jit``, ``cond``, ``while``, ``scan``, ``custom_jvp`` / ``custom_vjp`` calls, ``checkpoint``) is
interpreted recursively, masks riding along in the carries.

**Means and variances.** ``jnp.mean`` and ``jnp.var`` divide a sum by the *static* number of
elements it summed. ``maskify`` tracks how many elements each masked ``reduce_sum`` counted:
dividing such a sum by its static element count (``n``), or by ``n - ddof``, divides by the
number of *valid* elements (minus ``ddof``) instead, valid where that number is positive. So
``jnp.mean``, ``jnp.var``, ``jnp.std`` and the layer norms built from them get their masked
meaning; a sum divided by a number that is not its element count is left alone.
"""

from __future__ import annotations

import contextlib
import functools
import threading

import jax
import jax.extend.core.primitives as P
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core as jcore

from masked_jax import _jaxpr
from masked_jax import nn as mnn
from masked_jax import numpy as mnp
from masked_jax._core import MaskedArray, SparseMasked, from_pair
from masked_jax._maskify import _rules as primitives
from masked_jax._validate import dtype_kind
from masked_jax.ops import _factors, normalization
from masked_jax.ops._base import Pair, and_masks, compact_or_ones, count_valid, fill, materialize, ranked, uniform_along

# Call-like primitives whose body is interpreted with the masks riding along.
# checkpoint's primitive: exported as remat_p by newer jax; otherwise read off a staged checkpoint
_CALLS = _jaxpr.CALL_PRIMITIVES
_LOOPS = frozenset((P.cond_p, P.while_p, P.scan_p))


class MaskifyError(NotImplementedError):
    """A primitive reached by a masked operand has no masked rule (see ``primitives.UNSUPPORTED``).

    Examples:
        >>> import jax.numpy as jnp, masked_jax as mj
        >>> x = mj.masked_array(jnp.eye(2), jnp.array([[True, False], [True, True]]))
        >>> try:
        ...     mj.maskify(jnp.linalg.cholesky)(x)
        ... except mj.MaskifyError as err:
        ...     print("cholesky" in str(err))
        True
    """


def maskify(fun):
    """``fun`` with masked semantics: it accepts masked arrays wherever it accepted arrays.

    ``fun`` is ordinary ``jax.numpy`` / ``jax.nn`` / ``lax`` code. Its arguments may be
    ``MaskedArray`` objects, sparse layouts (densified to ``MaskedArray``), arrays, and pytrees of them;
    non-array arguments (Python numbers, strings) and keyword arguments are static. Outputs that
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

    Examples:
        >>> import jax, jax.numpy as jnp, masked_jax as mj
        >>> x = mj.masked_array(jnp.array([1.0, 2.0, 100.0]), jnp.array([True, True, False]))
        >>> mj.maskify(jnp.mean)(x)
        MaskedArray(1.5, dtype=float32)
        >>> mj.maskify(jax.nn.softmax)(x).mask
        Array([ True,  True, False], dtype=bool)
    """
    if not callable(fun):
        raise TypeError(f"maskify: fun must be callable; got {type(fun).__name__}.")
    name = getattr(fun, "__name__", repr(fun))

    @functools.wraps(fun)
    def wrapped(*args, **kwargs):
        flat, tree = jax.tree_util.tree_flatten(args, is_leaf=_is_masked_leaf)
        pairs, statics, dyn_pos = [], {}, []
        for i, leaf in enumerate(flat):
            if isinstance(leaf, SparseMasked):
                leaf = leaf.todense()
            if isinstance(leaf, MaskedArray):
                pairs.append(Pair(leaf.data, leaf.compact_mask))
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
            return fun(*jax.tree_util.tree_unflatten(tree, leaves), **kwargs)

        with _recording_scans() as scans, _factors.new_trace():  # (inside an outer maskify: a trace apart)
            closed, out_shape = jax.make_jaxpr(on_data, return_shape=True)(*(p.data for p in pairs))
        out_tree = jax.tree_util.tree_structure(out_shape)
        program = _eager_program(name, closed, scans, out_tree, pairs)
        if program is not None:
            outs = program([p.data for p in pairs], [p.mask for p in pairs])
        else:
            outs = _interpret(name, closed, scans, pairs)
        return jax.tree_util.tree_unflatten(out_tree, outs)

    return wrapped


def _interpret(name, closed, scans, pairs):
    """The masked outputs of ``closed`` (``fun``'s jaxpr) on ``pairs``."""
    with _factors.recording():
        outs = _Interpreter(name, scans).run(closed.jaxpr, closed.consts, pairs)
    return [_wrap(o) for o in outs]


_EAGER_PROGRAMS: dict = {}
_SMALL_CONSTANT = 4096  # bytes: constants up to this size are part of the key by value


def _eager_program(name, closed, scans, out_tree, pairs):
    """For a call outside any trace (no argument is a tracer): the masked program of ``closed``,
    jitted, so that the call compiles one program instead of one per operation. Programs are kept
    by the jaxpr's text, its constants' values, the output structure and the masks' types: a later
    call that traces to the same program (the same function, or another one written the same way,
    even a new ``lambda``) reuses it, and one whose Python values changed traces to another. ``None``
    (the program then runs operation by operation) under a trace, for a jaxpr with a recorded
    ``associative_scan`` (its combine function is called again) or a constant larger than
    :data:`_SMALL_CONSTANT` bytes (it would be kept alive by the program)."""
    if scans or not all(_is_concrete(x) for p in pairs for x in (p.data, p.mask)):
        return None
    consts = []
    for c in closed.consts:
        if not isinstance(c, (jax.Array, np.ndarray, np.generic)) or not _is_concrete(c):
            return None
        keys = jnp.issubdtype(c.dtype, jax.dtypes.extended)  # PRNG keys: their key data
        a = np.asarray(jax.random.key_data(c) if keys else c)
        if a.nbytes > _SMALL_CONSTANT or a.dtype == object:
            return None
        consts.append((str(c.dtype), a.shape, a.tobytes()))
    masks = tuple(None if p.mask is None else (tuple(np.shape(p.mask)), str(jnp.result_type(p.mask))) for p in pairs)
    key = (str(closed.jaxpr), tuple(consts), out_tree, masks)  # (the name only enters error messages)

    def run(datas, masks):
        return _interpret(name, closed, (), [Pair(d, m) for d, m in zip(datas, masks)])

    return _kept(_EAGER_PROGRAMS, key, lambda: jax.jit(run), 256)


def _kept(table, key, make, limit):
    """``table[key]``, made by ``make()`` the first time; ``table`` is cleared when it holds
    ``limit`` programs (programs differ in their jaxprs and constants)."""
    program = table.get(key)
    if program is None:
        if len(table) >= limit:
            table.clear()
        program = table[key] = make()
    return program


def _is_masked_leaf(x):
    return isinstance(x, (MaskedArray, SparseMasked))


def _wrap(p: Pair):
    # a plain output is a jax array, as jax's own functions return (a literal output is a numpy value)
    return jnp.asarray(p.data) if p.mask is None else from_pair(p.data, p.mask)


def _moved_count(prim, params, count, shape):
    """A compact count of a sum of ``shape`` after the sum's ``broadcast_in_dim`` / ``reshape`` /
    ``convert_element_type`` (the count keeps its int dtype), kept compact where it can be."""
    c = count()
    if prim is P.convert_element_type_p:
        return c
    c = ranked(c, len(shape))
    new = primitives.compact_shape(prim, params, c, shape)
    return new if new is not None else prim.bind(jnp.broadcast_to(c, shape), **params)


class _Sized:
    """What a masked ``reduce_sum`` counted: the static element count ``n``, and ``count()``, the
    valid count at a compact shape of the sum (the sum's rank, 1 along dims the mask does not vary
    along). ``count`` is a function: the count is built only for a sum that is divided.
    ``uniform``: the mask does not vary along the summed axes (a layer norm's mean over the
    features of a token mask), so every slice counts ``n`` or is masked. ``any``: the sum is valid
    exactly where the count is positive (a ``reduce_sum``, not a window sum)."""

    def __init__(self, n, count, uniform=False, any=False):
        self.n, self.count, self.uniform, self.any = n, count, uniform, any


# -- lax.associative_scan, recognised as a whole call -------------------------------------------------
# Its body (slices, pads, the combine function) read primitive by primitive would combine valid and
# masked elements into masked ones, masking everything after a hole or left padding. While maskify
# traces, lax.associative_scan is therefore wrapped in a jit named _SCAN_NAME + its index in this
# trace's record of (fn, elems structure, reverse, axis), and the interpreter runs the scan over
# valid elements only (``_Interpreter._associative_scan``).
_ASSOCIATIVE_SCAN = lax.associative_scan
_SCAN_NAME = "masked_jax_associative_scan_"
_SCAN_RECORDS = threading.local()  # per thread: a stack of the records of the traces in progress
_SCAN_PATCH = {"users": 0, "lock": threading.Lock()}


@functools.wraps(_ASSOCIATIVE_SCAN)
def _recorded_associative_scan(fn, elems, reverse=False, axis=0):
    stack = getattr(_SCAN_RECORDS, "stack", None)
    if not stack:  # another thread's trace patched it: jax's own scan
        return _ASSOCIATIVE_SCAN(fn, elems, reverse=reverse, axis=axis)
    record = stack[-1]
    leaves, tree = jax.tree_util.tree_flatten(elems)

    def scan(*leaves):
        return _ASSOCIATIVE_SCAN(fn, jax.tree_util.tree_unflatten(tree, leaves), reverse=reverse, axis=axis)

    scan.__name__ = scan.__qualname__ = f"{_SCAN_NAME}{len(record)}"
    record.append((fn, tree, reverse, axis))
    return jax.jit(scan)(*leaves)


@contextlib.contextmanager
def _recording_scans():
    stack = _SCAN_RECORDS.__dict__.setdefault("stack", [])
    stack.append([])
    with _SCAN_PATCH["lock"]:
        _SCAN_PATCH["users"] += 1
        lax.associative_scan = _recorded_associative_scan
    try:
        yield stack[-1]
    finally:
        stack.pop()
        with _SCAN_PATCH["lock"]:
            _SCAN_PATCH["users"] -= 1
            if not _SCAN_PATCH["users"]:
                lax.associative_scan = _ASSOCIATIVE_SCAN


class _Interpreter:
    def __init__(self, fun_name, scans=()):
        self.fun_name = fun_name
        self.scans = scans  # lax.associative_scan calls recorded while tracing (see _recorded_associative_scan)
        # the jaxpr being run: its values, the equation that produced each variable, read counts
        self.env, self.producer, self.uses = {}, {}, {}

    def run(self, jaxpr, consts, args, literal_args=None):
        outer = (self.env, self.producer, self.uses)  # inner calls (jit, scan bodies) nest
        try:
            return self._run(jaxpr, consts, args, literal_args)
        finally:
            self.env, self.producer, self.uses = outer

    def _run(self, jaxpr, consts, args, literal_args):
        env, sized, minus = {}, {}, {}
        self.env, self.producer, self.uses = env, {}, _uses(jaxpr)
        # variables computed from literals alone: constants of the function (also an argument of an
        # inner call that the caller computed from literals, as jnp.where's 0.0 inside its jit)
        literal = {v for v, lit in zip(jaxpr.invars, literal_args or ()) if lit}

        def read(v):
            if _jaxpr.is_literal(v):
                return Pair(v.val, None)
            return env[v]

        for v, c in zip(jaxpr.constvars, consts):
            env[v] = Pair(c, None)
        for v, a in zip(jaxpr.invars, args):
            env[v] = a
        constants = _literal_constants(jaxpr, literal, env)
        skip = set()
        for i, eqn in enumerate(jaxpr.eqns):
            if i in skip:
                continue
            invals = [read(v) for v in eqn.invars]
            if eqn.outvars and eqn.outvars[0] in constants:  # from literals alone, evaluated beforehand
                literal.update(eqn.outvars)
                env[eqn.outvars[0]] = Pair(constants[eqn.outvars[0]], None)
                self.producer[eqn.outvars[0]] = eqn
                self._track_literals(eqn, invals, constants[eqn.outvars[0]], minus)
                continue
            whole = self._softmax(jaxpr.eqns, i, invals)
            if whole is not None:  # jax.nn.softmax, as one masked op
                chain, out = whole
                skip.update(chain)
                env[jaxpr.eqns[chain[-1]].outvars[0]] = out
                continue
            is_literal = [_jaxpr.is_literal(v) or v in literal for v in eqn.invars]
            if all(is_literal) and not eqn.effects:
                literal.update(eqn.outvars)
            if eqn.primitive is P.select_n_p and any(p.mask is not None for p in invals):
                invals = [_as_constant(p) if lit else p for p, lit in zip(invals, is_literal)]
            outs = self.equation(eqn, invals, sized, minus, is_literal)
            outs = outs if eqn.primitive.multiple_results else [outs]
            for v, o in zip(eqn.outvars, outs):
                env[v] = o
                self.producer[v] = eqn
        return [read(v) for v in jaxpr.outvars]

    # -- one equation ------------------------------------------------------------------------------
    def equation(self, eqn, invals, sized, minus, is_literal=None):
        prim, params = eqn.primitive, dict(eqn.params)
        name = prim.name
        unmasked = all(p.mask is None for p in invals)
        if prim is P.jit_p and not unmasked and str(params.get("name")).startswith(_SCAN_NAME):
            return self._associative_scan(params, invals)
        if (
            prim is P.jit_p
            and not unmasked
            and (params.get("name") in primitives.NAMED or params.get("name") in primitives.UNSUPPORTED_CALLS)
        ):
            return self.named_call(eqn, params, invals)
        if (prim in _CALLS or prim in _LOOPS) and not unmasked:
            return self.control(prim, params, invals, is_literal)
        if unmasked:
            if all(_is_concrete(p.data) for p in invals) and not prim.multiple_results:
                # Values computed from literals and constants alone stay constants, also when the
                # function is interpreted inside an outer jit/scan: counts, ddof and fills are
                # recognised the same way eagerly and under every transformation.
                with jax.ensure_compile_time_eval():
                    out = prim.bind(*(p.data for p in invals), **params)
            else:
                out = prim.bind(*(p.data for p in invals), **params)
            self._track_literals(eqn, invals, out, minus)
            return [Pair(o, None) for o in out] if prim.multiple_results else Pair(out, None)
        special = self._weighted_mean(eqn, invals)
        if special is None:
            special = self._mean_like(eqn, invals, sized, minus)
        if special is not None:
            return special
        rule = primitives.rule_for(prim)
        if rule is None:
            why = primitives.UNSUPPORTED.get(prim, "no masked rule is registered for it")
            raise MaskifyError(
                f"maskify({self.fun_name}): primitive '{name}' has a masked operand but no masked "
                f"rule ({why}). Fill the operand first (x.filled(...)) or compute it with "
                "masked_jax.numpy."
            )
        try:
            out = rule(prim, invals, **params)
        except primitives.NoMaskedRule as err:
            raise MaskifyError(
                f"maskify({self.fun_name}): primitive '{name}' has a masked operand and {err}. "
                "Fill the operand first (x.filled(...)) or compute it with masked_jax.numpy."
            ) from None
        if prim is P.reduce_sum_p:
            x = invals[0]
            shape, axes = jnp.shape(x.data), tuple(params["axes"])
            n = int(np.prod([shape[a] for a in axes], dtype=np.int64))
            compact = compact_or_ones(x.mask, shape)
            sized[eqn.outvars[0]] = _Sized(
                n, lambda: count_valid(compact, shape, axes), uniform=n > 0 and uniform_along(compact, axes), any=True
            )
        elif prim is P.reduce_window_sum_p:  # average pooling divides by the window size: a mean
            x = invals[0]
            n = int(np.prod(params["window_dimensions"], dtype=np.int64))
            sized[eqn.outvars[0]] = _Sized(
                n, lambda: primitives.window_count(materialize(x.mask, jnp.shape(x.data)), params)
            )
        elif prim in (P.broadcast_in_dim_p, P.reshape_p, P.convert_element_type_p) and _known(eqn.invars[0], sized):
            s = sized[eqn.invars[0]]
            sized[eqn.outvars[0]] = _Sized(
                s.n, functools.partial(_moved_count, prim, params, s.count, eqn.invars[0].aval.shape), s.uniform, s.any
            )
        return out

    @staticmethod
    def _track_literals(eqn, invals, out, minus):
        """Remember ``n - ddof`` (a concrete number minus a concrete number): jnp.var's divisor."""
        if eqn.primitive is P.sub_p and all(_concrete_scalar(p.data) is not None for p in invals):
            minus[eqn.outvars[0]] = (_concrete_scalar(invals[0].data), _concrete_scalar(invals[1].data))

    def _weighted_mean(self, eqn, invals):
        """``sum(x * w) / sum(w)`` (``jnp.average(x, weights=w)``) -> the weight total over the
        positions where ``x * w`` is valid: the masked weighted mean of ``masked_jax.numpy.average``,
        masked where those weights sum to 0."""
        if eqn.primitive is not P.div_p or any(_jaxpr.is_literal(v) for v in eqn.invars):
            return None
        (num_var, num_chain), (den_var, den_chain) = (self._root(v) for v in eqn.invars)
        num_eq, den_eq = self.producer.get(num_var), self.producer.get(den_var)
        if (
            num_eq is None
            or den_eq is None
            or num_eq.primitive is not P.reduce_sum_p
            or den_eq.primitive is not P.reduce_sum_p
            or num_eq.params["axes"] != den_eq.params["axes"]
            or len(num_chain) != len(den_chain)
        ):
            return None
        prod_eq = self.producer.get(num_eq.invars[0])
        weights = den_eq.invars[0]
        if prod_eq is None or prod_eq.primitive is not P.mul_p or weights not in prod_eq.invars:
            return None
        product, w = self.env[num_eq.invars[0]], self.env[weights]
        if product.mask is None:
            return None
        if any(self.uses[v] > 1 for v in [den_var, *(e.outvars[0] for e in den_chain)]):
            raise MaskifyError(
                f"maskify({self.fun_name}): the sum of the weights of a masked weighted average is "
                "used again (jnp.average(..., returned=True)); only the weights of valid entries "
                "count, so compute it as jnp.sum(jnp.where(valid, w, 0)) or use "
                "masked_jax.numpy.average."
            )
        mask = materialize(product.mask, jnp.shape(product.data))
        total = jnp.sum(jnp.where(mask, w.data, 0), axis=num_eq.params["axes"]).astype(invals[1].data.dtype)
        for e in reversed(num_chain):  # keepdims: the numerator's broadcasts, applied to the total
            total = e.primitive.bind(total, **e.params)
        num = invals[0]
        valid = and_masks(num.mask, total != 0)
        return Pair(jnp.where(valid, num.data / jnp.where(valid, total, 1), 0), valid)

    def _softmax(self, eqns, i, invals):
        """``(indices of the equations, result)`` when equation ``i`` begins ``jax.nn.softmax`` of a
        masked float operand (its own form or its custom-jvp body): ``exp(x - max(x))`` over its sum
        along the same axes, each intermediate read by the next step alone; or
        ``jax.nn.log_softmax``: ``x - max(x)`` minus the log of that sum. The masked softmax then
        runs as one op (:func:`masked_jax.ops.normalization.compact_softmax`, ``compact_log_softmax``:
        one select, no fills of the exponentials), where the equations one at a time would each
        sanitise their operands. Other equations between the steps run as usual."""
        eqn = eqns[i]
        if (
            eqn.primitive is not P.reduce_max_p
            or invals[0].mask is None
            or not jnp.issubdtype(eqn.invars[0].aval.dtype, jnp.floating)
        ):
            return None
        x, axes = eqn.invars[0], tuple(eqn.params["axes"])
        keep = tuple(1 if d in axes else n for d, n in enumerate(x.aval.shape))
        chain = [i]

        def follow(var, accept, uses=1):
            """The index of the one equation after the chain that reads ``var``, if ``accept`` takes it."""
            if self.uses.get(var) != uses:
                return None
            k = next((k for k in range(chain[-1] + 1, len(eqns)) if var in eqns[k].invars), None)
            return k if k is not None and accept(eqns[k]) else None

        def step(accept, uses=1):
            k = follow(eqns[chain[-1]].outvars[0], accept, uses)
            if k is not None:
                chain.append(k)
            return k is not None

        def minus_inf(v, before):  # jnp.max's initial: a literal, or a constant converted in the body
            if _jaxpr.is_literal(v):
                return np.ndim(v.val) == 0 and float(v.val) == -np.inf
            src = next((e for e in eqns[:before] if v in e.outvars), None)
            if src is not None and src.primitive is P.convert_element_type_p:
                v = src.invars[0]
                if _jaxpr.is_literal(v):
                    return np.ndim(v.val) == 0 and float(v.val) == -np.inf
            value = self.env.get(v)
            return value is not None and value.mask is None and _concrete_scalar(value.data) == -np.inf

        def keepdims(e):
            return e.primitive in (P.broadcast_in_dim_p, P.reshape_p) and e.outvars[0].aval.shape == keep

        k = follow(eqn.outvars[0], lambda e: e.primitive is P.max_p)
        if k is not None and any(minus_inf(v, k) for v in eqns[k].invars if v is not eqn.outvars[0]):
            chain.append(k)
        if not step(keepdims):
            return None
        step(lambda e: e.primitive is P.stop_gradient_p)
        if not step(lambda e: e.primitive is P.sub_p and e.invars[0] is x and e.invars[1] is not x):
            return None
        shifted = eqns[chain[-1]].outvars[0]
        log = self.uses.get(shifted) == 2  # log_softmax: x - max also minus the log of the sum
        if not step(lambda e: e.primitive is P.exp_p, uses=2 if log else 1):
            return None
        exps = eqns[chain[-1]].outvars[0]
        summed = lambda e: e.primitive is P.reduce_sum_p and tuple(e.params["axes"]) == axes  # noqa: E731
        # bfloat16 and float16 are summed in float32: a convert before the sum and after it
        reads = 1 if log else 2
        if not (
            step(summed, uses=reads)
            or (step(lambda e: e.primitive is P.convert_element_type_p, uses=reads) and step(summed))
        ):
            return None
        total = eqns[chain[-1]].outvars[0]
        if not step(keepdims):
            return None
        step(lambda e: e.primitive is P.convert_element_type_p and e.outvars[0].aval.dtype == x.aval.dtype)
        if log:
            if not step(lambda e: e.primitive is P.log_p):
                return None
            lse = eqns[chain[-1]].outvars[0]
            k = follow(lse, lambda e: e.primitive is P.sub_p and e.invars[0] is shifted and e.invars[1] is lse)
        else:
            norm = eqns[chain[-1]].outvars[0]
            k = follow(norm, lambda e: e.primitive is P.div_p and e.invars[0] is exps and e.invars[1] is norm)
        if k is None or self.uses.get(total) != 1:
            return None
        op = normalization.compact_log_softmax if log else normalization.compact_softmax
        return chain + [k], op(invals[0], axes)

    def _root(self, var):
        """``(v, chain)``: ``var`` is ``v`` reshaped or broadcast by the equations of ``chain``."""
        chain = []
        while _known(var, self.producer) and self.producer[var].primitive in (P.broadcast_in_dim_p, P.reshape_p):
            chain.append(self.producer[var])
            var = chain[-1].invars[0]
        return var, chain

    def _mean_like(self, eqn, invals, sized, minus):
        """``sum / n`` -> ``sum / count``; ``sum / (n - ddof)`` -> ``sum / (count - ddof)``."""
        if eqn.primitive is not P.div_p or not _known(eqn.invars[0], sized):
            return None
        s, den = sized[eqn.invars[0]], invals[1]
        if den.mask is not None:
            return None
        value = _concrete_scalar(den.data)
        if value is not None and value == s.n:
            ddof = 0
        elif _known(eqn.invars[1], minus) and minus[eqn.invars[1]][0] == s.n:
            ddof = minus[eqn.invars[1]][1]
        else:
            return None
        num = invals[0]
        if s.uniform and s.n - ddof > 0:
            # each slice is all valid (count n) or all masked, and the sum's mask says which: the
            # quotient is the plain one, ``sum / (n - ddof)``, a finite sum of zero-filled terms
            # where it is masked (no count, no select, no new mask)
            data, mask = num.data / jnp.asarray(s.n - ddof, jnp.result_type(num.data)), num.mask
        else:
            dof = s.count() - ddof  # compact: the quotient's mask stays as compact as the count
            valid = dof > 0
            # Where it is masked the quotient is the sum itself (a finite sum of zero-filled terms,
            # or a valid sum left without a divisor): no select at the sum's shape, only at the
            # count's. With no ddof a positive count is the sum's own validity: its mask, no and.
            data = num.data / jnp.where(valid, dof, 1).astype(jnp.result_type(num.data))
            mask = num.mask if ddof == 0 and s.any else and_masks(num.mask, valid)
        if mask is num.mask and _factors.holds_zero(num.data, num.mask):  # zero sums stay zero
            _factors.record_value(data, mask, 0, True)
        return Pair(data, mask)

    def named_call(self, eqn, params, invals):
        """A jax function's own jit call (``jnp.median``) replaced by its op's rule, its static
        arguments recognised from the call's body (see ``OpSpec.static``)."""
        name = params["name"]
        if name in primitives.UNSUPPORTED_CALLS:
            raise MaskifyError(
                f"maskify({self.fun_name}): jnp.{name} of a masked operand is not supported "
                f"({primitives.UNSUPPORTED_CALLS[name]})."
            )
        spec = primitives.NAMED[name]
        kw = primitives.recognise(spec, params["jaxpr"], [v.aval for v in eqn.invars])
        if kw is None:
            raise MaskifyError(
                f"maskify({self.fun_name}): jnp.{name} is called on a masked operand with arguments "
                f"maskify does not recognise (it matches the forms masked_jax.numpy.{spec.name} "
                f"takes); call masked_jax.numpy.{spec.name} directly."
            )
        n = len(spec.operands)
        operands, rest = invals[:n], invals[n:]
        if any(p.mask is not None for p in rest):
            raise MaskifyError(
                f"maskify({self.fun_name}): an argument of jnp.{name} other than the array "
                "(such as q) is masked; it must be a plain array."
            )
        out = spec.rule(*operands, *(p.data for p in rest), **kw)
        return [out if isinstance(out, Pair) else Pair(out, None)]

    def _associative_scan(self, params, invals):
        """``lax.associative_scan(fn, elems)`` over the valid elements only: an element is valid
        where every leaf of ``elems`` is, masked-out elements are skipped (the combination of
        ``a`` and a masked ``b`` is ``a``), and the result keeps that mask. Masked-out data are
        replaced by zeros before ``fn`` sees them, which only ever combines valid values."""
        fn, tree, reverse, axis = self.scans[int(params["name"][len(_SCAN_NAME) :])]
        shapes = {jnp.shape(p.data) for p in invals}
        if len(shapes) != 1:
            raise MaskifyError(
                f"maskify({self.fun_name}): lax.associative_scan of masked elements needs every "
                f"leaf of elems to have one shape (got {sorted(shapes)}): an element is valid where "
                "all its leaves are."
            )
        shape = shapes.pop()
        valid = materialize(and_masks(*(p.mask for p in invals)), shape)
        data = [fill(p.data, valid, 0) for p in invals]

        def combine(a, b):
            (xa, va), (xb, vb) = a, b
            both = tree.flatten_up_to(
                fn(jax.tree_util.tree_unflatten(tree, xa), jax.tree_util.tree_unflatten(tree, xb))
            )
            return [jnp.where(va & vb, ab, jnp.where(vb, b_, a_)) for ab, a_, b_ in zip(both, xa, xb)], va | vb

        out, _ = _ASSOCIATIVE_SCAN(combine, (data, valid), reverse=reverse, axis=axis)
        return [Pair(fill(o, valid, 0), valid) for o in out]

    # -- control flow ------------------------------------------------------------------------------
    def control(self, prim, params, invals, is_literal=None):
        if prim in _CALLS:
            closed = params.get("jaxpr") or params.get("call_jaxpr") or params.get("fun_jaxpr")
            try:
                if isinstance(closed, jcore.ClosedJaxpr):
                    return self.run(closed.jaxpr, closed.consts, invals, is_literal)
                return self.run(closed, (), invals, is_literal)
            except MaskifyError as err:
                user = _public_name(params.get("name")) if prim is P.jit_p else None
                if user is None:
                    raise
                new = MaskifyError(_inside_public_call(self.fun_name, user, err))
                new.detail = getattr(err, "detail", None) or str(err).split(": ", 1)[-1]  # the primitive's
                raise new from None
        if prim is P.cond_p:
            index, *ops = invals
            if index.mask is not None:
                raise MaskifyError(
                    f"maskify({self.fun_name}): the predicate of lax.cond is masked; a branch "
                    "cannot be chosen for a missing value."
                )
            ops = _materialized(ops)
            branches = [functools.partial(self._branch, b) for b in params["branches"]]
            return lax.switch(index.data, branches, ops)
        if prim is P.while_p:
            return self._while(params, invals)
        return self._scan(params, invals)

    def _branch(self, closed, ops):
        with _factors.new_trace():
            return _materialized(self.run(closed.jaxpr, closed.consts, ops))

    def _while(self, params, invals):
        nc, nb = params["cond_nconsts"], params["body_nconsts"]
        cconsts, bconsts, carry = invals[:nc], invals[nc : nc + nb], _materialized(invals[nc + nb :])
        cj, bj = params["cond_jaxpr"], params["body_jaxpr"]

        def cond_fn(c):
            with _factors.new_trace():
                (p,) = self.run(cj.jaxpr, cj.consts, list(cconsts) + list(c))
            return p.data if p.mask is None else p.data & p.mask  # a masked predicate stops the loop

        def body_fn(c):
            with _factors.new_trace():
                return _materialized(self.run(bj.jaxpr, bj.consts, list(bconsts) + list(c)))

        return lax.while_loop(cond_fn, body_fn, carry)

    def _scan(self, params, invals):
        nconsts, ncarry = _scan_counts(params, len(invals))
        consts, carry, xs = (
            invals[:nconsts],
            _materialized(invals[nconsts : nconsts + ncarry]),
            invals[nconsts + ncarry :],
        )
        xs = _materialized(xs)
        body = params["jaxpr"]

        def step(c, x):
            with _factors.new_trace():
                outs = _materialized(self.run(body.jaxpr, body.consts, list(consts) + list(c) + list(x)))
            return outs[:ncarry], outs[ncarry:]

        carry, ys = lax.scan(
            step, carry, xs, length=params["length"], reverse=params["reverse"], unroll=params["unroll"]
        )
        return list(carry) + list(ys)


def _public_name(name):
    """``"jnp.searchsorted"`` for the jit call of a public ``jax.numpy`` / ``jax.nn`` function, else
    ``None`` (jax's internal helpers start with ``_``)."""
    if not name or name.startswith("_"):
        return None
    for label, module in (("jnp", jnp), ("jax.nn", jax.nn)):
        if callable(getattr(module, name, None)):
            return f"{label}.{name}"
    return None


def _inside_public_call(fun_name, user, err):
    """The message for a primitive without a masked meaning met inside ``user`` (a jax function):
    the user-level function first, the masked function to call instead where there is one, the
    primitive's detail last."""
    short = user.split(".")[-1]
    module = mnn if user.startswith("jax.nn") else mnp
    instead = (
        f" Call masked_jax.{module.__name__.split('.')[-1]}.{short}, its masked version, directly"
        + (
            " (jnp.interp and jnp.histogram call jnp.searchsorted: masked_jax.numpy.interp and "
            "masked_jax.numpy.histogram are theirs)."
            if short == "searchsorted"
            else "."
        )
        if hasattr(module, short)
        else " Fill the operand first (x.filled(...))."
    )
    detail = getattr(err, "detail", None) or str(err).split(": ", 1)[-1]
    return (
        f"maskify({fun_name}): {user} is not supported on a masked operand; its implementation "
        f"reads elements in a way that has no masked meaning.{instead} (Inside {user}: {detail})"
    )


_CONSTANT_PROGRAMS: dict = {}


def _literal_constants(jaxpr, literal, env):
    """``{variable: value}`` of the equations computed from literals alone (``zeros_like``, a
    fill's broadcast, ``n - ddof``), evaluated by one compiled program. Evaluated one at a time, as
    :meth:`_Interpreter.equation` does the others (so that counts and fills are recognised under
    every transformation), each would compile a program of its own when the function is first
    traced. The literals enter the program as arguments, so nothing is folded when it is compiled
    and each value is what its equation alone gives. Empty (the equations then run one at a time)
    when there are fewer than two, when a parameter cannot be a cache key, or when a value's type
    differs from its equation's."""
    inputs, group, seen = [], [], set()
    for v in jaxpr.invars:
        if v in literal and env[v].mask is None and _is_concrete(env[v].data):
            seen.add(v)
            inputs.append(v)
    for eqn in jaxpr.eqns:
        if (
            eqn.primitive.multiple_results
            or eqn.effects
            or len(eqn.outvars) != 1
            or not all(_jaxpr.is_literal(v) or v in seen for v in eqn.invars)
        ):
            continue
        group.append(eqn)
        seen.add(eqn.outvars[0])
    if len(group) < 2:
        return {}
    lits = [v for e in group for v in e.invars if _jaxpr.is_literal(v)]
    names = {v: i for i, v in enumerate(inputs + [e.outvars[0] for e in group])}
    lit_at = iter(range(len(names), len(names) + len(lits)))
    structure = tuple(
        (
            e.primitive,
            tuple(sorted(e.params.items())),
            tuple(("l", next(lit_at)) if _jaxpr.is_literal(v) else ("v", names[v]) for v in e.invars),
        )
        for e in group
    )
    values = [env[v].data for v in inputs] + [v.val for v in lits]
    avals = tuple(jax.typeof(x) for x in values[: len(inputs)]) + tuple(v.aval for v in lits)
    key = (structure, avals)
    try:
        hash(key)
    except TypeError:  # a parameter that is not hashable: one equation at a time
        return {}
    program = _kept(
        _CONSTANT_PROGRAMS, key, lambda: jax.jit(functools.partial(_run_constants, structure, len(inputs))), 1024
    )
    try:
        # lowered and compiled apart from any trace this runs in (jax's caches keep the compiled
        # program; jax.clear_caches() clears it), then run on the concrete values, also inside a trace
        specs = [jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=a.weak_type) for a in avals]
        outs = program.lower(*specs).compile()(*values)
    except Exception:  # noqa: BLE001 (anything the program cannot take runs one equation at a time)
        return {}
    if any(jax.typeof(o) != e.outvars[0].aval for o, e in zip(outs, group)):
        return {}
    return {e.outvars[0]: o for e, o in zip(group, outs)}


def _run_constants(structure, n_inputs, *values):
    """The equations of a :func:`_literal_constants` key, on its inputs, then its literals."""
    env = list(values[:n_inputs])
    lits = values[n_inputs:]
    first_lit = n_inputs + len(structure)
    for prim, params, reads in structure:
        args = [lits[i - first_lit] if kind == "l" else env[i] for kind, i in reads]
        env.append(prim.bind(*args, **dict(params)))
    return env[n_inputs:]


def _known(v, table) -> bool:
    """Is variable ``v`` a key of ``table``? (Literals are unhashable and never are.)"""
    return not _jaxpr.is_literal(v) and v in table


def _uses(jaxpr):
    """How many times each variable is read (by an equation or as an output)."""
    counts = {}
    for v in [v for e in jaxpr.eqns for v in e.invars] + list(jaxpr.outvars):
        if not _jaxpr.is_literal(v):
            counts[v] = counts.get(v, 0) + 1
    return counts


def _scan_counts(params, n_in):
    """``(consts, carry)`` operand counts of a ``scan`` equation.

    jax up to 0.10 names them ``num_consts`` / ``num_carry``; jax 0.11 passes ``ft_in``, a flat
    tree that splits the operands into ``(consts, carry, xs)`` the way jax's own scan rules
    read it (``ft_in.update(operands).unpack()``).
    """
    if "num_consts" in params:
        return params["num_consts"], params["num_carry"]
    groups = params.get("ft_in")
    try:
        consts, carry, _ = groups.update(list(range(n_in))).unpack()
    except (AttributeError, TypeError, ValueError):
        raise NotImplementedError(
            f"maskify: this jax version's scan parameters ({sorted(params)}) are not understood; expected "
            "num_consts/num_carry, or an ft_in that unpacks into (consts, carry, xs)."
        ) from None
    return len(consts), len(carry)


def _materialized(pairs):
    """Pairs with every mask an array (loop carries and branch outputs need one fixed structure)."""
    return [Pair(p.data, materialize(p.mask, jnp.shape(p.data))) for p in pairs]


def _as_constant(p: Pair) -> Pair:
    """A value computed from literals alone (``zeros_like``, a broadcast ``-inf``) as a 0-d constant
    when it is uniform: ``where`` then gives it the validity of the masked operand it is combined
    with, so a constant fill never makes a masked position valid."""
    if p.mask is not None or not _is_concrete(p.data) or np.ndim(p.data) == 0 or np.size(p.data) == 0:
        return p
    flat = np.asarray(p.data).reshape(-1)
    if np.all((flat == flat[0]) | (np.isnan(flat) & np.isnan(flat[0]) if dtype_kind(flat.dtype) in "fc" else False)):
        return Pair(jnp.asarray(flat[0], dtype=flat.dtype), None)
    return p


def _is_concrete(x) -> bool:
    return not isinstance(x, jax.core.Tracer)


def _concrete_scalar(x):
    if isinstance(x, jax.core.Tracer) or np.ndim(x) != 0:
        return None
    try:
        return float(x)
    except (TypeError, ValueError):
        return None
