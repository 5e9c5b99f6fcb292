"""A program fuzzer for ``maskify``: padding stays padding in programs nobody wrote by hand.

hypothesis builds small programs from a grammar of what models do to a (B, L, F) batch of tokens:

* entrywise functions, ``where`` with constant fills, ``concatenate`` with constants and with
  other features, dense layers (random or zero biases, as flax initialises them), a mean along
  the tokens subtracted back, a recurrent ``lax.scan`` over the tokens (its outputs, or its final
  carry);
* custom derivatives: ``jax.nn.relu`` (its own rule says ``relu'(0) = 0``), a NaN-safe norm
  written with ``jax.custom_jvp``, a straight-through rounding and a NaN-safe ``|u|`` written with
  ``jax.custom_vjp``, each after a bias (zeros, so its derivative is read at the bias) and
  optionally after centring the tokens, which puts exact zeros at the valid entries of an
  example with one token, where the rule and the primal's derivative differ;
* positions along the token axis: ``jnp.pad`` on the left then a ``VALID`` convolution (a causal
  convolution), ``jnp.pad`` on both sides, a constant or learned token concatenated at the start
  or at the end, ``pos_emb[jnp.arange(T)]`` and sinusoidal features from ``arange``, slices and
  reversals (``v[:, -2:]``, ``v[:, ::-1]``, ``v[:, 1:]``, ``v[:, :-1]``), the first and the
  last token (``v[:, 0]``, ``v[:, -1]``) as pools;
* id spaces: ``segment_sum`` and ``.at[].add`` of the tokens into segments, with ids made by
  ``arange`` (tokens 2k and 2k + 1 into segment k) or read from the data (the sign of a feature);
  segment results gathered back at the ids (``v * segment_sum(ones, ids)[ids]``, a GCN-like
  degree normalisation) and cast (``jnp.bincount(ids).astype(float)``,
  ``segment_sum(...).astype(jnp.float16)``);
* sorts and ranks: the top-k tokens by a score (``jnp.argsort(-s)[:, :k]`` then
  ``take_along_axis``, or ``jnp.argsort(s)[:, ::-1][:, :k]``), ranks by a double ``argsort`` as
  indices into an embedding table, ``jnp.sort`` along the tokens;
* a last step: a mean, max or sum pool, a recurrent final carry, the first or last token,
  ``jnp.unique(..., size=3, fill_value=0.0)`` of the (rounded) values, or the tokens themselves.

The batch is padded row-wise (whole examples missing) or token-wise (right padding, left padding,
holes), with NaN, ``inf`` or large values in the padding; every step kind meets every padding.

The reference is the same program run on each example's valid tokens alone
(``x[b:b+1, valid[b]]``). For each program, ``maskify`` on the padded batch (eagerly and under
``jit``) must equal it, or raise ``MaskifyError``. Equal means:

* an output with no token axis (a pool, the first or last token, ``unique``): for every example,
  the output is valid and equals the reference (to ``RTOL``);
* an output with a token axis (the last step "tokens"; its length may differ from the reference's
  after slices, pads, concatenated tokens, segments or a top-k): every token of the output is
  valid in all its features or masked in all of them, and the valid tokens, in order, equal the
  reference's tokens, as many as the reference has. So ``maskify`` may return an example's valid
  tokens where they sit in the padded batch or moved to the front (the unpadded example's
  coordinates); a reversal or a sort may put them anywhere, but their order is the reference's;
* where the reference has no value (a max over no token, ``v[:, -1]`` of no token, a non-finite
  result) the output of that example is masked; for an example with no valid token, a masked
  output is accepted as well as the reference's value (the final carry of a scan over no step);
* parameter gradients of the sum of the valid outputs equal the reference's (and are finite),
  eagerly and under ``jit``.

A result that depends on the padding fails. ``MJ_FUZZ_EXAMPLES`` sets the example count (``make
test`` runs a sample; ``make test-slow`` runs more); ``MJ_FUZZ_SHRINK=1`` lets hypothesis shrink a
failing example (minutes: each example compiles several programs). ``test_one_program_per_class``
runs one fixed program per construct class on every run.
"""

from __future__ import annotations

import os
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import masked_jax as mj

B, L, F = 3, 5, 3
RTOL = 2e-4
EXAMPLES = int(os.environ.get("MJ_FUZZ_EXAMPLES", "3"))
# each example compiles several programs: shrinking a failure takes minutes, so it is asked for
PHASES = tuple(Phase) if os.environ.get("MJ_FUZZ_SHRINK") == "1" else (Phase.explicit, Phase.reuse, Phase.generate)
PADDINGS = ("right", "left", "holes", "rows")
TOP_K = 3

UNARY = {
    "tanh": jnp.tanh,
    "sin": jnp.sin,
    "relu": jax.nn.relu,
    "gelu": jax.nn.gelu,
    "exp": lambda v: jnp.exp(jnp.clip(v, -3.0, 3.0)),
    "square": lambda v: 0.1 * v * v,
}


# -- custom derivatives, as users write them ----------------------------------------------------
@jax.custom_jvp
def safe_norm(v):
    """The norm of the last axis (keepdims), whose derivative at 0 is 0, not NaN."""
    return jnp.sqrt(jnp.sum(v * v, axis=-1, keepdims=True))


@safe_norm.defjvp
def _safe_norm_jvp(primals, tangents):
    (v,), (t,) = primals, tangents
    n = safe_norm(v)
    positive = n > 0
    return n, jnp.where(positive, jnp.sum(v * t, axis=-1, keepdims=True) / jnp.where(positive, n, 1.0), 0.0)


@jax.custom_vjp
def straight_through_round(v):
    """Rounding whose gradient is the identity's."""
    return jnp.round(v)


straight_through_round.defvjp(lambda v: (jnp.round(v), None), lambda _, g: (g,))


@jax.custom_vjp
def safe_abs(v):
    """``sqrt(v * v)``, whose gradient at 0 is 0, not NaN."""
    return jnp.sqrt(v * v)


def _safe_abs_bwd(v, g):
    return (jnp.where(v != 0, g * v / jnp.where(v != 0, jnp.abs(v), 1.0), 0.0),)


safe_abs.defvjp(lambda v: (jnp.sqrt(v * v), v), _safe_abs_bwd)

CUSTOM = {
    "relu": jax.nn.relu,
    "safe_norm": lambda u: jnp.concatenate([u, safe_norm(u)], -1),
    "straight_through_round": straight_through_round,
    "safe_abs": safe_abs,
}


# -- the grammar ---------------------------------------------------------------------------------
def _ids(kind, v):
    """Segment ids of one example's tokens ``v`` (T, C), and the number of segments."""
    if kind == "pairs":  # tokens 2k and 2k + 1 into segment k
        return jnp.arange(v.shape[0]) // 2, (v.shape[0] + 1) // 2
    return (v[:, 0] > 0).astype(jnp.int32), 2  # by the sign of the first feature


def _segment(arg, p, u):
    """A segment step on one example's tokens ``u`` (T, C)."""
    op, kind = arg
    ids, n = _ids(kind, u)
    if op == "segment_sum":
        return jax.ops.segment_sum(u, ids, n)
    if op == "at_add":
        return jnp.zeros((n, u.shape[-1]), u.dtype).at[ids].add(u)
    if op == "count":  # each token scaled by its segment's size
        return u * jax.ops.segment_sum(jnp.ones_like(u[:, :1]), ids, n)[ids]
    if op == "gcn":  # a degree-normalised aggregation, gathered back at the tokens
        norm = jax.lax.rsqrt(jax.ops.segment_sum(jnp.ones_like(u[:, :1]), ids, n))[ids]
        return jax.ops.segment_sum(u * norm, ids, n)[ids] * norm
    if op == "bincount":
        return u * jnp.bincount(ids, length=n).astype(u.dtype)[ids][:, None]
    if op == "float16":
        return jax.ops.segment_sum(u, ids, n).astype(jnp.float16)[ids].astype(u.dtype)
    if op == "float16-slots":
        return jax.ops.segment_sum(u, ids, n).astype(jnp.float16).astype(u.dtype)
    raise AssertionError(op)


def _step(kind, arg, p, v):
    """One step of a program on ``v`` (n, T, C) -> (n, T', C')."""
    if kind == "unary":
        return UNARY[arg](v)
    if kind == "where":
        return jnp.where(v > 0.1, v, 0.0)
    if kind == "dense":
        return v @ p["w"] + p["b"]
    if kind == "concat_ones":
        return (
            jnp.concatenate([v, jnp.ones_like(v[..., :1])], -1) if arg else jnp.concatenate([jnp.ones_like(v), v], -1)
        )
    if kind == "concat_self":
        return jnp.concatenate([v, jnp.tanh(v)], -1)
    if kind == "center":
        return v - jnp.mean(v, axis=1, keepdims=True)
    if kind == "scan":

        def cell(h, xt):
            h = jnp.tanh(xt @ p["w"] + h @ p["u"])
            return h, h

        h, hs = jax.lax.scan(
            cell, jnp.zeros((v.shape[0], p["u"].shape[0]), v.dtype), jnp.swapaxes(v, 0, 1), reverse=arg
        )
        return jnp.swapaxes(hs, 0, 1)
    if kind == "custom":
        fn, centred = arg
        if centred:
            v = v - jnp.mean(v, axis=1, keepdims=True)
        return CUSTOM[fn](v + p["b"])
    if kind == "segment":
        return jax.vmap(lambda u: _segment(arg, p, u))(v)
    if kind == "causal_conv":  # pad k - 1 tokens on the left, then a VALID convolution
        v = jnp.pad(v, ((0, 0), (arg - 1, 0), (0, 0)))
        return jax.lax.conv_general_dilated(v, p["w"], (1,), "VALID", dimension_numbers=("NWC", "WIO", "NWC"))
    if kind == "pad":
        return jnp.pad(v, ((0, 0), arg, (0, 0)))
    if kind == "concat_token":
        where, what = arg
        if what == "param":
            token = jnp.broadcast_to(p["token"], (v.shape[0], 1, v.shape[-1]))
        else:
            token = jnp.full((v.shape[0], 1, v.shape[-1]), 1.0 if what == "ones" else 0.0, v.dtype)
        return jnp.concatenate([token, v] if where == "start" else [v, token], 1)
    if kind == "position":
        t = v.shape[1]
        if arg == "table":
            return v + p["pos"][jnp.arange(t)]
        freq = 1.0 / 10.0 ** (jnp.arange(v.shape[-1]) / v.shape[-1])
        return v + jnp.sin(jnp.arange(t)[:, None] * freq).astype(v.dtype)
    if kind == "slice":
        return {"-2:": v[:, -2:], "::-1": v[:, ::-1], "1:": v[:, 1:], ":-1": v[:, :-1]}[arg]
    if kind == "sort":
        if arg == "sort":
            return jnp.sort(v, axis=1)
        s = v @ p["w"]
        if arg == "rank":  # each token's rank by its score, as an index into a table
            return v + p["pos"][jnp.argsort(jnp.argsort(s, axis=1), axis=1)]
        top = jnp.argsort(-s, axis=1)[:, :TOP_K] if arg == "top" else jnp.argsort(s, axis=1)[:, ::-1][:, :TOP_K]
        return jnp.take_along_axis(v, top[..., None], axis=1)
    raise AssertionError(kind)


def _pool(kind, p, v):
    """The last step: (n, T, C) -> (n, C), (n, 3) or (n, T, C) ("tokens")."""
    if kind == "mean":
        return jnp.mean(v, axis=1)
    if kind == "max":
        return jnp.max(v, axis=1)
    if kind == "sum-dense":
        return jnp.sum(v, axis=1) @ p["w"]
    if kind == "first":
        return v[:, 0]
    if kind == "last":
        return v[:, -1]
    if kind == "unique":
        return jax.vmap(lambda u: jnp.unique(u, size=3, fill_value=0.0))(jnp.round(2 * v[..., 0]))
    if kind == "tokens":
        return v
    # the final carry of a recurrent scan
    h = jnp.zeros((v.shape[0], p["u"].shape[0]), v.dtype)
    h, _ = jax.lax.scan(lambda h, xt: (jnp.tanh(xt @ p["w"] + h @ p["u"]), None), h, jnp.swapaxes(v, 0, 1))
    return h


STEPS = {  # kind -> the arguments it is drawn with
    "unary": sorted(UNARY),
    "where": [None],
    "dense": [False, True],  # a zero bias
    "concat_ones": [False, True],
    "concat_self": [None],
    "center": [None],
    "scan": [False, True],  # reverse
    "custom": [(fn, centred) for fn in CUSTOM for centred in (False, True)],
    "segment": [
        (op, ids)
        for op in ("segment_sum", "at_add", "count", "gcn", "bincount", "float16", "float16-slots")
        for ids in ("pairs", "sign")
    ],
    "causal_conv": [2, 3],
    "pad": [(1, 0), (0, 1), (1, 1)],
    "concat_token": [(where, what) for where in ("start", "end") for what in ("zeros", "ones", "param")],
    "position": ["table", "sinusoid"],
    "slice": ["-2:", "::-1", "1:", ":-1"],
    "sort": ["top", "top-reversed", "rank", "sort"],
}
POOLS = ("mean", "max", "sum-dense", "final-carry", "first", "last", "unique", "tokens")


def _build(structure, rng, dtype):
    """Parameters for a program's ``structure`` (steps of (kind, arg), then a pool) on (B, L, F)."""
    *steps, pool = structure
    params, width, t = [], F, L
    for kind, arg in steps:
        p, out = {}, width
        if kind in ("dense", "scan", "causal_conv"):
            out = int(rng.integers(2, 5))
        if kind == "dense":
            p = {"w": rng.normal(size=(width, out)) * 0.7, "b": np.zeros(out) if arg else rng.normal(size=out) * 0.7}
        elif kind == "scan":
            p = {"w": rng.normal(size=(width, out)) * 0.7, "u": rng.normal(size=(out, out)) * 0.7}
        elif kind == "causal_conv":
            p = {"w": rng.normal(size=(arg, width, out)) * 0.7}
        elif kind == "custom":
            p = {"b": np.zeros(width)}
            out = width + (arg[0] == "safe_norm")
        elif kind == "concat_ones":
            out = width + (1 if arg else width)
        elif kind == "concat_self":
            out = 2 * width
        elif kind == "concat_token":
            p = {"token": rng.normal(size=(width,))} if arg[1] == "param" else {}
            t += 1
        elif kind == "pad":
            t += sum(arg)
        elif kind == "position" and arg == "table":
            p = {"pos": rng.normal(size=(t, width)) * 0.7}
        elif kind == "slice":
            t = {"-2:": min(t, 2), "::-1": t, "1:": max(t - 1, 0), ":-1": max(t - 1, 0)}[arg]
        elif kind == "sort" and arg != "sort":
            p = {"w": rng.normal(size=(width,))}
            if arg == "rank":
                p["pos"] = rng.normal(size=(t, width)) * 0.7
            else:
                t = min(t, TOP_K)
        elif kind == "segment":
            if arg[0] in ("segment_sum", "at_add", "float16-slots"):  # the segments' axis
                t = (t + 1) // 2 if arg[1] == "pairs" else 2
        params.append({k: jnp.asarray(a, dtype) for k, a in p.items()})
        width = out
    params.append({k: jnp.asarray(rng.normal(size=s) * 0.7, dtype) for k, s in (("w", (width, 2)), ("u", (2, 2)))})
    return params


def _valid(padding, lengths):
    """A (B, L) token mask: ``lengths`` valid tokens per example, placed by ``padding``."""
    lengths = np.asarray(lengths)[:, None]
    if padding == "right":
        return np.arange(L)[None, :] < lengths
    if padding == "left":
        return np.arange(L)[None, :] >= L - lengths
    raise AssertionError(padding)


def _structure(rng):
    """A program's steps (1 to 4, each kind equally likely) and its pool, from a seed that
    hypothesis draws: hypothesis' own choices among the step kinds cluster on a few kinds over a
    hundred examples, a seed spreads them evenly."""
    kinds = sorted(STEPS)
    steps = []
    for kind in rng.choice(kinds, size=int(rng.integers(1, 5))):
        args = STEPS[str(kind)]
        steps.append((str(kind), args[int(rng.integers(len(args)))]))
    return (*steps, POOLS[int(rng.integers(len(POOLS)))])


@st.composite
def programs(draw):
    padding = draw(st.sampled_from(PADDINGS))
    structure = _structure(np.random.default_rng(draw(st.integers(0, 2**32 - 1))))
    dtype = draw(st.sampled_from([np.float32, np.float64]))
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    if padding == "rows":
        valid = np.repeat(np.array([True, False, True])[:, None], L, 1)
    elif padding == "holes":
        valid = np.array(draw(st.lists(st.lists(st.booleans(), min_size=L, max_size=L), min_size=B, max_size=B)))
    else:  # one valid token is where a centred example is exactly 0
        valid = _valid(padding, draw(st.lists(st.sampled_from([0, 1, 1, 2, 3, 4, 5]), min_size=B, max_size=B)))
    x = rng.normal(size=(B, L, F)).astype(dtype)
    poison = draw(st.sampled_from([np.nan, np.inf, -np.inf, 1e30]))
    return structure, _build(structure, rng, dtype), valid, x, poison


def _program(structure, params, v):
    *steps, pool = structure
    for (kind, arg), p in zip(steps, params):
        v = _step(kind, arg, p, v)
    return _pool(pool, params[-1], v)


def _alone(structure, params, x_b):
    """The program on one example's valid tokens, or ``None`` where it has no value there."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            out = _program(structure, params, jnp.asarray(x_b)[None])[0]
        except (ValueError, TypeError, IndexError):  # a max over no token, v[:, -1] of no token
            return None
    return out if bool(jnp.all(jnp.isfinite(out))) else None


def _close(got, want, what):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=RTOL, atol=RTOL, err_msg=what)


def _check_example(data, mask, ref, tokens, empty, what):
    """One example's output (data, mask) against its reference, as the module docstring says."""
    data, mask = np.asarray(data), np.asarray(mask)
    if ref is None:
        assert not mask.any(), f"{what}: valid output where the example has no value"
        return
    if empty and not mask.any():
        return  # an example with no valid token: masked (a sum over no token), or the empty run's value
    if not tokens:
        assert mask.all(), f"{what}: masked output {mask.astype(int)}"
        _close(data, ref, what)
        return
    rows = mask.all(-1)
    assert (rows == mask.any(-1)).all(), f"{what}: tokens valid in some features only, mask {mask.astype(int)}"
    assert rows.sum() == ref.shape[0], (
        f"{what}: {rows.sum()} valid tokens where the example alone gives {ref.shape[0]}, mask {rows.astype(int)}"
    )
    _close(data[rows], ref, what)


def check_program(structure, params, valid, x, poison, refusal=True):
    """maskify of the program on the padded batch against each example alone (see the module docstring).

    A ``MaskifyError`` passes where ``refusal`` is true."""
    xm = mj.masked_array(jnp.asarray(np.where(valid[..., None], x, poison)), jnp.asarray(valid[..., None]))
    refs = [_alone(structure, params, x[b, valid[b]]) for b in range(B)]
    fn = mj.maskify(lambda p, v: _program(structure, p, v))
    tokens = structure[-1] == "tokens"
    try:
        outs = [("eager", fn(params, xm)), ("jit", jax.jit(fn)(params, xm))]
    except mj.MaskifyError:
        if refusal:
            return  # a refusal is allowed; a silently padding-dependent value is not
        raise
    for label, out in outs:
        out = mj.as_masked(out)
        for b, ref in enumerate(refs):
            what = f"{label}: program {structure}, padding {valid[b].astype(int)}, example {b}"
            _check_example(out.data[b], out.mask[b], ref, tokens, not valid[b].any(), what)

    # parameter gradients of the valid outputs' sum against the per-example runs'
    have = [b for b, ref in enumerate(refs) if ref is not None and valid[b].any()]
    if not have:
        return

    def masked_loss(p):
        out = mj.as_masked(fn(p, xm))
        rows = jnp.asarray(have)
        return jnp.sum(jnp.where(out.mask[rows], out.data[rows], 0))

    def ref_loss(p):
        return sum(jnp.sum(_program(structure, p, jnp.asarray(x[b, valid[b]])[None])) for b in have)

    want = jax.grad(ref_loss)(params)
    for label, grad in (("eager", jax.grad(masked_loss)), ("jit", jax.jit(jax.grad(masked_loss)))):
        got = grad(params)
        for path, g in jax.tree_util.tree_leaves_with_path(got):
            w = _at(want, path)
            where = f"{label}: program {structure}: parameter gradient {jax.tree_util.keystr(path)}"
            assert bool(jnp.all(jnp.isfinite(g))), f"{where}: not finite {g}"
            _close(g, w, where)


def _at(tree, path):
    for key in path:
        tree = tree[key.idx if hasattr(key, "idx") else key.key]
    return tree


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,
    suppress_health_check=list(HealthCheck),
    database=None,
    phases=PHASES,
)
@given(programs())
def test_maskify_of_a_random_program_equals_each_example_alone(case):
    structure, params, valid, x, poison = case
    check_program(structure, params, valid, x, poison)


def _fixed(structure, padding, lengths=(5, 1, 3), seed=0, dtype=np.float64, poison=np.nan, refusal=True):
    """``structure`` on a fixed batch: ``lengths`` valid tokens per example (or a (B, L) mask)."""
    rng = np.random.default_rng(seed)
    params = _build(structure, rng, dtype)
    valid = np.asarray(lengths, bool) if np.ndim(lengths) == 2 else _valid(padding, lengths)
    x = rng.normal(size=(B, L, F)).astype(dtype)
    check_program(structure, params, valid, x, poison, refusal)


HOLES = ((1, 0, 1, 1, 0), (0, 1, 0, 0, 0), (0, 1, 1, 0, 1))  # 3, 1 and 3 valid tokens

# One program per construct class, run every time, each on the padding that makes it matter:
# examples with one valid token put exact zeros where the centred tokens meet the custom rules;
# positions, indices, pads and sorts meet the padding on the side they read (right padding for
# the last token, left padding for the first, holes for both).
CLASSES = {
    "custom_jvp relu at 0": ((("custom", ("relu", True)), "sum-dense"), "right", (5, 1, 3)),
    "custom_jvp safe norm at 0": ((("custom", ("safe_norm", True)), "sum-dense"), "right", (5, 1, 3)),
    "custom_vjp straight-through round": ((("custom", ("straight_through_round", False)), "sum-dense"), "holes", HOLES),
    "custom_vjp safe abs at 0": ((("custom", ("safe_abs", True)), "mean"), "left", (5, 1, 3)),
    "causal pad then VALID conv": ((("causal_conv", 2), "tokens"), "left", (5, 2, 3)),
    "pad both sides then the last token": ((("pad", (1, 1)), "last"), "right", (5, 2, 3)),
    "pad both sides then a causal conv": ((("pad", (1, 1)), ("causal_conv", 2), "tokens"), "holes", HOLES),
    "pad both sides then a scan": ((("pad", (1, 1)), ("scan", False), "final-carry"), "holes", HOLES),
    "constant token at the end": ((("concat_token", ("end", "ones")), "tokens"), "right", (5, 2, 3)),
    "constant token at the end then a causal conv": (
        (("concat_token", ("end", "ones")), ("causal_conv", 2), "tokens"),
        "right",
        (5, 2, 3),
    ),
    "learned token at the start then a causal conv": (
        (("concat_token", ("start", "param")), ("causal_conv", 2), "tokens"),
        "left",
        (5, 2, 3),
    ),
    "zero token at the start then the first token": (
        (("concat_token", ("start", "zeros")), "first"),
        "left",
        (5, 2, 3),
    ),
    "positions from arange": ((("position", "table"), "tokens"), "left", (5, 2, 3)),
    "sinusoidal positions": ((("position", "sinusoid"), "tokens"), "holes", HOLES),
    "last token": ((("dense", False), "last"), "right", (5, 2, 3)),
    "first token": ((("dense", False), "first"), "left", (5, 2, 3)),
    "last tokens v[:, -2:]": ((("slice", "-2:"), "tokens"), "right", (5, 1, 3)),
    "reversal": ((("slice", "::-1"), "tokens"), "left", (5, 2, 3)),
    "reversal then the first token": ((("slice", "::-1"), "first"), "right", (5, 2, 3)),
    "reversal then a causal conv": ((("slice", "::-1"), ("causal_conv", 2), "tokens"), "right", (5, 2, 3)),
    "drop the first token": ((("slice", "1:"), "mean"), "holes", HOLES),
    "drop the last token": ((("slice", ":-1"), "tokens"), "right", (5, 2, 3)),
    "segment counts gathered at arange ids": ((("segment", ("count", "pairs")), "tokens"), "right", (5, 1, 3)),
    "segment counts gathered at data ids": ((("segment", ("count", "sign")), "tokens"), "holes", HOLES),
    "GCN normalisation, arange ids": ((("segment", ("gcn", "pairs")), "tokens"), "right", (5, 1, 3)),
    "GCN normalisation, data ids": ((("segment", ("gcn", "sign")), "tokens"), "holes", HOLES),
    "segments by sign, pooled": ((("segment", ("segment_sum", "sign")), "mean"), "right", (5, 1, 3)),
    "segments of arange ids, tokens": ((("segment", ("at_add", "pairs")), "tokens"), "holes", HOLES),
    "top-k by argsort(-s)": ((("sort", "top"), "tokens"), "right", (5, 2, 3)),
    "top-k by argsort(s)[::-1]": ((("sort", "top-reversed"), "tokens"), "right", (5, 2, 3)),
    "ranks by double argsort": ((("sort", "rank"), "tokens"), "holes", HOLES),
    "sort along the tokens": ((("sort", "sort"), "tokens"), "left", (5, 2, 3)),
    "sort along the tokens then the last": ((("sort", "sort"), "last"), "right", (5, 2, 3)),
    "bincount astype float, data ids": ((("segment", ("bincount", "sign")), "tokens"), "holes", HOLES),
    "bincount astype float, arange ids": ((("segment", ("bincount", "pairs")), "tokens"), "right", (5, 1, 3)),
    "segment_sum astype float16 gathered": ((("segment", ("float16", "pairs")), "tokens"), "left", (5, 2, 3)),
    "segment_sum astype float16 slots": ((("segment", ("float16-slots", "sign")), "mean"), "right", (5, 1, 3)),
    "unique of valid values": ((("dense", False), "unique"), "right", (5, 2, 3)),
    "scan over left padding": ((("scan", True), "tokens"), "left", (5, 2, 3)),
}


@pytest.mark.parametrize("name", sorted(CLASSES))
def test_one_program_per_class(name):
    """One fixed program per construct class of the grammar, on padding that makes it matter
    (see the module docstring for what is compared)."""
    structure, padding, lengths = CLASSES[name]
    _fixed(structure, padding, lengths, refusal=_positional(structure))


def _positional(structure):
    """Does the program read positions along the tokens? Where their meaning cannot be carried,
    a ``MaskifyError`` is the contract's answer (also for ``jnp.unique`` under ``vmap``, which the
    docs list as raising); the custom rules, segments over ids read from the data and casts must
    run."""
    *steps, pool = structure
    # jnp.unique under vmap raises, as docs/maskify.md says (call it directly, or masked_jax.numpy's)
    return pool in ("first", "last", "unique") or any(
        kind in ("causal_conv", "pad", "concat_token", "position", "slice", "sort")
        or (kind == "segment" and arg[1] == "pairs")
        for kind, arg in steps
    )


@pytest.mark.parametrize(
    "structure",
    [
        (("segment", ("segment_sum", "pairs")), ("dense", False), "mean"),  # free segments through a dense layer
        pytest.param((("concat_ones", True), ("dense", False), "final-carry"), marks=pytest.mark.slow),
        pytest.param((("scan", True), ("concat_self", None), "max"), marks=pytest.mark.slow),
    ],
)
def test_programs_the_fuzzer_found_worth_keeping(structure):
    """Programs kept as plain cases: free positions through a biased dense layer, a bias column
    before a recurrent final carry, a reversed scan's outputs joined with themselves."""
    _fixed(structure, "right", (5, 2, 3))
