"""Shared helpers for masked rules.

Every rule in :mod:`masked_jax.ops` works on *pairs* ``(data, mask)`` of plain
``jax.Array`` objects, never on :class:`~masked_jax.MaskedArray` itself. ``mask`` is a
bool array broadcastable to ``data``, or ``None`` meaning "every element is
valid" (a plain operand), which lets rules skip work for unmasked inputs. The
same rules therefore serve the ``masked_jax.numpy`` front end, the sparse
layouts (which apply them to stored values) and the ``maskify`` interpreter.

The one pattern every rule follows is *sanitise on entry*: before data enters a
nonlinear computation, masked-out positions are replaced by a value that is
safe for that computation (``safe``). Masked-out NaN/inf then never reaches a
valid output, and reverse-mode cotangents at masked positions are exactly zero
instead of ``0 * inf = NaN`` (the ``jnp.where`` double-NaN trap).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from masked_jax._validate import dtype_kind
from masked_jax.ops import _factors
from masked_jax.ops._factors import NO_FACTS, Facts

# a bool array that broadcasts to the data, or None: statically all valid (typed Any: jax's
# arrays and tracers, numpy's bools and Python's all stand for one)
Mask = Any


class Pair(NamedTuple):
    """Data and mask of a masked value inside a rule (``mask=None``: all valid)."""

    data: Any
    mask: Mask


def and_masks(*masks: Mask, facts: Facts = NO_FACTS) -> Mask:
    """Logical and of masks, where ``None`` is the identity (all valid). With ``facts`` (under
    ``maskify``) the result is recorded as the and of the operands' factors (see
    :mod:`masked_jax.ops._factors`), and an operand already at the result's shape whose factors are
    all of them is the result (``x + f(x)`` keeps ``x``'s mask, with no ``and``)."""
    present = [m for m in masks if m is not None]
    if not present:
        return None
    if len(present) == 1:
        return present[0]
    if not facts.active:
        return functools.reduce(jnp.logical_and, present)
    shape = np.broadcast_shapes(*(np.shape(m) for m in present))
    fs = _factors.without_implied(
        tuple(dict.fromkeys(f for m in present for f in _factors.aligned(facts.factors(m), len(shape))))
    )
    for m in present:
        own = _factors.without_implied(_factors.aligned(facts.factors(m), len(shape)))
        if np.shape(m) == shape and set(own) == set(fs):
            return m
    return facts.record(functools.reduce(jnp.logical_and, present), fs)


def fill(
    data,
    mask: Mask,
    value,
    *,
    finite: bool = False,
    conditional: bool | None = None,
    along=None,
    facts: Facts = NO_FACTS,
):
    """``data`` with masked-out positions replaced by ``value`` (no-op if ``mask`` is None).

    With ``facts`` (under ``maskify``) the output is recorded as holding ``value`` there (see
    :mod:`masked_jax.ops._factors`), and data already recorded as holding exactly ``value`` there
    are returned as they are; with ``finite=True`` (a fill that only keeps derivatives finite, such
    as a dense layer's input: a masked row reaches masked outputs only) any recorded value is
    enough, a conditional one included (see :class:`masked_jax.ops._factors.Known`) unless
    ``conditional=False`` (a fill whose masked entries meet valid outputs); ``along``: the fill
    of a contraction along these axes (see :class:`masked_jax.ops._factors.Known`).
    """
    if mask is None:
        return data
    data = jnp.asarray(data)
    if not facts.active or not isinstance(value, (bool, int, float, complex)):
        return jnp.where(mask, data, scalar_like(value, data.dtype))
    k = facts.known(data, mask, conditional=finite if conditional is None else conditional, along=along)
    if k is not None and ((k.exact and k.value == value) or finite):
        return data
    return facts.memo(
        ("fill", id(data), id(mask), value),
        lambda: facts.record_value(jnp.where(mask, data, scalar_like(value, data.dtype)), mask, value, True),
        data,
        mask,
    )


def bound(prim, params):
    """``prim`` bound with ``params``, as a function of its operands; ``.key`` names it for the
    caches of :func:`masked_jax.ops._factors.evaluate`."""
    fn = lambda *datas: prim.bind(*datas, **params)  # noqa: E731
    try:
        fn.__dict__["key"] = (prim, tuple(sorted((k, repr(v)) for k, v in params.items())))
    except TypeError:
        pass
    return fn


def scalar_like(value, dtype):
    """``value`` as a Python scalar of ``dtype``'s kind.

    A Python scalar is weakly typed, so filling with it keeps ``data``'s dtype
    and weak type exactly (``jnp.where(m, x, 1.0)`` stays float16 for float16 x).
    An integer a weak Python int cannot carry (``2**32 - 1`` for uint32 or uint64: jax parses
    Python ints as int32/int64) comes as a 0-d array of ``dtype``.
    """
    kind = dtype_kind(dtype)
    if kind == "b":
        return bool(value)
    if kind in "iu":
        value = int(value)
        return value if -(2**31) <= value < 2**31 else np.asarray(value, dtype)
    if kind == "c":
        return complex(value)
    return float(value)


def full_mask(shape) -> jnp.ndarray:
    """An all-valid mask of ``shape``."""
    return jnp.ones(shape, dtype=bool)


def materialize(mask: Mask, shape) -> jnp.ndarray:
    """``mask`` broadcast to ``shape``, materialising ``None`` as all-valid."""
    if mask is None:
        return full_mask(shape)
    return jnp.broadcast_to(mask, shape)


def ranked(mask: Mask, ndim: int, facts: Facts = NO_FACTS) -> Mask:
    """``mask`` with leading 1s up to ``ndim`` dims (a compact mask keeps its sizes)."""
    if mask is None or jnp.ndim(mask) == ndim:
        return mask
    out = jnp.reshape(mask, (1,) * (ndim - jnp.ndim(mask)) + tuple(jnp.shape(mask)))
    return facts.record(out, _factors.aligned(facts.factors(mask), ndim)) if facts.active else out


def compact_or_ones(mask: Mask, shape, facts: Facts = NO_FACTS) -> jnp.ndarray:
    """``mask`` at the data's rank, kept compact; ``None`` (all valid) as a (1, ..., 1) True."""
    return jnp.ones((1,) * len(shape), bool) if mask is None else ranked(mask, len(shape), facts)


def uniform_along(mask, axes) -> bool:
    """Whether the compact ``mask`` (at the data's rank) does not vary along ``axes``: each slice
    along them is all valid or all masked."""
    return all(mask.shape[a] == 1 for a in axes)


def any_valid(mask, shape, axes, keepdims=False, facts: Facts = NO_FACTS):
    """Validity of a reduction over ``axes`` of data of ``shape``: whether each slice has a valid
    element, at the compact shape of the kept axes (``mask`` is compact, of the data's rank). A
    zero-size slice has none."""
    axes = tuple(axes)
    if any(shape[a] == 0 for a in axes):
        out = jnp.zeros_like(jnp.any(mask, axis=axes, keepdims=True))
        return out if keepdims else jnp.squeeze(out, axis=axes)
    if uniform_along(mask, axes):  # nothing to reduce
        out = mask
    else:
        out = facts.memo(
            ("any", id(mask), axes),
            lambda: facts.record(_any_of_factors(mask, axes, facts), _factors.any_along(facts.factors(mask), axes)),
            mask,
        )
    if keepdims:
        return out
    squeezed = jnp.squeeze(out, axis=axes)
    if facts.active:
        facts.record(squeezed, _factors.dropped(facts.factors(out), axes))
    return squeezed


def _any_of_factors(mask, axes, facts: Facts):
    """``jnp.any(mask, axes, keepdims=True)``; under ``maskify``, for a mask recorded as the ``and``
    of factors, the factors constant along ``axes`` are kept and only the ``and`` of those that
    vary is reduced (see :meth:`masked_jax.ops._factors.Facts.parts`): no array at the mask's full
    shape is built for the reduction."""
    parts = facts.parts(mask, np.ndim(mask))
    if parts is None:
        return jnp.any(mask, axis=axes, keepdims=True)
    varying = [p for f, p in parts if any(f.axes[a] is not None for a in axes)]
    kept = [p for f, p in parts if all(f.axes[a] is None for a in axes)]
    after = _factors.any_along(tuple(f for f, _ in parts), axes)
    implied = after is not None and _factors.without_implied(after) != after  # a kept factor implies the any
    if implied and kept:  # (a token mask and "the sequence has a valid token")
        out = functools.reduce(jnp.logical_and, kept)
    else:
        reduced = jnp.any(functools.reduce(jnp.logical_and, varying), axis=axes, keepdims=True)
        out = functools.reduce(jnp.logical_and, kept, reduced)
    return jnp.broadcast_to(out, tuple(1 if i in axes else n for i, n in enumerate(np.shape(mask))))


def count_valid(mask, shape, axes, keepdims=False):
    """The number of valid elements of each slice over ``axes`` (int32), at the compact shape of
    the kept axes: axes along which the compact ``mask`` does not vary count their length."""
    varying = tuple(a for a in axes if mask.shape[a] != 1)
    factor = int(np.prod([shape[a] for a in axes if mask.shape[a] == 1], dtype=np.int64))
    n = jnp.sum(mask, axis=varying, keepdims=True, dtype=jnp.int32) if varying else mask.astype(jnp.int32)
    n = n * factor if factor != 1 else n
    return n if keepdims else jnp.squeeze(n, axis=axes)


def normalize_axis(axis, ndim: int) -> tuple[int, ...]:
    """``axis`` (None, int or tuple) as a sorted tuple of non-negative ints."""
    if axis is None:
        return tuple(range(ndim))
    if isinstance(axis, (bool, np.bool_)) or not isinstance(axis, (int, np.integer, tuple, list)):
        raise TypeError(f"axis must be None, an int or a tuple of ints; got {axis!r}.")
    axes = (axis,) if isinstance(axis, (int, np.integer)) else tuple(axis)
    out = []
    for a in axes:
        if isinstance(a, (bool, np.bool_)) or not isinstance(a, (int, np.integer)):
            raise TypeError(f"axis must be None, an int or a tuple of ints; got {axis!r}.")
        a = int(a)
        if not -ndim <= a < ndim:  # as jnp: a 0-d array has no axis 0
            raise ValueError(f"axis {a} is out of bounds for an array of dimension {ndim}.")
        out.append(a % max(ndim, 1))
    if len(set(out)) != len(out):
        raise ValueError(f"axis {axis} contains a repeated axis.")
    return tuple(sorted(out))


@functools.cache
def _has_inf(dtype) -> bool:
    """Whether float ``dtype`` holds infinities (float8_e4m3fn and the other "fn" types do not: inf
    casts to NaN there, so their extremes are the largest finite values)."""
    with np.errstate(invalid="ignore", over="ignore"):
        return bool(np.isinf(np.asarray(np.inf).astype(dtype)))


def lowest(dtype):
    """The smallest value of ``dtype`` (-inf for floats that hold it, else their most negative finite
    value): the identity of ``max`` (a scalar that ``jnp`` takes for ``dtype``: see
    :func:`scalar_like`)."""
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        return False
    if jnp.issubdtype(dtype, jnp.floating):
        return -np.inf if _has_inf(dtype) else float(jnp.finfo(dtype).min)
    if dtype.kind == "c":  # jnp orders complex values lexicographically
        return complex(-np.inf, -np.inf)
    return scalar_like(jnp.iinfo(dtype).min, dtype)


def highest(dtype):
    """The largest value of ``dtype`` (+inf for floats that hold it): the identity of ``min``."""
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        return True
    if jnp.issubdtype(dtype, jnp.floating):
        return np.inf if _has_inf(dtype) else float(jnp.finfo(dtype).max)
    if dtype.kind == "c":
        return complex(np.inf, np.inf)
    return scalar_like(jnp.iinfo(dtype).max, dtype)


_LOW_PRECISION = (np.dtype(jnp.float16), np.dtype(jnp.bfloat16))


def accumulation_dtype(dtype):
    """The dtype a sum of ``dtype`` values accumulates in, as ``jax.numpy`` does: float16 and
    bfloat16 in float32 (a bfloat16 running sum of ones stalls at 256), every other dtype in
    itself."""
    return np.dtype(jnp.float32) if np.dtype(dtype) in _LOW_PRECISION else np.dtype(dtype)


def widened_indices(indices):
    """Integer ``indices`` of 8 or 16 bits as int32, others as they are: compared with a row count
    or holding the padding index (the shape), they must count past their own range (a uint8 id
    < 300 would compare as id < 44)."""
    return indices.astype(jnp.int32) if indices.dtype.itemsize < 4 else indices


def result_dtype(jax_fn, in_dtype, **params):
    """The dtype ``jax_fn(x, **params)`` returns for ``dtype`` data, read off ``jax.numpy`` itself
    (abstract evaluation, no computation): the oracle for ``mean``'s, ``var``'s and the cumulative
    ops' result dtypes, including the ``dtype=`` argument."""
    params = tuple(sorted(params.items(), key=lambda kv: kv[0]))
    return _result_dtype(jax_fn, np.dtype(in_dtype), params, bool(jax.config.read("jax_enable_x64")))


@functools.cache
def _result_dtype(jax_fn, in_dtype, params, x64):  # x64: the answer depends on it
    return jax.eval_shape(lambda d: jax_fn(d, **dict(params)), jax.ShapeDtypeStruct((1,), in_dtype)).dtype


@jax.custom_jvp
def mask_tangent(data, mask):
    """Identity on ``data`` whose tangent is zero wherever ``mask`` is False.

    Applied to every op output: a masked-out output has an exactly-zero tangent
    in forward mode, and in reverse mode a cotangent placed on a masked-out
    output never flows back into any input. Together with sanitising inputs on
    entry, a gradient at a masked-out element is exactly 0 and never NaN.
    """
    return data


@mask_tangent.defjvp
def _mask_tangent_jvp(primals, tangents):
    data, mask = primals
    t_data, _ = tangents
    return data, jnp.where(mask, t_data, jnp.zeros((), t_data.dtype))


def with_mask_tangent(data, mask):
    """``mask_tangent`` for differentiable (inexact) data; other dtypes pass through."""
    if mask is None or not jnp.issubdtype(jnp.result_type(data), jnp.inexact):
        return data
    return mask_tangent(data, jnp.broadcast_to(mask, jnp.shape(data)))


Rule = Callable[..., Pair]


def candidate_axes(shape, *, none=True):
    """The axes a named jax call over an array of ``shape`` may have reduced or sorted along (for
    ``OpSpec.static``): ``None`` (all), then each axis."""
    return ([None] if none else []) + list(range(len(shape)))
