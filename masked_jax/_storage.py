"""Storage shared by all layouts: the sparse base class, conversions by name, the densifying fallback
and strict mode. Kept outside `layouts/` so that `_core` can use it without an import cycle."""

from __future__ import annotations

import contextlib
import threading
import warnings

import jax


class StorageFallbackWarning(UserWarning):
    """An op had no sparse rule for a layout and densified its operand (MXNet's storage fallback).

    Emitted once per op name.

    Examples:
        >>> import warnings, jax.numpy as jnp, masked_jax as mj, masked_jax.numpy as mnp
        >>> x = mj.row_sparse(jnp.ones((1, 2)), jnp.array([0]), (3, 2))
        >>> with warnings.catch_warnings(record=True) as w:
        ...     warnings.simplefilter("always")
        ...     mnp.atleast_2d(x)
        ...     [issubclass(i.category, mj.StorageFallbackWarning) for i in w][:1]
        MaskedArray(...)
        [True]
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


_state = threading.local()
_warned: set = set()


def _strict() -> bool:
    return getattr(_state, "strict", False)


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
    old = _strict()
    _state.strict = strict
    try:
        yield
    finally:
        _state.strict = old


def fallback(op_name: str, layout: str):
    """Record that ``op_name`` densifies a ``layout`` operand: warn once per op, or raise if strict."""
    if _strict():
        raise StorageFallbackError(
            f"{op_name} has no sparse rule for {layout} storage and strict storage is on; "
            f"convert explicitly with x.tostype('dense') or leave strict_storage()."
        )
    if op_name not in _warned:
        _warned.add(op_name)
        warnings.warn(
            f"masked_jax: {op_name} has no sparse rule for {layout} storage; densifying the operand "
            "(storage fallback). Use strict_storage() to make this an error.",
            StorageFallbackWarning,
            stacklevel=4,
        )


class SparseMasked:
    """Base of the sparse layouts: a pytree with masked semantics and a ``tostype`` conversion."""

    storage: str = "sparse"

    def todense(self):  # pragma: no cover - abstract
        raise NotImplementedError

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

    def _repr_shape(self):
        return f"{self.dtype}[{', '.join(str(d) for d in self.shape)}]"


# storage name -> function(MaskedArray-or-sparse, nse) building that storage; filled by the layouts.
FROM_MASKED = {}
# operator name -> the masked_jax.numpy function; filled by masked_jax.numpy (which imports us).
OPERATORS = {}


def tostype(x, storage: str, nse: int | None = None):
    """``x`` (any layout) in ``storage``: ``"dense"``, ``"bcoo"`` or ``"row_sparse"``."""
    if storage not in ("dense", "bcoo", "row_sparse"):
        raise ValueError(f"storage must be 'dense', 'bcoo' or 'row_sparse'; got {storage!r}.")
    current = getattr(x, "storage", "dense")
    if storage == current:
        return x
    if storage == "dense":
        return x.todense()
    return FROM_MASKED[storage](x, nse)


def _operator(name, dunder, reflected=False):
    def method(self, other):
        fn = OPERATORS[name]
        return fn(other, self) if reflected else fn(self, other)

    method.__name__ = dunder
    return method


for _dunder, _name in {"add": "add", "sub": "subtract", "mul": "multiply", "truediv": "true_divide",
                       "pow": "power", "matmul": "matmul"}.items():
    setattr(SparseMasked, f"__{_dunder}__", _operator(_name, f"__{_dunder}__"))
    setattr(SparseMasked, f"__r{_dunder}__", _operator(_name, f"__r{_dunder}__", reflected=True))
for _dunder, _name in {"gt": "greater", "ge": "greater_equal", "lt": "less", "le": "less_equal"}.items():
    setattr(SparseMasked, f"__{_dunder}__", _operator(_name, f"__{_dunder}__"))


def _neg(self):
    return OPERATORS["negative"](self)


SparseMasked.__neg__ = _neg
del _dunder, _name

def is_tracer(x) -> bool:
    return isinstance(x, jax.core.Tracer)
