"""jax's own BCOO tests (tests/sparse_bcoo_bcsr_test.py), translated for what our BCOO-backed
layout supports: the same sparse data through ``jax.experimental.sparse`` and through
``mj.from_bcoo``, over jax's layouts (batch and dense dimensions, duplicate indices). The stored
entries are our valid ones and the unstored ones masked, so where jax's result is a BCOO (or a
dense array that counts unstored entries as 0), ours filled with 0 is jax's, and ours is valid
exactly where some stored entry reached it. Each test names the jax test it comes from."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import sparse

import masked_jax as mj
import masked_jax.numpy as mnp

jax.config.update("jax_enable_x64", True)

# (shape, n_batch, n_dense): jax's test layouts
LAYOUTS = [((5, 6), 0, 0), ((3, 4, 5), 1, 0), ((4, 5, 2), 0, 1), ((2, 3, 4), 1, 1)]
IDS = [f"{s}-batch{b}-dense{d}" for s, b, d in LAYOUTS]


def _random(shape, n_batch, n_dense, seed=0):
    rng = np.random.default_rng(seed)
    dense = rng.normal(size=shape) * (rng.random(shape) < 0.4)
    return jnp.asarray(dense), sparse.BCOO.fromdense(jnp.asarray(dense), n_batch=n_batch, n_dense=n_dense)


def _filled(x):
    x = x.todense() if hasattr(x, "todense") else x
    return np.asarray(x.filled(0) if isinstance(x, mj.MaskedArray) else x)


def _stored(b):
    """Where the BCOO ``b`` stores an entry (its pattern)."""
    ones = sparse.BCOO((jnp.ones_like(b.data), b.indices), shape=b.shape)
    return np.asarray(ones.todense()) > 0


@pytest.mark.parametrize("shape, n_batch, n_dense", LAYOUTS, ids=IDS)
def test_bcoo_dense_round_trip(shape, n_batch, n_dense):
    """test_bcoo_dense_round_trip / test_bcoo_todense: stored entries valid, the others masked."""
    dense, b = _random(shape, n_batch, n_dense)
    x = mj.from_bcoo(b)
    assert x.shape == b.shape
    np.testing.assert_array_equal(_filled(x), np.asarray(b.todense()))
    np.testing.assert_array_equal(np.asarray(x.todense().mask), _stored(b))


@pytest.mark.parametrize("shape, n_batch, n_dense", LAYOUTS, ids=IDS)
def test_bcoo_transpose(shape, n_batch, n_dense):
    """test_bcoo_transpose (batch axes stay in front, as jax requires); the result stays BCOO-backed."""
    _, b = _random(shape, n_batch, n_dense)
    perm = (
        tuple(range(n_batch))
        + tuple(reversed(range(n_batch, len(shape) - n_dense)))
        + tuple(range(len(shape) - n_dense, len(shape)))
    )
    got = mnp.transpose(mj.from_bcoo(b), perm)
    assert isinstance(got, mj.BCOOMaskedArray)  # the stored entries' indices permuted, no densifying
    np.testing.assert_array_equal(_filled(got), np.asarray(sparse.bcoo_transpose(b, permutation=perm).todense()))


@pytest.mark.parametrize("shape, n_batch, n_dense", LAYOUTS, ids=IDS)
@pytest.mark.parametrize("axis", [0, -1, None])
def test_bcoo_reduce_sum(shape, n_batch, n_dense, axis):
    """test_bcoo_reduce_sum: equal where a stored entry is summed; masked where none is (jax: 0)."""
    _, b = _random(shape, n_batch, n_dense)
    axes = tuple(range(len(shape))) if axis is None else (axis % len(shape),)
    got = mnp.sum(mj.from_bcoo(b), axis=axis)
    want = np.asarray(sparse.bcoo_reduce_sum(b, axes=axes).todense())
    np.testing.assert_allclose(_filled(got), want, rtol=1e-12, atol=1e-12)
    reached = _stored(b).any(axis=axes)
    np.testing.assert_array_equal(
        np.asarray(mj.as_masked(got.todense() if hasattr(got, "todense") else got).mask), reached
    )


@pytest.mark.parametrize("shape, n_batch, n_dense", LAYOUTS[:2], ids=IDS[:2])
def test_bcoo_dot_general_sparse_dense(shape, n_batch, n_dense):
    """test_bcoo_dot_general_contiguous / test_bcoo_matmul: sparse @ dense over the last axis."""
    _, b = _random(shape, n_batch, n_dense)
    rhs = jnp.asarray(np.random.default_rng(1).normal(size=(shape[-1], 3)))
    with warnings.catch_warnings():  # a layout with no sparse rule is densified (a storage fallback)
        warnings.simplefilter("ignore", mj.StorageFallbackWarning)
        got = mnp.matmul(mj.from_bcoo(b), rhs)
    want = np.asarray(b @ rhs)
    reached = _stored(b).any(axis=-1)[..., None].repeat(3, -1)
    np.testing.assert_allclose(_filled(got)[reached], want[reached], rtol=1e-12)
    np.testing.assert_array_equal(np.asarray(mj.as_masked(got).mask), reached)


@pytest.mark.parametrize("shape, n_batch, n_dense", LAYOUTS, ids=IDS)
def test_bcoo_mul_sparse_sparse(shape, n_batch, n_dense):
    """test_bcoo_mul_sparse: the product of two sparse arrays, stored where both are."""
    _, b = _random(shape, n_batch, n_dense)
    got = mj.from_bcoo(b) * mj.from_bcoo(b)
    np.testing.assert_allclose(_filled(got), np.asarray(sparse.bcoo_multiply_sparse(b, b).todense()), rtol=1e-12)


@pytest.mark.parametrize("shape, n_batch, n_dense", LAYOUTS, ids=IDS)
def test_bcoo_mul_dense(shape, n_batch, n_dense):
    """test_bcoo_mul_dense: a sparse array times a dense one is stored where the sparse one is."""
    _, b = _random(shape, n_batch, n_dense)
    other = jnp.asarray(np.random.default_rng(2).normal(size=shape))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", mj.StorageFallbackWarning)
        got = mj.from_bcoo(b) * other
    np.testing.assert_allclose(_filled(got), np.asarray(sparse.sparsify(jnp.multiply)(b, other).todense()), rtol=1e-12)
    np.testing.assert_array_equal(
        np.asarray(mj.as_masked(got.todense() if hasattr(got, "todense") else got).mask), _stored(b)
    )


@pytest.mark.parametrize("shape, n_batch, n_dense", LAYOUTS, ids=IDS)
def test_bcoo_slicing(shape, n_batch, n_dense):
    """test_bcoo_slice / test_bcoo_getitem: ints and slices on the stored entries."""
    _, b = _random(shape, n_batch, n_dense)
    x = mj.from_bcoo(b)
    for index in (1, slice(1, 3), (slice(None), 1)):
        np.testing.assert_array_equal(_filled(x[index]), np.asarray(b.todense())[index])


def test_bcoo_sum_duplicates():
    """test_bcoo_sum_duplicates: entries stored twice at one index count as their sum."""
    data = jnp.array([1.0, 2.0, 3.0, 4.0])
    indices = jnp.array([[0, 1], [2, 0], [0, 1], [1, 1]])
    b = sparse.BCOO((data, indices), shape=(3, 2))
    x = mj.from_bcoo(b)
    np.testing.assert_array_equal(_filled(x), np.asarray(b.todense()))
    np.testing.assert_array_equal(_filled(mnp.sum(x, axis=0)), np.asarray(b.todense()).sum(0))
    np.testing.assert_array_equal(_filled(mj.from_bcoo(b.sum_duplicates())), np.asarray(b.todense()))


@pytest.mark.parametrize("shape, n_batch, n_dense", LAYOUTS, ids=IDS)
def test_bcoo_unary_zero_preserving(shape, n_batch, n_dense):
    """test_bcoo_unary (jax's zero-preserving ops: neg, sin, abs): stored entries only."""
    _, b = _random(shape, n_batch, n_dense)
    x = mj.from_bcoo(b)
    for ours, theirs in (
        (lambda a: -a, lambda a: -a),
        (mnp.sin, sparse.sparsify(jnp.sin)),
        (mnp.abs, sparse.sparsify(jnp.abs)),
    ):
        np.testing.assert_allclose(_filled(ours(x)), np.asarray(theirs(b).todense()), rtol=1e-12)


def test_bcoo_exp_applies_to_stored_entries_only():
    """jax refuses ``sparsify(jnp.exp)`` on a BCOO (``exp(0) != 0`` would fill every unstored
    entry). Here an unstored entry is masked, not 0, so ``exp`` applies to the stored entries and
    the others stay masked (docs/semantics.md): a deliberate difference."""
    dense, b = _random((4, 5), 0, 0)
    with pytest.raises(NotImplementedError):
        sparse.sparsify(jnp.exp)(b)
    got = mnp.exp(mj.from_bcoo(b)).todense()
    stored = _stored(b)
    np.testing.assert_array_equal(np.asarray(got.mask), stored)
    np.testing.assert_allclose(np.asarray(got.data)[stored], np.exp(np.asarray(dense))[stored], rtol=1e-12)
