"""``maskify`` over 250+ functions of ``jax.numpy``, ``jax.nn``, ``jax.scipy.special`` and ``lax``.

Every function here either equals its masked reference, eagerly and under ``jit``, or raises
``MaskifyError``: never a silently wrong value, never another exception. The reference depends on
what the function does to the masked operand:

* elementwise: the function of the data at valid positions; the mask is the operands' (and-ed);
* along the last axis (reductions, scans, sorts, softmax, diff): a per-row *unpadded* reference.
  Row ``b`` keeps its first ``n_b`` entries (NaN after them); the result is compared with the
  function of ``x[b, :n_b]``: its valid prefix, masked after it, and masked when ``n_b == 0``;
* shape: the same function of the data and of the mask;
* contractions: masked entries count as 0; an output entry is valid where one pair of valid
  entries met.

Functions expected to raise (decompositions, FFTs) are listed as such, and must raise
``MaskifyError``. The counts and the primitive coverage are printed.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import jax.scipy.special as jss
import numpy as np
import pytest
from harness import sub_jaxprs
from jax import lax

import masked_jax as mj
from masked_jax._maskify import _interpreter as _transform
from masked_jax._maskify import _rules as primitives

F = np.float32
POS, UNIT, ANY = (0.2, 3.0), (-0.9, 0.9), (-3.0, 3.0)
COMPLEX = (-2.0, 2.0, "complex")  # real and imaginary parts in [-2, 2]
LENGTHS = (7, 4, 1, 0, 5)  # valid prefix of each row (row 3 is all padding)


# -- elementwise: name -> (function, domain) -------------------------------------------------------
STORED = {"jnp.tril", "jnp.triu", "dropout-like where"}  # elementwise by stored position


def _j(name, dom=ANY):
    return getattr(jnp, name), dom


UNARY = {
    **{
        f"jnp.{n}": _j(n)
        for n in (
            "abs absolute negative positive sign exp exp2 expm1 sin cos tan arctan sinh cosh tanh arcsinh floor ceil "
            "round rint trunc isfinite isinf isnan isneginf isposinf signbit deg2rad rad2deg degrees radians conj "
            "conjugate real sinc i0 nan_to_num fabs square cbrt angle spacing tril triu"
        ).split()
    },
    **{f"jnp.{n}": _j(n, POS) for n in "log log1p log2 log10 sqrt reciprocal".split()},
    **{f"jnp.{n}": _j(n, UNIT) for n in "arcsin arccos arctanh".split()},
    "jnp.arccosh": (jnp.arccosh, (1.1, 3.0)),
    **{
        f"jax.nn.{n}": (getattr(jax.nn, n), ANY)
        for n in (
            "relu relu6 sigmoid softplus soft_sign silu swish log_sigmoid leaky_relu hard_sigmoid hard_silu hard_swish "
            "hard_tanh elu celu selu gelu mish squareplus sparse_plus sparse_sigmoid identity tanh"
        ).split()
    },
    "jax.nn.gelu(approximate=False)": (functools.partial(jax.nn.gelu, approximate=False), ANY),
    **{f"jss.{n}": (getattr(jss, n), ANY) for n in "erf erfc expit ndtr log_ndtr i0e i1e i0 i1 entr".split()},
    **{f"jss.{n}": (getattr(jss, n), POS) for n in "gammaln digamma".split()},
    **{f"jss.{n}": (getattr(jss, n), UNIT) for n in "erfinv".split()},
    "jss.logit": (jss.logit, (0.1, 0.9)),
    "jss.ndtri": (jss.ndtri, (0.1, 0.9)),
    **{
        f"lax.{n}": (getattr(lax, n), ANY)
        for n in (
            "abs neg sign floor ceil round is_finite exp exp2 expm1 tanh logistic sin cos tan atan sinh cosh asinh "
            "cbrt erf erfc bessel_i0e bessel_i1e square stop_gradient conj"
        ).split()
    },
    **{f"{m.__name__}.{n}(complex)": (getattr(m, n), COMPLEX) for m in (jnp, lax) for n in ("real", "imag")},
    "jnp.abs(complex)": (jnp.abs, COMPLEX),
    "jnp.angle(complex)": (jnp.angle, COMPLEX),
    **{f"lax.{n}": (getattr(lax, n), POS) for n in "log log1p sqrt rsqrt lgamma digamma".split()},
    **{f"lax.{n}": (getattr(lax, n), UNIT) for n in "asin acos atanh erf_inv".split()},
    "lax.acosh": (lax.acosh, (1.1, 3.0)),
    "lax.integer_pow(3)": (lambda x: lax.integer_pow(x, 3), ANY),
    "lax.reduce_precision": (lambda x: lax.reduce_precision(x, 5, 10), ANY),
    "lax.convert_element_type(f64)": (lambda x: lax.convert_element_type(x, jnp.float64), ANY),
    "jnp.astype(int32)": (lambda x: x.astype(jnp.int32), ANY),
    "jnp.clip": (lambda x: jnp.clip(x, -1.0, 1.5), ANY),
    "lax.clamp": (lambda x: lax.clamp(F(-1.0), x, F(1.5)), ANY),
    "jnp.where(x>0,x,0)": (lambda x: jnp.where(x > 0, x, 0.0), ANY),
    "dropout-like where": (lambda x: jnp.where(jnp.arange(x.shape[-1]) % 2 == 0, x / 0.5, 0.0), ANY),
    "jnp.heaviside(x,0.5)": (lambda x: jnp.heaviside(x, 0.5), ANY),
    "jnp.power(x,3)": (lambda x: jnp.power(x, 3), ANY),
    "x ** 0.5": (lambda x: x**0.5, POS),
    "1.0 / x": (lambda x: 1.0 / x, POS),
    "jnp.frexp[0]": (lambda x: jnp.frexp(x)[0], ANY),
    "jnp.modf[0]": (lambda x: jnp.modf(x)[0], ANY),
    "jnp.copysign(x,-1)": (lambda x: jnp.copysign(x, -1.0), ANY),
    "jnp.ldexp(x,2)": (lambda x: jnp.ldexp(x, 2), ANY),
    "jnp.isclose(x,0.5)": (lambda x: jnp.isclose(x, 0.5), ANY),
}


@jax.custom_vjp
def _scaled_identity(x):
    return x * 2.0


_scaled_identity.defvjp(lambda x: (x * 2.0, None), lambda _, g: (g * 2.0,))


def _printed(x):
    jax.debug.print("maskify coverage sees {}", x.shape)
    return x * 3.0


UNARY.update(
    {
        "x.at[:, 0].add(1)": (lambda x: x.at[:, 0].add(1.0), ANY),
        "x.at[:, 1].multiply(2)": (lambda x: x.at[:, 1].multiply(2.0), ANY),
        "x.at[0].min(0)": (lambda x: x.at[0].min(0.0), ANY),
        "x.at[0].max(0)": (lambda x: x.at[0].max(0.0), ANY),
        "lax.cond": (lambda x: lax.cond(True, jnp.sin, jnp.cos, x), ANY),
        "lax.fori_loop": (lambda x: lax.fori_loop(0, 3, lambda i, c: c * 1.5 + 1.0, x), ANY),
        "lax.while_loop": (
            lambda x: lax.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, c[1] * 0.5), (0, x))[1],
            ANY,
        ),
        "jax.custom_vjp": (_scaled_identity, ANY),
        "jax.debug.print": (_printed, ANY),
        "jax.device_put": (jax.device_put, ANY),
        "jax.named_call": (jax.named_call(jnp.sin, name="named"), ANY),
    }
)

INT_UNARY = {
    **{f"jnp.{n}": getattr(jnp, n) for n in "bitwise_not invert bitwise_count".split()},
    **{f"lax.{n}": getattr(lax, n) for n in "population_count clz bitwise_not".split()},
}

BINARY = {
    **{
        f"jnp.{n}": (getattr(jnp, n), ANY)
        for n in (
            "add subtract multiply maximum minimum fmax fmin arctan2 hypot logaddexp logaddexp2 copysign nextafter "
            "equal not_equal less less_equal greater greater_equal isclose"
        ).split()
    },
    **{
        f"jnp.{n}": (getattr(jnp, n), POS)
        for n in ("divide true_divide floor_divide power float_power mod remainder fmod").split()
    },
    **{
        f"lax.{n}": (getattr(lax, n), ANY)
        for n in "add sub mul max min atan2 nextafter eq ne lt le gt ge complex".split()
    },
    **{f"lax.{n}": (getattr(lax, n), POS) for n in "div rem pow igamma igammac".split()},
    "lax.zeta": (lax.zeta, (1.5, 3.0)),
    **{f"jss.{n}": (getattr(jss, n), POS) for n in "xlogy xlog1py gammainc gammaincc betaln rel_entr kl_div".split()},
    "jnp.where(x>y,x,y)": (lambda a, b: jnp.where(a > b, a, b), ANY),
    "x * y + 1": (lambda a, b: a * b + 1.0, ANY),
}

BOOL_BINARY = {f"jnp.{n}": getattr(jnp, n) for n in "logical_and logical_or logical_xor".split()}
INT_BINARY = {
    **{
        f"jnp.{n}": getattr(jnp, n) for n in "bitwise_and bitwise_or bitwise_xor left_shift right_shift gcd lcm".split()
    },
    **{
        f"lax.{n}": getattr(lax, n)
        for n in "bitwise_and bitwise_or bitwise_xor shift_left shift_right_arithmetic shift_right_logical".split()
    },
}

# -- along the last axis: name -> (function of an array, its last axis the sequence; minimum length) --
ALONG = {
    **{
        f"jnp.{n}": (lambda x, n=n: getattr(jnp, n)(x, axis=-1), 1)
        for n in (
            "sum prod mean var std max min amax amin ptp median argmax argmin all any count_nonzero cumsum cumprod "
            "sort argsort nansum nanmean nanmax nanmin nanvar nanstd nanprod nanargmax nanargmin nancumsum "
            "nancumprod"
        ).split()
    },
    "jnp.cumulative_sum": (lambda x: jnp.cumulative_sum(x, axis=-1), 1),
    "jnp.cumulative_prod": (lambda x: jnp.cumulative_prod(x, axis=-1), 1),
    "jnp.var(ddof=1)": (lambda x: jnp.var(x, axis=-1, ddof=1), 2),
    "jnp.std(ddof=1)": (lambda x: jnp.std(x, axis=-1, ddof=1), 2),
    "jnp.mean(keepdims)": (lambda x: jnp.mean(x, axis=-1, keepdims=True)[..., 0], 1),
    "jnp.quantile(0.3)": (lambda x: jnp.quantile(x, 0.3, axis=-1), 1),
    "jnp.quantile(nearest)": (lambda x: jnp.quantile(x, 0.7, axis=-1, method="nearest"), 1),
    "jnp.percentile(80)": (lambda x: jnp.percentile(x, 80.0, axis=-1), 1),
    "jnp.sort(descending)": (lambda x: jnp.sort(x, axis=-1, descending=True), 1),
    "jnp.argsort(descending)": (lambda x: jnp.argsort(x, axis=-1, descending=True), 1),
    "jnp.partition[kth]": (lambda x: jnp.partition(x, 0, axis=-1)[..., 0], 1),
    "jnp.average(weights)": (lambda x: jnp.average(x, axis=-1, weights=jnp.linspace(1.0, 2.0, 7)[: x.shape[-1]]), 1),
    "jnp.diff": (lambda x: jnp.diff(x, axis=-1), 1),
    "jnp.linalg.norm": (lambda x: jnp.linalg.norm(x, axis=-1), 1),
    "jnp.linalg.norm(ord=1)": (lambda x: jnp.linalg.norm(x, ord=1, axis=-1), 1),
    "jnp.linalg.vector_norm": (lambda x: jnp.linalg.vector_norm(x, axis=-1), 1),
    "jss.logsumexp": (lambda x: jss.logsumexp(x, axis=-1), 1),
    "jss.softmax": (lambda x: jss.softmax(x, axis=-1), 1),
    "jss.log_softmax": (lambda x: jss.log_softmax(x, axis=-1), 1),
    **{
        f"jax.nn.{n}": (lambda x, n=n: getattr(jax.nn, n)(x, axis=-1), 1)
        for n in ("softmax log_softmax logsumexp standardize").split()
    },
    "layer norm": (lambda x: (x - x.mean(-1, keepdims=True)) * lax.rsqrt(x.var(-1, keepdims=True) + 1e-5), 1),
    "rms norm": (lambda x: x * lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6), 1),
    **{
        f"lax.{n}": (lambda x, n=n: getattr(lax, n)(x, axis=x.ndim - 1), 1)
        for n in ("cumsum cumprod cummax cummin cumlogsumexp").split()
    },
    **{
        f"lax.reduce_{n}": (lambda x, n=n: getattr(lax, f"reduce_{n}")(x, axes=(x.ndim - 1,)), 1)
        for n in ("sum max min prod").split()
    },
    "lax.sort": (lambda x: lax.sort(x, dimension=x.ndim - 1), 1),
    "jnp.max(initial)": (lambda x: jnp.max(x, axis=-1, initial=-10.0), 1),
    "jnp.sum(where)": (lambda x: jnp.sum(x, axis=-1, where=x > 0), 1),
    "x.sum()/x.size": (lambda x: x.sum(-1) / x.shape[-1], 1),
    "sum(exp(x - max))": (lambda x: jnp.log(jnp.sum(jnp.exp(x - jnp.max(x, -1, keepdims=True)), -1)), 1),
    "jnp.ediff1d-like": (lambda x: x[..., 1:] - x[..., :-1], 1),
    "lax.scan cumsum": (
        lambda x: jnp.moveaxis(
            lax.scan(lambda c, v: (c + v, c + v), jnp.zeros(x.shape[:-1], x.dtype), jnp.moveaxis(x, -1, 0))[1], 0, -1
        ),
        1,
    ),
    "lax.associative_scan": (lambda x: lax.associative_scan(jnp.add, x, axis=x.ndim - 1), 1),
    "jnp.argmax(keepdims)": (lambda x: jnp.argmax(x, axis=-1, keepdims=True)[..., 0], 1),
    "jnp.top_k[0]": (lambda x: lax.top_k(x, 1)[0][..., 0], 1),
}

# -- shape: the same function of data and mask -------------------------------------------------------
SHAPE = {
    **{
        f"jnp.{n}": getattr(jnp, n)
        for n in (
            "transpose flip fliplr flipud rot90 ravel atleast_1d atleast_2d atleast_3d squeeze copy array asarray "
            "diagonal"
        ).split()
    },
    "jnp.reshape": lambda x: jnp.reshape(x, (-1, 3)),
    "jnp.roll": lambda x: jnp.roll(x, 2, axis=1),
    "jnp.expand_dims": lambda x: jnp.expand_dims(x, 1),
    "jnp.swapaxes": lambda x: jnp.swapaxes(x, 0, 1),
    "jnp.moveaxis": lambda x: jnp.moveaxis(x, 0, 1),
    "jnp.broadcast_to": lambda x: jnp.broadcast_to(x, (2,) + x.shape),
    "jnp.tile": lambda x: jnp.tile(x, (1, 2)),
    "jnp.repeat": lambda x: jnp.repeat(x, 2, axis=0),
    "jnp.concatenate": lambda x: jnp.concatenate([x, x[::-1]], axis=1),
    "jnp.stack": lambda x: jnp.stack([x, x[::-1]]),
    "jnp.hstack": lambda x: jnp.hstack([x, x]),
    "jnp.vstack": lambda x: jnp.vstack([x, x]),
    "jnp.dstack": lambda x: jnp.dstack([x, x]),
    "jnp.column_stack": lambda x: jnp.column_stack([x[0], x[1]]),
    "jnp.split[1]": lambda x: jnp.split(x, [2], axis=1)[1],
    "jnp.array_split[0]": lambda x: jnp.array_split(x, 2, axis=0)[0],
    "jnp.take": lambda x: jnp.take(x, jnp.array([2, 0, 1]), axis=1),
    "jnp.take_along_axis": lambda x: jnp.take_along_axis(x, jnp.zeros((x.shape[0], 2), int), axis=1),
    "x[index array]": lambda x: x[jnp.array([3, 1])],
    "x[::2]": lambda x: x[::2, 1:],
    "x[1, 2:5]": lambda x: x[1, 2:5],
    "x.T": lambda x: x.T,
    "lax.slice": lambda x: lax.slice(x, (1, 0), (3, 4)),
    "lax.rev": lambda x: lax.rev(x, (1,)),
    "lax.reshape": lambda x: lax.reshape(x, (x.size,)),
    "lax.transpose": lambda x: lax.transpose(x, (1, 0)),
    "lax.broadcast_in_dim": lambda x: lax.broadcast_in_dim(x, (3,) + x.shape, (1, 2)),
    "lax.expand_dims": lambda x: lax.expand_dims(x, (0,)),
    "lax.dynamic_slice": lambda x: lax.dynamic_slice(x, (1, 2), (2, 3)),
    "lax.dynamic_index_in_dim": lambda x: lax.dynamic_index_in_dim(x, 2, axis=1),
    "lax.concatenate": lambda x: lax.concatenate([x, x], 0),
    "lax.optimization_barrier": lambda x: lax.optimization_barrier(x),
    "jnp.pad(edge)": lambda x: jnp.pad(x, 1, mode="edge"),
    "x.at[1].set(x[0])": lambda x: x.at[1].set(x[0]),
    "lax.dynamic_update_slice": lambda x: lax.dynamic_update_slice(x, x[:1, :2], (2, 3)),
    "jnp.split[0]": lambda x: jnp.split(x, 2, axis=0)[0],
    "jax.checkpoint": lambda x: jax.checkpoint(lambda y: y.T)(x),
    "jax.jit inner": lambda x: jax.jit(jnp.transpose)(x),
}

# -- contractions: masked entries count as 0, valid where a pair of valid entries met ---------------
CONTRACT = {
    "jnp.matmul": jnp.matmul,
    "jnp.dot": jnp.dot,
    "x @ y": lambda a, b: a @ b,
    "jnp.einsum": lambda a, b: jnp.einsum("ij,jk->ik", a, b),
    "jnp.tensordot": lambda a, b: jnp.tensordot(a, b, axes=1),
    "lax.dot": lax.dot,
    "lax.dot_general": lambda a, b: lax.dot_general(a, b, (((1,), (0,)), ((), ()))),
    "jnp.inner": lambda a, b: jnp.inner(a, b.T),
    "jnp.linalg.multi_dot": lambda a, b: jnp.linalg.multi_dot([a, b]),
    "jnp.matmul(precision)": lambda a, b: jnp.matmul(a, b, precision="highest"),
}

CONTRACT_SHAPES = {
    "lax.conv": ((1, 1, 5, 6), (1, 1, 2, 3)),
    "lax.conv_general_dilated(SAME)": ((1, 1, 5, 6), (1, 1, 2, 3)),
    "jnp.convolve": ((7,), (3,)),
    "jnp.correlate": ((7,), (3,)),
}
CONTRACT.update(
    {
        "lax.conv": lambda a, k: lax.conv(a, k, (1, 1), "VALID"),
        "lax.conv_general_dilated(SAME)": lambda a, k: lax.conv_general_dilated(a, k, (1, 1), "SAME"),
        "jnp.convolve": jnp.convolve,
        "jnp.correlate": jnp.correlate,
    }
)

# -- window reductions: pooling over the valid elements of windows of 2 along the last axis ----------
WINDOW = {
    "sum pooling": (lambda x: lax.reduce_window(x, F(0), lax.add, (1, 2), (1, 1), "VALID"), "sum"),
    "max pooling": (lambda x: lax.reduce_window(x, -jnp.inf, lax.max, (1, 2), (1, 1), "VALID"), "max"),
    "min pooling": (lambda x: lax.reduce_window(x, jnp.inf, lax.min, (1, 2), (1, 1), "VALID"), "min"),
    "average pooling": (lambda x: lax.reduce_window(x, F(0), lax.add, (1, 2), (1, 1), "VALID") / 2.0, "mean"),
}

# -- refused: MaskifyError is the only acceptable answer ---------------------------------------------
REFUSED = {
    **{f"jnp.linalg.{n}": getattr(jnp.linalg, n) for n in "inv cholesky qr svd eigh det slogdet pinv eigvalsh".split()},
    "jnp.linalg.solve": lambda a: jnp.linalg.solve(a, jnp.ones(a.shape[0])),
    **{f"jnp.fft.{n}": getattr(jnp.fft, n) for n in "fft ifft rfft fft2 irfft".split()},
    **{f"jnp.{n}": (lambda a, n=n: getattr(jnp, n)(a, axis=-1)) for n in "nanmedian".split()},
    "jnp.nanquantile": lambda a: jnp.nanquantile(a, 0.5, axis=-1),
    "jnp.nanpercentile": lambda a: jnp.nanpercentile(a, 50.0, axis=-1),
    "jax.scipy.linalg.expm": jax.scipy.linalg.expm,
    "jnp.lexsort": lambda a: jnp.lexsort([a[0], a[1]]),
    "lax.reduce_window(custom)": lambda a: lax.reduce_window(
        a, F(1.0), lambda u, v: u * v + u, (1, 2), (1, 1), "VALID"
    ),
    "jnp.trapezoid": lambda a: jnp.trapezoid(a, axis=-1),
}

CASES = (
    [("unary", n, f, d) for n, (f, d) in UNARY.items()]
    + [("int_unary", n, f, None) for n, f in INT_UNARY.items()]
    + [("binary", n, f, d) for n, (f, d) in BINARY.items()]
    + [("bool_binary", n, f, None) for n, f in BOOL_BINARY.items()]
    + [("int_binary", n, f, None) for n, f in INT_BINARY.items()]
    + [("along", n, f, k) for n, (f, k) in ALONG.items()]
    + [("shape", n, f, None) for n, f in SHAPE.items()]
    + [("contract", n, f, CONTRACT_SHAPES.get(n, ((3, 4), (4, 2)))) for n, f in CONTRACT.items()]
    + [("window", n, f, r) for n, (f, r) in WINDOW.items()]
    + [("refused", n, f, None) for n, f in REFUSED.items()]
)


# -- inputs ------------------------------------------------------------------------------------------
def _masked(rng, shape, domain, dtype=F, poison=np.nan):
    lo, hi = domain[:2]
    data = rng.uniform(lo, hi, shape).astype(dtype)
    if domain is COMPLEX:
        data, dtype = data + 1j * rng.uniform(lo, hi, shape).astype(dtype), np.complex64
    mask = rng.random(shape) < 0.7
    return mj.masked_array(jnp.asarray(np.where(mask, data, poison).astype(dtype)), jnp.asarray(mask))


def _ints(rng, shape, dtype=np.int32, hi=20):
    mask = rng.random(shape) < 0.7
    return mj.masked_array(jnp.asarray(rng.integers(1, hi, shape).astype(dtype)), jnp.asarray(mask))


def _padded(rng):
    length = len(LENGTHS)
    data = rng.uniform(-3, 3, (length, 7)).astype(F)
    mask = np.arange(7)[None, :] < np.asarray(LENGTHS)[:, None]
    return mj.masked_array(jnp.asarray(np.where(mask, data, np.nan).astype(F)), jnp.asarray(mask)), data


def _both(fn, *args, positions="unpadded"):
    """``maskify(fn)`` eagerly and under jit."""
    return mj.maskify(fn, positions=positions)(*args), jax.jit(mj.maskify(fn, positions=positions))(*args)


def _pair(out):
    if isinstance(out, mj.MaskedArray):
        return np.asarray(out.data), np.asarray(out.mask)
    out = np.asarray(out)
    return out, np.ones(out.shape, bool)


def _close(got, want, where, what):
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape, f"{what}: shape {got.shape} against {want.shape}"
    g, w = np.where(where, got, 0), np.where(where, want, 0)
    if np.iscomplexobj(g) or np.iscomplexobj(w) or np.issubdtype(w.dtype, np.inexact):
        np.testing.assert_allclose(g, w, rtol=2e-4, atol=2e-5, equal_nan=True, err_msg=what)
    else:
        np.testing.assert_array_equal(g, w, err_msg=what)


# -- checks per kind ---------------------------------------------------------------------------------
def _check_elementwise(fn, args, positions="unpadded"):
    want = np.asarray(fn(*(jnp.where(a.mask, a.data, 1).astype(a.dtype) for a in args)))
    valid = functools.reduce(np.logical_and, [np.asarray(a.mask) for a in args])
    for label, out in zip(("eager", "jit"), _both(fn, *args, positions=positions)):
        d, m = _pair(out)
        np.testing.assert_array_equal(m, np.broadcast_to(valid, m.shape), err_msg=f"{label}: mask")
        _close(d, want, m, f"{label}: values")


def _check_along(fn, min_len, rng):
    x, data = _padded(rng)
    for label, out in zip(("eager", "jit"), _both(fn, x)):
        d, m = _pair(out)
        for b, n in enumerate(LENGTHS):
            if n < min_len:
                assert not m[b].any() or not isinstance(out, mj.MaskedArray), (
                    f"{label}: row {b} has {n} valid entries but a valid result"
                )
                continue
            ref = np.asarray(fn(jnp.asarray(data[b, :n])))
            if ref.ndim == 0:
                assert m[b], f"{label}: row {b} masked"
                _close(d[b], ref, True, f"{label}: row {b}")
            else:
                k = ref.shape[-1]
                assert m[b, :k].all(), f"{label}: row {b} mask {m[b]} (expected {k} valid)"
                # a plain array (argsort: indices are always defined) has no mask to check after the prefix
                assert not m[b, k:].any() or not isinstance(out, mj.MaskedArray), f"{label}: row {b} mask {m[b]}"
                _close(d[b, :k], ref, True, f"{label}: row {b}")


def _check_shape(fn, x):
    # positions as stored: the mask marks missing entries (a (4, 6) mask also makes axis 1 a token
    # axis, where the default counts positions among valid entries: tests/test_maskify_positions.py)
    want_d, want_m = np.asarray(fn(x.data)), np.asarray(fn(x.mask))
    for label, out in zip(("eager", "jit"), _both(fn, x, positions="padded")):
        d, m = _pair(out)
        np.testing.assert_array_equal(m, want_m, err_msg=f"{label}: mask")
        _close(d, want_d, m, f"{label}: values")


def _check_contract(fn, a, b):
    want = np.asarray(fn(a.filled(0), b.filled(0)))
    valid = np.asarray(fn(a.mask.astype(F), b.mask.astype(F))) > 0
    for label, out in zip(("eager", "jit"), _both(fn, a, b, positions="padded")):
        d, m = _pair(out)
        np.testing.assert_array_equal(m, valid, err_msg=f"{label}: mask")
        _close(d, want, m, f"{label}: values")


def _check_window(fn, reducer, x):
    a = np.ma.masked_array(np.asarray(x.data), ~np.asarray(x.mask))
    pairs = np.ma.stack([a[:, :-1], a[:, 1:]])
    want = getattr(np.ma, reducer)(pairs, axis=0)
    for label, out in zip(("eager", "jit"), _both(fn, x, positions="padded")):
        d, m = _pair(out)
        np.testing.assert_array_equal(m, ~np.ma.getmaskarray(want), err_msg=f"{label}: mask")
        _close(d, np.ma.getdata(want), m, f"{label}: values")


# the test loop runs every other case; the rest run in the slow tier (`make test-slow`)
@pytest.mark.parametrize(
    "kind,name,fn,extra",
    [pytest.param(*c, id=f"{c[0]}:{c[1]}", marks=pytest.mark.slow if i % 2 else ()) for i, c in enumerate(CASES)],
)
def test_masked_reference_or_maskify_error(kind, name, fn, extra, record_property):
    """The outcome is recorded for the run's summary (conftest prints the counts)."""
    rng = np.random.default_rng(abs(hash(name)) % 2**32)
    try:
        if kind == "unary":  # (tril, triu: stored positions; a row's own are tests/test_maskify_positions.py's)
            _check_elementwise(fn, [_masked(rng, (4, 5), extra)], "padded" if name in STORED else "unpadded")
        elif kind == "int_unary":
            _check_elementwise(fn, [_ints(rng, (4, 5))])
        elif kind == "binary":
            _check_elementwise(fn, [_masked(rng, (4, 5), extra), _masked(rng, (4, 5), extra)])
        elif kind == "bool_binary":
            _check_elementwise(fn, [_ints(rng, (4, 5), bool, 2), _ints(rng, (4, 5), bool, 2)])
        elif kind == "int_binary":
            _check_elementwise(fn, [_ints(rng, (4, 5), hi=8), _ints(rng, (4, 5), hi=4)])
        elif kind == "along":
            _check_along(fn, extra, rng)
        elif kind == "shape":
            _check_shape(fn, _masked(rng, (4, 6), ANY))
        elif kind == "contract":
            _check_contract(fn, _masked(rng, extra[0], ANY), _masked(rng, extra[1], ANY))
        elif kind == "window":
            _check_window(fn, extra, _masked(rng, (4, 6), ANY))
        else:
            x = _masked(rng, (4, 4), POS)
            with pytest.raises(mj.MaskifyError):
                mj.maskify(fn)(x)
            with pytest.raises(mj.MaskifyError):
                jax.jit(mj.maskify(fn))(x)
            record_property("maskify_outcome", "MaskifyError")
            return
    except mj.MaskifyError:
        record_property("maskify_outcome", "MaskifyError")
        return
    record_property("maskify_outcome", "equal")


def test_case_count():
    assert len(CASES) >= 250, len(CASES)
    print(
        f"\nmaskify coverage: {len(CASES)} functions ({len(CASES) - len(REFUSED)} with a masked reference, "
        f"{len(REFUSED)} expected to raise MaskifyError)"
    )


# -- primitive coverage -------------------------------------------------------------------------------
def _example_args(kind, extra):
    rng = np.random.default_rng(0)
    if kind in ("unary", "refused"):
        return [_masked(rng, (4, 4), extra or POS)]
    if kind == "shape":
        return [_masked(rng, (4, 6), ANY)]
    if kind == "int_unary":
        return [_ints(rng, (4, 5))]
    if kind == "binary":
        return [_masked(rng, (4, 5), extra)] * 2
    if kind == "bool_binary":
        return [_ints(rng, (4, 5), bool, 2)] * 2
    if kind == "int_binary":
        return [_ints(rng, (4, 5))] * 2
    if kind == "along":
        return [_padded(rng)[0]]
    if kind == "window":
        return [_masked(rng, (4, 6), ANY)]
    return [_masked(rng, extra[0], ANY), _masked(rng, extra[1], ANY)]


def _primitives(jaxpr, seen):
    for eqn in jaxpr.eqns:
        seen.add(eqn.primitive)
        if eqn.primitive.name == "jit" and eqn.params.get("name") in primitives.NAMED:
            continue  # replaced as a whole by its op's rule
        for sub in sub_jaxprs(eqn.params):
            _primitives(sub, seen)


def test_primitive_coverage():
    """Primitives in the jaxprs of these functions: most have a masked rule; the rest are listed."""
    seen = set()
    for kind, _, fn, extra in CASES:
        args = [a.data for a in _example_args(kind, extra)]
        _primitives(jax.make_jaxpr(fn)(*args).jaxpr, seen)
    interpreted = _transform._CALLS | _transform._LOOPS
    covered = {
        p
        for p in seen
        if primitives.rule_for(p) is not None
        or p in interpreted
        or p.name in ("jit", "iota", "rng_bit_generator", "random_seed", "random_bits", "random_wrap")
    }
    refused = {p for p in seen if p in primitives.UNSUPPORTED}
    missing = seen - covered - refused
    print(
        f"\nmaskify primitive coverage: {len(covered)} of {len(seen)} primitives in these jaxprs have a masked "
        f"rule or are interpreted; {len(refused)} raise MaskifyError by design "
        f"({', '.join(sorted(p.name for p in refused))}); without a rule: "
        f"{', '.join(sorted(p.name for p in missing)) or 'none'}"
    )
    assert len(covered) >= 120, sorted(p.name for p in missing)
