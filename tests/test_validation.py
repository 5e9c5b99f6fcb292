"""Bad input: every public callable rejects a malformed call with a ValueError or TypeError whose
message names the argument. The table is generated from the op registry for every masked_jax.numpy /
masked_jax.nn function, and written out for the rest of the public API."""

from __future__ import annotations

import harness
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conformance_table import ROWS as TABLE

import masked_jax as mj
import masked_jax.numpy as mnp
from masked_jax import optim
from masked_jax.numpy import _frontend
from masked_jax.ops import REGISTRY

X = mj.masked_array(jnp.ones((2, 3)), jnp.array([[True, False, True], [True, True, False]]))


def _first_operand(spec):
    return spec.operands[0].lstrip("*")


def _registry_rows():
    rows = []
    for name, spec in REGISTRY.items():
        if not spec.modules:
            continue
        fn = _frontend.function(name)
        operand = _first_operand(spec)
        bad = [object()] if spec.sequence else object()
        args = ("ij->ij", bad) if name == "einsum" else (bad,)
        label = f"{operand}[0]" if spec.sequence or operand in ("operands", "arys") else operand
        rows.append((f"{name}: a non-array {operand}", (lambda f=fn, a=args: f(*a)), TypeError, label))
        rows.append(
            (
                f"{name}: an unknown keyword",
                (
                    lambda n=name, f=fn: harness.call(
                        n, f, harness.operands(n, TABLE[n].dtypes[0]), {**TABLE[n].cases[0], "no_such_argument": 1}
                    )
                ),
                (TypeError, ValueError),
                "no_such_argument",
            )
        )
    return rows


MANUAL = [
    (
        "masked_array: float mask",
        lambda: mj.masked_array(jnp.zeros(3), jnp.array([1.0, 0.0, 1.0])),
        TypeError,
        "mask must have dtype bool",
    ),
    (
        "a float mask made by tree_map",
        lambda: mnp.mean(jax.tree.map(lambda a: a - 0.1 * a, X)),
        TypeError,
        "mask must stay bool",
    ),
    ("as_masked: a string", lambda: mj.as_masked("abc"), TypeError, "a must"),
    ("from_numpy_ma: a list", lambda: mj.from_numpy_ma([1, 2]), TypeError, "numpy.ma.MaskedArray"),
    (
        "row_sparse: float indices",
        lambda: mj.row_sparse(jnp.ones((1, 2)), jnp.array([0.5]), (3, 2)),
        TypeError,
        "indices must be integers",
    ),
    (
        "row_sparse: indices out of range",
        lambda: mj.row_sparse(jnp.ones((1, 2)), jnp.array([5]), (3, 2)),
        ValueError,
        "indices must be in",
    ),
    (
        "row_sparse: int64 index past int32 with x64 off",
        lambda: _x64_off(lambda: mj.row_sparse(jnp.ones((1, 2)), np.array([2**32], np.int64), (3, 2))),
        ValueError,
        "indices",
    ),
    ("lookup: float ids", lambda: mj.lookup(jnp.ones((3, 2)), jnp.array([0.5])), TypeError, "ids must be integers"),
    (
        "lookup: int64 id past int32 with x64 off",
        lambda: _x64_off(lambda: mj.lookup(jnp.ones((3, 2)), np.array([2**32], np.int64))),
        ValueError,
        "ids",
    ),
    ("from_bcoo: not a BCOO", lambda: mj.from_bcoo(jnp.ones(3)), TypeError, "BCOO"),
    ("tostype: unknown storage", lambda: X.tostype("csr"), ValueError, "storage must be"),
    ("sum: axis out of range", lambda: mnp.sum(X, axis=2), ValueError, "axis 2 is out of bounds"),
    ("sum: repeated axis", lambda: mnp.sum(X, axis=(0, 0)), ValueError, "repeated axis"),
    ("mean: a float axis", lambda: mnp.mean(X, axis=1.5), TypeError, "axis must be None, an int"),
    ("argmax: tuple axis", lambda: mnp.argmax(X, axis=(0, 1)), TypeError, "axis must be an int"),
    ("quantile: q out of [0, 1]", lambda: mnp.quantile(X, 1.5), ValueError, "q must be numbers in"),
    ("partition: kth out of range", lambda: mnp.partition(X, 3), ValueError, "kth must be an int in [-3, 3)"),
    ("argpartition: a float kth", lambda: mnp.argpartition(X, 1.5), ValueError, "kth must be an int"),
    (
        "cov: a 3-D input",
        lambda: mnp.cov(mj.masked_array(jnp.ones((2, 2, 2)), jnp.ones((2, 2, 2), bool))),
        ValueError,
        "1-D or 2-D",
    ),
    ("cov: a float ddof", lambda: mnp.cov(X, ddof=0.5), TypeError, "ddof must be an int"),
    (
        "cov: y with another number of observations",
        lambda: mnp.cov(X, y=mj.masked_array(jnp.ones((1, 7)), jnp.ones((1, 7), bool))),
        ValueError,
        "as many observations",
    ),
    (
        "corrcoef: a 3-D input",
        lambda: mnp.corrcoef(mj.masked_array(jnp.ones((2, 2, 2)), jnp.ones((2, 2, 2), bool))),
        ValueError,
        "1-D or 2-D",
    ),
    ("percentile: q out of [0, 100]", lambda: mnp.percentile(X, 150.0), ValueError, "q must be numbers in"),
    ("norm: unknown matrix ord", lambda: mnp.norm(X, ord=3, axis=(0, 1)), ValueError, "ord must be one of"),
    (  # jnp's message, word for word
        "norm: three axes",
        lambda: mnp.norm(mj.masked_array(jnp.ones((2, 2, 2)), jnp.ones((2, 2, 2), bool)), axis=(0, 1, 2)),
        ValueError,
        "Improper number of axes for norm",
    ),
    ("norm: matrix ord for a vector", lambda: mnp.norm(X, ord="fro", axis=0), ValueError, "ord='fro' is a matrix"),
    ("add: shapes that do not broadcast", lambda: mnp.add(X, jnp.ones(4)), ValueError, "could not be broadcast"),
    ("sum: initial=", lambda: mnp.sum(X, initial=1.0), TypeError, "initial=1.0 is not supported"),
    ("take: float indices", lambda: mnp.take(X, jnp.array([0.5])), TypeError, "indices must be integers"),
    ("where=: a float array", lambda: mnp.sum(X, where=jnp.ones((2, 3))), TypeError, "where must be a bool"),
    ("check_jacobian: eps=0", lambda: mj.check_jacobian(jnp.sin, (jnp.ones(2),), eps=0), ValueError, "eps must be"),
    ("check_jacobian: atol<0", lambda: mj.check_jacobian(jnp.sin, (jnp.ones(2),), atol=-1), ValueError, "atol must be"),
    (
        "check_jacobian: rtol not a number",
        lambda: mj.check_jacobian(jnp.sin, (jnp.ones(2),), rtol="x"),
        TypeError,
        "rtol must be a number",
    ),
    ("check_jacobian: f not callable", lambda: mj.check_jacobian(3, (jnp.ones(2),)), TypeError, "f must be callable"),
    (
        "check_jacobian: semantics",
        lambda: mj.check_jacobian(jnp.sin, (jnp.ones(2),), semantics="x"),
        ValueError,
        "semantics must be",
    ),
    ("lazy: not a transformation", lambda: optim.lazy(3), TypeError, "inner must be an optax"),
    (
        "lazy: gradient of another shape",
        lambda: _lazy_update(mj.row_sparse(jnp.ones((1, 3)), jnp.array([4]), (5, 3)), jnp.zeros((2, 3))),
        ValueError,
        "shape",
    ),
    (
        "lazy: another optimizer's state",
        lambda: optim.lazy(optax.adam(0.1)).update(X, optax.sgd(0.1).init(jnp.zeros((2, 3)))),
        ValueError,
        "state does not belong",
    ),
    (
        "masked_adagrad: another parameter's state",
        lambda: optim.masked_adagrad(0.1).update(X, optim.masked_adagrad(0.1).init(jnp.zeros((3, 3)))),
        ValueError,
        "state does not belong",
    ),
    (
        "scale_by_rss: another parameter's state",
        lambda: optim.scale_by_rss().update(X, optim.scale_by_rss().init(jnp.zeros((3, 3)))),
        ValueError,
        "sums of squares have shapes",
    ),
    (
        "apply_updates: a string update",
        lambda: optim.apply_updates(jnp.zeros(2), "x"),
        TypeError,
        "updates must be arrays",
    ),
    (
        "apply_updates: shape mismatch",
        lambda: optim.apply_updates(jnp.zeros(2), jnp.zeros(3)),
        ValueError,
        "must match",
    ),
    (
        "make_train_step: loss not callable",
        lambda: optim.make_train_step(3, optax.sgd(0.1)),
        TypeError,
        "loss_fn must be callable",
    ),
    ("grad: argnums out of range", lambda: mj.grad(lambda x: mnp.sum(x), argnums=3)(X), ValueError, "argnums"),
    ("tangent: wrong shape", lambda: mj.tangent(X, jnp.ones(3)), ValueError, "data_tangent must have shape"),
    ("one_hot: float classes", lambda: mj.nn.one_hot(X, 3), TypeError, "integer class indices"),
    (
        "value_and_grad: argnums out of range",
        lambda: mj.value_and_grad(lambda x: mnp.sum(x), argnums=2)(X),
        ValueError,
        "argnums",
    ),
    ("jacfwd: argnums out of range", lambda: mj.jacfwd(lambda x: x, argnums=1)(X), ValueError, "argnums"),
    ("jacrev: argnums out of range", lambda: mj.jacrev(lambda x: x, argnums=1)(X), ValueError, "argnums"),
    ("hessian: argnums out of range", lambda: mj.hessian(lambda x: mnp.sum(x), argnums=1)(X), ValueError, "argnums"),
    ("grad: a non-scalar loss", lambda: mj.grad(lambda x: x)(X), TypeError, "scalar output"),
    ("maskify: not callable", lambda: mj.maskify(3), TypeError, "fun must be callable"),
    ("strict_storage: not a bool", lambda: mj.strict_storage("yes").__enter__(), TypeError, "strict must be a bool"),
    ("scale_by_rss: eps_placement", lambda: optim.scale_by_rss(eps_placement="middle"), ValueError, "eps_placement"),
    (
        "init_sharded: not a transformation",
        lambda: optim.init_sharded(3, jnp.zeros(2)),
        TypeError,
        "optimizer must be an optax",
    ),
    (
        "sharded_update: mesh",
        lambda: optim.sharded_update(optim.lazy(optax.sgd(0.1)), jnp.zeros(2), (), jnp.zeros(2), mesh=3, axis="rows"),
        TypeError,
        "mesh must be",
    ),
    (
        "lazy(optax.masked): the reason and the way out",
        lambda: _lazy_masked_update(optax.masked(optax.adam(0.1), {"a": True, "b": False})),
        ValueError,
        "optax.masked(lazy(inner), mask)",
    ),
]


def _lazy_masked_update(inner):
    """lazy(inner) given a masked gradient (with plain gradients every inner is accepted)."""
    opt = optim.lazy(inner)
    params = {"a": jnp.zeros(2), "b": jnp.zeros(2)}
    grads = {"a": mj.masked_array(jnp.ones(2), jnp.array([True, False])), "b": jnp.ones(2)}
    return opt.update(grads, opt.init(params), params)


def _x64_off(fn):
    jax.config.update("jax_enable_x64", False)
    try:
        return fn()
    finally:
        jax.config.update("jax_enable_x64", True)


def _lazy_update(g, params):
    opt = optim.lazy(optax.adam(0.1))
    return opt.update(g, opt.init(params), params)


ROWS = _registry_rows() + MANUAL


@pytest.mark.parametrize("what,call,error,names", ROWS, ids=[r[0] for r in ROWS])
def test_bad_input_names_the_argument(what, call, error, names):
    with pytest.raises(error) as info:
        call()
    assert names in str(info.value), f"{what}: {info.value}"


def test_the_table_covers_every_public_function():
    public = {
        n for n in mnp.__all__ if getattr(getattr(mnp, n), "spec", None) is not None and getattr(mnp, n).spec.name == n
    }  # amax, amin: aliases of max, min
    covered = {r[0].split(":")[0] for r in ROWS}
    assert public <= covered
    assert len(ROWS) > 2 * len(public)


# -- bad input by argument kind: every kind's bad values, fed to every public parameter of that kind ----
from masked_jax import _validate  # noqa: E402

_REDUCERS = ["sum", "mean", "var", "std", "max", "min", "argmax", "cumsum", "logsumexp", "median", "ptp", "any"]
KIND_PARAMS = {
    "shape": [("row_sparse: shape", lambda v: mj.row_sparse(jnp.ones((1, 2)), jnp.array([0]), v))],
    "count": [("one_hot: num_classes", lambda v: mj.nn.one_hot(jnp.array([1]), v))],
    "nonnegative": [
        ("initial_accumulator_value", lambda v: optim.masked_adagrad(0.1, initial_accumulator_value=v)),
        ("eps", lambda v: optim.masked_adagrad(0.1, eps=v)),
        ("eps", lambda v: optim.scale_by_rss(eps=v)),
    ],
    "learning_rate": [("learning_rate", lambda v: optim.masked_adagrad(v))],
    "axis": [(f"{n}: axis", lambda v, n=n: getattr(mnp, n)(X, axis=v)) for n in _REDUCERS]
    + [("softmax: axis", lambda v: mj.nn.softmax(X, axis=v)), ("diff: axis", lambda v: mnp.diff(X, axis=v))],
    "dtype": [
        ("astype: dtype", lambda v: mnp.astype(X, v)),
        ("sum: dtype", lambda v: mnp.sum(X, dtype=v)),
        ("mean: dtype", lambda v: mnp.mean(X, dtype=v)),
    ],
}
KIND_ROWS = [
    (kind, label, call, bad, error)
    for kind, params in KIND_PARAMS.items()
    for label, call in params
    for bad, error in _validate.KINDS[kind][1]
]


@pytest.mark.parametrize(
    "kind,label,call,bad,error", KIND_ROWS, ids=[f"{k}-{label}-{bad!r}" for k, label, _, bad, _ in KIND_ROWS]
)
def test_bad_input_by_argument_kind(kind, label, call, bad, error):
    with pytest.raises(error) as info:
        call(bad)
    name = label.split(": ")[-1]
    assert name in str(info.value) or (kind == "axis" and "axis" in str(info.value)), f"{label}={bad!r}: {info.value}"


def test_every_argument_kind_has_bad_values_and_parameters():
    assert set(KIND_PARAMS) == set(_validate.KINDS)
    for kind, (check, bad) in _validate.KINDS.items():
        assert bad and callable(check), kind
