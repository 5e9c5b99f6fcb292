"""check_jacobian: masked versus dense semantics (seed 001), every layout, full and fast modes."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from browser import screenshot as _screenshot
from hypothesis import given
from hypothesis import strategies as st
from jax.experimental import sparse

import masked_jax as mj
import masked_jax.nn as mnn
import masked_jax.numpy as mnp
from masked_jax.checking._probes import _unravel
from masked_jax.checking._verdict import _largest

MASK = jnp.array([[True, False, True], [True, True, False]])
X = mj.masked_array(jnp.array([[0.5, jnp.nan, 2.0], [1.5, -0.3, jnp.inf]]), MASK)


def seed_foo(x):
    """Seed 001's ``torch.mm(torch.sparse.mm(x, x), x)``: masked semantics only."""
    x = x.tostype("dense")  # an explicit conversion: the storage is the user's choice, not the semantics
    return mnp.matmul(mnp.matmul(x, x), x)


SEED_T = sparse.BCOO.fromdense(jnp.array([[0.0, 1.0], [2.0, 3.0]]))  # the 0 is unspecified


def test_correct_masked_function_passes_masked_and_reports_it():
    r = mj.check_jacobian(lambda v: mnn.softmax(v, axis=1), (X,), raise_exception=False)
    assert r and r.satisfies == ("masked",)  # a masked softmax does not have dense semantics
    assert all(c.passed for c in r.checks if c.semantics == "masked")
    assert {c.mode for c in r.checks} == {"fwd", "rev"}
    with pytest.raises(mj.JacobianError) as err:
        mj.check_jacobian(lambda v: mnn.softmax(v, axis=1), (X,), semantics="dense")
    assert "fails dense semantics" in str(err.value) and not err.value.report


def test_reading_masked_out_data_passes_dense_and_fails_masked():
    f = lambda v: jnp.sum(v.data**2)  # reads the data under the mask
    r = mj.check_jacobian(f, (X,), raise_exception=False)
    assert r.satisfies == ("dense",)
    failed = [c for c in r.checks if not c.passed]
    assert failed and all(c.semantics == "masked" for c in failed)
    for c in failed:
        assert c.leaks["valid outputs vs masked-out data"] > 1e-3
        # the gradient at masked-out inputs (2 x): the probes put a huge value there
        assert c.leaks["VJP to masked-out inputs with a huge value under the masks"] > 1e-3
        assert "numerical, masked-out inputs" not in c.leaks  # tables shared with dense semantics: not perturbed
        assert c.max_abs < 1e-6  # on the specified elements the derivatives agree: only the leak fails
    # without probes the masked tables are taken on their own, at random data under the mask
    alone = mj.check_jacobian(f, (X,), raise_exception=False, leak_probes=False)
    for c in alone.failures():
        assert c.leaks["analytical, masked-out inputs"] > 1e-3 and c.leaks["numerical, masked-out inputs"] > 1e-3
    assert alone.satisfies == ("dense",)
    with pytest.raises(mj.JacobianError, match="leak"):
        mj.check_jacobian(f, (X,), semantics="masked")


def test_seed_001_sparse_mm_example_is_masked_only_and_the_fix_passes():
    t = mj.from_bcoo(SEED_T)
    r = mj.check_jacobian(seed_foo, (t,), raise_exception=False)
    assert r.satisfies == ("masked",)
    dense_fail = [c for c in r.checks if c.semantics == "dense" and not c.passed]
    assert dense_fail
    # the seed's printed Jacobians (torch prints inputs x outputs: the transpose of ours)
    seed_numerical = np.array([[4, 3, 6, 2], [6, 13, 4, 12], [3, 1, 13, 6], [2, 6, 12, 31]], float)
    num, an = dense_fail[0].numerical, dense_fail[0].analytical
    np.testing.assert_allclose(num, seed_numerical.T, rtol=1e-6)
    np.testing.assert_allclose(an[:, 1:], seed_numerical.T[:, 1:], rtol=1e-9)
    np.testing.assert_array_equal(an[:, 0], 0.0)  # no tangent for the unspecified x[0, 0]
    # the fix: the function masks its (dense) input itself, so perturbing x[0, 0] changes nothing
    t_mask = jnp.array([[False, True], [True, True]])
    fixed = lambda d: seed_foo(mj.masked_array(d, t_mask))
    assert mj.check_jacobian(fixed, (SEED_T.todense(),)).satisfies == ("dense", "masked")


def test_wrong_custom_vjp_fails_and_points_at_the_wrong_entries():
    @jax.custom_vjp
    def f(x):
        return jnp.sin(x)

    def bwd(x, g):
        return (g * jnp.cos(x) * jnp.array([1.0, 1.0, 3.0]),)  # wrong for element 2 only

    f.defvjp(lambda x: (jnp.sin(x), x), bwd)
    r = mj.check_jacobian(f, (jnp.array([0.1, 0.4, 0.8]),), raise_exception=False)
    assert not r
    assert any("forward mode skipped" in n for n in r.notes) and {c.mode for c in r.checks} == {"rev"}
    worst = r.checks[0].worst[0]
    assert worst[:2] == ((2,), (2,)) and worst[4]
    np.testing.assert_allclose([worst[2], worst[3]], [np.cos(0.8), 3 * np.cos(0.8)], rtol=1e-6)
    assert "out[2] in[2]" in repr(r)


@given(
    st.lists(st.sampled_from([0.0, 1.0, -1.0, 2.5, np.nan, np.inf, -np.inf]), min_size=0, max_size=12),
    st.integers(0, 6),
    st.lists(st.integers(1, 4), min_size=0, max_size=3),
    st.integers(0, 10**6),
)
def test_largest_and_unravel_helpers_match_numpy(values, k, shape, i):
    a = np.array(values, float)
    before = a.copy()
    picks = _largest(a, k)
    np.testing.assert_array_equal(a, before)  # searched in place, restored
    key = lambda p: (0, 0, p) if np.isnan(a[p]) else (1, -a[p], p)  # NaN first, then largest, ties by position
    ranked = sorted(range(a.size), key=key)[:k]
    above_marker = [p for p in ranked if a[p] != -np.inf]  # -inf entries tie with the picked ones' marker
    assert picks[: len(above_marker)] == above_marker and len(picks) == min(k, a.size)
    shape = tuple(shape)
    flat = i % max(int(np.prod(shape)), 1)
    assert _unravel(flat, shape) == tuple(int(v) for v in np.unravel_index(flat, shape))


@pytest.mark.parametrize("semantics", ["dense", "masked"])
def test_worst_entries_are_ranked_by_excess_over_tolerance(semantics):
    # A wrong backward pass: input element j's column scaled by w[j] (NaN for one), so every
    # output row has a different error; the ranking must match a numpy sort of the same errors.
    w = np.array([1.0, 1.5, 1.0, 4.0, np.nan, 1.0, 2.5, 1.5])

    @jax.custom_vjp
    def f(x):
        return jnp.outer(jnp.arange(1.0, 4.0), jnp.sin(x)).ravel()

    f.defvjp(lambda x: (f(x), x), lambda x, g: ((jnp.arange(1.0, 4.0) @ g.reshape(3, -1)) * jnp.cos(x) * w,))
    x0 = jnp.linspace(0.1, 0.8, 8)
    mask = jnp.array([True] * 7 + [False])
    arg = x0 if semantics == "dense" else mj.masked_array(x0, mask)
    g = f if semantics == "dense" else lambda m: f(m.filled(0.0))
    r = mj.check_jacobian(g, (arg,), semantics=semantics, modes=("rev",), fast=False, raise_exception=False)
    (c,) = r.checks
    cols = np.arange(8) if semantics == "dense" else np.arange(7)
    num, an = c.numerical[:, cols], c.analytical[:, cols]
    excess = np.abs(num - an) - (r.atol + r.rtol * np.abs(num))
    excess[np.isnan(excess)] = np.inf
    order = sorted(np.ndindex(excess.shape), key=lambda rc: (-excess[rc], rc))[:5]
    assert [(w_[0], w_[1]) for w_ in c.worst] == [((i,), (int(cols[j]),)) for i, j in order]
    assert c.worst[0][1] == (4,) and np.isnan(c.worst[0][3]) and all(w_[4] for w_ in c.worst)
    assert c.max_abs == np.inf and c.max_rel == np.inf  # the NaN counts as an infinite error
    if semantics == "masked":
        assert np.isnan(c.diff[:, 7]).all() and not np.isnan(c.diff[:, :7][:, [0, 1, 2, 3, 5, 6]]).any()
    else:
        np.testing.assert_array_equal(c.diff, np.abs(c.numerical - c.analytical))


@pytest.mark.parametrize(
    "layout,fast",
    [("dense", False), ("bcoo", True), ("bcoo_batch", False), ("row_sparse", True), ("row_sparse", False)],
)
def test_layouts_and_modes(layout, fast):
    rng = np.random.default_rng(0)
    rows = np.array([True, False, True, True])
    x = mj.masked_array(jnp.asarray(rng.uniform(0.5, 1.5, (4, 3))), jnp.asarray(np.repeat(rows[:, None], 3, 1)))
    arg = {
        "dense": x,
        "bcoo": x.tostype("bcoo"),
        "row_sparse": x.tostype("row_sparse"),
        "bcoo_batch": mj.BCOOMaskedArray.from_masked(x, nse=3, n_batch=1),
    }[layout]
    f = lambda v: mnp.sum(mnp.log1p(v) * 2.0, axis=1)
    r = mj.check_jacobian(f, (arg,), fast=fast, raise_exception=False)
    assert r.fast == fast
    assert "masked" in r.satisfies, repr(r)
    assert mj.check_jacobian(lambda v: mnp.exp(v), (arg,), semantics="masked", fast=fast)


def test_jax_bcoo_inputs_have_dense_semantics_and_pytrees_of_inputs_and_outputs():
    w = jnp.array([[1.0, -2.0], [0.5, 0.3], [2.0, 1.0]])
    b = sparse.BCOO.fromdense(jnp.array([[0.0, 1.5, 0.0], [2.0, 0.0, -1.0]]))
    f = lambda p: {"y": jnp.tanh(p["b"] @ p["w"]), "n": jnp.sum(p["w"] ** 2)}
    r = mj.check_jacobian(f, ({"b": b, "w": w},), semantics="dense")
    assert {(c.input, c.output) for c in r.checks} >= {("args[0]['b']", "out['y']"), ("args[0]['w']", "out['n']")}
    # the product ignores unspecified entries analytically but dense semantics counts them: BCOO's own
    # matmul has dense semantics, so the check passes with every element perturbed
    assert r.satisfies == ("dense",)


def test_fast_mode_catches_a_wrong_derivative_and_is_chosen_by_size():
    @jax.custom_jvp
    def g(x):
        return jnp.tanh(x)

    g.defjvp(lambda p, t: (jnp.tanh(p[0]), t[0] * 1.5 * (1 - jnp.tanh(p[0]) ** 2)))
    big = jnp.linspace(-1.0, 1.0, 2100)  # past FULL_MAX_ELEMENTS (2048)
    r = mj.check_jacobian(lambda v: jnp.sum(g(v) * v), (big,), semantics="dense", raise_exception=False)
    assert r.fast and not r and all(not c.passed for c in r.checks)
    assert "direction" in repr(r) and "random projections" in repr(r)
    ok = mj.check_jacobian(lambda v: jnp.sum(jnp.tanh(v) * v), (big,), semantics="dense")
    assert ok.fast and ok


@pytest.mark.parametrize("fast", [False, True])
def test_the_check_program_holds_f_a_fixed_number_of_times_however_many_inputs(fast, monkeypatch):
    """The compiled check holds ``f`` (its evaluation, JVP and VJP) as often for six parameter
    leaves as for one: fast mode twice (a JVP and a VJP batch, the points and probes among their
    rows), full tables three times (the points and perturbations, the JVP of jacfwd, the probes'
    VJP batch with jacrev's cotangents among its rows). A wrong check of a leaf (a leak, a wrong derivative) is still
    found in the batch."""
    from masked_jax import _jaxpr
    from masked_jax.checking import _compile

    seen = {}
    original = _compile._Entry.__call__

    def spy(self, operands, seed, compile):
        program = jax.make_jaxpr(self.run)(operands, self.draws(seed))
        seen["sin"] = sum(e.primitive.name == "sin" for e in _jaxpr.equations(program.jaxpr))
        return original(self, operands, seed, compile)

    monkeypatch.setattr(_compile._Entry, "__call__", spy)
    x = mj.masked_array(jnp.array([[0.3, 0.5, 9.0], [0.2, 9.0, 9.0]]), jnp.array([[1, 1, 0], [1, 0, 0]], bool))
    copies = {}
    for k in (1, 6):
        params = [jnp.linspace(0.1, 0.5, 3 + j) for j in range(k)]

        def f(ps, v):
            return mnp.mean(v * sum(jnp.sum(jnp.sin(p)) for p in ps), axis=1)

        assert mj.check_jacobian(f, (params, x), fast=fast, seed=k)
        copies[k] = seen["sin"] / k  # f holds k sines
        leaky = mj.check_jacobian(
            lambda ps, v: jnp.mean(v.data, axis=1) * sum(jnp.sum(jnp.sin(p)) for p in ps),
            (params, x),
            semantics="masked",
            fast=fast,
            raise_exception=False,
        )
        assert not leaky and any(not c.passed and c.input == "args[1]" for c in leaky.checks)
    assert copies[1] == copies[6] == (2 if fast else 3), copies


def test_float32_defaults_and_report_content():
    r = mj.check_jacobian(jnp.sin, (jnp.array([0.1, 0.5], jnp.float32),), semantics="dense")
    assert (r.dtype, r.eps, r.atol, r.rtol) in {("float64", 1e-6, 1e-5, 1e-3), ("float32", 1e-3, 1e-2, 1e-2)}
    text = repr(r)
    for piece in (
        "PASSED",
        f"backend={jax.default_backend()}",
        f"eps={r.eps:g}",
        f"atol={r.atol:g}",
        "dense  fwd",
        "dense  rev",
        "dout/dargs[0]",
        "full Jacobian",
    ):
        assert piece in text, piece
    jax.config.update("jax_enable_x64", False)
    try:
        r32 = mj.check_jacobian(jnp.sin, (jnp.array([0.1, 0.5], jnp.float32),), semantics="dense")
    finally:
        jax.config.update("jax_enable_x64", True)
    assert (r32.dtype, r32.eps, r32.atol, r32.rtol) == ("float32", 1e-3, 1e-2, 1e-2)


def test_html_report_has_tables_and_heatmap():
    r = mj.check_jacobian(lambda v: jnp.sum(v.data**2, axis=1), (X,), raise_exception=False)
    page = r._repr_html_()
    assert "<table" in page and "satisfies dense semantics" in page and "fails masked semantics" in page
    assert page.count("<tr") > len(r.checks)
    r2 = mj.check_jacobian(seed_foo, (mj.from_bcoo(SEED_T),), raise_exception=False)
    page2 = r2.to_html(heatmap=True)
    assert "mj-heatmap" in page2 and "4" in page2 and "numerical" in page2
    assert "mj-heatmap" not in r2.to_html(heatmap=False)
    assert "input element" in page2 and "output element" in page2 and "|error|" in page2


def test_report_plot_is_a_labelled_matplotlib_heatmap():
    r = mj.check_jacobian(seed_foo, (mj.from_bcoo(SEED_T),), raise_exception=False)
    fig = r.plot()
    panels = [ax for ax in fig.axes if ax.get_images()]
    assert [ax.get_title() for ax in panels] == ["dense fwd dout/dargs[0]: FAIL", "dense rev dout/dargs[0]: FAIL"]
    assert {ax.get_xlabel() for ax in panels} == {"input element"}
    shown = panels[0].get_images()[0].get_array()
    np.testing.assert_allclose(shown.filled(np.nan), r.failures()[0].diff, equal_nan=True)
    fast = mj.check_jacobian(jnp.sin, (jnp.array([0.5, 1.0]),), semantics="dense", fast=True)
    with pytest.raises(ValueError, match="fast mode"):
        fast.plot()


def test_bad_input_errors():
    with pytest.raises(TypeError, match="no differentiable input"):
        mj.check_jacobian(lambda i: i * 2, (jnp.arange(3),))
    with pytest.raises(TypeError, match="complex"):
        mj.check_jacobian(lambda z: jnp.abs(z), (jnp.ones(2, jnp.complex64),))
    with pytest.raises(TypeError, match="output out\\[1\\] is a str"):
        mj.check_jacobian(lambda v: (v, "label"), (jnp.ones(2),))
    with pytest.raises(TypeError, match="no float output"):
        mj.check_jacobian(lambda v: v > 0, (jnp.ones(2),))
    with pytest.raises(ValueError, match="semantics must be"):
        mj.check_jacobian(jnp.sin, (jnp.ones(2),), semantics="sparse")
    with pytest.raises(ValueError, match="modes must be"):
        mj.check_jacobian(jnp.sin, (jnp.ones(2),), modes=("backward",))
    # a function whose output pytree depends on the input's storage pattern
    shifty = lambda b: {"y": b.data} if b.nse == 2 else {"z": b.data}
    with pytest.raises(TypeError, match="changed structure"):
        mj.check_jacobian(shifty, (sparse.BCOO.fromdense(jnp.array([0.0, 1.0, 2.0])),), semantics="dense")
    with pytest.raises(TypeError, match="must be callable"):
        mj.check_jacobian(3, (jnp.ones(2),))


def test_constants_static_arguments_and_the_compile_cache():
    from masked_jax.checking import _compile as _check

    def f(v, idx, scale):
        return jnp.take(v, idx) * scale

    v = jnp.array([0.5, 1.0, 2.0])
    r = mj.check_jacobian(f, (v, jnp.array([2, 0]), 3.0), semantics="dense")
    assert {c.input for c in r.checks} == {"args[0]"}
    n = len(_check._CACHE)
    mj.check_jacobian(f, (v * 2, jnp.array([1, 1]), 3.0), semantics="dense")
    assert len(_check._CACHE) == n  # same function and pattern: the compiled check is reused


# -- every op of masked_jax.numpy / masked_jax.nn passes the checker in masked semantics ------------
def _op_table():
    """name -> (fn of (3, 4) masked operands, arity, domain), from the shared op tables."""
    from test_ad import ELEMENTWISE, MASKED_REDUCE, OTHER_OPS, REDUCTIONS

    table = {op.name: (op.fn, 2 if op.family == "binary" else 1, op.domain) for op in ELEMENTWISE}
    domains = {op.name: op.domain for op in REDUCTIONS}
    for name, fn in MASKED_REDUCE.items():
        kw = {} if name in ("quantile", "percentile") else {"axis": 1}
        table[f"{name}_axis1"] = (functools.partial(fn, **kw), 1, domains.get(name, (0.5, 1.5)))
    for name, (fn, _) in OTHER_OPS.items():  # shape, indexing, contraction and cumulative ops
        table[name] = (fn, 1, (0.5, 1.5))
    return table


def test_every_op_passes_check_jacobian_in_masked_semantics():
    table = _op_table()
    names = sorted(table)
    rng = np.random.default_rng(7)
    base = rng.uniform(0.05, 0.95, (len(names), 2, 3, 4))
    mask = rng.random(base.shape) > 0.35
    mask[..., 0, 0], mask[..., 2, 3] = True, False
    x = mj.masked_array(jnp.asarray(np.where(mask, base, np.nan)), jnp.asarray(mask))

    def run(x):
        out = {}
        for i, name in enumerate(names):
            fn, arity, (lo, hi) = table[name]
            operands = [x[i, j] * (hi - lo) + lo for j in range(arity)]  # into the op's domain
            out[name] = fn(*operands)
        return out

    # no leak probes here: the harness poisons every op (NaN and +-inf under the masks, values and
    # gradients, tests/test_conformance.py), and probing all ops in one function doubles its compile
    r = mj.check_jacobian(run, (x,), semantics="masked", fast=False, raise_exception=False, leak_probes=False)
    by_op = {c.output.removeprefix("out['").removesuffix("']") for c in r.checks}
    assert by_op == set(names) and len(names) >= 60
    failed = {c.output for c in r.checks if not c.passed}
    assert not failed, "\n".join(repr(c) for c in r.checks if not c.passed)


def test_html_report_renders_labelled_heatmap_in_headless_chromium(tmp_path):
    r = mj.check_jacobian(seed_foo, (mj.from_bcoo(SEED_T),), raise_exception=False)
    page = tmp_path / "report.html"
    r.save_html(page)
    shown = _screenshot(page, tmp_path / "shown.png", tmp_path)
    white = (shown > 0.97).all(axis=-1)
    assert (~white).mean() > 0.03, "the screenshot is (almost) blank"
    reds = shown[(shown[..., 0] > shown[..., 1] + 0.15)]  # heatmap cells and the colour scale
    assert len(reds) > 12 * 18 * 18, "too few red pixels: the heatmap cells are not sized"
    assert len(np.unique((reds * 255).round().astype(int), axis=0)) >= 8, "no graded colour scale"
    # The same page with the axis labels and colour scale hidden: what disappears is the labelling.
    hidden = tmp_path / "hidden.html"
    hidden.write_text(
        page.read_text().replace("</head>", "<style>.mj-axis, .mj-scale { visibility: hidden; }</style></head>")
    )
    bare = _screenshot(hidden, tmp_path / "bare.png", tmp_path)
    changed = np.abs(shown - bare).max(axis=-1) > 0.2
    assert changed.sum() > 500, "axis labels and colour scale are not visible in the rendered report"
    assert (bare[changed] > 0.97).all(axis=-1).mean() > 0.9, "hidden labels should leave white background"


_X = mj.masked_array(jnp.array([1.0, 2.0, 3.0, 0.5]), jnp.array([True, False, True, True]))

LEAKY = {  # name: (function, the probe or check that must name the leak)
    "nan_times_zero": (lambda v: mnp.sum(v) + jnp.sum(0 * v.data), "valid outputs with NaN under the masks"),
    "where_log_trap": (
        lambda v: jnp.sum(jnp.where(v.mask, jnp.log(v.data), 0.0)),
        "VJP to masked-out inputs with NaN under the masks",
    ),
    "stabiliser_from_data": (
        lambda v: mnp.log(mnp.sum(mnp.exp(v - jnp.max(v.data)))) + jnp.max(v.data),
        "valid outputs with a huge value under the masks",
    ),
    "mean_from_data": (lambda v: jnp.mean(v.data) * mnp.sum(v), "valid outputs vs masked-out data"),
    "gather_reads_padding": (lambda v: mnp.sum(v) * v.data[1], "valid outputs vs masked-out data"),
}


@pytest.mark.parametrize("fast", [False, True], ids=["tables", "projections"])
@pytest.mark.parametrize("name", LEAKY)
def test_leaky_functions_never_pass_masked_semantics(name, fast):
    """NaN, +-inf and huge values under the masks: a function that reads masked-out data fails
    the masked check, named by the probe that caught it."""
    f, expected = LEAKY[name]
    report = mj.check_jacobian(f, (_X,), semantics="masked", fast=fast, raise_exception=False)
    assert "masked" not in report.satisfies
    failing = {k for c in report.checks for k, v in c.leaks.items() if not (np.isfinite(v) and v <= 1e-6)}
    assert expected in failing, failing


@pytest.mark.parametrize("name", LEAKY)
def test_shared_tables_catch_and_locate_every_leak(name):
    """semantics="both" (the default) takes one set of tables for both semantics at the dense point
    and perturbs no masked-out element: the fills, the probes and the leak map still catch every
    leaky function and name the element it reads."""
    f, expected = LEAKY[name]
    report = mj.check_jacobian(f, (_X,), raise_exception=False)
    assert "masked" not in report.satisfies
    masked = [c for c in report.checks if c.semantics == "masked"]
    failing = {k for c in masked for k, v in c.leaks.items() if not (np.isfinite(v) and v <= 1e-6)}
    assert expected in failing, failing
    assert all("numerical, masked-out inputs" not in c.leaks for c in masked)  # not perturbed: not reported
    assert {entry[0] for c in masked for entry in c.leak_map} == {(1,)}
    assert "args[0][1] -> out[]: " in repr(report)


_CORRECT = {
    "sum_exp": lambda v: mnp.sum(mnp.exp(v)),
    "softmax": lambda v: mnn.softmax(v * 2.0),
    "cumsum_sin": lambda v: mnp.cumsum(mnp.sin(v)),
    "var": lambda v: mnp.var(30 * v),
}


@pytest.mark.parametrize("name", _CORRECT)
def test_shared_tables_equal_the_masked_tables_taken_alone(name):
    """The shared masked tables (dense point, raw outputs' Jacobians) equal the ones taken on their
    own at random data under the mask (``semantics="masked"``) on every compared entry, with the
    same verdict; the masked-out inputs' numerical columns are 0 (not perturbed)."""
    f = _CORRECT[name]
    shared = [c for c in mj.check_jacobian(f, (_X,), raise_exception=False).checks if c.semantics == "masked"]
    alone = mj.check_jacobian(f, (_X,), semantics="masked").checks
    spec = np.asarray(_X.mask)
    for a, b in zip(shared, alone):
        assert (a.mode, a.passed, a.mismatch) == (b.mode, True, False)
        np.testing.assert_allclose(a.analytical, b.analytical, rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(a.numerical[:, spec], b.numerical[:, spec], rtol=1e-2, atol=2e-3)
        assert not a.numerical[:, ~spec].any()
        np.testing.assert_array_equal(np.isnan(a.diff), np.isnan(b.diff))


def test_the_verdict_is_taken_where_the_tables_are_and_the_tables_are_read_on_demand():
    """A report's text and HTML need only the verdict: no check copies its tables until one of
    them, its worst entries or its leak map is read. The worst entries read then agree with the
    verdict: a mismatch has a failed worst entry, a match has none."""
    wrong = jax.custom_jvp(jnp.sin)
    wrong.defjvp(lambda p, t: (jnp.sin(p[0]), 1.05 * jnp.cos(p[0]) * t[0]))  # 5% off
    y = jnp.array([0.1, 0.5, -0.3])
    cases = [
        (lambda v: mnp.sum(mnp.exp(v)), _X, ("masked",)),
        (jnp.tanh, y, ("dense", "masked")),
        (wrong, y, ()),
        (LEAKY["mean_from_data"][0], _X, ()),
    ]
    for f, x, satisfies in cases:
        report = mj.check_jacobian(f, (x,), raise_exception=False, modes=("fwd",))
        assert report.satisfies == satisfies
        repr(report), report.to_html()
        assert not any("_shown" in vars(c) for c in report.checks if c.passed)  # no table read yet
        for c in report.checks:
            assert isinstance(c.numerical, np.ndarray) and c.numerical.shape == c.diff.shape
            assert c.mismatch == any(w[4] for w in c.worst)
            assert c.max_abs == pytest.approx(np.nanmax(c.diff), rel=1e-6, abs=1e-12)


_SPARSE = {
    "bcoo": _X.tostype("bcoo"),
    "row_sparse": mj.masked_array(
        jnp.array([[1.0, 2.0], [3.0, 4.0], [0.5, 1.5]]),
        jnp.array([[True, True], [False, False], [True, True]]),
    ).tostype("row_sparse"),
}


@pytest.mark.parametrize("fast", [False, True], ids=["tables", "projections"])
@pytest.mark.parametrize("layout", list(_SPARSE))
def test_sparse_ops_reading_padding_slots_never_pass(layout, fast):
    """A sparse input's padding slots (stored slots past its entries) hold NaN and inf in the
    probes too: a function summing the stored data, padding included, fails; a correct one passes."""
    x = _SPARSE[layout]
    leaky = mj.check_jacobian(
        lambda s: mnp.sum(s) + jnp.sum(0 * s.data), (x,), semantics="masked", fast=fast, raise_exception=False
    )
    assert "masked" not in leaky.satisfies
    failing = {k for c in leaky.checks for k, v in c.leaks.items() if not (np.isfinite(v) and v <= 1e-6)}
    assert "valid outputs with NaN under the masks and in the padding slots of args[0]" in failing, failing
    ok = mj.check_jacobian(lambda s: mnp.sum(mnp.exp(s)), (x,), semantics="masked", fast=fast)
    assert ok.satisfies == ("masked",)
    assert all(v == 0 for c in ok.checks for k, v in c.leaks.items() if "padding" in k)


LEAK_KINDS = {
    "nan_times_zero": "value",
    "where_log_trap": "gradient",
    "stabiliser_from_data": "value",
    "mean_from_data": "numerical",
    "gather_reads_padding": "gradient",
}


def test_the_leak_map_locates_every_leak_in_text_html_and_plot():
    """Full tables: each leaky function's masked check names the masked-out element (args[0][1],
    the only one of _X) and the valid output it reaches, and how; the report shows it."""
    for name, kind in LEAK_KINDS.items():
        report = mj.check_jacobian(LEAKY[name][0], (_X,), semantics="masked", fast=False, raise_exception=False)
        check = report.failures()[0]
        assert check.leak_map, name
        assert {entry[0] for entry in check.leak_map} == {(1,)}, (name, check.leak_map)
        assert any(kind in entry[2] for entry in check.leak_map), (name, check.leak_map)
        assert check.leak_cells[:, 1].any() and not check.leak_cells[:, [0, 2, 3]].any(), name
        assert "args[0][1] -> out[]: " in repr(report), name
    html = report.to_html()
    assert "leak map" in html and "class='mj-leak'" in html
    fig = report.plot()
    assert fig.axes[0].get_legend().get_texts()[0].get_text() == "leak"
    # a correct function has an empty map, and no program that takes one ran for it: the map (an
    # evaluation and a Jacobian per input element) is a second run, for failed masked checks only
    from masked_jax.checking import _compile as _check

    _check._CACHE.clear()
    ok = mj.check_jacobian(lambda v: mnp.sum(mnp.exp(v)), (_X,), semantics="masked", fast=False)
    assert all(not c.leak_map and not c.leak_cells.any() for c in ok.checks)
    assert _check._CACHE and not any(key[-1] for key in _check._CACHE)
    leaky = mj.check_jacobian(LEAKY["nan_times_zero"][0], (_X,), semantics="masked", fast=False, raise_exception=False)
    assert leaky.failures()[0].leak_map
    assert any(key[-1] == "only" for key in _check._CACHE)


@pytest.mark.parametrize("fast", [False, True], ids=["tables", "projections"])
def test_correct_functions_pass_the_leak_probes(fast):
    for f in (
        lambda v: mnp.sum(mnp.exp(v)),
        lambda v: mnp.log(mnp.sum(mnp.exp(v))),
        lambda v: mnp.mean(mnp.log(v)),
        lambda v: mnn.softmax(v) * 2.0,
    ):
        report = mj.check_jacobian(f, (_X,), semantics="masked", fast=fast, raise_exception=False)
        assert report.satisfies == ("masked",)
        assert all(v == 0 for c in report.checks for k, v in c.leaks.items() if "under the masks" in k)


# the output scale is an integer argument (a constant to check_jacobian), so each function compiles
# once per dtype and serves every scale from the cache
_SCALED = [
    lambda v, e: 10.0**e * mnp.sum(mnp.sin(v) * v),
    lambda v, e: mnp.var(10.0 ** (e / 2) * 30 * v),
    lambda v, e: 10.0**e * mnp.linalg.norm(v) + 10.0**e,
]


@pytest.mark.parametrize("fast", [False, True], ids=["tables", "projections"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64])
def test_correct_functions_pass_at_every_output_magnitude(dtype, fast):
    """Tolerances grow with the outputs' magnitude (the finite differences' rounding, per output
    row in full tables, through each direction in projections), so correct float32 and float64
    functions with outputs from 1e-3 to 1e6 pass at default settings; a derivative 5% off still
    fails."""
    rng = np.random.default_rng(1)
    x = mj.masked_array(jnp.asarray(rng.normal(size=12), dtype), jnp.asarray(rng.random(12) < 0.7))
    for exponent in (-3, 0, 3, 6):
        for f in _SCALED:
            report = mj.check_jacobian(
                f, (x, jnp.int32(exponent)), semantics="masked", fast=fast, raise_exception=False
            )
            assert report.satisfies == ("masked",), (exponent, report)
    scale = 1e3

    @jax.custom_jvp
    def off(v):
        return scale * jnp.sin(v)

    off.defjvp(lambda p, t: (off(p[0]), 1.05 * scale * jnp.cos(p[0]) * t[0]))
    assert not mj.check_jacobian(
        lambda v: mnp.sum(off(v.data) * v.mask), (x,), semantics="dense", fast=fast, raise_exception=False
    )


def test_leak_probes_can_be_turned_off_and_are_what_catches_the_where_log_trap():
    f = LEAKY["where_log_trap"][0]
    without = mj.check_jacobian(f, (_X,), semantics="masked", raise_exception=False, leak_probes=False)
    assert without.satisfies == ("masked",)  # finite fills alone cannot see the trap
    assert not any("under the masks" in k for c in without.checks for k in c.leaks)
    assert not mj.check_jacobian(f, (_X,), semantics="masked", raise_exception=False)


def test_forward_only_checks_probe_the_jvp():
    @jax.custom_jvp
    def zero(d):  # value 0 whatever the data, but a tangent that multiplies masked-out data
        return jnp.zeros(())

    zero.defjvp(lambda p, t: (zero(p[0]), jnp.sum(p[0] * t[0])))
    report = mj.check_jacobian(
        lambda v: mnp.sum(v) + zero(v.data), (_X,), semantics="masked", modes=("fwd",), raise_exception=False
    )
    assert "masked" not in report.satisfies
    assert any(
        k.startswith("JVP of valid outputs with NaN") and not v <= 1e-6
        for c in report.checks
        for k, v in c.leaks.items()
    )


# -- latency: the structure cache, the eager first call, the background compile -------------------
def _entry_of(f, args, **kw):
    """The cached check entry ``check_jacobian(f, args, **kw)`` used first (a failing check's second
    run, with the leak map or the error estimate, has its own: keys end in those two flags)."""
    from masked_jax.checking import _compile as _check

    mj.check_jacobian(f, args, **kw)
    return next(entry for key, (entry, _) in reversed(_check._CACHE.items()) if not any(key[-2:]))


def test_the_first_check_of_new_code_compiles_its_own_program_alone():
    """A first check pays for one XLA compile, its program's: nothing of its set-up (the inputs'
    patterns, their flattening, the random draws) runs as an eager op, each of which compiles a
    program of its own for every new shape (a tenth of a tiny model's first check)."""
    import logging

    compiled = []

    class Compiles(logging.Handler):
        def emit(self, record):
            message = record.getMessage()
            if message.startswith("Finished XLA compilation of"):
                compiled.append(message.split(" of ")[1].split(" in ")[0])

    rng = np.random.default_rng(11)
    params = {"w": jnp.asarray(rng.normal(size=(5, 3))), "b": jnp.asarray(rng.normal(size=3))}
    tokens = jnp.arange(9)[None, :, None] < jnp.array([9, 4])[:, None, None]  # shapes no other test uses
    x = mj.masked_array(jnp.asarray(rng.normal(size=(2, 9, 5))), tokens)
    handler = Compiles()
    logging.getLogger("jax").addHandler(handler)
    jax.config.update("jax_log_compiles", True)
    try:
        report = mj.check_jacobian(
            lambda p, v: mnp.sum(mnp.tanh(v @ p["w"]), axis=1) + p["b"], (params, x), compile=True
        )
    finally:
        jax.config.update("jax_log_compiles", False)
        logging.getLogger("jax").removeHandler(handler)
    assert report.satisfies == ("masked",)
    assert compiled == ["jit(run)"], compiled


def test_a_new_function_with_the_same_code_finds_the_compiled_check():
    """A re-run cell, other captured arrays and numbers, another mask of the same shapes: one compiled
    check, run on each function's own constants and mask (its tables are that function's)."""
    x = mj.masked_array(jnp.array([0.5, 1.0, 2.0, 3.0]), jnp.array([True, False, True, True]))
    y = mj.masked_array(jnp.array([1.5, -1.0, 0.25, 3.0]), jnp.array([False, True, True, False]))

    def cell(scale, c):  # a notebook cell: a new lambda every run, capturing an array and a number
        a = jnp.arange(4.0) * scale
        return lambda v: mnp.sin(v * c) * a

    first = _entry_of(cell(1.0, 2.0), (x,), compile=True)
    assert first.ready.is_set()
    assert _entry_of(cell(1.0, 2.0), (x,)) is first  # same code, same captured values
    for scale, c, arg in [(2.0, 3.0, x), (-1.0, 0.5, y)]:  # other captured values, another mask
        assert _entry_of(cell(scale, c), (arg,)) is first
        report = mj.check_jacobian(cell(scale, c), (arg,), semantics="masked", modes=("rev",))
        expected = np.diag(np.arange(4.0) * scale * c * np.cos(np.asarray(arg.data) * c))
        keep = np.asarray(arg.mask)
        np.testing.assert_allclose(
            np.asarray(report.checks[0].analytical)[np.ix_(keep, keep)], expected[np.ix_(keep, keep)], rtol=1e-12
        )
    # a leak that only the other captured value exposes: the shared check still finds it
    leaky = lambda k: lambda v: mnp.sin(v) + jnp.sum(jnp.where(jnp.arange(4) < k, v.data, 0))
    assert mj.check_jacobian(leaky(0), (x,), raise_exception=False).satisfies == ("masked",)
    assert _entry_of(leaky(4), (x,), raise_exception=False) is _entry_of(leaky(0), (x,))
    assert "masked" not in mj.check_jacobian(leaky(4), (x,), raise_exception=False).satisfies
    assert _entry_of(lambda v: mnp.cos(v * 2.0) * jnp.arange(4.0), (x,)) is not first  # other code


def test_a_different_custom_rule_is_a_different_function():
    """Same primal code, different derivative rules: the cache must not serve one for the other."""

    def make(factor):
        @jax.custom_jvp
        def f(x):
            return jnp.sin(x)

        f.defjvp(lambda p, t: (jnp.sin(p[0]), factor * jnp.cos(p[0]) * t[0]))
        return f

    def make_vjp(factor):
        @jax.custom_vjp
        def f(x):
            return jnp.sin(x)

        f.defvjp(lambda x: (jnp.sin(x), x), lambda x, g: (factor * g * jnp.cos(x),))
        return f

    x = jnp.array([0.3, 0.7, 1.1])
    assert mj.check_jacobian(make(1.0), (x,), semantics="dense")
    assert not mj.check_jacobian(make(2.0), (x,), semantics="dense", raise_exception=False)
    assert mj.check_jacobian(make_vjp(1.0), (x,), semantics="dense", modes=("rev",))
    assert not mj.check_jacobian(make_vjp(3.0), (x,), semantics="dense", modes=("rev",), raise_exception=False)
    # a rule capturing an array (its values are not in any printed jaxpr), under a lambda of the same code
    right, wrong = make(jnp.ones(3)), make(jnp.array([1.0, 1.0, 2.0]))
    assert mj.check_jacobian(lambda v: jnp.exp(v) + right(v), (x,), semantics="dense")
    assert not mj.check_jacobian(lambda v: jnp.exp(v) + wrong(v), (x,), semantics="dense", raise_exception=False)


def test_host_callbacks_of_the_same_name_are_different_functions():
    """A jaxpr prints a callback by name only: the closure it runs is part of the function."""

    def make(k):
        def callback():
            return np.asarray(k)

        return lambda v: (
            v * jax.pure_callback(callback, jax.ShapeDtypeStruct((), v.dtype), vmap_method="broadcast_all") + jnp.sin(v)
        )

    x = jnp.array([0.3, 0.7, 1.1])
    for k in (1.0, 3.0):
        report = mj.check_jacobian(make(k), (x,), semantics="dense", modes=("fwd",))
        np.testing.assert_allclose(
            np.diag(np.asarray(report.checks[0].numerical)), k + np.cos(np.asarray(x)), rtol=1e-5
        )


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
def test_half_precision_inputs_are_checked_in_float32(dtype):
    """A central difference in bfloat16 moves by ~0.3 from rounding alone at outputs near 1, so
    half-precision inputs are checked in float32 (float64 with x64): a masked op still fails
    dense semantics, and a derivative 5% off still fails."""
    x = mj.masked_array(jnp.array([1.0, 2.0, 3.0, 0.5], dtype), jnp.array([True, False, True, True]))
    report = mj.check_jacobian(lambda v: mnp.sum(mnp.sin(v)), (x,), raise_exception=False)
    assert report.satisfies == ("masked",)
    assert report.dtype == ("float64" if jax.config.jax_enable_x64 else "float32")
    wrong = jax.custom_jvp(jnp.sin)
    wrong.defjvp(lambda p, t: (jnp.sin(p[0]), 1.05 * jnp.cos(p[0]) * t[0]))
    assert not mj.check_jacobian(wrong, (jnp.array([0.1, 0.5, -0.3], dtype),), raise_exception=False)


def test_eager_compiled_and_background_checks_agree(monkeypatch):
    from masked_jax.checking import _compile as _check

    x = mj.masked_array(jnp.array([[0.5, 1.0, 2.0], [3.0, -1.0, 0.2]]), jnp.array([[1, 0, 1], [1, 1, 0]], bool))
    make = lambda op: lambda v: mnp.sum(op(v) * 1.5, axis=1)  # each op: new code
    eager = mj.check_jacobian(make(mnp.negative), (x,), compile=False)
    compiled = mj.check_jacobian(make(mnp.negative), (x,), compile=True)
    assert eager.satisfies == compiled.satisfies == ("masked",)
    for a, b in zip(eager.checks, compiled.checks):
        np.testing.assert_allclose(a.numerical, b.numerical, rtol=1e-7, atol=1e-8)  # XLA fuses differently
        np.testing.assert_allclose(a.analytical, b.analytical, rtol=1e-9, atol=1e-12)
        # the verdict: numpy on the host for the eager check, the compiled judge for the other
        assert (a.passed, a.mismatch, a.near_miss, list(a.leaks)) == (b.passed, b.mismatch, b.near_miss, list(b.leaks))
        np.testing.assert_allclose(
            [a.max_abs, a.max_rel, *a.leaks.values()], [b.max_abs, b.max_rel, *b.leaks.values()], rtol=1e-5, atol=1e-7
        )
    leaky = LEAKY["where_log_trap"][0]
    eager, compiled = (mj.check_jacobian(leaky, (_X,), compile=c, raise_exception=False) for c in (False, True))
    assert eager.satisfies == compiled.satisfies == ()
    assert [c.reason for c in eager.checks] == [c.reason for c in compiled.checks]
    # these shapes have run eagerly: new code runs eagerly at once, then compiles in the background
    monkeypatch.setenv("MJ_CHECK_BACKGROUND", "1")
    entry = _entry_of(make(mnp.sin), (x,))
    assert entry.thread is not None  # the eager check ran; the compile started after it
    _check.wait_for_compiles()
    assert entry.ready.is_set() and entry.compilable
    assert mj.check_jacobian(make(mnp.sin), (x,)).satisfies == ("masked",)  # the compiled check
    # cold shapes compile in the foreground; the background run warms them for the next function
    y = mj.masked_array(jnp.ones((2, 5)), jnp.ones((2, 5), bool).at[0, 1].set(False))
    cold = _entry_of(make(mnp.cos), (y,))
    assert cold.ready.is_set()
    _check.wait_for_compiles()
    assert cold.shapes in _check._WARM
    monkeypatch.setenv("MJ_CHECK_BACKGROUND", "0")
    warm = _entry_of(make(mnp.tanh), (y,))
    assert warm.thread is None and not warm.ready.is_set()  # ran eagerly, nothing in the background


def test_all_valid_inputs_still_check_masked_outputs():
    """With every input valid the masked tables are the dense ones, except when an output is masked:
    a tangent leaking at a masked-out output is still caught."""
    m = jnp.array([True, False, True])

    def leaky(v):  # built without the tangent masking every op applies
        return mj.MaskedArray.tree_unflatten(None, (v * 2.0, m))

    r = mj.check_jacobian(leaky, (jnp.array([0.5, 1.0, 2.0]),), raise_exception=False)
    assert "masked" not in r.satisfies
    failing = [c for c in r.failures() if c.semantics == "masked"]
    assert failing and failing[0].leaks["analytical, masked-out outputs"] == 2.0
    assert mj.check_jacobian(
        lambda v: mnp.sin(mj.masked_array(v, m)), (jnp.array([0.5, 1.0, 2.0]),), semantics="masked"
    )


# -- second order (gradgradcheck) -----------------------------------------------------------------
def test_second_order_checks_agree_with_jax_hessian():
    x = jnp.array([0.3, -0.8, 1.2, 0.5])
    f = lambda v: jnp.sum(jnp.sin(v) * v**2) + jnp.prod(v)
    report = mj.check_jacobian(f, (x,), semantics="dense", order=2)
    assert report.notes[0].startswith("second order")
    hess = np.asarray(jax.hessian(f)(x))
    for c in report.checks:  # d(grad . w)/dx = w * H for the scalar cotangent w: a multiple of the Hessian
        ratio = np.asarray(c.analytical) / hess
        np.testing.assert_allclose(ratio, ratio[0, 0], rtol=1e-6)
        np.testing.assert_allclose(np.asarray(c.numerical), np.asarray(c.analytical), rtol=1e-4, atol=1e-6)
    # masked semantics: the Hessian of the valid entries alone; masked-out entries are no one's
    xm = mj.masked_array(x, jnp.array([True, False, True, True]))
    g = lambda v: mnp.sum(mnp.exp(v) * v) + mnp.logsumexp(v)
    masked = mj.check_jacobian(g, (xm,), order=2)
    assert masked.satisfies == ("masked",)
    valid = np.array([0, 2, 3])
    h_valid = np.asarray(jax.hessian(lambda u: jnp.sum(jnp.exp(u) * u) + jax.nn.logsumexp(u))(x[valid]))
    an = np.asarray(masked.checks[-1].analytical)[np.ix_(valid, valid)]
    np.testing.assert_allclose(an / h_valid, an[0, 0] / h_valid[0, 0], rtol=1e-6)


def test_a_rule_right_at_first_order_but_not_second_fails_only_the_second_order_check():
    @jax.custom_jvp
    def f(x):
        return jnp.sin(x)

    # the tangent is right, but it does not differentiate further: cos(x) is held constant
    f.defjvp(lambda p, t: (jnp.sin(p[0]), jax.lax.stop_gradient(jnp.cos(p[0])) * t[0]))
    x = jnp.array([0.3, 0.9, 1.4])
    assert mj.check_jacobian(lambda v: jnp.sum(f(v) ** 2), (x,), semantics="dense")
    bad = mj.check_jacobian(lambda v: jnp.sum(f(v) ** 2), (x,), semantics="dense", order=2, raise_exception=False)
    assert not bad and {c.mode for c in bad.failures()} == {"fwd", "rev"}
    with pytest.raises(ValueError, match="order must be 1 or 2"):
        mj.check_jacobian(jnp.sin, (x,), order=3)
    with pytest.raises(TypeError, match="second-order checks take"):
        mj.check_jacobian(lambda s: s.todense().sum(), (sparse.BCOO.fromdense(x),), order=2)


# -- finite-difference error estimates (Richardson) and reasons ----------------------------------
def test_richardson_error_estimate_decides_what_counts_as_a_mismatch():
    """With a coarse step the central difference of sin(10 x) is off by ~(10 eps)^2 / 6 relative,
    past rtol: the estimated error (from eps and 2 eps) keeps the right derivative passing while a
    derivative 5% off still fails, and the failure says why."""
    x = jnp.array([0.1, 0.4, 0.7])
    f = lambda v: jnp.sin(10.0 * v)
    coarse = mj.check_jacobian(f, (x,), semantics="dense", eps=1e-2)
    c = coarse.checks[0]
    truncation = np.max(np.abs(np.asarray(c.numerical) - np.diag(10 * np.cos(10 * np.asarray(x)))))
    assert truncation > 1e-3 * 10 * 0.5  # past atol + rtol |num| alone
    assert c.fd_error == pytest.approx(truncation, rel=0.05)  # Richardson's estimate finds it

    @jax.custom_jvp
    def off(v):
        return jnp.sin(10.0 * v)

    off.defjvp(lambda p, t: (off(p[0]), 1.05 * 10.0 * jnp.cos(10.0 * p[0]) * t[0]))
    bad = mj.check_jacobian(off, (x,), semantics="dense", eps=1e-2, raise_exception=False)
    assert not bad
    assert "beyond their estimated error" in bad.failures()[0].reason and "why:" in repr(bad)
    trap = mj.check_jacobian(LEAKY["where_log_trap"][0], (_X,), semantics="masked", raise_exception=False)
    assert "breaks masked semantics" in trap.failures()[0].reason


@pytest.mark.parametrize("kw", [{}, {"fast": True}, {"order": 2}], ids=["full", "fast", "second_order"])
def test_empty_inputs_have_an_empty_jacobian_and_pass(kw):
    """An input with no entries (size 0, masked or plain, alone or beside another input) adds no
    column to the Jacobian: the check passes on the other inputs, as torch's gradcheck does."""
    empty = mj.masked_array(jnp.zeros((2, 0)), jnp.zeros((2, 0), bool))
    x = mj.masked_array(jnp.array([0.5, 2.0]), jnp.array([True, False]))
    assert mj.check_jacobian(mnp.sin, (empty,), **kw).satisfies == ("dense", "masked")
    assert mj.check_jacobian(jnp.sin, (jnp.zeros((0, 3)),), semantics="dense", **kw).satisfies == ("dense",)
    beside = mj.check_jacobian(lambda a, b: mnp.sin(a) * 2.0 + jnp.sum(b.filled(0.0)), (x, empty), **kw)
    alone = mj.check_jacobian(lambda a: mnp.sin(a) * 2.0, (x,), **kw)
    assert "masked" in beside.satisfies and beside.satisfies == alone.satisfies
    wrong = jax.custom_jvp(jnp.sin)  # a wrong first derivative, or (order 2) a wrong second one
    scale = (lambda c: 2.0 * c) if kw.get("order", 1) == 1 else jax.lax.stop_gradient
    wrong.defjvp(lambda p, t: (jnp.sin(p[0]), scale(jnp.cos(p[0])) * t[0]))
    with pytest.raises(mj.JacobianError):  # the other input is still checked
        mj.check_jacobian(
            lambda a, b: wrong(a) + jnp.sum(b), (jnp.array([0.5, 2.0]), jnp.zeros((0,))), semantics="dense", **kw
        )


@jax.custom_jvp
def _scaled_wrong(w, x):
    return w * x


@_scaled_wrong.defjvp
def _scaled_wrong_jvp(primals, tangents):
    (w, x), (dw, dx) = primals, tangents
    return w * x, 2.0 * dw * x + w * dx  # the derivative in w is doubled


@pytest.mark.parametrize("fast", [False, True], ids=["tables", "projections"])
def test_a_pytree_of_inputs_is_checked_input_by_input_in_one_batch(fast):
    """Several parameter arrays and a masked input, checked together (the tables or projections of
    all of them from one batch of evaluations): a right function passes; a wrong derivative in one
    parameter fails that parameter's checks only; a leak through the masked input is found."""
    x = mj.masked_array(jnp.array([[0.5, -1.0, 2.0], [1.5, 0.3, -0.7]]), jnp.array([[1, 1, 0], [1, 0, 1]], bool))
    params = {"a": jnp.array([0.3, -0.2, 0.5]), "b": jnp.array(0.7), "w": jnp.array([[1.0, 2.0], [0.5, -1.0]])}

    def right(p, v):
        return mnp.sum(mnp.tanh(v * p["a"] + p["b"]), axis=1) @ p["w"]

    assert mj.check_jacobian(right, (params, x), semantics="masked", fast=fast)

    def wrong(p, v):
        return mnp.sum(mnp.tanh(v * p["a"]), axis=1) @ p["w"] + _scaled_wrong(p["b"], 3.0)

    report = mj.check_jacobian(wrong, (params, x), semantics="masked", fast=fast, raise_exception=False)
    assert not report
    failed = {c.input for c in report.failures()}
    assert failed and all("'b'" in name for name in failed), failed

    def leaky(p, v):
        return right(p, v) + jnp.sum(v.data) * p["b"]

    assert not mj.check_jacobian(leaky, (params, x), semantics="masked", fast=fast, raise_exception=False)


@pytest.mark.parametrize("name", ["correct", "wrong derivative", *LEAKY])
def test_tables_judged_on_the_host_and_by_a_compiled_program_agree(monkeypatch, name):
    """On the CPU numpy judges the full tables (no program to compile); on an accelerator a compiled
    program judges them where they are. Both verdicts are the same, check by check, for a correct
    function, a wrong custom derivative and each leaky function."""
    import masked_jax.checking._check as check_module

    @jax.custom_jvp
    def wrong(x):
        return jnp.sin(x)

    wrong.defjvp(lambda p, t: (jnp.sin(p[0]), 1.5 * jnp.cos(p[0]) * t[0]))
    f = {
        "correct": lambda v: mnp.sum(mnp.sin(v) * v),
        "wrong derivative": lambda v: mnp.sum(mj.masked_array(wrong(v.data), v.mask)),
    }.get(name) or LEAKY[name][0]
    reports = {}
    for where, limit in (("host", check_module.HOST_JUDGE_MAX), ("program", -1)):
        monkeypatch.setattr(check_module, "HOST_JUDGE_MAX", limit)
        reports[where] = mj.check_jacobian(f, (_X,), semantics="masked", fast=False, raise_exception=False)
    host, program = reports["host"], reports["program"]
    assert [(c.input, c.mode, c.semantics, c.passed) for c in host.checks] == [
        (c.input, c.mode, c.semantics, c.passed) for c in program.checks
    ]
    for a, b in zip(host.checks, program.checks):
        np.testing.assert_allclose(a.max_abs, b.max_abs, rtol=1e-6, atol=1e-12)
    assert bool(host) is bool(program) is (name == "correct")


# Padding found by a sentinel value: the user pads with PAD, the function counts what is not PAD.
# No random fill and no probe value (NaN, +-inf, a huge value) is PAD, so only the user's own data
# under the masks (and zeros there) show that the valid outputs move with the masked-out data.
SENTINEL_MASK = jnp.array([[True, True, False, False], [True, True, True, False]])


def _sentinel_input(pad):
    data = jnp.where(SENTINEL_MASK, jnp.array([[1.0, 2.0, 0, 0], [0.5, -1.5, 3.0, 0]]), pad)
    return mj.masked_array(data, SENTINEL_MASK)


SENTINELS = {  # name: (the user's padding, f)
    "zero_padding_nonzero_count": (0.0, lambda v: mnp.sum(v, axis=1) / jnp.sum(v.data != 0, axis=1)),
    "minus_one_padding": (-1.0, lambda v: mnp.sum(v, axis=1) * jnp.sum(v.data == -1, axis=1)),
    "zero_padding_where": (0.0, lambda v: mnp.sum(v * 2.0, axis=1) + jnp.sum(jnp.where(v.data == 0, 1.0, 0.0), axis=1)),
}


@pytest.mark.parametrize("semantics", ["masked", "both"])
@pytest.mark.parametrize("fast", [False, True], ids=["tables", "projections"])
@pytest.mark.parametrize("name", SENTINELS)
def test_sentinel_padding_fails_masked_semantics(name, fast, semantics):
    pad, f = SENTINELS[name]
    report = mj.check_jacobian(f, (_sentinel_input(pad),), semantics=semantics, fast=fast, raise_exception=False)
    assert "masked" not in report.satisfies
    failing = {k for c in report.checks for k, v in c.leaks.items() if not (np.isfinite(v) and v <= 1e-6)}
    assert "valid outputs vs the given masked-out data" in failing, failing
    assert "valid outputs vs the given masked-out data" in repr(report)


def test_sentinel_padding_fails_assert_jacobian_with_parameters():
    """The notebook's case: parameters and a zero-padded input, the count of tokens taken by ``!= 0``."""
    from masked_jax.testing import assert_jacobian

    params = {"w": jnp.array([0.3, -0.7]), "b": jnp.array(0.1)}
    x = _sentinel_input(0.0)

    def loss(p, v):
        return (mnp.sum(v, axis=1) * p["w"] + p["b"]) / jnp.sum(v.data != 0, axis=1)

    with pytest.raises(mj.JacobianError, match="the given masked-out data"):
        assert_jacobian(loss, (params, x))
    # the same model counting its tokens by the mask passes
    assert_jacobian(lambda p, v: (mnp.sum(v, axis=1) * p["w"] + p["b"]) / jnp.sum(v.mask, axis=1), (params, x))


@pytest.mark.parametrize("fast", [False, True], ids=["tables", "projections"])
def test_masked_function_passes_with_any_given_data_under_the_masks(fast):
    """The user's data under the masks may hold anything (NaN, inf, the valid values again): a
    function with masked semantics still passes."""
    data = jnp.where(
        SENTINEL_MASK, jnp.array([[1.0, 2.0, 0, 0], [0.5, -1.5, 3.0, 0]]), jnp.array([jnp.nan, jnp.inf, -jnp.inf, 7.0])
    )
    x = mj.masked_array(data, SENTINEL_MASK)
    report = mj.check_jacobian(lambda v: mnn.softmax(v, axis=1), (x,), semantics="masked", fast=fast)
    assert report.satisfies == ("masked",)
