"""Where padding lives: the coordinates of every axis of every value of a jaxpr, read statically.

A masked input whose mask varies along a *token axis* (a ``(B, L, 1)`` mask of ``(B, L, D)``
activations, an ``(L, 1)`` mask of one sequence) has a ragged axis: the example it stands for has
only its valid tokens there. Every position the program builds along such an axis means what it
means in that unpadded example. This module follows, equation by equation and without running
anything, which axis of which value is such an axis and in which coordinates its entries sit:

* ``Ragged(space, "P")``: *padded* coordinates. The entries sit where the input put them; the
  valid ones, in order, are the unpadded example's. Elementwise functions, dense layers,
  reductions along other axes, scans (which skip padded steps), cumulative ops and
  concatenations and pads (whose constants are new valid entries) keep them.
* ``Ragged(space, "U")``: *unpadded* coordinates. Entry ``j`` is the unpadded example's entry
  ``j``; the valid entries come first. Slices, reversals, static indices, sorts and windows that
  change the axis's length give these.
* ``BUILT``: positions the program made itself (``jnp.arange``, a table read at them, a slice
  of a plain array): ``pos_emb[jnp.arange(L)]`` holds, at entry ``j``, the embedding of position
  ``j`` of the unpadded example, so it is in unpadded coordinates too.
* ``ROWS``: the batch axis of a masked input (each example has its own valid entries).
* ``None``: nothing positional (features, plain inputs: arrays the user passes in are in padded
  coordinates, as given).

``space`` names the ragged axis of a masked input: ``(input index, axis)``. The interpreter reads
these coordinates where two values meet along a ragged axis (an unpadded-coordinate operand
is moved to padded coordinates, entry ``j`` to the ``j``-th valid place) and where a positional
construct acts on one (it acts in unpadded coordinates). :class:`Info` also says whether a value's
entries are *numbers the program built* (``number``: an ``arange``, a literal, an ``argsort``; used
as indices into a ragged axis they count valid entries) and whether a boolean is an *order
comparison* of built positions (``order``: ``tril``'s mask, which ranks leave as it is).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax.extend.core.primitives as P
import numpy as np
from jax import lax

from masked_jax import _jaxpr
from masked_jax._maskify import _rules
from masked_jax._maskify._rows import REDUCTIONS, RUNNING
from masked_jax._maskify._scan import associative_scans


class Ragged(NamedTuple):
    """A ragged axis: ``space`` (``(input index, input axis)``), ``layout`` ``"P"`` or ``"U"``."""

    space: tuple
    layout: str


BUILT = "built"  # positions the program made: unpadded coordinates
ROWS = "rows"  # the batch axis of a masked input: examples, each with its own ragged axis


class Info(NamedTuple):
    """What is known of one value: ``axes`` (a tag per axis: :class:`Ragged`, :data:`BUILT` or
    ``None``), ``number`` (its entries are numbers the program built: positions counted among
    valid entries), ``order`` (a boolean made by comparing built positions only), ``masked``
    (it depends on a masked input)."""

    axes: tuple
    number: bool = False
    order: bool = False
    masked: bool = False
    pad: tuple | None = None  # per axis, the (lo, hi) of a pad that made this value, or None
    position: bool = False  # an ``arange``'s values as they are (moved, converted, plus 0)
    # plain, and computed over every entry of an axis built as long as a token axis (a sum or a
    # segment count over ``arange(L)``): its value depends on the padded length
    spans: bool = False


def plain(ndim: int, number: bool = False) -> Info:
    return Info((None,) * ndim, number=number)


def input_info(mask_shape, ndim: int, index: int) -> Info:
    """The coordinates of a masked input with a mask of compact shape ``mask_shape``: the axes its
    mask varies along are the batch axis (the first, when there are two) and the token axis (the
    other, or the only one); a mask that varies along three or more axes masks entries, not
    tokens, and has no ragged axis."""
    shape = (1,) * (ndim - len(mask_shape)) + tuple(mask_shape)
    varying = [i for i, n in enumerate(shape) if n != 1]
    axes: list[Any] = [None] * ndim
    if len(varying) in (1, 2):
        token = varying[-1]
        axes[token] = Ragged((index, token), "P")
        if len(varying) == 2:
            axes[varying[0]] = ROWS
    return Info(tuple(axes), masked=True)


def ragged_axis(mask_shape, ndim: int) -> int | None:
    """The token axis :func:`input_info` finds, or ``None``."""
    tags = input_info(mask_shape, ndim, 0).axes
    return next((i for i, t in enumerate(tags) if isinstance(t, Ragged)), None)


def is_ragged(tag) -> bool:
    return isinstance(tag, Ragged)


# -- how each primitive maps its operands' axes to its results' -------------------------------------
_ENTRYWISE_EXTRA = frozenset(
    (
        P.select_n_p,
        P.clamp_p,
        P.convert_element_type_p,
        P.copy_p,
        P.copy_p,
        P.stop_gradient_p if hasattr(P, "stop_gradient_p") else P.copy_p,
        P.reduce_precision_p,
        lax.optimization_barrier_p,
        P.integer_pow_p,
        P.is_finite_p,
        P.not_p,
        P.and_p,
        P.or_p,
        P.xor_p,
        P.eq_p,
        P.ne_p,
        P.lt_p,
        P.le_p,
        P.gt_p,
        P.ge_p,
        P.add_p,
        P.sub_p,
        P.mul_p,
        P.div_p,
        P.rem_p,
        P.max_p,
        P.min_p,
        P.neg_p,
        P.sign_p,
        P.abs_p,
        P.floor_p,
        P.ceil_p,
        P.round_p,
        P.shift_left_p,
        P.shift_right_logical_p,
        P.shift_right_arithmetic_p,
        P.pow_p,
    )
)
_COMPARISONS = frozenset((P.lt_p, P.le_p, P.gt_p, P.ge_p, P.eq_p, P.ne_p))
_LOGIC = frozenset((P.and_p, P.or_p, P.not_p, P.xor_p, P.select_n_p))
_NUMERIC = frozenset(
    (P.add_p, P.sub_p, P.mul_p, P.neg_p, P.max_p, P.min_p, P.clamp_p, P.convert_element_type_p, P.select_n_p)
) | frozenset((P.div_p, P.rem_p, P.abs_p, P.sign_p, P.copy_p, P.floor_p, P.ceil_p, P.round_p))
WINDOWS = frozenset((P.conv_general_dilated_p, P.reduce_window_sum_p, P.reduce_window_max_p, P.reduce_window_min_p))


def entrywise(prim) -> bool:
    from masked_jax._maskify import _free  # (no cycle: _free does not import this module)

    return prim in _ENTRYWISE_EXTRA or _free.entrywise(prim)


def merge(tags) -> Any:
    """The tag of an axis where operands with ``tags`` meet entrywise: padded coordinates win (the
    others are moved to them), then unpadded ones, then built positions."""
    ragged = [t for t in tags if isinstance(t, Ragged)]
    if any(t.layout == "P" for t in ragged):
        return next(t for t in ragged if t.layout == "P")
    if ragged:
        return ragged[0]
    return BUILT if BUILT in tags else ROWS if ROWS in tags else None


def _is_zero(v) -> bool:
    return _jaxpr.is_literal(v) and np.ndim(v.val) == 0 and v.val == 0


def _positional(info: Info) -> bool:
    """Whether a value varies with positions (an axis of built or unpadded coordinates)."""
    return any(t is BUILT or (isinstance(t, Ragged) and t.layout == "U") for t in info.axes)


def _shape(v):
    return tuple(getattr(v.aval, "shape", ()))


def _reshape_axes(tags, old, new):
    """``tags`` of a value of shape ``old`` reshaped to ``new``: an axis keeps its tag where the sizes
    before it and its own size survive as one axis."""
    out: list[Any] = [None] * len(new)
    for d, t in enumerate(tags):
        if t is None:
            continue
        before = int(np.prod(old[:d], dtype=np.int64))
        for j in range(len(new)):
            if new[j] == old[d] and int(np.prod(new[:j], dtype=np.int64)) == before:
                out[j] = t
                break
    return tuple(out)


def _tagged(t, size):
    """A tag kept only along an axis longer than 1 (a size-1 axis broadcasts: nothing positional)."""
    return t if size != 1 else None


def analyse(jaxpr, ins: list[Info | None], literal=frozenset(), tied=None, prefix=()) -> dict:
    """``{variable: Info}`` for every variable of ``jaxpr`` given its inputs' (``None``: plain, given).
    ``literal``: input variables computed from literals by the caller (numbers the program built).
    ``tied(path)``: how the shape of the equation at ``path`` (``prefix`` plus its index) moves when
    the token axes are one longer (see :class:`masked_jax._maskify._positions.Relativity`): an
    ``arange`` as long as a token axis is that axis in unpadded coordinates."""
    env: dict = {}
    for v, info in zip(jaxpr.invars, ins):
        env[v] = info if info is not None else plain(len(_shape(v)), number=v in literal)
    for v in jaxpr.constvars:
        env[v] = plain(len(_shape(v)))

    def read(v):
        if _jaxpr.is_literal(v):
            return plain(np.ndim(v.val), number=True)
        return env.get(v) or plain(len(_shape(v)))

    ends = {call.stop - 1: call for call in associative_scans(jaxpr).values()}
    for i, eqn in enumerate(jaxpr.eqns):
        outs = equation(eqn, [read(v) for v in eqn.invars], tied, prefix + (i,))
        for v, o in zip(eqn.outvars, outs):
            env[v] = o
        if i in ends:  # a lax.associative_scan call runs on its elements where they stand
            _scan_results(ends[i], env, read)
    return env


def _scan_results(call, env, read):
    """The results of a ``lax.associative_scan`` ``call`` share its elements' coordinates (its
    levels' strided slices do not move them: see ``_recognise.associative_scan``)."""
    elems = [read(v) for v in call.elems]
    for v in call.outputs:
        same = [e for e in elems if len(e.axes) == len(_shape(v))]
        if same:
            axes = tuple(merge(list(tags)) for tags in zip(*(e.axes for e in same)))
            env[v] = Info(axes, masked=any(e.masked for e in same))


def _shift(tied, path, k, length):
    """Whether the ``k``-th static position of the equation at ``path``, along an axis of ``length``,
    moved with the token axes (1) or not (0; also when unknown)."""
    s = tied.flags(path, length) if tied is not None else None
    return 0 if s is None or k >= np.size(s) else int(np.ravel(s)[k])


def _tied(t) -> bool:
    return isinstance(t, Ragged) and t.layout == "U" and t.space[0] == "length"


_SPANNING = REDUCTIONS | frozenset(_rules.SCATTERS) | {P.dot_general_p, P.sort_p}


def equation(eqn, ins: list[Info], tied=None, path=()) -> list[Info]:
    """The :class:`Info` of each result of ``eqn`` from its operands' (``tied``, ``path``: see
    :func:`analyse`)."""
    outs = _equation(eqn, ins, tied, path)
    if _jaxpr.call_body(eqn) is not None:  # (the call's own equations tell)
        return outs
    spans = any(i.spans for i in ins)
    if not spans and eqn.primitive in _SPANNING and not any(i.masked for i in ins):
        before = {t.space for i in ins for t in i.axes if _tied(t)}
        after = {t.space for o in outs for t in o.axes if _tied(t)}
        spans = bool(before - after) or (eqn.primitive is P.sort_p and bool(before))
    return [o._replace(spans=True) for o in outs] if spans else outs


def _equation(eqn, ins: list[Info], tied=None, path=()) -> list[Info]:
    prim, params = eqn.primitive, eqn.params
    out_shapes = [_shape(v) for v in eqn.outvars]
    in_shapes = [_shape(v) if not _jaxpr.is_literal(v) else np.shape(v.val) for v in eqn.invars]
    masked = any(i.masked for i in ins)
    body = _jaxpr.call_body(eqn)
    if body is not None:
        subs = list(_jaxpr.nested_jaxprs(params.values()))
        sub = next((j for j, b in enumerate(subs) if b is body[0]), 0)
        inner = analyse(body[0], list(ins), tied=tied, prefix=path + (sub,))
        return [
            inner.get(v, plain(len(s))) if not _jaxpr.is_literal(v) else plain(len(s), True)
            for v, s in zip(body[0].outvars, out_shapes)
        ]
    if prim is P.iota_p:
        (shape,) = out_shapes
        d = params["dimension"]
        tag = Ragged(("length", shape[d]), "U") if _shift(tied, path, d, shape[d]) == 1 else BUILT
        built = tuple(tag if i == d and shape[i] != 1 else None for i in range(len(shape)))
        return [Info(built, number=True, position=True)]
    if prim in (P.convert_element_type_p, P.copy_p):
        return [ins[0]._replace(order=False)]
    if prim in (P.add_p, P.sub_p) and any(_is_zero(v) for v in eqn.invars[1 if prim is P.sub_p else 0 :]):
        (k,) = [j for j, v in enumerate(eqn.invars) if not _is_zero(v)] or [0]
        if ins[k].position and len(ins[k].axes) == len(out_shapes[0]):
            return [ins[k]]
    if entrywise(prim):
        (shape,) = out_shapes[:1]
        axes = []
        for i, n in enumerate(shape):
            tags = [info.axes[i] for info, s in zip(ins, in_shapes) if len(s) == len(shape) and s[i] == n]
            axes.append(_tagged(merge(tags), n))
        cases = ins[1:] if prim is P.select_n_p else ins
        number = all(i.number for i in cases) and prim in _NUMERIC
        order = (prim in _COMPARISONS and all(i.position for i in ins) and not masked) or (
            prim in _LOGIC and any(i.order for i in ins) and all(i.order or not _positional(i) for i in ins)
        )
        return [Info(tuple(axes), number=number, order=order, masked=masked)] * len(out_shapes)
    x = ins[0] if ins else plain(0)
    if prim is P.broadcast_in_dim_p:
        axes: list[Any] = [None] * len(out_shapes[0])
        for j, d in enumerate(params["broadcast_dimensions"]):
            axes[d] = _tagged(x.axes[j], in_shapes[0][j])
        return [x._replace(axes=tuple(axes))]
    if prim is P.reshape_p:
        return [x._replace(axes=_reshape_axes(x.axes, in_shapes[0], out_shapes[0]))]
    if prim is P.transpose_p:
        return [x._replace(axes=tuple(x.axes[p] for p in params["permutation"]))]
    if prim is P.squeeze_p:
        return [x._replace(axes=tuple(t for i, t in enumerate(x.axes) if i not in params["dimensions"]))]
    if prim in REDUCTIONS:
        reduced = tuple(params["axes"])
        kept = tuple(t for i, t in enumerate(x.axes) if i not in reduced)
        number = prim in (P.argmax_p, P.argmin_p) and any(is_ragged(x.axes[a]) for a in reduced)
        return [Info(kept, number=number or (x.number and prim is not P.reduce_sum_p), masked=masked)]
    if prim in RUNNING:
        return [x._replace(order=False)]
    if prim is P.rev_p:
        return [x]
    if prim is P.slice_p:
        axes = list(x.axes)
        for d, (s, e) in enumerate(zip(params["start_indices"], params["limit_indices"])):
            stride = (params["strides"] or (1,) * len(axes))[d]
            whole = s == 0 and e == in_shapes[0][d] and stride == 1
            if whole:
                continue
            t = axes[d]
            if isinstance(t, Ragged):
                axes[d] = _tagged(Ragged(t.space, "U"), out_shapes[0][d])
            elif not x.masked and in_shapes[0][d] != 1:
                n = in_shapes[0][d]
                tie = _shift(tied, path, len(axes) + d, n) == 1 and _shift(tied, path, d, n) == 0
                tag = Ragged(("length", out_shapes[0][d]), "U") if tie else BUILT
                axes[d] = _tagged(tag, out_shapes[0][d])
        return [x._replace(axes=tuple(axes), order=False)]
    if prim is P.dynamic_slice_p:
        idx = ins[1:]
        axes = list(x.axes)
        for d, (size, i) in enumerate(zip(params["slice_sizes"], idx)):
            if size == in_shapes[0][d]:
                continue
            t = axes[d]
            if isinstance(t, Ragged):
                axes[d] = _tagged(Ragged(t.space, "U") if i.number else t, size)
            elif not x.masked and i.number and in_shapes[0][d] != 1:
                axes[d] = _tagged(BUILT, size)
        return [x._replace(axes=tuple(axes), order=False)]
    if prim is P.pad_p:
        axes = list(x.axes)
        for d, (lo, hi, interior) in enumerate(params["padding_config"]):
            t = axes[d]
            if isinstance(t, Ragged) and (lo < 0 or hi < 0 or interior):
                axes[d] = Ragged(t.space, "U")
        pads = tuple(
            (lo, hi) if isinstance(t, Ragged) and t.layout == "P" and lo >= 0 and hi >= 0 and not interior else None
            for t, (lo, hi, interior) in zip(x.axes, params["padding_config"])
        )
        return [x._replace(axes=tuple(axes), order=False, masked=masked, pad=pads)]
    if prim is P.concatenate_p:
        (shape,) = out_shapes
        axes = []
        dim = params["dimension"]
        for i, n in enumerate(shape):
            tags = [info.axes[i] for info, s in zip(ins, in_shapes) if (s[i] == n or i == dim) and s[i] != 1]
            axes.append(_tagged(merge(tags), n))
        return [Info(tuple(axes), number=all(i.number for i in ins), masked=masked)]
    if prim is P.dot_general_p:
        (lc, rc), (lb, rb) = params["dimension_numbers"]
        a, b = ins
        lfree = [d for d in range(len(a.axes)) if d not in lc and d not in lb]
        rfree = [d for d in range(len(b.axes)) if d not in rc and d not in rb]
        axes: list[Any] = [merge([a.axes[i], b.axes[j]]) for i, j in zip(lb, rb)]
        axes += [a.axes[d] for d in lfree] + [b.axes[d] for d in rfree]
        return [Info(tuple(_tagged(t, n) for t, n in zip(axes, out_shapes[0])), masked=masked)]
    if prim in WINDOWS:
        return [window(prim, params, x, in_shapes, out_shapes[0], masked)]
    if prim is P.gather_p:
        dn = params["dimension_numbers"]
        operand, idx = ins
        (shape,) = out_shapes
        batch = [d for d in range(len(shape)) if d not in dn.offset_dims]
        kept = [d for d in range(len(in_shapes[0])) if d not in dn.collapsed_slice_dims]
        kept = [d for d in kept if d not in dn.operand_batching_dims]
        idx_axes = [t for i, t in enumerate(idx.axes) if i != len(idx.axes) - 1]
        axes: list[Any] = [None] * len(shape)
        for d, t in zip(batch, idx_axes):
            axes[d] = t
        for d, src in zip(dn.offset_dims, kept):
            sliced = params["slice_sizes"][src] != in_shapes[0][src]
            t = operand.axes[src]
            axes[d] = Ragged(t.space, "U") if isinstance(t, Ragged) and sliced and idx.number else t
        number = operand.number
        return [Info(tuple(_tagged(t, n) for t, n in zip(axes, shape)), number=number, masked=masked)]
    if prim is P.dynamic_update_slice_p:  # the update's axes are the operand's
        u = ins[1]
        merged = tuple(merge([t, s]) for t, s in zip(x.axes, u.axes))
        return [Info(merged, number=x.number and u.number, masked=masked)]
    if prim in _rules.SCATTERS:  # the updates' window axes are the operand's axes they slice
        u = ins[2]
        dn = params["dimension_numbers"]
        sliced = [
            d for d in range(len(x.axes)) if d not in dn.inserted_window_dims and d not in dn.operand_batching_dims
        ]
        axes = list(x.axes)
        for d, w in zip(sliced, dn.update_window_dims):
            axes[d] = merge([x.axes[d], u.axes[w]])
        return [Info(tuple(axes), masked=masked)]
    if prim is P.sort_p:
        dim = params["dimension"]
        axes = [merge([i.axes[a] for i in ins]) for a in range(len(x.axes))]
        tag = axes[dim]
        axes[dim] = Ragged(tag.space, "U") if isinstance(tag, Ragged) else tag
        return [Info(tuple(axes), number=i.number, masked=masked) for i in ins]
    if prim is P.top_k_p:
        axes = list(x.axes)
        t = axes[-1]
        axes[-1] = Ragged(t.space, "U") if isinstance(t, Ragged) else t
        return [Info(tuple(axes), number=x.number, masked=masked), Info(tuple(axes), number=True, masked=masked)]
    if prim is _rules.SPLIT_P and prim is not None:
        return [x] * len(out_shapes)
    if prim is P.scan_p:
        return _scan(eqn, ins, tied, path, out_shapes)
    if prim is P.while_p:
        start = params["cond_nconsts"] + params["body_nconsts"]
        return [i._replace(order=False) for i in ins[start:]]
    if prim is P.cond_p:
        subs = list(_jaxpr.nested_jaxprs(params.values()))
        outs = []
        for j, branch in enumerate(subs):
            inner = analyse(branch, list(ins[1:]), tied=tied, prefix=path + (j,))
            outs.append([inner.get(v) or plain(len(s)) for v, s in zip(branch.outvars, out_shapes)])
        return [
            Info(tuple(merge([o[k].axes[a] for o in outs]) for a in range(len(s))), masked=masked)
            for k, s in enumerate(out_shapes)
        ]
    return [Info((None,) * len(s), masked=masked) for s in out_shapes]


def _scan(eqn, ins, tied, path, out_shapes):
    """A scan: the carries keep their coordinates; the stacked outputs' leading axis is the scanned
    inputs' (steps along a token axis stay at their places: a padded step is skipped), the rest is
    the body's."""
    params = eqn.params
    nconsts, ncarry = params["num_consts"], params["num_carry"]
    body = params["jaxpr"]
    xs = ins[nconsts + ncarry :]
    step = [i._replace(axes=i.axes[1:], pad=None) if k >= nconsts + ncarry and i.axes else i for k, i in enumerate(ins)]
    subs = list(_jaxpr.nested_jaxprs(params.values()))
    sub = next((j for j, b in enumerate(subs) if b is body.jaxpr), 0)
    inner = analyse(body.jaxpr, step, tied=tied, prefix=path + (sub,))
    lead = merge([i.axes[0] for i in xs if i.axes])
    outs = [i._replace(order=False) for i in ins[nconsts : nconsts + ncarry]]
    for v, shape in zip(body.jaxpr.outvars[ncarry:], out_shapes[ncarry:]):
        y = inner.get(v) if not _jaxpr.is_literal(v) else None
        axes = (lead, *(y.axes if y is not None else (None,) * (len(shape) - 1)))
        outs.append(Info(tuple(_tagged(t, n) for t, n in zip(axes, shape)), masked=any(i.masked for i in ins)))
    return outs


def window(prim, params, x: Info, in_shapes, out_shape, masked) -> Info:
    """A convolution or pooling: the batch axis and the spatial axes keep their tags; a spatial
    ragged axis is in padded coordinates when the window keeps its length (stride 1, padding that
    makes up for the window, a pad made just before it included; see :func:`keeps_length`), else
    in unpadded ones."""
    in_shape = in_shapes[0]
    axes: list[Any] = [None] * len(out_shape)
    for d, t in spatial_axes(prim, params, len(in_shape)):
        tag = x.axes[t]
        extra = (x.pad[t] if x.pad is not None else None) or (0, 0)
        if isinstance(tag, Ragged) and not keeps_length(
            prim, params, d, kernel_size(prim, params, in_shapes, t), extra
        ):
            tag = Ragged(tag.space, "U")
        axes[d] = _tagged(tag, out_shape[d])
    if prim is P.conv_general_dilated_p:
        dn = params["dimension_numbers"]
        axes[dn.out_spec[0]] = x.axes[dn.lhs_spec[0]]
    return Info(tuple(axes), masked=masked)


def spatial_axes(prim, params, ndim):
    """``(output axis, input axis)`` of each windowed axis of a convolution or pooling."""
    if prim is P.conv_general_dilated_p:
        dn = params["dimension_numbers"]
        return list(zip(dn.out_spec[2:], dn.lhs_spec[2:]))
    return [(d, d) for d in range(ndim) if params["window_dimensions"][d] != 1 or params["padding"][d] != (0, 0)]


def kernel_size(prim, params, in_shapes, in_axis):
    """The window's size along input ``in_axis`` (a convolution's kernel's, read off its shape)."""
    if prim is P.conv_general_dilated_p:
        dn = params["dimension_numbers"]
        i = list(dn.lhs_spec[2:]).index(in_axis)
        return in_shapes[1][dn.rhs_spec[2 + i]]
    return params["window_dimensions"][in_axis]


def keeps_length(prim, params, out_axis, size, extra=(0, 0)) -> bool:
    """Whether the window along ``out_axis`` (of ``size``) maps entry ``j`` to entry ``j``: stride 1
    and padding ``lo + hi`` equal to the window's reach, counting ``extra`` padding made before it."""
    if prim is P.conv_general_dilated_p:
        dn = params["dimension_numbers"]
        i = list(dn.out_spec[2:]).index(out_axis)
        stride, dil = params["window_strides"][i], params["rhs_dilation"][i]
        if params["lhs_dilation"][i] != 1:
            return False
        lo, hi = params["padding"][i]
    else:
        stride, dil = params["window_strides"][out_axis], params["window_dilation"][out_axis]
        if params["base_dilation"][out_axis] != 1:
            return False
        lo, hi = params["padding"][out_axis]
    return stride == 1 and lo + hi + extra[0] + extra[1] == (size - 1) * dil
