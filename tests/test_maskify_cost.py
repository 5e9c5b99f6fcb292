"""What keeps maskify's cost near hand-written JAX, checked for values (the timings live in
``benchmarks/maskify_models.py``):

* a move between padded and unpadded coordinates, and ``lax.associative_scan``'s moves, skip their
  gathers where the batch is right padded (left padded for a reverse scan): both branches give the
  per-row unpadded results, values and gradients, with NaN in the padding;
* the scalar arithmetic maskify evaluates to know whether a masked operand needs sanitising
  (``x / sqrt(d)``, ``2 * x - 1``) is computed on the host, exactly as XLA computes it, so tracing
  such a function compiles nothing.
"""

from __future__ import annotations

import itertools
import logging
import math

import jax
import jax.extend.core.primitives as P
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import masked_jax as mj
from masked_jax._maskify import _positions
from masked_jax.ops import _factors

PATTERNS = {
    "right": np.array([[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 1], [1, 0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0]], bool),
    "left": np.array([[0, 0, 0, 1, 1, 1], [1, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, 1], [0, 0, 0, 0, 0, 0]], bool),
    "holes": np.array([[1, 0, 1, 1, 0, 1], [0, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0], [0, 0, 0, 0, 0, 0]], bool),
}


@pytest.mark.parametrize("padding", list(PATTERNS))
def test_right_padded_tells_the_usual_batch(padding):
    valid = jnp.asarray(PATTERNS[padding])
    assert bool(_positions.right_padded(valid, 1)) == (padding == "right")
    assert bool(_positions.right_padded(valid[..., None], 1)) == (padding == "right")
    assert bool(_positions.right_padded(jnp.flip(valid, 1), 1)) == (padding == "left")
    assert bool(_positions.right_padded(valid[:, :1], 1))  # one entry: nothing to move


def _affine(a, b):  # x -> m x + c maps composed: associative, not commutative
    (m1, c1), (m2, c2) = a, b
    return m1 * m2, c1 * m2 + c2


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("reverse", [False, True], ids=["forward", "reverse"])
@pytest.mark.parametrize("padding", list(PATTERNS))
def test_associative_scan_equals_each_row_alone_on_every_padding(padding, reverse, jit):
    """Right padding forward and left padding in reverse take the branch with no move; the others
    move. Each equals the scan of every row's valid elements alone, values and gradients, with a
    (B, L, F) element and its (B, L, 1) token mask, NaN in the padding."""
    mask = PATTERNS[padding]
    rng = np.random.default_rng(3)
    m = rng.uniform(0.5, 1.5, mask.shape + (2,)).astype(np.float32)
    c = rng.normal(size=mask.shape + (2,)).astype(np.float32)
    keep = mask[..., None]

    def poison(a):
        return mj.masked_array(jnp.asarray(np.where(keep, a, np.nan)), jnp.asarray(keep))

    f = mj.maskify(lambda mv, cv: lax.associative_scan(_affine, (mv, cv), reverse=reverse, axis=1))
    f = jax.jit(f) if jit else f
    out_m, out_c = f(poison(m), poison(c))
    g_m, g_c = mj.grad(lambda mv, cv: jnp.sum(f(mv, cv)[1].filled(0) ** 2), argnums=(0, 1))(poison(m), poison(c))
    ref = lambda mv, cv: lax.associative_scan(_affine, (mv, cv), reverse=reverse)
    for r in range(mask.shape[0]):
        idx = np.flatnonzero(mask[r])
        np.testing.assert_array_equal(np.asarray(jnp.broadcast_to(out_c.mask, c.shape)[r, :, 0]), mask[r])
        if not idx.size:
            continue
        want_m, want_c = ref(jnp.asarray(m[r, idx]), jnp.asarray(c[r, idx]))
        np.testing.assert_allclose(np.asarray(out_m.data[r, idx]), np.asarray(want_m), rtol=1e-6)
        np.testing.assert_allclose(np.asarray(out_c.data[r, idx]), np.asarray(want_c), rtol=1e-6)
        want_g = jax.grad(lambda mv, cv: jnp.sum(ref(mv, cv)[1] ** 2), argnums=(0, 1))(
            jnp.asarray(m[r, idx]), jnp.asarray(c[r, idx])
        )
        np.testing.assert_allclose(np.asarray(g_m.data[r, idx]), np.asarray(want_g[0]), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(np.asarray(g_c.data[r, idx]), np.asarray(want_g[1]), rtol=1e-5, atol=1e-6)
    assert np.isfinite(np.asarray(g_m.filled(0))).all() and np.isfinite(np.asarray(g_c.filled(0))).all()


# -- scalar arithmetic on the host --------------------------------------------------------------------
SPECIAL = [0.0, -0.0, 1.0, -2.5, 3e-39, 1e38, 65504.0, math.inf, -math.inf, math.nan]
ARITHMETIC = [P.add_p, P.sub_p, P.mul_p, P.div_p, P.max_p, P.min_p]


# (without 64-bit types there are no float64 arrays to evaluate at)
KINDS = [(np.float16, True), (np.float32, True), (np.float64, True), (np.float16, False), (np.float32, False)]


@pytest.mark.parametrize(("dtype", "x64"), KINDS, ids=lambda k: getattr(k, "__name__", f"x64={k}"))
@pytest.mark.parametrize("prim", ARITHMETIC, ids=lambda p: p.name)
def test_scalar_arithmetic_on_the_host_equals_jax(prim, dtype, x64):
    """The value, and whether it and its partial derivatives are finite, as jax computes them, at
    every pair of special values (those with a subnormal are left to jax), with and without
    64-bit types."""
    with jax.enable_x64(x64):
        _compare_scalar_arithmetic(prim, dtype)


def _compare_scalar_arithmetic(prim, dtype):
    fn = lambda a, b: prim.bind(a, b)
    on_host = 0
    for a, b in itertools.product(SPECIAL, SPECIAL):
        for derivatives in (True, False):
            got = _factors._scalar_on_host(prim, (a, b), (dtype, dtype), derivatives)
            if got is None:  # a subnormal met (XLA on the CPU flushes them): left to jax
                continue
            on_host += 1
            with np.errstate(over="ignore"):  # 1e38 as float16
                want = _factors._evaluated(fn, (a, b), (dtype, dtype), derivatives)
            assert got[1] == want[1], (prim, a, b, dtype, derivatives)
            assert (math.isnan(got[0]) and math.isnan(want[0])) or got[0] == want[0], (prim, a, b, got, want)
    assert on_host >= 0.6 * 2 * len(SPECIAL) ** 2


def test_tracing_a_maskified_function_compiles_nothing(caplog):
    """Scalar arithmetic with a masked operand (``/ sqrt(d)``, ``* 2.0 - 1.0``) is known to need no
    sanitising without compiling a program, so a trace after a cleared cache compiles nothing."""

    def scaled(x):
        s = jnp.einsum("bqd,bkd->bqk", x, x) / math.sqrt(x.shape[-1])
        return jnp.einsum("bqk,bkd->bqd", jax.nn.softmax(s, -1), x * 2.0 - 1.0)

    valid = jnp.asarray(PATTERNS["holes"][:3])
    x = mj.masked_array(jnp.ones((3, 6, 4)), valid[..., None])
    jax.jit(mj.maskify(scaled)).trace(x)  # the first trace in this process may fill caches
    jax.clear_caches()
    _factors._SAFE_CACHE.clear()  # (what maskify learned about the scalars, kept per process)
    with caplog.at_level(logging.WARNING), jax.log_compiles(True):
        jax.jit(mj.maskify(scaled)).trace(x)
    compiles = [r.getMessage() for r in caplog.records if "Compiling" in r.getMessage()]
    assert compiles == []
