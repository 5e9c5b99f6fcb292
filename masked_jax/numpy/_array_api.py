"""The Array API standard (2023.12) on top of the op registry: constants, dtypes, creation
functions, dtype functions, the standard's names for ops the registry already defines, and the
functions whose masked meaning is a composition (``vecdot``, ``cumulative_sum``, the ``unique_*``
family, ``searchsorted``, ``nonzero``).

Creation functions return fully valid :class:`~masked_jax.MaskedArray` objects. Functions whose
output size depends on the data (``nonzero``, ``unique_*``) need concrete inputs, as in
``jax.numpy``; they work on the valid entries only.
"""

from __future__ import annotations

import builtins
import inspect
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from masked_jax._core import MaskedArray, SparseMasked, from_pair, fully_valid_data
from masked_jax._core import as_masked as _as_masked
from masked_jax.numpy import _frontend
from masked_jax.ops._base import normalize_axis, result_dtype

API_VERSION = "2023.12"

# Constants and dtypes: jax.numpy's.
e, pi, inf, nan, newaxis = jnp.e, jnp.pi, jnp.inf, jnp.nan, jnp.newaxis
bool = jnp.bool_  # noqa: A001 - the standard's name
int8, int16, int32, int64 = jnp.int8, jnp.int16, jnp.int32, jnp.int64
uint8, uint16, uint32, uint64 = jnp.uint8, jnp.uint16, jnp.uint32, jnp.uint64
float32, float64, complex64, complex128 = jnp.float32, jnp.float64, jnp.complex64, jnp.complex128

CONSTANTS = ["e", "pi", "inf", "nan", "newaxis"]
DTYPES = [
    "bool",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint8",
    "uint16",
    "uint32",
    "uint64",
    "float32",
    "float64",
    "complex64",
    "complex128",
]

# The standard's names for ops of the registry (the same functions, not copies).
ALIASES = {
    "acos": "arccos",
    "acosh": "arccosh",
    "asin": "arcsin",
    "asinh": "arcsinh",
    "atan": "arctan",
    "atanh": "arctanh",
    "atan2": "arctan2",
    "pow": "power",
    "bitwise_invert": "invert",
    "bitwise_left_shift": "left_shift",
    "bitwise_right_shift": "right_shift",
    "concat": "concatenate",
    "permute_dims": "transpose",
}


def as_masked(x) -> MaskedArray:
    """``x`` as a ``MaskedArray``; a sparse layout is densified (these functions have no sparse rule)."""
    return x.todense() if isinstance(x, SparseMasked) else _as_masked(x)


def _op(name):
    """The public function of a registered op (signature binding included)."""
    return _frontend.function(name)


def _document(fn, name, summary, *example, signature_of=None):
    """Name a generated function and give it a docstring: ``summary``, then an Examples block whose
    lines are ``example`` (``>>>``/``...`` lines and the outputs they print). ``signature_of``: the
    ``jax.numpy`` function it wraps, whose signature (parameter names, defaults, keyword-only
    markers) it reports to ``inspect.signature``, as the Array API requires."""
    fn.__name__ = fn.__qualname__ = name
    if signature_of is not None:
        params = list(inspect.signature(signature_of).parameters.values())
        own = list(inspect.signature(fn).parameters.values())
        if own and own[0].kind is inspect.Parameter.POSITIONAL_ONLY:  # the array: ours is positional-only
            params[0] = own[0]
        fn.__signature__ = inspect.Signature(params)
    fn.__doc__ = summary + "\n\n    Examples:\n" + "".join(f"        {line}\n" for line in example) + "    "
    return fn


def _dtype_of(x):
    return x.dtype if isinstance(x, MaskedArray) else x


def _valid(make):
    """A creation function of ``jax.numpy`` whose result is fully valid."""

    def created(*args, **kwargs):
        return as_masked(make(*args, **kwargs))

    return _document(
        created,
        make.__name__,
        f"``jax.numpy.{make.__name__}``, fully valid.",
        ">>> import masked_jax.numpy as mnp",
        f">>> bool(mnp.{make.__name__}({_EXAMPLE_ARGS[make.__name__]}).mask.all())",
        "True",
        signature_of=make,
    )


_EXAMPLE_ARGS = {
    "arange": "3",
    "empty": "(2,)",
    "eye": "2",
    "full": "(2,), 7.0",
    "linspace": "0.0, 1.0, 5",
    "ones": "(2,)",
    "zeros": "(2,)",
}
arange, empty, eye, full, linspace, ones, zeros = (
    _valid(f) for f in (jnp.arange, jnp.empty, jnp.eye, jnp.full, jnp.linspace, jnp.ones, jnp.zeros)
)


def asarray(obj, /, *, dtype=None, device=None, copy=None) -> MaskedArray:
    """``obj`` as a :class:`MaskedArray`: a masked array keeps its mask, anything else is fully valid.

    Examples:
        >>> import masked_jax.numpy as mnp
        >>> mnp.asarray([1, 2], dtype=mnp.float32)
        MaskedArray([1.0 2.0], dtype=float32)
    """
    if isinstance(obj, MaskedArray):
        data = jnp.asarray(obj.data, dtype=dtype, device=device, copy=copy)
        return from_pair(data, jnp.asarray(obj.mask, device=device, copy=copy))
    if isinstance(obj, SparseMasked):
        return asarray(obj.todense(), dtype=dtype, device=device, copy=copy)
    if isinstance(obj, (list, tuple)):
        leaves = jax.tree_util.tree_leaves(obj, is_leaf=_is_masked)
        if builtins.any(_is_masked(v) for v in leaves):
            # a nested sequence with masked elements: their data and masks, stacked alike
            dense = jax.tree_util.tree_map(
                lambda v: v.todense() if isinstance(v, SparseMasked) else v, obj, is_leaf=_is_masked
            )
            data = jax.tree_util.tree_map(lambda v: v.data if _is_masked(v) else v, dense, is_leaf=_is_masked)
            mask = jax.tree_util.tree_map(
                lambda v: v.mask if _is_masked(v) else np.ones(np.shape(v), np.bool_), dense, is_leaf=_is_masked
            )
            return from_pair(jnp.asarray(data, dtype=dtype, device=device, copy=copy), jnp.asarray(mask, device=device))
    return as_masked(jnp.asarray(obj, dtype=dtype, device=device, copy=copy))


def _is_masked(v) -> builtins.bool:
    return isinstance(v, (MaskedArray, SparseMasked))


def from_dlpack(x, /, *, device=None, copy=None) -> MaskedArray:
    """An array exported through DLPack (by any library), fully valid.

    Examples:
        >>> import numpy as np, masked_jax.numpy as mnp
        >>> mnp.from_dlpack(np.arange(3, dtype=np.float32))
        MaskedArray([0.0 1.0 2.0], dtype=float32)
    """
    return as_masked(jnp.from_dlpack(x, device=device, copy=copy))


def _like(make):
    def created(x, /, *args, **kwargs):
        return as_masked(make(jnp.empty(x.shape, _dtype_of(x)), *args, **kwargs))

    fill = ", 5.0" if make is jnp.full_like else ""
    return _document(
        created,
        make.__name__,
        f"``jax.numpy.{make.__name__}`` of ``x``'s shape and dtype, fully valid (whatever ``x``'s mask).",
        ">>> import jax.numpy as jnp, masked_jax as mj, masked_jax.numpy as mnp",
        ">>> x = mj.masked_array(jnp.array([1.0, 2.0]), jnp.array([True, False]))",
        f">>> bool(mnp.{make.__name__}(x{fill}).mask.all())",
        "True",
        signature_of=make,
    )


empty_like, full_like, ones_like, zeros_like = (
    _like(f) for f in (jnp.empty_like, jnp.full_like, jnp.ones_like, jnp.zeros_like)
)


def _triangle(keep, example_mask):
    def tri(x, /, k: int = 0) -> MaskedArray:
        x = as_masked(x)
        if x.ndim < 2:
            raise ValueError(f"{keep.__name__} needs at least 2 dimensions; got shape {x.shape}.")
        return from_pair(keep(x.data, k=k), x.compact_mask)

    return _document(
        tri,
        keep.__name__,
        f"``jax.numpy.{keep.__name__}``: zeros outside the kept triangle; the "
        "mask is unchanged (a written zero is valid where the entry was: a constant never makes a "
        "masked entry valid, as under ``maskify``).",
        ">>> import jax.numpy as jnp, masked_jax as mj, masked_jax.numpy as mnp",
        ">>> x = mj.masked_array(jnp.ones((2, 2)), jnp.array([[False, False], [True, True]]))",
        f">>> mnp.{keep.__name__}(x).mask.tolist()",
        example_mask,
    )


tril = _triangle(jnp.tril, "[[False, False], [True, True]]")
triu = _triangle(jnp.triu, "[[False, False], [True, True]]")


def meshgrid(*arrays, indexing: str = "xy") -> list[MaskedArray]:
    """``jax.numpy.meshgrid`` of data and of masks: each output is valid where its input is.

    Examples:
        >>> import jax.numpy as jnp, masked_jax as mj, masked_jax.numpy as mnp
        >>> xs, ys = mnp.meshgrid(mj.masked_array(jnp.array([0.0, 1.0]), jnp.array([True, False])),
        ...                       mnp.asarray([5.0, 6.0, 7.0]))
        >>> xs.shape, xs.mask[:, 1].tolist()
        ((3, 2), [False, False, False])
    """
    arrays = [as_masked(a) for a in arrays]
    data = jnp.meshgrid(*(a.data for a in arrays), indexing=indexing)
    masks = jnp.meshgrid(*(a.mask for a in arrays), indexing=indexing)
    return [from_pair(d, m) for d, m in zip(data, masks)]


# -- data type functions: a MaskedArray stands for its dtype ------------------------------------


def can_cast(from_, to, /) -> builtins.bool:
    """``jax.numpy.can_cast``; ``from_`` may be a dtype or an array.

    Examples:
        >>> import masked_jax.numpy as mnp
        >>> mnp.can_cast(mnp.asarray([1], dtype=mnp.int8), mnp.int32)
        True
    """
    return jnp.can_cast(_dtype_of(from_), to)


def finfo(type, /):  # noqa: A002 - the standard's parameter name
    """``jax.numpy.finfo`` of a float dtype or array.

    Examples:
        >>> import masked_jax.numpy as mnp
        >>> mnp.finfo(mnp.float32).bits
        32
    """
    return jnp.finfo(_dtype_of(type))


def iinfo(type, /):  # noqa: A002 - the standard's parameter name
    """``jax.numpy.iinfo`` of an integer dtype or array.

    Examples:
        >>> import masked_jax.numpy as mnp
        >>> int(mnp.iinfo(mnp.int8).max)
        127
    """
    return jnp.iinfo(_dtype_of(type))


def isdtype(dtype, kind) -> builtins.bool:
    """``jax.numpy.isdtype``.

    Examples:
        >>> import masked_jax.numpy as mnp
        >>> mnp.isdtype(mnp.float32, "real floating")
        True
    """
    return jnp.isdtype(dtype, kind)


def result_type(*arrays_and_dtypes):
    """``jax.numpy.result_type``; masked arrays stand for their dtypes.

    Examples:
        >>> import masked_jax.numpy as mnp
        >>> mnp.result_type(mnp.asarray([1], dtype=mnp.int8), mnp.float32)
        dtype('float32')
    """
    return jnp.result_type(*(_dtype_of(a) for a in arrays_and_dtypes))


# -- compositions of registry ops ---------------------------------------------------------------


def matrix_transpose(x, /) -> MaskedArray:
    """The last two axes swapped, mask with data.

    Examples:
        >>> import masked_jax.numpy as mnp
        >>> mnp.matrix_transpose(mnp.zeros((2, 3))).shape
        (3, 2)
    """
    return as_masked(x).mT


def vecdot(x1, x2, /, *, axis: int = -1) -> MaskedArray:
    """``sum(conj(x1) * x2, axis)`` over the positions where both are valid; masked where none is.

    Examples:
        >>> import jax.numpy as jnp, masked_jax as mj, masked_jax.numpy as mnp
        >>> a = mj.masked_array(jnp.array([1.0, 2.0, 3.0]), jnp.array([True, False, True]))
        >>> mnp.vecdot(a, mnp.asarray([1.0, 1.0, 1.0]))
        MaskedArray(4.0, dtype=float32)
    """
    a, b = as_masked(x1), as_masked(x2)
    if a.shape[axis] != b.shape[axis]:
        raise ValueError(
            f"vecdot: the contracted axis {axis} has size {a.shape[axis]} in x1 and "
            f"{b.shape[axis]} in x2; they must match."
        )
    out_dtype = jax.eval_shape(lambda u, v: jnp.vecdot(u, v, axis=axis), a.data, b.data).dtype
    if jnp.issubdtype(out_dtype, jnp.integer) and jnp.iinfo(out_dtype).bits < 8:
        # int4 and narrower: jnp sums none of them, but its vecdot does; integer sums wrap alike in
        # 32 bits and in the narrow type, so the sum is taken in 32 bits and cast back
        wide = jnp.int32 if jnp.issubdtype(out_dtype, jnp.signedinteger) else jnp.uint32
        a, b = _op("astype")(a, wide), _op("astype")(b, wide)
    return _op("astype")(_op("sum")(_op("multiply")(_op("conj")(a), b), axis=axis), out_dtype)


def broadcast_arrays(*arrays) -> list[MaskedArray]:
    """The arrays broadcast to one shape, masks with data.

    Examples:
        >>> import masked_jax.numpy as mnp
        >>> [a.shape for a in mnp.broadcast_arrays(mnp.zeros((2, 1)), mnp.zeros(3))]
        [(2, 3), (2, 3)]
    """
    shape = jnp.broadcast_shapes(*(np.shape(a) for a in arrays))
    return [_op("broadcast_to")(as_masked(a), shape) for a in arrays]


def unstack(x, /, *, axis: int = 0) -> tuple[MaskedArray, ...]:
    """The slices of ``x`` along ``axis``, masks with data.

    Examples:
        >>> import masked_jax.numpy as mnp
        >>> len(mnp.unstack(mnp.zeros((3, 2))))
        3
    """
    x = _op("moveaxis")(as_masked(x), axis, 0)
    return tuple(x[i] for i in range(x.shape[0]))


def _cumulative(name, x, axis, dtype, include_initial):
    x = as_masked(x)
    if axis is None:
        if x.ndim != 1:
            raise ValueError(
                f"cumulative_{name}: axis is required for a {x.ndim}-d array (the standard "
                "leaves it optional for 1-d arrays only)."
            )
        axis = 0
    # the standard's cumulative_sum promotes as sum does (int8 -> the default int), jnp.cumsum does not
    dtype = result_dtype(getattr(jnp, f"cumulative_{name}"), x.dtype, dtype=dtype)
    out = _op(f"cum{name}")(x, axis=axis, dtype=dtype)
    if not include_initial:
        return out
    axis = axis % x.ndim
    shape = out.shape[:axis] + (1,) + out.shape[axis + 1 :]
    initial = jnp.zeros(shape, out.dtype) if name == "sum" else jnp.ones(shape, out.dtype)
    return _op("concatenate")([as_masked(initial), out], axis=axis)


def cumulative_sum(x, /, *, axis: int | None = None, dtype=None, include_initial: builtins.bool = False) -> MaskedArray:
    """Running sum over the valid entries; a masked entry is masked in the output and adds nothing
    (``numpy.ma.cumsum``). ``include_initial`` prepends a valid 0.

    Examples:
        >>> import jax.numpy as jnp, masked_jax as mj, masked_jax.numpy as mnp
        >>> x = mj.masked_array(jnp.array([1.0, 9.0, 3.0]), jnp.array([True, False, True]))
        >>> mnp.cumulative_sum(x)
        MaskedArray([1.0 -- 4.0], dtype=float32)
    """
    return _cumulative("sum", x, axis, dtype, include_initial)


def cumulative_prod(
    x, /, *, axis: int | None = None, dtype=None, include_initial: builtins.bool = False
) -> MaskedArray:
    """Running product over the valid entries (Array API 2024.12); a masked entry is masked in the
    output and multiplies by nothing (``numpy.ma.cumprod``). ``include_initial`` prepends a valid 1.

    Examples:
        >>> import jax.numpy as jnp, masked_jax as mj, masked_jax.numpy as mnp
        >>> x = mj.masked_array(jnp.array([2.0, 9.0, 3.0]), jnp.array([True, False, True]))
        >>> mnp.cumulative_prod(x)
        MaskedArray([2.0 -- 6.0], dtype=float32)
    """
    return _cumulative("prod", x, axis, dtype, include_initial)


def count_nonzero(x, /, *, axis=None, keepdims: builtins.bool = False) -> jax.Array:
    """How many valid entries are nonzero (Array API 2024.12): a plain array, as a count is
    always defined.

    Examples:
        >>> import jax.numpy as jnp, masked_jax as mj, masked_jax.numpy as mnp
        >>> mnp.count_nonzero(mj.masked_array(jnp.array([0.0, 2.0, 3.0]), jnp.array([True, True, False])))
        Array(1, dtype=int32)
    """
    x = as_masked(x)
    return jnp.count_nonzero(x.mask & (x.data != 0), axis=axis, keepdims=keepdims)


def _valid_values(x):
    x = as_masked(x)
    try:
        return np.asarray(x.data)[np.asarray(x.mask)], x
    except jax.errors.TracerArrayConversionError as err:
        raise TypeError(
            "this function's output size depends on the data: it needs concrete arrays, "
            "not traced ones (call it outside jit, as jax.numpy's)"
        ) from err


class UniqueAllResult(NamedTuple):
    values: MaskedArray
    indices: jax.Array
    inverse_indices: MaskedArray
    counts: jax.Array


class UniqueCountsResult(NamedTuple):
    values: MaskedArray
    counts: jax.Array


class UniqueInverseResult(NamedTuple):
    values: MaskedArray
    inverse_indices: MaskedArray


def unique_all(x, /) -> UniqueAllResult:
    """The distinct valid values (sorted), the flat index of each one's first occurrence, the
    inverse (masked where ``x`` is) and the counts. NaN values are distinct, as in the standard.

    Examples:
        >>> import jax.numpy as jnp, masked_jax as mj, masked_jax.numpy as mnp
        >>> x = mj.masked_array(jnp.array([3, 1, 3, 7]), jnp.array([True, True, True, False]))
        >>> r = mnp.unique_all(x)
        >>> r.values, r.indices.tolist(), r.counts.tolist()
        (MaskedArray([1 3], dtype=int32), [1, 0], [1, 2])
        >>> r.inverse_indices
        MaskedArray([1 0 1 --], dtype=int32)
    """
    return unique_of_valid(x, equal_nan=False)


def unique_of_valid(x, *, equal_nan: builtins.bool, index=True, inverse=True, counts=True) -> UniqueAllResult:
    """``jnp.unique`` of the valid entries alone (with ``equal_nan``), its indices and inverse
    mapped back to ``x``'s positions; the inverse is masked where ``x`` is. Only the parts asked
    for are computed (each is a separate compilation); the others are ``None``."""
    vals, x = _valid_values(x)
    flat = np.flatnonzero(np.asarray(x.mask))
    out = jnp.unique(
        jnp.asarray(vals), return_index=index, return_inverse=inverse, return_counts=counts, equal_nan=equal_nan
    )
    out = list(out) if isinstance(out, (tuple, list)) else [out]
    values = out.pop(0)
    first = out.pop(0) if index else None
    inv = out.pop(0) if inverse else None
    count = out.pop(0) if counts else None
    if inv is not None:
        full_inverse = np.zeros(x.size, np.asarray(inv).dtype)
        full_inverse[flat] = np.asarray(inv).ravel()
        inv = from_pair(jnp.asarray(full_inverse.reshape(x.shape)), x.compact_mask)
    if first is not None:
        first = jnp.asarray(flat[np.asarray(first)], first.dtype)
    return UniqueAllResult(as_masked(values), first, inv, count)


def unique_counts(x, /) -> UniqueCountsResult:
    """The distinct valid values (sorted) and how often each occurs.

    Examples:
        >>> import jax.numpy as jnp, masked_jax as mj, masked_jax.numpy as mnp
        >>> r = mnp.unique_counts(mj.masked_array(jnp.array([2, 2, 5]), jnp.array([True, True, False])))
        >>> r.values, r.counts.tolist()
        (MaskedArray([2], dtype=int32), [2])
    """
    r = unique_of_valid(x, equal_nan=False, index=False, inverse=False)
    return UniqueCountsResult(r.values, r.counts)


def unique_inverse(x, /) -> UniqueInverseResult:
    """The distinct valid values (sorted) and, for each entry of ``x``, the index of its value
    (masked where ``x`` is masked).

    Examples:
        >>> import jax.numpy as jnp, masked_jax as mj, masked_jax.numpy as mnp
        >>> mnp.unique_inverse(mj.masked_array(jnp.array([5, 2, 5]), jnp.array([True, True, False]))).inverse_indices
        MaskedArray([1 0 --], dtype=int32)
    """
    r = unique_of_valid(x, equal_nan=False, index=False, counts=False)
    return UniqueInverseResult(r.values, r.inverse_indices)


def unique_values(x, /) -> MaskedArray:
    """The distinct valid values, sorted.

    Examples:
        >>> import jax.numpy as jnp, masked_jax as mj, masked_jax.numpy as mnp
        >>> mnp.unique_values(mj.masked_array(jnp.array([5, 2, 5, 9]), jnp.array([True, True, True, False])))
        MaskedArray([2 5], dtype=int32)
    """
    return unique_of_valid(x, equal_nan=False, index=False, inverse=False, counts=False).values


def nonzero(x, /) -> tuple[jax.Array, ...]:
    """Indices of the valid nonzero entries (plain arrays: an index is always defined).

    Examples:
        >>> import jax.numpy as jnp, masked_jax as mj, masked_jax.numpy as mnp
        >>> mnp.nonzero(mj.masked_array(jnp.array([0.0, 2.0, 3.0]), jnp.array([True, True, False])))
        (Array([1], dtype=int32),)
    """
    x = as_masked(x)
    if x.ndim == 0:
        raise ValueError("nonzero of a 0-d array is not defined by the standard; use x[None].")
    return jnp.nonzero(x.mask & (x.data != 0))


def searchsorted(x1, x2, /, *, side: str = "left", sorter=None) -> MaskedArray:
    """Insertion positions of the queries ``x2`` among the **valid** entries of the sorted 1-d
    ``x1`` (masked entries of ``x1`` are absent, wherever they sit); masked where a query is masked.
    Each position is a count of valid entries below the query: exact for any mask under ``jit``, at
    ``len(x1) * x2.size`` comparisons.

    Examples:
        >>> import jax.numpy as jnp, masked_jax as mj, masked_jax.numpy as mnp
        >>> x1 = mj.masked_array(jnp.array([1.0, 99.0, 3.0, 5.0]), jnp.array([True, False, True, True]))
        >>> q = mj.masked_array(jnp.array([0.0, 4.0, 9.0]), jnp.array([True, True, False]))
        >>> mnp.searchsorted(x1, q)
        MaskedArray([0 2 --], dtype=int32)
    """
    a, q = as_masked(x1), as_masked(x2)
    if a.ndim != 1:
        raise ValueError(f"searchsorted: x1 must be 1-d; got shape {a.shape}.")
    if side not in ("left", "right"):
        raise ValueError(f"searchsorted: side must be 'left' or 'right'; got {side!r}.")
    if sorter is not None:
        a = _op("take")(a, jnp.asarray(sorter))
    v, w = a.data[None, :], q.data.reshape(-1, 1)
    below = (v < w) if side == "left" else (v <= w)
    if jnp.issubdtype(jnp.result_type(v, w), jnp.inexact):  # sort order, as jnp: NaN after every number
        below = (below | (~jnp.isnan(v) & jnp.isnan(w))) if side == "left" else (below | jnp.isnan(w))
    out_dtype = jax.eval_shape(jnp.searchsorted, a.data, q.data).dtype
    pos = jnp.sum(below & a.mask[None, :], axis=1, dtype=out_dtype).reshape(q.shape)
    return from_pair(pos, q.compact_mask)


# -- the inspection namespace -------------------------------------------------------------------


def __array_namespace_info__():
    """jax.numpy's inspection namespace (devices, default and supported dtypes); the capabilities
    say that boolean-mask indexing and data-dependent shapes need concrete arrays, as in jax.

    Examples:
        >>> import masked_jax.numpy as mnp
        >>> mnp.__array_namespace_info__().default_dtypes()["indexing"]
        dtype('int32')
    """
    return jnp.__array_namespace_info__()


def diagonal(x, /, *, offset: int = 0) -> MaskedArray:
    """The diagonals of the last two axes, mask with data (``linalg.diagonal``).

    Examples:
        >>> import jax.numpy as jnp, masked_jax as mj, masked_jax.numpy as mnp
        >>> mnp.linalg.diagonal(mj.masked_array(jnp.eye(2), jnp.array([[True, True], [True, False]])))
        MaskedArray([1.0 --], dtype=float32)
    """
    return _diagonal(x, offset, -2, -1)


def _diagonal(x, offset, axis1, axis2):
    x = as_masked(x)
    return from_pair(jnp.diagonal(x.data, offset, axis1, axis2), jnp.diagonal(x.mask, offset, axis1, axis2))


def _trace(x, offset, axis1, axis2, dtype):
    return _op("sum")(_diagonal(x, offset, axis1, axis2), axis=-1, dtype=dtype)


def trace(x, /, *, offset: int = 0, dtype=None) -> MaskedArray:
    """Sum of the valid diagonal entries of the last two axes; masked where none is valid.

    Examples:
        >>> import jax.numpy as jnp, masked_jax as mj, masked_jax.numpy as mnp
        >>> mnp.linalg.trace(mj.masked_array(jnp.array([[1.0, 2.0], [3.0, 9.0]]), jnp.array([[True, True], [True, False]])))
        MaskedArray(1.0, dtype=float32)
    """
    return _trace(x, offset, -2, -1, dtype)


def matrix_norm(x, /, *, keepdims: builtins.bool = False, ord="fro") -> MaskedArray:
    """The norm of each matrix (last two axes) over its valid entries.

    Examples:
        >>> import jax.numpy as jnp, masked_jax as mj, masked_jax.numpy as mnp
        >>> mnp.linalg.matrix_norm(mj.masked_array(jnp.array([[3.0, 9.0], [4.0, 0.0]]), jnp.array([[True, False], [True, True]])))
        MaskedArray(5.0, dtype=float32)
    """
    return _op("norm")(x, ord=ord, axis=(-2, -1), keepdims=keepdims)


def vector_norm(x, /, *, axis=None, keepdims: builtins.bool = False, ord=2) -> MaskedArray:
    """The vector norm over the valid entries of ``axis`` (``None``: every axis, the array taken as
    one vector; a tuple: those axes taken as one vector), by ``jnp.linalg.vector_norm``'s own
    arithmetic (integers square and sum in their dtype, as jnp's).

    Examples:
        >>> import jax.numpy as jnp, masked_jax as mj, masked_jax.numpy as mnp
        >>> x = mj.masked_array(jnp.array([[1.0, 2.0], [3.0, 9.0]]), jnp.array([[True, True], [True, False]]))
        >>> mnp.linalg.vector_norm(x, ord=1)
        MaskedArray(6.0, dtype=float32)
    """
    x = as_masked(x)
    if isinstance(ord, str) or not (ord is None or np.ndim(ord) == 0):
        raise ValueError(f"vector_norm: ord must be a number (or inf, -inf); got {ord!r}.")
    axes = tuple(range(x.ndim)) if axis is None else (axis,) if isinstance(axis, (int, np.integer)) else tuple(axis)
    axes = normalize_axis(axes, x.ndim)
    rest = [a for a in range(x.ndim) if a not in axes]
    flat = _op("reshape")(_op("transpose")(x, rest + list(axes)), tuple(x.shape[a] for a in rest) + (-1,))
    total = lambda v, **kw: _op("sum")(v, axis=-1, **kw)  # noqa: E731
    if ord is None or ord == 2:
        out = _op("sqrt")(total(_op("real")(_op("multiply")(flat, _op("conj")(flat)))))
    elif ord == np.inf:
        out = _op("max")(_op("abs")(flat), axis=-1)
    elif ord == -np.inf:
        out = _op("min")(_op("abs")(flat), axis=-1)
    elif ord == 0:
        out = total(_op("not_equal")(flat, 0), dtype=jnp.finfo(jnp.result_type(float)).dtype)
    elif ord == 1:
        out = total(_op("abs")(flat))
    else:
        a = _op("abs")(flat)
        out = _op("power")(total(_op("power")(a, jnp.asarray(ord, a.dtype))), jnp.asarray(1.0 / ord, a.dtype))
    out_dtype = jax.eval_shape(lambda d: jnp.linalg.vector_norm(d, ord=ord), x.data).dtype
    out = _op("astype")(out, out_dtype)
    if keepdims:
        out = _op("reshape")(out, tuple(1 if a in axes else d for a, d in enumerate(x.shape)))
    return out


def cross(x1, x2, /, *, axis: int = -1) -> MaskedArray:
    """The cross product of 3-vectors along ``axis``: a vector is valid where all three components
    of both operands are (each component of the result reads the other two).

    Examples:
        >>> import jax.numpy as jnp, masked_jax as mj, masked_jax.numpy as mnp
        >>> mnp.linalg.cross(mnp.asarray([1.0, 0.0, 0.0]), mnp.asarray([0.0, 1.0, 0.0]))
        MaskedArray([0.0 0.0 1.0], dtype=float32)
    """
    a, b = as_masked(x1), as_masked(x2)
    if a.shape[axis] != 3 or b.shape[axis] != 3:
        raise ValueError(
            f"cross: the vectors along axis {axis} must have 3 components; got shapes {a.shape} and {b.shape}."
        )
    valid = jnp.all(a.mask, axis=axis, keepdims=True) & jnp.all(b.mask, axis=axis, keepdims=True)
    data = jnp.cross(jnp.where(a.mask, a.data, 0), jnp.where(b.mask, b.data, 0), axis=axis)
    return from_pair(data, jnp.broadcast_to(valid, data.shape))


# -- linalg and fft: decompositions and transforms have no masked meaning -----------------------


def _fully_valid(x, name):
    """The data of ``x`` when it is a plain array or a ``MaskedArray`` whose mask is concretely all
    True; otherwise a ``TypeError`` that says why."""
    return fully_valid_data(
        x,
        name,
        "it has no masked meaning: a decomposition or transform of an array with "
        "masked entries is not defined by its valid entries alone; for the dense meaning call "
        "it on x.filled(value).",
    )


def dense_only(fn, name):
    def dense(x, /, *args, **kwargs):
        out = fn(
            _fully_valid(x, name),
            *(_fully_valid(a, name) for a in args),
            **{k: _fully_valid(v, f"{name}'s {k}") for k, v in kwargs.items()},
        )
        return jax.tree_util.tree_map(as_masked, out)

    return _document(
        dense,
        name.rsplit(".", 1)[-1],
        f"``jax.numpy.{name}`` of fully valid arrays, with a fully valid result. An array with masked "
        f"entries (or a traced mask) raises ``TypeError``: {name} has no masked meaning.",
        ">>> import jax.numpy as jnp, masked_jax as mj, masked_jax.numpy as mnp",
        ">>> mnp.linalg.det(mnp.eye(2))",
        "MaskedArray(1.0, dtype=float32)",
        ">>> mnp.linalg.det(mj.masked_array(jnp.eye(2), jnp.eye(2) > 0))",
        "Traceback (most recent call last):",
        "TypeError: linalg.det must be fully valid (a concrete all-True mask): it has no masked meaning: ...",
        signature_of=fn,
    )


__all__ = (
    CONSTANTS
    + DTYPES
    + [
        "arange",
        "asarray",
        "empty",
        "empty_like",
        "eye",
        "from_dlpack",
        "full",
        "full_like",
        "linspace",
        "meshgrid",
        "ones",
        "ones_like",
        "tril",
        "triu",
        "zeros",
        "zeros_like",
        "can_cast",
        "finfo",
        "iinfo",
        "isdtype",
        "result_type",
        "matrix_transpose",
        "vecdot",
        "broadcast_arrays",
        "unstack",
        "cumulative_sum",
        "cumulative_prod",
        "count_nonzero",
        "unique_all",
        "unique_counts",
        "unique_inverse",
        "unique_values",
        "nonzero",
        "searchsorted",
    ]
)
