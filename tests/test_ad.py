"""Autodiff through masked ops: Jacobians equal the dense op's on valid entries, exactly 0 off the
mask, agree with float64 finite differences, and stay finite whatever sits under the mask."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from op_table import OPS

import masked_jax as mj
import masked_jax.nn as mnn
import masked_jax.numpy as mnp

# Ops whose derivative is zero almost everywhere or undefined (steps, comparisons, integer outputs).
NONDIFF = {"sign", "floor", "ceil", "round", "trunc", "floor_divide", "mod", "remainder", "nan_to_num"}
ELEMENTWISE = [
    op
    for op in OPS
    if op.family in ("elementwise", "binary")
    and np.float64 in op.dtypes
    and op.name not in NONDIFF
    and op.name not in ("isnan", "isinf", "isfinite")
    and not any(op.name.startswith(p) for p in ("logical", "bitwise", "equal", "not_equal", "less", "greater"))
]
REDUCTIONS = [op for op in OPS if op.family == "reductions" and op.name not in ("argmax", "argmin", "any", "all")]

DENSE = {  # the dense jax function each masked reduction/normalization restricts to valid entries
    "sum": jnp.sum,
    "prod": jnp.prod,
    "mean": jnp.mean,
    "var": jnp.var,
    "std": jnp.std,
    "max": jnp.max,
    "min": jnp.min,
    "ptp": jnp.ptp,
    "median": jnp.median,
    "logsumexp": jax.nn.logsumexp,
    "norm": jnp.linalg.norm,
    "quantile": lambda x: jnp.quantile(x, 0.3),
    "percentile": lambda x: jnp.percentile(x, 30.0),
    "softmax": jax.nn.softmax,
    "log_softmax": jax.nn.log_softmax,
    "softmin": lambda x: jax.nn.softmax(-x),
    "normalize": lambda x: x / jnp.maximum(jnp.linalg.norm(x), 1e-12),
}
MASKED_REDUCE = {
    **{op.name: op.fn for op in REDUCTIONS},
    "quantile": lambda x: mnp.quantile(x, 0.3),
    "percentile": lambda x: mnp.percentile(x, 30.0),
    "softmax": mnn.softmax,
    "log_softmax": mnn.log_softmax,
    "softmin": mnn.softmin,
    "normalize": mnn.normalize,
}
POISON = np.array([np.nan, np.inf, -np.inf, 0.0, -1.0, 1e30])


def _jnp_fn(name):
    return getattr(jnp, name, None) or getattr(jax.nn, name)


def _data(op, shape, seed, poison=True):
    rng = np.random.default_rng(seed)
    lo, hi = op.domain
    clean = rng.uniform(lo, hi, shape)
    mask = rng.random(shape) > 0.4
    mask.flat[0], mask.flat[-1] = True, False
    bad = POISON[rng.integers(0, len(POISON), shape)] if poison else clean
    return clean, np.where(mask, clean, bad), mask


def _operands(op, seed, shape=(2, 3)):
    n = 2 if op.family == "binary" else 1
    out = []
    for i in range(n):
        dom_op = op if i == 0 or op.domain2 is None else type(op)(**{**op.__dict__, "domain": op.domain2})
        out.append(_data(dom_op, shape, seed + i))
    return out


def _outer(mo, mi):
    mo, mi = np.asarray(mo), np.asarray(mi)
    return mo.reshape(mo.shape + (1,) * mi.ndim) & mi.reshape((1,) * mo.ndim + mi.shape)


@pytest.mark.parametrize("mode", ["fwd", "rev"])
@pytest.mark.parametrize("op", ELEMENTWISE, ids=repr)
def test_elementwise_jacobian_is_dense_jacobian_on_valid_entries(op, mode):
    operands = _operands(op, 0)
    xs = [mj.masked_array(jnp.asarray(p), jnp.asarray(m)) for _, p, m in operands]
    argnums = tuple(range(len(xs)))
    jac = (mj.jacfwd if mode == "fwd" else mj.jacrev)(op.fn, argnums=argnums)(*xs)
    dense = (jax.jacfwd if mode == "fwd" else jax.jacrev)(_jnp_fn(op.name), argnums=argnums)(
        *[jnp.asarray(c) for c, _, _ in operands]
    )
    out_mask = np.logical_and.reduce([m for _, _, m in operands])
    for j, d, (_, _, m_in) in zip(jac, dense, operands):
        block = _outer(out_mask, m_in)
        np.testing.assert_array_equal(j.mask, block)
        got = np.asarray(j.data)
        assert np.all(got[~block] == 0), "off-mask Jacobian entries must be exactly 0"
        np.testing.assert_allclose(got[block], np.asarray(d)[block], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("mode", ["fwd", "rev"])
@pytest.mark.parametrize("name", list(DENSE), ids=str)
def test_reduction_jacobian_is_dense_jacobian_of_valid_elements(name, mode):
    rng = np.random.default_rng(1)
    clean = rng.uniform(0.5, 2.0, 7)
    mask = np.array([True, False, True, True, False, True, True])
    x = mj.masked_array(jnp.asarray(np.where(mask, clean, np.resize(POISON, 7))), jnp.asarray(mask))
    jac = (mj.jacfwd if mode == "fwd" else mj.jacrev)(MASKED_REDUCE[name])(x)
    dense = (jax.jacfwd if mode == "fwd" else jax.jacrev)(DENSE[name])(jnp.asarray(clean[mask]))
    got = np.asarray(jac.data)
    assert np.all(np.isfinite(got))
    if got.ndim == 1:  # scalar reduction: d out / d x
        np.testing.assert_array_equal(jac.mask, mask)
        np.testing.assert_allclose(got[mask], dense, rtol=1e-10, atol=1e-12)
        assert np.all(got[~mask] == 0)
    else:  # normalization: d out_i / d x_j
        np.testing.assert_array_equal(jac.mask, _outer(mask, mask))
        np.testing.assert_allclose(got[np.ix_(mask, mask)], dense, rtol=1e-10, atol=1e-12)
        assert np.all(got[~_outer(mask, mask)] == 0)


def _fd_jacobian(f, x, mask, eps=1e-6):
    """Central differences perturbing valid elements only; masked outputs read as 0."""
    flat = np.asarray(x, np.float64).ravel()
    cols = []
    for j in np.flatnonzero(np.asarray(mask).ravel()):
        e = np.zeros_like(flat)
        e[j] = eps
        hi = np.asarray(f(jnp.asarray((flat + e).reshape(x.shape))))
        lo = np.asarray(f(jnp.asarray((flat - e).reshape(x.shape))))
        cols.append((hi - lo) / (2 * eps))
    return np.stack(cols, axis=-1)


@pytest.mark.parametrize("op", ELEMENTWISE + [o for o in OPS if o.name in DENSE], ids=repr)
def test_jacobian_agrees_with_float64_finite_differences(op):
    (_, poisoned, mask), *rest = _operands(op, 2)
    extra = [mj.masked_array(jnp.asarray(p), jnp.asarray(m)) for _, p, m in rest]
    kw = {"axis": 1} if op.family == "reductions" else {}
    if op.name in ("quantile", "percentile"):
        kw["q"] = 0.3 if op.name == "quantile" else 30.0

    def f(d):
        return op.fn(mj.masked_array(d, jnp.asarray(mask)), *extra, **kw).filled(0)

    fd = _fd_jacobian(f, poisoned, mask)
    jac = np.asarray(jax.jacrev(f)(jnp.asarray(poisoned)))
    jac = jac.reshape(fd.shape[:-1] + (-1,))[..., np.flatnonzero(mask.ravel())]
    np.testing.assert_allclose(jac, fd, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("op", [o for o in OPS if np.float64 in o.dtypes], ids=repr)
def test_gradients_finite_whatever_is_under_the_mask(op, jit):
    operands = _operands(op, 3)
    xs = [mj.masked_array(jnp.asarray(p), jnp.asarray(m)) for _, p, m in operands]
    kw = {"axis": 1} if op.family == "reductions" else {}
    if op.name in ("quantile", "percentile"):
        kw["q"] = 0.3 if op.name == "quantile" else 30.0

    def loss(*xs):
        out = op.fn(*xs, **kw)
        return mnp.sum(out.astype(jnp.float64) * 1.5)

    g = mj.grad(loss, argnums=tuple(range(len(xs))))
    grads = (jax.jit(g) if jit else g)(*xs)
    for gr, (_, _, m) in zip(grads, operands):
        data = np.asarray(gr.data)
        assert np.all(np.isfinite(data)), f"{op.name}: non-finite gradient {data}"
        assert np.all(data[~m] == 0), f"{op.name}: gradient under the mask"
        np.testing.assert_array_equal(gr.mask, m)


def test_jnp_where_trap_regression():
    m = jnp.array([True, False, True])
    v = jnp.array([2.0, 0.0, -1.0])
    trap = jax.grad(lambda v: jnp.where(m, jnp.log(jnp.abs(v)) + jnp.sqrt(v + 1.0), 0.0).sum())(v)
    assert np.isnan(np.asarray(trap)[1])  # the classic: 0 * inf at the masked-out x = 0
    ours = mj.grad(lambda x: mnp.sum(mnp.log(mnp.abs(x)) + mnp.sqrt(x + 1.0)))(mj.masked_array(v, m))
    np.testing.assert_allclose(np.asarray(ours.data)[[0, 1]], [0.5 + 0.5 / np.sqrt(3.0), 0.0], rtol=1e-12)
    # x = -1 is valid: d/dx log|x| = -1 and d/dx sqrt(x + 1) = inf there, as in jnp
    assert np.asarray(ours.data)[2] == np.inf


def _fd_hessian(f, x, mask, eps=1e-4):
    g = jax.grad(lambda d: f(d))
    return _fd_jacobian(g, x, mask, eps)


@pytest.mark.parametrize(
    "name,f",
    [
        ("sum_cubed", lambda x: mnp.sum(x**3)),
        ("logsumexp", lambda x: mnp.logsumexp(x)),
        ("softmax", lambda x: mnp.sum(mnn.softmax(x) * jnp.arange(1.0, 6.0))),
        ("log_softmax", lambda x: mnp.sum(mnn.log_softmax(x) * jnp.arange(1.0, 6.0))),
        ("var", lambda x: mnp.var(x, ddof=1)),
        ("std", lambda x: mnp.std(x)),
        ("normalize", lambda x: mnp.sum(mnn.normalize(x) * jnp.arange(1.0, 6.0))),
        ("mean_of_exp", lambda x: mnp.mean(mnp.exp(x))),
    ],
)
def test_hessians_against_finite_differences(name, f):
    mask = np.array([True, False, True, True, False])
    clean = np.array([0.3, 0.0, -0.7, 1.1, 0.0])
    x = mj.masked_array(jnp.asarray(np.where(mask, clean, [0, np.nan, 0, 0, -np.inf])), jnp.asarray(mask))
    hess = mj.hessian(f)(x)
    np.testing.assert_array_equal(hess.mask, _outer(mask, mask))
    got = np.asarray(hess.data)
    assert np.all(got[~_outer(mask, mask)] == 0)

    def scalar(d):
        return f(mj.masked_array(d, jnp.asarray(mask))).filled(0)

    fd = _fd_hessian(scalar, np.asarray(x.data), mask)
    np.testing.assert_allclose(got[np.ix_(mask, mask)], fd[mask], rtol=1e-6, atol=1e-8)


# -- the grad family's API ---------------------------------------------------------------------------
def test_grad_family_signatures():
    x = mj.masked_array(jnp.array([1.0, 2.0, 3.0]), jnp.array([True, False, True]))
    y = jnp.array([1.0, 1.0, 2.0])

    def f(x, y):
        return mnp.sum(x * y), {"n": x.count()}

    (val, aux), (gx, gy) = mj.value_and_grad(f, argnums=(0, 1), has_aux=True)(x, y)
    assert float(val.data) == 7.0 and int(aux["n"]) == 2
    np.testing.assert_array_equal(gx.filled(-1), [1.0, -1, 2.0])
    np.testing.assert_array_equal(gy, [1.0, 0.0, 3.0])
    g, aux = mj.grad(f, has_aux=True)(x, y)
    np.testing.assert_array_equal(g.mask, x.mask)
    params = {"w": x, "b": jnp.float64(1.0)}
    gp = mj.grad(lambda p: mnp.sum(p["w"] * p["b"]))(params)
    assert isinstance(gp["w"], mj.MaskedArray) and float(gp["b"]) == 4.0
    c = mj.grad(lambda z: mnp.sum(mnp.abs(z) ** 2).astype(jnp.float64), holomorphic=False)(x)
    np.testing.assert_allclose(c.filled(), [2.0, 0.0, 6.0], rtol=1e-15)  # XLA:GPU's pow rounds 6 down
    with pytest.raises(TypeError, match="scalar output"):
        mj.grad(lambda x: x * 2)(x)
    with pytest.raises(ValueError, match="argnums"):
        mj.grad(lambda x: mnp.sum(x), argnums=3)(x)
    with pytest.raises(TypeError, match="pair"):
        mj.grad(lambda x: mnp.sum(x), has_aux=True)(x)
    with pytest.raises(ValueError, match="data_tangent must have shape"):
        mj.tangent(x, jnp.ones(2))


def test_masked_loss_counts_as_zero():
    x = mj.masked_array(jnp.array([1.0, 2.0]), jnp.array([False, False]))
    val, g = mj.value_and_grad(lambda x: mnp.sum(x * 3.0))(x)
    assert not bool(val.mask)
    np.testing.assert_array_equal(g.data, [0.0, 0.0])


# -- plain JAX transformations -------------------------------------------------------------------------
def _x():
    return mj.masked_array(jnp.array([0.5, jnp.nan, 2.0, -1.0]), jnp.array([True, False, True, False]))


def test_plain_jax_grad_jvp_vjp_linearize():
    x = _x()

    def f(x):
        return mnp.sum(mnp.log(x) * x)

    g = jax.grad(lambda x: f(x).data, allow_int=True)(x)
    want = np.where(np.asarray(x.mask), np.log(np.asarray(x.filled(1.0))) + 1, 0.0)
    np.testing.assert_allclose(np.asarray(g.data), want, rtol=1e-12)
    t = mj.tangent(x, jnp.ones(4))
    y, ty = jax.jvp(f, (x,), (t,))
    assert float(ty.data) == pytest.approx(want.sum())
    assert ty.mask.dtype == jax.dtypes.float0
    y, lin = jax.linearize(f, x)
    assert float(lin(t).data) == pytest.approx(want.sum())
    out, vjp = jax.vjp(lambda x: mnp.log(x), x)
    (ct,) = vjp(mj.tangent(out, jnp.full(4, 7.0)))  # a cotangent on masked outputs is dropped
    np.testing.assert_allclose(np.asarray(ct.data), np.where(np.asarray(x.mask), 7.0 / np.asarray(x.filled(1.0)), 0.0))


def test_checkpoint_scan_vmap_of_grads_and_jit():
    x = _x()
    f = jax.checkpoint(lambda x: mnp.sum(mnp.exp(x) * x))
    g1 = mj.grad(f)(x)
    g2 = jax.jit(mj.grad(f))(x)
    np.testing.assert_allclose(g1.filled(), g2.filled(), rtol=1e-12)
    np.testing.assert_array_equal(np.asarray(g1.data)[~np.asarray(x.mask)], 0.0)

    def rnn(x):
        def step(h, xi):
            h = mnp.tanh(h * 0.5 + xi)
            return h, h

        # a carry that gains a mask starts with one (a mask-less one is statically valid)
        h, hs = jax.lax.scan(step, mj.masked_array(jnp.float64(0.0), True), x)
        return mnp.sum(hs)

    gs = jax.jit(mj.grad(rnn))(x)
    assert np.all(np.isfinite(np.asarray(gs.data)))
    masks = jnp.stack([x.mask, ~x.mask])
    batch = mj.masked_array(jnp.where(masks, jnp.array([0.5, 1.5, 2.0, 3.0]), jnp.nan), masks)
    gb = jax.jit(jax.vmap(mj.grad(lambda r: mnp.sum(mnp.sqrt(r)))))(batch)
    np.testing.assert_array_equal(gb.mask, batch.mask)
    assert np.all(np.asarray(gb.data)[~np.asarray(batch.mask)] == 0)
    assert np.all(np.isfinite(np.asarray(gb.data)))


# -- shape, indexing, contraction and cumulative ops ---------------------------------------------
_W = jnp.asarray(np.random.default_rng(5).uniform(0.5, 1.5, (3, 4)))
OTHER_OPS = {  # masked fn of x (3, 4) -> its dense counterpart on the filled (masked = 0) data
    "reshape": (lambda x: mnp.reshape(x, (4, 3)), lambda d: jnp.reshape(d, (4, 3))),
    "transpose": (mnp.transpose, jnp.transpose),
    "flip": (lambda x: mnp.flip(x, 1), lambda d: jnp.flip(d, 1)),
    "roll": (lambda x: mnp.roll(x, 1, 1), lambda d: jnp.roll(d, 1, 1)),
    "tile": (lambda x: mnp.tile(x, 2), lambda d: jnp.tile(d, 2)),
    "repeat": (lambda x: mnp.repeat(x, 2, axis=0), lambda d: jnp.repeat(d, 2, axis=0)),
    "pad": (lambda x: mnp.pad(x, 1), lambda d: jnp.pad(d, 1)),
    "concatenate": (lambda x: mnp.concatenate([x, x], 1), lambda d: jnp.concatenate([d, d], 1)),
    "stack": (lambda x: mnp.stack([x, x]), lambda d: jnp.stack([d, d])),
    "getitem": (lambda x: x[1:, jnp.array([0, 2])], lambda d: d[1:, jnp.array([0, 2])]),
    "take": (lambda x: mnp.take(x, jnp.array([2, 0]), axis=1), lambda d: jnp.take(d, jnp.array([2, 0]), axis=1)),
    "at_set": (lambda x: x.at[0, 1].set(5.0), lambda d: d.at[0, 1].set(5.0)),
    "at_add": (lambda x: x.at[0, :].add(2.0), lambda d: d.at[0, :].add(2.0)),
    "where": (lambda x: mnp.where(_W > 1.0, x, 2.0 * x), lambda d: jnp.where(_W > 1.0, d, 2.0 * d)),
    "clip": (lambda x: mnp.clip(x, 0.6, 1.2), lambda d: jnp.clip(d, 0.6, 1.2)),
    "cumsum": (lambda x: mnp.cumsum(x, axis=1), lambda d: jnp.cumsum(d, axis=1)),
    "cumprod": (lambda x: mnp.cumprod(x, axis=1), None),
    "sort": (lambda x: mnp.sort(x, axis=1), None),
    "average": (lambda x: mnp.average(x, axis=1, weights=_W), None),
    "matmul": (lambda x: x @ _W.T, lambda d: d @ _W.T),
    "einsum": (lambda x: mnp.einsum("ij,kj->ik", x, _W), lambda d: jnp.einsum("ij,kj->ik", d, _W)),
    "dot": (lambda x: mnp.dot(x, _W.T), lambda d: jnp.dot(d, _W.T)),
    "outer": (lambda x: mnp.outer(x[0], x[1]), lambda d: jnp.outer(d[0], d[1])),
    "tensordot": (lambda x: mnp.tensordot(x, _W, axes=2), lambda d: jnp.tensordot(d, _W, axes=2)),
    "normalize_axis0": (lambda x: mnn.normalize(x, axis=0), None),
}


@pytest.mark.parametrize("name", list(OTHER_OPS))
def test_other_ops_jacobians(name):
    masked_fn, dense_fn = OTHER_OPS[name]
    rng = np.random.default_rng(6)
    clean = rng.uniform(0.5, 1.5, (3, 4))
    mask = rng.random((3, 4)) > 0.35
    mask[0, 0], mask[2, 3] = True, False
    poisoned = np.where(mask, clean, POISON[rng.integers(0, len(POISON), (3, 4))])
    x = mj.masked_array(jnp.asarray(poisoned), jnp.asarray(mask))
    fwd, rev = mj.jacfwd(masked_fn)(x), mj.jacrev(masked_fn)(x)
    np.testing.assert_array_equal(fwd.mask, rev.mask)
    np.testing.assert_allclose(np.asarray(fwd.data), np.asarray(rev.data), rtol=1e-12, atol=1e-14)
    got, block = np.asarray(fwd.data), np.asarray(fwd.mask)
    assert np.all(np.isfinite(got)) and np.all(got[~block] == 0)
    out_mask = np.asarray(masked_fn(x).mask)
    np.testing.assert_array_equal(block, _outer(out_mask, mask))
    if dense_fn is not None:  # the dense op's Jacobian at the filled data, restricted to the block
        dense = np.asarray(jax.jacfwd(dense_fn)(jnp.asarray(np.where(mask, clean, 0.0))))
        np.testing.assert_allclose(got[block], dense[block], rtol=1e-12, atol=1e-14)
    fd = _fd_jacobian(lambda d: masked_fn(mj.masked_array(d, jnp.asarray(mask))).filled(0), poisoned, mask)
    restricted = got.reshape(fd.shape[:-1] + (-1,))[..., np.flatnonzero(mask.ravel())]
    np.testing.assert_allclose(restricted, fd, rtol=1e-5, atol=1e-6)


# -- gradients of layouts with duplicate stored entries ------------------------------------------
def _duplicate_layouts():
    """Layouts storing some logical entries more than once (unsorted, beside padding), and the same
    logical array without duplicates."""
    from jax.experimental import sparse

    rows = jnp.array([[1.0, 2.0], [5.0, 6.0], [0.5, -1.0], [3.0, 4.0], [9.0, 9.0]])
    return {
        "row_sparse": mj.row_sparse(rows, jnp.array([3, 1, 3, 0, 4]), (4, 2)),  # row 4: padding
        "row_sparse_three_copies": mj.row_sparse(rows[:3], jnp.array([1, 1, 1]), (3, 2)),
        "row_sparse_unique": mj.row_sparse(rows[:3], jnp.array([2, 0, 1]), (3, 2)),
        "bcoo": mj.from_bcoo(
            sparse.BCOO(
                (jnp.array([1.0, 2.0, 3.0, 4.0, 7.0]), jnp.array([[1, 0], [0, 2], [1, 0], [1, 0], [3, 0]])),
                shape=(3, 3),
            )
        ),
        "bcoo_hybrid": mj.from_bcoo(sparse.BCOO((rows[:4], jnp.array([[2], [0], [2], [9]])), shape=(3, 2))),
        "bcoo_batch": mj.from_bcoo(
            sparse.BCOO(
                (jnp.array([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]), jnp.array([[[1], [1], [0]], [[2], [0], [2]]])),
                shape=(2, 3),
            )
        ),
    }


_WEIGHTS = jnp.array([[0.5, -2.0, 3.0], [1.5, 0.25, -1.0], [2.0, 1.0, 4.0], [-3.0, 0.5, 1.0]])
DUPLICATE_LOSSES = {
    "sum": mnp.sum,
    "mean": mnp.mean,
    "weighted_sum": lambda v: mnp.sum(v * _WEIGHTS[: v.shape[0], : v.shape[1]]),
    "nonlinear": lambda v: mnp.sum(mnp.sin(v) * mnp.exp(0.1 * v)) + mnp.logsumexp(v) ** 2,
    "sum_of_squares": lambda v: mnp.sum(mnp.square(v)),
}


@pytest.mark.parametrize("kind", list(_duplicate_layouts()))
@pytest.mark.parametrize("loss", list(DUPLICATE_LOSSES))
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.filterwarnings("ignore::masked_jax.StorageFallbackWarning")
def test_gradient_of_a_layout_with_duplicates_reads_as_the_dense_gradient(kind, loss, jit):
    """Duplicates are one logical entry (summed): the gradient with respect to a layout, read as an
    array (``todense()``, duplicates summed), is the gradient with respect to its dense array,
    for every layout and for linear and nonlinear losses; ``value_and_grad`` agrees."""
    x = _duplicate_layouts()[kind]
    f = DUPLICATE_LOSSES[loss]
    grad = jax.jit(mj.grad(f)) if jit else mj.grad(f)
    got, want = grad(x), grad(x.todense())
    assert type(got) is type(x) and got.shape == x.shape
    np.testing.assert_array_equal(np.asarray(got.todense().mask), np.asarray(want.mask))
    np.testing.assert_allclose(np.asarray(got.todense().filled(0)), np.asarray(want.filled(0)), rtol=1e-5, atol=1e-6)
    value, again = mj.value_and_grad(f)(x)
    np.testing.assert_allclose(float(value), float(f(x.todense())), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(again.todense().filled(0)), np.asarray(want.filled(0)), rtol=1e-5, atol=1e-6)


def test_gradient_of_duplicates_sits_in_the_first_stored_copy():
    """The rule: each logical entry's cotangent in its first stored copy, 0 in the later ones."""
    r = mj.row_sparse(jnp.array([[1.0, 2.0], [5.0, 6.0], [7.0, 8.0]]), jnp.array([1, 0, 1]), (3, 2))
    g = mj.grad(lambda v: mnp.sum(v * jnp.array([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])))(r)
    np.testing.assert_array_equal(np.asarray(g.data), [[3.0, 4.0], [1.0, 2.0], [0.0, 0.0]])
    np.testing.assert_array_equal(np.asarray(g.indices), np.asarray(r.indices))
