"""numpy.ma's own tests (numpy/ma/tests/test_core.py), translated for the functions
``masked_jax.numpy`` mirrors. Each case names the numpy test it comes from; it runs the same
expression on numpy.ma arrays and on ours (``ns`` is ``numpy.ma`` or ``masked_jax.numpy``) and
compares masks and valid values. numpy.ma's mask is True where an element is masked; ours is
True where it is valid.

Deliberate differences (docs/semantics.md, "Differences from the peers"), tested as documented:
a domain error (``log(-1)``, ``1 / 0``, ``mod(x, 0)``) is a valid ``nan``/``inf`` here where
numpy.ma masks it; ``dot`` is numpy.ma's ``strict=False``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from peer_helpers import assert_like_peer, ours, setup_data

import masked_jax.numpy as mnp

jax.config.update("jax_enable_x64", True)


def _both(expr, **extra):
    """``expr(ns, d)`` on numpy.ma (arrays as numpy.ma arrays) and on masked_jax."""
    d = setup_data()
    d.update(extra)
    peer = expr(np.ma, d)
    mine = expr(mnp, {k: ours(v) if isinstance(v, np.ma.MaskedArray) else v for k, v in d.items()})
    return mine, peer


# (numpy test, expression); a domain case also says which inputs' validity the result keeps here
ARITHMETIC = [
    ("TestMaskedArrayArithmetic::test_basic_arithmetic[neg]", lambda ns, d: -d["xm"], None),
    ("TestMaskedArrayArithmetic::test_basic_arithmetic[add]", lambda ns, d: d["xm"] + d["ym"], None),
    ("TestMaskedArrayArithmetic::test_basic_arithmetic[sub]", lambda ns, d: d["xm"] - d["ym"], None),
    ("TestMaskedArrayArithmetic::test_basic_arithmetic[mul]", lambda ns, d: d["xm"] * d["ym"], None),
    ("TestMaskedArrayArithmetic::test_basic_arithmetic[div]", lambda ns, d: d["xm"] / d["ym"], ("xm", "ym")),
    ("TestMaskedArrayArithmetic::test_basic_arithmetic[scalar+y]", lambda ns, d: 10.0 + d["ym"], None),
    ("TestMaskedArrayArithmetic::test_basic_arithmetic[x-scalar]", lambda ns, d: d["xm"] - 10.0, None),
    ("TestMaskedArrayArithmetic::test_basic_arithmetic[x*scalar]", lambda ns, d: d["xm"] * 10.0, None),
    ("TestMaskedArrayArithmetic::test_basic_arithmetic[x**2]", lambda ns, d: d["xm"] ** 2, None),
    ("TestMaskedArrayArithmetic::test_basic_arithmetic[abs(x)**2.5]", lambda ns, d: abs(d["xm"]) ** 2.5, None),
    ("TestMaskedArrayArithmetic::test_basic_arithmetic[add()]", lambda ns, d: ns.add(d["xm"], d["ym"]), None),
    ("TestMaskedArrayArithmetic::test_basic_arithmetic[subtract()]", lambda ns, d: ns.subtract(d["xm"], d["ym"]), None),
    ("TestMaskedArrayArithmetic::test_basic_arithmetic[multiply()]", lambda ns, d: ns.multiply(d["xm"], d["ym"]), None),
    (
        "TestMaskedArrayArithmetic::test_basic_arithmetic[divide()]",
        lambda ns, d: ns.divide(d["xm"], d["ym"]),
        ("xm", "ym"),
    ),
    ("TestMaskedArrayArithmetic::test_basic_ufuncs[cos]", lambda ns, d: ns.cos(d["xm"]), None),
    ("TestMaskedArrayArithmetic::test_basic_ufuncs[cosh]", lambda ns, d: ns.cosh(d["xm"]), None),
    ("TestMaskedArrayArithmetic::test_basic_ufuncs[sin]", lambda ns, d: ns.sin(d["xm"]), None),
    ("TestMaskedArrayArithmetic::test_basic_ufuncs[sinh]", lambda ns, d: ns.sinh(d["xm"]), None),
    ("TestMaskedArrayArithmetic::test_basic_ufuncs[tan]", lambda ns, d: ns.tan(d["xm"]), None),
    ("TestMaskedArrayArithmetic::test_basic_ufuncs[tanh]", lambda ns, d: ns.tanh(d["xm"]), None),
    ("TestMaskedArrayArithmetic::test_basic_ufuncs[sqrt(abs)]", lambda ns, d: ns.sqrt(ns.abs(d["xm"])), None),
    ("TestMaskedArrayArithmetic::test_basic_ufuncs[log(abs)]", lambda ns, d: ns.log(ns.abs(d["xm"])), None),
    ("TestMaskedArrayArithmetic::test_basic_ufuncs[log10(abs)]", lambda ns, d: ns.log10(ns.abs(d["xm"])), None),
    ("TestMaskedArrayArithmetic::test_basic_ufuncs[exp]", lambda ns, d: ns.exp(d["xm"]), None),
    ("TestMaskedArrayArithmetic::test_basic_ufuncs[arcsin]", lambda ns, d: ns.arcsin(d["zm"]), None),
    ("TestMaskedArrayArithmetic::test_basic_ufuncs[arccos]", lambda ns, d: ns.arccos(d["zm"]), None),
    ("TestMaskedArrayArithmetic::test_basic_ufuncs[arctan]", lambda ns, d: ns.arctan(d["zm"]), None),
    ("TestMaskedArrayArithmetic::test_basic_ufuncs[arctan2]", lambda ns, d: ns.arctan2(d["xm"], d["ym"]), None),
    ("TestMaskedArrayArithmetic::test_basic_ufuncs[absolute]", lambda ns, d: ns.absolute(d["xm"]), None),
    ("TestMaskedArrayArithmetic::test_basic_ufuncs[equal]", lambda ns, d: ns.equal(d["xm"], d["ym"]), None),
    ("TestMaskedArrayArithmetic::test_basic_ufuncs[not_equal]", lambda ns, d: ns.not_equal(d["xm"], d["ym"]), None),
    ("TestMaskedArrayArithmetic::test_basic_ufuncs[less]", lambda ns, d: ns.less(d["xm"], d["ym"]), None),
    ("TestMaskedArrayArithmetic::test_basic_ufuncs[greater]", lambda ns, d: ns.greater(d["xm"], d["ym"]), None),
    ("TestMaskedArrayArithmetic::test_basic_ufuncs[less_equal]", lambda ns, d: ns.less_equal(d["xm"], d["ym"]), None),
    (
        "TestMaskedArrayArithmetic::test_basic_ufuncs[greater_equal]",
        lambda ns, d: ns.greater_equal(d["xm"], d["ym"]),
        None,
    ),
    ("TestMaskedArrayArithmetic::test_basic_ufuncs[conjugate]", lambda ns, d: ns.conjugate(d["xm"]), None),
    ("TestMaskedArrayArithmetic::test_minimummaximum_func[maximum]", lambda ns, d: ns.maximum(d["xm"], d["ym"]), None),
    ("TestMaskedArrayArithmetic::test_minimummaximum_func[minimum]", lambda ns, d: ns.minimum(d["xm"], d["ym"]), None),
    ("TestMaskedArrayArithmetic::test_mod", lambda ns, d: ns.mod(d["xm"], d["ym"]), ("xm", "ym")),
    ("TestMaskedArrayArithmetic::test_binops_d2D[x*y]", lambda ns, d: d["a2"] * d["b2"], None),
    ("TestMaskedArrayArithmetic::test_binops_d2D[x*ycol]", lambda ns, d: d["a2"] * d["b2"][:, :1], None),
    ("TestMaskedArrayArithmetic::test_binops_d2D[x/ycol]", lambda ns, d: d["a2"] / d["b2"][:, :1], None),
    ("TestMaskedArrayArithmetic::test_domained_binops_d2D[x//y]", lambda ns, d: d["a2"] // d["b2"], None),
    ("TestMaskedArrayArithmetic::test_noshrinking[x+=scalar]", lambda ns, d: d["a2"] + 1, None),
]

_A2 = np.ma.array([[1.0], [2.0], [3.0]], mask=[[False], [True], [True]])
_B2 = np.ma.array([[2.0, 3.0], [4.0, 5.0], [6.0, 7.0]], mask=[[False, False], [False, False], [True, False]])


@pytest.mark.parametrize("name, expr, domain", ARITHMETIC, ids=[a[0] for a in ARITHMETIC])
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_arithmetic_and_ufuncs_as_numpy_ma(name, expr, domain, jit):
    d = setup_data()
    d.update(a2=_A2, b2=_B2)
    peer = expr(np.ma, d)
    inputs = {k: ours(v) if isinstance(v, np.ma.MaskedArray) else v for k, v in d.items()}
    mine = jax.jit(lambda v: expr(mnp, v))(inputs) if jit else expr(mnp, inputs)
    if domain is None:
        assert_like_peer(mine, peer)
        return
    # numpy.ma masks the domain errors; here they are the valid IEEE values jnp gives
    both = ~(np.ma.getmaskarray(d[domain[0]]) | np.ma.getmaskarray(d[domain[1]]))
    assert_like_peer(mine, peer, valid_only=~np.ma.getmaskarray(peer))
    np.testing.assert_array_equal(np.asarray(mine.mask), both)
    with np.errstate(all="ignore"):
        raw = expr(np, {k: np.ma.getdata(v) for k, v in d.items()})
    np.testing.assert_allclose(np.asarray(mine.data)[both], np.asarray(raw)[both], equal_nan=True)


REDUCTIONS = [
    ("TestMaskedArrayArithmetic::test_count_func", lambda ns, d: ns.count(d["xm"]), {}),
    ("TestMaskedArrayArithmetic::test_count_func[axis]", lambda ns, d: ns.count(d["xm"].reshape(3, 4), axis=0), {}),
    ("TestMaskedArrayArithmetic::test_minmax_func[max]", lambda ns, d: ns.max(d["xm"]), {}),
    ("TestMaskedArrayArithmetic::test_minmax_func[min]", lambda ns, d: ns.min(d["xm"]), {}),
    ("TestMaskedArrayArithmetic::test_minmax_reduce[axis0]", lambda ns, d: ns.max(d["xm"].reshape(4, 3), axis=0), {}),
    ("TestMaskedArrayArithmetic::test_minmax_reduce[axis1]", lambda ns, d: ns.min(d["xm"].reshape(4, 3), axis=1), {}),
    ("TestMaskedArrayArithmetic::test_addsumprod[sum]", lambda ns, d: ns.sum(d["xm"]), {}),
    ("TestMaskedArrayArithmetic::test_addsumprod[sum axis]", lambda ns, d: ns.sum(d["xm"].reshape(3, 4), axis=1), {}),
    ("TestMaskedArrayArithmetic::test_addsumprod[prod]", lambda ns, d: ns.prod(d["xm"]), {}),
    ("TestMaskedArrayArithmetic::test_addsumprod[prod axis]", lambda ns, d: ns.prod(d["xm"].reshape(3, 4), axis=0), {}),
    ("TestMaskedArrayArithmetic::test_addsumprod[cumsum]", lambda ns, d: ns.cumsum(d["xm"]), {}),
    (
        "TestMaskedArrayArithmetic::test_addsumprod[cumprod axis]",
        lambda ns, d: ns.cumprod(d["xm"].reshape(3, 4), axis=1),
        {},
    ),
    ("TestMaskedArrayMathMethods::test_cumsumprod", lambda ns, d: ns.cumsum(d["xm"].reshape(3, 4), axis=0), {}),
    ("TestMaskedArrayMathMethods::test_ptp", lambda ns, d: ns.ptp(d["xm"].reshape(3, 4), axis=0), {}),
    ("TestMaskedArrayMathMethods::test_ptp[all]", lambda ns, d: ns.ptp(d["xm"]), {}),
    ("TestMaskedArrayMathMethods::test_varstd[var]", lambda ns, d: ns.var(d["xm"]), {}),
    ("TestMaskedArrayMathMethods::test_varstd[std axis]", lambda ns, d: ns.std(d["xm"].reshape(3, 4), axis=1), {}),
    ("TestMaskedArrayMathMethods::test_varstd_ddof", lambda ns, d: ns.var(d["xm"].reshape(3, 4), axis=1, ddof=1), {}),
    (
        "TestMaskedArrayMathMethods::test_varstd_ddof[ddof past count]",
        lambda ns, d: ns.var(d["sparse"], axis=1, ddof=2),
        {},
    ),
    (
        "TestMaskedArrayMathMethods::test_axis_methods_nomask[mean]",
        lambda ns, d: ns.mean(d["xm"].reshape(3, 4), axis=0),
        {},
    ),
    ("TestMaskedArrayMathMethods::test_trace", lambda ns, d: ns.trace(d["xm"].reshape(3, 4)), {}),
    ("TestMaskedArrayMethods::test_argmax_argmin[argmax]", lambda ns, d: ns.argmax(d["xm"]), {}),
    (
        "TestMaskedArrayMethods::test_argmax_argmin[argmin axis]",
        lambda ns, d: ns.argmin(d["xm"].reshape(3, 4), axis=1),
        {},
    ),
    ("TestMaskedArrayMethods::test_allany[all]", lambda ns, d: ns.all(d["xm"].reshape(3, 4) > 0, axis=1), {}),
    ("TestMaskedArrayMethods::test_allany[any]", lambda ns, d: ns.any(d["xm"].reshape(3, 4) > 2, axis=0), {}),
]


@pytest.mark.parametrize("name, expr, _", REDUCTIONS, ids=[a[0] for a in REDUCTIONS])
def test_reductions_as_numpy_ma(name, expr, _):
    sparse = np.ma.array(np.arange(8.0).reshape(2, 4), mask=[[0, 1, 1, 1], [0, 0, 0, 1]])
    mine, peer = _both(expr, sparse=sparse)
    if np.ma.is_masked(peer) and np.ndim(peer) == 0:  # numpy.ma's masked singleton
        assert not bool(np.asarray(mine.mask))
        return
    assert_like_peer(mine, np.ma.masked_array(peer) if np.ndim(peer) else np.ma.array(peer))


SHAPES = [
    ("TestMaskedArray::test_concatenate_basic", lambda ns, d: ns.concatenate([d["xm"], d["ym"]])),
    (
        "TestMaskedArray::test_concatenate_alongaxis",
        lambda ns, d: ns.concatenate([d["xm"].reshape(3, 4), d["ym"].reshape(3, 4)], axis=1),
    ),
    ("TestMaskedArrayMethods::test_ravel", lambda ns, d: d["xm"].reshape(3, 4).ravel()),
    ("TestMaskedArrayMethods::test_reshape", lambda ns, d: d["xm"].reshape(2, 6)),
    ("TestMaskedArrayMethods::test_squeeze", lambda ns, d: ns.squeeze(d["xm"].reshape(1, 12))),
    ("TestMaskedArrayMethods::test_swapaxes", lambda ns, d: ns.swapaxes(d["xm"].reshape(2, 3, 2), 0, 2)),
    ("TestMaskedArrayMethods::test_take", lambda ns, d: ns.take(d["xm"], np.array([0, 3, 6]))),
    ("TestMaskedArrayMethods::test_take[axis]", lambda ns, d: ns.take(d["xm"].reshape(3, 4), np.array([0, 2]), axis=1)),
    ("TestMaskedArrayMethods::test_clip", lambda ns, d: ns.clip(d["xm"], 0.0, 4.0)),
    ("TestMaskedArrayMathMethods::test_diag", lambda ns, d: ns.diag(d["xm"].reshape(3, 4))),
    (
        "TestMaskedArrayArithmetic::test_TakeTransposeInnerOuter[transpose]",
        lambda ns, d: ns.transpose(d["xm"].reshape(2, 3, 2), (2, 0, 1)),
    ),
    (
        "TestMaskedArrayArithmetic::test_TakeTransposeInnerOuter[outer]",
        lambda ns, d: ns.outer(d["xm"][:4], d["ym"][:3]),
    ),
    ("TestMaskedArrayFunctions::test_round", lambda ns, d: ns.round(d["xm"] * 1.2345, 2)),
    ("TestMaskedArrayFunctions::test_power", lambda ns, d: ns.power(ns.abs(d["xm"]), 1.5)),
    ("TestMaskedArrayFunctions::test_where", lambda ns, d: ns.where(d["x"] > 1.5, d["xm"], d["ym"])),
    ("TestMaskedArrayFunctions::test_reshape", lambda ns, d: ns.reshape(d["xm"], (4, 3))),
    ("TestMaskedArrayFunctions::test_repeat", lambda ns, d: ns.repeat(d["xm"][:4], 2)),
]


@pytest.mark.parametrize("name, expr", SHAPES, ids=[a[0] for a in SHAPES])
def test_shapes_and_selections_as_numpy_ma(name, expr):
    mine, peer = _both(expr)
    assert_like_peer(mine, peer)


def test_sort_puts_masked_elements_last_as_numpy_ma():
    """TestMaskedArrayMethods::test_sort and test_argsort (endwith=True, numpy.ma's default): the
    valid elements in ascending order, the masked ones last; argsort orders the indices alike."""
    a = np.ma.array([1.0, 2.0, 5.0, 3.0, 4.0], mask=[0, 1, 0, 1, 0])
    got = mnp.sort(ours(a))
    peer = np.ma.sort(a)
    np.testing.assert_array_equal(np.asarray(got.mask), ~np.ma.getmaskarray(peer))
    np.testing.assert_array_equal(np.asarray(got.data)[:3], np.ma.compressed(peer))
    np.testing.assert_array_equal(np.asarray(mnp.argsort(ours(a)))[:3], np.ma.argsort(a)[:3])
    a2 = np.ma.array([[8.0, 4.0, 1.0], [2.0, 0.0, 9.0]], mask=[[0, 1, 0], [1, 0, 0]])
    for axis in (0, 1):
        got, peer = mnp.sort(ours(a2), axis=axis), np.ma.sort(a2, axis=axis)
        assert_like_peer(got, peer)


def test_compressed_and_filled_as_numpy_ma():
    """TestMaskedArray::test_basic1d (filled, count) and TestMaskedArrayMethods::test_compressed."""
    d = setup_data()
    xm = ours(d["xm"])
    np.testing.assert_array_equal(np.asarray(xm.filled(1e20)), np.ma.filled(d["xm"], 1e20))
    np.testing.assert_array_equal(
        np.asarray(xm.compressed() if hasattr(xm, "compressed") else xm.data[xm.mask]), d["xm"].compressed()
    )
    assert int(mnp.count(xm)) == d["xm"].count()


def test_dot_is_numpy_ma_dot_without_strict():
    """numpy/ma/tests/test_extras.py::Test2DFunctions::test_dot, strict=False: masked entries count
    as 0; an output is valid where some pair of valid entries meets (numpy.ma's non-strict dot
    leaves every output valid; ours masks one that no valid pair reaches)."""
    n = np.arange(1, 7)
    for m in ([1, 0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 1], [0, 0, 0, 0, 0, 0]):
        a = np.ma.array(n, mask=m).reshape(2, 3)
        b = np.ma.array(n, mask=m).reshape(3, 2)
        for p, q in ((a, b), (b, a)):
            got = mnp.dot(ours(p), ours(q))
            np.testing.assert_array_equal(np.asarray(got.data), np.dot(p.filled(0), q.filled(0)))
            reached = (~np.ma.getmaskarray(p)).astype(int) @ (~np.ma.getmaskarray(q)).astype(int) > 0
            np.testing.assert_array_equal(np.asarray(got.mask), reached)


def test_masked_singleton_results_are_masked_here():
    """TestMaskedArrayArithmetic::test_masked_singleton_arithmetic / test_minmax_func: a reduction
    of a fully masked array is numpy.ma's ``masked`` singleton; here a 0-d array that is masked
    (its data the reduction's fill: 0 for sum and mean, the extremes for max and min). The
    reduction of a zero-size array is where the two part: numpy.ma's sum of nothing is 0, as
    ours, and its mean a NaN with a warning, where ours is masked (docs/semantics.md)."""
    a = np.ma.array([1.0, 2.0], mask=[1, 1])
    for fn in ("sum", "prod", "max", "min", "mean", "var"):
        assert getattr(np.ma, fn)(a) is np.ma.masked
        assert not bool(np.asarray(getattr(mnp, fn)(ours(a)).mask)), fn
    empty = np.ma.array(np.zeros((0,)))
    assert float(np.ma.sum(empty)) == 0.0
    got = mnp.sum(ours(empty))
    assert bool(np.asarray(got.mask)) and float(got.data) == 0.0
    assert not bool(np.asarray(mnp.mean(ours(empty)).mask))


def test_where_with_a_constant_keeps_the_masked_operands_validity():
    """TestMaskedArrayFunctions::test_where with a scalar branch: numpy.ma makes the positions that
    take the scalar valid; here a constant fill takes the validity of the masked operand it is
    combined with, so ``where(c, x, 0)`` never turns a masked element into a valid 0
    (docs/semantics.md). Where ``x`` is chosen, both agree."""
    d = setup_data()
    cond = d["x"] > 1.5
    peer = np.ma.where(cond, d["xm"], 99.0)
    got = mnp.where(jnp.asarray(cond), ours(d["xm"]), 99.0)
    assert_like_peer(got, peer, valid_only=cond)
    np.testing.assert_array_equal(np.asarray(got.mask), ~d["m1"])
    np.testing.assert_array_equal(np.asarray(got.data)[~cond & ~d["m1"]], 99.0)
