"""``jnp.unique`` calls, found in a jaxpr by the source of their equations and run as the masked
unique (:func:`masked_jax.numpy.unique` with ``size``).

``jnp.unique(x, size=...)`` (and ``jnp.unique_values``, ``unique_counts``, ``unique_inverse``,
``unique_all``, which call it) traces to a sort, a mark at the first element of each run of equal
values, and ``jnp.nonzero`` of those marks. Read one equation at a time, the masked elements would
sort among the valid ones and turn the runs around them masked: valid values would be dropped and
fill entries take their places. The equations a call produced are those traced inside
``jnp.unique``'s code (as for ``lax.associative_scan``, :mod:`._scan`); a group of them is taken
for the call when re-tracing ``jnp.unique`` on the group's operand with candidate static arguments
(the flags, ``size``, ``fill_value``, ``equal_nan``, ``axis``) gives the same equations, and each
of its results read later is one of the call's. The call then runs over the valid elements:
their distinct values in order, then the fill entries, as ``jnp.unique`` gives on the valid
elements alone.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import warnings

import jax
import jax.extend.core.primitives as P
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jcore

from masked_jax import _jaxpr
from masked_jax._maskify._errors import MaskifyError
from masked_jax._maskify._scan import code_of, traced_inside
from masked_jax.numpy._setops import sized_unique
from masked_jax.ops._base import Pair

_UNIQUE = code_of(jnp.unique)
SORTED_MASK = "_unique_sorted_mask"  # the named call inside jnp.unique that sorts the elements
_FLAGS = ("return_index", "return_inverse", "return_counts")


@dataclasses.dataclass(frozen=True)
class UniqueCall:
    """One taken ``jnp.unique`` call: its equations ``start`` to ``stop`` (exclusive), its operand
    (and ``fill_value``, where it is traced), its static arguments, and its results read after it
    with their place among ``jnp.unique``'s results (``outputs``: ``(variable, place)``)."""

    start: int
    stop: int
    operand: object
    fill: object
    kwargs: dict
    outputs: tuple


def unique_calls(jaxpr) -> dict[int, UniqueCall]:
    """The ``jnp.unique`` calls among ``jaxpr``'s own equations, by their first equation; a group
    of equations that is not exactly one call is left out (then a masked operand of its sort
    raises, see :func:`refuse`)."""
    if _UNIQUE is None or not any(e.primitive is P.jit_p and e.params.get("name") == SORTED_MASK for e in jaxpr.eqns):
        return {}
    groups, last = [], None
    for i, eqn in enumerate(jaxpr.eqns):
        found = traced_inside(eqn, lambda code: code is _UNIQUE)
        if found is None:
            last = None
            continue
        codes, lastis, k = found
        frame = (tuple(zip(codes[k + 1 :], lastis[k + 1 :])), lastis[k])
        if last is None or frame[0] != last[0] or frame[1] < last[1]:  # a new call (also the same line again)
            groups.append([])
        groups[-1].append(i)
        last = frame
    calls = {}
    for group in groups:
        call = _taken(jaxpr, group[0], group[-1] + 1)
        if call is not None:
            calls[call.start] = call
    return calls


def _program(invars, eqns):
    with warnings.catch_warnings():  # a jaxpr built to be printed needs no debugging information
        warnings.simplefilter("ignore", DeprecationWarning)
        return str(jcore.Jaxpr([], list(invars), [], list(eqns)))


def _taken(jaxpr, start, stop):
    eqns = jaxpr.eqns[start:stop]
    defined = {v for e in eqns for v in e.outvars}
    operands = []
    for e in eqns:
        for v in e.invars:
            if not _jaxpr.is_literal(v) and v not in defined and v not in operands:
                operands.append(v)
    if not 1 <= len(operands) <= 2:
        return None
    after = {v for e in jaxpr.eqns[stop:] for v in e.invars if not _jaxpr.is_literal(v)}
    after.update(v for v in jaxpr.outvars if not _jaxpr.is_literal(v))
    read = [v for e in eqns for v in e.outvars if v in after]
    structs = tuple(jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in operands)
    found = _match(_program(operands, eqns), structs, _candidates(eqns, operands, read))
    if found is None:
        return None
    kwargs, places = found
    where = {(i, j): v for i, e in enumerate(eqns) for j, v in enumerate(e.outvars)}
    outputs = []
    for (i, j), place in places:
        v = where[(i, j)]
        if v in after:
            outputs.append((v, place))
    if len(outputs) != len(read):  # an intermediate value of the call is read after it
        return None
    fill = operands[1] if len(operands) == 2 else None
    return UniqueCall(start, stop, operands[0], fill, dict(kwargs), tuple(outputs))


def _candidates(eqns, operands, read):
    """Static arguments to try, the likeliest first (each is checked by re-tracing): the flags
    read off the group (``return_counts`` adds a ``jnp.diff``, ``return_index`` a second gather,
    ``return_inverse`` a scatter), ``size`` among the leading dims of the results read after it,
    then of the group's values, ``fill_value`` a traced operand or a scalar literal (those a
    ``where`` reads first), ``equal_nan``, and ``axis`` (``None``, or an axis of a multi-dim
    operand)."""
    names = [e.params.get("name") if e.primitive is P.jit_p else e.primitive.name for e in eqns]
    counts = "diff" in names
    guess = (names.count("gather") > 1, names.count("scatter") > counts, counts)
    flags = sorted(itertools.product((False, True), repeat=len(_FLAGS)), key=lambda f: (f != guess, sum(f)))
    dims = [v.aval.shape[0] for v in read if v.aval.shape] + [
        v.aval.shape[0] for e in eqns for v in e.outvars if v.aval.shape
    ]
    sizes = tuple(dict.fromkeys(dims))
    if len(operands) == 2:
        fills: tuple = ("operand",)
    else:
        nested = sorted(
            (e for top in eqns for e in (top, *_inner(top))), key=lambda e: e.params.get("name") != "_where"
        )
        literals = [v.val for e in nested for v in e.invars if _jaxpr.is_literal(v) and np.ndim(v.val) == 0]
        # the value as a Python number (jnp.unique's weak fill) and as the literal's own dtype
        values = [x for lit in literals for x in (np.asarray(lit).item(), np.asarray(lit)[()])]
        fills = (None, *{(type(x), repr(x)): x for x in values}.values())
    ndim = len(operands[0].aval.shape)
    axes = (None,) + (tuple(range(ndim)) if ndim > 1 else ())
    nans = (True, False) if jnp.issubdtype(operands[0].aval.dtype, jnp.inexact) else (True,)
    return tuple(
        (*zip(_FLAGS, flag), ("size", size), ("fill_value", fill), ("equal_nan", equal_nan), ("axis", axis))
        for flag, size, fill, equal_nan, axis in itertools.product(flags, sizes, fills, nans, axes)
    )


def _inner(eqn):
    for sub in _jaxpr.nested_jaxprs(eqn.params.values()):
        yield from _jaxpr.equations(sub)


@functools.lru_cache(maxsize=256)
def _match(program, structs, candidates):
    """``(static arguments, ((equation, result), place) of each result)`` with which
    ``jnp.unique`` traces to ``program`` on operands ``structs``, else ``None``."""
    for kwargs in candidates:
        kw = dict(kwargs)

        def call(x, fill=None, kw=kw):
            if kw["fill_value"] == "operand":
                kw = {**kw, "fill_value": fill}
            return jnp.unique(x, **kw)

        try:
            traced = jax.make_jaxpr(call)(*structs)
        except Exception:  # noqa: BLE001 - arguments jnp.unique rejects are not the call's
            continue
        if traced.consts or _program(traced.jaxpr.invars, traced.jaxpr.eqns) != program:
            continue
        where = {v: (i, j) for i, e in enumerate(traced.jaxpr.eqns) for j, v in enumerate(e.outvars)}
        if not all(not _jaxpr.is_literal(v) and v in where for v in traced.jaxpr.outvars):
            continue
        return kwargs, tuple((where[v], place) for place, v in enumerate(traced.jaxpr.outvars))
    return None


def run(fun_name, call: UniqueCall, operand: Pair, fill: Pair | None):
    """The results of a taken call (``[(variable, Pair)]``), or ``None`` when its operand is not
    masked (its equations then run as they are)."""
    if operand.mask is None:
        return None
    kw = call.kwargs
    if kw["axis"] is not None:
        raise MaskifyError(
            f"maskify({fun_name}): jnp.unique with axis= of a masked array has no masked meaning (a "
            "row with masked entries is not a value); call it with axis=None, or fill the array first."
        )
    if fill is not None and fill.mask is not None:
        raise MaskifyError(f"maskify({fun_name}): the fill_value of jnp.unique is masked; it must be a plain value.")
    fill_value = fill.data if fill is not None else kw["fill_value"]
    values, first, inverse, counts = sized_unique(
        operand.data, operand.mask, size=kw["size"], fill_value=fill_value, equal_nan=kw["equal_nan"]
    )
    results = [values] + [p for p, flag in zip((first, inverse, counts), _FLAGS) if kw[flag]]
    out = []
    for v, place in call.outputs:
        p = results[place]
        data = jnp.reshape(p.data, v.aval.shape).astype(v.aval.dtype)
        out.append((v, Pair(data, p.mask)))
    return out


def refuse(fun_name):
    """The error for ``jnp.unique``'s sort met with a masked operand outside a taken call (a set
    operation built on it, a ``vmap``ped call)."""
    return MaskifyError(
        f"maskify({fun_name}): jnp.unique is supported on a masked operand when called directly "
        "(jnp.unique, unique_values, unique_counts, unique_inverse, unique_all, with size= and "
        "axis=None); here its sort of a masked operand is reached another way (a set operation such "
        "as jnp.intersect1d or jnp.setxor1d, or jnp.unique under vmap). Compute it with "
        "masked_jax.numpy.unique(x, size=...), or fill the operand first (x.filled(...))."
    )
