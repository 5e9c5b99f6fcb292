"""``MaskedArray``: a pytree of ``data`` and a bool ``mask`` (``True`` = valid).

Mask convention: **True means valid / specified**, as in ``jnp.sum(where=...)``,
``optax.masked`` and ``torch.masked``. This is the *opposite* of ``numpy.ma``,
whose mask marks invalid entries; :func:`from_numpy_ma` and
:meth:`MaskedArray.to_numpy_ma` invert it.
"""

from __future__ import annotations

import html
import math
import re
from typing import TYPE_CHECKING, Any, cast

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike, DTypeLike

from masked_jax import ops
from masked_jax._core import _sparse as _layouts
from masked_jax._core._methods import ArrayMethods
from masked_jax._validate import dtype_kind, is_tracer
from masked_jax.ops._base import Pair, ranked, with_mask_tangent
from masked_jax.ops.shape import at_update

if TYPE_CHECKING:
    from types import ModuleType

    from jax.experimental import sparse as jsparse


def format_values(data: np.ndarray, mask: np.ndarray) -> str:
    """The values as numpy.ma prints them, masked entries as ``--``: every value while the array
    has at most ``np.get_printoptions()["threshold"]`` elements, else the edge items
    (``edgeitems``) around ``...``, as ``jax.Array`` and ``numpy.ma`` summarise."""
    data = _layouts.displayable(data)
    options = np.get_printoptions()
    big = data.size > options["threshold"]
    if big:  # only the edge items are formatted: along a long axis, edgeitems, one stand-in, edgeitems
        edge = options["edgeitems"]
        picks = np.ix_(*(np.r_[0:edge, edge, n - edge : n] if n > 2 * edge else np.arange(n) for n in data.shape))
        data, mask = data[picks], np.broadcast_to(mask, data.shape)[picks]
    cells = np.array([str(v) if ok else "--" for v, ok in zip(data.flat, mask.flat)], dtype=object)
    # numpy puts "..." in place of the stand-ins (numpy.ma's own summary drops rows of a long 2-d
    # array with no "..." and prints float32 with float64 digits)
    return np.array2string(
        cells.reshape(data.shape), separator=" ", formatter={"all": str}, threshold=0 if big else options["threshold"]
    )


def html_table(data: np.ndarray, mask: np.ndarray, caption: str) -> str:
    """An HTML table of a 0-, 1- or 2-d array (summarised as :func:`format_values`); higher
    dimensions as the printed text."""
    if data.ndim > 2:
        return f"<pre>{html.escape(caption)}\n{html.escape(format_values(data, mask))}</pre>"
    d2, m2 = np.atleast_2d(_layouts.displayable(data)), np.atleast_2d(mask)
    big = data.size > np.get_printoptions()["threshold"]
    rows = []
    for i in _layouts.edge_positions(d2.shape[0], big):
        cells = []
        for j in _layouts.edge_positions(d2.shape[1], big):
            if i is None or j is None:
                cells.append('<td style="color:#888">&hellip;</td>')
            elif m2[i, j]:
                cells.append(f'<td class="mj-valid" style="padding:2px 6px">{html.escape(str(d2[i, j]))}</td>')
            else:
                cells.append('<td class="mj-masked" style="padding:2px 6px;background:#d0d0d0;color:#555">--</td>')
        rows.append("<tr>" + "".join(cells) + "</tr>")
    return (
        f'<table class="mj-array" style="border-collapse:collapse;font-family:monospace">'
        f"<caption>{html.escape(caption)}</caption>{''.join(rows)}</table>"
    )


def fully_valid_data(x, what: str, why: str):
    """The data of ``x`` when it is a plain value or a masked array whose mask is concretely all
    True (a sparse layout is densified); otherwise a ``TypeError`` naming ``what`` and saying
    ``why`` a masked entry has no meaning there."""
    if isinstance(x, _layouts.SparseMasked):
        x = x.todense()
    if not isinstance(x, MaskedArray):
        return x
    if x.compact_mask is None:  # statically valid
        return x.data
    try:
        all_valid = bool(np.asarray(x.mask).all())
    except jax.errors.TracerArrayConversionError:
        all_valid = False
    if not all_valid:
        raise TypeError(f"{what} must be fully valid (a concrete all-True mask): {why}")
    return x.data


def _check_rebuilt_mask(mask):
    """A mask that generic tree code rebuilt (``jax.tree.map`` maps the mask too): bool, or a
    tangent's float0; anything else is refused at once, with the fix."""
    dtype = getattr(mask, "dtype", None)
    if dtype is None or dtype == jnp.bool_ or dtype == jax.dtypes.float0:
        return
    raise TypeError(
        f"a MaskedArray's mask must stay bool (True = valid); generic tree code turned it into {dtype}. "
        "jax.tree.map maps every leaf, the mask too: map over the data only with "
        "mj.tree_map_data(f, tree), or pass is_leaf=mj.is_masked_leaf and rebuild each array with "
        "mj.masked_array(f(x.data), x.mask)."
    )


_DATA_KEY = jax.tree_util.GetAttrKey("data")
_MASK_KEY = jax.tree_util.GetAttrKey("mask")


def check_data(data, argname: str = "data") -> jax.Array:
    if isinstance(data, MaskedArray):
        raise TypeError(f"{argname} must be an array, not a MaskedArray; pass it directly instead.")
    if isinstance(data, (str, bytes)) or (isinstance(data, np.ndarray) and dtype_kind(data.dtype) in "SUOV"):
        kind = data.dtype if isinstance(data, np.ndarray) else type(data).__name__
        raise TypeError(f"{argname} must be a numeric or bool array; got {kind}.")
    try:
        arr = jnp.asarray(data)
    except (TypeError, ValueError) as err:
        raise TypeError(f"{argname} must be a numeric or bool array; got {type(data).__name__} ({err}).") from None
    if not (jnp.issubdtype(arr.dtype, jnp.number) or arr.dtype == jnp.bool_):
        raise TypeError(f"{argname} must have a numeric or bool dtype; got {arr.dtype}.")
    return arr


def _check_mask(mask, shape) -> jax.Array:
    if mask is np.ma.nomask:  # numpy.ma's "nothing masked" is False, which here would mask everything
        raise ValueError(
            "mask is numpy.ma.nomask (numpy.bool_ False), whose meaning is inverted here: masked_jax's "
            "mask is True = valid. Pass mask=None for every element valid, or x = mj.from_numpy_ma(a) "
            "for a numpy.ma array (a Python False masks every element)."
        )
    if isinstance(mask, MaskedArray):
        raise TypeError("mask must be a bool array, not a MaskedArray.")
    try:
        mask = jnp.asarray(mask)
    except (TypeError, ValueError):
        raise TypeError(f"mask must be a bool array; got {type(mask).__name__}.") from None
    if mask.dtype != jnp.bool_:
        raise TypeError(
            f"mask must have dtype bool (True = valid); got {mask.dtype}. "
            "Convert it with mask.astype(bool) or build it with a comparison."
        )
    return compact(mask, shape)


def compact(mask, shape):
    """``mask`` stored at its own (compact) shape, with leading 1s up to ``len(shape)`` dims: a
    (B, L, 1) token mask of (B, L, D) data stays (B, L, 1). It must broadcast to ``shape`` without
    growing it."""
    shape = tuple(shape)
    mshape = tuple(jnp.shape(mask))
    if len(mshape) > len(shape) or any(m not in (1, d) for m, d in zip(mshape[::-1], shape[::-1])):
        raise ValueError(f"mask must have the data's shape {shape} or broadcast to it; got mask of shape {mshape}.")
    return ranked(mask, len(shape))


@jax.tree_util.register_pytree_with_keys_class
class MaskedArray(ArrayMethods):
    """An array with a bool validity mask: ``mask[i]`` is ``True`` where ``data[i]`` is valid.

    Masked-out data is unspecified: no result and no gradient depends on it.
    Build one with :func:`masked_array` or :func:`as_masked`. It is a pytree
    with children ``(data, mask)``, so it flows through ``jit``, ``vmap``,
    ``scan`` and ``grad(..., allow_int=True)``; built without a mask it is
    statically valid and its mask child is ``None`` (see :attr:`compact_mask`).

    Examples:
        >>> import jax.numpy as jnp, masked_jax as mj
        >>> x = mj.masked_array(jnp.array([1.0, 2.0, 3.0]), jnp.array([True, False, True]))
        >>> x
        MaskedArray([1.0 -- 3.0], dtype=float32)
        >>> (x * 2).sum()
        MaskedArray(8.0, dtype=float32)
    """

    # _zeroed (set by _from_pair(..., zeroed=True), absent otherwise): the masked-out data are
    # known to be 0 with a zero tangent, so filled(0) needs no select; a Python-level fact of this
    # object, not of the pytree, so it is dropped (conservatively) across jit boundaries and tree maps
    __slots__ = ("_data", "_mask", "_zeroed")
    _data: jax.Array
    _mask: jax.Array | None  # None: statically all valid (no mask stored)
    # numpy defers binary operators to us instead of converting us to an ndarray.
    __array_ufunc__ = None
    __array_priority__ = 100

    def __init__(self, data: ArrayLike, mask: ArrayLike | None = None):
        data = check_data(data)
        mask = None if mask is None else _check_mask(mask, data.shape)
        self._data = data
        self._mask = mask

    @classmethod
    def _from_pair(cls, data, mask, *, zeroed=False):
        """Trusted constructor for rule outputs: no dtype checks, mask broadcast to data.

        ``zeroed=True``: the caller has already set the data to 0, with a zero tangent, wherever
        ``mask`` is False (``jnp.where(mask, x, 0)``), so no ``mask_tangent`` is added and
        ``filled(0)`` returns the data as it is (no second select for XLA to fuse into every
        consumer)."""
        obj = object.__new__(cls)
        data = jnp.asarray(data)
        # None (statically all valid) stays None; a compact mask stays compact
        obj._mask = None if mask is None else compact(mask, data.shape)
        if zeroed:
            obj._data, obj._zeroed = data, True
        else:
            obj._data = with_mask_tangent(data, mask)  # None (all valid): nothing to mask
        return obj

    # -- pytree ---------------------------------------------------------------------------
    def tree_flatten(self):
        return (self._data, self._mask), None

    def tree_flatten_with_keys(self):
        """Children with their names: paths read ``.data`` and ``.mask`` (checkpoints, npz files)."""
        return ((_DATA_KEY, self._data), (_MASK_KEY, self._mask)), None

    @classmethod
    def tree_unflatten(cls, aux, children):
        obj = object.__new__(cls)
        obj._data, obj._mask = children
        _check_rebuilt_mask(obj._mask)
        return obj

    # -- attributes -----------------------------------------------------------------------
    @property
    def data(self) -> jax.Array:
        """The data buffer; values at masked-out positions are unspecified."""
        return self._data

    @property
    def mask(self) -> jax.Array:
        """The bool validity mask at the data's shape, ``True`` where the element is valid (a
        compact mask broadcast, and all ``True`` for a statically valid array; see
        :attr:`compact_mask`)."""
        if self._mask is None:
            return jnp.ones(self._data.shape, bool)
        if self._mask.shape == self._data.shape:
            return self._mask
        return jnp.broadcast_to(self._mask, self._data.shape)

    @property
    def compact_mask(self) -> jax.Array | None:
        """The mask as stored: any shape of the data's rank that broadcasts to the data's shape,
        such as (B, L, 1) for (B, L, D) data, or ``None`` when the array is statically all valid
        (built without a mask, or computed from such arrays by elementwise, shape and most
        reduction ops). Rules propagate it without broadcasting it (an elementwise op of two
        compact masks gives their broadcast), so a token mask costs (B, L) bools, not (B, L, D),
        and a statically valid array carries no mask at all.

        ``None`` is part of the pytree structure (a ``MaskedArray`` without a mask has one leaf,
        its data), as ``None`` fields are in flax and equinox. A ``lax.scan`` carry or the branches
        of a ``lax.cond`` that may gain a mask need a mask from the start: build it with
        ``mj.masked_array(x, jnp.ones(x.shape, bool))``.

        Examples:
            >>> import jax.numpy as jnp, masked_jax as mj
            >>> x = mj.masked_array(jnp.ones((2, 3, 4)), jnp.array([[True, True, False], [True, False, False]])[..., None])
            >>> x.compact_mask.shape, x.mask.shape, (2 * x).compact_mask.shape
            ((2, 3, 1), (2, 3, 4), (2, 3, 1))
            >>> print(mj.as_masked(jnp.ones(3)).compact_mask)
            None
        """
        return self._mask

    shape = property(lambda self: tuple(self._data.shape), doc="Shape of the array.")
    dtype = property(lambda self: self._data.dtype, doc="Dtype of the data.")
    ndim = property(lambda self: self._data.ndim, doc="Number of dimensions.")
    size = property(lambda self: self._data.size, doc="Number of elements, valid or not.")

    def __len__(self):
        if self.ndim == 0:
            raise TypeError("len() of a 0-d MaskedArray.")
        return self.shape[0]

    def filled(self, fill_value: ArrayLike = 0) -> jax.Array:
        """A plain array with ``fill_value`` at masked-out positions.

        Results that already hold 0 under their mask (``mj.embedding_bag``, ``mj.lookup`` of
        masked ids) return their data from ``filled(0)``, with no select.

        Examples:
            >>> import jax.numpy as jnp, masked_jax as mj
            >>> mj.masked_array(jnp.array([1, 2]), jnp.array([True, False])).filled(-1)
            Array([ 1, -1], dtype=int32)
        """
        if self._mask is None:
            return self._data
        if (
            getattr(self, "_zeroed", False)
            and type(fill_value) in (int, float, bool)
            and fill_value == 0
            and math.copysign(1.0, float(cast(float, fill_value))) > 0
        ):
            return self._data  # already 0 (and 0 in tangents) under the mask
        return jnp.where(self._mask, self._data, jnp.asarray(fill_value, dtype=self.dtype))  # broadcasts

    def to_numpy_ma(self) -> np.ma.MaskedArray:
        """Convert to ``numpy.ma.MaskedArray``, **inverting** the mask (numpy.ma: True = invalid).

        Examples:
            >>> import jax.numpy as jnp, masked_jax as mj
            >>> m = mj.masked_array(jnp.array([1, 2]), jnp.array([True, False])).to_numpy_ma()
            >>> m.mask, m.compressed()
            (array([False,  True]), array([1], dtype=int32))
        """
        if is_tracer(self._data) or is_tracer(self._mask):
            raise TypeError("to_numpy_ma() needs concrete values; it cannot run inside jit/vmap/grad.")
        return np.ma.masked_array(np.asarray(self._data), mask=~np.asarray(self.mask))

    def to_bcoo(self, nse: int | None = None) -> jsparse.BCOO:
        """A ``jax.experimental.sparse.BCOO`` holding exactly the valid entries (stored zeros too).

        ``nse`` (the number of valid entries) is counted eagerly; under ``jit`` pass it.

        Examples:
            >>> import jax.numpy as jnp, masked_jax as mj
            >>> b = mj.masked_array(jnp.array([0.0, 7.0, 1.0]), jnp.array([True, False, True])).to_bcoo()
            >>> b.data, b.indices[:, 0]
            (Array([0., 1.], dtype=float32), Array([0, 2], dtype=int32))
        """
        return _layouts.SparseMasked.LAYOUTS["bcoo"].from_masked(self, nse).to_bcoo()

    def tostype(self, storage: str, nse: int | None = None) -> Any:
        """This array in ``"dense"``, ``"bcoo"`` or ``"row_sparse"`` storage (same valid entries).

        Examples:
            >>> import jax.numpy as jnp, masked_jax as mj
            >>> x = mj.masked_array(jnp.ones((3, 2)), jnp.array([[True], [False], [True]]))
            >>> x.tostype("row_sparse").indices
            Array([0, 2], dtype=int32)
        """
        return _layouts.tostype(self, storage, nse)

    storage = "dense"

    # -- conversions to Python scalars: a valid element gives its value ----------------------------
    def _scalar(self, kind, convert):
        """``convert(data)`` when the (single) element is valid and concrete; else a clear error."""
        if is_tracer(self._data) or is_tracer(self._mask):
            raise TypeError(
                f"{kind}() of a traced MaskedArray: inside jit/vmap/grad its value and validity are not "
                "known yet. Use jnp.where(x.mask, ...) or lax.cond on x.filled(value) instead."
            )
        if self.size == 1 and self._mask is not None and not bool(np.asarray(self._mask).reshape(())):
            raise ValueError(
                f"{kind}() of a masked element: it has no value. Use x.filled(fill_value) to choose one, "
                "or test x.mask first."
            )
        return convert(self._data)

    def __bool__(self):
        return self._scalar("bool", bool)

    def __float__(self):
        return self._scalar("float", float)

    def __int__(self):
        return self._scalar("int", int)

    def __complex__(self):
        return self._scalar("complex", complex)

    def __index__(self):
        return self._scalar("index", lambda d: d.__index__())

    def __format__(self, format_spec: str) -> str:
        """``f"{x:.2f}"`` of a 0-d array: a valid value formats as jax's does, a masked one as
        ``--`` (aligned and padded to the spec's width); an empty spec gives ``str(x)``."""
        if not format_spec:
            return str(self)
        if self.ndim != 0 or is_tracer(self._data) or is_tracer(self._mask):
            raise TypeError(
                f"unsupported format string {format_spec!r} for a MaskedArray of shape {self.shape}: "
                "only a concrete 0-d array takes one, as for jax arrays."
            )
        if self._mask is not None and not bool(np.asarray(self._mask).reshape(())):
            layout = re.match(r"(?:(.)?([<>=^]))?[-+ ]?z?#?0?(\d*)", format_spec)
            fill, align, width = (
                layout.groups() if layout else (None, None, "")
            )  # a masked entry is padded with the fill, never zeros
            return format("--", f"{fill or ' '}{align or '>'}{width}")
        return format(self._data, format_spec)

    def item(self, *args):
        """The value of one element as a Python scalar (``x.item()`` of a one-element array, or
        ``x.item(i)`` by flat index or ``x.item(i, j)``); a masked element has no value and raises
        ``ValueError``, as ``float(x)`` does.

        Examples:
            >>> import jax.numpy as jnp, masked_jax as mj
            >>> x = mj.masked_array(jnp.array([1.5, 2.5]), jnp.array([True, False]))
            >>> x.item(0)
            1.5
        """
        one = self
        if len(args) == 1:
            one = self.reshape(-1)[args[0]]
        elif args:
            one = self[args]
        if one.size != 1:
            raise ValueError(f"item() takes one element; this array has {one.size} (pass an index).")
        return one._scalar("item", lambda d: d.reshape(()).item())

    def tolist(self):
        """Nested Python lists of the values, ``None`` at masked entries (``numpy.ma``'s ``tolist``).

        Examples:
            >>> import jax.numpy as jnp, masked_jax as mj
            >>> mj.masked_array(jnp.array([[1, 2], [3, 4]]), jnp.array([[True, False], [True, True]])).tolist()
            [[1, None], [3, 4]]
        """
        if is_tracer(self._data) or is_tracer(self._mask):
            raise TypeError("tolist() of a traced MaskedArray: its values are not known inside jit/vmap/grad.")

        def merge(values, valid):
            return (
                [merge(v, m) for v, m in zip(values, valid)]
                if isinstance(values, list)
                else (values if valid else None)
            )

        return merge(np.asarray(self._data).tolist(), np.asarray(self.mask).tolist())

    def __array__(self, dtype=None, copy=None):
        raise TypeError(
            "A MaskedArray cannot be converted to a plain array implicitly (the mask would be "
            "lost). Use x.filled(fill_value), x.data, or x.to_numpy_ma()."
        )

    def __contains__(self, value) -> bool:
        """``value in x``: whether a valid entry equals ``value`` (masked entries hold no value)."""
        if is_tracer(self._data) or is_tracer(self._mask):
            raise TypeError(
                "`in` on a traced MaskedArray: its values are not known inside jit/vmap/grad. Use "
                "jnp.any(x.mask & (x.data == value))."
            )
        return bool(jnp.any(self.mask & (self._data == value)))

    def __iter__(self):
        if self.ndim == 0:
            raise TypeError("iteration over a 0-d MaskedArray.")
        return (self[i] for i in range(self.shape[0]))

    # -- repr -------------------------------------------------------------------------------
    def __repr__(self):
        if is_tracer(self._data) or is_tracer(self._mask) or not hasattr(self._data, "shape"):
            dt = getattr(self._data, "dtype", "?")
            shape = ", ".join(str(d) for d in getattr(self._data, "shape", ()))
            return f"MaskedArray({dt}[{shape}])"
        if self._mask is not None and self._mask.dtype == jax.dtypes.float0:  # a tangent or cotangent
            return f"MaskedArray(tangent={np.asarray(self._data)!r})"
        body = format_values(np.asarray(self._data), np.asarray(self.mask))
        body = body.replace("\n", "\n" + " " * len("MaskedArray("))
        shape = f"shape={self.shape}, " if self.size == 0 else ""  # as jax.Array: [] alone has no shape
        return f"MaskedArray({body}, {shape}dtype={self.dtype})"

    __str__ = __repr__

    def _repr_html_(self):
        """The notebook view: a table of the values, masked entries shown as ``--`` on grey."""
        odd_mask = self._mask is not None and self._mask.dtype != jnp.bool_  # a tangent's float0, a mapped mask
        if is_tracer(self._data) or is_tracer(self._mask) or odd_mask:
            return f"<pre>{html.escape(repr(self))}</pre>"
        return html_table(
            np.asarray(self._data),
            np.asarray(self.mask),
            f"MaskedArray {self.dtype}[{', '.join(map(str, self.shape))}], {int(np.asarray(self.mask).sum())} valid",
        )

    # -- indexing -----------------------------------------------------------------------------
    def __getitem__(self, index) -> MaskedArray:
        taken = _masked_ids(self, index)
        if taken is not None:  # table[ids] with masked ids: masked rows
            return taken
        return apply("getitem", self, index=check_index(index, self.shape))

    @property
    def at(self) -> _AtIndexer:
        """Functional updates as ``jax.Array.at``: ``x.at[i].set(v)`` makes element ``i`` valid.

        Examples:
            >>> import jax.numpy as jnp, masked_jax as mj
            >>> x = mj.masked_array(jnp.zeros(3), jnp.array([True, False, False]))
            >>> x.at[1].set(5.0)
            MaskedArray([0.0 5.0 --], dtype=float32)
        """
        return _AtIndexer(self)

    @property
    def T(self) -> MaskedArray:
        """Transpose (reversed axes)."""
        return apply("transpose", self)

    @property
    def mT(self) -> MaskedArray:
        """Transpose of the last two axes (the Array API's matrix transpose)."""
        if self.ndim < 2:
            raise ValueError(f"mT needs at least 2 dimensions; got shape {self.shape}.")
        return apply("swapaxes", self, axis1=-1, axis2=-2)

    @property
    def device(self):
        """The device of the data (the Array API's ``x.device``)."""
        return self._data.device

    def to_device(self, device, /, *, stream=None) -> MaskedArray:
        """Data and mask moved to ``device`` (a ``jax.Device`` or ``Sharding``).

        Examples:
            >>> import jax, jax.numpy as jnp, masked_jax as mj
            >>> x = mj.masked_array(jnp.array([1.0, 2.0]), jnp.array([True, False]))
            >>> x.to_device(jax.devices()[0]).device == jax.devices()[0]
            True
        """
        if stream is not None:
            raise ValueError("to_device: streams are not supported; pass stream=None.")
        mask = None if self._mask is None else jax.device_put(self._mask, device)
        return MaskedArray._from_pair(jax.device_put(self._data, device), mask)

    if TYPE_CHECKING:  # installed by masked_jax.numpy, which is built on this class (see _array_methods)

        def __array_namespace__(self, *, api_version: str | None = None) -> ModuleType: ...

    def __setitem__(self, index, value):
        raise TypeError(
            "MaskedArray is immutable, as jax arrays are: use x.at[index].set(value), which "
            "returns a new array (a MaskedArray value brings its mask along)."
        )

    def __dlpack__(self, *, stream=None, max_version=None, dl_device=None, copy=None):
        """The data through DLPack, for a fully valid array (a concrete all-True mask); DLPack carries
        no mask, so an array with masked entries (or a traced mask) raises ``TypeError``."""
        data = fully_valid_data(
            self,
            "a MaskedArray exported through DLPack",
            "DLPack carries no mask. Export x.filled(value) and x.mask separately.",
        )
        options = {"stream": stream, "max_version": max_version, "dl_device": dl_device, "copy": copy}
        return data.__dlpack__(**options)

    def __dlpack_device__(self):
        return cast(Any, self._data).__dlpack_device__()  # jax arrays have it; their type stubs do not

    def __hash__(self):
        raise TypeError("MaskedArray is unhashable.")


class _AtIndexer:
    __slots__ = ("_x",)

    def __init__(self, x):
        self._x = x

    def __getitem__(self, index) -> _AtRef:
        return _AtRef(self._x, check_index(index))


class _AtRef:
    __slots__ = ("_x", "_index")

    def __init__(self, x, index):
        self._x, self._index = x, index

    def get(self, **kwargs) -> MaskedArray:
        return apply("getitem", self._x, index=self._index)

    def _update(self, op, value, kwargs) -> MaskedArray:
        return wrap(at_update(unwrap(self._x), self._index, op, unwrap(value, "value"), **kwargs))

    def set(self, value: ArrayLike | MaskedArray, **kwargs) -> MaskedArray:
        return self._update("set", value, kwargs)

    def add(self, value: ArrayLike | MaskedArray, **kwargs) -> MaskedArray:
        return self._update("add", value, kwargs)

    def multiply(self, value: ArrayLike | MaskedArray, **kwargs) -> MaskedArray:
        return self._update("multiply", value, kwargs)

    def min(self, value: ArrayLike | MaskedArray, **kwargs) -> MaskedArray:
        return self._update("min", value, kwargs)

    def max(self, value: ArrayLike | MaskedArray, **kwargs) -> MaskedArray:
        return self._update("max", value, kwargs)


def _plain_index(p):
    """An index part that is a MaskedArray: its data when every entry is (concretely) valid."""
    if not isinstance(p, MaskedArray):
        return p
    return fully_valid_data(
        p,
        "Indexing with a MaskedArray: the index",
        "a masked entry has no defined position. Use idx.filled(...) or a plain bool/int array.",
    )


def _masked_ids(x, index):
    """``x[ids]``, ``x[:, ids]``, ... for an integer :class:`MaskedArray` ``ids`` with masked entries
    (the other index parts full slices): the rows ``ids`` name along that axis, a masked id giving a
    masked row (``take``). A valid id out of range raises ``IndexError`` when it is known (as
    numpy), and gives a masked row under a trace. ``None`` for any other index.

    >>> import jax.numpy as jnp, masked_jax as mj
    >>> table = mj.masked_array(jnp.arange(6.0).reshape(3, 2), jnp.ones((3, 2), bool))
    >>> ids = mj.masked_array(jnp.array([2, 0]), jnp.array([True, False]))
    >>> table[ids]
    MaskedArray([[4.0 5.0]
                 [-- --]], dtype=float32)
    """
    parts = index if isinstance(index, tuple) else (index,)
    at = [i for i, p in enumerate(parts) if isinstance(p, MaskedArray) and dtype_kind(p.dtype) in "iu"]
    if len(at) != 1 or at[0] >= x.ndim:
        return None
    ids = parts[at[0]]
    if ids.compact_mask is None or (not is_tracer(ids.mask) and bool(np.asarray(ids.mask).all())):
        return None  # every id valid: an ordinary index
    if any(not (isinstance(p, slice) and p == slice(None)) for i, p in enumerate(parts) if i != at[0]):
        return None  # (refused by _check_index, with its message)
    n = x.shape[at[0]]
    if not (is_tracer(ids.data) or is_tracer(ids.mask)):
        valid_ids = np.asarray(ids.data)[np.asarray(ids.mask)]
        bad = valid_ids[(valid_ids < -n) | (valid_ids >= n)]
        if bad.size:
            raise IndexError(f"index {int(bad[0])} is out of bounds for axis {at[0]} with size {n}.")
    return apply("take", x, ids, axis=at[0])


def check_index(index, shape=None):
    """Refuse masked indices (a fully valid concrete MaskedArray index is its data), and static
    integer indices and concrete integer arrays of ids out of range (as numpy does; jax would clamp
    them and return valid data from another position; traced ids out of range read masked
    elements, see the ``getitem`` rule). Returns the index with plain arrays for masked ones."""
    parts = index if isinstance(index, tuple) else (index,)
    parts = tuple(_plain_index(p) for p in parts)
    index = parts if isinstance(index, tuple) else parts[0]
    if shape is None or any(
        isinstance(p, (np.ndarray, jax.Array, list)) and np.ndim(p) and np.asarray(p).dtype == bool
        for p in parts
        if not is_tracer(p)
    ):
        return index  # a bool index consumes several dimensions: leave it to jax
    dim = 0
    for p in parts:
        if p is None:
            continue
        if p is Ellipsis:
            dim = len(shape) - sum(1 for q in parts if q is not None and q is not Ellipsis) + dim
            continue
        if isinstance(p, (int, np.integer)) and not isinstance(p, (bool, np.bool_)) and dim < len(shape):
            if not -shape[dim] <= p < shape[dim]:
                raise IndexError(f"index {int(p)} is out of bounds for axis {dim} with size {shape[dim]}.")
        elif dim < len(shape) and ops.shape.gathers(p) and not is_tracer(p):
            # known ids out of range: an error, as numpy (jax would clamp them; traced ones are masked)
            ids = np.asarray(p)
            bad = ids[(ids < -shape[dim]) | (ids >= shape[dim])]
            if bad.size:
                raise IndexError(f"index {int(bad.flat[0])} is out of bounds for axis {dim} with size {shape[dim]}.")
        dim += 1
    return index


# -- wrapping rules ----------------------------------------------------------------------------
def from_pair(data, mask, *, zeroed: bool = False) -> MaskedArray:
    """The trusted constructor for rule outputs: no dtype checks, ``mask`` broadcast to ``data``.

    For library code whose data and mask come out of a rule; users call :func:`masked_array`.
    ``zeroed``: see :meth:`MaskedArray._from_pair`.
    """
    return MaskedArray._from_pair(data, mask, zeroed=zeroed)


def unwrap(x, argname: str = "argument") -> Pair:
    """A MaskedArray or array-like as a rule operand (plain arrays are fully valid)."""
    if isinstance(x, MaskedArray):
        if x._mask is not None and x._mask.dtype != jnp.bool_:
            raise TypeError(
                f"{argname} has a mask of dtype {x._mask.dtype}; a mask must be bool (True = valid). "
                "A jax.tree.map over a MaskedArray maps its mask too: map over x.data, or pass "
                "is_leaf=mj.is_masked and rebuild with mj.masked_array(f(x.data), x.mask)."
            )
        return Pair(x._data, x._mask)
    if isinstance(x, np.ma.MaskedArray):  # numpy.ma's mask marks *invalid* entries: inverted here
        return unwrap(from_numpy_ma(x), argname)
    if x is None or isinstance(x, (str, bytes)):
        raise TypeError(f"{argname} must be an array or MaskedArray; got {type(x).__name__}.")
    try:
        arr = jnp.asarray(x)
    except (TypeError, ValueError):
        raise TypeError(f"{argname} must be an array, a scalar or a MaskedArray; got {type(x).__name__}.") from None
    return Pair(arr, None)


def wrap(out) -> Any:
    """A rule output (Pair, list of Pairs, or a plain array) as user-facing values."""
    if isinstance(out, Pair):
        return MaskedArray._from_pair(out.data, out.mask)
    if isinstance(out, (list, tuple)):
        return type(out)(wrap(o) for o in out)
    return out


def apply(name: str, *operands, **params) -> Any:
    """Apply registered op ``name``'s rule to MaskedArray / array operands and wrap the result."""
    rule = ops.REGISTRY[name].rule
    return wrap(rule(*(unwrap(o, f"operand {i}") for i, o in enumerate(operands)), **params))


def is_operand(x) -> bool:
    """Whether ``x`` can be an operand of a masked operator (an array, scalar or masked array)."""
    return isinstance(x, (ArrayMethods, jax.Array, np.ndarray, np.generic, int, float, complex, bool))


def masked_array(data: ArrayLike, mask: ArrayLike | None = None, *, dtype: DTypeLike | None = None) -> MaskedArray:
    """Build a :class:`MaskedArray` from ``data`` and a bool ``mask`` (``True`` = valid).

    Args:
        data: numeric or bool array-like.
        mask: bool array of ``data``'s shape, or broadcastable to it (stored at its own
            shape). ``None`` means every element is valid, and no mask is stored.
        dtype: optional dtype to cast ``data`` to.

    Returns:
        A ``MaskedArray``.

    Raises:
        TypeError: ``data`` is not numeric/bool, or ``mask`` is not bool.
        ValueError: ``mask`` does not broadcast to ``data``'s shape.

    Examples:
        >>> import jax.numpy as jnp, masked_jax as mj
        >>> x = mj.masked_array(jnp.arange(3.0), jnp.array([True, True, False]))
        >>> x.mean()
        MaskedArray(0.5, dtype=float32)
        >>> mj.masked_array(jnp.ones((2, 3)), jnp.array([True, False, True])).mask.shape
        (2, 3)
    """
    data = check_data(data)
    if dtype is not None:
        data = data.astype(dtype)
    return MaskedArray(data, mask)


def as_masked(a: ArrayLike | MaskedArray) -> MaskedArray:
    """``a`` as a fully valid :class:`MaskedArray`; a ``MaskedArray`` passes through unchanged.

    Examples:
        >>> import jax.numpy as jnp, masked_jax as mj
        >>> mj.as_masked(jnp.array([1.0, 2.0])).mask
        Array([ True,  True], dtype=bool)
    """
    if isinstance(a, MaskedArray):
        return a
    if isinstance(a, np.ma.MaskedArray):
        return from_numpy_ma(a)
    return MaskedArray(check_data(a, "a"))


def from_numpy_ma(a: np.ndarray) -> MaskedArray:
    """Convert a ``numpy.ma.MaskedArray``, **inverting** its mask (numpy.ma: True = invalid).

    Examples:
        >>> import numpy as np, masked_jax as mj
        >>> x = mj.from_numpy_ma(np.ma.masked_array([1.0, 2.0], mask=[False, True]))
        >>> x.mask
        Array([ True, False], dtype=bool)
    """
    if not isinstance(a, np.ndarray):
        raise TypeError(f"a must be a numpy.ma.MaskedArray or ndarray; got {type(a).__name__}.")
    data = np.ma.getdata(a)
    if np.ma.getmask(a) is np.ma.nomask:  # numpy.ma's "no mask": statically valid
        return MaskedArray(check_data(data, "a"))
    return MaskedArray(check_data(data, "a"), jnp.asarray(~np.ma.getmaskarray(a)))


def is_masked_leaf(x: Any) -> bool:
    """``is_leaf`` for generic tree code: a masked array in any storage is one leaf, so a
    ``jax.tree.map(f, tree, is_leaf=mj.is_masked_leaf)`` sees whole masked arrays, never their masks.

    Examples:
        >>> import jax, jax.numpy as jnp, masked_jax as mj
        >>> tree = {"w": mj.masked_array(jnp.ones(2), jnp.array([True, False]))}
        >>> len(jax.tree.leaves(tree, is_leaf=mj.is_masked_leaf))
        1
    """
    return isinstance(x, (MaskedArray, _layouts.SparseMasked))


def tree_map_data(f, tree: Any, *rest: Any) -> Any:
    """``jax.tree.map(f, tree, *rest)`` over the *data* only: a masked array (any storage) keeps its
    mask (or indices) and gets ``f`` of its data; plain leaves get ``f``. The way to scale, cast or
    average parameter trees that hold masked arrays (a plain ``jax.tree.map`` maps the mask too).

    Examples:
        >>> import jax.numpy as jnp, masked_jax as mj
        >>> tree = {"w": mj.masked_array(jnp.ones(2), jnp.array([True, False])), "b": jnp.ones(1)}
        >>> mj.tree_map_data(lambda x: x * 2, tree)["w"]
        MaskedArray([2.0 --], dtype=float32)
        >>> mj.tree_map_data(lambda x: x.astype(jnp.bfloat16), tree)["w"].mask.dtype
        dtype('bool')
    """

    def one(x, *others):
        datas = [o.data if is_masked_leaf(o) else o for o in others]
        if isinstance(x, MaskedArray):
            return MaskedArray._from_pair(f(x.data, *datas), x.compact_mask)
        if is_masked_leaf(x):
            return x.with_data(f(x.data, *datas))
        return f(x, *datas)

    return jax.tree_util.tree_map(one, tree, *rest, is_leaf=is_masked_leaf)


def is_masked(x: Any) -> bool:
    """Whether ``x`` is a :class:`MaskedArray`.

    Examples:
        >>> import jax.numpy as jnp, masked_jax as mj
        >>> mj.is_masked(mj.as_masked(jnp.zeros(2))), mj.is_masked(jnp.zeros(2))
        (True, False)
    """
    return isinstance(x, MaskedArray)
