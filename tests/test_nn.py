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
