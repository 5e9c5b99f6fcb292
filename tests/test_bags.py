"""embedding_bag against a NumPy reference: every combiner, padded and ragged bags, weights,
empty bags and padding (negative, past the table, masked), eagerly and under jit, values and
row-sparse gradients."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import masked_jax as mj
from masked_jax import optim

N, D = 9, 3
TABLE = jnp.cos(jnp.arange(N * D, dtype=jnp.float32) * 0.7).reshape(N, D)
# padded bags: 4 bags of up to 5 ids; bag 2 holds only padding (empty); -1 and 9 are padding
IDS = np.array([[1, 4, 4, -1, 8], [0, 9, 3, 3, 3], [-1, -1, 9, -5, -1], [7, 2, 6, 5, 1]])
MASK = np.array([[1, 1, 1, 1, 0], [1, 1, 1, 0, 1], [1, 1, 1, 1, 1], [1, 1, 1, 1, 1]], bool)
WEIGHTS = np.linspace(0.5, 2.0, IDS.size, dtype=np.float32).reshape(IDS.shape)


def _reference(table, bags, weights, combiner):
    """Per bag, in NumPy float64: (rows combined or None for an empty bag)."""
    table = np.asarray(table, np.float64)
    out = []
    for ids, w in zip(bags, weights):
        keep = [(i, wi) for i, wi in zip(ids, w) if 0 <= i < N]
        if not keep:
            out.append(None)
            continue
        rows = np.stack([table[i] for i, _ in keep])
        ws = np.array([wi for _, wi in keep], np.float64)[:, None]
        if combiner == "max":
            out.append(rows.max(0))
        elif combiner == "sum":
            out.append((ws * rows).sum(0))
        elif combiner == "mean":
            out.append((ws * rows).sum(0) / ws.sum())
        else:
            out.append((ws * rows).sum(0) / np.sqrt((ws**2).sum()))
    return out


def _bags(form, weighted):
    """(positional/keyword arguments for embedding_bag, the reference's bags and weights)."""
    ids = np.where(MASK, IDS, -7)  # what the mask hides never counts
    w = WEIGHTS if weighted else np.ones(IDS.shape, np.float32)
    bags = [list(r[m]) for r, m in zip(IDS, MASK)]
    bag_w = [list(r[m]) for r, m in zip(w, MASK)]
    if form == "masked":
        kw = {"ids": mj.masked_array(jnp.asarray(IDS), jnp.asarray(MASK))}
        if weighted:
            kw["weights"] = jnp.asarray(WEIGHTS)
        return kw, bags, bag_w
    if form == "padded":
        kw = {"ids": jnp.asarray(ids)}
        if weighted:
            kw["weights"] = jnp.asarray(WEIGHTS)
        return kw, [list(r) for r in ids], [list(r) for r in w]
    flat = np.concatenate([np.asarray(b, np.int32) for b in bags] + [np.array([3, 3], np.int32)])  # 2 ids past the bags
    flat_w = np.concatenate([np.asarray(b, np.float32) for b in bag_w] + [np.ones(2, np.float32)])
    lengths = np.array([len(b) for b in bags])
    kw = {"ids": jnp.asarray(flat)}
    if form == "lengths":
        kw["lengths"] = jnp.asarray(lengths)
    else:  # offsets: ids after the last offset belong to the last bag
        kw["offsets"] = jnp.asarray(np.concatenate([[0], np.cumsum(lengths)[:-1]]))
        bags[-1], bag_w[-1] = bags[-1] + [3, 3], bag_w[-1] + [1.0, 1.0]
    if weighted:
        kw["weights"] = jnp.asarray(flat_w)
    return kw, bags, bag_w


FORMS = ["padded", "masked", "offsets", "lengths"]


# max takes no weights (test_bad_arguments_name_the_argument)
POOLINGS = [(c, w) for c in ("sum", "mean", "sqrtn", "max") for w in (False, True) if not (c == "max" and w)]


FULL = os.environ.get("MJ_ORACLE") == "full"
# `make test`: every pooling and form under jit, and eagerly with masked ids; `make test-full`
# (MJ_ORACLE=full): every one eagerly too
VALUE_CASES = [(c, w, f, j) for c, w in POOLINGS for f in FORMS for j in (False, True) if j or f == "masked" or FULL]


@pytest.mark.parametrize("combiner, weighted, form, jit", VALUE_CASES)
def test_bags_equal_numpy_reference(combiner, weighted, form, jit):
    kw, bags, bag_w = _bags(form, weighted)
    fn = lambda table, kw: mj.embedding_bag(table, combiner=combiner, **kw)
    out = (jax.jit(fn) if jit else fn)(TABLE, kw)
    ref = _reference(TABLE, bags, bag_w, combiner)
    assert out.shape == (4, D)
    np.testing.assert_array_equal(np.asarray(out.mask[:, 0]), [r is not None for r in ref])
    assert not np.any(np.isnan(np.asarray(out.data)))
    for b, r in enumerate(ref):
        if r is not None:
            np.testing.assert_allclose(np.asarray(out.data[b]), r, rtol=2e-6, atol=1e-6)
        else:
            np.testing.assert_array_equal(np.asarray(out.data[b]), 0)


def _loop_loss(table, bags, bag_w, combiner):
    """The same pooling written bag by bag with concrete ids: the dense-gradient reference."""
    total = 0.0
    for b, (ids, w) in enumerate(zip(bags, bag_w)):
        keep = [(i, wi) for i, wi in zip(ids, w) if 0 <= i < N]
        if not keep:
            continue
        rows = jnp.stack([table[i] for i, _ in keep])
        ws = jnp.array([wi for _, wi in keep], jnp.float32)[:, None]
        pooled = {
            "max": lambda rows=rows: rows.max(0),
            "sum": lambda rows=rows, ws=ws: (ws * rows).sum(0),
            "mean": lambda rows=rows, ws=ws: (ws * rows).sum(0) / ws.sum(),
            "sqrtn": lambda rows=rows, ws=ws: (ws * rows).sum(0) / jnp.sqrt((ws**2).sum()),
        }[combiner]()
        total = total + jnp.sum(jnp.sin(pooled) * (b + 1))
    return total


# `make test`: each combiner padded and in one more form (a rotation); `make test-full`: all forms
GRAD_CASES = [
    (c, f)
    for i, c in enumerate(("sum", "mean", "sqrtn", "max"))
    for j, f in enumerate(FORMS)
    if FULL or f == "padded" or j == 1 + i % 3
]


@pytest.mark.parametrize("combiner, form", GRAD_CASES)
def test_bag_gradients_are_row_sparse_and_touch_only_rows_read(combiner, form):
    weighted = combiner != "max"
    kw, bags, bag_w = _bags(form, weighted)

    def loss(table, kw):
        pooled = mj.embedding_bag(table, combiner=combiner, **kw)
        return jnp.sum(jnp.sin(pooled.filled(0)) * jnp.arange(1.0, 5.0)[:, None])

    g = jax.jit(mj.grad(loss, row_sparse=True))(TABLE, kw)
    ref = jax.grad(_loop_loss)(TABLE, bags, bag_w, combiner)
    assert isinstance(g, mj.RowSparseArray)
    np.testing.assert_allclose(np.asarray(g.todense().filled(0)), np.asarray(ref), rtol=2e-5, atol=1e-6)
    read = {int(i) for b in bags for i in b if 0 <= i < N}
    assert set(np.asarray(g.indices).tolist()) - {N} == read  # padding and empty bags store no row
    if weighted:  # and the weights get their gradient
        gw = jax.grad(lambda w: loss(TABLE, {**kw, "weights": w}))(kw["weights"])
        assert np.all(np.isfinite(np.asarray(gw)))


def test_bags_with_leading_dims_and_wide_rows():
    table = jnp.arange(5 * 2 * 2, dtype=jnp.float32).reshape(5, 2, 2)
    ids = jnp.array([[[0, 1], [4, -1]], [[-1, -1], [2, 2]]])
    out = mj.embedding_bag(table, ids, combiner="mean")
    assert out.shape == (2, 2, 2, 2) and out.mask.shape == (2, 2, 2, 2)
    np.testing.assert_allclose(np.asarray(out.data[0, 0]), (np.asarray(table[0]) + np.asarray(table[1])) / 2)
    np.testing.assert_array_equal(np.asarray(out.mask[:, :, 0, 0]), [[True, True], [False, True]])


@pytest.mark.parametrize(
    "call, kind, match",
    [
        (lambda: mj.embedding_bag(TABLE, jnp.array([[0.5]])), TypeError, "ids must be integers"),
        (
            lambda: mj.embedding_bag(TABLE, jnp.array([0, 1]), offsets=jnp.array([0.0])),
            TypeError,
            "offsets must be integers",
        ),
        (
            lambda: mj.embedding_bag(TABLE, jnp.array([0, 1]), offsets=jnp.array([1, 2])),
            ValueError,
            "offsets must start at 0",
        ),
        (lambda: mj.embedding_bag(TABLE, jnp.array([0, 1]), offsets=jnp.array([0, 2, 1])), ValueError, "offsets"),
        (lambda: mj.embedding_bag(TABLE, jnp.array([0, 1]), lengths=jnp.array([3])), ValueError, "lengths must be"),
        (lambda: mj.embedding_bag(TABLE, jnp.array([0, 1]), lengths=jnp.array([-1, 2])), ValueError, "lengths"),
        (
            lambda: mj.embedding_bag(TABLE, jnp.array([0, 1]), lengths=jnp.array([1]), offsets=jnp.array([0])),
            ValueError,
            "exactly one of offsets",
        ),
        (
            lambda: mj.embedding_bag(TABLE, jnp.array([[0, 1]]), offsets=jnp.array([0])),
            ValueError,
            "one-dimensional ids",
        ),
        (lambda: mj.embedding_bag(TABLE, jnp.array([[0, 1]]), weights=jnp.ones(2)), ValueError, "weights must have"),
        (
            lambda: mj.embedding_bag(TABLE, jnp.array([[0, 1]]), weights=jnp.ones((1, 2)), combiner="max"),
            ValueError,
            "takes no weights",
        ),
        (lambda: mj.embedding_bag(TABLE, jnp.array([[0, 1]]), combiner="median"), ValueError, "combiner must be"),
        (lambda: mj.embedding_bag(mj.as_masked(TABLE), jnp.array([[0, 1]])), TypeError, "plain table"),
        (lambda: mj.embedding_bag(TABLE, jnp.array(3)), ValueError, "shape"),
    ],
)
def test_bad_arguments_name_the_argument(call, kind, match):
    with pytest.raises(kind, match=match):
        call()


@pytest.mark.parametrize("jit", [False, True])
def test_ids_past_the_last_ragged_bag_are_padding(jit):
    """``lengths`` may sum to fewer than ``len(ids)``: the ids after the last bag are padding, read
    nothing and get no gradient, so a lazy optimizer leaves their rows alone."""
    ids, lengths = jnp.array([0, 3, 5, 7]), jnp.array([1, 1])

    def loss(t):
        return jnp.sum(mj.embedding_bag(t, ids, lengths=lengths, combiner="sum").filled(0))

    grads = (jax.jit if jit else (lambda f: f))(mj.grad(loss, row_sparse=True))(TABLE)
    stored = np.asarray(grads.indices)[np.asarray(grads.row_valid())]
    assert sorted(stored.tolist()) == [0, 3]
    opt = optim.lazy(optax.adam(0.1))
    updates, _ = opt.update(grads, opt.init(TABLE), TABLE)
    new = np.asarray(optim.apply_updates(TABLE, updates))
    np.testing.assert_array_equal(new[[5, 7]], np.asarray(TABLE)[[5, 7]])
    assert (new[[0, 3]] != np.asarray(TABLE)[[0, 3]]).all()


@pytest.mark.parametrize(
    "kind, bad, good",
    [
        ("offsets", [1, 2], [0, 2]),
        ("offsets", [0, 2, 1], [0, 1, 1]),
        ("offsets", [0, 4], [0, 3]),
        ("lengths", [-1, 2], [1, 2]),
        ("lengths", [2, 3], [2, 1]),
    ],
)
def test_offsets_and_lengths_that_break_the_rules_under_jit_mask_every_bag(kind, bad, good):
    """Under jit they cannot raise: every bag is masked, reads no row and gets no gradient; a valid
    argument in the same compiled function pools as it does eagerly."""
    ids = jnp.array([0, 3, 3])
    fn = jax.jit(lambda t, x: mj.embedding_bag(t, ids, combiner="mean", **{kind: x}))
    out = fn(TABLE, jnp.array(bad))
    assert not np.asarray(out.mask).any() and not np.asarray(out.data).any()
    grads = mj.grad(lambda t: jnp.sum(fn(t, jnp.array(bad)).filled(0)), row_sparse=True)(TABLE)
    assert np.asarray(grads.row_valid()).sum() == 0
    want = mj.embedding_bag(TABLE, ids, combiner="mean", **{kind: jnp.array(good)})
    got = fn(TABLE, jnp.array(good))
    np.testing.assert_array_equal(np.asarray(got.mask), np.asarray(want.mask))
    np.testing.assert_allclose(np.asarray(got.data), np.asarray(want.data), rtol=1e-6)


def test_bags_in_flax_and_equinox_models_train_row_sparse():
    """A flax module and an equinox module pooling bags; a donated lazy-Adam step changes only the
    rows the bags read."""
    import equinox as eqx
    import flax.linen as nn

    class Tower(nn.Module):
        @nn.compact
        def __call__(self, ids, weights):
            table = self.param("table", nn.initializers.normal(0.1), (N, D))
            pooled = mj.embedding_bag(table, ids, weights=weights, combiner="mean")
            return nn.Dense(1)(pooled.filled(0))[..., 0]

    ids = mj.masked_array(jnp.asarray(IDS), jnp.asarray(MASK))
    w, y = jnp.asarray(WEIGHTS), jnp.array([1.0, -1.0, 0.5, 0.0])
    params = Tower().init(jax.random.key(0), ids, w)["params"]
    loss = lambda p, ids, w, y: jnp.mean((Tower().apply({"params": p}, ids, w) - y) ** 2)
    sparse = {"table": True, "Dense_0": False}
    g = mj.grad(loss, row_sparse=sparse)(params, ids, w, y)
    np.testing.assert_allclose(
        np.asarray(g["table"].todense().filled(0)),
        np.asarray(jax.grad(loss)(params, ids, w, y)["table"]),
        rtol=1e-5,
        atol=1e-8,
    )
    opt = optim.lazy(optax.adam(0.05))
    before = np.asarray(params["table"])
    new, _, _ = optim.make_train_step(loss, opt, row_sparse=sparse)(params, opt.init(params), ids, w, y)
    changed = np.nonzero(np.any(np.asarray(new["table"]) != before, axis=1))[0]
    np.testing.assert_array_equal(changed, sorted({int(i) for r, m in zip(IDS, MASK) for i in r[m] if 0 <= i < N}))

    class EqxTower(eqx.Module):
        table: jax.Array
        head: eqx.nn.Linear

        def __call__(self, flat_ids, lengths):
            pooled = mj.embedding_bag(self.table, flat_ids, lengths=lengths, combiner="sqrtn")
            return jax.vmap(self.head)(pooled.filled(0))

    model = EqxTower(TABLE, eqx.nn.Linear(D, 1, key=jax.random.key(2)))
    flat, lengths = jnp.array([1, 5, 5, 0, 2]), jnp.array([3, 0, 2])
    eqx_loss = lambda m: jnp.sum(m(flat, lengths) ** 2)
    g = mj.grad(eqx_loss, row_sparse=lambda m: EqxTower(True, jax.tree_util.tree_map(lambda _: False, m.head)))(model)
    np.testing.assert_allclose(
        np.asarray(g.table.todense().filled(0)), np.asarray(jax.grad(eqx_loss)(model).table), rtol=1e-5, atol=1e-8
    )


def test_one_padding_rule_eagerly_and_under_jit():
    """Each entry point treats ids the same eagerly and under jit: lookup counts negative ids from
    the end and reads zeros past the table; a bag drops negative ids and ids >= N; a row-sparse
    array takes N as its padding index; optimizers skip padding rows."""
    ids = jnp.array([-1, N, N + 3, -N - 1, 2])
    for f in (lambda t, i: mj.lookup(t, i), lambda t, i: mj.embedding_bag(t, i[None]).filled(0)):
        np.testing.assert_array_equal(np.asarray(f(TABLE, ids)), np.asarray(jax.jit(f)(TABLE, ids)))
    rows = np.asarray(mj.lookup(TABLE, ids))
    np.testing.assert_array_equal(rows[0], np.asarray(TABLE[N - 1]))
    np.testing.assert_array_equal(rows[1:4], 0)
    np.testing.assert_allclose(np.asarray(mj.embedding_bag(TABLE, ids[None]).data[0]), np.asarray(TABLE[2]))

    def step(rows, idx):
        g = mj.row_sparse(rows, idx, (N, D))
        u, _ = optim.lazy(optax.sgd(1.0)).update(g, optax.sgd(1.0).init(TABLE), TABLE)
        return optim.apply_updates(TABLE, u), g.todense().filled(0)

    idx = jnp.array([3, N, 3])  # N: the padding index, accepted eagerly as under jit
    eager, jitted = step(jnp.ones((3, D)), idx), jax.jit(step)(jnp.ones((3, D)), idx)
    for a, b in zip(eager, jitted):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    np.testing.assert_array_equal(np.asarray(eager[1]).sum(axis=1), [0, 0, 0, 2 * D, 0, 0, 0, 0, 0])
    with pytest.raises(ValueError, match=r"indices must be in \[0, 9\) \(or 9, the padding index\); got \[-1\]"):
        mj.row_sparse(jnp.ones((2, D)), jnp.array([-1, 2]), (N, D))
    # under jit an index it cannot check is padding, as N is
    out = jax.jit(lambda i: mj.row_sparse(jnp.ones((2, D)), i, (N, D)).todense().filled(0))(jnp.array([-1, 2]))
    np.testing.assert_array_equal(np.asarray(out).sum(axis=1), [0, 0, D, 0, 0, 0, 0, 0, 0])


def _selects(fun, *args):
    return sum(e.primitive.name == "select_n" for e in jax.make_jaxpr(fun)(*args).jaxpr.eqns)


@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn", "max"])
def test_filled_zero_of_a_bag_is_its_data(combiner):
    """A bag's output holds 0 under its mask already, so ``filled(0)`` adds no select (XLA would
    recompute the mask in every fused consumer of the backward pass); other fills, and the same
    array after any change to its data, still select. Empty bags, and mean bags whose weights sum
    to 0 over inf rows, give 0 and no NaN, in values and gradients."""
    table = TABLE.at[6].set(jnp.inf)  # read only by bag 1, whose weights sum to 0 (masked for mean)
    ids = jnp.array([[1, 4, -1], [6, 6, 6], [-1, -1, 9]])
    w = None if combiner == "max" else jnp.array([[1.0, 2.0, 1.0], [1.0, -2.0, 1.0], [1.0, 1.0, 1.0]])
    if combiner == "max":
        ids = ids.at[1].set(-1)

    def bag(t):
        return mj.embedding_bag(t, ids, weights=w, combiner=combiner)

    out = bag(table)
    assert out.filled(0) is out.data
    assert _selects(lambda t: bag(t).filled(0), table) == _selects(lambda t: bag(t).data, table)
    empty = [1, 2] if combiner in ("mean", "max") else [2]
    np.testing.assert_array_equal(np.asarray(out.mask[:, 0]), [b not in empty for b in range(3)])
    for fill in (0, 0.0, False):
        np.testing.assert_array_equal(np.asarray(out.filled(fill))[empty], 0)
    np.testing.assert_array_equal(np.asarray(out.filled(-0.0))[empty], 0)  # -0.0 selects: its sign is kept
    assert np.all(np.signbit(np.asarray(out.filled(-0.0))[empty]))
    np.testing.assert_array_equal(np.asarray(out.filled(5))[empty], 5)
    # the fact is this object's: a tree map (or a jit boundary) that changes the data drops it
    shifted = jax.tree_util.tree_map(lambda a: a + 1 if a.dtype != jnp.bool_ else a, out)
    np.testing.assert_array_equal(np.asarray(shifted.filled(0))[empty], 0)
    jitted = jax.jit(bag)(table)
    np.testing.assert_array_equal(np.asarray(jitted.filled(0)), np.asarray(out.filled(0)))
    # gradients through filled(0): finite, 0 for rows read only by masked bags, and those of an
    # explicit select
    finite = TABLE.at[6].set(7.0)

    def loss(t, explicit):
        o = bag(t)
        x = jnp.where(o.mask, o.data, 0) if explicit else o.filled(0)
        return jnp.sum(jnp.sin(x) * jnp.arange(1.0, 4.0)[:, None])

    for t in (table, finite):
        g = jax.grad(loss)(t, False)
        np.testing.assert_array_equal(np.asarray(g), np.asarray(jax.grad(loss)(t, True)))
        if combiner == "mean":
            np.testing.assert_array_equal(np.asarray(g[6]), 0)
    rs = jax.jit(mj.grad(loss, row_sparse=True), static_argnums=1)(finite, False)
    np.testing.assert_allclose(
        np.asarray(rs.todense().filled(0)), np.asarray(jax.grad(loss)(finite, True)), rtol=1e-6, atol=1e-7
    )
    tangent = jax.jvp(lambda t: bag(t).filled(0), (table,), (jnp.ones_like(table),))[1]
    np.testing.assert_array_equal(np.asarray(tangent)[empty], 0)


@pytest.mark.parametrize("shape", [(0, 3), (4, 0)], ids=["no_rows", "empty_rows"])
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_empty_tables_read_padding_and_get_empty_gradients(shape, jit):
    """A table with no rows (a feature switched off) makes every id padding: `lookup` reads zeros,
    every bag is masked and the row-sparse gradient stores no row, where `jnp.take` would raise on
    the empty axis. Rows of no entries are read as usual."""
    table = jnp.zeros(shape)
    ids = jnp.array([[0, 1], [-1, 2]])
    maybe = jax.jit if jit else (lambda f: f)
    rows = maybe(mj.lookup)(table, ids)
    assert rows.shape == ids.shape + shape[1:] and not np.any(np.asarray(rows))
    for combiner in ("sum", "mean", "max"):
        bags = maybe(lambda t, i, c=combiner: mj.embedding_bag(t, i, combiner=c))(table, ids)
        assert bags.shape == (2,) + shape[1:]
        assert not np.any(np.asarray(bags.mask)) or shape[0]
    ragged = maybe(lambda t: mj.embedding_bag(t, jnp.array([0, 1, 2]), lengths=jnp.array([1, 2])))(table)
    assert ragged.shape == (2,) + shape[1:]

    def loss(t):
        return mj.embedding_bag(t, ids, combiner="mean").filled(0.0).sum() + mj.lookup(t, ids).sum()

    g = maybe(mj.grad(loss, row_sparse=True))(table)
    assert isinstance(g, mj.RowSparseArray) and g.shape == shape
    np.testing.assert_array_equal(g.todense().filled(0.0), jax.grad(loss)(table))
    assert "RowSparseArray" in str(g)


ID_DTYPES = [jnp.int8, jnp.uint8, jnp.int16, jnp.uint16, jnp.int32, jnp.uint32]
BIG = jnp.sin(jnp.arange(600 * 2, dtype=jnp.float32)).reshape(600, 2)  # more rows than int8/uint8 hold


def _entry_points(stack, stacked):
    """Every way ids reach rows, each as ``f(ids) -> array`` (ids: (2, 3), nonnegative)."""
    return {
        "lookup": lambda i: mj.lookup(BIG, i),
        "bag": lambda i: mj.embedding_bag(BIG, i, combiner="mean").data,
        "ragged_lengths": lambda i: mj.embedding_bag(BIG, i.reshape(-1), lengths=jnp.array([2, 4], i.dtype)).data,
        "ragged_offsets": lambda i: mj.embedding_bag(BIG, i.reshape(-1), offsets=jnp.array([0, 1], i.dtype)).data,
        "stack_lookup": lambda i: stack.lookup(stacked, {"big": i})["big"],
        "stack_bag": lambda i: stack.embedding_bag(stacked, {"big": i})["big"].data,
        "row_sparse_grad": lambda i: (
            mj.grad(lambda t: jnp.sum(mj.lookup(t, i) ** 2), row_sparse=True)(BIG).todense().filled(0.0)
        ),
        "row_sparse": lambda i: mj.row_sparse(jnp.ones((6, 2)), i.reshape(-1), BIG.shape).todense().filled(0.0),
    }


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("dtype", ID_DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_every_id_dtype_reads_the_rows_its_values_name(dtype, jit):
    """Ids, offsets and lengths of every integer dtype give the int32 result at every entry point,
    with a table longer than an 8-bit id can count: a uint8 id 100 reads row 100 of a 600-row
    table (compared with the row count in uint8, 600 wraps to 88 and the id would be padding)."""
    stack, stacked = mj.stack_tables({"small": jnp.zeros((3, 2), BIG.dtype), "big": BIG})
    hi = int(jnp.iinfo(dtype).max)
    values = np.array([[100, 5, min(hi, 599)], [0, 99, 100]])
    maybe = jax.jit if jit else (lambda f: f)
    for name, f in _entry_points(stack, stacked).items():
        want = f(jnp.asarray(values, jnp.int32))
        got = maybe(f)(jnp.asarray(values, dtype))
        np.testing.assert_array_equal(
            np.asarray(got), np.asarray(want), err_msg=f"{name} with {jnp.dtype(dtype).name} ids"
        )
    # lengths and offsets that pass their dtype's range when summed or compared with len(ids)
    n = 260 if hi >= 260 else 2 * hi
    ids = jnp.arange(n) % 600
    for kw in ({"lengths": jnp.array([n // 2, n - n // 2], dtype)}, {"offsets": jnp.array([0, n // 2], dtype)}):
        got = maybe(lambda i, kw=kw: mj.embedding_bag(BIG, i, **kw).data)(ids)
        np.testing.assert_allclose(
            np.asarray(got),
            np.stack([BIG[ids[: n // 2]].sum(0), BIG[ids[n // 2 :]].sum(0)]),
            rtol=1e-5,
            err_msg=f"{list(kw)[0]} in {jnp.dtype(dtype).name}",
        )


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bfloat16", "float16"])
def test_half_precision_bags_add_up_in_float32(dtype):
    """A bag of 600 rows of ones pools to 600 padded, ragged (lengths or offsets), weighted,
    stacked and in its row-sparse gradient's duplicates, as jnp.sum does; a bfloat16 running sum
    would stop at 256."""
    table = jnp.ones((1000, 2), dtype)
    ids = jnp.arange(600) % 7  # hot rows: each read ~86 times
    stack, stacked = mj.stack_tables({"a": table, "b": table})
    pooled = {
        "padded": mj.embedding_bag(table, ids[None]).data[0, 0],
        "lengths": mj.embedding_bag(table, ids, lengths=jnp.array([600])).data[0, 0],
        "offsets": mj.embedding_bag(table, ids, offsets=jnp.array([0])).data[0, 0],
        "weighted": mj.embedding_bag(table, ids, lengths=jnp.array([600]), weights=jnp.ones(600, dtype)).data[0, 0],
        "stacked": stack.embedding_bag(stacked, {"b": {"ids": ids, "lengths": jnp.array([600])}})["b"].data[0, 0],
    }
    for name, value in pooled.items():
        assert float(value) == 600.0, (name, value)
    g = mj.grad(
        lambda t: jnp.sum(
            mj.embedding_bag(t, jnp.zeros(600, jnp.int32), lengths=jnp.array([600])).data.astype(jnp.float32)
        ),
        row_sparse=True,
    )(table)
    assert float(g.coalesce().data[0, 0]) == 600.0 and float(g.todense().data[0, 0]) == 600.0


@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn"])
@pytest.mark.parametrize(
    "table_dtype, weight_dtype",
    [(jnp.int32, jnp.float32), (jnp.bfloat16, jnp.float32), (jnp.float32, jnp.bfloat16)],
    ids=["int-float", "bf16-f32", "f32-bf16"],
)
def test_weights_promote_with_the_table_as_jnp_does(table_dtype, weight_dtype, combiner):
    """Weighted bags pool in the dtype jnp gives ``weights * rows``: float weights on an integer
    table are not truncated to integers (1.25 stayed 1), and float32 weights on a bfloat16 table
    are not rounded to bfloat16; padded, ragged and stacked alike."""
    table = jnp.arange(12).reshape(6, 2).astype(table_dtype)
    ids = jnp.array([[0, 5, 2]])
    w = jnp.array([[1.25, 0.5, 3.0]], weight_dtype)
    rows = jnp.take(table, ids, axis=0)
    wp = w.astype(jnp.result_type(table_dtype, weight_dtype))  # the weights in the pooling dtype
    total = jnp.sum(wp[..., None] * rows, axis=1)
    norm = {"sum": 1.0, "mean": jnp.sum(wp, axis=1), "sqrtn": jnp.sqrt(jnp.sum(wp * wp, axis=1))}[combiner]
    want = total / jnp.reshape(norm, (-1, 1)) if combiner != "sum" else total
    stack, stacked = mj.stack_tables({"t": table})
    got = {
        "padded": mj.embedding_bag(table, ids, weights=w, combiner=combiner),
        "ragged": mj.embedding_bag(table, ids[0], lengths=jnp.array([3]), weights=w[0], combiner=combiner),
        "stacked": stack.embedding_bag(stacked, {"t": {"ids": ids, "weights": w, "combiner": combiner}})["t"],
    }
    for name, out in got.items():
        assert out.dtype == want.dtype, (name, out.dtype)
        np.testing.assert_allclose(
            np.asarray(out.data, np.float64), np.asarray(want, np.float64), rtol=1e-6, err_msg=name
        )
