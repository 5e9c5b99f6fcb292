"""Id spaces: which array's entries the integer ids of a gather or a scatter index.

A ``segment_*`` or scatter result's axis is the *space* its ids index: ``segment_sum(m, rcv, N)``
has one entry per node that ``rcv`` can name. A slot of such a result that no valid update
reached holds the reduction's identity (it is *free*, :mod:`masked_jax._maskify._free`); it is
valid where the space's own entries are valid (a real node with no incoming edge exists and
receives nothing) and masked where they are padding. The ids tell the space:

* ids are the same ids through what only rewrites their values in place: ``ids + n`` and the
  select of jax's negative-index normalisation, ``clip``, ``%``, casts, reshapes and broadcasts
  (the ``(E,)`` ids become the ``(E, 1)`` index operand of the gather or scatter);
* a gather ``x[ids]`` of a masked array ``x`` *anchors* the space of ``ids``: an entry is valid
  where ``x``'s entries along the indexed dim (and the batching dims of a ``vmap``) are valid,
  all along the other dims (a node whose features are valid);
* ids that index a scatter result of other ids (``deg[snd]`` where ``deg = segment_sum(ones,
  rcv, N)``), or a value computed from one entry by entry (``rsqrt(deg)``), index the same space:
  the two ids' spaces are joined, and an anchor of one is an anchor of both.

A scatter result itself anchors nothing: its mask says which slots a valid update reached, not
which entries of the space exist. Where no anchor is known when a free slot is read, the slot is
masked (the rule with no array of the space in sight), unless the space is as long as no axis
along which the function's masked inputs vary: then it is a fixed set of segments
(``segment_sum(x, sign, 2)``), every one present in the unpadded example, and its free slots are
valid.

Each space is kept per batch: the anchor of a gather with batching dims (a ``vmap``) is its
validity over ``(batching dims..., the indexed dim)``, flattened; a scatter's free slots hold
their flat index into the same layout (:class:`masked_jax._maskify._free.Free`'s ``slot``), and
an anchor is read only by slots of the same layout.

Values are told apart by identity (the traced arrays the interpreter holds), so ids keep their
space across the interpreter's inner calls (``jit``, ``take``'s call). Loop bodies and branches
run in traces of their own: :meth:`Spaces.apart` keeps what they learn inside them.
"""

from __future__ import annotations

import contextlib
from typing import Any

import jax.extend.core.primitives as P
import jax.numpy as jnp
import numpy as np
from jax import lax

from masked_jax import _jaxpr
from masked_jax._maskify import _rules
from masked_jax.ops._base import ranked
from masked_jax.ops._registry import REGISTRY

# operations that keep ids the same ids: their values rewritten in place (jax's normalisation of
# negative indices, clip, wrap), their layout changed
_SAME_IDS = frozenset(
    (
        P.add_p,
        P.sub_p,
        P.rem_p,
        P.max_p,
        P.min_p,
        P.clamp_p,
        P.select_n_p,
        P.broadcast_in_dim_p,
        P.reshape_p,
        P.squeeze_p,
        P.convert_element_type_p,
        P.copy_p,
        lax.optimization_barrier_p,
    )
)
# layout changes that keep ids one per position (the others keep values in place)
_LAYOUT = frozenset((P.broadcast_in_dim_p, P.reshape_p, P.squeeze_p))


def _entrywise(prim) -> bool:
    owner = _rules.OWNER.get(prim)
    return (owner is not None and REGISTRY[owner].family in ("elementwise", "binary")) or prim in (
        P.select_n_p,
        P.clamp_p,
        P.convert_element_type_p,
        P.copy_p,
    )


def _integer(x) -> bool:
    return jnp.issubdtype(jnp.result_type(x), jnp.integer)


def _sources(prim, in_shapes, in_dtypes, dynamic, out_shape, out_dtype):
    """Which operands an output of ``prim`` takes its ids and its space axes from:
    ``(ids sources, space sources)``, indices into the operands. ``dynamic``: the operands not
    computed from literals alone (constants say nothing about either)."""
    ids, space = [], []
    if prim in _SAME_IDS and jnp.issubdtype(out_dtype, jnp.integer):
        ids = [k for k, dt in enumerate(in_dtypes) if dynamic[k] and jnp.issubdtype(dt, jnp.integer)]
        if prim in _LAYOUT:
            ids = ids[:1]
    if _entrywise(prim):
        space = [k for k, s in enumerate(in_shapes) if dynamic[k] and tuple(s) == tuple(out_shape)]
    return ids, space


_CALL_SOURCES: dict = {}


def _call_sources_cached(jaxpr, dynamic):
    """:func:`_call_sources`, kept per body (a model calls the same jitted function many times)."""
    key = (id(jaxpr), tuple(dynamic))
    hit = _CALL_SOURCES.get(key)
    if hit is None or hit[0] is not jaxpr:
        if len(_CALL_SOURCES) > 256:
            _CALL_SOURCES.clear()
        hit = _CALL_SOURCES[key] = (jaxpr, _call_sources(jaxpr, dynamic))
    return hit[1]


def _call_sources(jaxpr, dynamic):
    """What a call's body does with its operands, read off the body: for each output, the operand
    whose ids it keeps and the operand whose space axes it keeps (entry by entry, at the same
    shape), or ``None``; and its gathers ``(operand, ids operand, layout dims)`` of an operand
    kept entry by entry by ids kept from another."""
    ids: dict = {}
    space: dict = {}
    gathers = []
    live = set()  # computed from a dynamic operand
    for k, (v, dyn) in enumerate(zip(jaxpr.invars, dynamic)):
        if dyn:
            ids[v] = k
            space[v] = k
            live.add(v)

    def known(v, table):
        return not _jaxpr.is_literal(v) and v in table

    for eqn in jaxpr.eqns:
        body = _jaxpr.call_body(eqn)
        if body is not None:
            live.update(eqn.outvars if any(known(v, live) for v in eqn.invars) else ())
            inner, inner_gathers = _call_sources(body[0], [known(v, live) for v in eqn.invars])
            for o, (i, s) in zip(eqn.outvars, inner):
                if i is not None and known(eqn.invars[i], ids):
                    ids[o] = ids[eqn.invars[i]]
                if s is not None and known(eqn.invars[s], space):
                    space[o] = space[eqn.invars[s]]
            for x, j, dims in inner_gathers:
                if known(eqn.invars[x], space) and known(eqn.invars[j], ids):
                    gathers.append((space[eqn.invars[x]], ids[eqn.invars[j]], dims))
            continue
        if eqn.primitive is P.gather_p:
            dims = _layout_dims(eqn.params["dimension_numbers"], gather=True)
            x, idx = eqn.invars
            if dims is not None and known(x, space) and known(idx, ids):
                gathers.append((space[x], ids[idx], dims))
        dyn = [known(v, live) for v in eqn.invars]
        if any(dyn):
            live.update(eqn.outvars)
        if len(eqn.outvars) != 1:
            continue
        out = eqn.outvars[0]
        shapes = [np.shape(v.val) if _jaxpr.is_literal(v) else v.aval.shape for v in eqn.invars]
        dtypes = [jnp.result_type(v.val) if _jaxpr.is_literal(v) else v.aval.dtype for v in eqn.invars]
        i_src, s_src = _sources(eqn.primitive, shapes, dtypes, dyn, out.aval.shape, out.aval.dtype)
        if i_src and all(known(eqn.invars[k], ids) for k in i_src):
            roots = {ids[eqn.invars[k]] for k in i_src}
            if len(roots) == 1:
                ids[out] = roots.pop()
        roots = {space[eqn.invars[k]] for k in s_src if known(eqn.invars[k], space)}
        if len(roots) == 1:
            space[out] = roots.pop()
    outs = [
        (ids.get(v) if not _jaxpr.is_literal(v) else None, space.get(v) if not _jaxpr.is_literal(v) else None)
        for v in jaxpr.outvars
    ]
    return outs, gathers


def _layout_dims(dn, gather: bool):
    """The operand dims of a gather's or a scatter's space: its batching dims, then the one
    indexed dim; ``None`` when it indexes several dims."""
    indexed = dn.start_index_map if gather else dn.scatter_dims_to_operand_dims
    if len(indexed) != 1:
        return None
    return [*dn.operand_batching_dims, indexed[0]]


def slots(dn, shape, compact_shape):
    """``(sizes, slot)`` of a scatter into an operand of ``shape``: the layout of its space and
    each position's flat index into it, at ``compact_shape`` (a compact mask's shape); ``None``
    where the scatter indexes several dims or the compact shape drops one of the layout's."""
    dims = _layout_dims(dn, gather=False)
    if dims is None or any(compact_shape[d] != shape[d] for d in dims):
        return None
    sizes = tuple(shape[d] for d in dims)
    slot = jnp.zeros(tuple(compact_shape), jnp.int32)
    stride = 1
    for d, n in zip(reversed(dims), reversed(sizes)):
        slot = slot + lax.broadcasted_iota(jnp.int32, tuple(compact_shape), d) * stride
        stride *= n
    return sizes, slot


def _anchor_of(x, dims):
    """``(sizes, validity)`` of the entries of ``x``'s space along ``dims`` (flattened): an entry
    is valid where every entry of ``x`` along its other dims is (a node whose features are valid).
    (Under a ``vmap`` of ids shared by every example the examples are such other dims: a node is
    then valid where it is valid in every example, never where it is padding.)"""
    shape = np.shape(x.data)
    m = ranked(x.mask, len(shape))
    other = tuple(a for a in range(len(shape)) if a not in dims)
    if other:
        m = jnp.all(m, axis=other)
    kept = sorted(dims)
    m = jnp.transpose(m, [kept.index(a) for a in dims])
    sizes = tuple(shape[a] for a in dims)
    return sizes, jnp.reshape(jnp.broadcast_to(m, sizes), (-1,))


class Spaces:
    """The id spaces met in one ``maskify`` call: the ids behind each index operand, the space
    axis of each scatter result (and what is computed from one entry by entry), the spaces
    joined by ids that index another's scatter result, and each space's anchor."""

    def __init__(self):
        self._ids: dict[int, tuple[Any, Any]] = {}  # id(array) -> (array, the ids it is)
        self._axis: dict[int, tuple[Any, Any, int]] = {}  # id(array) -> (array, ids, its axis indexed by them)
        self._parent: dict[int, Any] = {}  # id(ids) -> ids it is joined to
        self._anchors: dict[int, tuple[tuple, Any]] = {}  # id(representative ids) -> (sizes, validity)
        self._alive: list = []  # the ids keyed by identity above, kept alive for the call (no id reused)
        # the lengths of the axes along which the function's masked inputs vary: a space of
        # another length (``segment_sum(x, ids, 2)``) is a fixed set of segments, all of them
        # present in every example
        self.lengths: set = set()
        self._grows: set = set()  # id(representative ids) of ids made of token positions

    def grows(self, ids):
        """``ids`` are made of positions along a token axis (``arange(L) // 2``): their space grows
        with the example, its unreached slots are masked."""
        ids = self._find(ids)
        self._alive.append(ids)
        self._grows.add(id(ids))

    @contextlib.contextmanager
    def apart(self):
        """What is learnt inside (a loop body, a branch: a trace of its own) stays inside."""
        saved = (dict(self._ids), dict(self._axis), dict(self._parent), dict(self._anchors))
        try:
            yield
        finally:
            self._ids, self._axis, self._parent, self._anchors = saved

    def ids(self, array):
        """The ids ``array`` is (itself unless it was derived from ids in place)."""
        hit = self._ids.get(id(array))
        return array if hit is None else hit[1]

    def _find(self, ids):
        while id(ids) in self._parent:
            ids = self._parent[id(ids)]
        return ids

    def _join(self, a, b):
        a, b = self._find(a), self._find(b)
        if a is b:
            return
        anchor = self._anchors.get(id(a)) or self._anchors.get(id(b))
        self._alive += [a, b]
        self._parent[id(b)] = a
        self._anchors.pop(id(b), None)
        if anchor is not None:
            self._anchors[id(a)] = anchor

    def anchor(self, space):
        """The validity (flat) of the entries of ``space`` (``(ids, sizes)``), or ``None`` when no
        array of the space is in sight (or its layout differs)."""
        ids, sizes = space
        hit = self._anchors.get(id(self._find(ids)))
        fixed = sizes and sizes[-1] not in self.lengths and id(self._find(ids)) not in self._grows
        if hit is None and fixed:  # a fixed set of segments
            return jnp.ones((int(np.prod(sizes)),), bool)
        if hit is None or hit[0] != tuple(sizes):
            return None
        return hit[1]

    def track(self, eqn, invals, frees, outs, dynamic):
        """Learn from one equation run on ``invals`` (their free positions ``frees``; ``dynamic``:
        not computed from literals alone) giving ``outs``. A call's body is read statically
        where it was bound as a whole (no masked operand); a call ``maskify`` ran equation by
        equation was learnt from as it ran."""
        prim = eqn.primitive
        if prim is P.gather_p:
            dims = _layout_dims(eqn.params["dimension_numbers"], gather=True)
            if dims is not None:
                self._gathered(dims, invals[0], frees[0], invals[1].data)
            return
        if prim in _rules.SCATTERS:
            dims = _layout_dims(eqn.params["dimension_numbers"], gather=False)
            if dims is not None and len(outs) == 1:
                self._axis[id(outs[0].data)] = (outs[0].data, self.ids(invals[1].data), dims[-1])
            return
        body = _jaxpr.call_body(eqn)
        if body is not None:
            if any(p.mask is not None for p in invals):
                return
            sources, gathers = _call_sources_cached(body[0], dynamic)
            for out, (i, s) in zip(outs, sources):
                self._follow(out, [invals[i]] if i is not None else [], [invals[s]] if s is not None else [])
            for x, i, dims in gathers:
                self._gathered(dims, invals[x], None, invals[i].data)
            return
        if len(outs) != 1 or len(eqn.outvars) != 1:
            return
        out = outs[0]
        shapes = [np.shape(p.data) for p in invals]
        dtypes = [jnp.result_type(p.data) for p in invals]
        i_src, s_src = _sources(prim, shapes, dtypes, dynamic, np.shape(out.data), jnp.result_type(out.data))
        self._follow(out, [invals[k] for k in i_src], [invals[k] for k in s_src])

    def _follow(self, out, id_sources, space_sources):
        roots = {id(self.ids(p.data)): self.ids(p.data) for p in id_sources}
        if len(roots) == 1:
            self._ids[id(out.data)] = (out.data, next(iter(roots.values())))
        axes = [self._axis[id(p.data)] for p in space_sources if id(p.data) in self._axis]
        if axes and id(out.data) not in self._axis:
            _, ids, axis = axes[0]
            for _, other, a in axes[1:]:  # one entry by entry with another of the same axis: one space
                if a == axis:
                    self._join(ids, other)
            self._axis[id(out.data)] = (out.data, ids, axis)

    def _gathered(self, dims, x, free, idx):
        """``x[idx]`` along the layout ``dims`` of ``x``: joins the spaces of ``idx`` and of a
        scatter result ``x``, or anchors ``idx``'s space on a masked ``x``."""
        ids, indexed = self.ids(idx), dims[-1]
        hit = self._axis.get(id(x.data))
        if hit is not None:
            if hit[2] == indexed:
                self._join(hit[1], ids)
            return
        if free is not None:
            if free.space is not None and indexed in free.axes:
                self._join(free.space[0], ids)
            return
        if x.mask is None:
            return
        root = self._find(ids)
        if id(root) not in self._anchors:
            self._alive.append(root)
            self._anchors[id(root)] = _anchor_of(x, dims)


# -- counts of constants with plain ids --------------------------------------------------------------
# ``segment_sum(ones_like(w), ids, n)`` and ``jnp.bincount(ids)``: jax traces ``ones_like(w)`` to a
# constant, so the count's equation has no masked operand. Its updates sit along the ids' own axis
# (the edges); an argument of the function masked along that axis (the edge weights ``w``) says which
# of them are padding. Which axes are one axis is read off the whole program: two axes are linked
# where an equation computes one entry of the one from the same entry of the other (an entrywise
# operation, a shape operation, a contraction's batch and free dims, a gather's and a scatter's
# ids and updates).


class _Axes:
    """Union-find over ``(variable, axis)``."""

    def __init__(self):
        self.parent: dict = {}

    def find(self, x):
        while x in self.parent:
            x = self.parent[x]
        return x

    def link(self, a, b):
        a, b = self.find(a), self.find(b)
        if a != b:
            self.parent[a] = b


def _var(v):
    return None if _jaxpr.is_literal(v) else v


def _links(eqn, axes: _Axes, inner) -> None:
    """Link the axes ``eqn`` relates; ``inner``: a call's body, walked with its variables linked to
    the call's."""
    prim, params = eqn.primitive, eqn.params
    ins = [_var(v) for v in eqn.invars]
    outs = eqn.outvars

    def shape(v):
        return tuple(v.aval.shape)

    def link(a, i, b, j):
        if a is not None and b is not None and shape(a)[i] == shape(b)[j] and shape(a)[i] > 1:
            axes.link((a, i), (b, j))

    body = _jaxpr.call_body(eqn)
    if body is not None:
        jaxpr = body[0]
        for v, w in zip(ins, jaxpr.invars):
            for d in range(len(shape(w))):
                link(v, d, w, d)
        inner(jaxpr)
        for v, w in zip(outs, jaxpr.outvars):
            for d in range(len(shape(v))):
                link(v, d, _var(w), d)
        return
    if len(outs) != 1:
        return
    out = outs[0]
    n = len(shape(out))
    if _entrywise(prim) or prim in (P.stop_gradient_p, P.reduce_precision_p, lax.optimization_barrier_p):
        for v in ins:
            if v is not None and len(shape(v)) == n:
                for d in range(n):
                    link(v, d, out, d)
    elif prim is P.broadcast_in_dim_p:
        for d, e in enumerate(params["broadcast_dimensions"]):
            link(ins[0], d, out, e)
    elif prim is P.transpose_p:
        for i, d in enumerate(params["permutation"]):
            link(ins[0], d, out, i)
    elif prim is P.squeeze_p and ins[0] is not None:
        kept = [d for d in range(len(shape(ins[0]))) if d not in params["dimensions"]]
        for i, d in enumerate(kept):
            link(ins[0], d, out, i)
    elif prim is P.reshape_p and ins[0] is not None:
        old = shape(ins[0])
        for d in range(len(old)):
            for j in range(n):
                if old[d] == shape(out)[j] and np.prod(old[:d]) == np.prod(shape(out)[:j]):
                    link(ins[0], d, out, j)
    elif prim in (P.reduce_sum_p, P.reduce_max_p, P.reduce_min_p, P.reduce_prod_p, P.argmax_p, P.argmin_p):
        reduced = tuple(params["axes"])
        kept = [d for d in range(len(shape(ins[0]))) if d not in reduced] if ins[0] is not None else []
        for i, d in enumerate(kept):
            link(ins[0], d, out, i)
    elif prim is P.concatenate_p:
        for v in ins:
            for d in range(n):
                if d != params["dimension"]:
                    link(v, d, out, d)
    elif prim is P.dot_general_p:
        (lc, rc), (lb, rb) = params["dimension_numbers"]
        a, b = ins
        for i, j in zip(lc, rc):
            link(a, i, b, j)
        for k, (i, j) in enumerate(zip(lb, rb)):
            link(a, i, out, k)
            link(b, j, out, k)
        if a is not None and b is not None:
            lf = [d for d in range(len(shape(a))) if d not in lc and d not in lb]
            rf = [d for d in range(len(shape(b))) if d not in rc and d not in rb]
            for k, d in enumerate(lf):
                link(a, d, out, len(lb) + k)
            for k, d in enumerate(rf):
                link(b, d, out, len(lb) + len(lf) + k)
    elif prim is P.gather_p:
        dn = params["dimension_numbers"]
        x, idx = ins
        batch = [i for i in range(n) if i not in dn.offset_dims]
        for k, i in enumerate(batch):
            link(idx, k, out, i)
        kept = [d for d in range(len(shape(eqn.invars[0]))) if d not in dn.collapsed_slice_dims]
        kept = [d for d in kept if d not in dn.operand_batching_dims]
        for d, i in zip(kept, dn.offset_dims):
            link(x, d, out, i)
        for d, j in zip(dn.operand_batching_dims, dn.start_indices_batching_dims):
            link(x, d, idx, j)
    elif prim in _rules.SCATTERS:
        dn = params["dimension_numbers"]
        x, idx, upd = ins
        for d in range(n):
            link(x, d, out, d)
        scatter_dims = [d for d in range(len(shape(eqn.invars[2]))) if d not in dn.update_window_dims]
        for k, d in enumerate(scatter_dims):
            link(idx, k, upd, d)
        for d, j in zip(dn.operand_batching_dims, dn.scatter_indices_batching_dims):
            link(x, d, idx, j)


def counts(jaxpr) -> dict:
    """The scatter-adds with non-literal ids in ``jaxpr`` (and the calls it makes) whose ids'
    axes are axes of arguments of ``jaxpr``: ``{id(equation): (equation, [(argument index, its
    axis for each of the ids' dims), ...])}``, read once before the function runs
    (:class:`_Axes`). The interpreter reads an argument's mask only for a count (constant
    updates) whose ids are plain."""
    axes = _Axes()
    scatters = []

    def find(j):
        for eqn in j.eqns:
            body = _jaxpr.call_body(eqn)
            if body is not None:
                find(body[0])
            elif eqn.primitive is P.scatter_add_p and _var(eqn.invars[1]) is not None:
                scatters.append(eqn)

    def walk(j):
        for eqn in j.eqns:
            _links(eqn, axes, walk)

    find(jaxpr)
    if not scatters:  # (a program with no count pays nothing)
        return {}
    walk(jaxpr)
    found = {}
    classes: dict = {}
    for k, v in enumerate(jaxpr.invars):
        for d in range(len(v.aval.shape)):
            classes.setdefault(axes.find((v, d)), []).append((k, d))
    for eqn in scatters:
        idx = eqn.invars[1]
        dims = range(len(idx.aval.shape) - 1)  # (the last is the index vector)
        options = []
        for k in range(len(jaxpr.invars)):
            at = []
            for d in dims:
                hit = [a for (i, a) in classes.get(axes.find((idx, d)), []) if i == k]
                if not hit:
                    break
                at.append(hit[0])
            else:
                if at and len(set(at)) == len(at):
                    options.append((k, tuple(at)))
        if options:
            found[id(eqn)] = (eqn, options)
    return found


def count_validity(upd_shape, window_dims, arg, at):
    """The validity of a count's constant updates (of ``upd_shape``, slices along
    ``window_dims``) read off the argument ``arg`` masked along the axes ``at`` (one for each of
    the updates' other dims), or ``None`` when its mask does not vary along them."""
    shape = np.shape(arg.data)
    m = ranked(arg.mask, len(shape))
    if arg.mask is None or all(np.shape(m)[a] == 1 for a in at):
        return None
    other = tuple(a for a in range(len(shape)) if a not in at)
    if other:
        m = jnp.any(m, axis=other)
    kept = sorted(at)
    m = jnp.transpose(m, [kept.index(a) for a in at])
    for d in sorted(window_dims):
        m = jnp.expand_dims(m, d)
    return jnp.broadcast_to(m, tuple(1 if d in window_dims else s for d, s in enumerate(upd_shape)))
