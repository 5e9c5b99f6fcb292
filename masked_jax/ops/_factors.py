"""Static records kept while ``maskify`` traces a program: which masks are the same along an axis,
and what data hold where they are masked.

A compact mask is often the logical and of masks that each vary along few axes: in attention the
weights' (B, 1, Lq, Lk) mask is the queries' (B, 1, Lq, 1) mask and the keys' (B, 1, 1, Lk) mask.
While ``maskify`` interprets a program, the mask helpers of :mod:`masked_jax.ops._base` record such
a factorisation for the masks they build: each mask is the ``and`` of its *factors*, and a factor
is a *root* (a mask array met earlier) seen through insertions and removals of size-1 dims and
transposes, written as the root axis each of its axes shows (``None``: size 1). Two factors with
the same root and the same axis map hold the same values, whatever arrays carry them.

The factor records are static (Python objects beside the traced masks, nothing is computed), sound by
construction (a mask nobody recorded is its own one factor; an operation the helpers cannot follow
records nothing) and kept for one ``maskify`` call only, in a :class:`Facts` object that the
interpreter creates and hands to every rule and helper that reads or writes them, as an argument
(``facts=``, ``_facts=`` on the registered rules). :data:`NO_FACTS` (the default, and what
``masked_jax.numpy`` passes) records and knows nothing. The contraction rule reads them: when the
factors of both operands' masks that vary along the contracted axes are the same, a valid ``inf``
can never meet a masked entry, so the zero-filled contraction is exact with no run-time test.
"""

from __future__ import annotations

import contextlib
from typing import Any, NamedTuple

import jax
import jax.extend.core.primitives as P
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive


class Factor(NamedTuple):
    """A root mask seen at another layout: ``axes[i]`` is the root axis shown by axis ``i``, or
    ``None`` where the factor has size 1."""

    root: Any  # id of the root array (which the records keep alive), or a derived key
    axes: tuple[int | None, ...]


def aligned(fs, ndim):
    """Factors brought to ``ndim`` axes by leading size-1 axes (numpy broadcasting)."""
    return tuple(Factor(f.root, (None,) * (ndim - len(f.axes)) + f.axes) for f in fs)


def transposed(fs, perm):
    return tuple(Factor(f.root, tuple(f.axes[p] for p in perm)) for f in fs)


def dropped(fs, dims):
    """Factors without ``dims``, or ``None`` when a factor varies along one of them."""
    if any(f.axes[d] is not None for f in fs for d in dims):
        return None
    return tuple(Factor(f.root, tuple(a for i, a in enumerate(f.axes) if i not in dims)) for f in fs)


def broadcast(fs, ndim, dims):
    """Factors after ``lax.broadcast_in_dim`` to ``ndim`` axes with ``broadcast_dimensions=dims``."""
    out = []
    for f in fs:
        axes = [None] * ndim
        for i, d in enumerate(dims):
            axes[d] = f.axes[i]
        out.append(Factor(f.root, tuple(axes)))
    return tuple(out)


def reshaped(fs, old, new):
    """Factors of a mask of compact shape ``old`` reshaped to ``new``, when the reshape only adds
    or removes size-1 dims (the sizes other than 1 are the same, in the same order); else ``None``."""
    old_dims = [i for i, s in enumerate(old) if s != 1]
    new_dims = [i for i, s in enumerate(new) if s != 1]
    if [old[i] for i in old_dims] != [new[i] for i in new_dims]:
        return None
    where = dict(zip(old_dims, new_dims))
    out = []
    for f in fs:
        axes = [None] * len(new)
        for i, a in enumerate(f.axes):
            if a is not None:
                axes[where[i]] = a
        out.append(Factor(f.root, tuple(axes)))
    return tuple(out)


def any_along(fs, axes):
    """Factors of ``any(m, axes, keepdims=True)`` for a mask ``m`` with factors ``fs`` (at its
    rank), or ``None``. When one factor ``v`` varies along ``axes``, the others are constant there
    and ``any(m) = (and of the others) & any(v)``; ``any(v)`` is a function of ``v``'s root and
    the root axes reduced, named by the root ``("any", root, reduced)`` (no array is computed for
    it: only the records compare it). It is implied by ``v``'s root (see :func:`implies`): a
    token mask and "the sequence has a valid token" together are the token mask."""
    varying = [f for f in fs if any(f.axes[a] is not None for a in axes)]
    if len(varying) != 1:
        return None
    v = varying[0]
    reduced = tuple(sorted(v.axes[a] for a in axes if v.axes[a] is not None))
    g = Factor(("any", v.root, reduced), tuple(None if i in axes else a for i, a in enumerate(v.axes)))
    return tuple(f for f in fs if f is not v) + (g,)


def implies(f, g) -> bool:
    """Whether factor ``f`` being True implies ``g`` being True at every position (the same rank):
    ``g`` is ``any`` of ``f``'s root over some root axes, shown at the axes where ``f`` shows them."""
    if not (isinstance(g.root, tuple) and g.root[0] == "any" and g.root[1] == f.root):
        return False
    return all(a is None or f.axes[i] == a for i, a in enumerate(g.axes))


def without_implied(fs):
    """``fs`` without the factors another one of them implies (their ``and`` is the same)."""
    return tuple(g for g in fs if not any(f != g and implies(f, g) for f in fs))


def same_along(fa, fb, roles_a, roles_b):
    """Whether two masks, as factor sets of two operands, hold the same values along the axes the
    roles name. ``roles_x[i]`` is the role of operand axis ``i``: ``("c", t)`` for the t-th
    contracted axis, ``("b", t)`` for the t-th batch axis, ``None`` for a free axis. True when the
    factors that vary along a contracted axis are, on each side, functions of contracted and batch
    axes only and the two sides' are the same roots under the same roles."""

    def varying(fs, roles):
        keyed = set()
        for f in fs:
            if not any(a is not None and roles[i] is not None and roles[i][0] == "c" for i, a in enumerate(f.axes)):
                continue
            if any(a is not None and roles[i] is None for i, a in enumerate(f.axes)):
                return None  # varies along a free axis too: the sides cannot be compared
            keyed.add((f.root, frozenset((a, roles[i]) for i, a in enumerate(f.axes) if a is not None)))
        return keyed

    va, vb = varying(fa, roles_a), varying(fb, roles_b)
    return va is not None and vb is not None and bool(va) and va == vb


# -- known values under a mask ---------------------------------------------------------------------
# Beside the masks' factors, maskify records what some data hold where their mask is False: a fill
# puts there exactly its value, and an elementwise op of filled data puts there the op of those
# values. The rules read the record to sanitise only where it matters: data already holding a
# value at which the op and its derivatives are finite are not filled again (a layer norm's
# ``(x - mean) * rsqrt(var + eps)`` fills once, not at every step).


class Known(NamedTuple):
    """What data hold where a mask with (at least) ``factors`` is False: ``value``, exactly when
    ``exact`` (a fill, or moves of filled data), else approximately (computed on a scalar).

    ``conditional``: the value holds when the plain operands it was computed with are finite. A
    dense layer with no bias, ``x @ w``, holds 0 in the rows of ``x`` filled with 0, but NaN in a
    column of ``w`` that holds an inf; every valid row of that column is then inf or NaN too
    (each one is a sum with a term ``x * inf``), and so is any gradient that such a column reaches
    in jnp. Only a fill that keeps a contraction's gradient finite (``fill(..., finite=True)``: a
    masked row meets masked outputs only) reads conditional records.

    ``along``: the value holds except in the slices along these data axes whose valid values are
    all NaN (a softmax's output: a slice with a valid NaN is NaN throughout). Only a contraction
    along exactly these axes reads such a record, where a NaN under the mask meets the valid NaN
    of its own slice only.
    """

    factors: frozenset
    value: object
    exact: bool
    conditional: bool = False
    along: tuple | None = None


def _axes(along):
    return None if along is None else tuple(sorted(along))


def _own_factor(m) -> tuple[Factor, ...]:
    """``m`` as its own one factor: its root, every axis of size other than 1 shown."""
    return (Factor(id(m), tuple(i if s != 1 else None for i, s in enumerate(np.shape(m)))),)


class Facts:
    """The static facts of one ``maskify`` call: the recorded factorisation of each mask met, the
    values recorded under masks (:class:`Known`), and a memo of fills and reductions already
    computed in the trace being built. Keyed by the ids of the traced arrays, which it keeps
    alive. The interpreter makes one per call and passes it to the rules; nothing is global."""

    active = True

    def __init__(self):
        self._masks: dict = {}  # id(mask) -> (mask, factors)
        self._values: dict = {}  # id(data) -> (data, Known)
        self._memo: dict = {}  # key -> (result, kept objects)

    # -- masks ---------------------------------------------------------------------------------
    def factors(self, m) -> tuple[Factor, ...]:
        """The factors of mask ``m``: its record, or ``m`` itself as its one root."""
        if id(m) in self._masks:
            return self._masks[id(m)][1]
        own = _own_factor(m)
        self._masks[id(m)] = (m, own)  # keeps ``m`` alive: its id names it for the whole call
        return own

    def record(self, m, fs):
        """``m``, recorded as the ``and`` of the factors ``fs`` (``None``: record nothing)."""
        if m is not None and fs is not None:
            self._masks[id(m)] = (m, tuple(dict.fromkeys(fs)))
        return m

    def parts(self, m, ndim):
        """The arrays of ``m``'s factors at rank ``ndim`` (each broadcastable to ``m``, their ``and``
        is ``m``), or ``None`` when ``m`` has one factor or a factor has no array (a derived root).
        A reduction of ``m`` then reduces only the factors that vary along its axes: ``any`` of a
        (B, Lq, Lk) mask built from a (B, Lq, 1) and a (B, 1, Lk) factor, along Lk, is the first
        times ``any`` of the second, with no (B, Lq, Lk) array."""
        fs = aligned(self.factors(m), ndim)
        if len(fs) < 2:
            return None
        out = []
        for f in fs:
            entry = self._masks.get(f.root) if not isinstance(f.root, tuple) else None
            if entry is None:
                return None
            root = entry[0]
            shown = [a for a in f.axes if a is not None]
            varying = [i for i, n in enumerate(np.shape(root)) if n != 1]
            if sorted(shown) != varying:  # not a root seen through moves of its axes: nothing to rebuild
                return None
            squeezed = jnp.reshape(root, [np.shape(root)[i] for i in varying])
            moved = jnp.transpose(squeezed, [varying.index(a) for a in shown])
            out.append(jnp.reshape(moved, [1 if a is None else np.shape(root)[a] for a in f.axes]))
        return tuple(zip(fs, out))

    # -- values under masks ------------------------------------------------------------------------
    def _mask_key(self, mask, ndim):
        return frozenset(aligned(self.factors(mask), ndim))

    def known(self, data, mask, conditional=False, along=None) -> Known | None:
        """The recorded value of ``data`` wherever ``mask`` is False, if one is known: a record made
        under a mask with the same or more factors (more factors: more positions) covers it. A
        conditional record (see :class:`Known`) only where ``conditional`` asks for it, a record
        ``along`` some axes only for a contraction ``along`` the same axes."""
        if mask is None or id(data) not in self._values:
            return None
        k = self._values[id(data)][1]
        if (k.conditional and not conditional) or (k.along is not None and k.along != _axes(along)):
            return None
        return k if self._mask_key(mask, np.ndim(data)) <= k.factors else None

    def holds_zero(self, data, mask, conditional=False, along=None) -> bool:
        """Whether ``data`` are recorded as holding exactly 0 wherever ``mask`` is False."""
        k = self.known(data, mask, conditional, along)
        return k is not None and k.exact and k.value == 0

    def record_value(self, data, mask, value, exact, conditional=False, along=None):
        """Record that ``data`` hold ``value`` wherever ``mask`` is False (``conditional``: when the
        plain operands they were computed with are finite). Only finite values are recorded
        (``None``, inf or NaN: nothing), so a record always means finite data there."""
        if mask is not None and value is not None and bool(np.isfinite(value)):
            self._values[id(data)] = (
                data,
                Known(self._mask_key(mask, np.ndim(data)), value, exact, conditional, _axes(along)),
            )
        return data

    def same_values(self, pairs):
        """For each ``(new, old)`` pair of values (``(data, mask)``): ``new``'s data hold what
        ``old``'s hold under the same mask (an identity that only changes derivatives), so the
        record of ``old``'s data, if any, holds for ``new``'s."""
        for new, old in pairs:
            if new[0] is not old[0] and id(old[0]) in self._values:
                self._values[id(new[0])] = (new[0], self._values[id(old[0])][1])

    # -- traces --------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def new_trace(self):
        """A block traced apart (a ``scan`` or ``while`` body, a ``cond`` branch): results computed
        inside belong to its trace, so the memo of :meth:`memo` starts empty there and the outer
        one is restored after (records of masks and values stay: they only read arrays)."""
        outer, self._memo = self._memo, {}
        try:
            yield
        finally:
            self._memo = outer

    def memo(self, key, make, *keep):
        """``make()``, computed once per ``key`` (the same fill of the same data under the same mask,
        asked for by two rules, is one fill); ``keep`` are the objects whose ids the key holds,
        kept alive with the result."""
        if key not in self._memo:
            self._memo[key] = (make(), keep)
        return self._memo[key][0]


class _NoFacts(Facts):
    """No records: every mask is its own one factor, nothing is known under a mask, nothing is
    memoised (``masked_jax.numpy``, and any rule called without facts)."""

    active = False

    def factors(self, m):
        return _own_factor(m)

    def record(self, m, fs):
        return m

    def parts(self, m, ndim):
        return None

    def known(self, data, mask, conditional=False, along=None):
        return None

    def record_value(self, data, mask, value, exact, conditional=False, along=None):
        return data

    def same_values(self, pairs):
        pass

    @contextlib.contextmanager
    def new_trace(self):
        yield

    def memo(self, key, make, *keep):
        return make()


NO_FACTS: Facts = _NoFacts()


_SAFE_CACHE: dict = {}


def _on_host():
    """Scalar evaluations on the CPU where jax has one (on an accelerator each scalar op would be
    compiled for it, a kernel launched and its result copied back)."""
    try:
        cpu = jax.devices("cpu")[0]
    except RuntimeError:
        return contextlib.nullcontext()
    return jax.default_device(cpu)


def evaluate(fn, values, dtypes, derivatives=True):
    """``(fn(*values), safe)`` on 0-d arrays of ``dtypes``: its value as a Python number, and
    whether that value and every partial derivative are finite there (so data holding these
    values need no sanitising before ``fn``). ``(None, False)`` when ``fn`` cannot be evaluated
    on scalars. ``derivatives=False`` (at an op's own safe values, safe by design) evaluates the
    value alone. Cached by ``fn.key`` where the caller gives one (a primitive and its params)."""
    key = getattr(fn, "key", None)
    cache_key = None if key is None else (key, tuple(values), tuple(str(d) for d in dtypes), derivatives)
    if cache_key is not None and cache_key in _SAFE_CACHE:
        return _SAFE_CACHE[cache_key]
    host = None if key is None else _scalar_on_host(key[0], values, dtypes, derivatives)
    if host is not None:
        result = host
    else:
        result = _evaluated(fn, values, dtypes, derivatives)
    if cache_key is not None:
        if len(_SAFE_CACHE) >= 8192:  # bounded: programs differ in their ops and values
            _SAFE_CACHE.clear()
        _SAFE_CACHE[cache_key] = result
    return result


def _scalar_on_host(prim, values, dtypes, derivatives):
    """:func:`evaluate` by numpy for the arithmetic whose value and partial derivatives it computes
    as XLA does (one IEEE operation each: ``+ - * /``, ``max``, ``min`` on float16/32/64 scalars),
    with no program compiled; ``None`` for anything else."""
    if not isinstance(prim, Primitive) or prim not in _HOST_ARITHMETIC or len(values) != 2:
        return None
    dts = [np.dtype(jax.dtypes.canonicalize_dtype(d)) for d in dtypes]  # float64 is float32 without x64
    if any(d not in (np.float16, np.float32, np.float64) for d in dts) or dts[0] != dts[1]:
        return None
    with np.errstate(all="ignore"):
        a, b = (np.asarray(v, d)[()] for v, d in zip(values, dts))
        out = _HOST_ARITHMETIC[prim](a, b)
        partials = []
        if derivatives:
            if prim is P.mul_p:
                partials = [b, a]
            elif prim is P.div_p:
                partials = [np.divide(np.ones_like(b), b), np.negative(a) * np.divide(np.ones_like(b), b * b)]
    tiny = np.finfo(dts[0]).tiny
    if any(0 < abs(float(x)) < tiny for x in (a, b, out, *partials)):
        return None  # XLA on the CPU flushes subnormals to zero; numpy keeps them
    finite = bool(np.isfinite(out)) and all(bool(np.isfinite(d)) for d in partials)
    return (out.item(), finite)


_HOST_ARITHMETIC = {
    P.add_p: np.add,
    P.sub_p: np.subtract,
    P.mul_p: np.multiply,
    P.div_p: np.divide,
    P.max_p: np.maximum,
    P.min_p: np.minimum,
}


def _evaluated(fn, values, dtypes, derivatives):
    """:func:`evaluate`'s result computed by jax (each scalar op compiled once per process)."""
    try:
        with jax.ensure_compile_time_eval(), _on_host():
            args = [jnp.asarray(v, d) for v, d in zip(values, dtypes)]
            out = fn(*args)
            if np.ndim(out) != 0 or not jnp.issubdtype(out.dtype, jnp.inexact):
                result = (None, False)
            else:
                diff = [i for i, a in enumerate(args) if jnp.issubdtype(a.dtype, jnp.inexact) and derivatives]
                finite = bool(jnp.isfinite(out))
                for i in diff:
                    tangents = [jnp.zeros_like(a) if j != i else jnp.ones_like(a) for j, a in enumerate(args)]
                    tangents = [
                        t if jnp.issubdtype(a.dtype, jnp.inexact) else np.zeros((), jax.dtypes.float0)
                        for t, a in zip(tangents, args)
                    ]
                    _, dout = jax.jvp(fn, tuple(args), tuple(tangents))
                    finite = finite and bool(jnp.all(jnp.isfinite(dout)))
                result = (out.item(), finite)
    except Exception:  # noqa: BLE001 - an op that does not take scalars: nothing known
        result = (None, False)
    return result
