"""masked_jax.testing: the assertion helpers, and the pytest plugin's ``--mj-report`` files."""

from __future__ import annotations

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import masked_jax as mj
import masked_jax.numpy as mnp
from masked_jax.testing import assert_invariant, assert_jacobian
from masked_jax.testing._plugin import report_path

pytest_plugins = ["pytester"]

X = mj.masked_array(jnp.array([0.5, 1.0, 2.0, -1.0]), jnp.array([True, True, False, True]))
TOKENS = mj.masked_array(jnp.arange(8.0).reshape(2, 4), jnp.array([[1, 1, 1, 0], [1, 0, 0, 0]], bool))


def test_assert_jacobian_returns_the_report_of_a_passing_check():
    report = assert_jacobian(lambda v: mnp.sum(mnp.sin(v) * v), (X,))
    assert isinstance(report, mj.JacobianReport) and bool(report)
    assert report.satisfies == ("masked",)


def test_assert_jacobian_raises_an_assertion_error_carrying_the_report():
    with pytest.raises(AssertionError) as info:
        assert_jacobian(lambda v: jnp.sum(jnp.sin(v.data)), (X,))
    err = info.value
    assert isinstance(err, mj.JacobianError) and not err.report
    text = str(err)
    assert text == repr(err.report)
    assert "FAILED: fails masked semantics" in text and "leak map" in text
    assert "x[2]" in text or "[2]" in text  # the masked-out element that leaks is named


def test_assert_jacobian_checks_masked_semantics_by_default():
    """A function that reads the data under the mask has dense semantics: check_jacobian's default
    ("both") accepts it, the assertion (masked, by default) does not, unless asked for dense."""
    leaky = lambda v: jnp.sum(v.data**2)
    assert bool(mj.check_jacobian(leaky, (X,), raise_exception=False))
    with pytest.raises(mj.JacobianError):
        assert_jacobian(leaky, (X,))
    assert bool(assert_jacobian(leaky, (X,), semantics="dense"))


def test_assert_invariant_passes_and_fails_as_check_invariance():
    report = assert_invariant(lambda v: mnp.mean(v, axis=1), (TOKENS,), axis=1)
    assert isinstance(report, mj.InvarianceReport) and bool(report)
    with pytest.raises(AssertionError) as info:
        assert_invariant(lambda v: jnp.mean(v.filled(0), axis=1), (TOKENS,), axis=1)
    err = info.value
    assert isinstance(err, mj.InvarianceError) and str(err) == repr(err.report)
    assert "[FAIL]" in str(err) and err.report.first_failure.first[0] == "out"


def test_an_invariance_report_as_html_lists_every_failing_case(tmp_path):
    report = mj.check_invariance(lambda v: jnp.mean(v.filled(0), axis=1), (TOKENS,), axis=1, raise_exception=False)
    page = report.to_html()
    assert "Invariance check FAILED" in page
    assert page.count("<tr>") == len(report.failures()) + 1  # a header and one row per failing case
    report.save_html(tmp_path / "r.html")
    assert (tmp_path / "r.html").read_text().startswith("<!DOCTYPE html>")


_SUITE = """
import jax.numpy as jnp
import masked_jax as mj
import masked_jax.numpy as mnp
from masked_jax.testing import assert_invariant, assert_jacobian

X = mj.masked_array(jnp.array([0.5, 1.0, 2.0]), jnp.array([True, True, False]))
T = mj.masked_array(jnp.ones((2, 4)), jnp.array([[1, 1, 0, 0], [1, 1, 1, 0]], bool))

def test_leak():
    assert_jacobian(lambda v: jnp.sum(jnp.sin(v.data)), (X,))

def test_padded_mean():
    assert_invariant(lambda v: jnp.mean(v.filled(0), axis=1), (T,), axis=1)

def test_raised_by_the_check_itself():
    mj.check_jacobian(lambda v: jnp.sum(v.data), (X,), semantics="masked")

def test_passes():
    assert_jacobian(lambda v: mnp.sum(mnp.sin(v)), (X,))

def test_fails_otherwise():
    assert 1 == 2
"""


def test_the_plugin_writes_the_report_of_each_failing_check(pytester, tmp_path):
    pytester.makepyfile(test_suite=_SUITE)
    out = tmp_path / "reports"
    result = pytester.runpytest("--mj-report", str(out), "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, failed=4)
    written = sorted(p.name for p in out.iterdir())
    want = {name: report_path(out, f"test_suite.py::{name}").name for name in ("test_leak", "test_padded_mean")}
    want["test_raised_by_the_check_itself"] = report_path(out, "test_suite.py::test_raised_by_the_check_itself").name
    assert written == sorted(want.values())  # no file for the passing test, nor for a plain assert
    assert "Jacobian check FAILED" in (out / want["test_leak"]).read_text()
    assert "Invariance check FAILED" in (out / want["test_padded_mean"]).read_text()
    assert "Jacobian check FAILED" in (out / want["test_raised_by_the_check_itself"]).read_text()
    result.stdout.fnmatch_lines(["*check report written to*test_suite.py_test_leak-*.html*"])


_LONG_IDS = """
import jax.numpy as jnp
import pytest
import masked_jax as mj
from masked_jax.testing import assert_jacobian

X = mj.masked_array(jnp.array([0.5, 1.0, 2.0]), jnp.array([True, True, False]))

# ids past any file name's length, and ids that differ only in punctuation
IDS = ["a" * 300, "a" * 299 + "b", "x.y", "x-y", "x/y", "x y"]
@pytest.mark.parametrize("name", IDS, ids=IDS)
def test_leak(name):
    assert_jacobian(lambda v: jnp.sum(jnp.sin(v.data)), (X,))
"""


def test_the_plugin_writes_one_bounded_file_per_test_id(pytester, tmp_path):
    """A test id of hundreds of characters does not abort the session (the file name is bounded),
    and ids that differ only in punctuation, or only past the readable part, get files of their own."""
    pytester.makepyfile(test_suite=_LONG_IDS)
    out = tmp_path / "reports"
    result = pytester.runpytest("--mj-report", str(out), "-p", "no:cacheprovider")
    result.assert_outcomes(failed=6)
    assert "INTERNALERROR" not in result.stdout.str()
    written = sorted(out.iterdir())
    assert len(written) == 6  # one page per test, none overwritten
    assert all(len(p.name) <= 128 for p in written)
    assert all("Jacobian check FAILED" in p.read_text() for p in written)
    ids = [f"test_suite.py::test_leak[{n}]" for n in ("a" * 300, "a" * 299 + "b", "x.y", "x-y", "x/y", "x y")]
    assert sorted(p.name for p in written) == sorted(report_path(out, i).name for i in ids)
    assert report_path(out, ids[2]).name.startswith("test_suite.py_test_leak_x.y-")  # readable


def test_without_the_option_the_plugin_writes_nothing(pytester):
    pytester.makepyfile(test_suite=_SUITE)
    result = pytester.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, failed=4)
    assert not list(pytester.path.rglob("*.html"))
    assert "--mj-report" in "\n".join(pytester.runpytest("--help").outlines)


def test_the_test_file_in_the_docs_runs_and_passes():
    """docs/jacobians.md's test file, as written: its tests pass."""
    import pathlib
    import re

    text = (pathlib.Path(__file__).parent.parent / "docs" / "jacobians.md").read_text()
    section = text[text.index("## In a test suite") :]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    scope: dict = {}
    exec(compile(code, "docs/jacobians.md", "exec"), scope)
    tests = [v for k, v in scope.items() if k.startswith("test_")]
    assert len(tests) == 2
    for test in tests:
        test()


# -- planted padding bugs in models, found by the assertions (and their fixes passing) ---------------
_MASK = jnp.asarray(np.arange(6)[None, :] < np.array([[6], [4], [3]]))
_TOKENS = mj.masked_array(jnp.asarray(np.random.default_rng(0).normal(size=(3, 6, 4))), _MASK[..., None])


def _pooled(h, m):
    return jnp.sum(h * m[..., None], axis=1) / jnp.sum(m, axis=1, keepdims=True)


class _Attention(nn.Module):
    """Attention by hand; ``keys_masked=False`` is the bug: the softmax runs over padded keys."""

    keys_masked: bool

    @nn.compact
    def __call__(self, v, m):
        v = jnp.where(m[..., None], v, 0.0)
        scores = nn.Dense(4)(v) @ jnp.swapaxes(nn.Dense(4)(v), 1, 2)
        if self.keys_masked:
            scores = jnp.where(m[:, None, :], scores, -jnp.inf)
        return _pooled(jax.nn.softmax(scores, axis=-1) @ v, m)


class _BiasColumn(nn.Module):
    """A constant column joined to the features; ``valid_mean=False`` is the bug: the padded
    positions' constant column makes them count in the mean."""

    valid_mean: bool

    @nn.compact
    def __call__(self, v, m):
        v = jnp.where(m[..., None], v, 0.0)
        h = nn.Dense(3)(jnp.concatenate([v, jnp.ones_like(v[..., :1])], -1))
        return _pooled(h, m) if self.valid_mean else jnp.mean(h, axis=1)


class _EqxBiasColumn(eqx.Module):
    linear: eqx.nn.Linear
    valid_mean: bool = eqx.field(static=True)

    def __call__(self, v, m):
        v = jnp.where(m[..., None], v, 0.0)
        h = jax.vmap(jax.vmap(self.linear))(jnp.concatenate([v, jnp.ones_like(v[..., :1])], -1))
        return _pooled(h, m) if self.valid_mean else jnp.mean(h, axis=1)


class _MeanPool(nn.Module):
    """``valid_mean=False`` is the bug: a mean over the padded length (the padding zeroed)."""

    valid_mean: bool

    @nn.compact
    def __call__(self, v, m):
        h = jnp.where(m[..., None], nn.Dense(3)(jnp.where(m[..., None], v, 0.0)), 0.0)
        return _pooled(h, m) if self.valid_mean else jnp.mean(h, axis=1)


class _EqxMeanPool(eqx.Module):
    linear: eqx.nn.Linear
    valid_mean: bool = eqx.field(static=True)

    def __call__(self, v, m):
        h = jnp.where(m[..., None], jax.vmap(jax.vmap(self.linear))(jnp.where(m[..., None], v, 0.0)), 0.0)
        return _pooled(h, m) if self.valid_mean else jnp.mean(h, axis=1)


def _flax_case(module):
    params = module.init(jax.random.key(0), _TOKENS.data, _MASK)
    return (lambda p, t: module.apply(p, t.data, t.mask[..., 0])), params


def _eqx_case(flag, module=_EqxBiasColumn, features=5):
    """``(f, params)`` of ``module(linear, flag)``, a linear layer of ``features`` inputs."""
    model = module(eqx.nn.Linear(features, 3, key=jax.random.key(0)), flag)
    params, static = eqx.partition(model, eqx.is_inexact_array)
    return (lambda p, t: eqx.combine(p, static)(t.data, t.mask[..., 0])), params


@pytest.mark.parametrize(
    "name, case",
    [
        ("flax: softmax over padded keys", lambda fixed: _flax_case(_Attention(keys_masked=fixed))),
        ("flax: a constant column made valid", lambda fixed: _flax_case(_BiasColumn(valid_mean=fixed))),
        ("equinox: a constant column made valid", _eqx_case),
        ("flax: a mean over the padded length", lambda fixed: _flax_case(_MeanPool(valid_mean=fixed))),
        ("equinox: a mean over the padded length", lambda fixed: _eqx_case(fixed, _EqxMeanPool, 4)),
    ],
)
def test_planted_padding_bugs_are_found_and_their_fixes_pass(name, case):
    """Each bug moves a valid output when the padding changes: ``assert_invariant`` fails and its
    report names the output and the entry that moved; the fixed model passes."""
    f, params = case(False)
    with pytest.raises(mj.InvarianceError) as info:
        assert_invariant(f, (params, _TOKENS), axis=1, params=(0,))
    what, index, expected, got = info.value.report.first_failure.first
    assert what == "out" and len(index) == 2 and expected != got, name
    assert f"out{list(index)} changed" in str(info.value)
    f, params = case(True)
    assert bool(assert_invariant(f, (params, _TOKENS), axis=1, params=(0,))), name


def _leaky(layer, bug, d, m):
    """``bug="data"``: the padded data reach the output (``t.data`` read as if valid);
    ``bug="where"``: ``jnp.where(m, log|layer(data)|, 0)``, right forward, but its backward pass
    multiplies what the padding makes of the layer by 0, NaN for NaN padding; ``bug=None``: both
    written right (the padding zeroed before the layer and the sum)."""
    clean = jnp.where(m[..., None], d, 0.0)
    h = jnp.where(m[..., None], jnp.log(jnp.abs(layer(d if bug == "where" else clean)) + 1.0), 0.0)
    extra = (d if bug == "data" else clean)[..., :1]
    return _pooled(h, m) + 0.1 * jnp.sum(extra, axis=1)


class _Leaky(nn.Module):
    bug: str | None

    @nn.compact
    def __call__(self, d, m):
        return _leaky(nn.Dense(3), self.bug, d, m)


class _EqxLeaky(eqx.Module):
    linear: eqx.nn.Linear
    bug: str | None = eqx.field(static=True)

    def __call__(self, d, m):
        return _leaky(jax.vmap(jax.vmap(self.linear)), self.bug, d, m)


def _leaky_case(framework, bug):
    return _flax_case(_Leaky(bug)) if framework == "flax" else _eqx_case(bug, _EqxLeaky, 4)


_PADDED = [(1, 4), (1, 5), (2, 3), (2, 4), (2, 5)]  # _TOKENS' padded (batch, position) pairs


@pytest.mark.parametrize("framework", ["flax", "equinox"])
def test_an_x_data_leak_is_located_at_every_padded_position(framework):
    """A model that reads the padded data fails ``assert_jacobian`` on the padded input only (not
    on its parameters); the leak map's summary names every padded (batch, position) pair and lists
    every leaking element, however many there are; the fixed model passes."""
    f, params = _leaky_case(framework, "data")
    with pytest.raises(mj.JacobianError) as info:
        assert_jacobian(f, (params, _TOKENS))
    report = info.value.report
    failing = {c.input for c in report.failures()}
    assert failing == {"args[1]"}, failing
    check = report.failures()[0]
    # feature 0 of each padded position reaches the 3 outputs of its batch row
    assert len(check.leak_map) == len(_PADDED) * 3
    assert {tuple(i[:2]) for i, _, _ in check.leak_map} == set(_PADDED)
    text = str(info.value)
    assert "at (batch, position) of args[1]: " + ", ".join(f"({b}, {p})" for b, p in _PADDED) in text
    assert f"leak map: {len(_PADDED)} masked-out elements of args[1] reach 6 valid elements of out" in text
    for b, p in _PADDED:
        assert f"args[1][{b}, {p}, 0] -> out[{b}, 0], out[{b}, 1], out[{b}, 2]: value" in text
    f, params = _leaky_case(framework, None)
    assert bool(assert_jacobian(f, (params, _TOKENS)))


@pytest.mark.parametrize("framework", ["flax", "equinox"])
def test_a_where_trap_in_the_gradient_is_located_at_the_parameters_it_poisons(framework):
    """``jnp.where(m, log|layer(data)|, 0)``: the values are right, but NaN in the padding reaches the
    layer's weight gradient. ``assert_jacobian`` fails the weight's check, by its pytree path, for
    that reason; the fixed model passes."""
    f, params = _leaky_case(framework, "where")
    with pytest.raises(mj.JacobianError) as info:
        assert_jacobian(f, (params, _TOKENS))
    poisoned = {c.input: c for c in info.value.report.failures() if c.input != "args[1]"}
    weight = "args[0]['params']['Dense_0']['kernel']" if framework == "flax" else "args[0].linear.weight"
    assert weight in poisoned, sorted(poisoned)
    leaks = poisoned[weight].leaks
    assert not leaks["VJP to valid inputs with NaN under the masks"] <= 1e-5
    assert "valid outputs with NaN under the masks" not in leaks  # the outputs are right: not charged here
    f, params = _leaky_case(framework, None)
    assert bool(assert_jacobian(f, (params, _TOKENS)))
