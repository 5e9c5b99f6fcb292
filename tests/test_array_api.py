"""masked_jax.numpy as an Array API (2024.12) namespace, checked against the standard itself.

``array_api_2024_12.json`` lists every name and signature of the standard, read off its signature
stubs (``src/array_api_stubs/_2024_12`` of the data-apis/array-api repository). Hypothesis draws
dtypes, shapes and values, special values (+-0, +-inf, NaN) included. With fully valid masks every
function must equal jax.numpy bit for bit; with random masks it must equal numpy.ma on the valid
entries.
"""

from __future__ import annotations

import functools
import inspect
import json
import pathlib
import warnings

import array_api_compat
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import masked_jax as mj
import masked_jax.numpy as mnp
from masked_jax.ops import REGISTRY

SPEC = json.loads((pathlib.Path(__file__).parent / "array_api_2024_12.json").read_text())
MODULES = [m for m in SPEC if m.endswith("_functions")]
FUNCTIONS = {name: sig for m in MODULES for name, sig in SPEC[m].items()}
SPECIALS = [0.0, -0.0, np.inf, -np.inf, np.nan, 1.0, -1.0, 0.5, 2.0, -2.5]

# Elementwise functions, and numpy's name for each (numpy.ma has the same names).
UNARY = [
    "abs",
    "acos",
    "acosh",
    "asin",
    "asinh",
    "atan",
    "atanh",
    "ceil",
    "cos",
    "cosh",
    "exp",
    "expm1",
    "floor",
    "isfinite",
    "isinf",
    "isnan",
    "log",
    "log1p",
    "log2",
    "log10",
    "negative",
    "positive",
    "round",
    "sign",
    "signbit",
    "sin",
    "sinh",
    "sqrt",
    "square",
    "tan",
    "tanh",
    "trunc",
]
BINARY = [
    "add",
    "atan2",
    "copysign",
    "divide",
    "equal",
    "floor_divide",
    "greater",
    "greater_equal",
    "hypot",
    "less",
    "less_equal",
    "logaddexp",
    "maximum",
    "minimum",
    "multiply",
    "not_equal",
    "pow",
    "remainder",
    "subtract",
]
NUMPY_NAME = {
    "acos": "arccos",
    "acosh": "arccosh",
    "asin": "arcsin",
    "asinh": "arcsinh",
    "atan": "arctan",
    "atanh": "arctanh",
    "atan2": "arctan2",
    "pow": "power",
}
REDUCTIONS = ["sum", "prod", "max", "min", "mean", "std", "var"]
# Float sums and means equal jax.numpy up to the order of summation: masked_jax sums value and count
# in one variadic reduction (several times faster on CPU), which XLA orders differently, and jnp's
# division by a constant count becomes a product with its reciprocal. max, min and prod: bit for bit.
SUMS = ("sum", "mean", "std", "var")


def test_every_name_of_the_standard_is_in_the_namespace():
    missing = [n for n in [*FUNCTIONS, *SPEC["constants"], *SPEC["dtypes"]] if not hasattr(mnp, n)]
    missing += [f"linalg.{n}" for n in SPEC["linalg"] if not hasattr(mnp.linalg, n)]
    missing += [f"fft.{n}" for n in SPEC["fft"] if not hasattr(mnp.fft, n)]
    assert not missing, f"masked_jax.numpy lacks {missing}"
    assert mnp.__array_api_version__ == jnp.__array_api_version__ == "2024.12"
    # 2024.12's additions over 2023.12, all in the namespace (jax.numpy has them too)
    for name in ("nextafter", "reciprocal", "take_along_axis", "count_nonzero", "cumulative_prod", "diff"):
        assert name in FUNCTIONS and hasattr(mnp, name) and hasattr(jnp, name), name
    assert mnp.__array_namespace_info__().default_dtypes()["real floating"] in (jnp.float32, jnp.float64)
    for name in SPEC["dtypes"] + SPEC["constants"]:
        assert getattr(mnp, name) is getattr(jnp, name if name != "bool" else "bool_") or (
            name in ("e", "pi", "inf", "nan") and np.array_equal(getattr(mnp, name), getattr(jnp, name), equal_nan=True)
        )


def test_the_array_object_has_every_attribute_of_the_standard():
    x = mj.masked_array(jnp.arange(6.0).reshape(2, 3), jnp.arange(6).reshape(2, 3) % 2 == 0)
    missing = [n for n in SPEC["array_object"] if not hasattr(x, n)]
    assert not missing, missing
    for version in ("2024.12", "2023.12"):
        assert x.__array_namespace__(api_version=version) is mnp
    assert x.__array_namespace__() is mnp
    with pytest.raises(ValueError, match="2024.12"):
        x.__array_namespace__(api_version="2099.01")
    assert x.device == x.data.device and x.to_device(jax.devices()[0]).device == jax.devices()[0]
    np.testing.assert_array_equal(x.mT.mask, x.mask.T)
    np.testing.assert_array_equal(x.mT.data, x.data.T)
    with pytest.raises(TypeError, match="immutable"):
        x[0, 0] = 1.0
    with pytest.raises(TypeError, match="DLPack carries no mask"):
        x.__dlpack__()
    assert x.__dlpack_device__() == x.data.__dlpack_device__()
    full = mnp.asarray(jnp.arange(3.0))  # fully valid: its data goes through DLPack, to numpy too
    np.testing.assert_array_equal(np.from_dlpack(full), np.arange(3.0))
    np.testing.assert_array_equal(mnp.from_dlpack(full).data, np.arange(3.0))


@pytest.mark.parametrize("name", sorted(FUNCTIONS))
def test_signature_takes_the_standards_parameters(name):
    """Positional parameters of the standard can be passed positionally, keyword-only ones by name."""
    fn, sig = getattr(mnp, name), FUNCTIONS[name]
    if name == "__array_namespace_info__":
        return
    params = inspect.signature(fn).parameters
    kinds = [p.kind for p in params.values()]
    var_kw = inspect.Parameter.VAR_KEYWORD in kinds
    positional = [p for p in params.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if inspect.Parameter.VAR_POSITIONAL not in kinds:
        assert len(positional) >= len(sig["positional_only"]) + len(sig["args"]), (name, list(params))
    for kw in sig["args"] + sig["keyword_only"]:
        assert kw in params or var_kw, f"{name} does not take the standard's {kw}="


def test_array_api_compat_finds_the_masked_namespace():
    x = mj.masked_array(jnp.ones(3), jnp.array([True, False, True]))
    assert array_api_compat.array_namespace(x) is mnp
    assert array_api_compat.array_namespace(x, mnp.asarray([1.0])) is mnp


def _special_floats(dtype):
    # (no subnormals: XLA on CPU flushes them to zero, numpy does not)
    return st.one_of(
        st.sampled_from(SPECIALS), st.floats(-5, 5, width=np.dtype(dtype).itemsize * 8, allow_subnormal=False)
    )


@st.composite
def _operand(draw, dtype=None, shape=None):
    dtype = dtype or draw(st.sampled_from([np.float32, np.float64]))
    shape = shape if shape is not None else draw(hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=4))
    data = draw(hnp.arrays(dtype, shape, elements=_special_floats(dtype)))
    mask = draw(hnp.arrays(np.bool_, shape))
    return data, mask


def _same_bits(got, want):
    got, want = np.asarray(got), np.asarray(want)
    assert got.dtype == want.dtype and got.shape == want.shape, (got.dtype, want.dtype, got.shape, want.shape)
    np.testing.assert_array_equal(got, want)
    if got.dtype.kind == "f":  # the sign of zero too
        np.testing.assert_array_equal(np.signbit(got), np.signbit(want))


FEW = settings(max_examples=max(2, settings().max_examples // 3))  # each example compiles every function


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_special_values_equal_jax_numpy_bit_for_bit(dtype):
    """+-0, +-inf, NaN and ordinary values through every elementwise function, every pair of them
    through every binary function, fully valid: the same bits as jax.numpy (the sign of zero too)."""
    x = np.array(SPECIALS, dtype)
    a, b = x[:, None], x[None, :]
    with np.errstate(all="ignore"):
        for name in UNARY:
            _same_bits(getattr(mnp, name)(mnp.asarray(x)).data, getattr(jnp, name)(jnp.asarray(x)))
        for name in BINARY:
            got = getattr(mnp, name)(mnp.asarray(a), mnp.asarray(b))
            assert bool(got.mask.all()), name
            _same_bits(got.data, getattr(jnp, name)(jnp.asarray(a), jnp.asarray(b)))


@pytest.mark.parametrize("name", UNARY)
@FEW
@given(op=_operand())
def test_unary_on_valid_equals_jax_numpy_and_on_masked_equals_numpy_ma(name, op):
    data, mask = op
    with np.errstate(all="ignore"):
        full = getattr(mnp, name)(mnp.asarray(data))
        assert bool(jnp.all(full.mask))
        _same_bits(full.data, getattr(jnp, name)(jnp.asarray(data)))
        got = getattr(mnp, name)(mj.masked_array(data, mask))
        np.testing.assert_array_equal(got.mask, mask)
        np_name = NUMPY_NAME.get(name, name)  # numpy.ma's function, or numpy's ufunc on a numpy.ma array
        ref = (getattr(np.ma, np_name, None) or getattr(np, np_name))(np.ma.masked_array(data, ~mask))
        where = mask & ~np.ma.getmaskarray(ref)  # numpy.ma also masks out-of-domain results
        rtol = 1e-6 if data.dtype == np.float32 else 1e-12
        np.testing.assert_allclose(np.asarray(got.data)[where], np.ma.getdata(ref)[where], rtol=rtol, atol=1e-30)


@pytest.mark.parametrize("name", BINARY)
@FEW
@given(data=st.data())
def test_binary_on_valid_equals_jax_numpy_and_on_masked_equals_numpy_ma(name, data):
    dtype = data.draw(st.sampled_from([np.float32, np.float64]))
    shape = data.draw(hnp.array_shapes(min_dims=1, max_dims=2, min_side=1, max_side=4))
    (a, ma), (b, mb) = data.draw(_operand(dtype, shape)), data.draw(_operand(dtype, shape[-1:]))  # broadcast
    with np.errstate(all="ignore"):
        full = getattr(mnp, name)(mnp.asarray(a), mnp.asarray(b))
        _same_bits(full.data, getattr(jnp, name)(jnp.asarray(a), jnp.asarray(b)))
        got = getattr(mnp, name)(mj.masked_array(a, ma), mj.masked_array(b, mb))
        np.testing.assert_array_equal(got.mask, ma & mb)
        ref = getattr(np, NUMPY_NAME.get(name, name))(a, b)
        rtol = 1e-6 if dtype == np.float32 else 1e-12
        np.testing.assert_allclose(
            np.asarray(got.data)[ma & mb], np.broadcast_to(ref, got.shape)[ma & mb], rtol=rtol, atol=1e-30
        )


@pytest.mark.parametrize("name", REDUCTIONS)
@given(data=st.data())
def test_reductions_on_valid_equal_jax_numpy_and_on_masked_equal_numpy_ma(name, data):
    dtype = data.draw(st.sampled_from([np.float32, np.float64]))
    shape = data.draw(hnp.array_shapes(min_dims=1, max_dims=3, min_side=1, max_side=4))
    x, m = data.draw(_operand(dtype, shape))
    x = np.where(np.isfinite(x), x, 1.5).astype(dtype)  # numpy.ma does not mask inf - inf; keep both finite
    axis = data.draw(st.sampled_from([None, *range(len(shape))]))
    with np.errstate(all="ignore"):
        full = getattr(mnp, name)(mnp.asarray(x), axis=axis)
        want = getattr(jnp, name)(jnp.asarray(x), axis=axis)
        if name in SUMS:  # the same sum in another order: within the rounding of reordering it
            n = x.size if axis is None else x.shape[axis]
            scale = np.sum(np.abs(x), axis=axis) if name == "sum" else np.abs(np.asarray(want))
            bound = 4 * n * np.finfo(dtype).eps * scale
            assert np.all(np.abs(np.asarray(full.data, np.float64) - np.asarray(want, np.float64)) <= bound)
        else:
            _same_bits(full.data, want)
        got = getattr(mnp, name)(mj.masked_array(x, m), axis=axis)
        ref = getattr(np.ma, name)(np.ma.masked_array(x.astype(np.float64), ~m), axis=axis)
    ref_mask = np.ma.getmaskarray(ref) if axis is not None else np.array(not m.any())
    valid = np.asarray(got.mask) & ~ref_mask
    rtol = 1e-4 if dtype == np.float32 else 1e-9
    np.testing.assert_allclose(np.asarray(got.data, np.float64)[valid], np.ma.getdata(ref)[valid], rtol=rtol, atol=1e-5)
    if name not in ("std", "var"):  # a single valid entry: numpy.ma gives var 0, we too (ddof 0)
        np.testing.assert_array_equal(np.asarray(got.mask), ~ref_mask)


def test_creation_functions_are_fully_valid_and_equal_jax_numpy():
    x = mj.masked_array(jnp.arange(6.0).reshape(2, 3), jnp.arange(6).reshape(2, 3) > 2)
    cases = {
        "arange": ((2, 9, 3), {}),
        "eye": ((3,), {"k": 1}),
        "full": (((2, 2), 7), {}),
        "linspace": ((0.0, 1.0, 5), {"endpoint": False}),
        "ones": (((2, 3),), {"dtype": jnp.int32}),
        "zeros": (((2,),), {}),
        "asarray": (([1, 2],), {"dtype": jnp.float32}),
    }
    for name, (args, kw) in cases.items():
        got = getattr(mnp, name)(*args, **kw)
        assert isinstance(got, mj.MaskedArray) and bool(got.mask.all()), name
        _same_bits(got.data, getattr(jnp, name)(*args, **kw))
    for name in ("zeros_like", "ones_like", "empty_like"):
        got = getattr(mnp, name)(x)
        assert got.shape == x.shape and got.dtype == x.dtype and bool(got.mask.all()), name
    assert bool(mnp.full_like(x, 3.0).mask.all()) and float(mnp.full_like(x, 3.0).data[0, 0]) == 3.0
    assert mnp.empty((2, 2)).shape == (2, 2)
    assert mnp.asarray(x) is not x and np.array_equal(mnp.asarray(x).mask, x.mask)  # keeps the mask
    np.testing.assert_array_equal(mnp.from_dlpack(np.arange(3.0)).data, np.arange(3.0))
    # tril/triu: zeros written outside the triangle, the mask unchanged (a constant never makes a
    # masked entry valid), as maskify gives for jax.numpy's own tril/triu
    for name, k in (("tril", 0), ("triu", 1)):
        got = getattr(mnp, name)(x, k=k)
        np.testing.assert_array_equal(got.data, getattr(jnp, name)(x.data, k=k))
        np.testing.assert_array_equal(got.mask, x.mask)
        want = mj.maskify(lambda v, name=name, k=k: getattr(jnp, name)(v, k=k))(x)
        np.testing.assert_array_equal(got.filled(-1), want.filled(-1))
    gx, gy = mnp.meshgrid(x[0], mnp.arange(2.0))
    np.testing.assert_array_equal(gx.mask, np.broadcast_to(np.asarray(x.mask[0]), (2, 3)))
    assert bool(gy.mask.all())


def test_dtype_functions_take_masked_arrays_for_their_dtypes():
    x = mnp.asarray([1, 2], dtype=mnp.int16)
    assert mnp.result_type(x, mnp.float32) == jnp.result_type(jnp.int16, jnp.float32)
    assert mnp.can_cast(x, mnp.int32) and not mnp.can_cast(mnp.float32, mnp.int8)
    assert mnp.iinfo(x).bits == 16 and mnp.finfo(mnp.float32).eps == jnp.finfo(jnp.float32).eps
    assert mnp.isdtype(mnp.float32, ("real floating", "complex floating")) and not mnp.isdtype(mnp.int8, "bool")
    assert mnp.astype(x, mnp.float32).dtype == jnp.float32
    for a, b in [(jnp.int8, jnp.float32), (jnp.int16, jnp.uint8), (jnp.float32, jnp.float64), (jnp.bool_, jnp.int32)]:
        l, r = jnp.ones((2, 1), a), jnp.ones(3, b)  # promotion and broadcasting as in jax.numpy
        got = mnp.multiply(mnp.asarray(l), mnp.asarray(r))
        assert got.dtype == jnp.multiply(l, r).dtype and got.shape == (2, 3), (a, b)


def test_compositions_equal_numpy_ma_on_valid_entries(rng):
    data = rng.normal(size=(4, 5))
    mask = rng.random((4, 5)) > 0.3
    x, ref = mj.masked_array(data, mask), np.ma.masked_array(data, ~mask)
    np.testing.assert_allclose(mnp.cumulative_sum(x, axis=1).filled(0), np.ma.cumsum(ref, axis=1).filled(0))
    np.testing.assert_array_equal(mnp.cumulative_sum(x, axis=1).mask, mask)
    np.testing.assert_allclose(mnp.cumulative_prod(x, axis=1).filled(0), np.ma.cumprod(ref, axis=1).filled(0))
    np.testing.assert_array_equal(mnp.count_nonzero(x, axis=0), np.ma.count(np.ma.masked_equal(ref, 0), axis=0))
    assert bool(mnp.cumulative_prod(x, axis=1, include_initial=True).data[:, 0].all())
    first = mnp.cumulative_sum(x, axis=0, include_initial=True)
    assert first.shape == (5, 5) and bool(first.mask[0].all()) and float(jnp.abs(first.data[0]).sum()) == 0.0
    y = mj.masked_array(rng.normal(size=(4, 5)), rng.random((4, 5)) > 0.3)
    both = mask & np.asarray(y.mask)
    vd = mnp.vecdot(x, y)
    np.testing.assert_allclose(vd.filled(0), np.where(both, data * np.asarray(y.data), 0).sum(1))
    np.testing.assert_array_equal(vd.mask, both.any(1))
    sq = mj.masked_array(data[:, :4], mask[:, :4])
    np.testing.assert_allclose(mnp.linalg.trace(sq).data, np.where(np.diag(mask[:, :4]), np.diag(data[:, :4]), 0).sum())
    np.testing.assert_allclose(mnp.linalg.matrix_norm(x).data, np.sqrt((np.where(mask, data, 0) ** 2).sum()))
    ints = mj.masked_array(np.array([3, 1, 3, 7, 1, 2]), np.array([True, True, True, False, True, False]))
    r = mnp.unique_all(ints)
    ref_vals, ref_first, ref_inv, ref_counts = np.unique(
        np.array([3, 1, 3, 1]), return_index=True, return_inverse=True, return_counts=True
    )
    np.testing.assert_array_equal(r.values.data, ref_vals)
    np.testing.assert_array_equal(r.counts, ref_counts)
    np.testing.assert_array_equal(r.indices, np.flatnonzero(np.asarray(ints.mask))[ref_first])
    np.testing.assert_array_equal(np.asarray(r.inverse_indices.data)[np.asarray(ints.mask)], ref_inv)
    np.testing.assert_array_equal(r.inverse_indices.mask, ints.mask)
    np.testing.assert_array_equal(
        mnp.nonzero(mj.masked_array(np.array([0.0, 2.0, 3.0]), np.array([True, True, False])))[0], [1]
    )
    srt = mj.masked_array(np.array([1.0, 50.0, 3.0, 5.0, 9.0]), np.array([True, False, True, True, True]))
    q = np.array([0.0, 3.0, 4.0, 10.0])
    for side in ("left", "right"):
        np.testing.assert_array_equal(
            mnp.searchsorted(srt, q, side=side).data, np.searchsorted(np.array([1.0, 3.0, 5.0, 9.0]), q, side=side)
        )
    assert [a.shape for a in mnp.broadcast_arrays(mnp.zeros((2, 1)), jnp.zeros(3))] == [(2, 3), (2, 3)]
    parts = mnp.unstack(x, axis=1)
    assert len(parts) == 5 and np.array_equal(parts[2].mask, mask[:, 2])
    c = mnp.linalg.cross(
        mj.masked_array(np.eye(3), np.array([[True] * 3, [True, False, True], [True] * 3])),
        mnp.asarray(np.ones((3, 3))),
    )
    np.testing.assert_array_equal(c.mask.all(axis=1), [True, False, True])
    np.testing.assert_allclose(c.data[0], np.cross(np.eye(3)[0], np.ones(3)))


def test_functions_without_a_masked_meaning_raise_and_accept_fully_valid_input():
    a = jnp.array([[2.0, 1.0], [1.0, 3.0]])
    np.testing.assert_array_equal(mnp.linalg.inv(mnp.asarray(a)).data, jnp.linalg.inv(a))
    np.testing.assert_array_equal(mnp.fft.fft(mnp.asarray(a)).data, jnp.fft.fft(a))
    masked = mj.masked_array(a, jnp.array([[True, False], [True, True]]))
    for fn in (mnp.linalg.inv, mnp.linalg.det, mnp.linalg.svd, mnp.fft.fft, mnp.fft.rfft):
        with pytest.raises(TypeError, match="has no masked meaning.*filled"):
            fn(masked)
    with pytest.raises(TypeError, match="no masked meaning"):  # a traced mask is not known to be all valid
        jax.jit(mnp.linalg.det)(mj.masked_array(a, jnp.ones(a.shape, bool)))
    # a mask-less array is statically valid, under jit too
    np.testing.assert_allclose(jax.jit(mnp.linalg.det)(mnp.asarray(a)).data, jnp.linalg.det(a), rtol=1e-6)
    with pytest.raises(ValueError, match="3 components"):
        mnp.linalg.cross(mnp.zeros((2, 2)), mnp.zeros((2, 2)))
    with pytest.raises(ValueError, match="x1 must be 1-d"):
        mnp.searchsorted(mnp.zeros((2, 2)), mnp.zeros(2))
    with pytest.raises(ValueError, match="axis is required"):
        mnp.cumulative_sum(mnp.zeros((2, 2)))
    with pytest.raises(TypeError, match="concrete"):
        jax.jit(mnp.unique_values)(mnp.asarray([1, 2]))


# -- beyond the standard: jax.numpy functions with a masked meaning --------------------------------


def _ma(x):
    return np.ma.masked_array(np.asarray(x.data), ~np.asarray(x.mask))


def _equal_on_valid(got, ref, rtol=1e-12):
    ref_mask = np.ma.getmaskarray(ref)
    np.testing.assert_array_equal(~np.asarray(got.mask), ref_mask)
    np.testing.assert_allclose(np.asarray(got.data)[~ref_mask], np.ma.getdata(ref)[~ref_mask], rtol=rtol)


@pytest.mark.parametrize("name", ["sum", "prod", "mean", "max", "min", "std", "var", "median"])
def test_nan_reductions_treat_nan_as_masked(name, rng):
    data = rng.normal(size=(4, 6))
    data[rng.random((4, 6)) < 0.3] = np.nan
    mask = rng.random((4, 6)) > 0.2
    data[0], mask[0] = np.nan, True  # a row with no valid non-NaN entry: masked, not NaN
    got = getattr(mnp, f"nan{name}")(mj.masked_array(data, mask), axis=1)
    ref = getattr(np.ma, name)(np.ma.masked_array(data, ~mask | np.isnan(data)), axis=1)
    _equal_on_valid(got, ref)
    valid = np.asarray(got.mask)
    with warnings.catch_warnings():  # numpy warns of the all-NaN row, which is masked here
        warnings.simplefilter("ignore", RuntimeWarning)
        want = getattr(np, f"nan{name}")(np.where(mask, data, np.nan), axis=1)
    np.testing.assert_allclose(np.asarray(got.data)[valid], want[valid])


def test_stacking_and_splitting_match_numpy_ma(rng):
    a = mj.masked_array(rng.normal(size=(2, 3)), rng.random((2, 3)) > 0.4)
    b = mj.masked_array(rng.normal(size=(2, 3)), rng.random((2, 3)) > 0.4)
    v = mj.masked_array(rng.normal(size=3), rng.random(3) > 0.4)
    for name, args in [
        ("hstack", [a, b]),
        ("vstack", [a, b]),
        ("dstack", [a, b]),
        ("column_stack", [v, v]),
        ("hstack", [v, v]),
        ("vstack", [v, a]),
        ("dstack", [v, v]),
    ]:
        _equal_on_valid(getattr(mnp, name)(args), getattr(np.ma, name)([_ma(x) for x in args]))
    big = mj.masked_array(rng.normal(size=(5, 4, 2)), rng.random((5, 4, 2)) > 0.4)
    for name, args in [
        ("array_split", (big, 3)),
        ("array_split", (big, [1, 3])),
        ("hsplit", (big, 2)),
        ("vsplit", (big, [2])),
        ("dsplit", (big, 2)),
    ]:
        got, want = getattr(mnp, name)(*args), getattr(np, name)(np.asarray(big.data), *args[1:])
        wmask = getattr(np, name)(np.asarray(big.mask), *args[1:])
        assert len(got) == len(want)
        for g, w, wm in zip(got, want, wmask):
            np.testing.assert_array_equal(g.data, w)
            np.testing.assert_array_equal(g.mask, wm)


def test_differences_diagonals_and_products_match_numpy_ma(rng):
    x = mj.masked_array(rng.normal(size=(3, 5)), rng.random((3, 5)) > 0.3)
    for n in (1, 2):
        _equal_on_valid(mnp.diff(x, n=n), np.ma.diff(_ma(x), n=n))
        _equal_on_valid(mnp.diff(x, axis=0), np.ma.diff(_ma(x), axis=0))
    np.testing.assert_array_equal(mnp.diff(x, prepend=0.0).shape, (3, 5))
    sq = mj.masked_array(rng.normal(size=(4, 4)), rng.random((4, 4)) > 0.3)
    np.testing.assert_allclose(mnp.trace(sq).data, np.ma.trace(_ma(sq)))
    np.testing.assert_allclose(mnp.trace(sq, offset=1).data, np.ma.trace(_ma(sq), offset=1))
    _equal_on_valid(mnp.diagonal(sq, 1), np.ma.diagonal(_ma(sq), 1))
    a = mj.masked_array(rng.normal(size=(4, 3)), np.array([[True] * 3, [True, False, True], [True] * 3, [True] * 3]))
    got = mnp.cross(a, rng.normal(size=3) * np.ones((4, 1)))
    np.testing.assert_array_equal(np.asarray(got.mask).all(1), [True, False, True, True])
    c = mnp.cross(mnp.moveaxis(a, 0, 1), mnp.asarray(np.ones((3, 4))), axis=0)
    np.testing.assert_allclose(np.asarray(c.data)[:, 0], np.cross(np.asarray(a.data)[0], np.ones(3)))


@pytest.mark.parametrize("mode", ["full", "same", "valid"])
@pytest.mark.parametrize("propagate_mask", [True, False])
@pytest.mark.parametrize("name", ["convolve", "correlate"])
def test_convolutions_match_numpy_ma(name, mode, propagate_mask, rng):
    a = mj.masked_array(rng.normal(size=7), np.array([True, True, False, True, True, True, False]))
    v = mj.masked_array(rng.normal(size=3), np.array([True, False, True]))
    got = getattr(mnp, name)(a, v, mode=mode, propagate_mask=propagate_mask)
    ref = getattr(np.ma, name)(_ma(a), _ma(v), mode=mode, propagate_mask=propagate_mask)
    _equal_on_valid(got, ref, rtol=1e-10)


def test_membership_binning_and_interpolation_over_valid_entries(rng):
    e = mj.masked_array(np.array([1, 4, 7, 9, 4]), np.array([True, True, False, True, True]))
    t = mj.masked_array(np.array([4, 9, 7]), np.array([True, False, True]))
    got = mnp.isin(e, t)
    np.testing.assert_array_equal(got.mask, e.mask)
    np.testing.assert_array_equal(np.asarray(got.data)[np.asarray(e.mask)], np.isin([1, 4, 9, 4], [4, 7]))
    np.testing.assert_array_equal(
        np.asarray(mnp.isin(e, t, invert=True).data)[np.asarray(e.mask)], ~np.isin([1, 4, 9, 4], [4, 7])
    )
    x = mj.masked_array(rng.uniform(0, 4, size=20), rng.random(20) > 0.3)
    valid = np.asarray(x.data)[np.asarray(x.mask)]
    bins = np.array([0.5, 1.0, 2.5, 3.0])
    np.testing.assert_array_equal(np.asarray(mnp.digitize(x, bins).data)[np.asarray(x.mask)], np.digitize(valid, bins))
    counts, edges = mnp.histogram(x, bins=5)
    ref_counts, ref_edges = np.histogram(valid, bins=5)
    np.testing.assert_allclose(counts, ref_counts)
    np.testing.assert_allclose(edges, ref_edges, rtol=1e-12)
    ids = mj.masked_array(np.array([0, 3, 3, 1, 7]), np.array([True, True, True, True, False]))
    np.testing.assert_array_equal(mnp.bincount(ids), np.bincount([0, 3, 3, 1]))
    w = mj.masked_array(np.array([1.0, 2.0, 3.0, 4.0, 5.0]), np.array([True, False, True, True, True]))
    np.testing.assert_allclose(
        mnp.bincount(ids, weights=w, length=8), np.bincount([0, 3, 1], [1.0, 3.0, 4.0], minlength=8)
    )
    np.testing.assert_array_equal(jax.jit(lambda i: mnp.bincount(i, length=4))(ids), np.bincount([0, 3, 3, 1]))
    xp = mj.masked_array(np.array([0.0, 1.0, 2.0, 3.0, 4.0]), np.array([False, True, False, True, True]))
    fp = np.array([50.0, 10.0, 70.0, 30.0, 20.0])
    q = mj.masked_array(np.array([0.0, 1.5, 2.0, 3.5, 9.0]), np.array([True, True, True, True, False]))
    got = mnp.interp(q, xp, fp)
    np.testing.assert_allclose(
        np.asarray(got.data)[:4], np.interp([0.0, 1.5, 2.0, 3.5], [1.0, 3.0, 4.0], [10.0, 30.0, 20.0])
    )
    np.testing.assert_array_equal(got.mask, q.mask)
    np.testing.assert_allclose(jax.jit(mnp.interp)(q, xp, fp).data, got.data)
    poisoned = mj.masked_array(np.where(np.asarray(q.mask), np.asarray(q.data), np.nan), q.mask)
    g = mj.grad(
        lambda v: mnp.sum(
            mnp.interp(v, mj.masked_array(np.where(np.asarray(xp.mask), np.asarray(xp.data), np.nan), xp.mask), fp)
        )
    )(poisoned)
    assert np.isfinite(np.asarray(g.data)).all()  # NaN under either mask reaches no gradient
    vals, counts = mnp.unique(e, return_counts=True)
    np.testing.assert_array_equal(vals.data, [1, 4, 9])
    np.testing.assert_array_equal(counts, [1, 2, 1])
    with pytest.raises(TypeError, match="fully valid"):
        mnp.digitize(x, mj.masked_array(bins, np.array([True, False, True, True])))
    with pytest.raises(ValueError, match="1-d"):
        mnp.convolve(mnp.zeros((2, 2)), mnp.zeros(2))
    with pytest.raises(TypeError, match="length="):
        jax.jit(mnp.bincount)(ids)


def test_more_jax_numpy_functions_match_numpy_ma(rng):
    """diag, diagflat, append, ediff1d as numpy.ma's; kron, matvec, vecmat, select and allclose by
    their definitions on the valid entries; argwhere and flatnonzero over valid nonzero entries;
    each eagerly and under jit, NaN under the mask reaching no valid value."""
    v = mj.masked_array(np.where([1, 0, 1], rng.normal(size=3), np.nan), np.array([True, False, True]))
    m = mj.masked_array(rng.normal(size=(3, 4)), rng.random((3, 4)) > 0.3)
    for k in (0, 1, -2):
        _equal_on_valid(mnp.diag(v, k), np.ma.diag(_ma(v), k))
        np.testing.assert_array_equal(mnp.diag(v, k).mask, ~np.ma.getmaskarray(np.ma.diag(_ma(v), k)))
        _equal_on_valid(mnp.diag(m, k), np.ma.diag(_ma(m), k))
    np.testing.assert_array_equal(mnp.diagflat(m[:2, :2]).mask, ~np.diagflat(~np.asarray(m.mask)[:2, :2]))
    _equal_on_valid(mnp.append(m, v), np.ma.append(_ma(m), _ma(v)))
    _equal_on_valid(mnp.append(m, m[:1], axis=0), np.ma.append(_ma(m), _ma(m[:1]), axis=0))
    _equal_on_valid(mnp.ediff1d(m, to_end=v, to_begin=[7.0]), np.ma.ediff1d(_ma(m), to_end=_ma(v), to_begin=[7.0]))
    b = mj.masked_array(rng.normal(size=(2, 3)), rng.random((2, 3)) > 0.3)
    got = mnp.kron(m, b)
    np.testing.assert_array_equal(got.mask, np.kron(np.asarray(m.mask), np.asarray(b.mask)).astype(bool))
    np.testing.assert_allclose(got.filled(0), np.kron(m.filled(0), b.filled(0)))
    assert mnp.kron(v, b).shape == jnp.kron(v.data, b.data).shape
    x = mj.masked_array(rng.normal(size=4), np.array([True, False, True, True]))
    for f, want in [
        (lambda a, w: mnp.matvec(a, w), mnp.matmul(m, x)),
        (lambda a, w: mnp.vecmat(w[:3], a), mnp.matmul(x[:3], m)),
    ]:
        for g in (f, jax.jit(f)):
            got = g(m, x)
            np.testing.assert_array_equal(got.mask, want.mask)
            np.testing.assert_allclose(got.filled(0), want.filled(0))
    cond = mj.masked_array(np.array([True, False, True, False]), np.array([True, True, False, True]))
    picked = mnp.select([cond, x > 0], [x * 2, x], default=-1.0)
    np.testing.assert_array_equal(picked.mask, [True, False, False, True])
    want = np.select(
        [np.asarray(cond.data), np.asarray(x.data) > 0], [2 * np.asarray(x.data), np.asarray(x.data)], -1.0
    )
    np.testing.assert_allclose(np.asarray(picked.data)[[0, 3]], want[[0, 3]])
    near = mj.masked_array(np.array([1.0, 5.0, 2.0]), np.array([True, False, True]))
    assert bool(mnp.allclose(near, np.array([1.0, 0.0, 2.0 + 1e-9]))) and not bool(mnp.allclose(near, np.zeros(3)))
    assert not bool(mnp.allclose(mj.masked_array(np.ones(2), np.zeros(2, bool)), np.ones(2)).mask)  # nothing valid
    nz = mj.masked_array(np.array([[0.0, 2.0], [3.0, np.nan]]), np.array([[True, True], [False, True]]))
    np.testing.assert_array_equal(mnp.argwhere(nz), [[0, 1], [1, 1]])
    np.testing.assert_array_equal(jax.jit(lambda a: mnp.flatnonzero(a, size=3, fill_value=-1))(nz), [1, 3, -1])
    assert mnp.shape(m) == (3, 4) and mnp.ndim(m) == 2 and mnp.size(m) == 12 and mnp.size(m, -1) == 4
    assert mnp.copy(m) is not m and bool((mnp.copy(m) == m).all())
    with pytest.raises(ValueError, match="1-d or 2-d"):
        mnp.diag(mnp.zeros((2, 2, 2)))
    with pytest.raises(ValueError, match="same length"):
        mnp.select([cond], [x, x])
    with pytest.raises(TypeError, match="bool"):
        mnp.select([x], [x])


def test_the_namespace_covers_more_of_jax_numpy():
    """Counted by name: jax.numpy's public functions (its dtype classes aside) that masked_jax.numpy
    also provides. Before the Array API layer: 133 of 344; with it: 213; with the remaining
    elementwise functions, shape functions and products: 260."""
    names = [
        n
        for n in dir(jnp)
        if not n.startswith("_")
        and inspect.isfunction(getattr(jnp, n))
        or (
            not n.startswith("_")
            and callable(getattr(jnp, n))
            and not inspect.isclass(getattr(jnp, n))
            and not inspect.ismodule(getattr(jnp, n))
        )
    ]
    covered = [n for n in names if hasattr(mnp, n)]
    assert len(covered) >= 260, f"{len(covered)} of {len(names)}"


def test_sparse_layouts_give_the_dense_results():
    dense = mj.masked_array(
        jnp.arange(12.0).reshape(4, 3), jnp.array([True, False, True, False])[:, None] & jnp.ones(3, bool)
    )
    layouts = [
        mj.row_sparse(dense.data[jnp.array([0, 2])], jnp.array([0, 2]), (4, 3)),
        mj.BCOOMaskedArray.from_masked(dense),
    ]
    fns = [
        lambda x: mnp.vecdot(x, jnp.ones((4, 3))),
        lambda x: mnp.nansum(x, axis=0),
        lambda x: mnp.cumulative_sum(x, axis=1),
        lambda x: mnp.diff(x, axis=0),
        lambda x: mnp.asarray(x),
        lambda x: mnp.linalg.trace(x),
        lambda x: mnp.unique_values(x),
    ]
    for lay in layouts:
        for fn in fns:
            got, want = fn(lay), fn(dense)
            np.testing.assert_array_equal(got.mask, want.mask)
            np.testing.assert_array_equal(got.filled(0), want.filled(0))


@pytest.mark.parametrize(
    "name",
    [
        "arange",
        "eye",
        "full",
        "full_like",
        "linspace",
        "zeros",
        "linalg.svd",
        "linalg.cholesky",
        "fft.fft",
        "fft.fftfreq",
    ],
)
def test_generated_wrappers_report_the_wrapped_signature(name):
    """The creation, linalg and fft wrappers take jnp's parameters by jnp's names (the array, where
    there is one, positional-only)."""
    ours = functools.reduce(getattr, name.split("."), mnp)
    theirs = functools.reduce(getattr, name.split("."), jnp)
    got, want = list(inspect.signature(ours).parameters.values()), list(inspect.signature(theirs).parameters.values())
    assert [p.name for p in got[1:]] == [p.name for p in want[1:]]
    assert [p.default for p in got[1:]] == [p.default for p in want[1:]]


def test_asarray_of_a_sequence_with_masked_elements_keeps_their_masks():
    x = mj.masked_array(jnp.arange(4.0).reshape(2, 2), jnp.array([[True, False], [True, True]]))
    t = mnp.asarray([[x[i, j] for i in range(2)] for j in range(2)], dtype=x.dtype)  # a transpose, by hand
    np.testing.assert_array_equal(t.mask, np.asarray(x.mask).T)
    np.testing.assert_array_equal(np.where(t.mask, t.data, 0), np.where(x.mask, x.data, 0).T)
    mixed = mnp.asarray([x[0, 1], 5.0])
    np.testing.assert_array_equal(mixed.mask, [False, True])
    assert mixed.data[1] == 5.0


@pytest.mark.parametrize(
    "name", ["mean", "var", "std", "average", "max", "median", "sum", "prod", "any", "all", "logsumexp", "norm"]
)
def test_reductions_over_zero_size_slices_follow_one_rule(name):
    """No element at all: where the reduction of nothing has a value (an identity), jnp's value,
    valid; where it has none (a mean is 0 / 0, a maximum of nothing), masked with no NaN in the data,
    as numpy.ma. An all-masked slice stays masked either way."""
    fn = getattr(mnp, name)
    ref = REGISTRY[name].fn
    for shape, axis in [((0,), None), ((0, 3), 0)]:
        got = fn(mnp.asarray(jnp.zeros(shape)), axis=axis)
        if name in ("sum", "prod", "any", "all", "logsumexp", "norm"):
            want = ref(jnp.zeros(shape), axis=axis)
            assert bool(got.mask.all()) and got.dtype == want.dtype
            np.testing.assert_array_equal(got.data, want)
        else:
            assert not bool(got.mask.any()) and not np.isnan(np.asarray(got.data)).any()
    masked = fn(mj.masked_array(jnp.zeros(3), jnp.zeros(3, bool)))
    assert not bool(masked.mask)


def test_parameters_given_as_fully_valid_masked_arrays_take_their_data():
    """A parameter jnp takes as a plain array (repeats, rtol) may come as a masked array, as the
    Array API suite passes them: fully valid, its data is used; with a masked entry it is refused."""
    x = mnp.asarray(jnp.arange(3))
    np.testing.assert_array_equal(mnp.repeat(x, mnp.asarray(jnp.array([1, 0, 2]))).data, [0, 2, 2])
    np.testing.assert_allclose(mnp.linalg.pinv(mnp.eye(2), rtol=mnp.asarray(1e-3)).data, np.eye(2))
    with pytest.raises(TypeError, match="repeats= must be fully valid"):
        mnp.repeat(x, mj.masked_array(jnp.array([1, 0, 2]), jnp.array([True, False, True])))
