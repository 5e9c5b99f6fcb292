"""Under ``maskify`` a ``custom_jvp`` / ``custom_vjp`` function's derivative is its own rule on the
valid entries; its values and masks are those of its primal under the masked rules.

* ``jax.nn.relu``'s derivative at 0 is 0 (relu's own rule), not the 0.5 of ``max(x, 0)``'s
  derivative, eagerly and under ``jit``, in forward and reverse mode;
* a NaN-safe rule (a norm whose JVP guards ``x == 0``, a square root whose VJP does) stays finite
  and equals the unpadded runs' gradients;
* a Set Transformer-like model (features centred on their set's mean, then relu) with a set of
  one element, where every centred feature is exactly 0, has the parameter gradients of the
  per-set unpadded runs, over right and left padding and holes with NaN in the padding, eagerly
  and under ``jit``, written by hand, with flax linen and with equinox;
* custom rules inside ``jit``, ``vmap``, ``scan`` bodies and other custom rules; free positions
  (a relu of a ``segment_sum``) and compact masks are kept.
"""

from __future__ import annotations

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import masked_jax as mj
from masked_jax import _jaxpr

RTOL = 1e-5
B, L, D, H = 3, 6, 3, 4
# each padding has a set of one element (the last row) and a full one (the first)
PADDINGS = {
    "right": np.array([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0], [1, 0, 0, 0, 0, 0]], bool),
    "left": np.array([[1, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1], [0, 0, 0, 0, 0, 1]], bool),
    "holes": np.array([[1, 1, 1, 1, 1, 1], [1, 0, 1, 1, 0, 1], [0, 0, 1, 0, 0, 0]], bool),
}


def _close(got, want, what):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=RTOL, atol=RTOL, err_msg=what)


def _finite(tree, what):
    assert all(bool(jnp.isfinite(g).all()) for g in jax.tree.leaves(tree)), f"{what}: not finite"


# -- relu'(0) -------------------------------------------------------------------------------------
X = mj.masked_array(
    jnp.array([[0.0, 1.5, -2.0, np.nan], [0.0, 0.0, np.nan, 3.0]]),
    jnp.array([[True, True, True, False], [True, True, False, False]]),
)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_relu_has_derivative_zero_at_zero(jit):
    """relu's own rule: 0 at 0, in mj.grad, jax.grad, jacfwd and jacrev; 0 under the mask."""
    wrap = jax.jit if jit else (lambda f: f)
    total = mj.maskify(lambda v: jnp.sum(jax.nn.relu(v)))
    elementwise = mj.maskify(jax.nn.relu)
    want = np.array([[0.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]], np.float32)

    g = wrap(mj.grad(total))(X)
    np.testing.assert_array_equal(np.asarray(g.mask), np.asarray(X.mask))
    np.testing.assert_array_equal(np.asarray(g.data), want)
    g = wrap(jax.grad(lambda d: total(mj.masked_array(d, X.mask)).data))(X.data)
    np.testing.assert_array_equal(np.asarray(g), want)
    for jac in (jax.jacfwd, jax.jacrev):
        j = wrap(jac(lambda d: elementwise(mj.masked_array(d, X.mask)).filled(0.0)))(X.data)
        np.testing.assert_array_equal(np.asarray(jnp.einsum("ijij->ij", j)), want)
        np.testing.assert_array_equal(np.asarray(j).reshape(8, 8) != 0, np.diag(want.ravel() != 0))


def test_custom_rules_of_jax_functions_match_the_plain_functions_on_the_valid_entries():
    """relu6 at 0 and 6, softplus (``logaddexp``'s rule), ``jnp.sinc`` at 0, and second
    derivatives (``hessian``: sinc's at 0 is its rule's, not the 0 of its body's ``where``)."""
    x = mj.masked_array(jnp.array([0.0, 6.0, 3.0, -1.0, np.nan]), jnp.array([True, True, True, True, False]))
    valid = x.data[:4]
    for fn in (jax.nn.relu6, jax.nn.softplus, lambda v: jnp.logaddexp(v, 0.5 * v), jnp.sinc):
        loss = lambda v, fn=fn: jnp.sum(fn(v) ** 2)
        f = mj.maskify(loss)
        g = jax.jit(mj.grad(f))(x)
        _close(g.data[:4], jax.grad(loss)(valid), f"{fn}: gradient")
        assert float(g.data[4]) == 0.0 and not bool(g.mask[4])
        h = jax.hessian(lambda d, f=f: f(mj.masked_array(d, x.mask)).data)(x.data)
        _close(h[:4, :4], jax.hessian(loss)(valid), f"{fn}: hessian")
        assert not np.asarray(h[4]).any() and not np.asarray(h[:, 4]).any()


# -- NaN-safe rules ----------------------------------------------------------------------------------
@jax.custom_jvp
def safe_norm(v):
    """The norm along the last axis, with derivative 0 at 0 (sqrt's would be inf * 0 = NaN)."""
    return jnp.sqrt(jnp.sum(v * v, axis=-1))


@safe_norm.defjvp
def _safe_norm_jvp(primals, tangents):
    (v,), (dv,) = primals, tangents
    n = safe_norm(v)
    nonzero = n > 0
    return n, jnp.where(nonzero, jnp.sum(v * dv, axis=-1) / jnp.where(nonzero, n, 1.0), 0.0)


@jax.custom_vjp
def safe_sqrt(v):
    return jnp.sqrt(v)


def _safe_sqrt_fwd(v):
    s = jnp.sqrt(v)
    return s, s


def _safe_sqrt_bwd(s, g):
    return (jnp.where(s > 0, g / (2.0 * jnp.where(s > 0, s, 1.0)), 0.0),)


safe_sqrt.defvjp(_safe_sqrt_fwd, _safe_sqrt_bwd)


@jax.custom_vjp
def logsumexp_vjp(v):
    """A custom_vjp whose backward rule reads the whole last axis (a softmax of it)."""
    return jnp.log(jnp.sum(jnp.exp(v), axis=-1))


def _lse_fwd(v):
    y = logsumexp_vjp(v)
    return y, (v, y)


def _lse_bwd(res, g):
    v, y = res
    return (g[..., None] * jnp.exp(v - y[..., None]),)


logsumexp_vjp.defvjp(_lse_fwd, _lse_bwd)

# rows along the reduced axis: valid zeros (the guarded point) with NaN in the holes
ROWS = np.array([[0.0, np.nan, 0.0, 0.0], [1.0, -2.0, np.nan, 0.5], [np.nan, 0.0, np.nan, np.nan]], np.float32)
ROW_MASK = ~np.isnan(ROWS)
REDUCING = {
    "custom_jvp norm": lambda w, v: safe_norm(v * w),
    "custom_vjp sqrt": lambda w, v: safe_sqrt(jnp.sum((v * w) ** 2, axis=-1)),
    "custom_vjp logsumexp": lambda w, v: logsumexp_vjp(v * w),
    "optax.safe_norm": lambda w, v: optax.safe_norm(v * w, 0.0, axis=-1),
}


@pytest.mark.parametrize("name", sorted(REDUCING))
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_nan_safe_rules_stay_finite_and_equal_the_unpadded_rows(name, jit):
    """Gradients with respect to the masked rows and to a weight equal each row's unpadded run,
    finite where that one is, 0 under the mask; values and masks equal the unpadded rows'."""
    fn, w = REDUCING[name], jnp.float32(1.5)
    x = mj.masked_array(jnp.asarray(ROWS), jnp.asarray(ROW_MASK))
    masked = mj.maskify(lambda w, v: jnp.sum(fn(w, v) * jnp.arange(1.0, 4.0)))
    wrap = jax.jit if jit else (lambda f: f)
    out = wrap(mj.maskify(fn))(w, x)
    gw, gx = wrap(jax.grad(lambda w, d: masked(w, mj.masked_array(d, x.mask)).data, argnums=(0, 1)))(w, x.data)
    want_w = 0.0
    for r in range(3):
        row = jnp.asarray(ROWS[r][ROW_MASK[r]])
        _close(out.data[r], fn(w, row), f"row {r}: value")
        rw, rx = jax.grad(lambda w, v, r=r: fn(w, v) * (r + 1.0), argnums=(0, 1))(w, row)
        _finite((rw, rx), f"the unpadded row {r}")
        _close(gx[r][ROW_MASK[r]], rx, f"row {r}: input gradient")
        assert not np.asarray(gx[r][~ROW_MASK[r]]).any()
        want_w += rw
    assert bool(out.mask.all())
    _close(gw, want_w, "weight gradient")
    g = mj.grad(lambda v: masked(w, v))(x)  # mj.grad: the input's mask, finite
    np.testing.assert_array_equal(np.asarray(g.mask), ROW_MASK)
    _finite(g.data, "mj.grad")


def test_a_custom_vjp_function_has_no_forward_mode_as_in_jax():
    x = mj.masked_array(jnp.asarray(ROWS), jnp.asarray(ROW_MASK))
    f = mj.maskify(lambda v: safe_sqrt(jnp.sum(v * v, axis=-1)))
    with pytest.raises(TypeError, match="custom_vjp"):
        jax.jvp(lambda v: safe_sqrt(jnp.sum(v * v, axis=-1)), (jnp.ones(3),), (jnp.ones(3),))
    with pytest.raises(TypeError, match="custom_vjp"):
        jax.jacfwd(lambda d: f(mj.masked_array(d, x.mask)).data)(x.data)


# -- a Set Transformer-like model: centred features through relu, a set of one ------------------------
# A set of one element centred on its mean is exactly 0; a dense layer with a zero bias (flax's
# and the usual initialisation) keeps it 0, so relu meets 0 with a nonzero derivative along the
# bias: its own rule's 0 there, where max(x, 0)'s derivative would give the bias half the gradient.
def _set_params(seed=0):
    k = jax.random.split(jax.random.key(seed), 3)
    return {
        "w1": jax.random.normal(k[0], (D, H)),
        "w2": jax.random.normal(k[1], (H, H)),
        "b2": jnp.zeros((H,)),
        "w3": jax.random.normal(k[2], (H, 2)),
    }


def set_encoder(p, x):
    """(B, L, D) sets -> (B, 2): each element's features centred on its set's mean, a dense layer
    and relu, pooled over the set."""
    h = x @ p["w1"]
    h = jax.nn.relu((h - jnp.mean(h, axis=1, keepdims=True)) @ p["w2"] + p["b2"])  # a set of one: 0
    return jnp.mean(h, axis=1) @ p["w3"]


class LinenSetEncoder(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.Dense(H)(x)
        h = nn.relu(nn.Dense(H)(h - jnp.mean(h, axis=1, keepdims=True)))
        return nn.Dense(2)(jnp.mean(h, axis=1))


class EqxSetEncoder(eqx.Module):
    mlp: eqx.nn.MLP  # relu activations
    centred: eqx.nn.Linear
    out: eqx.nn.Linear

    def __call__(self, x):  # one set (L, D)
        h = jax.vmap(self.mlp)(x)
        h = jax.nn.relu(jax.vmap(self.centred)(h - jnp.mean(h, axis=0, keepdims=True)))
        return self.out(jnp.mean(h, axis=0))


def _linen_model():
    module = LinenSetEncoder()
    return module.apply, module.init(jax.random.key(1), jnp.zeros((1, 2, D)))


def _eqx_model():
    k = jax.random.split(jax.random.key(2), 3)
    centred = eqx.nn.Linear(H, H, key=k[1])
    model = EqxSetEncoder(
        eqx.nn.MLP(D, H, H, 1, key=k[0]),
        eqx.tree_at(lambda m: m.bias, centred, jnp.zeros(H)),
        eqx.nn.Linear(H, 2, key=k[2]),
    )
    params, static = eqx.partition(model, eqx.is_array)
    return (lambda p, v: jax.vmap(eqx.combine(p, static))(v)), params


def _scanned_model():
    """Two centred relu layers stacked with lax.scan (the masked carry through the scan's body)."""
    k = jax.random.split(jax.random.key(3), 2)
    params = {"w": jax.random.normal(k[0], (2, H, H)), "b": jnp.zeros((2, H)), "w0": jax.random.normal(k[1], (D, H))}

    def apply(p, x):
        def layer(h, wb):
            w, b = wb
            return jax.nn.relu((h - jnp.mean(h, axis=1, keepdims=True)) @ w + b) + h, None

        return jnp.mean(jax.lax.scan(layer, x @ p["w0"], (p["w"], p["b"]))[0], axis=1)

    return apply, params


MODELS = {
    "by-hand": lambda: (set_encoder, _set_params()),
    "linen": _linen_model,
    "equinox": _eqx_model,
    "scan": _scanned_model,
}


@pytest.mark.parametrize("padding", sorted(PADDINGS))
@pytest.mark.parametrize("model", sorted(MODELS))
def test_a_set_of_one_has_the_gradients_of_the_unpadded_runs(model, padding):
    apply, params = MODELS[model]()
    valid = PADDINGS[padding]
    x = np.random.default_rng(0).normal(size=(B, L, D)).astype(np.float32)
    xm = mj.masked_array(jnp.asarray(np.where(valid[..., None], x, np.nan)), jnp.asarray(valid[..., None]))
    alone = [jnp.asarray(x[b : b + 1, valid[b]]) for b in range(B)]
    for label, fn in (("eager", mj.maskify(apply)), ("jit", jax.jit(mj.maskify(apply)))):
        out = fn(params, xm)
        assert bool(out.mask.all()), label
        for b in range(B):
            _close(out.data[b], apply(params, alone[b])[0], f"{label}: set {b}")

    def masked_loss(p):
        return jnp.sum(jnp.tanh(mj.maskify(apply)(p, xm).data))

    def ref_loss(p):
        return sum(jnp.sum(jnp.tanh(apply(p, a))) for a in alone)

    want = jax.grad(ref_loss)(params)
    for label, grad in (("eager", jax.grad(masked_loss)), ("jit", jax.jit(jax.grad(masked_loss)))):
        got = grad(params)
        _finite(got, label)
        jax.tree.map(lambda a, b, label=label: _close(a, b, f"{label}: parameter gradient"), got, want)


def test_a_set_of_one_under_vmap_of_the_maskified_function():
    """maskify of one set, vmapped over the batch (jax's batching of the custom rules)."""
    params, valid = _set_params(), PADDINGS["holes"]
    x = np.random.default_rng(1).normal(size=(B, L, D)).astype(np.float32)
    xm = mj.masked_array(jnp.asarray(np.where(valid[..., None], x, np.nan)), jnp.asarray(valid[..., None]))
    one = mj.maskify(lambda p, v: set_encoder(p, v[None])[0])

    def masked_loss(p):
        return jnp.sum(jax.vmap(one, in_axes=(None, 0))(p, xm).data)

    want = jax.grad(lambda p: sum(jnp.sum(set_encoder(p, jnp.asarray(x[b : b + 1, valid[b]]))) for b in range(B)))(
        params
    )
    got = jax.jit(jax.grad(masked_loss))(params)
    jax.tree.map(lambda a, b: _close(a, b, "parameter gradient"), got, want)


# -- the rule that decides, what stays as it was ---------------------------------------------------------
@jax.custom_jvp
def doubled_relu(v):
    return 2.0 * jax.nn.relu(v)


@doubled_relu.defjvp
def _doubled_relu_jvp(primals, tangents):
    (v,), (dv,) = primals, tangents
    return doubled_relu(v), jnp.where(v >= 0, 7.0, 2.0) * dv  # 7 at and above 0: the outer rule decides


def test_the_outermost_rule_decides_for_nested_custom_rules():
    g = jax.jit(mj.grad(mj.maskify(lambda v: jnp.sum(doubled_relu(v)))))(X)
    np.testing.assert_array_equal(np.asarray(g.data), [[7.0, 7.0, 2.0, 0.0], [7.0, 7.0, 0.0, 0.0]])


def _primal_body(f):
    """``f`` with its custom rules inlined: the primal body, which maskify interpreted before."""

    def body(v):
        closed = jax.make_jaxpr(f)(v)
        return _jaxpr.inline(closed.jaxpr, closed.consts, [v])[0]

    return body


FUNCTIONS = {
    "relu": jax.nn.relu,
    "softplus": jax.nn.softplus,
    "safe_norm": safe_norm,
    "safe_sqrt": lambda v: safe_sqrt(v * v),
    "logsumexp_vjp": logsumexp_vjp,
    "doubled_relu": doubled_relu,
}


@pytest.mark.parametrize("name", sorted(FUNCTIONS))
def test_values_and_masks_are_those_of_the_primal_body(name):
    """A function with a custom rule gives, data and (compact) mask alike, what its primal body
    gives under maskify, eagerly and under jit: only the derivative changed."""
    custom = FUNCTIONS[name]
    body = _primal_body(custom)
    valid = PADDINGS["holes"][..., None]
    tokens = mj.masked_array(jnp.asarray(np.where(valid, 1.0, np.nan)) * jnp.arange(-1.0, 2.0), jnp.asarray(valid))
    for x in (X, tokens):
        for wrap in (lambda f: f, jax.jit):
            got, want = wrap(mj.maskify(custom))(x), wrap(mj.maskify(body))(x)
            np.testing.assert_array_equal(np.asarray(got.compact_mask), np.asarray(want.compact_mask))
            np.testing.assert_array_equal(np.asarray(got.data), np.asarray(want.data))


def test_a_relu_of_a_segment_sum_keeps_its_free_positions():
    """``h + relu(segment_sum(...))``: a valid node that no valid edge reaches stays valid, as in the
    graph run alone, and the gradients equal that run's."""
    h = mj.masked_array(jnp.array([[1.0, -1.0], [0.5, 2.0], [np.nan, np.nan]]), jnp.array([[True], [True], [False]]))
    ids = mj.masked_array(jnp.array([0, 0, 2]), jnp.array([True, True, False]))

    def layer(w, h, ids):
        return jnp.sum(jnp.tanh(h + jax.nn.relu(jax.ops.segment_sum(h * w, ids, h.shape[0]))), axis=-1)

    w = jnp.array([1.0, -1.0])
    out = jax.jit(mj.maskify(layer))(w, h, ids)
    np.testing.assert_array_equal(np.asarray(out.mask), [True, True, False])  # node 1: no edge, valid
    alone = (h.data[:2], ids.data[:2])
    _close(out.data[:2], layer(w, *alone), "values")
    got = jax.grad(lambda w: jnp.sum(mj.maskify(layer)(w, h, ids).data))(w)
    _close(got, jax.grad(lambda w: jnp.sum(layer(w, *alone)))(w), "weight gradient")


# -- what cannot be carried ------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["custom_jvp", "custom_vjp"])
def test_a_custom_rule_closing_over_a_differentiated_value_raises(kind):
    def f(w, v):
        if kind == "custom_jvp":

            @jax.custom_jvp
            def scale(u):
                return u * w

            scale.defjvp(lambda p, t: (scale(p[0]), t[0] * w))
        else:

            @jax.custom_vjp
            def scale(u):
                return u * w

            scale.defvjp(lambda u: (u * w, None), lambda _, g: (g * w,))
        return jnp.sum(scale(v))

    with pytest.raises(mj.MaskifyError, match=f"{kind} function 'scale' closes over"):
        jax.grad(lambda w: mj.maskify(f)(w, X).data)(2.0)
    # not differentiated with respect to it: the function's own rule
    g = mj.grad(lambda v: mj.maskify(f)(2.0, v))(X)
    np.testing.assert_array_equal(np.asarray(g.filled(0.0)), np.where(np.asarray(X.mask), 2.0, 0.0))


def _scaled_by(w, kind="custom_jvp"):
    """A function with a rule of its own (3 times the derivative of its body) closing over ``w``."""

    @jax.custom_jvp
    def scale(u):
        return u * w

    scale.defjvp(lambda p, t: (scale(p[0]), t[0] * w * 3.0))
    return scale


def test_a_rule_closing_over_a_value_traced_inside_the_function_raises():
    """The rule reads ``w``, traced with the function: it cannot run once the function is traced
    (jax cannot differentiate ``jit`` of such a function either). A ``w`` traced outside the
    maskify'd function (closed over by it) is still there when the rule runs: its rule applies."""

    def f(w, v):
        return jnp.sum(_scaled_by(w)(v))

    for grad in (
        mj.grad(lambda v: mj.maskify(f)(jnp.float32(2.0), v)),
        jax.jit(mj.grad(lambda v: mj.maskify(f)(jnp.float32(2.0), v))),
    ):
        with pytest.raises(
            mj.MaskifyError, match="rule of the custom-derivative function 'scale' closes over a value traced inside f"
        ):
            grad(X)

    def outside(w, d):
        return mj.maskify(lambda v: jnp.sum(_scaled_by(w)(v)))(mj.masked_array(d, X.mask)).data

    for grad in (jax.grad(outside, argnums=1), jax.jit(jax.grad(outside, argnums=1))):
        np.testing.assert_array_equal(
            np.asarray(grad(jnp.float32(2.0), X.data)), np.where(np.asarray(X.mask), 6.0, 0.0)
        )


def test_a_custom_call_on_plain_operands_is_bound_with_its_rules():
    """A custom rule reached by no masked operand (a softplus of a parameter) runs as jax runs it."""
    scale = jnp.array([0.0, -1.0, 2.0, 0.5])

    def f(s, v):
        return jnp.sum(jax.nn.softplus(s) * jax.nn.relu(s) + v)

    np.testing.assert_array_equal(np.asarray(mj.maskify(jax.nn.relu)(scale)), np.asarray(jax.nn.relu(scale)))
    got = jax.jit(jax.grad(lambda s: mj.maskify(f)(s, X).data))(scale)
    counts = jnp.sum(X.mask, axis=0)  # each column is summed over its valid entries
    _close(got, jax.grad(lambda s: f(s, 0.0))(scale) * counts, "parameter gradient")


def test_a_derivative_rule_without_a_masked_meaning_raises_naming_the_function():
    @jax.custom_jvp
    def spectral(v):
        return v * 2.0

    spectral.defjvp(lambda p, t: (spectral(p[0]), jnp.real(jnp.fft.ifft(jnp.fft.fft(t[0])))))
    f = mj.maskify(lambda v: jnp.sum(spectral(v)))
    _close(f(X).data, 2.0 * jnp.nansum(X.filled(0.0)), "values")
    with pytest.raises(mj.MaskifyError, match="derivative rule.*'spectral'.*fft"):
        mj.grad(f)(X)
