"""Custom derivative rules under ``maskify``: a ``custom_jvp`` / ``custom_vjp`` function's derivative
is its own rule, on the valid entries.

The primal of such a call is its body interpreted with the masked rules, as any call's. Its
derivative is not that body's: ``jax.nn.relu`` is ``max(x, 0)``, whose derivative at 0 JAX would
split in halves, while relu's own rule says 0; a norm whose rule guards ``x == 0`` must stay finite
there. So the call's outputs pass through an identity (a ``jax.custom_jvp``, resp. a
``jax.custom_vjp``) whose derivative is the function's own rule interpreted with the masked rules:

* ``custom_jvp``: the tangents are the function's JVP rule (what ``jax.jvp`` of the call runs)
  interpreted on the masked operands and on tangents that are 0 under the operands' masks. That
  map is linear in the tangents; it is differentiated along them (the JVP of the masked rules at
  0) rather than evaluated, so that reverse mode transposes what JAX knows how to transpose;
* ``custom_vjp``: the cotangents are the function's forward and backward rules (what
  ``jax.vjp`` of the call runs) interpreted on the masked operands and on cotangents that are 0
  under the outputs' masks; the forward rule runs again in the backward pass.

The operands' masked-out entries are filled with 0 before the rules read them, and the results
are 0 under the masks of the outputs (tangents) or of the operands (cotangents): no NaN of the
padding enters a derivative. Values and masks are those of the masked primal.
"""

from __future__ import annotations

import jax
import jax.extend.core.primitives as P
import jax.numpy as jnp
import numpy as np

from masked_jax import _jaxpr
from masked_jax._maskify._constants import _is_concrete
from masked_jax._maskify._errors import MaskifyError
from masked_jax._validate import is_tracer
from masked_jax.ops._base import Pair

SymbolicZero = jax.custom_derivatives.SymbolicZero

CUSTOM = frozenset((P.custom_jvp_call_p, P.custom_vjp_call_p))


def _inexact(x) -> bool:
    return jnp.issubdtype(jnp.result_type(x), jnp.inexact)


def _name(params) -> str:
    closed = params.get("call_jaxpr")
    info = getattr(getattr(closed, "jaxpr", None), "debug_info", None)
    return getattr(info, "func_name", None) or "<custom rule>"


def _zero_under(mask, data):
    """``data`` with 0 where ``mask`` (broadcastable to it) is False."""
    if mask is None:
        return data
    return jnp.where(mask, data, jnp.zeros((), jnp.result_type(data)))


def _and(a, b):
    if a is None or b is None:
        return b if a is None else a
    return jnp.logical_and(a, b)


def own_derivatives(interpret, live, fun_name, prim, params, invals, is_literal, outs):
    """``outs`` (the masked primal of the ``custom_jvp_call`` / ``custom_vjp_call`` equation of
    ``prim`` and ``params`` on ``invals``) with their data passed through an identity whose
    derivative is the function's own rule on the valid entries. ``interpret(jaxpr, consts, args,
    literal)`` runs a jaxpr with the masked rules (a fresh interpreter); ``live``: the ids of the
    values traced outside maskify's function that it closes over (a rule may read them)."""
    floats = [i for i, o in enumerate(outs) if _inexact(o.data)]
    if not floats:
        return outs
    n = len(invals)
    literal = [bool(is_literal and is_literal[i]) for i in range(n)]
    # concrete operands computed from literals stay closed over (still recognised as constants);
    # the others enter the identity as arguments
    closed = {i: invals[i].data for i in range(n) if literal[i] and _is_concrete(invals[i].data)}
    moving = [i for i in range(n) if i not in closed]
    nconsts = params.get("num_consts", 0)
    diff = [i for i in moving if i >= nconsts and _inexact(invals[i].data)]
    rule = _Rule(interpret, live, fun_name, prim, params, invals, literal, closed, moving, diff, floats)
    args = (
        [jax.lax.stop_gradient(outs[i].data) for i in floats],
        [invals[i].data for i in moving],
        [invals[i].mask for i in moving],
        [outs[i].mask for i in floats],
    )
    through = rule.jvp_identity() if prim is P.custom_jvp_call_p else rule.vjp_identity()
    datas = through(*args)
    outs = list(outs)
    for i, d in zip(floats, datas):
        outs[i] = Pair(d, outs[i].mask)
    return outs


class _Rule:
    """The derivative of one custom call: its operands (``closed`` by position, the ``moving``
    ones passed in), which are differentiated (``diff``), which outputs are (``floats``)."""

    def __init__(self, interpret, live, fun_name, prim, params, invals, literal, closed, moving, diff, floats):
        self.interpret, self.live, self.fun_name, self.prim, self.params = interpret, live, fun_name, prim, params
        self.avals = [jax.ShapeDtypeStruct(np.shape(p.data), jnp.result_type(p.data)) for p in invals]
        self.literal, self.closed, self.moving, self.diff, self.floats = literal, closed, moving, diff, floats
        self.name = _name(params)

    def _operands(self, xs):
        """All operands, from the moving ones."""
        full = [self.closed.get(i) for i in range(len(self.avals))]
        for i, x in zip(self.moving, xs):
            full[i] = x
        return full

    def _call(self, operands):
        return _jaxpr.bind_primitive(self.prim, self.params, operands)

    def _run(self, derivative, xs, masks, extra):
        """The masked outputs of ``derivative`` (a function of all operands and ``extra`` arrays)
        on the moving operands ``xs`` (masked-out entries filled with 0) and ``extra`` pairs."""
        pairs = []
        for x, m in zip(xs, masks):
            pairs.append(Pair(_zero_under(m, x) if _inexact(x) else x, m))
        full = self._operands(pairs)
        for i in self.closed:
            full[i] = Pair(self.closed[i], None)
        avals = [jax.ShapeDtypeStruct(np.shape(p.data), jnp.result_type(p.data)) for p in extra]
        try:
            jaxpr = jax.make_jaxpr(derivative)([self.avals[i] for i in range(len(full))], avals)
        except jax.errors.UnexpectedTracerError:
            jaxpr = None
        # A value traced inside maskify's function that the rule closes over is gone by the time
        # the rule runs; values traced outside it (closed over by the function) are still live.
        if jaxpr is None or any(is_tracer(c) and id(c) not in self.live for c in jaxpr.consts):
            raise MaskifyError(
                f"maskify({self.fun_name}): the derivative rule of the custom-derivative function "
                f"'{self.name}' closes over a value traced inside {self.fun_name}, so it cannot run "
                "once that is traced (jax cannot differentiate it under jit either). Pass "
                f"that value to '{self.name}' as an argument."
            )
        try:
            return self.interpret(jaxpr.jaxpr, jaxpr.consts, full + list(extra), self.literal + [False] * len(extra))
        except MaskifyError as err:
            raise MaskifyError(
                f"maskify({self.fun_name}): in the derivative rule of the custom-derivative function "
                f"'{self.name}': {str(err).split(': ', 1)[-1]}"
            ) from None

    # -- custom_jvp ----------------------------------------------------------------------------
    def _tangents(self, xs, masks, out_masks, txs):
        """The output tangents of the function's own JVP rule on the valid entries."""
        pos = {i: k for k, i in enumerate(self.moving)}

        def own(operands, tangents):  # jax.jvp of the call: the function's JVP rule
            def call(*d):
                full = list(operands)
                for i, v in zip(self.diff, d):
                    full[i] = v
                return self._call(full)

            _, t = jax.jvp(call, tuple(operands[i] for i in self.diff), tuple(tangents))
            return [t[i] for i in self.floats]

        def masked(ts):  # linear in ts
            extra = [Pair(_zero_under(masks[pos[i]], t), masks[pos[i]]) for i, t in zip(self.diff, ts)]
            outs = self._run(own, xs, masks, extra)
            return [
                _zero_under(_and(m, o.mask), o.data).astype(self._out_dtype(k))
                for k, (m, o) in enumerate(zip(out_masks, outs))
            ]

        ts = [txs[pos[i]] for i in self.diff]
        zeros = [jnp.zeros_like(t) for t in ts]
        _, tangents = jax.jvp(masked, (zeros,), (ts,))
        return tangents

    def _out_dtype(self, k):
        return self.params["call_jaxpr"].out_avals[self.floats[k]].dtype

    def _closed_over(self, kind):
        return MaskifyError(
            f"maskify({self.fun_name}): the {kind} function '{self.name}' closes over a value that "
            "is being differentiated, and its rule only differentiates its arguments (jax cannot "
            f"differentiate it either). Pass that value to '{self.name}' as an argument."
        )

    def jvp_identity(self):
        rule = self
        consts = [k for k, i in enumerate(self.moving) if i < self.params.get("num_consts", 0)]

        @jax.custom_jvp
        def through(outs, xs, masks, out_masks):
            return outs

        def _through_jvp(primals, tangents):
            outs, xs, masks, out_masks = primals
            txs = tangents[1]
            if any(_inexact(xs[k]) and not isinstance(txs[k], SymbolicZero) for k in consts):
                raise rule._closed_over("custom_jvp")
            txs = [jnp.zeros_like(x) if isinstance(t, SymbolicZero) else t for x, t in zip(xs, txs)]
            return through(outs, xs, masks, out_masks), rule._tangents(xs, masks, out_masks, txs)

        through.defjvp(_through_jvp, symbolic_zeros=True)
        return through

    # -- custom_vjp ----------------------------------------------------------------------------
    def _cotangents(self, xs, masks, out_masks, cts):
        """The operands' cotangents (``None`` where not differentiated) of the function's own
        forward and backward rules on the valid entries."""
        pos = {i: k for k, i in enumerate(self.moving)}
        avals = self.params["call_jaxpr"].out_avals

        def own(operands, cotangents):  # jax.vjp of the call: its forward then backward rule
            def call(*d):
                full = list(operands)
                for i, v in zip(self.diff, d):
                    full[i] = v
                return [self._call(full)[i] for i in self.floats]

            _, pullback = jax.vjp(call, *(operands[i] for i in self.diff))
            return list(pullback(list(cotangents)))

        extra = []
        for m, ct, k in zip(out_masks, cts, self.floats):
            if isinstance(ct, SymbolicZero):
                ct = jnp.zeros(avals[k].shape, avals[k].dtype)
            extra.append(Pair(_zero_under(m, ct), m))
        outs = self._run(own, xs, masks, extra)
        found: list = [None] * len(xs)
        for i, o in zip(self.diff, outs):
            found[pos[i]] = _zero_under(_and(masks[pos[i]], o.mask), o.data).astype(self.avals[i].dtype)
        return found

    def vjp_identity(self):
        rule = self
        consts = [k for k, i in enumerate(self.moving) if i < self.params.get("num_consts", 0)]

        @jax.custom_vjp
        def through(outs, xs, masks, out_masks):
            return outs

        def fwd(outs, xs, masks, out_masks):
            if any(xs[k].perturbed for k in consts):
                raise rule._closed_over("custom_vjp")
            values = jax.custom_derivatives.custom_vjp_primal_tree_values
            return values(outs), values((xs, masks, out_masks))

        def bwd(res, cts):
            xs, masks, out_masks = res
            return None, rule._cotangents(xs, masks, out_masks, cts), None, None

        through.defvjp(fwd, bwd, symbolic_zeros=True)
        return through
