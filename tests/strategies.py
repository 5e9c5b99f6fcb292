"""Hypothesis strategies for masked arrays: shapes 0-d..4-d (size-0 axes too), masks that are
all-valid, none-valid or random, dtypes float32/float64/int32/bool, NaN poisoned under the mask."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import masked_jax as mj

FLOATS = (np.float32, np.float64)
NUMERIC = FLOATS + (np.int32,)
ALL = NUMERIC + (np.bool_,)


def shapes(min_dims=0, max_dims=4, min_side=0, max_side=3):
    return hnp.array_shapes(min_dims=min_dims, max_dims=max_dims, min_side=min_side, max_side=max_side)


@st.composite
def masks(draw, shape):
    kind = draw(st.sampled_from(["all", "none", "random", "random"]))
    if kind == "all":
        return np.ones(shape, bool)
    if kind == "none":
        return np.zeros(shape, bool)
    return draw(hnp.arrays(np.bool_, shape))


@st.composite
def values(draw, shape, dtype, domain=(-3.0, 3.0)):
    dtype = np.dtype(dtype)
    lo, hi = domain
    if dtype == np.bool_:
        return draw(hnp.arrays(np.bool_, shape))
    if dtype.kind in "iu":
        return draw(hnp.arrays(dtype, shape, elements=st.integers(int(np.ceil(lo)), int(np.floor(hi)))))
    seed = draw(st.integers(0, 2**32 - 1))
    return np.random.default_rng(seed).uniform(lo, hi, size=shape).astype(dtype)


def poison(data, mask):
    """Put NaN (floats) or garbage (ints) under the mask: nothing valid may depend on it."""
    data = np.array(data, copy=True)
    if data.dtype.kind == "f":
        data[~mask] = np.nan
    elif data.dtype.kind in "iu":
        data[~mask] = 7
    return data


@st.composite
def masked_arrays(draw, dtypes=ALL, shape=None, domain=(-3.0, 3.0), **shape_kw):
    dtype = draw(st.sampled_from(dtypes))
    shape = draw(shapes(**shape_kw)) if shape is None else shape
    mask = draw(masks(shape))
    data = poison(draw(values(shape, dtype, domain)), mask)
    return mj.masked_array(jnp.asarray(data), jnp.asarray(mask))


@st.composite
def axes(draw, ndim, allow_none=True, allow_tuple=True, max_tuple=None):
    """None, an int or a tuple of distinct axes (of at most ``max_tuple`` axes, if given)."""
    options = []
    if allow_none:
        options.append(st.none())
    if ndim > 0:
        options.append(st.integers(-ndim, ndim - 1))
        if allow_tuple:
            options.append(
                st.lists(st.integers(0, ndim - 1), min_size=1, max_size=min(ndim, max_tuple or ndim), unique=True).map(
                    tuple
                )
            )
    if not options:
        return None
    return draw(st.one_of(*options))


def tolerance(dtype):
    dtype = np.dtype(dtype)
    if dtype == np.float64:
        return dict(rtol=1e-10, atol=1e-12)
    return dict(rtol=2e-5, atol=2e-5)


def to_ma(x):
    return x.to_numpy_ma()


def assert_masked_equal(result, expected_data, expected_valid, **tol):
    """``result`` has mask ``expected_valid`` and ``expected_data`` at valid entries."""
    got_valid = np.asarray(result.mask)
    expected_valid = np.broadcast_to(np.asarray(expected_valid, bool), got_valid.shape)
    np.testing.assert_array_equal(got_valid, expected_valid, err_msg="mask differs")
    got = np.asarray(result.data)
    exp = np.broadcast_to(np.asarray(expected_data), got.shape)
    if got.dtype.kind in "fc" or np.asarray(exp).dtype.kind in "fc":
        np.testing.assert_allclose(
            np.where(expected_valid, got, 0).astype(np.float64),
            np.where(expected_valid, exp, 0).astype(np.float64),
            equal_nan=True,
            **tol,
        )
    else:
        np.testing.assert_array_equal(np.where(expected_valid, got, 0), np.where(expected_valid, exp, 0))
