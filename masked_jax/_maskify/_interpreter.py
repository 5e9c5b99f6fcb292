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
from masked_jax._maskify import _free, _rows
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
from masked_jax._maskify._scan import _ASSOCIATIVE_SCAN, _SCAN_NAME, _scan_counts
from masked_jax.ops import _factors, normalization
from masked_jax.ops._base import Pair, and_masks, compact_or_ones, count_valid, fill, materialize, ranked, uniform_along

# Call-like primitives whose body is interpreted with the masks riding along.
# checkpoint's primitive: exported as remat_p by newer jax; otherwise read off a staged checkpoint
_CALLS = _jaxpr.CALL_PRIMITIVES

_LOOPS = frozenset((P.cond_p, P.while_p, P.scan_p))


class _Interpreter:
    def __init__(self, fun_name, scans=()):
        self.fun_name = fun_name
        self.scans = scans  # lax.associative_scan calls recorded while tracing (see _recorded_associative_scan)
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
            frees = [self._free_of(v) for v in eqn.invars]
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
        return [read(v) for v in jaxpr.outvars]

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
        if prim is P.jit_p and not unmasked and str(params.get("name")).startswith(_SCAN_NAME):
            return self._associative_scan(params, invals)
        if (
            prim is P.jit_p
            and not unmasked
            and (params.get("name") in primitives.NAMED or params.get("name") in primitives.UNSUPPORTED_CALLS)
        ):
            return self.named_call(eqn, params, invals)
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

        k = follow(eqn.outvars[0], lambda e: e.primitive is P.max_p)
        if k is not None and any(minus_inf(v, k) for v in eqns[k].invars if v is not eqn.outvars[0]):
            chain.append(k)
        # the maximum back at x's rank: a broadcast (or reshape) with 1 along the axes, possibly after a
        # transpose, and subtracted from x or from x transposed the same way (jax's grouped-query
        # attention layout): the softmax then runs on the transposed x
        rest = [d for d in range(len(keep)) if d not in axes]  # the maximum's dims, as dims of x
        perm_max = list(range(len(rest)))
        if step(lambda e: e.primitive is P.transpose_p):
            perm_max = list(eqns[chain[-1]].params["permutation"])
        if not step(lambda e: e.primitive in (P.broadcast_in_dim_p, P.reshape_p)):
            return None
        widen = eqns[chain[-1]]
        step(lambda e: e.primitive is P.stop_gradient_p)
        moved = {}  # x transposed before the subtraction: its equation and permutation

        def shifted_x(e):
            if e.primitive is not P.sub_p or e.invars[1] is x or e.invars[1] is not eqns[chain[-1]].outvars[0]:
                return False
            if e.invars[0] is x:
                return True
            src = next((j for j in range(i + 1, len(eqns)) if e.invars[0] in eqns[j].outvars), None)
            if src is None or eqns[src].primitive is not P.transpose_p or eqns[src].invars[0] is not x:
                return False
            if self.uses.get(e.invars[0]) != 1:
                return False
            moved.update(index=src, perm=list(eqns[src].params["permutation"]))
            return True

        if not step(shifted_x):
            return None
        perm = moved.get("perm", list(range(len(keep))))
        shape = tuple(keep[d] for d in perm)  # the maximum's shape in the subtraction's layout
        if widen.outvars[0].aval.shape != shape:
            return None
        if widen.primitive is P.broadcast_in_dim_p:  # each dim of the maximum lands where x's dim went
            dims = widen.params["broadcast_dimensions"]
            if any(perm[dims[j]] != rest[perm_max[j]] for j in range(len(rest))):
                return None
        elif perm_max != sorted(perm_max) or perm != sorted(perm):
            return None
        axes = tuple(sorted(perm.index(a) for a in axes))  # from here on, in the subtraction's layout

        def keepdims(e):
            return e.primitive in (P.broadcast_in_dim_p, P.reshape_p) and e.outvars[0].aval.shape == shape

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
        operand = invals[0]
        if moved:  # the softmax of x transposed, along the axes where x's axes went
            operand = primitives.compact_shape_op(P.transpose_p, [operand], permutation=tuple(perm))
            chain.insert(0, moved["index"])
        return chain + [k], op(operand, axes)

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
        with _factors.new_trace():
            return _materialized(self.run(closed.jaxpr, closed.consts, ops))

    def _scan_whole_rows(self, params, consts, carry, xs, rows, ncarry):
        """A scan whose steps are valid or missing by whole rows (see :func:`_whole_rows`), run as
        the hand-written code runs it: the body on plain data (the padding filled with 0), the
        carry of a missing row left as it was by one select, the outputs masked by the rows."""
        body = params["jaxpr"]
        xs_data = [p.data if p.mask is None else fill(p.data, p.mask, 0) for p in xs]

        def step(c, inp):
            x, valid = inp
            with _factors.new_trace():
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
            with _factors.new_trace():
                (p,) = self.run(cj.jaxpr, cj.consts, list(cconsts) + list(c))
            return p.data if p.mask is None else p.data & p.mask  # a masked predicate stops the loop

        def body_fn(c):
            with _factors.new_trace():
                return _materialized(self.run(bj.jaxpr, bj.consts, list(bconsts) + list(c)))

        return lax.while_loop(cond_fn, body_fn, carry)

    def _scan(self, params, invals):
        nconsts, ncarry = _scan_counts(params, len(invals))
        consts, carry_in, xs = invals[:nconsts], invals[nconsts : nconsts + ncarry], invals[nconsts + ncarry :]
        masked_xs = [p.mask is not None for p in xs]  # (plain inputs say nothing about padding)
        rows = _whole_rows(consts, carry_in, xs, params["jaxpr"].jaxpr)
        if rows is not None:
            return self._scan_whole_rows(params, consts, carry_in, xs, rows, ncarry)
        carry = _materialized(carry_in)
        xs = _materialized(xs)
        body = params["jaxpr"]

        def step(c, x):
            with _factors.new_trace():
                outs = _materialized(self.run(body.jaxpr, body.consts, list(consts) + list(c) + list(x)))
            carry, ys = outs[:ncarry], outs[ncarry:]
            missing = _missing_rows([p.mask for p, m in zip(x, masked_xs) if m])
            if missing is not None:  # a padded step: the carry is left as it was, the outputs masked
                carry = [_where_rows(missing, old, new) for old, new in zip(c, carry)]
                ys = [Pair(y.data, y.mask & ~_rows_like(missing, y.mask)) for y in ys]
            return carry, ys

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
