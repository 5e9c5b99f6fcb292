"""masked_jax.optim: lazy optax transformations, masked Adagrad, apply_updates, the train step."""

from __future__ import annotations

import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from jax import export

import masked_jax as mj
from masked_jax import optim

SCHEDULE = optax.exponential_decay(0.05, transition_steps=2, decay_rate=0.5)

# One table of optimizers; every property below runs over it.
OPTIMIZERS = {
    "sgd": lambda: optax.sgd(0.1),
    "momentum": lambda: optax.sgd(0.1, momentum=0.9),
    "nesterov": lambda: optax.sgd(0.1, momentum=0.9, nesterov=True),
    "adam": lambda: optax.adam(0.05),
    "adamw": lambda: optax.adamw(0.05, weight_decay=0.1),
    "adagrad": lambda: optax.adagrad(0.1),
    "rmsprop": lambda: optax.rmsprop(0.05),
    "lion": lambda: optax.lion(0.01),
    "clip_adam": lambda: optax.chain(optax.clip_by_global_norm(0.5), optax.adam(0.05)),
    "schedule_adam": lambda: optax.adam(SCHEDULE),
    "decay_sgd": lambda: optax.chain(optax.add_decayed_weights(0.1), optax.sgd(0.1, momentum=0.5)),
    "inject_adam": lambda: optax.inject_hyperparams(optax.adam)(learning_rate=0.05),
}
N, D = 12, 3


def _tiered(names, quick):
    """The parameters ``names``: ``make test`` runs those in ``quick`` (one of each kind of state),
    the slow tier (``make test-slow``) the others."""
    return [pytest.param(n, marks=() if n in quick else pytest.mark.slow) for n in names]


def _params():
    rng = np.random.default_rng(0)
    return {
        "emb": jnp.asarray(rng.normal(size=(N, D)), jnp.float32),
        "b": jnp.asarray(rng.normal(size=(D,)), jnp.float32),
    }


def _row_grads(steps=4, k=5, seed=1):
    """Row-sparse gradients of "emb" (with duplicate rows) and dense gradients of "b"."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(steps):
        idx = rng.integers(0, N - 3, size=k)  # rows N-3.. are never touched
        out.append(
            {
                "emb": mj.row_sparse(jnp.asarray(rng.normal(size=(k, D)), jnp.float32), jnp.asarray(idx), (N, D)),
                "b": jnp.asarray(rng.normal(size=(D,)), jnp.float32),
            }
        )
    return out


def _run(opt, grads, params=None, jit=True):
    params = _params() if params is None else params
    state = opt.init(params)

    def step(params, state, g):
        u, state = opt.update(g, state, params)
        return optim.apply_updates(params, u), state

    step = jax.jit(step) if jit else step
    for g in grads:
        params, state = step(params, state, g)
    return params, state


def _dense(g):
    return g.todense() if isinstance(g, mj.RowSparseArray) else g


def _param_shaped(state, shape):
    return [x for x in jax.tree_util.tree_leaves(state) if np.shape(x) == shape]


def _close(a, b, **kw):
    kw = {"rtol": 2e-5, "atol": 2e-6, **kw}
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
        np.testing.assert_allclose(np.asarray(x, np.float64), np.asarray(y, np.float64), **kw)


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_dense_gradient_is_inner_exactly(name):
    inner = OPTIMIZERS[name]()
    grads = [{"emb": _dense(g["emb"]).filled(0), "b": g["b"]} for g in _row_grads()]
    p_lazy, s_lazy = _run(optim.lazy(inner), grads)
    p_ref, s_ref = _run(inner, grads)
    for x, y in zip(jax.tree_util.tree_leaves((p_lazy, s_lazy)), jax.tree_util.tree_leaves((p_ref, s_ref))):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_fully_valid_masked_and_row_sparse_gradients_equal_inner(name):
    inner = OPTIMIZERS[name]()
    rng = np.random.default_rng(3)
    dense = [
        {"emb": jnp.asarray(rng.normal(size=(N, D)), jnp.float32), "b": jnp.asarray(rng.normal(size=(D,)), jnp.float32)}
        for _ in range(3)
    ]
    ref = _run(inner, dense)
    perm = jnp.asarray(rng.permutation(N))
    for wrap in (lambda e: mj.as_masked(e), lambda e: mj.row_sparse(e[perm], perm, (N, D))):
        grads = [{"emb": wrap(g["emb"]), "b": g["b"]} for g in dense]
        _close(_run(optim.lazy(inner), grads), ref)


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_only_valid_entries_change(name):
    """Reference: the dense optimizer on the filled gradient, then untouched entries of the parameters
    and of every parameter-shaped state leaf put back. Row-sparse and masked gradients agree."""
    inner = OPTIMIZERS[name]()
    grads = _row_grads()
    params = _params()
    state = inner.init(params)
    for g in grads:
        dense = g["emb"].todense()
        u, new_state = inner.update({"emb": dense.filled(0), "b": g["b"]}, state, params)
        m = dense.mask
        state = jax.tree_util.tree_map(
            lambda old, new, m=m: jnp.where(m, new, old) if np.shape(old) == (N, D) else new, state, new_state
        )
        params = {"emb": jnp.where(m, params["emb"] + u["emb"], params["emb"]), "b": params["b"] + u["b"]}
    p_rows, s_rows = _run(optim.lazy(inner), grads)
    p_mask, s_mask = _run(optim.lazy(inner), [{"emb": g["emb"].todense(), "b": g["b"]} for g in grads], jit=False)
    _close((p_rows, s_rows), (params, state))
    _close((p_mask, s_mask), (params, state))
    initial = _params()["emb"]
    np.testing.assert_array_equal(np.asarray(p_rows["emb"][N - 3 :]), np.asarray(initial[N - 3 :]))
    np.testing.assert_array_equal(np.asarray(p_mask["emb"][N - 3 :]), np.asarray(initial[N - 3 :]))
    for x, x0 in zip(_param_shaped(s_rows, (N, D)), _param_shaped(optim.lazy(inner).init(_params()), (N, D))):
        np.testing.assert_array_equal(np.asarray(x[N - 3 :]), np.asarray(x0[N - 3 :]))


def test_clip_by_global_norm_counts_valid_entries_only():
    """A NaN or a huge value stored under the mask must not enter the norm."""
    inner = optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(1.0))
    data = jnp.array([3.0, 4.0, jnp.nan, 1e6])
    g = mj.masked_array(data, jnp.array([True, True, False, False]))
    u, _ = optim.lazy(inner).update(g, optim.lazy(inner).init(jnp.zeros(4)), jnp.zeros(4))
    np.testing.assert_allclose(np.asarray(u.filled(0)), [-0.6, -0.8, 0.0, 0.0], rtol=1e-6)
    rows = mj.row_sparse(jnp.array([[3.0], [4.0]]), jnp.array([0, 2]), (5, 1))
    u, _ = optim.lazy(inner).update(rows, optim.lazy(inner).init(jnp.zeros((5, 1))))
    np.testing.assert_allclose(np.asarray(u.todense().filled(0))[:, 0], [-0.6, 0, -0.8, 0, 0], rtol=1e-6)


def test_lazy_rejects_state_that_mixes_entries():
    opt = optim.lazy(optax.adafactor(0.1, min_dim_size_to_factor=4))
    params = {"w": jnp.zeros((8, 8))}
    state = opt.init(params)  # plain gradients: adafactor itself
    grads = {"w": mj.masked_array(jnp.ones((8, 8)), jnp.eye(8, dtype=bool))}
    with pytest.raises(ValueError, match=r"cannot lift.*v_row.*cannot be updated lazily\.$"):
        opt.update(grads, state, params)  # (v_row has a row's shape; no rowwise_adagrad hint)
    # row-wise Adagrad's sums: it is lazy by itself, also under MultiSteps
    g = mj.row_sparse(jnp.ones((2, 8)), jnp.array([1, 1]), (8, 8))
    for opt in (optim.lazy(optim.rowwise_adagrad(0.1)), optim.lazy(optax.MultiSteps(optim.rowwise_adagrad(0.1), 2))):
        with pytest.raises(ValueError, match=r"sum_of_squares.*use it without lazy\(\)"):
            opt.update({"w": g}, opt.init(params), params)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_lazy_adafactor_of_parameters_it_does_not_factor(jit):
    """adafactor keeps a per-entry second moment for a parameter it does not factor (its factors
    are then shape-(1,) placeholders, global state as a scalar is): lazy(adafactor) lifts it. With
    full masks it follows optax.adafactor step for step (updates and state); with partial masks a
    masked-out entry's parameter and second moment stay as they were, and a valid entry moves."""
    params = {"w": jnp.linspace(-1.0, 1.0, 12).reshape(3, 4), "b": jnp.zeros(4)}
    mask = {"w": jnp.arange(12).reshape(3, 4) % 3 > 0, "b": jnp.array([True, False, True, True])}
    dense, lazy = optax.adafactor(1e-2), optim.lazy(optax.adafactor(1e-2))
    step = jax.jit(lazy.update) if jit else lazy.update
    rng = np.random.default_rng(0)
    p_dense, p_full, p_part = params, params, params
    s_dense, s_full, s_part = dense.init(params), lazy.init(params), lazy.init(params)
    for _ in range(4):
        g = {k: jnp.asarray(rng.normal(size=v.shape), jnp.float32) for k, v in params.items()}
        u, s_dense = dense.update(g, s_dense, p_dense)
        p_dense = optax.apply_updates(p_dense, u)
        full = {k: mj.masked_array(v, jnp.ones(v.shape, bool)) for k, v in g.items()}
        u, s_full = step(full, s_full, p_full)
        p_full = optax.apply_updates(p_full, jax.tree.map(lambda x: x.filled(0.0), u, is_leaf=mj.is_masked_leaf))
        for k in params:
            np.testing.assert_allclose(np.asarray(p_full[k]), np.asarray(p_dense[k]), rtol=1e-5, atol=1e-7)
        part = {k: mj.masked_array(v, mask[k]) for k, v in g.items()}
        before_p, before_v = p_part, s_part[0].v
        u, s_part = step(part, s_part, p_part)
        p_part = optax.apply_updates(p_part, jax.tree.map(lambda x: x.filled(0.0), u, is_leaf=mj.is_masked_leaf))
        for k in params:
            off = ~np.asarray(mask[k])
            np.testing.assert_array_equal(np.asarray(p_part[k])[off], np.asarray(before_p[k])[off])
            np.testing.assert_array_equal(np.asarray(s_part[0].v[k])[off], np.asarray(before_v[k])[off])
            assert not np.allclose(np.asarray(p_part[k])[~off], np.asarray(before_p[k])[~off])
    np.testing.assert_allclose(np.asarray(s_full[0].v["w"]), np.asarray(s_dense[0].v["w"]), rtol=1e-5)


def test_bad_arguments_are_named():
    with pytest.raises(TypeError, match="inner must be an optax.GradientTransformation"):
        optim.lazy(optax.adam)  # the factory, not the transformation
    with pytest.raises(TypeError, match="optimizer must be an optax.GradientTransformation"):
        optim.make_train_step(lambda p: jnp.sum(p), "adam")
    with pytest.raises(TypeError, match="loss_fn must be callable"):
        optim.make_train_step(None, optax.sgd(0.1))


def test_global_state_advances_with_inner():
    opt = optim.lazy(optax.adam(0.1))
    _, state = _run(opt, _row_grads(steps=3))
    assert int(state[0].count) == 3


# -- masked Adagrad ------------------------------------------------------------------------------


def _seed_problem():
    """Seed 000: param = arange(8).reshape(2, 4), gradient specified at (0,2), (1,0), (1,2)."""
    i = np.array([[0, 1, 1], [2, 0, 2]])
    v = np.array([3.0, 4.0, 5.0], np.float32)
    return np.arange(8, dtype=np.float32).reshape(2, 4), i, v


def _seed_torch_result():
    """The seed's own sparse-Adagrad code, run in torch."""
    param, i, v = _seed_problem()
    param = torch.tensor(param)
    with torch.sparse.check_sparse_tensor_invariants():  # explicit opt-in: torch 2.11 warns without one
        grad = torch.sparse_coo_tensor(torch.tensor(i), torch.tensor(v), [2, 4], check_invariants=True).coalesce()
        state_sum = torch.full_like(param, 0.5)
        state_sum.add_(
            torch.sparse_coo_tensor(grad._indices(), grad._values().pow(2), grad.size(), check_invariants=True)
        )
        std = state_sum.sparse_mask(grad)
        std_values = std._values().sqrt_().add_(1e-10)
        param.add_(
            torch.sparse_coo_tensor(grad._indices(), grad._values() / std_values, grad.size(), check_invariants=True),
            alpha=-0.1,
        )
    return param.numpy(), state_sum.numpy()


SEED_OPT = dict(learning_rate=0.1, initial_accumulator_value=0.5, eps=1e-10, eps_placement="outside")


def test_seed_example_masked_gradient():
    param, i, v = _seed_problem()
    expected_param, expected_sum = _seed_torch_result()
    dense = np.zeros((2, 4), np.float32)
    dense[i[0], i[1]] = v
    grad = mj.masked_array(jnp.asarray(dense), jnp.asarray(dense != 0))
    opt = optim.masked_adagrad(**SEED_OPT)
    state = opt.init(jnp.asarray(param))
    updates, state = opt.update(grad, state)
    new = optim.apply_updates(jnp.asarray(param), updates)
    np.testing.assert_allclose(np.asarray(new), expected_param, rtol=1e-7, atol=0)
    np.testing.assert_allclose(np.asarray(state[0].sum_of_squares), expected_sum, rtol=1e-7)
    # closed form, written out
    np.testing.assert_allclose(np.asarray(new)[0, 2], 2 - 0.1 * 3 / (np.sqrt(9.5) + 1e-10), rtol=1e-7)


@pytest.mark.parametrize("layout", ["row_sparse", "bcoo"])
def test_seed_example_sparse_gradient_under_jit(layout):
    param, i, v = _seed_problem()
    expected_param, _ = _seed_torch_result()
    if layout == "row_sparse":  # rows 0 and 1, unspecified entries stored as 0: g = 0 changes nothing
        dense = np.zeros((2, 4), np.float32)
        dense[i[0], i[1]] = v
        grad = mj.row_sparse(jnp.asarray(dense), jnp.array([0, 1]), (2, 4))
    else:
        from jax.experimental import sparse

        grad = mj.from_bcoo(sparse.BCOO((jnp.asarray(v), jnp.asarray(i.T)), shape=(2, 4)))
    opt = optim.masked_adagrad(**SEED_OPT)

    @jax.jit
    def step(p, s, g):
        u, s = opt.update(g, s, p)
        return optim.apply_updates(p, u), s

    new, _ = step(jnp.asarray(param), opt.init(jnp.asarray(param)), grad)
    np.testing.assert_allclose(np.asarray(new), expected_param, rtol=1e-7, atol=0)


def test_masked_adagrad_dense_gradient_is_optax_adagrad_exactly():
    grads = [{"emb": _dense(g["emb"]).filled(0), "b": g["b"]} for g in _row_grads()]
    ours = _run(optim.masked_adagrad(0.1), grads)
    ref = _run(optax.adagrad(0.1), grads)
    for x, y in zip(jax.tree_util.tree_leaves(ours), jax.tree_util.tree_leaves(ref)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("placement", ["inside", "outside"])
@pytest.mark.parametrize("jit", [True, False])
def test_masked_adagrad_scatter_add_path_equals_generic_lazy_path(placement, jit):
    """scale_by_rss adds g**2 into the stored rows (or where the mask holds) itself; the generic
    lazy() lift (gather the sums, update, scatter them back) gives the same result, for row-sparse
    gradients with duplicates beside a dense leaf, and for masked gradients. Up to one rounding:
    under jit XLA may fuse g * g + s into one FMA in one program and not in the other."""
    ours = optim.masked_adagrad(0.1, 0.3, 1e-6, eps_placement=placement)
    generic = optim.lazy(optax.chain(optim.scale_by_rss(0.3, 1e-6, placement), optax.scale_by_learning_rate(0.1)))
    rows = _row_grads()
    masked = [{"emb": g["emb"].todense(), "b": g["b"]} for g in rows]
    for grads in (rows, masked):
        _close(_run(ours, grads, jit=jit), _run(generic, grads, jit=jit), rtol=1e-6, atol=0)
    updates, _ = ours.update(rows[0], ours.init(_params()))
    assert isinstance(updates["emb"], mj.RowSparseArray) and not isinstance(updates["b"], mj.RowSparseArray)


def test_masked_adagrad_masked_parameters():
    p = mj.masked_array(jnp.arange(1.0, 5.0), jnp.array([True, False, True, True]))
    g = mj.masked_array(jnp.array([1.0, 7.0, 0.0, 2.0]), jnp.array([True, False, False, True]))
    opt = optim.masked_adagrad(0.5, initial_accumulator_value=0.0, eps_placement="outside", eps=0.0)
    u, state = opt.update(g, opt.init(p), p)
    new = optim.apply_updates(p, u)
    np.testing.assert_array_equal(np.asarray(new.mask), np.asarray(p.mask))
    np.testing.assert_allclose(np.asarray(new.data), [0.5, 2.0, 3.0, 3.5])  # -lr * g / |g| where valid
    np.testing.assert_array_equal(np.asarray(state[0].sum_of_squares), [1.0, 0.0, 0.0, 4.0])


def test_eps_placement_is_checked():
    with pytest.raises(ValueError, match="eps_placement"):
        optim.masked_adagrad(0.1, eps_placement="around")


def _torch_parity(make_torch, ours, steps=6, seed=0):
    rng = np.random.default_rng(seed)
    n, d, k = 40, 5, 8
    p0 = rng.normal(size=(n, d)).astype(np.float32)
    tp = torch.nn.Parameter(torch.tensor(p0))
    topt = make_torch([tp])
    state = ours.init(jnp.asarray(p0))

    @jax.jit
    def step(p, s, g):
        u, s = ours.update(g, s, p)
        return optim.apply_updates(p, u), s

    p = jnp.asarray(p0)
    touched = set()
    with torch.sparse.check_sparse_tensor_invariants():  # also for the tensors torch builds inside step()
        for _ in range(steps):
            idx = rng.integers(0, n // 2, size=k)  # duplicates likely: 8 draws from 20 rows
            vals = rng.normal(size=(k, d)).astype(np.float32)
            touched |= set(idx.tolist())
            tp.grad = torch.sparse_coo_tensor(
                torch.tensor(idx)[None], torch.tensor(vals), (n, d), check_invariants=True
            )
            topt.step()
            p, state = step(p, state, mj.row_sparse(jnp.asarray(vals), jnp.asarray(idx), (n, d)))
    np.testing.assert_allclose(np.asarray(p), tp.detach().numpy(), rtol=1e-5, atol=1e-6)
    untouched = sorted(set(range(n)) - touched)
    assert untouched
    np.testing.assert_array_equal(np.asarray(p)[untouched], p0[untouched])


def test_torch_sparse_adagrad_parity():
    _torch_parity(
        lambda ps: torch.optim.Adagrad(ps, lr=0.1, initial_accumulator_value=0.2, eps=1e-10),
        optim.masked_adagrad(0.1, 0.2, 1e-10, eps_placement="outside"),
    )


def test_torch_sparse_adam_parity():
    _torch_parity(
        lambda ps: torch.optim.SparseAdam(ps, lr=0.05, betas=(0.8, 0.95)), optim.lazy(optax.adam(0.05, b1=0.8, b2=0.95))
    )


# -- apply_updates -------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float64])
def test_apply_updates_keeps_dtype_and_storage(dtype):
    p = jnp.ones((4, 2), dtype)
    mask = jnp.array([[True, False]] * 4)
    masked_param = mj.masked_array(p, mask)
    dense_u = jnp.full((4, 2), 0.5, jnp.float32)
    rows_u = mj.row_sparse(jnp.ones((3, 2), jnp.float32), jnp.array([1, 1, 3]), (4, 2))
    masked_u = mj.masked_array(jnp.full((4, 2), 0.5), mask)
    out = optim.apply_updates(
        {"a": p, "b": p, "c": masked_param, "d": p}, {"a": dense_u, "b": rows_u, "c": masked_u, "d": None}
    )
    assert all(x.dtype == dtype for x in (out["a"], out["b"], out["c"].data, out["d"]))
    np.testing.assert_array_equal(np.asarray(out["b"], np.float32)[:, 0], [1, 3, 1, 2])  # duplicates add
    np.testing.assert_array_equal(np.asarray(out["c"].mask), np.asarray(mask))
    np.testing.assert_array_equal(np.asarray(out["c"].data, np.float32)[:, 1], [1, 1, 1, 1])
    np.testing.assert_array_equal(np.asarray(out["d"]), np.asarray(p))


@pytest.mark.parametrize(
    "make",
    [lambda: optim.lazy(optax.adam(0.1)), lambda: optim.masked_adagrad(0.1), lambda: optax.sgd(0.1)],
    ids=["lazy_adam", "masked_adagrad", "optax_sgd"],
)
def test_statically_valid_parameters_stay_mask_less_through_steps(make):
    """A parameter built without a mask keeps none: its gradient, update and new value have the
    parameter's pytree structure, so a jitted step neither retraces nor changes structure, and
    a lax.scan over steps carries it."""
    params = {"w": mj.as_masked(jnp.array([1.0, -2.0, 3.0])), "b": jnp.zeros(())}
    opt = make()
    loss = lambda p: mj.numpy.sum(p["w"] ** 2).data + p["b"] ** 2
    traces = []

    @jax.jit
    def step(p, s):
        traces.append(1)
        g = mj.grad(loss)(p)
        u, s = opt.update(g, s, p)
        return optim.apply_updates(p, u), s

    state = opt.init(params)
    p = params
    for _ in range(3):
        p, state = step(p, state)
    assert p["w"].compact_mask is None and len(traces) == 1
    assert jax.tree_util.tree_structure(p) == jax.tree_util.tree_structure(params)
    (p_scan, _), _ = jax.lax.scan(lambda c, _: (step(*c), None), (params, opt.init(params)), None, length=3)
    np.testing.assert_allclose(p_scan["w"].data, p["w"].data, rtol=1e-6)
    # the same values as the plain-array parameters (plain optax takes a mask-less one as data)
    q = {"w": params["w"].data, "b": params["b"]}
    qs = opt.init(q)
    for _ in range(3):
        q, qs = step(q, qs)
    np.testing.assert_allclose(q["w"], p["w"].data, rtol=1e-6)
    np.testing.assert_allclose(q["b"], p["b"], rtol=1e-6)
    assert not np.allclose(p["w"].data, params["w"].data)  # the steps moved it


def test_apply_updates_shape_mismatch():
    with pytest.raises(ValueError, match=r"update of shape \(3,\) for a parameter of shape \(4,\)"):
        optim.apply_updates(jnp.zeros(4), jnp.zeros(3))


def test_masked_parameters_keep_their_mask_through_a_step():
    p = mj.masked_array(jnp.arange(4.0), jnp.array([True, True, False, True]))
    g = mj.grad(lambda p: mj.numpy.sum(p**2))(p)
    opt = optim.lazy(optax.adam(0.1))
    u, _ = opt.update(g, opt.init(p), p)
    new = optim.apply_updates(p, u)
    np.testing.assert_array_equal(np.asarray(new.mask), np.asarray(p.mask))
    assert float(new.data[2]) == 2.0 and float(new.data[0]) == 0.0 and float(new.data[1]) < 1.0


# -- row-sparse gradients of lookups, and the donated train step ---------------------------------


def _embedding_loss(params, users, items, ratings):
    u = mj.lookup(params["user"], users)
    v = params["item"][items]
    pred = jnp.sum(u * v, axis=-1) + params["bias"]
    return jnp.mean((pred - ratings) ** 2)


def _embedding_problem(n_users, n_items, dim, batch, seed=0):
    k = jax.random.split(jax.random.key(seed), 6)
    params = {
        "user": 0.1 * jax.random.normal(k[0], (n_users, dim)),
        "item": 0.1 * jax.random.normal(k[1], (n_items, dim)),
        "bias": jnp.zeros(()),
    }
    users = jax.random.randint(k[2], (batch,), 0, n_users)
    items = jax.random.randint(k[3], (batch,), 0, n_items)
    return params, users, items, jax.random.normal(k[4], (batch,))


SPARSE_TABLES = {"user": True, "item": True, "bias": False}


def test_row_sparse_lookup_gradient_equals_dense_gradient():
    params, users, items, r = _embedding_problem(50, 30, 4, 64)
    users = users.at[0].set(-1)  # negative ids count from the end
    value, grads = jax.jit(mj.value_and_grad(_embedding_loss, row_sparse=SPARSE_TABLES))(params, users, items, r)
    ref_value, ref = jax.value_and_grad(_embedding_loss)(params, users, items, r)
    assert isinstance(grads["user"], mj.RowSparseArray) and grads["user"].nse == 64
    np.testing.assert_allclose(value, ref_value, rtol=1e-12)
    for name in ("user", "item"):
        np.testing.assert_allclose(np.asarray(grads[name].todense().filled(0)), np.asarray(ref[name]), atol=1e-12)
    np.testing.assert_allclose(grads["bias"], ref["bias"], rtol=1e-12)


def test_row_sparse_lookup_options():
    table = jnp.arange(10.0).reshape(5, 2)

    def loss(t, w, ids):
        return jnp.sum(t[ids] * w), ids.shape

    (value, aux), (gt, gw) = mj.value_and_grad(loss, argnums=(0, 1), has_aux=True, row_sparse=(True, False))(
        table, 2.0, jnp.array([[4, 4]])
    )
    assert aux == (1, 2) and float(value) == 68.0 and float(gw) == 34.0
    np.testing.assert_array_equal(np.asarray(gt.todense().filled(0))[4], [4.0, 4.0])
    # an out-of-range id reads zeros and gets no gradient
    g = mj.grad(lambda t: jnp.sum(mj.lookup(t, jnp.array([1, 9])) ** 2), row_sparse=True)(table)
    np.testing.assert_array_equal(
        np.asarray(g.todense().filled(0)), np.asarray(jnp.zeros((5, 2)).at[1].set([4.0, 6.0]))
    )
    # a table never read gets an empty gradient
    g = mj.grad(lambda t: jnp.float32(1.0) + 0 * jnp.sum(jnp.zeros(1)), row_sparse=True)(table)
    assert g.nse == 0


@pytest.mark.parametrize(
    "fun, match",
    [
        (lambda t: jnp.sum(t[:, 0]), "read by a slice that does not take whole rows"),
        (lambda t: jnp.sum(t[jnp.array([1]), 0]), "read by a gather that does not take whole rows"),
        (lambda t: jnp.sum(t @ jnp.ones(2)), "can only be read by rows .*used by 'dot_general'"),
        (lambda t: jnp.sum(mj.lookup(t, jnp.array([0.5]))), "must be integers"),
        (
            lambda t: jax.lax.fori_loop(
                0,
                jnp.int32(2) + 0 * jnp.sum(t[jnp.array([0])]).astype(jnp.int32),
                lambda i, c: c + jnp.sum(t[jnp.array([i])]),
                0.0,
            ),
            "while_loop",
        ),
        (lambda t: jax.lax.cond(True, lambda: jnp.sum(t[jnp.array([1])]), lambda: 0.0), "cond"),
        (lambda t: jax.lax.scan(lambda c, row: (c + jnp.sum(row), None), 0.0, t)[0], "scanned input"),
        (lambda t: jax.nn.relu(t).sum(), "custom_jvp"),
        (lambda t: t, "returned"),
    ],
)
def test_row_sparse_lookup_misuse(fun, match):
    with pytest.raises(TypeError, match=match):
        mj.grad(fun, row_sparse=True)(jnp.ones((3, 2)))


def test_row_sparse_lookup_rejects_masked_table_and_bad_spec():
    with pytest.raises(TypeError, match="must select plain arrays"):
        mj.grad(lambda t: mj.numpy.sum(t), row_sparse=True)(mj.as_masked(jnp.ones((3, 2))))
    with pytest.raises(ValueError, match="prefix"):
        mj.grad(lambda p: jnp.sum(p["a"]), row_sparse={"zz": True})({"a": jnp.ones((3, 2))})


def _hlo(step, *args):
    return step.lower(*args).compile().as_text()


def _table_sized(hlo, n, d, dtype="f32"):
    """Instructions that copy or broadcast a whole (n, d) table."""
    return [
        line.strip()
        for line in hlo.splitlines()
        if f"{dtype}[{n},{d}]" in line and re.search(r"\b(copy|broadcast)\(", line)
    ]


@pytest.mark.parametrize("batch, chunk_rows", [(1, 8192), (64, 8192), (64, 16)])  # 16: the tables in chunks
@pytest.mark.parametrize(
    "make",
    [lambda: optim.lazy(optax.adam(0.01)), lambda: optim.masked_adagrad(0.1)],
    ids=["lazy_adam", "masked_adagrad"],
)
def test_donated_row_sparse_step_is_in_place(make, batch, chunk_rows):
    n, dim = 5003, 64
    params, users, items, r = _embedding_problem(n, n, dim, batch)
    params = jax.tree_util.tree_map(lambda x: x.astype(jnp.float32), params)
    opt = make()
    step = optim.make_train_step(_embedding_loss, opt, row_sparse=SPARSE_TABLES, chunk_rows=chunk_rows)
    hlo = _hlo(step, params, opt.init(params), users, items, r)
    if chunk_rows < batch:  # a loop over the chunks of each table, besides the one-call step's loops
        one_call = optim.make_train_step(_embedding_loss, opt, row_sparse=SPARSE_TABLES, chunk_rows=None)
        assert hlo.count("while(") == _hlo(one_call, params, opt.init(params), users, items, r).count("while(") + 2
    header = hlo.splitlines()[0]
    aliased = {int(i) for i in re.findall(r"\{\d*\}: \((\d+), \{\}, (?:may|must)-alias\)", header)}
    inputs = re.search(r"entry_computation_layout=\{\((.*?)\)->", header).group(1)
    tables = [i for i, shape in enumerate(re.findall(r"\w+\[[\d,]*\]", inputs)) if shape == f"f32[{n},{dim}]"]
    n_big = sum(1 for x in jax.tree_util.tree_leaves((params, opt.init(params))) if np.shape(x) == (n, dim))
    assert len(tables) == n_big >= 4 and set(tables) <= aliased  # params and state, each updated in place
    assert _table_sized(hlo, n, dim) == []
    # lowered for a GPU, a straight-line program: there each trip of a while loop waits for the
    # host to read its predicate (on the CPU the loop is the faster search, and is kept)
    cuda = export.export(step, platforms=["cuda"])(params, opt.init(params), users, items, r)
    assert "stablehlo.while" not in cuda.mlir_module()
    # the dense-gradient step, by contrast, builds an (n, dim) zero gradient
    dense_step = optim.make_train_step(_embedding_loss, opt)
    assert _table_sized(_hlo(dense_step, params, opt.init(params), users, items, r), n, dim)


def test_train_step_donates_and_does_not_recompile():
    params, users, items, r = _embedding_problem(200, 100, 8, 32)
    opt = optim.lazy(optax.adam(0.01))
    traces = []

    def loss_fn(*args):
        traces.append(1)  # runs only while tracing
        return _embedding_loss(*args)

    step = optim.make_train_step(loss_fn, opt, row_sparse=SPARSE_TABLES)
    state = opt.init(params)
    old = params["user"]
    params, state, loss0 = step(params, state, users, items, r)
    assert old.is_deleted()
    first = len(traces)
    for _ in range(5):
        params, state, loss = step(params, state, users, items, r)
    assert len(traces) == first == 1  # traced once to a jaxpr, which both evaluations read
    assert float(loss) < float(loss0)


def test_state_and_gradients_are_plain_pytrees(tmp_path):
    params, users, items, r = _embedding_problem(60, 40, 4, 16)
    opt = optim.lazy(optax.adam(0.01))
    state = opt.init(params)
    grads = mj.grad(_embedding_loss, row_sparse=SPARSE_TABLES)(params, users, items, r)
    _, state = opt.update(grads, state, params)
    loaded_trees = []
    for tree in (state, grads):
        leaves, treedef = jax.tree_util.tree_flatten(tree)
        moved = jax.device_put(tree)
        assert jax.tree_util.tree_structure(moved) == treedef
        np.savez(tmp_path / "t.npz", *[np.asarray(x) for x in leaves])
        with np.load(tmp_path / "t.npz") as f:
            loaded = jax.tree_util.tree_unflatten(treedef, [jnp.asarray(f[f"arr_{i}"]) for i in range(len(leaves))])
        for a, b in zip(jax.tree_util.tree_leaves(loaded), leaves):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
            assert a.dtype == b.dtype
        loaded_trees.append(loaded)
    # training continues identically from what was loaded
    u1, s1 = opt.update(grads, state, params)
    u2, s2 = opt.update(loaded_trees[1], loaded_trees[0], params)
    _close((u1, s1), (u2, s2), rtol=0, atol=0)


@given(n=st.integers(2, 9), k=st.integers(1, 6), seed=st.integers(0, 2**16))
def test_row_sparse_and_masked_gradients_agree(n, k, seed):
    """Property: any row-sparse gradient (duplicates, any K) and its dense-storage masked form
    give the same lazy adam step; rows not touched stay bit-identical."""
    rng = np.random.default_rng(seed)
    idx = jnp.asarray(rng.integers(0, n, size=k))
    g = mj.row_sparse(jnp.asarray(rng.normal(size=(k, 2)), jnp.float32), idx, (n, 2))
    p = jnp.asarray(rng.normal(size=(n, 2)), jnp.float32)
    opt = optim.lazy(optax.adam(0.1))
    a, _ = _run(opt, [g, g], params=p)
    b, _ = _run(opt, [g.todense(), g.todense()], params=p)
    _close(a, b)
    untouched = np.setdiff1d(np.arange(n), np.asarray(idx))
    np.testing.assert_array_equal(np.asarray(a)[untouched], np.asarray(p)[untouched])


def test_lazy_adam_converges_like_dense_adam():
    """Matrix factorisation, 100k x 32 user table, rank-4 truth plus noise (sd 0.3): lazy adam
    reaches within 5% of dense adam's loss in the same number of steps."""
    n_users, n_items, dim, batch, steps = 100_000, 500, 32, 4096, 250
    k = jax.random.split(jax.random.key(7), 4)
    true_u = jax.random.normal(k[0], (n_users, 4), jnp.float32)
    true_v = jax.random.normal(k[1], (n_items, 4), jnp.float32)
    users = jax.random.randint(k[2], (steps, batch), 0, n_users // 20)  # 5k active users
    items = jax.random.randint(k[3], (steps, batch), 0, n_items)
    noise = 0.3 * jax.random.normal(k[3], (steps, batch), jnp.float32)
    ratings = jnp.sum(true_u[users] * true_v[items], -1) + noise
    params0 = {
        "user": 0.1 * jax.random.normal(k[0], (n_users, dim), jnp.float32),
        "item": 0.1 * jax.random.normal(k[1], (n_items, dim), jnp.float32),
        "bias": jnp.zeros((), jnp.float32),
    }

    def train(opt, row_sparse):
        step = optim.make_train_step(_embedding_loss, opt, row_sparse=row_sparse)
        params = jax.tree_util.tree_map(jnp.copy, params0)
        state = opt.init(params)
        for t in range(steps):
            params, state, _ = step(params, state, users[t], items[t], ratings[t])
        return float(jnp.mean(jax.vmap(lambda u, i, r: _embedding_loss(params, u, i, r))(users, items, ratings)))

    initial = float(jnp.mean(jax.vmap(lambda u, i, r: _embedding_loss(params0, u, i, r))(users, items, ratings)))
    dense = train(optax.adam(0.02), None)
    lazy = train(optim.lazy(optax.adam(0.02)), SPARSE_TABLES)
    assert dense < 0.1 * initial
    assert lazy <= 1.05 * dense, (lazy, dense)


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_thousand_steps_leave_untouched_rows_and_state_bit_identical(name):
    """1000 jitted steps (one scan) of row-sparse gradients that never touch the last rows."""
    opt = optim.lazy(OPTIMIZERS[name]())
    params = _params()
    state0 = opt.init(params)
    rng = np.random.default_rng(5)
    idx = jnp.asarray(rng.integers(0, N - 3, size=(1000, 4)))
    vals = jnp.asarray(rng.normal(size=(1000, 4, D)), jnp.float32)

    @jax.jit
    def run(params, state):
        def step(carry, xs):
            p, s = carry
            g = {"emb": mj.row_sparse(xs[1], xs[0], (N, D)), "b": jnp.zeros(D, jnp.float32)}
            u, s = opt.update(g, s, p)
            return (optim.apply_updates(p, u), s), None

        return jax.lax.scan(step, (params, state), (idx, vals))[0]

    p, s = run(params, state0)
    np.testing.assert_array_equal(np.asarray(p["emb"][N - 3 :]), np.asarray(params["emb"][N - 3 :]))
    assert not np.array_equal(np.asarray(p["emb"][: N - 3]), np.asarray(params["emb"][: N - 3]))
    for x, x0 in zip(_param_shaped(s, (N, D)), _param_shaped(state0, (N, D))):
        np.testing.assert_array_equal(np.asarray(x[N - 3 :]), np.asarray(x0[N - 3 :]))
    assert all(np.all(np.isfinite(np.asarray(x))) for x in jax.tree_util.tree_leaves((p, s)))


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_mismatched_gradients_and_states_raise_at_trace_time(name):
    opt = optim.lazy(OPTIMIZERS[name]())
    params = _params()
    state = opt.init(params)
    update = jax.jit(opt.update)
    too_big = {"emb": mj.row_sparse(jnp.ones((1, D)), jnp.array([N + 2]), (N + 3, D)), "b": jnp.zeros(D)}
    with pytest.raises(ValueError, match="shape"):
        update(too_big, state, params)
    other = opt.init({"emb": jnp.zeros((N + 1, D)), "b": jnp.zeros(D)})
    if jax.tree_util.tree_leaves(other):  # a stateless optimizer (sgd) has no state to mismatch
        with pytest.raises(ValueError, match="state does not belong"):
            update({"emb": mj.as_masked(jnp.ones((N, D))), "b": jnp.zeros(D)}, other)


def test_lifting_inside_masked_and_multi_transform_works():
    """optax.masked / multi_transform around lazy(...): the way the refusal of lazy(masked) points to."""
    params = {"emb": jnp.zeros((N, D)), "b": jnp.zeros(D)}
    g = {"emb": mj.row_sparse(jnp.ones((2, D)), jnp.array([1, 4]), (N, D)), "b": jnp.ones(D)}
    for opt in (
        optax.masked(optim.lazy(optax.adam(0.1)), {"emb": True, "b": False}),
        optax.multi_transform(
            {"rows": optim.lazy(optax.adam(0.1)), "dense": optax.sgd(0.1)}, {"emb": "rows", "b": "dense"}
        ),
    ):
        state = opt.init(params)
        u, state = jax.jit(opt.update)(g, state, params)
        new = optim.apply_updates(params, u)
        touched = np.zeros(N, bool)
        touched[[1, 4]] = True
        assert np.all(np.asarray(new["emb"])[touched] != 0) and np.all(np.asarray(new["emb"])[~touched] == 0)


# -- optax compositions around lazy --------------------------------------------------------------------
_CPARAMS = {"emb": jnp.linspace(-1.0, 1.0, 18).reshape(6, 3), "w": jnp.ones(3)}


def _micro_grads():
    """Four micro-steps of row-sparse gradients touching different rows (row 5 never)."""
    rows = [[0, 1], [1, 2], [3, 3], [4, 0]]
    out = []
    for i, r in enumerate(rows):
        data = jnp.full((2, 3), 0.1 * (i + 1)) + jnp.arange(3.0)
        out.append({"emb": mj.row_sparse(data, jnp.array(r), (6, 3)), "w": jnp.full(3, 0.05 * (i + 1))})
    return out


@pytest.mark.parametrize("use_grad_mean", [True, False])
def test_lazy_multisteps_accumulates_exactly_per_row(use_grad_mean):
    """Every row touched in a window of k micro-steps is updated with its exact accumulated gradient
    at the k-th step (also rows not touched at that step); untouched rows and their state stay."""
    k, grads = 2, _micro_grads()
    opt = optim.lazy(optax.MultiSteps(optax.adam(0.1), k, use_grad_mean=use_grad_mean))
    step = jax.jit(opt.update)
    params, state = _CPARAMS, opt.init(_CPARAMS)
    for i in range(0, len(grads), k):
        window = grads[i : i + k]
        dense = [
            jax.tree_util.tree_map(
                lambda g: g.todense().filled(0) if isinstance(g, mj.RowSparseArray) else g,
                g,
                is_leaf=lambda x: isinstance(x, mj.RowSparseArray),
            )
            for g in window
        ]
        total = jax.tree_util.tree_map(lambda *gs: sum(gs) / (k if use_grad_mean else 1), *dense)
        touched = np.zeros(6, bool)
        for g in window:
            touched[np.asarray(g["emb"].indices)] = True
        # the reference: lazy(adam) on the accumulated gradient, valid on the touched rows
        ref_opt = optim.lazy(optax.adam(0.1))
        ref_state = jax.tree_util.tree_map(lambda x: x, state.multi_steps.inner_opt_state)
        ref_g = {
            "emb": mj.masked_array(total["emb"], jnp.broadcast_to(jnp.asarray(touched)[:, None], (6, 3))),
            "w": total["w"],
        }
        ref_u, ref_state = ref_opt.update(ref_g, ref_state, params)
        ref_params = optim.apply_updates(params, ref_u)
        for j, g in enumerate(window):
            u, state = step(g, state, params)
            if j < k - 1:
                assert not np.asarray(u["emb"].mask).any()  # no update before the k-th micro-step
        params = optim.apply_updates(params, u)
        np.testing.assert_allclose(np.asarray(params["emb"]), np.asarray(ref_params["emb"]), rtol=1e-6)
        np.testing.assert_allclose(np.asarray(params["w"]), np.asarray(ref_params["w"]), rtol=1e-6)
        untouched = ~touched
        np.testing.assert_array_equal(
            np.asarray(state.multi_steps.inner_opt_state[0].mu["emb"])[untouched],
            np.asarray(ref_state[0].mu["emb"])[untouched],
        )
    assert params["emb"][5].tolist() == _CPARAMS["emb"][5].tolist()  # never touched: bit-identical


def test_lazy_multisteps_equals_dense_multisteps_when_every_row_is_touched():
    opt_l, opt_d = optim.lazy(optax.MultiSteps(optax.adam(0.1), 3)), optax.MultiSteps(optax.adam(0.1), 3)
    p_l = p_d = _CPARAMS
    s_l, s_d = opt_l.init(p_l), opt_d.init(p_d)
    for i in range(6):
        g = {"emb": jnp.full((6, 3), 0.1 * i) + jnp.arange(6.0)[:, None], "w": jnp.full(3, 0.2)}
        rows = {"emb": mj.row_sparse(g["emb"], jnp.arange(6), (6, 3)), "w": g["w"]}
        u_l, s_l = opt_l.update(rows, s_l, p_l)
        u_d, s_d = opt_d.update(g, s_d, p_d)
        p_l, p_d = optim.apply_updates(p_l, u_l), optax.apply_updates(p_d, u_d)
        jax.tree_util.tree_map(
            lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6), p_l, p_d
        )


@pytest.mark.parametrize("capacity", [None, 6], ids=["dense accumulator", "row accumulator"])
def test_lazy_multisteps_passes_extra_arguments_to_the_inner_update(capacity):
    """``update(..., value=loss)`` reaches the inner transformation, as in ``optax.MultiSteps``:
    Polyak's step size reads the loss; every row touched, the trajectory is optax's."""
    inner = lambda: optax.chain(optax.scale_by_polyak(max_learning_rate=0.5), optax.scale(-1.0))
    opt_l = optim.lazy(optax.MultiSteps(inner(), 2), capacity=capacity)
    opt_d = optax.MultiSteps(inner(), 2)
    p_l = p_d = _CPARAMS
    s_l, s_d = opt_l.init(p_l), opt_d.init(p_d)
    for i in range(4):
        g = {"emb": jnp.full((6, 3), 0.1 * i) + jnp.arange(6.0)[:, None], "w": jnp.full(3, 0.2)}
        rows = {"emb": mj.row_sparse(g["emb"], jnp.arange(6), (6, 3)), "w": g["w"]}
        loss = jnp.asarray(3.0 - 0.5 * i)
        u_l, s_l = jax.jit(opt_l.update)(rows, s_l, p_l, value=loss)
        u_d, s_d = opt_d.update(g, s_d, p_d, value=loss)
        p_l, p_d = optim.apply_updates(p_l, u_l), optax.apply_updates(p_d, u_d)
        jax.tree_util.tree_map(
            lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6), p_l, p_d
        )
    assert not np.allclose(np.asarray(p_l["emb"]), np.asarray(_CPARAMS["emb"]))  # the loss moved them


def test_lazy_apply_if_finite_checks_valid_entries_only():
    """NaN under a gradient's mask is not a NaN gradient; NaN in a valid entry skips the step."""
    opt = optim.lazy(optax.apply_if_finite(optax.adam(0.1), 2))
    state = opt.init(_CPARAMS)
    rows_valid = jnp.broadcast_to(jnp.arange(6)[:, None] < 2, (6, 3))
    poisoned = {"emb": mj.masked_array(jnp.where(rows_valid, 1.0, jnp.nan), rows_valid), "w": jnp.full(3, 0.1)}
    u, state = jax.jit(opt.update)(poisoned, state, _CPARAMS)
    assert int(state.notfinite_count) == 0 and bool(state.last_finite)
    assert np.isfinite(np.asarray(u["emb"].filled(0))).all() and np.asarray(u["emb"].mask[:2]).all()
    bad = {"emb": mj.masked_array(jnp.where(rows_valid, jnp.nan, 1.0), rows_valid), "w": jnp.full(3, 0.1)}
    u, state = jax.jit(opt.update)(bad, state, _CPARAMS)
    assert int(state.notfinite_count) == 1
    assert float(jnp.abs(u["emb"].filled(0)).sum()) == 0.0 and float(jnp.abs(u["w"]).sum()) == 0.0
    rows = {"emb": mj.row_sparse(jnp.ones((2, 3)), jnp.array([1, 4]), (6, 3)), "w": jnp.full(3, 0.1)}
    u, state = opt.update(rows, state, _CPARAMS)
    assert int(state.notfinite_count) == 0


@pytest.mark.parametrize("wrap", ["multi_transform", "masked", "MultiSteps", "apply_if_finite"])
def test_lazy_of_optax_wrappers_is_the_wrapper_for_plain_gradients(wrap):
    inner = {
        "multi_transform": lambda: optax.multi_transform(
            {"a": optax.adam(0.1), "b": optax.sgd(0.1)}, {"emb": "a", "w": "b"}
        ),
        "masked": lambda: optax.masked(optax.adam(0.1), {"emb": True, "w": False}),
        "MultiSteps": lambda: optax.MultiSteps(optax.adam(0.1), 2),
        "apply_if_finite": lambda: optax.apply_if_finite(optax.adam(0.1), 2),
    }[wrap]
    lazy_opt, plain = optim.lazy(inner()), inner()
    p_l = p_d = _CPARAMS
    s_l, s_d = lazy_opt.init(p_l), plain.init(p_d)
    for i in range(4):
        g = {"emb": jnp.sin(jnp.arange(18.0) + i).reshape(6, 3), "w": jnp.cos(jnp.arange(3.0) * i)}
        u_l, s_l = lazy_opt.update(g, s_l, p_l)
        u_d, s_d = plain.update(g, s_d, p_d)
        p_l, p_d = optim.apply_updates(p_l, u_l), optax.apply_updates(p_d, u_d)
    jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6), p_l, p_d)


def test_equinox_partition_combine_with_row_sparse_grads():
    """mj.grad(row_sparse=True) on an equinox model split by eqx.partition: the embedding's gradient
    is row-sparse over the looked-up ids, the rest dense, and lazy(adam) trains the combined model."""
    import equinox as eqx

    class Model(eqx.Module):
        emb: jax.Array
        head: eqx.nn.Linear

        def __call__(self, ids):
            return jnp.sum(jax.vmap(self.head)(mj.lookup(self.emb, ids)))

    model = Model(jnp.linspace(-1, 1, 24).reshape(8, 3), eqx.nn.Linear(3, 1, key=jax.random.key(0)))
    params, static = eqx.partition(model, eqx.is_array)
    ids = jnp.array([1, 5, 5])

    def loss(p):
        return eqx.combine(p, static)(ids)

    def only_emb(p):  # a prefix tree of bools over the partitioned model
        return eqx.tree_at(lambda m: m.emb, jax.tree_util.tree_map(lambda _: False, p), True)

    g = mj.grad(loss, row_sparse=only_emb)(params)
    assert isinstance(g.emb, mj.RowSparseArray) and not isinstance(g.head.weight, mj.RowSparseArray)
    np.testing.assert_allclose(np.asarray(g.head.weight), np.asarray(jax.grad(loss)(params).head.weight), rtol=1e-6)
    dense = jax.grad(loss)(params)
    np.testing.assert_allclose(np.asarray(g.emb.todense().filled(0)), np.asarray(dense.emb), rtol=1e-6)
    opt = optim.lazy(optax.adam(0.1))
    state = opt.init(params)
    u, state = opt.update(g, state, params)
    new = optim.apply_updates(params, u)
    changed = np.asarray(jnp.any(new.emb != params.emb, axis=1))
    np.testing.assert_array_equal(changed, np.isin(np.arange(8), [1, 5]))
    assert isinstance(eqx.combine(new, static), Model)


@pytest.mark.parametrize("k", [1, 2, 3])
def test_apply_if_finite_around_lazy_with_row_sparse_gradients(k):
    """optax.apply_if_finite(lazy(adam)) selects between the update and zeros of the gradient's
    structure: lazy's row-sparse updates keep the gradient's K, so the composition runs (under jit)
    and equals lazy(adam); a non-finite stored row skips the step."""
    params = {"emb": jnp.ones((6, 3))}
    ids = jnp.array([4, 1, 4][:k])
    g = {"emb": mj.row_sparse(jnp.ones((k, 3)), ids, (6, 3))}
    tx = optax.apply_if_finite(optim.lazy(optax.adam(0.1)), 2)
    u, state = jax.jit(tx.update)(g, tx.init(params), params)
    ref = optim.lazy(optax.adam(0.1))
    ru, _ = ref.update(g, ref.init(params), params)
    assert u["emb"].nse == k
    np.testing.assert_array_equal(
        np.asarray(optim.apply_updates(params, u)["emb"]), np.asarray(optim.apply_updates(params, ru)["emb"])
    )
    bad = {"emb": mj.row_sparse(jnp.full((k, 3), jnp.nan), ids, (6, 3))}
    u, state = jax.jit(tx.update)(bad, state, params)
    assert int(state.notfinite_count) == 1
    np.testing.assert_array_equal(np.asarray(optim.apply_updates(params, u)["emb"]), np.ones((6, 3)))


def _rowwise_reference(table, bias, steps, lr, eps, init):
    """Row-wise Adagrad in NumPy float64: one sum per table row (the mean square of the row's
    summed gradient), one per entry for the bias; rows and entries not touched do not move."""
    table, bias = np.array(table, np.float64), np.array(bias, np.float64)
    s_t, s_b = np.full(table.shape[0], init), np.full(bias.shape, init)
    for rows, grads, gb, gb_valid in steps:
        g = np.zeros_like(table)
        np.add.at(g, rows, grads)
        for r in sorted(set(rows)):
            s_t[r] += np.mean(g[r] ** 2)
            table[r] -= lr * g[r] / (np.sqrt(s_t[r]) + eps)
        s_b = np.where(gb_valid, s_b + gb**2, s_b)
        bias = np.where(gb_valid, bias - lr * gb / (np.sqrt(s_b) + eps), bias)
    return table, bias, s_t


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_rowwise_adagrad_equals_reference(jit):
    n, dim, lr, eps, init = 7, 4, 0.3, 1e-8, 0.1
    rng = np.random.default_rng(0)
    params = {
        "table": jnp.asarray(rng.normal(size=(n, dim)), jnp.float32),
        "bias": jnp.asarray(rng.normal(size=3), jnp.float32),
    }
    opt = optim.rowwise_adagrad(lr, initial_accumulator_value=init, eps=eps)
    state = opt.init(params)
    assert state[0].sum_of_squares["table"].shape == (n,) and state[0].sum_of_squares["bias"].shape == (3,)
    update = jax.jit(opt.update) if jit else opt.update
    steps, p = [], params
    for k in range(4):
        rows = rng.integers(0, n, size=3)
        rows[1] = rows[0]  # a duplicate: its gradients are summed first
        grads = rng.normal(size=(3, dim)).astype(np.float32)
        gb, gb_valid = rng.normal(size=3).astype(np.float32), np.array([True, k % 2 == 0, True])
        steps.append((rows, grads, gb, gb_valid))
        g = {
            "table": mj.row_sparse(jnp.asarray(grads), jnp.asarray(rows), (n, dim)),
            "bias": mj.masked_array(jnp.asarray(gb), jnp.asarray(gb_valid)),
        }
        u, state = update(g, state, p)
        p = optim.apply_updates(p, u)
    table, bias, s_t = _rowwise_reference(params["table"], params["bias"], steps, lr, eps, init)
    np.testing.assert_allclose(np.asarray(p["table"]), table, rtol=2e-6, atol=1e-7)
    np.testing.assert_allclose(np.asarray(p["bias"]), bias, rtol=2e-6, atol=1e-7)
    np.testing.assert_allclose(np.asarray(state[0].sum_of_squares["table"]), s_t, rtol=2e-6)
    untouched = sorted(set(range(n)) - {int(r) for rows, *_ in steps for r in rows})
    np.testing.assert_array_equal(np.asarray(p["table"])[untouched], np.asarray(params["table"])[untouched])
    # a dense gradient is the same rule applied to every row
    dense = jnp.asarray(rng.normal(size=(n, dim)), jnp.float32)
    t = optim.scale_by_rowwise_rss(initial_accumulator_value=init, eps=eps)
    u, s = t.update(dense, t.init(dense))
    expect = np.asarray(dense) / (np.sqrt(init + np.mean(np.asarray(dense, np.float64) ** 2, axis=1)) + eps)[:, None]
    np.testing.assert_allclose(np.asarray(u), expect, rtol=2e-6)


def test_rowwise_adagrad_rejects_bad_state_and_arguments():
    t = optim.scale_by_rowwise_rss()
    with pytest.raises(ValueError, match="sums have shapes"):
        t.update(jnp.ones((4, 2)), t.init(jnp.zeros((5, 2))))
    with pytest.raises(ValueError, match="ScaleByRowwiseRssState"):
        t.update(jnp.ones((4, 2)), optim.scale_by_rss().init(jnp.zeros((4, 2))))
    with pytest.raises(ValueError, match="eps_placement"):
        optim.scale_by_rowwise_rss(eps_placement="middle")
    with pytest.raises(ValueError, match="initial_accumulator_value"):
        optim.rowwise_adagrad(0.1, initial_accumulator_value=-1.0)


CATCH_UP = {  # name: (inner, parameters exactly equal to dense optax: a closed form for the drift exists)
    "sgd_momentum": (optax.sgd(0.1, momentum=0.9), True),
    "nesterov": (optax.sgd(0.1, momentum=0.9, nesterov=True), True),
    "rmsprop": (optax.rmsprop(0.05, decay=0.8), True),
    "adagrad": (optax.adagrad(0.1), True),
    "adamw_b1_0": (optax.adamw(0.1, b1=0.0, weight_decay=0.1), True),
    "adam": (optax.adam(0.1), False),
    "adamw": (optax.adamw(0.1, weight_decay=0.1), False),
}


# `make test`: every optimizer with row-sparse gradients, two with masked whole-row gradients;
# `make test-full` (MJ_ORACLE=full): every optimizer with both
_CATCH_UP_CASES = [
    (n, g)
    for n in CATCH_UP
    for g in ("row_sparse", "masked_rows")
    if g == "row_sparse" or n in ("sgd_momentum", "adam") or os.environ.get("MJ_ORACLE") == "full"
]


@pytest.mark.parametrize("name, gradient", _CATCH_UP_CASES)
def test_lazy_catch_up_equals_dense_optax(name, gradient):
    """Rows touched now and then: with catch_up, lazy's state (and, where the drift has a closed
    form, its parameters) equals dense optax fed zero gradients on untouched rows; without it, not."""
    inner, exact_params = CATCH_UP[name]
    n, dim = 8, 3
    params = {"emb": jnp.linspace(-1.0, 1.0, n * dim).reshape(n, dim), "w": jnp.ones(3)}
    results = {}
    for catch_up in (False, True):
        opt = optim.lazy(inner, catch_up=catch_up)
        update = jax.jit(opt.update)
        s_l, s_d, p_l, p_d = opt.init(params), inner.init(params), params, params
        rng = np.random.default_rng(0)
        for t in range(7):
            rows = rng.choice(n, 2, replace=False) if t < 6 else np.arange(n)  # the last step touches every row
            data = jnp.asarray(rng.normal(size=(len(rows), dim)), jnp.float32)
            sparse = mj.row_sparse(data, jnp.asarray(rows), (n, dim))
            dense = sparse.todense().filled(0)
            g = {
                "emb": sparse if gradient == "row_sparse" else sparse.todense(),
                "w": jnp.asarray(rng.normal(size=3), jnp.float32),
            }
            u, s_l = update(g, s_l, p_l)
            p_l = optim.apply_updates(p_l, u)
            u, s_d = inner.update({"emb": dense, "w": g["w"]}, s_d, p_d)
            p_d = optax.apply_updates(p_d, u)
        state = s_l.inner if catch_up else s_l
        state_err = max(
            float(jnp.max(jnp.abs(a - b)))
            for a, b in zip(jax.tree_util.tree_leaves(state), jax.tree_util.tree_leaves(s_d))
        )
        results[catch_up] = (state_err, float(jnp.max(jnp.abs(p_l["emb"] - p_d["emb"]))))
    state_err, param_err = results[True]
    assert state_err < 1e-6
    if exact_params:
        assert param_err < 1e-6
    if name != "adagrad":  # adagrad's sums do not decay: nothing to catch up
        assert max(results[False]) > 1e-3


def test_lazy_catch_up_in_a_donated_train_step_and_rejections():
    params, users, items, r = _embedding_problem(40, 20, 4, 16)
    opt = optim.lazy(optax.adamw(0.05, weight_decay=0.01), catch_up=True)
    step = optim.make_train_step(_embedding_loss, opt, row_sparse=SPARSE_TABLES)
    state = opt.init(params)
    assert state.last["user"].shape == (40,) and state.last["bias"].shape == ()
    for _ in range(3):
        params, state, loss = step(params, state, users, items, r)
    assert int(state.step) == 3 and set(np.unique(np.asarray(state.last["user"]))) <= {0, 3}
    rejected = {  # each with the reason its zero-gradient step has no closed form
        "L2 weight decay": optax.chain(optax.add_decayed_weights(0.1), optax.sgd(0.1, momentum=0.9)),
        "leaves zero .* floored": optax.adamax(0.1),  # nu -> max(b2 * nu, eps): not s -> c * s
        "changes another": optax.amsgrad(0.1),  # the running maximum reads nu
    }
    for match, inner in rejected.items():
        bad = optim.lazy(inner, catch_up=True)
        with pytest.raises(ValueError, match=match):
            bad.update(
                mj.row_sparse(jnp.ones((1, 2)), jnp.array([1]), (3, 2)), bad.init(jnp.zeros((3, 2))), jnp.zeros((3, 2))
            )
    with pytest.raises(ValueError, match="needs params"):
        wd = optim.lazy(optax.adamw(0.1, weight_decay=0.1), catch_up=True)
        wd.update(mj.row_sparse(jnp.ones((1, 2)), jnp.array([1]), (3, 2)), wd.init(jnp.zeros((3, 2))))
    with pytest.raises(ValueError, match="MultiSteps"):
        optim.lazy(optax.MultiSteps(optax.adam(0.1), 2), catch_up=True)


def _micro_steps(opt, params, grads):
    p, s = params, opt.init(params)
    update = jax.jit(opt.update)
    for g in grads:
        u, s = update(g, s, p)
        p = optim.apply_updates(p, u)
    return p, s


def _rows(rows, values, n=10, d=2):
    return mj.row_sparse(jnp.asarray(values, jnp.float32), jnp.asarray(rows), (n, d))


@pytest.mark.parametrize("inner", [optax.adam(0.1), optax.sgd(0.2, momentum=0.9)], ids=["adam", "sgd_momentum"])
def test_multi_steps_row_accumulator_equals_dense_accumulator(inner):
    """With room for every row of a window, the row accumulator gives the dense one's parameters,
    with its state O(capacity x dim) instead of O(table)."""
    rng = np.random.default_rng(3)
    params = {"emb": jnp.linspace(-1.0, 1.0, 20).reshape(10, 2), "w": jnp.ones(3)}
    grads = []
    for _ in range(7):
        rows = rng.integers(0, 10, size=3)
        rows[1] = rows[0]  # duplicates within a micro-step
        grads.append({"emb": _rows(rows, rng.normal(size=(3, 2))), "w": jnp.asarray(rng.normal(size=3), jnp.float32)})
    ms = optax.MultiSteps(inner, 3)
    dense, _ = _micro_steps(optim.lazy(ms), params, grads)
    rows, state = _micro_steps(optim.lazy(ms, capacity={"emb": 9, "w": None}), params, grads)
    assert state.acc["emb"].data.shape == (9, 2) and state.acc["w"].shape == (3,) and int(state.early_flushes) == 0
    for k in params:
        np.testing.assert_allclose(np.asarray(rows[k]), np.asarray(dense[k]), rtol=1e-6, atol=1e-7)


def test_multi_steps_row_accumulator_ends_a_full_window_early():
    """The documented rule: a micro-step whose rows would not fit ends the window before it (the
    accumulated mean is applied), and starts the next window; nothing is dropped."""
    params = jnp.zeros((10, 2))
    g = [
        _rows([0, 1], [[1.0, 2.0], [3.0, 4.0]]),
        _rows([2, 3], [[5.0, 6.0], [7.0, 8.0]]),
        _rows([2, 4], [[1.0, 1.0], [2.0, 2.0]]),
        _rows([3, 3], [[1.0, 0.0], [0.0, 1.0]]),
    ]
    opt = optim.lazy(optax.MultiSteps(optax.adam(0.1), 3), capacity=3)
    out, state = _micro_steps(opt, params, g)
    assert int(state.early_flushes) == 1 and int(state.gradient_step) == 2 and int(state.mini_step) == 0
    # reference: adam on g0 alone (the window ended early), then on the mean of g1, g2, g3
    mean = mj.row_sparse(
        jnp.concatenate([x.data for x in g[1:]]) / 3, jnp.concatenate([x.indices for x in g[1:]]), (10, 2)
    )
    ref, _ = _micro_steps(optim.lazy(optax.adam(0.1)), params, [g[0], mean])
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-6, atol=1e-7)


def test_multi_steps_row_accumulator_rejections():
    with pytest.raises(ValueError, match="cannot fit an accumulator of 2 rows"):
        opt = optim.lazy(optax.MultiSteps(optax.adam(0.1), 2), capacity=2)
        opt.update(_rows([1, 2, 3], np.ones((3, 2))), opt.init(jnp.zeros((10, 2))), jnp.zeros((10, 2)))
    with pytest.raises(ValueError, match="applies to optax.MultiSteps"):
        optim.lazy(optax.adam(0.1), capacity=4)
    with pytest.raises(ValueError, match="capacity must be an int >= 2"):
        optim.lazy(optax.MultiSteps(optax.adam(0.1), 2), capacity={"a": 1}).init({"a": jnp.zeros((4, 2))})
    with pytest.raises(TypeError, match="masked array"):
        opt = optim.lazy(optax.MultiSteps(optax.adam(0.1), 2), capacity=4)
        opt.update(mj.masked_array(jnp.ones((4, 2)), jnp.ones((4, 2), bool)), opt.init(jnp.zeros((4, 2))))


ENTRYWISE = {"clip_adam": False}  # every other optimizer of the table works entry by entry


def _two_table_params(rng):
    """Parameters of :func:`_two_table_loss`: tables "a" (40 x 4) and "b" (9 x 4), "w", "s"."""
    return {
        "a": jnp.asarray(rng.normal(size=(40, 4)), jnp.float32),
        "b": jnp.asarray(rng.normal(size=(9, 4)), jnp.float32),
        "w": jnp.asarray(rng.normal(size=(4,)), jnp.float32),
        "s": jnp.asarray(0.3, jnp.float32),
    }


def _two_table_loss(p, a_ids, b_ids):
    rows = mj.lookup(p["a"], a_ids) * p["w"] + p["s"]
    return jnp.sum(jnp.tanh(rows) ** 2) + jnp.sum(jnp.cos(mj.lookup(p["b"], b_ids)) * p["w"])


# stateless, per-entry moments, reading the parameters, hyperparameters in the state, and one that
# combines entries (kept in the one-call update); the other optimizers: `make test-slow`
@pytest.mark.parametrize("name", _tiered(OPTIMIZERS, ("sgd", "adam", "decay_sgd", "inject_adam", "clip_adam")))
def test_chunked_table_updates_equal_the_one_call_update(name):
    """``make_train_step`` updates row-sparse tables in chunks of rows (on the CPU) when the inner
    transformation works entry by entry, read off its jaxpr; the result is the one-call update's
    (up to rounding), for chunks that leave a partial last chunk, with one table in chunks and one
    in the single call, and with none in chunks; other transformations keep the one-call update,
    exactly."""
    from masked_jax.optim._chunked import entrywise

    rng = np.random.default_rng(3)
    params = _two_table_params(rng)
    batches = [
        (jnp.asarray(rng.integers(0, 30, size=(6, 5))), jnp.asarray(rng.integers(0, 9, size=(7,)))) for _ in range(3)
    ]  # duplicates in every batch; rows 30.. of "a" never read
    opt = optim.lazy(OPTIMIZERS[name]())
    sparse = {"a": True, "b": True, "w": False, "s": False}
    grads = mj.grad(_two_table_loss, row_sparse=sparse)(params, *batches[0])
    expect = ENTRYWISE.get(name, True)
    assert entrywise(optim._state.lazy_inner(opt), grads, opt.init(params), params) is expect
    results = {}
    for chunk in (None, 2, 7, 30):
        step = optim.make_train_step(_two_table_loss, opt, row_sparse=sparse, chunk_rows=chunk)
        p, s = jax.tree_util.tree_map(jnp.array, params), opt.init(params)
        hlo = _hlo(step, p, s, *batches[0])
        # loops over chunks of "a" (30 stored rows) and of "b" (7) where they store more than a chunk
        loops = 0 if chunk is None or not expect else (chunk < 30) + (chunk < 7)
        assert hlo.count("while(") == loops
        for ids in batches:
            p, s, _ = step(p, s, *ids)
        results[chunk] = (p, s)
    for chunk in (2, 7, 30):
        if expect:
            _close(results[chunk], results[None], rtol=1e-5, atol=1e-6)
        else:
            for x, y in zip(jax.tree_util.tree_leaves(results[chunk]), jax.tree_util.tree_leaves(results[None])):
                np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
        np.testing.assert_array_equal(np.asarray(results[chunk][0]["a"][30:]), np.asarray(params["a"][30:]))


@pytest.mark.parametrize("lr", [0.1, optax.linear_schedule(0.1, 0.01, 3)], ids=["constant", "schedule"])
@pytest.mark.parametrize("eps_placement", ["outside", "inside"])
def test_rowwise_adagrad_tables_in_chunks_equal_the_one_call_update(lr, eps_placement):
    """``rowwise_adagrad`` updates each row from that row alone (its one sum per row included), so
    ``make_train_step`` updates its tables in chunks of rows too: equal to the one-call update over
    three steps with duplicates and partial last chunks (its schedule's count advancing once per
    step), untouched rows and their sums bit-identical, the tables and sums updated in place."""
    rng = np.random.default_rng(4)
    params = _two_table_params(rng)
    batches = [
        (jnp.asarray(rng.integers(0, 30, size=(6, 5))), jnp.asarray(rng.integers(0, 9, size=(7,)))) for _ in range(3)
    ]
    opt = optim.rowwise_adagrad(lr, initial_accumulator_value=0.1, eps_placement=eps_placement)
    sparse = {"a": True, "b": True, "w": False, "s": False}
    results = {}
    for chunk in (None, 2, 7, 30):
        step = optim.make_train_step(_two_table_loss, opt, row_sparse=sparse, chunk_rows=chunk)
        p, s = jax.tree_util.tree_map(jnp.array, params), opt.init(params)
        hlo = _hlo(step, p, s, *batches[0])
        assert hlo.count("while(") == (0 if chunk is None else (chunk < 30) + (chunk < 7))
        header = hlo.splitlines()[0]
        aliased = {int(i) for i in re.findall(r"\{\d*\}: \((\d+), \{\}, (?:may|must)-alias\)", header)}
        assert {0, 1} | {4, 5} <= aliased  # "a", "b" and their sums (flattened: a, b, s, w, then the sums)
        assert _table_sized(hlo, 40, 4) == []
        for ids in batches:
            p, s, _ = step(p, s, *ids)
        results[chunk] = (p, s)
    for chunk in (2, 7, 30):
        _close(results[chunk], results[None], rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(np.asarray(results[chunk][0]["a"][30:]), np.asarray(params["a"][30:]))
        np.testing.assert_array_equal(np.asarray(results[chunk][1][0].sum_of_squares["a"][30:]), np.float32(0.1))


# a momentum, an accumulator, and no closed form (adam); the other optimizers: `make test-slow`
@pytest.mark.parametrize("name", _tiered(CATCH_UP, ("sgd_momentum", "adagrad", "adam")))
def test_chunked_catch_up_equals_the_one_call_update(name):
    """With ``catch_up``, rows read now and then over five steps: the chunked tables (counters,
    caught-up state and parameters) equal the one-call update's, up to rounding."""
    opt = optim.lazy(CATCH_UP[name][0], catch_up=True)
    sparse = {"a": True, "b": True, "w": False, "s": False}
    rng = np.random.default_rng(5)
    params = _two_table_params(rng)
    batches = [
        (jnp.asarray(rng.integers(0, 30, size=(2, 5))), jnp.asarray(rng.integers(0, 9, size=(3,)))) for _ in range(5)
    ]
    results = {}
    for chunk in (None, 2, 4):
        step = optim.make_train_step(_two_table_loss, opt, row_sparse=sparse, chunk_rows=chunk)
        p, s = jax.tree_util.tree_map(jnp.array, params), opt.init(params)
        # loops over the chunks of "a" (10 stored rows) and of "b" (3) where they store more than one
        assert _hlo(step, p, s, *batches[0]).count("while(") == (0 if chunk is None else (chunk < 10) + (chunk < 3))
        for ids in batches:
            p, s, _ = step(p, s, *ids)
        results[chunk] = (p, s)
    assert int(results[2][1].step) == 5
    for chunk in (2, 4):
        _close(results[chunk], results[None], rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(np.asarray(results[chunk][1].last["a"]), np.asarray(results[None][1].last["a"]))


def test_entrywise_rejects_what_mixes_entries_or_leaves():
    """The jaxpr reading behind chunked updates: a transformation that reduces over entries, moves
    them, mixes two leaves, or derives global state from entries is not entry by entry."""
    from masked_jax.optim._chunked import entrywise

    def tx(update):
        return optax.GradientTransformation(lambda p: optax.EmptyState(), lambda u, s, p=None: (update(u), s))

    params = {"a": jnp.ones((5, 2)), "b": jnp.ones((5, 2))}
    grads = {"a": mj.row_sparse(jnp.ones((2, 2)), jnp.array([0, 3]), (5, 2)), "b": jnp.ones((5, 2))}
    cases = {
        "scale": (tx(lambda u: jax.tree_util.tree_map(lambda x: -0.1 * x, u)), True),
        "centred": (tx(lambda u: jax.tree_util.tree_map(lambda x: x - jnp.mean(x, axis=0), u)), False),
        "reversed rows": (tx(lambda u: jax.tree_util.tree_map(lambda x: x[::-1], u)), False),
        "cumulative": (tx(lambda u: jax.tree_util.tree_map(lambda x: jnp.cumsum(x, axis=0), u)), False),
        "two leaves": (tx(lambda u: {"a": u["a"] + u["b"], "b": u["b"]}), False),
        "position": (tx(lambda u: jax.tree_util.tree_map(lambda x: x * jnp.arange(x.shape[0])[:, None], u)), False),
        "trust ratio": (optax.chain(optax.scale_by_adam(), optax.scale_by_trust_ratio()), False),
        "apply_if_finite": (optax.apply_if_finite(optax.adam(0.1), 3), False),
        "jit inside": (tx(jax.jit(lambda u: jax.tree_util.tree_map(lambda x: jnp.sqrt(jnp.abs(x)) * 2.0, u))), True),
    }
    for name, (inner, expect) in cases.items():
        state = inner.init(params)
        assert entrywise(inner, grads, state, params) is expect, name


@pytest.mark.parametrize("bad", [0, -3, 2.5, True, "8"])
def test_chunk_rows_is_checked(bad):
    with pytest.raises(ValueError, match="chunk_rows must be a positive int or None"):
        optim.make_train_step(_two_table_loss, optim.lazy(optax.sgd(0.1)), row_sparse=True, chunk_rows=bad)


def test_entrywise_reads_captured_arrays_as_global():
    """A transformation that closes over an array: a captured scalar is the same at every entry; a
    captured parameter-shaped array differs by position, so chunking it would misalign it."""
    from masked_jax.optim._chunked import entrywise

    params = {"a": jnp.ones((5, 2))}
    grads = {"a": mj.row_sparse(jnp.ones((2, 2)), jnp.array([0, 3]), (5, 2))}
    scale, per_entry = jnp.asarray(0.5), jnp.arange(10.0).reshape(5, 2)
    for captured, expect in ((scale, True), (per_entry, False)):
        inner = optax.GradientTransformation(
            lambda p: optax.EmptyState(),
            lambda u, s, p=None, c=captured: (jax.tree_util.tree_map(lambda x: x * c, u), s),
        )
        assert entrywise(inner, grads, inner.init(params), params) is expect


def _fused_step(opt, interpret=True):
    from masked_jax.optim._fused import fused_update

    return jax.jit(lambda p, s, g: fused_update(opt, g, s, p, optim.apply_updates, interpret=interpret))


def _one_call_step(opt):
    def step(p, s, g):
        u, s = opt.update(g, s, p)
        return optim.apply_updates(p, u), s

    return jax.jit(step)


# entrywise optax optimizers beyond the table above, for the fused kernel's flat program
FUSED_EXTRA = {
    "adam_bf16_mu": lambda: optax.adam(0.05, mu_dtype=jnp.bfloat16),
    "yogi": lambda: optax.yogi(0.05),
    "nadam": lambda: optax.nadam(0.05),
    "amsgrad": lambda: optax.amsgrad(0.05),
    "adamax": lambda: optax.adamax(0.05),
    "adabelief": lambda: optax.adabelief(0.05),
    "adadelta": lambda: optax.adadelta(1.0),
    "masked_adagrad": lambda: optim.masked_adagrad(0.1),
}


@pytest.mark.parametrize("name", [*OPTIMIZERS, *FUSED_EXTRA])
def test_fused_table_updates_equal_the_one_call_update(name):
    """The fused GPU update (run here in Pallas' interpreter) sums each row's duplicates inside the
    kernel that updates the row; for every entrywise optimizer of the table its parameters and
    state equal the one-call lazy update's over three steps of two tables with duplicates and
    padding rows (index N), untouched rows bit-identical; the others are not fusable."""
    from masked_jax.optim._fused import fusable

    rng = np.random.default_rng(5)
    params = _two_table_params(rng)
    sparse = {"a": True, "b": True, "w": False, "s": False}
    grads = []
    for _ in range(3):
        a_ids = rng.integers(0, 30, size=(6, 5))
        a_ids[0, :2] = 40  # padding rows of the gradient
        grads.append(
            mj.grad(_two_table_loss, row_sparse=sparse)(
                params, jnp.asarray(a_ids), jnp.asarray(rng.integers(0, 9, size=(7,)))
            )
        )
    opt = {**OPTIMIZERS, **FUSED_EXTRA}[name]()
    opt = opt if name == "masked_adagrad" else optim.lazy(opt)  # a lazy lift already
    expect = ENTRYWISE.get(name, True)
    assert fusable(opt, grads[0], opt.init(params), params) is expect
    if not expect:
        return
    fused, one_call = _fused_step(opt), _one_call_step(opt)
    got, want = (params, opt.init(params)), (params, opt.init(params))
    for g in grads:
        got, want = fused(*got, g), one_call(*want, g)
    # a bfloat16 moment: the kernel computes its ops in float32 and rounds after each one
    _close(got, want, **({"rtol": 1e-2, "atol": 1e-3} if "bf16" in name else {"rtol": 1e-5, "atol": 1e-6}))
    np.testing.assert_array_equal(np.asarray(got[0]["a"][30:]), np.asarray(params["a"][30:]))
    assert got[1] is not None and jax.tree_util.tree_structure(got[1]) == jax.tree_util.tree_structure(want[1])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("row", [(2, 3), ()])
@pytest.mark.parametrize("unique", [False, True])
def test_fused_update_row_shapes_dtypes_and_unique_ids(dtype, row, unique):
    """Rows of any shape (2 x 3: six entries, padded to a power of two in the kernel; a vector's
    scalars), 16-bit tables (computed in float32 in the kernel, rounded after each op), gradients
    promised unique (no sort) or not, more stored rows than one kernel program holds: the fused
    update equals the one-call update, eagerly and under jit."""
    from masked_jax.optim._fused import fused_update

    rng = np.random.default_rng(6)
    n, k = 300, 150
    table = jnp.asarray(rng.normal(size=(n, *row)), dtype)
    ids = rng.choice(n - 20, size=k, replace=False) if unique else rng.integers(0, n - 20, size=k)
    ids[:3] = n  # padding
    g = mj.row_sparse(
        jnp.asarray(rng.normal(size=(k, *row)), dtype), jnp.asarray(ids), (n, *row), unique_indices=unique
    )
    opt = optim.lazy(optax.adam(0.05, mu_dtype=jnp.bfloat16) if dtype == "bfloat16" else optax.adam(0.05))
    want = _one_call_step(opt)(table, opt.init(table), g)
    for got in (
        fused_update(opt, g, opt.init(table), table, optim.apply_updates, interpret=True),
        _fused_step(opt)(table, opt.init(table), g),
    ):
        _close(got, want, **({} if dtype == "float32" else {"rtol": 2e-2, "atol": 2e-2}))
        assert got[0].dtype == table.dtype
        np.testing.assert_array_equal(np.asarray(got[0][n - 20 :], np.float32), np.asarray(table[n - 20 :], np.float32))


def test_fused_update_of_some_tables_equals_the_one_call_update(monkeypatch):
    """A table the kernel cannot address (here: more entries than a lowered limit allows) is
    updated by the one-call lazy update beside the fused ones, in the same step: together they
    equal the one-call update of both."""
    from masked_jax.optim import _fused

    monkeypatch.setattr(_fused, "MAX_ENTRIES", 100)  # "a" (160 entries) is left out, "b" (36) fused
    rng = np.random.default_rng(9)
    params = _two_table_params(rng)
    g = mj.grad(_two_table_loss, row_sparse={"a": True, "b": True, "w": False, "s": False})(
        params, jnp.asarray(rng.integers(0, 30, size=(6, 5))), jnp.asarray(rng.integers(0, 9, size=(7,)))
    )
    opt = optim.lazy(optax.adam(0.05))
    assert _fused.fused_tables(opt, g, opt.init(params), params) == [1]  # leaves a, b, s, w: "b" only
    got = _fused_step(opt)(params, opt.init(params), g)
    _close(got, _one_call_step(opt)(params, opt.init(params), g), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("unique", [False, True])
def test_fused_update_stores_nothing_past_the_table(monkeypatch, unique):
    """The kernel's masked lanes point past the table, where Pallas' interpreter drops a store that
    a GPU would make. Here the kernel is told the table ends two rows early, so those two rows
    stand for the memory past it: ids there are padding to the kernel, and neither they nor the
    masked lanes may write them. The other rows equal the one-call update with those ids as
    padding."""
    from masked_jax.optim import _fused

    guard = 2
    real = _fused._table_kernel
    monkeypatch.setattr(
        _fused,
        "_table_kernel",
        lambda in_kernel, n_hoisted, dtypes, n_refs, n, *rest: real(
            in_kernel, n_hoisted, dtypes, n_refs, n - guard, *rest
        ),
    )
    rng = np.random.default_rng(11)
    n, k, d = 40, 24, 3
    ids = rng.choice(n - guard, size=k, replace=False) if unique else rng.integers(n - 6, n, size=k)
    ids[:3] = n - 2, n - 1, n  # rows past the kernel's end (and more of them if not unique), padding
    data = jnp.asarray(rng.normal(size=(k, d)), jnp.float32)
    table = jnp.asarray(rng.normal(size=(n, d)), jnp.float32)
    opt = optim.lazy(optax.adam(0.05))
    g = mj.row_sparse(data, jnp.asarray(ids), (n, d), unique_indices=unique)
    # moments that a stray store of a masked lane (zero in, zero out) would change
    state = jax.tree_util.tree_map(
        lambda x: jnp.asarray(rng.uniform(0.1, 1.0, size=x.shape), x.dtype) if np.ndim(x) == 2 else x, opt.init(table)
    )
    cut = _fused.KernelConfig(block_elements=16, max_block_rows=4)  # several programs, masked lanes in each
    got = jax.jit(lambda p, s, g: _fused.fused_update(opt, g, s, p, optim.apply_updates, interpret=True, config=cut))(
        table, state, g
    )
    past = np.where(ids >= n - guard, n, ids)
    want = _one_call_step(opt)(table, state, mj.row_sparse(data, jnp.asarray(past), (n, d), unique_indices=unique))
    _close(got, want, rtol=1e-5, atol=1e-6)
    for new, old in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves((table, state))):
        if np.ndim(old) == 2:  # the table and adam's moments, past the kernel's end
            np.testing.assert_array_equal(np.asarray(new[n - guard :]), np.asarray(old[n - guard :]))


def _runs(pattern, rng, n, k):
    """``k`` ids (at most 12 distinct, plus padding ``n``) in runs of lengths set by ``pattern``."""
    if pattern == "even":  # runs of about 17
        return rng.permutation(np.sort(rng.integers(0, 12, size=k)))
    if pattern == "hot":  # one id of 150 positions: a run over many programs
        return rng.permutation(np.concatenate([np.full(150, 7), rng.integers(0, 12, size=k - 150)]))
    lengths = [8, 16, 4, 1, 3, 32, 64]  # "aligned": runs that end where programs of 1, 2, 4 or 8 end
    ids = np.concatenate([np.full(m, i) for i, m in enumerate(lengths)])
    return np.concatenate([ids, np.full(k - ids.size, n)])  # padding after the last run


@pytest.mark.parametrize("rows_per_program", [1, 2, 4, 8, 128])
@pytest.mark.parametrize("pattern", ["even", "hot", "aligned"])
def test_fused_update_runs_of_duplicates_across_kernel_programs(rows_per_program, pattern):
    """However the kernel is cut (programs of 1 to 128 sorted positions), a run of one id is summed
    once: the program it starts in reads it up to the end of its block, and adds the rest, which
    the carry kernel sums in the later programs and a scan over blocks chains. Runs of 150 over
    many programs, runs that end where a program ends, padding (NaN in its slots); a valid inf in
    one run reaches that row only."""
    from masked_jax.optim._fused import KernelConfig, fused_update

    rng = np.random.default_rng(8)
    n, k, d = 50, 200, 4
    ids = _runs(pattern, rng, n, k)
    ids[np.flatnonzero(ids != n)[:1]] = n  # padding among the ids as well
    data = rng.normal(size=(k, d))
    data[np.flatnonzero(ids == 3)[-1:], 1] = np.inf  # a valid inf, in the last position of id 3's run
    data[ids == n] = np.nan  # padding slots hold anything: never read
    g = mj.row_sparse(jnp.asarray(data, jnp.float32), jnp.asarray(ids), (n, d))
    table = jnp.asarray(rng.normal(size=(n, d)), jnp.float32)
    opt = optim.lazy(optax.sgd(0.1, momentum=0.9))
    cut = KernelConfig(block_elements=rows_per_program * 4, max_block_rows=rows_per_program)
    got = jax.jit(lambda p, s, g: fused_update(opt, g, s, p, optim.apply_updates, interpret=True, config=cut))(
        table, opt.init(table), g
    )
    want = _one_call_step(opt)(table, opt.init(table), g)
    _close(got, want, rtol=1e-5, atol=1e-5)
    assert np.isinf(np.asarray(got[0])).sum() == 1 and not np.isnan(np.asarray(got[0])).any()


@given(
    n=st.integers(3, 60),
    k=st.integers(1, 120),
    rows_per_program=st.sampled_from([1, 2, 4, 8, 64]),
    hot=st.floats(0.0, 0.9),
    padding=st.floats(0.0, 0.5),
    seed=st.integers(0, 2**16),
)
def test_fused_update_equals_the_one_call_update_on_any_runs(n, k, rows_per_program, hot, padding, seed):
    """Property: for any table size, number of stored rows, kernel cut, share of one hot id (runs
    over many programs) and share of padding, the fused update equals the one-call update, and
    rows not touched are bit-identical."""
    from masked_jax.optim._fused import KernelConfig, fused_update

    rng = np.random.default_rng(seed)
    ids = rng.integers(0, n, size=k)
    ids[rng.random(k) < hot] = rng.integers(0, n)
    ids[rng.random(k) < padding] = n
    g = mj.row_sparse(jnp.asarray(rng.normal(size=(k, 3)), jnp.float32), jnp.asarray(ids), (n, 3))
    table = jnp.asarray(rng.normal(size=(n, 3)), jnp.float32)
    opt = optim.lazy(optax.adam(0.1))
    cut = KernelConfig(block_elements=rows_per_program * 4, max_block_rows=rows_per_program)
    got = fused_update(opt, g, opt.init(table), table, optim.apply_updates, interpret=True, config=cut)
    _close(got, _one_call_step(opt)(table, opt.init(table), g), rtol=1e-5, atol=1e-6)
    untouched = np.setdiff1d(np.arange(n), ids)
    np.testing.assert_array_equal(np.asarray(got[0])[untouched], np.asarray(table)[untouched])


def test_train_step_fused_rows_picks_the_kernel_on_cuda_only():
    """``make_train_step(fused_rows=True)`` puts the kernel in the step's CUDA branch, for fusable
    optimizers only; the CPU runs the step it would run without it (equal results; on a GPU, equal
    up to rounding); a non-bool ``fused_rows`` is refused."""
    params = {
        "a": jnp.asarray(np.random.default_rng(7).normal(size=(40, 4)), jnp.float32),
        "b": jnp.ones((9, 4)),
        "w": jnp.ones((4,)),
        "s": jnp.asarray(0.3),
    }
    sparse = {"a": True, "b": True, "w": False, "s": False}
    batch = (jnp.asarray([[1, 2, 2, 5, 7]]), jnp.asarray([0, 0, 3]))
    for inner, fusable in ((optax.adam(0.05), True), (OPTIMIZERS["clip_adam"](), False)):
        opt = optim.lazy(inner)
        steps = {f: optim.make_train_step(_two_table_loss, opt, row_sparse=sparse, fused_rows=f) for f in (False, True)}
        jaxprs = {f: str(jax.make_jaxpr(s)(params, opt.init(params), *batch)) for f, s in steps.items()}
        assert ("pallas_call" in jaxprs[True]) is fusable and "pallas_call" not in jaxprs[False]
        out = {f: s(jax.tree_util.tree_map(jnp.array, params), opt.init(params), *batch) for f, s in steps.items()}
        # the CPU runs the same step; a CUDA GPU runs the kernel, which sums duplicates in another order
        exact = jax.default_backend() == "cpu"
        _close(out[True], out[False], **({"rtol": 0, "atol": 0} if exact else {"rtol": 1e-5, "atol": 1e-6}))
    catch_up = optim.lazy(optax.adam(0.05), catch_up=True)
    step = optim.make_train_step(_two_table_loss, catch_up, row_sparse=sparse, fused_rows=True)
    assert "pallas_call" not in str(jax.make_jaxpr(step)(params, catch_up.init(params), *batch))
    # a table of 2**31 entries (traced from its shape only): the kernel's 32-bit offsets cannot address it
    huge = {"a": jax.ShapeDtypeStruct((2**29, 4), jnp.float32), "b": params["b"], "w": params["w"], "s": params["s"]}
    opt = optim.lazy(optax.adam(0.05))
    step = optim.make_train_step(_two_table_loss, opt, row_sparse=sparse, fused_rows=True)
    assert (
        str(jax.make_jaxpr(step)(huge, jax.eval_shape(opt.init, huge), *batch)).count("pallas_call") == 2
    )  # "b" only (its carries, its update)
    with pytest.raises(ValueError, match="fused_rows must be a bool"):
        optim.make_train_step(_two_table_loss, opt, fused_rows=1)


# the library's own row-sparse optimizers, for properties beyond the optax table above
ROW_OPTIMIZERS = {
    "lazy_adam": lambda: optim.lazy(optax.adam(0.1)),
    "lazy_adamw_catch_up": lambda: optim.lazy(optax.adamw(0.1, weight_decay=0.1), catch_up=True),
    "lazy_multi_steps": lambda: optim.lazy(optax.MultiSteps(optax.adam(0.1), 2), capacity=8),
    "masked_adagrad": lambda: optim.masked_adagrad(0.1),
    "rowwise_adagrad": lambda: optim.rowwise_adagrad(0.1),
}


@pytest.mark.parametrize("shape", [(0, 3), (4, 0)], ids=["no_rows", "empty_rows"])
@pytest.mark.parametrize("chunk_rows", [8192, 1, None])
@pytest.mark.parametrize("name", ROW_OPTIMIZERS)
def test_empty_tables_train_beside_others(name, chunk_rows, shape):
    """A table with no rows, or with rows of no entries, goes through every optimizer's row-sparse
    step (one call, in chunks, and the fused kernel in Pallas' interpreter) unchanged, and the
    table beside it trains as it would alone."""

    make = ROW_OPTIMIZERS[name]
    ids = jnp.array([[0, 1], [2, -1]])

    def loss(p, ids):
        return mj.embedding_bag(p["empty"], ids, combiner="mean").filled(0.0).sum() + jnp.sum(
            mj.lookup(p["t"], ids) ** 2
        )

    def alone(p, ids):
        return jnp.sum(mj.lookup(p["t"], ids) ** 2)

    def run(loss, params):
        opt = make()
        step = optim.make_train_step(loss, opt, row_sparse=True, chunk_rows=chunk_rows)
        state = opt.init(params)
        for _ in range(3):
            params, state, _ = step(params, state, ids)
        return params

    got = run(loss, {"empty": jnp.zeros(shape), "t": jnp.linspace(-1.0, 1.0, 12).reshape(4, 3)})
    want = run(alone, {"t": jnp.linspace(-1.0, 1.0, 12).reshape(4, 3)})
    assert got["empty"].shape == shape
    np.testing.assert_array_equal(got["t"], want["t"])
    if name == "lazy_adam":  # the fused kernel leaves the empty table to the one-call update
        opt = make()
        params = {"empty": jnp.zeros(shape), "t": jnp.ones((4, 3))}
        g = mj.grad(loss, row_sparse=True)(params, ids)
        fused, _ = _fused_step(opt)(params, opt.init(params), g)
        one_call, _ = _one_call_step(opt)(params, opt.init(params), g)
        assert fused["empty"].shape == shape
        _close(fused["t"], one_call["t"])  # up to rounding: the kernel sums in its own order


@pytest.mark.parametrize("name", ROW_OPTIMIZERS)
def test_training_continues_from_a_checkpoint_of_numpy_arrays(name):
    """flax.serialization (as other checkpoint readers) restores state and parameters as numpy
    arrays; an eager update and apply_updates take them and continue exactly as the run that was
    never saved."""
    import flax.serialization

    opt = ROW_OPTIMIZERS[name]()
    grads = _row_grads(steps=4)
    params, state = _run(opt, grads[:2], jit=False)
    restored_params = flax.serialization.from_bytes(params, flax.serialization.to_bytes(params))
    restored_state = flax.serialization.from_bytes(state, flax.serialization.to_bytes(state))
    assert isinstance(jax.tree_util.tree_leaves(restored_state)[-1], np.ndarray)
    want = _run_from(opt, grads[2:], params, state)
    got = _run_from(opt, grads[2:], restored_params, restored_state)
    _close(got, want, rtol=0, atol=0)


def _run_from(opt, grads, params, state):
    for g in grads:
        u, state = opt.update(g, state, params)
        params = optim.apply_updates(params, u)
    return params, state


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bfloat16", "float16"])
def test_rowwise_sums_of_half_precision_tables_keep_growing(dtype):
    """Row-wise Adagrad keeps its sums in float32 for a bfloat16 or float16 table, as FBGEMM keeps
    its row-wise state: 600 unit mean squares sum to 600 (a bfloat16 sum stops at 256, where 256 + 1
    rounds back to 256, and the step size would stop shrinking). The same in chunks of rows."""
    table = jnp.zeros((4, 2), dtype)
    opt = optim.rowwise_adagrad(0.5)
    g = mj.row_sparse(jnp.ones((1, 2), dtype), jnp.array([1]), (4, 2))

    def body(carry, _):
        params, state = carry
        u, state = opt.update(g, state, params)
        return (optim.apply_updates(params, u), state), None

    (params, state), _ = jax.lax.scan(body, (table, opt.init(table)), None, length=600)
    sums = state[0].sum_of_squares
    assert sums.dtype == jnp.float32 and float(sums[1]) == 600.0 and float(sums[0]) == 0.0
    u, _ = opt.update(g, state, params)
    np.testing.assert_allclose(np.asarray(u.data, np.float32), -0.5 / np.sqrt(601.0), rtol=1e-2)
    step = optim.make_train_step(
        lambda t, i: jnp.sum(mj.lookup(t, i).astype(jnp.float32)), opt, row_sparse=True, chunk_rows=1
    )
    params, state = table, opt.init(table)
    for _ in range(300):
        params, state, _ = step(params, state, jnp.array([1, 2]))
    assert state[0].sum_of_squares.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(state[0].sum_of_squares), [0.0, 300.0, 300.0, 0.0])


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bfloat16", "float16"])
def test_catch_up_reads_half_precision_optimizers_in_float32(dtype):
    """Catch-up reads an optimizer's closed forms off a probe in float32 at least: in float16 the
    decayed weight (1 - lr * wd) * p rounds differently at p = 1 and p = 2, which looked non-linear
    and refused adamw. The coefficients equal those of the float32 table."""
    from masked_jax.optim._catch_up import probe

    for inner in (optax.adamw(0.1, weight_decay=0.1), optax.sgd(0.1, momentum=0.9)):
        half, full = (probe(inner, {"t": jnp.zeros((3, 2), d)}) for d in (dtype, jnp.float32))
        assert half == full
        opt = optim.lazy(inner, catch_up=True)
        table = jnp.ones((3, 2), dtype)
        u, _ = opt.update(mj.row_sparse(jnp.ones((1, 2), dtype), jnp.array([1]), (3, 2)), opt.init(table), table)
        assert u.dtype == dtype


def test_train_step_coalesces_a_half_precision_gradient_as_often_as_a_float32_one():
    """apply_updates coalesces float16/bfloat16 row-sparse updates (their duplicates add up in
    float32), but a lazy optimizer's updates hold each row once already: the training step's
    one-call update coalesces a bfloat16 gradient as often as a float32 one, and equals the
    result of update and apply_updates."""
    from unittest import mock

    ids = jnp.array([1, 1, 2, 7, 1])
    original = mj.RowSparseArray.sum_duplicates
    calls = []

    def counting(self, *args, **kwargs):
        calls.append(self.dtype)
        return original(self, *args, **kwargs)

    def loss(t, i):
        return jnp.sum(mj.lookup(t, i).astype(jnp.float32) ** 2)

    for opt in (optim.lazy(optax.adam(0.1)), optim.rowwise_adagrad(0.1)):
        counts = {}
        for dtype in (jnp.float32, jnp.bfloat16):
            table = jnp.linspace(-1.0, 1.0, 40, dtype=dtype).reshape(10, 4)
            step = optim.make_train_step(loss, opt, row_sparse=True, chunk_rows=None, donate=False)
            calls.clear()
            with mock.patch.object(mj.RowSparseArray, "sum_duplicates", counting):
                got, _, _ = step(table, opt.init(table), ids)
            counts[dtype] = len(calls)
            u, _ = opt.update(mj.grad(loss, row_sparse=True)(table, ids), opt.init(table), table)
            np.testing.assert_array_equal(np.asarray(got), np.asarray(optim.apply_updates(table, u)))
        assert counts[jnp.bfloat16] == counts[jnp.float32] > 0


def test_a_plain_optax_optimizer_on_row_sparse_gradients_is_told_to_use_lazy():
    """optax updates every leaf it is handed, a row-sparse gradient's indices too: adam fails on
    the gradient's structure, sgd turns the indices into floats. Both name optim.lazy."""
    table = jnp.ones((5, 2))
    for opt, where in ((optax.adam(0.1), "make_train_step"), (optax.sgd(0.1), "apply_updates")):
        step = optim.make_train_step(lambda t, i: jnp.sum(mj.lookup(t, i)), opt, row_sparse=True)
        with pytest.raises(TypeError, match=rf"{where}: .*optim\.lazy"):
            step(table, opt.init(table), jnp.array([1, 3]))
    g = mj.row_sparse(jnp.ones((2, 2)), jnp.array([1, 3]), (5, 2))
    u, _ = optax.sgd(0.1).update(g, optax.sgd(0.1).init(g))
    with pytest.raises(TypeError, match=r"float\d+ indices"):
        optim.apply_updates(table, u)


CUDA_STEP_OPTIMIZERS = {
    "lazy adam": lambda: optim.lazy(optax.adam(0.1)),
    "lazy adam, catch-up": lambda: optim.lazy(optax.adam(0.1), catch_up=True),
    "lazy sgd, momentum": lambda: optim.lazy(optax.sgd(0.1, momentum=0.9)),
    "rowwise_adagrad": lambda: optim.rowwise_adagrad(0.1),
    "masked_adagrad": lambda: optim.masked_adagrad(0.1),
}


def _scatters(stablehlo: str):
    """``(unique_indices, combiner ops)`` of every scatter in a StableHLO module's text."""
    found = re.findall(r'"stablehlo.scatter"\(.*?\) <\{(.*?)\}> \(\{\n(.*?)\}\)', stablehlo, flags=re.S)
    return [
        ("unique_indices = true" in attrs, [op for op in re.findall(r"stablehlo\.(\w+) %", body) if op != "return"])
        for attrs, body in found
    ]


@pytest.mark.parametrize("fused", [False, True], ids=["one_call", "fused_rows"])
@pytest.mark.parametrize("name", list(CUDA_STEP_OPTIMIZERS))
def test_the_cuda_lowered_row_sparse_step_has_no_scatter_add_that_may_repeat_indices(name, fused):
    """On CUDA, a float scatter-add whose indices may repeat compiles to atomics (a compare-and-swap
    loop in jaxlib 0.10.2 to 0.11.0, hundreds of times slower). The training step lowered for CUDA
    (no GPU needed) holds no such scatter: duplicate rows are summed by a sorted segmented scan and
    written once per row, and every scatter into the tables and their state is told its indices
    are unique; with ``fused_rows`` (where the optimizer is fusable) the Triton kernel's runs are
    added up the same way. Lowered for the CPU, the one-call step keeps ``segment_sum`` (faster
    there)."""
    opt = CUDA_STEP_OPTIMIZERS[name]()

    def loss(p, users, items, ratings):
        pred = jnp.sum(mj.lookup(p["user"], users) * mj.lookup(p["item"], items), axis=-1) + p["bias"]
        return jnp.mean((pred - ratings) ** 2)

    step = optim.make_train_step(loss, opt, row_sparse={"user": True, "item": True, "bias": False}, fused_rows=fused)
    params = {"user": jnp.zeros((1000, 8)), "item": jnp.zeros((1000, 8)), "bias": jnp.zeros(())}
    ids = jnp.array([1, 1, 5, 7, 1])
    traced = jax.jit(step).trace(params, opt.init(params), ids, ids[::-1], jnp.ones(5))
    text = traced.lower(lowering_platforms=("cuda",)).as_text()
    cuda = _scatters(text)
    assert cuda, "the step scatters its rows"
    assert all(unique for unique, ops in cuda if "add" in ops), cuda
    assert all(unique for unique, _ in cuda), cuda  # sets too: one write per row
    if fused:
        assert ("triton" in text) is (name in ("lazy adam", "lazy sgd, momentum", "masked_adagrad"))
        return
    cpu = _scatters(traced.lower(lowering_platforms=("cpu",)).as_text())
    assert any("add" in ops and not unique for unique, ops in cpu)  # segment_sum of the duplicates
