"""MaskedArray: construction, validation, repr, conversions, pytree, operators and transforms."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import masked_jax as mj
import masked_jax.numpy as mnp

M = jnp.array([True, False, True])


def x3(dtype=jnp.float32):
    return mj.masked_array(jnp.array([1.0, jnp.nan, 3.0], dtype), M)


# -- construction and bad input --------------------------------------------------------------
def test_construction_and_attributes():
    x = mj.masked_array(jnp.arange(6.0, dtype=jnp.float32).reshape(2, 3), jnp.array([True, False, True]))
    assert x.shape == (2, 3) and x.ndim == 2 and x.size == 6 and x.dtype == jnp.float32
    assert x.mask.shape == (2, 3)  # broadcast mask materialised
    np.testing.assert_array_equal(x.mask, [[True, False, True]] * 2)
    assert x.T.shape == (3, 2)
    np.testing.assert_array_equal(x.T.mask, np.asarray(x.mask).T)
    assert mj.masked_array([1, 2], dtype=jnp.float32).dtype == jnp.float32
    assert bool(jnp.all(mj.masked_array(jnp.zeros(2)).mask))


BAD_INPUTS = [
    (lambda: mj.masked_array(jnp.zeros(3), jnp.array([1, 0, 1])), TypeError, "mask must have dtype bool"),
    (lambda: mj.masked_array(jnp.zeros(3), jnp.ones(4, bool)), ValueError, r"mask must have the data's shape \(3,\)"),
    (lambda: mj.masked_array(jnp.zeros((2, 3)), jnp.ones((3, 2), bool)), ValueError, r"got mask of shape \(3, 2\)"),
    (lambda: mj.masked_array(np.array(["a", "b"]), None), TypeError, "data must"),
    (lambda: mj.masked_array(object(), None), TypeError, "data must be a numeric or bool array"),
    (lambda: mj.masked_array(x3(), None), TypeError, "not a MaskedArray"),
    (lambda: mj.masked_array(jnp.zeros(3), "yes"), TypeError, "mask must"),
    (lambda: mj.masked_array(jnp.zeros(3), np.ma.nomask), ValueError, "inverted here"),  # would mask everything
    (lambda: bool(x3()), ValueError, "more than one element"),
    (lambda: float(mj.masked_array(jnp.array(2.0), jnp.array(False))), ValueError, r"x.filled\(fill_value\)"),
    (lambda: jax.jit(lambda v: int(v))(mj.as_masked(jnp.int32(3))), TypeError, "traced"),
    (lambda: np.asarray(x3()), TypeError, "cannot be converted to a plain array"),
    (  # masked ids take rows (table[ids]); beside another index part they have no position
        lambda: x3()[None, mj.masked_array(jnp.array([0]), jnp.array([False]))],
        TypeError,
        "Indexing with a MaskedArray",
    ),
    (lambda: x3()[mj.masked_array(jnp.array([5, 0]), jnp.array([True, False]))], IndexError, "index 5 is out of"),
    (lambda: mnp.add(x3(), "a"), TypeError, "x2 must be an array"),
    (lambda: mnp.add(x3(), None), TypeError, "x2 must be an array"),
    (lambda: mnp.sum(x3(), axis=3), ValueError, "out of bounds"),
    (lambda: mnp.pad(x3(), 1, mode="mean"), ValueError, "pad mode must be one of"),
    (lambda: mnp.quantile(x3(), 0.5, method="weird"), ValueError, "method must be one of"),
    (lambda: mnp.norm(x3(), "fro", axis=0), ValueError, "matrix norm"),
    (lambda: mnp.average(x3(), axis=0, weights=jnp.ones(2)), ValueError, r"or of the averaged axes \(0,\) \(\(3,\)\)"),
    (lambda: mnp.concatenate(x3()), TypeError, "sequence of arrays"),
    (lambda: mj.from_numpy_ma([1, 2]), TypeError, "numpy.ma.MaskedArray"),
    (lambda: x3().at[0].divide(2.0), AttributeError, "divide"),
    (lambda: hash(x3()), TypeError, "unhashable"),
    (lambda: len(mj.as_masked(jnp.float32(1))), TypeError, "0-d"),
    (lambda: mj.nn.one_hot(x3(), 3), TypeError, "integer class indices"),
    (lambda: x3().to_numpy_ma() if jax.jit(lambda x: x.to_numpy_ma())(x3()) else None, TypeError, "concrete"),
]


@pytest.mark.parametrize("call,error,message", BAD_INPUTS, ids=range(len(BAD_INPUTS)))
def test_bad_input_raises_clear_error(call, error, message):
    with pytest.raises(error, match=message):
        call()


@pytest.mark.parametrize("axis", [0, 1])
@pytest.mark.parametrize("compile", [False, True], ids=["eager", "jit"])
def test_indexing_with_masked_ids_gives_masked_rows(axis, compile):
    """``table[ids]`` (``table[:, ids]``) with masked ids: each valid id's row, as the plain
    index gives it, with the table's own mask; a masked id's row masked, whatever its data hold
    (out of range included); equal to ``take``; its gradient reaches the valid ids' rows only."""
    table = mj.masked_array(
        jnp.arange(12.0).reshape(3, 4) if axis == 0 else jnp.arange(12.0).reshape(4, 3),
        jnp.arange(12).reshape((3, 4) if axis == 0 else (4, 3)) % 5 != 0,
    )
    ids = mj.masked_array(jnp.array([2, 99, -1, 0]), jnp.array([True, False, True, True]))
    index = ids if axis == 0 else (slice(None), ids)
    got = jax.jit(lambda t: t[index])(table) if compile else table[index]
    valid = np.asarray(ids.mask)
    for k, (i, ok) in enumerate(zip(np.asarray(ids.data), valid)):
        row = np.take(np.asarray(got.mask), k, axis=axis)
        if not ok:
            assert not row.any()
            continue
        want = table[int(i)] if axis == 0 else table[:, int(i)]
        np.testing.assert_array_equal(row, np.asarray(want.mask))
        np.testing.assert_array_equal(np.take(np.asarray(got.data), k, axis=axis)[row], np.asarray(want.data)[row])
    took = mnp.take(table, ids, axis=axis)
    np.testing.assert_array_equal(np.asarray(took.mask), np.asarray(got.mask))
    grad = mj.grad(lambda t: mnp.sum(t[index]))(table)
    hits = np.zeros(table.shape[axis])
    for i, ok in zip(np.asarray(ids.data), valid):
        if ok:
            hits[int(i)] += 1
    want_grad = (hits[:, None] if axis == 0 else hits[None, :]) * np.asarray(table.mask)
    np.testing.assert_array_equal(np.asarray(grad.filled(0) if hasattr(grad, "filled") else grad), want_grad)


# -- repr and conversions -------------------------------------------------------------------------
def test_repr_concrete_and_traced():
    assert repr(x3()) == "MaskedArray([1.0 -- 3.0], dtype=float32)"
    two = mj.masked_array(jnp.array([[1, 2], [3, 4]], jnp.int32), jnp.array([[True, False], [False, True]]))
    assert repr(two) == "MaskedArray([[1 --]\n             [-- 4]], dtype=int32)"
    seen = []
    jax.jit(lambda x: seen.append(repr(x)) or x)(mj.as_masked(jnp.zeros((3, 4), jnp.float32)))
    assert seen == ["MaskedArray(float32[3, 4])"]
    assert "..." in repr(mj.as_masked(jnp.zeros((100, 100))))  # summarised as numpy.ma (tests/test_tree.py)


@pytest.mark.parametrize("shape", [(0,), (0, 3), (3, 0), (2, 0, 4)], ids=str)
@pytest.mark.parametrize("dtype", ["float32", "int32", "bool", "bfloat16"])
def test_repr_of_an_empty_array_shows_its_shape_in_every_layout(shape, dtype):
    """An array with no elements prints its shape, as ``jax.Array`` does (``[]`` alone has none), in
    every layout: the dense one as jax prints the data, the sparse ones in their summary line."""
    data = jnp.zeros(shape, dtype)
    x = mj.masked_array(data, jnp.zeros(shape, bool))
    assert repr(x) == str(x) == repr(data).replace("Array(", "MaskedArray(", 1)
    assert repr(mj.as_masked(data)) == repr(x)  # a statically valid array: the same text
    dims = ", ".join(str(d) for d in shape)
    for storage in ("bcoo", "row_sparse"):
        y = x.tostype(storage)
        assert f"{dtype}[{dims}]" in repr(y) and repr(y.todense()) == repr(x)


def test_numpy_ma_round_trip_inverts_mask():
    a = np.ma.masked_array([1.0, 2.0, 3.0], mask=[False, True, False])
    x = mj.from_numpy_ma(a)
    np.testing.assert_array_equal(x.mask, [True, False, True])
    back = x.to_numpy_ma()
    np.testing.assert_array_equal(np.ma.getmaskarray(back), [False, True, False])
    np.testing.assert_array_equal(back.compressed(), [1.0, 3.0])
    # nomask converts to all valid; as_masked accepts numpy.ma too.
    assert bool(jnp.all(mj.from_numpy_ma(np.ma.masked_array([1, 2])).mask))
    np.testing.assert_array_equal(mj.as_masked(a).mask, [True, False, True])


def test_filled_count_astype():
    x = x3()
    np.testing.assert_array_equal(x.filled(), [1.0, 0.0, 3.0])
    np.testing.assert_array_equal(x.filled(-5), [1.0, -5.0, 3.0])
    assert int(x.count()) == 2
    y = x.astype(jnp.int32)
    assert y.dtype == jnp.int32
    np.testing.assert_array_equal(y.mask, M)
    assert mj.as_masked(x) is x


# -- operators ----------------------------------------------------------------------------------
def test_operators_follow_binary_semantics():
    x = x3()
    y = mj.masked_array(jnp.array([2.0, 2.0, 0.0]), jnp.array([True, True, False]))
    for got, fn in [
        (x + y, np.add),
        (x - y, np.subtract),
        (x * y, np.multiply),
        (x / y, np.divide),
        (x**y, np.power),
        (x // y, np.floor_divide),
        (x % y, np.mod),
    ]:
        np.testing.assert_array_equal(got.mask, [True, False, False])
        assert float(got.data[0]) == pytest.approx(fn(1.0, 2.0))
    np.testing.assert_array_equal((2.0 * x).mask, M)
    np.testing.assert_array_equal((2.0 - x).filled(), [1.0, 0.0, -1.0])
    np.testing.assert_array_equal((jnp.ones(3) + x).filled(), [2.0, 0.0, 4.0])
    np.testing.assert_array_equal((np.ones(3) + x).filled(), [2.0, 0.0, 4.0])
    np.testing.assert_array_equal((x > 2).filled(False), [False, False, True])
    np.testing.assert_array_equal((x == 1.0).filled(False), [True, False, False])
    np.testing.assert_array_equal((-x).filled(), [-1.0, 0.0, -3.0])
    np.testing.assert_array_equal(abs(-x).filled(), [1.0, 0.0, 3.0])
    i = mj.masked_array(jnp.array([1, 2, 3]), M)
    np.testing.assert_array_equal((i & 1).filled(), [1, 0, 1])
    np.testing.assert_array_equal((~i).filled(), [-2, 0, -4])
    np.testing.assert_array_equal((i << 1).filled(), [2, 0, 6])


def test_matmul_operator_and_methods():
    a = mj.masked_array(jnp.array([[1.0, 2.0], [3.0, 4.0]]), jnp.array([[True, False], [False, False]]))
    out = a @ jnp.array([[1.0, 1.0], [1.0, 1.0]])
    np.testing.assert_array_equal(out.mask, [[True, True], [False, False]])
    np.testing.assert_array_equal(out.data[0], [1.0, 1.0])
    assert float(a.sum().data) == 1.0
    np.testing.assert_array_equal(a.sum(axis=1).mask, [True, False])
    np.testing.assert_array_equal(a.reshape(4).mask, [True, False, False, False])
    np.testing.assert_array_equal(a.reshape(1, 4).shape, (1, 4))
    np.testing.assert_array_equal(a.transpose(1, 0).mask, [[True, False], [False, False]])
    assert a.ravel().shape == (4,) and a.flatten().shape == (4,)
    assert int(a.argmax().data) == 0
    np.testing.assert_array_equal(a.max(axis=0).mask, [True, False])


def test_iteration_and_len():
    x = x3()
    assert len(x) == 3
    rows = list(x)
    assert [bool(r.mask) for r in rows] == [True, False, True]


# -- indexing, .at, where -----------------------------------------------------------------------------
def test_indexing_moves_mask():
    x = mj.masked_array(jnp.arange(12.0).reshape(3, 4), jnp.arange(12).reshape(3, 4) % 3 != 0)
    ref = x.to_numpy_ma()
    for index in [
        0,
        (1, 2),
        slice(1, None),
        (slice(None), 1),
        (Ellipsis, -1),
        jnp.array([2, 0]),
        (jnp.array([0, 2]), jnp.array([1, 3])),
        jnp.array([True, False, True]),
        None,
    ]:
        got = x[index]
        exp = ref[np.asarray(index) if isinstance(index, jax.Array) else index]
        np.testing.assert_array_equal(got.mask, ~np.ma.getmaskarray(exp))
        np.testing.assert_array_equal(got.filled(-1), np.ma.filled(exp, -1))


def test_at_set_makes_valid_and_add_combines_validity():
    x = mj.masked_array(jnp.array([1.0, jnp.nan, 3.0, 4.0]), jnp.array([True, False, True, False]))
    s = x.at[1].set(5.0)
    np.testing.assert_array_equal(s.mask, [True, True, True, False])
    assert float(s.data[1]) == 5.0
    v = mj.masked_array(jnp.array([10.0, 20.0]), jnp.array([True, False]))
    s2 = x.at[jnp.array([0, 2])].set(v)  # setting a masked value masks the element
    np.testing.assert_array_equal(s2.mask, [True, False, False, False])
    a = x.at[jnp.array([0, 1])].add(1.0)
    np.testing.assert_array_equal(a.mask, x.mask)
    assert float(a.data[0]) == 2.0
    a2 = x.at[jnp.array([0, 2])].add(v)
    np.testing.assert_array_equal(a2.mask, [True, False, False, False])
    assert float(a2.data[0]) == 11.0
    d = x.at[jnp.array([0, 0])].add(mj.masked_array(jnp.array([1.0, 1.0]), jnp.array([True, False])))
    assert not bool(d.mask[0])  # duplicates: any masked contribution masks the element
    m = x.at[2].min(0.0)
    assert float(m.data[2]) == 0.0 and bool(m.mask[2])
    np.testing.assert_array_equal(x.at[0].multiply(3.0).filled(), [3.0, 0.0, 3.0, 0.0])
    np.testing.assert_array_equal(x.at[0].get().mask, True)


def test_where_selects_data_and_mask():
    a = mj.masked_array(jnp.array([1.0, 2.0, 3.0]), jnp.array([True, False, True]))
    b = mj.masked_array(jnp.array([10.0, 20.0, 30.0]), jnp.array([False, True, True]))
    c = jnp.array([True, True, False])
    w = mnp.where(c, a, b)
    np.testing.assert_array_equal(w.mask, [True, False, True])
    np.testing.assert_array_equal(w.filled(), [1.0, 0.0, 30.0])
    cm = mj.masked_array(c, jnp.array([True, True, False]))  # a masked condition masks the result
    np.testing.assert_array_equal(mnp.where(cm, a, b).mask, [True, False, False])
    np.testing.assert_array_equal(mnp.where(c, a, 0.0).mask, [True, False, True])
    np.testing.assert_array_equal(mnp.where(c, 1.0, 0.0).mask, [True, True, True])


# -- pytree and transforms ------------------------------------------------------------------------
def test_pytree_round_trip():
    x = x3()
    leaves, tree = jax.tree_util.tree_flatten(x)
    assert len(leaves) == 2 and leaves[1].dtype == jnp.bool_
    y = jax.tree_util.tree_unflatten(tree, leaves)
    assert isinstance(y, mj.MaskedArray)
    np.testing.assert_array_equal(y.mask, x.mask)
    z = jax.tree_util.tree_map(lambda l: l, {"a": x, "b": [x]})
    assert isinstance(z["b"][0], mj.MaskedArray)


def test_statically_valid_arrays_store_no_mask():
    a = jnp.array([[1.0, 4.0], [9.0, 16.0]])
    for x in (mj.masked_array(a), mj.as_masked(a), mnp.asarray(a), mj.from_numpy_ma(np.ma.masked_array(np.asarray(a)))):
        assert x.compact_mask is None and x.mask.shape == (2, 2) and bool(x.mask.all())
        leaves, tree = jax.tree_util.tree_flatten(x)
        assert len(leaves) == 1 and tree.num_leaves == 1  # one leaf: the data
    x = mj.masked_array(a)
    # elementwise and shape ops keep it mask-less, eagerly and inside jit (where None is static)
    assert (mnp.sqrt(x) * 2 + x).T.compact_mask is None
    seen = []

    @jax.jit
    def f(x):
        y = mnp.sqrt(x) + 1.0
        seen.append(y.compact_mask)
        return y

    assert f(x).compact_mask is None and seen == [None]
    # jax.grad takes it directly: there is no bool leaf
    g = jax.grad(lambda x: mnp.sum(mnp.sqrt(x)).data)(x)
    assert g.compact_mask is None and mj.grad(lambda x: mnp.sum(mnp.sqrt(x)).data)(x).compact_mask is None
    np.testing.assert_allclose(g.data, 0.5 / np.sqrt(np.asarray(a)))
    np.testing.assert_allclose(jax.vmap(lambda r: mnp.sum(r).data)(x), a.sum(1))
    # meeting a masked array gives that array's mask; a reduction gives its result a mask
    m = mj.masked_array(a, jnp.array([True, False]))
    np.testing.assert_array_equal((x + m).mask, [[True, False], [True, False]])
    np.testing.assert_allclose(mnp.sum(x, axis=0).filled(), [10.0, 20.0])
    for out in (mnp.sum(x, axis=0), mnp.mean(x), mnp.max(x, 1), mnp.cumsum(x, 0), mj.nn.softmax(x)):
        assert out.compact_mask is None  # no slice is empty
    empty = mnp.max(mj.as_masked(jnp.zeros((0, 3))), axis=0)  # empty slices have no maximum: masked
    assert empty.compact_mask is not None and not bool(empty.mask.any())
    assert x.filled(-1) is x.data
    # a carry that gains a mask needs one from the start: jax names the mask-less carry
    with pytest.raises(TypeError, match="mask"):
        jax.lax.scan(lambda c, r: (c + r, None), mj.as_masked(jnp.zeros(2)), m[:1])
    final, _ = jax.lax.scan(lambda c, r: (c + r, None), mj.masked_array(jnp.zeros(2), jnp.ones(2, bool)), m[:1])
    np.testing.assert_array_equal(final.mask, [True, False])


def test_jit_equals_eager_and_no_retrace_on_mask_change():
    traces = []

    @jax.jit
    def f(x):
        traces.append(1)
        return mnp.mean(mj.nn.softmax(x, axis=-1) * x, axis=-1)

    rng = np.random.default_rng(0)
    data = jnp.asarray(rng.normal(size=(4, 5)), jnp.float32)
    for seed in range(3):
        mask = jnp.asarray(np.random.default_rng(seed).random((4, 5)) > 0.4)
        x = mj.masked_array(data, mask)
        got, want = f(x), mnp.mean(mj.nn.softmax(x, axis=-1) * x, axis=-1)
        np.testing.assert_array_equal(got.mask, want.mask)
        np.testing.assert_allclose(got.filled(), want.filled(), rtol=1e-6)
    assert len(traces) == 1


def test_vmap_over_leading_axis():
    rng = np.random.default_rng(1)
    x = mj.masked_array(jnp.asarray(rng.normal(size=(3, 4))), jnp.asarray(rng.random((3, 4)) > 0.5))
    out = jax.vmap(lambda r: mnp.sum(r * 2.0))(x)
    want = mnp.sum(x * 2.0, axis=1)
    np.testing.assert_array_equal(out.mask, want.mask)
    np.testing.assert_allclose(out.filled(), want.filled())
    out2 = jax.vmap(mnp.var, in_axes=(1,))(x)
    np.testing.assert_allclose(out2.filled(), mnp.var(x, axis=0).filled(), rtol=1e-10)


def test_scan_carries_masked_array():
    xs = mj.masked_array(jnp.arange(6.0).reshape(3, 2), jnp.array([[True, False], [True, True], [False, True]]))

    def step(carry, row):
        new = mnp.where(row.mask, carry + row.filled(), carry)
        return new, mnp.max(row)

    init = mj.masked_array(jnp.zeros(2), jnp.array([True, True]))
    final, maxes = jax.lax.scan(step, init, xs)
    assert isinstance(final, mj.MaskedArray) and isinstance(maxes, mj.MaskedArray)
    np.testing.assert_array_equal(final.filled(), [0 + 2, 3 + 5])
    np.testing.assert_array_equal(maxes.filled(), [0.0, 3.0, 5.0])


def test_grad_allow_int_flows_through_pytree():
    x = x3()
    g = jax.grad(lambda x: mnp.sum(mnp.log(x)).data, allow_int=True)(x)
    assert isinstance(g, mj.MaskedArray)
    np.testing.assert_allclose(np.asarray(g.data), [1.0, 0.0, 1 / 3])


def test_nan_under_mask_never_leaks():
    x = mj.masked_array(
        jnp.array([[1.0, jnp.nan, jnp.inf], [-jnp.inf, 2.0, jnp.nan]]),
        jnp.array([[True, False, False], [False, True, False]]),
    )
    for out in [
        mnp.sum(x, 1),
        mnp.mean(x, 1),
        mnp.var(x, 1),
        mnp.max(x, 1),
        mnp.logsumexp(x, 1),
        mj.nn.softmax(x),
        mj.nn.log_softmax(x),
        mnp.norm(x, axis=1),
        x @ x.T,
        mnp.median(x, 1),
    ]:
        vals = np.asarray(out.data)[np.asarray(out.mask)]
        assert np.all(np.isfinite(vals)), out


class ChexVariantsTest(chex.TestCase):
    """The same masked computations with and without jit (chex variants), compared as pytrees."""

    @chex.variants(with_jit=True, without_jit=True)
    def test_reductions_and_gradients_with_and_without_jit(self):
        x = mj.masked_array(
            jnp.array([[1.0, jnp.nan, 3.0], [jnp.inf, 5.0, 6.0]]), jnp.array([[True, False, True], [False, True, True]])
        )
        stats = self.variant(lambda v: (mnp.mean(v, axis=1), mnp.std(v, axis=1), mnp.logsumexp(v, axis=1)))(x)
        chex.assert_trees_all_equal_structs(stats, (x[0], x[0], x[0]))
        chex.assert_trees_all_close(stats[0].filled(0), jnp.array([2.0, 5.5]))
        grads = self.variant(mj.grad(lambda v: mnp.sum(mnp.log1p(v * v))))(x)
        chex.assert_trees_all_equal_structs(grads, x)  # a gradient is a MaskedArray with x's mask
        chex.assert_trees_all_equal(grads.mask, x.mask)
        chex.assert_tree_all_finite(grads.data)


def _layouts_of(data, mask):
    """The operand in each storage: dense and BCOO with ``mask``, row-sparse with its whole rows valid."""
    x = mj.masked_array(data, mask)
    rows = mj.masked_array(
        data, jnp.broadcast_to(jnp.all(mask, axis=1, keepdims=True) | (jnp.arange(len(mask)) == 0)[:, None], mask.shape)
    )
    return {"dense": x, "rows": rows.tostype("row_sparse"), "bcoo": x.tostype("bcoo")}


def test_jax_array_methods_follow_the_masked_functions_in_every_layout():
    """The jax.Array methods that are not one registry op (real, imag, conjugate, copy, diagonal,
    trace, nonzero, searchsorted, round(), divmod(), block_until_ready, argpartition) give the
    masked function's result, in every layout."""
    data = jnp.array([[1.25, -2.5, 3.0], [4.75, 5.5, -6.0], [7.0, 8.25, 9.5]])
    mask = jnp.array([[True, False, True], [True, True, False], [False, True, True]])
    for name, x in _layouts_of(data, mask).items():
        dense = x.todense() if name != "dense" else x
        for got, want in [
            (x.real, mnp.real(dense)),
            (x.imag, mnp.imag(dense)),
            (x.conjugate(), mnp.conj(dense)),
            (x.copy(), dense),
            (x.diagonal(1), mnp.diagonal(dense, 1)),
            (x.trace(), mnp.trace(dense)),
            (round(x), mnp.round(dense)),
            (round(x, 1), mnp.round(dense, 1)),
            (divmod(x, 2.0)[0], mnp.floor_divide(dense, 2.0)),
            (divmod(x, 2.0)[1], mnp.mod(dense, 2.0)),
            (divmod(7.0, x)[1], mnp.mod(7.0, dense)),
            (x.block_until_ready(), dense),
        ]:
            got = got.todense() if hasattr(got, "todense") else got
            np.testing.assert_array_equal(np.asarray(got.mask), np.asarray(want.mask), err_msg=name)
            np.testing.assert_array_equal(np.asarray(got.filled(0)), np.asarray(want.filled(0)), err_msg=name)
        for got, want in zip(x.nonzero(), jnp.nonzero(dense.mask & (data != 0))):
            np.testing.assert_array_equal(got, want)
    row = mj.masked_array(jnp.array([3.0, 1.0, 99.0, 2.0]), jnp.array([True, True, False, True]))
    assert row.searchsorted(2.5).tolist() == 2
    assert row.argpartition(1).tolist() == mnp.argpartition(row, 1).tolist()
    assert isinstance(x.copy(), type(x)) and x.copy() is not x


def test_item_tolist_and_format():
    """item() and float() agree; tolist() puts None at masked entries (numpy.ma's tolist); a 0-d
    array formats as jax's, a masked one as `--` padded to the width; a masked element has no item."""
    x = mj.masked_array(jnp.array([[1.5, 2.0], [3.0, 4.5]]), jnp.array([[True, False], [True, True]]))
    assert x.item(0) == 1.5 and x.item(1, 0) == 3.0 and x[1, 1].item() == 4.5
    assert x.tolist() == [[1.5, None], [3.0, 4.5]] == x.to_numpy_ma().tolist()
    assert mj.masked_array(jnp.array(7, jnp.int8)).tolist() == 7
    assert mj.masked_array(jnp.array(7), jnp.array(False)).tolist() is None
    assert f"{x[0, 0]:.3f}|{x[0, 1]:>6.1f}|{x[0, 1]:*^6}|{x[0, 1]:08.2f}" == "1.500|    --|**--**|      --"
    assert f"{x[0, 0]}" == str(x[0, 0])
    with pytest.raises(ValueError, match="masked element"):
        x.item(1)
    with pytest.raises(ValueError, match="one element"):
        x.item()
    with pytest.raises(TypeError, match="0-d"):
        f"{x:.2f}"
    with pytest.raises(TypeError, match="traced"):
        jax.jit(lambda v: v.tolist())(x)


def test_in_looks_at_valid_entries_only():
    """``v in x``: a masked entry neither matches nor stops the search (iterating would meet it)."""
    x = mj.masked_array(jnp.array([1.0, 5.0, 2.0]), jnp.array([True, False, True]))
    assert 2.0 in x and 1.0 in x and 5.0 not in x and 7.0 not in x
    assert 2.0 in x.tostype("bcoo").todense()
    with pytest.raises(TypeError, match="traced"):
        jax.jit(lambda v: 2.0 in v)(x)
