"""The op registry: one registration makes an op appear everywhere it is derived into."""

from __future__ import annotations

import warnings

import harness
import jax.numpy as jnp
import numpy as np
import pytest
from conformance_table import AXES, ROWS, Row, over_valid
from conformance_table import elementwise as ew_ref
from jax.extend import core as jcore
from jax.interpreters import ad, batching, mlir

import masked_jax as mj
import masked_jax.numpy as mnp
from masked_jax.ops import REGISTRY, elementwise, register, unregister
from masked_jax.ops._base import Pair
from masked_jax.ops._registry import OpSpec, rule_signature
from masked_jax.ops.reductions import sum as masked_sum

X = mj.masked_array(jnp.array([[1.0, jnp.nan, 3.0], [4.0, 5.0, 6.0]]), jnp.array([[True, False, True], [True] * 3]))


def _cube_primitive():
    """A brand-new lax primitive (x * x * x), with impl, abstract eval, lowering, JVP and batching.
    The cube is written as products, which keep every dtype (``x ** 3`` of a bool is an int32, which
    the abstract eval's "same dtype" would contradict)."""
    p = jcore.Primitive("toy_cube")
    p.def_impl(lambda x: x * x * x)
    p.def_abstract_eval(lambda x: x)  # same shape and dtype
    mlir.register_lowering(p, mlir.lower_fun(lambda x: x * x * x, multiple_results=False))
    ad.defjvp(p, lambda t, x: 3 * x * x * t)
    batching.defvectorized(p)
    return p


CUBE_P = _cube_primitive()


@pytest.fixture
def toy_ops():
    """Register an elementwise op (on a new primitive) and a reduction, with their table rows."""

    def sumsq(x, axis=None, keepdims=False):
        return masked_sum(Pair(jnp.square(x.data), x.mask), axis=axis, keepdims=keepdims)

    register(elementwise.unary_spec("toy_cube", CUBE_P.bind, safe=0, primitives=(CUBE_P,), methods=("toy_cube",)))
    register(
        OpSpec(
            name="toy_sumsq",
            family="reductions",
            rule=sumsq,
            signature=rule_signature(sumsq),
            operands=("x",),
            methods=("toy_sumsq",),
            segment=lambda g, v: g.sum(v * v),
            excluded={"maskify": "a toy with no jax function", "oracle": "a toy with no jax function to compare with"},
        )
    )
    ROWS["toy_cube"] = Row(ew_ref(lambda x: x**3))
    ROWS["toy_sumsq"] = Row(
        over_valid(lambda d, axis=None, keepdims=False: np.nansum(d * d, axis=axis, keepdims=keepdims)), cases=AXES
    )
    yield
    for name in ("toy_cube", "toy_sumsq"):
        unregister(name)
        del ROWS[name]


def test_a_new_op_is_one_registration_away_from_everywhere(toy_ops):
    want = mj.masked_array(X.data**3, X.mask)
    harness.assert_same(mnp.toy_cube(X), want)  # masked_jax.numpy
    harness.assert_same(X.toy_cube(), want)  # a method
    harness.assert_same(mj.maskify(lambda v: CUBE_P.bind(v) + 0.0)(X), want)  # maskify, by its primitive
    assert "toy_cube" in mnp.__all__ and "x" in str(__import__("inspect").signature(mnp.toy_cube))
    with mj.strict_storage():  # the layouts: elementwise on stored values, the reduction by segments
        assert mnp.toy_cube(X.tostype("bcoo")).storage == "bcoo"
        assert mnp.toy_sumsq(X.tostype("bcoo"), axis=1).storage == "bcoo"
    harness.assert_same(X.toy_sumsq(axis=1), mj.masked_array(jnp.array([10.0, 77.0]), jnp.array([True, True])))
    for name in ("toy_cube", "toy_sumsq"):  # and the whole conformance harness
        for check in harness.CHECKS:
            if check not in REGISTRY[name].excluded:
                harness.CHECKS[check](name)


def test_unregistered_op_is_gone_from_everywhere(toy_ops):
    spec = REGISTRY["toy_cube"]
    unregister("toy_cube")
    try:
        assert not hasattr(mnp, "toy_cube") and not hasattr(mj.MaskedArray, "toy_cube")
        with pytest.raises(mj.MaskifyError, match="toy_cube"):
            mj.maskify(lambda v: CUBE_P.bind(v))(X)
    finally:
        register(spec)  # for the fixture's teardown


def test_a_harness_check_fails_on_a_wrong_rule(toy_ops):
    """The harness can fail: a rule that reads masked-out data, or computes the wrong value, is caught."""
    spec = REGISTRY["toy_cube"]
    register(
        OpSpec(
            name="toy_cube",
            family="elementwise",
            signature=spec.signature,
            rule=lambda x: Pair(x.data**3 + 0 * jnp.sum(x.data), x.mask),
        )
    )  # NaN under the mask leaks
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(AssertionError, match="under the mask"):
            harness.check_poison("toy_cube")
    register(
        OpSpec(name="toy_cube", family="elementwise", rule=lambda x: Pair(x.data**2, x.mask), signature=spec.signature)
    )
    with pytest.raises(AssertionError, match="data differs"):
        harness.check_reference("toy_cube")
    register(spec)


def test_registry_rejects_malformed_specs():
    with pytest.raises(ValueError, match="family must be one of"):
        OpSpec(name="x", family="nope", rule=lambda x: x, signature=rule_signature(lambda x: x))
    with pytest.raises(ValueError, match="unknown checks"):
        elementwise.unary_spec("x", jnp.exp, excluded={"everything": "no"})
    with pytest.raises(ValueError, match="operand 'a' is not a parameter"):
        OpSpec(name="x", family="shape", rule=lambda x: x, signature=rule_signature(lambda x: x), operands=("a",))
    with pytest.raises(TypeError, match="spec must be an OpSpec"):
        register("exp")
