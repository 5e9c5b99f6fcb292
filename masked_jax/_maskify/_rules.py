"""Masked rules keyed by JAX primitive object, for :func:`masked_jax.maskify`.

Two kinds of entries, looked up by :func:`rule_for`:

* **derived from the op registry**: every :class:`~masked_jax.ops._registry.OpSpec` lists the
  primitives it answers to; the family's adapter binds the primitive itself for the data (so
  values match ``jax.numpy`` exactly) and takes the semantics from the spec (its ``safe`` value,
  its rule): ``exp_p`` is ``exp``'s rule, ``reduce_sum_p`` is ``sum``'s. A new op registered
  later is picked up at once.
* **structural rules** below, for primitives that are not ops of ``masked_jax.numpy``
  (``select_n``, ``gather``, ``scatter``, ``pad``, ``sort`` with several operands, ...). They
  call the same helpers (``where``, ``clip``, ``passthrough``, ``concatenate``) as the ops do.

A rule takes ``(prim, invals: list[Pair], facts, **params)`` (``facts``: the call's
:class:`~masked_jax.ops._factors.Facts`, which it reads and extends) and returns a ``Pair`` (or a list for
primitives with several results). Rules run only when some operand is masked; otherwise the
interpreter binds the primitive directly.
"""

from __future__ import annotations

import functools

import jax
import jax.extend.core.primitives as P
import jax.numpy as jnp
import numpy as np
from jax import lax

from masked_jax._validate import is_tracer
from masked_jax.ops import _factors, binary, elementwise, linalg, reductions, shape
from masked_jax.ops._base import Pair, and_masks, bound, fill, highest, lowest, materialize, ranked
from masked_jax.ops._factors import NO_FACTS, Facts
from masked_jax.ops._registry import REGISTRY, OpSpec, on_register

STRUCTURAL: dict = {}  # primitive -> rule(prim, invals, facts, **params)
DERIVED: dict = {}  # primitive -> rule, from the registry's specs
OWNER: dict = {}  # primitive -> the name of the op whose spec claims it
NAMED: dict = {}  # name of a jax function's own jit call -> the spec whose rule replaces the call
# jax functions whose jit call is refused by name, with the reason
_NAN_ORDER = (
    "NaN-ignoring order statistics of masked data: mask the NaNs too (a mask AND-ed with ~isnan(x)) "
    "and call jnp.median / jnp.quantile / jnp.percentile"
)
UNSUPPORTED_CALLS = {
    "nanmedian": _NAN_ORDER,
    "nanquantile": _NAN_ORDER,
    "nanpercentile": _NAN_ORDER,
    "trapezoid": "jnp.trapezoid reads the first and last elements by position, which need not be the first and "
    "last valid ones; integrate the valid samples with masked_jax.numpy (a masked sum of the trapezoids)",
}


class NoMaskedRule(Exception):
    """Raised by a rule for a use of its primitive that has no masked meaning; ``maskify`` turns it
    into a ``MaskifyError`` naming the primitive and the function."""


class _Body:
    """The body of a jit call, hashed and compared by its printed program (the recognition cache's
    key) and kept for the candidates to read (``OpSpec.static``)."""

    def __init__(self, closed_jaxpr):
        self.jaxpr, self.program = closed_jaxpr.jaxpr, str(closed_jaxpr)

    def __hash__(self):
        return hash(self.program)

    def __eq__(self, other):
        return isinstance(other, _Body) and other.program == self.program


def recognise(spec: OpSpec, closed_jaxpr, avals):
    """The static keyword arguments ``spec.fn`` was called with, given the body of its jit call and
    the avals of the call's operands; ``None`` when no candidate of ``spec.static`` gives the same
    program."""
    return _recognise(spec.name, _Body(closed_jaxpr), tuple(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in avals))


@functools.lru_cache(maxsize=512)
def _recognise(name, body, structs):
    spec = REGISTRY[name]
    assert spec.static is not None and spec.fn is not None  # only specs with both are recognised
    for kw in spec.static(body.jaxpr, *(s.shape for s in structs)):
        try:
            traced = jax.make_jaxpr(functools.partial(spec.fn, **kw))(*structs)
        except Exception:  # noqa: BLE001 - a candidate jax rejects (an axis out of range) is not the one
            continue
        eqns = traced.jaxpr.eqns
        if len(eqns) == 1 and eqns[0].primitive is P.jit_p and str(eqns[0].params["jaxpr"]) == body.program:
            return kw
    return None


def rule_for(prim):
    """The masked rule of ``prim``, or ``None``."""
    return STRUCTURAL.get(prim) or DERIVED.get(prim)


# -- adapters: a registered op answering to a primitive, by family ---------------------------------
def _elementwise(spec):
    def rule(prim, invals, facts, **params):
        return elementwise.unary(bound(prim, params), spec.safe)(invals[0], _facts=facts)

    return rule


def _binary(spec):
    def rule(prim, invals, facts, **params):
        return binary.nary(bound(prim, params), spec.safe, binary.PRESERVES.get(spec.name, ()))(*invals, _facts=facts)

    return rule


def _linalg(spec):
    def rule(prim, invals, facts, **params):
        if prim is P.dot_general_p:
            a, b = invals
            return linalg.dot_general(bound(prim, params), a, b, params["dimension_numbers"], facts)
        return linalg.contraction(bound(prim, params))(*invals)

    return rule


def _reductions(spec):
    def rule(prim, invals, facts, **params):
        (x,) = invals
        if prim in OVER_NOTHING and reductions.empty_slices(jnp.shape(x.data), params["axes"]):
            return over_nothing(prim, x, params)
        if "reverse" in params:  # cumsum_p, cumprod_p: the op's running rule, the primitive's data
            fn = lambda d, axis=None: prim.bind(d, axis=axis, reverse=params["reverse"])  # noqa: E731
            identity = {"cumsum": 0, "cumprod": 1}[spec.name]
            return reductions.cumulative(fn, identity, spec.name)(x, axis=params["axis"])
        if "index_dtype" in params:  # argmax_p, argmin_p
            out = spec.rule(x, axis=int(params["axes"][0]))
            return Pair(out.data.astype(params["index_dtype"]), out.mask)
        out = spec.rule(x, axis=tuple(params["axes"]), _facts=facts)
        dtype = params.get("out_dtype") or jnp.result_type(x.data)
        return Pair(out.data if spec.name in ("any", "all") else out.data.astype(dtype), out.mask)

    return rule


# reductions with a value over a zero-size slice: their identity (lax's own value there)
OVER_NOTHING = frozenset(
    (P.reduce_sum_p, P.reduce_prod_p, P.reduce_max_p, P.reduce_min_p, P.reduce_or_p, P.reduce_and_p, P.reduce_xor_p)
)


def over_nothing(prim, x: Pair, params) -> Pair:
    """A reduction whose slices have no element at all (a zero-size axis among ``axes``): its
    identity, valid, as ``masked_jax.numpy`` gives it (a sum 0, a product 1, ``any`` False, ``all``
    True; a maximum ``-inf``, the value lax gives it: ``jnp.max`` refuses an empty slice before it
    reaches the primitive, and ``jax.nn.logsumexp`` of nothing reads it to give ``-inf``). No
    element is masked there, so no mask decides. The mask is an all-valid array, not ``None``: a
    mean of nothing (this sum over its element count, 0) is still recognised, and masked."""
    data = prim.bind(x.data, **params)
    return Pair(data, jnp.ones((1,) * np.ndim(data), bool))


ADAPTERS = {"elementwise": _elementwise, "binary": _binary, "linalg": _linalg, "reductions": _reductions}


def _derive(spec: OpSpec, removed: bool = False):
    for prim in [p for p, owner in OWNER.items() if owner == spec.name]:
        DERIVED.pop(prim, None)
        OWNER.pop(prim, None)
    for name in [n for n, s in NAMED.items() if s.name == spec.name]:
        del NAMED[name]
    if removed:
        return
    if spec.static is not None and spec.fn is not None:
        NAMED[spec.fn.__name__] = spec
    for entry in spec.primitives:
        prim, adapter = entry if isinstance(entry, tuple) else (entry, ADAPTERS[spec.family])
        DERIVED[prim] = adapter(spec)
        OWNER[prim] = spec.name


def _select_n(prim, invals, facts, **params):
    """``select_n(pred, *cases)``: data and mask selected together (``where``'s rule)."""
    pred, *cases = invals
    shape = next((jnp.shape(c.data) for c in cases if np.ndim(c.data)), jnp.shape(pred.data))
    if pred.mask is None and np.ndim(pred.data) == 0 and not is_tracer(pred.data):
        # a predicate known when traced (jnp.var's "n - ddof > 0"): the case it picks, as where
        # picks it (a constant case takes the validity of the masked cases), with no select
        chosen = cases[int(pred.data)]
        mask = (
            and_masks(*(c.mask for c in cases if not binary.is_constant(c)), facts=facts)
            if binary.is_constant(chosen)
            else chosen.mask
        )
        data = chosen.data if np.shape(chosen.data) == tuple(shape) else jnp.broadcast_to(chosen.data, shape)
        return Pair(data, mask)
    if len(cases) == 2:  # select_n(p, false_case, true_case) is where(p, true_case, false_case)
        return binary.where(pred, cases[1], cases[0], _facts=facts)
    data = prim.bind(pred.data, *(jnp.broadcast_to(c.data, shape) for c in cases))
    # as in where: a constant case takes the validity of the masked cases it is combined with
    masked_cases = and_masks(*(c.mask for c in cases if not binary.is_constant(c)), facts=facts)
    masks = [materialize(masked_cases if binary.is_constant(c) else c.mask, shape) for c in cases]
    return Pair(data, and_masks(pred.mask, prim.bind(pred.data, *masks), facts=facts))


def _clamp(prim, invals, facts, **params):
    lo, x, hi = invals
    return binary.clip(x, lo, hi)


STRUCTURAL.update({P.select_n_p: _select_n, P.clamp_p: _clamp})


# -- running reductions without a masked_jax.numpy twin ------------------------------------------
def _cumulative(identity):
    def rule(prim, invals, facts, axis, reverse):
        (x,) = invals
        fn = lambda d, axis=None: prim.bind(d, axis=axis, reverse=reverse)  # noqa: E731
        return reductions.cumulative(fn, identity, prim.name)(x, axis=axis)

    return rule


STRUCTURAL.update(
    {P.cummax_p: _cumulative(lowest), P.cummin_p: _cumulative(highest), P.cumlogsumexp_p: _cumulative(lowest)}
)  # -inf (the finite min where there is no inf)


# -- shape and indexing: the mask moves with the data ---------------------------------------------
def _passthrough(prim, invals, facts, **params):
    """A shape op of one array operand (reshape, transpose, broadcast_in_dim, slice, rev, ...);
    further operands (dynamic sizes, start indices) must be unmasked and are passed to both."""
    x, *rest = invals
    _require_valid(prim, rest)
    extra = [r.data for r in rest]
    return shape.passthrough(lambda d: prim.bind(d, *extra, **params))(x)


def compact_shape_op(prim, invals, facts, **params):
    """Shape primitives that keep a compact mask compact (see :func:`compact_shape`); the others,
    and a reshape that cannot keep it compact, materialise the mask."""
    x = invals[0]
    shape = jnp.shape(x.data)
    m = ranked(x.mask, len(shape), facts)
    if m is None or len(invals) > 1:
        return _passthrough(prim, invals, facts, **params)
    new = compact_shape(prim, params, m, shape, facts)
    if new is None:
        return _passthrough(prim, invals, facts, **params)
    data = prim.bind(x.data, **params)
    k = facts.known(x.data, x.mask, conditional=True)
    if k is not None:  # the masked entries move with the mask: they hold what they held
        facts.record_value(data, new, k.value, k.exact, k.conditional)
    return Pair(data, new)


def compact_shape(prim, params, m, shape, facts: Facts = NO_FACTS):
    """``m`` (compact, at the rank of data of ``shape``) as the compact array for the data after
    the shape primitive ``prim``, or ``None`` where it must be materialised: ``transpose`` and
    ``squeeze`` act on it as on the data, ``broadcast_in_dim`` broadcasts it only along the dims it
    already has, ``reshape`` keeps it compact where each group of merged or split dims is all 1 or
    all full in it. With ``facts`` the result's factors are recorded (see
    :mod:`masked_jax.ops._factors`)."""
    fs = facts.factors(m) if facts.active else None
    if prim is P.transpose_p:
        return facts.record(prim.bind(m, **params), fs and _factors.transposed(fs, params["permutation"]))
    if prim is P.squeeze_p:
        return facts.record(prim.bind(m, **params), fs and _factors.dropped(fs, params["dimensions"]))
    if prim is P.broadcast_in_dim_p:
        out = [1] * len(params["shape"])
        for i, d in enumerate(params["broadcast_dimensions"]):
            out[d] = m.shape[i]
        new = jax.lax.broadcast_in_dim(m, tuple(out), params["broadcast_dimensions"])
        return facts.record(new, fs and _factors.broadcast(fs, len(out), params["broadcast_dimensions"]))
    if prim is P.reshape_p and params.get("dimensions") is None:
        new = _reshaped_compact(m, shape, tuple(params["new_sizes"]))
        return new if new is None else facts.record(new, fs and _factors.reshaped(fs, m.shape, new.shape))
    return None


def _reshaped_compact(m, old, new):
    """``m`` (compact, for data of shape ``old``) reshaped for data of shape ``new``, or ``None``
    when a group of dims that the reshape merges or splits is partly compact."""
    if 0 in old or 0 in new:
        return None
    out, i, j = [], 0, 0
    while i < len(old) or j < len(new):
        gi, gj = [i], [j]  # the smallest groups of old and new dims with equal sizes
        po, pn = (old[i] if i < len(old) else 1), (new[j] if j < len(new) else 1)
        i, j = i + 1, j + 1
        while po != pn:
            if po < pn:
                if i >= len(old):
                    return None
                po *= old[i]
                gi.append(i)
                i += 1
            else:
                if j >= len(new):
                    return None
                pn *= new[j]
                gj.append(j)
                j += 1
        sizes = [m.shape[k] for k in gi if k < len(old)]
        if all(sz == 1 for sz in sizes):
            out += [1] * len([k for k in gj if k < len(new)])
        elif all(m.shape[k] == old[k] for k in gi if k < len(old)):
            out += [new[k] for k in gj if k < len(new)]
        else:
            return None
    return jnp.reshape(m, tuple(out)) if len(out) == len(new) else None


def _require_valid(prim, operands, what="index"):
    if any(o.mask is not None for o in operands):
        raise NoMaskedRule(f"its {what} operands are masked (a masked {what} selects no defined element)")


def _concatenate(prim, invals, facts, dimension):
    return shape.concatenate(invals, axis=dimension)


def _pad(prim, invals, facts, padding_config):
    x, value = invals
    data = prim.bind(x.data, value.data, padding_config=padding_config)
    if x.mask is None and value.mask is None:
        return Pair(data, None)
    m = materialize(x.mask, jnp.shape(x.data))
    fill_valid = jnp.asarray(True) if value.mask is None else value.mask
    return Pair(data, prim.bind(m, fill_valid, padding_config=padding_config))  # constant padding: valid


def _gather(prim, invals, facts, **params):
    """Rows (slices) move with their mask; a masked index gives a masked slice that reads nothing
    (the gather turns into fill mode with an out-of-range start there, so no slice is read and no
    gradient goes anywhere, also for row-sparse gradients); out of range in fill mode: masked.
    The mask stays compact: a (N, 1) row mask gathers to (E, 1), and the indices' validity and
    range are laid along the output's batch dims."""
    x, idx = invals
    idx_data = idx.data
    dn, shape = params["dimension_numbers"], jnp.shape(x.data)
    fill_mode = params["mode"] == lax.GatherScatterMode.FILL_OR_DROP
    if idx.mask is not None:
        if not fill_mode:  # clamp in-range as the original mode does
            hi = jnp.array([shape[d] - params["slice_sizes"][d] for d in dn.start_index_map], idx_data.dtype)
            idx_data = jnp.clip(idx_data, 0, hi)
        params = {**params, "mode": lax.GatherScatterMode.FILL_OR_DROP, "fill_value": 0}  # masked: any data
        whole = jnp.all(materialize(idx.mask, jnp.shape(idx_data)), axis=-1, keepdims=True)
        idx_data = jnp.where(whole, idx_data, -1)
    data = prim.bind(x.data, idx_data, **params)

    def along_batch(v):  # a (batch...) validity of the indices, at the output's rank
        return jnp.expand_dims(v, dn.offset_dims)

    masks = []
    if x.mask is not None:
        m = ranked(x.mask, len(shape))
        # dims the mask does not vary along keep size 1, unless the gather indexes them
        indexed = set(dn.start_index_map) | set(dn.operand_batching_dims)
        m = jnp.broadcast_to(m, tuple(n if d in indexed else np.shape(m)[d] for d, n in enumerate(shape)))
        sizes = tuple(1 if np.shape(m)[d] == 1 else k for d, k in enumerate(params["slice_sizes"]))
        masks.append(prim.bind(m, idx_data, **{**params, "slice_sizes": sizes, "fill_value": False}))
    if fill_mode:  # out of range: masked
        hi = jnp.array([shape[d] - params["slice_sizes"][d] for d in dn.start_index_map], idx.data.dtype)
        masks.append(along_batch(jnp.all((idx.data >= 0) & (idx.data <= hi), axis=-1)))
    if idx.mask is not None:  # output dims: the indices' batch dims, with the slice (offset) dims inserted
        masks.append(along_batch(jnp.all(materialize(idx.mask, jnp.shape(idx.data)), axis=-1)))
    return Pair(data, and_masks(*masks))


def _conv(prim, invals, facts, **params):
    """A convolution of a masked input with a plain kernel follows the unpadded reference: masked
    taps read as zeros, as the convolution's own padding, and an output is valid iff every tap it
    reads is valid, outside the array, or a masked tap the convolution's padding would cover in a
    run on the valid region alone (within ``pad_lo`` before it or ``pad_hi`` after it, per spatial
    dim). For a right-padded sequence that is exactly the outputs of the per-sequence run on the
    unpadded tokens, for every padding, stride and dilation. A masked kernel, or an input
    dilation (a transposed convolution), takes the partial-convolution rule: valid where one
    jointly valid tap exists."""
    lhs, rhs = invals
    if (
        rhs.mask is not None
        or any(d != 1 for d in params["lhs_dilation"])
        or params["batch_group_count"] != 1
        or any(p < 0 for pair in params["padding"] for p in pair)
    ):
        return linalg.contraction(bound(prim, params))(*invals)
    dn = params["dimension_numbers"]
    lhs_spec = dn.lhs_spec
    shape = jnp.shape(lhs.data)
    spatial, pads = lhs_spec[2:], params["padding"]
    m = ranked(lhs.mask, len(shape))
    m = jnp.all(m, axis=lhs_spec[1], keepdims=True)  # a position is valid where all its channels are
    m = jnp.broadcast_to(m, tuple(shape[d] if d in spatial else m.shape[d] for d in range(len(shape))))
    # where the run on the valid region alone would have its padding: valid positions dilated by
    # (pad_lo forward, pad_hi backward) along each spatial dim
    window = [1] * len(shape)
    offsets = [(0, 0)] * len(shape)
    for d, (lo, hi) in zip(spatial, pads):
        window[d] = lo + hi + 1
        offsets[d] = (lo, hi)
    # on the array extended by the convolution's padding: a padding position far from the valid
    # region (past a short sequence's end) is not the unpadded run's padding
    m = jnp.pad(m, offsets, constant_values=False)
    allowed = jax.lax.reduce_window(
        m, False, jax.lax.bitwise_or, tuple(window), (1,) * len(shape), tuple((hi, lo) for lo, hi in offsets)
    )
    kernel_shape = [1] * len(shape)  # one input and one output feature, the kernel's window
    for d in dn.rhs_spec[2:]:
        kernel_shape[d] = jnp.shape(rhs.data)[d]
    bad = jax.lax.conv_general_dilated(
        (~allowed).astype(jnp.float32),
        jnp.ones(tuple(kernel_shape), jnp.float32),
        params["window_strides"],
        [(0, 0)] * len(pads),
        rhs_dilation=params["rhs_dilation"],
        dimension_numbers=dn,
    )
    data = prim.bind(fill(lhs.data, lhs.mask, 0), rhs.data, **params)
    return Pair(data, bad == 0)


def _reduce_window(identity):
    """Pooling over the valid elements of each window (masked ones enter as the reduction's identity);
    a window with no valid element is masked."""

    def rule(prim, invals, facts, **params):
        (x,) = invals
        m = materialize(x.mask, jnp.shape(x.data))
        data = prim.bind(fill(x.data, m, identity(jnp.result_type(x.data))), **params)
        return Pair(data, window_count(m, params) > 0)

    return rule


def window_count(mask, params):
    """The number of valid elements in each window of ``reduce_window_*`` with ``params``."""
    return P.reduce_window_sum_p.bind(mask.astype(jnp.int32), **params)


def _same_value(prim, invals, facts, **params):
    """Primitives that return their operands' values (barriers, placement): masks unchanged."""
    outs = prim.bind(*(p.data for p in invals), **params)
    if not prim.multiple_results:
        return Pair(outs, invals[0].mask)
    return [Pair(o, p.mask) for o, p in zip(outs, invals)]


def _reduce_xor(prim, invals, facts, axes, **params):
    (x,) = invals
    if reductions.empty_slices(jnp.shape(x.data), axes):
        return over_nothing(prim, x, dict(params, axes=axes))
    m = materialize(x.mask, jnp.shape(x.data))
    return Pair(prim.bind(fill(x.data, m, 0), axes=axes, **params), jnp.any(m, axis=tuple(axes)))


def _dynamic_update_slice(prim, invals, facts):
    x, upd, *idx = invals
    _require_valid(prim, idx)
    data = prim.bind(x.data, upd.data, *(i.data for i in idx))
    if x.mask is None and upd.mask is None:
        return Pair(data, None)
    m = prim.bind(
        materialize(x.mask, jnp.shape(x.data)), materialize(upd.mask, jnp.shape(upd.data)), *(i.data for i in idx)
    )
    return Pair(data, m)  # as .at[].set: the update's validity is copied


SCATTERS = {  # scatter primitive -> the identity of its combination (None: a plain scatter, .at[].set)
    P.scatter_p: None,
    P.scatter_add_p: lambda dtype: 0,
    P.scatter_mul_p: lambda dtype: 1,
    P.scatter_min_p: highest,
    P.scatter_max_p: lowest,
}


def _scatter(prim, invals, facts, **params):
    return scatter(prim, params, invals)[0]


def scatter(prim, params, invals, frees=(None, None, None), buffer_is_constant=False):
    """A scatter as a masked reduction: ``(Pair, free positions)`` (see :mod:`masked_jax._maskify._free`;
    ``frees``: the operands' free positions, ``buffer_is_constant``: the operand is computed from
    literals alone).

    ``scatter-add`` / ``-mul`` / ``-min`` / ``-max`` combine, at each position, the operand's
    element with the *valid* updates that reach it; an update with a masked index (any component)
    or masked data is dropped. A position keeps the validity of the operand's element; a position
    of a constant operand (a ``segment_sum``'s zeros) that no valid update reached is free. A plain ``scatter`` (``.at[].set``) copies the written updates'
    validity (and freedom), and drops the updates with a masked index."""
    x, idx, upd = invals
    fx, _, fu = frees
    dn, mode = params["dimension_numbers"], params["mode"]
    x_shape, idx_data, upd_shape = jnp.shape(x.data), idx.data, jnp.shape(upd.data)
    window = tuple(dn.update_window_dims)  # the updates' dims that are slices of the operand
    operand_window = [
        d for d in range(len(x_shape)) if d not in dn.inserted_window_dims and d not in dn.operand_batching_dims
    ]
    um = ranked(upd.mask, len(upd_shape))  # compact: (E, 1) for whole update rows
    if idx.mask is not None:
        # an update whose index has a masked component is dropped: its start moves out of range
        dropped = ~jnp.all(materialize(idx.mask, jnp.shape(idx_data)), axis=-1)
        if mode == lax.GatherScatterMode.CLIP:  # clamp the kept ones in range as the original mode does
            hi = jnp.array([x_shape[d] - 1 for d in dn.scatter_dims_to_operand_dims], jnp.result_type(idx_data))
            idx_data = jnp.clip(idx_data, 0, hi)
        out_of_range = jnp.array([x_shape[d] for d in dn.scatter_dims_to_operand_dims], jnp.result_type(idx_data))
        idx_data = jnp.where(dropped[..., None], out_of_range, idx_data)
        params = {**params, "mode": lax.GatherScatterMode.FILL_OR_DROP}
        keep = jnp.expand_dims(~dropped, window)  # the updates of a dropped index: masked
        um = keep if um is None else um & keep
    identity = SCATTERS[prim]
    set_params = _scatter_params(params)
    if um is None:
        um = jnp.ones((1,) * len(upd_shape), bool)
    xm = ranked(x.mask, len(x_shape))
    # the masks at a compact shape: size 1 along the slices' dims when no mask varies along them
    compact = (
        fx is None
        and fu is None
        and all(np.shape(um)[d] == 1 for d in window)
        and (xm is None or all(np.shape(xm)[d] == 1 for d in operand_window))
    )
    cs = tuple(1 if compact and d in operand_window else n for d, n in enumerate(x_shape))
    us = tuple(1 if compact and d in window else n for d, n in enumerate(upd_shape))
    um_c = jnp.broadcast_to(um, us)
    xm_c = jnp.ones(cs, bool) if xm is None else jnp.broadcast_to(xm, cs)
    fx_c = (jnp.full(cs, buffer_is_constant) if x.mask is None else jnp.zeros(cs, bool)) if fx is None else fx
    fx_c = jnp.broadcast_to(fx_c, cs)
    if identity is None:  # .at[].set: the written positions take the update's validity
        data = prim.bind(x.data, idx_data, upd.data, **params)
        written = lax.scatter(jnp.zeros(cs, bool), idx_data, jnp.ones(us, bool), **set_params)
        mask = lax.scatter(xm_c, idx_data, um_c, **set_params)
        fu_c = jnp.zeros(us, bool) if fu is None else jnp.broadcast_to(fu, us)
        free = jnp.where(written, lax.scatter(jnp.zeros(cs, bool), idx_data, fu_c, **set_params), fx_c)
        return Pair(data, mask), free
    ident = identity(jnp.result_type(upd.data))
    data = prim.bind(fill(x.data, x.mask, ident), idx_data, fill(upd.data, um, ident), **params)
    # a free update (a constant no valid term reached) adds its value but makes nothing valid
    counted = um_c if fu is None else um_c & ~jnp.broadcast_to(fu, us)
    reached = lax.scatter_add(jnp.zeros(cs, jnp.int32), idx_data, counted.astype(jnp.int32), **set_params) > 0
    # an element keeps its own validity (a masked one stays masked); a constant buffer's element is
    # valid where a valid update reached it, and free where none did
    return Pair(data, xm_c), fx_c & ~reached


def _scatter_params(params):
    return {k: params[k] for k in ("dimension_numbers", "indices_are_sorted", "unique_indices", "mode")}


def _sort(prim, invals, facts, dimension, is_stable, num_keys):
    """Masked elements of the first key go last (as ``mnp.sort``); the other operands (argsort's
    iota) follow their keys, masks too."""
    if num_keys != 1:
        raise NoMaskedRule("a sort with several keys (lexsort) has no masked order")
    key = invals[0]
    m = materialize(key.mask, jnp.shape(key.data))
    masks = [materialize(o.mask, jnp.shape(o.data)) for o in invals]
    outs = lax.sort([~m, *(o.data for o in invals), *masks], dimension=dimension, is_stable=True, num_keys=2)
    n = len(invals)
    return [Pair(d, mk) for d, mk in zip(outs[1 : 1 + n], outs[1 + n :])]


def _top_k(prim, invals, facts, k, **params):
    (x,) = invals
    m = materialize(x.mask, jnp.shape(x.data))
    vals, idx = prim.bind(fill(x.data, m, lowest(jnp.result_type(x.data))), k=k, **params)
    valid = jnp.take_along_axis(m, idx, axis=-1)
    return [Pair(vals, valid), Pair(idx, valid)]


def _split(prim, invals, facts, sizes, axis):
    (x,) = invals
    datas = prim.bind(x.data, sizes=sizes, axis=axis)
    if x.mask is None:
        return [Pair(d, None) for d in datas]
    masks = prim.bind(materialize(x.mask, jnp.shape(x.data)), sizes=sizes, axis=axis)
    return [Pair(d, mk) for d, mk in zip(datas, masks)]


def _stack(prim, invals, facts, axis):
    return shape.stack(invals, axis=axis)


def staged_primitive(name, fn, *args):
    """The primitive ``fn`` stages, for primitives this jax has but does not export (``stack``,
    ``split``, ``tile`` in some versions); ``None`` when ``fn`` is not one primitive named ``name``
    (any name when ``name`` is ``None``)."""
    eqns = jax.make_jaxpr(fn)(*args).eqns
    return eqns[0].primitive if len(eqns) == 1 and name in (None, eqns[0].primitive.name) else None


def _debug(prim, invals, facts, **params):
    """Debug output (``jax.debug.print``, ``jax.debug.callback``) sees the stored data of masked
    operands, masked-out entries included: it only observes, and returns nothing."""
    return prim.bind(*(p.data for p in invals), **params)


def _pure_callback(prim, invals, facts, result_avals, **params):
    """A host function is opaque: any of its outputs may depend on any input element. It is called
    on the stored data; its outputs are valid only where every element of every input is valid
    (all or nothing per call). Fill the inputs first to get valid outputs from partly masked ones."""
    outs = prim.bind(*(p.data for p in invals), result_avals=result_avals, **params)
    ok = functools.reduce(jnp.logical_and, [jnp.all(p.mask) for p in invals if p.mask is not None], jnp.asarray(True))
    return [Pair(o, jnp.broadcast_to(ok, jnp.shape(o))) for o in outs]


_ONES = jax.ShapeDtypeStruct((4,), jnp.float32)  # (abstract: importing the library starts no XLA backend)
STACK_P = _STACK_P = staged_primitive("stack", lambda a, b: jnp.stack([a, b]), _ONES, _ONES)
SPLIT_P = _SPLIT_P = staged_primitive("split", lambda a: jnp.split(a, 2), _ONES)
_TILE_P = staged_primitive("tile", lambda a: jnp.tile(a, 2), _ONES)
_DEBUG_PRINT_P = staged_primitive("debug_print", lambda a: jax.debug.print("{}", a), _ONES)
_DEBUG_CALLBACK_P = staged_primitive("debug_callback", lambda a: jax.debug.callback(lambda _: None, a), _ONES)
_PURE_CALLBACK_P = staged_primitive(
    "pure_callback", lambda a: jax.pure_callback(lambda b: b, jax.ShapeDtypeStruct((4,), jnp.float32), a), _ONES
)

_PASSTHROUGH = [P.rev_p, P.slice_p, P.dynamic_slice_p, _TILE_P]
STRUCTURAL.update({prim: _passthrough for prim in _PASSTHROUGH if prim is not None})
STRUCTURAL.update({prim: compact_shape_op for prim in (P.reshape_p, P.transpose_p, P.broadcast_in_dim_p, P.squeeze_p)})
STRUCTURAL.update(
    {
        P.conv_general_dilated_p: _conv,
        P.reduce_window_sum_p: _reduce_window(lambda d: 0),
        P.reduce_window_max_p: _reduce_window(lowest),
        P.reduce_window_min_p: _reduce_window(highest),
        P.reduce_xor_p: _reduce_xor,
        lax.optimization_barrier_p: _same_value,
        P.sharding_constraint_p: _same_value,
        P.device_put_p: _same_value,
    }
)
STRUCTURAL.update(
    {
        P.concatenate_p: _concatenate,
        P.pad_p: _pad,
        P.gather_p: _gather,
        P.dynamic_update_slice_p: _dynamic_update_slice,
        P.sort_p: _sort,
        P.top_k_p: _top_k,
    }
)
STRUCTURAL.update(
    {
        prim: rule
        for prim, rule in (
            (_STACK_P, _stack),
            (_SPLIT_P, _split),
            (_DEBUG_PRINT_P, _debug),
            (_DEBUG_CALLBACK_P, _debug),
            (_PURE_CALLBACK_P, _pure_callback),
        )
        if prim is not None
    }
)
for _prim in (P.scatter_p, P.scatter_add_p, P.scatter_mul_p, P.scatter_min_p, P.scatter_max_p):
    STRUCTURAL[_prim] = _scatter

# Not supported, with the reason (shown in the MaskifyError and in the docs).
_DECOMPOSITION = "matrix decompositions of partly missing matrices are undefined; fill the matrix first"
UNSUPPORTED = {
    P.fft_p: "an FFT mixes every element; masked-out elements have no defined contribution",
    P.reduce_window_p: "a window reduction with a custom reducer has no masked identity; use sum, max or min",
    P.cholesky_p: _DECOMPOSITION,
    P.eigh_p: _DECOMPOSITION,
    P.lu_p: _DECOMPOSITION,
    P.qr_p: _DECOMPOSITION,
    P.svd_p: _DECOMPOSITION,
    P.triangular_solve_p: "solves with partly missing matrices are undefined; fill the matrix first",
    P.linear_solve_p: "solves with partly missing matrices are undefined; fill the matrix first",
    P.psum_p: "collectives: use the sharding support of masked arrays instead",
    P.all_gather_p: "collectives: use the sharding support of masked arrays instead",
}

on_register(_derive)
del _prim
