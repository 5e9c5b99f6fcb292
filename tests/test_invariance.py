"""``mj.check_invariance``: re-padded inputs (other lengths, positions, NaN/inf/huge content), eager,
under jit and under vmap; masked_jax functions pass, padding bugs in real flax and equinox models are
caught with the first changed output named, and their fixes pass."""

import concurrent.futures

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from harness import backend_compiles

import masked_jax as mj
import masked_jax.nn as mnn
import masked_jax.numpy as mnp


def tokens(dtype=np.float32, shape=(3, 5, 4), seed=0):
    """(B, L, D) token features with a (B, L, 1) token mask, rows of different lengths."""
    rng = np.random.default_rng(seed)
    mask = np.zeros(shape[:2] + (1,), bool)
    for b, n in enumerate([2, shape[1] - 1, 3][: shape[0]]):
        mask[b, rng.choice(shape[1], n, replace=False)] = True  # valid positions anywhere, padding between
    return mj.masked_array(jnp.asarray(rng.normal(size=shape), dtype), jnp.asarray(mask))


MASKED_FUNCTIONS = {
    "mean over tokens": lambda w, v: mnp.mean(v @ w, axis=1),
    "softmax over tokens": lambda w, v: mnn.softmax(mnp.sum(v @ w, axis=2), axis=1),
    "elementwise": lambda w, v: mnp.tanh(v @ w),
    "max over tokens": lambda w, v: mnp.max(v @ w, axis=1),
}


EVERY_FILL = ("zero", "nan", "inf", "-inf", "huge")
# (name, dtype, lengths, positions, fills): every option for one function, a share for the others
INVARIANT_CASES = [
    ("mean over tokens", np.float32, ("tight", "same", "longer"), ("end", "start", "scattered"), EVERY_FILL),
    ("softmax over tokens", np.float64, ("tight", "longer"), ("end", "start"), ("zero", "nan", "inf")),
    ("elementwise", np.float32, ("same", "longer"), ("start", "scattered"), ("nan", "-inf", "huge")),
    ("max over tokens", np.float64, ("tight", "longer"), ("scattered",), EVERY_FILL),
]


@pytest.mark.parametrize("name,dtype,lengths,positions,fills", INVARIANT_CASES, ids=[c[0] for c in INVARIANT_CASES])
def test_masked_functions_are_padding_invariant(name, dtype, lengths, positions, fills):
    x = tokens(dtype)
    w = jnp.asarray(np.random.default_rng(1).normal(size=(4, 3)), dtype)
    report = mj.check_invariance(
        MASKED_FUNCTIONS[name], (w, x), axis=1, params=(0,), lengths=lengths, positions=positions, fills=fills
    )  # the suite runs with x64 enabled
    assert report, name
    # every length x position x content under eager, jit and vmap
    assert {c.transform for c in report.cases} == {"eager", "jit", "vmap"}
    assert len(report.cases) == len(lengths) * len(positions) * 3 * len(fills), name


def test_padding_bugs_are_caught_and_named():
    x = tokens()
    w = jnp.ones((4,), jnp.float32)
    # a mean over the padded length counts the padding: caught by the pad length, at the first output
    r = mj.check_invariance(lambda v: jnp.mean(v.filled(0), axis=1), (x,), axis=1, raise_exception=False)
    assert not r and r.first_failure.first[0] == "out"
    assert "zero content" in str(r)  # no NaN needed: a longer pad of zeros moves it
    # reading the data under the mask: NaN content reaches the output
    r = mj.check_invariance(
        lambda v: jnp.sum(v.data * v.mask.astype(v.dtype), axis=1), (x,), axis=1, raise_exception=False
    )
    bad = r.failures()
    assert bad and all(c.padding.endswith(("nan content", "inf content")) for c in bad)
    assert np.isnan(bad[0].first[3])
    # the jnp.where trap: the value is right, the parameter gradient is NaN
    trap = lambda w, v: jnp.sum(jnp.where(v.mask, jnp.log(jnp.abs(v.data @ w[:, None]) + 1), 0))
    r = mj.check_invariance(trap, (w, x), axis=1, params=(0,), raise_exception=False)
    assert not r
    assert r.first_failure.first[0].startswith("grad args[0]")
    assert all(c.first[0].startswith("grad") for c in r.failures())  # the outputs never moved
    with pytest.raises(mj.InvarianceError, match=r"grad args\[0\]"):
        mj.check_invariance(trap, (w, x), axis=1, params=(0,))


def test_positions_matter_for_lengths_based_code():
    """Code that takes lengths assumes right padding: left padding is a bug it has, and the check says so."""

    def last_token(v, lengths):  # hand-masked: the last valid token by length
        return jnp.take_along_axis(v, (lengths - 1)[:, None, None], axis=1)[:, 0]

    f = lambda v: last_token(v.data, v.mask[..., 0].sum(1))
    right = tokens(shape=(2, 6, 3))
    keep = np.asarray(right.mask[..., 0])
    order = np.argsort(~keep, axis=1, kind="stable")  # the same tokens, right-padded
    data = np.take_along_axis(np.asarray(right.data), order[..., None], 1)
    right = mj.masked_array(jnp.asarray(data), jnp.asarray(np.take_along_axis(keep, order, 1))[..., None])
    assert mj.check_invariance(f, (right,), axis=1, positions=("end",))
    r = mj.check_invariance(f, (right,), axis=1, positions=("end", "start"), raise_exception=False)
    assert not r and all(" at start" in c.padding for c in r.failures())


def test_plain_array_outputs_are_compacted_along_out_axis():
    x = tokens()
    hand = lambda v: jnp.where(v.mask, v.data * 2.0, 0.0)  # a hand-masked (B, L, D) output
    assert mj.check_invariance(hand, (x,), axis=1, out_axis=1)
    r = mj.check_invariance(hand, (x,), axis=1, raise_exception=False)  # compared whole: the length changes
    assert not r and r.first_failure.first[1] == "shape"


class Pool(nn.Module):
    """A flax encoder over padded tokens, pooling by mean: ``bug="mean"`` divides by the padded
    length, ``bug="nan"`` masks the mean but not the input (NaN padding reaches the gradient),
    ``bug=None`` is the fixed model."""

    bug: str | None

    @nn.compact
    def __call__(self, x, mask):
        if self.bug != "nan":
            x = jnp.where(mask[..., None], x, 0)
        h = nn.relu(nn.Dense(8)(x))
        if self.bug == "mean":
            pooled = jnp.mean(h * mask[..., None], axis=1)
        else:
            pooled = jnp.sum(jnp.where(mask[..., None], h, 0), 1) / jnp.maximum(mask.sum(1, keepdims=True), 1)
        return nn.Dense(2)(pooled)


@pytest.mark.parametrize("bug", ["mean", "nan", None])
def test_a_flax_model_with_a_padding_bug_is_caught_and_its_fix_passes(bug):
    x = tokens()
    model = Pool(bug)
    params = model.init(jax.random.PRNGKey(0), x.data, x.mask[..., 0])
    report = mj.check_invariance(
        lambda p, t: model.apply(p, t.data, t.mask[..., 0]), (params, x), axis=1, params=(0,), raise_exception=False
    )
    if bug is None:
        assert report, report
        return
    assert not report
    what = report.first_failure.first[0]
    if bug == "mean":
        assert what == "out" and report.first_failure.padding.endswith("zero content")
    else:  # the outputs are right; NaN reaches the Dense kernel's gradient through 0 * NaN
        assert all(c.first[0].startswith("grad args[0]") for c in report.failures())
        assert "kernel" in what


class EqxPool(eqx.Module):
    dense: eqx.nn.Linear
    head: eqx.nn.Linear
    masked_mean: bool

    def __init__(self, key, masked_mean):
        k1, k2 = jax.random.split(key)
        self.dense = eqx.nn.Linear(4, 8, key=k1)
        self.head = eqx.nn.Linear(8, 2, key=k2)
        self.masked_mean = masked_mean

    def __call__(self, x, mask):  # one sequence: (L, D), (L,)
        h = jax.nn.relu(jax.vmap(self.dense)(jnp.where(mask[:, None], x, 0)))
        if self.masked_mean:
            pooled = jnp.sum(jnp.where(mask[:, None], h, 0), 0) / jnp.maximum(mask.sum(), 1)
        else:
            pooled = jnp.mean(h, 0)  # the padding's relu(bias) counts
        return self.head(pooled)


@pytest.mark.parametrize("masked_mean", [False, True])
def test_equinox_model(masked_mean):
    x = tokens()
    model = EqxPool(jax.random.PRNGKey(1), masked_mean)
    f = lambda m, t: jax.vmap(m)(t.data, t.mask[..., 0])
    report = mj.check_invariance(f, (model, x), axis=1, params=(0,), raise_exception=False)
    assert bool(report) == masked_mean, report
    if not masked_mean:
        assert report.first_failure.first[0] == "out"


def test_bad_arguments():
    x = tokens()
    with pytest.raises(TypeError, match="no MaskedArray"):
        mj.check_invariance(jnp.sum, (jnp.ones(3),))
    with pytest.raises(ValueError, match="axis 5 is out of range"):
        mj.check_invariance(lambda v: v, (x,), axis=5)
    with pytest.raises(ValueError, match="positions must be"):
        mj.check_invariance(lambda v: v, (x,), axis=1, positions=("middle",))
    with pytest.raises(ValueError, match="params must hold positions"):
        mj.check_invariance(lambda v: v, (x,), axis=1, params=(3,))
    with pytest.raises(ValueError, match="disagree on the length"):
        mj.check_invariance(lambda a, b: a, (x, tokens(shape=(3, 6, 4))), axis=1)
    with pytest.raises(TypeError, match="must be callable"):
        mj.check_invariance(3, (x,))
    with pytest.raises(ValueError, match="rtol must be a finite number"):
        mj.check_invariance(lambda v: v, (x,), axis=1, rtol=-1.0)
    with pytest.raises(TypeError, match="axis must be an int"):
        mj.check_invariance(lambda v: v, (x,), axis="1")
    with pytest.raises(TypeError, match="out_axis must be None or an int"):
        mj.check_invariance(lambda v: v, (x,), axis=1, out_axis=1.5)
    # one name instead of a sequence is one option, not its letters
    r = mj.check_invariance(
        lambda v: mnp.sum(v, axis=1), (x,), axis=1, lengths="longer", positions="start", fills="nan", transforms="jit"
    )
    assert [c.padding for c in r.cases] == ["pad to 8 (longer) at start, nan content"]


@pytest.mark.parametrize(
    "shape, axis, other", [((2, 0), -1, 0), ((0, 3), -1, -1), ((2, 0, 3), 1, 2)], ids=["no_positions", "no_rows", "3d"]
)
def test_inputs_with_a_zero_size_axis_are_re_padded(shape, axis, other):
    """Inputs with no positions along the padded axis (every re-padding is pads only) or no rows
    before it are re-padded like any other; an elementwise op and a reduction over another axis
    are unchanged by it."""
    x = mj.masked_array(jnp.zeros(shape), jnp.zeros(shape, bool))
    for f in (mnp.sin, lambda v: mnp.sum(v, axis=other)):
        report = mj.check_invariance(f, (x,), axis=axis)
        assert report and "PASSED" in str(report)


class _Tokens(nn.Module):
    @nn.compact
    def __call__(self, x):
        return jnp.mean(nn.Dense(3)(jnp.tanh(nn.Dense(5)(x))), axis=1)


def _token_model(scale):
    """A new maskify'd flax model (a new function object each call) scaled by ``scale``."""
    return mj.maskify(lambda p, v: _Tokens().apply(p, v) * scale)


def test_a_re_run_with_the_same_code_reuses_the_compiled_programs():
    """A re-run notebook cell: a new function with the same code, and other parameters. Its check
    compiles nothing (the programs are found by the function's structure, its constants passed
    in), and a function that differs only in a captured number still checks its own number."""
    mask = jnp.asarray(np.arange(5)[None, :] < np.array([[5], [3], [2]]))[..., None]
    x = mj.masked_array(jnp.asarray(np.random.default_rng(3).normal(size=(3, 5, 4))), mask)
    params = _Tokens().init(jax.random.key(0), x.data)
    first, n_first = backend_compiles(lambda: mj.check_invariance(_token_model(2.0), (params, x), axis=1, params=(0,)))
    other = jax.tree_util.tree_map(lambda a: a * 1.5, params)
    again, n_again = backend_compiles(lambda: mj.check_invariance(_token_model(2.0), (other, x), axis=1, params=(0,)))
    assert bool(first) and bool(again) and len(again.cases) == len(first.cases)
    assert n_first > 0 and n_again == 0, (n_first, n_again)
    # a captured constant that breaks invariance is this function's, not the cached one's
    for c, ok in ((0.0, True), (1.0, False), (0.0, True)):  # c times a sum over the padded length / its size
        model = _token_model(2.0)

        def f(p, v, c=c, model=model):
            return model(p, v) + c * jnp.sum(v.filled(0.0)) / v.shape[1]

        report = mj.check_invariance(f, (other, x), axis=1, params=(0,), raise_exception=False)
        assert bool(report) == ok, c


def test_an_eager_gradient_of_masked_code_runs_its_compiled_program():
    """``jax.grad`` of a maskify'd model outside ``jit``: the masked program is compiled (with its
    derivative) once; a new function with the same code compiles nothing, and the gradient equals
    the jitted one."""
    mask = jnp.asarray(np.arange(5)[None, :] < np.array([[5], [3]]))[..., None]
    x = mj.masked_array(jnp.asarray(np.random.default_rng(4).normal(size=(2, 5, 4))), mask)
    params = _Tokens().init(jax.random.key(1), x.data)

    def loss(model):
        return lambda p: jnp.sum(model(p, x).data)

    g1, n1 = backend_compiles(lambda: jax.grad(loss(_token_model(2.0)))(params))
    g2, n2 = backend_compiles(lambda: jax.grad(loss(_token_model(2.0)))(params))
    assert n1 > 0 and n2 == 0, (n1, n2)
    want = jax.jit(jax.grad(loss(_token_model(2.0))))(params)
    jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-12), g2, want)


def test_a_gradient_zero_but_for_round_off_is_compared_on_the_whole_gradient_s_scale():
    """A parameter whose gradient is 0 but for round-off (a bias that a softmax cancels: its
    gradient is a sum of terms that cancel) may move by round-off of the gradient's size; a real
    change of that parameter's gradient is still found."""
    from masked_jax.checking._invariance import _first_change

    ref = {0: np.array([0.5, -2.0]), 1: np.array([1.4e-17])}
    outs = [((np.array([1.0]), None), "out")]
    assert _first_change(outs, outs, ref, {0: ref[0], 1: np.array([-2.1e-17])}, 1e-10, ["w", "b"]) is None
    moved = _first_change(outs, outs, ref, {0: ref[0], 1: np.array([1e-6])}, 1e-10, ["w", "b"])
    assert moved is not None and moved[0] == "grad b" and moved[1] == (0,)
    # a whole gradient of round-off: nothing to compare against but itself
    tiny = {0: np.array([1e-17])}
    assert _first_change(outs, outs, tiny, {0: np.array([3e-17])}, 1e-10, ["b"]) is not None


@pytest.mark.parametrize("bug", [False, True], ids=["invariant", "divides-by-padded-length"])
def test_compiled_cases_in_worker_threads_give_the_serial_report(monkeypatch, bug):
    """The compiled cases run in worker threads, one per padded length, beside the eager ones
    (unless ``MJ_CHECK_BACKGROUND=0``): the report is the serial one, case for case, for a model
    with parameters at three padded lengths, whether it passes or fails."""
    w = jnp.linspace(-1.0, 1.0, 12).reshape(4, 3)
    x = mj.masked_array(jnp.arange(24.0).reshape(2, 3, 4) / 10, jnp.array([[1, 1, 0], [1, 0, 0]], bool)[..., None])

    def f(p, v):
        h = jnp.tanh(v.filled(0.0) @ p)
        m = v.mask[..., :1]
        return jnp.mean(h, axis=1) if bug else jnp.sum(h * m, axis=1) / jnp.sum(m, axis=1)

    reports, submitted = {}, []
    submit = concurrent.futures.ThreadPoolExecutor.submit
    monkeypatch.setattr(
        concurrent.futures.ThreadPoolExecutor, "submit", lambda pool, *a: submitted.append(1) or submit(pool, *a)
    )
    for flag in ("0", "1"):
        monkeypatch.setenv("MJ_CHECK_BACKGROUND", flag)
        reports[flag] = mj.check_invariance(f, (w, x), axis=1, params=(0,), raise_exception=False)
        assert len(submitted) == (3 if flag == "1" else 0)  # one job group per padded length
    serial, threaded = reports["0"], reports["1"]
    assert len({c.padding.split(" (")[0] for c in threaded.cases}) == 3  # lengths 2, 3 and 6
    assert [(c.padding, c.transform, c.passed) for c in threaded.cases] == [
        (c.padding, c.transform, c.passed) for c in serial.cases
    ]
    assert [c.first and c.first[:2] for c in threaded.cases] == [c.first and c.first[:2] for c in serial.cases]
    assert bool(threaded) is (not bug)


def test_eager_cases_trace_a_maskified_function_once_per_padded_length(monkeypatch):
    """maskify traces on shapes, never on values, so the eager cases of one padded length (every
    position of the pads, every content) share one trace of ``f``; a maskify'd function with a
    padding bug (a mean over the padded length) is still caught eagerly at every content; and
    outside the check each eager call traces again, as maskify's eager calls do."""
    monkeypatch.delenv("MJ_CHECK_BACKGROUND", raising=False)  # (eager cases only: no worker thread either way)
    traces = []

    def body(v):
        traces.append(v.shape)  # runs once per trace
        return jnp.mean(v, axis=1)

    f = mj.maskify(body)
    x = tokens()
    r = mj.check_invariance(f, (x,), axis=1, transforms=("eager",))
    assert r and len(r.cases) >= 30  # eager calls: 3 padded lengths x 3 positions x 5 contents and more
    lengths = {shape[1] for shape in traces}
    # one trace per padded length (tight, same, longer) and one of the given arguments (their
    # mask's own layout), against one per call before
    assert len(lengths) <= 3 and len(traces) <= len(lengths) + 1, traces
    leaky = mj.maskify(lambda v: v[:, 0] * 2.0)  # the first position: a pad when the pads lead
    bad = mj.check_invariance(leaky, (x,), axis=1, transforms=("eager",), raise_exception=False)
    assert not bad and all(c.transform == "eager" for c in bad.failures())
    traces.clear()
    f(x)
    f(x)
    assert len(traces) == 2
