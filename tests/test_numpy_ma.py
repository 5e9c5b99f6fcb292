"""Property tests: every elementwise, binary and reduction op against numpy.ma.

Shapes 0-d..4-d with size-0 axes, masks all-valid / none-valid / random, dtypes
float32, float64, int32 and bool where meaningful, NaN poisoned under the mask.
numpy.ma's mask is inverted (True = invalid) relative to ours.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from op_table import BY_FAMILY, quiet
from strategies import ALL, assert_masked_equal, masked_arrays, masks, poison, tolerance, values

import masked_jax as mj
import masked_jax.numpy as mnp
from masked_jax.ops._base import normalize_axis
from masked_jax.ops._registry import REGISTRY
from masked_jax.ops.reductions import empty_slices, identity_over_empty


def _check_against(result, ref, expected_valid, dtype):
    ref_valid = ~np.ma.getmaskarray(ref)
    expected_valid = np.broadcast_to(expected_valid, np.shape(result.mask))
    # numpy.ma agrees on validity wherever our semantics says valid.
    assert np.all(np.broadcast_to(ref_valid, expected_valid.shape)[expected_valid]), "numpy.ma masks a valid output"
    assert_masked_equal(result, np.ma.getdata(ref), expected_valid, **tolerance(dtype))
    got = np.asarray(result.data)[np.asarray(result.mask)]
    if got.dtype.kind == "f":
        exp = np.broadcast_to(np.ma.getdata(ref), expected_valid.shape)[expected_valid]
        assert not np.any(np.isnan(got) & ~np.isnan(exp)), "NaN leaked into a valid output"


@pytest.mark.parametrize("op", BY_FAMILY["elementwise"], ids=repr)
@given(data=st.data())
def test_unary_matches_numpy_ma(op, data):
    x = data.draw(masked_arrays(dtypes=op.dtypes, domain=op.domain))
    got = op.fn(x)
    assert isinstance(got, mj.MaskedArray)
    assert got.shape == x.shape
    _check_against(got, op.reference(x.to_numpy_ma()), np.asarray(x.mask), x.dtype)


@st.composite
def _binary_operands(draw, op):
    dtype = draw(st.sampled_from(op.dtypes))
    shapes = draw(hnp.mutually_broadcastable_shapes(num_shapes=2, min_dims=0, max_dims=4, max_side=3))
    operands = []
    for shape, domain in zip(shapes.input_shapes, (op.domain, op.domain2 or op.domain)):
        mask = draw(masks(shape))
        data = poison(draw(values(shape, dtype, domain)), mask)
        operands.append(mj.masked_array(jnp.asarray(data), jnp.asarray(mask)))
    plain = draw(st.sampled_from([None, 0, 1]))  # optionally make one operand a plain array
    return operands, plain


@pytest.mark.parametrize("op", BY_FAMILY["binary"], ids=repr)
@given(data=st.data())
def test_binary_matches_numpy_ma(op, data):
    (a, b), plain = data.draw(_binary_operands(op))
    args = [a, b]
    refs = [a.to_numpy_ma(), b.to_numpy_ma()]
    if plain is not None:
        full = mj.as_masked(args[plain].filled(1))
        args[plain] = full.data
        refs[plain] = full.to_numpy_ma()
    got = op.fn(*args)
    expected_valid = np.logical_and(*[~np.ma.getmaskarray(r) for r in refs])
    assert got.shape == np.broadcast_shapes(a.shape, b.shape)
    _check_against(got, op.reference(*refs), expected_valid, a.dtype)


def _expected_valid(x, kw, min_count):
    axis = kw.get("axis")
    cnt = np.sum(np.asarray(x.mask), axis=axis, keepdims=kw.get("keepdims", False))
    return cnt >= min_count


@pytest.mark.parametrize("op", BY_FAMILY["reductions"], ids=repr)
@given(data=st.data())
def test_reduction_matches_numpy_ma(op, data):
    x = data.draw(masked_arrays(dtypes=op.dtypes, domain=op.domain))
    kw = op.kwargs(data.draw, x.ndim)
    got = op.fn(x, **kw)
    expected_valid = _expected_valid(x, kw, 1 + kw.get("ddof", 0))
    assert np.shape(got.mask) == np.shape(expected_valid)
    try:
        ref = op.reference(x.to_numpy_ma(), **kw)
    except ValueError:
        assert x.size == 0, "numpy.ma only refuses reductions of empty arrays"
        ref = np.ma.masked_all(np.shape(got.data))
    if identity_over_empty(op.name, kw, x.ndim) and empty_slices(x.shape, normalize_axis(kw.get("axis"), x.ndim)):
        # a zero-size slice (nothing masked in it): jnp's identity, valid (numpy.ma masks it); a
        # reduction with no identity (a mean) is masked there, as numpy.ma does
        ref = np.asarray(REGISTRY[op.name].fn(x.data, **kw))  # the jax function itself
        expected_valid = np.ones(np.shape(got.data), bool)
    _check_against(got, ref, expected_valid, x.dtype)
    # Fully masked slices hold a finite documented fill (or ±inf identity for max/min), never NaN.
    assert not np.any(np.isnan(np.asarray(got.data, dtype=np.float64)[~np.asarray(got.mask)]))


@given(x=masked_arrays(dtypes=ALL), data=st.data())
def test_count_matches_numpy_ma(x, data):
    from strategies import axes

    axis = data.draw(axes(x.ndim))
    keepdims = data.draw(st.booleans())
    got = mnp.count(x, axis=axis, keepdims=keepdims)
    ref = np.ma.count(x.to_numpy_ma(), axis=axis, keepdims=keepdims)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(ref))


@pytest.mark.parametrize("name", ["cumsum", "cumprod"])
@given(x=masked_arrays(dtypes=(np.float32, np.float64, np.int32), domain=(0.5, 1.5)), data=st.data())
def test_cumulative_matches_numpy_ma(name, x, data):
    axis = data.draw(st.one_of(st.none(), st.integers(-x.ndim, x.ndim - 1))) if x.ndim else None
    got = getattr(mnp, name)(x, axis=axis)
    ref = quiet(getattr(np.ma, name))(x.to_numpy_ma(), axis=axis)
    _check_against(got, ref, ~np.ma.getmaskarray(ref), x.dtype)


@given(x=masked_arrays(dtypes=(np.float32, np.float64), min_dims=1), data=st.data())
def test_average_matches_numpy_ma(x, data):
    axis = data.draw(st.one_of(st.none(), st.integers(0, x.ndim - 1)))
    w = np.random.default_rng(data.draw(st.integers(0, 99))).uniform(0.5, 2.0, x.shape).astype(x.dtype)
    got = mnp.average(x, axis=axis, weights=jnp.asarray(w))
    ref = quiet(np.ma.average)(x.to_numpy_ma(), axis=axis, weights=w)
    expected_valid = np.sum(np.asarray(x.mask), axis=axis) > 0
    _check_against(got, np.ma.asarray(ref), expected_valid, x.dtype)


@given(x=masked_arrays(dtypes=(np.float32, np.float64), min_dims=1), data=st.data())
def test_average_returned_matches_numpy_ma(x, data):
    """``returned=True``: the average and the sum of the weights that counted (numpy.ma's pair),
    with weights of the array's shape, 1-D along the axis, or none (the count of valid elements)."""
    axis = data.draw(st.one_of(st.none(), st.integers(0, x.ndim - 1)))
    rng = np.random.default_rng(data.draw(st.integers(0, 99)))
    full = rng.uniform(0.5, 2.0, x.shape).astype(x.dtype)
    choices = [None, full] + ([rng.uniform(0.5, 2.0, x.shape[axis]).astype(x.dtype)] if axis is not None else [])
    w = data.draw(st.sampled_from(range(len(choices))))
    weights = choices[w]
    got, got_sum = mnp.average(x, axis=axis, weights=None if weights is None else jnp.asarray(weights), returned=True)
    ref, ref_sum = quiet(np.ma.average)(x.to_numpy_ma(), axis=axis, weights=weights, returned=True)
    counted = np.sum(np.asarray(x.mask), axis=axis)
    _check_against(got, np.ma.asarray(ref), counted > 0, x.dtype)
    ref_sum = np.ma.asarray(ref_sum)
    ref_valid = ~np.ma.getmaskarray(ref_sum)
    assert np.shape(got_sum.data) == np.shape(ref_sum)
    np.testing.assert_array_equal(np.broadcast_to(got_sum.mask, ref_valid.shape), ref_valid | (x.size == 0))
    np.testing.assert_allclose(
        np.asarray(got_sum.data)[ref_valid],
        np.ma.getdata(ref_sum)[ref_valid],
        rtol=1e-5 if x.dtype == np.float32 else 1e-12,
    )


def test_average_takes_weights_of_the_averaged_axes_shape():
    """Weights shaped like the averaged axes (a tuple ``axis``, in its order) weigh those axes, as
    in jnp; a mask on them drops their elements too."""
    a = jnp.arange(24.0).reshape(2, 3, 4)
    w = jnp.arange(1.0, 9.0).reshape(2, 4)
    for axis, weights in (((0, 2), w), ((2, 0), w.T)):
        got = mnp.average(mnp.asarray(a), axis=axis, weights=weights)
        np.testing.assert_allclose(got.data, jnp.average(a, axis=axis, weights=weights), rtol=1e-6)
        assert bool(got.mask.all())
    keep = jnp.arange(8).reshape(2, 4) % 3 != 0
    got = mnp.average(mnp.asarray(a), axis=(0, 2), weights=mj.masked_array(w, keep))
    want = jnp.sum(a * jnp.where(keep, w, 0)[:, None, :], axis=(0, 2)) / jnp.sum(jnp.where(keep, w, 0))
    np.testing.assert_allclose(got.data, want, rtol=1e-6)
    with pytest.raises(ValueError, match="of the averaged axes"):
        mnp.average(mnp.asarray(a), axis=(0, 2), weights=jnp.ones((4, 2)))
    x = mj.masked_array(jnp.array([0.0, 1.0, 2.0, 3.0]), jnp.array([False, True, True, True]))
    avg, total = mnp.average(x, weights=jnp.array([1.0, 1.0, 2.0, 1.0]), returned=True)
    assert (float(avg), float(total)) == (2.0, 4.0)  # numpy.ma's (2.0, 4.0)


@pytest.mark.parametrize("name", ["cov", "corrcoef"])
@given(data=st.data())
def test_cov_and_corrcoef_of_two_masked_arrays_match_numpy_ma(name, data):
    """``cov(x, y)`` / ``corrcoef(x, y)`` with masked entries in both: ``y``'s variables stacked
    after ``x``'s; of the same shape, an observation masked in either is masked in both (numpy.ma's
    common mask); of another shape, each keeps its own."""
    nvars, nobs = data.draw(st.integers(1, 3)), data.draw(st.integers(3, 7))
    rowvar = data.draw(st.booleans())
    y_vars = data.draw(st.sampled_from([nvars, 1, 2]))
    rng = np.random.default_rng(data.draw(st.integers(0, 999)))

    def draw(n):
        shape = (n, nobs) if rowvar else (nobs, n)
        values = rng.normal(size=shape)
        valid = rng.uniform(size=shape) > 0.25
        return mj.masked_array(jnp.asarray(np.where(valid, values, np.nan)), jnp.asarray(valid))

    x, y = draw(nvars), draw(y_vars)
    got = getattr(mnp, name)(x, y, rowvar=rowvar)
    ref = np.ma.asarray(quiet(getattr(np.ma, name))(x.to_numpy_ma(), y.to_numpy_ma(), rowvar=rowvar))
    ref_valid = ~np.ma.getmaskarray(ref)
    got_valid = np.broadcast_to(np.asarray(got.mask), np.shape(ref))
    # valid here is valid there; here also masked where no degree of freedom is left (numpy.ma
    # divides by a negative count there)
    assert not (got_valid & ~ref_valid).any()
    both = got_valid & ref_valid & np.isfinite(np.ma.getdata(ref))
    np.testing.assert_allclose(np.asarray(got.data)[both], np.ma.getdata(ref)[both], rtol=1e-9, atol=1e-12)
    # the jnp function under maskify is the same op
    jnp_fn = getattr(jnp, name)
    same = mj.maskify(lambda a, b: jnp_fn(a, b, rowvar=rowvar))(x, y)
    np.testing.assert_array_equal(np.asarray(same.mask), np.asarray(got.mask))
    np.testing.assert_allclose(np.where(got.mask, same.data, 0), np.where(got.mask, got.data, 0), rtol=1e-12)
