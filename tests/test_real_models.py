"""``maskify`` on real third-party modules (flax linen, flax nnx, equinox) over padded batches.

A batch holds sequences of lengths ``LENGTHS`` padded to ``L`` tokens, with NaN in the padding.
Each module runs once on the masked batch (eagerly and under ``jit``) and once per sequence on the
unpadded tokens alone. Checked:

* the outputs of the valid tokens equal the per-sequence outputs; padded tokens stay masked;
* a masked mean-pool over tokens equals the mean over the unpadded outputs;
* the parameter gradients of a loss on the pooled outputs equal the sum of the per-sequence ones
  (under ``jit``).
"""

from __future__ import annotations

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import masked_jax as mj

LENGTHS = (5, 3, 1)
B, L, D = len(LENGTHS), 5, 4
VALID = np.arange(L)[None, :] < np.asarray(LENGTHS)[:, None]  # (B, L) token validity
RTOL = 2e-5


def _batch(seed=0, features=D):
    x = np.random.default_rng(seed).normal(size=(B, L, features)).astype(np.float32)
    tokens = np.broadcast_to(VALID[:, :, None], x.shape)
    return mj.masked_array(jnp.asarray(np.where(tokens, x, np.nan)), jnp.asarray(tokens)), x


def _pool(y):
    return jnp.mean(y, axis=1)  # over tokens: a masked mean inside maskify


def _close(got, want, what):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=RTOL, atol=RTOL, err_msg=what)


def check_module(apply, params, xm, x, *, per_sequence=None):
    """``apply(params, x)``: (B, L, ...) -> (B, L, F). ``per_sequence(params, x_b)`` is the reference
    on one unpadded sequence (1, n, ...) (``apply`` itself by default)."""
    per_sequence = per_sequence or apply
    refs = [per_sequence(params, x[b : b + 1, :n]) for b, n in enumerate(LENGTHS)]
    for label, fn in (("eager", mj.maskify(apply)), ("jit", jax.jit(mj.maskify(apply)))):
        out = fn(params, xm)
        assert isinstance(out, mj.MaskedArray), label
        mask = np.asarray(out.mask)
        for b, n in enumerate(LENGTHS):
            assert mask[b, :n].all() and not mask[b, n:].any(), f"{label}: sequence {b} mask {mask[b, :, 0]}"
            _close(out.data[b, :n], refs[b][0], f"{label}: sequence {b}")
            assert np.isfinite(np.asarray(out.data[b, :n])).all()
        pooled = mj.maskify(lambda p, v: _pool(apply(p, v)))(params, xm)
        _close(pooled.data, jnp.stack([r[0].mean(0) for r in refs]), f"{label}: mean-pool")

    # parameter gradients of a loss on the pooled outputs
    w = jnp.linspace(-1.0, 1.0, refs[0].shape[-1])

    def masked_loss(p):
        return jnp.sum(mj.maskify(lambda q, v: _pool(apply(q, v)))(p, xm).data * w)

    def ref_loss(p):
        return sum(jnp.sum(_pool(per_sequence(p, x[b : b + 1, :n]))[0] * w) for b, n in enumerate(LENGTHS))

    want = jax.jit(jax.grad(ref_loss))(params)
    g = jax.jit(jax.grad(masked_loss))(params)  # (under jit: the eager path is the values' above)
    assert all(np.isfinite(np.asarray(v)).all() for v in jax.tree_util.tree_leaves(g)), "NaN in parameter gradients"
    jax.tree_util.tree_map(lambda a, b: _close(a, b, "parameter gradient"), g, want)


# -- flax linen --------------------------------------------------------------------------------------
def _linen(module, x, **kw):
    params = module.init(jax.random.key(0), jnp.asarray(x[:, :2]), **kw)
    return lambda p, v: module.apply(p, v, **kw), params


LINEN = {
    "Dense": lambda: nn.Dense(3),
    "LayerNorm": lambda: nn.LayerNorm(),
    "RMSNorm": lambda: nn.RMSNorm(),
    "GroupNorm": lambda: nn.GroupNorm(num_groups=2),
    "MLP": lambda: nn.Sequential([nn.Dense(8), nn.gelu, nn.Dense(3)]),
    "MultiHeadAttention": lambda: nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=4),
    "GRU": lambda: nn.RNN(nn.GRUCell(features=3)),
    "LSTM": lambda: nn.RNN(nn.OptimizedLSTMCell(features=3)),
    # SAME padding: the positions just past each sequence read its padding, which the unpadded run
    # sees as the convolution's own zeros: they stay masked, the last tokens are valid
    "Conv": lambda: nn.Conv(3, kernel_size=(3,), padding="SAME"),
    "Conv-dilated": lambda: nn.Sequential(
        [
            nn.Conv(4, kernel_size=(2,), kernel_dilation=(2,), padding="SAME"),
            nn.gelu,
            nn.Conv(3, kernel_size=(3,), padding="SAME"),
        ]
    ),
}


@pytest.mark.parametrize("name", sorted(LINEN))
def test_linen_module_equals_unpadded_sequences(name):
    xm, x = _batch()
    apply, params = _linen(LINEN[name](), x)
    check_module(apply, params, xm, x)


def test_linen_attention_with_padding_mask():
    """An explicit attention mask (padded keys excluded with a big negative constant) agrees too."""
    xm, x = _batch(1)
    mha = nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=4)
    params = mha.init(jax.random.key(0), jnp.asarray(x))
    attn = nn.make_attention_mask(jnp.asarray(VALID), jnp.asarray(VALID))

    def apply(p, v):
        return mha.apply(p, v, mask=attn[: v.shape[0], :, : v.shape[1], : v.shape[1]])

    check_module(apply, params, xm, x, per_sequence=lambda p, v: mha.apply(p, v))


def test_linen_batchnorm_training_uses_valid_tokens_only():
    xm, x = _batch(2)
    bn = nn.BatchNorm(use_running_average=False, momentum=0.9)
    variables = bn.init(jax.random.key(0), jnp.asarray(x))

    def apply(v):
        y, updates = bn.apply(variables, v, mutable=["batch_stats"])
        return y, updates["batch_stats"]

    tokens = x[VALID][None]  # (1, N, D): every valid token, as one unpadded batch
    y_ref, stats_ref = apply(jnp.asarray(tokens))
    for label, fn in (("eager", mj.maskify(apply)), ("jit", jax.jit(mj.maskify(apply)))):
        y, stats = fn(xm)
        np.testing.assert_array_equal(np.asarray(y.mask)[..., 0], VALID)
        _close(np.asarray(y.data)[VALID], y_ref[0], f"{label}: normalised tokens")
        for key in ("mean", "var"):
            _close(stats[key].data, stats_ref[key], f"{label}: running {key}")


class _EncoderBlock(nn.Module):
    """A pre-norm transformer encoder block with dropout (as in a real model)."""

    @nn.compact
    def __call__(self, x, mask=None, train=True):
        h = nn.LayerNorm()(x)
        h = nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=4, dropout_rate=0.2)(
            h, mask=mask, deterministic=not train
        )
        x = x + nn.Dropout(0.3)(h, deterministic=not train)
        h = nn.Dense(4)(nn.gelu(nn.Dense(8)(nn.LayerNorm()(x))))
        return x + nn.Dropout(0.3)(h, deterministic=not train)


def test_linen_encoder_block_with_dropout_keeps_padding_masked():
    """Dropout (where(keep, x / rate, 0)) never turns padding into valid zeros. The reference is the
    same block on the zero-filled batch with an explicit attention mask and the same dropout key
    (so the same dropout pattern): equal on the valid tokens, and so after a masked mean-pool."""
    xm, x = _batch(3)
    block = _EncoderBlock()
    params = block.init(jax.random.key(0), jnp.asarray(x), train=False)
    rngs = {"dropout": jax.random.key(7)}
    attn = nn.make_attention_mask(jnp.asarray(VALID), jnp.asarray(VALID))
    ref = block.apply(params, jnp.asarray(np.where(VALID[..., None], x, 0)), mask=attn, rngs=rngs)
    ref_pool = np.stack([np.asarray(ref[b, :n]).mean(0) for b, n in enumerate(LENGTHS)])
    for label, fn in (("eager", mj.maskify), ("jit", lambda f: jax.jit(mj.maskify(f)))):
        out = fn(lambda v: block.apply(params, v, rngs=rngs))(xm)
        np.testing.assert_array_equal(np.asarray(out.mask)[..., 0], VALID, err_msg=f"{label}: padding turned valid")
        _close(np.asarray(out.data)[VALID], np.asarray(ref)[VALID], f"{label}: valid tokens")
        pooled = fn(lambda v: _pool(block.apply(params, v, rngs=rngs)))(xm)
        _close(pooled.data, ref_pool, f"{label}: mean-pool")


def test_linen_embed_with_padded_ids():
    """Padded token ids are masked: their embeddings are masked rows (a gather with masked indices)."""
    ids = np.where(VALID, np.random.default_rng(4).integers(0, 10, (B, L)), 10**6)  # junk in the padding
    ids_m = mj.masked_array(jnp.asarray(ids), jnp.asarray(VALID))
    model = nn.Sequential([nn.Embed(10, 4), nn.Dense(3)])
    params = model.init(jax.random.key(0), jnp.zeros((1, 2), int))
    refs = [model.apply(params, jnp.asarray(ids[b : b + 1, :n])) for b, n in enumerate(LENGTHS)]
    for label, fn in (("eager", mj.maskify), ("jit", lambda f: jax.jit(mj.maskify(f)))):
        out = fn(lambda i: model.apply(params, i))(ids_m)
        np.testing.assert_array_equal(np.asarray(out.mask)[..., 0], VALID)
        for b, n in enumerate(LENGTHS):
            _close(out.data[b, :n], refs[b][0], f"{label}: sequence {b}")
        pooled = fn(lambda i: _pool(model.apply(params, i)))(ids_m)
        _close(pooled.data, jnp.stack([r[0].mean(0) for r in refs]), f"{label}: mean-pool")


def test_linen_conv_and_pooling():
    """Conv then max-pooling over the valid tokens: a causal convolution of the valid prefix equals
    the unpadded one; the positions it reaches past the prefix are restricted to the tokens again by
    multiplying with a masked array of ones (a convolution output is valid where a valid tap met)."""
    xm, x = _batch(5)
    conv = nn.Conv(3, kernel_size=(2,), padding=((1, 0),))
    params = conv.init(jax.random.key(0), jnp.asarray(x))
    ones = mj.masked_array(jnp.ones((B, L, 1), jnp.float32), jnp.asarray(VALID[..., None]))

    def features(v, o):
        return jnp.max(conv.apply(params, v) * o, axis=1)  # max-pool over tokens

    refs = np.stack(
        [np.asarray(conv.apply(params, jnp.asarray(x[b : b + 1, :n])))[0].max(0) for b, n in enumerate(LENGTHS)]
    )
    for label, fn in (("eager", mj.maskify(features)), ("jit", jax.jit(mj.maskify(features)))):
        _close(fn(xm, ones).data, refs, f"{label}: max-pooled conv features")


# -- flax nnx ------------------------------------------------------------------------------------------
def test_nnx_modules_equal_unpadded_sequences():
    rngs = nnx.Rngs(0)
    model = nnx.Sequential(nnx.Linear(D, 8, rngs=rngs), nnx.LayerNorm(8, rngs=rngs), nnx.Linear(8, 3, rngs=rngs))
    graphdef, state = nnx.split(model)

    def apply(s, v):
        return nnx.merge(graphdef, s)(v)

    xm, x = _batch(6)
    check_module(apply, state, xm, x)


def test_nnx_conv_same_padding_equals_unpadded_sequences():
    graphdef, state = nnx.split(nnx.Conv(D, 3, kernel_size=3, padding="SAME", rngs=nnx.Rngs(0)))

    def apply(s, v):
        return nnx.merge(graphdef, s)(v)

    xm, x = _batch(8)
    check_module(apply, state, xm, x)


# -- equinox ---------------------------------------------------------------------------------------------
class _EqxEncoder(eqx.Module):
    """Per-sequence equinox model (L, D) -> (L, 3): attention, a GRU under scan, layer norm, MLP."""

    attn: eqx.nn.MultiheadAttention
    gru: eqx.nn.GRUCell
    norm: eqx.nn.LayerNorm
    head: eqx.nn.MLP

    def __init__(self, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.attn = eqx.nn.MultiheadAttention(2, D, key=k1)
        self.gru = eqx.nn.GRUCell(D, D, key=k2)
        self.norm = eqx.nn.LayerNorm(D)
        self.head = eqx.nn.MLP(D, 3, 8, 1, key=k3)

    def __call__(self, x):
        x = x + self.attn(x, x, x)
        _, hs = jax.lax.scan(lambda h, v: (self.gru(v, h),) * 2, jnp.zeros(D, x.dtype), x)
        return jax.vmap(lambda v: self.head(self.norm(v)))(hs)


def test_equinox_conv1d_with_padding_equals_unpadded_sequences():
    conv = eqx.nn.Conv1d(D, 3, kernel_size=3, padding=1, key=jax.random.key(3))  # (channels, length)
    params, static = eqx.partition(conv, eqx.is_array)
    params = jax.tree.map(lambda a: a.astype(jnp.float32), params)  # (the tests run with x64 on)

    def apply(p, v):  # (B, L, D) -> (B, L, 3)
        return jnp.swapaxes(jax.vmap(eqx.combine(p, static))(jnp.swapaxes(v, 1, 2)), 1, 2)

    xm, x = _batch(9)
    check_module(apply, params, xm, x)


def test_equinox_model_equals_unpadded_sequences():
    model = _EqxEncoder(jax.random.key(0))
    params, static = eqx.partition(model, eqx.is_array)

    def apply(p, v):
        return jax.vmap(eqx.combine(p, static))(v)

    xm, x = _batch(7)
    check_module(apply, params, xm, x)
