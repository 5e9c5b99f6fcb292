"""Sparse storage with masked semantics: every layout gives the dense-layout masked result."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export
from jax.experimental import sparse

import masked_jax as mj
import masked_jax.nn as mnn
import masked_jax.numpy as mnp
from masked_jax._core import STATE

_warned = STATE.warned

ROWS = np.array([False, True, False, False, True, True])


def dense_x():
    rng = np.random.default_rng(0)
    data = rng.uniform(0.5, 2.0, (6, 3))
    return mj.masked_array(
        jnp.asarray(np.where(ROWS[:, None], data, np.nan)), jnp.asarray(np.repeat(ROWS[:, None], 3, 1))
    )


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
    "exp": (mnp.exp, ALL),
    "log1p": (mnp.log1p, ALL),
    "cos": (mnp.cos, ALL),
    "sqrt": (mnp.sqrt, ALL),
    "negative": (mnp.negative, ALL),
    "relu": (mnn.relu, ALL),
    "mul_scalar": (lambda x: x * 3.0, ALL),
    "add_scalar": (lambda x: x + 1.0, ALL),
    "rdiv_scalar": (lambda x: 1.0 / x, ALL),
    "pow_scalar": (lambda x: x**2, ALL),
    "add_dense": (lambda x: mnp.add(x, jnp.ones((6, 3))), ROW),
    "mul_rowvec": (lambda x: mnp.multiply(x, ROWVEC), ROW),
    "sum": (mnp.sum, ALL),
    "max": (mnp.max, ALL),
    "mean": (mnp.mean, ALL),
    "var": (mnp.var, ALL),
    "logsumexp": (mnp.logsumexp, ALL),
    "sum_axis0": (lambda x: mnp.sum(x, axis=0), ALL),
    "sum_axis1": (lambda x: mnp.sum(x, axis=1), ALL),
    "mean_axis0": (lambda x: mnp.mean(x, axis=0), ALL),
    "std_axis1": (lambda x: mnp.std(x, axis=1), ALL),
    "var_axis0_ddof1": (lambda x: mnp.var(x, axis=0, ddof=1), ALL),
    "max_axis1": (lambda x: mnp.max(x, axis=1), ALL),
    "min_axis0": (lambda x: mnp.min(x, axis=0), ALL),
    "prod_axis1": (lambda x: mnp.prod(x, axis=1), ALL),
    "ptp_axis0": (lambda x: mnp.ptp(x, axis=0), ALL),
    "logsumexp_axis1": (lambda x: mnp.logsumexp(x, axis=1), ALL),
    "norm_axis0": (lambda x: mnp.norm(x, axis=0), ALL),
    "norm1_axis1": (lambda x: mnp.norm(x, ord=1, axis=1), ALL),
    "any_axis1": (lambda x: mnp.any(x > 1.0, axis=1), ALL),
    "all_axis0": (lambda x: mnp.all(x > 1.0, axis=0), ALL),
    "sum_keepdims": (lambda x: mnp.sum(x, axis=1, keepdims=True), ALL),
    "median_axis0": (lambda x: mnp.median(x, axis=0), ROW),
    "softmax_axis1": (lambda x: mnn.softmax(x, axis=1), ALL),
    "softmax_axis0": (lambda x: mnn.softmax(x, axis=0), ALL),
    "log_softmax_axis1": (lambda x: mnn.log_softmax(x, axis=1), ALL),
    "softmin_axis0": (lambda x: mnn.softmin(x, axis=0), ALL),
    "normalize_axis1": (lambda x: mnn.normalize(x, axis=1), ALL),
    "matmul_dense": (lambda x: x @ W, ALL),
    "mul_same_layout": (lambda x: x * (x + 1.0), ALL),
    "transpose": (mnp.transpose, {"dense", "bcoo", "bcoo_hybrid"}),  # BCOO's indices permuted
    "swapaxes": (lambda x: mnp.swapaxes(x, 0, 1), {"dense", "bcoo", "bcoo_hybrid"}),
    "moveaxis": (lambda x: mnp.moveaxis(x, -1, 0), {"dense", "bcoo", "bcoo_hybrid"}),
    "argmax": (lambda x: mnp.argmax(x, axis=0), {"dense"}),
}


# Ops whose result is dense by nature: whole-array reductions on every layout, and on row-sparse
# storage the reductions across the stored axis (BCOO keeps a BCOO result along any axis).
DENSE_RESULT = {"sum", "max", "mean", "var", "logsumexp"}
ACROSS_ROWS = {
    "sum_axis0",
    "mean_axis0",
    "median_axis0",
    "var_axis0_ddof1",
    "min_axis0",
    "ptp_axis0",
    "norm_axis0",
    "all_axis0",
}


def _dense_of(y):
    return y.todense() if hasattr(y, "todense") else y


def _same(got, want):
    got, want = _dense_of(got), _dense_of(want)
    np.testing.assert_array_equal(got.mask, want.mask)
    np.testing.assert_allclose(np.asarray(got.filled(0)), np.asarray(want.filled(0)), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("layout", [lay for lay in STORAGE if lay != "dense"])
def test_layout_keeps_sparse_storage_where_the_op_allows(layout):
    """Which ops keep which storage (values and gradients on every layout are checked for every op
    by the conformance harness, tests/test_conformance.py)."""
    x = layouts()[layout]
    for op, (fn, keeps) in OPS.items():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", mj.StorageFallbackWarning)
            _warned.clear()
            got = fn(x)
        fell_back = any(issubclass(w.category, mj.StorageFallbackWarning) for w in caught)
        assert fell_back == (layout not in keeps), f"{op} on {layout}: fallback={fell_back}"
        if layout in keeps:
            across_rows = op in ACROSS_ROWS and layout == "row_sparse"
            bcoo_matmul = op == "matmul_dense" and layout != "row_sparse"
            expected = "dense" if op in DENSE_RESULT or across_rows or bcoo_matmul else STORAGE[layout]
            assert getattr(got, "storage", "dense") == expected, f"{op} on {layout} gave {got!r}"
        _same(got, fn(layouts()["dense"]))


VMAP_OPS = [
    "exp",
    "mul_scalar",
    "sum",
    "logsumexp",
    "sum_axis1",
    "mean_axis0",
    "softmax_axis1",
    "softmax_axis0",
    "matmul_dense",
]


@pytest.mark.parametrize("layout", ["bcoo", "bcoo_hybrid", "row_sparse"])
@pytest.mark.parametrize("op", VMAP_OPS)
def test_vmap_over_a_batch_of_sparse_arrays(op, layout):
    fn, keeps = OPS[op]
    xs = [dense_x(), mj.masked_array(dense_x().data * 2 - 1, dense_x().mask)]
    build = {
        "bcoo": lambda x: x.tostype("bcoo"),
        "row_sparse": lambda x: x.tostype("row_sparse"),
        "bcoo_hybrid": lambda x: mj.BCOOMaskedArray.from_masked(x, nse=3, n_dense=1),
    }[layout]
    batch = jax.tree_util.tree_map(lambda *leaves: jnp.stack(leaves), *[build(x) for x in xs])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", mj.StorageFallbackWarning)
        out = jax.vmap(lambda v: _dense_of(fn(v)))(batch)
    for i, x in enumerate(xs):
        _same(jax.tree_util.tree_map(lambda leaf, i=i: leaf[i], out), fn(x))


# -- semantics, conversions and edge cases -------------------------------------------------------
BASIC_INDICES = [
    1,
    4,
    -1,
    (4, 2),
    (slice(None), 0),
    slice(1, 5),
    slice(None, None, 2),
    (Ellipsis, 1),
    (None, 4),
    (2, 0),
]


@pytest.mark.parametrize("kind", ["bcoo", "bcoo_batch", "bcoo_hybrid", "row_sparse"])
@pytest.mark.parametrize("compile", [False, True], ids=["eager", "jit"])
def test_basic_indexing_of_a_sparse_layout_equals_indexing_its_dense_array(kind, compile):
    """ints, slices, ``...`` and ``None`` index a sparse layout on its stored entries (BCOO's own
    indexing): the values and masks of ``x.todense()[index]``, unstored positions masked; an int
    out of range raises ``IndexError``."""
    x = layouts()[kind]
    dense = x.todense()
    for index in BASIC_INDICES:
        got = jax.jit(lambda v, index=index: v[index])(x) if compile else x[index]
        got = got if isinstance(got, mj.MaskedArray) else got.todense()
        want = dense[index]
        assert got.shape == want.shape, index
        np.testing.assert_array_equal(np.asarray(got.mask), np.asarray(want.mask), err_msg=str(index))
        np.testing.assert_array_equal(np.asarray(got.filled(0)), np.asarray(want.filled(0)), err_msg=str(index))
    with pytest.raises(IndexError, match="out of bounds for axis 0 with size 6"):
        x[6]


ROW_IDS = {
    "repeated": (jnp.array([3, 0, 3, 5]), None),
    "negative": (jnp.array([-1, -6, 2]), None),
    "masked": (jnp.array([4, 9, 1]), jnp.array([True, False, True])),  # the masked id is out of range: no matter
    "empty": (jnp.zeros((0,), jnp.int32), None),
}


@pytest.mark.parametrize("kind", ["bcoo", "bcoo_batch", "bcoo_hybrid", "row_sparse"])
@pytest.mark.parametrize("ids", list(ROW_IDS), ids=list(ROW_IDS))
@pytest.mark.parametrize("dtype", ["float32", "int32"])
@pytest.mark.parametrize("compile", [False, True], ids=["eager", "jit"])
def test_integer_array_indexing_of_a_sparse_layout_equals_its_dense_array(kind, ids, dtype, compile):
    """``x[ids]`` (a 1-d integer array, or a MaskedArray of ids) on a sparse layout: the values and
    masks of ``x.todense()[ids]``. A row-sparse array, and a BCOO-backed one with one sparse
    dimension, gather their stored rows and keep their layout (no fallback); the other BCOO layouts
    take it on dense storage through the storage fallback."""
    x = layouts()[kind]
    x = x.astype(dtype) if dtype != "float32" else x
    data, valid = ROW_IDS[ids]
    index = data if valid is None else mj.masked_array(data, valid)
    keeps = kind == "row_sparse" or (isinstance(x, mj.BCOOMaskedArray) and x.n_batch == 0 and x.n_sparse == 1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", mj.StorageFallbackWarning)
        _warned.clear()
        got = jax.jit(lambda v, i: v[i])(x, index) if compile else x[index]
    assert any(issubclass(w.category, mj.StorageFallbackWarning) for w in caught) != keeps
    if keeps:
        assert got.storage == x.storage
    got = got.todense() if hasattr(got, "todense") else got
    want = x.todense()[index]
    assert got.shape == want.shape and got.dtype == want.dtype
    np.testing.assert_array_equal(np.asarray(got.mask), np.asarray(want.mask))
    np.testing.assert_array_equal(np.asarray(got.filled(0)), np.asarray(want.filled(0)))


def test_integer_array_indexing_of_row_sparse_rows_out_of_range_and_gradients():
    """A valid id out of range: ``IndexError`` when known, a masked row under ``jit``; the gradient
    of the gathered rows reaches the stored rows they came from (repeats add up)."""
    table = mj.row_sparse(jnp.array([[1.0, 2.0], [3.0, 4.0]]), jnp.array([4, 1]), (6, 2))
    with pytest.raises(IndexError, match="index 7 is out of bounds for axis 0 with size 6"):
        table[jnp.array([0, 7])]
    with pytest.raises(TypeError, match="take_rows: ids must be a 1-d integer array"):
        table.take_rows(jnp.array([0.0, 1.0]))
    under_jit = jax.jit(lambda i: table[i].todense())(jnp.array([7, 4]))
    np.testing.assert_array_equal(np.asarray(under_jit.mask), [[False, False], [True, True]])
    w = jnp.arange(6.0).reshape(3, 2)

    def loss(data):
        rows = mj.row_sparse(data, jnp.array([4, 1]), (6, 2))[jnp.array([4, 4, 1])]
        return jnp.sum(rows.todense().filled(0) * w)

    np.testing.assert_array_equal(np.asarray(jax.grad(loss)(jnp.ones((2, 2)))), [[2.0, 4.0], [4.0, 5.0]])


def test_indexing_a_huge_sparse_array_reads_its_stored_entries_only():
    """A row of a 70,000 x 70,000 x 2 BCOO-backed array with 4 stored entries: O(nse) work, the
    entries of that row and nothing else."""
    ids = jnp.array([[0, 0, 0], [5, 6, 1], [69_999, 3, 0], [5, 7, 0]])
    big = mj.from_bcoo(sparse.BCOO((jnp.array([1.0, 2.0, 3.0, 4.0]), ids), shape=(70_000, 70_000, 2)))
    row = big[5]
    assert isinstance(row, mj.BCOOMaskedArray) and row.shape == (70_000, 2) and row.nse == big.nse
    cell = big[5, 6].todense()
    np.testing.assert_array_equal(np.asarray(cell.mask), [False, True])
    assert float(cell.data[1]) == 2.0
    assert float(big[69_999, 3, 0]) == 3.0 and not bool(big[1, 1, 1].mask)


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


@pytest.mark.parametrize("n,k", [(0, 3), (1, 5), (2, 4), (7, 3), (64, 200), (1000, 1)])
def test_sorted_search_is_searchsorted_looping_on_cpu_only(n, k):
    from masked_jax.layouts._segments import sorted_search

    r = np.random.default_rng(n + k)
    values = jnp.asarray(np.sort(r.integers(0, 20, n)).astype(np.int32))  # duplicates included
    queries = jnp.asarray(r.integers(-3, 24, k).astype(np.int32))  # below, inside and past the range
    expected = np.searchsorted(np.asarray(values), np.asarray(queries), side="left")
    np.testing.assert_array_equal(sorted_search(values, queries), expected)
    np.testing.assert_array_equal(jax.jit(sorted_search)(values, queries), expected)
    np.testing.assert_array_equal(jax.vmap(sorted_search, (None, 0))(values, queries[:, None])[:, 0], expected)

    def lowered(platform):  # lowering for a platform needs no device of that kind
        return export.export(jax.jit(sorted_search), platforms=[platform])(values, queries).mlir_module()

    assert ("stablehlo.while" in lowered("cpu")) == (n > 1)  # the loop: fastest on XLA:CPU
    assert "stablehlo.while" not in lowered("cuda")  # unrolled: no host round trip per trip


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


def test_promised_unique_indices_in_any_order_meet_in_binary_ops():
    """Indices promised unique are not sorted (nor are the optimizers' summed rows): every binary op
    of two row-sparse operands must still find their common rows, eagerly and under jit."""
    from masked_jax.ops import REGISTRY

    a = mj.row_sparse(jnp.array([[1.0], [5.0], [3.0]]), jnp.array([0, 3, 2]), (5, 1))
    b = mj.row_sparse(jnp.array([[1.5], [2.5], [0.5]]), jnp.array([3, 0, 4]), (5, 1), unique_indices=True)
    product = (a * b).todense()
    np.testing.assert_array_equal(np.asarray(product.mask[:, 0]), [True, False, False, True, False])
    np.testing.assert_array_equal(np.asarray(product.data[[0, 3], 0]), [2.5, 7.5])
    tested = 0
    for name in sorted(n for n, spec in REGISTRY.items() if spec.family == "binary"):
        fn = getattr(mnp, name, None)
        try:
            want = fn(a.todense(), b.todense())  # the dense-storage reference
        except (TypeError, ValueError):  # integer-only ops (bitwise, shifts), three-operand ops
            continue
        with warnings.catch_warnings():  # ops without a row-sparse rule densify (and warn): also checked
            warnings.simplefilter("ignore", mj.StorageFallbackWarning)
            for f in (fn, jax.jit(fn)):
                got = f(a, b)
                for g, w in zip(got, want) if isinstance(want, tuple) else [(got, want)]:  # divmod: a pair
                    _same(g, w)
        tested += 1
    assert tested >= 25, tested


@pytest.mark.parametrize("rows,k", [(40, 64), (5000, 64), (7, 3)])  # without and with a sort (rows > 64 k)
def test_distinct_ids_number_every_distinct_row_once(rows, k):
    from masked_jax.layouts._segments import distinct_ids

    rng = np.random.default_rng(rows + k)
    for trial in range(4):
        ids = rng.integers(0, rows + 1, size=k).astype(np.int32)  # rows = padding
        ids[:trial] = rows
        for fn in (distinct_ids, jax.jit(distinct_ids, static_argnums=1)):
            uniq, seg = (np.asarray(a) for a in fn(jnp.asarray(ids), rows))
            present = np.unique(ids[ids < rows])
            d = present.size
            assert sorted(uniq[:d].tolist()) == present.tolist()  # distinct rows first, each once
            assert (uniq[d:] == rows).all()
            np.testing.assert_array_equal(uniq[seg[ids < rows]], ids[ids < rows])
            assert (seg[ids == rows] == k).all()  # padding: past the end, dropped by segment sums
    data = jnp.asarray(rng.normal(size=(k, 2)).astype(np.float32))
    g = mj.row_sparse(data, jnp.asarray(ids), (rows, 2))
    fast, ref = g.sum_duplicates(), g.coalesce()
    _same(fast.todense(), ref.todense())


@pytest.mark.parametrize("storage", ["bcoo", "row_sparse"])
def test_binary_ops_of_sparse_operands_with_different_index_sets(storage):
    rng = np.random.default_rng(3)

    def make(seed):
        rows = np.random.default_rng(seed).random(8) > 0.5
        mask = (
            np.repeat(rows[:, None], 3, 1)
            if storage == "row_sparse"
            else np.random.default_rng(seed).random((8, 3)) > 0.5
        )
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


def _poisoned(shape, seed, p_valid=0.6, block_last=False):
    rng = np.random.default_rng(seed)
    mask = rng.random(shape) < p_valid
    if block_last:  # whole blocks over the last axis: representable by a hybrid layout
        mask = np.broadcast_to(mask[..., :1], shape)
    data = np.where(mask, rng.normal(size=shape), np.nan)
    return mj.masked_array(jnp.asarray(data), jnp.asarray(mask))


AXIS_OPS_3D = {
    "sum_axis1": lambda v: mnp.sum(v, axis=1),
    "sum_axes02_keepdims": lambda v: mnp.sum(v, axis=(0, 2), keepdims=True),
    "mean_axis2": lambda v: mnp.mean(v, axis=2),
    "var_axis0_ddof1": lambda v: mnp.var(v, axis=0, ddof=1),
    "max_axes01": lambda v: mnp.max(v, axis=(0, 1)),
    "prod_axis1": lambda v: mnp.prod(v, axis=1),
    "logsumexp_axis0": lambda v: mnp.logsumexp(v, axis=0),
    "norm_inf_axis2": lambda v: mnp.norm(v, ord=np.inf, axis=2),
    "softmax_axis1": lambda v: mnn.softmax(v, axis=1),
    "softmax_axes01": lambda v: mnn.softmax(v, axis=(0, 1)),
    "log_softmax_axis0": lambda v: mnn.log_softmax(v, axis=0),
    "normalize_axis2": lambda v: mnn.normalize(v, axis=2),
}


@pytest.mark.parametrize("layout", ["bcoo", "bcoo_batch2", "bcoo_hybrid"])
def test_bcoo_reductions_and_softmax_along_axes_stay_sparse_in_3d(layout):
    x = _poisoned((5, 4, 3), 0, block_last=layout == "bcoo_hybrid")
    build = {
        "bcoo": lambda: x.tostype("bcoo"),
        "bcoo_batch2": lambda: mj.BCOOMaskedArray.from_masked(x, nse=3, n_batch=2),
        "bcoo_hybrid": lambda: mj.BCOOMaskedArray.from_masked(x, nse=20, n_dense=1),
    }
    b = build[layout]()
    run_all = lambda v: {name: fn(v) for name, fn in AXIS_OPS_3D.items()}  # one compile
    with mj.strict_storage():  # no op may densify (checked while tracing)
        got_all = jax.jit(run_all)(b)
        want_all = run_all(x)
        for name, got in got_all.items():
            assert got.storage == "bcoo", name
            assert got.data.size <= b.data.size, name  # O(stored entries), never the dense size
            _same(got, want_all[name])
        _same(mnp.var(b, axis=1), mnp.var(x, axis=1))  # and eagerly
        loss = lambda v: mnp.sum(mnn.log_softmax(v, axis=1) ** 2) + mnp.sum(mnp.var(v, axis=1))
        g = mj.grad(loss)(b)
        assert type(g) is type(b) and bool(jnp.all(jnp.isfinite(g.data)))
        _same(g.todense(), mj.grad(loss)(x))


@pytest.mark.parametrize("n_batch", [1, 2])
def test_bcoo_binary_ops_with_batch_dimensions_keep_storage(n_batch):
    x, y = _poisoned((3, 4, 5), 1), _poisoned((3, 4, 5), 2)
    nse = {1: 20, 2: 5}[n_batch]
    a = mj.BCOOMaskedArray.from_masked(x, nse=nse, n_batch=n_batch)
    b = mj.BCOOMaskedArray.from_masked(y, nse=nse, n_batch=n_batch)
    fns = (mnp.multiply, mnp.subtract, mnp.maximum)
    with mj.strict_storage():
        got_all = jax.jit(lambda u, v: [fn(u, v) for fn in fns])(a, b)
        for fn, got in zip(fns, got_all):
            assert got.storage == "bcoo" and got.n_batch == n_batch
            _same(got, fn(x, y))
        _same(mnp.multiply(a, b), mnp.multiply(x, y))  # and eagerly
        g = mj.grad(lambda u: mnp.sum(u * b))(a)
        np.testing.assert_array_equal(np.asarray(g.indices), np.asarray(a.indices))
        _same(g.todense(), mj.grad(lambda u: mnp.sum(u * y))(x))


def test_bcoo_axis_reductions_edge_cases():
    nse0 = mj.from_bcoo(sparse.BCOO((jnp.zeros((0,)), jnp.zeros((0, 2), jnp.int32)), shape=(3, 2)))
    with mj.strict_storage():
        s = mnp.sum(nse0, axis=1)
        assert s.storage == "bcoo" and s.shape == (3,) and not bool(jnp.any(s.todense().mask))
        assert mnn.softmax(nse0, axis=0).nse == 0 and mnp.prod(nse0, axis=0).nse == 0
        # duplicates count once (summed), padding entries are ignored, explicit zeros are valid
        dup = mj.from_bcoo(
            sparse.BCOO(
                (jnp.array([1.0, 2.0, 0.0, jnp.nan]), jnp.array([[0, 1], [0, 1], [1, 0], [3, 0]])), shape=(3, 2)
            )
        )
        np.testing.assert_array_equal(mnp.max(dup, axis=1).todense().filled(-1), [3.0, 0.0, -1])
        np.testing.assert_array_equal(mnp.mean(dup, axis=0).todense().mask, [True, True])
        sm = mnn.softmax(dup, axis=1).todense()
        np.testing.assert_array_equal(sm.filled(-1), [[-1, 1.0], [1.0, -1], [-1, -1]])
    x = _poisoned((4, 3), 3)
    with pytest.raises(ValueError, match="fully valid or fully masked"):
        mj.BCOOMaskedArray.from_masked(mj.masked_array(x.data, x.mask.at[0].set([True, False, True])), n_dense=1)
    with pytest.raises(ValueError, match="nse=1 is too small"):
        mj.BCOOMaskedArray.from_masked(x, nse=1)
    with warnings.catch_warnings(record=True) as caught:  # order statistics and matrix norms densify
        warnings.simplefilter("always", mj.StorageFallbackWarning)
        _warned.clear()
        _same(mnp.median(x.tostype("bcoo"), axis=0), mnp.median(x, axis=0))
    assert any("median" in str(w.message) for w in caught)


@pytest.mark.parametrize("shape", [(0, 3), (4, 0), (0, 0), (0,)])
@pytest.mark.parametrize("layout", ["row_sparse", "bcoo"])
def test_zero_size_arrays_convert_print_and_compute_in_every_layout(layout, shape):
    """Arrays with a zero-size axis (no rows, or rows of no entries) go to each layout and back,
    print, and take elementwise ops and reductions like the dense array: nothing is stored."""
    x = mj.masked_array(jnp.zeros(shape), jnp.zeros(shape, bool))
    y = x.tostype(layout)
    back = y.todense()
    assert back.shape == shape and not np.any(np.asarray(back.mask))
    assert type(y).__name__ in str(y) and type(y).__name__ in y._repr_html_()
    np.testing.assert_array_equal(np.asarray((y * 2.0).todense().mask), np.zeros(shape, bool))
    assert mnp.sum(y).shape == mnp.sum(x).shape


@pytest.mark.parametrize("dtype", [jnp.int8, jnp.uint8, jnp.int16, jnp.uint16], ids=lambda d: jnp.dtype(d).name)
def test_bcoo_with_narrow_index_dtypes_on_a_long_axis(dtype):
    """A BCOO whose indices are 8- or 16-bit, over more rows than 8 bits count, reads as the same
    BCOO with int32 indices: padding at one past the end needs room for the shape."""
    idx = np.array([[100], [5], [7]])
    for data, shape in ((jnp.array([1.0, 2.0, 3.0]), (300,)), (jnp.ones((3, 2)), (300, 2))):
        want = mj.from_bcoo(sparse.BCOO((data, jnp.asarray(idx, jnp.int32)), shape=shape))
        got = mj.from_bcoo(sparse.BCOO((data, jnp.asarray(idx, dtype)), shape=shape))
        for a, b in ((got.todense(), want.todense()), (mnp.sum(got, axis=0), mnp.sum(want, axis=0))):
            a, b = (v.todense() if hasattr(v, "todense") else v for v in (a, b))
            np.testing.assert_array_equal(np.asarray(a.mask), np.asarray(b.mask))
            np.testing.assert_array_equal(np.asarray(a.filled(0)), np.asarray(b.filled(0)))
        if len(shape) == 2:
            np.testing.assert_array_equal(np.sort(np.asarray(got.tostype("row_sparse").indices)), [5, 7, 100])


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bfloat16", "float16"])
def test_half_precision_duplicates_add_up_in_float32(dtype):
    """600 duplicates of one entry add up to 600 in every layout and by every way of summing them
    (coalescing, densifying, reductions, applying them as an update), as jnp.sum of 600 ones does:
    a bfloat16 running sum stops at 256, where 256 + 1 rounds back to 256."""
    ones = jnp.ones((600, 2), dtype)
    rows = mj.row_sparse(ones, jnp.zeros(600, jnp.int32), (10, 2))
    entries = mj.from_bcoo(sparse.BCOO((jnp.ones(600, dtype), jnp.zeros((600, 2), jnp.int32)), shape=(10, 2)))
    want = float(jnp.sum(ones[:, 0]))
    assert want == 600.0
    got = {
        "rows coalesce": rows.coalesce().data[0, 0],
        "rows todense": rows.todense().data[0, 0],
        "rows sum": mnp.sum(rows, axis=0).data[0],
        "rows todense, jit": jax.jit(lambda r: r.todense().data)(rows)[0, 0],
        "bcoo coalesce": entries.coalesce().todense().data[0, 0],
        "bcoo todense": entries.todense().data[0, 0],
        "bcoo sum": mnp.sum(entries, axis=0).todense().data[0],
        "apply_updates": mj.optim.apply_updates(jnp.zeros((10, 2), dtype), rows)[0, 0],
        "apply_updates, jit": jax.jit(mj.optim.apply_updates)(jnp.zeros((10, 2), dtype), rows)[0, 0],
    }
    for name, value in got.items():
        assert value.dtype == dtype and float(value) == want, (name, value)


# -- sparse arrays of any logical size ------------------------------------------------------------
_HUGE = (70_000, 70_000, 2)  # 9.8e9 elements: no linear index fits int32
_HUGE_INDICES = np.array([[0, 1, 0], [69_999, 5, 1], [3, 69_999, 1], [0, 1, 1], [3, 69_999, 1], [69_999, 69_999, 0]])
_HUGE_OPS = {  # name: (op, the axes it reduces, whether integers take it)
    "sum(axis=2)": (lambda x: mnp.sum(x, axis=2), (2,), True),
    "sum(axis=(0, 2))": (lambda x: mnp.sum(x, axis=(0, 2)), (0, 2), True),
    "max(axis=2)": (lambda x: mnp.max(x, axis=2), (2,), True),
    "min(axis=1)": (lambda x: mnp.min(x, axis=1), (1,), True),
    "prod(axis=0)": (lambda x: mnp.prod(x, axis=0), (0,), True),
    "mean(axis=2)": (lambda x: mnp.mean(x, axis=2), (2,), False),
    "softmax(axis=2)": (lambda x: mnn.softmax(x, axis=2), (), False),
    "x * x": (lambda x: x * x, (), True),
    "x + x": (lambda x: x + x, (), True),
    "coalesce": (lambda x: x.coalesce(), (), True),
}


def _entries(x):
    """``{index tuple: value}`` of the valid stored entries of a BCOO-backed array."""
    data, indices, valid = (np.asarray(a) for a in (x.data, x.indices, x.entry_valid()))
    return {tuple(int(c) for c in i): v for i, v, ok in zip(indices, data, valid) if ok}


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize(
    "op,dtype", [(op, d) for op, (_, _, ints) in _HUGE_OPS.items() for d in ("float32", "int32")[: 1 + ints]]
)
def test_sparse_ops_at_a_logical_size_past_int32_equal_them_on_the_compressed_array(op, dtype, jit):
    """A BCOO-backed array of 70,000 x 70,000 x 2 with six stored entries (two of them duplicates)
    reduces, combines, normalises and coalesces in O(stored entries), as the same entries do in
    the small array that keeps each axis's distinct coordinates in order (the ops only compare
    coordinates): same values at the corresponding index tuples, eagerly and under jit."""
    values = np.arange(1, 7).astype(dtype)
    # per axis, the distinct coordinates in order: the small array's coordinates are their ranks
    ranks = [np.unique(_HUGE_INDICES[:, a], return_inverse=True) for a in range(3)]
    small_idx = np.stack([inv for _, inv in ranks], -1)
    small_shape = tuple(len(u) for u, _ in ranks)
    huge = mj.from_bcoo(sparse.BCOO((jnp.asarray(values), jnp.asarray(_HUGE_INDICES, jnp.int32)), shape=_HUGE))
    small = mj.from_bcoo(sparse.BCOO((jnp.asarray(values), jnp.asarray(small_idx, jnp.int32)), shape=small_shape))
    fn, reduced, _ = _HUGE_OPS[op]
    got, want = (jax.jit(fn) if jit else fn)(huge), fn(small)
    kept = [a for a in range(3) if a not in reduced]
    assert got.shape == tuple(_HUGE[a] for a in kept)
    back = {
        tuple(int(ranks[a][0][c]) for a, c in zip(kept, i)): v
        for i, v in _entries(want).items()  # the small array's coordinates, mapped back
    }
    have = _entries(got)
    assert have.keys() == back.keys()
    for key, v in back.items():
        np.testing.assert_allclose(have[key], v, rtol=1e-6, err_msg=str(key))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int32"])
@pytest.mark.parametrize("shape", [(7,), (7, 3)], ids=["scalars", "rows"])
def test_sorted_totals_equal_segment_sums(dtype, shape):
    """The accelerators' duplicate-row sums (sorted segmented scan, one write per segment, unique
    scatter indices) equal ``segment_sum``'s, out-of-range segments dropped, empty input included;
    and so do their gradients."""
    from masked_jax.layouts._segments import segment_total, sorted_totals

    rng = np.random.default_rng(0)
    values = jnp.asarray(rng.integers(-5, 5, size=shape)).astype(dtype)
    segments = jnp.array([3, 0, 3, 5, 0, 7, 3])  # duplicates, an empty segment, one out of range
    for fn in (jax.jit(sorted_totals, static_argnums=2), sorted_totals):
        got = fn(values, segments, 6)
        want = segment_total(values, segments, 6)
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(np.asarray(got.astype(jnp.float32)), np.asarray(want.astype(jnp.float32)))
    assert sorted_totals(values[:0], segments[:0], 6).shape == (6,) + shape[1:]
    if dtype == "float32":
        w = jnp.asarray(rng.normal(size=(6,) + shape[1:]), jnp.float32)
        g_sorted = jax.grad(lambda v: jnp.sum(sorted_totals(v, segments, 6) * w))(values)
        g_segment = jax.grad(lambda v: jnp.sum(segment_total(v, segments, 6) * w))(values)
        np.testing.assert_allclose(np.asarray(g_sorted), np.asarray(g_segment))


# -- reads of reads: a read's result carries only flags that are true of it ---------------------
def _read_layouts():
    """Every layout, with duplicate, unsorted and promised-unique unsorted rows among them."""
    out = dict(layouts())
    data = jnp.array([[1.0, 1.0], [2.0, 2.0], [3.0, 3.0], [4.0, 5.0]])
    out["row_sparse_unsorted"] = mj.row_sparse(data[:3], jnp.array([4, 1, 5]), (6, 2))
    out["row_sparse_promised"] = mj.row_sparse(data[:3], jnp.array([5, 4, 1]), (6, 2), unique_indices=True)
    out["row_sparse_duplicates"] = mj.row_sparse(data, jnp.array([5, 1, 5, 6]), (6, 2))
    out["bcoo_duplicates"] = mj.from_bcoo(sparse.BCOO((data, jnp.array([[5], [1], [5], [3]])), shape=(6, 2)))
    return out


READ_CHAINS = {  # each: reads applied in turn (1-d id arrays, repeated, unsorted, negative, ints, slices)
    "ids_then_ids": (jnp.array([5, 4, 0, 1]), jnp.array([3, 0, 3, 1])),
    "ids_then_negative": (jnp.array([1, 4, 2, 0]), jnp.array([-1, -4, 2])),
    "ids_three_times": (jnp.array([5, 1, 4, 1, 0]), jnp.array([4, 3, 1, 2, 0]), jnp.array([1, 0, 4])),
    "ids_then_int": (jnp.array([4, 1, 0]), 1),
    "ids_then_slice": (jnp.array([5, 4, 1, 0]), slice(1, None)),
    "slice_then_ids": (slice(1, 6), jnp.array([3, 0, 3])),
}


@pytest.mark.parametrize("kind", list(_read_layouts()))
@pytest.mark.parametrize("chain", list(READ_CHAINS))
@pytest.mark.parametrize("dtype", ["float32", "int32"])
@pytest.mark.parametrize("compile", [False, True], ids=["eager", "jit"])
def test_a_read_of_a_read_equals_the_same_reads_of_the_dense_array(kind, chain, dtype, compile):
    """Each read of a layout (integer ids, repeated, unsorted or negative; ints; slices), and each
    read of its result, equals the same read of ``todense()``: a read's result carries only the
    flags (unique, sorted) that are true of it."""
    x = _read_layouts()[kind].astype(dtype)
    dense = _dense_of(x)
    reads = READ_CHAINS[chain]

    def run(v):
        for r in reads:
            v = v[r]
        return _dense_of(v)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", mj.StorageFallbackWarning)
        got = jax.jit(run)(x) if compile else run(x)
    want = run(dense)
    assert got.shape == want.shape and got.dtype == want.dtype
    np.testing.assert_array_equal(np.asarray(got.mask), np.asarray(want.mask))
    np.testing.assert_array_equal(np.asarray(got.filled(0)), np.asarray(want.filled(0)))


def test_a_row_read_of_a_read_finds_every_valid_row():
    """The stored rows of a read are unique but unsorted (padding in the middle): a second read
    still finds each of them."""
    rs = mj.row_sparse(jnp.array([[1.0, 1.0], [2.0, 2.0], [3.0, 3.0]]), jnp.array([4, 1, 7]), (10, 2))
    a = rs[jnp.array([7, 4, 0, 1])]
    np.testing.assert_array_equal(np.asarray(a[jnp.array([3])].todense().filled(0)), [[2.0, 2.0]])
    np.testing.assert_array_equal(np.asarray(a.coalesce().todense().filled(0)), np.asarray(a.todense().filled(0)))


# -- ids out of range: IndexError when known, a masked row under a trace, never another row --------
def _id_layouts():
    out = dict(layouts())
    out["dense_maskless"] = mj.as_masked(jnp.asarray(np.random.default_rng(2).uniform(0.5, 2.0, (6, 3))))
    return out


OUT_OF_RANGE_IDS = {  # 6 rows: -1 is the last row, -6 the first, -7 and 6 are out of range
    "past_end": [6, 0],
    "far_past_end": [1, 1000],
    "below_minus_n": [-7, 2],
    "negative_in_range": [-1, -6, 3],
}


def _id_forms(ids):
    """The forms ids come in: a jax array, a numpy array, an all-valid MaskedArray."""
    a = jnp.asarray(ids, jnp.int32)
    return {
        "jax": a,
        "numpy": np.asarray(ids),
        "masked_all_valid": mj.masked_array(a, jnp.ones(a.shape, bool)),
    }


def _expected_rows(dense, ids):
    """numpy's ``x[ids]`` with every id out of ``[-n, n)`` a masked row (the traced result)."""
    n = dense.shape[0]
    ids = np.asarray(ids)
    ok = (ids >= -n) & (ids < n)
    at = np.where(ok, ids % n, 0)
    data, mask = np.asarray(dense.filled(0))[at], np.asarray(dense.mask)[at] & ok[:, None]
    return np.where(mask, data, 0), mask


@pytest.mark.parametrize("kind", list(_id_layouts()))
@pytest.mark.parametrize("case", list(OUT_OF_RANGE_IDS))
@pytest.mark.parametrize("form", ["jax", "numpy", "masked_all_valid"])
@pytest.mark.parametrize("dtype", ["float32", "int32", "bool"])
def test_ids_out_of_range_raise_eagerly_and_read_masked_rows_under_jit_and_vmap(kind, case, form, dtype):
    """``x[ids]`` for every layout and every form of ids: negative ids in ``[-n, 0)`` count from the
    end (as numpy); an id out of range raises ``IndexError`` when the ids are known, and reads a
    masked row under ``jit`` and ``vmap`` (never the clamped last row). Apart from the error, eager
    and traced reads agree. ``take`` and ``take_along_axis`` (jnp's default ``"fill"`` mode) read
    masked rows for ids out of range, eagerly too."""
    x = _id_layouts()[kind].astype(dtype)
    dense = _dense_of(x)
    raw = OUT_OF_RANGE_IDS[case]
    ids = _id_forms(raw)[form]
    want_data, want_mask = _expected_rows(dense, raw)
    in_range = all(-6 <= i < 6 for i in raw)

    def read(v, i):
        return _dense_of(v[i])

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", mj.StorageFallbackWarning)
        if in_range:
            eager = read(x, ids)
        else:
            with pytest.raises(IndexError, match="out of bounds for axis 0 with size 6"):
                read(x, ids)
        traced_ids = _id_forms(raw)["jax" if form == "numpy" else form]
        jitted = jax.jit(read)(x, traced_ids)
        batched = jax.vmap(read, in_axes=(None, 0))(x, jax.tree.map(lambda a: jnp.stack([a, a[::-1]]), traced_ids))
        # take and take_along_axis in jnp's default "fill" mode: masked rows eagerly and traced alike
        plain = jnp.asarray(raw, jnp.int32)
        taken = [
            _dense_of(mnp.take(x, plain, axis=0)),
            _dense_of(jax.jit(lambda v, i: mnp.take(v, i, axis=0))(x, plain)),
        ]
        along = jnp.broadcast_to(plain[:, None], (len(raw), 3))
        taken.append(_dense_of(mnp.take_along_axis(x, along, axis=0)))
    outs = [jitted, jax.tree.map(lambda a: a[0], batched), *taken]
    if in_range:
        outs.append(eager)
    for got in outs:
        np.testing.assert_array_equal(np.asarray(got.mask), want_mask)
        np.testing.assert_array_equal(np.asarray(got.filled(0)), want_data.astype(dtype))
    np.testing.assert_array_equal(np.asarray(batched.mask[1]), want_mask[::-1])


@pytest.mark.parametrize("kind", ["dense", "dense_maskless", "bcoo"])
def test_ids_out_of_range_along_a_later_axis_and_in_several_parts(kind):
    """``x[:, ids]`` and ``x[ids0, ids1]`` (ids along two axes): the same rules on each axis."""
    x = _id_layouts()[kind]
    dense = _dense_of(x)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", mj.StorageFallbackWarning)
        with pytest.raises(IndexError, match="index 3 is out of bounds for axis 1 with size 3"):
            x[:, jnp.array([0, 3])]
        with pytest.raises(IndexError, match="index -4 is out of bounds for axis 1 with size 3"):
            x[jnp.array([0, 1]), jnp.array([-4, 2])]
        cols = _dense_of(jax.jit(lambda v, i: v[:, i])(x, jnp.array([3, -1, -4])))
        pairs = _dense_of(jax.jit(lambda v, i, j: v[i, j])(x, jnp.array([6, 5, -1]), jnp.array([0, -1, 9])))
    np.testing.assert_array_equal(np.asarray(cols.mask[:, [0, 2]]), np.zeros((6, 2), bool))
    np.testing.assert_array_equal(np.asarray(cols.mask[:, 1]), np.asarray(dense.mask[:, 2]))
    np.testing.assert_array_equal(np.asarray(cols.filled(0)[:, 1]), np.asarray(dense.filled(0)[:, 2]))
    np.testing.assert_array_equal(np.asarray(pairs.mask), [False, bool(dense.mask[5, 2]), False])


# -- a dimension longer than int32 counts ---------------------------------------------------------
_WIDE = (2, 2**31 + 10)  # the padding index of the long axis (its length) is past int32
_WIDE_INDICES = np.array([[0, 5], [1, 2**31 + 5], [1, 7], [0, 2**31 + 5], [1, 7]], np.uint32)
_WIDE_OPS = {  # name: (op, the axes it reduces)
    "sum(axis=0)": (lambda x: mnp.sum(x, axis=0), (0,)),
    "sum(axis=1)": (lambda x: mnp.sum(x, axis=1), (1,)),
    "max(axis=0)": (lambda x: mnp.max(x, axis=0), (0,)),
    "mean(axis=1)": (lambda x: mnp.mean(x, axis=1), (1,)),
    "sum(axis=0, keepdims)": (lambda x: mnp.sum(x, axis=0, keepdims=True), ()),
    "softmax(axis=1)": (lambda x: mnn.softmax(x, axis=1), ()),
    "x * x": (lambda x: x * x, ()),
    "exp": (mnp.exp, ()),
    "coalesce": (lambda x: x.coalesce(), ()),
    "x[1]": (lambda x: x[1].coalesce(), (0,)),  # coalesced: duplicates summed on both sides
}


@pytest.mark.parametrize("x64", [False, True], ids=["x64_off", "x64_on"])
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("op", list(_WIDE_OPS))
def test_sparse_ops_on_a_dimension_longer_than_int32_equal_them_on_the_compressed_array(op, jit, x64):
    """A BCOO-backed (2, 2**31 + 10) array whose stored indices fit 32 bits: its padding index (the
    length) does not fit int32, so the indices are kept in a dtype that holds it (uint32 with x64
    off, int64 with it on); reductions along either axis, elementwise and binary ops, softmax,
    coalescing and reads give the values the same entries give in the small array that keeps each
    axis's distinct coordinates in order."""
    with jax.enable_x64(x64):
        _wide_op_equals_it_on_the_compressed_array(op, jit)


def _wide_op_equals_it_on_the_compressed_array(op, jit):
    values = np.arange(1.0, 6.0, dtype=np.float32)
    ranks = [np.unique(_WIDE_INDICES[:, a], return_inverse=True) for a in range(2)]
    small_idx = np.stack([inv for _, inv in ranks], -1).astype(np.int32)
    small_shape = tuple(len(u) for u, _ in ranks)
    wide = mj.from_bcoo(sparse.BCOO((jnp.asarray(values), jnp.asarray(_WIDE_INDICES)), shape=_WIDE))
    small = mj.from_bcoo(sparse.BCOO((jnp.asarray(values), jnp.asarray(small_idx)), shape=small_shape))
    fn, reduced = _WIDE_OPS[op]
    got, want = (jax.jit(fn) if jit else fn)(wide), fn(small)
    kept = [a for a in range(2) if a not in reduced]
    if op == "sum(axis=0, keepdims)":
        kept = [0, 1]
        ranks[0] = (np.zeros(1, np.int64), None)
    assert got.shape == tuple(1 if op.endswith("keepdims)") and a == 0 else _WIDE[a] for a in kept)
    back = {tuple(int(ranks[a][0][c]) for a, c in zip(kept, i)): v for i, v in _entries(want).items()}
    have = _entries(got)
    assert have.keys() == back.keys()
    for key, v in back.items():
        np.testing.assert_allclose(have[key], v, rtol=1e-6, err_msg=str(key))


def test_a_dimension_no_index_dtype_holds_is_a_clear_error():
    """Past 2**32 - 1 with x64 off no index dtype holds the padding index: a ValueError says to
    enable x64; a row-sparse array of more rows than int32 counts says to use a BCOO-backed one.
    An array with no entries and a long axis converts to BCOO storage."""
    with jax.enable_x64(False):
        b = sparse.BCOO((jnp.ones(1), jnp.zeros((1, 1), jnp.int32)), shape=(2**32 + 3,))
        with pytest.raises(ValueError, match="enable jax_enable_x64"):
            mj.from_bcoo(b)
    assert mj.from_bcoo(b).indices.dtype == jnp.int64  # with x64 on
    with jax.enable_x64(False):  # no entries at all: the padding index of the long axis still fits
        empty = mj.masked_array(jnp.zeros((0, 2**31 + 10)), jnp.zeros((0, 2**31 + 10), bool)).tostype("bcoo")
        assert empty.indices.dtype == jnp.uint32 and mnp.exp(empty).shape == (0, 2**31 + 10)
    with pytest.raises(ValueError, match="BCOO-backed"):
        mj.row_sparse(jnp.ones((1, 2)), jnp.array([3]), (2**31 + 10, 2))
