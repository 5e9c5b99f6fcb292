"""*Free* positions: where a masked value holds a constant that no masked input has reached yet.

A constant never makes a masked position valid. In ``where`` a constant fill takes, position by
position, the validity of the masked operand it is combined with. This module carries the same
rule past ``where``, to the places where constants sit *beside* masked data instead of in place of
it:

* **scatters and segment reductions**: a position of a constant buffer (``jnp.zeros`` of a
  ``segment_sum``, the ``-inf`` of a ``segment_max``) that no valid update reached holds the
  buffer's constant: it is *free*;
* **concatenation** (and ``stack``, along a new axis): a piece that carries no mask of its own
  (``ones_like(x)``, a bias column, a parameter) and the free positions of a masked piece take
  the validity of the row's other masked pieces (valid where one of them is valid along the
  joined axis); masked pieces joined along their free positions' axis (a roll of a segment
  result) keep them;
* **entrywise operations**: a free position combined with a masked operand's non-free position
  takes that operand's validity (the masks' ``and``: a free position's mask is ``True``); combined
  with plain operands (constants, parameters: they say nothing about padding) or with other free
  positions, it stays free;
* **a contraction with a plain operand** (a dense layer ``agg @ W``) maps each row by itself: an
  output whose terms are all free is free; otherwise it is valid where a non-free term is;
* moved by shape operations (reshapes, also those that split or merge the free axis, transposes,
  broadcasts, slices), casts and gathers with the data.

Anywhere else (a reduction, a sort, a softmax, a loop carry, an output of the function) a free
position is *resolved* (:func:`resolved`): a scatter's free slot is valid where the entry of its
ids' space is valid (a real node no valid edge reached, see :mod:`masked_jax._maskify._spaces`)
and masked where it is padding or where no array of the space is in sight. So ``h +
segment_sum(...)``, ``concat([h, agg]) @ W`` and ``h @ W1 + agg @ W2`` are valid exactly where
``h`` is, isolated nodes included, and ``segment_sum(...) + b`` is valid at the valid nodes of an
array the same ids gather from.

Free positions are free *along axes*: the axes their operation made them along (a segment
reduction's segment axis, a concatenation's joined axis). Only a masked operand whose mask varies
along those axes speaks for them: ``h + agg`` with a per-node mask anchors ``agg``'s free nodes,
while ``agg - mean(agg)`` (the mean does not vary along the nodes) leaves them free, as they are
in the run on the unpadded graph, where those nodes do not exist.

A free table maps a value to a :class:`Free`; a value with no free position has no entry. Every
free position of a value is valid in its mask.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax.extend.core.primitives as P
import jax.numpy as jnp
import numpy as np
from jax import lax

from masked_jax._maskify import _rules
from masked_jax._maskify._spaces import Spaces, slots
from masked_jax._validate import is_tracer
from masked_jax.ops._base import Pair, fill, materialize, ranked
from masked_jax.ops._registry import REGISTRY

# shape operations of one array operand (the others, if any, are sizes or start indices)
_MOVES = frozenset(
    (
        P.reshape_p,
        P.transpose_p,
        P.broadcast_in_dim_p,
        P.squeeze_p,
        P.rev_p,
        P.slice_p,
        P.dynamic_slice_p,
        P.copy_p,
        P.convert_element_type_p,
        lax.optimization_barrier_p,
    )
)


class Free(NamedTuple):
    """The free positions of a value: ``where`` (bool, at the data's shape) and the ``axes`` they
    were made along; ``space``: the id space of a scatter's free slots (``(ids, layout sizes)``,
    see :mod:`masked_jax._maskify._spaces`) and ``slot``: each free position's flat index into
    that space's layout (int, broadcast like ``where``), or ``None``."""

    where: Any
    axes: frozenset
    space: Any = None
    slot: Any = None


def entrywise(prim) -> bool:
    """Does ``prim`` compute each output position from the same position of its operands?"""
    owner = _rules.OWNER.get(prim)
    return (owner is not None and REGISTRY[owner].family in ("elementwise", "binary")) or prim in (
        P.select_n_p,
        P.clamp_p,
    )


def makes_free(prim) -> bool:
    """Can ``prim`` put constants beside masked data (and so make free positions)?"""
    return prim is P.concatenate_p or (prim is _rules.STACK_P and prim is not None) or prim in _rules.SCATTERS


def keeps_free(prim) -> bool:
    """Does ``prim`` carry free positions through (see the module docstring)?"""
    return entrywise(prim) or prim in _MOVES or prim in (P.dot_general_p, P.gather_p) or makes_free(prim)


def carried(prim, n: int) -> range:
    """The operands of ``prim`` (of ``n``) whose free positions it carries: a shape operation's or
    a gather's array, not its indices."""
    return range(1) if prim in _MOVES or prim is P.gather_p else range(n)


def resolved(p: Pair, free: Free | None, spaces: Spaces | None = None) -> Pair:
    """``p`` as every other operation reads it: a free position is valid where its id space's
    entry is (a real node no valid edge reached), else masked (no array of the space in sight)."""
    if free is None:
        return p
    n = np.ndim(p.data)
    gone = ranked(free.where, n)
    anchor = None if spaces is None or free.space is None or free.slot is None else spaces.anchor(free.space)
    if anchor is not None:
        slot = ranked(free.slot, n)
        valid = jnp.take(anchor, jnp.clip(slot, 0, anchor.shape[0] - 1)) & (slot >= 0)
        gone = gone & ~valid
    return Pair(p.data, ranked(p.mask, n) & ~gone)


def _settled(where, axes, mask, shape, space=None, slot=None) -> Free | None:
    """The free table entry of a result: ``None`` when no position is free; only valid positions
    are free."""
    if where is None or not axes or (not is_tracer(where) and not np.any(where)):
        return None
    n = len(shape)
    where = ranked(jnp.asarray(where), n) & ranked(mask, n)  # (compact)
    if space is None or slot is None:
        return Free(where, frozenset(axes))
    return Free(where, frozenset(axes), space, ranked(jnp.asarray(slot), n))


def _space_of(frees):
    """The space and slots of the free positions shared by ``frees`` (each free position of the
    result is free in every one of them): the first one's that has a space."""
    for f in frees:
        if f is not None and f.space is not None and f.slot is not None:
            return f.space, f.slot
    return None, None


def _speaks(p: Pair, axes, shape) -> bool:
    """Does the masked operand ``p``'s (compact) mask vary along every axis of ``axes`` of the
    result's ``shape`` (an operand broadcast along one, such as a mean over it, does not)?"""
    m = ranked(p.mask, len(shape))
    return all(np.shape(m)[a] == shape[a] for a in axes)


def _moved_axes(prim, params, axes, in_shape, out_shape):
    """``axes`` of the operand of the shape operation ``prim`` as axes of its result."""
    if prim is P.transpose_p:
        return {i for i, d in enumerate(params["permutation"]) if d in axes}
    if prim is P.broadcast_in_dim_p:
        return {params["broadcast_dimensions"][d] for d in axes}
    if prim is P.squeeze_p:
        kept = [d for d in range(len(in_shape)) if d not in params["dimensions"]]
        return {kept.index(d) for d in axes if d in kept}
    if prim is P.reshape_p:  # an axis goes to the axes it is split into or merged with
        before = np.cumprod((1, *in_shape))
        after = np.cumprod((1, *out_shape))
        return {
            j
            for d in axes
            for j in range(len(out_shape))
            if max(before[d], after[j]) < min(before[d + 1], after[j + 1])
        }
    return set(axes)  # slices, reversal, copies, casts keep the axes


# the dims of a gather's result: its indices' batch dims and the slices' (offset) dims
def _gathered_axes(dn, axes, x_ndim, out_ndim):
    batch = [i for i in range(out_ndim) if i not in dn.offset_dims]
    kept = [d for d in range(x_ndim) if d not in dn.collapsed_slice_dims and d not in dn.operand_batching_dims]
    out = set()
    for a in axes:
        if a in kept:
            out.add(dn.offset_dims[kept.index(a)])
        if a in dn.start_index_map:  # free where the ids reach a free slot: along the ids' own dims
            out.update(b for k, b in enumerate(batch) if k not in dn.start_indices_batching_dims)
        if a in dn.operand_batching_dims:
            out.add(batch[dn.start_indices_batching_dims[list(dn.operand_batching_dims).index(a)]])
    return out


def _gather(params, x_shape, free, idx, out):
    """The free positions of ``x[idx]`` (a gather of ``x``, with ``free``): each gathered position
    keeps the freedom and the slot of the position it reads."""
    dn = params["dimension_numbers"]
    mode = params["mode"]
    if mode == lax.GatherScatterMode.PROMISE_IN_BOUNDS:
        mode = lax.GatherScatterMode.FILL_OR_DROP  # (a masked index's junk reads nothing)
    bound = {**params, "mode": mode}
    where = P.gather_p.bind(jnp.broadcast_to(free.where, x_shape), idx, **{**bound, "fill_value": False})
    slot = None
    if free.slot is not None:
        slot = P.gather_p.bind(jnp.broadcast_to(free.slot, x_shape), idx, **{**bound, "fill_value": -1})
    axes = _gathered_axes(dn, free.axes, len(x_shape), np.ndim(out.data)) or set(range(np.ndim(out.data)))
    return _settled(where, axes, out.mask, jnp.shape(out.data), free.space, slot)


_SAME_VALUES = (P.convert_element_type_p, P.copy_p, lax.optimization_barrier_p)  # values kept in place


def after(prim, params, invals, frees, out: Pair) -> Free | None:
    """The free positions of ``out`` (``prim``'s masked result) for an entrywise, shape or gather
    operation, or ``None``. ``frees``: each operand's free table entry."""
    shape = jnp.shape(out.data)
    if prim is P.gather_p:
        x, idx = invals
        return None if frees[0] is None else _gather(params, jnp.shape(x.data), frees[0], idx.data, out)
    if prim in _MOVES:
        x, *rest = invals
        f = frees[0]
        if f is None:
            return None
        # (axes that cannot be followed: free along every axis, which no masked operand speaks for)
        axes = _moved_axes(prim, params, f.axes, jnp.shape(x.data), shape) or set(range(len(shape)))
        if prim in _SAME_VALUES:  # a cast moves nothing
            return _settled(f.where, axes, out.mask, shape, f.space, f.slot)

        def moved(a):
            return prim.bind(jnp.broadcast_to(a, jnp.shape(x.data)), *(r.data for r in rest), **params)

        slot = None if f.slot is None else moved(f.slot)
        return _settled(moved(f.where), axes, out.mask, shape, f.space, slot)
    # entrywise: free where every free operand is, unless a masked operand speaks for the free
    # positions (its mask varies along their axes); plain operands (constants, parameters) say
    # nothing about padding
    where, axes = None, set()
    for f in frees:
        if f is not None:
            where = f.where if where is None else where & f.where
            axes |= f.axes
    if any(p.mask is not None and f is None and _speaks(p, axes, shape) for p, f in zip(invals, frees)):
        return None
    return _settled(where, axes, out.mask, shape, *_space_of(frees))


def _along(invals, frees, dimension):
    """``concatenate`` along an axis that some pieces' free positions were made along (a roll of a
    segment result, segment results joined end to end): every piece masked, the free positions
    and their slots go with the data."""
    shapes = [jnp.shape(p.data) for p in invals]
    data = lax.concatenate([p.data for p in invals], dimension)
    n = len(shapes[0])
    mask = lax.concatenate([materialize(ranked(p.mask, n), s) for p, s in zip(invals, shapes)], dimension)
    where = lax.concatenate(
        [jnp.zeros(s, bool) if f is None else jnp.broadcast_to(f.where, s) for f, s in zip(frees, shapes)], dimension
    )
    space, _ = _space_of(frees)
    slot = None
    if space is not None:
        slot = lax.concatenate(
            [
                jnp.full(s, -1, jnp.int32) if f is None or f.slot is None else jnp.broadcast_to(f.slot, s)
                for f, s in zip(frees, shapes)
            ],
            dimension,
        )
    axes = set().union(*(f.axes for f in frees if f is not None))
    return Pair(data, mask), _settled(where, axes, mask, jnp.shape(data), space, slot)


def concatenate(invals, frees, dimension):
    """``concatenate`` with free positions and pieces with no mask of their own, which take the
    validity of the row's other masked pieces: ``(Pair, free, blocks)``. ``blocks``: when every
    piece's masks are uniform along the joined axis (whole rows: a token mask, a node mask), each
    piece's resolved ``(mask, free)`` at a compact shape (1 along the axis), which a contraction
    along that axis reads block by block (:func:`block_contraction`); else ``None``."""
    if all(p.mask is not None for p in invals) and any(f is not None and dimension in f.axes for f in frees):
        return (*_along(invals, frees, dimension), None)
    shapes = [jnp.shape(p.data) for p in invals]
    n = len(shapes[0])
    data = lax.concatenate([p.data for p in invals], dimension)
    out_shape = jnp.shape(data)
    # per piece, compact: is a position anchored (masked, or valid and not free), and valid
    anchored, valid, axes = [], [], set()
    for p, f in zip(invals, frees):
        if p.mask is None:
            anchored.append(jnp.zeros((1,) * n, bool))
            valid.append(jnp.zeros((1,) * n, bool))
            continue
        m = ranked(p.mask, n)
        a = jnp.ones((1,) * n, bool) if f is None else ~ranked(f.where, n)
        axes |= set() if f is None else f.axes
        anchored.append(a)
        valid.append(m & a)
    uniform = all(np.shape(x)[dimension] == 1 for x in anchored + valid)
    if uniform:  # the rows' anchoring and validity, compact
        row_anchored = functools.reduce(jnp.logical_or, anchored)
        row_valid = functools.reduce(jnp.logical_or, valid)
    else:
        full = [jnp.broadcast_to(x, s) for x, s in zip(anchored, shapes)]
        row_anchored = jnp.any(lax.concatenate(full, dimension), axis=dimension, keepdims=True)
        full = [jnp.broadcast_to(x, s) for x, s in zip(valid, shapes)]
        row_valid = jnp.any(lax.concatenate(full, dimension), axis=dimension, keepdims=True)
    rest = jnp.where(row_anchored, row_valid, True)  # what a free or plain position takes
    blocks = [(jnp.where(a, v, rest), ~a & ~row_anchored) for a, v in zip(anchored, valid)]
    joint = np.broadcast_shapes(
        *(np.shape(b)[:dimension] + (1,) + np.shape(b)[dimension + 1 :] for bm in blocks for b in bm)
    )
    pieces = []
    for (bm, bf), s in zip(blocks, shapes):
        size = [*joint]
        size[dimension] = s[dimension]
        pieces.append((jnp.broadcast_to(bm, size), jnp.broadcast_to(bf, size)))
    mask = lax.concatenate([bm for bm, _ in pieces], dimension)
    # a row's free positions (its free pieces' and its plain ones') stand for its free pieces' slot
    space, _ = _space_of(frees)
    slot = None
    if space is not None:
        row_slot = functools.reduce(
            jnp.maximum,
            [
                jnp.max(jnp.where(ranked(f.where, n), ranked(f.slot, n), -1), axis=dimension, keepdims=True)
                for f in frees
                if f is not None and f.slot is not None
            ],
        )
        at = [np.shape(row_slot)[:dimension] + (s[dimension],) + np.shape(row_slot)[dimension + 1 :] for s in shapes]
        slot = lax.concatenate([jnp.broadcast_to(row_slot, a) for a in at], dimension)
    free = _settled(lax.concatenate([bf for _, bf in pieces], dimension), axes, mask, out_shape, space, slot)
    return Pair(data, mask), free, (blocks if uniform else None)


def stack(invals, frees, axis):
    """``stack``: the pieces given a new axis, then :func:`concatenate` along it (a constant piece
    next to a masked one takes the row's validity, as in a concatenation): ``(the pieces, Pair,
    free, blocks)``."""
    pieces, piece_frees = [], []
    for p, f in zip(invals, frees):
        n = np.ndim(p.data)
        data = jnp.expand_dims(p.data, axis)
        mask = None if p.mask is None else jnp.expand_dims(ranked(p.mask, n), axis)
        pieces.append(Pair(data, mask))
        if f is None:
            piece_frees.append(None)
            continue
        moved = frozenset(a + (a >= axis) for a in f.axes)
        slot = None if f.slot is None else jnp.expand_dims(ranked(f.slot, n), axis)
        piece_frees.append(Free(jnp.expand_dims(ranked(f.where, n), axis), moved, f.space, slot))
    return (pieces, *concatenate(pieces, piece_frees, axis))


def _laid_out(indicator, contracted, batch, kept, lhs, lhs_free, rhs_free, reduce=jnp.any):
    """``reduce`` (``any``) of an operand's (compact) ``indicator`` along its ``contracted`` dims,
    laid out as a ``dot_general``'s output dims (batch, the lhs's free dims, the rhs's free dims);
    ``lhs``: the operand is the lhs."""
    n = np.ndim(indicator)
    v = reduce(indicator, axis=tuple(contracted)) if contracted else indicator
    rest = [d for d in range(n) if d not in contracted]
    v = jnp.transpose(v, [rest.index(d) for d in [*batch, *kept]])
    shape = np.shape(v)
    if lhs:
        return jnp.reshape(v, shape + (1,) * rhs_free)
    return jnp.reshape(v, shape[: len(batch)] + (1,) * lhs_free + shape[len(batch) :])


def _layout(params, a, b, masked_is_lhs, n):
    (lc, rc), (lb, rb) = params["dimension_numbers"]
    contracted, batch = (lc, lb) if masked_is_lhs else (rc, rb)
    kept = [d for d in range(n) if d not in contracted and d not in batch]
    lhs_free = np.ndim(a.data) - len(lc) - len(lb)
    rhs_free = np.ndim(b.data) - len(rc) - len(rb)
    return contracted, batch, kept, lhs_free, rhs_free


def _out_axes(free_axes, params, a, masked_is_lhs, contracted, batch, kept, lhs_free):
    offset = len(params["dimension_numbers"][1][0]) + (0 if masked_is_lhs else lhs_free)
    return {list(batch).index(d) if d in batch else offset + kept.index(d) for d in free_axes if d not in contracted}


def _slot_out(free, n, layout):
    """A free operand's slots laid out as a contraction's output (the slot of a row's free terms)."""
    if free is None or free.slot is None:
        return None
    return _laid_out(jnp.where(ranked(free.where, n), ranked(free.slot, n), -1), *layout, reduce=jnp.max)


def contraction(prim, params, invals, frees):
    """``dot_general`` of a masked operand holding free positions with a plain one: ``(Pair,
    free)``, or ``None`` when both are masked (the free positions are then masked). An output is
    free where all its terms are, else valid where a term that is not free is valid; both are
    ``any`` of the masked operand's compact masks along the contracted dims."""
    (a, b), (fa, fb) = invals, frees
    if (a.mask is None) == (b.mask is None):
        return None
    masked, free = (a, fa) if b.mask is None else (b, fb)
    if free is None:
        return None
    n = np.ndim(masked.data)
    m, where = ranked(masked.mask, n), ranked(free.where, n)
    data = fill(masked.data, m, 0)
    out = prim.bind(data, b.data, **params) if masked is a else prim.bind(a.data, data, **params)
    contracted, batch, kept, lhs_free, rhs_free = _layout(params, a, b, masked is a, n)
    layout = (contracted, batch, kept, masked is a, lhs_free, rhs_free)
    all_free = ~_laid_out(~where, *layout)
    mask = _laid_out(m & ~where, *layout) | all_free
    axes = _out_axes(free.axes, params, a, masked is a, contracted, batch, kept, lhs_free)
    return Pair(out, mask), _settled(all_free, axes, mask, jnp.shape(out), free.space, _slot_out(free, n, layout))


def block_contraction(prim, params, invals, side, pieces, blocks, dimension, joined):
    """``dot_general`` along the joined axis of a concatenation of whole-row pieces (see
    :func:`concatenate`; ``joined``: its free positions) with a plain operand, block by block:
    each piece contracted with its slice of the other operand, its masked rows' terms dropped by
    one select, the blocks summed. The same values and masks as the concatenation contracted (an
    output is valid where a valid piece's row reaches it, free where every piece's row is free),
    with no mask varying along the contraction: ``(Pair, free)``, or ``None`` when the
    contraction is not along that axis alone."""
    a, b = invals
    other = b if side == 0 else a
    (lc, rc), _ = params["dimension_numbers"]
    mine, theirs = (lc, rc) if side == 0 else (rc, lc)
    if other.mask is not None or tuple(mine) != (dimension,):
        return None
    n = np.ndim((a if side == 0 else b).data)
    contracted, batch, kept, lhs_free, rhs_free = _layout(params, a, b, side == 0, n)
    layout = (contracted, batch, kept, side == 0, lhs_free, rhs_free)
    outs, valids, frees = [], [], []
    offset = 0
    for p, (bm, bf) in zip(pieces, blocks):
        size = jnp.shape(p.data)[dimension]
        w = lax.slice_in_dim(other.data, offset, offset + size, axis=theirs[0])
        offset += size
        d = fill(p.data, bm, 0)
        o = prim.bind(d, w, **params) if side == 0 else prim.bind(w, d, **params)
        v = _laid_out(bm & ~bf, *layout)
        fr = _laid_out(bf, *layout)
        outs.append(jnp.where(v | fr, o, jnp.zeros((), o.dtype)))
        valids.append(v)
        frees.append(fr)
    out = functools.reduce(jnp.add, outs)
    all_free = functools.reduce(jnp.logical_and, frees)
    mask = functools.reduce(jnp.logical_or, valids) | all_free
    axes = set() if joined is None else joined.axes
    axes = _out_axes(axes, params, a, side == 0, contracted, batch, kept, lhs_free)
    space = None if joined is None else joined.space
    return Pair(out, mask), _settled(all_free, axes, mask, jnp.shape(out), space, _slot_out(joined, n, layout))


def scatter(prim, params, invals, frees, buffer_is_constant, ids=None):
    """A scatter as a masked reduction (:func:`masked_jax._maskify._rules.scatter`) with the free
    positions of its result, free along the dims the indices address: ``(Pair, free)``. A free
    slot of a constant buffer belongs to the space of ``ids`` (the scatter's ids, see
    :mod:`masked_jax._maskify._spaces`); one of a buffer with free positions keeps its own."""
    fs = [None if f is None else f.where for f in frees]
    out, where = _rules.scatter(prim, params, invals, fs, buffer_is_constant)
    dn = params["dimension_numbers"]
    axes = set(dn.scatter_dims_to_operand_dims)
    for f in frees:
        axes |= set() if f is None else f.axes
    space = slot = None
    fx, _, fu = frees
    if fx is not None:
        space, slot = fx.space, fx.slot
    elif ids is not None and (fu is None or _rules.SCATTERS[prim] is not None):
        laid = slots(dn, jnp.shape(out.data), np.shape(where))
        if laid is not None:
            space, slot = (ids, laid[0]), laid[1]
    return out, _settled(where, axes, out.mask, jnp.shape(out.data), space, slot)
