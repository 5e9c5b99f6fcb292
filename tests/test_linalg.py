"""Masked contractions: sum over indices where both operands are valid."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from strategies import masks, poison, tolerance, values

import masked_jax as mj
import masked_jax.numpy as mnp


def _operand(draw, shape, dtype):
    m = draw(masks(shape))
    return mj.masked_array(jnp.asarray(poison(draw(values(shape, dtype)), m)), jnp.asarray(m))


def _reference(subscripts, *xs):
    """Explicit masked contraction: data over jointly valid terms, valid iff a jointly valid term
    exists, or no term at all (a zero-size contracted dim: a sum of nothing, 0)."""
    datas = [np.where(np.asarray(x.mask), np.asarray(x.data, np.float64), 0) for x in xs]
    ms = [np.asarray(x.mask).astype(np.float64) for x in xs]
    terms = np.einsum(subscripts, *(np.ones(x.shape) for x in xs))
    return np.einsum(subscripts, *datas), (np.einsum(subscripts, *ms) > 0) | (terms == 0)


@given(data=st.data())
def test_matmul_dot_einsum_against_explicit_masked_sum(data):
    dtype = data.draw(st.sampled_from([np.float32, np.float64]))
    i, k, j, b = (data.draw(st.integers(0, 4)) for _ in range(4))
    a = _operand(data.draw, (b, i, k), dtype)
    c = _operand(data.draw, (k, j), dtype)
    exp_d, exp_m = _reference("bik,kj->bij", a, c)
    tol = tolerance(dtype)
    for got in [mnp.matmul(a, c), a @ c, mnp.einsum("bik,kj->bij", a, c), mnp.tensordot(a, c, axes=1)]:
        np.testing.assert_array_equal(got.mask, exp_m)
        np.testing.assert_allclose(got.filled(0), np.where(exp_m, exp_d, 0), **tol)
    a2 = a[0] if b else _operand(data.draw, (i, k), dtype)
    d_d, d_m = _reference("ik,kj->ij", a2, c)
    got = mnp.dot(a2, c)
    np.testing.assert_array_equal(got.mask, d_m)
    np.testing.assert_allclose(got.filled(0), np.where(d_m, d_d, 0), **tol)


def test_vector_products():
    u = mj.masked_array(jnp.array([1.0, 2.0, 3.0]), jnp.array([True, False, True]))
    v = mj.masked_array(jnp.array([4.0, 5.0, 6.0]), jnp.array([True, True, False]))
    assert float(mnp.vdot(u, v).data) == 4.0
    assert float(mnp.inner(u, v).data) == 4.0
    none = mnp.vdot(u, mj.masked_array(v.data, jnp.array([False, True, False])))
    assert not bool(none.mask)  # no jointly valid index: masked
    o = mnp.outer(u, v)
    np.testing.assert_array_equal(o.mask, np.outer(np.asarray(u.mask), np.asarray(v.mask)))
    three = mnp.einsum("i,i,i->", u, v, jnp.ones(3))
    assert float(three.data) == 4.0 and bool(three.mask)


def test_matmul_with_plain_operand_and_nan_under_mask():
    a = mj.masked_array(jnp.array([[1.0, jnp.nan], [jnp.inf, jnp.nan]]), jnp.array([[True, False], [False, False]]))
    out = a @ jnp.array([[1.0, 2.0], [3.0, 4.0]])
    np.testing.assert_array_equal(out.mask, [[True, True], [False, False]])
    np.testing.assert_array_equal(out.data[0], [1.0, 2.0])
    assert np.all(np.isfinite(np.asarray(out.data)))


@pytest.mark.parametrize("ord", [None, 2, 1, np.inf, -np.inf, 0, 3])
def test_vector_norms(ord):
    x = mj.masked_array(
        jnp.array([[3.0, -4.0, jnp.nan], [1.0, 1.0, 1.0]]), jnp.array([[True, True, False], [False, False, False]])
    )
    got = mnp.norm(x, ord=ord, axis=1)
    np.testing.assert_array_equal(got.mask, [True, False])
    assert float(got.data[0]) == pytest.approx(np.linalg.norm(np.array([3.0, -4.0]), ord=ord))
    assert float(got.data[1]) == 0.0 or ord in (np.inf, -np.inf)


@pytest.mark.parametrize("ord", ["fro", 1, -1, np.inf, -np.inf, 2, -2, "nuc"])
def test_matrix_norms(ord):
    rng = np.random.default_rng(0)
    data = rng.normal(size=(2, 3, 4))
    mask = rng.random((2, 3, 4)) > 0.3
    mask[:, :, 0] = True
    x = mj.masked_array(jnp.asarray(np.where(mask, data, np.nan)), jnp.asarray(mask))
    got = mnp.linalg.norm(x, ord=ord, axis=(1, 2))
    ref = np.linalg.norm(np.where(mask, data, 0.0), ord=ord, axis=(1, 2))
    if ord in (1, -1, np.inf, -np.inf):  # only over rows/columns that have a valid element
        a = np.ma.masked_array(np.abs(data), ~mask)
        inner = 1 if ord in (1, -1) else 2
        sums = a.sum(axis=inner)
        ref = (sums.max(axis=1) if ord in (1, np.inf) else sums.min(axis=1)).filled()
    np.testing.assert_allclose(np.asarray(got.data), ref, rtol=1e-10)
    assert bool(jnp.all(got.mask))


def test_the_exact_value_conditional_stays_a_conditional_under_vmap():
    """jax.vmap turns a conditional with a batched predicate into a select of both branches; the
    contraction's exact-value branch (valid inf or NaN meeting masked entries) must not run on every
    call of a vmapped function, and must still give the exact result when it is needed: nested
    vmaps, unbatched operands, jit, gradients and scan included."""
    rng = np.random.default_rng(3)
    a_data, b_data = rng.normal(size=(4, 6, 5)), rng.normal(size=(4, 5, 3))
    a_mask, b_mask = rng.random((4, 6, 5)) > 0.3, rng.random((4, 5, 3)) > 0.3
    a_data[0, 1, 2], a_mask[0, 1, 2] = np.inf, True  # a valid inf meets masked entries of b
    b_mask[0, 2, :] = [True, False, False]
    a = mj.masked_array(jnp.asarray(a_data), jnp.asarray(a_mask))
    b = mj.masked_array(jnp.asarray(b_data), jnp.asarray(b_mask))
    mm = jax.vmap(mnp.matmul)
    want = mnp.matmul(a, b)  # batched matmul, no vmap: a plain conditional
    row = np.asarray(want.filled(0))[0, 1]
    assert np.isinf(row[0]) and np.isfinite(row[1:]).all()  # zero-filling alone gives NaN at row[1:]
    assert np.isnan(np.asarray(jnp.matmul(a.filled(0), b.filled(0)))[0, 1, 1:]).all()

    def same(got, ref):
        np.testing.assert_array_equal(np.asarray(got.mask), np.asarray(ref.mask))
        np.testing.assert_array_equal(np.asarray(got.filled(0)), np.asarray(ref.filled(0)))

    assert "cond" in str(jax.make_jaxpr(mm)(a, b))
    same(mm(a, b), want)
    same(jax.jit(mm)(a, b), want)
    split = lambda x: mj.masked_array(x.data.reshape((2, 2) + x.shape[1:]), x.mask.reshape((2, 2) + x.shape[1:]))
    nested = jax.vmap(jax.vmap(mnp.matmul))
    assert "cond" in str(jax.make_jaxpr(nested)(split(a), split(b)))
    out = jax.jit(nested)(split(a), split(b))
    same(mj.masked_array(out.data.reshape(want.shape), out.mask.reshape(want.shape)), want)
    same(jax.jit(jax.vmap(lambda x: mnp.matmul(x, b[0])))(a), mnp.matmul(a, b[0]))  # unbatched right
    same(jax.jit(jax.vmap(lambda y: mnp.matmul(a[0], y)))(b), mnp.matmul(a[0], b))  # unbatched left
    same(jax.jit(lambda x, y: jax.lax.scan(lambda c, xy: (c, mnp.matmul(*xy)), 0.0, (x, y))[1])(a, b), want)
    finite = mj.masked_array(jnp.where(jnp.isinf(a.data), 1.0, a.data), a.mask)
    loss = lambda f: lambda x: mnp.sum(f(x, b) ** 2).data
    np.testing.assert_allclose(
        jax.jit(mj.grad(loss(mm)))(finite).filled(0), mj.grad(loss(mnp.matmul))(finite).filled(0), rtol=1e-12
    )
