"""jax.numpy functions beyond the Array API standard whose masked meaning is a composition of
registered ops: the ``nan*`` reductions (NaN counts as masked), differences and diagonals, the
stacking and splitting family, membership and binning over valid entries, 1-d convolutions with
``numpy.ma``'s mask propagation, and interpolation with masked sample points.
"""

from __future__ import annotations

import builtins
import math

import jax
import jax.numpy as jnp
import numpy as np

from masked_jax._core import MaskedArray, from_pair
from masked_jax.numpy._array_api import _diagonal, _document, _fully_valid, _op, _trace, as_masked, unique_of_valid
from masked_jax.numpy._array_api import cross as _cross_last
from masked_jax.ops._base import highest, lowest, normalize_axis

# jax.numpy's other names for functions of the registry (the same functions, not copies)
ALIASES = {"around": "round", "conjugate": "conj", "degrees": "rad2deg", "radians": "deg2rad"}


def _nan_masked(x):
    x = as_masked(x)
    if not jnp.issubdtype(x.dtype, jnp.inexact):
        return x
    return from_pair(x.data, x.mask & ~jnp.isnan(x.data))


def _nan_reduction(name):
    def reduce(a, *args, **kwargs):
        if name in ("cumsum", "cumprod"):  # as jnp: a NaN adds (multiplies) nothing, its position stays
            x = as_masked(a)
            if jnp.issubdtype(x.dtype, jnp.inexact):
                x = from_pair(jnp.where(jnp.isnan(x.data), 0 if name == "cumsum" else 1, x.data), x.compact_mask)
            return _op(name)(x, *args, **kwargs)
        return _op(name)(_nan_masked(a), *args, **kwargs)

    args = {"quantile": ", 0.5", "percentile": ", 50.0"}.get(name, "")
    return _document(
        reduce,
        f"nan{name}",
        f"``{name}`` with NaN treated as masked (``jax.numpy.nan{name}``'s "
        "meaning, on the valid entries); a slice with no valid non-NaN entry is masked.",
        ">>> import jax.numpy as jnp, masked_jax as mj, masked_jax.numpy as mnp",
        ">>> x = mj.masked_array(jnp.array([1.0, jnp.nan, 3.0, 7.0]), jnp.array([True, True, True, False]))",
        f">>> bool(jnp.isnan(mnp.nan{name}(x{args}).filled(0)).any())",
        "False",
    )


NAN_REDUCTIONS = [
    "sum",
    "prod",
    "mean",
    "max",
    "min",
    "std",
    "var",
    "argmax",
    "argmin",
    "cumsum",
    "cumprod",
    "median",
    "quantile",
    "percentile",
]
NAN = {f"nan{n}": _nan_reduction(n) for n in NAN_REDUCTIONS}
globals().update(NAN)


def diff(a, n: int = 1, axis: int = -1, prepend=None, append=None) -> MaskedArray:
    """``a[1:] - a[:-1]`` along ``axis``, ``n`` times: valid where both neighbours are
    (``numpy.ma.diff``).

    Examples:
        >>> import jax.numpy as jnp, masked_jax as mj, masked_jax.numpy as mnp
        >>> mnp.diff(mj.masked_array(jnp.array([1.0, 4.0, 9.0, 16.0]), jnp.array([True, True, False, True])))
        MaskedArray([3.0 -- --], dtype=float32)
    """
    x = as_masked(a)
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0:
        raise ValueError(f"diff: n must be an int >= 0; got {n!r}.")
    if x.ndim == 0:
        raise ValueError("diff: a must be at least 1-d (a 0-d array has no neighbours); got a 0-d array.")
    (axis,) = normalize_axis(axis, x.ndim)
    parts = [p for p in (prepend, x, append) if p is not None]
    if len(parts) > 1:
        shape = list(x.shape)
        shape[axis] = 1
        parts = [
            p if p is x or np.ndim(p) == x.ndim else _op("broadcast_to")(as_masked(p), tuple(shape)) for p in parts
        ]
        x = _op("concatenate")([as_masked(p) for p in parts], axis=axis)
    for _ in range(n):
        hi = tuple(slice(1, None) if d == axis else slice(None) for d in range(x.ndim))
        lo = tuple(slice(None, -1) if d == axis else slice(None) for d in range(x.ndim))
        # as jnp.diff: bool neighbours differ where they are not equal
        x = _op("not_equal" if x.dtype == jnp.bool_ else "subtract")(x[hi], x[lo])
    return x


def diagonal(a, offset: int = 0, axis1: int = 0, axis2: int = 1) -> MaskedArray:
    """``jax.numpy.diagonal``: the mask moves with the data.

    Examples:
        >>> import jax.numpy as jnp, masked_jax as mj, masked_jax.numpy as mnp
        >>> mnp.diagonal(mj.masked_array(jnp.eye(2), jnp.array([[True, True], [True, False]])))
        MaskedArray([1.0 --], dtype=float32)
    """
    return _diagonal(a, offset, axis1, axis2)


def trace(a, offset: int = 0, axis1: int = 0, axis2: int = 1, dtype=None) -> MaskedArray:
    """Sum of the valid diagonal entries (``numpy.ma.trace``); masked where none is valid.

    Examples:
        >>> import jax.numpy as jnp, masked_jax as mj, masked_jax.numpy as mnp
        >>> mnp.trace(mj.masked_array(jnp.array([[1.0, 2.0], [3.0, 9.0]]), jnp.array([[True, True], [True, False]])))
        MaskedArray(1.0, dtype=float32)
    """
    return _trace(a, offset, axis1, axis2, dtype)


def cross(a, b, axisa: int = -1, axisb: int = -1, axisc: int = -1, axis: int | None = None) -> MaskedArray:
    """``jax.numpy.cross`` of 3-vectors: a vector is valid where all components of both operands are.

    Examples:
        >>> import masked_jax.numpy as mnp
        >>> mnp.cross(mnp.asarray([1.0, 0.0, 0.0]), mnp.asarray([0.0, 1.0, 0.0]))
        MaskedArray([0.0 0.0 1.0], dtype=float32)
    """
    if axis is not None:
        axisa = axisb = axisc = axis
    a = _op("moveaxis")(as_masked(a), axisa, -1)
    b = _op("moveaxis")(as_masked(b), axisb, -1)
    return _op("moveaxis")(_cross_last(a, b), -1, axisc)


def _at_least(x, ndim):
    x = as_masked(x)
    if x.ndim >= ndim:
        return x
    shape = {
        0: {1: (1,), 2: (1, 1), 3: (1, 1, 1)},
        1: {2: (1,) + x.shape, 3: (1,) + x.shape + (1,)},
        2: {3: x.shape + (1,)},
    }[x.ndim][ndim]
    return _op("reshape")(x, shape)


def hstack(tup, *, dtype=None) -> MaskedArray:
    """Join along the second axis (the first for 1-d arrays), masks with data.

    Examples:
        >>> import masked_jax.numpy as mnp
        >>> mnp.hstack([mnp.zeros(2), mnp.ones(3)]).shape
        (5,)
    """
    arrs = [_at_least(t, 1) for t in tup]
    return _op("concatenate")(arrs, axis=0 if arrs[0].ndim == 1 else 1, dtype=dtype)


def vstack(tup, *, dtype=None) -> MaskedArray:
    """Join along the first axis after making every array at least 2-d, masks with data.

    Examples:
        >>> import masked_jax.numpy as mnp
        >>> mnp.vstack([mnp.zeros(2), mnp.ones(2)]).shape
        (2, 2)
    """
    return _op("concatenate")([_at_least(t, 2) for t in tup], axis=0, dtype=dtype)


def dstack(tup, *, dtype=None) -> MaskedArray:
    """Join along the third axis after making every array at least 3-d, masks with data.

    Examples:
        >>> import masked_jax.numpy as mnp
        >>> mnp.dstack([mnp.zeros(2), mnp.ones(2)]).shape
        (1, 2, 2)
    """
    return _op("concatenate")([_at_least(t, 3) for t in tup], axis=2, dtype=dtype)


def column_stack(tup) -> MaskedArray:
    """1-d arrays as columns, 2-d arrays as they are, joined along the second axis.

    Examples:
        >>> import masked_jax.numpy as mnp
        >>> mnp.column_stack([mnp.zeros(3), mnp.ones(3)]).shape
        (3, 2)
    """
    cols = [_op("reshape")(as_masked(t), (-1, 1)) if np.ndim(t) < 2 else as_masked(t) for t in tup]
    return _op("concatenate")(cols, axis=1)


def array_split(ary, indices_or_sections, axis: int = 0) -> list[MaskedArray]:
    """``jax.numpy.array_split``: like ``split``, but the sections may differ in size by one.

    Examples:
        >>> import masked_jax.numpy as mnp
        >>> [p.shape for p in mnp.array_split(mnp.zeros(5), 2)]
        [(3,), (2,)]
    """
    x = as_masked(ary)
    if isinstance(indices_or_sections, int):
        sections = indices_or_sections
        if sections <= 0:
            raise ValueError(f"array_split: the number of sections must be > 0; got {sections}.")
        each, extra = divmod(x.shape[axis], sections)
        sizes = [each + 1] * extra + [each] * (sections - extra)
        indices_or_sections = list(np.cumsum(sizes)[:-1])
    return list(_op("split")(x, indices_or_sections, axis=axis))


def _split_along(axis_of, name):
    def split_fn(ary, indices_or_sections) -> list[MaskedArray]:
        x = as_masked(ary)
        return list(_op("split")(x, indices_or_sections, axis=axis_of(x)))

    return _document(
        split_fn,
        name,
        f"``jax.numpy.{name}``: ``split`` along its axis, masks with data.",
        ">>> import masked_jax.numpy as mnp",
        f">>> len(mnp.{name}(mnp.zeros((2, 2, 2)), 2))",
        "2",
    )


hsplit = _split_along(lambda x: 1 if x.ndim > 1 else 0, "hsplit")
vsplit = _split_along(lambda x: 0, "vsplit")
dsplit = _split_along(lambda x: 2, "dsplit")


def isin(element, test_elements, invert: bool = False) -> MaskedArray:
    """Whether each valid entry of ``element`` equals a **valid** entry of ``test_elements``;
    masked where ``element`` is masked.

    Examples:
        >>> import jax.numpy as jnp, masked_jax as mj, masked_jax.numpy as mnp
        >>> tests = mj.masked_array(jnp.array([2, 5]), jnp.array([True, False]))
        >>> mnp.isin(mj.masked_array(jnp.array([2, 5, 9]), jnp.array([True, True, False])), tests)
        MaskedArray([True False --], dtype=bool)
    """
    e, t = as_masked(element), as_masked(test_elements)
    hit = jnp.any((e.data[..., None] == t.data.ravel()) & t.mask.ravel(), axis=-1)
    return from_pair(~hit if invert else hit, e.compact_mask)


def digitize(x, bins, right: bool = False) -> MaskedArray:
    """``jax.numpy.digitize`` of the valid entries of ``x`` (masked where ``x`` is); ``bins`` must
    be fully valid.

    Examples:
        >>> import jax.numpy as jnp, masked_jax as mj, masked_jax.numpy as mnp
        >>> mnp.digitize(mj.masked_array(jnp.array([0.5, 2.5, 9.0]), jnp.array([True, True, False])),
        ...              jnp.array([1.0, 2.0, 3.0]))
        MaskedArray([0 2 --], dtype=int32)
    """
    x = as_masked(x)
    out = jnp.digitize(x.data, _fully_valid(bins, "digitize's bins"), right=right)
    return from_pair(out, x.compact_mask)


def bincount(x, weights=None, minlength: int = 0, *, length: int | None = None) -> jax.Array:
    """Counts (or summed ``weights``) of the valid entries of the non-negative integer ``x``;
    masked entries and masked weights count nothing. A plain array: a count is always defined.

    Examples:
        >>> import jax.numpy as jnp, masked_jax as mj, masked_jax.numpy as mnp
        >>> mnp.bincount(mj.masked_array(jnp.array([0, 1, 1, 3]), jnp.array([True, True, True, False])))
        Array([1, 2], dtype=int32)
    """
    x = as_masked(x)
    valid = x.mask
    if weights is None:  # counts in the dtype jnp.bincount counts in
        w = valid.astype(jax.eval_shape(lambda d: jnp.bincount(d, length=1), x.data).dtype)
    else:
        wm = as_masked(weights)
        valid = valid & wm.mask
        w = jnp.where(valid, wm.data, 0)
    if length is None:
        try:
            length = builtins.max(
                int(np.max(np.where(np.asarray(valid), np.asarray(x.data), -1), initial=-1)) + 1, minlength
            )
        except jax.errors.TracerArrayConversionError as err:
            raise TypeError("bincount under jit needs length= (its output size depends on the data)") from err
    return jnp.bincount(jnp.where(valid, x.data, 0), weights=w, minlength=minlength, length=length)


def histogram(a, bins=10, range=None, weights=None, density=None):  # noqa: A002 - numpy's name
    """``jax.numpy.histogram`` of the valid entries (masked entries and masked weights count
    nothing); the default range is that of the valid entries.

    Examples:
        >>> import jax.numpy as jnp, masked_jax as mj, masked_jax.numpy as mnp
        >>> x = mj.masked_array(jnp.array([0.0, 1.0, 1.0, 99.0]), jnp.array([True, True, True, False]))
        >>> counts, edges = mnp.histogram(x, bins=2)
        >>> counts.tolist(), edges.tolist()
        ([1.0, 2.0], [0.0, 0.5, 1.0])
    """
    x = as_masked(a)
    valid = x.mask
    w = valid.astype(x.dtype if jnp.issubdtype(x.dtype, jnp.inexact) else jnp.float32)
    if weights is not None:
        wm = as_masked(weights)
        valid = valid & wm.mask
        w = jnp.where(valid, wm.data, 0)
    if range is None and np.ndim(bins) == 0:
        lo = jnp.min(jnp.where(valid, x.data, highest(x.dtype)))  # not inf: float8_e4m3fn has none
        hi = jnp.max(jnp.where(valid, x.data, lowest(x.dtype)))
        any_valid = jnp.any(valid)
        range = (jnp.where(any_valid, lo, 0), jnp.where(any_valid, hi, 1))
    return jnp.histogram(
        jnp.where(valid, x.data, range[0] if range is not None else 0),
        bins=bins,
        range=range,
        weights=w,
        density=density,
    )


def _convolution(fn, name):
    def conv(a, v, mode: str = "full", propagate_mask: bool = True) -> MaskedArray:
        x, k = as_masked(a), as_masked(v)
        if x.ndim != 1 or k.ndim != 1:
            raise ValueError(f"{name}: a and v must be 1-d; got shapes {x.shape} and {k.shape}.")
        zero = lambda m: jnp.where(m.mask, m.data, jnp.zeros((), m.dtype))  # noqa: E731 (keeps the dtype)
        data = fn(zero(x), zero(k), mode=mode)
        xm, km = x.mask.astype(jnp.float32), k.mask.astype(jnp.float32)
        if propagate_mask:  # masked where any masked entry takes part
            touched = fn(1 - xm, jnp.ones_like(km), mode=mode) + fn(jnp.ones_like(xm), 1 - km, mode=mode)
            valid = touched < 0.5
        else:  # masked where no pair of valid entries takes part
            valid = fn(xm, km, mode=mode) > 0.5
        return from_pair(data, valid)

    return _document(
        conv,
        name,
        f"``jax.numpy.{name}`` with ``numpy.ma.{name}``'s masks: with ``propagate_mask`` "
        "an output is masked when any masked entry takes part in it, without it only when no pair of "
        "valid entries does (masked entries then count as 0).",
        ">>> import jax.numpy as jnp, masked_jax as mj, masked_jax.numpy as mnp",
        ">>> a = mj.masked_array(jnp.array([1.0, 2.0, 3.0]), jnp.array([True, False, True]))",
        f">>> mnp.{name}(a, jnp.array([1.0, 1.0]), mode='valid').mask.tolist()",
        "[False, False]",
    )


convolve = _convolution(jnp.convolve, "convolve")
correlate = _convolution(jnp.correlate, "correlate")


def interp(x, xp, fp, left=None, right=None, period=None) -> MaskedArray:
    """``jax.numpy.interp`` through the **valid** sample points ``(xp, fp)`` (a point is valid
    where both are); masked where the query ``x`` is masked or no sample point is valid.

    Examples:
        >>> import jax.numpy as jnp, masked_jax as mj, masked_jax.numpy as mnp
        >>> xp = mj.masked_array(jnp.array([0.0, 1.0, 2.0]), jnp.array([True, False, True]))
        >>> mnp.interp(jnp.array([0.5, 1.0]), xp, jnp.array([0.0, 100.0, 2.0]))
        MaskedArray([0.5 1.0], dtype=float32)
    """
    q, sx, sf = as_masked(x), as_masked(xp), as_masked(fp)
    if sx.ndim != 1 or sf.shape != sx.shape:
        raise ValueError(f"interp: xp and fp must be 1-d of one length; got shapes {sx.shape} and {sf.shape}.")
    ok = sx.mask & sf.mask
    # Each masked sample point takes the previous valid one's values (the first valid one's before
    # it): repeated points change nothing, and the shapes stay static.
    idx = jnp.where(ok, jnp.arange(ok.shape[0]), -1)
    prev = jax.lax.cummax(idx)
    take = jnp.where(prev < 0, jnp.argmax(ok), prev)
    # sanitised on entry: NaN under a mask reaches neither the values nor the gradients
    xs, fs = jnp.where(ok, sx.data, 0)[take], jnp.where(ok, sf.data, 0)[take]
    out = jnp.interp(jnp.where(q.mask, q.data, xs[0]), xs, fs, left=left, right=right, period=period)
    return from_pair(out, q.mask & jnp.any(ok))


def unique(
    ar,
    return_index: bool = False,
    return_inverse: bool = False,
    return_counts: bool = False,
    axis: int | None = None,
    *,
    equal_nan: bool = True,
):
    """The sorted distinct valid values of ``ar`` (and, as in ``numpy.unique``, the first indices,
    the inverse and the counts, over the flattened array). Needs concrete arrays.

    Examples:
        >>> import jax.numpy as jnp, masked_jax as mj, masked_jax.numpy as mnp
        >>> mnp.unique(mj.masked_array(jnp.array([3, 1, 3, 8]), jnp.array([True, True, True, False])))
        MaskedArray([1 3], dtype=int32)
    """
    if axis is not None:
        raise ValueError(
            "unique: axis= has no masked meaning (rows with masked entries are not values); pass axis=None"
        )
    r = unique_of_valid(ar, equal_nan=equal_nan, index=return_index, inverse=return_inverse, counts=return_counts)
    extra = [r.indices] * return_index + [r.inverse_indices] * return_inverse + [r.counts] * return_counts
    return (r.values, *extra) if extra else r.values


def diag(v, k: int = 0) -> MaskedArray:
    """``jax.numpy.diag``: of a 1-d array, a matrix with ``v`` on diagonal ``k`` (masked where ``v``
    is) and valid zeros elsewhere, as ``numpy.ma.diag`` and as ``pad`` writes constants; of a 2-d
    array, its diagonal ``k``.

    Examples:
        >>> import jax.numpy as jnp, masked_jax as mj, masked_jax.numpy as mnp
        >>> mnp.diag(mj.masked_array(jnp.array([1.0, 2.0]), jnp.array([True, False])))
        MaskedArray([[1.0 0.0]
                     [0.0 --]], dtype=float32)
    """
    x = as_masked(v)
    if x.ndim == 2:
        return _diagonal(x, k, 0, 1)
    if x.ndim != 1:
        raise ValueError(f"diag: the input must be 1-d or 2-d; got shape {x.shape}.")
    return from_pair(jnp.diag(x.filled(0), k), ~jnp.diag(~x.mask, k))


def diagflat(v, k: int = 0) -> MaskedArray:
    """``diag`` of ``v`` flattened (``jax.numpy.diagflat``).

    Examples:
        >>> import jax.numpy as jnp, masked_jax as mj, masked_jax.numpy as mnp
        >>> mnp.diagflat(mj.masked_array(jnp.array([[1.0], [2.0]]), jnp.array([[True], [False]]))).mask
        Array([[ True,  True],
               [ True, False]], dtype=bool)
    """
    return diag(_op("ravel")(as_masked(v)), k)


def append(arr, values, axis: int | None = None) -> MaskedArray:
    """``values`` joined to the end of ``arr`` (both flattened when ``axis`` is ``None``), masks with data.

    Examples:
        >>> import jax.numpy as jnp, masked_jax as mj, masked_jax.numpy as mnp
        >>> mnp.append(mj.masked_array(jnp.array([1.0, 2.0]), jnp.array([True, False])), 3.0)
        MaskedArray([1.0 -- 3.0], dtype=float32)
    """
    a, b = as_masked(arr), as_masked(values)
    if axis is None:
        a, b = _op("ravel")(a), _op("ravel")(b)
        axis = 0
    return _op("concatenate")([a, b], axis=axis)


def select(condlist, choicelist, default=0) -> MaskedArray:
    """``jax.numpy.select``: at each position the choice of the first true condition, else ``default``.
    A masked condition leaves the position masked (whether it holds is unknown); so does a masked
    chosen value. A constant ``default`` never makes a masked position valid (as in ``where``).

    Examples:
        >>> import jax.numpy as jnp, masked_jax as mj, masked_jax.numpy as mnp
        >>> x = mj.masked_array(jnp.array([-2.0, 0.5, 3.0, 9.0]), jnp.array([True, True, True, False]))
        >>> mnp.select([x < 0, x < 1], [-x, x * 10], default=x)
        MaskedArray([2.0 5.0 3.0 --], dtype=float32)
    """
    if len(condlist) != len(choicelist):
        raise ValueError(
            f"select: condlist and choicelist must have the same length; got {len(condlist)} and {len(choicelist)}."
        )
    if not condlist:
        raise ValueError("select: condlist must not be empty.")
    where = _op("where")
    out = default
    for cond, choice in zip(reversed(condlist), reversed(choicelist)):
        c = as_masked(cond)
        if c.dtype != jnp.bool_:
            raise TypeError(f"select: each condition must be a bool array; got dtype {c.dtype}.")
        # known true: the choice; known false: what comes after; masked condition: masked
        out = where(c, choice, out)
    return as_masked(out)


def allclose(a, b, rtol=1e-05, atol=1e-08, equal_nan: bool = False) -> MaskedArray:
    """Whether every jointly valid pair is close (``isclose``), reduced as ``all``: a 0-d bool array,
    masked when no pair is jointly valid (masked entries are never compared).

    Examples:
        >>> import jax.numpy as jnp, masked_jax as mj, masked_jax.numpy as mnp
        >>> a = mj.masked_array(jnp.array([1.0, 5.0]), jnp.array([True, False]))
        >>> mnp.allclose(a, jnp.array([1.0, 2.0]))
        MaskedArray(True, dtype=bool)
    """
    return _op("all")(_op("isclose")(a, b, rtol=rtol, atol=atol, equal_nan=equal_nan))


def matvec(x1, x2) -> MaskedArray:
    """Batched matrix-vector product ``x1 @ x2`` (``jax.numpy.matvec``): sums over jointly valid terms, as ``matmul``.

    Examples:
        >>> import jax.numpy as jnp, masked_jax as mj, masked_jax.numpy as mnp
        >>> m = mj.masked_array(jnp.array([[1.0, 2.0], [3.0, 4.0]]), jnp.array([[True, False], [False, False]]))
        >>> mnp.matvec(m, jnp.array([10.0, 20.0]))
        MaskedArray([10.0 --], dtype=float32)
    """
    return _op("matmul")(x1, _op("expand_dims")(as_masked(x2), -1))[..., 0]


def vecmat(x1, x2) -> MaskedArray:
    """Batched vector-matrix product ``conj(x1) @ x2`` (``jax.numpy.vecmat``), as ``matmul``.

    Examples:
        >>> import jax.numpy as jnp, masked_jax as mj, masked_jax.numpy as mnp
        >>> v = mj.masked_array(jnp.array([1.0, 2.0]), jnp.array([True, False]))
        >>> mnp.vecmat(v, jnp.array([[1.0, 2.0], [3.0, 4.0]]))
        MaskedArray([1.0 2.0], dtype=float32)
    """
    return _op("matmul")(_op("expand_dims")(_op("conj")(x1), -2), x2)[..., 0, :]


def kron(a, b) -> MaskedArray:
    """Kronecker product (``jax.numpy.kron``): each entry valid where both of its factors are.

    Examples:
        >>> import jax.numpy as jnp, masked_jax as mj, masked_jax.numpy as mnp
        >>> mnp.kron(mj.masked_array(jnp.array([1.0, 2.0]), jnp.array([True, False])), jnp.array([1.0, 10.0]))
        MaskedArray([1.0 10.0 -- --], dtype=float32)
    """
    x, y = as_masked(a), as_masked(b)
    n = builtins.max(x.ndim, y.ndim)
    x, y = (_op("reshape")(v, (1,) * (n - v.ndim) + v.shape) for v in (x, y))
    spread_x = _op("reshape")(x, tuple(d for s in x.shape for d in (s, 1)))  # (a0, 1, a1, 1, ...)
    spread_y = _op("reshape")(y, tuple(d for s in y.shape for d in (1, s)))  # (1, b0, 1, b1, ...)
    return _op("reshape")(_op("multiply")(spread_x, spread_y), tuple(p * q for p, q in zip(x.shape, y.shape)))


def ediff1d(ary, to_end=None, to_begin=None) -> MaskedArray:
    """Differences of consecutive entries of ``ary`` flattened, valid where both are
    (``numpy.ma.ediff1d``), with ``to_begin``/``to_end`` joined on.

    Examples:
        >>> import jax.numpy as jnp, masked_jax as mj, masked_jax.numpy as mnp
        >>> mnp.ediff1d(mj.masked_array(jnp.array([1.0, 4.0, 9.0, 16.0]), jnp.array([True, True, False, True])))
        MaskedArray([3.0 -- --], dtype=float32)
    """
    x = diff(_op("ravel")(as_masked(ary)))
    parts = [_op("ravel")(as_masked(p)).astype(x.dtype) for p in (to_begin,) if p is not None]
    parts += [x] + [_op("ravel")(as_masked(p)).astype(x.dtype) for p in (to_end,) if p is not None]
    return _op("concatenate")(parts) if len(parts) > 1 else x


def _valid_nonzero(a):
    x = as_masked(a)
    return x.mask & (x.data != 0)


def argwhere(a, *, size: int | None = None, fill_value=None) -> jax.Array:
    """Indices of the valid nonzero entries, one row each (``jax.numpy.argwhere``; a plain array:
    an index is always defined). Without ``size`` it needs a concrete array, as in jax.numpy.

    Examples:
        >>> import jax.numpy as jnp, masked_jax as mj, masked_jax.numpy as mnp
        >>> mnp.argwhere(mj.masked_array(jnp.array([0.0, 2.0, 3.0]), jnp.array([True, True, False])))
        Array([[1]], dtype=int32)
    """
    return jnp.argwhere(_valid_nonzero(a), size=size, fill_value=fill_value)


def flatnonzero(a, *, size: int | None = None, fill_value=None) -> jax.Array:
    """Flat indices of the valid nonzero entries (``jax.numpy.flatnonzero``; a plain array).

    Examples:
        >>> import jax.numpy as jnp, masked_jax as mj, masked_jax.numpy as mnp
        >>> mnp.flatnonzero(mj.masked_array(jnp.array([0.0, 2.0, 3.0]), jnp.array([True, True, False])))
        Array([1], dtype=int32)
    """
    return jnp.flatnonzero(_valid_nonzero(a), size=size, fill_value=fill_value)


def copy(a, order=None) -> MaskedArray:
    """A copy of data and mask (``jax.numpy.copy``).

    Examples:
        >>> import jax.numpy as jnp, masked_jax as mj, masked_jax.numpy as mnp
        >>> mnp.copy(mj.masked_array(jnp.array([1.0, 2.0]), jnp.array([True, False])))
        MaskedArray([1.0 --], dtype=float32)
    """
    if order not in (None, "K", "C"):
        raise ValueError(f"copy: only order='K' (or 'C', None) is supported, as in jax.numpy; got {order!r}.")
    return as_masked(a).copy()


def shape(a) -> tuple[int, ...]:
    """The shape (``jax.numpy.shape``).

    Examples:
        >>> import masked_jax.numpy as mnp
        >>> mnp.shape(mnp.zeros((2, 3)))
        (2, 3)
    """
    return tuple(a.shape) if hasattr(a, "shape") else np.shape(a)


def ndim(a) -> int:
    """The number of dimensions (``jax.numpy.ndim``).

    Examples:
        >>> import masked_jax.numpy as mnp
        >>> mnp.ndim(mnp.zeros((2, 3)))
        2
    """
    return len(shape(a))


def size(a, axis: int | None = None) -> int:
    """The number of elements, or the length of ``axis`` (``jax.numpy.size``).

    Examples:
        >>> import masked_jax.numpy as mnp
        >>> mnp.size(mnp.zeros((2, 3))), mnp.size(mnp.zeros((2, 3)), 1)
        (6, 3)
    """
    dims = shape(a)
    return math.prod(dims) if axis is None else dims[normalize_axis(axis, len(dims))[0]]


__all__ = [
    *NAN,
    "diff",
    "diagonal",
    "trace",
    "cross",
    "hstack",
    "vstack",
    "dstack",
    "column_stack",
    "array_split",
    "hsplit",
    "vsplit",
    "dsplit",
    "isin",
    "digitize",
    "bincount",
    "histogram",
    "convolve",
    "correlate",
    "interp",
    "unique",
    "diag",
    "diagflat",
    "append",
    "select",
    "allclose",
    "matvec",
    "vecmat",
    "kron",
    "ediff1d",
    "argwhere",
    "flatnonzero",
    "copy",
    "shape",
    "ndim",
    "size",
]
