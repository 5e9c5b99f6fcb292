"""torch's own MaskedTensor tests (test/test_maskedtensor.py), translated and run against torch
itself: the same data and mask through ``torch.masked`` and through masked_jax, values, masks and
gradients compared. Each test names the torch test it comes from. torch's MaskedTensor binary
ops require equal masks, so those cases share one."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import masked_jax as mj
import masked_jax.nn as mnn
import masked_jax.numpy as mnp

torch = pytest.importorskip("torch")
masked = pytest.importorskip("torch.masked")

jax.config.update("jax_enable_x64", True)

DATA = np.array([[0.5, 1.0, 2.0, -1.5], [3.0, -4.0, 5.0, 0.25], [1.5, 2.5, -0.5, 7.0]])
MASK = np.array([[True, False, False, True], [True, True, False, True], [False, False, False, False]])


def _torch(data=DATA, mask=MASK, grad=False):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return masked.masked_tensor(torch.tensor(data), torch.tensor(mask), requires_grad=grad)


def _ours(data=DATA, mask=MASK):
    return mj.masked_array(jnp.asarray(data), jnp.asarray(mask))


def _same(got, mt, rtol=1e-12):
    """``got`` (ours) equals the MaskedTensor ``mt`` on its mask and valid values."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        data, mask = mt.get_data().detach().numpy(), mt.get_mask().numpy()
    np.testing.assert_array_equal(np.broadcast_to(np.asarray(got.mask), mask.shape), mask)
    np.testing.assert_allclose(np.asarray(got.data)[mask], data[mask], rtol=rtol)


UNARY = [  # TestUnary (torch's list of unary ufuncs), on the positive or any data
    ("abs", torch.abs, mnp.abs, DATA),
    ("neg", torch.neg, mnp.negative, DATA),
    ("exp", torch.exp, mnp.exp, DATA),
    ("log", torch.log, mnp.log, np.abs(DATA) + 0.1),
    ("sqrt", torch.sqrt, mnp.sqrt, np.abs(DATA)),
    ("sin", torch.sin, mnp.sin, DATA),
    ("cos", torch.cos, mnp.cos, DATA),
    ("tanh", torch.tanh, mnp.tanh, DATA),
    ("sigmoid", torch.sigmoid, mnn.sigmoid, DATA),
    ("square", torch.square, mnp.square, DATA),
    ("floor", torch.floor, mnp.floor, DATA),
    ("sign", torch.sign, mnp.sign, DATA),
]


@pytest.mark.parametrize("name, t_fn, ours_fn, data", UNARY, ids=[u[0] for u in UNARY])
def test_unary(name, t_fn, ours_fn, data):
    """TestUnary::test_unary (values and mask) and test_inplace_unary's results."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expected = t_fn(_torch(data))
    _same(ours_fn(_ours(data)), expected)


BINARY = [  # TestBinary (torch's list of binary ufuncs); the masks are equal
    ("add", torch.add, mnp.add),
    ("sub", torch.sub, mnp.subtract),
    ("mul", torch.mul, mnp.multiply),
    ("div", torch.div, mnp.divide),
    ("maximum", torch.maximum, mnp.maximum),
    ("minimum", torch.minimum, mnp.minimum),
    ("atan2", torch.atan2, mnp.arctan2),
    ("pow", lambda a, b: torch.pow(a, 2.5), lambda a, b: mnp.power(a, 2.5)),  # a scalar exponent: torch's only form
]


@pytest.mark.parametrize("name, t_fn, ours_fn", BINARY, ids=[b[0] for b in BINARY])
def test_binary(name, t_fn, ours_fn):
    """TestBinary::test_binary, and TestBasics::test_add."""
    other = np.abs(DATA[::-1]) + 0.5
    base = np.abs(DATA) + 0.5 if name == "pow" else DATA
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expected = t_fn(_torch(base), _torch(other))
    _same(ours_fn(_ours(base), _ours(other)), expected)


REDUCTIONS = [  # TestReductions: over everything and along each dim
    ("sum", torch.sum, mnp.sum),
    ("mean", torch.mean, mnp.mean),
    ("amax", torch.amax, mnp.max),
    ("amin", torch.amin, mnp.min),
    ("prod", torch.prod, mnp.prod),
]


@pytest.mark.parametrize("name, t_fn, ours_fn", REDUCTIONS, ids=[r[0] for r in REDUCTIONS])
@pytest.mark.parametrize("dim", [None, 0, 1])
def test_reductions(name, t_fn, ours_fn, dim):
    """TestReductions::test_sum, test_mean, test_amax, test_amin, test_prod (a row with no valid
    element gives a masked output under both)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expected = t_fn(_torch()) if dim is None else t_fn(_torch(), dim)
    _same(ours_fn(_ours()) if dim is None else ours_fn(_ours(), axis=dim), expected)


@pytest.mark.parametrize("name, t_fn, ours_fn", REDUCTIONS, ids=[r[0] for r in REDUCTIONS])
def test_reduction_gradients(name, t_fn, ours_fn):
    """TestReductions::test_sum_grad, test_mean_grad, test_amax_grad, test_amin_grad,
    test_prod_grad: the gradient of the reduction over everything, on the valid entries (both
    libraries give the input's mask to it)."""
    mt = _torch(grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        t_fn(mt).backward()
        grad_t = mt.grad
    grad = mj.grad(lambda x: ours_fn(x))(_ours())
    _same(grad, grad_t)


def test_softmax():
    """TestBasics::test_softmax: over the valid entries of the last axis; masked entries stay
    masked (torch's and ours)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expected = torch.softmax(_torch(), -1)
    _same(mnn.softmax(_ours(), axis=-1), expected)


def test_softmax_gradient():
    """TestBasics::test_softmax's backward, with a weighted sum of the valid outputs."""
    w = np.arange(DATA.size, dtype=np.float64).reshape(DATA.shape) / 7.0
    mt = _torch(grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = torch.softmax(mt, -1) * _torch(w)
        torch.sum(out).backward()
        grad_t = mt.grad
    grad = mj.grad(lambda x: mnp.sum(mnn.softmax(x, axis=-1) * _ours(w)))(_ours())
    _same(grad, grad_t, rtol=1e-10)


def test_where():
    """TestBasics::test_where: ``where(c, x, y)`` of two masked operands selects data and mask."""
    cond = DATA > 0.7
    other = _torch(DATA * 10.0, ~MASK)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expected = torch.where(torch.tensor(cond), _torch(), other)
    _same(mnp.where(jnp.asarray(cond), _ours(), _ours(DATA * 10.0, ~MASK)), expected)


def test_to_dense_and_sparse_round_trip():
    """TestBasics::test_to_sparse, test_to_dense: a masked array to a sparse layout and back keeps
    its data and mask, as a MaskedTensor to sparse COO and back."""
    x = _ours()
    back = mj.from_bcoo(x.to_bcoo()).todense()
    np.testing.assert_array_equal(np.asarray(back.mask), MASK)
    np.testing.assert_array_equal(np.asarray(back.data)[MASK], DATA[MASK])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mt = _torch().to_sparse_coo().to_dense()
    _same(back, mt)
