"""Sharded arrays on 8 CPU devices: masked ops keep their shardings and match one device; the
row-sharded optimizer step (optim.sharded_update) matches the single-device step and stays local."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import masked_jax as mj
import masked_jax.nn as mnn
import masked_jax.numpy as mnp
from masked_jax import optim
from masked_jax._core import SparseMasked

D = 8


@pytest.fixture(scope="module")
def mesh():
    assert jax.device_count() == D, "run with XLA_FLAGS=--xla_force_host_platform_device_count=8"
    return Mesh(np.array(jax.devices()), ("rows",))


def _put(tree, mesh, spec):
    return jax.device_put(tree, NamedSharding(mesh, spec))


def _masked(rng, shape, dtype=jnp.float32):
    mask = rng.random(shape) < 0.6
    mask[:, 3] = False  # a fully masked column: its reductions along axis 0 stay masked
    data = np.where(mask, rng.normal(size=shape), np.nan)  # NaN under the mask must never leak
    return mj.masked_array(jnp.asarray(data, dtype), jnp.asarray(mask))


def _same(a, b, rtol=1e-6):
    a, b = a.todense() if isinstance(a, SparseMasked) else a, b
    np.testing.assert_array_equal(np.asarray(a.mask), np.asarray(b.mask))
    np.testing.assert_allclose(np.asarray(a.filled(0)), np.asarray(b.filled(0)), rtol=rtol, atol=1e-6)


# -- masked arrays keep their shardings, and match one device ---------------------------------

ELEMENTWISE = {
    "exp": mnp.exp,
    "log1p": lambda x: mnp.log1p(mnp.abs(x)),
    "mul": lambda x: x * 2.0 + x,
    "where": lambda x: mnp.where(x > 0, x, -x),
}


@pytest.mark.parametrize("name", list(ELEMENTWISE))
def test_elementwise_ops_keep_the_row_sharding_of_data_and_mask(mesh, name):
    x = _masked(np.random.default_rng(0), (64, 8))
    xs = _put(x, mesh, P("rows"))
    assert xs.data.sharding.spec == xs.mask.sharding.spec == P("rows")
    out = jax.jit(ELEMENTWISE[name])(xs)
    assert out.data.sharding.spec == P("rows") and out.mask.sharding.spec == P("rows")
    _same(out, ELEMENTWISE[name](x))


ALONG = {
    "sum": lambda x, a: mnp.sum(x, axis=a),
    "mean": lambda x, a: mnp.mean(x, axis=a),
    "var": lambda x, a: mnp.var(x, axis=a),
    "std": lambda x, a: mnp.std(x, axis=a, ddof=1),
    "max": lambda x, a: mnp.max(x, axis=a),
    "argmin": lambda x, a: mnp.argmin(x, axis=a),
    "logsumexp": lambda x, a: mnp.logsumexp(x, axis=a),
    "norm": lambda x, a: mnp.linalg.norm(x, axis=a),
    "softmax": lambda x, a: mnn.softmax(x, axis=a),
    "log_softmax": lambda x, a: mnn.log_softmax(x, axis=a),
    "normalize": lambda x, a: mnn.normalize(x, axis=a),
}


@pytest.mark.parametrize("axis", [0, 1])
@pytest.mark.parametrize("name", list(ALONG))
def test_reductions_and_softmax_over_a_sharded_axis_match_one_device(mesh, name, axis):
    x = _masked(np.random.default_rng(1), (64, 8))
    fn = jax.jit(lambda x: ALONG[name](x, axis))
    _same(fn(_put(x, mesh, P("rows"))), fn(x), rtol=2e-6)


def test_row_sparse_and_bcoo_arrays_keep_their_shardings(mesh):
    rng = np.random.default_rng(2)
    g = mj.row_sparse(
        jnp.asarray(rng.normal(size=(16, 4)), jnp.float32),
        jnp.asarray(rng.permutation(40)[:16]),
        (40, 4),
        unique_indices=True,
    )
    gs = _put(g, mesh, P("rows"))  # the K stored rows spread over the devices
    out = jax.jit(lambda g: mnp.exp(g) * 2.0)(gs)
    assert isinstance(out, mj.RowSparseArray) and out.data.sharding.spec == P("rows")
    _same(out.todense(), (mnp.exp(g) * 2.0).todense())
    b = mj.masked_array(jnp.asarray(rng.normal(size=(8, 6)), jnp.float32), jnp.asarray(rng.random((8, 6)) < 0.5))
    bc = b.tostype("bcoo")
    bcs = _put(bc, mesh, P())  # replicated entries
    out = jax.jit(lambda x: mnp.sum(mnp.cos(x), axis=1))(bcs)
    _same(out.todense() if isinstance(out, SparseMasked) else out, mnp.sum(mnp.cos(b), axis=1))


# -- the row-sharded optimizer step --------------------------------------------------------------

OPTIMIZERS = {
    "sgd": lambda: optim.lazy(optax.sgd(0.1)),
    "momentum": lambda: optim.lazy(optax.sgd(0.1, momentum=0.9)),
    "nesterov": lambda: optim.lazy(optax.sgd(0.1, momentum=0.9, nesterov=True)),
    "adam": lambda: optim.lazy(optax.adam(0.05)),
    "adamw": lambda: optim.lazy(optax.adamw(0.05, weight_decay=0.1)),
    "adagrad": lambda: optim.lazy(optax.adagrad(0.1)),
    "rmsprop": lambda: optim.lazy(optax.rmsprop(0.05)),
    "lion": lambda: optim.lazy(optax.lion(0.01)),
    "schedule_adam": lambda: optim.lazy(optax.adam(optax.exponential_decay(0.05, 2, 0.5))),
    "decay_sgd": lambda: optim.lazy(optax.chain(optax.add_decayed_weights(0.1), optax.sgd(0.1, momentum=0.5))),
    "masked_adagrad": lambda: optim.masked_adagrad(0.1),
    "rowwise_adagrad": lambda: optim.rowwise_adagrad(0.1, initial_accumulator_value=0.1),  # one sum per row
}
N, DIM, K = 4096, 8, 96


def _problem(seed=0, skew=False):
    rng = np.random.default_rng(seed)
    params = {
        "emb": jnp.asarray(rng.normal(size=(N, DIM)), jnp.float32),
        "w": jnp.asarray(rng.normal(size=(DIM,)), jnp.float32),
    }
    grads = []
    for _ in range(3):
        hi = N // D if skew else N - 64  # skew: every id on device 0; the last 64 rows never touched
        ids = rng.integers(0, hi, size=K)
        ids[:4] = ids[4:8]  # duplicates
        grads.append(
            {
                "emb": mj.row_sparse(jnp.asarray(rng.normal(size=(K, DIM)), jnp.float32), jnp.asarray(ids), (N, DIM)),
                "w": jnp.asarray(rng.normal(size=(DIM,)), jnp.float32),
            }
        )
    return params, grads


def _single(opt, params, grads):
    state = opt.init(params)
    step = jax.jit(lambda p, s, g: _apply(opt, p, s, g))
    for g in grads:
        params, state = step(params, state, g)
    return params, state


def _apply(opt, params, state, g):
    updates, state = opt.update(g, state, params)
    return optim.apply_updates(params, updates), state


def _sharded(opt, mesh, params, grads, capacity=None):
    params = {"emb": _put(params["emb"], mesh, P("rows")), "w": _put(params["w"], mesh, P())}
    state = optim.init_sharded(opt, params)
    step = jax.jit(
        lambda p, s, g: optim.sharded_update(opt, g, s, p, mesh=mesh, axis="rows", capacity=capacity),
        donate_argnums=(0, 1),
    )
    for g in grads:
        params, state = step(params, state, g)
    return params, state


@pytest.mark.parametrize("capacity", [None, 4, K], ids=["default", "overflow", "all_rows"])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_sharded_step_matches_the_single_device_step(mesh, name, capacity):
    params, grads = _problem()
    opt = OPTIMIZERS[name]()
    ref_p, ref_s = _single(opt, params, grads)
    got_p, got_s = _sharded(opt, mesh, params, grads, capacity)
    assert got_p["emb"].sharding.spec == P("rows")
    for a, b in zip(jax.tree_util.tree_leaves((got_p, got_s)), jax.tree_util.tree_leaves((ref_p, ref_s))):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-6, atol=1e-7)
    # rows never touched are bit-identical to their initial values, in params and state
    np.testing.assert_array_equal(np.asarray(got_p["emb"])[-64:], np.asarray(params["emb"])[-64:])


def test_ids_concentrated_on_one_device_take_the_exact_path(mesh):
    params, grads = _problem(seed=3, skew=True)  # K ids on device 0: more than its capacity 2K/D
    opt = OPTIMIZERS["adam"]()
    ref_p, _ = _single(opt, params, grads)
    got_p, _ = _sharded(opt, mesh, params, grads)
    np.testing.assert_allclose(np.asarray(got_p["emb"]), np.asarray(ref_p["emb"]), rtol=2e-6, atol=1e-7)
    np.testing.assert_array_equal(np.asarray(got_p["emb"])[N // D :], np.asarray(params["emb"])[N // D :])


def test_sharded_state_is_placed_like_the_parameters(mesh):
    params, _ = _problem()
    params = {"emb": _put(params["emb"], mesh, P("rows")), "w": params["w"]}
    state = optim.init_sharded(optim.lazy(optax.adam(0.1)), params)
    adam = state[0]
    assert adam.mu["emb"].sharding.spec == adam.nu["emb"].sharding.spec == P("rows")
    assert adam.mu["w"].sharding.spec == adam.count.sharding.spec == P()
    # one device holds 1/D of each table-shaped leaf
    assert {s.data.shape for s in adam.mu["emb"].addressable_shards} == {(N // D, DIM)}
    # row-wise Adagrad's one sum per row: sharded by rows like its table
    sums = optim.init_sharded(optim.rowwise_adagrad(0.1), params)[0].sum_of_squares
    assert sums["emb"].sharding.spec == P("rows") and sums["w"].sharding.spec == P()
    assert {s.data.shape for s in sums["emb"].addressable_shards} == {(N // D,)}
    # unsharded parameters: the plain init
    plain = optim.init_sharded(optim.lazy(optax.adam(0.1)), {"emb": jnp.zeros((4, 2))})
    assert not isinstance(plain[0].mu["emb"].sharding, NamedSharding)


def test_optimizers_that_combine_rows_are_rejected(mesh):
    params, grads = _problem()
    for inner in (optax.chain(optax.clip_by_global_norm(1.0), optax.adam(0.1)), optax.lamb(0.1)):
        opt = optim.lazy(inner)
        with pytest.raises(ValueError, match="depends on other rows"):
            optim.sharded_update(opt, grads[0], opt.init(params), params, mesh=mesh, axis="rows")
    # clipping each entry acts entry by entry: accepted
    opt = optim.lazy(optax.chain(optax.clip(0.5), optax.adam(0.1)))
    ref_p, _ = _single(opt, params, grads)
    got_p, _ = _sharded(opt, mesh, params, grads)
    np.testing.assert_allclose(np.asarray(got_p["emb"]), np.asarray(ref_p["emb"]), rtol=2e-6, atol=1e-7)


def test_bad_arguments_are_named(mesh):
    opt = OPTIMIZERS["sgd"]()
    g = {"emb": mj.row_sparse(jnp.ones((2, 2)), jnp.array([0, 1]), (12, 2))}
    p = {"emb": jnp.zeros((12, 2))}
    with pytest.raises(ValueError, match="cannot be split evenly over the 8 devices"):
        optim.sharded_update(opt, g, opt.init(p), p, mesh=mesh, axis="rows")
    with pytest.raises(ValueError, match="not an axis of the mesh"):
        optim.sharded_update(opt, g, opt.init(p), p, mesh=mesh, axis="cols")
    with pytest.raises(TypeError, match="jax.sharding.Mesh"):
        optim.sharded_update(opt, g, opt.init(p), p, mesh="rows", axis="rows")
    with pytest.raises(ValueError, match="needs a plain array parameter of the same shape"):
        optim.sharded_update(opt, g, opt.init(p), {"emb": jnp.zeros((16, 2))}, mesh=mesh, axis="rows")
    with pytest.raises(ValueError, match="give both mesh and axis"):
        optim.make_train_step(lambda p: 0.0, opt, mesh=mesh)


# -- the training step on a sharded table ----------------------------------------------------------


def _loss(params, users, items, ratings):
    pred = jnp.sum(mj.lookup(params["user"], users) * mj.lookup(params["item"], items), axis=-1) + params["bias"]
    return jnp.mean((pred - ratings) ** 2)


def _embedding(n, dim, batch, seed=0):
    k = jax.random.split(jax.random.key(seed), 5)
    params = {
        "user": 0.1 * jax.random.normal(k[0], (n, dim), jnp.float32),
        "item": 0.1 * jax.random.normal(k[1], (n, dim), jnp.float32),
        "bias": jnp.zeros((), jnp.float32),
    }
    users = jax.random.randint(k[2], (batch,), 0, n)
    items = jax.random.randint(k[3], (batch,), 0, n)
    return params, users, items, jax.random.normal(k[4], (batch,), jnp.float32)


TABLES = {"user": True, "item": True, "bias": False}


def _place(params, mesh):
    return {
        "user": _put(params["user"], mesh, P("rows")),
        "item": _put(params["item"], mesh, P("rows")),
        "bias": _put(params["bias"], mesh, P()),
    }


def test_sharded_train_step_matches_one_device(mesh):
    params, users, items, r = _embedding(2048, 8, 64)
    opt = optim.lazy(optax.adam(0.05))
    step = optim.make_train_step(_loss, opt, row_sparse=TABLES)
    sharded_step = optim.make_train_step(_loss, opt, row_sparse=TABLES, mesh=mesh, axis="rows")
    p1, s1 = params, opt.init(params)
    p8 = _place(_embedding(2048, 8, 64)[0], mesh)  # fresh buffers: the steps donate theirs
    s8 = optim.init_sharded(opt, p8)
    for _i in range(4):
        p1, s1, l1 = step(p1, s1, users, items, r)
        p8, s8, l8 = sharded_step(p8, s8, users, items, r)
        np.testing.assert_allclose(float(l8), float(l1), rtol=1e-6)
    assert p8["user"].sharding.spec == s8[0].mu["item"].sharding.spec == P("rows")
    for a, b in zip(jax.tree_util.tree_leaves((p8, s8)), jax.tree_util.tree_leaves((p1, s1))):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-6, atol=1e-7)


def test_sharded_step_hlo_is_local_and_in_place(mesh):
    n, dim = 8192, 16
    params, users, items, r = _embedding(n, dim, 128)
    opt = optim.lazy(optax.adam(0.05))
    step = optim.make_train_step(_loss, opt, row_sparse=TABLES, mesh=mesh, axis="rows")
    p8 = _place(params, mesh)
    hlo = step.lower(p8, optim.init_sharded(opt, p8), users, items, r).compile().as_text()
    header = hlo.splitlines()[0]
    # per device: a shard of n / D rows; parameters and state shards are donated and aliased
    shard = f"f32[{n // D},{dim}]"
    inputs = re.search(r"entry_computation_layout=\{\((.*?)\)->", header).group(1)
    shards = [i for i, s in enumerate(re.findall(r"\w+\[[\d,]*\]", inputs)) if s == shard]
    aliased = {int(i) for i in re.findall(r"\{\d*\}: \((\d+), \{\}, (?:may|must)-alias\)", header)}
    assert len(shards) == 6 and set(shards) <= aliased  # two tables and their adam mu and nu
    # no table is gathered (no all-gather at all), and no shard or table is copied or broadcast
    assert "all-gather" not in hlo and "all-to-all" not in hlo
    big = [
        line
        for line in hlo.splitlines()
        if (shard in line or f"f32[{n},{dim}]" in line) and re.search(r"\b(copy|broadcast)\(", line)
    ]
    assert big == []
    # the lookups are local gathers summed over devices: K x dim values (K = 128 ids), never a table
    reduces = [line.split("all-reduce(")[0] for line in hlo.splitlines() if "all-reduce(" in line]
    assert reduces and all(set(re.findall(r"\w+\[[\d,]*\]", lhs)) == {"f32[128,16]"} for lhs in reduces)


def test_stacked_tables_shard_by_rows_as_one_table(mesh):
    """Two tables stacked into one: the sharded step equals the one-device step, and its HLO
    gathers no table (no all-gather): the stack shards by rows as a single table does."""
    n, dim = 2048, 8
    params, users, items, r = _embedding(n, dim, 64, seed=3)
    stack, table = mj.stack_tables({"user": params["user"], "item": params["item"]})

    def loss(p, users, items, ratings):
        rows = stack.lookup(p["table"], {"user": users, "item": items})
        pred = jnp.sum(rows["user"] * rows["item"], axis=-1) + p["bias"]
        return jnp.mean((pred - ratings) ** 2)

    sparse = {"table": True, "bias": False}
    opt = optim.lazy(optax.adam(0.05))
    step = optim.make_train_step(loss, opt, row_sparse=sparse)
    sharded_step = optim.make_train_step(loss, opt, row_sparse=sparse, mesh=mesh, axis="rows")
    p1 = {"table": table, "bias": params["bias"]}
    s1 = opt.init(p1)
    p8 = {"table": _put(jnp.array(table), mesh, P("rows")), "bias": _put(jnp.array(params["bias"]), mesh, P())}
    s8 = optim.init_sharded(opt, p8)
    hlo = sharded_step.lower(p8, s8, users, items, r).compile().as_text()
    assert "all-gather" not in hlo and "all-to-all" not in hlo
    for _ in range(3):
        p1, s1, l1 = step(p1, s1, users, items, r)
        p8, s8, l8 = sharded_step(p8, s8, users, items, r)
        np.testing.assert_allclose(float(l8), float(l1), rtol=1e-6)
    assert p8["table"].sharding.spec == P("rows")
    np.testing.assert_allclose(np.asarray(p8["table"]), np.asarray(p1["table"]), rtol=2e-6, atol=1e-7)
