"""Positions in the unpadded example's coordinates: the rules that act on a ragged axis.

:mod:`._coords` says, for every value, which axes are ragged and in which coordinates their entries
sit. This module does what those coordinates ask for, at run time:

* **ranks**: along a ragged axis, a valid entry's *rank* is the number of valid entries before it,
  its position in the unpadded example; ``order`` lists, per slice, the places of the valid
  entries by rank (the masked ones after them). Both come from the value's own mask;
* **moves between coordinates**: :func:`to_unpadded` gathers the valid entries to the front, in
  order; :func:`to_padded` puts entry ``j`` of a value in unpadded coordinates at the ``j``-th
  valid place of a pattern. Where two values meet along a ragged axis in different coordinates
  (:meth:`Positions.meet`), the one in unpadded coordinates moves;
* **positional constructs** (:meth:`Positions.rule`): a slice, a reversal, a static index, a read
  at built positions, a window (convolution, pooling), a sort, ``top_k``, ``argmax`` along a ragged
  axis act on the valid entries, in unpadded coordinates. A static bound measured from the end
  (``x[:, -1]``, ``x[:, :-1]``) counts from the example's own end: :class:`Relativity` tells which
  bounds are, by tracing the function again with each ragged axis one longer.
"""

from __future__ import annotations

import jax
import jax.extend.core.primitives as P
import jax.numpy as jnp
import numpy as np
from jax import lax

from masked_jax import _jaxpr
from masked_jax._maskify import _coords, _rules
from masked_jax._maskify._coords import BUILT, Info, Ragged
from masked_jax._maskify._errors import MaskifyError
from masked_jax._validate import is_tracer
from masked_jax.ops._base import Pair, ranked


# -- ranks and moves ----------------------------------------------------------------------------------
def pattern(p: Pair, info: Info, axis: int):
    """Which entries along ``axis`` of ``p`` are valid, per slice: ``p``'s compact mask at its rank,
    ``any`` over its other ragged axes (an attention score's keys are valid where some query sees
    them), full along ``axis``. A token mask (B, L, 1) gives one pattern per example; a mask that
    varies along the features too gives one per feature, which a token mask makes the same."""
    n = np.ndim(p.data)
    shape = jnp.shape(p.data)
    m = ranked(p.mask, n)
    if m is None:
        m = jnp.ones((1,) * n, bool)
    others = tuple(
        a for a, t in enumerate(info.axes[:n]) if a != axis and isinstance(t, Ragged) and np.shape(m)[a] != 1
    )
    if others:
        m = jnp.any(m, axis=others, keepdims=True)
    if np.shape(m)[axis] != shape[axis]:
        m = jnp.broadcast_to(m, tuple(shape[axis] if a == axis else s for a, s in enumerate(np.shape(m))))
    return m


def ranks(valid, axis):
    """``(rank, count, order)`` of the pattern ``valid`` along ``axis``: each entry's number of
    valid entries before it (its position in the unpadded example, where it is valid), each
    slice's valid count, and the places of the valid entries by rank, then the masked ones."""
    as_int = valid.astype(jnp.int32)
    rank = jnp.cumsum(as_int, axis=axis, dtype=jnp.int32) - 1
    count = jnp.sum(as_int, axis=axis, keepdims=True, dtype=jnp.int32)
    order = jnp.argsort(~valid, axis=axis, stable=True).astype(jnp.int32)
    return rank, count, order


def take(x, idx, axis):
    """``x`` read along ``axis`` at ``idx`` (broadcast against ``x`` on the other axes)."""
    x = jnp.asarray(x)
    shape = np.broadcast_shapes(
        tuple(1 if a == axis else s for a, s in enumerate(np.shape(x))),
        tuple(1 if a == axis else s for a, s in enumerate(np.shape(idx))),
    )
    xs = tuple(np.shape(x)[axis] if a == axis else s for a, s in enumerate(shape))
    ids = tuple(np.shape(idx)[axis] if a == axis else s for a, s in enumerate(shape))
    return jnp.take_along_axis(jnp.broadcast_to(x, xs), jnp.broadcast_to(idx, ids), axis=axis, mode="clip")


def _mask_along(p: Pair, axis):
    """``p``'s mask at its rank, full along ``axis`` (to be read at places along it)."""
    n = np.ndim(p.data)
    m = ranked(p.mask, n)
    if m is None:
        m = jnp.ones((1,) * n, bool)
    size = jnp.shape(p.data)[axis]
    if np.shape(m)[axis] != size:
        m = jnp.broadcast_to(m, tuple(size if a == axis else s for a, s in enumerate(np.shape(m))))
    return m


def right_padded(valid, axis):
    """Whether every slice of the pattern ``valid`` holds its valid entries first (right padding,
    the usual batch): then padded and unpadded coordinates agree on the valid entries, and a move
    between them is no move."""
    n = np.shape(valid)[axis]
    if n < 2:
        return jnp.array(True)
    head = lax.slice_in_dim(valid, 0, n - 1, axis=axis)
    tail = lax.slice_in_dim(valid, 1, n, axis=axis)
    return jnp.all(head | ~tail)


def _moved(valid, axis, same, general, *operands):
    """``general(*operands)``, a move along ``axis`` by the pattern ``valid`` (gathers by rank), or
    ``same(*operands)`` where the pattern is right padded, where the move is the identity on the
    valid entries: a conditional, so the usual batch runs no gather (nor, in the gradient, the
    gathers' scatters). ``same`` returns what ``general`` does, up to the masked entries' data."""
    return lax.cond(right_padded(valid, axis), same, general, *operands)


def _fit(x, length, axis, shape):
    """``x`` cut or extended (by its last entry: masked places only) to ``length`` along ``axis``,
    broadcast to ``shape``: entry ``j`` of ``x`` stays at ``j``."""
    n = np.shape(x)[axis]
    if n > length:
        x = lax.slice_in_dim(x, 0, length, axis=axis)
    elif n < length:
        widths = [(0, length - n if a == axis else 0) for a in range(np.ndim(x))]
        x = jnp.pad(x, widths, mode="edge")
    return jnp.broadcast_to(x, shape)


def gathered_shape(x, idx, axis):
    """The shape of :func:`take`'s result: ``x`` and ``idx`` broadcast, ``idx``'s length along ``axis``."""
    return tuple(
        np.shape(idx)[axis] if a == axis else s
        for a, s in enumerate(
            np.broadcast_shapes(
                tuple(1 if a == axis else s for a, s in enumerate(np.shape(x))),
                tuple(1 if a == axis else s for a, s in enumerate(np.shape(idx))),
            )
        )
    )


def to_unpadded(p: Pair, info: Info, axis: int) -> Pair:
    """``p`` in unpadded coordinates along ``axis``: the valid entries first, in order."""
    valid = pattern(p, info, axis)
    mask = _mask_along(p, axis)
    shapes = (gathered_shape(p.data, valid, axis), gathered_shape(mask, valid, axis))

    def general(data, mask):
        _, _, order = ranks(valid, axis)
        return take(data, order, axis), take(mask, order, axis)

    def same(data, mask):
        return jnp.broadcast_to(data, shapes[0]), jnp.broadcast_to(mask, shapes[1])

    return Pair(*_moved(valid, axis, same, general, p.data, mask))


def to_padded(u: Pair, valid, axis: int) -> Pair:
    """``u`` (in unpadded coordinates along ``axis``) with its entry ``j`` at the ``j``-th valid place
    of the pattern ``valid``; the pattern's masked places are masked."""
    mask = _mask_along(u, axis)
    length = np.shape(valid)[axis]
    shapes = (gathered_shape(u.data, valid, axis), gathered_shape(mask, valid, axis))

    def general(data, mask):
        rank, _, _ = ranks(valid, axis)
        at = jnp.clip(rank, 0, np.shape(data)[axis] - 1)
        return take(data, at, axis), take(mask, at, axis)

    def same(data, mask):
        return _fit(data, length, axis, shapes[0]), _fit(mask, length, axis, shapes[1])

    data, mask = _moved(valid, axis, same, general, jnp.asarray(u.data), mask)
    return Pair(data, valid & mask)


def built_to_padded(x, valid, axis):
    """A plain value holding at entry ``j`` what belongs to position ``j`` of the unpadded example
    (``pos_emb[jnp.arange(L)]``), read at each valid place's rank."""
    length = np.shape(valid)[axis]
    shape = gathered_shape(x, valid, axis)

    def general(x):
        rank, _, _ = ranks(valid, axis)
        return take(x, jnp.clip(rank, 0, np.shape(x)[axis] - 1), axis)

    return _moved(valid, axis, lambda x: _fit(x, length, axis, shape), general, jnp.asarray(x))


# -- which bounds count from the end ---------------------------------------------------------------
class Relativity:
    """Which static positions of a program count from the end of a ragged axis, by path (indices of
    equations, and of the nested jaxprs between them): ``shifts[path]`` is, for a slice, one flag
    per start and limit bound, and for a read at constant indices, one flag per index; 1 where the
    bound counts from the end. Read off ``extended``, the function's jaxpr traced with every ragged
    axis one longer: a bound that moves with it counts from the end (``x[:, -1]`` is
    ``x[:, L - 1]``, and ``L - 1`` becomes ``L``), one that stays counts from the start. Empty when
    there is no extended trace (it failed, or nothing positional was found)."""

    def __init__(self, shifts: dict | None = None, literals: dict | None = None, growth: dict | None = None):
        self.shifts = shifts or {}  # path -> how the equation's static positions moved
        self.literals = literals or {}  # path -> {operand index: how that literal moved}
        self.growth = growth or {}  # token length -> how much longer the extended trace made it

    def get(self, path):
        """The raw shifts of the equation at ``path`` (``None``: not read)."""
        return self.shifts.get(path)

    def flags(self, path, lengths):
        """The shifts at ``path`` as flags (1: counts from the end) for entries along axes of
        ``lengths`` (one per entry, broadcast), or ``None`` where they are not 0 or 1."""
        s = self.shifts.get(path)
        if s is None:
            return None
        growth = np.vectorize(lambda n: self.growth.get(int(n), 0))(np.asarray(lengths))
        with np.errstate(divide="ignore", invalid="ignore"):
            out = np.where(growth > 0, np.asarray(s) / np.where(growth > 0, growth, 1), np.asarray(s))
        return out.astype(np.int64) if np.all((out == 0) | (out == 1)) else None

    def length_of(self, path, k):
        """The token length the ``k``-th literal operand of the equation at ``path`` stands for (a
        literal that grew with that axis: ``P`` in ``P + t``), or ``None``."""
        delta = self.literals.get(path, {}).get(k)
        if not delta:
            return None
        return next((n for n, g in self.growth.items() if g == delta), None)

    def key(self):
        return (
            tuple(sorted((p, tuple(np.ravel(s).tolist())) for p, s in self.shifts.items())),
            tuple(sorted((p, tuple(sorted(d.items()))) for p, d in self.literals.items())),
        )


def growth(lengths) -> dict:
    """How much longer the extended trace makes each token length: 1, 2, 3, ... by length, so that
    a literal that grew tells which length it stands for."""
    return {n: i + 1 for i, n in enumerate(sorted(lengths))}


def relativity(closed, extended, lengths) -> Relativity:
    """The :class:`Relativity` of the closed jaxpr ``closed`` given the ``extended`` one (see
    there); ``lengths``: the ragged axes' lengths (positional equations on other axes are not
    read)."""
    if extended is None or not lengths:
        return Relativity()
    shifts: dict = {}
    literals: dict = {}
    _walk(closed.jaxpr, _consts(closed), extended.jaxpr, _consts(extended), (), lengths, shifts, literals)
    return Relativity(shifts, literals, growth(lengths))


def positional(jaxpr, lengths) -> bool:
    """Whether ``jaxpr`` has an equation whose static positions may need :func:`relativity`: a slice,
    dynamic slice or gather of an axis as long as a ragged one, an ``arange`` that long."""
    for eqn in _jaxpr.equations(jaxpr):
        if eqn.primitive is P.iota_p:
            if any(n in lengths for n in eqn.params["shape"]):
                return True
        elif eqn.primitive in _POSITIONAL and eqn.invars and not _jaxpr.is_literal(eqn.invars[0]):
            if any(n in lengths for n in getattr(eqn.invars[0].aval, "shape", ())):
                return True
    return False


def _consts(closed):
    """The concrete constants of ``closed`` by variable (index arrays the program holds)."""
    return {v: np.asarray(c) for v, c in zip(closed.jaxpr.constvars, closed.consts) if not is_tracer(c)}


_POSITIONAL = frozenset((P.slice_p, P.dynamic_slice_p, P.gather_p, P.dynamic_update_slice_p, P.iota_p))


class _Unknown(Exception):
    pass


def _value(jaxpr, var, known, producers):
    """The value of ``var`` in ``jaxpr`` computed from literals and the ``known`` inputs alone."""
    if _jaxpr.is_literal(var):
        return var.val
    if var in known:
        return known[var]
    eqn = producers.get(var)
    if eqn is None or eqn.primitive in (P.scan_p, P.while_p, P.cond_p) or eqn.effects:
        raise _Unknown
    ins = [_value(jaxpr, v, known, producers) for v in eqn.invars]
    body = _jaxpr.call_body(eqn)
    if body is not None:
        inner, consts = body
        inner_known = dict(zip(inner.constvars, consts)) | dict(zip(inner.invars, ins))
        return _value(inner, inner.outvars[eqn.outvars.index(var)], inner_known, _producers(inner))
    with jax.ensure_compile_time_eval():
        outs = _jaxpr.bind(eqn, ins)
    return np.asarray(outs[eqn.outvars.index(var)])


def _producers(jaxpr):
    return {v: e for e in jaxpr.eqns for v in e.outvars}


class _Lazy(dict):
    """Values computed on first read: ``{var: thunk}``; reading one runs its thunk once (a value
    that cannot be computed raises :class:`_Unknown`, every time). Most inputs of a call's body are
    never read by a positional rule, and computing one at trace time runs (and compiles) its ops."""

    def __getitem__(self, var):
        value = super().__getitem__(var)
        if isinstance(value, _Thunk):
            value = value()
            super().__setitem__(var, value)
        return value


class _Thunk:
    def __init__(self, fn):
        self.fn, self.failed = fn, False

    def __call__(self):
        if self.failed:
            raise _Unknown
        try:
            return self.fn()
        except _Unknown:
            self.failed = True
            raise


def _known_inputs(eqn, inner, known, producers, jaxpr):
    """The inputs of a call's body computed from literals in the caller, each when first read."""
    out = _Lazy()
    if _jaxpr.call_body(eqn) is None:
        return out
    for v, outer in zip(inner.invars, eqn.invars):
        out[v] = _Thunk(lambda outer=outer: _value(jaxpr, outer, known, producers))
    return out


def _matched(eqns, others):
    """``(i, j)`` pairs of corresponding equations: the same primitives from the start, then from
    the end (a part that depends on the length, such as ``lax.associative_scan``'s levels, may
    differ in between)."""
    pairs, n, m = [], len(eqns), len(others)
    head = 0
    while head < min(n, m) and eqns[head].primitive is others[head].primitive:
        pairs.append((head, head))
        head += 1
    tail = 0
    while tail < min(n, m) - head and eqns[n - 1 - tail].primitive is others[m - 1 - tail].primitive:
        pairs.append((n - 1 - tail, m - 1 - tail))
        tail += 1
    return pairs


def _walk(jaxpr, known, ext, ext_known, prefix, lengths, shifts, literals):
    prods, ext_prods = _producers(jaxpr), _producers(ext)
    for i, j_ext in _matched(jaxpr.eqns, ext.eqns):
        eqn, other = jaxpr.eqns[i], ext.eqns[j_ext]
        path = prefix + (i,)
        try:
            _read(eqn, other, jaxpr, ext, known, ext_known, prods, ext_prods, path, lengths, shifts)
        except _Unknown:
            pass
        moved = {}
        for k, (a, b) in enumerate(zip(eqn.invars, other.invars)):
            if (
                _jaxpr.is_literal(a)
                and _jaxpr.is_literal(b)
                and np.ndim(a.val) == 0
                and np.ndim(b.val) == 0
                and np.asarray(a.val).dtype.kind in "iu"
                and np.asarray(b.val).dtype.kind in "iu"
            ):
                d = int(b.val) - int(a.val)
                if d:
                    moved[k] = d
        if moved:
            literals[path] = moved
        subs = list(_jaxpr.nested_jaxprs(eqn.params.values()))
        ext_subs = list(_jaxpr.nested_jaxprs(other.params.values()))
        for j, (sub, ext_sub) in enumerate(zip(subs, ext_subs)):
            _walk(
                sub,
                _known_inputs(eqn, sub, known, prods, jaxpr),
                ext_sub,
                _known_inputs(other, ext_sub, ext_known, ext_prods, ext),
                path + (j,),
                lengths,
                shifts,
                literals,
            )


def _read(eqn, other, jaxpr, ext, known, ext_known, prods, ext_prods, path, lengths, shifts):
    prim = eqn.primitive
    if prim is P.iota_p:
        a, b = np.array(eqn.params["shape"]), np.array(other.params["shape"])
        if a.shape == b.shape and any(n in lengths for n in a):
            shifts[path] = b - a
        return
    if prim not in _POSITIONAL or _jaxpr.is_literal(eqn.invars[0]):
        return
    shape = tuple(eqn.invars[0].aval.shape)
    if not any(n in lengths for n in shape):
        return
    if prim is P.slice_p:
        a = np.array([*eqn.params["start_indices"], *eqn.params["limit_indices"]])
        b = np.array([*other.params["start_indices"], *other.params["limit_indices"]])
        if a.shape == b.shape:
            shifts[path] = b - a
        return
    if prim is P.gather_p:
        ours = _value(jaxpr, eqn.invars[1], known, prods)
        theirs = _value(ext, other.invars[1], ext_known, ext_prods)
    else:
        first = 1 if prim is P.dynamic_slice_p else 2
        ours = [_value(jaxpr, v, known, prods) for v in eqn.invars[first:]]
        theirs = [_value(ext, v, ext_known, ext_prods) for v in other.invars[first:]]
    ours, theirs = np.asarray(ours), np.asarray(theirs)
    if ours.shape == theirs.shape:
        shifts[path] = (theirs - ours).astype(np.int64)


def _ambiguous(bound, length):
    return 0 < bound < length


class Positions:
    """The positional rules of one ``maskify`` call (see the module docstring)."""

    def __init__(self, fun_name, relativity: Relativity):
        self.fun_name = fun_name
        self.relativity = relativity

    # -- meetings --------------------------------------------------------------------------------------
    def meet(self, eqn, invals, ins: list[Info], out: Info):
        """Operands of an entrywise ``eqn`` moved to one system of coordinates. Along an axis where a
        masked operand is in padded coordinates, an operand in unpadded coordinates is put at the
        valid places (a plain one holding built positions, ``pos_emb[jnp.arange(L)]``, is read at
        the valid places' ranks); a comparison of built positions read only at valid places
        (``tril``'s mask between queries and keys) is left as it is, ranks keep its order. A
        plain operand along an axis built as long as a token axis, and read in unpadded
        coordinates, gets the example's entries only: its entries past the valid count are
        masked (the unpadded example has no query ``q`` past its length)."""
        if not _coords.entrywise(eqn.primitive) or len(invals) < 2 or not eqn.outvars:
            return invals
        shape = tuple(eqn.outvars[0].aval.shape)
        n = len(shape)
        invals = list(invals)
        same = [np.ndim(p.data) == n and len(i.axes) == n for p, i in zip(invals, ins)]
        anchors = {}
        for a in range(n):
            for k, (p, i) in enumerate(zip(invals, ins)):
                t = i.axes[a] if same[k] else None
                if p.mask is not None and isinstance(t, Ragged) and t.layout == "P" and np.shape(p.data)[a] == shape[a]:
                    anchors[a] = k
                    break
        for k, (p, i) in enumerate(zip(invals, ins)):
            if not same[k] or k in anchors.values():
                continue
            positional = [
                a
                for a in range(n)
                if np.shape(p.data)[a] == shape[a] != 1
                and (i.axes[a] is BUILT or (isinstance(i.axes[a], Ragged) and i.axes[a].layout == "U"))
                and (p.mask is None or isinstance(i.axes[a], Ragged))
            ]
            if not positional:
                continue
            moving = [a for a in positional if a in anchors]
            if p.mask is None and i.order and set(positional) <= set(anchors):
                continue
            q = p
            for a in moving:
                valid = pattern(invals[anchors[a]], ins[anchors[a]], a)
                q = Pair(built_to_padded(q.data, valid, a), None) if q.mask is None else to_padded(q, valid, a)
            if p.mask is None:
                for a in positional:
                    if a in moving or not isinstance(i.axes[a], Ragged):
                        continue
                    count = _count_of_length(invals, ins, shape[a])
                    if count is not None:
                        j = lax.broadcasted_iota(jnp.int32, tuple(shape[a] if b == a else 1 for b in range(n)), a)
                        exists = j < count
                        q = Pair(q.data, exists if q.mask is None else q.mask & exists)
            invals[k] = q
        for a, tag in enumerate(out.axes):
            if not (isinstance(tag, Ragged) and tag.layout == "U"):
                continue
            for k, (p, i) in enumerate(zip(invals, ins)):
                if not same[k]:
                    continue
                given = p.mask is None and i.axes[a] is None and not i.number
                if (
                    given
                    and np.shape(p.data)[a] == shape[a] != 1
                    and any(
                        isinstance(j.axes[a], Ragged) and q.mask is not None
                        for q, j in zip(invals, ins)
                        if len(j.axes) == n
                    )
                ):
                    raise MaskifyError(
                        f"maskify({self.fun_name}): a plain array given in padded coordinates meets "
                        "values whose positions along a token axis were rebuilt (a slice, a "
                        "reversal, a sort, a window that changed the axis's length), which hold the "
                        "unpadded example's entries first. Pass that array as a MaskedArray with the "
                        "token mask (its entries then move with the tokens), or compute it inside the "
                        "function from the masked inputs."
                    )
        return invals

    def scattered(self, eqn, invals, ins: list[Info]):
        """A scatter's operands with its updates moved to its ids' coordinates: where the ids along
        an update's scatter axis are positions in the unpadded example (``arange(L) // 2``) and the
        masked updates are in padded coordinates, the updates' valid entries go first, in order
        (token ``r`` of the example goes where ``ids[r]`` says)."""
        if eqn.primitive not in _rules.SCATTERS or len(invals) != 3:
            return invals
        x, idx, upd = invals
        if upd.mask is None:
            return invals
        dn = eqn.params["dimension_numbers"]
        scatter_dims = [d for d in range(np.ndim(upd.data)) if d not in dn.update_window_dims]
        idx_dims = [d for d in range(np.ndim(idx.data)) if d != np.ndim(idx.data) - 1]
        moved = upd
        for u, i in zip(scatter_dims, idx_dims):
            t_idx = ins[1].axes[i] if i < len(ins[1].axes) else None
            t_upd = ins[2].axes[u] if u < len(ins[2].axes) else None
            built = t_idx is BUILT or (isinstance(t_idx, Ragged) and t_idx.layout == "U")
            if built and isinstance(t_upd, Ragged) and t_upd.layout == "P":
                moved = to_unpadded(moved, ins[2], u)
        return invals if moved is upd else [x, idx, moved]

    def contract(self, eqn, invals, ins: list[Info], rules):
        """A contraction along a token axis between values in different coordinates (``tril(ones)
        @ x``, a table of built positions against masked tokens): the masked operand moved to
        unpadded coordinates along it, the result's axes built as long as the token axis masked
        past the valid count; ``None`` when the coordinates agree."""
        if eqn.primitive is not P.dot_general_p:
            return None
        (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
        a, b = invals
        ia, ib = ins
        moved = [a, b]
        count, lengths = None, set()
        for i, j in zip(lc, rc):
            ta, tb = ia.axes[i], ib.axes[j]
            for side, (t, u, axis) in enumerate(((ta, tb, i), (tb, ta, j))):
                p = moved[side]
                if p.mask is None or not (isinstance(t, Ragged) and t.layout == "P"):
                    continue
                if u is BUILT or (isinstance(u, Ragged) and u.layout == "U"):
                    valid = pattern(p, ins[side], axis)
                    c = jnp.sum(valid, axis=axis, keepdims=True, dtype=jnp.int32)
                    count = (side, c, axis) if count is None else count
                    lengths.add(np.shape(p.data)[axis])
                    moved[side] = to_unpadded(p, ins[side], axis)
        if count is None:
            return None
        out = rules(eqn.primitive)(eqn.primitive, moved, **eqn.params)
        side, c, _ = count
        other = 1 - side
        o_info, o_contr = ins[other], (lc, rc)[other]
        o_batch = (lb, rb)[other]
        o_free = [d for d in range(len(o_info.axes)) if d not in o_contr and d not in o_batch]
        n_out = np.ndim(out.data)
        # the count, laid out as the result (the moved side's free and batch axes)
        s_contr, s_batch = (lc, rc)[side], (lb, rb)[side]
        s_free = [d for d in range(np.ndim(c)) if d not in s_contr and d not in s_batch]
        c = jnp.squeeze(c, axis=tuple(s_contr))
        kept = [d for d in range(np.ndim(invals[side].data)) if d not in s_contr]
        c = jnp.transpose(c, [kept.index(d) for d in [*s_batch, *s_free]])
        nb = len(s_batch)
        lhs_free = np.ndim(a.data) - len(lc) - len(lb)
        if side == 0:
            c = jnp.reshape(c, np.shape(c) + (1,) * (n_out - np.ndim(c)))
        else:
            c = jnp.reshape(c, np.shape(c)[:nb] + (1,) * lhs_free + np.shape(c)[nb:])
        exists = jnp.ones((1,) * n_out, bool)
        offset = nb + (lhs_free if other == 1 else 0)
        for k, d in enumerate(o_free):
            t = o_info.axes[d]
            if isinstance(t, Ragged) and t.layout == "U" and np.shape(invals[other].data)[d] in lengths:
                o = offset + k
                j = lax.broadcasted_iota(
                    jnp.int32, tuple(np.shape(out.data)[o] if x == o else 1 for x in range(n_out)), o
                )
                exists = exists & (j < c)
        return Pair(out.data, exists if out.mask is None else out.mask & exists)

    # -- positional constructs --------------------------------------------------------------------------
    def rule(self, eqn, invals, ins: list[Info], path, rules):
        """The result of a positional ``eqn`` acting on a ragged axis of a masked operand, or ``None``
        when ``eqn`` is not one (its usual rule then runs). ``rules``: the primitives' masked
        rules, for the constructs that run theirs on moved operands."""
        prim = eqn.primitive
        if not invals or all(p.mask is None for p in invals):
            return None
        x, info = invals[0], ins[0]
        ragged = [a for a, t in enumerate(info.axes) if isinstance(t, Ragged)]
        if prim is P.slice_p:
            return self._slice(eqn, x, info, path) if x.mask is not None and ragged else None
        if prim is P.rev_p:
            dims = [d for d in eqn.params["dimensions"] if d in ragged]
            return _rev(x, info, eqn.params["dimensions"], dims) if x.mask is not None and dims else None
        if prim is P.dynamic_slice_p:
            return self._dynamic_slice(eqn, invals, ins, path)
        if prim is P.gather_p:
            return self._gather(eqn, invals, ins, path, rules)
        if prim is P.dot_general_p:
            return self.contract(eqn, invals, ins, rules)
        if prim in _coords.WINDOWS:
            return self._window(eqn, invals, ins, rules)
        if prim in (P.sort_p, P.argmax_p, P.argmin_p, P.top_k_p):
            axis = {
                P.sort_p: lambda: eqn.params["dimension"],
                P.argmax_p: lambda: eqn.params["axes"][0],
                P.argmin_p: lambda: eqn.params["axes"][0],
                P.top_k_p: lambda: len(info.axes) - 1,
            }[prim]()
            moved = self.unpadded_along(invals, ins, axis)
            if moved is None:
                return None
            return rules(prim)(prim, moved, **eqn.params)
        return None

    def unpadded_along(self, invals, ins, axis):
        """``invals`` with each masked operand that is in padded coordinates along ``axis`` moved to
        unpadded ones (a sort's keys; its ``iota`` operand holds built positions already), or
        ``None`` when none is."""
        moved, any_moved = [], False
        for p, i in zip(invals, ins):
            tag = i.axes[axis] if axis < len(i.axes) else None
            if p.mask is not None and isinstance(tag, Ragged) and tag.layout == "P":
                moved.append(to_unpadded(p, i, axis))
                any_moved = True
            else:
                moved.append(p)
        return moved if any_moved else None

    def _relative(self, path, lengths):
        """The flags of the equation at ``path`` (0: from the start, 1: from the end) for entries
        along axes of ``lengths``, or ``None`` where the extended trace does not tell."""
        return self.relativity.flags(path, lengths)

    def _slice(self, eqn, x, info, path):
        params = eqn.params
        start, limit = list(params["start_indices"]), list(params["limit_indices"])
        strides = list(params["strides"] or (1,) * len(start))
        shape = jnp.shape(x.data)
        ragged = [
            d
            for d, t in enumerate(info.axes)
            if isinstance(t, Ragged) and not (start[d] == 0 and limit[d] == shape[d] and strides[d] == 1)
        ]
        if not ragged:
            return None
        shifts = None
        if any(_ambiguous(start[d], shape[d]) or _ambiguous(limit[d], shape[d]) for d in ragged):
            shifts = self._relative(path, [*shape, *shape])
            if shifts is None:
                raise self._unknown("a slice", ragged)
        n = len(shape)
        # the other axes first, as they are
        s0 = [0 if d in ragged else start[d] for d in range(n)]
        l0 = [shape[d] if d in ragged else limit[d] for d in range(n)]
        st = [1 if d in ragged else strides[d] for d in range(n)]
        p = Pair(lax.slice(x.data, s0, l0, st), _slice_mask(x.mask, n, s0, l0, st, shape))
        for d in ragged:
            rs = int(shifts[d]) if shifts is not None else int(start[d] == shape[d] and start[d] > 0)
            rl = int(shifts[n + d]) if shifts is not None else int(limit[d] == shape[d])
            size = len(range(start[d], limit[d], strides[d]))
            p = _read_ranks(p, info, d, start[d], size, strides[d], rs, rl, limit[d])
        return p

    def _dynamic_slice(self, eqn, invals, ins, path):
        x, *idx = invals
        info = ins[0]
        shape = jnp.shape(x.data)
        sizes = eqn.params["slice_sizes"]
        ragged = [
            d
            for d, t in enumerate(info.axes)
            if isinstance(t, Ragged) and sizes[d] != shape[d] and ins[1 + d].number and idx[d].mask is None
        ]
        if x.mask is None or not ragged:
            return None
        if any(i.mask is not None for i in idx):
            return None
        n = len(shape)
        others = [jnp.asarray(0, jnp.result_type(idx[d].data)) if d in ragged else idx[d].data for d in range(n)]
        full = [shape[d] if d in ragged else sizes[d] for d in range(n)]
        data = lax.dynamic_slice(x.data, others, full)
        m = _mask_along_all(x.mask, n)
        m_sizes = [full[d] if np.shape(m)[d] != 1 else 1 for d in range(n)]
        m_idx = [others[d] if np.shape(m)[d] != 1 else 0 for d in range(n)]
        p = Pair(data, lax.dynamic_slice(m, m_idx, m_sizes))
        shifts = self._relative(path, list(shape))
        for d in ragged:
            start = idx[d].data
            if shifts is None and not is_tracer(start) and _ambiguous(int(start), shape[d]):
                raise self._unknown("a read at a constant position", [d])
            shift = 0 if shifts is None else int(np.ravel(shifts)[d])
            p = _read_ranks(p, info, d, start, sizes[d], 1, shift, shift)
        return p

    def _gather(self, eqn, invals, ins, path, rules):
        """A read of a ragged axis at built positions (``jnp.take(x, jnp.arange(k))``, the indices of
        an ``argsort``, a loop counter): the operand moved to unpadded coordinates (to the end of the
        axis where a constant index counts from the end), then read as it is."""
        x, idx = invals
        info, idx_info = ins
        dn = eqn.params["dimension_numbers"]
        ragged = [
            d
            for d in dn.start_index_map
            if isinstance(info.axes[d], Ragged)
            and eqn.params["slice_sizes"][d] != jnp.shape(x.data)[d]
            and info.axes[d].layout == "P"
        ]
        if x.mask is None or not ragged or not idx_info.number:
            return None
        shifts = self._relative(path, jnp.shape(x.data)[ragged[0]])
        if shifts is None and not is_tracer(idx.data):
            lengths = [jnp.shape(x.data)[d] for d in ragged]
            if any(_ambiguous(int(v), n) for v in np.ravel(idx.data) for n in lengths):
                raise self._unknown("a read at constant positions", ragged)
        out = None
        for from_end in (False, True):
            if from_end and (shifts is None or not np.any(shifts)):
                continue
            if shifts is not None and not from_end and np.all(shifts):
                continue
            moved = x
            for d in ragged:
                moved = _to_end(moved, info, d) if from_end else to_unpadded(moved, info, d)
            res = rules(eqn.primitive)(eqn.primitive, [moved, idx], **eqn.params)
            if out is None:
                out = res
            else:  # the entries whose index counts from the end
                sel = np.asarray(shifts).astype(bool)
                sel = _index_layout(sel, eqn, jnp.shape(res.data))
                out = Pair(
                    jnp.where(sel, res.data, out.data),
                    jnp.where(sel, _full(res.mask, res.data), _full(out.mask, out.data)),
                )
        return out

    def _window(self, eqn, invals, ins, rules):
        """A convolution or pooling along ragged axes: run on the valid entries moved to the front of
        each axis (the unpadded example's window positions), and put back at the valid places when
        the window keeps the axis's length (the pattern of a pad made just before it is cut off)."""
        prim, params = eqn.primitive, eqn.params
        x, info = invals[0], ins[0]
        if x.mask is None or any(p.mask is not None for p in invals[1:]):
            return None
        pairs = _coords.spatial_axes(prim, params, np.ndim(x.data))
        axes = [(o, i) for o, i in pairs if isinstance(info.axes[i], Ragged) and info.axes[i].layout == "P"]
        if not axes:
            return None
        moved, valids = x, {}
        for _, i in axes:
            valids[i] = pattern(moved, info, i)
            moved = to_unpadded(moved, info, i)
        out = rules(prim)(prim, [moved, *invals[1:]], **params)
        in_shapes = [tuple(v.aval.shape) for v in eqn.invars]
        for o, i in axes:
            extra = (info.pad[i] if info.pad is not None else None) or (0, 0)
            size = _coords.kernel_size(prim, params, in_shapes, i)
            if not _coords.keeps_length(prim, params, o, size, extra):
                continue
            valid = valids[i]
            lo, hi = extra
            valid = lax.slice_in_dim(valid, lo, np.shape(valid)[i] - hi, axis=i)
            valid = _as_output(prim, params, valid)
            out = to_padded(out, _pattern_for(valid, out, o), o)
        return out

    def compact_call(self, name, operands, infos, kw):
        """A jax function's named call that sorts along a token axis (``jnp.argsort``, ``jnp.sort``,
        ``jnp.argpartition``, ``jnp.partition``): ``(operands, finish)``, the operand moved to unpadded
        coordinates along the call's axis (so the positions it returns are the unpadded example's)
        and ``finish`` the function that masks the result's entries past the valid count (the
        example has no such entries)."""
        keep = (operands, lambda out: out)
        if name not in ("argsort", "sort", "argpartition", "partition") or not operands:
            return keep
        x, info = operands[0], infos[0]
        if x.mask is None or np.ndim(x.data) == 0:
            return keep
        axis = kw.get("axis", -1)
        axis = -1 if axis is None else axis
        axis = axis % np.ndim(x.data)
        tag = info.axes[axis] if axis < len(info.axes) else None
        if not isinstance(tag, Ragged):
            return keep
        valid = pattern(x, info, axis)
        _, count, _ = ranks(valid, axis)

        def finish(out):
            if not isinstance(out, Pair) or np.ndim(out.data) != np.ndim(x.data):
                return out
            j = lax.broadcasted_iota(jnp.int32, np.shape(out.data), axis)
            exists = j < count
            return Pair(out.data, exists if out.mask is None else out.mask & exists)

        moved = to_unpadded(x, info, axis) if tag.layout == "P" else x
        return [moved, *operands[1:]], finish

    def _unknown(self, what, axes):
        return MaskifyError(
            f"maskify({self.fun_name}): {what} along a token axis (axis {axes}) has a bound that may "
            "count from the start or from the end of the unpadded example, and tracing the function "
            "with a longer axis did not tell which. Write bounds from the end as negative indices of "
            "a function that traces at any length, or pass the positions as an argument."
        )


def _count_of_length(invals, ins, length):
    """The valid count (at the operands' rank, 1 along the axis) of a masked operand's token axis in
    padded coordinates that is ``length`` long, or ``None``."""
    for p, i in zip(invals, ins):
        if p.mask is None or len(i.axes) != np.ndim(p.data):
            continue
        for a, t in enumerate(i.axes):
            if isinstance(t, Ragged) and t.layout == "P" and np.shape(p.data)[a] == length:
                return jnp.sum(pattern(p, i, a), axis=a, keepdims=True, dtype=jnp.int32)
    return None


def _full(mask, data):
    return jnp.broadcast_to(jnp.ones((), bool) if mask is None else mask, jnp.shape(data))


def _index_layout(sel, eqn, out_shape):
    """A per-index flag of a gather's constant indices laid along its output's batch axes."""
    dn = eqn.params["dimension_numbers"]
    sel = np.asarray(sel)
    idx_shape = tuple(eqn.invars[1].aval.shape)
    flag = sel.reshape(idx_shape)
    if flag.ndim:
        flag = flag.any(axis=-1) if flag.ndim == len(idx_shape) and idx_shape else flag
    batch = [d for d in range(len(out_shape)) if d not in dn.offset_dims]
    shape = [1] * len(out_shape)
    for d, n in zip(batch, np.shape(flag)):
        shape[d] = n
    return jnp.asarray(np.reshape(flag, shape))


def _mask_along_all(mask, n):
    return jnp.ones((1,) * n, bool) if mask is None else ranked(mask, n)


def _slice_mask(mask, n, start, limit, strides, shape):
    if mask is None:
        return None
    m = ranked(mask, n)
    s = [start[d] if np.shape(m)[d] != 1 else 0 for d in range(n)]
    e = [limit[d] if np.shape(m)[d] != 1 else 1 for d in range(n)]
    st = [strides[d] if np.shape(m)[d] != 1 else 1 for d in range(n)]
    return lax.slice(m, s, e, st)


def _read_ranks(p: Pair, info, axis, start, size, stride, from_end_start, from_end_limit, limit=None):
    """``p`` read along ``axis`` at ``size`` ranks ``start, start + stride, ...`` (below ``limit``),
    each counted from the start of the unpadded example, or from its end where ``from_end_*`` is 1
    (the padded length then stands for the example's): entry ``j`` of the result is the example's
    entry ``start + j * stride``, valid where that entry exists."""
    length = jnp.shape(p.data)[axis]
    valid = pattern(p, info, axis)
    _, count, order = ranks(valid, axis)
    j = lax.broadcasted_iota(jnp.int32, tuple(size if a == axis else 1 for a in range(np.ndim(p.data))), axis)
    shift = count - length
    first = jnp.asarray(start).astype(jnp.int32) + from_end_start * shift
    r = first + j * stride
    ok = (r >= 0) & (r < count)
    if limit is not None:
        ok = ok & (r < jnp.asarray(limit).astype(jnp.int32) + from_end_limit * shift)
    at = take(order, jnp.clip(r, 0, length - 1), axis)
    data = take(p.data, at, axis)
    mask = take(_mask_along(p, axis), at, axis) & ok
    return Pair(data, mask)


def _rev(x: Pair, info, dims, ragged):
    """A reversal: along a ragged axis, the valid entries in reverse order at the valid places."""
    n = np.ndim(x.data)
    plain_dims = tuple(d for d in dims if d not in ragged)
    data, mask = x.data, ranked(x.mask, n)
    if plain_dims:
        data = lax.rev(data, plain_dims)
        mask = lax.rev(mask, tuple(d for d in plain_dims if np.shape(mask)[d] != 1))
    p = Pair(data, mask)
    for d in ragged:
        valid = pattern(p, info, d)
        rank, count, order = ranks(valid, d)
        here = lax.broadcasted_iota(jnp.int32, np.shape(valid), d)
        src = jnp.where(valid, take(order, jnp.clip(count - 1 - rank, 0, np.shape(valid)[d] - 1), d), here)
        p = Pair(take(p.data, src, d), take(_mask_along(p, d), src, d))
    return p


def _to_end(p: Pair, info, axis):
    """``p`` with its valid entries moved to the end of ``axis``, in order (so a position counted
    from the end of the padded axis reads the example's entry that far from its own end)."""
    valid = pattern(p, info, axis)
    length = np.shape(valid)[axis]
    _, count, order = ranks(valid, axis)
    j = lax.broadcasted_iota(jnp.int32, np.shape(valid), axis)
    r = j - (length - count)
    at = jnp.where(r >= 0, take(order, jnp.clip(r, 0, length - 1), axis), take(order, count + j, axis))
    return Pair(take(p.data, at, axis), take(_mask_along(p, axis), at, axis))


def _as_output(prim, params, valid):
    """A pattern laid out as a convolution's input, laid out as its output (same roles)."""
    if prim is not P.conv_general_dilated_p:
        return valid
    dn = params["dimension_numbers"]
    perm = [0] * len(dn.out_spec)
    for o, i in zip(dn.out_spec, dn.lhs_spec):
        perm[o] = i
    return jnp.transpose(valid, perm)


def _pattern_for(valid, out: Pair, axis):
    """The pattern ``valid`` broadcast against ``out`` (features reduced away)."""
    n = np.ndim(out.data)
    shape = [np.shape(valid)[a] if a == axis or np.shape(valid)[a] == np.shape(out.data)[a] else 1 for a in range(n)]
    if shape != list(np.shape(valid)):
        red = tuple(a for a in range(n) if shape[a] == 1 and np.shape(valid)[a] != 1)
        valid = jnp.any(valid, axis=red, keepdims=True)
    return valid
