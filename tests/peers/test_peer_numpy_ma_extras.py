"""numpy.ma's own tests of its extras (numpy/ma/tests/test_extras.py), translated for the functions
``masked_jax.numpy`` mirrors: ``average``, ``median``, ``cov``, ``corrcoef``, ``ediff1d``,
``unique``. Each test names the numpy test it comes from; numpy.ma's mask is True where an element
is masked, ours where it is valid."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from peer_helpers import assert_like_peer, ours

import masked_jax.numpy as mnp

jax.config.update("jax_enable_x64", True)


def test_average_1():
    """TestAverage::test_testAverage1."""
    ott = np.ma.array([0.0, 1.0, 2.0, 3.0], mask=[True, False, False, False])
    w = jnp.array([1.0, 1.0, 2.0, 1.0])
    assert float(mnp.average(ours(ott), axis=0).data) == 2.0
    assert float(mnp.average(ours(ott), weights=w).data) == 2.0
    result, wts = mnp.average(ours(ott), weights=w, returned=True)
    assert float(result.data) == 2.0 and float(wts.data) == 4.0
    assert not bool(np.asarray(mnp.average(ours(np.ma.array(ott.data, mask=True)), axis=0).mask))
    ott2 = np.ma.array([0.0, 1.0, 2.0, 3.0], mask=[True, False, False, False]).reshape(2, 2)
    ott2[:, 1] = np.ma.masked
    assert_like_peer(mnp.average(ours(ott2), axis=0), np.ma.average(ott2, axis=0))
    assert_like_peer(mnp.average(ours(ott2), axis=1), np.ma.average(ott2, axis=1))
    r, w2 = mnp.average(ours(ott2), axis=0, returned=True)
    pr, pw = np.ma.average(ott2, axis=0, returned=True)
    assert_like_peer(r, pr)
    # numpy.ma gives a valid 0 weight sum for the masked column; ours masks it with its average
    np.testing.assert_array_equal(np.asarray(w2.data)[~np.ma.getmaskarray(pr)], np.asarray(pw)[~np.ma.getmaskarray(pr)])


def test_average_2():
    """TestAverage::test_testAverage2."""
    w1 = jnp.array([0, 1, 1, 1, 1, 0])
    w2 = jnp.array([[0, 1, 1, 1, 1, 0], [1, 0, 0, 0, 0, 1]])
    x = np.ma.arange(6, dtype=np.float64)
    y = np.ma.array([np.arange(6, dtype=np.float64), 2.0 * np.arange(6)])
    assert float(mnp.average(ours(x), axis=0).data) == 2.5
    assert float(mnp.average(ours(x), axis=0, weights=w1).data) == 2.5
    assert float(mnp.average(ours(y)).data) == np.add.reduce(np.arange(6)) * 3.0 / 12.0
    assert_like_peer(mnp.average(ours(y), axis=0), np.ma.average(y, axis=0))
    assert_like_peer(mnp.average(ours(y), axis=1), np.ma.average(y, axis=1))
    assert float(mnp.average(ours(y), weights=w2).data) == pytest.approx(20.0 / 6.0)
    assert_like_peer(mnp.average(ours(y), axis=0, weights=w2), np.ma.average(y, axis=0, weights=np.asarray(w2)))
    m3 = [[0, 0, 1, 1, 0, 0], [0, 1, 1, 1, 1, 0]]
    for m in ([0] * 6, [0, 0, 1, 1, 0, 0], [1] * 6, [0, 1, 1, 1, 1, 1]):
        xm = np.ma.array(np.arange(6.0), mask=m)
        assert_like_peer(mnp.average(ours(xm), axis=0), np.ma.masked_array(np.ma.average(xm, axis=0)))
    z = np.ma.array(np.asarray(y), mask=m3)
    assert float(mnp.average(ours(z)).data) == pytest.approx(20.0 / 6.0)
    assert_like_peer(mnp.average(ours(z), axis=0), np.ma.average(z, axis=0))
    assert_like_peer(mnp.average(ours(z), axis=1), np.ma.average(z, axis=1))
    assert_like_peer(mnp.average(ours(z), axis=0, weights=w2), np.ma.average(z, axis=0, weights=np.asarray(w2)))


def test_average_3():
    """TestAverage::test_testAverage3: ``returned`` weights have the result's shape."""
    a, b = np.arange(6), np.arange(6) * 3
    r1, w1 = mnp.average(mnp.asarray(jnp.array([[a, b], [b, a]])), axis=1, returned=True)
    assert r1.shape == w1.shape
    r2, w2 = mnp.average(mnp.asarray(jnp.ones((2, 2, 3))), axis=0, weights=jnp.array([3.0, 1.0]), returned=True)
    assert r2.shape == w2.shape
    r2, w2 = mnp.average(mnp.asarray(jnp.ones((2, 2, 3))), weights=jnp.ones((2, 2, 3)), returned=True)
    assert r2.shape == w2.shape
    a2dm = np.ma.array([[1.0, 2.0], [0.0, 4.0]], mask=[[False, False], [True, False]])
    for axis in (0, None, 1):
        assert_like_peer(mnp.average(ours(a2dm), axis=axis), np.ma.masked_array(np.ma.average(a2dm, axis=axis)))


def test_average_on_integers_with_mask():
    """TestAverage::test_onintegers_with_mask."""
    assert float(mnp.average(mnp.asarray(jnp.array([1, 2]))).data) == 1.5
    a = np.ma.array([1, 2, 3, 4], mask=[False, False, True, True])
    assert float(mnp.average(ours(a)).data) == 1.5


def _masked_rows():
    x = np.ma.array(np.arange(30.0).reshape(10, 3))
    x[:3] = x[-3:] = np.ma.masked
    return x


def test_median_2d_with_axis():
    """TestMedian::test_2d_waxis and test_neg_axis."""
    x = _masked_rows()
    assert float(mnp.median(ours(x)).data) == 14.5
    assert_like_peer(mnp.median(ours(x), axis=0), np.ma.median(x, axis=0))
    assert_like_peer(mnp.median(ours(x), axis=1), np.ma.median(x, axis=1))
    assert_like_peer(mnp.median(ours(x), axis=-1), np.ma.median(x, axis=1))


def test_median_2d():
    """TestMedian::test_2d: the valid values' median, whatever their order."""
    n, p = 101, 30
    x = np.ma.array(np.linspace(-1.0, 1.0, n))
    x[:10] = x[-10:] = np.ma.masked
    rng = np.random.default_rng(0)
    z = np.ma.array(np.empty((n, p)), mask=np.zeros((n, p), bool))
    for i in range(p):
        idx = np.arange(n) if i == 0 else rng.permutation(n)
        z[:, i] = x[idx]
    assert float(mnp.median(ours(z[:, 0])).data) == pytest.approx(0.0, abs=1e-12)
    assert float(mnp.median(ours(z)).data) == pytest.approx(0.0, abs=1e-12)
    np.testing.assert_allclose(np.asarray(mnp.median(ours(z), axis=0).data), np.zeros(p), atol=1e-12)
    np.testing.assert_allclose(np.asarray(mnp.median(ours(z.T), axis=1).data), np.zeros(p), atol=1e-12)


def test_median_3d():
    """TestMedian::test_3d."""
    x = np.ma.arange(24.0).reshape(3, 4, 2)
    x[np.asarray(x % 3 == 0)] = np.ma.masked
    assert_like_peer(mnp.median(ours(x), axis=0), np.ma.median(x, axis=0))
    x = np.ma.array(x.data.reshape(4, 3, 2), mask=np.ma.getmaskarray(x).reshape(4, 3, 2))
    assert_like_peer(mnp.median(ours(x), axis=0), np.ma.median(x, axis=0))
    x = np.ma.arange(24.0).reshape(4, 3, 2)
    x[np.asarray(x % 5 == 0)] = np.ma.masked
    assert_like_peer(mnp.median(ours(x), axis=0), np.ma.median(x, axis=0))


def test_median_non_masked():
    """TestMedian::test_non_masked and test_pytype."""
    assert float(mnp.median(mnp.asarray(jnp.arange(9.0))).data) == 4.0
    r = mnp.median(mnp.asarray(jnp.full((2, 2), jnp.inf)), axis=-1)
    np.testing.assert_array_equal(np.asarray(r.data), np.inf)


@pytest.fixture
def data12():
    return np.random.default_rng(3).random(12)


@pytest.mark.parametrize("fn", ["cov", "corrcoef"])
def test_cov_corrcoef_without_missing(fn, data12):
    """TestCov::test_1d_wo_missing, test_2d_wo_missing; TestCorrcoef::test_1d_wo_missing,
    test_2d_wo_missing."""
    for x in (np.ma.array(data12), np.ma.array(data12.reshape(3, 4))):
        for kw in ({}, {"rowvar": False}) + (({"rowvar": False, "bias": True},) if fn == "cov" else ()):
            np.testing.assert_allclose(
                np.asarray(getattr(mnp, fn)(ours(x), **kw).data), getattr(np, fn)(x.data, **kw), rtol=1e-12
            )


@pytest.mark.parametrize("fn", ["cov", "corrcoef"])
def test_cov_corrcoef_1d_with_missing(fn, data12):
    """TestCov::test_1d_w_missing and TestCorrcoef::test_1d_w_missing: the valid observations'
    statistic; with a second variable, an observation masked in either is left out of both."""
    x = np.ma.array(data12)
    x[-1] = np.ma.masked
    x -= x.mean()
    nx = x.compressed()
    np.testing.assert_allclose(np.asarray(getattr(mnp, fn)(ours(x)).data), getattr(np, fn)(nx), rtol=1e-12)
    np.testing.assert_allclose(
        np.asarray(getattr(mnp, fn)(ours(x), rowvar=False).data), getattr(np, fn)(nx, rowvar=False), rtol=1e-12
    )
    # 2 1-d variables with missing values
    nx = x[1:-1]
    got = getattr(mnp, fn)(ours(x), ours(x[::-1]))
    np.testing.assert_allclose(np.asarray(got.data), getattr(np, fn)(nx, nx[::-1]), rtol=1e-10)
    np.testing.assert_allclose(np.asarray(got.data), np.ma.getdata(getattr(np.ma, fn)(x, x[::-1])), rtol=1e-10)


def test_cov_2d_with_missing(data12):
    """TestCov::test_2d_w_missing: each pair of variables over the observations valid in both."""
    x = np.ma.array(data12)
    x[-1] = np.ma.masked
    x = x.reshape(3, 4)
    for kw in ({}, {"bias": True}, {"rowvar": False}, {"rowvar": False, "bias": True}):
        np.testing.assert_allclose(
            np.asarray(mnp.cov(ours(x), **kw).data), np.ma.getdata(np.ma.cov(x, **kw)), rtol=1e-10
        )


def test_corrcoef_2d_with_missing(data12):
    """TestCorrcoef::test_2d_w_missing."""
    x = np.ma.array(data12)
    x[-1] = np.ma.masked
    x = x.reshape(3, 4)
    np.testing.assert_allclose(np.asarray(mnp.corrcoef(ours(x)).data), np.ma.getdata(np.ma.corrcoef(x)), rtol=1e-10)


def test_ediff1d():
    """TestArraySetOps::test_ediff1d and test_ediff1d_tobegin_toend: a difference is valid where
    both neighbours are."""
    x = np.ma.array([1, 1, 2, 4, 7], mask=[0, 1, 0, 0, 0])
    peer = np.ma.ediff1d(x)
    got = mnp.ediff1d(ours(x))
    assert_like_peer(got, peer)
    got = mnp.ediff1d(ours(x), to_end=jnp.array([99]), to_begin=jnp.array([0]))
    assert_like_peer(got, np.ma.ediff1d(x, to_end=[99], to_begin=[0]))


def test_unique():
    """TestArraySetOps::test_unique_onlist / test_unique_allmasked: the distinct valid values
    (numpy.ma adds one masked entry when there are masked ones; here they are left out, see
    docs/semantics.md)."""
    x = np.ma.array([1, 1, 2, 1, 3, 3], mask=[0, 0, 0, 1, 0, 1])
    got = mnp.unique(ours(x))
    valid = np.asarray(got.mask)
    np.testing.assert_array_equal(np.asarray(got.data)[valid], [1, 2, 3])
    peer = np.ma.unique(x)
    np.testing.assert_array_equal(np.ma.compressed(peer), [1, 2, 3])
