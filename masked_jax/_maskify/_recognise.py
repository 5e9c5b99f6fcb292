"""Whole-call recognisers: sequences of equations (or named calls) that ``maskify`` runs as one
masked op, because read one equation at a time they would mean something else.

* ``jax.nn.softmax`` and ``log_softmax`` (their own forms, custom-jvp bodies, and the transposed
  layout of grouped-query ``dot_product_attention``): one masked op, one select;
* a sum divided by its static element count (``jnp.mean``, ``jnp.var``): a division by the valid
  count; ``sum(x * w) / sum(w)`` (``jnp.average``): a masked weighted mean;
* jax functions' own named calls (``jnp.median``, ``jnp.sort``, ...): the ``masked_jax.numpy`` op;
* ``lax.associative_scan`` (found by its equations' source, :mod:`._scan`): a scan over the valid
  elements.

Each takes the interpreter (:class:`masked_jax._maskify._interpreter._Interpreter`), whose tables
(values, producers, read counts of the jaxpr being run) it reads.
"""

from __future__ import annotations

import jax
import jax.extend.core.primitives as P
import jax.numpy as jnp
import numpy as np

from masked_jax import _jaxpr
from masked_jax._maskify import _positions
from masked_jax._maskify import _rules as primitives
from masked_jax._maskify._constants import _concrete_scalar, _known, _uniform_scalar
from masked_jax._maskify._errors import MaskifyError
from masked_jax.ops import normalization
from masked_jax.ops._base import Pair, and_masks, fill, materialize, ranked


def weighted_mean(interp, eqn, invals):
    """``sum(x * w) / sum(w)`` (``jnp.average(x, weights=w)``) -> the weight total over the
    positions where ``x * w`` is valid: the masked weighted mean of ``masked_jax.numpy.average``,
    masked where those weights sum to 0."""
    if eqn.primitive is not P.div_p or any(_jaxpr.is_literal(v) for v in eqn.invars):
        return None
    (num_var, num_chain), (den_var, den_chain) = (root(interp, v) for v in eqn.invars)
    num_eq, den_eq = interp.producer.get(num_var), interp.producer.get(den_var)
    if (
        num_eq is None
        or den_eq is None
        or num_eq.primitive is not P.reduce_sum_p
        or den_eq.primitive is not P.reduce_sum_p
        or num_eq.params["axes"] != den_eq.params["axes"]
        or len(num_chain) != len(den_chain)
    ):
        return None
    prod_eq = interp.producer.get(num_eq.invars[0])
    weights = den_eq.invars[0]
    if prod_eq is None or prod_eq.primitive is not P.mul_p or weights not in prod_eq.invars:
        return None
    product, w = interp.env[num_eq.invars[0]], interp.env[weights]
    product = interp.resolved(product, interp.free.get(num_eq.invars[0]))  # (free slots read as their space says)
    if product.mask is None:
        return None
    if any(interp.uses[v] > 1 for v in [den_var, *(e.outvars[0] for e in den_chain)]):
        raise MaskifyError(
            f"maskify({interp.fun_name}): the sum of the weights of a masked weighted average is "
            "used again (jnp.average(..., returned=True)); only the weights of valid entries "
            "count, so compute it as jnp.sum(jnp.where(valid, w, 0)) or use "
            "masked_jax.numpy.average."
        )
    mask = materialize(product.mask, jnp.shape(product.data))
    total = jnp.sum(jnp.where(mask, w.data, 0), axis=num_eq.params["axes"]).astype(invals[1].data.dtype)
    for e in reversed(num_chain):  # keepdims: the numerator's broadcasts, applied to the total
        total = e.primitive.bind(total, **e.params)
    num = invals[0]
    valid = and_masks(num.mask, total != 0, facts=interp.facts)
    return Pair(jnp.where(valid, num.data / jnp.where(valid, total, 1), 0), valid)


def softmax(interp, eqns, i, invals):
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
        if interp.uses.get(var) != uses:
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
        value = interp.env.get(v)
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
        if interp.uses.get(e.invars[0]) != 1:
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
    log = interp.uses.get(shifted) == 2  # log_softmax: x - max also minus the log of the sum
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
    if k is None or interp.uses.get(total) != 1:
        return None
    op = normalization.compact_log_softmax if log else normalization.compact_softmax
    operand = invals[0]
    if moved:  # the softmax of x transposed, along the axes where x's axes went
        operand = primitives.compact_shape_op(P.transpose_p, [operand], interp.facts, permutation=tuple(perm))
        chain.insert(0, moved["index"])
    return chain + [k], op(operand, axes, interp.facts)


def root(interp, var):
    """``(v, chain)``: ``var`` is ``v`` reshaped or broadcast by the equations of ``chain``."""
    chain = []
    while _known(var, interp.producer) and interp.producer[var].primitive in (P.broadcast_in_dim_p, P.reshape_p):
        chain.append(interp.producer[var])
        var = chain[-1].invars[0]
    return var, chain


def mean_like(interp, eqn, invals, sized, minus):
    """``sum / n`` -> ``sum / count``; ``sum / (n - ddof)`` -> ``sum / (count - ddof)``."""
    if eqn.primitive is not P.div_p or not _known(eqn.invars[0], sized):
        return None
    s, den = sized[eqn.invars[0]], invals[1]
    if den.mask is not None:
        return None
    value = _concrete_scalar(den.data)
    num_shape = np.shape(invals[0].data)
    if value is None and np.broadcast_shapes(num_shape, np.shape(den.data)) == num_shape:
        value = _uniform_scalar(den.data)  # the length once per slice: jnp.ones_like(x).sum(axis)
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
        mask = num.mask if ddof == 0 and s.any else and_masks(num.mask, valid, facts=interp.facts)
    if mask is num.mask and interp.facts.holds_zero(num.data, num.mask):  # zero sums stay zero
        interp.facts.record_value(data, mask, 0, True)
    return Pair(data, mask)


def is_named_call(eqn) -> bool:
    """Is ``eqn`` a jax function's own named call that runs as its ``masked_jax.numpy`` op (or
    raises)?"""
    name = eqn.params.get("name")
    return eqn.primitive is P.jit_p and (name in primitives.NAMED or name in primitives.UNSUPPORTED_CALLS)


def named_call(interp, eqn, params, invals):
    """A jax function's own jit call (``jnp.median``) replaced by its op's rule, its static
    arguments recognised from the call's body (see ``OpSpec.static``)."""
    name = params["name"]
    if name in primitives.UNSUPPORTED_CALLS:
        raise MaskifyError(
            f"maskify({interp.fun_name}): jnp.{name} of a masked operand is not supported "
            f"({primitives.UNSUPPORTED_CALLS[name]})."
        )
    spec = primitives.NAMED[name]
    kw = primitives.recognise(spec, params["jaxpr"], [v.aval for v in eqn.invars])
    if kw is None:
        raise MaskifyError(
            f"maskify({interp.fun_name}): jnp.{name} is called on a masked operand with arguments "
            f"maskify does not recognise (it matches the forms masked_jax.numpy.{spec.name} "
            f"takes); call masked_jax.numpy.{spec.name} directly."
        )
    n = len(spec.operands)
    operands, rest = invals[:n], invals[n:]
    # positions along a token axis (argsort's) are the unpadded example's
    operands, finish = interp.positions.compact_call(name, operands, [interp.info_of(v) for v in eqn.invars[:n]], kw)
    # the op's optional operands (cov's y) come next and may be masked; the others are parameters
    optional, rest = rest[: len(spec.optional_operands)], rest[len(spec.optional_operands) :]
    if any(p.mask is not None for p in rest):
        raise MaskifyError(
            f"maskify({interp.fun_name}): an argument of jnp.{name} other than the array "
            "(such as q) is masked; it must be a plain array."
        )
    out = spec.rule(*operands, *optional, *(p.data for p in rest), **kw)
    return [finish(out if isinstance(out, Pair) else Pair(out, None))]


def associative_scan(interp, call, elems):
    """``lax.associative_scan(fn, elems)`` over the valid elements only (``call`` found by
    :func:`masked_jax._maskify._scan.associative_scans`, ``elems`` its leaves' values), or ``None``
    when no leaf is masked (its equations then run as they are).

    An element is valid where every leaf of ``elems`` is; the result at a valid element combines
    the valid elements up to it (from it, with ``reverse``), skipping masked ones, and the result
    keeps the elements' mask. The call's own equations run on the valid elements moved to the front
    of each row (to the back with ``reverse``), in order, the places after them holding a copy of
    the last valid element (so that ``fn`` only ever sees valid values); :func:`scan_results` moves
    the results back. Returns ``(the moved leaves by variable, the run's state)``."""
    if all(p.mask is None for p in elems):
        return None
    shapes = {jnp.shape(p.data) for p in elems}
    if len(shapes) != 1:
        raise MaskifyError(
            f"maskify({interp.fun_name}): lax.associative_scan of masked elements needs every "
            f"leaf of elems to have one shape (got {sorted(shapes)}): an element is valid where "
            "all its leaves are."
        )
    shape, axis = shapes.pop(), call.axis
    n = shape[axis]
    valid = ranked(and_masks(*(p.mask for p in elems), facts=interp.facts), len(shape))
    if valid is None:
        valid = jnp.ones((1,) * len(shape), bool)
    valid = jnp.broadcast_to(valid, tuple(n if a == axis else s for a, s in enumerate(np.shape(valid))))
    count = jnp.sum(valid, axis=axis, keepdims=True, dtype=jnp.int32)
    first = n - count  # with reverse, where the valid elements begin
    # no move where the valid elements already stand where the scan wants them: first (last with
    # reverse) in every row, as in the usual right- (left-) padded batch
    in_place = _positions.right_padded(jnp.flip(valid, axis) if call.reverse else valid, axis)
    datas = [fill(p.data, valid, 0, facts=interp.facts) for p in elems]

    def general(*datas):
        place = jax.lax.broadcasted_iota(jnp.int32, np.shape(valid), axis)
        # the valid elements' positions first (last with reverse), each row's order kept
        order = jnp.argsort(valid if call.reverse else ~valid, axis=axis, stable=True)
        source = jnp.clip(place, first, n - 1) if call.reverse else jnp.minimum(place, jnp.maximum(count - 1, 0))
        source = jnp.take_along_axis(order, source, axis=axis)
        return [_positions.take(d, source, axis) for d in datas]

    def same(*datas):  # the masked places hold a copy of the nearest valid element
        edge = jnp.minimum(first, n - 1) if call.reverse else jnp.maximum(count - 1, 0)
        return [jnp.where(valid, d, _positions.take(d, edge, axis)) for d in datas]

    moved = dict(zip(call.elems, (Pair(d, None) for d in jax.lax.cond(in_place, same, general, *datas))))
    return moved, (valid, in_place, first if call.reverse else None, shape, axis)


def scan_results(interp, state, outs):
    """The results of an :func:`associative_scan` call, moved back to the valid elements' places and
    masked where the elements are (or where ``fn`` made a result masked)."""
    valid, in_place, first, shape, axis = state
    n = shape[axis]
    results = []
    for p in outs:
        if jnp.shape(p.data) != shape:
            raise MaskifyError(
                f"maskify({interp.fun_name}): a result of lax.associative_scan has shape "
                f"{jnp.shape(p.data)}, not its elements' {shape}; a scan over masked elements "
                "needs results shaped like them."
            )
        inner = jnp.ones((1,) * len(shape), bool) if p.mask is None else ranked(p.mask, len(shape))

        def general(data, inner):
            rank = jnp.cumsum(valid, axis=axis, dtype=jnp.int32) - 1
            back = jnp.clip(rank + first if first is not None else rank, 0, n - 1)
            return _positions.take(data, back, axis), _positions.take(inner, back, axis)

        def same(data, inner):
            return data, jnp.broadcast_to(inner, _positions.gathered_shape(inner, valid, axis))

        data, inner = jax.lax.cond(in_place, same, general, p.data, inner)
        mask = valid if p.mask is None else valid & inner
        results.append(Pair(fill(data, mask, 0, facts=interp.facts), mask))
    return results


# -- control flow ------------------------------------------------------------------------------
