"""Shared pieces of the peers' suites translated: numpy.ma arrays as ours and back, and the
comparison of a result with the peer's (mask and valid values)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

import masked_jax as mj


def ours(a):
    """A numpy.ma array (True = masked) as a ``MaskedArray`` (True = valid)."""
    a = np.ma.asarray(a)
    return mj.masked_array(jnp.asarray(np.ma.getdata(a)), jnp.asarray(~np.ma.getmaskarray(a)))


def assert_like_peer(got, expected, *, rtol=1e-12, atol=0.0, valid_only=None):
    """``got`` (ours) has ``expected``'s (numpy.ma's) mask and its values at the valid entries.
    ``valid_only``: compare there only (a deliberate difference elsewhere, asserted by the caller)."""
    expected = np.ma.asarray(expected)
    want_valid = ~np.ma.getmaskarray(expected)
    if isinstance(got, mj.MaskedArray):
        got_valid, got_data = np.asarray(got.mask), np.asarray(got.data)
    else:
        got_data = np.asarray(got)
        got_valid = np.ones(got_data.shape, bool)
    assert got_data.shape == expected.shape, (got_data.shape, expected.shape)
    where = np.ones(want_valid.shape, bool) if valid_only is None else np.asarray(valid_only)
    np.testing.assert_array_equal(got_valid[where], want_valid[where], err_msg="masks differ")
    keep = want_valid & where
    np.testing.assert_allclose(got_data[keep], np.ma.getdata(expected)[keep], rtol=rtol, atol=atol, equal_nan=True)


def setup_data():
    """The data of numpy.ma's ``TestMaskedArray.setup`` (numpy/ma/tests/test_core.py): ``x, y``
    with masks ``m1, m2`` (True = masked), ``z`` with ``zm``'s mask."""
    x = np.array([1.0, 1.0, 1.0, -2.0, np.pi / 2.0, 4.0, 5.0, -10.0, 10.0, 1.0, 2.0, 3.0])
    y = np.array([5.0, 0.0, 3.0, 2.0, -1.0, -4.0, 0.0, -10.0, 10.0, 1.0, 0.0, 3.0])
    m1 = np.array([1, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0], bool)
    m2 = np.array([0, 0, 1, 0, 0, 1, 1, 0, 0, 0, 0, 1], bool)
    z = np.array([-0.5, 0.0, 0.5, 0.8])
    zm = np.array([0, 1, 0, 0], bool)
    return {
        "x": x,
        "y": y,
        "xm": np.ma.array(x, mask=m1),
        "ym": np.ma.array(y, mask=m2),
        "zm": np.ma.array(z, mask=zm),
        "m1": m1,
        "m2": m2,
    }
