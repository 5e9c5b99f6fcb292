"""``maskify`` on model families written as users write them, against per-example unpadded runs.

* **Recurrent networks** (flax linen ``nn.RNN``, ``nn.Bidirectional``, flax nnx ``RNN``, a hand
  written ``lax.scan``): forward, reverse and bidirectional, over right padding, left padding and
  holes, with NaN in the padding. A padded step is missing: the carry is left as it was and the
  step's outputs are masked, so the final carry of the natural code (no ``seq_lengths``) and the
  outputs at the valid steps equal the run on each example's valid steps alone; code that passes
  ``seq_lengths`` keeps working.
* **Message passing on padded graphs** (``segment_sum``, ``.at[].add``, ``segment_max``): the
  update forms ``concat([h, agg]) @ W``, ``h @ W1 + agg @ W2``, ``h + agg`` and ``h +
  relu(agg)``, on graphs with isolated valid nodes and with padded edges pointing at node 0,
  equal each graph run alone.
* **Constants beside padding**: a bias column ``concat([x, ones_like(x)]) @ W``.

Values, masks and parameter gradients are checked, eagerly and under ``jit``.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import masked_jax as mj

RTOL = 1e-5
B, L, D, H = 3, 6, 4, 5
PADDINGS = {
    "right": np.array([[1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0], [1, 0, 0, 0, 0, 0]], bool),
    "left": np.array([[1, 1, 1, 1, 1, 1], [0, 0, 0, 1, 1, 1], [0, 0, 0, 0, 1, 1]], bool),
    "holes": np.array([[1, 0, 1, 1, 0, 1], [0, 1, 1, 0, 1, 0], [1, 1, 0, 0, 0, 1]], bool),
}


def _close(got, want, what):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=RTOL, atol=RTOL, err_msg=what)


def _tokens(valid, seed=0):
    x = np.random.default_rng(seed).normal(size=(B, L, D)).astype(np.float32)
    xm = mj.masked_array(jnp.asarray(np.where(valid[..., None], x, np.nan)), jnp.asarray(valid[..., None]))
    return xm, x


# -- recurrent networks --------------------------------------------------------------------------
def _linen(module):
    params = module.init(jax.random.key(0), jnp.zeros((1, 2, D), jnp.float32))
    return (lambda p, v: module.apply(p, v)), params


def _nnx(module, carries=1):
    graphdef, params, rest = nnx.split(module, nnx.Param, ...)  # (the gradients are the parameters')

    def apply(p, v):  # zero initial carries: (h,) for a GRU, (c, h) for an LSTM
        zeros = tuple(jnp.zeros((v.shape[0], H), v.dtype) for _ in range(carries))
        return nnx.merge(graphdef, p, rest)(v, initial_carry=zeros if carries > 1 else zeros[0])

    return apply, params


def _scan_by_hand():
    """A GRU written with lax.scan over the time axis of (B, L, D), with a step counter carried
    beside the state (it counts every step, padded ones included: it has no rows)."""
    k = jax.random.split(jax.random.key(3), 3)
    params = {"wx": jax.random.normal(k[0], (D, 3 * H)) * 0.5, "wh": jax.random.normal(k[1], (H, 3 * H)) * 0.5}

    def apply(p, v):
        def step(carry, xt):
            h, t = carry
            r, z, n = jnp.split(xt @ p["wx"], 3, axis=-1)
            hr, hz, hn = jnp.split(h @ p["wh"], 3, axis=-1)
            r, z = jax.nn.sigmoid(r + hr), jax.nn.sigmoid(z + hz)
            h = (1 - z) * jnp.tanh(n + r * hn) + z * h
            return (h, t + 1), h

        (h, _), hs = jax.lax.scan(step, (jnp.zeros((v.shape[0], H)), 0), jnp.swapaxes(v, 0, 1))
        return h, jnp.swapaxes(hs, 0, 1)

    return apply, params


RNNS = {
    "linen-gru": lambda: _linen(nn.RNN(nn.GRUCell(H), return_carry=True)),
    "linen-lstm-reverse": lambda: _linen(
        nn.RNN(nn.OptimizedLSTMCell(H), return_carry=True, reverse=True, keep_order=True)
    ),
    "linen-bidirectional": lambda: _linen(
        nn.Bidirectional(  # (dtype: flax's carry under x64)
            nn.RNN(nn.GRUCell(H, dtype=jnp.float32)), nn.RNN(nn.GRUCell(H, dtype=jnp.float32)), return_carry=True
        )
    ),
    "nnx-gru": lambda: _nnx(nnx.RNN(nnx.GRUCell(D, H, rngs=nnx.Rngs(0)), return_carry=True, rngs=False)),
    "nnx-lstm-reverse": lambda: _nnx(
        nnx.RNN(nnx.LSTMCell(D, H, rngs=nnx.Rngs(1)), return_carry=True, reverse=True, keep_order=True, rngs=False),
        carries=2,
    ),
    "scan-by-hand": _scan_by_hand,
}


def _leaves(tree):
    return jax.tree.leaves(tree, is_leaf=lambda a: isinstance(a, mj.MaskedArray))


def _check_rnn(apply, params, valid, seed=0):
    xm, x = _tokens(valid, seed)
    refs = [apply(params, jnp.asarray(x[b : b + 1, valid[b]])) for b in range(B)]
    for label, fn in (("eager", mj.maskify(apply)), ("jit", jax.jit(mj.maskify(apply)))):
        carry, outs = fn(params, xm)
        for b, (ref_carry, ref_outs) in enumerate(refs):
            for got, want in zip(_leaves(carry), jax.tree.leaves(ref_carry)):
                assert bool(jnp.all(got.mask[b])), f"{label}: final carry of example {b} is masked"
                _close(got.data[b], want[0], f"{label}: final carry of example {b}")
            np.testing.assert_array_equal(np.asarray(outs.mask[b, :, 0]), valid[b], err_msg=f"{label}: output mask")
            _close(outs.data[b, valid[b]], ref_outs[0], f"{label}: outputs of example {b}")

    w = jnp.linspace(-1.0, 1.0, H)

    def loss(c, o):  # the final carry and a mean-pool over the steps
        return sum(jnp.sum(leaf * w) for leaf in jax.tree.leaves(c)) + jnp.sum(jnp.mean(o, axis=-2) * w[0])

    def masked_loss(p):
        c, o = mj.maskify(lambda q, v: apply(q, v))(p, xm)
        return jnp.sum(mj.maskify(lambda c, o: jax.vmap(loss)(c, o))(c, o).data)

    def ref_loss(p):
        return sum(loss(*jax.tree.map(lambda a: a[0], apply(p, jnp.asarray(x[b : b + 1, valid[b]])))) for b in range(B))

    want = jax.jit(jax.grad(ref_loss))(params)
    for label, grad in (("eager", jax.grad(masked_loss)), ("jit", jax.jit(jax.grad(masked_loss)))):
        got = grad(params)
        assert all(bool(jnp.isfinite(g).all()) for g in jax.tree.leaves(got)), f"{label}: NaN in the gradients"
        jax.tree.map(lambda a, b, label=label: _close(a, b, f"{label}: parameter gradient"), got, want)


# the test loop runs a linen GRU and a hand-written scan over holes (padding anywhere); right and
# left padding, nnx, the reversed and the bidirectional models are in the slow tier (make test-slow)
QUICK_RNNS = ("linen-gru", "scan-by-hand")  # (the reversed and bidirectional ones: slow tier)
RNN_CASES = [
    pytest.param(
        name,
        padding,
        marks=() if padding == "holes" and name in QUICK_RNNS else pytest.mark.slow,
        id=f"{name}-{padding}",
    )
    for name in sorted(RNNS)
    for padding in sorted(PADDINGS)
]


@pytest.mark.parametrize("name,padding", RNN_CASES)
def test_rnn_final_carry_and_outputs_equal_unpadded_runs(name, padding):
    apply, params = RNNS[name]()
    _check_rnn(apply, params, PADDINGS[padding])


def test_linen_rnn_with_seq_lengths_keeps_working():
    rnn = nn.RNN(nn.GRUCell(H), return_carry=True)
    params = rnn.init(jax.random.key(0), jnp.zeros((1, 2, D), jnp.float32))
    valid = PADDINGS["right"]
    lengths = jnp.asarray(valid.sum(1))
    xm, x = _tokens(valid, 4)
    carry, outs = jax.jit(mj.maskify(lambda p, v: rnn.apply(p, v, seq_lengths=lengths)))(params, xm)
    natural, _ = jax.jit(mj.maskify(lambda p, v: rnn.apply(p, v)))(params, xm)
    for b in range(B):
        ref_carry, ref_outs = rnn.apply(params, jnp.asarray(x[b : b + 1, valid[b]]))
        _close(carry.data[b], ref_carry[0], f"seq_lengths: final carry of example {b}")
        _close(natural.data[b], ref_carry[0], f"no seq_lengths: final carry of example {b}")
        _close(outs.data[b, valid[b]], ref_outs[0], f"outputs of example {b}")


def test_a_scan_over_one_sequence_skips_its_padded_steps():
    """Unbatched (an equinox-style per-sequence scan, vmapped or not): the step is the row."""
    cell = nnx.GRUCell(D, H, rngs=nnx.Rngs(5))
    graphdef, state = nnx.split(cell)

    def run(s, v):  # (L, D) -> final state (H,)
        c = nnx.merge(graphdef, s)
        return jax.lax.scan(lambda h, xt: (c(h, xt)[0], None), jnp.zeros(H), v)[0]

    xm, x = _tokens(PADDINGS["holes"], 6)
    for b in range(B):
        one = mj.masked_array(xm.data[b], xm.mask[b])
        _close(mj.maskify(run)(state, one).data, run(state, jnp.asarray(x[b, PADDINGS["holes"][b]])), f"row {b}")
    batched = jax.jit(mj.maskify(lambda s, v: jax.vmap(lambda u: run(s, u))(v)))(state, xm)
    for b in range(B):
        _close(batched.data[b], run(state, jnp.asarray(x[b, PADDINGS["holes"][b]])), f"vmapped row {b}")


# -- message passing on padded graphs ------------------------------------------------------------------
N, E, F = 6, 7, 3
# per graph: its node count and edges (sender, receiver). Graph 0's node 4 and graph 1's node 2
# receive nothing (isolated valid nodes); padded edges point at node 0 with sender 0.
GRAPHS = [(5, [(0, 1), (1, 2), (2, 1), (3, 1)]), (3, [(0, 1), (1, 0)]), (4, [(2, 3), (3, 3), (0, 2)])]


def _graphs(seed=0):
    rng = np.random.default_rng(seed)
    g = len(GRAPHS)
    h = rng.normal(size=(g, N, F)).astype(np.float32)
    s, r, em = np.zeros((g, E), np.int32), np.zeros((g, E), np.int32), np.zeros((g, E), bool)
    for b, (_, edges) in enumerate(GRAPHS):
        for k, (a, c) in enumerate(edges):
            s[b, k], r[b, k], em[b, k] = a, c, True
    nm = np.arange(N)[None] < np.array([n for n, _ in GRAPHS])[:, None]
    masked = (
        mj.masked_array(jnp.asarray(np.where(nm[..., None], h, np.nan)), jnp.asarray(nm[..., None])),
        mj.masked_array(jnp.asarray(s), jnp.asarray(em)),
        mj.masked_array(jnp.asarray(r), jnp.asarray(em)),
    )
    alone = [
        (jnp.asarray(h[b, :n]), jnp.asarray(s[b, : len(e)]), jnp.asarray(r[b, : len(e)]))
        for b, (n, e) in enumerate(GRAPHS)
    ]
    return masked, alone


def _aggregate(kind, msg, r, n):
    if kind == "segment_sum":
        return jax.ops.segment_sum(msg, r, n)
    if kind == "at-add":
        return jnp.zeros((n, msg.shape[-1]), msg.dtype).at[r].add(msg)
    return jnp.maximum(jax.ops.segment_max(msg, r, n), -10.0)  # segment_max, with a floor for empty nodes


UPDATES = {
    "concat": lambda p, h, agg: jnp.concatenate([h, agg], -1) @ p["w"],
    "two-matmuls": lambda p, h, agg: h @ p["w"][:F] + agg @ p["w"][F:],
    "sum": lambda p, h, agg: h + agg,
    "sum-relu": lambda p, h, agg: h + jax.nn.relu(agg),
}


def _layer(p, h, s, r, update, kind):
    """Two rounds of message passing on one graph, then a mean over its nodes."""
    for _ in range(2):
        agg = _aggregate(kind, jnp.tanh(h[s] @ p["m"]), r, h.shape[0])
        h = jnp.tanh(UPDATES[update](p, h, agg))
    return h, jnp.mean(h, axis=0)


# the test loop runs the update forms through segment_sum and concat through .at[].add too
MP_CASES = [
    pytest.param(
        update,
        kind,
        marks=()
        if (kind == "segment_sum" and update != "sum-relu") or (update, kind) == ("concat", "at-add")
        else pytest.mark.slow,
        id=f"{update}-{kind}",
    )
    for update in sorted(UPDATES)
    for kind in ("segment_sum", "at-add", "segment_max")
]


@pytest.mark.parametrize("update,kind", MP_CASES)
def test_message_passing_equals_each_graph_alone(update, kind):
    rng = np.random.default_rng(2)
    params = {
        "m": jnp.asarray(rng.normal(size=(F, F)), jnp.float32),
        "w": jnp.asarray(rng.normal(size=(2 * F, F)), jnp.float32),
    }
    (hm, sm, rm), alone = _graphs()

    def apply(p, h, s, r):
        return jax.vmap(lambda a, b, c: _layer(p, a, b, c, update, kind))(h, s, r)

    refs = [_layer(params, *g, update, kind) for g in alone]
    for label, fn in (("eager", mj.maskify(apply)), ("jit", jax.jit(mj.maskify(apply)))):
        nodes, pooled = fn(params, hm, sm, rm)
        for b, (n, _) in enumerate(GRAPHS):
            np.testing.assert_array_equal(
                np.asarray(nodes.mask[b, :, 0]), np.arange(N) < n, err_msg=f"{label} graph {b}"
            )
            _close(nodes.data[b, :n], refs[b][0], f"{label}: nodes of graph {b}")
            _close(pooled.data[b], refs[b][1], f"{label}: pooled graph {b}")

    def masked_loss(p):
        return jnp.sum(mj.maskify(apply)(p, hm, sm, rm)[1].data)

    def ref_loss(p):
        return sum(jnp.sum(_layer(p, *g, update, kind)[1]) for g in alone)

    want = jax.grad(ref_loss)(params)
    for label, grad in (("eager", jax.grad(masked_loss)), ("jit", jax.jit(jax.grad(masked_loss)))):
        got = grad(params)
        assert all(bool(jnp.isfinite(g).all()) for g in jax.tree.leaves(got)), f"{label}: NaN in the gradients"
        jax.tree.map(lambda a, b, label=label: _close(a, b, f"{label}: parameter gradient"), got, want)


def test_segment_reductions_follow_the_reduction_rules():
    x = mj.masked_array(jnp.array([1.0, 2.0, 3.0, 4.0]), jnp.array([True, True, False, True]))
    ids = mj.masked_array(jnp.array([0, 0, 1, 2]), jnp.array([True, True, True, False]))
    # segment 0: 1 + 2; segment 1: its one term is masked; segment 2: its one id is masked. The 3
    # segments are a fixed set (as long as no masked axis): as in the unpadded run, segments 1 and
    # 2 exist and receive nothing, 0
    got = mj.maskify(lambda v, i: jax.ops.segment_sum(v, i, 3))(x, ids)
    np.testing.assert_array_equal(np.asarray(got.mask), [True, True, True])
    np.testing.assert_array_equal(np.asarray(got.data), [3.0, 0.0, 0.0])
    # over a space as long as the masked axis (nodes), with no array of it in sight: masked
    got = mj.maskify(lambda v, i: jax.ops.segment_sum(v, i, 4))(x, ids)
    np.testing.assert_array_equal(np.asarray(got.mask), [True, False, False, False])
    # a valid segment that also receives a masked term is computed over its valid terms
    got = mj.maskify(lambda v: jax.ops.segment_max(v, jnp.array([0, 0, 0, 1]), 2))(x)
    np.testing.assert_array_equal(np.asarray(got.mask), [True, True])
    np.testing.assert_array_equal(np.asarray(got.data), [2.0, 4.0])
    # a masked id drops its update, also under jit and from a masked operand's valid slots
    base = mj.masked_array(jnp.array([10.0, 20.0, 30.0]), jnp.array([True, False, True]))
    add = jax.jit(mj.maskify(lambda b, v, i: b.at[i].add(v)))(base, x, ids)
    np.testing.assert_array_equal(np.asarray(add.mask), [True, False, True])
    np.testing.assert_array_equal(np.asarray(add.filled(0.0)), [13.0, 0.0, 30.0])
    put = mj.maskify(lambda b, v, i: b.at[i].set(v))(base, x, ids)  # the last write per slot wins
    np.testing.assert_array_equal(np.asarray(put.mask), [True, False, True])
    np.testing.assert_array_equal(np.asarray(put.data[0]), 2.0)
    np.testing.assert_array_equal(np.asarray(put.data[2]), 30.0)


# -- constants beside padding --------------------------------------------------------------------------
FORMS = {
    "bias-column": lambda w, v: jnp.mean(jnp.concatenate([v, jnp.ones_like(v)], -1) @ w, axis=-2),
    "bias-column-first": lambda w, v: jnp.mean(
        jnp.concatenate([jnp.ones_like(v[..., :1]), v], -1) @ w[: D + 1], axis=-2
    ),
    "constant-features": lambda w, v: jnp.max(jnp.concatenate([v, jnp.full_like(v, 2.0)], -1) @ w, axis=-2),
    "parameter-column": lambda w, v: jnp.mean(
        jnp.concatenate([v, jnp.broadcast_to(w[0, :D], v.shape)], -1) @ w, axis=-2
    ),
}


@pytest.mark.parametrize("padding", ["right", pytest.param("holes", marks=pytest.mark.slow)])
@pytest.mark.parametrize("form", sorted(FORMS))
def test_constants_beside_padding_stay_padding(form, padding):
    valid = PADDINGS[padding]
    xm, x = _tokens(valid, 9)
    w = jnp.asarray(np.random.default_rng(3).normal(size=(2 * D, H)), jnp.float32)
    fn = FORMS[form]
    refs = jnp.stack([fn(w, jnp.asarray(x[b, valid[b]])) for b in range(B)])
    for label, f in (("eager", mj.maskify(fn)), ("jit", jax.jit(mj.maskify(fn)))):
        out = f(w, xm)
        assert bool(jnp.all(out.mask)), label
        _close(out.data, refs, label)
    got = jax.jit(jax.grad(lambda q: jnp.sum(mj.maskify(fn)(q, xm).data)))(w)
    _close(got, jax.grad(lambda q: sum(jnp.sum(fn(q, jnp.asarray(x[b, valid[b]]))) for b in range(B)))(w), "gradient")


# -- attention --------------------------------------------------------------------------------------
HEADS, DEPTH = 4, 8
ATTENTION = {  # name: (key/value heads, keyword arguments of jax.nn.dot_product_attention)
    "jax": (4, {}),
    "jax, grouped-query": (2, {}),
    "jax, multi-query": (1, {}),
    "jax, causal": (4, {"is_causal": True}),
    "jax, grouped-query causal, scale": (2, {"is_causal": True, "scale": 0.3}),
    "jax, bias": (4, {"bias": True}),  # (1, HEADS, L, L), read at the tokens' places
    "jax, grouped-query mask": (2, {"mask": True}),  # (1, 1, L, L) bool, each query sees itself
    # a bias computed from the masked tokens is masked: the call runs equation by equation
    "jax, data bias": (4, {"data bias": True}),
    "jax, grouped-query data bias": (2, {"data bias": True}),
    "flax": (4, None),  # nn.MultiHeadDotProductAttention
    "flax, causal mask": (4, "causal"),  # ... with mask=nn.make_causal_mask(tokens)
}
ROUTED = {name for name, (_, kw) in ATTENTION.items() if not isinstance(kw, dict) or "data bias" not in kw}


def _attention(name):
    """``(f(params, x, **positional), params, positional)``: projections of ``x`` to heads and the
    attention of ``name``, as a user writes it; ``positional`` holds the ``bias`` / ``mask``
    arrays at the padded places (the unpadded runs read them at the tokens' places)."""
    kv_heads, kwargs = ATTENTION[name]
    rng = np.random.default_rng(11)
    if not isinstance(kwargs, dict):
        module = nn.MultiHeadDotProductAttention(num_heads=HEADS, qkv_features=HEADS * DEPTH)
        params = module.init(jax.random.key(0), jnp.zeros((1, L, D)))
        if kwargs == "causal":
            return (lambda p, v: module.apply(p, v, mask=nn.make_causal_mask(v[..., 0]))), params, {}
        return (lambda p, v: module.apply(p, v)), params, {}
    params = {
        k: jnp.asarray(rng.normal(size=(D, h * DEPTH)) / 2, jnp.float32)
        for k, h in (("q", HEADS), ("k", kv_heads), ("v", kv_heads))
    }
    positional = {}
    if kwargs.get("bias"):
        positional["bias"] = jnp.asarray(rng.normal(size=(1, HEADS, L, L)), jnp.float32)
    if kwargs.get("mask"):
        positional["mask"] = jnp.asarray((rng.random((1, 1, L, L)) < 0.5) | np.eye(L, dtype=bool))
    options = {k: v for k, v in kwargs.items() if k not in ("bias", "mask", "data bias")}
    data_bias = kwargs.get("data bias")

    def attend(p, v, **given):
        b, n, _ = v.shape
        q, k, w = ((v @ p[name]).reshape(b, n, -1, DEPTH) for name in ("q", "k", "v"))
        bias = jnp.einsum("btd,bsd->bts", v, v)[:, None] / D if data_bias else given.get("bias")
        return jax.nn.dot_product_attention(q, k, w, bias, given.get("mask"), **options)

    return attend, params, positional


@pytest.mark.parametrize("padding", ["right", "holes"])
@pytest.mark.parametrize("name", sorted(ATTENTION))
def test_attention_equals_unpadded_runs_and_runs_as_one_masked_call(name, padding, monkeypatch):
    """``jax.nn.dot_product_attention`` (grouped-query and multi-query layouts, causal, a scale, a
    bias, a mask) and flax's ``MultiHeadDotProductAttention`` (with a causal mask too), on
    projections of one padded batch with NaN in the padding: every valid token's output equals the
    run on its sequence with the padding removed (a bias and a mask read at the tokens' places),
    eagerly, under ``jit`` and under ``vmap``, and the padded tokens are masked; so do the
    parameters' gradients. maskify finds each call by its equations' source and runs it as
    ``masked_jax.nn.dot_product_attention``; a call whose bias is computed from the masked tokens
    is not taken and runs equation by equation, with the same values."""
    calls = []
    masked = mj.nn.dot_product_attention
    monkeypatch.setattr(mj.nn, "dot_product_attention", lambda *a, **kw: calls.append(kw) or masked(*a, **kw))
    valid = PADDINGS[padding]
    xm, x = _tokens(valid, 12)
    fn, params, positional = _attention(name)

    def alone(p, b):
        keep = np.flatnonzero(valid[b])
        given = {k: a[:, :, keep][:, :, :, keep] for k, a in positional.items()}
        return fn(p, jnp.asarray(x[b : b + 1, keep]), **given)[0]

    f = mj.maskify(functools.partial(fn, **positional))

    def vmapped(p, v):  # over two copies of the batch; the second
        copies = jax.tree.map(lambda a: jnp.stack([a, a]), v)
        return jax.tree.map(lambda a: a[1], jax.vmap(f, in_axes=(None, 0))(p, copies))

    for label, run in (("eager", f), ("jit", jax.jit(f)), ("vmap", vmapped)):
        out = run(params, xm)
        for b in range(B):
            _close(out.data[b, valid[b]], alone(params, b), f"{label}: sequence {b}")
            mask = np.broadcast_to(np.asarray(out.mask), out.shape)[b]
            assert mask[valid[b]].all() and not mask[~valid[b]].any(), label
    assert bool(calls) == (name in ROUTED), calls

    def masked_loss(p):
        return jnp.sum(mj.maskify(lambda q, v: jnp.mean(f(q, v), axis=1))(p, xm).data)

    def ref_loss(p):
        return sum(jnp.sum(jnp.mean(alone(p, b), axis=0)) for b in range(B))

    want = jax.grad(ref_loss)(params)
    for label, grad in (("eager", jax.grad(masked_loss)), ("jit", jax.jit(jax.grad(masked_loss)))):
        jax.tree.map(lambda a, b, label=label: _close(a, b, f"{label}: parameter gradient"), grad(params), want)


@pytest.mark.parametrize("padding", ["right", "holes"])
def test_attention_in_a_scan_over_stacked_layers_runs_as_one_masked_call(padding, monkeypatch):
    """Residual causal self-attention layers stacked with ``lax.scan`` (the activations are the
    carry): the carry's token mask stays a token mask through the body, so each layer's call runs
    as ``masked_jax.nn.dot_product_attention``; values, masks and gradients equal the unpadded
    runs, eagerly and under ``jit``."""
    calls = []
    masked = mj.nn.dot_product_attention
    monkeypatch.setattr(mj.nn, "dot_product_attention", lambda *a, **kw: calls.append(kw) or masked(*a, **kw))
    valid = PADDINGS[padding]
    xm, x = _tokens(valid, 8)
    weights = jnp.asarray(np.random.default_rng(2).normal(size=(3, D, 2 * D)) / 2, jnp.float32)

    def layers(w, v):
        def layer(h, wl):
            b, n, _ = h.shape
            q = (h @ wl).reshape(b, n, 2, D)
            return h + jax.nn.dot_product_attention(q, q, q, is_causal=True).sum(axis=2), None

        return jax.lax.scan(layer, v, w)[0]

    f = mj.maskify(layers)
    for label, run in (("eager", f), ("jit", jax.jit(f))):
        out = run(weights, xm)
        for b in range(B):
            _close(out.data[b, valid[b]], layers(weights, jnp.asarray(x[b : b + 1, valid[b]]))[0], f"{label}: {b}")
            mask = np.broadcast_to(np.asarray(out.mask), out.shape)[b]
            assert mask[valid[b]].all() and not mask[~valid[b]].any(), label
    assert calls and all(kw["is_causal"] for kw in calls)
    got = jax.jit(jax.grad(lambda w: jnp.sum(f(w, xm).data)))(weights)
    want = jax.grad(lambda w: sum(jnp.sum(layers(w, jnp.asarray(x[b : b + 1, valid[b]]))) for b in range(B)))(weights)
    _close(got, want, "gradient")


@pytest.mark.parametrize("name", ["jax, data bias", "jax, grouped-query data bias"])
def test_attention_not_taken_is_one_softmax(name):
    """A call maskify does not take (a bias computed from the masked tokens) runs equation by
    equation, and its softmax, in grouped-query layouts too (a transpose between the maximum and
    the subtraction), is recognised as one masked op: one select at the scores' shape, and no
    conditional exact rule in the weights times values."""
    from harness import primitive_count

    fn, params, _ = _attention(name)
    xm, _ = _tokens(PADDINGS["right"], 12)
    jaxpr = jax.make_jaxpr(mj.maskify(fn))(params, xm)
    scores = [tuple(e.outvars[0].aval.shape) for e in jaxpr.jaxpr.eqns if e.primitive.name == "exp"]
    assert scores and primitive_count(jaxpr, "select_n", scores[0]) <= 1, "the softmax ran op by op"
    size = int(np.prod(scores[0]))
    layouts = {tuple(e.outvars[0].aval.shape) for e in jaxpr.jaxpr.eqns if e.outvars}
    assert sum(primitive_count(jaxpr, "select_n", t) for t in layouts if int(np.prod(t)) == size) <= 1
    assert primitive_count(jaxpr, "cond") == 0, "weights times values took the conditional exact rule"


@pytest.mark.parametrize("causal", [False, True])
def test_maskified_attention_lowered_for_cuda_is_cudnn_flash_attention(causal, monkeypatch):
    """``jax.nn.dot_product_attention(..., implementation="cudnn")`` on projections of a padded
    bfloat16 batch, maskify'd and lowered for CUDA: one cuDNN fused attention call and no T x S
    array (the padding went as lengths), causal self-attention included (the queries' and keys'
    masks are known to be one)."""
    from harness import answer_cudnn_probes_as_an_h100, cuda_squares

    answer_cudnn_probes_as_an_h100(monkeypatch)
    length = 200  # not a multiple of the features, so a T x S tensor is one
    x = jnp.zeros((2, length, 32), jnp.bfloat16)
    tokens = jnp.arange(length)[None] < jnp.array([length, 100])[:, None]
    ws = [jnp.zeros((32, n * 64), jnp.bfloat16) for n in (4, 2, 2)]

    def attend(ws, v):
        b, n, _ = v.shape
        q, k, w = ((v @ p).reshape(b, n, -1, 64) for p in ws)
        return jax.nn.dot_product_attention(q, k, w, is_causal=causal, implementation="cudnn")

    lowered = jax.jit(mj.maskify(attend)).trace(ws, mj.masked_array(x, tokens[:, :, None]))
    text = lowered.lower(lowering_platforms=("cuda",)).as_text()
    assert "__cudnn$fmhaSoftmax" in text
    assert not cuda_squares(text, length)


def test_attention_calls_are_told_apart_and_their_intermediates_keep_them_op_by_op(monkeypatch):
    """Two calls on one line (a loop over layers) are two calls; a call whose intermediate value is
    read after it (the weights, sown by flax) is not taken, and still equals the unpadded runs."""
    from masked_jax._maskify import _calls

    valid = PADDINGS["holes"]
    xm, x = _tokens(valid, 5)
    fn, params, _ = _attention("jax")

    def two_layers(p, v):
        for _ in range(2):
            v = v + fn(p, v).reshape(v.shape[0], v.shape[1], -1)[..., : v.shape[-1]]
        return v

    calls = _calls.library_calls(jax.make_jaxpr(two_layers)(params, jnp.asarray(x)).jaxpr)
    assert len(calls) == 2 and all(c.kwargs == {"scale": None, "is_causal": False} for c in calls.values())
    out = jax.jit(mj.maskify(two_layers))(params, xm)
    for b in range(B):
        _close(out.data[b, valid[b]], two_layers(params, jnp.asarray(x[b : b + 1, valid[b]]))[0], f"sequence {b}")

    module = nn.MultiHeadDotProductAttention(num_heads=HEADS, qkv_features=HEADS * DEPTH)
    p = module.init(jax.random.key(0), jnp.zeros((1, L, D)))

    def sown(p, v):
        out, state = module.apply(p, v, sow_weights=True, mutable=["intermediates"])
        return out, jax.tree.leaves(state)[0]  # the attention weights

    f = mj.maskify(sown)
    monkeypatch.setattr(mj.nn, "dot_product_attention", None)  # not called
    out, weights = f(p, xm)
    for b in range(B):
        keep = valid[b]
        _close(out.data[b, keep], module.apply(p, jnp.asarray(x[b : b + 1, keep]))[0], f"sown: sequence {b}")
        _close(weights.data[b][:, keep][:, :, keep], sown(p, jnp.asarray(x[b : b + 1, keep]))[1][0], "weights")


def test_a_scan_body_that_mixes_rows_reads_only_the_valid_rows():
    """A step that reads across the batch (each row adds the mean of the step's rows) cannot take
    the whole-row fast path: a valid row would read the padded rows. The mean is over the step's
    valid rows, and a padded row's carry is left as it was (a reference written step by step)."""
    valid = PADDINGS["holes"]
    xm, x = _tokens(valid, 13)
    w = jnp.asarray(np.random.default_rng(4).normal(size=(D, D)) * 0.5, jnp.float32)

    def run(v):
        def step(h, xt):
            h = jnp.tanh(xt @ w + h) + jnp.mean(xt, axis=0)
            return h, h

        return jax.lax.scan(step, jnp.zeros((v.shape[0], D), v.dtype), jnp.swapaxes(v, 0, 1))[0]

    h = np.zeros((B, D), np.float32)
    for t in range(L):
        rows = valid[:, t]
        if rows.any():
            new = np.tanh(x[:, t] @ np.asarray(w) + h) + x[rows, t].mean(0)
            h = np.where(rows[:, None], new, h)
    for label, fn in (("eager", mj.maskify(run)), ("jit", jax.jit(mj.maskify(run)))):
        _close(fn(xm).data, h, label)
