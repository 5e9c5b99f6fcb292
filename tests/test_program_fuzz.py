"""A program fuzzer for ``maskify``: padding stays padding in programs nobody wrote by hand.

hypothesis builds small programs from a grammar of what models do to a (B, L, F) batch:
entrywise functions, ``where`` with constant fills, ``concatenate`` with constants and with other
features, dense layers, a mean along the sequence subtracted back, a recurrent ``lax.scan`` over
the sequence axis (its outputs, or its final carry), ``segment_sum`` and ``.at[].add`` over the
tokens, and a pooling at the end. The batch is padded row-wise (whole examples missing) or
token-wise (right padding, holes), with NaN, ``inf`` or large values in the padding.

For each program, ``maskify`` on the padded batch (eagerly and under ``jit``) must equal the
program run on every example's valid tokens alone, in values, masks and parameter gradients, or
raise ``MaskifyError``. A padded example (no valid token) gives a masked output, or the value
the program gives on an empty sequence (the final carry of a scan over no step); where the
program has no value there (a max over no token) it must be masked. A result that
depends on the padding fails. ``MJ_FUZZ_EXAMPLES`` sets the example count (``make test`` runs a
sample; ``make test-slow`` runs more).
"""

from __future__ import annotations

import os
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import masked_jax as mj

B, L, F = 3, 5, 3
RTOL = 2e-4
EXAMPLES = int(os.environ.get("MJ_FUZZ_EXAMPLES", "8"))
POSITIONAL = ("segment_sum", "at_add")  # steps that read token positions: right padding only

UNARY = {
    "tanh": jnp.tanh,
    "sin": jnp.sin,
    "relu": jax.nn.relu,
    "gelu": jax.nn.gelu,
    "exp": lambda v: jnp.exp(jnp.clip(v, -3.0, 3.0)),
    "square": lambda v: 0.1 * v * v,
}


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
    if kind in POSITIONAL:  # tokens 2k and 2k + 1 into segment k, per example
        segments = (v.shape[1] + 1) // 2
        ids = jnp.arange(v.shape[1]) // 2
        if kind == "segment_sum":
            return jax.vmap(lambda u: jax.ops.segment_sum(u, ids, segments))(v)
        return jax.vmap(lambda u: jnp.zeros((segments, u.shape[-1]), u.dtype).at[ids].add(u))(v)
    raise AssertionError(kind)


def _pool(kind, p, v):
    """The last step: (n, T, C) -> (n, C)."""
    if kind == "mean":
        return jnp.mean(v, axis=1)
    if kind == "max":
        return jnp.max(v, axis=1)
    if kind == "sum-dense":
        return jnp.sum(v, axis=1) @ p["w"]
    # the final carry of a recurrent scan
    h = jnp.zeros((v.shape[0], p["u"].shape[0]), v.dtype)
    h, _ = jax.lax.scan(lambda h, xt: (jnp.tanh(xt @ p["w"] + h @ p["u"]), None), h, jnp.swapaxes(v, 0, 1))
    return h


@st.composite
def programs(draw):
    padding = draw(st.sampled_from(["right", "holes", "rows"]))
    kinds = ["unary", "where", "dense", "concat_ones", "concat_self", "center", "scan"]
    if padding != "holes":
        kinds += list(POSITIONAL)
    steps, width, rng = [], F, np.random.default_rng(draw(st.integers(0, 2**16)))
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(kinds))
        arg, p, out = None, {}, width
        if kind == "unary":
            arg = draw(st.sampled_from(sorted(UNARY)))
        elif kind in ("concat_ones", "scan"):
            arg = draw(st.booleans())
        if kind in ("dense", "scan"):
            out = draw(st.integers(2, 4))
            p["w"] = rng.normal(size=(width, out)) * 0.7
            p["u" if kind == "scan" else "b"] = rng.normal(size=(out, out) if kind == "scan" else (out,)) * 0.7
        elif kind == "concat_ones":
            out = width + (1 if arg else width)
        elif kind == "concat_self":
            out = 2 * width
        steps.append((kind, arg, p))
        width = out
    pool = draw(st.sampled_from(["mean", "max", "sum-dense", "final-carry"]))
    p = {"w": rng.normal(size=(width, 2)) * 0.7, "u": rng.normal(size=(2, 2)) * 0.7}
    dtype = draw(st.sampled_from([np.float32, np.float64]))
    if padding == "rows":
        valid = np.repeat(np.array([True, False, True])[:, None], L, 1)
    else:
        valid = np.array(draw(st.lists(st.lists(st.booleans(), min_size=L, max_size=L), min_size=B, max_size=B)))
        if padding == "right":
            valid = np.arange(L)[None, :] < valid.sum(1, keepdims=True)
    params = [{k: jnp.asarray(a, dtype) for k, a in q.items()} for _, _, q in steps] + [
        {k: jnp.asarray(a, dtype) for k, a in p.items()}
    ]
    structure = [(kind, arg) for kind, arg, _ in steps] + [pool]
    x = rng.normal(size=(B, L, F)).astype(dtype)
    poison = draw(st.sampled_from([np.nan, np.inf, -np.inf, 1e30]))
    return structure, params, valid, x, poison


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
        except (ValueError, TypeError, IndexError):  # a max over no token, a reshape of nothing
            return None
    return out if bool(jnp.all(jnp.isfinite(out))) else None


def _close(got, want, what):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=RTOL, atol=RTOL, err_msg=what)


@settings(
    max_examples=EXAMPLES, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck), database=None
)
@given(programs())
def test_maskify_of_a_random_program_equals_each_example_alone(case):
    structure, params, valid, x, poison = case
    xm = mj.masked_array(jnp.asarray(np.where(valid[..., None], x, poison)), jnp.asarray(valid[..., None]))
    refs = [_alone(structure, params, x[b, valid[b]]) for b in range(B)]
    fn = mj.maskify(lambda p, v: _program(structure, p, v))
    try:
        outs = [("eager", fn(params, xm)), ("jit", jax.jit(fn)(params, xm))]
    except mj.MaskifyError:
        return  # a refusal is allowed; a silently padding-dependent value is not
    for label, out in outs:
        out = mj.as_masked(out)
        for b, ref in enumerate(refs):
            what = f"{label}: program {structure}, padding {valid[b].astype(int)}, example {b}"
            if ref is None:
                assert not bool(jnp.any(out.mask[b])), f"{what}: valid output where the example has no value"
            elif not valid[b].any() and not bool(jnp.any(out.mask[b])):
                continue  # an empty example: masked (a sum over no token), or the empty run's value
            else:
                assert bool(jnp.all(out.mask[b])), f"{what}: masked output {out.mask[b]}"
                _close(out.data[b], ref, what)

    # parameter gradients of the valid outputs' sum against the per-example runs'
    have = [b for b, ref in enumerate(refs) if ref is not None and valid[b].any()]
    if not have:
        return

    def masked_loss(p):
        out = mj.as_masked(fn(p, xm))
        return jnp.sum(out.data[jnp.asarray(have)])

    def ref_loss(p):
        return sum(jnp.sum(_program(structure, p, jnp.asarray(x[b, valid[b]])[None])) for b in have)

    want = jax.grad(ref_loss)(params)
    for label, grad in (("eager", jax.grad(masked_loss)), ("jit", jax.jit(jax.grad(masked_loss)))):
        got = grad(params)
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            assert bool(jnp.all(jnp.isfinite(g))), f"{label}: program {structure}: NaN in a parameter gradient"
            _close(g, w, f"{label}: program {structure}: parameter gradient")


@pytest.mark.parametrize(
    "structure",
    [
        [("segment_sum", None), ("dense", None), "mean"],  # free segments through a dense layer stay free
        pytest.param([("concat_ones", True), ("dense", None), "final-carry"], marks=pytest.mark.slow),
        pytest.param([("scan", True), ("concat_self", None), "max"], marks=pytest.mark.slow),
    ],
)
def test_programs_the_fuzzer_found_worth_keeping(structure):
    """Programs kept as plain cases: free positions through a biased dense layer, a bias column
    before a recurrent final carry, a reversed scan's outputs joined with themselves."""
    rng = np.random.default_rng(0)
    widths, params, w = [F], [], F
    for kind, _ in structure[:-1]:
        p = {}
        if kind == "dense":
            p = {"w": rng.normal(size=(w, 4)), "b": rng.normal(size=(4,))}
            w = 4
        elif kind == "scan":
            p = {"w": rng.normal(size=(w, 3)), "u": rng.normal(size=(3, 3))}
            w = 3
        elif kind == "concat_ones":
            w += 1
        elif kind == "concat_self":
            w *= 2
        params.append({k: jnp.asarray(a) for k, a in p.items()})
        widths.append(w)
    params.append({"w": jnp.asarray(rng.normal(size=(w, 2))), "u": jnp.asarray(rng.normal(size=(2, 2)))})
    valid = np.arange(L)[None, :] < np.array([[5], [2], [3]])
    x = rng.normal(size=(B, L, F))
    test_maskify_of_a_random_program_equals_each_example_alone.hypothesis.inner_test(
        (structure, params, valid, x, np.nan)
    )
