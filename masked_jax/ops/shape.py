"""Shape, indexing and reordering rules: the mask moves with the data.

The passthrough rule is the whole idea: apply the same shape op to the data
and to the mask. Rules that need more (sort puts masked elements last, pad
decides the validity of padding, ``.at[]`` updates) are written out below.
"""

from __future__ import annotations

import inspect

import jax
import jax.numpy as jnp
import numpy as np

from masked_jax.ops._base import Pair, and_masks, candidate_axes, fill, materialize, normalize_axis
from masked_jax.ops._registry import OpSpec, register, signature_of


def _full(x: Pair):
    """The mask at the data's shape (None stays None)."""
    return None if x.mask is None else materialize(x.mask, jnp.shape(x.data))


def passthrough(fn):
    """Rule for a shape op ``fn(array, *args, **kwargs)`` applied to data and mask alike."""

    def rule(x: Pair, *args, **kwargs) -> Pair:
        m = _full(x)
        return Pair(fn(x.data, *args, **kwargs), None if m is None else fn(m, *args, **kwargs))

    rule.__name__ = getattr(fn, "__name__", "passthrough")
    rule.__dict__["fn"] = fn  # the function the rule applies, for maskify's recognisers
    return rule


def split(x: Pair, indices_or_sections, axis=0) -> list[Pair]:
    datas = jnp.split(x.data, indices_or_sections, axis=axis)
    m = _full(x)
    masks = [None] * len(datas) if m is None else jnp.split(m, indices_or_sections, axis=axis)
    return [Pair(d, mk) for d, mk in zip(datas, masks)]


def _join(fn, pairs, axis):
    data = fn([p.data for p in pairs], axis=axis)
    if all(p.mask is None for p in pairs):
        return Pair(data, None)
    return Pair(data, fn([materialize(p.mask, jnp.shape(p.data)) for p in pairs], axis=axis))


def concatenate(pairs, axis=0) -> Pair:
    return _join(jnp.concatenate, pairs, axis)


def stack(pairs, axis=0) -> Pair:
    return _join(jnp.stack, pairs, axis)


PAD_MODES = ("constant", "edge", "wrap", "reflect", "symmetric", "empty")


def pad(x: Pair, pad_width, mode="constant", **kwargs) -> Pair:
    """Pad data and mask. Constant padding is valid (its value is given); ``empty`` padding is
    masked; ``edge``/``wrap``/``reflect``/``symmetric`` copy validity with the values."""
    if mode not in PAD_MODES:
        raise ValueError(
            f"pad mode must be one of {PAD_MODES} for masked arrays; got {mode!r} (statistic "
            "modes would read masked-out values)."
        )
    m = _full(x)
    data = jnp.pad(fill(x.data, m, 0) if m is not None else x.data, pad_width, mode=mode, **kwargs)
    if mode == "empty":
        m = materialize(m, jnp.shape(x.data))
        return Pair(data, jnp.pad(m, pad_width, mode="constant", constant_values=False))
    if m is None:
        return Pair(data, None)
    if mode == "constant":
        return Pair(data, jnp.pad(m, pad_width, mode="constant", constant_values=True))
    return Pair(data, jnp.pad(m, pad_width, mode=mode))


def take(x: Pair, indices, axis=None, mode=None, fill_value=None) -> Pair:
    """``jnp.take``; out-of-range indices in the default ``"fill"`` mode give masked elements, and so
    do masked indices (a masked array of indices: its masked entries read nothing)."""
    indices, valid_index = _split_indices(indices)
    data = jnp.take(x.data, indices, axis=axis, mode=mode, fill_value=fill_value)
    m = materialize(x.mask, jnp.shape(x.data))
    if mode in (None, "fill"):
        mask = jnp.take(m, indices, axis=axis, mode="fill", fill_value=False)
    else:
        mask = jnp.take(m, indices, axis=axis, mode=mode)
    if valid_index is not None:  # the index's validity, at the output axes the index spans
        before = 0 if axis is None else normalize_axis(axis, jnp.ndim(x.data))[0]
        after = jnp.ndim(mask) - before - jnp.ndim(valid_index)
        mask = mask & valid_index.reshape((1,) * before + valid_index.shape + (1,) * after)
    return Pair(data, mask)


def take_along_axis(x: Pair, indices, axis=-1, mode=None, fill_value=None) -> Pair:
    """``jnp.take_along_axis``; out-of-range indices in the default ``"fill"`` mode are masked, and
    so are masked indices."""
    indices, valid_index = _split_indices(indices)
    data = jnp.take_along_axis(x.data, indices, axis=axis, mode=mode, fill_value=fill_value)
    m = materialize(x.mask, jnp.shape(x.data))
    fill_mode = mode in (None, "fill")
    mask = jnp.take_along_axis(m, indices, axis=axis, mode=mode, fill_value=False if fill_mode else None)
    return Pair(data, and_masks(mask, valid_index))


def _split_indices(indices):
    """``(positions, validity)`` of integer indices: a plain array has validity ``None``; a masked
    one (a ``MaskedArray`` or a ``Pair``) reads position 0 at its masked entries, whose outputs the
    caller masks with the validity."""
    valid = None
    if isinstance(indices, Pair) or hasattr(indices, "mask"):
        if not hasattr(indices, "data"):
            raise TypeError(
                f"indices must be an integer array or a masked array of them; got {type(indices).__name__}."
            )
        indices, valid = jnp.asarray(indices.data), indices.mask
    dtype = jnp.result_type(indices)
    if not jnp.issubdtype(dtype, jnp.integer):
        raise TypeError(f"indices must be integers; got dtype {dtype}.")
    if valid is None:
        return indices, None
    valid = materialize(valid, jnp.shape(indices))
    return jnp.where(valid, indices, 0), valid


def atleast(fn):
    """``atleast_1d`` / ``atleast_2d`` of one or several operands."""

    def rule(*pairs: Pair):
        outs = [passthrough(fn)(p) for p in pairs]
        return outs[0] if len(outs) == 1 else outs

    rule.__name__ = fn.__name__
    return rule


def _sort_operands(x: Pair, axis, descending):
    """Sort keys and the values to carry, as ``jnp.sort`` arranges them: ascending, masked last;
    descending is jnp's reversed ascending sort (NaN first), masked still last. For the
    descending sort the keys put masked entries *first* and the caller reverses the result."""
    data = jnp.asarray(x.data)
    m = materialize(x.mask, data.shape)
    if axis is None:
        data, m = data.ravel(), m.ravel()
        axis = 0
    (axis,) = normalize_axis(axis, data.ndim)
    data = fill(data, m, 0)
    first = m if descending else ~m  # the key that sorts masked entries to the far end
    return [first.astype(jnp.int8), data], data, axis


def sort(x: Pair, axis=-1, *, stable=True, descending=False) -> Pair:
    """Sort valid elements (ascending, or descending with ``descending=True`` as jnp's reversed
    ascending sort); masked elements go last either way (as ``numpy.ma.sort``). Always stable."""
    keys, data, axis = _sort_operands(x, axis, descending)
    outs = jax.lax.sort((*keys, data), dimension=axis, num_keys=len(keys), is_stable=True)
    valid, out = (outs[0] == 1, outs[-1]) if descending else (outs[0] == 0, outs[-1])
    if descending:
        valid, out = jax.lax.rev(valid, (axis,)), jax.lax.rev(out, (axis,))
    return Pair(out, valid)


def argsort(x: Pair, axis=-1, *, stable=True, descending=False, dtype=None):
    """Indices that sort valid elements (ascending or descending), masked ones last (a plain int
    array of jnp's index dtype). Equal valid elements keep their order, descending too (as jnp's
    stable descending argsort: reverse, sort, reverse)."""
    keys, data, axis = _sort_operands(x, axis, descending)
    idx_dtype = dtype or jax.eval_shape(lambda d: jnp.argsort(d, axis=axis), data).dtype
    iota = jax.lax.broadcasted_iota(idx_dtype, data.shape, axis)
    if descending:
        keys, iota = [jax.lax.rev(k, (axis,)) for k in keys], jax.lax.rev(iota, (axis,))
    out = jax.lax.sort((*keys, iota), dimension=axis, num_keys=len(keys), is_stable=True)[-1]
    return jax.lax.rev(out, (axis,)) if descending else out


def _check_kth(x: Pair, kth, axis):
    (ax,) = normalize_axis(axis, np.ndim(x.data))
    n = np.shape(x.data)[ax]
    if not isinstance(kth, (int, np.integer)) or not -n <= kth < n:
        raise ValueError(f"partition: kth must be an int in [{-n}, {n}) for an axis of length {n}; got {kth!r}.")


def partition(x: Pair, kth, axis=-1) -> Pair:
    """Valid elements partitioned around position ``kth``, masked elements last. The masked result
    is the sorted one (a partition whose every position is in order), so position ``kth`` holds
    the element a sort would put there, as in ``jnp.partition``."""
    _check_kth(x, kth, axis)
    return sort(x, axis)


def argpartition(x: Pair, kth, axis=-1):
    """Indices that partition ``x`` around ``kth`` (those of :func:`partition`): a plain int array."""
    _check_kth(x, kth, axis)
    return argsort(x, axis, dtype=jax.eval_shape(lambda d: jnp.argpartition(d, kth, axis), jnp.asarray(x.data)).dtype)


def getitem(x: Pair, index) -> Pair:
    """``x[index]``. Integer array parts gather: an id out of range (which jax would clamp to the
    last row) gives a masked element, and the result has a mask. The caller raises
    ``IndexError`` for ids out of range that it can see (concrete ones)."""
    m = _full(x)
    data = jnp.asarray(x.data)
    if not gathers(index):
        return Pair(data[index], None if m is None else m[index])
    m = jnp.ones(data.shape, bool) if m is None else m
    return Pair(data.at[index].get(mode="fill", fill_value=0), m.at[index].get(mode="fill", fill_value=False))


def gathers(index) -> bool:
    """Whether ``index`` has an integer array part (a gather, which jax clamps out of range)."""
    parts = index if isinstance(index, tuple) else (index,)
    return any(_is_int_array(p) for p in parts)


def _is_int_array(p) -> bool:
    """An integer array index part (0-d included; a Python int is static, not an array)."""
    return isinstance(p, (jax.Array, np.ndarray)) and jnp.issubdtype(p.dtype, jnp.integer)


_AT_FILL = {"add": 0, "multiply": 1, "min": None, "max": None}


def at_update(x: Pair, index, op: str, value: Pair, **kwargs) -> Pair:
    """``x.at[index].<op>(value)``. ``set`` copies the value's validity (a valid value makes the
    element valid); ``add``/``multiply``/``min``/``max`` leave an element valid only where both the
    element and every value applied to it are valid."""
    data = jnp.asarray(x.data)
    m = materialize(x.mask, data.shape)
    if op in _AT_FILL:  # sanitise on entry: a masked element enters as the op's identity (or 0)
        data = fill(data, m, _AT_FILL[op] if _AT_FILL[op] is not None else 0)
    if op == "set":
        vmask = True if value.mask is None else value.mask
        return Pair(data.at[index].set(value.data, **kwargs), m.at[index].set(vmask, **kwargs))
    if op not in _AT_FILL:
        raise ValueError(f"unsupported .at[] operation {op!r}; expected set, add, multiply, min or max.")
    vdata = jnp.asarray(value.data)
    if value.mask is None:
        return Pair(getattr(data.at[index], op)(vdata, **kwargs), m)
    # An element touched by a masked value becomes masked, so for min/max its
    # data does not matter; add/multiply use their identity to stay finite.
    if _AT_FILL[op] is not None:
        vdata = fill(vdata, value.mask, _AT_FILL[op])
    new = getattr(data.at[index], op)(vdata, **kwargs)
    vm = jnp.broadcast_to(value.mask, jnp.shape(data[index])).astype(jnp.int8)
    mask = m.astype(jnp.int8).at[index].min(vm, **kwargs) > 0
    return Pair(new, mask)


def _shape_op(name, rule, jax_fn, *, methods=(), sequence=False, signature=None, operands=None, **kw):
    sig = signature or signature_of(jax_fn, drop=("out_sharding",))
    first = next(iter(sig.parameters))
    first = "*" + first if sig.parameters[first].kind is inspect.Parameter.VAR_POSITIONAL else first
    return register(
        OpSpec(
            name=name,
            family="shape",
            rule=rule,
            signature=sig,
            operands=operands or (first,),
            methods=methods,
            sequence=sequence,
            fn=jax_fn,
            jax_name=f"jnp.{name}",
            **kw,
        )
    )


_X22 = "x = mj.masked_array(jnp.array([[1.0, 2.0], [3.0, 4.0]]), jnp.array([[True, False], [True, True]]))"
# name, jax function, example arguments after x, mask.sum() of the example's result, methods
PASSTHROUGH = [
    ("reshape", jnp.reshape, "(4,)", 3, ("reshape",)),
    ("ravel", jnp.ravel, "", 3, ("ravel", "flatten")),
    ("transpose", jnp.transpose, "", 3, ("transpose",)),
    ("swapaxes", jnp.swapaxes, "0, 1", 3, ("swapaxes",)),
    ("moveaxis", jnp.moveaxis, "0, 1", 3, ()),
    ("expand_dims", jnp.expand_dims, "0", 3, ()),
    ("squeeze", jnp.squeeze, "", 3, ("squeeze",)),
    ("broadcast_to", jnp.broadcast_to, "(3, 2, 2)", 9, ()),
    ("flip", jnp.flip, "0", 3, ()),
    ("roll", jnp.roll, "1, 0", 3, ()),
    ("tile", jnp.tile, "2", 6, ()),
    ("repeat", jnp.repeat, "2", 6, ("repeat",)),
    ("fliplr", jnp.fliplr, "", 3, ()),
    ("flipud", jnp.flipud, "", 3, ()),
    ("rot90", jnp.rot90, "", 3, ()),
    ("rollaxis", jnp.rollaxis, "1", 3, ()),
    ("delete", jnp.delete, "0, 0", 2, ()),
    ("resize", jnp.resize, "(3, 2)", 4, ()),
]
for _name, _fn, _args, _count, _methods in PASSTHROUGH:
    _call = "{mod}.{name}(" + ", ".join(a for a in ("x", _args) if a) + ").mask.sum()"
    _shape_op(_name, passthrough(_fn), _fn, methods=_methods, example=(_X22, _call, f"Array({_count}, dtype=int32)"))

_shape_op(
    "take_along_axis",
    take_along_axis,
    jnp.take_along_axis,
    example=(_X22, "{mod}.take_along_axis(x, jnp.array([[0], [1]]), 1).mask.sum()", "Array(2, dtype=int32)"),
)
for _name, _fn in (("atleast_1d", jnp.atleast_1d), ("atleast_2d", jnp.atleast_2d), ("atleast_3d", jnp.atleast_3d)):
    _shape_op(
        _name,
        atleast(_fn),
        _fn,
        returns="any",
        example=(_X22, f"{{mod}}.{_name}(x).mask.sum()", "Array(3, dtype=int32)"),
    )
_shape_op(
    "split",
    split,
    jnp.split,
    returns="list",
    excluded={"jacobians": "returns a list of slices; each is a getitem, whose Jacobian is checked"},
    example=(_X22, "[p.mask.tolist() for p in {mod}.split(x, 2)]", "[[[True, False]], [[True, True]]]"),
)
_JOIN = (
    "x = mj.masked_array(jnp.array([1.0, 2.0]), jnp.array([True, False]))",
    "{mod}.{name}([x, jnp.array([3.0, 4.0])]).mask.sum()",
    "Array(3, dtype=int32)",
)
_shape_op("concatenate", concatenate, jnp.concatenate, sequence=True, example=_JOIN)
_shape_op("stack", stack, jnp.stack, sequence=True, example=_JOIN)
_shape_op(
    "pad",
    pad,
    jnp.pad,
    example=(
        "x = mj.masked_array(jnp.array([1.0, 2.0]), jnp.array([True, False]))",
        "{mod}.pad(x, 1)",
        "MaskedArray([0.0 1.0 -- 0.0], dtype=float32)",
    ),
)
_shape_op(
    "take",
    take,
    jnp.take,
    methods=("take",),
    example=(
        "x = mj.masked_array(jnp.array([1.0, 2.0]), jnp.array([True, False]))",
        "{mod}.take(x, jnp.array([1, 0, 5]))",
        "MaskedArray([-- 1.0 --], dtype=float32)",
    ),
)


def _sort_static(body, a):
    return [
        dict(axis=ax, stable=st, descending=d)
        for ax in candidate_axes(a)
        for d in (False, True)
        for st in (True, False)
    ]


def _partition_static(body, a):
    """jnp's partition takes ``top_k`` of ``kth + 1`` and of ``n - kth - 1`` elements: the ``k`` values in
    its body name the candidate ``kth`` values (instead of every position of every axis)."""
    ks = {e.params["k"] for e in body.eqns if e.primitive is jax.lax.top_k_p}
    return [
        dict(kth=kth, axis=ax)
        for ax in candidate_axes(a, none=False)
        for kth in sorted({k - 1 for k in ks} | {a[ax] - k - 1 for k in ks})
        if 0 <= kth < a[ax]
    ]


_SORT = "x = mj.masked_array(jnp.array([3.0, 1.0, 2.0]), jnp.array([True, False, True]))"
_shape_op(
    "sort",
    sort,
    jnp.sort,
    methods=("sort",),
    static=_sort_static,
    example=(_SORT, "{mod}.sort(x)", "MaskedArray([2.0 3.0 --], dtype=float32)"),
)
_shape_op(
    "argsort",
    argsort,
    jnp.argsort,
    methods=("argsort",),
    returns="array",
    static=_sort_static,
    example=(_SORT, "{mod}.argsort(x)", "Array([2, 0, 1], dtype=int32)"),
    excluded={"jacobians": "integer output: no derivative"},
)
_PART = "x = mj.masked_array(jnp.array([3.0, 1.0, 2.0, 0.0]), jnp.array([True, True, True, False]))"
_shape_op(
    "partition",
    partition,
    jnp.partition,
    static=_partition_static,
    example=(_PART, "{mod}.partition(x, 1)[1]", "MaskedArray(2.0, dtype=float32)"),
)
_shape_op(
    "argpartition",
    argpartition,
    jnp.argpartition,
    methods=("argpartition",),
    returns="array",
    static=_partition_static,
    example=(_PART, "{mod}.argpartition(x, 1)", "Array([1, 2, 0, 3], dtype=int32)"),
    excluded={"jacobians": "integer output: no derivative"},
)
_shape_op(
    "getitem",
    getitem,
    None,
    modules=(),
    signature=inspect.Signature(
        [
            inspect.Parameter("a", inspect.Parameter.POSITIONAL_ONLY),
            inspect.Parameter("index", inspect.Parameter.POSITIONAL_ONLY),
        ]
    ),
)
