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

import jax
import jax.extend.core.primitives as P
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core as jcore

from masked_jax import _jaxpr
from masked_jax._maskify import _calls, _free, _recognise, _rows, _spaces
from masked_jax._maskify import _rules as primitives
from masked_jax._maskify._constants import (
    _as_constant,
    _concrete_scalar,
    _is_concrete,
    _known,
    _literal_constants,
    _materialized,
    _moved_count,
    _Sized,
    _uses,
)
from masked_jax._maskify._errors import MaskifyError, _inside_public_call, _public_name
from masked_jax._maskify._scan import _scan_counts, associative_scans
from masked_jax._maskify._spaces import Spaces
from masked_jax.ops import _factors
from masked_jax.ops._base import Pair, compact_or_ones, count_valid, fill, materialize, ranked, uniform_along

# Call-like primitives whose body is interpreted with the masks riding along.
# checkpoint's primitive: exported as remat_p by newer jax; otherwise read off a staged checkpoint
_CALLS = _jaxpr.CALL_PRIMITIVES

_LOOPS = frozenset((P.cond_p, P.while_p, P.scan_p))


class _Interpreter:
    def __init__(self, fun_name):
        self.fun_name = fun_name
        # the static facts of this call (masks' factors, values under masks, a memo of fills),
        # handed to every rule as an argument
        self.facts = _factors.Facts()
        # the jaxpr being run: its values, the equation that produced each variable, read counts,
        # the free positions of its values (see _free)
        self.env, self.producer, self.uses, self.free = {}, {}, {}, {}
        self.blocks = {}  # a concatenation of whole-row pieces: its axis, pieces and their masks (see _free)
        self.out_free = None  # the free positions of the outputs of the last call run with keep_free
        self.spaces = Spaces()  # the id spaces of gathers and scatters (see _spaces)
        # counts of constants with plain ids, and the function's arguments that say which of their
        # updates are padding (see _spaces.counts); read when the function's jaxpr starts
        self.counts: dict | None = None
        self.args: list = []

    def run(self, jaxpr, consts, args, literal_args=None, free_args=None, keep_free=False):
        """The outputs of ``jaxpr`` on ``args``. ``free_args``: the arguments' free positions; with
        ``keep_free`` the outputs keep theirs (in :attr:`out_free`), else they are masked there."""
        outer = (self.env, self.producer, self.uses, self.free, self.blocks)  # inner calls (jit, scan bodies) nest
        if self.counts is None:  # the function's own jaxpr
            self.counts, self.args = _spaces.counts(jaxpr), list(args)
        try:
            outs = self._run(jaxpr, consts, args, literal_args, free_args)
            frees = [self._free_of(v) for v in jaxpr.outvars]
            if keep_free:
                self.out_free = frees
                return outs
            return [self.resolved(o, f) for o, f in zip(outs, frees)]
        finally:
            self.env, self.producer, self.uses, self.free, self.blocks = outer

    def _free_of(self, v):
        return None if _jaxpr.is_literal(v) else self.free.get(v)

    def resolved(self, p, free):
        """``p`` with its free positions read as valid where their id space's entry is, else as
        masked (:func:`masked_jax._maskify._free.resolved`)."""
        return _free.resolved(p, free, self.spaces)

    def _apart(self):
        """A loop body's or a branch's trace: its fills and its id spaces stay inside it."""
        stack = contextlib.ExitStack()
        stack.enter_context(self.facts.new_trace())
        stack.enter_context(self.spaces.apart())
        return stack

    def _run(self, jaxpr, consts, args, literal_args, free_args=None):
        env, sized, minus = {}, {}, {}
        self.env, self.producer, self.uses, self.free, self.blocks = env, {}, _uses(jaxpr), {}, {}
        for v, f in zip(jaxpr.invars, free_args or ()):
            if f is not None:
                self.free[v] = f
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
        scans, scan = associative_scans(jaxpr), None  # lax.associative_scan calls; the one running
        library = _calls.library_calls(jaxpr)  # jax.nn.dot_product_attention, ...
        for i, eqn in enumerate(jaxpr.eqns):
            if scan is not None and i == scan[0].stop:
                self._scan_results(scan)
                scan = None
            if i in skip:
                continue
            if i in library:  # a whole library call, as its masked function
                call = library[i]
                operands, extras = (
                    [self.resolved(read(v), self._free_of(v)) for v in vs]
                    for vs in (call.operands, [v for _, v in call.extras])
                )
                out = _calls.run(call, operands, extras, self.facts)
                if out is not None:
                    env[call.output] = out
                    self.producer[call.output] = jaxpr.eqns[call.stop - 1]
                    skip.update(range(i + 1, call.stop))
                    continue
            if i in scans:
                call = scans[i]
                elems = [self.resolved(read(v), self._free_of(v)) for v in call.elems]
                moved = _recognise.associative_scan(self, call, elems)
                scan = None if moved is None else (call, *moved)
            invals = [read(v) for v in eqn.invars]
            frees = [self._free_of(v) for v in eqn.invars]
            if scan is not None and i in scan[0].readers:  # the call reads its valid elements, moved
                invals = [scan[1].get(v, p) for v, p in zip(eqn.invars, invals)]
                frees = [None if v in scan[1] else f for v, f in zip(eqn.invars, frees)]
            if eqn.outvars and eqn.outvars[0] in constants:  # from literals alone, evaluated beforehand
                literal.update(eqn.outvars)
                env[eqn.outvars[0]] = Pair(constants[eqn.outvars[0]], None)
                self.producer[eqn.outvars[0]] = eqn
                self._track_literals(eqn, invals, constants[eqn.outvars[0]], minus)
                continue
            if eqn.primitive is P.reduce_max_p and frees[0] is not None:  # (a softmax reads them resolved)
                whole = _recognise.softmax(self, jaxpr.eqns, i, [self.resolved(invals[0], frees[0])])
            else:
                whole = _recognise.softmax(self, jaxpr.eqns, i, invals)
            if whole is not None:  # jax.nn.softmax, as one masked op
                chain, out = whole
                skip.update(chain)
                env[jaxpr.eqns[chain[-1]].outvars[0]] = out
                continue
            is_literal = [_jaxpr.is_literal(v) or v in literal for v in eqn.invars]
            if all(is_literal) and not eqn.effects:
                literal.update(eqn.outvars)
            prim = eqn.primitive
            if prim is P.scatter_add_p and id(eqn) in (self.counts or ()) and is_literal[2] and not is_literal[1]:
                invals = [*invals[:2], self._counted(eqn, invals[2])]  # a count alongside masked data
            masked = any(p.mask is not None for p in invals)
            blocked = prim is P.dot_general_p and any(not _jaxpr.is_literal(v) and v in self.blocks for v in eqn.invars)
            if masked and (
                _free.makes_free(prim) or (prim is P.dot_general_p and any(f is not None for f in frees)) or blocked
            ):
                special = self._with_free(eqn, invals, frees, is_literal)
                if special is not None:  # a concatenation, a scatter, a dense layer of free rows
                    out, self.free[eqn.outvars[0]] = special
                    env[eqn.outvars[0]] = out
                    self.producer[eqn.outvars[0]] = eqn
                    self.spaces.track(eqn, invals, frees, [out], [not lit for lit in is_literal])
                    continue
            calls = prim in _CALLS and masked and not _recognise.is_named_call(eqn)
            if any(f is not None for f in frees) and not (_free.keeps_free(prim) or calls):
                invals = [self.resolved(p, f) for p, f in zip(invals, frees)]  # read as their space says
                frees = [None] * len(frees)
            elif any(f is not None for f in frees[1:]) and not calls:  # (indices are read as they are)
                kept = _free.carried(prim, len(frees))
                invals = [p if k in kept else self.resolved(p, f) for k, (p, f) in enumerate(zip(invals, frees))]
                frees = [f if k in kept else None for k, f in enumerate(frees)]
            if prim is P.select_n_p and masked:
                invals = [_as_constant(p) if lit else p for p, lit in zip(invals, is_literal)]
            self.out_free = None
            outs = self.equation(eqn, invals, sized, minus, is_literal, frees if calls else None)
            outs = outs if prim.multiple_results else [outs]
            if calls and self.out_free is not None:
                out_free = self.out_free
            elif any(f is not None for f in frees) and len(outs) == 1 and isinstance(first := outs[0], Pair):
                out_free = [_free.after(prim, eqn.params, invals, frees, first)]
            else:
                out_free = [None] * len(outs)
            for v, o, f in zip(eqn.outvars, outs, out_free):
                env[v] = o
                self.producer[v] = eqn
                if f is not None:
                    self.free[v] = f
            if all(isinstance(o, Pair) for o in outs):
                self.spaces.track(eqn, invals, frees, outs, [not lit for lit in is_literal])
        if scan is not None:
            self._scan_results(scan)
        return [read(v) for v in jaxpr.outvars]

    def _scan_results(self, scan):
        """At the end of a ``lax.associative_scan`` call run on moved elements: its results, moved
        back (:func:`masked_jax._maskify._recognise.scan_results`)."""
        call, _, state = scan
        outs = [self.resolved(self.env[v], self._free_of(v)) for v in call.outputs]
        for v, o in zip(call.outputs, _recognise.scan_results(self, state, outs)):
            self.env[v] = o
            self.free.pop(v, None)

    def _counted(self, eqn, upd):
        """The constant updates of a count with plain ids (``segment_sum(ones_like(w), ids)``),
        valid where an argument masked along the ids' axis is valid (:func:`_spaces.counts`)."""
        known, options = (self.counts or {})[id(eqn)]
        if known is not eqn or upd.mask is not None:
            return upd
        window = eqn.params["dimension_numbers"].update_window_dims
        for k, at in options:
            arg = self.args[k]
            valid = None if arg.mask is None else _spaces.count_validity(jnp.shape(upd.data), window, arg, at)
            if valid is not None:
                return Pair(upd.data, valid)
        return upd

    def _with_free(self, eqn, invals, frees, is_literal):
        """``(result, its free positions)`` of an equation that puts constants beside masked data
        (see :mod:`masked_jax._maskify._free`), or ``None`` (then the usual rule)."""
        prim, params = eqn.primitive, eqn.params
        if prim is P.concatenate_p or prim is primitives.STACK_P:  # (a stack: pieces given a new axis)
            if all(p.mask is not None for p in invals) and all(f is None for f in frees):
                return None
            if prim is P.concatenate_p:
                axis = params["dimension"]
                out, free, blocks = _free.concatenate(invals, frees, axis)
            else:
                axis = params["axis"]
                invals, out, free, blocks = _free.stack(invals, frees, axis)
            if blocks is not None:  # whole-row pieces: a contraction along the axis reads them by block
                self.blocks[eqn.outvars[0]] = (axis, invals, blocks, free)
            return out, free
        if prim is P.dot_general_p:
            for side, v in enumerate(eqn.invars):
                if not _jaxpr.is_literal(v) and v in self.blocks:
                    dimension, pieces, blocks, joined = self.blocks[v]
                    out = _free.block_contraction(prim, params, invals, side, pieces, blocks, dimension, joined)
                    if out is not None:
                        return out
            return _free.contraction(prim, params, invals, frees)
        x, idx, upd = invals
        idx = self.resolved(idx, frees[1])  # (indices are read as they are)
        frees = [frees[0], None, frees[2]]
        return _free.scatter(prim, params, [x, idx, upd], frees, bool(is_literal[0]), self.spaces.ids(idx.data))

    # -- one equation ------------------------------------------------------------------------------
    def equation(self, eqn, invals, sized, minus, is_literal=None, frees=None):
        prim, params = eqn.primitive, dict(eqn.params)
        name = prim.name
        unmasked = all(p.mask is None for p in invals)
        if (
            prim is P.jit_p
            and not unmasked
            and (params.get("name") in primitives.NAMED or params.get("name") in primitives.UNSUPPORTED_CALLS)
        ):
            return _recognise.named_call(self, eqn, params, invals)
        if (prim in _CALLS or prim in _LOOPS) and not unmasked:
            return self.control(prim, params, invals, is_literal, frees)
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
        special = _recognise.weighted_mean(self, eqn, invals)
        if special is None:
            special = _recognise.mean_like(self, eqn, invals, sized, minus)
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
            out = rule(prim, invals, self.facts, **params)
        except primitives.NoMaskedRule as err:
            raise MaskifyError(
                f"maskify({self.fun_name}): primitive '{name}' has a masked operand and {err}. "
                "Fill the operand first (x.filled(...)) or compute it with masked_jax.numpy."
            ) from None
        if prim is P.reduce_sum_p:
            x = invals[0]
            shape, axes = jnp.shape(x.data), tuple(params["axes"])
            n = int(np.prod([shape[a] for a in axes], dtype=np.int64))
            compact = compact_or_ones(x.mask, shape, self.facts)
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

    def control(self, prim, params, invals, is_literal=None, frees=None):
        if prim in _CALLS:
            closed = params.get("jaxpr") or params.get("call_jaxpr") or params.get("fun_jaxpr")
            try:
                if isinstance(closed, jcore.ClosedJaxpr):
                    return self.run(closed.jaxpr, closed.consts, invals, is_literal, frees, keep_free=True)
                return self.run(closed, (), invals, is_literal, frees, keep_free=True)
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
        with self._apart():
            return _materialized(self.run(closed.jaxpr, closed.consts, ops))

    def _scan_whole_rows(self, params, consts, carry, xs, rows, ncarry):
        """A scan whose steps are valid or missing by whole rows (see :func:`_whole_rows`), run as
        the hand-written code runs it: the body on plain data (the padding filled with 0), the
        carry of a missing row left as it was by one select, the outputs masked by the rows."""
        body = params["jaxpr"]
        xs_data = [p.data if p.mask is None else fill(p.data, p.mask, 0, facts=self.facts) for p in xs]

        def step(c, inp):
            x, valid = inp
            with self._apart():
                outs = self.run(
                    body.jaxpr, body.consts, list(consts) + [Pair(d, None) for d in c] + [Pair(d, None) for d in x]
                )
            if any(o.mask is not None for o in outs):  # (plain operands give plain results)
                raise AssertionError("a scan body on plain operands gave a masked result")
            new, ys = [o.data for o in outs[:ncarry]], [o.data for o in outs[ncarry:]]
            missing = ~valid
            return [jnp.where(_rows_like(missing, n), o, n) for o, n in zip(c, new)], ys

        carry, ys = lax.scan(
            step,
            [p.data for p in carry],
            (xs_data, rows),
            length=params["length"],
            reverse=params["reverse"],
            unroll=params["unroll"],
        )
        # the carry depends on the masked inputs: a masked value, valid everywhere (a compact mask)
        outs = [Pair(c, jnp.ones((1,) * np.ndim(c), bool)) for c in carry]
        for y in ys:  # valid where the step's row is: (length, rows, 1, ...), or (length, 1, ...)
            if np.ndim(rows) == 2 and np.ndim(y) >= 2 and np.shape(y)[1] == np.shape(rows)[1]:
                m = jnp.reshape(rows, np.shape(rows) + (1,) * (np.ndim(y) - 2))
            else:
                valid = jnp.any(rows, axis=1) if np.ndim(rows) == 2 else rows
                m = jnp.reshape(valid, (np.shape(y)[0],) + (1,) * (np.ndim(y) - 1))
            outs.append(Pair(y, m))
        return outs

    def _while(self, params, invals):
        nc, nb = params["cond_nconsts"], params["body_nconsts"]
        cconsts, bconsts, carry = invals[:nc], invals[nc : nc + nb], _materialized(invals[nc + nb :])
        cj, bj = params["cond_jaxpr"], params["body_jaxpr"]

        def cond_fn(c):
            with self._apart():
                (p,) = self.run(cj.jaxpr, cj.consts, list(cconsts) + list(c))
            return p.data if p.mask is None else p.data & p.mask  # a masked predicate stops the loop

        def body_fn(c):
            with self._apart():
                return _materialized(self.run(bj.jaxpr, bj.consts, list(bconsts) + list(c)))

        return lax.while_loop(cond_fn, body_fn, carry)

    def _scan(self, params, invals):
        nconsts, ncarry = _scan_counts(params, len(invals))
        consts, carry_in, xs = invals[:nconsts], invals[nconsts : nconsts + ncarry], invals[nconsts + ncarry :]
        masked_xs = [p.mask is not None for p in xs]  # (plain inputs say nothing about padding)
        rows = _whole_rows(consts, carry_in, xs, params["jaxpr"].jaxpr)
        if rows is not None:
            return self._scan_whole_rows(params, consts, carry_in, xs, rows, ncarry)
        xs = [p if p.mask is None else _materialized([p])[0] for p in xs]  # plain inputs stay plain
        body = params["jaxpr"]

        def step(c, x):
            with self._apart():
                outs = self.run(body.jaxpr, body.consts, list(consts) + list(c) + list(x))
            # each carry's mask at the shape it came in with (a compact one stays compact)
            carry, ys = [_mask_shaped(o, np.shape(old.mask)) for o, old in zip(outs, c)], _materialized(outs[ncarry:])
            missing = _missing_rows([p.mask for p, m in zip(x, masked_xs) if m])
            if missing is not None:  # a padded step: the carry is left as it was, the outputs masked
                carry = [_where_rows(missing, old, new) for old, new in zip(c, carry)]
                ys = [Pair(y.data, y.mask & ~_rows_like(missing, y.mask)) for y in ys]
            return carry, ys

        # The carries' masks keep their compact shapes where the body keeps them (a (B, L, 1) token
        # mask through stacked layers: the whole calls of the body see token masks), found by
        # tracing one step; else they are materialised at the data's shape.
        carry = _materialized(carry_in)
        compact = [Pair(p.data, compact_or_ones(p.mask, np.shape(p.data), self.facts)) for p in carry_in]
        if any(np.shape(a.mask) != np.shape(b.mask) for a, b in zip(compact, carry)):
            one = [jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a)[1:], a.dtype), x) for x in xs]
            try:
                jax.eval_shape(step, compact, one)
                carry = compact
            except _GrowingMask:
                pass
        carry, ys = lax.scan(
            step, carry, xs, length=params["length"], reverse=params["reverse"], unroll=params["unroll"]
        )
        return list(carry) + list(ys)


def _whole_rows(consts, carry, xs, body):
    """For a scan whose constants and initial carry are plain, whose masked inputs are masked by
    whole rows (each step's row all valid or all masked: a token mask) and whose ``body`` never
    mixes the rows of those inputs (:func:`masked_jax._maskify._rows.row_axes`), the valid rows of
    each step, (length, rows) (or (length,) when the steps have no row axis); else ``None``."""
    if any(p.mask is not None for p in [*consts, *carry]):
        return None
    masks = [ranked(p.mask, np.ndim(p.data)) for p in xs if p.mask is not None]
    if not masks or any(np.ndim(m) < 1 or any(n != 1 for n in np.shape(m)[2:]) for m in masks):
        return None
    lead = {np.shape(p.data)[1] for p in xs if p.mask is not None and np.ndim(p.data) >= 2}
    length = np.shape(xs[0].data)[0]
    if len(lead) > 1 or (lead and any(np.ndim(p.data) < 2 for p in xs if p.mask is not None)):
        return None
    if lead:  # a valid row's step must read no padded row
        axes_in = [None] * (len(consts) + len(carry)) + [0 if p.mask is not None else None for p in xs]
        outs = _rows.row_axes(body, axes_in, next(iter(lead)))
        if outs is None or any(a not in (None, 0) for a in outs):
            return None
    shape = (length, *lead)
    valid = [jnp.broadcast_to(jnp.reshape(m, np.shape(m)[: len(shape)]), shape) for m in masks]
    return functools.reduce(jnp.logical_or, valid)


class _GrowingMask(Exception):
    """A loop body gives a carry a mask that varies along more axes than the one it came in with."""


def _mask_shaped(p: Pair, shape) -> Pair:
    """``p`` with its mask broadcast to ``shape`` (a loop carry's mask shape); raises
    :class:`_GrowingMask` when the mask varies along an axis where ``shape`` has size 1."""
    mask = compact_or_ones(p.mask, np.shape(p.data))
    if len(shape) != np.ndim(mask) or any(m not in (1, n) for m, n in zip(np.shape(mask), shape)):
        raise _GrowingMask
    return Pair(p.data, jnp.broadcast_to(mask, shape))


def _missing_rows(masks):
    """Which rows of one scan step are *missing*: every masked input of that row at that step is
    masked. The rows are the leading axis of the step's inputs when they all have one of the same
    size (a batch under ``vmap`` or ``nn.RNN``), else the step is one row. ``None`` when no input
    of the step carries a mask."""
    if not masks:
        return None
    lead = {np.shape(m)[0] if np.ndim(m) else None for m in masks}
    if len(lead) == 1 and None not in lead:
        valid = [jnp.any(m, axis=tuple(range(1, np.ndim(m)))) for m in masks]
    else:
        valid = [jnp.any(m) for m in masks]
    return ~functools.reduce(jnp.logical_or, valid)


def _rows_like(missing, x):
    """``missing`` (rows, or one flag) laid along the leading axis of ``x`` when ``x`` has those
    rows; otherwise the step is missing for ``x`` only where it is missing for every row."""
    if np.ndim(missing) and np.ndim(x) and np.shape(x)[0] == np.shape(missing)[0]:
        return jnp.reshape(missing, np.shape(missing) + (1,) * (np.ndim(x) - 1))
    return jnp.all(missing)


def _where_rows(missing, old: Pair, new: Pair) -> Pair:
    """The carry after a step: ``old`` in the missing rows, ``new`` elsewhere (data and mask)."""
    m = _rows_like(missing, new.data)
    return Pair(jnp.where(m, old.data, new.data), jnp.where(m, old.mask, new.mask))
