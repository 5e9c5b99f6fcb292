"""The newer model families of ``maskify_models.py``, each written once for unpadded arrays and once
with the masks an expert places by hand:

* **selective SSM**: gates ``a = sigmoid(.)``, inputs ``b``, the recurrence ``h_t = a_t h_{t-1} + b_t``
  by ``lax.scan`` or by ``lax.associative_scan``, a SiLU gate, a mean pool. By hand: zeroed input,
  ``a = 1, b = 0`` on the padding (the carry passes through), a masked mean.
* **causal dilated CNN**: flax ``nn.Conv(padding="CAUSAL")`` with dilations 1, 2, 4, 8 and
  residuals, a mean pool. By hand: zeroed input and a masked mean (a causal convolution never reads
  the right padding).
* **nnx BiLSTM tagger**: ``nnx.Bidirectional`` of two ``nnx.RNN(LSTMCell)``, a tag per token, the
  token-level cross entropy. By hand: ``seq_lengths`` and a masked mean of the losses.
* **decoder training**: a causal pre-norm transformer with learned positions
  ``pos[arange(L)]``, a next-tag loss per token. By hand: the causal mask combined with the padding
  mask, a masked mean of the losses.
* **KV-cache generation**: greedy decoding of ``GEN_STEPS`` tokens with a KV cache from left-padded
  prompts, positions ``arange(P)`` then ``P + t``. By hand: each prompt's positions counted from its
  first token, the padding masked out of the attention and the cache.
* **GATv2**: a softmax over each node's incoming edges (``segment_max``, ``exp``, ``segment_sum``).
  By hand: padded edges' logits at ``-inf`` and their messages at zero, a masked mean over nodes.
* **MoE routing**: the batch's tokens flattened and routed top-1 to ``EXPERTS`` experts with a
  capacity (position in the expert by ``cumsum``, a dispatch tensor). By hand: padded tokens take no
  capacity, a masked mean.

``family(name, b, length, features)`` returns ``{"hand-masked": Entry, "maskify": Entry}``.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax import lax

import masked_jax as mj

D_MODEL, HEADS, CLASSES, LAYERS = 128, 4, 10, 2
GEN_STEPS, VOCAB, MAX_POS, EXPERTS = 16, 256, 512, 8


class Entry(NamedTuple):
    """A version of a model: ``step(*args)`` is the jitted step (``donate`` its donated arguments: the
    parameters and optimizer state of a train step), ``forward(*fargs)`` the eager first call."""

    step: Any
    args: tuple
    donate: tuple
    forward: Any
    fargs: tuple


def _masked_mean(h, tokens):
    w = tokens[..., None].astype(h.dtype)
    return jnp.sum(h * w, axis=1) / jnp.maximum(jnp.sum(w, axis=1), 1.0)


def _pool(h, tokens):
    return jnp.mean(h, axis=1) if tokens is None else _masked_mean(h, tokens)


class SSM(nn.Module):
    assoc: bool = True

    @nn.compact
    def __call__(self, x, tokens=None):
        if tokens is not None:
            x = jnp.where(tokens[..., None], x, 0.0)
        h = nn.Dense(D_MODEL)(x)
        a, b = jax.nn.sigmoid(nn.Dense(D_MODEL)(h)), nn.Dense(D_MODEL)(h)
        if tokens is not None:
            a, b = jnp.where(tokens[..., None], a, 1.0), jnp.where(tokens[..., None], b, 0.0)
        if self.assoc:
            hs = lax.associative_scan(lambda u, v: (v[0] * u[0], v[0] * u[1] + v[1]), (a, b), axis=1)[1]
        else:

            def step(c, ab):
                c = ab[0] * c + ab[1]
                return c, c

            _, hs = lax.scan(step, jnp.zeros_like(a[:, 0]), (jnp.swapaxes(a, 0, 1), jnp.swapaxes(b, 0, 1)))
            hs = jnp.swapaxes(hs, 0, 1)
        y = nn.Dense(D_MODEL)(hs * nn.silu(h))
        return nn.Dense(CLASSES)(_pool(y, tokens))


class CausalCNN(nn.Module):
    @nn.compact
    def __call__(self, x, tokens=None):
        if tokens is not None:
            x = jnp.where(tokens[..., None], x, 0.0)
        h = nn.Dense(D_MODEL)(x)
        for d in (1, 2, 4, 8):
            h = h + nn.relu(nn.Conv(D_MODEL, (3,), padding="CAUSAL", kernel_dilation=(d,))(h))
        return nn.Dense(CLASSES)(_pool(h, tokens))


class _DecoderBlock(nn.Module):
    @nn.compact
    def __call__(self, x, mask):
        h = nn.LayerNorm()(x)
        x = x + nn.MultiHeadDotProductAttention(num_heads=HEADS, qkv_features=D_MODEL)(h, mask=mask)
        return x + nn.Dense(D_MODEL)(nn.gelu(nn.Dense(2 * D_MODEL)(nn.LayerNorm()(x))))


class Decoder(nn.Module):
    """Per-token logits of a causal transformer with learned positions ``pos[arange(L)]``."""

    @nn.compact
    def __call__(self, x, tokens=None):
        if tokens is not None:
            x = jnp.where(tokens[..., None], x, 0.0)
        length = x.shape[1]
        pos = self.param("pos", nn.initializers.normal(0.02), (MAX_POS, D_MODEL))
        h = nn.Dense(D_MODEL)(x) + pos[jnp.arange(length)]
        mask = nn.make_causal_mask(x[..., 0])
        if tokens is not None:
            mask = nn.combine_masks(mask, nn.make_attention_mask(tokens, tokens))
        for _ in range(LAYERS):
            h = _DecoderBlock()(h, mask)
        return nn.Dense(CLASSES)(nn.LayerNorm()(h))


def _token_loss(logits, labels, tokens=None):
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    if tokens is None:
        return ce.mean()
    return jnp.sum(jnp.where(tokens, ce, 0.0)) / jnp.maximum(jnp.sum(tokens), 1)


def _train_entries(apply_plain, apply_hand, params, labels, masked, hand, per_token=False):
    """The train steps (loss, gradients, an ``optax.adam`` update) of both versions. ``per_token``:
    the loss is the cross entropy of every token's logits; maskify'd whole, its mean is over the
    valid tokens."""
    opt = optax.adam(1e-3)

    if per_token:

        def hand_loss(p, labels, *inputs):
            return _token_loss(apply_hand(p, *inputs), labels, tokens=inputs[-1])

        def plain_loss(p, labels, *inputs):
            return _token_loss(apply_plain(p, *inputs), labels)

        def mask_loss(p, labels, *inputs):
            return mj.maskify(plain_loss)(p, labels, *inputs).data
    else:

        def hand_loss(p, labels, *inputs):
            return optax.softmax_cross_entropy_with_integer_labels(apply_hand(p, *inputs), labels).mean()

        def mask_loss(p, labels, *inputs):
            logits = mj.maskify(apply_plain)(p, *inputs)
            logits = logits.data if isinstance(logits, mj.MaskedArray) else logits
            return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

    def stepper(loss):
        def step(p, s, *batch):
            value, g = jax.value_and_grad(loss)(p, *batch)
            updates, s = opt.update(g, s, p)
            return optax.apply_updates(p, updates), s, value

        return step

    state = opt.init(params)
    return {
        "hand-masked": Entry(stepper(hand_loss), (params, state, labels, *hand), (0, 1), apply_hand, (params, *hand)),
        "maskify": Entry(
            stepper(mask_loss), (params, state, labels, *masked), (0, 1), mj.maskify(apply_plain), (params, *masked)
        ),
    }


def _linen(model, x, tokens, labels, features, per_token=False):
    params = model.init(jax.random.key(0), jnp.zeros((1, 4, features)))
    return _train_entries(
        lambda p, v: model.apply(p, v),
        lambda p, v, t: model.apply(p, v, t),
        params,
        labels,
        (mj.masked_array(x, tokens[..., None]),),
        (x, tokens),
        per_token,
    )


def _bilstm(x, tokens, tag_labels, features):
    rngs = nnx.Rngs(0)
    model = nnx.Sequential(
        nnx.Bidirectional(
            nnx.RNN(nnx.LSTMCell(features, D_MODEL // 2, rngs=rngs)),
            nnx.RNN(nnx.LSTMCell(features, D_MODEL // 2, rngs=rngs)),
        ),
        nnx.Linear(D_MODEL, CLASSES, rngs=rngs),
    )
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)  # the gradients are the parameters'

    def tag(p, v, seq_lengths=None):  # zero initial carries (c, h) for both directions
        m = nnx.merge(graphdef, p, rest)
        z = jnp.zeros((v.shape[0], D_MODEL // 2), v.dtype)
        return m.layers[1](m.layers[0](v, initial_carry=((z, z), (z, z)), seq_lengths=seq_lengths))

    def plain(p, v):
        return tag(p, v)

    def hand(p, v, t):
        return tag(p, jnp.where(t[..., None], v, 0.0), jnp.sum(t, axis=1))

    return _train_entries(
        plain, hand, params, tag_labels, (mj.masked_array(x, tokens[..., None]),), (x, tokens), per_token=True
    )


# -- KV-cache generation on left-padded prompts -------------------------------------------------------------
def _decoder_params(seed=1):
    rng = np.random.default_rng(seed)
    shapes = {
        "emb": (VOCAB, D_MODEL),
        "pos": (MAX_POS, D_MODEL),
        "wq": (D_MODEL, D_MODEL),
        "wk": (D_MODEL, D_MODEL),
        "wv": (D_MODEL, D_MODEL),
        "wo": (D_MODEL, VOCAB),
    }
    return {k: jnp.asarray(rng.normal(size=s).astype(np.float32) / math.sqrt(s[0])) for k, s in shapes.items()}


def _attend(q, k, v, allowed):
    s = jnp.where(allowed, jnp.einsum("bqd,bkd->bqk", q, k) / math.sqrt(D_MODEL), -jnp.inf)
    return jnp.einsum("bqk,bkd->bqd", jax.nn.softmax(s, -1), v)


def generate(p, prompt):
    """Greedy generation with a KV cache, written for unpadded prompts (B, P) of token ids: the
    prompt's positions are ``arange(P)``, generated token ``t``'s is ``P + t``."""
    batch, length = prompt.shape
    x = p["emb"][prompt] + p["pos"][jnp.arange(length)]
    q, k, v = x @ p["wq"], x @ p["wk"], x @ p["wv"]
    h = _attend(q, k, v, jnp.tril(jnp.ones((length, length), bool)))
    first = jnp.argmax(h[:, -1] @ p["wo"], -1)
    keys = jnp.zeros((batch, length + GEN_STEPS, D_MODEL), k.dtype).at[:, :length].set(k)
    values = jnp.zeros((batch, length + GEN_STEPS, D_MODEL), v.dtype).at[:, :length].set(v)

    def step(carry, t):
        keys, values, tok = carry
        pos = length + t
        xt = p["emb"][tok] + p["pos"][pos]
        keys = lax.dynamic_update_slice(keys, (xt @ p["wk"])[:, None], (0, pos, 0))
        values = lax.dynamic_update_slice(values, (xt @ p["wv"])[:, None], (0, pos, 0))
        st = jnp.einsum("bd,bsd->bs", xt @ p["wq"], keys) / math.sqrt(D_MODEL)
        st = jnp.where(jnp.arange(length + GEN_STEPS) <= pos, st, -jnp.inf)
        nxt = jnp.argmax(jnp.einsum("bs,bsd->bd", jax.nn.softmax(st, -1), values) @ p["wo"], -1)
        return (keys, values, nxt), nxt

    _, toks = lax.scan(step, (keys, values, first), jnp.arange(GEN_STEPS))
    return jnp.concatenate([first[:, None], toks.T], 1)


def generate_by_hand(p, prompt, valid):
    """``generate`` on left-padded prompts, masked by hand: positions counted from each prompt's
    first token, the padding out of the attention and the cache (padded queries attend to
    themselves, so that no row is all ``-inf``)."""
    batch, length = prompt.shape
    pad = length - jnp.sum(valid, axis=1)
    positions = jnp.maximum(jnp.arange(length)[None] - pad[:, None], 0)
    x = p["emb"][prompt] + p["pos"][positions]
    q, k, v = x @ p["wq"], x @ p["wk"], x @ p["wv"]
    causal = jnp.tril(jnp.ones((length, length), bool))
    allowed = (causal & valid[:, None, :]) | (~valid[:, :, None] & jnp.eye(length, dtype=bool))
    h = _attend(q, k, v, allowed)
    first = jnp.argmax(h[:, -1] @ p["wo"], -1)
    keys = jnp.zeros((batch, length + GEN_STEPS, D_MODEL), k.dtype).at[:, :length].set(k)
    values = jnp.zeros((batch, length + GEN_STEPS, D_MODEL), v.dtype).at[:, :length].set(v)
    cache_valid = jnp.concatenate([valid, jnp.ones((batch, GEN_STEPS), bool)], 1)

    def step(carry, t):
        keys, values, tok = carry
        pos = length + t
        xt = p["emb"][tok] + p["pos"][length - pad + t]
        keys = lax.dynamic_update_slice(keys, (xt @ p["wk"])[:, None], (0, pos, 0))
        values = lax.dynamic_update_slice(values, (xt @ p["wv"])[:, None], (0, pos, 0))
        st = jnp.einsum("bd,bsd->bs", xt @ p["wq"], keys) / math.sqrt(D_MODEL)
        st = jnp.where((jnp.arange(length + GEN_STEPS) <= pos) & cache_valid, st, -jnp.inf)
        nxt = jnp.argmax(jnp.einsum("bs,bsd->bd", jax.nn.softmax(st, -1), values) @ p["wo"], -1)
        return (keys, values, nxt), nxt

    _, toks = lax.scan(step, (keys, values, first), jnp.arange(GEN_STEPS))
    return jnp.concatenate([first[:, None], toks.T], 1)


def _generation(b, length, seed=3):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, length + 1, size=b)
    valid = np.arange(length)[None, :] >= (length - lengths)[:, None]
    prompts = np.where(valid, rng.integers(0, VOCAB, size=(b, length)), 0).astype(np.int32)
    prompts, valid = jnp.asarray(prompts), jnp.asarray(valid)
    p = _decoder_params()
    pm = mj.masked_array(prompts, valid)

    def masked(p, pm):
        return mj.maskify(generate)(p, pm).data

    return {
        "hand-masked": Entry(generate_by_hand, (p, prompts, valid), (), generate_by_hand, (p, prompts, valid)),
        "maskify": Entry(masked, (p, pm), (), mj.maskify(generate), (p, pm)),
    }


# -- graphs -----------------------------------------------------------------------------------------------
def _gatv2_layer(p, h, s, r, edge_mask=None):
    n = h.shape[0]
    q = h @ p["q"]
    logits = jax.nn.leaky_relu(q[s] + q[r], 0.2) @ p["a"]
    if edge_mask is not None:
        logits = jnp.where(edge_mask, logits, -jnp.inf)
    top = jax.ops.segment_max(logits, r, n)
    ex = jnp.exp(logits - top[r])
    if edge_mask is not None:
        ex = jnp.where(edge_mask, ex, 0.0)
    attention = ex / jnp.maximum(jax.ops.segment_sum(ex, r, n)[r], 1e-30)
    return jax.nn.elu(jax.ops.segment_sum(q[s] * attention[:, None], r, n) + p["b"])


def _gatv2(b, nodes, edges, features, labels, seed=0):
    rng = np.random.default_rng(seed)
    n = rng.integers(nodes // 2, nodes + 1, size=b)
    e = rng.integers(edges // 2, edges + 1, size=b)
    node_mask = np.arange(nodes)[None, :] < n[:, None]
    edge_mask = np.arange(edges)[None, :] < e[:, None]
    s = np.where(edge_mask, rng.integers(0, nodes, (b, edges)) % n[:, None], 0).astype(np.int32)
    r = np.where(edge_mask, rng.integers(0, nodes, (b, edges)) % n[:, None], 0).astype(np.int32)
    h = np.where(node_mask[..., None], rng.normal(size=(b, nodes, features)), np.nan).astype(np.float32)
    h, s, r, node_mask, edge_mask = (jnp.asarray(a) for a in (h, s, r, node_mask, edge_mask))
    k = jax.random.split(jax.random.key(5), 6)
    params = {
        "embed": jax.random.normal(k[0], (features, D_MODEL)) / math.sqrt(features),
        "layers": [
            {
                "q": jax.random.normal(k[1 + i], (D_MODEL, D_MODEL)) / math.sqrt(D_MODEL),
                "a": jax.random.normal(k[3 + i], (D_MODEL,)) / math.sqrt(D_MODEL),
                "b": jnp.zeros((D_MODEL,)),
            }
            for i in range(2)
        ],
        "head": jax.random.normal(k[5], (D_MODEL, CLASSES)) / math.sqrt(D_MODEL),
    }

    def one(p, h, s, r, nm=None, em=None):
        if nm is not None:
            h = jnp.where(nm[:, None], h, 0.0)
        h = h @ p["embed"]
        for layer in p["layers"]:
            h = _gatv2_layer(layer, h, s, r, em)
        pooled = jnp.mean(h, 0) if nm is None else jnp.sum(jnp.where(nm[:, None], h, 0.0), 0) / jnp.sum(nm)
        return pooled @ p["head"]

    def plain(p, h, s, r):
        return jax.vmap(lambda a, b_, c: one(p, a, b_, c))(h, s, r)

    def hand(p, h, s, r, nm, em):
        return jax.vmap(lambda *a: one(p, *a))(h, s, r, nm, em)

    masked = (mj.masked_array(h, node_mask[..., None]), mj.masked_array(s, edge_mask), mj.masked_array(r, edge_mask))
    return _train_entries(plain, hand, params, labels, masked, (h, s, r, node_mask, edge_mask))


# -- MoE routing over the batch ---------------------------------------------------------------------------
class MoE(nn.Module):
    """An embedding, one top-1 mixture-of-experts MLP over the batch's tokens (flattened) with a
    capacity of 1.25 tokens per expert's share, a residual, a mean pool and a head."""

    @nn.compact
    def __call__(self, x, tokens=None):
        if tokens is not None:
            x = jnp.where(tokens[..., None], x, 0.0)
        b, length, _ = x.shape
        h = nn.Dense(D_MODEL)(x).reshape(b * length, D_MODEL)
        probs = jax.nn.softmax(nn.Dense(EXPERTS)(h), -1)
        expert = jnp.argmax(probs, -1)
        choice = jax.nn.one_hot(expert, EXPERTS, dtype=h.dtype)
        if tokens is not None:
            choice = choice * tokens.reshape(-1)[:, None]
        capacity = math.ceil(1.25 * b * length / EXPERTS)
        slot = jnp.cumsum(choice, axis=0) * choice - 1.0  # the token's place in its expert's queue
        dispatch = choice[..., None] * jax.nn.one_hot(slot, capacity, dtype=h.dtype)  # (N, E, C)
        gate = jnp.sum(probs * choice, -1)
        w1 = self.param("w1", nn.initializers.lecun_normal(), (EXPERTS, D_MODEL, 2 * D_MODEL))
        w2 = self.param("w2", nn.initializers.lecun_normal(), (EXPERTS, 2 * D_MODEL, D_MODEL))
        xe = jnp.einsum("nec,nd->ecd", dispatch, h)
        ye = jnp.einsum("ecf,efd->ecd", nn.gelu(jnp.einsum("ecd,edf->ecf", xe, w1)), w2)
        out = jnp.einsum("nec,ecd->nd", dispatch, ye) * gate[:, None]
        h = (h + out).reshape(b, length, D_MODEL)
        return nn.Dense(CLASSES)(_pool(h, tokens))


FAMILIES = (
    "selective SSM, scan",
    "selective SSM, associative_scan",
    "causal dilated CNN",
    "nnx BiLSTM tagger",
    "decoder training",
    "KV-cache generation",
    "GATv2",
    "MoE routing",
)


def family(name, x, tokens, labels, tag_labels, features):
    """``{version: Entry}`` of the family ``name`` on the padded batch ``x`` (B, L, F)."""
    b, length = tokens.shape
    if name.startswith("selective SSM"):
        return _linen(SSM(assoc="associative" in name), x, tokens, labels, features)
    if name == "causal dilated CNN":
        return _linen(CausalCNN(), x, tokens, labels, features)
    if name == "nnx BiLSTM tagger":
        return _bilstm(x, tokens, tag_labels, features)
    if name == "decoder training":
        return _linen(Decoder(), x, tokens, tag_labels, features, per_token=True)
    if name == "KV-cache generation":
        return _generation(b, length)
    if name == "GATv2":
        return _gatv2(b, length, 2 * length, features, labels)
    if name == "MoE routing":
        return _linen(MoE(), x, tokens, labels, features)
    raise ValueError(f"unknown model family {name!r}; expected one of {FAMILIES}")
