"""Contractions (matmul, dot, einsum, ...) over the indices where both operands are valid.

``out[i, j] = sum_k a[i, k] b[k, j]`` over the ``k`` where ``a[i, k]`` and
``b[k, j]`` are both valid; ``out[i, j]`` is valid iff one such ``k`` exists, or iff there is no
``k`` at all (a zero-size contracted dim: a sum of nothing, 0).
Because masked-out entries are replaced by 0 before contracting, the data is
the contraction of the filled operands, and the mask is the same contraction
applied to the masks as 0/1 numbers, compared with 0.

A masked term never contributes, whatever it holds, and a *valid* ``inf`` or NaN is a value as
in ``jax.numpy``. Zero-filling alone breaks the second rule: a valid ``inf`` meeting a masked
entry would form ``inf * 0 = NaN``. The zero-filled contraction is exact wherever it is finite,
so when an entry of it is not (checked at run time: ``lax.cond`` under a transform, a Python
branch eagerly; under ``vmap`` one test for the whole batch, so the conditional stays one), the
finite terms are contracted as above and the non-finite ones are counted by sign (a loop of
contractions of indicator arrays, which lengthens the compile of a program that has it): an output with a NaN term (a valid NaN, or a valid ``inf`` times a valid 0) or
with both ``+inf`` and ``-inf`` terms is NaN, else one with an infinite term is that infinity, as
IEEE sums are. Complex operands take this rule by their real and imaginary parts.
"""

from __future__ import annotations

import functools
import inspect

import jax
import jax.extend.core.primitives as P
import jax.numpy as jnp
import numpy as np

from masked_jax._validate import is_tracer
from masked_jax.ops import _factors
from masked_jax.ops._base import Pair, and_masks, any_valid, fill, ranked, uniform_along
from masked_jax.ops._factors import NO_FACTS, Facts
from masked_jax.ops._registry import OpSpec, register, signature_of


def contraction(fn):
    """Rule for a multilinear ``fn(*operands, **kwargs)`` such as ``jnp.matmul``."""

    def rule(*operands: Pair, **kwargs) -> Pair:
        if all(o.mask is None for o in operands):
            return Pair(fn(*(o.data for o in operands), **kwargs), None)
        valid = [jnp.broadcast_to(True if o.mask is None else o.mask, jnp.shape(o.data)) for o in operands]
        mask = fn(*(v.astype(jnp.float32) for v in valid), **kwargs) > 0
        if any(np.size(o.data) == 0 for o in operands):
            # an output with no term at all (a zero-size contracted dim) is a sum of nothing: 0, valid
            terms = fn(*(jnp.ones(jnp.shape(o.data), jnp.float32) for o in operands), **kwargs)
            mask = mask | (terms == 0)
        return Pair(_contract_data(fn, operands, **kwargs), mask)

    rule.__name__ = getattr(fn, "__name__", "contraction")
    rule.__dict__["fn"] = fn  # the function the rule applies, for maskify's recognisers
    return rule


def _contract_data(fn, operands, **kwargs):
    """The data of a contraction over jointly valid terms: masked entries zero-filled, and, for two
    float operands, the exact rule for valid non-finite entries (see the module docstring)."""
    filled = [fill(o.data, o.mask, 0) for o in operands]
    if len(operands) != 2 or not all(jnp.issubdtype(jnp.result_type(o.data), jnp.inexact) for o in operands):
        return fn(*filled, **kwargs)
    a, b = [jnp.asarray(o.data) for o in operands]
    va, vb = [jnp.broadcast_to(True if o.mask is None else o.mask, jnp.shape(o.data)) for o in operands]
    # The zero-filled contraction is exact wherever it is finite: a term it adds that is not jointly
    # valid is a filled 0 times an entry, 0 when the entry is finite and NaN when it is not. So only
    # a non-finite entry of it (a valid inf or NaN met, or a finite sum that overflowed) calls for
    # the exact rule; the test reads the output, not the two operands.
    fast = fn(*filled, **kwargs)
    nonfinite = ~jnp.all(jnp.isfinite(fast))
    if not any(is_tracer(v) for v in (a, b, va, vb)):
        # eagerly the branch is known: only the program that runs is built (no compile of the other)
        return _with_nonfinite(fn, kwargs, a, b, va, vb) if bool(nonfinite) else fast
    # The zero-filled contraction outside the conditional: XLA fuses the fills into it, and the
    # result's derivative is its derivative (the conditional is never differentiated). Where the
    # exact value differs it is not finite, or it replaces a NaN formed by a masked entry times a
    # valid inf, whose terms' derivatives the zero-filled contraction has right.
    return _exact_value(functools.partial(fn, **kwargs), fast, nonfinite, a, b, va, vb)


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def _exact_value(fn, fast, nonfinite, a, b, va, vb):
    """``fast`` (the zero-filled contraction), or the exact contraction when a valid entry is not
    finite; its tangent is ``fast``'s."""
    return _guarded(lambda *ops: _with_nonfinite(fn, {}, *ops), nonfinite, fast, a, b, va, vb)


def _guarded(exact, pred, fast, *operands):
    """``lax.cond(pred, lambda: exact(*operands), lambda: fast)`` that stays a conditional under
    ``vmap``. ``jax.vmap`` turns a conditional with a batched predicate into a ``select`` of both
    branches, so the exact branch would run on every call of a vmapped model (equinox's usual
    form); here a batched predicate is or-ed over the batch instead, and ``exact`` runs, vmapped,
    for the whole batch or not at all. That is exact because ``exact`` equals ``fast`` wherever
    ``fast`` is finite. Nested ``vmap``s recurse."""

    @jax.custom_batching.custom_vmap
    def pick(pred, fast, *ops):
        return jax.lax.cond(pred, lambda: exact(*ops), lambda: fast)

    @pick.def_vmap
    def _batched(axis_size, in_batched, pred, fast, *ops):
        pred_batched, fast_batched, *ops_batched = in_batched
        if pred_batched:
            pred = jnp.any(pred)
        if not fast_batched:
            fast = jnp.broadcast_to(fast, (axis_size,) + jnp.shape(fast))
        exact_batched = jax.vmap(exact, in_axes=tuple(0 if x else None for x in ops_batched), axis_size=axis_size)
        return _guarded(exact_batched, pred, fast, *ops), True

    return pick(pred, fast, *operands)


@_exact_value.defjvp
def _exact_value_jvp(fn, primals, tangents):
    return _exact_value(fn, *primals), tangents[0]


def dot_general(bind, a: Pair, b: Pair, dimension_numbers, facts: Facts = NO_FACTS) -> Pair:
    """``lax.dot_general`` over jointly valid terms, with compact masks.

    ``bind(a, b)`` contracts data (the primitive with its parameters). Where the masks allow, the
    output mask comes from the masks alone, with no mask contraction, and stays compact:

    when neither mask varies along the contracted dims (a (B, L, 1) token mask times a dense
    layer's weights; queries against keys over the head dim), an output is valid iff both operands'
    slices are, and each output has all its terms valid or none. Zero-filling is then exact (a
    valid ``inf`` never meets a masked entry) and the output mask is the broadcast of the two
    reduced masks, with no mask contraction. Otherwise the data follow the general rule (exact for
    valid non-finite entries) and the mask is contracted on the compact masks.
    """
    (lc, rc), (lb, rb) = dimension_numbers
    nda, ndb = jnp.ndim(a.data), jnp.ndim(b.data)
    ma, mb = ranked(a.mask, nda, facts), ranked(b.mask, ndb, facts)
    if ma is None and mb is None:
        return Pair(bind(a.data, b.data), None)
    if any(jnp.shape(a.data)[d] == 0 for d in lc):  # no term at all: a sum of nothing, 0 and valid
        out = bind(a.data, b.data)
        return Pair(out, jnp.ones((1,) * np.ndim(out), bool))
    const_a = ma is None or uniform_along(ma, lc)
    const_b = mb is None or uniform_along(mb, rc)
    if not (const_a and const_b or _same_along_contraction(ma, mb, nda, ndb, lc, rc, lb, rb, facts)):
        # a masked term may meet a valid inf: the data by the general rule
        data = _contract_data(bind, [a, b])
        return Pair(data, _compact_mask_contraction(ma, mb, jnp.shape(a.data), jnp.shape(b.data), lc, rc, lb, rb))
    free_a = [d for d in range(nda) if d not in lc and d not in lb]
    free_b = [d for d in range(ndb) if d not in rc and d not in rb]

    def side(m, contract, batch, free, before, after, shape):
        """``any`` of ``m`` over the contracted dims, in the output's layout (batch, lhs free, rhs
        free), 1 on the other operand's free dims."""
        if m is None:
            return None
        r = any_valid(m, shape, tuple(contract), keepdims=True, facts=facts)
        perm = list(batch) + list(free) + list(contract)
        t = jnp.transpose(r, perm)
        out = jnp.reshape(
            t, t.shape[: len(batch)] + (1,) * before + t.shape[len(batch) : len(batch) + len(free)] + (1,) * after
        )
        if facts.active:
            facts.record(out, _factors.reshaped(_factors.transposed(facts.factors(r), perm), t.shape, out.shape))
        return out

    out_a = side(ma, lc, lb, free_a, 0, len(free_b), jnp.shape(a.data))
    out_b = side(mb, rc, rb, free_b, len(free_a), 0, jnp.shape(b.data))
    if const_a and const_b:
        # a masked term meets masked outputs only: the fill keeps the weight gradient's sum finite,
        # so data already holding finite values where masked need none
        fa, fb = fill(a.data, ma, 0, finite=True, facts=facts), fill(b.data, mb, 0, finite=True, facts=facts)
    else:
        # masked terms meet valid outputs: one side must hold exactly 0 there (one that already
        # does, else the smaller one is filled), the other finite values (not conditionally)
        zero_b = facts.holds_zero(b.data, mb, along=rc) or (
            not facts.holds_zero(a.data, ma, along=lc) and np.size(b.data) <= np.size(a.data)
        )
        fa = fill(a.data, ma, 0, finite=zero_b, conditional=False, along=lc, facts=facts)
        fb = fill(b.data, mb, 0, finite=not zero_b, conditional=False, along=rc, facts=facts)
        fa, fb = _materialized(fa, a.data, facts), _materialized(fb, b.data, facts)
    out = Pair(bind(fa, fb), and_masks(out_a, out_b, facts=facts))
    if facts.active and const_a and const_b and not lb and (ma is None) != (mb is None):
        # a dense layer with no bias, on rows that hold 0 where masked: 0 there while the plain
        # operand (no batch dims: every row meets all of it) is finite; a conditional record
        # (see masked_jax.ops._factors.Known)
        x, m = (fa, ma) if mb is None else (fb, mb)
        if facts.holds_zero(x, m, conditional=True):
            facts.record_value(out.data, out.mask, 0, True, conditional=True)
    return out


def _materialized(filled, data, facts: Facts):
    """``filled`` (a fill of ``data``) behind an optimisation barrier when traced, so that XLA
    keeps it as one buffer.

    It is what the backward pass reads (the contraction's residual). Without the barrier, XLA's
    GPU fusion recomputed the fill inside a backward kernel from the unfilled data, and kept that
    producer alive across the rest of the forward pass. For attention's values that producer is
    the fused query/key/value projection, three times the values' size (``benchmarks/gpu_compile.py``
    reads the difference in an equinox encoder step's temporary memory). Only attention-like
    contractions (masked terms meeting valid outputs) take it: on dense layers' inputs XLA fuses
    the fills into the layer, and a barrier there costs memory instead.
    """
    if filled is data or not is_tracer(filled):
        return filled
    return facts.memo(("materialized", id(filled)), lambda: jax.lax.optimization_barrier(filled), filled)


def _same_along_contraction(ma, mb, nda, ndb, lc, rc, lb, rb, facts: Facts):
    """Whether both masks are known (statically, by their recorded factors) to be the same along
    the contracted dims, and to vary there with the batch dims only: attention's weights (the
    keys' mask along the keys) times the values (the same keys' mask). Then, for every output whose
    slices are valid, a term is valid on both sides or on neither, as when no mask varies along
    the contracted dims: zero-filling is exact and the output mask comes from the masks alone."""
    if ma is None or mb is None or not facts.active:
        return False

    def roles(nd, contract, batch):
        out = [None] * nd
        for t, d in enumerate(contract):
            out[d] = ("c", t)
        for t, d in enumerate(batch):
            out[d] = ("b", t)
        return out

    return _factors.same_along(facts.factors(ma), facts.factors(mb), roles(nda, lc, lb), roles(ndb, rc, rb))


def _compact_mask_contraction(ma, mb, shape_a, shape_b, lc, rc, lb, rb):
    """The output mask of a ``dot_general`` (is there a jointly valid term?) contracted on the
    compact masks: a contracted dim along which one mask is 1 is reduced (``any``) in the other
    first, batch dims are brought to a common size, free dims stay compact."""
    ma = jnp.ones((1,) * len(shape_a), bool) if ma is None else ma
    mb = jnp.ones((1,) * len(shape_b), bool) if mb is None else mb
    for da, db in zip(lc, rc):
        if ma.shape[da] == 1 and mb.shape[db] != 1:
            mb = any_valid(mb, mb.shape, (db,), keepdims=True)
        elif mb.shape[db] == 1 and ma.shape[da] != 1:
            ma = any_valid(ma, ma.shape, (da,), keepdims=True)
    for da, db in zip(lb, rb):
        size = max(ma.shape[da], mb.shape[db])
        ma = jnp.broadcast_to(ma, ma.shape[:da] + (size,) + ma.shape[da + 1 :])
        mb = jnp.broadcast_to(mb, mb.shape[:db] + (size,) + mb.shape[db + 1 :])
    counts = jax.lax.dot_general(ma.astype(jnp.float32), mb.astype(jnp.float32), ((lc, rc), (lb, rb)))
    return counts > 0


# Each operand entry as a code: 0 masked, 1 +inf, 2 -inf, 3 positive finite, 4 negative finite, 5 zero,
# 6 NaN; the kinds of entry the non-finite terms are counted over, as sets of codes.
_KINDS = {
    "v": {1, 2, 3, 4, 5, 6},
    "pi": {1},
    "ni": {2},
    "pf": {3},
    "nf": {4},
    "p": {1, 3},
    "n": {2, 4},
    "i": {1, 2},
    "z": {5},
    "nan": {6},
}
_TERMS = [
    ("pi", "p"),
    ("pf", "pi"),
    ("ni", "n"),
    ("nf", "ni"),  # +inf terms
    ("pi", "n"),
    ("pf", "ni"),
    ("ni", "p"),
    ("nf", "pi"),  # -inf terms
    ("nan", "v"),
    ("v", "nan"),
    ("i", "z"),
    ("z", "i"),
]  # NaN terms
# per term kind, the codes each side may hold as the bits of one int8 (bit c: code c)
_LEFT_BITS, _RIGHT_BITS = (
    np.array([sum(1 << code for code in _KINDS[pair[side]]) for pair in _TERMS], np.int8) for side in (0, 1)
)


def _codes(x, valid):
    code = jnp.where(jnp.isinf(x), jnp.where(x > 0, 1, 2), jnp.where(x > 0, 3, jnp.where(x < 0, 4, 5)))
    return jnp.where(valid, jnp.where(jnp.isnan(x), 6, code), 0).astype(jnp.int8)


def _with_nonfinite(fn, kwargs, a, b, va, vb):
    """:func:`_real_nonfinite`, for complex operands by their real and imaginary parts: each
    term's real part is ``ar br - ai bi`` and its imaginary part ``ar bi + ai br``, so the four real
    contractions sum the same products (IEEE sums of infinities do not depend on the order)."""
    if not any(jnp.issubdtype(jnp.result_type(x), jnp.complexfloating) for x in (a, b)):
        return _real_nonfinite(fn, kwargs, a, b, va, vb)
    dtype = jnp.result_type(a, b)
    (ar, ai), (br, bi) = [(jnp.real(x), jnp.imag(x)) for x in (a, b)]
    part = lambda x, y: _real_nonfinite(fn, kwargs, x, y, va, vb)  # noqa: E731
    return jax.lax.complex(part(ar, br) - part(ai, bi), part(ar, bi) + part(ai, br)).astype(dtype)


def _real_nonfinite(fn, kwargs, a, b, va, vb):
    """``fn(a, b)`` over jointly valid terms when valid entries may be ``inf`` or NaN: the finite
    terms contracted, the non-finite ones counted by sign (see the module docstring). One term
    kind at a time (a loop over the 12 kinds, each indicator read off one int8 code per entry by a
    shift, the +inf, -inf and NaN flags or-ed into the loop's carry): this branch is compiled into
    every program with a general masked contraction, so its memory is kept to about one
    contraction's (no int32 copy of the codes, no stack of the 12 counts)."""
    finite = fn(jnp.where(va & jnp.isfinite(a), a, 0), jnp.where(vb & jnp.isfinite(b), b, 0), **kwargs)
    ca, cb = _codes(a, va), _codes(b, vb)
    left, right = jnp.asarray(_LEFT_BITS), jnp.asarray(_RIGHT_BITS)

    def count(t, flags):
        u = jnp.right_shift(left[t], ca) & 1  # int8 throughout: nothing code-sized to hoist
        w = jnp.right_shift(right[t], cb) & 1
        hit = fn(u.astype(jnp.bfloat16), w.astype(jnp.bfloat16), **kwargs) > 0
        return tuple(f | (hit & (t // 4 == i)) for i, f in enumerate(flags))

    no = jnp.zeros(jnp.shape(finite), bool)
    pos, neg, nan = jax.lax.fori_loop(0, len(_TERMS), count, (no, no, no))
    out = jnp.where(pos, jnp.inf, jnp.where(neg, -jnp.inf, finite))
    return jnp.where(nan | (pos & neg), jnp.nan, out).astype(finite.dtype)


def einsum(*operands: Pair, subscripts: str, **kwargs) -> Pair:
    """``jnp.einsum(subscripts, *operands)``: the subscripts come as a keyword (operands first)."""
    if not isinstance(subscripts, str):
        raise TypeError(f"subscripts must be an einsum string such as 'ij,jk->ik'; got {type(subscripts).__name__}.")
    return contraction(lambda *ops, **kw: jnp.einsum(subscripts, *ops, **kw))(*operands, **kwargs)


_A = "a = mj.masked_array(jnp.array([[1.0, 2.0], [3.0, 4.0]]), jnp.array([[True, False], [False, False]]))"
_V = "a = mj.masked_array(jnp.array([1.0, 2.0]), jnp.array([True, False]))"
_ROWS = "Array([[ True,  True],\n       [False, False]], dtype=bool)"
# name, jax function, methods, primitives, example
CONTRACTIONS = [
    (
        "matmul",
        jnp.matmul,
        ("__matmul__", "__rmatmul__"),
        (P.dot_general_p,),
        (_A, "{mod}.matmul(a, jnp.ones((2, 2))).mask", _ROWS),
    ),
    ("dot", jnp.dot, ("dot",), (), (_A, "{mod}.dot(a, jnp.ones((2, 2))).mask", _ROWS)),
    ("vdot", jnp.vdot, (), (), (_V, "{mod}.vdot(a, jnp.array([10.0, 10.0]))", "MaskedArray(10.0, dtype=float32)")),
    ("inner", jnp.inner, (), (), (_V, "{mod}.inner(a, jnp.array([10.0, 10.0]))", "MaskedArray(10.0, dtype=float32)")),
    ("outer", jnp.outer, (), (), (_V, "{mod}.outer(a, jnp.array([1.0, 1.0])).mask.sum()", "Array(2, dtype=int32)")),
    ("tensordot", jnp.tensordot, (), (), (_A, "{mod}.tensordot(a, jnp.ones((2, 2)), axes=1).mask", _ROWS)),
]
for _name, _fn, _methods, _prims, _example in CONTRACTIONS:
    register(
        OpSpec(
            name=_name,
            family="linalg",
            rule=contraction(_fn),
            operands=("a", "b"),
            methods=_methods,
            signature=signature_of(_fn, drop=("out_sharding",)),
            primitives=_prims,
            fn=_fn,
            jax_name=f"jnp.{_name}",
            example=_example,
        )
    )

_POS = inspect.Parameter.POSITIONAL_ONLY
register(
    OpSpec(
        name="einsum",
        family="linalg",
        rule=einsum,
        fn=jnp.einsum,
        jax_name="jnp.einsum",
        signature=signature_of(jnp.einsum, drop=("out_sharding",)),
        operands=("*operands",),
        example=(_A, "{mod}.einsum('ij,jk->ik', a, jnp.ones((2, 2))).mask", _ROWS),
    )
)
