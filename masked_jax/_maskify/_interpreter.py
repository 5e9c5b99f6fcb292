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
from masked_jax.ops._base import Pair, and_masks, compact_or_ones, count_valid, fill, materialize, uniform_along

# Call-like primitives whose body is interpreted with the masks riding along.
# checkpoint's primitive: exported as remat_p by newer jax; otherwise read off a staged checkpoint
_CALLS = _jaxpr.CALL_PRIMITIVES

_LOOPS = frozenset((P.cond_p, P.while_p, P.scan_p))


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
