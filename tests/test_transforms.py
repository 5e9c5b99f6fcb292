"""Every op of the table under jit and vmap: equal to eager, no retrace when only masks change."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from op_table import OPS
from strategies import poison

import masked_jax as mj


def _inputs(op, shape, seed):
    rng = np.random.default_rng(seed)
    dtype = np.dtype(op.dtypes[0])
    lo, hi = op.domain
    if dtype == np.bool_:
        data = rng.random(shape) > 0.5
    elif dtype.kind in "iu":
        data = rng.integers(int(np.ceil(lo)), int(np.floor(hi)) + 1, shape).astype(dtype)
    else:
        data = rng.uniform(lo, hi, shape).astype(dtype)
    mask = rng.random(shape) > 0.4
    return mj.masked_array(jnp.asarray(poison(data, mask)), jnp.asarray(mask))


def _call(op, *xs):
    kw = {"axis": 1}
    if op.family == "reductions":
        if op.name in ("quantile", "percentile"):
            kw["q"] = 0.25 if op.name == "quantile" else 25.0
        return op.fn(*xs, **kw)
    return op.fn(*xs)


def _operands(op, seed):
    n = 2 if op.family == "binary" else 1
    return [_inputs(op, (3, 4), seed + i) for i in range(n)]


@pytest.mark.parametrize("op", OPS, ids=repr)
def test_jit_equals_eager_without_retrace(op):
    traces = []

    def fn(*xs):
        traces.append(1)
        return _call(op, *xs)

    jitted = jax.jit(fn)
    for seed in (0, 10):  # the second call changes data and mask values only
        xs = _operands(op, seed)
        got, want = jitted(*xs), _call(op, *xs)
        np.testing.assert_array_equal(got.mask, want.mask)
        np.testing.assert_allclose(
            np.asarray(got.filled(0), np.float64), np.asarray(want.filled(0), np.float64), rtol=1e-5, atol=1e-6
        )
    assert len(traces) == 1


@pytest.mark.parametrize("op", OPS, ids=repr)
def test_vmap_over_leading_axis_equals_loop(op):
    xs = [mj.masked_array(jnp.stack([x.data] * 2), jnp.stack([x.mask, ~x.mask])) for x in _operands(op, 3)]
    batched = jax.vmap(lambda *a: _call(op, *a))(*xs)
    for b in range(2):
        one = _call(op, *[x[b] for x in xs])
        np.testing.assert_array_equal(batched.mask[b], one.mask)
        np.testing.assert_allclose(
            np.asarray(batched[b].filled(0), np.float64), np.asarray(one.filled(0), np.float64), rtol=1e-5, atol=1e-6
        )
