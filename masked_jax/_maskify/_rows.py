"""Which axis of each value of a jaxpr holds the *rows* of a batch, if every row is computed from
the same row of the inputs alone.

A scan over a batch (``nn.RNN``, a ``vmap``ped scan) whose inputs are masked by whole rows can skip
a padded step with one select per carry, with no masked rule inside the loop, *if* its body never
mixes rows: a valid row's step must not read a padded row (a batch norm over the rows, a softmax
across them would). :func:`row_axes` reads the body once and follows the row axis through each
equation: entrywise operations, shape operations that keep the axis, contractions and reductions
along other axes, gathers from tables indexed by row, calls. Anything else (a reduction over the
rows, a transpose of them into another axis that then mixes them, a loop, an unknown primitive)
answers ``None``: the scan then runs its body through the masked rules.
"""

from __future__ import annotations

import jax.extend.core.primitives as P
import numpy as np
from jax import lax

from masked_jax import _jaxpr
from masked_jax._maskify import _free, _rules

# reductions along some axes, and running ones along one (their axes are told by their params)
REDUCTIONS = frozenset(
    (
        P.reduce_sum_p,
        P.reduce_max_p,
        P.reduce_min_p,
        P.reduce_prod_p,
        P.reduce_and_p,
        P.reduce_or_p,
        P.reduce_xor_p,
        P.argmax_p,
        P.argmin_p,
    )
)
RUNNING = frozenset((P.cumsum_p, P.cumprod_p, P.cummax_p, P.cummin_p, P.cumlogsumexp_p))
_SAME = frozenset((P.copy_p, P.stop_gradient_p, P.reduce_precision_p, lax.optimization_barrier_p))

NONE = None  # a value that does not depend on the rows (a parameter, a constant)


class Mixed(Exception):
    """The jaxpr mixes rows (or does something the analysis does not follow)."""


def row_axes(jaxpr, axes_in, rows, lenient=False):
    """The row axis of each output of ``jaxpr`` given ``axes_in`` (the row axis of each input, or
    ``None``), where the rows are ``rows`` long; ``None`` when some equation mixes rows. With
    ``lenient``, an equation that mixes rows (or that the analysis does not follow) gives values
    with no row axis instead: the layout of each value, whatever its body reads."""
    try:
        return _run(jaxpr, axes_in, rows, lenient)
    except Mixed:
        return None


def scan_axes(body, consts_in, carry_in, xs_in, rows, lenient=False):
    """``(carries' row axes, outputs' row axes)`` of a scan ``body`` whose inputs have the row axes
    ``consts_in``, ``xs_in`` (one step's) and, to begin with, ``carry_in``; ``None`` where the body
    mixes rows (see :func:`row_axes`). A carry's row axis is the one the body gives it, decided
    from the structure (which values it is computed from), not from its size: it is read until
    the carries' axes come back as they went in. A carry that does not settle has none."""
    carry = list(carry_in)
    for _ in range(len(carry) + 2):
        outs = row_axes(body, [*consts_in, *carry, *xs_in], rows, lenient)
        if outs is None:
            return None
        new, ys = list(outs[: len(carry)]), list(outs[len(carry) :])
        if new == carry:
            return carry, ys
        carry = new
    if not lenient:
        return None
    settled = [NONE] * len(carry)
    outs = row_axes(body, [*consts_in, *settled, *xs_in], rows, lenient) or []
    return settled, list(outs[len(carry) :])


def _run(jaxpr, axes_in, rows, lenient=False):
    env = {}

    def read(v):
        return NONE if _jaxpr.is_literal(v) else env.get(v, NONE)

    for v, a in zip(jaxpr.invars, axes_in):
        env[v] = a
    for eqn in jaxpr.eqns:
        ins = [read(v) for v in eqn.invars]
        if all(a is NONE for a in ins):
            outs = [NONE] * len(eqn.outvars)
        else:
            try:
                outs = _equation(eqn, ins, rows, lenient)
            except Mixed:
                if not lenient:
                    raise
                outs = [NONE] * len(eqn.outvars)
        for v, a in zip(eqn.outvars, outs):
            env[v] = a
    return [read(v) for v in jaxpr.outvars]


def _shape(v):
    return tuple(v.aval.shape)


def _equation(eqn, ins, rows, lenient=False):
    prim, params = eqn.primitive, eqn.params
    body = _jaxpr.call_body(eqn)
    if body is not None:
        return _run(body[0], ins, rows, lenient)
    out_shapes = [_shape(v) for v in eqn.outvars]
    if _free.entrywise(prim) or prim in _SAME:
        axes = {a for a in ins if a is not NONE}
        if len(axes) != 1:
            raise Mixed
        (a,) = axes
        if any(len(s) <= a or s[a] != rows for s in out_shapes):
            raise Mixed
        return [a] * len(eqn.outvars)  # (an operand without rows is read entry by entry too)
    (a,) = [x for x in ins if x is not NONE][:1] or [NONE]
    x_in = eqn.invars[ins.index(a)] if a is not NONE else None
    if prim is P.broadcast_in_dim_p:
        return [params["broadcast_dimensions"][a]]
    if prim is P.transpose_p:
        return [list(params["permutation"]).index(a)]
    if prim is P.squeeze_p:
        if a in params["dimensions"]:
            raise Mixed
        return [a - sum(d < a for d in params["dimensions"])]
    if prim is P.reshape_p:
        old, new = _shape(x_in), out_shapes[0]
        before = int(np.prod(old[:a]))
        match = [j for j in range(len(new)) if new[j] == rows and int(np.prod(new[:j])) == before]
        if not match or params.get("dimensions") is not None:
            raise Mixed
        return [match[0]]
    if prim in (P.slice_p, P.rev_p, P.pad_p, P.dynamic_slice_p, P.dynamic_update_slice_p):
        if ins.index(a) != 0 or any(x is not NONE for x in ins[1:]) or out_shapes[0][a] != rows:
            raise Mixed
        if prim is P.rev_p and a in params["dimensions"]:
            raise Mixed
        if prim is P.slice_p and (params["start_indices"][a] != 0 or (params["strides"] or [1] * 99)[a] != 1):
            raise Mixed
        if prim is P.pad_p and tuple(params["padding_config"][a]) != (0, 0, 0):
            raise Mixed
        return [a]
    if prim is P.concatenate_p:
        if params["dimension"] in {x for x in ins if x is not NONE} or len({x for x in ins if x is not NONE}) != 1:
            raise Mixed
        return [a]
    if prim in REDUCTIONS or prim in RUNNING:
        axes = tuple(params["axes"]) if "axes" in params else (params["axis"],)
        if a in axes:
            raise Mixed
        return [a if prim in RUNNING else a - sum(d < a for d in axes)]
    if prim is _rules.SPLIT_P and prim is not None:
        if params["axis"] == a:
            raise Mixed
        return [a] * len(eqn.outvars)
    if prim is P.dot_general_p:
        return [_contraction(params["dimension_numbers"], ins, [_shape(v) for v in eqn.invars])]
    if prim is P.gather_p and ins[0] is NONE:  # a table read at row-wise indices (token ids)
        dn = params["dimension_numbers"]
        if a == len(_shape(eqn.invars[1])) - 1 or dn.operand_batching_dims:
            raise Mixed
        batch = [d for d in range(len(out_shapes[0])) if d not in dn.offset_dims]
        return [batch[a]]
    raise Mixed


def _contraction(dimension_numbers, ins, shapes):
    (lc, rc), (lb, rb) = dimension_numbers
    ra, rb_ = ins
    if ra is not NONE and rb_ is not NONE:  # both have rows: only as a paired batch dim
        if ra not in lb or rb_ not in rb or lb.index(ra) != rb.index(rb_):
            raise Mixed
        return lb.index(ra)
    if ra is not NONE:
        if ra in lc:
            raise Mixed
        if ra in lb:
            return lb.index(ra)
        free = [d for d in range(len(shapes[0])) if d not in lc and d not in lb]
        return len(lb) + free.index(ra)
    if rb_ in rc:
        raise Mixed
    if rb_ in rb:
        return rb.index(rb_)
    lhs_free = len(shapes[0]) - len(lc) - len(lb)
    free = [d for d in range(len(shapes[1])) if d not in rc and d not in rb]
    return len(lb) + lhs_free + free.index(rb_)
