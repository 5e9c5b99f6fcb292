"""What the interpreter knows statically: values computed from literals alone (evaluated before
the masked run), concrete scalars, and the element counts of masked sums (so that a mean divides
by the number of valid elements).
"""

from __future__ import annotations

import functools

import jax
import jax.extend.core.primitives as P
import jax.numpy as jnp
import numpy as np

from masked_jax import _jaxpr
from masked_jax._maskify import _rules as primitives
from masked_jax._validate import dtype_kind, is_tracer
from masked_jax.ops._base import Pair, materialize, ranked


def _moved_count(prim, params, count, shape):
    """A compact count of a sum of ``shape`` after the sum's ``broadcast_in_dim`` / ``reshape`` /
    ``convert_element_type`` (the count keeps its int dtype), kept compact where it can be."""
    c = count()
    if prim is P.convert_element_type_p:
        return c
    c = ranked(c, len(shape))
    new = primitives.compact_shape(prim, params, c, shape)
    return new if new is not None else prim.bind(jnp.broadcast_to(c, shape), **params)


class _Sized:
    """What a masked ``reduce_sum`` counted: the static element count ``n``, and ``count()``, the
    valid count at a compact shape of the sum (the sum's rank, 1 along dims the mask does not vary
    along). ``count`` is a function: the count is built only for a sum that is divided.
    ``uniform``: the mask does not vary along the summed axes (a layer norm's mean over the
    features of a token mask), so every slice counts ``n`` or is masked. ``any``: the sum is valid
    exactly where the count is positive (a ``reduce_sum``, not a window sum)."""

    def __init__(self, n, count, uniform=False, any=False):
        self.n, self.count, self.uniform, self.any = n, count, uniform, any


_CONSTANT_PROGRAMS: dict = {}


def _literal_constants(jaxpr, literal, env):
    """``{variable: value}`` of the equations computed from literals alone (``zeros_like``, a
    fill's broadcast, ``n - ddof``), evaluated by one compiled program. Evaluated one at a time, as
    :meth:`_Interpreter.equation` does the others (so that counts and fills are recognised under
    every transformation), each would compile a program of its own when the function is first
    traced. The literals enter the program as arguments, so nothing is folded when it is compiled
    and each value is what its equation alone gives. Empty (the equations then run one at a time)
    when there are fewer than two, when a parameter cannot be a cache key, or when a value's type
    differs from its equation's."""
    inputs, group, seen = [], [], set()
    for v in jaxpr.invars:
        if v in literal and env[v].mask is None and _is_concrete(env[v].data):
            seen.add(v)
            inputs.append(v)
    for eqn in jaxpr.eqns:
        if (
            eqn.primitive.multiple_results
            or eqn.effects
            or len(eqn.outvars) != 1
            or not all(_jaxpr.is_literal(v) or v in seen for v in eqn.invars)
        ):
            continue
        group.append(eqn)
        seen.add(eqn.outvars[0])
    if len(group) < 2:
        return {}
    lits = [v for e in group for v in e.invars if _jaxpr.is_literal(v)]
    names = {v: i for i, v in enumerate(inputs + [e.outvars[0] for e in group])}
    lit_at = iter(range(len(names), len(names) + len(lits)))
    structure = tuple(
        (
            e.primitive,
            tuple(sorted(e.params.items())),
            tuple(("l", next(lit_at)) if _jaxpr.is_literal(v) else ("v", names[v]) for v in e.invars),
        )
        for e in group
    )
    values = [env[v].data for v in inputs] + [v.val for v in lits]
    avals = tuple(jax.typeof(x) for x in values[: len(inputs)]) + tuple(v.aval for v in lits)
    key = (structure, avals)
    try:
        hash(key)
    except TypeError:  # a parameter that is not hashable: one equation at a time
        return {}
    exact = _on_host(group, dict(zip(inputs, values[: len(inputs)])), values[len(inputs) :])
    if exact is not None:
        return exact
    program = _kept(
        _CONSTANT_PROGRAMS, key, lambda: jax.jit(functools.partial(_run_constants, structure, len(inputs))), 1024
    )
    try:
        # lowered and compiled apart from any trace this runs in (jax's caches keep the compiled
        # program; jax.clear_caches() clears it), then run on the concrete values, also inside a trace
        specs = [jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=a.weak_type) for a in avals]
        outs = program.lower(*specs).compile()(*values)
    except Exception:  # noqa: BLE001 (anything the program cannot take runs one equation at a time)
        return {}
    if any(jax.typeof(o) != e.outvars[0].aval for o, e in zip(outs, group)):
        return {}
    return {e.outvars[0]: o for e, o in zip(group, outs)}


def _broadcast_in_dim(x, shape, broadcast_dimensions, sharding=None):
    del sharding
    kept = [1] * len(shape)
    for d, n in zip(broadcast_dimensions, np.shape(x)):
        kept[d] = n
    return np.broadcast_to(np.reshape(x, kept), shape)


def _iota(dtype, shape, dimension, sharding=None):
    del sharding
    at = [1] * len(shape)
    at[dimension] = shape[dimension]
    return np.broadcast_to(np.arange(shape[dimension], dtype=dtype).reshape(at), shape)


def _slice(x, start_indices, limit_indices, strides=None):
    strides = strides or (1,) * len(start_indices)
    return x[tuple(slice(a, b, c) for a, b, c in zip(start_indices, limit_indices, strides))]


def _convert(x, new_dtype):
    """``x.astype(new_dtype)`` where numpy converts as XLA does (integers and booleans to anything,
    floats to floats or booleans), else ``None`` (a float to an integer saturates in XLA)."""
    new = np.dtype(new_dtype)
    if x.dtype.kind in "biu" or (x.dtype.kind == "f" and new.kind in "fb"):
        return x.astype(new)
    return None


def _int_div(a, b, remainder):
    """XLA's integer ``div`` (rounds toward zero) or ``rem`` (the dividend's sign), where no divisor
    is 0 and no quotient overflows, else ``None``."""
    a, b = np.broadcast_arrays(a, b)
    if np.any(b == 0) or (a.dtype.kind == "i" and np.any((a == np.iinfo(a.dtype).min) & (b == -1))):
        return None
    if remainder:
        return np.fmod(a, b)
    q = np.abs(a) // np.abs(b)
    return np.where((a < 0) != (b < 0), -q, q).astype(a.dtype) if a.dtype.kind == "i" else q


def _select_n(which, *cases):
    return np.choose(np.asarray(which, np.int32), np.broadcast_arrays(*cases))


# Primitives whose value numpy computes exactly as XLA does (layout, comparisons, logic, and the
# arithmetic of integers): for these, the constants of a program are computed on the host, with no
# program compiled. ``None`` for anything else.
_INTS = "biu"
_EXACT = {
    P.iota_p: (lambda p: lambda: _iota(p["dtype"], p["shape"], p["dimension"]), None),
    P.broadcast_in_dim_p: (lambda p: lambda x: _broadcast_in_dim(x, p["shape"], p["broadcast_dimensions"]), None),
    P.reshape_p: (lambda p: lambda x: np.reshape(x, p["new_sizes"]) if p.get("dimensions") is None else None, None),
    P.squeeze_p: (lambda p: lambda x: np.squeeze(x, tuple(p["dimensions"])), None),
    P.transpose_p: (lambda p: lambda x: np.transpose(x, p["permutation"]), None),
    P.concatenate_p: (lambda p: lambda *xs: np.concatenate(xs, p["dimension"]), None),
    P.slice_p: (lambda p: lambda x: _slice(x, p["start_indices"], p["limit_indices"], p["strides"]), None),
    P.rev_p: (lambda p: lambda x: np.flip(x, tuple(p["dimensions"])), None),
    P.select_n_p: (lambda p: _select_n, None),
    P.convert_element_type_p: (lambda p: lambda x: _convert(x, p["new_dtype"]), None),
    P.lt_p: (lambda p: np.less, None),
    P.le_p: (lambda p: np.less_equal, None),
    P.gt_p: (lambda p: np.greater, None),
    P.ge_p: (lambda p: np.greater_equal, None),
    P.eq_p: (lambda p: np.equal, None),
    P.ne_p: (lambda p: np.not_equal, None),
    P.and_p: (lambda p: np.bitwise_and, _INTS),
    P.or_p: (lambda p: np.bitwise_or, _INTS),
    P.not_p: (lambda p: lambda x: np.logical_not(x) if x.dtype == bool else np.invert(x), _INTS),
    P.add_p: (lambda p: np.add, _INTS),
    P.sub_p: (lambda p: np.subtract, _INTS),
    P.mul_p: (lambda p: np.multiply, _INTS),
    P.max_p: (lambda p: np.maximum, _INTS),
    P.min_p: (lambda p: np.minimum, _INTS),
    P.neg_p: (lambda p: np.negative, _INTS),
    P.div_p: (lambda p: lambda a, b: _int_div(a, b, False), "iu"),
    P.rem_p: (lambda p: lambda a, b: _int_div(a, b, True), "iu"),
}


def _exact_on_host(eqn, args):
    """``eqn``'s value computed by numpy when it is one of :data:`_EXACT` on operands of the kinds
    it is exact for, else ``None``."""
    entry = _EXACT.get(eqn.primitive)
    aval = eqn.outvars[0].aval
    if entry is None or not hasattr(aval, "dtype"):
        return None
    make, kinds = entry
    if kinds is not None and any(np.asarray(a).dtype.kind not in kinds for a in args):
        return None
    with np.errstate(all="ignore"):
        out = make(eqn.params)(*args)
    if out is None:
        return None
    out = np.asarray(out)
    if out.shape != tuple(aval.shape) or out.dtype != aval.dtype:
        out = out.astype(aval.dtype) if out.shape == tuple(aval.shape) and kinds is not None else None
    return out


def _on_host(group, inputs, literals):
    """The values of a :func:`_literal_constants` group (``inputs``: its inputs' values by variable,
    ``literals``: its literals' values in order) computed on the host by numpy, where every equation
    is one numpy computes exactly (:func:`_exact_on_host`) and no output is weakly typed (a host
    array carries no weak type), else ``None``."""
    if any(getattr(e.outvars[0].aval, "weak_type", True) for e in group):
        return None
    known = {v: np.asarray(x) for v, x in inputs.items()}
    literal = iter(literals)
    out = {}
    for e in group:
        args = [np.asarray(next(literal), v.aval.dtype) if _jaxpr.is_literal(v) else known[v] for v in e.invars]
        value = _exact_on_host(e, args)
        if value is None:
            return None
        known[e.outvars[0]] = out[e.outvars[0]] = value
    return {v: jnp.asarray(x) for v, x in out.items()}


def _run_constants(structure, n_inputs, *values):
    """The equations of a :func:`_literal_constants` key, on its inputs, then its literals."""
    env = list(values[:n_inputs])
    lits = values[n_inputs:]
    first_lit = n_inputs + len(structure)
    for prim, params, reads in structure:
        args = [lits[i - first_lit] if kind == "l" else env[i] for kind, i in reads]
        env.append(prim.bind(*args, **dict(params)))
    return env[n_inputs:]


def _known(v, table) -> bool:
    """Is variable ``v`` a key of ``table``? (Literals are unhashable and never are.)"""
    return not _jaxpr.is_literal(v) and v in table


def _uses(jaxpr):
    """How many times each variable is read (by an equation or as an output)."""
    counts = {}
    for v in [v for e in jaxpr.eqns for v in e.invars] + list(jaxpr.outvars):
        if not _jaxpr.is_literal(v):
            counts[v] = counts.get(v, 0) + 1
    return counts


def _materialized(pairs):
    """Pairs with every mask an array (loop carries and branch outputs need one fixed structure)."""
    return [Pair(p.data, materialize(p.mask, jnp.shape(p.data))) for p in pairs]


def _as_constant(p: Pair) -> Pair:
    """A value computed from literals alone (``zeros_like``, a broadcast ``-inf``) as a 0-d constant
    when it is uniform: ``where`` then gives it the validity of the masked operand it is combined
    with, so a constant fill never makes a masked position valid."""
    if p.mask is not None or not _is_concrete(p.data) or np.ndim(p.data) == 0 or np.size(p.data) == 0:
        return p
    flat = np.asarray(p.data).reshape(-1)
    if np.all((flat == flat[0]) | (np.isnan(flat) & np.isnan(flat[0]) if dtype_kind(flat.dtype) in "fc" else False)):
        return Pair(jnp.asarray(flat[0], dtype=flat.dtype), None)
    return p


def _is_concrete(x) -> bool:
    return not is_tracer(x)


def _concrete_scalar(x):
    if is_tracer(x) or np.ndim(x) != 0:
        return None
    try:
        return float(x)
    except (TypeError, ValueError):
        return None


def _uniform_scalar(x):
    """The one value of every element of a concrete array (``jnp.ones_like(x).sum(1)``: the static
    length, once per slice), or ``None``."""
    if is_tracer(x) or np.size(x) == 0:
        return None
    try:
        values = np.asarray(x)
    except (TypeError, ValueError):
        return None
    first = values.reshape(-1)[0]
    return float(first) if values.dtype != object and np.all(values == first) else None


def _kept(table, key, make, limit):
    """``table[key]``, made by ``make()`` the first time; ``table`` is cleared when it holds
    ``limit`` programs (programs differ in their jaxprs and constants)."""
    program = table.get(key)
    if program is None:
        if len(table) >= limit:
            table.clear()
        program = table[key] = make()
    return program
