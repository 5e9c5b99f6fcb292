"""Positions along a token axis under ``maskify`` mean what they mean in the unpadded example.

Each form is written once, for one unpadded example, and run with ``maskify`` on a padded batch
(right padding, left padding and holes, NaN in the padding), eagerly and under ``jit``. The
reference is the same code on each example's valid tokens alone. Equal means: where the output has
a token axis, its valid tokens, in order, are the reference's tokens (the other entries masked);
where it has none, it is valid and equal. Parameter gradients of a loss that does not depend on
where the tokens sit equal the sum of the per-example gradients.

The forms:

* convolutions after a causal pad: ``jnp.pad`` then a ``VALID`` convolution, flax
  ``nn.Conv(padding="CAUSAL")`` (dilated, stacked with residuals) and ``nnx.Conv``;
* built positions: ``pos_emb[jnp.arange(L)]``, sinusoidal features of ``arange``, a slice of a
  table, a causal ``tril`` mask read by a query axis the inputs do not cover, a local window, a
  causal running mean ``tril @ x``, batched KV-cache generation with ``pos_emb[P + t]``;
* static and negative indices, slices and reversals after a ``lax.scan``, a
  ``lax.associative_scan`` and a convolution stack;
* sorts and ranks: ``argsort(-s)[:, :k]``, ``argsort(s)[:, ::-1][:, :k]``, ranks by a double
  ``argsort``, ``jnp.take_along_axis`` at sorted positions, ``argmax`` along the tokens.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax import lax

import masked_jax as mj

B, L, D = 3, 6, 4
TOL = 2e-5
PADDINGS = {
    "right": np.array([[1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0], [1, 0, 0, 0, 0, 0]], bool),
    "left": np.array([[1, 1, 1, 1, 1, 1], [0, 0, 0, 1, 1, 1], [0, 0, 0, 0, 1, 1]], bool),
    "holes": np.array([[1, 0, 1, 1, 0, 1], [0, 1, 1, 0, 1, 0], [1, 1, 0, 0, 0, 1]], bool),
}
RNG = np.random.default_rng(0)
X = RNG.normal(size=(B, L, D)).astype(np.float32)


def _param(*shape, scale=0.5):
    return jnp.asarray(RNG.normal(size=shape).astype(np.float32) * scale)


# -- the forms: (apply(params, x) -> output, params) ----------------------------------------------
def _conv_pad():
    p = {"w": _param(3, D, D)}

    def apply(p, x):
        h = jnp.pad(x, ((0, 0), (2, 0), (0, 0)))
        return lax.conv_general_dilated(h, p["w"], (1,), "VALID", dimension_numbers=("NWC", "WIO", "NWC"))

    return apply, p


def _flax_causal_stack():
    class Block(nn.Module):
        @nn.compact
        def __call__(self, x):
            for dilation in (1, 2):
                x = x + jnp.tanh(nn.Conv(D, (2,), padding="CAUSAL", kernel_dilation=dilation)(x))
            return x

    module = Block()
    return module.apply, module.init(jax.random.key(0), jnp.zeros((1, L, D)))


def _nnx_causal():
    conv = nnx.Conv(D, D, kernel_size=(3,), padding="CAUSAL", kernel_dilation=2, rngs=nnx.Rngs(1))
    graphdef, params = nnx.split(conv)
    return (lambda p, x: x + nnx.merge(graphdef, p)(x)), params


def _pos_table():
    p = {"pos": _param(16, D)}
    return (lambda p, x: x + p["pos"][jnp.arange(x.shape[1])]), p


def _pos_slice():
    p = {"pos": _param(1, 16, D)}
    return (lambda p, x: x + p["pos"][:, : x.shape[1]]), p


def _sinusoid():
    p = {"w": _param(D, D)}

    def apply(p, x):
        t = jnp.arange(x.shape[1])[:, None] / (10.0 ** (jnp.arange(D) / D))
        return (x + jnp.sin(t)) @ p["w"]

    return apply, p


def _causal_rows():  # the query axis of tril is no input's: its entries past the example are not
    p = {"w": _param(D, D)}

    def apply(p, x):
        n = x.shape[1]
        s = (x @ p["w"])[:, :, 0]
        return jnp.where(jnp.tril(jnp.ones((n, n), bool)), s[:, None, :], 0.0).sum(-1)[..., None]

    return apply, p


def _window_softmax():
    p = {"w": _param(D, D)}

    def apply(p, x):
        n = x.shape[1]
        i = jnp.arange(n)
        s = jnp.einsum("bqd,bkd->bqk", x @ p["w"], x) - 0.3 * jnp.abs(i[:, None] - i[None, :])
        near = jnp.abs(i[:, None] - i[None, :]) < 2
        return jnp.einsum("bqk,bkd->bqd", jax.nn.softmax(jnp.where(near, s, -jnp.inf), -1), x)

    return apply, p


def _running_mean():
    p = {"w": _param(D, D)}

    def apply(p, x):
        n = x.shape[1]
        return (jnp.tril(jnp.ones((n, n))) @ (x @ p["w"])) / jnp.arange(1, n + 1)[:, None]

    return apply, p


def _gru_scan():
    p = {"wx": _param(D, D), "wh": _param(D, D)}

    def apply(p, x):
        def step(h, xt):
            h = jnp.tanh(xt @ p["wx"] + h @ p["wh"])
            return h, h

        _, hs = lax.scan(step, jnp.zeros((x.shape[0], D)), jnp.swapaxes(x, 0, 1))
        return jnp.swapaxes(hs, 0, 1)

    return apply, p


def _selective_ssm():  # a diagonal linear recurrence h_t = a_t * h_{t-1} + b_t, by associative_scan
    p = {"wa": _param(D, D), "wb": _param(D, D)}

    def apply(p, x):
        a, b = jax.nn.sigmoid(x @ p["wa"]), x @ p["wb"]

        def combine(u, v):
            return v[0] * u[0], v[0] * u[1] + v[1]

        return lax.associative_scan(combine, (a, b), axis=1)[1]

    return apply, p


def _conv_stack():
    apply, p = _flax_causal_stack()
    return apply, p


SEQUENCES = {"scan": _gru_scan, "associative_scan": _selective_ssm, "conv stack": _conv_stack}
READS = {
    "x[:, -1]": lambda h: h[:, -1],
    "x[:, 0]": lambda h: h[:, 0],
    "x[:, -2:]": lambda h: h[:, -2:],
    "x[:, ::-1]": lambda h: h[:, ::-1],
    "x[:, 1:] - x[:, :-1]": lambda h: h[:, 1:] - h[:, :-1],
    "jnp.take(x, -1, 1)": lambda h: jnp.take(h, -1, axis=1),
}


def _sorted(kind):
    p = {"w": _param(D, 1), "pos": _param(L, D)}

    def apply(p, x):
        s = (x @ p["w"])[..., 0]
        if kind == "top":
            return jnp.take_along_axis(x, jnp.argsort(-s, axis=1)[:, :2, None], axis=1)
        if kind == "top-reversed":
            return jnp.take_along_axis(x, jnp.argsort(s, axis=1)[:, ::-1][:, :2, None], axis=1)
        if kind == "ranks":
            return x + p["pos"][jnp.argsort(jnp.argsort(s, axis=1), axis=1)]
        if kind == "argmax":
            return jnp.take_along_axis(x, jnp.argmax(s, axis=1)[:, None, None], axis=1)[:, 0]
        raise AssertionError(kind)

    return apply, p


FORMS = {
    "pad then VALID conv": _conv_pad,
    "flax CAUSAL conv stack": _flax_causal_stack,
    "nnx CAUSAL dilated conv": _nnx_causal,
    "pos_emb[arange(L)]": _pos_table,
    "pos_emb[:, :L]": _pos_slice,
    "sinusoid of arange": _sinusoid,
    "tril rows": _causal_rows,
    "local window, relative bias": _window_softmax,
    "tril @ x running mean": _running_mean,
    **{f"{s} then {r}": (lambda s=s, r=r: _then(SEQUENCES[s], READS[r])) for s in SEQUENCES for r in READS},
    **{f"sort: {k}": (lambda k=k: _sorted(k)) for k in ("top", "top-reversed", "ranks", "argmax")},
}


def _then(make, read):
    apply, p = make()
    return (lambda q, x: read(apply(q, x))), p


# -- the check ---------------------------------------------------------------------------------------
def _tokens_in_order(data, mask, axis_len):
    """The valid tokens of one example's output in order (all features of a token valid or none)."""
    flat = mask.reshape(axis_len, -1)
    assert np.all(flat.all(1) == flat.any(1)), f"a token is partly valid: {mask}"
    return data[flat.all(1)]


def _compare(out, ref, b, label):
    """An example's output against its reference: (tokens, features) outputs by their valid tokens
    in order, (features,) outputs as they are."""
    data, mask = np.asarray(out.data[b]), np.asarray(out.mask[b])
    ref = np.asarray(ref)
    if ref.ndim == 2:
        got = _tokens_in_order(data, mask, data.shape[0])
        assert got.shape == ref.shape, f"{label}: example {b} has {got.shape[0]} valid tokens, want {ref.shape[0]}"
        np.testing.assert_allclose(got, ref, rtol=TOL, atol=TOL, err_msg=f"{label}: example {b}")
    else:
        assert mask.all(), f"{label}: example {b} masked"
        np.testing.assert_allclose(data, ref, rtol=TOL, atol=TOL, err_msg=f"{label}: example {b}")


def _loss_weights(out_shape):
    return jnp.linspace(0.5, 1.5, out_shape[-1])


@pytest.mark.parametrize("padding", list(PADDINGS))
@pytest.mark.parametrize("form", list(FORMS))
def test_positions_equal_unpadded_runs(form, padding):
    apply, params = FORMS[form]()
    valid = PADDINGS[padding]
    xm = mj.masked_array(jnp.asarray(np.where(valid[..., None], X, np.nan)), jnp.asarray(valid[..., None]))
    refs = [apply(params, jnp.asarray(X[b : b + 1, valid[b]]))[0] for b in range(B)]
    for label, fn in (("eager", mj.maskify(apply)), ("jit", jax.jit(mj.maskify(apply)))):
        out = mj.as_masked(fn(params, xm))
        for b in range(B):
            _compare(out, refs[b], b, f"{form}, {padding}, {label}")

    w = _loss_weights(refs[0].shape)

    def masked_loss(p):
        out = mj.as_masked(mj.maskify(apply)(p, xm))
        return jnp.sum(jnp.where(out.mask, out.data * w, 0.0))

    def ref_loss(p):
        return sum(jnp.sum(apply(p, jnp.asarray(X[b : b + 1, valid[b]]))[0] * w) for b in range(B))

    want = jax.grad(ref_loss)(params)
    for label, grad in (("eager", jax.grad(masked_loss)), ("jit", jax.jit(jax.grad(masked_loss)))):
        got = grad(params)
        for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            assert bool(jnp.all(jnp.isfinite(g))), f"{form}, {padding}, {label}: NaN in the gradients"
            np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-4, atol=1e-4, err_msg=f"{form}, {label}")


# -- KV-cache generation on left-padded prompts ----------------------------------------------------------
V, STEPS = 11, 3


def _decoder_params():
    rng = np.random.default_rng(1)
    shapes = {"emb": (V, D), "pos": (16, D), "wq": (D, D), "wk": (D, D), "wv": (D, D), "wo": (D, V)}
    return {k: jnp.asarray(rng.normal(size=s).astype(np.float32) * 0.7) for k, s in shapes.items()}


def generate(p, prompt):
    """Greedy generation with a KV cache, written for one unpadded prompt (B, P) of token ids: the
    prompt's positions are ``arange(P)``, the generated token ``t``'s is ``P + t``."""
    batch, length = prompt.shape
    x = p["emb"][prompt] + p["pos"][jnp.arange(length)]
    q, k, v = x @ p["wq"], x @ p["wk"], x @ p["wv"]
    causal = jnp.tril(jnp.ones((length, length), bool))
    s = jnp.where(causal, jnp.einsum("bqd,bkd->bqk", q, k) / np.sqrt(D), -jnp.inf)
    h = jnp.einsum("bqk,bkd->bqd", jax.nn.softmax(s, -1), v)
    first = jnp.argmax(h[:, -1] @ p["wo"], -1)
    keys = jnp.zeros((batch, length + STEPS, D), k.dtype).at[:, :length].set(k)
    values = jnp.zeros((batch, length + STEPS, D), v.dtype).at[:, :length].set(v)

    def step(carry, t):
        keys, values, tok = carry
        pos = length + t
        xt = p["emb"][tok] + p["pos"][pos]
        keys = lax.dynamic_update_slice(keys, (xt @ p["wk"])[:, None], (0, pos, 0))
        values = lax.dynamic_update_slice(values, (xt @ p["wv"])[:, None], (0, pos, 0))
        st = jnp.einsum("bd,bsd->bs", xt @ p["wq"], keys) / np.sqrt(D)
        st = jnp.where(jnp.arange(length + STEPS) <= pos, st, -jnp.inf)
        nxt = jnp.argmax(jnp.einsum("bs,bsd->bd", jax.nn.softmax(st, -1), values) @ p["wo"], -1)
        return (keys, values, nxt), nxt

    _, toks = lax.scan(step, (keys, values, first), jnp.arange(STEPS))
    return jnp.concatenate([first[:, None], toks.T], 1)


@pytest.mark.parametrize("padding", ["left", "right", "holes"])
def test_kv_cache_generation_equals_each_prompt_alone(padding):
    p = _decoder_params()
    prompts = np.random.default_rng(2).integers(0, V, size=(B, L))
    valid = PADDINGS[padding]
    want = np.stack([np.asarray(generate(p, jnp.asarray(prompts[b : b + 1, valid[b]]))[0]) for b in range(B)])
    pm = mj.masked_array(jnp.asarray(np.where(valid, prompts, 0)), jnp.asarray(valid))
    for fn in (mj.maskify(generate), jax.jit(mj.maskify(generate))):
        out = fn(p, pm)
        np.testing.assert_array_equal(np.asarray(out.data), want)
        assert bool(np.asarray(out.mask).all())


# -- loud where positions cannot be carried ----------------------------------------------------------
def test_a_given_array_meeting_rebuilt_positions_raises():
    valid = PADDINGS["left"]
    xm = mj.masked_array(jnp.asarray(X), jnp.asarray(valid[..., None]))
    weights = jnp.ones((B, L, D))  # per padded position, given by the user
    with pytest.raises(mj.MaskifyError, match="padded coordinates"):  # sorted tokens against padded places
        mj.maskify(lambda x, w: jnp.sort(x, axis=1) * w)(xm, weights)


def test_positions_padded_keeps_stored_positions():
    valid = PADDINGS["left"]
    xm = mj.masked_array(jnp.asarray(X), jnp.asarray(valid[..., None]))
    stored = mj.maskify(lambda x: x[:, -1], positions="padded")(xm)
    unpadded = mj.maskify(lambda x: x[:, -1])(xm)
    np.testing.assert_array_equal(np.asarray(stored.data), X[:, -1])
    assert bool(np.asarray(unpadded.mask).all())
    with pytest.raises(ValueError, match="positions"):
        mj.maskify(jnp.sin, positions="ragged")
