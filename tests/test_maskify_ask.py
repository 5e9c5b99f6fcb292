"""Asking the mask inside a maskified function: ``mj.mask_of`` and ``mj.lengths``.

The reference is the same function run on each example's valid tokens alone, where ``mask_of`` is
all ``True`` and ``lengths`` the example's length; values, masks and parameter gradients, eagerly
and under ``jit``, over right, left and hole padding with NaN in the padding.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import masked_jax as mj

B, L, D = 3, 6, 4
PADDINGS = {
    "right": np.array([[1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0], [1, 0, 0, 0, 0, 0]], bool),
    "left": np.array([[1, 1, 1, 1, 1, 1], [0, 0, 0, 1, 1, 1], [0, 0, 0, 0, 1, 1]], bool),
    "holes": np.array([[1, 0, 1, 1, 0, 1], [0, 1, 1, 0, 1, 0], [1, 1, 0, 0, 0, 1]], bool),
}
RNG = np.random.default_rng(3)
X = RNG.normal(size=(B, L, D)).astype(np.float32)
PARAMS = {
    "pos": jnp.asarray(RNG.normal(size=(L, D)).astype(np.float32)),
    "w": jnp.asarray(RNG.normal(size=(D, D)).astype(np.float32)),
}


def positions_from_the_mask(p, x):
    """Learned positions indexed by each token's rank among the valid tokens, read off the mask."""
    pos = jnp.cumsum(mj.mask_of(x)[..., 0], axis=1) - 1
    h = jnp.tanh((x + p["pos"][jnp.clip(pos, 0)]) @ p["w"])
    return h, h.sum(1) / mj.lengths(h)[:, None]  # tokens, and a mean over the example's own length


def _masked(padding):
    valid = PADDINGS[padding]
    return valid, mj.masked_array(jnp.asarray(np.where(valid[..., None], X, np.nan)), jnp.asarray(valid[..., None]))


@pytest.mark.parametrize("padding", list(PADDINGS))
def test_positions_and_lengths_from_the_mask_equal_unpadded_runs(padding):
    valid, xm = _masked(padding)
    refs = [positions_from_the_mask(PARAMS, jnp.asarray(X[b : b + 1, valid[b]])) for b in range(B)]
    for label, fn in (
        ("eager", mj.maskify(positions_from_the_mask)),
        ("jit", jax.jit(mj.maskify(positions_from_the_mask))),
    ):
        tokens, mean = fn(PARAMS, xm)
        for b in range(B):
            np.testing.assert_allclose(
                np.asarray(tokens.data[b][valid[b]]),
                np.asarray(refs[b][0][0]),
                rtol=1e-5,
                atol=1e-5,
                err_msg=f"{label} {b}",
            )
            assert not np.asarray(tokens.mask[b][~valid[b]]).any(), f"{label}: padding made valid"
            assert bool(np.asarray(mj.as_masked(mean).mask[b]).all())
            np.testing.assert_allclose(
                np.asarray(mj.as_masked(mean).data[b]), np.asarray(refs[b][1][0]), rtol=1e-5, atol=1e-5
            )

    def loss(p):
        return jnp.sum(mj.as_masked(mj.maskify(positions_from_the_mask)(p, xm)[1]).data)

    def ref_loss(p):
        return sum(jnp.sum(positions_from_the_mask(p, jnp.asarray(X[b : b + 1, valid[b]]))[1]) for b in range(B))

    want = jax.grad(ref_loss)(PARAMS)
    for grad in (jax.grad(loss), jax.jit(jax.grad(loss))):
        for g, r in zip(jax.tree.leaves(grad(PARAMS)), jax.tree.leaves(want)):
            np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("padding", list(PADDINGS))
def test_mask_of_reads_the_value_it_is_given(padding):
    valid, xm = _masked(padding)
    for fn in (mj.maskify(mj.mask_of), jax.jit(mj.maskify(mj.mask_of))):
        np.testing.assert_array_equal(np.asarray(fn(xm)), np.broadcast_to(valid[..., None], X.shape))
    # a computed value's validity: a shift along the tokens, in the stored coordinates
    shifted = mj.maskify(lambda v: mj.mask_of(jnp.exp(v) * 2.0))(xm)
    np.testing.assert_array_equal(np.asarray(shifted), np.broadcast_to(valid[..., None], X.shape))
    # under vmap inside the function: each example's own mask
    per = mj.maskify(lambda v: jax.vmap(mj.mask_of)(v))(xm)
    np.testing.assert_array_equal(np.asarray(per), np.broadcast_to(valid[..., None], X.shape))
    np.testing.assert_array_equal(np.asarray(mj.maskify(mj.lengths)(xm)), valid.sum(1))


def test_outside_maskify_the_answers_are_the_arrays_own():
    valid, xm = _masked("holes")
    np.testing.assert_array_equal(np.asarray(mj.mask_of(xm)), np.broadcast_to(valid[..., None], X.shape))
    np.testing.assert_array_equal(np.asarray(mj.lengths(xm)), valid.sum(1))
    assert bool(mj.mask_of(jnp.asarray(X)).all())
    np.testing.assert_array_equal(np.asarray(jax.jit(mj.lengths)(jnp.asarray(X))), np.full(B, L))
    np.testing.assert_array_equal(np.asarray(mj.lengths(jnp.asarray(X), axis=-1)), np.full((B, L), D))
    with pytest.raises(ValueError, match="axis 3 is out of range"):
        mj.lengths(jnp.asarray(X), axis=3)
    with pytest.raises(TypeError, match="axis must be an int"):
        mj.lengths(jnp.asarray(X), axis=1.0)


def test_the_data_hand_off_counts_the_padding_and_the_masked_mean_does_not():
    """The pitfall the docs show: per-token values taken out with ``.data`` and averaged count the
    padded tokens; the mean taken inside the function (or with the mask) does not."""
    valid, xm = _masked("right")
    logits = mj.maskify(lambda v: v @ PARAMS["w"])(xm)
    want = np.stack([np.asarray((jnp.asarray(X[b, valid[b]]) @ PARAMS["w"]).mean(0)) for b in range(B)])
    wrong = np.asarray(jnp.nan_to_num(logits.data).mean(1))
    assert not np.allclose(wrong, want, atol=1e-3)
    right = mj.maskify(lambda v: (v @ PARAMS["w"]).mean(1))(xm)
    np.testing.assert_allclose(np.asarray(right.data), want, rtol=1e-5, atol=1e-5)
    by_hand = logits.filled(0.0).sum(1) / mj.lengths(logits)[:, None]
    np.testing.assert_allclose(np.asarray(by_hand), want, rtol=1e-5, atol=1e-5)
