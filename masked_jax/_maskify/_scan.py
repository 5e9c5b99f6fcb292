"""``lax.associative_scan`` calls, found in a jaxpr by the source of their equations.

``lax.associative_scan`` has no primitive or named call of its own: it traces to slices, pads,
concatenations and the combining function's equations. Read one equation at a time, a hole or left
padding would combine valid and masked elements into masked ones and mask everything after it.
Every equation records the Python frames that were running when it was traced, so the equations a
call produced are those traced inside jax's ``associative_scan``; :func:`associative_scans` finds
them, with the call's element leaves and outputs, before the interpreter runs the jaxpr, and the
interpreter runs each call over the valid elements only (``_recognise.associative_scan``). Nothing is
patched or recorded while ``fun`` traces, so the call is found however it was reached (``lax.`` at call
time, ``from jax.lax import associative_scan``, a function object passed in, inside an inner ``jit``).
"""

from __future__ import annotations

import dataclasses
import inspect

import jax.extend.core.primitives as P
from jax import lax

from masked_jax import _jaxpr


def code_of(fn, name=None):
    """The code object of ``fn`` (``None``: not found), or of its nested function ``name``."""
    try:
        code = inspect.unwrap(fn).__code__
    except AttributeError:
        return None
    if name is None:
        return code
    return next((c for c in code.co_consts if getattr(c, "co_name", None) == name), None)


# jax's associative_scan, its recursive ``_scan`` and the ``combine`` wrapper of the user's function
_CALL, _LEVEL, _COMBINE = (
    code_of(lax.associative_scan),
    code_of(lax.associative_scan, "_scan"),
    code_of(lax.associative_scan, "combine"),
)


@dataclasses.dataclass(frozen=True)
class AssociativeScan:
    """One ``lax.associative_scan`` call in a jaxpr: its equations ``start`` to ``stop`` (exclusive),
    the equations among them that read the element leaves (``readers``), the leaves (``elems``),
    ``reverse`` and ``axis``, and the call's results that are read after it (``outputs``)."""

    start: int
    stop: int
    readers: frozenset
    elems: tuple
    reverse: bool
    axis: int
    outputs: tuple


def _frames(eqn):
    """``(caller, order, level)`` of an equation traced inside ``associative_scan``, else ``None``:
    the frames that called it; the position reached in ``associative_scan`` and in its outermost
    ``_scan`` (-1 outside one), which only grow within one call; the number of ``_scan`` frames and
    whether the user's function was running, which tell the element reads from the rest."""
    found = None if _CALL is None else traced_inside(eqn, lambda code: code is _CALL)
    if found is None:
        return None
    codes, lastis, k = found
    inner = codes[:k]
    level = sum(c is _LEVEL for c in inner)
    outer = lastis[k - 1] if k and codes[k - 1] is _LEVEL else -1
    caller = tuple(zip(codes[k + 1 :], lastis[k + 1 :]))
    return caller, (lastis[k], outer), (level, any(c is _COMBINE for c in inner))


def traced_inside(eqn, is_code):
    """``(codes, positions, k)`` of the Python frames that were running when ``eqn`` was traced
    (innermost first) and the index of the outermost one whose code ``is_code`` accepts; ``None``
    when there is none (or the equation kept no traceback)."""
    traceback = eqn.source_info.traceback
    if traceback is None:
        return None
    codes, lastis = traceback.raw_frames()
    k = next((k for k in range(len(codes) - 1, -1, -1) if is_code(codes[k])), None)
    return None if k is None else (codes, lastis, k)


def _maybe(jaxpr) -> bool:
    """Cheaply: whether ``jaxpr`` can hold an associative scan (a stride-2 slice or a reversal)."""
    return any(
        e.primitive is P.rev_p or (e.primitive is P.slice_p and 2 in (e.params.get("strides") or ()))
        for e in jaxpr.eqns
    )


def associative_scans(jaxpr) -> dict[int, AssociativeScan]:
    """The ``lax.associative_scan`` calls among ``jaxpr``'s own equations, by their first equation.

    A call whose element leaves cannot be told apart is left out: its equations then run one at a
    time, which masks an element's results wherever a masked element entered them."""
    if _LEVEL is None or not _maybe(jaxpr):
        return {}
    groups, last = [], None
    for i, eqn in enumerate(jaxpr.eqns):
        frames = _frames(eqn)
        if frames is None:
            last = None
            continue
        caller, order, _ = frames
        if last is None or caller != last[0] or order < last[1]:  # a new call (also the same line again)
            groups.append([])
        groups[-1].append((i, frames))
        last = (caller, order)
    calls = {}
    for group in groups:
        call = _call(jaxpr, group)
        if call is not None:
            calls[call.start] = call
    return calls


def _call(jaxpr, group):
    start, stop = group[0][0], group[-1][0] + 1
    eqns = jaxpr.eqns
    defined = {v for e in eqns[start:stop] for v in e.outvars}
    reverse = eqns[start].primitive is P.rev_p and group[0][1][2][0] == 0
    readers, elems, axes = set(), [], set()
    for i, (_, _, (level, in_fn)) in group:
        eqn = eqns[i]
        if reverse:  # the leading reversals of the leaves, before the first level
            if level:
                break
            if eqn.primitive is not P.rev_p:
                continue
        elif level != 1 or in_fn or eqn.primitive is not P.slice_p:
            continue
        v = eqn.invars[0]
        if _jaxpr.is_literal(v) or v in defined:
            continue
        if reverse:
            axes.update(eqn.params["dimensions"])
        else:  # the pairs (0, 1), (2, 3), ... and the even elements: stride 2 along the axis
            axes.update(d for d, s in enumerate(eqn.params.get("strides") or ()) if s == 2)
        readers.add(i)
        if v not in elems:
            elems.append(v)
    if not elems or len(axes) != 1:
        return None
    after = {v for e in eqns[stop:] for v in e.invars if not _jaxpr.is_literal(v)}
    after.update(v for v in jaxpr.outvars if not _jaxpr.is_literal(v))
    outputs = tuple(v for e in eqns[start:stop] for v in e.outvars if v in after)
    return AssociativeScan(start, stop, frozenset(readers), tuple(elems), reverse, axes.pop(), outputs)


def _scan_counts(params, n_in):
    """``(consts, carry)`` operand counts of a ``scan`` equation.

    jax up to 0.10 names them ``num_consts`` / ``num_carry``; jax 0.11 passes ``ft_in``, a flat
    tree that splits the operands into ``(consts, carry, xs)`` the way jax's own scan rules
    read it (``ft_in.update(operands).unpack()``).
    """
    if "num_consts" in params:
        return params["num_consts"], params["num_carry"]
    groups = params.get("ft_in")
    try:
        consts, carry, _ = groups.update(list(range(n_in))).unpack()
    except (AttributeError, TypeError, ValueError):
        raise NotImplementedError(
            f"maskify: this jax version's scan parameters ({sorted(params)}) are not understood; expected "
            "num_consts/num_carry, or an ft_in that unpacks into (consts, carry, xs)."
        ) from None
    return len(consts), len(carry)
