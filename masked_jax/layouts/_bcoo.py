"""BCOO-backed masked arrays: masked semantics on ``jax.experimental.sparse.BCOO`` storage.

The specified entries are exactly the valid ones; an explicitly stored zero is
valid. Batch (``n_batch``) and dense (``n_dense``, "hybrid") dimensions are
kept as BCOO has them: each stored entry covers a whole dense block. Padding
entries (indices out of range, as BCOO pads) are ignored everywhere. ``nse``
is static.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import sparse as jsparse

from masked_jax._core import STATE, MaskedArray, SparseMasked, check_index, from_pair, is_tracer
from masked_jax.layouts._segments import first_copies, segment_total, tuple_ids, unique_ids
from masked_jax.ops._base import Pair, accumulation_dtype, widened_indices

DATA_KEY, INDICES_KEY = jax.tree_util.GetAttrKey("data"), jax.tree_util.GetAttrKey("indices")


def batched_shape(shape, data, indices):
    """``shape`` with the batch dimensions a transform added or removed: ``vmap`` and ``scan`` stack
    or slice the buffers along new leading (batch) dimensions and keep the aux ``shape`` as it was.
    The buffers say how many dimensions the array has (``n_batch + n_sparse + n_dense = data.ndim -
    1 + indices.shape[-1]``); leading dimensions the buffers gained are prepended, those they lost
    dropped."""
    if not (hasattr(data, "ndim") and hasattr(indices, "ndim")) or indices.ndim < 2:
        return shape  # placeholders of a tree utility, or no index dimension to read
    extra = data.ndim - 1 + indices.shape[-1] - len(shape)
    if extra > 0:
        return tuple(data.shape[:extra]) + shape
    return shape[-extra:] if extra < 0 else shape


@jax.tree_util.register_pytree_with_keys_class
class BCOOMaskedArray(SparseMasked, storage="bcoo"):
    """A masked array stored as BCOO: build with :func:`from_bcoo` or ``x.tostype("bcoo")``.

    Examples:
        >>> import jax.numpy as jnp, masked_jax as mj
        >>> from jax.experimental import sparse
        >>> x = mj.from_bcoo(sparse.BCOO.fromdense(jnp.array([[0.0, 2.0], [3.0, 0.0]])))
        >>> x
        BCOOMaskedArray(float32[2, 2], nse=2, n_batch=0, n_dense=0)
        >>> x.todense()
        MaskedArray([[-- 2.0]
                     [3.0 --]], dtype=float32)
    """

    __slots__ = ("data", "indices", "shape")

    def tree_flatten(self):
        return (self.data, self.indices), self.shape

    def tree_flatten_with_keys(self):
        """Children with their names: paths read ``.data`` and ``.indices``."""
        return ((DATA_KEY, self.data), (INDICES_KEY, self.indices)), self.shape

    @classmethod
    def tree_unflatten(cls, shape, children):
        obj = object.__new__(cls)
        obj.data, obj.indices = children
        obj.shape = batched_shape(tuple(shape), obj.data, obj.indices)
        return obj

    _label = "entry"
    dtype = property(lambda self: self.data.dtype)
    n_batch = property(lambda self: self.indices.ndim - 2)
    n_sparse = property(lambda self: self.indices.shape[-1])
    n_dense = property(lambda self: self.data.ndim - self.indices.ndim + 1)

    @property
    def nse(self) -> int:
        """The static number of stored entries, padding included."""
        return self.indices.shape[-2]

    def __repr__(self):
        return f"BCOOMaskedArray({self._repr_shape()}, nse={self.nse}, n_batch={self.n_batch}, n_dense={self.n_dense})"

    @classmethod
    def from_bcoo(cls, bcoo: jsparse.BCOO) -> BCOOMaskedArray:
        if not isinstance(bcoo, jsparse.BCOO):
            raise TypeError(f"from_bcoo needs a jax.experimental.sparse.BCOO; got {type(bcoo).__name__}.")
        indices = holding_shape(widened_indices(bcoo.indices), bcoo.shape[bcoo.n_batch : bcoo.n_batch + bcoo.n_sparse])
        return cls.tree_unflatten(bcoo.shape, (bcoo.data, indices))

    def to_bcoo(self) -> jsparse.BCOO:
        """The storage as a plain BCOO (dense semantics: unspecified entries read as 0).

        Padding slots are sanitised on the way out: their data becomes 0 and their indices one
        past the end of every sparse dimension (negative indices are padding too, never wrapped),
        so no jax BCOO operation can read a padding value or wrap a padding index.
        """
        return jsparse.BCOO((self.clean_data(), self.clean_indices()), shape=self.shape)

    def clean_data(self):
        """The stored values with padding slots set to 0."""
        valid = self.entry_valid().reshape(self.entry_valid().shape + (1,) * self.n_dense)
        return jnp.where(valid, self.data, jnp.zeros((), self.dtype))

    def clean_indices(self):
        """The indices with every padding entry at one past the end (the one padding convention)."""
        end = jnp.array(self.shape[self.n_batch : self.n_batch + self.n_sparse], self.indices.dtype)
        return jnp.where(self.entry_valid()[..., None], self.indices, end)

    def entry_valid(self):
        """Per stored entry: True unless it is padding (an index out of range)."""
        sparse_shape = jnp.array(self.shape[self.n_batch : self.n_batch + self.n_sparse], self.indices.dtype)
        ok = (self.indices >= 0) & (self.indices < sparse_shape)
        return jnp.all(ok, axis=-1)

    def first_copies(self):
        """Per stored entry (batch..., nse): True at the first stored copy of its index tuple
        (within its batch element), False at later duplicates and at padding entries. A gradient
        keeps each element's cotangent in its first copy only, so that the duplicates, summed,
        read as the dense gradient once.

        Examples:
            >>> import jax.numpy as jnp, masked_jax as mj
            >>> from jax.experimental import sparse
            >>> b = sparse.BCOO((jnp.ones(3), jnp.array([[1, 0], [0, 1], [1, 0]])), shape=(2, 2))
            >>> mj.from_bcoo(b).first_copies()
            Array([ True,  True, False], dtype=bool)
        """
        sparse_shape = self.shape[self.n_batch : self.n_batch + self.n_sparse]
        valid = self.entry_valid()
        indices = jnp.broadcast_to(self.indices, valid.shape + (self.n_sparse,))

        def one(idx, ok):  # one batch element: (nse, n_sparse) index tuples
            return first_copies(tuple_ids(idx, sparse_shape, ok)[0]) & ok

        for _ in range(self.n_batch):
            one = jax.vmap(one)
        return one(indices, valid)

    def block(self) -> Pair:
        """Stored values as a dense masked block (batch..., nse, dense...): rules run on this."""
        valid = self.entry_valid().reshape(self.entry_valid().shape + (1,) * self.n_dense)
        return Pair(self.data, jnp.broadcast_to(valid, self.data.shape))

    def with_data(self, data) -> BCOOMaskedArray:
        return BCOOMaskedArray.tree_unflatten(self.shape, (data, self.indices))

    def __getitem__(self, index) -> BCOOMaskedArray | MaskedArray:
        """Basic indexing (ints, slices, ``...``, ``None``) on the stored entries, as BCOO indexes
        them: the result is BCOO-backed, built from the entries inside the index, with no array at
        the logical shape (dense, of the stored blocks' size, once ints take every sparse dim).

        Examples:
            >>> import jax.numpy as jnp, masked_jax as mj
            >>> from jax.experimental import sparse
            >>> x = mj.from_bcoo(sparse.BCOO.fromdense(jnp.array([[0.0, 2.0], [3.0, 0.0]])))
            >>> x[1].todense()
            MaskedArray([3.0 --], dtype=float32)
        """
        return basic_index(self, self.to_bcoo(), index)

    def todense(self) -> MaskedArray:
        """Dense-storage MaskedArray: stored entries valid (duplicates summed), the rest masked."""
        if self.dtype == jnp.bool_:  # duplicates of a bool are or-ed
            data = self.with_data(self.data.astype(jnp.int32)).to_bcoo().todense() > 0
        else:  # duplicates of float16/bfloat16 add up in float32, as jnp.sum adds
            acc = accumulation_dtype(self.dtype)
            data = self.with_data(self.data.astype(acc)).to_bcoo().todense().astype(self.dtype)
        ones = jnp.ones(self.data.shape, jnp.int32)
        mask = jsparse.BCOO((ones, self.clean_indices()), shape=self.shape).todense() > 0
        return from_pair(data, mask)

    def coalesce(self) -> BCOOMaskedArray:
        """Sum duplicate entries (static nse; freed slots become padding)."""
        boolean = self.dtype == jnp.bool_  # duplicates of a bool are or-ed
        flat = self.n_batch == 0 and self.n_dense == 0 and self.ndim > 0  # 0-d: no index to linearize
        if flat and 0 < self.nse:
            # flat layout: sort the entries' ids (unique_ids: faster than bcoo_sum_duplicates on
            # CPU; tuple_ids: at any logical size); padding entries sort last and stay padding
            lin, bound, decode = tuple_ids(self.indices, self.shape, self.entry_valid())
            uniq, seg = unique_ids(lin, bound)
            values = jnp.where(self.entry_valid(), self.data, jnp.zeros((), self.dtype))
            merge = jax.ops.segment_max if boolean else segment_total
            data = merge(values, seg, self.nse)
            indices = jnp.where((uniq < bound)[:, None], decode(uniq), jnp.array(self.shape, self.indices.dtype))
            return BCOOMaskedArray.tree_unflatten(self.shape, (data, indices))
        x = self.with_data(self.data.astype(jnp.int32)) if boolean else self
        summed = jsparse.bcoo_sum_duplicates(x.to_bcoo(), nse=self.nse)
        data = summed.data > 0 if boolean else summed.data
        return BCOOMaskedArray.tree_unflatten(self.shape, (data, summed.indices))

    def flatten_dense(self) -> BCOOMaskedArray:
        """Move hybrid dense dimensions into the sparse ones (one entry per stored element)."""
        if self.n_dense == 0:
            return self
        return BCOOMaskedArray.from_bcoo(jsparse.bcoo_update_layout(self.to_bcoo(), n_dense=0))

    def transpose(self, *args: Any, **kwargs: Any) -> Any:
        """The axes permuted, as ``jax.Array.transpose``: ``x.transpose()``, ``x.transpose(axes)``,
        ``x.transpose(*axes)`` or ``x.transpose(axes=...)``; the result stays BCOO-backed."""
        axes = kwargs.pop("axes", None) if not args else args[0] if len(args) == 1 else args
        if kwargs:
            raise TypeError(f"transpose: unexpected keyword arguments {sorted(kwargs)}.")
        return BCOOMaskedArray.from_bcoo(
            jsparse.bcoo_transpose(
                self.to_bcoo(), permutation=tuple(axes) if axes is not None else tuple(range(self.ndim))[::-1]
            )
        )

    @property
    def T(self):
        return self.flatten_dense().transpose()

    def to_row_sparse(self):
        """Row-sparse view when the layout is one sparse dimension + dense ones; else via dense."""
        rows = SparseMasked.LAYOUTS["row_sparse"]
        if self.n_batch == 0 and self.n_sparse == 1 and self.shape[0] <= np.iinfo(np.int32).max:
            return rows.tree_unflatten((tuple(self.shape), False), (self.data, self.indices[:, 0]))
        return rows.from_masked(self.todense())

    @classmethod
    def _empty(cls, dense, nse, n_batch, n_dense) -> BCOOMaskedArray:
        """The layout of a zero-size ``dense``: ``nse`` slots, all padding (index = the shape)."""
        shape = dense.shape
        n_sparse = len(shape) - n_batch - n_dense
        batch, block = shape[:n_batch], shape[len(shape) - n_dense :]
        data = jnp.zeros(batch + (nse,) + block, dense.dtype)
        dtype = holding_shape(jnp.zeros(0, jnp.int32), shape[n_batch : n_batch + n_sparse]).dtype
        indices = jnp.broadcast_to(jnp.array(shape[n_batch : n_batch + n_sparse], dtype), batch + (nse, n_sparse))
        return cls.tree_unflatten(shape, (data, indices))

    @classmethod
    def from_masked(cls, x, nse=None, n_batch=0, n_dense=0) -> BCOOMaskedArray:  # type: ignore[override]
        """BCOO storage holding exactly the valid entries of ``x`` (explicit zeros included).

        With ``n_dense > 0`` each stored entry is a whole dense block, so a block must be fully
        valid or fully masked: checked eagerly (``ValueError``); under ``jit`` a partly valid
        block is stored whole.
        """
        if getattr(x, "storage", None) == "row_sparse" and not (n_batch or n_dense):
            return cls.from_bcoo(x.to_bcoo())
        dense = x if isinstance(x, MaskedArray) else x.todense()
        if nse is None and is_tracer(dense.mask):
            raise ValueError("to_bcoo() under jit needs a static nse (number of stored entries).")
        if dense.size == 0:  # nothing to store (jax's bcoo_fromdense cannot extract from an empty array)
            return cls._empty(dense, nse or 0, n_batch, n_dense)
        if n_dense and not is_tracer(dense.mask):
            blocks = dense.mask.reshape(
                dense.shape[: dense.ndim - n_dense] + (math.prod(dense.shape[dense.ndim - n_dense :]),)
            )
            if not bool(jnp.all(jnp.all(blocks, -1) == jnp.any(blocks, -1))):
                raise ValueError(
                    f"a hybrid layout (n_dense={n_dense}) stores whole dense blocks: each block over the "
                    f"last {n_dense} dimension(s) must be fully valid or fully masked."
                )
        pattern = jsparse.BCOO.fromdense(dense.mask, nse=nse, n_batch=n_batch, n_dense=n_dense)
        if nse is not None and not is_tracer(dense.mask):
            need = jsparse.BCOO.fromdense(dense.mask, n_batch=n_batch, n_dense=n_dense).nse
            if need > nse:
                raise ValueError(
                    f"nse={nse} is too small: this layout needs {need} entries to hold every valid element."
                )
        data = jsparse.bcoo_extract(pattern, dense.data).data
        return cls.tree_unflatten(dense.shape, (data, pattern.indices))


def holding_shape(indices, sparse_shape):
    """``indices`` in an integer dtype that holds every sparse dimension's length, the padding
    index (one past the end): their own, else uint32 (lengths up to 2**32 - 1 with
    ``jax_enable_x64`` off) or int64. A ``ValueError`` says to enable x64 where no dtype holds it."""
    longest = max(sparse_shape, default=0)
    if longest <= np.iinfo(indices.dtype).max:
        return indices
    if jax.config.read("jax_enable_x64"):
        return indices.astype(jnp.int64)
    if longest <= np.iinfo(np.uint32).max:
        return indices.astype(jnp.uint32)
    raise ValueError(
        f"a sparse dimension of length {longest} needs 64-bit indices (its padding index, the length "
        "itself, must fit them); enable jax_enable_x64 (jax.config.update('jax_enable_x64', True))."
    )


def basic_index(x, bcoo: jsparse.BCOO, index) -> BCOOMaskedArray | MaskedArray:
    """``x[index]`` for a sparse layout ``x`` stored as ``bcoo`` (its stored entries are its valid
    ones): BCOO's own indexing for ints, slices, ``...`` and ``None`` (BCOO-backed while a sparse
    dimension is left, else a dense MaskedArray of the stored blocks' size); an int out of range raises
    ``IndexError`` (as numpy; BCOO would clamp it). Integer arrays along the rows (:func:`row_ids`)
    gather the stored rows (:meth:`RowSparseArray.take_rows`) when the layout is one sparse
    dimension and dense ones; any other array index is taken on dense storage, through the
    storage fallback."""
    ids = row_ids(index)
    if ids is not None and hasattr(x, "take_rows"):  # a row-sparse array
        return x.take_rows(*ids)
    if ids is not None and isinstance(x, BCOOMaskedArray) and x.n_batch == 0 and x.n_sparse == 1:
        return x.to_row_sparse().take_rows(*ids).to_bcoo_masked()
    if ids is not None or _array_part(index):
        STATE.fallback("getitem", x.storage)
        return x.todense()[index]
    parts = index if isinstance(index, tuple) else (index,)
    for p in parts:
        if not (
            p is None
            or p is Ellipsis
            or isinstance(p, slice)
            or (isinstance(p, (int, np.integer)) and not isinstance(p, (bool, np.bool_)))
        ):
            raise TypeError(
                f"{type(x).__name__}[...]: only ints, slices, ... and None index a sparse layout "
                f"(got {type(p).__name__}); index x.todense() for array indices."
            )
    check_index(index, x.shape)  # an int out of range: IndexError, as numpy (BCOO would clamp it)
    out = bcoo[index]
    if out.n_sparse == 0 and bcoo.n_sparse > 0:
        # every sparse dim taken by an int: no index is left to say which entries matched (BCOO
        # zeroes the others), so their number is read from marks indexed the same way; the
        # result is dense, of the stored blocks' size
        marks = jsparse.BCOO((jnp.ones(bcoo.data.shape, jnp.int32), bcoo.indices), shape=bcoo.shape)[index]
        return from_pair(BCOOMaskedArray.from_bcoo(out).todense().data, marks.todense() > 0)
    return BCOOMaskedArray.from_bcoo(out)


def _array_part(index) -> bool:
    """Whether ``index`` has an array part (integer or bool), which basic indexing does not take."""
    parts = index if isinstance(index, tuple) else (index,)
    return any(isinstance(p, (jax.Array, np.ndarray, list, MaskedArray)) for p in parts)


def row_ids(index):
    """``(ids, valid)`` when ``index`` takes rows by an integer array (``x[ids]``, or ``x[ids, :]``
    with full slices after it): the ids, and which of them are valid (a ``MaskedArray`` of ids
    may mask some); ``None`` for any other index. A 0-d id is an int, not a row list."""
    parts = index if isinstance(index, tuple) else (index,)
    if not parts or any(not (p is Ellipsis or (isinstance(p, slice) and p == slice(None))) for p in parts[1:]):
        return None
    ids = parts[0]
    if isinstance(ids, MaskedArray):
        data, valid = ids.data, ids.mask
    elif isinstance(ids, (jax.Array, np.ndarray, list)):
        data = jnp.asarray(ids)
        valid = jnp.ones(data.shape, bool)
    else:
        return None
    if jnp.ndim(data) != 1 or not jnp.issubdtype(data.dtype, jnp.integer):
        return None
    return data, valid


def from_bcoo(bcoo: jsparse.BCOO) -> BCOOMaskedArray:
    """Masked semantics on a BCOO: its specified entries are the valid ones (stored zeros too).

    Examples:
        >>> import jax.numpy as jnp, masked_jax as mj, masked_jax.numpy as mnp
        >>> from jax.experimental import sparse
        >>> b = sparse.BCOO((jnp.array([0.0, 5.0]), jnp.array([[0], [2]])), shape=(4,))
        >>> mnp.mean(mj.from_bcoo(b))   # the stored 0 counts, unspecified entries do not
        MaskedArray(2.5, dtype=float32)
    """
    return BCOOMaskedArray.from_bcoo(bcoo)


def to_bcoo(x, nse=None) -> jsparse.BCOO:
    """A BCOO holding exactly the valid entries of ``x`` (a MaskedArray or sparse layout)."""
    if isinstance(x, BCOOMaskedArray):
        return x.to_bcoo()
    return BCOOMaskedArray.from_masked(x, nse).to_bcoo()
