"""maskify: plain jax.numpy code run with masked semantics, against masked_jax.numpy and by hand."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from harness import backend_compiles, primitive_count
from hypothesis import given, settings
from hypothesis import strategies as st
from jax import lax
from jax.lax import associative_scan as imported_associative_scan

import masked_jax as mj
import masked_jax._maskify._scan
import masked_jax.nn as mnn
import masked_jax.numpy as mnp
from masked_jax._maskify import _rules as primitives

RNG = np.random.default_rng(3)
MASK = RNG.random((3, 4)) > 0.3
MASK[0, 0], MASK[2, :] = True, False  # a fully masked row
X = mj.masked_array(jnp.asarray(np.where(MASK, RNG.uniform(0.1, 0.9, (3, 4)), np.nan)), jnp.asarray(MASK))
Y = mj.masked_array(jnp.asarray(RNG.uniform(0.1, 0.9, (3, 4))), jnp.asarray(RNG.random((3, 4)) > 0.2))
W = jnp.asarray(RNG.normal(size=(4, 2)))

UNARY = [
    "exp",
    "exp2",
    "log",
    "log1p",
    "log2",
    "log10",
    "expm1",
    "sqrt",
    "cbrt",
    "square",
    "reciprocal",
    "sin",
    "cos",
    "tan",
    "arcsin",
    "arccos",
    "arctan",
    "sinh",
    "cosh",
    "tanh",
    "arcsinh",
    "arctanh",
    "abs",
    "negative",
    "sign",
    "floor",
    "ceil",
    "round",
    "isfinite",
    "deg2rad",
]
NN_UNARY = ["relu", "sigmoid", "softplus", "silu", "log_sigmoid", "gelu"]
BINARY = [
    "add",
    "subtract",
    "multiply",
    "divide",
    "power",
    "maximum",
    "minimum",
    "arctan2",
    "hypot",
    "logaddexp",
    "equal",
    "less",
    "greater_equal",
]
REDUCE = ["sum", "prod", "mean", "var", "std", "max", "min", "ptp", "argmax", "argmin", "cumsum", "cumprod"]


def _unary(f):
    return lambda x, y: f(x)


TABLE = {}  # name -> (plain jnp function of (x, y), the masked_jax function of (x, y))
TABLE.update({f"jnp.{n}": (_unary(getattr(jnp, n)), _unary(getattr(mnp, n))) for n in UNARY})
TABLE.update({f"jax.nn.{n}": (_unary(getattr(jax.nn, n)), _unary(getattr(mnn, n))) for n in NN_UNARY})
TABLE.update(
    {
        f"jnp.{n}": (
            (lambda f: lambda x, y: f(x, y))(getattr(jnp, n)),
            (lambda f: lambda x, y: f(x, y))(getattr(mnp, n)),
        )
        for n in BINARY
    }
)
for _n in REDUCE:
    for _axis in (None, 1):
        TABLE[f"jnp.{_n}(axis={_axis})"] = (
            (lambda f, a: lambda x, y: f(x, axis=a))(getattr(jnp, _n), _axis),
            (lambda f, a: lambda x, y: f(x, axis=a))(getattr(mnp, _n), _axis),
        )
TABLE.update(
    {
        "jnp.var(ddof=1, axis=0)": (lambda x, y: jnp.var(x, axis=0, ddof=1), lambda x, y: mnp.var(x, axis=0, ddof=1)),
        "jnp.mean(keepdims)": (
            lambda x, y: jnp.mean(x, axis=1, keepdims=True),
            lambda x, y: mnp.mean(x, axis=1, keepdims=True),
        ),
        "jnp.linalg.norm(axis=1)": (lambda x, y: jnp.linalg.norm(x, axis=1), lambda x, y: mnp.norm(x, axis=1)),
        "jax.nn.logsumexp": (lambda x, y: jax.nn.logsumexp(x, axis=1), lambda x, y: mnp.logsumexp(x, axis=1)),
        "jax.nn.softmax": (lambda x, y: jax.nn.softmax(x, axis=1), lambda x, y: mnn.softmax(x, axis=1)),
        "jax.nn.log_softmax": (lambda x, y: jax.nn.log_softmax(x, axis=0), lambda x, y: mnn.log_softmax(x, axis=0)),
        "jnp.reshape": (lambda x, y: jnp.reshape(x, (4, 3)), lambda x, y: mnp.reshape(x, (4, 3))),
        "jnp.transpose": (_unary(jnp.transpose), _unary(mnp.transpose)),
        "jnp.flip": (lambda x, y: jnp.flip(x, 1), lambda x, y: mnp.flip(x, 1)),
        "jnp.roll": (lambda x, y: jnp.roll(x, 1, 1), lambda x, y: mnp.roll(x, 1, 1)),
        "jnp.tile": (lambda x, y: jnp.tile(x, 2), lambda x, y: mnp.tile(x, 2)),
        "jnp.repeat": (lambda x, y: jnp.repeat(x, 2, axis=0), lambda x, y: mnp.repeat(x, 2, axis=0)),
        "jnp.expand_dims": (lambda x, y: jnp.expand_dims(x, 1), lambda x, y: mnp.expand_dims(x, 1)),
        "jnp.concatenate": (lambda x, y: jnp.concatenate([x, y], 1), lambda x, y: mnp.concatenate([x, y], 1)),
        "jnp.stack": (lambda x, y: jnp.stack([x, y]), lambda x, y: mnp.stack([x, y])),
        "jnp.pad": (lambda x, y: jnp.pad(x, 1), lambda x, y: mnp.pad(x, 1)),
        "jnp.take": (
            lambda x, y: jnp.take(x, jnp.array([3, 0]), axis=1),
            lambda x, y: mnp.take(x, jnp.array([3, 0]), axis=1),
        ),
        "getitem": (lambda x, y: x[1:, jnp.array([0, 2])], lambda x, y: x[1:, jnp.array([0, 2])]),
        "at.set": (lambda x, y: x.at[0, 1].set(5.0), lambda x, y: x.at[0, 1].set(5.0)),
        # under maskify a scatter is a reduction: a masked update is dropped, the element keeps its
        # own validity (masked_jax.numpy's .at[].add follows numpy.ma and masks it)
        "at.add": (
            lambda x, y: x.at[:, 0].add(y[:, 1]),
            lambda x, y: x.at[:, 0].add(mnp.where(y.mask[:, 1], y[:, 1], 0.0).filled(0.0)),
        ),
        "jnp.sort": (lambda x, y: jnp.sort(x, axis=1), lambda x, y: mnp.sort(x, axis=1)),
        "jnp.where": (lambda x, y: jnp.where(x > 0.5, x, y), lambda x, y: mnp.where(x > 0.5, x, y)),
        "jnp.clip": (lambda x, y: jnp.clip(x, 0.3, 0.7), lambda x, y: mnp.clip(x, 0.3, 0.7)),
        "matmul": (lambda x, y: x @ W, lambda x, y: x @ W),
        "jnp.dot": (lambda x, y: jnp.dot(x, y.T), lambda x, y: mnp.dot(x, y.T)),
        "jnp.einsum": (lambda x, y: jnp.einsum("ij,kj->ik", x, y), lambda x, y: mnp.einsum("ij,kj->ik", x, y)),
        "jnp.tensordot": (lambda x, y: jnp.tensordot(x, y, axes=2), lambda x, y: mnp.tensordot(x, y, axes=2)),
        "jnp.outer": (lambda x, y: jnp.outer(x[0], x[1]), lambda x, y: mnp.outer(x[0], x[1])),
    }
)


def _same(got, want):
    got, want = mj.as_masked(got), mj.as_masked(want)
    assert got.shape == want.shape
    np.testing.assert_array_equal(np.asarray(got.mask), np.asarray(want.mask))
    np.testing.assert_allclose(np.asarray(got.filled(0)), np.asarray(want.filled(0)), rtol=1e-10, atol=1e-12)


def test_the_table_is_large():
    assert len(TABLE) >= 60


# ops that act on positions along axis 1, the token axis of X's (3, 4) mask: with the default
# positions="unpadded" they act on each row's valid entries (tests/test_maskify_positions.py); with
# positions="padded", the stored positions, they equal masked_jax.numpy's
POSITIONAL = {"jnp.argmax(axis=1)", "jnp.argmin(axis=1)", "jnp.flip", "jnp.roll"}


@pytest.mark.parametrize("name", list(TABLE))
def test_maskify_matches_masked_jax_numpy(name):
    plain, masked = TABLE[name]  # masked operands reach plain code as arguments, never closed over
    _same(mj.maskify(plain, positions="padded")(X, Y), masked(X, Y))
    if name not in POSITIONAL:
        _same(mj.maskify(plain)(X, Y), masked(X, Y))


def test_masked_constants_passed_as_arguments_and_jit_vmap_grad():
    f = mj.maskify(lambda x, y: jnp.mean(x * y, axis=1))
    _same(f(X, Y), mnp.mean(X * Y, axis=1))
    _same(jax.jit(f)(X, Y), mnp.mean(X * Y, axis=1))
    _same(jax.vmap(f)(mnp.stack([X, X]), mnp.stack([Y, Y]))[1], mnp.mean(X * Y, axis=1))
    g = mj.grad(mj.maskify(lambda x: jnp.var(jnp.exp(x))))(X)
    g_ref = mj.grad(lambda x: mnp.var(mnp.exp(x)))(X)
    _same(g, g_ref)
    assert bool(jnp.all(jnp.isfinite(g.data)))
    axis = 0  # static arguments through closures
    _same(mj.maskify(lambda x: jnp.sum(x, axis=axis))(X), mnp.sum(X, axis=0))


def test_sparse_layouts_are_accepted():
    rows = mj.masked_array(X.data, jnp.asarray(np.repeat(MASK.any(1, keepdims=True), 4, 1)) & ~jnp.isnan(X.data))
    x = mj.masked_array(jnp.nan_to_num(X.data), jnp.asarray(np.repeat([[True], [True], [False]], 4, 1)))
    for layout in (x.tostype("bcoo"), x.tostype("row_sparse")):
        _same(mj.maskify(lambda v: jax.nn.softmax(v, axis=1))(layout), mnn.softmax(x, axis=1))
    assert rows.shape == (3, 4)


def test_mean_rule_leaves_other_divisions_alone():
    # a sum divided by a number that is not its element count is an ordinary division
    _same(mj.maskify(lambda x: jnp.sum(x, axis=1) / 3.0)(X), mnp.sum(X, axis=1) / 3.0)
    _same(mj.maskify(lambda x: jnp.sum(x, axis=1) / 4.0)(X), mnp.mean(X, axis=1))  # 4 = the count: a mean


def test_unsupported_primitive_names_it_and_the_function():
    def my_model(x):
        return jnp.linalg.cholesky(x @ x.T + jnp.eye(3))

    with pytest.raises(mj.MaskifyError, match="my_model.*'cholesky'"):
        mj.maskify(my_model)(X)
    # the same primitive on unmasked data runs as usual
    assert mj.maskify(my_model)(jnp.eye(3)).shape == (3, 3)
    with pytest.raises(mj.MaskifyError, match="predicate of lax.cond is masked"):
        mj.maskify(lambda x: jax.lax.cond(x[0, 0] > 0, jnp.sin, jnp.cos, x))(X)


def test_one_source_of_truth_with_the_registry():
    from masked_jax.ops import REGISTRY

    for prim, op_name in primitives.OWNER.items():  # every derived rule belongs to a registered op
        assert prim in {p if not isinstance(p, tuple) else p[0] for p in REGISTRY[op_name].primitives}
    claimed = [p for spec in REGISTRY.values() for p in spec.primitives]
    assert len(claimed) == len(set(claimed)), "a primitive is claimed by two ops"
    for prim in primitives.UNSUPPORTED:
        assert primitives.rule_for(prim) is None, prim


# -- a real model: MLP + layer norm + softmax cross-entropy over padded sequences ----------------
B, T, D, H, C = 3, 5, 4, 6, 3
LENGTHS = np.array([5, 2, 3])
PAD = np.arange(T)[None, :] < LENGTHS[:, None]  # (B, T): True = a real token


def _params(seed=0):
    r = np.random.default_rng(seed)
    return {
        "w1": jnp.asarray(r.normal(size=(D, H)) * 0.5),
        "b1": jnp.asarray(r.normal(size=H) * 0.1),
        "g": jnp.asarray(1 + 0.1 * r.normal(size=H)),
        "b": jnp.asarray(0.1 * r.normal(size=H)),
        "w2": jnp.asarray(r.normal(size=(H, C)) * 0.5),
    }


def plain_loss(params, x, onehot):
    """Written for unpadded data in plain jax.numpy."""
    h = jax.nn.relu(x @ params["w1"] + params["b1"])
    mu = jnp.mean(h, axis=-1, keepdims=True)
    var = jnp.var(h, axis=-1, keepdims=True)
    h = (h - mu) / jnp.sqrt(var + 1e-5) * params["g"] + params["b"]
    logp = jax.nn.log_softmax(h @ params["w2"], axis=-1)
    return jnp.mean(-jnp.sum(onehot * logp, axis=-1))


def hand_masked_loss(params, x, onehot, pad):
    """The same model written by hand with explicit masks (jnp.where and counts)."""
    m = pad[..., None]
    h = jax.nn.relu(jnp.where(m, x, 0) @ params["w1"] + params["b1"])
    mu = jnp.mean(h, axis=-1, keepdims=True)
    var = jnp.var(h, axis=-1, keepdims=True)
    h = (h - mu) / jnp.sqrt(var + 1e-5) * params["g"] + params["b"]
    logp = jax.nn.log_softmax(h @ params["w2"], axis=-1)
    nll = -jnp.sum(onehot * logp, axis=-1)
    return jnp.sum(jnp.where(pad, nll, 0)) / jnp.sum(pad)


def test_mlp_with_layer_norm_and_cross_entropy_over_padded_sequences():
    r = np.random.default_rng(1)
    x = r.normal(size=(B, T, D))
    x[~PAD] = np.nan  # padding holds garbage
    onehot = jnp.asarray(np.eye(C)[r.integers(0, C, (B, T))])
    xm = mj.masked_array(jnp.asarray(x), jnp.broadcast_to(jnp.asarray(PAD)[..., None], x.shape))
    params = _params()
    masked_loss = mj.maskify(plain_loss)
    got = masked_loss(params, xm, onehot)
    want = hand_masked_loss(params, jnp.asarray(np.nan_to_num(x)), onehot, jnp.asarray(PAD))
    np.testing.assert_allclose(float(got.data), float(want), rtol=1e-12)
    grads = jax.grad(lambda p: masked_loss(p, xm, onehot).data)(params)
    grads_ref = jax.grad(hand_masked_loss)(params, jnp.asarray(np.nan_to_num(x)), onehot, jnp.asarray(PAD))
    for k in params:
        np.testing.assert_allclose(np.asarray(grads[k]), np.asarray(grads_ref[k]), rtol=1e-10, atol=1e-12)
    jitted = jax.jit(lambda p: masked_loss(p, xm, onehot).data)
    np.testing.assert_allclose(float(jitted(params)), float(want), rtol=1e-12)


# -- control flow ---------------------------------------------------------------------------------
def test_scan_operand_counts_in_both_jax_parameter_layouts():
    from masked_jax._maskify._scan import _scan_counts

    eqn = jax.make_jaxpr(lambda u, c, xs: jax.lax.scan(lambda c, x: ((c[0] * u + x[0], c[1] * u + x), c[0]), c, xs))(
        2.0, (1.0, jnp.ones(2)), jnp.ones((3, 2))
    ).jaxpr.eqns[-1]
    assert _scan_counts(eqn.params, len(eqn.invars)) == (1, 2)  # this jax's own layout: u; (c0, c1); xs
    # jax 0.11's layout: a flat tree ft_in that splits the operands into (consts, carry, xs)

    class FlatTree:  # the two methods of jax 0.11's FlatTree that jax's own scan rules use
        def __init__(self, sizes, values=None):
            self.sizes, self.values = sizes, values

        def update(self, values):
            return FlatTree(self.sizes, list(values))

        def unpack(self):
            cuts = np.cumsum((0,) + self.sizes)
            return tuple(self.values[a:b] for a, b in zip(cuts[:-1], cuts[1:]))

    assert _scan_counts({"ft_in": FlatTree((1, 2, 1)), "length": 3}, 4) == (1, 2)
    with pytest.raises(NotImplementedError, match="scan parameters"):
        _scan_counts({"ft_in": ((None,), (None,)), "length": 3}, 4)
    with pytest.raises(NotImplementedError, match="scan parameters"):
        _scan_counts({"length": 3}, 4)


def test_scan_rnn_and_cond_inside_the_function():
    r = np.random.default_rng(2)
    xs = r.normal(size=(T, B, 2))
    valid = jnp.broadcast_to(jnp.asarray(PAD.T)[..., None], xs.shape)
    xm = mj.masked_array(jnp.asarray(np.where(np.asarray(valid), xs, np.nan)), valid)
    u = jnp.asarray(r.normal(size=(2, 2)))

    def rnn(xs, h0):
        def step(h, xt):
            h = jnp.tanh(xt @ u + jnp.where(True, h, 0.0))
            return h, jnp.sum(h, axis=-1)

        return jax.lax.scan(step, h0, xs)

    h_last, ys = mj.maskify(rnn)(xm, jnp.zeros((B, 2)))
    # a padded step is missing: the carry is left as it was and its output is masked, so each row
    # equals the scan of its own valid steps alone
    for b in range(B):
        h_ref, ys_ref = rnn(jnp.asarray(xs[PAD[b], b][:, None]), jnp.zeros((1, 2)))
        np.testing.assert_allclose(np.asarray(h_last.data[b]), np.asarray(h_ref[0]), rtol=1e-10)
        np.testing.assert_allclose(np.asarray(ys.data[PAD[b], b]), np.asarray(ys_ref[:, 0]), rtol=1e-10)
    assert bool(jnp.all(h_last.mask))
    np.testing.assert_array_equal(np.asarray(ys.mask), PAD.T)  # padded steps stay masked
    for flag in (True, False):
        got = mj.maskify(
            lambda x, flag=flag: jax.lax.cond(flag, lambda v: jnp.sin(v) * 2, lambda v: jnp.mean(v, 0) + v, x)
        )(X)
        _same(got, mnp.sin(X) * 2 if flag else mnp.mean(X, axis=0) + X)
    count = mj.maskify(lambda x: jax.lax.fori_loop(0, 3, lambda i, v: v * 2.0, x))(X)
    _same(count, X * 8.0)


def test_more_primitives_sort_top_k_dynamic_slices_custom_vjp_while():
    # (stored positions, as masked_jax.numpy; the unpadded example's: tests/test_maskify_positions.py)
    _same(mj.maskify(lambda x: jnp.argsort(x, axis=1), positions="padded")(X), mnp.argsort(X, axis=1))
    vals, idx = mj.maskify(lambda x: jax.lax.top_k(x, 2))(X)
    for i in range(3):
        valid = np.sort(np.asarray(X.data[i])[MASK[i]])[::-1][:2]
        np.testing.assert_array_equal(np.asarray(vals.mask[i]), np.arange(2) < valid.size)
        np.testing.assert_allclose(np.asarray(vals.data[i])[: valid.size], valid)
        np.testing.assert_array_equal(np.asarray(idx.mask[i]), np.arange(2) < valid.size)
    _same(mj.maskify(lambda x: jax.lax.dynamic_slice(x, (1, 1), (2, 2)), positions="padded")(X), X[1:3, 1:3])
    _same(
        mj.maskify(lambda x, y: jax.lax.dynamic_update_slice(x, y[:1, :2], (2, 1)), positions="padded")(X, Y),
        X.at[2:3, 1:3].set(Y[:1, :2]),
    )
    g = mj.grad(mj.maskify(lambda x: jnp.sum(jax.lax.stop_gradient(x) * x)))(X)
    _same(g, mj.grad(lambda x: mnp.sum(jax.lax.stop_gradient(x.data) * x))(X))

    @jax.custom_vjp
    def double(v):
        return 2.0 * v

    double.defvjp(lambda v: (2.0 * v, None), lambda _, g: (2.0 * g,))
    _same(mj.maskify(lambda x: double(jnp.exp(x)))(X), mnp.exp(X) * 2.0)

    def halve_until_small(x):
        return jax.lax.while_loop(lambda v: jnp.max(v) > 0.1, lambda v: v / 2.0, x)

    out = mj.maskify(halve_until_small)(X)  # the loop's max sees only valid elements (NaN is masked)
    want = X
    while float(mnp.max(want).data) > 0.1:
        want = want / 2.0
    _same(out, want)


# -- the where rule: a constant never makes a masked position valid ---------------------------------
PADDED = mj.masked_array(jnp.asarray(np.where(MASK, RNG.uniform(0.5, 1.5, (3, 4)), np.nan)), jnp.asarray(MASK))


@pytest.mark.parametrize(
    "name,fun",
    [
        ("dropout", lambda x: jnp.where(jnp.arange(12).reshape(3, 4) % 3 != 0, x / 0.5, 0.0)),
        ("attention mask", lambda x: jnp.where(jnp.asarray(np.tri(3, 4, dtype=bool)), x, -jnp.inf)),
        ("zeros_like fill", lambda x: jnp.where(x > 1.0, x, jnp.zeros_like(x))),
        ("select default", lambda x: jnp.select([x < 0.8, x > 1.2], [x, 2 * x], default=0.0)),
        ("tril", lambda x: jnp.tril(x)),
        ("triu", lambda x: jnp.triu(x, 1)),
    ],
)
def test_a_constant_never_makes_a_masked_position_valid(name, fun):
    for f in (mj.maskify(fun), jax.jit(mj.maskify(fun))):
        out = f(PADDED)
        assert not np.any(np.asarray(out.mask) & ~MASK), f"{name}: padding became valid"
        assert np.all(
            np.isfinite(np.asarray(out.data)[np.asarray(out.mask)])
            | np.isinf(np.asarray(out.data)[np.asarray(out.mask)])
        ), name
    # and the same rule in masked_jax.numpy
    got = mnp.where(PADDED > 1.0, PADDED, 0.0)
    np.testing.assert_array_equal(np.asarray(got.mask), MASK)


@pytest.mark.parametrize(
    "name, fun, filled",
    [
        ("x * 0.125", lambda x, s: x * 0.125, False),
        ("0.5 * x", lambda x, s: 0.5 * x, False),
        ("x / 8.0", lambda x, s: x / 8.0, False),
        ("x / 0.0", lambda x, s: x / 0.0, True),  # its derivative in x is not finite
        ("8.0 / x", lambda x, s: 8.0 / x, True),  # not linear in x
        ("x * s", lambda x, s: x * s, True),  # s has a derivative, which reads x
    ],
)
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_a_masked_operand_times_a_finite_constant_is_not_filled(name, fun, filled, jit):
    """``x * 0.125``, ``x / 8.0`` (attention's scale): the derivative in ``x`` is the constant's,
    whatever ``x`` holds where masked, so the masked entries (NaN and inf here) are not filled; a
    divisor 0, a reciprocal and a product with a differentiated operand still fill. Values and
    gradients equal the function of the valid entries, and no NaN reaches a gradient."""
    data = jnp.asarray([1.5, np.nan, np.inf, -2.0, -np.inf, 4.0], jnp.float32)
    mask = jnp.asarray([True, False, False, True, False, True])
    x, s = mj.masked_array(data, mask), jnp.float32(3.0)
    f = mj.maskify(fun)
    assert (primitive_count(jax.make_jaxpr(f)(x, s), "select_n", data.shape) > 0) == filled, name
    out = (jax.jit(f) if jit else f)(x, s)
    np.testing.assert_array_equal(np.asarray(out.mask), np.asarray(mask))
    valid = np.asarray(mask)
    np.testing.assert_allclose(np.asarray(out.data)[valid], np.asarray(fun(data[valid], s)), rtol=1e-6)

    def loss(d, s):
        return jnp.sum(f(mj.masked_array(d, mask), s).filled(0.0))

    gx, gs = (jax.jit(jax.grad(loss, (0, 1))) if jit else jax.grad(loss, (0, 1)))(data, s)
    want_x, want_s = jax.grad(lambda d, s: jnp.sum(fun(d, s)), (0, 1))(data[valid], s)
    np.testing.assert_allclose(np.asarray(gx)[valid], np.asarray(want_x), rtol=1e-6)
    assert not np.asarray(gx)[~valid].any(), f"{name}: a gradient under the mask"
    np.testing.assert_allclose(float(gs), float(want_s), rtol=1e-6)


def _constants_in_the_body(x):
    """Eight equations computed from literals alone (iota, converts of weak and strong literals, a
    transcendental, integer arithmetic, a broadcast), of several dtypes, beside a masked operand."""
    scale = jnp.arange(4.0, dtype=x.dtype) * 2 + jnp.log(jnp.asarray(10.0, x.dtype))
    n = jnp.int32(7) - 2
    return x * scale - (jnp.ones(4) > 0.5) + n, jnp.full((2, 4), -jnp.inf, x.dtype)


def _compiles_to_lower(fun, *args):
    """Programs XLA compiles while ``jax.jit(fun)`` is lowered, from cleared caches (after one
    lowering, so that the library's own caches of scalar evaluations are warm)."""
    jax.jit(fun).lower(*args)
    jax.clear_caches()
    return backend_compiles(lambda: jax.jit(fun).lower(*args))[1]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float64"])
def test_constants_of_the_function_are_evaluated_together_and_exactly(dtype):
    """The equations computed from literals alone stay concrete (counts and fills are recognised
    under jit), are compiled as one program, not one per equation, and give what jax gives them."""
    x = mj.masked_array(jnp.asarray([0.5, 1.5, -2.0, 3.0], dtype), jnp.ones(4, bool))
    for f in (mj.maskify(_constants_in_the_body), jax.jit(mj.maskify(_constants_in_the_body))):
        for got, want in zip(f(x), _constants_in_the_body(x.data)):
            got = got.data if isinstance(got, mj.MaskedArray) else got
            assert got.dtype == want.dtype and jax.typeof(got).weak_type == jax.typeof(want).weak_type
            np.testing.assert_array_equal(np.asarray(got, np.float64), np.asarray(want, np.float64))
    # the same masked ops with the constants passed in: what lowering compiles besides the constants
    passed = mj.maskify(lambda x, scale, n, top: (x * scale - (jnp.ones(4) > 0.5) + n, top))
    scale = jnp.arange(4.0, dtype=dtype) * 2 + jnp.log(jnp.asarray(10.0, dtype))
    others = _compiles_to_lower(passed, x, scale, jnp.int32(5), jnp.full((2, 4), -jnp.inf, dtype))
    assert _compiles_to_lower(mj.maskify(_constants_in_the_body), x) <= others + 1


def test_an_eager_call_compiles_one_program_and_reuses_it():
    """Called outside any trace, a maskify'd function runs its masked program as one compiled
    program (not one per operation), reused by later calls that trace to the same program (new
    values and masks, a new lambda written the same way); a changed Python value it reads, or
    another static argument, traces to another program, as eagerly. Results equal the
    masked_jax.numpy ones every time; under a trace no program of its own is made."""
    state = {"scale": 1.0}

    def f(x, k):  # (a roll along axis 1, the token axis: by stored positions, as masked_jax.numpy)
        return jnp.roll(jnp.tanh(x) * state["scale"], k, axis=1) - jnp.mean(x, axis=1, keepdims=True)

    def want(x, k):
        return mnp.roll(mnp.tanh(x) * state["scale"], k, axis=1) - mnp.mean(x, axis=1, keepdims=True)

    expected = want(X, 1)
    mj.maskify(f, positions="padded")(X, 1)  # (the library's cache of scalar evaluations is warm after one call)
    jax.clear_caches()
    got, compiles = backend_compiles(lambda: mj.maskify(f, positions="padded")(X, 1))
    _same(got, expected)
    assert compiles <= 2, f"{compiles} programs compiled for one eager call"
    other = mj.masked_array(Y.data, Y.mask)
    got, compiles = backend_compiles(
        lambda: mj.maskify(lambda x, k: f(x, k), positions="padded")(other, 1)
    )  # a new lambda, new values
    _same(got, want(other, 1))
    assert compiles == 0
    for args in ((X, 2), (X, True), (X, -1)):
        _same(mj.maskify(f, positions="padded")(*args), want(*args))
    state["scale"] = 3.0  # read when traced: a new program, as eagerly
    _same(mj.maskify(f, positions="padded")(X, 1), want(X, 1))
    # a closed-over array larger than the key's limit: operation by operation, the same values
    big = jnp.arange(4096.0).reshape(1024, 4)[:3] / 4096.0
    _same(mj.maskify(lambda x: x * big)(X), X * big)
    g = mj.maskify(f, positions="padded")
    assert "jit[name=run" not in str(jax.make_jaxpr(lambda x: g(x, 1))(X))


def test_masked_mean_pool_after_dropout_sees_only_real_tokens():
    keep = jnp.asarray(RNG.random((3, 4)) > 0.3)
    pooled = mj.maskify(lambda x: jnp.mean(jnp.where(keep, x / 0.7, 0.0), axis=1))(PADDED)
    want = mnp.mean(mj.masked_array(jnp.where(keep, PADDED.data / 0.7, 0.0), PADDED.mask), axis=1)
    _same(pooled, want)


def test_complementary_masks_merged_by_where_stay_valid():
    a = mj.masked_array(jnp.ones((2, 2)), jnp.array([[True, False], [True, False]]))
    b = mj.masked_array(2 * jnp.ones((2, 2)), jnp.array([[False, True], [False, True]]))
    pick = jnp.array([[True, False], [True, False]])
    for out in (mnp.where(pick, a, b), mj.maskify(jnp.where)(pick, a, b)):
        assert bool(jnp.all(out.mask))
        np.testing.assert_array_equal(np.asarray(out.data), [[1.0, 2.0], [1.0, 2.0]])


# -- convolution, pooling, masked gathers, checkpoint, barriers -------------------------------------
IMG_MASK = np.ones((2, 4, 4, 3), bool)
IMG_MASK[0, 0], IMG_MASK[1, :, 3], IMG_MASK[1, 1, 1] = False, False, False
IMG = mj.masked_array(jnp.asarray(np.where(IMG_MASK, RNG.normal(size=(2, 4, 4, 3)), np.nan)), jnp.asarray(IMG_MASK))


def _windows(a, k):
    """(N, H//k, W//k, C, k*k) non-overlapping k x k windows of an NHWC array (numpy)."""
    n, h, w, c = a.shape
    return a.reshape(n, h // k, k, w // k, k, c).transpose(0, 1, 3, 5, 2, 4).reshape(n, h // k, w // k, c, k * k)


def test_pooling_is_over_valid_elements_and_average_pooling_is_a_masked_mean():
    window = lambda op, init: lambda v: jax.lax.reduce_window(v, init, op, (1, 2, 2, 1), (1, 2, 2, 1), "VALID")
    data, valid = _windows(np.asarray(IMG.data), 2), _windows(IMG_MASK, 2)
    ma = np.ma.masked_array(data, ~valid)
    for fun, ref in (
        (window(jax.lax.max, -jnp.inf), np.ma.max(ma, -1)),
        (window(jax.lax.min, jnp.inf), np.ma.min(ma, -1)),
        (lambda v: window(jax.lax.add, 0.0)(v) / 4.0, np.ma.mean(ma, -1)),
    ):
        for f in (mj.maskify(fun), jax.jit(mj.maskify(fun))):
            out = f(IMG)
            np.testing.assert_array_equal(np.asarray(out.mask), ~np.ma.getmaskarray(ref))
            np.testing.assert_allclose(np.asarray(out.filled(0)), np.ma.filled(ref, 0), rtol=1e-12)


@pytest.mark.parametrize(
    "k,stride,dil,padding",
    [
        (3, 1, 1, "SAME"),
        (3, 2, 1, "SAME"),
        (2, 1, 2, "SAME"),
        (3, 1, 1, "VALID"),
        (3, 2, 2, "VALID"),
        (2, 1, 1, ((1, 0),)),
        (3, 1, 1, ((2, 0),)),
        (1, 1, 1, ((1, 2),)),
        (3, 2, 1, ((0, 3),)),
    ],
)
def test_convolution_equals_the_per_sequence_unpadded_run(k, stride, dil, padding):
    """Masked taps read as the convolution's own padding, and an output is valid iff the run on the
    unpadded sequence has it: values, masks and input gradients equal the per-sequence runs."""
    lengths, width, c, f = (9, 5, 1, 3), 9, 3, 2
    rng = np.random.default_rng(k * 10 + stride)
    w = jnp.asarray(rng.normal(size=(k, c, f)), jnp.float32)
    conv = lambda v: jax.lax.conv_general_dilated(
        v,
        w,
        (stride,),
        padding,
        rhs_dilation=(dil,),
        dimension_numbers=("NWC", "WIO", "NWC"),
    )
    x = rng.normal(size=(len(lengths), width, c)).astype(np.float32)
    tok = np.arange(width)[None] < np.asarray(lengths)[:, None]
    xm = mj.masked_array(jnp.asarray(np.where(tok[..., None], x, np.nan)), jnp.asarray(tok[..., None]))
    cot = jnp.asarray(rng.normal(size=np.shape(conv(jnp.asarray(x)))), jnp.float32)
    for f_ in (mj.maskify(conv), jax.jit(mj.maskify(conv))):
        out = f_(xm)
        g = jax.grad(lambda d, f_=f_: jnp.sum(f_(mj.masked_array(d, xm.compact_mask)).filled(0.0) * cot))(xm.data)
        for b, n in enumerate(lengths):
            ref = np.asarray(conv(jnp.asarray(x[b : b + 1, :n])))[0]  # (0 outputs when the window is longer)
            m = np.asarray(out.mask)[b, :, 0]
            n_out = ref.shape[0]
            assert m[:n_out].all() and not m[n_out:].any(), (b, m, n_out)
            np.testing.assert_allclose(np.asarray(out.data)[b, :n_out], ref, rtol=1e-5, atol=1e-5)
            g_ref = jax.grad(lambda u, b=b, n_out=n_out: jnp.sum(conv(u)[0] * cot[b, :n_out]))(
                jnp.asarray(x[b : b + 1, :n])
            )
            np.testing.assert_allclose(np.asarray(g)[b, :n], np.asarray(g_ref)[0], rtol=1e-5, atol=1e-5)
            assert not np.asarray(g)[b, n:].any()


def test_a_masked_kernel_keeps_the_partial_convolution_rule():
    w = mj.masked_array(jnp.asarray(RNG.normal(size=(3, 3, 3, 2))), jnp.asarray(RNG.random((3, 3, 3, 2)) > 0.3))
    conv = lambda v, k: jax.lax.conv_general_dilated(
        v,
        k,
        (1, 1),
        "SAME",
        dimension_numbers=("NHWC", "HWIO", "NHWC"),
    )
    out = mj.maskify(conv)(IMG, w)
    np.testing.assert_allclose(
        np.asarray(out.filled(0)), np.asarray(conv(IMG.filled(0), w.filled(0))) * np.asarray(out.mask), rtol=1e-12
    )
    valid_taps = conv(jnp.asarray(IMG_MASK, jnp.float64), jnp.asarray(w.mask, jnp.float64))
    np.testing.assert_array_equal(np.asarray(out.mask), np.asarray(valid_taps) > 0)


def test_a_masked_index_gives_a_masked_row():
    table = mj.as_masked(jnp.asarray(RNG.normal(size=(5, 3))))
    ids = mj.masked_array(jnp.array([[1, 4], [-1, 0]]), jnp.array([[True, False], [True, True]]))
    for f in (mj.maskify(lambda t, i: t[i]), mj.maskify(lambda t, i: jnp.take(t, i, axis=0))):
        out = f(table, ids)
        np.testing.assert_array_equal(np.asarray(out.mask[..., 0]), [[True, False], [True, True]])
        np.testing.assert_allclose(np.asarray(out.data[1, 0]), np.asarray(table.data[4]))
    embed_mean = mj.maskify(lambda t, i: jnp.mean(t[i], axis=(0, 1)))
    np.testing.assert_allclose(
        np.asarray(embed_mean(table, ids).data), np.asarray(table.data[jnp.array([1, 4, 0])]).mean(0), rtol=1e-12
    )


def test_checkpoint_and_barriers_are_interpreted():
    f = lambda v: jnp.mean(jnp.tanh(v) * 2, axis=1)
    _same(mj.maskify(jax.checkpoint(f))(X), mj.maskify(f, positions="padded")(X))
    _same(mj.maskify(lambda v: jax.lax.optimization_barrier(v) + 1.0)(X), X + 1.0)
    g = mj.grad(mj.maskify(lambda v: jnp.sum(jax.checkpoint(f)(v))))(X)
    _same(g, mj.grad(mj.maskify(lambda v: jnp.sum(f(v))))(X))


# -- compact masks, whole-call recognition, user-level error names --------------------------------
LENGTHS = (5, 2, 3)


def _padded(features=4, seed=0):
    """A (B, L, F) batch of sequences of LENGTHS with NaN padding, its (B, L, 1) compact mask."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(len(LENGTHS), max(LENGTHS), features)).astype(np.float32)
    tokens = np.arange(max(LENGTHS))[None, :] < np.asarray(LENGTHS)[:, None]
    x = np.where(tokens[..., None], x, np.nan)
    return mj.masked_array(jnp.asarray(x), jnp.asarray(tokens)[..., None]), x


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_logmeanexp_divides_by_the_valid_count(jit):
    """jax.nn.logmeanexp is recognised as a whole call: each sequence's value equals the unpadded run."""
    xm, x = _padded()
    f = mj.maskify(lambda v: jax.nn.logmeanexp(v, axis=1))
    out = (jax.jit(f) if jit else f)(xm)
    for b, n in enumerate(LENGTHS):
        np.testing.assert_allclose(out.data[b], jax.nn.logmeanexp(jnp.asarray(x[b, :n]), axis=0), rtol=1e-6)
    g = jax.grad(
        lambda v: jnp.sum(mj.maskify(lambda u: jax.nn.logmeanexp(u, axis=1))(mj.masked_array(v, xm.compact_mask)).data)
    )(jnp.nan_to_num(xm.data))
    for b, n in enumerate(LENGTHS):
        want = jax.grad(lambda u: jnp.sum(jax.nn.logmeanexp(u, axis=0)))(jnp.asarray(x[b, :n]))
        np.testing.assert_allclose(g[b, :n], want, rtol=1e-6)
        assert not np.asarray(g[b, n:]).any()


def test_a_token_mask_stays_compact_through_a_dense_layer_norm_and_attention():
    """A (B, L, 1) mask keeps its shape through dense layers, layer norm, attention scores and a
    softmax inside maskify; the results equal those of the same batch with a full mask."""
    xm, _ = _padded(8)
    full = mj.masked_array(xm.data, xm.mask)
    w = jax.random.normal(jax.random.key(0), (8, 8))

    def block(v):
        h = v @ w
        h = (h - h.mean(-1, keepdims=True)) / jnp.sqrt(h.var(-1, keepdims=True) + 1e-5)
        scores = jnp.einsum("bqd,bkd->bqk", h, h)
        return jax.nn.softmax(scores, axis=-1) @ h

    got, want = mj.maskify(block)(xm), mj.maskify(block)(full)
    assert xm.compact_mask.shape == (3, 5, 1) and full.compact_mask.shape == (3, 5, 8)
    np.testing.assert_array_equal(got.mask, want.mask)
    np.testing.assert_allclose(np.where(want.mask, got.data, 0), np.where(want.mask, want.data, 0), rtol=1e-5)
    seen = []
    original = mj.MaskedArray._from_pair

    def spy(data, mask, **kwargs):
        seen.append(np.shape(mask))
        return original(data, mask, **kwargs)

    mj.MaskedArray._from_pair = staticmethod(spy)
    try:
        mj.maskify(lambda v: v @ w)(xm)
    finally:
        mj.MaskedArray._from_pair = original
    assert seen == [(3, 5, 1)], seen  # the dense layer's output mask: not broadcast to (3, 5, 8)


@pytest.mark.parametrize(
    "fun,user,instead",
    [
        (lambda v: jnp.searchsorted(v, 2.5), "jnp.searchsorted", "masked_jax.numpy.searchsorted"),
        (lambda v: jnp.digitize(v, jnp.array([1.5, 2.5])), "jnp.digitize", "masked_jax.numpy.digitize"),
        (lambda v: jnp.interp(2.5, v, v), "jnp.searchsorted", "masked_jax.numpy.interp"),
        (lambda v: jnp.histogram(v, bins=2), "jnp.searchsorted", "masked_jax.numpy.histogram"),
    ],
)
def test_errors_name_the_user_level_function(fun, user, instead):
    x = mj.masked_array(jnp.array([1.0, 2.0, 3.0, 4.0]), jnp.array([True, True, True, False]))
    with pytest.raises(mj.MaskifyError) as err:
        mj.maskify(fun)(x)
    msg = str(err.value)
    assert msg.index(user) < msg.index("Inside"), msg  # the user-level name first, the primitive after
    assert instead in msg


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_outputs_valid_by_construction_come_back_as_plain_arrays(jit):
    """An output none of whose values depends on a masked input (its mask is statically all valid)
    is a plain array, eagerly and under jit alike; the others are masked arrays."""
    xm, _ = _padded()
    f = mj.maskify(lambda v, w: (jnp.mean(v, axis=1), jnp.zeros_like(v), w @ w.T, jnp.float32(v.shape[1])))
    pooled, zeros, gram, length = (jax.jit(f) if jit else f)(xm, jnp.ones((2, 3)))
    assert isinstance(pooled, mj.MaskedArray)
    assert all(isinstance(o, jax.Array) and not isinstance(o, mj.MaskedArray) for o in (zeros, gram, length))


def _affine(a, b):  # composition of x -> m x + c maps: associative, not commutative
    (m1, c1), (m2, c2) = a, b
    return m1 * m2, c1 * m2 + c2


@pytest.mark.parametrize("reverse", [False, True], ids=["forward", "reverse"])
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_associative_scan_runs_over_valid_elements_only(jit, reverse):
    """lax.associative_scan under maskify is recognised as one call: it combines the valid
    elements of each row (holes, left and right padding, NaN under the masks), in order, with a
    non-commutative combine of a pair of arrays, along axis 1; the mask is kept. Values and
    gradients equal the scan of each row's valid elements alone."""
    rng = np.random.default_rng(4)
    mask = np.array(
        [
            [True, False, True, True, False, True],
            [False, False, True, True, True, True],
            [True, True, True, False, False, False],
            [False] * 6,
        ]
    )
    m = rng.uniform(0.5, 1.5, mask.shape).astype(np.float32)
    c = rng.normal(size=mask.shape).astype(np.float32)
    poison = lambda a: mj.masked_array(jnp.asarray(np.where(mask, a, np.nan)), jnp.asarray(mask))

    def scan(mv, cv):
        return lax.associative_scan(_affine, (mv, cv), reverse=reverse, axis=1)

    f = mj.maskify(scan)
    f = jax.jit(f) if jit else f
    out_m, out_c = f(poison(m), poison(c))
    loss = lambda mv, cv: jnp.sum(f(mv, cv)[1].filled(0) ** 2)
    g_m, g_c = mj.grad(loss, argnums=(0, 1))(poison(m), poison(c))
    for r in range(mask.shape[0]):
        idx = np.flatnonzero(mask[r])
        np.testing.assert_array_equal(np.asarray(out_c.mask[r]), mask[r])
        if not idx.size:
            continue
        ref = lambda mv, cv: lax.associative_scan(_affine, (mv, cv), reverse=reverse)
        want_m, want_c = ref(jnp.asarray(m[r, idx]), jnp.asarray(c[r, idx]))
        np.testing.assert_allclose(np.asarray(out_m.data[r, idx]), np.asarray(want_m), rtol=1e-6)
        np.testing.assert_allclose(np.asarray(out_c.data[r, idx]), np.asarray(want_c), rtol=1e-6)
        want_g = jax.grad(lambda mv, cv, ref=ref: jnp.sum(ref(mv, cv)[1] ** 2), argnums=(0, 1))(
            jnp.asarray(m[r, idx]), jnp.asarray(c[r, idx])
        )
        np.testing.assert_allclose(np.asarray(g_m.data[r, idx]), np.asarray(want_g[0]), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(np.asarray(g_c.data[r, idx]), np.asarray(want_g[1]), rtol=1e-5, atol=1e-6)
    assert np.isfinite(np.asarray(g_m.filled(0))).all() and np.isfinite(np.asarray(g_c.filled(0))).all()


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_associative_scan_is_found_however_it_is_called(jit):
    """A call is found by its equations' source, not by patching ``lax``: imported before
    maskify ran, passed in as a function object, inside an inner ``jit``, called twice from one line
    (stacked layers) and with a combine function that closes over a traced parameter. Each equals
    the scan of every row's valid elements alone, in values, masks and gradients; the eager call
    compiles one program, reused by the next call."""
    mask = np.array([[True, False, True, True, False, True], [False, False, True, True, True, True]])
    rng = np.random.default_rng(5)
    x = rng.uniform(0.5, 1.5, mask.shape).astype(np.float32)
    poisoned = mj.masked_array(jnp.asarray(np.where(mask, x, np.nan)), jnp.asarray(mask))

    def layers(v, w, scan):
        assert lax.associative_scan is imported_associative_scan  # nothing in lax is patched
        for _ in range(2):  # one source line, two calls; each call's results feed the next one
            v = scan(lambda a, b: a * w + b, v, axis=1)
        return v

    @jax.jit
    def inner(v, w):
        return layers(v, w, lax.associative_scan)

    forms = {
        "imported": lambda v, w: layers(v, w, imported_associative_scan),
        "passed in": lambda v, w, scan=lax.associative_scan: layers(v, w, scan),
        "inner jit": inner,
    }
    w = jnp.float32(0.75)
    for name, form in forms.items():
        f = mj.maskify(form)
        f = jax.jit(f) if jit else f
        out = f(poisoned, w)
        g = mj.grad(lambda v, w, f=f: jnp.sum(f(v, w).filled(0) ** 2), argnums=(0, 1))(poisoned, w)
        np.testing.assert_array_equal(np.asarray(out.mask), mask, err_msg=name)
        g_w = 0.0
        for r in range(mask.shape[0]):
            idx = np.flatnonzero(mask[r])
            ref = lambda v, w: layers(v[None], w, lax.associative_scan)[0]
            np.testing.assert_allclose(np.asarray(out.data[r, idx]), ref(jnp.asarray(x[r, idx]), w), rtol=1e-6)
            want = jax.grad(lambda v, w, ref=ref: jnp.sum(ref(v, w) ** 2), argnums=(0, 1))(jnp.asarray(x[r, idx]), w)
            np.testing.assert_allclose(np.asarray(g[0].data[r, idx]), want[0], rtol=1e-5, err_msg=name)
            g_w += float(want[1])
        np.testing.assert_allclose(float(g[1]), g_w, rtol=1e-5, err_msg=name)
    if not jit:
        f = mj.maskify(forms["imported"])
        f(poisoned, w)
        _, compiled = backend_compiles(lambda: f(poisoned, w))
        assert compiled == 0


def test_associative_scan_of_leaves_of_different_shapes_is_refused_by_name():
    x = mj.masked_array(jnp.ones((2, 3)), jnp.array([[True, False, True], [True, True, True]]))
    with pytest.raises(mj.MaskifyError, match="lax.associative_scan"):
        mj.maskify(lambda v, w: lax.associative_scan(lambda a, b: (a[0] + b[0], a[1] + b[1]), (v, w)))(
            x, jnp.ones((2, 1))
        )


@pytest.mark.parametrize("mask", [[True, False, True, True], [False, False, True, True]], ids=["hole", "left-padding"])
def test_running_reductions_skip_holes_and_left_padding(mask):
    """Running sums and maxima over valid entries only, the mask kept (holes and left padding
    included), eagerly and under jit."""
    x = mj.masked_array(jnp.array([1.0, 2.0, 3.0, 4.0]), jnp.array(mask))
    valid = np.asarray(mask)
    for fun, ref in ((jnp.cumsum, np.cumsum), (lambda v: jax.lax.cummax(v, axis=0), np.maximum.accumulate)):
        for f in (mj.maskify(fun), jax.jit(mj.maskify(fun))):
            out = f(x)
            np.testing.assert_array_equal(out.mask, valid)
            np.testing.assert_allclose(np.asarray(out.data)[valid], ref(np.array([1.0, 2.0, 3.0, 4.0])[valid]))


@pytest.mark.parametrize("garbage", [np.nan, np.inf, -np.inf, 1e30])
def test_maximum_and_minimum_take_no_sanitising_select(garbage):
    """max and min differentiate to a multiplier of 0, 0.5 or 1 at any operands (NaN included), so
    their rule does not replace masked-out data first: a maskify'd ``relu`` is one ``max`` with no
    select (in a model, that select and its transpose sat in front of a weight gradient's matmul),
    and masked-out NaN, +-inf or huge values still reach no valid output and no gradient, with a
    broadcast parameter operand as well."""
    x = mj.masked_array(jnp.array([1.0, -2.0, 3.0, garbage]), jnp.array([True, True, True, False]))
    text = str(jax.make_jaxpr(mj.maskify(jax.nn.relu))(x))
    assert "select_n" not in text and " max " in text

    def loss(y, x, op):
        return mnp.sum(op(x, y) * 2.0)

    for op, dy, dx in [(mnp.maximum, 2.0, [2.0, 0.0, 2.0]), (mnp.minimum, 4.0, [0.0, 2.0, 0.0])]:
        gy, gx = mj.grad(loss, argnums=(0, 1))(jnp.float32(0.5), x, op)
        assert gy == dy  # the valid entries alone: 2 x (how many pick y)
        np.testing.assert_array_equal(gx.data[:3], dx)
    # plain code under maskify: relu(w x) summed over the valid entries 1.5 w and 4.5 w: d/dw = 1 + 3
    model = mj.maskify(lambda v, w: jnp.sum(jax.nn.relu(v * w)))
    assert jax.grad(lambda w: model(x, w).data)(jnp.float32(1.5)) == 4.0


# -- static mask factors: attention's contraction over one key mask -----------------------------
def _attention(q_in, kv_in, w, bias, v_in=None, np_=jnp, nn_=jax.nn):
    """Single-head attention, written once for jax.numpy and for masked_jax.numpy (``np_``, ``nn_``):
    keys from ``kv_in``, values from ``v_in`` (default ``kv_in``) plus ``bias``, an unmasked (L, D)."""
    v_in = kv_in if v_in is None else v_in
    q, k, v = q_in @ w[0], kv_in @ w[1], v_in @ w[2] + bias
    weights = nn_.softmax(np_.einsum("bqd,bkd->bqk", q, k) / 2.0, axis=-1)
    return np_.einsum("bqk,bkd->bqd", weights, v)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_attention_over_one_key_mask_takes_no_run_time_test(jit):
    """The attention weights' mask varies along the keys exactly as the values' mask does (both are
    the keys' token mask, as maskify records), so the weights x values contraction is exact with
    zero-filling: the program holds no conditional, and each sequence equals its unpadded run, with
    NaN padding and a valid +inf in one value (an inf that meets a masked weight in the shorter
    sequences, where zero-filling alone would form NaN, did it not meet a masked value too)."""
    xm, x = _padded(4)
    w = jax.random.normal(jax.random.key(1), (3, 4, 4))
    bias = np.zeros((max(LENGTHS), 4), np.float32)
    bias[2, 1] = np.inf  # valid in the sequences of length 5 and 3, padding in the one of length 2
    f = mj.maskify(lambda v: _attention(v, v, w, bias))
    assert "cond" not in str(jax.make_jaxpr(f)(xm))
    out = (jax.jit(f) if jit else f)(xm)
    for b, n in enumerate(LENGTHS):
        want = _attention(x[b : b + 1, :n], x[b : b + 1, :n], w, bias[:n])[0]
        np.testing.assert_allclose(np.asarray(out.data[b, :n]), want, rtol=2e-5)
        assert not np.asarray(out.mask[b, n:]).any()
    # gradients of a finite loss equal the unpadded runs'; no NaN from the padding or the inf
    loss = lambda v, w: jnp.sum(
        mj.maskify(lambda u: _attention(u, u, w, 0.0))(mj.masked_array(v, xm.compact_mask)).data
    )
    gv, gw = (jax.jit(jax.grad(loss, (0, 1))) if jit else jax.grad(loss, (0, 1)))(xm.data, w)
    want_w = 0
    for b, n in enumerate(LENGTHS):
        dv, dw = jax.grad(lambda u, w: jnp.sum(_attention(u, u, w, 0.0)), (0, 1))(jnp.asarray(x[b : b + 1, :n]), w)
        np.testing.assert_allclose(np.asarray(gv[b, :n]), dv[0], rtol=2e-4, atol=1e-5)
        assert not np.asarray(gv[b, n:]).any()
        want_w = want_w + dw
    np.testing.assert_allclose(np.asarray(gw), want_w, rtol=2e-4, atol=1e-5)


def test_attention_values_fill_is_kept_as_one_buffer():
    """The values' fill in attention's weights x values contraction sits behind one optimisation
    barrier (it is the backward pass's residual, kept as one buffer rather than recomputed from the
    unfilled projection); a dense layer's fill takes none. Forward and reverse derivatives through
    the barrier agree, under ``vmap`` too."""
    xm, _ = _padded(4)
    w = jax.random.normal(jax.random.key(1), (3, 4, 4))
    attention = mj.maskify(lambda v: _attention(v, v, w, 0.0))
    assert str(jax.make_jaxpr(attention)(xm)).count("optimization_barrier") == 1
    dense = mj.maskify(lambda v: jnp.tanh(v @ w[0]) @ w[1])
    assert "optimization_barrier" not in str(jax.make_jaxpr(dense)(xm))

    def loss(v, w):
        out = mj.maskify(lambda u: _attention(u, u, w, 0.0))(mj.masked_array(v, xm.compact_mask))
        return jnp.sum(jnp.sin(out.data))

    rev = jax.jit(jax.jacrev(loss, 1))(xm.data, w)
    fwd = jax.jit(jax.jacfwd(loss, 1))(xm.data, w)
    np.testing.assert_allclose(np.asarray(fwd), np.asarray(rev), rtol=2e-4, atol=1e-5)
    assert np.isfinite(np.asarray(rev)).all()
    per_w = jax.vmap(jax.grad(loss, 1), in_axes=(None, 0))(xm.data, jnp.stack([w, 2 * w]))
    np.testing.assert_allclose(np.asarray(per_w[0]), np.asarray(rev), rtol=2e-4, atol=1e-5)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_a_sum_over_masked_slices_is_a_known_zero(jit):
    """A sum (and a mean) along an axis the mask varies on holds 0 in its masked slices, and
    maskify records it: a dense layer after a mean pool reads the pooled rows with no fill at their
    shape. A sequence with no valid token is masked, its row of the layer's output too, and the
    weight gradient is the other sequences' (finite, no NaN from the padding)."""
    xm, x = _padded(4)
    tokens = np.asarray(xm.compact_mask).copy()
    tokens[1] = False  # the second sequence has no valid token
    xm = mj.masked_array(jnp.where(jnp.asarray(tokens), xm.data, jnp.nan), jnp.asarray(tokens))
    w = jax.random.normal(jax.random.key(3), (4, 2))
    pool = mj.maskify(lambda v, w: jnp.tanh(jnp.mean(v, axis=1) @ w))
    text = str(jax.make_jaxpr(pool)(xm, w))
    pooled_selects = [line for line in text.splitlines() if "select_n" in line and "f32[3,4]" in line.split("=")[0]]
    assert not pooled_selects, pooled_selects
    out = (jax.jit(pool) if jit else pool)(xm, w)
    assert np.asarray(out.mask).tolist() == [[True, True], [False, False], [True, True]]
    loss = lambda w: jnp.sum(pool(xm, w).filled(0.0))
    grad = (jax.jit(jax.grad(loss)) if jit else jax.grad(loss))(w)
    want = 0
    for b, n in ((0, LENGTHS[0]), (2, LENGTHS[2])):
        seq = jnp.asarray(x[b, :n])
        np.testing.assert_allclose(np.asarray(out.data[b]), jnp.tanh(jnp.mean(seq, axis=0) @ w), rtol=1e-5)
        want = want + jax.grad(lambda w, seq=seq: jnp.sum(jnp.tanh(jnp.mean(seq, axis=0) @ w)))(w)
    np.testing.assert_allclose(np.asarray(grad), np.asarray(want), rtol=1e-5, atol=1e-6)


def test_values_under_another_mask_keep_the_exact_rule():
    """Values whose mask differs from the keys' along the keys are not known to match: the exact
    rule and its conditional stay, and a valid inf meeting a masked weight gives no NaN."""
    xm, x = _padded(4)
    other = np.asarray(xm.compact_mask).copy()
    other[1, 3, 0] = True  # a value valid where the keys of sequence 1 are padding
    vm = mj.masked_array(jnp.where(jnp.asarray(other), jnp.nan_to_num(xm.data) + 1.0, jnp.nan), jnp.asarray(other))
    w = jax.random.normal(jax.random.key(2), (3, 4, 4))
    bias = np.zeros((max(LENGTHS), 4), np.float32)
    bias[3, 0] = np.inf

    f = mj.maskify(lambda a, b: _attention(a, a, w, bias, v_in=b))
    assert "cond" in str(jax.make_jaxpr(f)(xm, vm))
    want = _attention(xm, xm, w, bias, v_in=vm, np_=mnp, nn_=mnn)
    for got in (f(xm, vm), jax.jit(f)(xm, vm)):
        _same(got, want)
        assert not np.isnan(np.asarray(got.filled(0.0))).any()  # inf where it is valid, never NaN


def test_and_of_a_mask_with_its_own_factors_is_that_mask():
    """Inside maskify an ``and`` of masks whose factors one operand already holds returns that
    operand (``x + f(x)``: no ``and`` in the program); outside maskify nothing is recorded."""
    xm, _ = _padded(4)
    text = str(jax.make_jaxpr(mj.maskify(lambda v: v + jnp.tanh(v) * v))(xm))
    assert " and " not in text
    from masked_jax.ops._base import and_masks
    from masked_jax.ops._factors import Facts

    m = jnp.ones((2, 1), bool)
    assert and_masks(m, m) is not m  # no facts handed in: nothing known
    facts = Facts()
    assert and_masks(m, m, facts=facts) is m
    assert and_masks(m, jnp.ones((1, 3), bool), facts=facts).shape == (2, 3)


def test_a_mask_and_its_any_over_an_axis_is_that_mask():
    """ "The sequence has a valid token" (a reduction's validity along the tokens) is implied by the
    token mask: a token-masked array combined with its own mean, or with attention over its own
    tokens, keeps the token mask with no ``and`` of token masks in the program; the values and
    masks equal the unpadded runs. A mask it does not imply (another sequence's) still takes the
    ``and``."""
    xm, x = _padded(4)
    w = jax.random.normal(jax.random.key(4), (3, 4, 4))
    centered = mj.maskify(lambda v: v - jnp.mean(v, axis=1, keepdims=True))
    attended = mj.maskify(lambda v: v + _attention(v, v, w, 0.0))
    for f, one in (
        (centered, lambda u: u - u.mean(0)),
        (attended, lambda u: u + _attention(u[None], u[None], w, 0.0)[0]),
    ):
        # no and at the token mask's shape (attention's scores take the queries' and keys' masks)
        assert primitive_count(jax.make_jaxpr(f)(xm), "and", (3, max(LENGTHS), 1)) == 0
        for out in (f(xm), jax.jit(f)(xm)):
            assert out.compact_mask.shape == (3, max(LENGTHS), 1)
            for b, n in enumerate(LENGTHS):
                np.testing.assert_allclose(
                    np.asarray(out.data[b, :n]), one(jnp.asarray(x[b, :n])), rtol=2e-5, atol=1e-6
                )
                assert np.asarray(out.mask[b, :n]).all() and not np.asarray(out.mask[b, n:]).any()
    # the any of another mask is not implied: v's mean over the tokens minus a sequence-reversed v
    flipped = mj.maskify(lambda v, u: u - jnp.mean(v, axis=1, keepdims=True))
    rev = mj.masked_array(xm.data[::-1], xm.compact_mask[::-1])
    assert primitive_count(jax.make_jaxpr(flipped)(xm, rev), "and") == 1
    got = flipped(xm, rev)
    np.testing.assert_array_equal(
        np.asarray(got.mask), np.asarray(rev.mask) & np.asarray(xm.mask).any(1, keepdims=True)
    )


def test_a_predicate_known_when_traced_picks_its_case_with_no_select():
    """``select_n`` with a predicate computed from constants (as in ``jnp.var``'s ``n - ddof > 0``)
    picks its case when traced: no select, the chosen case's data and mask; a constant case takes
    the validity of the masked cases, as ``where`` gives it."""
    xm, _ = _padded(4)
    ym = mj.masked_array(xm.data * 2, jnp.roll(xm.compact_mask, 1, axis=1))
    for pred, want_data, want_mask in ((True, xm.data, xm.mask), (False, jnp.full(xm.shape, 7.0), xm.mask)):
        f = mj.maskify(lambda v, pred=pred: lax.select_n(jnp.asarray(pred), jnp.full(v.shape, 7.0, v.dtype), v))
        assert primitive_count(jax.make_jaxpr(f)(xm), "select_n", xm.shape) == 0
        for out in (f(xm), jax.jit(f)(xm)):
            np.testing.assert_array_equal(np.asarray(out.mask), np.asarray(want_mask))
            np.testing.assert_array_equal(np.asarray(out.filled(0.0)), np.where(want_mask, want_data, 0.0))
    three = mj.maskify(lambda v, u: lax.select_n(jnp.int32(2), v, jnp.zeros(v.shape, v.dtype), u))
    out = three(xm, ym)
    assert primitive_count(jax.make_jaxpr(three)(xm, ym), "select_n", xm.shape) == 0
    np.testing.assert_array_equal(np.asarray(out.mask), np.asarray(ym.mask))
    np.testing.assert_array_equal(np.asarray(out.filled(0.0)), np.asarray(ym.filled(0.0)))
    # jnp.var along an axis the mask does not vary along: its "n - ddof > 0" is known, no select
    var = mj.maskify(lambda v: v.var(-1, keepdims=True))
    assert primitive_count(jax.make_jaxpr(var)(xm), "select_n", (3, max(LENGTHS), 1)) == 0
    for b, n in enumerate(LENGTHS):
        np.testing.assert_allclose(
            np.asarray(var(xm).data[b, :n]), np.var(np.asarray(xm.data[b, :n]), -1, keepdims=True), rtol=1e-5
        )


def test_reductions_of_one_mask_share_its_any():
    """The validity of two reductions of the same masked array along the same axes is computed
    once (one ``reduce_or``), and a mean with no ``ddof`` takes its sum's mask (no ``and`` with
    "the count is positive"); with ``ddof=1`` the count must exceed 1: that ``and`` stays."""
    xm, x = _padded(4)
    both = mj.maskify(lambda v: jnp.sum(v, axis=1) + jnp.max(v, axis=1) + jnp.mean(v, axis=1))
    jaxpr = jax.make_jaxpr(both)(xm)
    assert primitive_count(jaxpr, "reduce_or") == 1 and primitive_count(jaxpr, "and") == 0
    out = both(xm)
    for b, n in enumerate(LENGTHS):
        u = x[b, :n]
        np.testing.assert_allclose(np.asarray(out.data[b]), u.sum(0) + u.max(0) + u.mean(0), rtol=1e-5)
    var1 = mj.maskify(lambda v: jnp.var(v, axis=1, ddof=1))
    assert primitive_count(jax.make_jaxpr(var1)(xm), "and") == 1
    short = mj.masked_array(xm.data, xm.compact_mask & (jnp.arange(max(LENGTHS)) < 1)[None, :, None])
    np.testing.assert_array_equal(np.asarray(var1(short).mask), False)  # one valid element: ddof=1 leaves none


def test_a_mean_pool_keeps_its_mask_compact_before_the_head():
    """A mean over the tokens of a (B, L, 1)-masked batch is valid per sequence: its mask stays
    (B, 1), so the classifier head's contraction needs no run-time test."""
    xm, x = _padded(4)
    head = jax.random.normal(jax.random.key(3), (4, 2))
    f = mj.maskify(lambda v: jnp.mean(v, axis=1) @ head)
    out = f(xm)
    assert out.compact_mask.shape == (3, 1) and "cond" not in str(jax.make_jaxpr(f)(xm))
    for b, n in enumerate(LENGTHS):
        np.testing.assert_allclose(np.asarray(out.data[b]), x[b, :n].mean(0) @ head, rtol=1e-5)


@settings(max_examples=int(os.environ.get("MJ_ATTENTION_EXAMPLES", 30)))
@given(
    seed=st.integers(0, 2**16),
    length=st.integers(1, 6),
    shared=st.booleans(),
    flip=st.integers(0, 11),
    special=st.sampled_from([np.inf, -np.inf, np.nan]),
    at=st.sampled_from(["values", "inputs"]),
)
def test_attention_with_recorded_factors_equals_the_general_rule(seed, length, shared, flip, special, at):
    """Property: maskify'd attention (recorded factors; no conditional where the values share the
    keys' mask; the softmax as one op) equals the same attention through masked_jax.numpy (the
    general rule), over random lengths, query masks, values under the keys' mask or a mask that
    differs in one entry, and a valid inf or NaN in the values or in the inputs (rows of NaN or
    inf scores), eagerly and under jit."""
    rng = np.random.default_rng(seed)
    b, d = 2, 3
    keys = rng.random((b, length, 1)) > 0.3
    vmask = keys.copy()
    if not shared:
        vmask.reshape(-1)[flip % vmask.size] ^= True
    data = rng.normal(size=(b, length, d))
    if at == "inputs":
        data.reshape(-1)[flip % data.size] = special
    x = mj.masked_array(jnp.where(keys, jnp.asarray(data), jnp.nan), jnp.asarray(keys))
    v = mj.masked_array(jnp.where(vmask, jnp.asarray(rng.normal(size=(b, length, d))), jnp.nan), jnp.asarray(vmask))
    bias = np.zeros((length, d))
    if at == "values":
        bias.reshape(-1)[flip % bias.size] = special
    w = jnp.asarray(rng.normal(size=(3, d, d)))

    want = _attention(x, x, w, bias, v_in=x if shared else v, np_=mnp, nn_=mnn)
    f = mj.maskify(lambda a, c: _attention(a, a, w, bias, v_in=a if shared else c))
    for got in (f(x, v), jax.jit(f)(x, v)):
        np.testing.assert_array_equal(np.asarray(got.mask), np.asarray(want.mask))
        np.testing.assert_allclose(np.asarray(got.filled(0.0)), np.asarray(want.filled(0.0)), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("op", [jnp.exp, jnp.cos, lambda v: v * 0.0 + 2.0], ids=["exp", "cos", "constant"])
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_a_contraction_over_the_mask_of_two_operands_holding_known_values_sums_valid_terms(op, jit):
    """Both operands of a contraction along the same masked axis hold a known finite nonzero value
    under the mask (exp, cos of a filled 0): the contraction is exact only if one side holds 0
    there, so one is filled; the value and the gradient equal the sums over the valid entries."""
    x = mj.masked_array(
        jnp.array([[0.5, np.nan, 0.2, np.nan], [np.nan, 0.3, -0.4, 1.0]]),
        jnp.array([[True, False, True, False], [False, True, True, True]]),
    )
    valid = np.asarray(x.mask)

    def f(v):
        e = op(v)
        return jnp.einsum("bk,bk->b", e, e * 3.0)

    g = jax.jit(mj.maskify(f, positions="padded")) if jit else mj.maskify(f, positions="padded")
    out = g(x)
    grad = jax.grad(lambda d: jnp.sum(mj.maskify(f)(mj.masked_array(d, x.mask)).data))(x.data)
    for b in range(2):
        row = jnp.asarray(np.asarray(x.data)[b][valid[b]])
        np.testing.assert_allclose(out.data[b], f(row[None])[0], rtol=1e-6)
        want = jax.grad(lambda r: f(r[None])[0])(row)
        np.testing.assert_allclose(np.asarray(grad[b])[valid[b]], want, rtol=1e-6)
        assert not np.asarray(grad[b])[~valid[b]].any()


def _no_bias_scores(v, wq, wk):
    """Attention scores from dense layers with no bias (equinox's default attention)."""
    return jnp.einsum("bqd,bkd->bqk", (v @ wq) / 2.0, v @ wk)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_dense_layers_without_bias_pass_their_zero_rows_on_to_the_next_contraction(jit):
    """Rows filled with 0 before a dense layer with no bias hold 0 after it while its weights are
    finite (a conditional record), so the queries and keys take no second fill before the scores
    (one select in the program: the input's); values and gradients equal the unpadded runs. With
    an inf in a weight, the values still do, and each gradient entry is the unpadded runs' sum
    wherever that is finite, and non-finite wherever it is not (masked rows meet the inf as
    ``0 * inf``, where every valid row of that column holds an inf or NaN already)."""
    xm, x = _padded(4)
    rng = np.random.default_rng(5)
    wq, wk = (jnp.asarray(rng.normal(size=(4, 4)), jnp.float32) for _ in range(2))
    f = mj.maskify(_no_bias_scores)
    assert primitive_count(jax.make_jaxpr(f)(xm, wq, wk), "select_n") == 1

    def loss_got(wq, wk):
        return jnp.sum(jnp.tanh(f(xm, wq, wk).filled(0.0)))

    def loss_want(wq, wk):
        return sum(
            jnp.sum(jnp.tanh(_no_bias_scores(jnp.asarray(x[b : b + 1, :n]), wq, wk))) for b, n in enumerate(LENGTHS)
        )

    grad = jax.grad(loss_got, (0, 1))
    grad = jax.jit(grad) if jit else grad
    for inf_at in (None, (1, 2)):
        wq_ = wq if inf_at is None else wq.at[inf_at].set(np.inf)
        out = (jax.jit(f) if jit else f)(xm, wq_, wk)
        for b, n in enumerate(LENGTHS):
            np.testing.assert_allclose(
                np.asarray(out.data[b, :n, :n]),
                _no_bias_scores(jnp.asarray(x[b : b + 1, :n]), wq_, wk)[0],
                rtol=1e-5,
                atol=1e-6,
            )
        got, want = grad(wq_, wk), jax.grad(loss_want, (0, 1))(wq_, wk)
        for g, w in zip(got, want):
            g, w = np.asarray(g), np.asarray(w)
            finite = np.isfinite(w)
            np.testing.assert_allclose(g[finite], w[finite], rtol=1e-4, atol=1e-5)
            assert not np.isfinite(g[~finite]).any()
        assert all(np.isfinite(np.asarray(w)).all() for w in want) == (inf_at is None)


def test_zero_rows_of_a_dense_layer_with_an_inf_weight_do_not_reach_valid_values():
    """A contraction along the masked axis (attention weights x values) needs one side to hold
    exactly 0 under the mask; a conditional record is not enough. Values from a dense layer with an
    inf weight are +inf in every valid row of a column and NaN in the masked rows: the valid
    outputs are +inf, and tanh of them 1, as in the unpadded runs (not NaN)."""
    xm, x = _padded(3)
    xm = mj.masked_array(jnp.abs(xm.data) + 0.1, xm.compact_mask)
    x = np.abs(x) + 0.1
    wv = jnp.eye(3).at[0, 1].set(np.inf)

    def attend(v, wv):
        weights = jax.nn.softmax(jnp.einsum("bqd,bkd->bqk", v, v), axis=-1)
        return jnp.tanh(jnp.einsum("bqk,bkd->bqd", weights, v @ wv))

    for f in (mj.maskify(attend), jax.jit(mj.maskify(attend))):
        out = f(xm, wv)
        for b, n in enumerate(LENGTHS):
            want = attend(jnp.asarray(x[b : b + 1, :n]), wv)[0]
            assert np.all(np.asarray(want[:, 1]) == 1.0)
            np.testing.assert_allclose(np.asarray(out.data[b, :n]), want, rtol=1e-6)


def _softmax_rows():
    """Rows of 5 with NaN padding and special values among the valid entries: plain, a valid +inf,
    a valid -inf, a valid NaN, every valid entry -inf, and no valid entry."""
    data = np.array(
        [
            [0.5, -1.0, 2.0, np.nan, np.nan],
            [0.1, np.inf, 0.3, 0.2, np.inf],
            [-np.inf, 0.4, 1.5, np.nan, -2.0],
            [0.3, np.nan, 0.7, 1e30, np.nan],
            [-np.inf, -np.inf, np.nan, np.nan, np.nan],
            [np.nan] * 5,
        ],
        np.float32,
    )
    mask = np.array(
        [[1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 1, 1, 0, 1], [1, 1, 1, 0, 0], [1, 1, 0, 0, 0], [0, 0, 0, 0, 0]], bool
    )
    return data, mask


@pytest.mark.parametrize("fn", [jax.nn.softmax, jax.nn.log_softmax], ids=["softmax", "log_softmax"])
@pytest.mark.parametrize("custom_jvp", [False, True], ids=["plain", "custom-jvp"])
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_softmax_is_recognised_as_one_op_that_equals_each_unpadded_row(jit, custom_jvp, fn):
    """``jax.nn.softmax`` and ``jax.nn.log_softmax`` of a masked operand run as one masked op (the
    masked entries enter as -inf: one select, no fill of the exponentials), with jax's own form and
    with softmax's custom-jvp form. Each row's values and gradients equal the function of the row's
    valid entries, specials included (NaN where jax gives NaN); gradients are exactly 0 under the
    mask; a row with no valid entry stays masked (the softmax's data finite)."""
    data, mask = _softmax_rows()
    x = mj.masked_array(jnp.asarray(data), jnp.asarray(mask))
    cot = jnp.asarray(np.linspace(0.5, 1.5, data.size, dtype=np.float32).reshape(data.shape))
    previous = jax.config.jax_softmax_custom_jvp
    jax.config.update("jax_softmax_custom_jvp", custom_jvp)
    try:
        f = mj.maskify(lambda v: fn(v, axis=-1))
        assert primitive_count(jax.make_jaxpr(f)(x), "select_n", data.shape) == 1  # the -inf entry
        out = (jax.jit(f) if jit else f)(x)
        grad = jax.grad(lambda d: jnp.sum(f(mj.masked_array(d, x.mask)).filled(0.0) * cot))(x.data)
        for r in range(len(data)):
            valid = mask[r]
            np.testing.assert_array_equal(np.asarray(out.mask[r]), valid)
            if not valid.any():
                assert not np.asarray(grad[r]).any()
                # softmax: the uniform 1 / n of an empty slice, finite (its data are unspecified)
                assert fn is jax.nn.log_softmax or np.isfinite(np.asarray(out.data[r])).all()
                continue
            row = jnp.asarray(data[r][valid])
            np.testing.assert_allclose(np.asarray(out.data[r])[valid], fn(row), rtol=1e-6)
            want = jax.grad(lambda v, r=r, valid=valid: jnp.sum(fn(v) * cot[r][valid]))(row)
            np.testing.assert_allclose(np.asarray(grad[r])[valid], want, rtol=1e-5, atol=1e-7)
            assert not np.asarray(grad[r])[~valid].any()
        empty = f(mj.masked_array(jnp.ones((2, 0)), jnp.ones((2, 0), bool)))  # as jax: nothing to normalise
        assert empty.shape == (2, 0)
    finally:
        jax.config.update("jax_softmax_custom_jvp", previous)


@pytest.mark.parametrize("fn", [jax.nn.softmax, jax.nn.log_softmax], ids=["softmax", "log_softmax"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("transform", ["vmap", "scan", "scan-inside"])
def test_the_softmax_op_under_vmap_and_scan_in_every_float_dtype(transform, dtype, fn):
    """The recognised softmax and log_softmax inside ``vmap`` (over the rows), in a ``scan`` body
    (one row per step) and in a scan inside the maskify'd function (the body interpreted by
    maskify), in float32, bfloat16 and float16: each row equals the function of its valid entries
    in that dtype (specials included), and the padding stays masked."""
    data, mask = _softmax_rows()
    x = mj.masked_array(jnp.asarray(data).astype(dtype), jnp.asarray(mask))  # the padding's 1e30: inf in float16
    soft = mj.maskify(lambda v: fn(v, axis=-1))
    if transform == "vmap":
        out = jax.jit(jax.vmap(soft))(x)
    elif transform == "scan-inside":
        scanned = mj.maskify(lambda v: jax.lax.scan(lambda c, r: (c, fn(r)), 0, v)[1])
        # one softmax op in the body: one select at a row's shape (the ops one at a time make four)
        assert primitive_count(jax.make_jaxpr(scanned)(x), "select_n", data.shape[1:]) == 1
        out = jax.jit(scanned)(x)
    else:

        def body(carry, row):
            y = soft(mj.masked_array(row[0], row[1]))
            return carry, (y.data, y.mask)

        _, (d, m) = jax.lax.scan(body, 0, (x.data, x.mask))
        out = mj.masked_array(d, m)
    assert out.dtype == jnp.dtype(dtype)
    tol = {"float32": 1e-6, "bfloat16": 1e-2, "float16": 1e-3}[dtype]
    for r in range(len(data)):
        np.testing.assert_array_equal(np.asarray(out.mask[r]), mask[r])
        if mask[r].any():
            want = fn(x.data[r][mask[r]])
            np.testing.assert_allclose(
                np.asarray(out.data[r], np.float32)[mask[r]], np.asarray(want, np.float32), rtol=tol, atol=tol
            )


def test_a_softmax_row_of_nan_stays_out_of_other_rows_sums():
    """A softmax row with a valid NaN is NaN at its masked entries too; only a contraction along the
    softmax's own axis (which reads the row's valid NaN as well) may skip filling them. A sum over
    the heads, where a masked entry of that row meets a valid entry of another head's row, fills
    it: the sum equals masked_jax.numpy's (finite there), eagerly and under jit."""
    x = mj.masked_array(
        jnp.array([[[np.nan, 0.5, 7.0], [0.1, 0.2, 0.3]], [[0.3, 0.1, 0.4], [1.0, 2.0, 3.0]]]),
        jnp.array([[[True, True, False], [True, True, True]], [[True, True, True], [True, True, True]]]),
    )

    def f(v, np_=jnp, nn_=jax.nn):
        return np_.sum(nn_.softmax(v, axis=-1), axis=0)

    want = f(x, mnp, mnn)
    assert np.isfinite(np.asarray(want.data[0, 2]))
    for g in (mj.maskify(f), jax.jit(mj.maskify(f))):
        _same(g(x), want)


def test_a_softmax_whose_exponentials_are_read_again_keeps_the_general_rules():
    """The exponentials also returned (read by more than the sum and the quotient): not the softmax
    pattern, so each op follows its own rule; the values equal masked_jax.numpy's."""
    data, mask = _softmax_rows()
    x = mj.masked_array(jnp.asarray(data[:3]), jnp.asarray(mask[:3]))

    def f(v, np_=jnp):
        e = np_.exp(v - jax.lax.stop_gradient(np_.max(v, axis=-1, keepdims=True)))
        return e / np_.sum(e, axis=-1, keepdims=True), e

    got = mj.maskify(f)(x)
    want = f(x, mnp)
    for g, w in zip(got, want):
        _same(g, w)


@pytest.mark.parametrize("ddof", [0, 1])
def test_a_layer_norm_over_the_features_of_a_token_mask_divides_by_the_static_count(ddof):
    """Each token is all valid or all masked along its features, so a mean or variance over them
    divides by the static feature count as jnp does: no valid count is formed (no int32 in the
    program), the mask stays the token mask, and values equal the per-sequence unpadded run."""
    xm, x = _padded(6)

    def norm(v):
        mu = jnp.mean(v, axis=-1, keepdims=True)
        return (v - mu) / jnp.sqrt(jnp.var(v, axis=-1, keepdims=True, ddof=ddof) + 1e-5)

    f = mj.maskify(norm)
    assert "int32" not in str(jax.make_jaxpr(f)(xm))
    for out in (f(xm), jax.jit(f)(xm)):
        assert out.compact_mask.shape == (3, 5, 1)
        for b, n in enumerate(LENGTHS):
            np.testing.assert_allclose(np.asarray(out.data[b, :n]), norm(jnp.asarray(x[b, :n])), rtol=1e-5, atol=1e-6)
            assert not np.asarray(out.mask[b, n:]).any()
    g = jax.grad(lambda d: jnp.sum(mj.maskify(norm)(mj.masked_array(d, xm.compact_mask)).data[:, :2] ** 2))(xm.data)
    assert np.isfinite(np.asarray(g)).all() and not np.asarray(g[1, 2:]).any()


# -- sanitising where it matters: known values under the mask -------------------------------------
_CHAIN_OPS = {
    "tanh": lambda v, w: jnp.tanh(v),
    "square": lambda v, w: jnp.square(v),
    "exp": lambda v, w: jnp.exp(v),
    "log1p_abs": lambda v, w: jnp.log1p(jnp.abs(v)),
    "rsqrt": lambda v, w: jax.lax.rsqrt(v * v + 1e-3),
    "scale": lambda v, w: v * w,
    "shift": lambda v, w: v + w,
    "divide": lambda v, w: v / (w * w + 0.5),
    "relu": lambda v, w: jnp.maximum(v, 0.0),
    "center": lambda v, w: v - jnp.mean(v, axis=-1, keepdims=True),
    "norm": lambda v, w: v * jax.lax.rsqrt(jnp.mean(v * v, axis=-1, keepdims=True) + 1e-5),
    "half": lambda v, w: 0.5 * v,
    "recip": lambda v, w: 1.0 / (v * v + 1.0),
    "dense": lambda v, w: v @ jnp.diag(w),
    # behind a barrier: under jit XLA would fold ``v * 3e38 * 0.5`` into ``v * 1.5e38``, which does
    # not overflow where the op-by-op product does
    "huge": lambda v, w: jax.lax.optimization_barrier(v * 3e38),
    "double": lambda v, w: v + v,
}


@settings(max_examples=int(os.environ.get("MJ_CHAIN_EXAMPLES", 40)) // 2)
@given(
    left=st.lists(st.sampled_from(sorted(_CHAIN_OPS)), min_size=0, max_size=3),
    right=st.lists(st.sampled_from(sorted(_CHAIN_OPS)), min_size=0, max_size=3),
    seed=st.integers(0, 2**16),
    garbage=st.sampled_from([np.nan, np.inf, 1e30]),
    special=st.sampled_from([None, np.inf, np.nan]),
)
def test_a_contraction_along_the_mask_of_two_chains_equals_its_ops_one_by_one(left, right, seed, garbage, special):
    """Property: two chains of elementwise ops from one masked batch (each side holding, under the
    token mask, what its ops made of the fills), contracted along the tokens (the masked axis, as
    attention's weights times values), under one maskify call equals the same ops maskify'd one
    call at a time, in values and weight gradients, with NaN, inf or huge padding and an inf or
    NaN among the weights."""
    rng = np.random.default_rng(seed)
    xm, _ = _padded(4, seed)
    xm = mj.masked_array(jnp.where(xm.compact_mask, xm.data, garbage), xm.compact_mask)
    w = rng.normal(size=4).astype(np.float32)
    if special is not None:
        w[rng.integers(4)] = special
    w = jnp.asarray(w)

    def side(ops, v, w, one_by_one):
        for name in ops:
            v = (mj.maskify(_CHAIN_OPS[name]) if one_by_one else _CHAIN_OPS[name])(v, w)
        return v

    def contract(a, b):
        return jnp.einsum("blf,blg->bfg", a, b)

    def together(v, w):
        return contract(side(left, v, w, False), side(right, v, w, False))

    def by_parts(v, w):
        return mj.maskify(contract)(side(left, v, w, True), side(right, v, w, True))

    for wrap in (lambda f: f, jax.jit):  # under jit both (XLA's rsqrt of a NaN under jit is not eager's)
        got, want = wrap(mj.maskify(together))(xm, w), wrap(by_parts)(xm, w)
        np.testing.assert_array_equal(np.asarray(got.mask), np.asarray(want.mask))
        np.testing.assert_allclose(np.asarray(got.filled(0.0)), np.asarray(want.filled(0.0)), rtol=1e-4, atol=1e-6)
    g_got = jax.grad(lambda w: jnp.sum(jnp.tanh(mj.maskify(together)(xm, w).filled(0.0))))(w)
    g_want = jax.grad(lambda w: jnp.sum(jnp.tanh(by_parts(xm, w).filled(0.0))))(w)
    np.testing.assert_allclose(np.asarray(g_got), np.asarray(g_want), rtol=2e-4, atol=1e-5)


def test_a_value_that_overflows_under_the_mask_is_not_taken_as_safe():
    """Filled data that an op without a fill of its own (an add) takes to inf under the mask are
    not recorded as safe: the dense layer after it fills them again, so the weight gradient has no
    ``inf * 0``."""
    x = mj.masked_array(jnp.array([[0.1, 0.2], [3.0, np.nan]], jnp.float32), jnp.array([[True], [False]]))
    f = mj.maskify(lambda v, w: (v * 3e38 + v * 3e38) @ w)
    g = jax.grad(lambda w: jnp.sum(f(x, w).filled(0.0)))(jnp.ones((2, 2), jnp.float32))
    np.testing.assert_allclose(np.asarray(g), [[6e37, 6e37], [1.2e38, 1.2e38]], rtol=1e-6)


@settings(max_examples=int(os.environ.get("MJ_CHAIN_EXAMPLES", 40)))
@given(
    ops=st.lists(st.sampled_from(sorted(_CHAIN_OPS)), min_size=2, max_size=6),
    seed=st.integers(0, 2**16),
    garbage=st.sampled_from([np.nan, np.inf, -np.inf, 1e30, 0.0]),
    special=st.sampled_from([None, np.inf, np.nan]),
)
def test_a_chain_sanitised_once_equals_its_ops_sanitised_one_by_one(ops, seed, garbage, special):
    """Property: a chain of elementwise ops, means and a dense layer under one maskify call (where
    data known to hold safe values under the mask are not filled again; eagerly, under jit and
    under vmap) gives the values and
    weight gradients of the same ops maskify'd one call at a time (each op sanitising its own
    inputs), with NaN, inf or huge values in the padding and an inf or NaN among the weights."""
    rng = np.random.default_rng(seed)
    xm, _ = _padded(4, seed)
    data = jnp.where(xm.compact_mask, xm.data, garbage)
    xm = mj.masked_array(data, xm.compact_mask)
    w = rng.normal(size=4).astype(np.float32)
    if special is not None:
        w[rng.integers(4)] = special
    w = jnp.asarray(w)

    def chain(v, w):
        for name in ops:
            v = _CHAIN_OPS[name](v, w)
        return v

    def by_parts(v, w):
        for name in ops:
            v = mj.maskify(_CHAIN_OPS[name])(v, w)
        return v

    # each form against the reference run the same way: under jit XLA's rsqrt of a NaN is not eager's
    for wrap in (lambda f: f, jax.jit, lambda f: jax.vmap(f, in_axes=(0, None))):
        got, want = wrap(mj.maskify(chain))(xm, w), wrap(by_parts)(xm, w)
        np.testing.assert_array_equal(np.asarray(got.mask), np.asarray(want.mask))
        # rtol: exp and rsqrt round differently in one fused program, and a chain (exp of exp) magnifies it
        np.testing.assert_allclose(np.asarray(got.filled(0.0)), np.asarray(want.filled(0.0)), rtol=1e-4, atol=1e-6)

    # arctan bounds the outputs (inf -> pi/2) and, unlike a saturating tanh, keeps the gradient as
    # well conditioned as the outputs: float32 roundings of one fused program and of the ops one by
    # one then move it by as little
    def loss(f):
        return lambda w: jnp.sum(jnp.arctan(f(xm, w).filled(0.0)))

    g_got, g_want = jax.grad(loss(mj.maskify(chain)))(w), jax.grad(loss(by_parts))(w)
    np.testing.assert_allclose(np.asarray(g_got), np.asarray(g_want), rtol=2e-4, atol=1e-5)
    # the input's gradient: the reference's on valid entries, exactly 0 under the mask
    gx = jax.grad(lambda d: jnp.sum(jnp.arctan(mj.maskify(chain)(mj.masked_array(d, xm.compact_mask), w).filled(0.0))))
    gx_want = jax.grad(lambda d: jnp.sum(jnp.arctan(by_parts(mj.masked_array(d, xm.compact_mask), w).filled(0.0))))
    got_x, want_x = np.asarray(gx(data)), np.asarray(gx_want(data))
    np.testing.assert_allclose(got_x, want_x, rtol=2e-4, atol=1e-5)
    assert not np.broadcast_to(~np.asarray(xm.compact_mask), got_x.shape)[got_x != 0].any()


@pytest.mark.parametrize("loop", ["scan", "while", "cond"])
def test_a_fill_inside_a_loop_body_is_not_reused_outside_it(loop):
    """The same masked value filled inside a scan, while or cond body (its own trace) and again
    outside: each trace gets its own fill (reusing the body's would leak its tracer); values equal
    jnp on the valid entries."""
    x = mj.masked_array(jnp.array([0.5, np.nan, 0.2]), jnp.array([True, False, True]))
    xs = jnp.arange(3.0)

    def f(x, xs):
        if loop == "scan":
            c, _ = lax.scan(lambda c, t: (c + jnp.tanh(x) * t, None), jnp.zeros_like(x), xs)
        elif loop == "while":
            c = lax.while_loop(lambda c: c[1] < 3, lambda c: (c[0] + jnp.tanh(x), c[1] + 1), (jnp.zeros_like(x), 0))[0]
        else:
            c = lax.cond(xs[0] < 1, lambda: jnp.tanh(x) * 3.0, lambda: jnp.zeros_like(x))
        return c + jnp.tanh(x)

    want = 4.0 * np.tanh(np.array([0.5, 0.2]))
    for g in (mj.maskify(f), jax.jit(mj.maskify(f))):
        out = g(x, xs)
        np.testing.assert_array_equal(np.asarray(out.mask), [True, False, True])
        np.testing.assert_allclose(np.asarray(out.data)[[0, 2]], want, rtol=1e-6)
