"""Library calls found in a jaxpr by the source of their equations, and run as a masked function.

``jax.nn.dot_product_attention`` and flax's ``dot_product_attention`` (what
``nn.MultiHeadDotProductAttention`` calls) trace to contractions, a softmax and, for causal
attention, a mask built from iotas. Read one equation at a time under ``maskify`` they give the
right values, but through XLA's softmax and contractions with the masks' rules: none of it reaches
jax's own attention call, and with ``implementation="cudnn"`` nothing of it can run. Run as
:func:`masked_jax.nn.dot_product_attention`, the padding goes to jax's call as a key mask on its
XLA path, as sequence lengths to cuDNN's flash attention.

**Finding a call.** Every equation records the Python frames that were running when it was
traced, so the equations a call produced are those traced inside the function's code object, one
after another in the jaxpr (:func:`library_calls` groups them; a new group starts where the
position reached in the function goes back, the same line calling it again). Nothing is patched or
recorded while the user's function traces, so a call is found however it was reached.

**Taking it.** A group is taken for the call only when re-tracing the function on the group's
operands (the query, key and value, and a ``bias`` or ``mask``), with candidate static arguments
read off the group (``scale``, ``is_causal``, ``implementation``), gives the same program,
equation for equation. A call with another operand (sequence lengths, a dropout key), with options
the candidates do not cover (a local window, another dtype), or whose intermediate values are read
after it (flax's sown weights) is not taken, and its equations run one at a time as any other
code. A taken call runs as the masked function only when its query, key and value are masked by
whole tokens (one validity per token, for every head and feature: the masks ``maskify`` carries
through the usual projections) and its bias and mask are not masked; otherwise, equation by
equation too.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import sys
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.extend.core.primitives as P
import numpy as np
from jax.extend import core as jcore

from masked_jax import _jaxpr
from masked_jax import nn as masked_nn
from masked_jax._core import MaskedArray, unwrap, wrap
from masked_jax._maskify._scan import code_of, traced_inside
from masked_jax.ops._base import Pair, ranked
from masked_jax.ops._factors import NO_FACTS, aligned


@dataclasses.dataclass(frozen=True)
class Known:
    """A library function ``maskify`` runs as a masked one: ``function()`` gives it (``None`` while
    its library is not imported), ``candidates(eqns)`` the static keyword arguments to try, read
    off a group of its equations, and ``masked(q, k, v, **kwargs)`` runs it on masked operands."""

    name: str
    function: Callable[[], Any]
    candidates: Callable[[list], Iterator[dict]]
    masked: Callable[..., Any]


def _jax_attention():
    return jax.nn.dot_product_attention


def _flax_attention():
    attention = sys.modules.get("flax.linen.attention")  # never imported here: flax is the user's
    return None if attention is None else getattr(attention, "dot_product_attention", None)


def _attention_candidates(eqns):
    """``scale`` (jax's default, or a scalar float the group multiplies by), ``is_causal``, and
    ``implementation="cudnn"`` where the group holds no ``exp`` of its own (the fused call)."""
    scales: list[float | None] = [None]
    for e in _all_equations(eqns):
        values = [v.val for v in e.invars if _jaxpr.is_literal(v)] if e.primitive is P.mul_p else []
        values += [v for k, v in e.params.items() if k == "scale"]
        for x in values:
            if np.ndim(x) == 0 and np.issubdtype(np.result_type(x), np.floating) and float(x) not in scales:
                scales.append(float(x))
    fused = not any(e.primitive is P.exp_p for e in eqns)
    for causal in (False, True):
        for scale in scales:
            yield {"scale": scale, "is_causal": causal, **({"implementation": "cudnn"} if fused else {})}


def _all_equations(eqns):
    for e in eqns:
        yield e
        for inner in _jaxpr.nested_jaxprs(e.params.values()):
            yield from _jaxpr.equations(inner)


def _masked_attention(q, k, v, **kwargs):
    return masked_nn.dot_product_attention(q, k, v, **kwargs)


KNOWN = (
    Known("jax.nn.dot_product_attention", _jax_attention, _attention_candidates, _masked_attention),
    Known("flax.linen.dot_product_attention", _flax_attention, lambda eqns: iter(({},)), _masked_attention),
)

_MOST_OPERANDS = 5  # query, key, value, bias, mask


def _assignments(structs):
    """The ways operands ``structs``, in the order a group first reads them, can be the query, key
    and value (their indices) and the ``bias`` / ``mask`` operands (name, index): the query is read
    first; the key and value are any operands whose shapes fit it (the query itself included); an
    operand left over is the ``mask`` (flax takes a float one too) or, if not bool, the ``bias``."""
    n, q = len(structs), structs[0]
    for k in range(n):
        for v in dict.fromkeys((k, 0, *range(n))):
            if not _fits(q, structs[k], structs[v]):
                continue
            rest = sorted(set(range(n)) - {0, k, v})
            kinds = [("mask",) if structs[i].dtype == np.dtype(bool) else ("bias", "mask") for i in rest]
            for names in itertools.product(*kinds):
                if len(set(names)) == len(names):
                    yield (0, k, v), tuple(sorted(zip(names, rest)))


def _fits(q, k, v) -> bool:
    """Can ``q``, ``k`` and ``v`` be a query, its keys and their values? The same rank, features of
    the query's size in the keys, one key per value."""
    return q.ndim == k.ndim == v.ndim >= 3 and q.shape[-1] == k.shape[-1] and k.shape[:-1] == v.shape[:-1]


@dataclasses.dataclass(frozen=True)
class LibraryCall:
    """One taken call in a jaxpr: its equations ``start`` to ``stop`` (exclusive), the function
    (``known``), its operands in role order (``operands``: query, key, value), its optional
    operands by keyword (``extras``: ``(name, variable)``, a bias or a mask), the static keyword
    arguments it was called with and its result (``output``)."""

    start: int
    stop: int
    known: Known
    operands: tuple
    extras: tuple
    kwargs: dict
    output: Any


def library_calls(jaxpr) -> dict[int, LibraryCall]:
    """The calls of :data:`KNOWN` functions among ``jaxpr``'s own equations, by their first
    equation; a group of equations that is not exactly one call is left out."""
    if not any(e.primitive is P.dot_general_p for e in jaxpr.eqns):  # every known function contracts
        return {}
    codes = {}
    for known in KNOWN:
        fn = known.function()
        code = None if fn is None else code_of(fn)
        if code is not None:
            codes[code] = known
    if not codes:
        return {}
    groups, last = [], None
    for i, eqn in enumerate(jaxpr.eqns):
        frame = _frame(eqn, codes)
        if frame is None:
            last = None
            continue
        known, caller, order = frame
        if last is None or (known, caller) != last[:2] or order < last[2]:
            groups.append((known, []))
        groups[-1][1].append(i)
        last = frame
    calls = {}
    for known, indices in groups:
        call = _taken(jaxpr, known, indices[0], indices[-1] + 1)
        if call is not None:
            calls[call.start] = call
    return calls


def _frame(eqn, codes):
    """``(known function, its caller's frames, the position reached in it)`` of an equation traced
    inside a known function (the outermost such frame), else ``None``."""
    found = traced_inside(eqn, codes.__contains__)
    if found is None:
        return None
    frames, lastis, k = found
    return codes[frames[k]], tuple(zip(frames[k + 1 :], lastis[k + 1 :])), lastis[k]


def _taken(jaxpr, known, start, stop):
    eqns = jaxpr.eqns[start:stop]
    defined = {v for e in eqns for v in e.outvars}
    operands = []
    for e in eqns:
        for v in e.invars:
            if not _jaxpr.is_literal(v) and v not in defined and v not in operands:
                operands.append(v)
    after = {v for e in jaxpr.eqns[stop:] for v in e.invars if not _jaxpr.is_literal(v)}
    after.update(v for v in jaxpr.outvars if not _jaxpr.is_literal(v))
    outputs = [v for e in eqns for v in e.outvars if v in after]
    if len(outputs) != 1 or not 0 < len(operands) <= _MOST_OPERANDS:
        return None
    with warnings.catch_warnings():  # a jaxpr built to be printed needs no debugging information
        warnings.simplefilter("ignore", DeprecationWarning)
        program = str(jcore.Jaxpr([], operands, outputs, eqns))
    structs = tuple(jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in operands)
    found = _match(known, program, structs, tuple(_candidate_keys(known, eqns)))
    if found is None:
        return None
    (roles, extras), kwargs = found
    return LibraryCall(
        start,
        stop,
        known,
        tuple(operands[r] for r in roles),
        tuple((name, operands[i]) for name, i in extras),
        dict(kwargs),
        outputs[0],
    )


def _candidate_keys(known, eqns):
    return (tuple(sorted(kw.items())) for kw in known.candidates(eqns))


@functools.lru_cache(maxsize=256)
def _match(known, program, structs, candidates):
    """``((roles, extras), static arguments)`` with which ``known``'s function traces to
    ``program`` on operands ``structs`` (see :func:`_assignments`), else ``None``."""
    fn = known.function()
    for roles, extras in _assignments(structs):
        for kwargs in candidates:

            def call(*xs, roles=roles, extras=extras, kwargs=kwargs):
                return fn(*(xs[r] for r in roles), **{name: xs[i] for name, i in extras}, **dict(kwargs))

            try:
                traced = jax.make_jaxpr(call)(*structs)
            except Exception:  # noqa: BLE001 - arguments the function rejects are not the call's
                continue
            if not traced.consts and str(traced.jaxpr) == program:
                return (roles, extras), kwargs
    return None


def run(call: LibraryCall, operands: list[Pair], extras: list[Pair], facts=NO_FACTS) -> Pair | None:
    """The result of a taken call on its operands (query, key, value) and its optional operands
    (``call.extras``' values), run as the masked function; ``None`` when no operand is masked, an
    optional operand is masked, or an operand is masked within a token (its equations then run one
    at a time). Operands whose masks ``facts`` knows to hold the same values share one mask array
    (self-attention: the function then knows its queries and keys are masked alike)."""
    if all(p.mask is None for p in operands) or any(p.mask is not None for p in extras):
        return None
    for p in operands:
        ndim = np.ndim(p.data)
        if ndim not in (3, 4):
            return None
        if p.mask is not None and np.shape(ranked(p.mask, ndim))[-2:] != (1, 1):
            return None
    first = operands[0]
    if all(p.mask is not None and np.ndim(p.data) == np.ndim(first.data) for p in operands):
        same = {frozenset(aligned(facts.factors(p.mask), np.ndim(p.data))) for p in operands}
        if len(same) == 1 and all(np.shape(p.data)[:2] == np.shape(first.data)[:2] for p in operands):
            operands = [Pair(p.data, first.mask) for p in operands]
    optional = {name: p.data for (name, _), p in zip(call.extras, extras)}
    out = call.known.masked(*(wrap(p) for p in operands), **optional, **call.kwargs)
    return unwrap(out) if isinstance(out, MaskedArray) else Pair(out, None)
