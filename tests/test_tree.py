"""Masked arrays in generic JAX code: printing, named pytree paths, serialisation, tree maps that
cannot corrupt masks, and the global-norm / EMA patterns (``_core``, ``_serialization``)."""

from __future__ import annotations

import io
import pickle

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from browser import screenshot

import masked_jax as mj
from masked_jax import optim

F32 = jnp.float32
BIG = mj.masked_array(jnp.arange(2000.0, dtype=F32).reshape(50, 40), jnp.arange(2000).reshape(50, 40) % 7 != 0)


def _state():
    return {
        "emb": mj.masked_array(
            jnp.arange(6.0, dtype=F32).reshape(2, 3), jnp.array([[True, False, True], [False, True, True]])
        ),
        "grad": mj.row_sparse(jnp.array([[1.0, 2.0], [3.0, 4.0]], F32), jnp.array([3, 0]), (5, 2)),
        "pattern": mj.masked_array(jnp.ones((2, 2), F32), jnp.eye(2, dtype=bool)).tostype("bcoo"),
        "bias": jnp.ones(2, F32),
        "scale": mj.as_masked(jnp.full(3, 0.5, F32)),
    }  # statically valid: no mask stored


def _same(a, b):
    assert type(a) is type(b)
    assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)
    la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
        assert np.asarray(x).dtype == np.asarray(y).dtype


# -- printing -------------------------------------------------------------------------------------
def _cells_summarised_by_numpy(x):
    """The reference print: every value's text (``--`` where masked) in an object array of the
    full shape, summarised by numpy itself under the current print options."""
    data, mask = np.asarray(x.data), np.asarray(x.mask)
    cells = np.array([str(v) if ok else "--" for v, ok in zip(data.flat, mask.flat)], dtype=object)
    return np.array2string(cells.reshape(data.shape), separator=" ", formatter={"all": str})


TALL = mj.masked_array((jnp.arange(1200, dtype=F32) / 10).reshape(300, 4), (jnp.arange(1200) % 7 != 0).reshape(300, 4))


@pytest.mark.parametrize("x", [BIG, TALL, TALL.T, TALL.reshape(3, 100, 4)], ids=["50x40", "300x4", "4x300", "3x100x4"])
@pytest.mark.parametrize("threshold,edgeitems", [(1000, 3), (100, 2), (5000, 3)])
def test_large_arrays_print_the_edge_items_around_ellipses(x, threshold, edgeitems):
    """A large array prints as numpy summarises: ``edgeitems`` at each end of every long axis around
    ``...``, nothing dropped silently (numpy.ma's own print of a 300 x 4 array jumps from row 49 to
    row 250 with no ``...``), float32 values with float32 digits."""
    with np.printoptions(threshold=threshold, edgeitems=edgeitems):
        text = repr(x)
        want = _cells_summarised_by_numpy(x)
    body = text[len("MaskedArray(") : text.rindex(", dtype=")]
    assert body.replace("\n" + " " * len("MaskedArray("), "\n") == want
    assert ("..." in text) == (x.size > threshold)
    if x is TALL and x.size > threshold:
        rows = [line for line in body.splitlines() if "[" in line]
        assert len(rows) == 2 * edgeitems and rows[-1].strip().startswith("[119.6 -- 119.8")
        assert "0.1 0.2 0.3" in rows[0]  # float32 digits, not 0.10000000149011612


def test_small_arrays_print_every_value_and_traced_arrays_stay_short():
    x = mj.masked_array(jnp.array([1.0, 2.0, 3.0], F32), jnp.array([True, False, True]))
    assert repr(x) == "MaskedArray([1.0 -- 3.0], dtype=float32)"
    seen = []
    jax.jit(lambda v: seen.append(repr(v)) or v)(BIG)
    assert seen == ["MaskedArray(float32[50, 40])"]


def test_bfloat16_and_sparse_layouts_show_their_values():
    assert "--" in repr(BIG.astype(jnp.bfloat16))
    text = str(_state()["grad"])
    assert text.splitlines() == ["RowSparseArray(float32[5, 2], rows=2)", "  row 3: [1. 2.]", "  row 0: [3. 4.]"]
    text = str(_state()["pattern"])
    assert "entry [0, 0]: 1.0" in text and "entry [1, 1]: 1.0" in text
    many = mj.row_sparse(jnp.ones((20, 2), F32), jnp.arange(20), (30, 2))
    assert "  ..." in str(many).splitlines()
    padded = mj.layouts.rows_from_parts((4, 2), jnp.ones((2, 2), F32), jnp.array([1, 4]))
    assert "  padding: [1. 1.]" in str(padded).splitlines()


def test_every_array_class_has_an_html_view_that_renders(tmp_path):
    state = _state()
    views = [BIG._repr_html_(), state["emb"]._repr_html_(), state["grad"]._repr_html_(), state["pattern"]._repr_html_()]
    assert all(v.startswith("<") for v in views)
    assert views[1].count("mj-masked") == 2 and views[1].count("mj-valid") == 4
    assert "&hellip;" in views[0]  # summarised as the text is
    page = tmp_path / "arrays.html"
    page.write_text("<html><body style='background:white'>" + "".join(views) + "</body></html>")
    shown = screenshot(page, tmp_path / "shown.png", tmp_path, size="900,1400")
    grey = np.abs(shown - 0xD0 / 255).max(axis=-1) < 0.02
    assert grey.sum() > 200, "masked cells are not shown on grey"
    hidden = tmp_path / "hidden.html"
    hidden.write_text(page.read_text().replace("<html>", "<html><style>.mj-masked { visibility: hidden; }</style>"))
    bare = screenshot(hidden, tmp_path / "bare.png", tmp_path, size="900,1400")
    assert (np.abs(shown - bare).max(axis=-1) > 0.1).sum() > 200, "the masked cells are not drawn"


# -- named paths and serialisation -------------------------------------------------------------------
def test_pytree_paths_name_the_children():
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(_state())[0]]
    assert paths == [
        "['bias']",
        "['emb'].data",
        "['emb'].mask",
        "['grad'].data",
        "['grad'].indices",
        "['pattern'].data",
        "['pattern'].indices",
        "['scale'].data",
    ]  # no mask: statically valid


def test_pickle_round_trip():
    state = _state()
    _same(pickle.loads(pickle.dumps(state)), state)


def test_flax_serialization_round_trip():
    import flax.serialization

    state = _state()
    back = flax.serialization.from_bytes(state, flax.serialization.to_bytes(state))
    _same(back, state)
    as_dict = flax.serialization.to_state_dict(state)
    assert set(as_dict["emb"]) == {"data", "mask"} and set(as_dict["grad"]) == {"data", "indices"}
    _same(flax.serialization.from_state_dict(state, as_dict), state)


def test_orbax_round_trip(tmp_path):
    import orbax.checkpoint as ocp

    state = _state()
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(tmp_path / "ckpt", state)
    with ocp.StandardCheckpointer() as ckpt:
        back = ckpt.restore(tmp_path / "ckpt", state)
    _same(back, state)


def test_npz_round_trip_by_path():
    state = _state()
    leaves, treedef = jax.tree_util.tree_flatten_with_path(state)
    buffer = io.BytesIO()
    np.savez(buffer, **{jax.tree_util.keystr(p): np.asarray(v) for p, v in leaves})
    buffer.seek(0)
    stored = np.load(buffer)
    back = jax.tree_util.tree_unflatten(treedef, [jnp.asarray(stored[jax.tree_util.keystr(p)]) for p, _ in leaves])
    _same(back, state)


# -- generic tree code -------------------------------------------------------------------------------
@pytest.mark.parametrize("f", [lambda p: p * 2, lambda p: p.astype(jnp.bfloat16), lambda p: p + 0.5])
def test_a_non_bool_mask_from_generic_code_is_refused_at_once(f):
    with pytest.raises(TypeError, match="mj.tree_map_data"):
        jax.tree.map(f, {"w": BIG})


def test_tree_map_data_maps_the_data_of_every_layout():
    state = _state()
    out = mj.tree_map_data(lambda p: p * 2, state)
    for key in ("emb", "grad", "pattern", "scale"):
        assert type(out[key]) is type(state[key])
        np.testing.assert_array_equal(
            out[key].todense().filled(0) if hasattr(out[key], "todense") else out[key].filled(0),
            2 * (state[key].todense().filled(0) if hasattr(state[key], "todense") else state[key].filled(0)),
        )
    np.testing.assert_array_equal(out["grad"].indices, state["grad"].indices)
    np.testing.assert_array_equal(out["bias"], 2 * state["bias"])
    assert len(jax.tree.leaves(state, is_leaf=mj.is_masked_leaf)) == 5
    assert out["scale"].compact_mask is None  # a statically valid array stays so


def test_ema_of_parameters_keeps_masks():
    params = {"w": mj.masked_array(jnp.array([1.0, 2.0]), jnp.array([True, False])), "b": jnp.ones(1)}
    ema = mj.tree_map_data(jnp.zeros_like, params)
    for _ in range(3):
        ema = mj.tree_map_data(lambda e, p: 0.5 * e + 0.5 * p, ema, params)
    assert float(ema["w"].data[0]) == 0.875 and ema["w"].mask.tolist() == [True, False]
    assert float(ema["b"][0]) == 0.875


def test_global_norm_and_clipping_patterns():
    grads = {"w": mj.masked_array(jnp.array([0.02, 0.02, 5.0, 0.02], F32), jnp.array([True, True, False, True]))}
    valid_norm = 0.02 * 3**0.5
    with pytest.raises(TypeError, match="mask must stay bool"):  # the trap, loud: the map builds an int mask
        optax.tree.norm(grads)
    trap = {"w": [grads["w"].data, grads["w"].mask]}  # the leaves it would have summed
    assert abs(float(optax.tree.norm(trap)) - 28.0012**0.5) < 1e-4
    filled = jax.tree.map(lambda g: g.filled(0), grads, is_leaf=mj.is_masked_leaf)
    assert abs(float(optax.tree.norm(filled)) - valid_norm) < 1e-7
    clip = optim.lazy(optax.clip_by_global_norm(0.01))
    params = {"w": jnp.zeros(4)}
    updates, _ = clip.update(grads, clip.init(params), params)
    np.testing.assert_allclose(float(optax.tree.norm(updates["w"].filled(0))), 0.01, rtol=1e-6)
    assert updates["w"].mask.tolist() == [True, True, False, True]
