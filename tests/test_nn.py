"""masked_jax.nn: normalizations over valid elements, fully masked slices, activations."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from strategies import masked_arrays, tolerance

import masked_jax as mj
import masked_jax.nn as mnn


def _ref_softmax(x, axis):
    d = np.ma.filled(x.to_numpy_ma().astype(np.float64), -np.inf)
    top = np.max(d, axis=axis, keepdims=True, initial=-np.inf)
    top = np.where(np.isfinite(top), top, 0)
    e = np.exp(d - top)
    s = np.sum(e, axis=axis, keepdims=True)
    with np.errstate(all="ignore"):
        return e / s, (d - top) - np.log(s)


@given(x=masked_arrays(dtypes=(np.float32, np.float64), min_dims=1), data=st.data())
def test_softmax_family_over_valid_elements(x, data):
    axis = data.draw(st.integers(-x.ndim, x.ndim - 1))
    sm, lsm = _ref_softmax(x, axis)
    valid = np.asarray(x.mask)
    tol = tolerance(x.dtype)
    for got, ref in [
        (mnn.softmax(x, axis=axis), sm),
        (mnn.log_softmax(x, axis=axis), lsm),
        (mnn.softmin(x, axis=axis), _ref_softmax(-x, axis)[0]),
    ]:
        np.testing.assert_array_equal(got.mask, valid)
        np.testing.assert_allclose(np.where(valid, got.data, 0), np.where(valid, ref, 0), **tol)
        assert np.all(np.isfinite(np.asarray(got.data)))  # fully masked slices: no NaN anywhere
    # softmax over valid entries sums to 1 on every slice that has a valid element
    s = np.sum(np.where(valid, mnn.softmax(x, axis=axis).data, 0), axis=axis)
    has = np.any(valid, axis=axis)
    np.testing.assert_allclose(s[has], 1.0, rtol=1e-5)


@given(x=masked_arrays(dtypes=(np.float32, np.float64), min_dims=1), data=st.data())
def test_normalize_and_logsumexp(x, data):
    axis = data.draw(st.integers(-x.ndim, x.ndim - 1))
    d = np.ma.filled(x.to_numpy_ma().astype(np.float64), 0.0)
    n = np.sqrt(np.sum(d * d, axis=axis, keepdims=True))
    got = mnn.normalize(x, axis=axis)
    valid = np.asarray(x.mask)
    np.testing.assert_array_equal(got.mask, valid)
    np.testing.assert_allclose(
        np.where(valid, got.data, 0), np.where(valid, d / np.maximum(n, 1e-12), 0), **tolerance(x.dtype)
    )
    lse = mnn.logsumexp(x, axis=axis)
    # valid where the slice has a valid element, or no element at all (the log of an empty sum: -inf)
    np.testing.assert_array_equal(lse.mask, np.any(valid, axis=axis) | (x.shape[axis] == 0))


def test_fully_masked_rows_every_reduction_and_normalization():
    import masked_jax.numpy as mnp

    x = mj.masked_array(
        jnp.array([[1.0, 2.0, 4.0], [jnp.nan, jnp.inf, -jnp.inf]]),
        jnp.array([[True, False, True], [False, False, False]]),
    )
    fills = {
        "sum": 0.0,
        "prod": 1.0,
        "mean": 0.0,
        "var": 0.0,
        "std": 0.0,
        "max": -np.inf,
        "min": np.inf,
        "ptp": 0.0,
        "median": 0.0,
        "logsumexp": -np.inf,
        "norm": 0.0,
        "argmax": 0,
        "argmin": 0,
        "any": False,
        "all": True,
    }
    for name, fill in fills.items():
        out = getattr(mnp, name)(x, axis=1)
        np.testing.assert_array_equal(out.mask, [True, False], err_msg=name)
        assert np.asarray(out.data)[1] == fill, name
    q = mnp.quantile(x, 0.3, axis=1)
    np.testing.assert_array_equal(q.mask, [True, False])
    for fn in (mnn.softmax, mnn.log_softmax, mnn.softmin, mnn.normalize):
        out = fn(x, axis=1)
        np.testing.assert_array_equal(out.mask, np.asarray(x.mask))
        np.testing.assert_array_equal(np.asarray(out.data)[1], 0.0)


@pytest.mark.parametrize("name", ["relu", "gelu", "silu", "sigmoid", "softplus", "log_sigmoid"])
def test_activations_keep_mask(name):
    x = mj.masked_array(jnp.array([-1.0, jnp.nan, 2.0]), jnp.array([True, False, True]))
    out = getattr(mnn, name)(x)
    np.testing.assert_array_equal(out.mask, x.mask)
    np.testing.assert_allclose(np.asarray(out.data)[[0, 2]], getattr(jax.nn, name)(jnp.array([-1.0, 2.0])), rtol=1e-6)


def test_one_hot_valid_where_index_valid():
    ids = mj.masked_array(jnp.array([2, 99, 0]), jnp.array([True, False, True]))
    out = mnn.one_hot(ids, 3)
    np.testing.assert_array_equal(out.mask, [[True] * 3, [False] * 3, [True] * 3])
    np.testing.assert_array_equal(out.filled(), [[0, 0, 1], [0, 0, 0], [1, 0, 0]])
    plain = mnn.one_hot(jnp.array([1]), 2)
    assert bool(jnp.all(plain.mask))


# -- dot_product_attention --------------------------------------------------------------------------
ATT_B, ATT_T, ATT_N, ATT_K, ATT_H = 3, 6, 4, 2, 8  # grouped-query: 4 query heads over 2 key heads
Q_TOKENS = np.array([[1, 1, 1, 1, 0, 0], [0, 1, 1, 0, 1, 1], [1, 1, 1, 1, 1, 1]], bool)  # right, scattered, none
K_TOKENS = np.array([[1, 1, 0, 1, 0, 0], [0, 0, 0, 0, 0, 0], [1, 0, 1, 0, 1, 1]], bool)  # a row with no key


def _attention_inputs(dtype, fill, same):
    rng = np.random.default_rng(0)
    k_tokens = Q_TOKENS if same else K_TOKENS
    parts = []
    for heads, tokens in ((ATT_N, Q_TOKENS), (ATT_K, k_tokens), (ATT_K, k_tokens)):
        x = rng.normal(size=(ATT_B, ATT_T, heads, ATT_H))
        parts.append((np.where(tokens[:, :, None, None], x, fill).astype(dtype), tokens))
    mask = jnp.asarray(Q_TOKENS)[:, :, None, None]
    q = mj.masked_array(jnp.asarray(parts[0][0]), mask)
    if same:  # self-attention: one token mask object
        return (
            q,
            mj.masked_array(jnp.asarray(parts[1][0]), mask),
            mj.masked_array(jnp.asarray(parts[2][0]), mask),
            parts,
        )
    kmask = jnp.asarray(k_tokens)[:, :, None, None]
    return q, mj.masked_array(jnp.asarray(parts[1][0]), kmask), mj.masked_array(jnp.asarray(parts[2][0]), kmask), parts


ATTENTION_CASES = {  # name: (keyword arguments, one token mask for queries and keys)
    "cross": ({}, False),
    "self": ({}, True),
    "self causal": ({"is_causal": True}, True),
    "cross causal": ({"is_causal": True}, False),
    "window": ({"local_window_size": (2, 1)}, True),
    "bias": ({"bias": "bias"}, False),
    "mask": ({"mask": "mask"}, False),  # query 1 of the first sequence sees no key through it
}


@pytest.mark.parametrize("case", list(ATTENTION_CASES))
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("fill", [0.0, np.nan, np.inf], ids=["zero", "nan", "inf"])
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_attention_equals_each_sequence_without_its_padding(case, dtype, fill, jit):
    """Every valid query's output equals ``jax.nn.dot_product_attention`` over its sequence with
    the padding removed (wherever the padding sits, with NaN or inf in it); a masked query, and a
    query that sees no valid key (through causality, its window or the user's mask), is masked
    with data 0 (jax would spread its weights over every key, the padding included)."""
    kwargs, same = ATTENTION_CASES[case]
    q, k, v, parts = _attention_inputs(dtype, fill, same)
    if kwargs.get("bias") == "bias":
        kwargs = {"bias": jnp.asarray(np.random.default_rng(1).normal(size=(ATT_B, ATT_N, ATT_T, ATT_T)), dtype)}
    if kwargs.get("mask") == "mask":
        user = np.random.default_rng(2).random((ATT_B, 1, ATT_T, ATT_T)) < 0.6
        user[0, 0, 1] = False
        kwargs = {"mask": jnp.asarray(user)}
    run = lambda a, b, c: mnn.dot_product_attention(a, b, c, **kwargs)
    out = jax.jit(run)(q, k, v) if jit else run(q, k, v)
    assert out.shape == q.shape and out.dtype == q.dtype
    data, valid = np.asarray(out.data), np.asarray(out.mask)[:, :, 0, 0]
    assert np.isfinite(data).all()
    k_tokens = parts[1][1]
    for b in range(ATT_B):
        qi, ki = np.flatnonzero(Q_TOKENS[b]), np.flatnonzero(k_tokens[b])
        allowed = np.ones((len(qi), len(ki)), bool)  # which valid keys each valid query may attend
        if kwargs.get("is_causal"):
            allowed &= ki[None, :] <= qi[:, None]
        if "local_window_size" in kwargs:
            before, after = kwargs["local_window_size"]
            allowed &= (ki[None, :] >= qi[:, None] - before) & (ki[None, :] <= qi[:, None] + after)
        if "mask" in kwargs:
            allowed &= np.asarray(kwargs["mask"])[b, 0][np.ix_(qi, ki)]
        reach = allowed.any(axis=1)
        np.testing.assert_array_equal(valid[b, qi], reach)
        assert not valid[b, np.setdiff1d(np.arange(ATT_T), qi)].any()
        assert (data[b][~valid[b]] == 0).all()
        if not reach.any():
            continue
        bias = None if "bias" not in kwargs else np.asarray(kwargs["bias"])[b : b + 1][:, :, qi][..., ki]
        ref = jax.nn.dot_product_attention(
            parts[0][0][b : b + 1, qi],
            parts[1][0][b : b + 1, ki],
            parts[2][0][b : b + 1, ki],
            None if bias is None else jnp.asarray(bias),
            jnp.asarray(allowed)[None, None],
        )
        tol = {"rtol": 1e-5, "atol": 1e-6} if dtype == "float32" else {"rtol": 1e-10, "atol": 1e-12}
        np.testing.assert_allclose(data[b, qi][reach], np.asarray(ref)[0][reach], **tol)


def test_attention_gradients_stay_off_the_padding():
    """Gradients of the valid outputs: finite, 0 at every masked-out query, key and value entry
    (NaN there included), and masked semantics by the Jacobian checker."""
    q, k, v, _ = _attention_inputs("float64", np.nan, False)
    grads = mj.grad(lambda a, b, c: mj.numpy.sum(mnn.dot_product_attention(a, b, c) ** 2), argnums=(0, 1, 2))(q, k, v)
    for g, x in zip(grads, (q, k, v)):
        data = np.asarray(g.data)
        assert np.isfinite(data).all() and (data[~np.asarray(x.mask)] == 0).all()
    # in float32 (the checker runs in float64 under x64): jax's attention takes its logits in
    # float32 whatever the inputs' dtype, so float64 central differences would measure that rounding
    jax.config.update("jax_enable_x64", False)
    try:
        small = [mj.masked_array(x.data[:2, :4, :2, :3].astype(jnp.float32), x.compact_mask[:2, :4]) for x in (q, k, v)]
        report = mj.check_jacobian(lambda a, b, c: mnn.dot_product_attention(a, b, c), tuple(small), semantics="masked")
    finally:
        jax.config.update("jax_enable_x64", True)
    assert report.satisfies == ("masked",)


# Gradients w.r.t. the query, key, value and bias: the per-sequence unpadded call's, whatever the
# bias or mask holds at the padded queries' rows (-inf, NaN: rows the unpadded run never reads).
def _hand_bias(q_tokens, k_tokens, fill, heads):
    """A random bias of ``(B, heads, T, S)`` holding ``fill`` wherever a query or a key is padding."""
    rng = np.random.default_rng(5)
    bias = rng.normal(size=(ATT_B, heads, ATT_T, ATT_T))
    both = q_tokens[:, None, :, None] & k_tokens[:, None, None, :]
    return np.where(both, bias, fill)


GRAD_TOL = {"rtol": 1e-4, "atol": 1e-6}  # jax's attention takes its logits in float32, float64 inputs too

GRAD_CASES = {  # name: (keyword arguments (bias/mask: built from the tokens), one token mask)
    "bias -inf": ({"bias": ("hand", -np.inf, 1)}, False),  # where(q_valid & k_valid, b, -inf)
    "bias -inf per head": ({"bias": ("hand", -np.inf, ATT_N)}, False),
    "bias nan": ({"bias": ("hand", np.nan, ATT_N)}, False),
    "bias broadcast over the batch": ({"bias": ("shared", None, ATT_N)}, False),
    "bias -inf self": ({"bias": ("hand", -np.inf, 1)}, True),
    "mask": ({"mask": "hand"}, False),
    "mask and bias -inf": ({"mask": "hand", "bias": ("hand", -np.inf, 1)}, False),
    "causal bias -inf": ({"is_causal": True, "bias": ("hand", -np.inf, 1)}, True),
    "causal bias nan cross": ({"is_causal": True, "bias": ("hand", np.nan, ATT_N)}, False),
    "causal": ({"is_causal": True}, True),
    "window bias -inf": ({"local_window_size": (2, 1), "bias": ("hand", -np.inf, 1)}, True),
}


# keys of cross-attention: the first sequence's are all valid, so a padded query's row of a -inf
# bias is -inf throughout (nothing of the keys' padding masks it)
GRAD_K_TOKENS = np.array([[1, 1, 1, 1, 1, 1], [1, 1, 0, 1, 1, 0], [1, 0, 1, 0, 1, 1]], bool)


def _grad_inputs(same):
    """``[(data, tokens)]`` of the query, key and value, float64, NaN at the padding."""
    rng = np.random.default_rng(0)
    k_tokens = Q_TOKENS if same else GRAD_K_TOKENS
    parts = []
    for heads, tokens in ((ATT_N, Q_TOKENS), (ATT_K, k_tokens), (ATT_K, k_tokens)):
        x = rng.normal(size=(ATT_B, ATT_T, heads, ATT_H))
        parts.append((np.where(tokens[:, :, None, None], x, np.nan), tokens))
    return parts


def _grad_case(case, same):
    kwargs, _ = GRAD_CASES[case]
    k_tokens = Q_TOKENS if same else GRAD_K_TOKENS
    out = dict(kwargs)
    if "bias" in kwargs:
        how, fill, heads = kwargs["bias"]
        if how == "hand":
            out["bias"] = jnp.asarray(_hand_bias(Q_TOKENS, k_tokens, fill, heads))
        else:  # one bias for every sequence, finite
            out["bias"] = jnp.asarray(np.random.default_rng(6).normal(size=(1, heads, ATT_T, ATT_T)))
    if kwargs.get("mask") == "hand":
        out["mask"] = jnp.asarray(Q_TOKENS[:, None, :, None] & k_tokens[:, None, None, :])
    return out, k_tokens


def _attention_reference_grads(parts, k_tokens, kwargs, weights):
    """The gradients of ``sum(weights * out)`` over the valid queries that see a key, each sequence
    run alone without its padding by ``jax.nn.dot_product_attention``, scattered back in place."""
    grads = [np.zeros(p[0].shape) for p in parts]
    bias = kwargs.get("bias")
    g_bias = None if bias is None else np.zeros((ATT_B,) + np.shape(bias)[1:])
    for b in range(ATT_B):
        qi, ki = np.flatnonzero(Q_TOKENS[b]), np.flatnonzero(k_tokens[b])
        allowed = np.ones((len(qi), len(ki)), bool)
        if kwargs.get("is_causal"):
            allowed &= ki[None, :] <= qi[:, None]
        if "local_window_size" in kwargs:
            before, after = kwargs["local_window_size"]
            allowed &= (ki[None, :] >= qi[:, None] - before) & (ki[None, :] <= qi[:, None] + after)
        reach = allowed.any(axis=1)
        if not reach.any():
            continue
        w = weights[b : b + 1, qi] * reach[None, :, None, None]

        def loss(q, k, v, bb, allowed=allowed, w=w):
            out = jax.nn.dot_product_attention(q, k, v, bb, jnp.asarray(allowed)[None, None])
            return jnp.sum(out * w)

        sub_bias = (
            None if bias is None else jnp.asarray(np.asarray(bias)[min(b, bias.shape[0] - 1)][None][:, :, qi][..., ki])
        )
        args = (parts[0][0][b : b + 1, qi], parts[1][0][b : b + 1, ki], parts[2][0][b : b + 1, ki], sub_bias)
        got = jax.grad(loss, argnums=(0, 1, 2) if bias is None else (0, 1, 2, 3))(
            *map(lambda a: None if a is None else jnp.asarray(a), args)
        )
        grads[0][b, qi] = got[0][0]
        grads[1][b, ki] = got[1][0]
        grads[2][b, ki] = got[2][0]
        if bias is not None:
            g_bias[b][np.ix_(np.arange(g_bias.shape[1]), qi, ki)] = got[3][0]
    if g_bias is not None and np.shape(bias)[0] == 1:
        g_bias = g_bias.sum(axis=0, keepdims=True)
    return grads, g_bias


@pytest.mark.parametrize("case", list(GRAD_CASES))
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_attention_gradients_equal_each_sequence_without_its_padding(case, jit):
    """A -inf or NaN bias (or a mask) at a padded query's row, which the unpadded run never reads,
    sends nothing into the gradients: those of the query, key, value and bias are the per-sequence
    unpadded call's, 0 at the padding, never NaN."""
    same = GRAD_CASES[case][1]
    parts = _grad_inputs(same)
    kwargs, k_tokens = _grad_case(case, same)
    weights = np.random.default_rng(7).normal(size=parts[0][0].shape)
    q_mask = jnp.asarray(Q_TOKENS)[:, :, None, None]
    k_mask = jnp.asarray(k_tokens)[:, :, None, None]

    def loss(q, k, v, bias):
        options = dict(kwargs) if bias is None else {**kwargs, "bias": bias}
        out = mnn.dot_product_attention(
            mj.masked_array(q, q_mask), mj.masked_array(k, k_mask), mj.masked_array(v, k_mask), **options
        )
        return jnp.sum(jnp.where(out.mask, out.data * weights, 0))

    bias = kwargs.get("bias")
    argnums = (0, 1, 2) if bias is None else (0, 1, 2, 3)
    grad = jax.grad(loss, argnums=argnums)
    grad = jax.jit(grad) if jit else grad
    got = grad(*(jnp.asarray(p[0]) for p in parts), bias)
    want, want_bias = _attention_reference_grads(parts, k_tokens, kwargs, weights)
    for g, w in zip(got[:3], want):
        assert np.isfinite(np.asarray(g)).all()
        np.testing.assert_allclose(np.asarray(g), w, **GRAD_TOL)
    if bias is not None:
        assert np.isfinite(np.asarray(got[3])).all()
        np.testing.assert_allclose(np.asarray(got[3]), want_bias, **GRAD_TOL)


@pytest.mark.parametrize("fill", [-np.inf, np.nan], ids=["-inf", "nan"])
def test_maskified_attention_gradients_ignore_the_padded_queries_bias_rows(fill):
    """``maskify(jax.nn.dot_product_attention)`` with a hand-built bias: the same gradients as the
    per-sequence unpadded call."""
    parts = _grad_inputs(False)
    bias = jnp.asarray(_hand_bias(Q_TOKENS, GRAD_K_TOKENS, fill, 1))
    weights = np.random.default_rng(7).normal(size=parts[0][0].shape)
    q_mask = jnp.asarray(Q_TOKENS)[:, :, None, None]
    k_mask = jnp.asarray(GRAD_K_TOKENS)[:, :, None, None]
    attention = mj.maskify(lambda q, k, v, b: jax.nn.dot_product_attention(q, k, v, b))

    def loss(q, k, v, b):
        out = attention(mj.masked_array(q, q_mask), mj.masked_array(k, k_mask), mj.masked_array(v, k_mask), b)
        return jnp.sum(jnp.where(out.mask, out.data * weights, 0))

    got = jax.grad(loss, argnums=(0, 1, 2, 3))(*(jnp.asarray(p[0]) for p in parts), bias)
    want, want_bias = _attention_reference_grads(parts, GRAD_K_TOKENS, {"bias": bias}, weights)
    for g, w in zip(got, [*want, want_bias]):
        assert np.isfinite(np.asarray(g)).all()
        np.testing.assert_allclose(np.asarray(g), w, **GRAD_TOL)


RESIDUAL_CASES = {
    "cross": {},
    "causal": {"is_causal": True},
    "window": {"local_window_size": (2, 1)},
    "bias": {"bias": "bias"},
    "mask": {"mask": "mask"},
}


@pytest.mark.parametrize("case", list(RESIDUAL_CASES))
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_attention_return_residual_equals_each_sequence_without_its_padding(case, jit):
    """``return_residual=True``: ``(output, residual)`` as jax returns them, the residual (each
    query's logsumexp, ``(B, T, N)``) that of the per-sequence unpadded call, masked where the
    output is."""
    q, k, v, parts = _attention_inputs("float64", np.nan, False)
    kwargs = dict(RESIDUAL_CASES[case])
    if kwargs.get("bias") == "bias":
        kwargs["bias"] = jnp.asarray(np.random.default_rng(1).normal(size=(ATT_B, ATT_N, ATT_T, ATT_T)))
    if kwargs.get("mask") == "mask":
        kwargs["mask"] = jnp.asarray(np.random.default_rng(2).random((ATT_B, 1, ATT_T, ATT_T)) < 0.6)
    run = lambda a, b, c: mnn.dot_product_attention(a, b, c, return_residual=True, **kwargs)
    out, residual = jax.jit(run)(q, k, v) if jit else run(q, k, v)
    plain = mnn.dot_product_attention(q, k, v, **kwargs)
    np.testing.assert_array_equal(np.asarray(out.data), np.asarray(plain.data))
    assert isinstance(residual, mj.MaskedArray) and residual.shape == (ATT_B, ATT_T, ATT_N)
    data, valid = np.asarray(residual.data), np.asarray(residual.mask)
    np.testing.assert_array_equal(valid, np.broadcast_to(np.asarray(out.mask)[..., 0], valid.shape))
    assert np.isfinite(data).all() and (data[~valid] == 0).all()
    k_tokens = parts[1][1]
    for b in range(ATT_B):
        qi, ki = np.flatnonzero(Q_TOKENS[b]), np.flatnonzero(k_tokens[b])
        if not len(ki):
            continue
        allowed = np.ones((len(qi), len(ki)), bool)
        if kwargs.get("is_causal"):
            allowed &= ki[None, :] <= qi[:, None]
        if "local_window_size" in kwargs:
            before, after = kwargs["local_window_size"]
            allowed &= (ki[None, :] >= qi[:, None] - before) & (ki[None, :] <= qi[:, None] + after)
        if "mask" in kwargs:
            allowed &= np.asarray(kwargs["mask"])[b, 0][np.ix_(qi, ki)]
        bias = None if "bias" not in kwargs else jnp.asarray(np.asarray(kwargs["bias"])[b : b + 1][:, :, qi][..., ki])
        _, ref = jax.nn.dot_product_attention(
            jnp.asarray(parts[0][0][b : b + 1, qi]),
            jnp.asarray(parts[1][0][b : b + 1, ki]),
            jnp.asarray(parts[2][0][b : b + 1, ki]),
            bias,
            jnp.asarray(allowed)[None, None],
            return_residual=True,
        )
        reach = allowed.any(axis=1)
        np.testing.assert_array_equal(valid[b, qi, 0], reach)
        np.testing.assert_allclose(data[b, qi][reach], np.asarray(ref)[0][reach], rtol=1e-6)


def test_attention_return_residual_without_masks_and_unbatched_is_jax():
    x = jnp.asarray(np.random.default_rng(2).normal(size=(2, 5, 2, 4)), jnp.float32)
    got = mnn.dot_product_attention(x, x, x, is_causal=True, return_residual=True)
    want = jax.nn.dot_product_attention(x, x, x, is_causal=True, return_residual=True)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    tokens = jnp.array([True, True, False, True, True])[:, None, None]
    out, residual = mnn.dot_product_attention(mj.masked_array(x[0], tokens), x[0], x[0], return_residual=True)
    assert out.shape == (5, 2, 4) and residual.shape == (5, 2)
    np.testing.assert_array_equal(np.asarray(residual.mask), np.broadcast_to(np.asarray(tokens)[:, :, 0], (5, 2)))
    _, ref = jax.nn.dot_product_attention(x[0], x[0], x[0], return_residual=True)
    np.testing.assert_allclose(np.asarray(residual.data)[[0, 1, 3, 4]], np.asarray(ref)[[0, 1, 3, 4]], rtol=1e-6)


def test_attention_without_masks_is_jax_and_rejects_bad_shapes():
    x = jnp.asarray(np.random.default_rng(2).normal(size=(2, 5, 2, 4)), jnp.float32)
    np.testing.assert_array_equal(
        np.asarray(mnn.dot_product_attention(x, x, x, is_causal=True)),
        np.asarray(jax.nn.dot_product_attention(x, x, x, is_causal=True)),
    )
    unbatched = mnn.dot_product_attention(mj.masked_array(x[0], jnp.ones((5, 1, 1), bool)), x[0], x[0])
    assert unbatched.shape == (5, 2, 4)
    user = jnp.asarray(np.random.default_rng(3).random((2, 5, 5)) < 0.5) | jnp.eye(5, dtype=bool)
    for user_mask in (user, user[None]):  # an unbatched call's mask, with and without its batch axis
        got = mnn.dot_product_attention(mj.masked_array(x[0], jnp.ones((5, 1, 1), bool)), x[0], x[0], mask=user_mask)
        np.testing.assert_allclose(got.data, jax.nn.dot_product_attention(x[0], x[0], x[0], mask=user_mask), atol=1e-6)
    with pytest.raises(ValueError, match=r"\(B, T, N, H\)"):
        mnn.dot_product_attention(mj.masked_array(x[0, 0], jnp.ones((2, 4), bool)), x, x)
    masked = mj.masked_array(x, jnp.ones((2, 5, 1, 1), bool))
    with pytest.raises(ValueError, match=r"key_value_seq_lengths must hold one integer per sequence, shape \(2,\)"):
        mnn.dot_product_attention(masked, masked, masked, key_value_seq_lengths=jnp.array([3]))
    with pytest.raises(ValueError, match="query_seq_lengths"):
        mnn.dot_product_attention(masked, masked, masked, query_seq_lengths=jnp.array([2.0, 3.0]))


def test_attention_holds_no_more_t_by_s_buffers_than_the_hand_written_call():
    """Compiled for the CPU at T = S = 512, right padding: the masked call holds as many T x S
    arrays as ``jax.nn.dot_product_attention(..., key_value_seq_lengths=...)`` on the padded
    arrays, and its temporary memory is within 1.10x of it."""
    import re

    b, length, heads, dim = 2, 512, 2, 16
    x = jnp.asarray(np.random.default_rng(3).normal(size=(b, length, heads, dim)), jnp.float32)
    lengths = jnp.array([length, length // 2], jnp.int32)
    tokens = (jnp.arange(length)[None] < lengths[:, None])[:, :, None, None]

    def hand(q, k, v, n):
        return jax.nn.dot_product_attention(q, k, v, key_value_seq_lengths=n)

    def masked(q, k, v, m):
        return mnn.dot_product_attention(mj.masked_array(q, m), mj.masked_array(k, m), mj.masked_array(v, m)).data

    def squares(fn, *args):
        compiled = jax.jit(fn).lower(*args).compile()
        shapes = re.findall(r"= \w+\[([\d,]+)\]", compiled.as_text())
        return sum(s.split(",").count(str(length)) >= 2 for s in shapes), compiled.memory_analysis().temp_size_in_bytes

    hand_squares, hand_temp = squares(hand, x, x, x, lengths)
    ours_squares, ours_temp = squares(masked, x, x, x, tokens)
    assert 0 < ours_squares <= hand_squares, (ours_squares, hand_squares)
    assert ours_temp <= 1.10 * hand_temp, (ours_temp, hand_temp)


@pytest.mark.parametrize("case", ["right padding", "scattered padding", "causal self-attention", "grouped-query heads"])
def test_attention_lowered_for_cuda_is_cudnn_flash_attention_with_no_t_by_s_array(case, monkeypatch):
    """Lowered for CUDA with ``implementation="cudnn"``, the masked call is one cuDNN fused
    attention (``__cudnn$fmhaSoftmax``) and holds no T x S array: the padding went as lengths,
    whatever its pattern. No GPU here: jax's cuDNN version and compute-capability probes are
    answered as an H100 with cuDNN 9.10 would answer them; the lowering itself is jax's."""
    from harness import answer_cudnn_probes_as_an_h100, cuda_squares

    answer_cudnn_probes_as_an_h100(monkeypatch)
    b, length = 2, 256
    kv_heads = 2 if case == "grouped-query heads" else 4
    q = jnp.zeros((b, length, 4, 64), jnp.bfloat16)
    kv = jnp.zeros((b, length, kv_heads, 64), jnp.bfloat16)
    if case == "scattered padding":
        tokens = jnp.asarray(np.random.default_rng(0).random((b, length)) < 0.7)
    else:
        tokens = jnp.arange(length)[None] < jnp.array([length, 100])[:, None]
    causal = case == "causal self-attention"

    def masked(q, k, v, m):
        m = m[:, :, None, None]
        qm = mj.masked_array(q, m)
        km, vm = (qm, mj.masked_array(v, m)) if causal else (mj.masked_array(k, m), mj.masked_array(v, m))
        if causal:
            vm = mj.masked_array(v, qm.compact_mask)
        return mnn.dot_product_attention(qm, km, vm, is_causal=causal, implementation="cudnn").data

    text = (
        jax.jit(masked)
        .trace(q, q if causal else kv, q if causal else kv, tokens)
        .lower(lowering_platforms=("cuda",))
        .as_text()
    )
    assert "__cudnn$fmhaSoftmax" in text
    assert not cuda_squares(text, length)
