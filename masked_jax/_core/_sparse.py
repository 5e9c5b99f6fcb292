"""Storage shared by all layouts: the sparse-layout protocol (an abstract base class), conversions by
storage name, and the storage-fallback state (strict mode, warned ops) as one object. The layouts
themselves (``masked_jax.layouts``) subclass :class:`SparseMasked`; ``MaskedArray`` converts to them
through :attr:`SparseMasked.LAYOUTS`, by storage name."""

from __future__ import annotations

import abc
import contextlib
import html
import threading
import warnings
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from masked_jax._core._methods import ArrayMethods
from masked_jax._validate import dtype_kind, is_tracer
from masked_jax.ops._base import Pair

if TYPE_CHECKING:
    from masked_jax._core._masked import MaskedArray


class StorageFallbackWarning(UserWarning):
    """An op had no sparse rule for a layout and densified its operand (MXNet's storage fallback).

    Emitted once per op name (per thread), the first time that op densifies; under
    :func:`~masked_jax.strict_storage` the same fallback raises :class:`StorageFallbackError`.

    Examples:
        >>> import warnings, jax.numpy as jnp, masked_jax as mj, masked_jax.numpy as mnp
        >>> x = mj.row_sparse(jnp.ones((1, 2)), jnp.array([0]), (3, 2))
        >>> with warnings.catch_warnings():
        ...     warnings.simplefilter("error", mj.StorageFallbackWarning)
        ...     with mj.strict_storage():  # an error instead of the warning
        ...         mnp.atleast_2d(x)
        Traceback (most recent call last):
        masked_jax.StorageFallbackError: atleast_2d has no sparse rule for row_sparse storage and ...
    """


class StorageFallbackError(TypeError):
    """Raised instead of densifying when strict storage is on (:func:`strict_storage`).

    Examples:
        >>> import jax.numpy as jnp, masked_jax as mj, masked_jax.numpy as mnp
        >>> x = mj.row_sparse(jnp.ones((1, 2)), jnp.array([0]), (3, 2))
        >>> with mj.strict_storage():
        ...     try:
        ...         mnp.transpose(x)
        ...     except mj.StorageFallbackError as err:
        ...         print("transpose" in str(err))
        True
    """


# public as masked_jax.StorageFallbackWarning / StorageFallbackError: tracebacks name them so
StorageFallbackWarning.__module__ = StorageFallbackError.__module__ = "masked_jax"


class StorageState(threading.local):
    """The storage-fallback state, one object per thread: strict mode and the ops already warned about.

    :meth:`fallback` is the one place where an op densifies a sparse operand: it warns once per op
    name, or raises :class:`StorageFallbackError` while strict storage is on.
    """

    def __init__(self):
        self.strict = False
        self.warned: set = set()

    def fallback(self, op_name: str, layout: str):
        """Record that ``op_name`` densifies a ``layout`` operand: warn once per op, or raise if strict."""
        if self.strict:
            raise StorageFallbackError(
                f"{op_name} has no sparse rule for {layout} storage and strict storage is on; "
                f"convert explicitly with x.tostype('dense') or leave strict_storage()."
            )
        if op_name not in self.warned:
            self.warned.add(op_name)
            warnings.warn(
                f"masked_jax: {op_name} has no sparse rule for {layout} storage; densifying the operand "
                "(storage fallback). Use strict_storage() to make this an error.",
                StorageFallbackWarning,
                stacklevel=6,
            )


STATE = StorageState()


@contextlib.contextmanager
def strict_storage(strict: bool = True):
    """Inside this context an op that would densify a sparse operand raises instead.

    Examples:
        >>> import jax.numpy as jnp, masked_jax as mj, masked_jax.numpy as mnp
        >>> x = mj.row_sparse(jnp.ones((1, 2)), jnp.array([3]), (5, 2))
        >>> with mj.strict_storage():
        ...     mnp.exp(x).storage
        'row_sparse'
    """
    if not isinstance(strict, bool):
        raise TypeError(f"strict_storage: strict must be a bool; got {type(strict).__name__}.")
    old = STATE.strict
    STATE.strict = strict
    try:
        yield
    finally:
        STATE.strict = old


class SparseMasked(ArrayMethods, abc.ABC):
    """Base of the sparse layouts: a pytree with masked semantics over stored values.

    A layout subclasses this with ``storage="<name>"`` in its class statement and implements the
    abstract members below; that registers it for :func:`tostype` under its name. Its ``rules``
    table maps an op family to ``rule(spec, operands, params) -> result | NotImplemented``; a
    family without a rule there (or a rule answering ``NotImplemented``) densifies the operands
    through the storage fallback and runs the dense rule.

    Every layout exposes its stored values as a dense masked *block* (:meth:`block`, padding slots
    masked), so an op's ordinary rule runs on them in O(stored entries).
    """

    __slots__ = ()
    data: Any  # the stored values, padding slots included (a layout's own slot)
    shape: tuple  # the full (dense) shape
    indices: Any  # where each stored slot sits (a layout's own form)
    dtype: Any
    _label: ClassVar[str]  # what a stored slot is called in the text view ("row", "entry")
    storage: ClassVar[str] = "sparse"
    rules: ClassVar[dict] = {}
    LAYOUTS: ClassVar[dict] = {}

    def __init_subclass__(cls, storage: str | None = None, **kwargs):
        super().__init_subclass__(**kwargs)
        if storage is not None:
            cls.storage = storage
            SparseMasked.LAYOUTS[storage] = cls

    # -- what a layout implements ------------------------------------------------------------------
    @property
    @abc.abstractmethod
    def nse(self) -> int:
        """The static number of stored slots (entries or rows), padding included."""

    @abc.abstractmethod
    def block(self) -> Pair:
        """The stored values as a ``Pair`` whose mask is False at padding slots."""

    @abc.abstractmethod
    def with_data(self, data) -> Any:
        """The same indices holding new stored values."""

    @abc.abstractmethod
    def coalesce(self) -> Any:
        """Duplicates summed; the static number of slots unchanged (freed slots become padding)."""

    @abc.abstractmethod
    def first_copies(self) -> Any:
        """Per stored slot: True at the first stored copy of its logical entry, False at later
        duplicates and at padding slots (the slot axes of :meth:`block`'s mask)."""

    @abc.abstractmethod
    def todense(self) -> MaskedArray:
        """The dense-storage ``MaskedArray`` with the same valid entries."""

    @classmethod
    @abc.abstractmethod
    def from_masked(cls, x, nse: int | None = None) -> Any:
        """This layout holding exactly the valid entries of ``x`` (any layout)."""

    # -- shared ------------------------------------------------------------------------------------
    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    def tostype(self, storage: str, nse: int | None = None):
        """Convert to ``"dense"`` (a MaskedArray), ``"bcoo"`` or ``"row_sparse"`` storage.

        Going to a sparse storage from elsewhere needs a static number of stored
        entries: counted eagerly, or given as ``nse`` under ``jit``.
        """
        return tostype(self, storage, nse)

    def filled(self, fill_value=0):
        return self.todense().filled(fill_value)

    @property
    def mask(self):
        return self.todense().mask

    def __bool__(self):
        raise TypeError("bool() of a sparse masked array is ambiguous; use .todense() or .filled().")

    def __array__(self, dtype=None, copy=None):
        raise TypeError("A sparse masked array cannot be converted implicitly; use .todense() or .filled().")

    __array_ufunc__ = None
    __array_priority__ = 100
    __hash__ = object.__hash__  # pyright: ignore[reportAssignmentType]  (ArrayMethods' __eq__ is elementwise)

    def _repr_shape(self):
        return f"{self.dtype}[{', '.join(str(d) for d in self.shape)}]"

    def _stored(self):
        """``[(position label, value text)]`` of the stored slots, padding marked, the middle cut as
        ``numpy`` summarises (``edgeitems`` at each end) when there are more than ``2 * edgeitems``;
        ``None`` when the buffers are traced or batched (then only the summary line is shown)."""
        if (
            is_tracer(self.data)
            or is_tracer(self.indices)
            or self.indices.ndim != (1 if self.storage == "row_sparse" else 2)
        ):
            return None
        data, indices = displayable(np.asarray(self.data)), np.asarray(self.indices)
        mask = np.asarray(self.block().mask)
        valid = np.asarray(
            mask.reshape(len(indices), mask.size // max(len(indices), 1)).any(axis=1)
        )  # no slots, or 0-wide
        out = []
        for i in edge_positions(len(indices), summarise=True):
            if i is None:
                out.append(("...", ""))
                continue
            where = f"{self._label} {indices[i].tolist()}" if valid[i] else "padding"
            out.append((where, np.array2string(data[i], separator=" ") if data[i].ndim else str(data[i])))
        return out

    def __str__(self):
        lines = self._stored()
        if lines is None:
            return repr(self)
        return repr(self) + "".join(f"\n  {where}: {value}" if value else f"\n  {where}" for where, value in lines)

    def _repr_html_(self):
        """The notebook view: the summary line, then one table row per stored slot."""
        lines = self._stored()
        head = f"<code>{html.escape(repr(self))}</code>"
        if lines is None:
            return head
        rows = "".join(
            f"<tr><td style='padding:2px 6px;color:#555'>{html.escape(w)}</td>"
            f"<td style='padding:2px 6px;font-family:monospace'>{html.escape(v)}</td></tr>"
            for w, v in lines
        )
        return f"<div class='mj-sparse'>{head}<table style='border-collapse:collapse'>{rows}</table></div>"


def displayable(data: np.ndarray) -> np.ndarray:
    """Host data as numpy can print it (bfloat16 and the other ml_dtypes floats through float32, int4
    and the other narrow integers through int64)."""
    if data.dtype.kind in "biufc":
        return data
    return data.astype(np.int64 if dtype_kind(data.dtype) in "iu" else np.float32)


def edge_positions(n: int, summarise: bool) -> list:
    """The positions shown along an axis of length ``n``: all, or when ``summarise`` and ``n`` is
    longer than ``2 * edgeitems``, the ``edgeitems`` at each end around ``None`` (the ellipsis)."""
    edge = np.get_printoptions()["edgeitems"]
    if not summarise or n <= 2 * edge:
        return list(range(n))
    return list(range(edge)) + [None] + list(range(n - edge, n))


def tostype(x, storage: str, nse: int | None = None):
    """``x`` (any layout) in ``storage``: ``"dense"`` or a registered sparse layout's name."""
    if storage != "dense" and storage not in SparseMasked.LAYOUTS:
        raise ValueError(f"storage must be 'dense' or one of {sorted(SparseMasked.LAYOUTS)}; got {storage!r}.")
    current = getattr(x, "storage", "dense")
    if storage == current:
        return x
    if storage == "dense":
        return x.todense()
    return SparseMasked.LAYOUTS[storage].from_masked(x, nse)
