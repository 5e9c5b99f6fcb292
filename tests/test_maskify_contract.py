"""``maskify`` against the contract where plain code meets its edges: reductions of nothing,
``jnp.unique(size=...)``, which axis of a scan's carry holds the rows, scans whose inputs are
masked by different rows, loop counters as indices, and the errors of code ``maskify`` cannot
trace. Each is compared with ``masked_jax.numpy`` or with a reference computed on the valid
entries alone, eagerly and under ``jit``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import masked_jax as mj
import masked_jax.numpy as mnp

MODES = ("eager", "jit")


def _run(fn, mode, *args, **kwargs):
    f = mj.maskify(fn)
    return (jax.jit(f) if mode == "jit" else f)(*args, **kwargs)


def _pair(x):
    """``(data, mask at the data's shape)`` of a masked or plain result."""
    if isinstance(x, mj.MaskedArray):
        return np.asarray(x.data), np.asarray(x.mask)
    x = np.asarray(x)
    return x, np.ones(x.shape, bool)


def _same(got, want, what=""):
    """Equal masks, and equal values where valid (NaN equal to NaN)."""
    (gd, gm), (wd, wm) = _pair(got), _pair(want)
    assert gd.shape == wd.shape and gd.dtype == wd.dtype, (what, gd.shape, wd.shape, gd.dtype, wd.dtype)
    np.testing.assert_array_equal(gm, wm, err_msg=f"{what}: masks")
    np.testing.assert_allclose(gd[gm], wd[wm], rtol=1e-5, atol=1e-6, equal_nan=True, err_msg=f"{what}: values")


# -- reductions of nothing -----------------------------------------------------------------------
REDUCTIONS = {
    "sum": (jnp.sum, mnp.sum),
    "prod": (jnp.prod, mnp.prod),
    "mean": (jnp.mean, mnp.mean),
    "var": (jnp.var, mnp.var),
    "std": (jnp.std, mnp.std),
    "any": (jnp.any, mnp.any),
    "all": (jnp.all, mnp.all),
    "logsumexp": (jax.nn.logsumexp, mnp.logsumexp),
    "norm": (jnp.linalg.norm, mnp.linalg.norm),
    "count_nonzero": (jnp.count_nonzero, mnp.count_nonzero),
}
IDENTITY = {"sum", "prod", "any", "all", "logsumexp", "norm", "count_nonzero"}
# (data shape, axis): the reduced axes hold no element
EMPTY = {"rows": ((3, 0), 1), "all": ((0,), None), "inner": ((2, 0, 4), (1, 2)), "lead": ((0, 3), 0)}
MASKS = {
    "no mask": lambda shape: None,
    "empty mask": lambda shape: np.zeros(shape, bool),
    "compact mask": lambda shape: np.arange(shape[0]).reshape((-1,) + (1,) * (len(shape) - 1)) % 2 == 0,
}


def _empty(shape, mask):
    x = jnp.zeros(shape, jnp.float32)
    return mj.masked_array(x) if mask is None else mj.masked_array(x, jnp.asarray(mask))


def _empty_cases():
    for name in REDUCTIONS:
        for masks in MASKS:
            for where, (shape, axis) in EMPTY.items():
                if masks == "compact mask" and shape[0] == 0:
                    continue  # no leading rows to mask
                if name == "norm" and isinstance(axis, tuple):
                    continue  # a matrix norm (Frobenius): test_a_frobenius_norm_of_nothing
                yield name, masks, where


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("keepdims", [False, True])
@pytest.mark.parametrize("name, masks, where", list(_empty_cases()))
def test_a_reduction_of_nothing_agrees_with_masked_jax_numpy(name, masks, where, keepdims, mode):
    """A slice with no element gives the reduction's identity, valid, where the reduction of
    nothing is defined (sum, norm 0, prod 1, logsumexp -inf, any False, all True, a count 0), and
    is masked where it is not (mean, var, std): as masked_jax.numpy, with and without a mask."""
    shape, axis = EMPTY[where]
    mask = MASKS[masks](shape)
    x = _empty(shape, mask)
    jnp_fn, mnp_fn = REDUCTIONS[name]
    got = _run(lambda v: jnp_fn(v, axis=axis, keepdims=keepdims), mode, x)
    want = mnp_fn(x, axis=axis, keepdims=keepdims)
    _same(got, want, name)
    if name in IDENTITY:  # valid, jnp's value
        plain = jnp_fn(jnp.zeros(shape, jnp.float32), axis=axis, keepdims=keepdims)
        _same(got, plain, name)
    else:
        assert not _pair(got)[1].any(), f"{name} of nothing must be masked"


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("masked", [False, True])
def test_a_frobenius_norm_of_nothing(masked, mode):
    x = _empty((2, 0, 4), np.zeros((2, 0, 4), bool) if masked else None)
    got = _run(lambda v: jnp.linalg.norm(v, axis=(1, 2)), mode, x)
    _same(got, jnp.zeros(2, jnp.float32), "fro")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize(
    "fn",
    [jnp.matmul, jnp.dot, lambda a, b: jnp.einsum("ij,jk->ik", a, b), lambda a, b: jnp.tensordot(a, b, 1)],
    ids=["matmul", "dot", "einsum", "tensordot"],
)
def test_a_contraction_over_nothing_is_a_valid_zero(fn, masked, mode):
    """``a @ b`` with a zero-size contracted dim sums nothing: 0, valid, as jnp (with a masked
    or a mask-less operand, in maskify and in masked_jax.numpy alike)."""
    a = _empty((3, 0), np.zeros((3, 0), bool) if masked else None)
    b = (
        mj.masked_array(jnp.ones((0, 4), jnp.float32), jnp.zeros((0, 4), bool))
        if masked
        else jnp.ones((0, 4), jnp.float32)
    )
    want = jnp.zeros((3, 4), jnp.float32)
    _same(_run(fn, mode, a, b), want, "maskify")
    _same(mnp.matmul(a, b), want, "mnp.matmul")
    _same(mnp.einsum("ij,jk->ik", a, b), want, "mnp.einsum")


@pytest.mark.parametrize("mode", MODES)
def test_a_mean_of_nothing_after_a_valid_sum_of_nothing(mode):
    """The sum of nothing is valid, its mean masked: the count of a masked sum is still read."""
    x = _empty((3, 0), np.zeros((3, 0), bool))
    total, mean = _run(lambda v: (jnp.sum(v, axis=1), jnp.sum(v, axis=1) / 0.0), mode, x)
    _same(total, jnp.zeros(3, jnp.float32))
    assert not _pair(mean)[1].any()


def test_a_maximum_of_nothing_raises_jnps_error():
    with pytest.raises(ValueError, match="zero-size"):
        mj.maskify(lambda v: jnp.max(v, axis=1))(_empty((3, 0), np.zeros((3, 0), bool)))


# -- jnp.unique(size=...) ------------------------------------------------------------------------
UNIQUE_MASKS = {
    "right": [1, 1, 1, 1, 0, 0, 0],
    "holes": [0, 1, 1, 0, 1, 1, 0],
    "left": [0, 0, 1, 1, 1, 1, 1],
    "all valid": [1, 1, 1, 1, 1, 1, 1],
    "none valid": [0, 0, 0, 0, 0, 0, 0],
}
UNIQUE_DATA = np.array([3.0, 1.0, 3.0, 5.0, 1.0, 2.0, 5.0], np.float32)  # duplicates throughout


def _unique_input(valid, dtype=np.float32):
    valid = np.asarray(valid, bool)
    data = UNIQUE_DATA.astype(dtype)
    padded = np.where(valid, data, np.nan) if np.issubdtype(dtype, np.floating) else np.where(valid, data, 99)
    return mj.masked_array(jnp.asarray(padded), jnp.asarray(valid)), data[valid], np.flatnonzero(valid)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("padding", list(UNIQUE_MASKS))
@pytest.mark.parametrize("fill", [0.0, None, -7.0])
@pytest.mark.parametrize("size", [6, 3])
def test_unique_with_size_is_the_valid_values_in_order_then_fill(size, fill, padding, mode):
    """jnp.unique(x, size=...) gives the distinct valid values in order, then fill entries, as
    jnp.unique of the valid values alone (the fill entries valid), with NaN in the padding."""
    x, valid_values, _ = _unique_input(UNIQUE_MASKS[padding])
    got = _run(lambda v: jnp.unique(v, size=size, fill_value=fill), mode, x)
    if valid_values.size == 0:
        if fill is None:  # no value to fill with: masked
            assert not _pair(got)[1].any()
            return
        want = jnp.full((size,), fill, jnp.float32)
    else:
        want = jnp.unique(jnp.asarray(valid_values), size=size, fill_value=fill)
    _same(got, want, padding)
    _same(mnp.unique(x, size=size, fill_value=fill), got, "masked_jax.numpy.unique")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("padding", ["right", "holes", "left"])
def test_unique_flags_and_the_array_api_forms(padding, mode):
    """return_index, return_inverse and return_counts, and jnp.unique_all / unique_counts /
    unique_values: each result as jnp gives it for the valid values (the first indices as
    positions in the padded array, the inverse masked where the input is)."""
    x, valid_values, where = _unique_input(UNIQUE_MASKS[padding])
    ref = jnp.unique(
        jnp.asarray(valid_values), size=6, fill_value=0.0, return_index=True, return_inverse=True, return_counts=True
    )
    values, first, inverse, counts = _run(
        lambda v: jnp.unique(v, size=6, fill_value=0.0, return_index=True, return_inverse=True, return_counts=True),
        mode,
        x,
    )
    _same(values, ref[0], "values")
    _same(first, jnp.asarray(where[np.asarray(ref[1])]), "first indices")
    inv_data, inv_mask = _pair(inverse)
    np.testing.assert_array_equal(inv_mask, np.asarray(x.mask))
    np.testing.assert_array_equal(inv_data[inv_mask], np.asarray(ref[2]))
    _same(counts, ref[3], "counts")
    every = _run(lambda v: jnp.unique_all(v, size=6, fill_value=-1.0), mode, x)
    ref_all = jnp.unique_all(jnp.asarray(valid_values), size=6, fill_value=-1.0)
    _same(every.values, ref_all.values, "unique_all values")
    _same(every.counts, ref_all.counts, "unique_all counts")
    _same(_run(lambda v: jnp.unique_values(v, size=6, fill_value=0.0), mode, x), ref[0], "unique_values")
    counted = _run(lambda v: jnp.unique_counts(v, size=6, fill_value=0.0), mode, x)
    _same(counted.counts, ref[3], "unique_counts")


@pytest.mark.parametrize("mode", MODES)
def test_unique_of_integers_of_a_2d_array_and_of_nan(mode):
    x, valid_values, _ = _unique_input(UNIQUE_MASKS["holes"], np.int32)
    _same(_run(lambda v: jnp.unique(v, size=5, fill_value=0), mode, x), jnp.unique(valid_values, size=5, fill_value=0))
    grid = mj.masked_array(jnp.arange(12).reshape(3, 4) % 5, jnp.arange(12).reshape(3, 4) % 3 != 0)
    want = jnp.unique(np.asarray(grid.data)[np.asarray(grid.mask)], size=7, fill_value=-1)
    _same(_run(lambda v: jnp.unique(v, size=7, fill_value=-1), mode, grid), want)
    nans = mj.masked_array(jnp.array([jnp.nan, 1.0, jnp.nan, 2.0, 9.0]), jnp.array([1, 1, 1, 1, 0], bool))
    for equal_nan in (True, False):
        want = jnp.unique(jnp.array([jnp.nan, 1.0, jnp.nan, 2.0]), size=5, fill_value=0.0, equal_nan=equal_nan)
        got = _run(lambda v, e=equal_nan: jnp.unique(v, size=5, fill_value=0.0, equal_nan=e), mode, nans)
        _same(got, want, f"equal_nan={equal_nan}")


def test_unique_reached_other_ways_raises():
    x, _, _ = _unique_input(UNIQUE_MASKS["holes"])
    with pytest.raises(mj.MaskifyError, match="axis="):
        mj.maskify(lambda v: jnp.unique(v.reshape(7, 1), axis=0, size=3))(x)
    with pytest.raises(mj.MaskifyError, match="jnp.unique"):
        mj.maskify(lambda v: jnp.intersect1d(v, jnp.array([1.0, 2.0]), size=3))(x)


# -- scans: which axis holds the rows; inputs masked by different rows ----------------------------
B, L, F = 3, 5, 2
LENGTHS = {"a": np.array([5, 2, 3]), "b": np.array([5, 4, 1])}


def _tokens(which, seed):
    valid = np.arange(L)[None] < LENGTHS[which][:, None]
    x = np.random.default_rng(seed).normal(size=(B, L, F)).astype(np.float32)
    return mj.masked_array(jnp.asarray(np.where(valid[..., None], x, np.nan)), jnp.asarray(valid[..., None])), x, valid


def _time_major(v):
    return jnp.swapaxes(v, 0, 1)


@pytest.mark.parametrize("mode", MODES)
def test_a_carry_as_long_as_the_batch_with_no_row_axis_is_not_read_as_rows(mode):
    """A (B,) carry that holds a total over every row (its size equal to the batch's by chance) is
    updated at every step some row has, not kept per row where that row is padding."""
    xm, x, valid = _tokens("a", 0)

    def total(v):
        return jax.lax.scan(lambda g, xt: (g + jnp.sum(xt), None), jnp.zeros(B, jnp.float32), _time_major(v))[0]

    got = _run(total, mode, xm)
    _same(got, jnp.full(B, np.sum(np.where(valid[..., None], x, 0)), jnp.float32))

    def counted(v):  # a per-row state beside a (B,) step counter: the body never mixes rows
        step = lambda c, xt: ((c[0] + xt.sum(-1), c[1] + 1.0), None)
        return jax.lax.scan(step, (jnp.zeros(B, jnp.float32), jnp.zeros(B, jnp.float32)), _time_major(v))[0]

    state, steps = _run(counted, mode, xm)
    _same(state, jnp.asarray(np.where(valid[..., None], x, 0).sum((1, 2)), jnp.float32))
    _same(steps, jnp.full(B, float(L), jnp.float32))  # a step counter: every step some row has


@pytest.mark.parametrize("mode", MODES)
def test_a_carry_with_its_rows_on_another_axis_keeps_them(mode):
    """A (H, B) carry: its rows are on axis 1 (the body puts them there), so a padded step of a
    row keeps that row's column, whatever the carry's leading size."""
    xm, x, valid = _tokens("a", 1)
    w = jnp.asarray(np.random.default_rng(2).normal(size=(F, 4)), jnp.float32)

    def run(v):
        return jax.lax.scan(lambda h, xt: (jnp.tanh(h + (xt @ w).T), None), jnp.zeros((4, B)), _time_major(v))[0]

    got = _run(run, mode, xm)
    for b in range(B):  # each row alone, over its valid steps
        alone = run(jnp.asarray(x[b : b + 1, : LENGTHS["a"][b]]))
        np.testing.assert_allclose(np.asarray(got.data)[:, b], np.asarray(alone)[:, 0], rtol=1e-5, atol=1e-6)
    assert np.asarray(got.mask).all()


@pytest.mark.parametrize("mode", MODES)
def test_a_step_with_one_input_masked_reads_it_as_masked_not_zero(mode):
    """Two scanned inputs with different token masks: where one is valid and the other masked,
    the step is not missing, and what the masked one reaches is masked (never computed with 0)."""
    am, a, va = _tokens("a", 3)
    bm, b, vb = _tokens("b", 4)

    def run(x, y):
        def step(c, inp):
            xt, yt = inp
            s = xt + yt
            return c + s.sum(-1), s

        return jax.lax.scan(step, jnp.zeros(B), (_time_major(x), _time_major(y)))

    carry, ys = _run(run, mode, am, bm)
    both = va & vb  # (B, L)
    ys_data, ys_mask = _pair(ys)
    np.testing.assert_array_equal(ys_mask.all(-1).T, both)
    np.testing.assert_allclose(ys_data.transpose(1, 0, 2)[both], (a + b)[both], rtol=1e-6)
    # the carry: kept at a missing step (both masked), masked once a step read a masked input
    partial = (va ^ vb).any(1)
    np.testing.assert_array_equal(_pair(carry)[1], ~partial)
    full = np.where(both[..., None], a + b, 0).sum((1, 2))
    np.testing.assert_allclose(_pair(carry)[0][~partial], full[~partial], rtol=1e-5)


@pytest.mark.parametrize("mode", MODES)
def test_inputs_with_one_token_mask_still_skip_padded_steps(mode):
    """Two inputs masked by the same token mask (one computed from the other): a padded step is
    missing for both, and each row's carry equals its run on its valid steps alone."""
    am, a, _ = _tokens("a", 5)

    def run(x):
        x = _time_major(x)
        step = lambda c, inp: (c * 0.5 + (inp[0] - inp[1]).sum(-1), inp[0] * inp[1])
        return jax.lax.scan(step, jnp.zeros(x.shape[1]), (x, 2 * x))

    carry, ys = _run(run, mode, am)
    for b in range(B):
        alone, alone_ys = run(jnp.asarray(a[b : b + 1, : LENGTHS["a"][b]]))
        np.testing.assert_allclose(np.asarray(carry.data)[b], np.asarray(alone)[0], rtol=1e-5)
        got_ys = np.asarray(ys.data)[: LENGTHS["a"][b], b]
        np.testing.assert_allclose(got_ys, np.asarray(alone_ys)[:, 0], rtol=1e-5)
    np.testing.assert_array_equal(np.asarray(ys.mask).all(-1).T, np.asarray(am.mask).all(-1))


# -- loop counters as indices --------------------------------------------------------------------
def _rows_masked():
    """(3, 4) data whose second row is padding (a (3, 1) mask: the indexed axis is not ragged)."""
    data = jnp.arange(12.0).reshape(3, 4).at[1].set(jnp.nan)
    return mj.masked_array(data, jnp.array([[True], [False], [True]]))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("bound", ["static", "traced"])
def test_a_fori_loop_reads_columns_by_its_counter(bound, mode):
    """``fori_loop`` reading ``x[:, i]`` by its counter: the counter is plain (no masked value
    reaches it), so the index is plain and the mask moves with the column."""
    x = _rows_masked()

    def columns(v, n):
        return jax.lax.fori_loop(0, n, lambda i, acc: acc + v[:, i], jnp.zeros(3))

    got = _run(lambda v: columns(v, 4), mode, x) if bound == "static" else _run(columns, mode, x, jnp.int32(4))
    _same(got, mj.masked_array(jnp.array([6.0, 0.0, 38.0]), jnp.array([True, False, True])))


@pytest.mark.parametrize("mode", MODES)
def test_a_plain_index_inside_a_cond_branch(mode):
    x = _rows_masked()
    got = _run(lambda v, i: jax.lax.cond(i > 0, lambda j: v[:, j], lambda j: -v[:, j], i), mode, x, jnp.int32(2))
    _same(got, mj.masked_array(jnp.array([2.0, 0.0, 10.0]), jnp.array([True, False, True])))


# -- errors name the function called, and say what to write ------------------------------------
def test_an_error_names_the_function_called_not_the_first_traced_to_the_program():
    x = mj.masked_array(jnp.eye(2), jnp.array([[True, False], [True, True]]))

    def first(v):
        return jnp.linalg.cholesky(v)

    def second(v):
        return jnp.linalg.cholesky(v)

    for fn in (first, second, first):
        with pytest.raises(mj.MaskifyError, match=rf"maskify\({fn.__name__}\)"):
            mj.maskify(fn)(x)


@pytest.mark.parametrize(
    "fn",
    [
        lambda v: jnp.nonzero(v),
        lambda v: jnp.unique(v),
        lambda v: v if v.sum() > 0 else -v,
        lambda v: float(v.sum()),
        lambda v: v[v > 0],
    ],
    ids=["nonzero", "unique", "python-if", "float", "boolean-index"],
)
def test_code_that_needs_a_value_while_traced_raises_a_maskify_error(fn):
    x = mj.masked_array(jnp.arange(4.0, dtype=jnp.float32), jnp.array([True, True, False, True]))
    with pytest.raises(mj.MaskifyError, match="traces the function on abstract arrays"):
        mj.maskify(fn)(x)


def test_a_closed_over_masked_array_raises_a_maskify_error_and_a_keyword_one_is_an_operand():
    x = mj.masked_array(jnp.arange(4.0, dtype=jnp.float32), jnp.array([True, True, False, True]))
    with pytest.raises(mj.MaskifyError, match="Pass it as an argument"):
        mj.maskify(lambda v: jnp.sum(x) + v)(jnp.ones(()))
    by_keyword = mj.maskify(lambda v, w=None: jnp.sum(v * w))(x, w=x)
    _same(by_keyword, mj.maskify(lambda v, w: jnp.sum(v * w))(x, x))
    _same(by_keyword, jnp.asarray(0.0 + 1.0 + 9.0, jnp.float32))
