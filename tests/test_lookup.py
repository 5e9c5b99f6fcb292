"""Lookups and row-sparse gradients: every way of reading rows, inside every transform.

The reference is ``jax.grad`` of the same plain-JAX function (a dense table gradient): the
row-sparse gradient, densified, must equal it, and must hold only rows that were read.
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax

import masked_jax as mj
from masked_jax import optim

N, D = 11, 3
TABLE = jnp.sin(jnp.arange(N * D, dtype=jnp.float32)).reshape(N, D)
IDS = jnp.array([[1, 4, 4], [0, 10, -1], [7, 7, 2], [3, 12, -12]], jnp.int32)  # duplicates, -1, out of range
W = jnp.cos(jnp.arange(D, dtype=jnp.float32) + 0.5)


def _score(rows):
    return jnp.sum(jnp.sin(rows) * W)


# how rows are read: (name, read(table, ids of shape (3,)) -> rows)
READS = {
    "lookup": lambda t, ids: mj.lookup(t, ids),
    "getitem": lambda t, ids: t[ids],
    "take_clip": lambda t, ids: jnp.take(t, ids, axis=0, mode="clip"),
    "take_fill": lambda t, ids: jnp.take(t, ids, axis=0, mode="fill", fill_value=-2.0),
    "scalar_id": lambda t, ids: t[ids[0]],  # dynamic_slice
    "dynamic_slice": lambda t, ids: lax.dynamic_slice_in_dim(t, ids[1], 2),
    "static_slice": lambda t, ids: t[2:8:3],
    "cast": lambda t, ids: mj.lookup(t.astype(jnp.bfloat16), ids).astype(jnp.float32),
}


# where the reads happen: (name, loss(table, ids of shape (4, 3), read))
def _plain(t, ids, read):
    return sum(_score(read(t, ids[i])) for i in range(ids.shape[0]))


def _jit(t, ids, read):
    return jax.jit(lambda t, ids: _plain(t, ids, read))(t, ids)


def _vmap(t, ids, read):
    return jnp.sum(jax.vmap(lambda i: _score(read(t, i)))(ids))


def _vmap_axis1(t, ids, read):  # ids batched along their second axis
    return jnp.sum(jax.vmap(lambda i: _score(read(t, i)), in_axes=1)(ids.T))


def _scan(t, ids, read):
    def body(c, i):
        return c + _score(read(t, i)), None

    return lax.scan(body, 0.0, ids)[0]


def _scan_reverse_nested(t, ids, read):
    def inner(c, i):
        return c * 0.5 + _score(read(t, i)), None

    def outer(c, pair):
        return lax.scan(inner, c, pair)[0], _score(read(t, pair[0]))

    carry, ys = lax.scan(outer, 0.0, ids.reshape(2, 2, 3), reverse=True)
    return carry + jnp.sum(ys * jnp.array([1.0, 3.0]))


def _checkpoint(t, ids, read):
    return jax.checkpoint(lambda ids: _plain(t, ids, read))(ids)


def _scan_of_checkpoint(t, ids, read):  # the usual remat-per-layer pattern
    layer = jax.checkpoint(lambda c, i: (c + _score(read(t, i)), None))
    return lax.scan(layer, 0.0, ids)[0]


def _vmap_of_scan(t, ids, read):
    return jnp.sum(jax.vmap(lambda row: _scan(t, row.reshape(1, 3), read))(ids))


WHERE = {
    f.__name__.lstrip("_"): f
    for f in (
        _plain,
        _jit,
        _vmap,
        _vmap_axis1,
        _scan,
        _scan_reverse_nested,
        _checkpoint,
        _scan_of_checkpoint,
        _vmap_of_scan,
    )
}


def _check(loss, jit, ids=IDS):
    value, g = (jax.jit if jit else lambda f: f)(mj.value_and_grad(loss, row_sparse=True))(TABLE, ids)
    ref_value, ref = jax.value_and_grad(loss)(TABLE, ids)
    assert isinstance(g, mj.RowSparseArray)
    np.testing.assert_allclose(float(value), float(ref_value), rtol=2e-6, atol=2e-6)
    np.testing.assert_allclose(np.asarray(g.todense().filled(0)), np.asarray(ref), rtol=2e-6, atol=2e-6)
    return g


FULL = os.environ.get("MJ_ORACLE") == "full"
# `make test` runs every read in the plain function, the lookup in every transform, and each other
# read in one more transform (a rotation); `make test-full` (MJ_ORACLE=full) runs all
CASES = [
    (r, w)
    for i, r in enumerate(READS)
    for j, w in enumerate(WHERE)
    if FULL or w == "plain" or r == "lookup" or j == (i * 2 + 2) % len(WHERE)
]


@pytest.mark.parametrize("read, where", CASES)
def test_row_sparse_gradient_of_every_read_in_every_transform(read, where):
    """Every read form inside every transform gives the dense gradient, eagerly (the plain case)
    and under jit; the rows read are the only rows stored."""
    loss = lambda t, ids: WHERE[where](t, ids, READS[read])
    g = _check(loss, jit=True)
    if where in ("plain", "scan"):
        _check(loss, jit=False)
    stored = set(np.asarray(g.indices).tolist()) - {N}
    touched = set(np.nonzero(np.asarray(jax.grad(loss)(TABLE, IDS)).any(axis=1))[0].tolist())
    assert touched <= stored


def test_rows_stored_are_the_rows_read():
    g = mj.grad(lambda t: jnp.sum(mj.lookup(t, jnp.array([3, 9, 3, 40]))), row_sparse=True)(TABLE)
    np.testing.assert_array_equal(np.asarray(g.indices), [3, 9, 3, N])  # 40 is out of range: padding
    g = mj.grad(lambda t: _scan(t, IDS[:2], READS["lookup"]), row_sparse=True)(TABLE)
    np.testing.assert_array_equal(np.asarray(g.indices), [1, 4, 4, 0, 10, 10])


def test_traced_once_and_values_may_depend_on_rows_read():
    """The function is traced once; ids computed from the rows read are fine (the differentiated
    evaluation reads the same values)."""
    traces = []

    def loss(t, ids):
        traces.append(1)
        first = mj.lookup(t, ids)
        second = jnp.argmax(first[:, 0]).astype(jnp.int32)  # an id that depends on a row read
        return jnp.sum(first**2) + jnp.sum(mj.lookup(t, second[None]) * 3.0)

    ids = jnp.array([2, 5, 8])
    _check(loss, jit=True, ids=ids)
    traces.clear()
    mj.grad(loss, row_sparse=True)(TABLE, ids)
    assert len(traces) == 1


def test_masked_ids_read_masked_rows_and_get_no_gradient():
    ids = mj.masked_array(jnp.array([1, 4, 4, 6]), jnp.array([True, False, True, False]))
    rows = mj.lookup(TABLE, ids)
    assert rows.shape == (4, D)
    np.testing.assert_array_equal(np.asarray(rows.mask), np.repeat([[True], [False], [True], [False]], D, 1))
    np.testing.assert_array_equal(np.asarray(rows.filled(0))[[0, 2]], np.asarray(TABLE)[[1, 4]])
    # masked ids read zeros, so filled(0) is the data itself (no select), eagerly and stacked
    assert rows.filled(0) is rows.data
    np.testing.assert_array_equal(np.asarray(rows.data)[[1, 3]], 0)
    stack, stacked = mj.stack_tables({"a": TABLE, "b": TABLE[:3]})
    out = stack.lookup(stacked, {"b": ids, "a": ids})
    assert out["a"].filled(0) is out["a"].data
    np.testing.assert_array_equal(np.asarray(out["a"].data), np.asarray(rows.data))
    np.testing.assert_array_equal(np.asarray(out["b"].filled(0))[[1, 3]], 0)

    def through(read):
        return lambda t, i: jnp.sum(jnp.sin(read(mj.lookup(t, i))) * W)

    g_filled = jax.jit(mj.grad(through(lambda r: r.filled(0)), row_sparse=True))(TABLE, ids)
    g_where = jax.grad(through(lambda r: jnp.where(ids.mask[:, None], r.data, 0)))(TABLE, ids)
    np.testing.assert_allclose(np.asarray(g_filled.todense().filled(0)), np.asarray(g_where), rtol=1e-6)

    def loss(t, ids):
        return mj.numpy.sum(mj.lookup(t, ids) * W)

    g = jax.jit(mj.grad(loss, row_sparse=True))(TABLE, ids)
    assert set(np.asarray(g.indices).tolist()) <= {1, 4, N}  # the masked ids 4 (once) and 6 read nothing
    ref = np.zeros((N, D), np.float32)
    ref[1] += np.asarray(W)
    ref[4] += np.asarray(W)
    np.testing.assert_allclose(np.asarray(g.todense().filled(0)), ref, rtol=1e-6)
    # masked ids of a masked table: both masks apply
    masked_table = mj.masked_array(TABLE, jnp.arange(N)[:, None] != 1)
    np.testing.assert_array_equal(np.asarray(mj.lookup(masked_table, ids).mask[:, 0]), [False, False, True, False])


def test_maskified_model_with_masked_ids_under_row_sparse():
    """A maskify'd model reading its table under mj.grad(row_sparse=True), with masked ids: the
    gradient equals the per-sequence unpadded run's, and masked ids touch no row."""
    lengths = np.array([3, 1, 4])
    ids_data = jnp.array([[2, 7, 7, 9], [5, 0, 0, 0], [1, 2, 3, 4]])
    valid = jnp.arange(4)[None, :] < jnp.asarray(lengths)[:, None]
    ids = mj.masked_array(ids_data, valid)
    head = jnp.linspace(-1.0, 1.0, D)

    def model(table, ids):  # ordinary jnp code: embeddings, a mean over tokens, a head
        x = table[ids]
        pooled = jnp.mean(jnp.tanh(x), axis=1)
        return jnp.sum(jnp.log1p(jnp.exp(pooled @ head)))

    loss = lambda t, ids: mj.maskify(model)(t, ids)
    value, g = jax.jit(mj.value_and_grad(loss, row_sparse=True))(TABLE, ids)

    def unpadded(t):
        return sum(model(t, ids_data[b, : lengths[b]][None]) for b in range(3))

    np.testing.assert_allclose(float(value), float(unpadded(TABLE)), rtol=1e-6)
    np.testing.assert_allclose(
        np.asarray(g.todense().filled(0)), np.asarray(jax.grad(unpadded)(TABLE)), rtol=1e-5, atol=1e-7
    )
    read = set(np.asarray(g.indices).tolist()) - {N}
    assert read == {2, 7, 5, 1, 3, 4}  # never rows 0 and 9, which only masked ids name


def test_flax_embed_and_equinox_embedding_read_rows():
    """flax.linen.Embed (jnp.take) and equinox.nn.Embedding under vmap (a dynamic slice per id)
    give row-sparse gradients equal to the dense ones; a lazy optimizer step touches only them."""
    import equinox as eqx
    import flax.linen as nn

    class Model(nn.Module):
        @nn.compact
        def __call__(self, ids):
            return jnp.sum(nn.Dense(1)(nn.Embed(N, D)(ids)) ** 2)

    ids = jnp.array([[3, 1], [3, 8]])
    params = Model().init(jax.random.key(0), ids)["params"]
    loss = lambda p, ids: Model().apply({"params": p}, ids)
    only_embed = {"Embed_0": True, "Dense_0": False}
    g = jax.jit(mj.grad(loss, row_sparse=only_embed))(params, ids)
    ref = jax.grad(loss)(params, ids)
    assert isinstance(g["Embed_0"]["embedding"], mj.RowSparseArray)
    np.testing.assert_allclose(
        np.asarray(g["Embed_0"]["embedding"].todense().filled(0)), np.asarray(ref["Embed_0"]["embedding"]), rtol=1e-6
    )
    np.testing.assert_allclose(np.asarray(g["Dense_0"]["kernel"]), np.asarray(ref["Dense_0"]["kernel"]), rtol=1e-6)
    opt = optim.lazy(optax.adam(0.1))
    step = optim.make_train_step(loss, opt, row_sparse=only_embed)
    before = np.asarray(params["Embed_0"]["embedding"])
    new, _, _ = step(params, opt.init(params), ids)  # donates params
    changed = np.asarray(jnp.any(new["Embed_0"]["embedding"] != before, axis=1))
    np.testing.assert_array_equal(np.nonzero(changed)[0], [1, 3, 8])

    emb = eqx.nn.Embedding(N, D, key=jax.random.key(1))

    def eqx_loss(m, ids):
        return jnp.sum(jnp.tanh(jax.vmap(m)(ids)))

    ids1 = jnp.array([4, 4, 0, 10])
    g = mj.grad(eqx_loss, row_sparse=True)(emb, ids1)
    np.testing.assert_allclose(
        np.asarray(g.weight.todense().filled(0)), np.asarray(jax.grad(eqx_loss)(emb, ids1).weight), rtol=1e-6
    )


def test_flax_nnx_embed_reads_rows():
    from flax import nnx

    class Model(nnx.Module):
        def __init__(self, rngs):
            self.embed = nnx.Embed(N, D, rngs=rngs)
            self.head = nnx.Linear(D, 1, rngs=rngs)

        def __call__(self, ids):
            return jnp.sum(jnp.tanh(self.head(self.embed(ids))))

    graphdef, params = nnx.split(Model(nnx.Rngs(0)), nnx.Param)
    loss = lambda p, ids: nnx.merge(graphdef, p)(ids)
    ids = jnp.array([[2, 9, 9], [0, 3, 2]])
    only_embed = jax.tree_util.tree_map_with_path(lambda path, _: "embed" in jax.tree_util.keystr(path), params)
    g = jax.jit(mj.grad(loss, row_sparse=only_embed))(params, ids)
    ref = jax.grad(loss)(params, ids)
    assert isinstance(g["embed"]["embedding"].get_value(), mj.RowSparseArray)
    np.testing.assert_allclose(
        np.asarray(g["embed"]["embedding"].get_value().todense().filled(0)),
        np.asarray(ref["embed"]["embedding"].get_value()),
        rtol=1e-6,
    )
    np.testing.assert_allclose(
        np.asarray(g["head"]["kernel"].get_value()), np.asarray(ref["head"]["kernel"].get_value()), rtol=1e-6
    )
