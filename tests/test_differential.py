"""Differential property tests: sparse layouts against the dense masked result, and the dense masked
result against numpy.ma, over random shapes, masks, duplicates, padding, negative and out-of-range
padding indices, and the dtypes float32, float64, float16, bfloat16, int32 and bool."""

from __future__ import annotations

import os
import warnings

import harness
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import oracle
import pytest
from conformance_table import ROWS
from hypothesis import given, settings
from hypothesis import strategies as st

import masked_jax as mj
from masked_jax.layouts import BCOOMaskedArray, RowSparseArray, rows_from_parts

FLOATS = (np.float32, np.float64, np.float16, ml_dtypes.bfloat16)
NUMERIC = FLOATS + (np.int32,)
EVERY = NUMERIC + (np.bool_,)
# op -> (dtypes it is drawn with, keyword cases)
OPS = {
    "exp": (FLOATS, [{}]),
    "sin": (FLOATS, [{}]),
    "tanh": (FLOATS, [{}]),
    "arctan": (FLOATS, [{}]),
    "negative": (NUMERIC, [{}]),
    "abs": (NUMERIC, [{}]),
    "square": (NUMERIC, [{}]),
    "sigmoid": (FLOATS, [{}]),
    "softplus": (FLOATS, [{}]),
    "add": (NUMERIC, [{}]),
    "subtract": (NUMERIC, [{}]),
    "multiply": (EVERY, [{}]),
    "maximum": (NUMERIC, [{}]),
    "minimum": (NUMERIC, [{}]),
    "sum": (EVERY, [{}, {"axis": 0}, {"axis": 1}]),
    "mean": (NUMERIC, [{}, {"axis": 0}, {"axis": 1}]),
    "max": (NUMERIC, [{}, {"axis": 1}]),
    "min": (NUMERIC, [{}, {"axis": 0}]),
    "var": (FLOATS, [{"axis": 1}, {"axis": 0, "ddof": 1}]),
    "std": (FLOATS, [{}, {"axis": 0}]),
    "logsumexp": (FLOATS, [{}, {"axis": 1}]),
    "count": (EVERY, [{}, {"axis": 0}]),
    "any": ((np.bool_,), [{}, {"axis": 1}]),
    "all": ((np.bool_,), [{}, {"axis": 0}]),
    "softmax": (FLOATS, [{"axis": 1}, {"axis": 0}]),
    "log_softmax": (FLOATS, [{"axis": 1}]),
}
LOW = (np.float16, ml_dtypes.bfloat16)


def _tol(dtype):
    return 3e-2 if dtype in LOW else (1e-5 if dtype == np.float32 else 1e-9)


@st.composite
def cases(draw, name):
    dtypes, kws = OPS[name]
    dtype = draw(st.sampled_from(dtypes))
    n, m = draw(st.integers(1, 5)), draw(st.integers(1, 4))
    rows = draw(st.booleans())  # whole rows valid: every layout holds it (else: BCOO flat only)
    if rows:
        mask = np.repeat(np.asarray(draw(st.lists(st.booleans(), min_size=n, max_size=n)))[:, None], m, 1)
    else:
        mask = np.asarray(draw(st.lists(st.booleans(), min_size=n * m, max_size=n * m))).reshape(n, m)
    seed = draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    if dtype == np.bool_:
        data = rng.random((n, m)) > 0.5
    elif dtype == np.int32:
        data = rng.integers(-4, 5, (n, m)).astype(np.int32)
    else:
        data = rng.uniform(-2, 2, (n, m)).astype(dtype)
    layout = draw(st.sampled_from(["bcoo", "rows"] if rows else ["bcoo"]))
    dup = draw(st.booleans())
    pads = draw(st.lists(st.sampled_from([-1, -3, n, n + 2]), max_size=3))  # padding indices, the one convention
    return dtype, data, mask, layout, dup, pads, draw(st.sampled_from(kws))


def _garbage(dtype, shape):
    if dtype == np.bool_:
        return np.ones(shape, bool)
    if dtype == np.int32:
        return np.full(shape, 7, np.int32)
    return np.full(shape, np.nan, dtype)


def _split(values):
    """Two parts that add up to ``values`` exactly (duplicates are summed; bools are or-ed)."""
    if values.dtype == np.bool_:
        return values, np.zeros_like(values)
    if values.dtype == np.int32:
        return values // 2, values - values // 2
    return values * 0.5, values * 0.5


def build(layout, x, dtype, dup, pads):
    n, m = x.shape
    if layout == "rows":
        r = RowSparseArray.from_masked(x)
        data, idx = np.asarray(r.data), np.asarray(r.indices)
        if dup:
            a, b = _split(data)
            data, idx = np.concatenate([a, b]), np.concatenate([idx, idx])
        data = np.concatenate([data, _garbage(dtype, (len(pads), m))])
        idx = np.concatenate([idx, np.asarray(pads, np.int32)]).astype(np.int32)
        return rows_from_parts((n, m), jnp.asarray(data), jnp.asarray(idx))
    b = BCOOMaskedArray.from_masked(x)
    data, idx = np.asarray(b.data), np.asarray(b.indices)
    if dup:
        a, c = _split(data)
        data, idx = np.concatenate([a, c]), np.concatenate([idx, idx])
    data = np.concatenate([data, _garbage(dtype, (len(pads),))])
    pad_idx = np.array([[p, 0] for p in pads], np.int32).reshape(-1, 2)
    return BCOOMaskedArray.tree_unflatten((n, m), (jnp.asarray(data), jnp.asarray(np.concatenate([idx, pad_idx]))))


# the layouts are also checked by the conformance harness on every op: half the examples here
# (MJ_HYPOTHESIS_EXAMPLES raises both). The elementwise and binary ops share one rule per family on
# the stored values: `make test` draws four and two of them, `make test-full` (MJ_ORACLE=full) all.
SAMPLED_OUT = ("sin", "tanh", "arctan", "negative", "sigmoid", "subtract", "maximum", "minimum")


# the test loop runs every other op of the sample; the rest run in the slow tier (`make test-slow`)
@pytest.mark.parametrize(
    "name",
    [
        pytest.param(n, marks=pytest.mark.slow if i % 2 and not oracle.FULL else ())
        for i, n in enumerate(n for n in OPS if oracle.FULL or n not in SAMPLED_OUT)
    ],
)
@settings(max_examples=max(3, int(os.environ.get("MJ_HYPOTHESIS_EXAMPLES", "8")) // 2))
@given(data=st.data())
def test_layouts_equal_dense_and_dense_equals_numpy_ma(name, data):
    dtype, values, mask, layout, dup, pads, kw = data.draw(cases(name))
    poisoned = np.where(mask, values, _garbage(dtype, values.shape))
    x = mj.masked_array(jnp.asarray(poisoned), jnp.asarray(mask))
    fn = harness.public(name)
    binary = name in ("add", "subtract", "multiply", "maximum", "minimum")
    args = (x, x * 1 if dtype != np.bool_ else x) if binary else (x,)
    want = fn(*args, **kw)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", mj.StorageFallbackWarning)
        sparse = build(layout, x, dtype, dup, pads)
        got = fn(*((sparse, sparse) if binary else (sparse,)), **kw)
    harness.assert_same(got, want, _tol(dtype), f"{name} on {layout} (dup={dup}, pads={pads}), {np.dtype(dtype)}")
    # the dense masked result against numpy.ma (low precision: against float32 numpy.ma)
    ref_dtype = np.float32 if dtype in LOW else dtype
    ma = np.ma.masked_array(np.asarray(values).astype(ref_dtype), mask=~mask)
    ref = ROWS[name].ref(*((ma, ma) if binary else (ma,)), **kw)
    harness.assert_same(want, harness.ref_pairs(ref), _tol(dtype), f"{name} against numpy.ma, {np.dtype(dtype)}")
