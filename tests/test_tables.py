"""Stacked tables equal separate tables: lookups, bags, row-sparse gradients and optimizer steps;
and they read all their rows with one gather."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import masked_jax as mj
from masked_jax import optim

SIZES = {"user": 13, "item": 7, "genre": 4}
D = 3


def _tables(seed=0):
    keys = jax.random.split(jax.random.key(seed), len(SIZES))
    return {k: jax.random.normal(key, (n, D)) for key, (k, n) in zip(keys, SIZES.items())}


IDS = {
    "user": jnp.array([[0, 12, 12], [-1, 13, 5]]),  # per-table: -1 is the table's last row, 13 is out of range
    "item": jnp.array([6, 6, 0, -8]),
    "genre": mj.masked_array(jnp.array([1, 3, 2]), jnp.array([True, False, True])),
}


def _separate_loss(tables, ids):
    return sum(
        jnp.sum(jnp.sin(mj.numpy.asarray(mj.lookup(tables[k], ids[k])).filled(0))) * (i + 1)
        for i, k in enumerate(SIZES)
    )


def _stacked_loss(stack):
    def loss(table, ids):
        rows = stack.lookup(table, ids)
        return sum(jnp.sum(jnp.sin(mj.numpy.asarray(rows[k]).filled(0))) * (i + 1) for i, k in enumerate(SIZES))

    return loss


def test_stacked_lookup_equals_separate_lookups():
    tables = _tables()
    stack, table = mj.stack_tables(tables)
    # tables given as nested lists or numpy arrays stack alike
    _, from_lists = mj.stack_tables(
        {k: np.asarray(t).tolist() if k == "user" else np.asarray(t) for k, t in tables.items()}
    )
    np.testing.assert_array_equal(np.asarray(from_lists), np.asarray(table))
    assert table.shape == (24, D) and stack.offsets == {"user": 0, "item": 13, "genre": 20}
    rows = stack.lookup(table, IDS)
    for k in SIZES:
        ref = mj.lookup(tables[k], IDS[k])
        out = rows[k]
        np.testing.assert_array_equal(
            np.asarray(mj.numpy.asarray(out).filled(0)), np.asarray(mj.numpy.asarray(ref).filled(0))
        )
        if mj.is_masked(ref):
            np.testing.assert_array_equal(np.asarray(out.mask), np.asarray(ref.mask))
    # a sequence of pairs: two lookups into one table
    a, b = stack.lookup(table, [("item", jnp.array([1])), ("item", jnp.array([2, 3]))])
    np.testing.assert_array_equal(np.asarray(b), np.asarray(tables["item"][2:4]))
    for k, t in stack.unstack(table).items():
        np.testing.assert_array_equal(np.asarray(t), np.asarray(tables[k]))


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_stacked_gradient_and_step_equal_separate_tables(jit):
    tables = _tables(1)
    stack, table = mj.stack_tables(tables)
    wrap = jax.jit if jit else (lambda f: f)
    g = wrap(mj.grad(_stacked_loss(stack), row_sparse=True))(table, IDS)
    ref = jax.grad(_separate_loss)(tables, IDS)
    assert isinstance(g, mj.RowSparseArray)
    for k, part in stack.unstack(g.todense().filled(0)).items():
        np.testing.assert_allclose(np.asarray(part), np.asarray(ref[k]), rtol=1e-6, atol=1e-7)
    # one lazy-Adam step on the stack = one on the separate tables (per row, the same arithmetic)
    opt = optim.lazy(optax.adam(0.1))
    sep_g = mj.grad(_separate_loss, row_sparse=True)(tables, IDS)
    u, _ = opt.update(sep_g, opt.init(tables), tables)
    separate = optim.apply_updates(tables, u)
    u, _ = opt.update(g, opt.init(table), table)
    stacked = stack.unstack(optim.apply_updates(table, u))
    for k in SIZES:
        np.testing.assert_allclose(np.asarray(stacked[k]), np.asarray(separate[k]), rtol=1e-6, atol=1e-7)


_W = jnp.array([[1.0, 0.5, 2.0], [0.0, 1.5, 1.0], [0.25, 0.25, 3.0]])
BAG_REQUESTS = {
    "mixed": {
        "user": {"ids": jnp.array([[0, 3, -1], [-1, -1, -1]]), "combiner": "mean"},
        "item": {
            "ids": jnp.array([1, 6, 6, 2]),
            "lengths": jnp.array([1, 0, 3]),
            "weights": jnp.array([1.0, 0.5, 0.5, 2.0]),
            "combiner": "sqrtn",
        },
        "genre": jnp.array([[3, 2], [0, 9]]),
    },
    # padded bags of one shape pool together, each with its own combiner (max pools alone)
    "one shape": {
        "user": {"ids": jnp.array([[0, 12, 12], [-1, -1, -1], [4, 4, 5]]), "weights": _W, "combiner": "sqrtn"},
        "item": {"ids": jnp.array([[6, 1, -1], [2, 0, 0], [3, 9, 1]]), "weights": _W, "combiner": "mean"},
        "genre": mj.masked_array(
            jnp.array([[1, 3, 2], [0, 0, 1], [2, 2, 2]]),
            jnp.array([[True, False, True], [False, False, False], [True] * 3]),
        ),
        "max": ("user", {"ids": jnp.array([[1, 2, -1], [0, 0, 0], [-1, -1, -1]]), "combiner": "max"}),
    },
}


@pytest.mark.parametrize("case", list(BAG_REQUESTS))
def test_stacked_bags_equal_separate_bags(case):
    tables = _tables(2)
    stack, table = mj.stack_tables(tables)
    requests = dict(BAG_REQUESTS[case])
    if "max" in requests:  # a second bag of one table: a sequence of (table, spec) pairs
        pairs = [(k, v) for k, v in requests.items() if k != "max"] + [requests.pop("max")]
        out_pairs = stack.embedding_bag(table, pairs)
        ref = mj.embedding_bag(tables[pairs[-1][0]], **pairs[-1][1])
        np.testing.assert_array_equal(np.asarray(out_pairs[-1].data), np.asarray(ref.data))
        np.testing.assert_array_equal(np.asarray(out_pairs[-1].mask), np.asarray(ref.mask))
    out = stack.embedding_bag(table, requests)
    for k, spec in requests.items():
        spec = spec if isinstance(spec, dict) else {"ids": spec}
        ref = mj.embedding_bag(tables[k], **spec)
        np.testing.assert_allclose(np.asarray(out[k].data), np.asarray(ref.data), rtol=1e-6)
        np.testing.assert_array_equal(np.asarray(out[k].mask), np.asarray(ref.mask))

    def loss(table):
        return sum(jnp.sum(v.filled(0) ** 2) for v in stack.embedding_bag(table, requests).values())

    def separate(tables):
        return sum(
            jnp.sum(mj.embedding_bag(tables[k], **(s if isinstance(s, dict) else {"ids": s})).filled(0) ** 2)
            for k, s in requests.items()
        )

    g = jax.jit(mj.grad(loss, row_sparse=True))(table)
    ref = jax.grad(separate)(tables)
    for k, part in stack.unstack(g.todense().filled(0)).items():
        np.testing.assert_allclose(np.asarray(part), np.asarray(ref[k]), rtol=1e-6, atol=1e-7)


def _gathers(fun, *args):
    """Gathers from an array of the stack's shape in the jaxpr of ``fun``, inner jaxprs included."""
    count = 0

    def walk(jaxpr):
        nonlocal count
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "gather" and eqn.invars[0].aval.shape[0] == sum(SIZES.values()):
                count += 1
            for v in eqn.params.values():
                if hasattr(v, "jaxpr") and hasattr(v.jaxpr, "eqns"):
                    walk(v.jaxpr)
                elif hasattr(v, "eqns"):
                    walk(v)

    walk(jax.make_jaxpr(fun)(*args).jaxpr)
    return count


def test_all_tables_are_read_with_one_gather():
    stack, table = mj.stack_tables(_tables())
    assert _gathers(_stacked_loss(stack), table, IDS) == 1
    bags = {"user": jnp.array([[1, 2]]), "item": jnp.array([[3, -1]]), "genre": jnp.array([[0, 0]])}
    assert _gathers(lambda t: sum(jnp.sum(v.data) for v in stack.embedding_bag(t, bags).values()), table) == 1


@pytest.mark.parametrize(
    "call, kind, match",
    [
        (lambda: mj.stack_tables({"a": jnp.zeros((2, 3)), "b": jnp.zeros((2, 4))}), ValueError, "one row shape"),
        (lambda: mj.stack_tables({"a": jnp.zeros((2, 3)), "b": jnp.zeros((2, 3), jnp.int32)}), ValueError, "one dtype"),
        (lambda: mj.stack_tables({}), TypeError, "non-empty mapping"),
        (
            lambda: mj.stack_tables({"a": jnp.zeros((2, 3))})[0].lookup(jnp.zeros((3, 3)), {"a": jnp.array([0])}),
            ValueError,
            r"must have shape \(2, 3\)",
        ),
        (
            lambda: mj.stack_tables({"a": jnp.zeros((2, 3))})[0].lookup(jnp.zeros((2, 3)), {"z": jnp.array([0])}),
            KeyError,
            "no table named 'z'",
        ),
        (
            lambda: mj.stack_tables({"a": jnp.zeros((2, 3))})[0].lookup(jnp.zeros((2, 3)), {"a": jnp.array([0.5])}),
            TypeError,
            "ids must be integers",
        ),
        (
            lambda: mj.stack_tables({"a": jnp.zeros((2, 3))})[0].stack({"a": jnp.zeros((3, 3))}),
            ValueError,
            "must have shape",
        ),
        (lambda: mj.TableStack({"a": 2, "b": -1}, (3,)), ValueError, "row counts must be >= 0"),
        (lambda: mj.stack_tables({"a": mj.masked_array(jnp.zeros((2, 3)))}), TypeError, "cannot be converted"),
    ],
)
def test_bad_stacks_and_requests_are_rejected(call, kind, match):
    with pytest.raises(kind, match=match):
        call()


@pytest.mark.parametrize("case", list(BAG_REQUESTS))
def test_fused_update_of_a_stacked_table_equals_the_one_call_update(case):
    """The GPU step's fused update (``make_train_step(fused_rows=True)``; here in Pallas'
    interpreter) on a stacked table's row-sparse gradient of bags and lookups (duplicates,
    padding, masked and out-of-range ids) equals the one-call lazy update over two steps; rows
    no table read stay bit-identical."""
    from masked_jax.optim._fused import fused_update

    stack, table = mj.stack_tables(_tables(2))

    requests = list(BAG_REQUESTS[case].items())  # (name, spec) pairs: "max" is a second bag of "user"
    requests = [spec if name == "max" else (name, spec) for name, spec in requests]

    def loss(t, ids):  # the requests hold combiner names: closed over, not traced
        pooled = stack.embedding_bag(t, requests)
        return sum(jnp.sum(jnp.tanh(mj.numpy.asarray(x).filled(0)) ** 2) for x in pooled) + _stacked_loss(stack)(t, ids)

    g = jax.jit(mj.grad(loss, row_sparse=True))(table, IDS)
    opt = optim.lazy(optax.adamw(0.1, weight_decay=0.01))
    fused = jax.jit(lambda p, s, g: fused_update(opt, g, s, p, optim.apply_updates, interpret=True))

    def one_call(p, s, g):
        u, s = opt.update(g, s, p)
        return optim.apply_updates(p, u), s

    got = want = (table, opt.init(table))
    for _ in range(2):
        got, want = fused(*got, g), jax.jit(one_call)(*want, g)
    for x, y in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-6)
    untouched = np.setdiff1d(np.arange(table.shape[0]), np.asarray(g.indices))
    assert untouched.size and (np.asarray(got[0])[untouched] == np.asarray(table)[untouched]).all()


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_a_table_of_no_rows_stacks_as_padding(jit):
    """A table of 0 rows (a feature switched off) stacks like any other: its ids are all padding,
    as with the table alone, and the tables beside it read, differentiate and train unchanged."""
    tables = {**_tables(3), "off": jnp.zeros((0, D))}
    stack, table = mj.stack_tables(tables)
    assert table.shape == (sum(SIZES.values()), D) and stack.unstack(table)["off"].shape == (0, D)
    ids = {**IDS, "off": jnp.array([[0, -1, 5]])}
    bags = {"user": jnp.array([[0, 3, -1]]), "off": {"ids": jnp.array([[0, 1, -1]]), "combiner": "mean"}}
    wrap = jax.jit if jit else (lambda f: f)
    rows = wrap(stack.lookup)(table, ids)
    np.testing.assert_array_equal(np.asarray(rows["off"]), np.zeros((1, 3, D)))
    np.testing.assert_array_equal(np.asarray(rows["item"]), np.asarray(mj.lookup(tables["item"], ids["item"])))
    pooled = wrap(lambda t: stack.embedding_bag(t, bags))(table)
    assert not np.any(np.asarray(pooled["off"].mask))
    np.testing.assert_array_equal(
        np.asarray(pooled["user"].data), np.asarray(mj.embedding_bag(tables["user"], bags["user"]).data)
    )

    def make_loss(stack, bags):
        def loss(table):
            pooled = stack.embedding_bag(table, bags)
            return _stacked_loss(stack)(table, IDS) + sum(jnp.sum(v.filled(0.0) ** 2) for v in pooled.values())

        return loss

    loss = make_loss(stack, bags)
    g = wrap(mj.grad(loss, row_sparse=True))(table)
    np.testing.assert_allclose(
        np.asarray(g.todense().filled(0)), np.asarray(jax.grad(loss)(table)), rtol=1e-6, atol=1e-7
    )
    # a step equals the step of the stack without the empty table
    opt = optim.lazy(optax.adam(0.1))

    def step(loss, table):
        return optim.make_train_step(loss, opt, row_sparse=True)(table, opt.init(table))

    without, same = mj.stack_tables(_tables(3))
    got, _, value = step(loss, table)
    want, _, want_value = step(make_loss(without, {"user": bags["user"]}), same)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert float(value) == float(want_value)
