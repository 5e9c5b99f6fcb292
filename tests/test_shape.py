"""Shape, reordering and indexing ops: the mask moves with the data (against numpy.ma)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from strategies import ALL, masked_arrays

import masked_jax as mj
import masked_jax.numpy as mnp


def _same(got, ref):
    np.testing.assert_array_equal(np.asarray(got.mask), ~np.ma.getmaskarray(ref))
    np.testing.assert_array_equal(got.filled(0), np.ma.filled(ref.astype(np.asarray(got.data).dtype), 0))


SHAPE_CASES = {
    "reshape": (lambda x: mnp.reshape(x, (-1,)), lambda r: r.reshape(-1)),
    "ravel": (mnp.ravel, np.ma.ravel),
    "transpose": (mnp.transpose, np.ma.transpose),
    "swapaxes": (lambda x: mnp.swapaxes(x, 0, -1), lambda r: np.ma.swapaxes(r, 0, -1)),
    "moveaxis": (lambda x: mnp.moveaxis(x, 0, -1), lambda r: np.moveaxis(r, 0, -1)),
    "expand_dims": (lambda x: mnp.expand_dims(x, 0), lambda r: np.ma.expand_dims(r, 0)),
    "squeeze": (mnp.squeeze, np.ma.squeeze),
    "broadcast_to": (
        lambda x: mnp.broadcast_to(x, (2,) + x.shape),
        lambda r: np.ma.masked_array(
            np.broadcast_to(r.data, (2,) + r.shape), np.broadcast_to(np.ma.getmaskarray(r), (2,) + r.shape)
        ),
    ),
    "flip": (lambda x: mnp.flip(x, 0), lambda r: r[::-1]),
    "roll": (
        lambda x: mnp.roll(x, 1, 0),
        lambda r: np.ma.masked_array(np.roll(r.data, 1, 0), np.roll(np.ma.getmaskarray(r), 1, 0)),
    ),
    "tile": (
        lambda x: mnp.tile(x, 2),
        lambda r: np.ma.masked_array(np.tile(r.data, 2), np.tile(np.ma.getmaskarray(r), 2)),
    ),
    "repeat": (lambda x: mnp.repeat(x, 2, axis=0), lambda r: np.ma.repeat(r, 2, axis=0)),
    "concatenate": (
        lambda x: mnp.concatenate([x, x.filled(0)], axis=0),
        lambda r: np.ma.concatenate([r, np.ma.masked_array(r.filled(0))], axis=0),
    ),
    "stack": (lambda x: mnp.stack([x, x], axis=0), lambda r: np.ma.stack([r, r], axis=0)),
    "flip_last": (lambda x: x[..., ::-1], lambda r: r[..., ::-1]),
}


@pytest.mark.parametrize("name", list(SHAPE_CASES))
@given(x=masked_arrays(dtypes=ALL, min_dims=1, min_side=1))
def test_shape_ops_match_numpy_ma(name, x):
    fn, ref = SHAPE_CASES[name]
    _same(fn(x), ref(x.to_numpy_ma()))


@given(x=masked_arrays(dtypes=(np.float32, np.float64, np.int32), min_dims=1), data=st.data())
def test_sort_puts_masked_last_like_numpy_ma(x, data):
    axis = data.draw(st.integers(-x.ndim, x.ndim - 1))
    got = mnp.sort(x, axis=axis)
    ref = np.ma.sort(x.to_numpy_ma(), axis=axis, endwith=True)
    _same(got, ref)
    idx = mnp.argsort(x, axis=axis)
    taken = np.take_along_axis(np.asarray(x.filled(0)), np.asarray(idx), axis=axis)
    np.testing.assert_array_equal(np.where(np.asarray(got.mask), taken, 0), np.asarray(got.filled(0)))


def test_split_pad_take_take_along_axis():
    x = mj.masked_array(jnp.arange(6.0).reshape(2, 3), jnp.array([[True, False, True], [False, True, True]]))
    parts = mnp.split(x, 3, axis=1)
    assert len(parts) == 3 and all(isinstance(p, mj.MaskedArray) for p in parts)
    np.testing.assert_array_equal(parts[1].mask, [[False], [True]])
    p = mnp.pad(x, ((0, 0), (1, 1)))
    np.testing.assert_array_equal(p.mask, [[True, True, False, True, True], [True, False, True, True, True]])
    e = mnp.pad(x, ((0, 0), (1, 0)), mode="edge")
    np.testing.assert_array_equal(e.mask[:, 0], [True, False])
    emp = mnp.pad(x, ((1, 0), (0, 0)), mode="empty")
    assert not bool(jnp.any(emp.mask[0]))
    t = mnp.take(x, jnp.array([2, 1, 7]), axis=1)  # out of range -> masked (fill mode)
    np.testing.assert_array_equal(t.mask, [[True, False, False], [True, True, False]])
    tc = mnp.take(x, jnp.array([7]), axis=1, mode="clip")
    np.testing.assert_array_equal(tc.mask, [[True], [True]])
    ta = mnp.take_along_axis(x, jnp.array([[1], [0]]), 1)
    np.testing.assert_array_equal(ta.mask, [[False], [False]])
    assert mnp.atleast_2d(x[0]).shape == (1, 3)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("axis", [None, 0, 1])
def test_masked_indices_read_nothing(jit, axis):
    """A masked index gives a masked element and no gradient, whatever position it holds (also
    out of range); valid indices read as plain ones."""
    import jax

    d = jnp.arange(6.0).reshape(2, 3)
    x = mj.masked_array(d, jnp.array([[True, False, True], [True, True, True]]))
    idx = mj.masked_array(jnp.array([1, 99, 0]), jnp.array([True, False, True]))
    take = jax.jit(mnp.take, static_argnames="axis") if jit else mnp.take
    got = take(x, idx, axis=axis)
    plain = mnp.take(x, jnp.array([1, 0, 0]), axis=axis)  # 99 replaced by any in-range index
    keep = np.array([True, False, True]).reshape(
        (1,) * (0 if axis in (None, 0) else 1) + (3,) + (1,) * (1 if axis == 0 else 0)
    )
    np.testing.assert_array_equal(got.mask, np.asarray(plain.mask) & keep)
    np.testing.assert_array_equal(np.where(got.mask, got.data, 0), np.where(got.mask, plain.data, 0))
    grad = jax.grad(lambda v: take(mj.masked_array(v, x.mask), idx, axis=axis).filled(0.0).sum())(d)
    expect = jax.grad(lambda v: jnp.sum(jnp.where(got.mask, jnp.take(v, jnp.array([1, 0, 0]), axis=axis), 0)))(d)
    np.testing.assert_array_equal(grad, expect * x.mask)
    along = mnp.take_along_axis(x, mj.masked_array(jnp.array([[2], [9]]), jnp.array([[True], [False]])), axis=1)
    np.testing.assert_array_equal(along.mask, [[True], [False]])
    np.testing.assert_array_equal(along.data[0], [2.0])


def test_at_updates_under_jit():
    import jax

    @jax.jit
    def f(x, i, v):
        return x.at[i].set(v)

    x = mj.masked_array(jnp.zeros(4, jnp.float32), jnp.zeros(4, bool))
    out = f(x, jnp.array([1, 3]), jnp.array([1.0, 2.0], jnp.float32))
    np.testing.assert_array_equal(out.mask, [False, True, False, True])
    np.testing.assert_array_equal(out.filled(), [0.0, 1.0, 0.0, 2.0])
