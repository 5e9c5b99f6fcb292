"""``maskify``: run ordinary ``jax.numpy`` code with masked semantics, by interpreting its jaxpr.

``maskify(fun)(*args)`` traces ``fun`` on the data of its arguments, then evaluates the jaxpr with
values that are :class:`~masked_jax.ops._base.Pair` ``(data, mask)``: an equation none of whose
operands is masked binds its primitive as usual; otherwise the primitive's masked rule from
:mod:`masked_jax._maskify._rules` runs (the same semantics as ``masked_jax.numpy``). Control flow
(``jit``, ``cond``, ``while``, ``scan``, ``custom_jvp`` / ``custom_vjp`` calls, ``checkpoint``) is
interpreted recursively, masks riding along in the carries; a custom call's derivative is its own
rule (:mod:`masked_jax._maskify._custom`).

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
from masked_jax._maskify import _ask, _calls, _coords, _custom, _free, _positions, _recognise, _rows, _spaces, _unique
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
from masked_jax._validate import is_tracer
from masked_jax.ops import _factors
from masked_jax.ops._base import Pair, compact_or_ones, count_valid, fill, materialize, ranked, uniform_along

# Call-like primitives whose body is interpreted with the masks riding along.
# checkpoint's primitive: exported as remat_p by newer jax; otherwise read off a staged checkpoint
_CALLS = _jaxpr.CALL_PRIMITIVES

_LOOPS = frozenset((P.cond_p, P.while_p, P.scan_p))


# what one jaxpr's run holds, saved and restored around the run of a nested one
_FRAME = ("env", "producer", "uses", "free", "blocks", "info", "prefix", "path", "per_row")


class _Interpreter:
    def __init__(self, fun_name, relativity: _positions.Relativity | None = None, live=None):
        self.fun_name = fun_name
        # the ids of the values traced outside the function that it closes over (the constants of
        # the first jaxpr run that are tracers): custom derivative rules may read them
        self.live = live
        # where padding lives: each value's coordinates (see _coords), the positional rules (see
        # _positions), the path of the equation being run (its index, and those of the jaxprs
        # around it), for the static positions read off the extended trace
        self.positions = _positions.Positions(fun_name, relativity or _positions.Relativity())
        self.info: dict = {}
        self.prefix: tuple = ()
        self.path: tuple = ()
        # numbers that stand for a token axis's length (``P`` in ``P + t``), per example: each
        # variable's values with the example's own length, along a leading axis of examples
        self.per_row: dict = {}
        self.out_rows: list | None = None
        self.top = None  # the function's masked inputs and their coordinates (where counts come from)
        # the static facts of this call (masks' factors, values under masks, a memo of fills),
        # handed to every rule as an argument
        self.facts = _factors.Facts()
        # the jaxpr being run: its values, the equation that produced each variable, read counts,
        # the free positions of its values (see _free)
        self.env, self.producer, self.uses, self.free = {}, {}, {}, {}
        self.blocks = {}  # a concatenation of whole-row pieces: its axis, pieces and their masks (see _free)
        self.ins: list = []  # the coordinates of the operands of the call or loop being entered
        self.rows: list = []  # and their values per example (see per_row)
        self.eqn_rows: dict = {}  # the values per example of the operands of the equation being run
        self.subs: list = []  # its nested jaxprs
        self.out_free = None  # the free positions of the outputs of the last call run with keep_free
        self.spaces = Spaces()  # the id spaces of gathers and scatters (see _spaces)
        # counts of constants with plain ids, and the function's arguments that say which of their
        # updates are padding (see _spaces.counts); read when the function's jaxpr starts
        self.counts: dict | None = None
        self.args: list = []

    def run(
        self,
        jaxpr,
        consts,
        args,
        literal_args=None,
        free_args=None,
        keep_free=False,
        infos=None,
        sub=None,
        rows_in=None,
    ):
        """The outputs of ``jaxpr`` on ``args``. ``free_args``: the arguments' free positions; with
        ``keep_free`` the outputs keep theirs (in :attr:`out_free`), else they are masked there.
        ``infos``: the arguments' coordinates (:class:`~._coords.Info`, ``None``: plain); ``sub``:
        the index of ``jaxpr`` among the nested jaxprs of the equation being run; ``rows_in``: the
        arguments' values per example, where they stand for a token axis's length (see
        :attr:`per_row`); the outputs' are left in :attr:`out_rows`."""
        if self.live is None:
            self.live = frozenset(id(c) for c in consts if is_tracer(c))
        outer = {name: getattr(self, name) for name in _FRAME}  # inner calls (jit, loop bodies) nest
        if self.counts is None:  # the function's own jaxpr
            self.counts, self.args = _spaces.counts(jaxpr), list(args)
            self.spaces.lengths = {
                n
                for p in args
                if p.mask is not None
                for n, m in zip(np.shape(p.data), np.shape(ranked(p.mask, np.ndim(p.data))))
                if m > 1
            }
        if sub is not None:
            self.prefix = self.path + (sub,)
        outermost = self.top is None
        if outermost:
            self.top = (list(args), list(infos) if infos is not None else [None] * len(args))
        self.per_row = {v: r for v, r in zip(jaxpr.invars, rows_in or ()) if r is not None}
        try:
            outs = self._run(jaxpr, consts, args, literal_args, free_args, infos)
            if outermost:
                outs = [o if _jaxpr.is_literal(v) else self._existing(v, o) for v, o in zip(jaxpr.outvars, outs)]
            self.out_rows = [None if _jaxpr.is_literal(v) else self.per_row.get(v) for v in jaxpr.outvars]
            frees = [self._free_of(v) for v in jaxpr.outvars]
            if keep_free:
                self.out_free = frees
                return outs
            return [self.resolved(o, f) for o, f in zip(outs, frees)]
        finally:
            for name, value in outer.items():
                setattr(self, name, value)

    def _free_of(self, v):
        return None if _jaxpr.is_literal(v) else self.free.get(v)

    def info_of(self, v):
        """The coordinates of jaxpr atom ``v`` (:class:`~._coords.Info`)."""
        if _jaxpr.is_literal(v):
            return _coords.plain(np.ndim(v.val), number=True)
        return self.info.get(v) or _coords.plain(len(getattr(v.aval, "shape", ())))

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

    def _run(self, jaxpr, consts, args, literal_args, free_args=None, infos=None):
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
        ins: list[_coords.Info | None] = list(infos) if infos is not None else [None] * len(jaxpr.invars)
        self.info = _coords.analyse(jaxpr, ins, frozenset(literal), self.positions.relativity, self.prefix)
        skip = set()
        scans, scan = associative_scans(jaxpr), None  # lax.associative_scan calls; the one running
        library = _calls.library_calls(jaxpr)  # jax.nn.dot_product_attention, ...
        uniques = _unique.unique_calls(jaxpr)  # jnp.unique(x, size=...)
        for i, eqn in enumerate(jaxpr.eqns):
            self.path = self.prefix + (i,)
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
                elems = [self.resolved(read(v), self._free_of(v)) for v in call.elems]
                moved = _recognise.associative_scan(self, call, elems)
                scan = None if moved is None else (call, *moved)
            invals = [read(v) for v in eqn.invars]
            frees = [self._free_of(v) for v in eqn.invars]
            if scan is not None and i in scan[0].readers:  # the call reads its valid elements, moved
                invals = [scan[1].get(v, p) for v, p in zip(eqn.invars, invals)]
                frees = [None if v in scan[1] else f for v, f in zip(eqn.invars, frees)]
            if eqn.primitive is P.jit_p and eqn.params.get("name") == _ask.NAME:  # mj.mask_of
                p = self.resolved(invals[0], frees[0])
                env[eqn.outvars[0]] = Pair(materialize(p.mask, np.shape(p.data)), None)
                self.producer[eqn.outvars[0]] = eqn
                continue
            rows = self._rows_in(eqn, invals)
            if rows and all(p.mask is None for p in invals):  # plain: computed per example too
                for v, o in zip(eqn.outvars, self._plain_rows(eqn, invals, rows)):
                    env[v] = o
                    self.producer[v] = eqn
                continue
            self.eqn_rows = rows
            if rows:
                invals, special = self._placed(eqn, invals, rows)
                if special:  # a dynamic slice or update at positions per example
                    env[eqn.outvars[0]] = self._sliced_per_row(eqn, invals, special)
                    self.producer[eqn.outvars[0]] = eqn
                    continue
            if eqn.outvars and eqn.outvars[0] in constants:  # from literals alone, evaluated beforehand
                literal.update(eqn.outvars)
                env[eqn.outvars[0]] = Pair(constants[eqn.outvars[0]], None)
                self.producer[eqn.outvars[0]] = eqn
                self._track_literals(eqn, invals, constants[eqn.outvars[0]], minus)
                continue
            if any(p.mask is not None for p in invals):
                if any(p.mask is None and self.info_of(v).spans for v, p in zip(eqn.invars, invals)):
                    raise self._spans_error(eqn)
                moved = self._positional(eqn, invals, frees)
                if moved is not None:
                    invals, frees, outs = moved
                    if outs is not None:
                        for v, o in zip(eqn.outvars, outs):
                            env[v] = o
                            self.producer[v] = eqn
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
            if calls and self.out_rows is not None:
                for v, r in zip(eqn.outvars, self.out_rows):
                    if r is not None:
                        self.per_row[v] = r
                self.out_rows = None
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

    def _positional(self, eqn, invals, frees):
        """Where ``eqn`` meets or builds positions along a ragged axis (see :mod:`._positions`):
        ``(operands, their free positions, results)``, the operands moved to one system of
        coordinates and the results of a positional construct (``None`` when the usual rule is to
        run on the operands); ``None`` when nothing positional happens."""
        ins = [self.info_of(v) for v in eqn.invars]
        out = self.info.get(eqn.outvars[0]) if eqn.outvars else None
        if not any(isinstance(t, _coords.Ragged) for i in ins for t in i.axes):
            return None
        moved = self.positions.meet(eqn, invals, ins, out) if out is not None else invals
        if eqn.primitive in primitives.SCATTERS:
            moved = self.positions.scattered(eqn, moved, ins)
            if any((isinstance(t, _coords.Ragged) and t.layout == "U") or t is _coords.BUILT for t in ins[1].axes):
                self.spaces.grows(self.spaces.ids(invals[1].data))  # ids made of positions
        changed = any(a is not b for a, b in zip(moved, invals))
        if changed:
            frees = [None if a is not b else f for a, b, f in zip(moved, invals, frees)]
        resolved = [self.resolved(p, f) for p, f in zip(moved, frees)]
        outs = self.positions.rule(eqn, resolved, ins, self.path, self._rule)
        if outs is not None:
            return resolved, [None] * len(frees), outs if eqn.primitive.multiple_results else [outs]
        return (moved, frees, None) if changed else None

    # -- numbers that stand for a token axis's length -----------------------------------------------------
    def _grows_inside(self):
        """Whether a literal inside the equation being run stands for a token length (the call is
        then interpreted, not bound: its numbers differ per example)."""
        n = len(self.path)
        return any(p[:n] == self.path and len(p) > n for p in self.positions.relativity.literals)

    def _existing(self, v, p):
        """A result of the function with the entries of each axis built as long as a token axis
        (``arange(L)``, ids made of it) that lie past the example's valid count masked: the
        unpadded example has no such entry."""
        info = self.info_of(v)
        n = np.ndim(p.data)
        if len(info.axes) != n:
            return p
        rows = next((a for a, t in enumerate(info.axes) if t == _coords.ROWS), None)
        for a, t in enumerate(info.axes):
            if not (isinstance(t, _coords.Ragged) and t.layout == "U" and t.space[0] == "length"):
                continue
            count, batch = self._count(t.space[1])
            if count is None or (batch is not None and rows is None):
                continue
            lay = tuple(np.shape(p.data)[b] if b == rows else 1 for b in range(n))
            exists = lax.broadcasted_iota(jnp.int32, tuple(np.shape(p.data)[a] if b == a else 1 for b in range(n)), a)
            exists = exists < jnp.reshape(count, lay)
            mask = exists if p.mask is None else ranked(p.mask, n) & exists
            p = Pair(p.data, jnp.broadcast_to(mask, np.shape(p.data)) if p.mask is None else mask)
        return p

    def _count(self, length):
        """``(count, batch)``: the valid count of the function's masked inputs' token axis of
        ``length`` per example (``(B,)``, or a scalar for one example), and ``B`` (or ``None``)."""
        args, infos = self.top or ([], [])
        for p, info in zip(args, infos):
            if p.mask is None or info is None:
                continue
            for a, t in enumerate(info.axes):
                if isinstance(t, _coords.Ragged) and np.shape(p.data)[a] == length:
                    count = jnp.sum(_positions.pattern(p, info, a), axis=a, dtype=jnp.int32)
                    after = [b for b in range(np.ndim(p.data)) if b != a]
                    rows = next((b for b in after if info.axes[b] == _coords.ROWS), None)
                    reduce = tuple(i for i, b in enumerate(after) if b != rows)
                    count = jnp.max(count, axis=reduce) if reduce else count
                    if rows is None:
                        return count, None
                    batch = np.shape(p.data)[rows]
                    return jnp.broadcast_to(count, (batch,)), batch
        return None, None

    def _rows_in(self, eqn, invals):
        """``{operand index: values per example}``: operands computed from a number that stands
        for a token length, and literals that do (read off the second trace). For one example the
        literal is replaced by its value, and nothing is per example."""
        rows = {}
        # arithmetic of a length with an array the user gave (``seq_lengths - 1 + L``, a negative
        # index normalised) stays in padded coordinates, as the given array is
        given = _coords.entrywise(eqn.primitive) and any(
            not _jaxpr.is_literal(v) and v not in self.per_row and not self.info_of(v).number for v in eqn.invars
        )
        for k, v in enumerate(eqn.invars):
            if _jaxpr.is_literal(v):
                length = self.positions.relativity.length_of(self.path, k)
                if length is None or given:
                    continue
                count, batch = self._count(length)
                if count is None:
                    continue
                value = (jnp.asarray(v.val) + (count - length)).astype(np.asarray(v.val).dtype)
                if batch is None:
                    invals[k] = Pair(value, None)
                else:
                    rows[k] = value
            elif v in self.per_row:
                rows[k] = self.per_row[v]
        return rows

    def _plain_rows(self, eqn, invals, rows):
        """The results of a plain ``eqn`` (as they are), with their values per example recorded; a
        result with a batch axis takes each example's own values at once (its diagonal)."""
        outs = _jaxpr.bind(eqn, [p.data for p in invals])
        in_axes = [0 if k in rows else None for k in range(len(invals))]
        args = [rows[k] if k in rows else p.data for k, p in enumerate(invals)]
        per = jax.vmap(lambda *a: tuple(_jaxpr.bind(eqn, a)), in_axes=in_axes)(*args)
        results = []
        for v, o, r in zip(eqn.outvars, outs, per):
            axis = self._rows_axis(v, np.shape(r)[0])
            if axis is not None:
                results.append(Pair(_diagonal(r, axis), None))
            else:
                self.per_row[v] = r
                results.append(Pair(o, None))
        return results

    def _rows_axis(self, v, batch):
        """The batch axis of variable ``v`` (its coordinates' rows) if it is ``batch`` long."""
        info = self.info_of(v)
        shape = getattr(v.aval, "shape", ())
        return next((a for a, t in enumerate(info.axes) if t == _coords.ROWS and shape[a] == batch), None)

    def _placed(self, eqn, invals, rows):
        """Operands of a masked ``eqn`` with their values per example put along the batch axis
        (of their own, or of the masked operands they meet entrywise)."""
        invals = list(invals)
        special = {}
        for k, r in rows.items():
            v = eqn.invars[k]
            batch = np.shape(r)[0]
            if eqn.primitive in _CALLS:  # the body takes them per example (see control)
                continue
            index = k >= {P.gather_p: 1, P.dynamic_slice_p: 1, P.dynamic_update_slice_p: 2}.get(eqn.primitive, 99)
            if index and self.positions.relativity.get(self.path) is not None:
                continue  # a constant index counted from the end: the positional rule reads it so
            own = None if _jaxpr.is_literal(v) else self._rows_axis(v, batch)
            if own is not None:
                invals[k] = Pair(_diagonal(r, own), invals[k].mask)
                continue
            if _coords.entrywise(eqn.primitive):
                n = max(np.ndim(p.data) for p in invals)
                axis = next(
                    (
                        a
                        for j, w in enumerate(eqn.invars)
                        if invals[j].mask is not None and not _jaxpr.is_literal(w)
                        for a in [self._rows_axis(w, batch)]
                        if a is not None and np.ndim(invals[j].data) == n
                    ),
                    None,
                )
                if axis is not None and np.ndim(invals[k].data) == 0:  # a scalar: along the batch axis
                    invals[k] = Pair(jnp.reshape(r, tuple(batch if a == axis else 1 for a in range(n))), None)
                    continue
                if axis is not None and np.ndim(invals[k].data) == n and np.shape(invals[k].data)[axis] in (1, batch):
                    invals[k] = Pair(_placed_rows(r, axis), None)
                    continue
            if eqn.primitive in (P.dynamic_slice_p, P.dynamic_update_slice_p) and k >= (
                1 if eqn.primitive is P.dynamic_slice_p else 2
            ):
                special[k] = r
                continue
            raise self._rows_error(eqn)
        return invals, special

    def _sliced_per_row(self, eqn, invals, special):
        """``dynamic_slice`` / ``dynamic_update_slice`` whose start along an axis is a number per
        example (``P + t``, counted among valid entries): each example's slice, at the place of
        that number's valid entry where the example has it, else (past its valid entries: a new
        entry, as a KV cache's next slot) at the padded place, which comes after the padding."""
        prim = eqn.primitive
        first = 1 if prim is P.dynamic_slice_p else 2
        x = self.resolved(invals[0], self._free_of(eqn.invars[0]))
        info = self.info_of(eqn.invars[0])
        batch = np.shape(next(iter(special.values())))[0]
        axis = self._rows_axis(eqn.invars[0], batch)
        if axis is None:
            raise self._rows_error(eqn)
        n = np.ndim(x.data)
        starts = [p.data for p in invals[first:]]
        per = {}
        for k, r in special.items():
            d = k - first
            tag = info.axes[d]
            if x.mask is not None and isinstance(tag, _coords.Ragged) and tag.layout == "P":
                valid = _positions.pattern(x, info, d)
                others = tuple(b for b in range(n) if b not in (axis, d) and np.shape(valid)[b] != 1)
                valid = jnp.any(valid, axis=others, keepdims=True) if others else valid  # (an entry: a token)
                lay = tuple(batch if b == axis else 1 for b in range(n))
                at = jnp.reshape(jnp.clip(r, 0, np.shape(x.data)[d] - 1), lay)
                # the place of valid entry number r: the number of places with at most r valid
                # entries up to and including them (no sort)
                seen = jnp.cumsum(valid.astype(jnp.int32), axis=d, dtype=jnp.int32)
                count = lax.slice_in_dim(seen, np.shape(seen)[d] - 1, np.shape(seen)[d], axis=d)
                place = jnp.sum(seen <= at, axis=d, keepdims=True, dtype=jnp.int32)
                place = jnp.reshape(jnp.moveaxis(jnp.broadcast_to(place, lay), axis, 0), (batch,))
                inside = jnp.reshape(jnp.moveaxis(jnp.broadcast_to(count, lay), axis, 0), (batch,)) > r
                per[d] = jnp.where(inside, place, jnp.asarray(starts[d]).astype(place.dtype))
            else:
                per[d] = jnp.broadcast_to(jnp.asarray(starts[d]), (batch,))
            per[d] = per[d].astype(jnp.result_type(starts[d]))  # (a slice's starts share one dtype)
        data = x.data
        mask = materialize(x.mask, np.shape(data))
        kept = [b for b in range(n) if b != axis]

        def starts_of(b_starts):
            return [b_starts[d] if d in b_starts else starts[d] for d in kept]

        if prim is P.dynamic_slice_p:
            sizes = [eqn.params["slice_sizes"][d] for d in kept]

            def one(xd, xm, *ps):
                st = starts_of(dict(zip(per, ps)))
                return lax.dynamic_slice(xd, st, sizes), lax.dynamic_slice(xm, st, sizes)

            d_out, m_out = jax.vmap(one, in_axes=(axis, axis, *[0] * len(per)), out_axes=axis)(
                data, mask, *per.values()
            )
            return Pair(d_out, m_out)
        u = invals[1]
        u_mask = materialize(u.mask, np.shape(u.data))

        def one_update(xd, xm, ud, um, *ps):
            st = starts_of(dict(zip(per, ps)))
            return lax.dynamic_update_slice(xd, ud, st), lax.dynamic_update_slice(xm, um, st)

        d_out, m_out = jax.vmap(one_update, in_axes=(axis, axis, axis, axis, *[0] * len(per)), out_axes=axis)(
            data, mask, u.data, u_mask, *per.values()
        )
        return Pair(d_out, m_out)

    def _rows_error(self, eqn):
        return MaskifyError(
            f"maskify({self.fun_name}): a number computed from the length of a token axis (the padded "
            f"length stands for each example's own) reaches '{eqn.primitive.name}', where maskify cannot "
            "carry it per example. Pass the positions as an argument (for example "
            "lengths + step), or compute them from the masked inputs."
        )

    def _spans_error(self, eqn):
        return MaskifyError(
            f"maskify({self.fun_name}): a value computed over every position of an axis built as long "
            f"as a token axis (a sum, sort or segment count over jnp.arange(L) or ids made from it) "
            f"meets masked data at '{eqn.primitive.name}'; it counts the padded positions, which the "
            "unpadded example does not have. Compute it from the masked inputs (a count as a sum "
            "of x * 0 + 1), or pass it in as an argument."
        )

    def _rule(self, prim):
        """``prim``'s masked rule with this call's facts: ``rule(prim, invals, **params)``."""
        rule = primitives.rule_for(prim)

        def run(p, invals, **params):
            if rule is None:
                raise MaskifyError(f"maskify({self.fun_name}): primitive '{p.name}' has no masked rule.")
            try:
                return rule(p, invals, self.facts, **params)
            except primitives.NoMaskedRule as err:
                raise MaskifyError(
                    f"maskify({self.fun_name}): primitive '{p.name}' has a masked operand and {err}. "
                    "Fill the operand first (x.filled(...)) or compute it with masked_jax.numpy."
                ) from None

        return run

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
        if prim is P.jit_p and not unmasked and params.get("name") == _unique.SORTED_MASK:
            raise _unique.refuse(self.fun_name)  # jnp.unique's sort, outside a call taken whole
        if (
            prim is P.jit_p
            and not unmasked
            and (params.get("name") in primitives.NAMED or params.get("name") in primitives.UNSUPPORTED_CALLS)
        ):
            return _recognise.named_call(self, eqn, params, invals)
        if (prim in _CALLS or prim in _LOOPS) and (not unmasked or self._grows_inside()):
            self.ins = [self.info_of(v) for v in eqn.invars]  # what the bodies' arguments are
            self.subs = list(_jaxpr.nested_jaxprs(eqn.params.values()))
            self.rows = [self.eqn_rows.get(k) for k in range(len(eqn.invars))]
            if prim in _LOOPS and any(r is not None for r in self.rows):
                raise self._rows_error(eqn)
            return self.control(prim, params, invals, is_literal, frees)
        if unmasked:
            if all(_is_concrete(p.data) for p in invals) and not prim.multiple_results:
                # Values computed from literals and constants alone stay constants, also when the
                # function is interpreted inside an outer jit/scan: counts, ddof and fills are
                # recognised the same way eagerly and under every transformation.
                with jax.ensure_compile_time_eval():
                    out = prim.bind(*(p.data for p in invals), **params)
            elif prim in _custom.CUSTOM:  # (bound with its rules, as jax.core.eval_jaxpr binds it)
                out = _jaxpr.bind_primitive(prim, params, [p.data for p in invals])
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
            ins, rows = self.ins, self.rows
            try:
                if isinstance(closed, jcore.ClosedJaxpr):
                    outs = self.run(
                        closed.jaxpr, closed.consts, invals, is_literal, frees, True, ins, self._sub(closed.jaxpr), rows
                    )
                else:
                    outs = self.run(closed, (), invals, is_literal, frees, True, ins, self._sub(closed), rows)
            except MaskifyError as err:
                user = _public_name(params.get("name")) if prim is P.jit_p else None
                if user is None:
                    raise
                new = MaskifyError(_inside_public_call(self.fun_name, user, err))
                new.detail = getattr(err, "detail", None) or str(err).split(": ", 1)[-1]  # the primitive's
                raise new from None
            if prim in _custom.CUSTOM:  # the primal as interpreted, the derivative the function's own rule
                new = _custom.own_derivatives(
                    self._derivative, self.live, self.fun_name, prim, params, invals, is_literal, outs
                )
                self.facts.same_values(zip(new, outs))
                outs = new
            return outs
        if prim is P.cond_p:
            index, *ops = invals
            if index.mask is not None:
                raise MaskifyError(
                    f"maskify({self.fun_name}): the predicate of lax.cond is masked; a branch "
                    "cannot be chosen for a missing value."
                )
            ops = [p if p.mask is None else _materialized([p])[0] for p in ops]  # plain operands stay plain
            ins = self.ins[1:]
            branches = [functools.partial(self._branch, b, ins, self._sub(b.jaxpr)) for b in params["branches"]]
            return lax.switch(index.data, branches, ops)
        if prim is P.while_p:
            return self._while(params, invals)
        return self._scan(params, invals)

    def _sub(self, jaxpr):
        """The index of ``jaxpr`` among the nested jaxprs of the equation being run."""
        return next((i for i, s in enumerate(self.subs) if s is jaxpr), None)

    @staticmethod
    def _step_infos(ins, nconsts, ncarry):
        """A loop body's arguments' coordinates: the scanned inputs lose their leading axis."""
        return [
            i if k < nconsts + ncarry else i._replace(axes=i.axes[1:], pad=None) if i.axes else i
            for k, i in enumerate(ins)
        ]

    def _derivative(self, jaxpr, consts, args, literal_args):
        """A custom derivative rule's jaxpr on ``args``, by an interpreter of its own: the rule runs
        when JAX differentiates, in a trace of its own."""
        return _Interpreter(self.fun_name, live=self.live).run(jaxpr, consts, args, literal_args)

    def _branch(self, closed, ins, sub, ops):
        with self._apart():
            return _materialized(self.run(closed.jaxpr, closed.consts, ops, infos=ins, sub=sub))

    def _scan_whole_rows(self, params, consts, carry, xs, whole, ncarry):
        """A scan whose steps are valid or missing by whole rows (see :func:`_whole_rows`), run as
        the hand-written code runs it: the body on plain data (the padding filled with 0: no valid
        row reads it), the carry of a missing row left as it was by one select, the outputs masked
        by the rows."""
        rows, carry_axes, ys_axes = whole
        body = params["jaxpr"]
        xs_data = [p.data if p.mask is None else fill(p.data, p.mask, 0, facts=self.facts) for p in xs]
        sub = self._sub(body.jaxpr)  # (plain operands: no coordinates inside)

        def step(c, inp):
            x, valid = inp
            with self._apart():
                outs = self.run(
                    body.jaxpr,
                    body.consts,
                    list(consts) + [Pair(d, None) for d in c] + [Pair(d, None) for d in x],
                    sub=sub,
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
        ins = self.ins
        c_ins, b_ins = ins[:nc] + ins[nc + nb :], ins[nc : nc + nb] + ins[nc + nb :]
        c_sub, b_sub = self._sub(cj.jaxpr), self._sub(bj.jaxpr)
        # a carry no masked value reaches (a loop counter, a bound) stays plain: its value indexes
        masked = _masked_carries(bj.jaxpr, [p.mask is not None for p in bconsts], carry, [])
        carry = [_materialized([p])[0] if m else p for p, m in zip(carry, masked)]

        def cond_fn(c):
            with self._apart():
                (p,) = self.run(cj.jaxpr, cj.consts, list(cconsts) + list(c), infos=c_ins, sub=c_sub)
            return p.data if p.mask is None else p.data & p.mask  # a masked predicate stops the loop

        def body_fn(c):
            with self._apart():
                outs = self.run(bj.jaxpr, bj.consts, list(bconsts) + list(c), infos=b_ins, sub=b_sub)
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
        ins, sub = self._step_infos(self.ins, nconsts, ncarry), self._sub(body.jaxpr)
        # a carry no masked value reaches (a loop counter: fori_loop's index) stays plain
        masked = _masked_carries(body.jaxpr, [p.mask is not None for p in consts], carry_in, masked_xs)

        def step(c, x):
            with self._apart():
                outs = self.run(body.jaxpr, body.consts, list(consts) + list(c) + list(x), infos=ins, sub=sub)
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


def _diagonal(r, axis):
    """Values per example ``r`` (a leading axis of examples) of a value whose ``axis`` is the batch:
    each example's own row."""
    moved = jnp.moveaxis(r, 0, -1)  # (..., batch@axis, ..., examples)
    picked = jnp.diagonal(moved, axis1=axis, axis2=np.ndim(moved) - 1)  # (..., batch) with axis removed
    return jnp.moveaxis(picked, -1, axis)


def _placed_rows(r, axis):
    """Values per example ``r`` of a value with no batch axis, laid along ``axis`` (where it has
    size 1 or the batch's size)."""
    if np.shape(r)[axis + 1] == 1:
        return jnp.moveaxis(jnp.squeeze(r, axis + 1), 0, axis)
    return _diagonal(r, axis)


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
