"""``maskify``'s id spaces: segment and scatter results against each graph (each example) run alone.

A ``segment_*`` or scatter result's axis is the space its ids index. A slot no valid update
reached holds the reduction's identity; it is valid where the space's own entries are valid (a
real node with no incoming edge) and masked where they are padding, and gathers, reshapes, rolls,
casts and whole-call readers carry it with the data.

* **Graph networks** (GATv2 without self loops, as jraph's GAT: a segment softmax over the
  incoming edges, then a bias; GCN with degrees from ``segment_sum(ones_like(w), rcv)`` and from
  ``jnp.bincount(rcv).astype(float)``), with the padded edges given four ways: ids as
  MaskedArrays holding 0 or out-of-range junk, plain ids pointing at a padding node, plain ids
  filled with 0 beside masked edge weights. Every graph has isolated valid nodes and padding
  nodes. Vmapped over the graphs, and as one batch of flattened graphs read out by
  ``reshape(G, N, F).mean(1)``.
* **Small forms**: a segment result read by ``jnp.sort``, softmaxes, a weighted average, a
  reduction; gathered back by other ids; cast; rolled and reshaped; ``.at[].set``; stacked.
* **Counts of constants**: ``x.sum(1) / jnp.ones_like(x).sum(1)`` and ``jnp.stack`` beside padded
  tokens.

Values, masks and parameter gradients are checked, eagerly and under ``jit``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import masked_jax as mj

TOL = 1e-5
N, E, F = 6, 7, 3
# per graph: its node count and edges (sender, receiver); nodes N - 1 and up are padding. Graph 0's
# nodes 0, 3 and 4, graph 1's node 2 and graph 2's node 3 receive nothing (isolated valid nodes).
GRAPHS = [(5, [(0, 1), (1, 2), (2, 1), (3, 1)]), (3, [(0, 1), (1, 0)]), (4, [(2, 0), (0, 2), (0, 1)])]
G = len(GRAPHS)
# how the padded edges are given: what the padded ids hold, and whether the ids or the weights are masked
EDGES = {
    "zero-filled": (0, "ids"),
    "junk-ids": (N + 3, "ids"),
    "padding-node": (N - 1, None),
    "masked-weights": (0, "weights"),
}


def _close(got, want, what):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=TOL, atol=TOL, err_msg=what)


def _graphs(edges, seed=0):
    """The padded graphs ``(h, senders, receivers, weights)`` (NaN in the padded nodes' features
    and the padded weights), and each graph alone."""
    rng = np.random.default_rng(seed)
    h = rng.normal(size=(G, N, F)).astype(np.float32)
    w = rng.uniform(0.5, 1.5, size=(G, E)).astype(np.float32)
    pad, masked = EDGES[edges]
    s, r = np.full((G, E), pad, np.int32), np.full((G, E), pad, np.int32)
    em = np.zeros((G, E), bool)
    for b, (_, es) in enumerate(GRAPHS):
        for k, (a, c) in enumerate(es):
            s[b, k], r[b, k], em[b, k] = a, c, True
    nm = np.arange(N)[None] < np.array([n for n, _ in GRAPHS])[:, None]
    hm = mj.masked_array(jnp.asarray(np.where(nm[..., None], h, np.nan)), jnp.asarray(nm[..., None]))
    sm, rm = jnp.asarray(s), jnp.asarray(r)
    if masked == "ids":
        sm, rm = mj.masked_array(sm, jnp.asarray(em)), mj.masked_array(rm, jnp.asarray(em))
    wm = jnp.asarray(np.where(em, w, 7.0))
    if masked == "weights":
        wm = mj.masked_array(jnp.asarray(np.where(em, w, np.nan)), jnp.asarray(em))
    alone = [
        (
            jnp.asarray(h[b, :n]),
            jnp.asarray(s[b, : len(es)]),
            jnp.asarray(r[b, : len(es)]),
            jnp.asarray(w[b, : len(es)]),
        )
        for b, (n, es) in enumerate(GRAPHS)
    ]
    return (hm, sm, rm, wm), alone


def _gatv2(p, h, s, r, w):
    """jraph's GAT with GATv2 logits and no self loops: a softmax over each node's incoming edges
    (``segment_max``, ``exp``, ``segment_sum``, gathered back by the receivers), then a bias."""
    n = h.shape[0]
    q = h @ p["q"]
    logits = jax.nn.leaky_relu(q[s] + q[r] + w[:, None] * p["e"], 0.2) @ p["a"]
    top = jax.ops.segment_max(logits, r, n)
    ex = jnp.exp(logits - top[r])
    attention = ex / jax.ops.segment_sum(ex, r, n)[r]
    out = jax.ops.segment_sum(q[s] * attention[:, None], r, n) + p["b"]
    return out, out.mean(0)


def _gcn(p, h, s, r, w, degree):
    """GCN with symmetric normalisation by the receivers' degrees (no self loops)."""
    n = h.shape[0]
    if degree == "segment_sum":
        deg = jax.ops.segment_sum(jnp.ones_like(w), r, n)
    else:
        deg = jnp.bincount(r, length=n).astype(float)
    norm = jax.lax.rsqrt(jnp.maximum(deg, 1.0))
    msg = (h @ p["q"])[s] * (norm[s] * norm[r] * w)[:, None]
    out = jax.nn.relu(jax.ops.segment_sum(msg, r, n) @ p["a2"] + p["b"])
    return out, out.mean(0)


MODELS = {
    "gatv2": _gatv2,
    "gcn-segment-sum": functools.partial(_gcn, degree="segment_sum"),
    "gcn-bincount": functools.partial(_gcn, degree="bincount"),
}
QUICK = {
    ("gatv2", "junk-ids"),
    ("gatv2", "masked-weights"),
    ("gcn-segment-sum", "masked-weights"),
    ("gcn-bincount", "zero-filled"),
}
CASES = [
    pytest.param(model, edges, marks=() if (model, edges) in QUICK else pytest.mark.slow, id=f"{model}-{edges}")
    for model in MODELS
    for edges in EDGES
]


def _params(seed=1):
    rng = np.random.default_rng(seed)
    shapes = {"q": (F, F), "a": (F,), "e": (F,), "a2": (F, F), "b": (F,)}
    return {k: jnp.asarray(rng.normal(size=s), jnp.float32) for k, s in shapes.items()}


def _check_gradients(masked_loss, ref_loss, params):
    want = jax.grad(ref_loss)(params)
    for label, grad in (("eager", jax.grad(masked_loss)), ("jit", jax.jit(jax.grad(masked_loss)))):
        got = grad(params)
        assert all(bool(jnp.isfinite(g).all()) for g in jax.tree.leaves(got)), f"{label}: NaN in the gradients"
        jax.tree.map(lambda a, b, label=label: _close(a, b, f"{label}: parameter gradient"), got, want)


@pytest.mark.parametrize("model,edges", CASES)
def test_graph_networks_equal_each_graph_alone(model, edges):
    params, fn = _params(), MODELS[model]
    masked, alone = _graphs(edges)

    def apply(p, *graph):
        return jax.vmap(lambda *one: fn(p, *one))(*graph)

    refs = [fn(params, *g) for g in alone]
    for label, f in (("eager", mj.maskify(apply)), ("jit", jax.jit(mj.maskify(apply)))):
        nodes, pooled = f(params, *masked)
        for b, (n, _) in enumerate(GRAPHS):  # isolated valid nodes valid, padding nodes masked
            np.testing.assert_array_equal(np.asarray(nodes.mask[b, :, 0]), np.arange(N) < n, f"{label} graph {b}")
            _close(nodes.data[b, :n], refs[b][0], f"{label}: nodes of graph {b}")
        assert bool(jnp.all(pooled.mask)), label
        _close(pooled.data, jnp.stack([ref[1] for ref in refs]), f"{label}: readout")
    _check_gradients(
        lambda p: jnp.sum(mj.maskify(apply)(p, *masked)[1].data),
        lambda p: sum(jnp.sum(fn(p, *g)[1]) for g in alone),
        params,
    )


def _flattened(edges):
    """The graphs of :func:`_graphs` as one graph of G * N nodes, the ids offset per graph."""
    (hm, sm, rm, wm), alone = _graphs(edges)
    offset = (jnp.arange(G) * N)[:, None]

    def flat(x, shift=0):
        if isinstance(x, mj.MaskedArray):
            return mj.masked_array(jnp.reshape(x.data + shift, (-1,)), jnp.reshape(x.mask, (-1,)))
        return jnp.reshape(x + shift, (-1,))

    h = mj.masked_array(jnp.reshape(hm.data, (G * N, F)), jnp.reshape(hm.compact_mask, (G * N, 1)))
    return (h, flat(sm, offset), flat(rm, offset), flat(wm)), alone


FLAT_QUICK = {("gatv2", "zero-filled"), ("gcn-segment-sum", "masked-weights")}


@pytest.mark.parametrize(
    "model,edges",
    [
        pytest.param(m, e, marks=() if (m, e) in FLAT_QUICK else pytest.mark.slow, id=f"{m}-{e}")
        for m in MODELS
        for e in EDGES
    ],
)
def test_a_batch_of_flattened_graphs_read_out_by_reshape_equals_each_graph_alone(model, edges):
    params, fn = _params(), MODELS[model]
    masked, alone = _flattened(edges)

    def readout(p, *graph):  # the usual batched-graph readout: padded nodes must not count
        return fn(p, *graph)[0].reshape(G, N, F).mean(1)

    want = jnp.stack([fn(params, *g)[1] for g in alone])
    for label, f in (("eager", mj.maskify(readout)), ("jit", jax.jit(mj.maskify(readout)))):
        got = f(params, *masked)
        assert bool(jnp.all(got.mask)), label
        _close(got.data, want, label)
    _check_gradients(
        lambda p: jnp.sum(mj.maskify(readout)(p, *masked).data),
        lambda p: sum(jnp.sum(fn(p, *g)[1]) for g in alone),
        params,
    )


# -- small forms ---------------------------------------------------------------------------------
# one graph of 4 nodes (node 3 padding) and 4 edges (the last padded, pointing at node 3 and
# masked by its value); node 1 is valid and receives nothing
H = np.array([1.0, 2.0, 3.0, np.nan], np.float32)
V = np.array([1.0, 2.0, 3.0, np.nan], np.float32)
SND, RCV = np.array([1, 2, 1, 3], np.int32), np.array([0, 0, 2, 3], np.int32)
VALID = np.array([True, True, True, False])


def _segments(h, v, r):
    return jax.ops.segment_sum(v * h[r], r, h.shape[0])


FORMS = {  # each reads a segment result whose slot 1 no valid edge reached
    "sort": lambda h, v, s, r: jnp.sort(_segments(h, v, r)),
    "softmax": lambda h, v, s, r: jax.nn.softmax(_segments(h, v, r)),
    "log-softmax": lambda h, v, s, r: jax.nn.log_softmax(_segments(h, v, r)),
    "weighted-average": lambda h, v, s, r: jnp.average(_segments(h, v, r), weights=h * h),
    "mean": lambda h, v, s, r: jnp.mean(_segments(h, v, r)),
    "max": lambda h, v, s, r: jnp.min(jax.ops.segment_max(v * h[r], r, h.shape[0])),
    "cumsum": lambda h, v, s, r: jnp.cumsum(_segments(h, v, r)),
    # gathered back by other ids: the senders' in-degrees (node 1 sends and receives nothing)
    "gathered": lambda h, v, s, r: v * jax.ops.segment_sum(jnp.ones_like(v), r, h.shape[0])[s],
    "gathered-plain": lambda h, v, s, r: h[s] * jax.ops.segment_sum(jnp.ones(s.shape), r, h.shape[0])[s],
    "cast": lambda h, v, s, r: _segments(h, v, r).astype(jnp.float16).astype(jnp.float32),
    "bincount": lambda h, v, s, r: jnp.sort(jnp.bincount(r, length=h.shape[0]).astype(float) * h),
    "at-set": lambda h, v, s, r: jnp.sort(
        jnp.zeros(h.shape[0]).at[jnp.array([2, 0])].set(v[:2]).astype(jnp.float16) + h
    ),
    "argsort": lambda h, v, s, r: jnp.argsort(_segments(h, v, r)),
    "stack": lambda h, v, s, r: jnp.mean(jnp.stack([_segments(h, v, r), jnp.ones_like(h)], -1) @ jnp.ones(2)),
}


@pytest.mark.parametrize("ids", ["plain", "masked"])
@pytest.mark.parametrize("form", sorted(FORMS))
def test_a_segment_result_read_by_other_operations_equals_the_unpadded_run(form, ids):
    fn = FORMS[form]
    h = mj.masked_array(jnp.asarray(H), jnp.asarray(VALID))
    v = mj.masked_array(jnp.asarray(V), jnp.asarray(VALID))
    s, r = jnp.asarray(SND), jnp.asarray(RCV)
    if ids == "masked":
        s, r = mj.masked_array(s, jnp.asarray(VALID)), mj.masked_array(r, jnp.asarray(VALID))
    want = np.asarray(fn(*(jnp.asarray(a[:3]) for a in (H, V, SND, RCV))), np.float64)
    for label, f in (("eager", mj.maskify(fn)), ("jit", jax.jit(mj.maskify(fn)))):
        got = f(h, v, s, r)
        data = np.asarray(got.data if isinstance(got, mj.MaskedArray) else got, np.float64)
        if np.ndim(want) == 0:
            assert not isinstance(got, mj.MaskedArray) or bool(got.mask), label
            _close(data, want, label)
            continue
        k = want.shape[0]  # the valid entries first (sorts put the masked last); the rest masked
        if isinstance(got, mj.MaskedArray):
            np.testing.assert_array_equal(np.asarray(got.mask), np.arange(len(data)) < k, label)
        _close(data[:k], want, label)


def test_segment_slots_with_no_array_of_their_space_in_sight_are_masked():
    v = mj.masked_array(jnp.array([1.0, 2.0, 3.0, 4.0]), jnp.array([True, True, True, False]))
    ids = jnp.array([0, 0, 3, 1])  # segment 1 gets a masked term only, segment 2 nothing
    for fn in (
        jax.jit(mj.maskify(lambda x: jnp.sort(jax.ops.segment_sum(x, ids, 4)))),
        mj.maskify(lambda x: jnp.sort(jax.ops.segment_sum(x, ids, 4))),
    ):
        got = fn(v)
        np.testing.assert_array_equal(np.asarray(got.mask), [True, True, False, False])
        np.testing.assert_array_equal(np.asarray(got.data[:2]), [3.0, 3.0])
    got = mj.maskify(lambda x: jax.ops.segment_sum(x, ids, 4).astype(jnp.float16))(v)
    np.testing.assert_array_equal(np.asarray(got.mask), [True, False, False, True])
    got = mj.maskify(lambda i: jnp.bincount(i, length=4).astype(float))(
        mj.masked_array(ids, jnp.array([1, 1, 1, 0], bool))
    )
    np.testing.assert_array_equal(np.asarray(got.mask), [True, False, False, True])
    np.testing.assert_array_equal(np.asarray(got.filled(0)), [2.0, 0.0, 0.0, 1.0])


def test_node_features_masked_entry_by_entry_name_their_nodes():
    # the node mask stored at the features' shape (4, 2), not compact (4, 1): node 1 is isolated
    h = np.array([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0], [np.nan, np.nan]], np.float32)
    valid = np.array([True, True, True, False])[:, None] & np.ones((1, 2), bool)
    hm = mj.masked_array(jnp.asarray(h), jnp.asarray(valid))
    r = jnp.array([0, 0, 2, 3])  # the last edge points at the padding node
    fn = lambda x: jnp.mean(jax.ops.segment_sum(x[r], r, x.shape[0]), axis=0)
    want = fn(jnp.asarray(h[:3]))  # (the padded edge reads a padded row: dropped)
    for label, f in (("eager", mj.maskify(fn)), ("jit", jax.jit(mj.maskify(fn)))):
        got = f(hm)
        assert bool(jnp.all(got.mask)), label
        _close(got.data, want, label)
    # ids shared by every example of a vmap: a node is valid where it is valid in every example
    two = mj.masked_array(jnp.stack([hm.data, hm.data]), jnp.stack([valid, valid & (np.arange(4) < 2)[:, None]]))
    got = mj.maskify(jax.vmap(lambda x: jax.ops.segment_sum(x[r], r, 4)))(two)
    np.testing.assert_array_equal(np.asarray(got.mask[:, :, 0]), [[1, 1, 1, 0], [1, 1, 0, 0]])


def test_a_reshape_and_a_roll_carry_unreached_slots_with_the_data():
    # two graphs of 3 nodes flattened; the second's node 2 is padding; nodes 1, 2 and 4 receive nothing
    h = mj.masked_array(jnp.array([1.0, 2.0, 3.0, 4.0, 5.0, jnp.nan]), jnp.array([1, 1, 1, 1, 1, 0], bool))
    r = jnp.array([0, 0, 3, 3])
    seg = lambda x: jax.ops.segment_sum(x[r], r, 6)
    ids = jnp.array([[0, 0], [0, 0]])  # (each graph its own ids)
    graphs = lambda x: jax.vmap(lambda a, i: jax.ops.segment_sum(a[i], i, 3))(x.reshape(2, 3), ids)
    for label, f in (("eager", mj.maskify), ("jit", lambda g: jax.jit(mj.maskify(g)))):
        split = f(lambda x: seg(x).reshape(2, 3).mean(1))(h)  # each graph's mean over its nodes
        np.testing.assert_array_equal(np.asarray(split.mask), [True, True], label)
        _close(split.data, [2.0 / 3.0, 4.0], label)
        merged = f(lambda x: graphs(x).reshape(6))(h)
        np.testing.assert_array_equal(np.asarray(merged.mask), [1, 1, 1, 1, 1, 0], label)
        _close(merged.data[:5], [2.0, 0.0, 0.0, 8.0, 0.0], label)
        rolled = f(lambda x: jnp.roll(seg(x)[:3], 1) + x[:3])(h)  # (within the first graph: no padding)
        np.testing.assert_array_equal(np.asarray(rolled.mask), [True] * 3, label)
        _close(rolled.data, [1.0, 4.0, 3.0], label)


def test_a_count_of_constants_beside_masked_weights_counts_the_valid_edges():
    # plain ids filled with 0 at the padded edges: only the weights say they are padding
    w = mj.masked_array(jnp.array([0.5, 2.0, 1.0, jnp.nan, jnp.nan]), jnp.array([1, 1, 1, 0, 0], bool))
    h = mj.masked_array(jnp.array([1.0, 2.0, 3.0]), jnp.ones(3, bool))
    s, r = jnp.array([1, 2, 0, 0, 0]), jnp.array([0, 0, 1, 0, 0])

    def mean_message(h, s, r, w):  # a mean over each node's incoming edges, by hand
        deg = jax.ops.segment_sum(jnp.ones_like(w), r, 3)
        return h + jax.ops.segment_sum(h[s] * w, r, 3) / jnp.maximum(deg, 1.0)

    want = mean_message(h.data, s[:3], r[:3], w.data[:3])
    for label, f in (("eager", mj.maskify(mean_message)), ("jit", jax.jit(mj.maskify(mean_message)))):
        got = f(h, s, r, w)
        np.testing.assert_array_equal(np.asarray(got.mask), [True, True, True], label)
        _close(got.data, want, label)


# -- constants beside padded tokens ------------------------------------------------------------------
B, L, D = 3, 5, 4
TOKENS = np.array([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [0, 1, 1, 0, 1]], bool)
TOKEN_FORMS = {
    "stack-after-a-dense-layer": lambda w, v: jnp.mean(jnp.stack([v @ w, jnp.ones_like(v @ w)], -1) @ jnp.ones(2), 1),
    "sum-over-a-count-of-ones": lambda w, v: (v @ w).sum(1) / jnp.ones_like(v @ w).sum(1),
}


@pytest.mark.parametrize("form", sorted(TOKEN_FORMS))
def test_constants_beside_padded_tokens_follow_the_unpadded_example(form):
    fn = TOKEN_FORMS[form]
    x = np.random.default_rng(4).normal(size=(B, L, D)).astype(np.float32)
    xm = mj.masked_array(jnp.asarray(np.where(TOKENS[..., None], x, np.nan)), jnp.asarray(TOKENS[..., None]))
    w = jnp.asarray(np.random.default_rng(5).normal(size=(D, D)), jnp.float32)
    alone = [jnp.asarray(x[b, TOKENS[b]]) for b in range(B)]
    want = jnp.stack([fn(w, a[None])[0] for a in alone])
    for label, f in (("eager", mj.maskify(fn)), ("jit", jax.jit(mj.maskify(fn)))):
        got = f(w, xm)
        assert bool(jnp.all(got.mask)), label
        _close(got.data, want, label)
    got = jax.jit(jax.grad(lambda q: jnp.sum(mj.maskify(fn)(q, xm).data)))(w)
    _close(got, jax.grad(lambda q: sum(jnp.sum(fn(q, a[None])) for a in alone))(w), "gradient")
