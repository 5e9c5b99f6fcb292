"""Sparse storage with masked semantics: every layout gives the dense-layout masked result."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import sparse

import masked_jax as mj
import masked_jax.nn as mnn
import masked_jax.numpy as mnp
from masked_jax._storage import _warned

ROWS = np.array([False, True, False, False, True, True])


def dense_x():
    rng = np.random.default_rng(0)
    data = rng.uniform(0.5, 2.0, (6, 3))
    return mj.masked_array(jnp.asarray(np.where(ROWS[:, None], data, np.nan)), jnp.asarray(np.repeat(ROWS[:, None], 3, 1)))


def layouts():
    x = dense_x()
    b = x.to_bcoo()
    return {
        "dense": x,
        "bcoo": mj.from_bcoo(b),
        "bcoo_batch": mj.BCOOMaskedArray.from_masked(x, nse=3, n_batch=1),
        "bcoo_hybrid": mj.BCOOMaskedArray.from_masked(x, nse=3, n_dense=1),
        "row_sparse": x.tostype("row_sparse"),
    }


STORAGE = {"dense": "dense", "bcoo": "bcoo", "bcoo_batch": "bcoo", "bcoo_hybrid": "bcoo", "row_sparse": "row_sparse"}
W = jnp.asarray(np.random.default_rng(1).normal(size=(3, 2)))
ROWVEC = jnp.asarray([1.0, 2.0, 3.0])

# op -> (function, layouts on which it keeps sparse storage)
ALL = set(STORAGE)
ROW = {"dense", "row_sparse"}
OPS = {
    "exp": (mnp.exp, ALL), "log1p": (mnp.log1p, ALL), "cos": (mnp.cos, ALL), "sqrt": (mnp.sqrt, ALL),
    "negative": (mnp.negative, ALL), "relu": (mnn.relu, ALL),
    "mul_scalar": (lambda x: x * 3.0, ALL), "add_scalar": (lambda x: x + 1.0, ALL),
    "rdiv_scalar": (lambda x: 1.0 / x, ALL), "pow_scalar": (lambda x: x**2, ALL),
    "add_dense": (lambda x: mnp.add(x, jnp.ones((6, 3))), ROW),
    "mul_rowvec": (lambda x: mnp.multiply(x, ROWVEC), ROW),
    "sum": (mnp.sum, ALL), "max": (mnp.max, ALL), "mean": (mnp.mean, ALL), "var": (mnp.var, ALL),
    "logsumexp": (mnp.logsumexp, ALL),
    "sum_axis0": (lambda x: mnp.sum(x, axis=0), ROW), "sum_axis1": (lambda x: mnp.sum(x, axis=1), ROW),
    "mean_axis0": (lambda x: mnp.mean(x, axis=0), ROW), "std_axis1": (lambda x: mnp.std(x, axis=1), ROW),
    "max_axis1": (lambda x: mnp.max(x, axis=1), ROW), "median_axis0": (lambda x: mnp.median(x, axis=0), ROW),
    "softmax_axis1": (lambda x: mnn.softmax(x, axis=1), ROW),
    "softmax_axis0": (lambda x: mnn.softmax(x, axis=0), ROW),
    "log_softmax_axis1": (lambda x: mnn.log_softmax(x, axis=1), ROW),
    "matmul_dense": (lambda x: x @ W, ALL),
    "mul_same_layout": (lambda x: x * (x + 1.0), ALL - {"bcoo_batch"}),
    "transpose": (mnp.transpose, {"dense"}),
    "argmax": (lambda x: mnp.argmax(x, axis=0), {"dense"}),
}


# Ops whose result is dense by nature (reductions across the stored axis or the whole array).
DENSE_RESULT = {"sum", "max", "mean", "var", "logsumexp", "sum_axis0", "mean_axis0", "median_axis0"}


def _dense_of(y):
    return y.todense() if hasattr(y, "todense") else y


def _same(got, want):
    got, want = _dense_of(got), _dense_of(want)
    np.testing.assert_array_equal(got.mask, want.mask)
    np.testing.assert_allclose(np.asarray(got.filled(0)), np.asarray(want.filled(0)), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("layout", list(STORAGE))
@pytest.mark.parametrize("op", list(OPS))
def test_layout_matches_dense_masked_result(op, layout):
    fn, keeps = OPS[op]
    x = layouts()[layout]
    want = fn(layouts()["dense"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", mj.StorageFallbackWarning)
        _warned.clear()
        got = fn(x)
    fell_back = any(issubclass(w.category, mj.StorageFallbackWarning) for w in caught)
    assert fell_back == (layout not in keeps), f"{op} on {layout}: fallback={fell_back}"
    if layout in keeps and layout != "dense":
        expected = "dense" if op in DENSE_RESULT or (op == "matmul_dense" and layout != "row_sparse") else STORAGE[layout]
        assert getattr(got, "storage", "dense") == expected, f"{op} on {layout} gave {got!r}"
    _same(got, want)
    jitted = jax.jit(fn)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", mj.StorageFallbackWarning)
        _same(jitted(x), want)


GRAD_OPS = ["exp", "log1p", "cos", "sqrt", "mul_scalar", "rdiv_scalar", "sum_axis1", "mean_axis0",
            "softmax_axis1", "softmax_axis0", "matmul_dense", "logsumexp", "var"]


@pytest.mark.parametrize("op,layout", [(op, lay) for op in GRAD_OPS for lay in ("bcoo", "bcoo_hybrid", "row_sparse")
                                       if lay in OPS[op][1]])
def test_grad_through_sparse_storage_matches_dense(op, layout):
    fn, _ = OPS[op]
    x = layouts()[layout]
    loss = lambda v: mnp.sum(fn(v) * 1.7)  # noqa: E731
    g = mj.grad(loss)(x)
    assert type(g) is type(x)
    np.testing.assert_array_equal(np.asarray(g.indices), np.asarray(x.indices))
    g_dense = mj.grad(loss)(layouts()["dense"])
    _same(g.todense(), g_dense)
    jf = mj.jacfwd(lambda v: fn(v))(x)
    jr = mj.jacrev(lambda v: fn(v))(x)
    np.testing.assert_allclose(np.asarray(_dense_of(jf).filled(0) if hasattr(jf, "filled") else jf),
                               np.asarray(_dense_of(jr).filled(0) if hasattr(jr, "filled") else jr), rtol=1e-10, atol=1e-12)


VMAP_OPS = ["exp", "mul_scalar", "sum", "logsumexp", "sum_axis1", "softmax_axis1", "matmul_dense"]


@pytest.mark.parametrize("layout", ["bcoo", "bcoo_hybrid", "row_sparse"])
@pytest.mark.parametrize("op", VMAP_OPS)
def test_vmap_over_a_batch_of_sparse_arrays(op, layout):
    fn, keeps = OPS[op]
    xs = [dense_x(), mj.masked_array(dense_x().data * 2 - 1, dense_x().mask)]
    build = {"bcoo": lambda x: x.tostype("bcoo"), "row_sparse": lambda x: x.tostype("row_sparse"),
             "bcoo_hybrid": lambda x: mj.BCOOMaskedArray.from_masked(x, nse=3, n_dense=1)}[layout]
    batch = jax.tree_util.tree_map(lambda *leaves: jnp.stack(leaves), *[build(x) for x in xs])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", mj.StorageFallbackWarning)
        out = jax.vmap(lambda v: _dense_of(fn(v)))(batch)
    for i, x in enumerate(xs):
        _same(jax.tree_util.tree_map(lambda leaf: leaf[i], out), fn(x))


# -- semantics, conversions and edge cases -------------------------------------------------------
def test_two_semantics_are_explicit():
    b = sparse.BCOO((jnp.array([0.0, 3.0]), jnp.array([[0], [2]])), shape=(4,))
    assert float(jnp.mean(b.todense())) == 0.75  # BCOO: dense semantics, unspecified = 0
    m = mj.from_bcoo(b)  # masked semantics: the stored 0 is valid, unspecified entries are absent
    assert float(mnp.mean(m).data) == 1.5
    np.testing.assert_array_equal(m.todense().mask, [True, False, True, False])
    back = m.tostype("dense").to_bcoo()
    np.testing.assert_array_equal(back.todense(), b.todense())
    assert back.nse == 2  # exactly the valid entries, the explicit zero included


def test_row_sparse_duplicates_unsorted_padding_and_retain():
    r = mj.row_sparse(jnp.array([[1.0], [2.0], [4.0]]), jnp.array([3, 0, 3]), (5, 1))
    d = r.todense()
    np.testing.assert_array_equal(d.filled(-1)[:, 0], [2.0, -1, -1, 5.0, -1])
    np.testing.assert_allclose(mnp.log(r).todense().filled(0)[:, 0], [np.log(2.0), 0, 0, np.log(5.0), 0])
    c = r.coalesce()
    np.testing.assert_array_equal(c.indices, [0, 3, 5])  # padding (index N) last, K unchanged
    kept = r.retain(jnp.array([0]))
    np.testing.assert_array_equal(kept.todense().mask[:, 0], [True, False, False, False, False])

    @jax.jit
    def build(idx):  # under jit out-of-range indices are padding: dropped everywhere
        return mj.row_sparse(jnp.ones((2, 1)), idx, (3, 1)).todense()

    np.testing.assert_array_equal(build(jnp.array([1, 7])).mask[:, 0], [False, True, False])
    with pytest.raises(ValueError, match=r"indices must be in \[0, 3\)"):
        mj.row_sparse(jnp.ones((2, 1)), jnp.array([1, 7]), (3, 1))
    with pytest.raises(ValueError, match="data must have shape"):
        mj.row_sparse(jnp.ones((2, 2)), jnp.array([0, 1]), (3, 1))
    with pytest.raises(TypeError, match="indices must be integers"):
        mj.row_sparse(jnp.ones((1, 1)), jnp.array([0.5]), (3, 1))


def test_edge_cases_nse0_1d_explicit_zeros_padding():
    empty = mj.row_sparse(jnp.zeros((0, 2)), jnp.zeros((0,), jnp.int32), (4, 2))
    assert not bool(mnp.sum(empty).mask) and not bool(jnp.any(empty.todense().mask))
    assert not bool(jnp.any(mnp.exp(empty).todense().mask))
    one_d = mj.from_bcoo(sparse.BCOO((jnp.array([0.0, 2.0, 9.0]), jnp.array([[1], [3], [5]])), shape=(5,)))
    # index 5 is padding (out of range): ignored by every op
    assert float(mnp.sum(one_d).data) == 2.0 and int(mnp.sum(mnp.exp(one_d) > 0).data) == 2
    np.testing.assert_array_equal(one_d.todense().mask, [False, True, False, True, False])
    assert float(mnp.max(mnp.cos(one_d)).data) == 1.0  # the explicit zero is valid: cos(0) = 1
    nse0 = mj.from_bcoo(sparse.BCOO((jnp.zeros((0,)), jnp.zeros((0, 1), jnp.int32)), shape=(3,)))
    assert not bool(mnp.mean(nse0).mask)


def test_fallback_warns_once_per_op_and_strict_raises():
    r = layouts()["row_sparse"]
    _warned.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mnp.transpose(r)
        mnp.transpose(r)
        mnp.flip(r, 0)
    msgs = [str(w.message) for w in caught if issubclass(w.category, mj.StorageFallbackWarning)]
    assert len(msgs) == 2 and "transpose" in msgs[0] and "flip" in msgs[1]
    with mj.strict_storage():
        assert mnp.exp(r).storage == "row_sparse"
        with pytest.raises(mj.StorageFallbackError, match="transpose has no sparse rule for row_sparse"):
            mnp.transpose(r)
    with pytest.raises(ValueError, match="storage must be"):
        r.tostype("csr")


def test_tostype_round_trips():
    x = dense_x()
    for storage in ("bcoo", "row_sparse"):
        y = x.tostype(storage)
        assert y.storage == storage
        _same(y.tostype("dense"), x)
        _same(y.tostype("bcoo" if storage == "row_sparse" else "row_sparse"), x)
    with pytest.raises(ValueError, match="fully valid or fully masked"):
        mj.masked_array(jnp.ones((2, 2)), jnp.array([[True, False], [True, True]])).tostype("row_sparse")


def test_unique_indices_flag_skips_coalescing_and_is_checked():
    r = mj.row_sparse(jnp.ones((2, 1)), jnp.array([3, 1]), (4, 1), unique_indices=True)
    assert r.coalesce() is r and r.unique_indices
    assert mnp.exp(r).unique_indices  # ops keep the flag
    plain = mj.row_sparse(jnp.ones((2, 1)), jnp.array([3, 1]), (4, 1))
    assert not plain.unique_indices and plain.coalesce().unique_indices
    _same(mnp.exp(r), mnp.exp(plain))
    with pytest.raises(ValueError, match="has duplicates"):
        mj.row_sparse(jnp.ones((2, 1)), jnp.array([1, 1]), (4, 1), unique_indices=True)


@pytest.mark.parametrize("storage", ["bcoo", "row_sparse"])
def test_binary_ops_of_sparse_operands_with_different_index_sets(storage):
    rng = np.random.default_rng(3)

    def make(seed):
        rows = np.random.default_rng(seed).random(8) > 0.5
        mask = np.repeat(rows[:, None], 3, 1) if storage == "row_sparse" else \
            np.random.default_rng(seed).random((8, 3)) > 0.5
        return mj.masked_array(jnp.asarray(rng.uniform(0.5, 2, (8, 3))), jnp.asarray(mask))
    a, b = make(10), make(11)
    for fn in (mnp.multiply, mnp.subtract, mnp.maximum, mnp.arctan2):
        with mj.strict_storage():  # stays sparse
            got = fn(a.tostype(storage), b.tostype(storage))
        assert got.storage == storage
        _same(got, fn(a, b))
        _same(jax.jit(fn)(a.tostype(storage), b.tostype(storage)), fn(a, b))


def test_zero_dimensional_arrays():
    valid = mj.as_masked(jnp.float32(0.0)).tostype("bcoo")  # an explicit zero stays valid
    assert valid.nse == 1 and bool(valid.todense().mask) and float(mnp.cos(valid).todense().data) == 1.0
    assert float(mj.grad(lambda v: mnp.sum(mnp.exp(v)))(valid).data[0]) == 1.0
    masked = mj.masked_array(jnp.float32(5.0), jnp.array(False)).tostype("bcoo")
    assert masked.nse == 0 and not bool(masked.todense().mask) and not bool(mnp.sum(masked).mask)
    with pytest.raises(ValueError, match="at least one dimension"):
        mj.row_sparse(jnp.ones(()), jnp.zeros((0,), jnp.int32), ())


def test_sparse_bad_input_errors():
    with pytest.raises(TypeError, match="from_bcoo needs a jax.experimental.sparse.BCOO"):
        mj.from_bcoo(jnp.ones(3))
    with pytest.raises(ValueError, match="needs a static nse"):
        jax.jit(lambda x: x.tostype("bcoo"))(dense_x())
    with pytest.raises(ValueError, match="needs a static nse"):
        jax.jit(lambda x: x.tostype("row_sparse"))(dense_x())
    rs = jax.jit(lambda x: x.tostype("row_sparse", nse=3))(dense_x())  # with nse it works under jit
    _same(rs, dense_x())
    with pytest.raises(TypeError, match="sparse masked array is ambiguous"):
        bool(layouts()["row_sparse"])


def test_list_and_variadic_operands_accept_sparse_layouts():
    x = dense_x()
    r = x.tostype("row_sparse")
    _warned.clear()
    with pytest.warns(mj.StorageFallbackWarning, match="concatenate"):
        got = mnp.concatenate([r, x], axis=0)
    _same(got, mnp.concatenate([x, x], axis=0))
    with pytest.warns(mj.StorageFallbackWarning, match="einsum"):
        got = mnp.einsum("ij,jk->ik", r, W)
    _same(got, mnp.einsum("ij,jk->ik", x, W))
    _same(-r, -x)
    with mj.strict_storage(), pytest.raises(mj.StorageFallbackError, match="stack"):
        mnp.stack([r, r])
