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
