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

import functools

import jax
import jax.extend.core.primitives as P
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core as jcore

from masked_jax import _jaxpr
from masked_jax._maskify import _calls, _free, _recognise, _rows, _unique
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

    def run(self, jaxpr, consts, args, literal_args=None, free_args=None, keep_free=False):
        """The outputs of ``jaxpr`` on ``args``. ``free_args``: the arguments' free positions; with
        ``keep_free`` the outputs keep theirs (in :attr:`out_free`), else they are masked there."""
        outer = (self.env, self.producer, self.uses, self.free, self.blocks)  # inner calls (jit, scan bodies) nest
        try:
            outs = self._run(jaxpr, consts, args, literal_args, free_args)
            frees = [self._free_of(v) for v in jaxpr.outvars]
            if keep_free:
                self.out_free = frees
                return outs
            return [_free.resolved(o, f) for o, f in zip(outs, frees)]
        finally:
            self.env, self.producer, self.uses, self.free, self.blocks = outer

    def _free_of(self, v):
        return None if _jaxpr.is_literal(v) else self.free.get(v)

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
        uniques = _unique.unique_calls(jaxpr)  # jnp.unique(x, size=...)
        for i, eqn in enumerate(jaxpr.eqns):
            if scan is not None and i == scan[0].stop:
                self._scan_results(scan)
                scan = None
            if i in skip:
                continue
            if i in library:  # a whole library call, as its masked function
                call = library[i]
                operands, extras = (
                    [_free.resolved(read(v), self._free_of(v)) for v in vs]
                    for vs in (call.operands, [v for _, v in call.extras])
                )
                out = _calls.run(call, operands, extras, self.facts)
                if out is not None:
                    env[call.output] = out
                    self.producer[call.output] = jaxpr.eqns[call.stop - 1]
                    skip.update(range(i + 1, call.stop))
                    continue
            if i in uniques:  # a whole jnp.unique call, over the valid elements
                call = uniques[i]
                fill = None if call.fill is None else read(call.fill)
                results = _unique.run(self.fun_name, call, read(call.operand), fill)
                if results is not None:
                    for v, out in results:
                        env[v] = out
                        self.producer[v] = jaxpr.eqns[call.stop - 1]
                    skip.update(range(i + 1, call.stop))
                    continue
            if i in scans:
                call = scans[i]
                elems = [_free.resolved(read(v), self._free_of(v)) for v in call.elems]
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
                    continue
            calls = prim in _CALLS and masked
            if any(f is not None for f in frees) and not (_free.keeps_free(prim) or calls):
                invals = [_free.resolved(p, f) for p, f in zip(invals, frees)]  # read as masked
                frees = [None] * len(frees)
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
        if scan is not None:
            self._scan_results(scan)
        return [read(v) for v in jaxpr.outvars]

    def _scan_results(self, scan):
        """At the end of a ``lax.associative_scan`` call run on moved elements: its results, moved
        back (:func:`masked_jax._maskify._recognise.scan_results`)."""
        call, _, state = scan
        outs = [_free.resolved(self.env[v], self._free_of(v)) for v in call.outputs]
        for v, o in zip(call.outputs, _recognise.scan_results(self, state, outs)):
            self.env[v] = o
            self.free.pop(v, None)

    def _with_free(self, eqn, invals, frees, is_literal):
        """``(result, its free positions)`` of an equation that puts constants beside masked data
        (see :mod:`masked_jax._maskify._free`), or ``None`` (then the usual rule)."""
        prim, params = eqn.primitive, eqn.params
        if prim is P.concatenate_p:
            if all(p.mask is not None for p in invals) and all(f is None for f in frees):
                return None
            out, free, blocks = _free.concatenate(invals, frees, params["dimension"])
            if blocks is not None:  # whole-row pieces: a contraction along the axis reads them by block
                self.blocks[eqn.outvars[0]] = (params["dimension"], invals, blocks, free.axes if free else set())
            return out, free
        if prim is P.dot_general_p:
            for side, v in enumerate(eqn.invars):
                if not _jaxpr.is_literal(v) and v in self.blocks:
                    dimension, pieces, blocks, axes = self.blocks[v]
                    out = _free.block_contraction(prim, params, invals, side, pieces, blocks, dimension, axes)
                    if out is not None:
                        return out
            return _free.contraction(prim, params, invals, frees)
        return _free.scatter(prim, params, invals, frees, bool(is_literal[0]))

    # -- one equation ------------------------------------------------------------------------------
    def equation(self, eqn, invals, sized, minus, is_literal=None, frees=None):
        prim, params = eqn.primitive, dict(eqn.params)
        name = prim.name
        unmasked = all(p.mask is None for p in invals)
        if prim is P.jit_p and not unmasked and params.get("name") == _unique.SORTED_MASK:
            raise _unique.refuse(self.fun_name)  # jnp.unique's sort, outside a call taken whole
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
                n,
                lambda: count_valid(compact, shape, axes),
                uniform=n > 0 and uniform_along(compact, axes),
                any=n > 0,  # (a sum of nothing is valid, with no valid element)
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
            ops = [p if p.mask is None else _materialized([p])[0] for p in ops]  # plain operands stay plain
            branches = [functools.partial(self._branch, b) for b in params["branches"]]
            return lax.switch(index.data, branches, ops)
        if prim is P.while_p:
            return self._while(params, invals)
        return self._scan(params, invals)

    def _branch(self, closed, ops):
        with self.facts.new_trace():
            return _materialized(self.run(closed.jaxpr, closed.consts, ops))

    def _scan_whole_rows(self, params, consts, carry, xs, whole, ncarry):
        """A scan whose steps are valid or missing by whole rows (see :func:`_whole_rows`), run as
        the hand-written code runs it: the body on plain data (the padding filled with 0: no valid
        row reads it), the carry of a missing row left as it was by one select, the outputs masked
        by the rows."""
        rows, carry_axes, ys_axes = whole
        body = params["jaxpr"]
        xs_data = [p.data if p.mask is None else fill(p.data, p.mask, 0, facts=self.facts) for p in xs]

        def step(c, inp):
            x, valid = inp
            with self.facts.new_trace():
                outs = self.run(
                    body.jaxpr, body.consts, list(consts) + [Pair(d, None) for d in c] + [Pair(d, None) for d in x]
                )
            if any(o.mask is not None for o in outs):  # (plain operands give plain results)
                raise AssertionError("a scan body on plain operands gave a masked result")
            new, ys = [o.data for o in outs[:ncarry]], [o.data for o in outs[ncarry:]]
            missing = ~valid
            return [jnp.where(_rows_at(missing, n, a), o, n) for o, n, a in zip(c, new, carry_axes)], ys

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
        for y, a in zip(ys, ys_axes):  # valid where the step's row is, along the step's row axis
            if np.ndim(rows) == 2 and a is not None and np.shape(y)[a + 1] == np.shape(rows)[1]:
                shape = [1] * np.ndim(y)
                shape[0], shape[a + 1] = np.shape(rows)
                m = jnp.reshape(rows, shape)
            else:  # an output with no row axis: valid where some row is
                valid = jnp.any(rows, axis=1) if np.ndim(rows) == 2 else rows
                m = jnp.reshape(valid, (np.shape(y)[0],) + (1,) * (np.ndim(y) - 1))
            outs.append(Pair(y, m))
        return outs

    def _while(self, params, invals):
        nc, nb = params["cond_nconsts"], params["body_nconsts"]
        cconsts, bconsts, carry = invals[:nc], invals[nc : nc + nb], invals[nc + nb :]
        cj, bj = params["cond_jaxpr"], params["body_jaxpr"]
        # a carry no masked value reaches (a loop counter, a bound) stays plain: its value indexes
        masked = _masked_carries(bj.jaxpr, [p.mask is not None for p in bconsts], carry, [])
        carry = [_materialized([p])[0] if m else p for p, m in zip(carry, masked)]

        def cond_fn(c):
            with self.facts.new_trace():
                (p,) = self.run(cj.jaxpr, cj.consts, list(cconsts) + list(c))
            return p.data if p.mask is None else p.data & p.mask  # a masked predicate stops the loop

        def body_fn(c):
            with self.facts.new_trace():
                outs = self.run(bj.jaxpr, bj.consts, list(bconsts) + list(c))
            return [_materialized([o])[0] if m else _plain(o) for o, m in zip(outs, masked)]

        return lax.while_loop(cond_fn, body_fn, carry)

    def _scan(self, params, invals):
        nconsts, ncarry = _scan_counts(params, len(invals))
        consts, carry_in, xs = invals[:nconsts], invals[nconsts : nconsts + ncarry], invals[nconsts + ncarry :]
        masked_xs = [p.mask is not None for p in xs]  # (plain inputs say nothing about padding)
        whole = _whole_rows(consts, carry_in, xs, params["jaxpr"].jaxpr, self.facts)
        if whole is not None:
            return self._scan_whole_rows(params, consts, carry_in, xs, whole, ncarry)
        carry_axes, ys_axes = _loop_axes(consts, carry_in, xs, params["jaxpr"].jaxpr)
        xs = [p if p.mask is None else _materialized([p])[0] for p in xs]  # plain inputs stay plain
        body = params["jaxpr"]
        # a carry no masked value reaches (a loop counter: fori_loop's index) stays plain
        masked = _masked_carries(body.jaxpr, [p.mask is not None for p in consts], carry_in, masked_xs)

        def step(c, x):
            with self.facts.new_trace():
                outs = self.run(body.jaxpr, body.consts, list(consts) + list(c) + list(x))
            # each carry's mask at the shape it came in with (a compact one stays compact)
            carry = [_mask_shaped(o, np.shape(old.mask)) if m else _plain(o) for o, old, m in zip(outs, c, masked)]
            ys = _materialized(outs[ncarry:])
            missing = _missing_rows([p.mask for p, m in zip(x, masked_xs) if m])
            if missing is not None:  # a padded step: the carry is left as it was, the outputs masked
                carry = [
                    _mask_shaped(_where_rows(missing, old, new, a), np.shape(old.mask))
                    if m
                    else Pair(jnp.where(_rows_at(missing, new.data, a), old.data, new.data), None)
                    for old, new, a, m in zip(c, carry, carry_axes, masked)
                ]
                ys = [Pair(y.data, y.mask & ~_rows_at(missing, y.mask, a)) for y, a in zip(ys, ys_axes)]
            return carry, ys

        # The carries' masks keep their compact shapes where the body keeps them (a (B, L, 1) token
        # mask through stacked layers: the whole calls of the body see token masks), found by
        # tracing one step; else they are materialised at the data's shape.
        carry = [_materialized([p])[0] if m else p for p, m in zip(carry_in, masked)]
        compact = [
            Pair(p.data, compact_or_ones(p.mask, np.shape(p.data), self.facts)) if m else p
            for p, m in zip(carry_in, masked)
        ]
        if any(a.mask is not None and np.shape(a.mask) != np.shape(b.mask) for a, b in zip(compact, carry)):
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


def _whole_rows(consts, carry, xs, body, facts):
    """For a scan whose constants and initial carry are plain, whose masked inputs are masked by
    whole rows (each step's row all valid or all masked: a token mask), all by the same rows (a
    step where one input is masked and another valid is not missing, and reads its masked input as
    masked: the body's masked rules must run), and whose ``body`` never mixes the rows of those
    inputs (:func:`masked_jax._maskify._rows.scan_axes`): ``(the valid rows of each step, the
    carries' row axes, the outputs' row axes)``, the rows (length, rows) (or (length,) when the
    steps have no row axis); else ``None``."""
    if any(p.mask is not None for p in [*consts, *carry]):
        return None
    masks = [ranked(p.mask, np.ndim(p.data), facts) for p in xs if p.mask is not None]
    if not masks or any(np.ndim(m) < 1 or any(n != 1 for n in np.shape(m)[2:]) for m in masks):
        return None
    if not _same_rows(masks, facts):
        return None
    lead = {np.shape(p.data)[1] for p in xs if p.mask is not None and np.ndim(p.data) >= 2}
    length = np.shape(xs[0].data)[0]
    if len(lead) > 1 or (lead and any(np.ndim(p.data) < 2 for p in xs if p.mask is not None)):
        return None
    carry_axes, ys_axes = [None] * len(carry), [None] * (len(body.outvars) - len(carry))
    if lead:  # a valid row's step must read no padded row
        xs_in = [0 if p.mask is not None else None for p in xs]
        found = _rows.scan_axes(body, [None] * len(consts), carry_axes, xs_in, next(iter(lead)))
        if found is None or any(a not in (None, 0) for a in found[0] + found[1]):
            return None
        carry_axes, ys_axes = found
    shape = (length, *lead)
    return jnp.broadcast_to(jnp.reshape(masks[0], np.shape(masks[0])[: len(shape)]), shape), carry_axes, ys_axes


def _same_rows(masks, facts) -> bool:
    """Whether the (length, rows, 1, ...) masks of a scan's inputs are known, when traced, to hold
    the same values: the same array, or masks recorded as the same factors (one token mask seen
    through the same moves)."""
    first = masks[0]
    if all(m is first for m in masks):
        return True

    def rows(m):
        return frozenset(_factors.Factor(f.root, f.axes[:2]) for f in _factors.without_implied(facts.factors(m)))

    return len({rows(m) for m in masks}) == 1


def _loop_axes(consts, carry, xs, body):
    """``(carries' row axes, outputs' row axes)`` of a scan run through the masked rules: the rows
    are those of :func:`_missing_rows` (the leading axis of every masked input's step), a carry's
    row axis is where its initial mask varies along the rows or where the body puts the rows
    (:func:`masked_jax._maskify._rows.scan_axes`, reading through what mixes rows); ``None`` for a
    value with no row axis (a step counter, a total over the rows), whatever its size."""
    lead = {np.shape(p.data)[1] if np.ndim(p.data) >= 2 else -1 for p in xs if p.mask is not None}
    nys = len(body.outvars) - len(carry)
    n = lead.pop() if len(lead) == 1 else -1
    if n < 0:  # the steps have no rows: one flag per step
        return [None] * len(carry), [None] * nys
    masks = [ranked(p.mask, np.ndim(p.data)) for p in carry]
    carry_in = [0 if m is not None and np.ndim(m) >= 1 and np.shape(m)[0] == n > 1 else None for m in masks]
    xs_in = [0 if p.mask is not None else None for p in xs]
    found = _rows.scan_axes(body, [None] * len(consts), carry_in, xs_in, n, lenient=True)
    return found if found is not None else ([None] * len(carry), [None] * nys)


def _masked_carries(body, consts_masked, carry, xs_masked):
    """Which carries of a loop ``body`` (a jaxpr of constants, carries, then inputs) may be masked:
    those whose initial value is masked, and those whose new value the body computes from a masked
    value (a masked constant, input or carry), to a fixed point. Every other carry holds values
    no masked input reaches (a loop counter, a bound, a key): it is plain, and stays plain, so a
    ``fori_loop``'s index reads ``x[:, i]`` as a plain index."""
    masked = [p.mask is not None for p in carry]
    while True:
        reached = _reached(body, [*consts_masked, *masked, *xs_masked])
        new = [m or r for m, r in zip(masked, reached)]
        if new == masked:
            return masked
        masked = new


def _reached(jaxpr, tainted):
    """Which outputs of ``jaxpr`` are computed from an input marked in ``tainted``."""
    taint = {v for v, t in zip(jaxpr.invars, tainted) if t}
    for eqn in jaxpr.eqns:
        if any(not _jaxpr.is_literal(v) and v in taint for v in eqn.invars):
            taint.update(eqn.outvars)
    return [not _jaxpr.is_literal(v) and v in taint for v in jaxpr.outvars]


def _plain(p: Pair) -> Pair:
    """A loop carry that no masked value reaches (see :func:`_masked_carries`): plain, as it came in."""
    if p.mask is not None:  # an equation with plain operands only gives a plain result
        raise AssertionError("a loop carry computed from plain values alone came out masked")
    return p


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


def _rows_at(missing, x, axis):
    """``missing`` (rows, or one flag) laid along ``axis`` of ``x``, the row axis the scan's body
    gives ``x`` (see :func:`_loop_axes`); for a value with no row axis (``None``: a step counter,
    a total), the step is missing only where it is missing for every row."""
    if not np.ndim(missing):
        return missing
    if axis is None or np.ndim(x) <= axis or np.shape(x)[axis] != np.shape(missing)[0]:
        return jnp.all(missing)
    shape = [1] * np.ndim(x)
    shape[axis] = np.shape(missing)[0]
    return jnp.reshape(missing, shape)


def _where_rows(missing, old: Pair, new: Pair, axis) -> Pair:
    """The carry after a step: ``old`` in the missing rows, ``new`` elsewhere (data and mask)."""
    m = _rows_at(missing, new.data, axis)
    return Pair(jnp.where(m, old.data, new.data), jnp.where(m, old.mask, new.mask))
