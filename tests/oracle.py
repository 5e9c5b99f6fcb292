"""``jax.numpy`` as the oracle: every registered op, over every dtype jnp accepts, with special values.

Two references, both computed by ``jax.numpy`` itself (never by ``numpy.ma``):

* **Full mask**: the masked op on fully valid operands equals jnp's function on the plain data, in
  dtype, in weak type and bit for bit (NaN matches any NaN; ``-0.0`` does not match ``0.0``). The
  operands hold the dtype's special values as *valid* entries: ±0, ±inf, NaN, the dtype's max, min
  and tiny (floats), its extremes (integers). Binary ops also run with a Python scalar operand
  (weak-type promotion). Ops whose summation order differs from jnp's are listed in
  :data:`SUMMATION_ORDER`, with the bound the comparison uses.
* **Partial mask** (a mask with full, partial and empty slices, NaN and inf under the mask): the
  unpadded reference, computed by compaction. Elementwise ops: jnp on the valid entries.
  Reductions, normalizations, order statistics and cumulative ops: jnp applied to each slice's
  valid entries alone (the slice compacted, then the function). Contractions: the sum over jointly
  valid terms only, each term formed by jnp. Shape ops: jnp applied to data and mask alike.

Each (op, dtype) runs eagerly and under ``jit``. An op leaves a dtype that jnp accepts only through
``OpSpec.refused_dtypes`` (with the reason); an op leaves the whole check only through
``OpSpec.excluded["oracle"]``.
"""

from __future__ import annotations

import functools
import os
import warnings

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from conformance_table import ROWS, oracle_rows, quiet

import masked_jax as mj
from masked_jax._validate import dtype_kind as kind
from masked_jax.layouts import SparseMasked
from masked_jax.numpy import _frontend
from masked_jax.ops import REGISTRY

# Every dtype of the matrix (x64 is on in the test process: the 64-bit ones run too).
DTYPES = (
    "bool",
    "int4",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint4",
    "uint8",
    "uint16",
    "uint32",
    "uint64",
    "float8_e4m3fn",
    "float8_e5m2",
    "float16",
    "bfloat16",
    "float32",
    "float64",
    "complex64",
    "complex128",
)
_ML_DTYPES = (
    "int4",
    "uint4",
    "bfloat16",
    "float8_e4m3fn",
    "float8_e5m2",
)  # jax's types that numpy names through ml_dtypes
SHAPE = (4, 3)
MASK = np.array([[1, 0, 1], [1, 1, 1], [0, 0, 0], [0, 1, 1]], bool)  # partial, full and empty rows
MASK2 = np.array([[1, 1, 0], [0, 1, 1], [1, 0, 1], [1, 1, 1]], bool)
POISON = (np.nan, np.inf)  # under the mask, in turn

# Ops whose float results may differ from jnp's by rounding alone, and why; the comparison bounds
# them by |got - want| <= SUM_ULPS * n * eps * max(|x|) * size (n: the slice length). This is the
# one list of such differences (the docs quote it).
SUM_ULPS = 4
_ORDER = (
    "summation order: value and count are reduced in one variadic reduction, which XLA orders "
    "differently from jnp's separate reductions (and a masked sum skips masked terms)"
)
_FMA = (
    "the linear interpolation a*w0 + b*w1 may be contracted by XLA into a fused multiply-add in one "
    "program and not in the other (1 ulp)"
)
ROUNDING = {
    **{
        name: _ORDER
        for name in (
            "sum",
            "mean",
            "var",
            "std",
            "average",
            "norm",
            "cov",
            "corrcoef",
            "logsumexp",
            "logmeanexp",
            "softmax",
            "log_softmax",
            "softmin",
            "normalize",
            "cumsum",
            "cumprod",
            "prod",
            "matmul",
            "dot",
            "vdot",
            "inner",
            "tensordot",
            "einsum",
        )
    },
    **{name: _FMA for name in ("quantile", "percentile", "median")},
}
SUMMATION_ORDER = set(ROUNDING)


def np_dtype(name):
    return np.dtype(getattr(ml_dtypes, str(name)) if str(name) in _ML_DTYPES else name)


def _weak(x) -> bool:
    return bool(getattr(x, "weak_type", False))


def special_values(dtype) -> np.ndarray:
    """The dtype's special values and a few ordinary ones (valid entries of the operands)."""
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        return np.array([True, False, True], bool)
    if kind(dtype) in "iu":
        info = ml_dtypes.iinfo(dtype)
        vals = [0, 1, 2, 7, info.max, info.max - 1] + ([info.min, -1, -3] if kind(dtype) == "i" else [3, 5])
        return np.array(vals, dtype)
    real = np.float32 if dtype == np.complex64 else np.float64 if dtype.kind == "c" else dtype
    info = ml_dtypes.finfo(real) if real not in (np.float32, np.float64, np.float16) else np.finfo(real)
    vals = np.array(
        [0.0, -0.0, np.inf, -np.inf, np.nan, float(info.max), float(info.min), float(info.tiny), 1.0, -1.5, 2.5, 0.5],
        np.float64,
    ).astype(real)
    if dtype.kind == "c":
        return (vals + 1j * np.roll(vals, 3)).astype(dtype)
    return vals


def ordinary_values(dtype, domain, n, rng) -> np.ndarray:
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        return rng.random(n) > 0.5
    lo, hi = domain
    if kind(dtype) in "iu":
        lo = max(int(np.ceil(lo)), 0) if kind(dtype) == "u" else int(np.ceil(lo))
        return rng.integers(lo, int(np.floor(hi)) + 1, n).astype(dtype)
    vals = rng.uniform(lo, hi, n)
    if dtype.kind == "c":
        vals = vals + 1j * rng.uniform(lo, hi, n)
    return vals.astype(dtype)


def draw(dtype, values: str, mask, domain, seed=0, poison=np.nan) -> mj.MaskedArray:
    """A MaskedArray of ``mask``'s shape: ``values`` "special" or "ordinary" valid entries, ``poison``
    under the mask (floats; integers hold their max there)."""
    rng = np.random.default_rng(seed)
    dtype = np.dtype(dtype)
    n = int(np.prod(np.shape(mask)))
    if values == "special":
        pool = special_values(dtype)
        data = np.resize(rng.permutation(pool), n)
        # keep some ordinary values among the special ones (sums of finite values, etc.)
        data[::4] = ordinary_values(dtype, domain, len(data[::4]), rng)
    else:
        data = ordinary_values(dtype, domain, n, rng)
    data = data.reshape(np.shape(mask))
    if kind(dtype) in "fc":
        data = np.where(mask, data, np.asarray(poison).astype(dtype))
    elif kind(dtype) in "iu":
        data = np.where(mask, data, np.asarray(ml_dtypes.iinfo(dtype).max, dtype))
    return mj.masked_array(jnp.asarray(data), jnp.asarray(mask))


# -- comparing with jnp -----------------------------------------------------------------------------
def _leaves(out):
    if isinstance(out, (list, tuple)):
        return [leaf for o in out for leaf in _leaves(o)]
    if isinstance(out, SparseMasked):
        out = out.todense()
    if isinstance(out, mj.MaskedArray):
        return [(out.data, out.mask)]
    if isinstance(out, Weak):
        return [(out.arr, out.weak)]
    return [(jnp.asarray(out), None)]


def _bits(a):
    a = np.asarray(a)
    if a.dtype.kind == "c":
        return np.stack([_bits(a.real), _bits(a.imag)], -1)
    if kind(a.dtype) == "f":
        return a.view(f"u{a.dtype.itemsize}")
    return a


def _isnan(a):
    a = np.asarray(a)
    if a.dtype.kind == "c":
        return np.stack([np.isnan(a.real), np.isnan(a.imag)], -1)
    if kind(a.dtype) == "f":
        return np.isnan(a.astype(np.float64))
    return np.zeros(a.shape, bool)


def _close(got, want, scale, ulps):
    """Equality within ``ulps * eps * max(|scale|, |want|)``, per element (NaN with NaN, inf with
    inf)."""
    g, w = np.asarray(got).astype(np.complex128), np.asarray(want).astype(np.complex128)
    eps = float(ml_dtypes.finfo(np.asarray(want).dtype).eps) if kind(np.asarray(want).dtype) in "fc" else 0.0
    same = (g == w) | (np.isnan(g) & np.isnan(w))
    with np.errstate(all="ignore"):
        near = np.abs(g - w) <= ulps * eps * np.maximum(np.abs(scale), np.abs(w)) + 1e-300
    return same | (np.isfinite(g) & np.isfinite(w) & near)


JIT_ULPS = 2
JIT_ROUNDING = (
    "under jit XLA fuses an elementwise function with its neighbours and may pick another "
    f"vectorised approximation of it (tanh, rsqrt, erf, exp ...): floats within {JIT_ULPS} ulp; eagerly bit "
    "for bit"
)


def assert_equal_to_jnp(got, want, what, *, valid=None, order_bound=None, undefined_masked=False, ulps=0):
    """``got`` (masked op result) equals ``want`` (jnp result): dtype, weak type and bits on the
    positions ``valid`` (all if None); with ``order_bound=(scale, n)`` floats within the summation
    bound. ``undefined_masked``: a masked result where jnp's is not finite is right (the semantics'
    "undefined on the valid entries means masked": a variance with too few elements, a
    correlation with a zero variance)."""
    g_leaves, w_leaves = _leaves(got), _leaves(want)
    assert len(g_leaves) == len(w_leaves), f"{what}: {len(g_leaves)} outputs, jnp gives {len(w_leaves)}"
    for k, ((gd, gm), (wd, weak)) in enumerate(zip(g_leaves, w_leaves)):
        tag = f"{what} [output {k}]"
        assert gd.dtype == wd.dtype, f"{tag}: dtype {gd.dtype}, jnp gives {wd.dtype}"
        gw = _weak(gd)
        ww = weak if isinstance(weak, bool) else _weak(wd)
        assert gw == ww, f"{tag}: weak_type={gw}, jnp gives weak_type={ww}"
        assert gd.shape == wd.shape, f"{tag}: shape {gd.shape}, jnp gives {wd.shape}"
        v = (
            np.ones(gd.shape, bool)
            if valid is None
            else np.broadcast_to(valid[k] if isinstance(valid, list) else valid, gd.shape)
        )
        if gm is not None:
            gm = np.asarray(jnp.broadcast_to(gm, gd.shape))
            if undefined_masked:
                with np.errstate(all="ignore"):
                    v = v & (gm | np.isfinite(np.asarray(wd).astype(np.complex128)))
            missing = v & ~gm
            assert not missing.any(), (
                f"{tag}: masked where jnp's result is defined, at {np.argwhere(missing)[:4].tolist()}"
            )
        gd, wd = np.asarray(gd), np.asarray(wd)
        if order_bound is not None and kind(gd.dtype) in "fc":
            ok = _close(gd, wd, order_bound[0], SUM_ULPS * max(order_bound[1], 1))
        elif ulps and kind(gd.dtype) in "fc":
            ok = _close(gd, wd, ulps[1], ulps[0])
        else:
            nan_g, nan_w = _isnan(gd), _isnan(wd)
            ok = (_bits(gd) == _bits(wd)) | (nan_g & nan_w)
            if ok.ndim > gd.ndim:
                ok = ok.all(-1)
        bad = v & ~ok
        if bad.any():
            at = tuple(np.argwhere(bad)[0])
            raise AssertionError(
                f"{tag}: {int(bad.sum())} of {int(v.sum())} values differ from jnp; first at {at}: "
                f"got {gd[at]!r}, jnp gives {wd[at]!r}"
            )


# -- the references -------------------------------------------------------------------------------------
def jnp_fn(name):
    o = oracle_rows().get(name)
    if o is not None and o.jax is not None:
        return o.jax
    return ROWS[name].jax or REGISTRY[name].fn


def cases(name):
    o = oracle_rows().get(name)
    return o.cases if o is not None and o.cases is not None else ROWS[name].cases


def differences():
    """Every documented difference from jnp, and every missing reference: ``{op: reason}``."""
    return {name: o.why for name, o in oracle_rows().items() if o.why}


def call(name, fn, ops, case):
    row = ROWS[name]
    return row.call(fn, list(ops), **case) if row.call is not None else fn(*ops, **case)


def accepts(name, dtype, case) -> bool:
    """Whether the op's own jnp function (else its oracle expression) accepts operands of ``dtype``
    (run on ordinary values: some refusals come only when jax lowers the call, as ``jnp.argmax`` of
    complex values)."""
    key = (name, str(dtype), repr(case))
    if key not in _ACCEPTS:
        _ACCEPTS[key] = _accepts(name, dtype, case)
    return _ACCEPTS[key]


_ACCEPTS: dict = {}


@quiet
def _accepts(name, dtype, case):
    ops = operands(name, np_dtype(dtype), "ordinary", full=True)
    plain = [o.data if isinstance(o, mj.MaskedArray) else o for o in ops]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            jax.block_until_ready(call(name, ROWS[name].jax or REGISTRY[name].fn or jnp_fn(name), plain, case))
    except Exception:  # noqa: BLE001 (jnp refuses: any error)
        return False
    return True


def operands(name, dtype, values, *, full, poison=np.nan, scalar=False):
    """The op's operands: its oracle ``make`` (conformance_table.ORACLE) or the family default."""
    spec, row = REGISTRY[name], ROWS[name]
    o = oracle_rows().get(name)
    masks = (np.ones(SHAPE, bool),) * 2 if full else (MASK, MASK2)
    if o is not None and o.make is not None:
        return o.make(dtype, values, masks, poison)
    domain = lambda i: row.domain[min(i, len(row.domain) - 1)]
    n = 2 if spec.family == "binary" else 1
    ops = [draw(dtype, values, masks[i], domain(i), seed=i, poison=poison) for i in range(n)]
    if scalar:
        ops[1] = special_values(dtype)[8 if np.dtype(dtype).kind in "fc" else 1].item()
    return ops


def row_shaped(name, dtype, values, masks, poison):
    """Operands of the shapes, masks and dtypes the op's conformance row makes (several operands of
    different shapes: contractions, ``where``'s bool condition, joins, weights), with ``values``
    ("special" or "ordinary") as their valid entries and ``poison`` under their masks."""
    shaped = ROWS[name].make(np.random.default_rng(0), dtype, masks)
    out = []
    for k, o in enumerate(shaped):
        if not isinstance(o, mj.MaskedArray):
            out.append(o)
            continue
        d, m = np.asarray(o.data), np.asarray(o.mask)
        # floats: the row's range; integers: small ones (the row's may have wrapped around)
        valid = d[m].real.astype(np.float64) if kind(d.dtype) in "fc" else []
        domain = (float(valid.min()), float(valid.max())) if len(valid) else (-2.0, 2.0)
        out.append(draw(d.dtype, values, m, domain, seed=k, poison=poison))
    return out


def _scale(ops):
    """The largest finite magnitude among the valid operand entries (rounding bounds scale with it)."""
    top = 0.0
    for o in ops:
        if isinstance(o, mj.MaskedArray):
            a = np.abs(np.asarray(o.data).astype(np.complex128))
            top = max(top, float(np.max(np.where(np.asarray(o.mask) & np.isfinite(a), a, 0), initial=0)))
    return top


def _plain(ops):
    return [o.data if isinstance(o, mj.MaskedArray) else o for o in ops]


@quiet
def check_full(name, dtype, values, case, jit=False, scalar=False):
    ops = operands(name, dtype, values, full=True, scalar=scalar)
    fn = _frontend.function(name)
    f = lambda *o: call(name, fn, o, case)
    g = lambda *o: call(name, jnp_fn(name), o, case)
    if jit:
        f, g = jax.jit(f), jax.jit(g)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", mj.StorageFallbackWarning)
        got = f(*ops)
    want = g(*_plain(ops))
    bound, scale = None, _scale(ops)
    if name in SUMMATION_ORDER:
        bound = (scale * np.size(_plain(ops)[0]), np.size(_plain(ops)[0]))
    what = (
        f"{name}({np_dtype(dtype)}, {values}, full mask{', scalar' if scalar else ''}, {case}{', jit' if jit else ''})"
    )
    check = functools.partial(
        assert_equal_to_jnp,
        what=what,
        order_bound=bound,
        undefined_masked=_undefined_masked(name),
        ulps=(JIT_ULPS, scale) if jit else 0,
    )
    try:
        check(got, want)
    except AssertionError as err:
        if not scalar:
            raise
        # jnp disagrees with itself: XLA rewrites ``convert(bool) / scalar`` as a select, so
        # ``divide(False, False)`` is 0 with a scalar divisor and NaN (IEEE) with an array one. Either
        # of jnp's two answers is accepted; dtype and weak type still come from the scalar form.
        first = _plain(ops)[0]
        spread = jnp.full(np.shape(first), ops[1], dtype=jnp.result_type(first, ops[1]))
        try:
            check(got, jax.tree.map(lambda w, a: a.astype(w.dtype), want, g(first, spread)))
        except AssertionError:
            raise err from None


CHECK_PARTIAL = {}  # family -> partial-mask reference (filled below)


@quiet
def check_partial(name, dtype, values, case, jit=False, poison=np.nan):
    spec = REGISTRY[name]
    o = oracle_rows().get(name)
    ref = o.partial if o is not None and o.partial is not None else CHECK_PARTIAL.get(spec.family)
    if ref is None or ref is False:
        return
    ops = operands(name, dtype, values, full=False, poison=poison)
    fn = _frontend.function(name)
    f = lambda *o: call(name, fn, o, case)
    if jit:
        f = jax.jit(f)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", mj.StorageFallbackWarning)
        got = f(*ops)
    want, valid = ref(name, ops, case)
    bound, scale = None, _scale(ops)
    if name in SUMMATION_ORDER:
        bound = (scale * np.size(_plain(ops)[0]), np.size(_plain(ops)[0]))
    what = f"{name}({np_dtype(dtype)}, {values}, partial mask, {poison} under it, {case}{', jit' if jit else ''})"
    assert_equal_to_jnp(
        got,
        want,
        what,
        valid=valid,
        order_bound=bound,
        undefined_masked=_undefined_masked(name),
        ulps=(JIT_ULPS, scale) if jit else 0,
    )


def _undefined_masked(name):
    o = oracle_rows().get(name)
    return bool(o is not None and o.undefined)


def _elementwise_partial(name, ops, case):
    want = call(name, jnp_fn(name), _plain(ops), case)
    masks = [np.asarray(o.mask) for o in ops if isinstance(o, mj.MaskedArray)]
    valid = functools.reduce(np.logical_and, np.broadcast_arrays(*masks))
    return want, [_valid_at(valid, np.shape(w)) for w in (want if isinstance(want, (list, tuple)) else [want])]


def _valid_at(valid, shape):
    """Elementwise validity at the output's shape; a bitcast to a narrower dtype adds a trailing
    axis of parts (each valid where its element is), one to a wider dtype removes one (valid where
    every part is)."""
    if len(shape) == valid.ndim + 1:
        valid = valid[..., None]
    elif len(shape) == valid.ndim - 1:
        valid = valid.all(axis=-1)
    return np.broadcast_to(valid, shape)


def _axes(case, ndim):
    axis = case.get("axis", None)
    if axis is None:
        return tuple(range(ndim))
    return tuple(sorted(a % ndim for a in ((axis,) if isinstance(axis, int) else axis)))


class Weak:
    """A reference array built by the test, with the weak type jnp's result has."""

    def __init__(self, arr, weak):
        self.arr, self.weak = arr, weak


def compacted(name, ops, case, *, keeps_shape, to_front=False, positions=False):
    """jnp's function on each slice's valid entries alone (a slice: the entries that share the
    kept coordinates; ``axis=None`` flattens). The per-slice results are placed:

    * one value per slice (reductions), or
    * ``keeps_shape``: back at the slice's valid positions (normalizations, cumulative ops), or
      ``to_front``: at the slice's first positions (sorts: masked entries last);
    * ``positions``: an index result (argmax, argsort) is an index into the compacted slice,
      mapped back to the slice's own positions.
    """
    x = ops[0]
    data, mask = np.asarray(x.data), np.asarray(x.mask)
    # masked operands of x's shape (average's weights) share its slices: an entry counts where all
    # are valid, and each is compacted with x
    co = [k for k, o in enumerate(ops[1:]) if isinstance(o, mj.MaskedArray) and np.shape(o.data) == data.shape]
    for k in co:
        mask = mask & np.asarray(ops[1 + k].mask)
    extras = _plain(ops[1:])
    fn = jnp_fn(name)
    if case.get("axis") is None and keeps_shape and not to_front:  # cumsum(axis=None) flattens
        data, mask, case = data.ravel(), mask.ravel(), {**case, "axis": 0}
    axes = _axes(case, data.ndim)
    kept = [a for a in range(data.ndim) if a not in axes]
    inner = {k: v for k, v in case.items() if k not in ("axis", "keepdims")}
    perm = kept + list(axes)
    lead = tuple(data.shape[a] for a in kept)
    d = data.transpose(perm).reshape(lead + (-1,))
    m = mask.transpose(perm).reshape(lead + (-1,))
    co_d = {k: np.asarray(extras[k]).reshape(data.shape).transpose(perm).reshape(lead + (-1,)) for k in co}
    template = call(name, fn, [jnp.asarray(data)] + extras, case)
    out = np.array(template)
    valid = np.zeros(out.shape, bool)
    per_element = keeps_shape or to_front
    if per_element:
        out_v = out.transpose(perm).reshape(lead + (-1,))
        valid_v = valid.transpose(perm).reshape(lead + (-1,))
    else:
        out_v, valid_v = out.reshape(lead), valid.reshape(lead)
    for idx in np.ndindex(*lead):
        where = np.flatnonzero(m[idx])
        if where.size == 0:
            continue
        args = [jnp.asarray(co_d[k][idx][where]) if k in co_d else e for k, e in enumerate(extras)]
        r = np.asarray(
            call(
                name,
                fn,
                [jnp.asarray(d[idx][where])] + args,
                {**inner, "axis": 0} if per_element or "axis" in case else inner,
            )
        )
        if positions:
            r = where[r]
        if to_front:
            out_v[idx][: where.size] = r
            valid_v[idx][: where.size] = True
        elif keeps_shape:
            out_v[idx][where] = r
            valid_v[idx][where] = True
        else:
            out_v[idx], valid_v[idx] = r, True
    if per_element:
        shape_t = tuple(data.shape[p] for p in perm)
        inv = np.argsort(perm)
        out, valid = out_v.reshape(shape_t).transpose(inv), valid_v.reshape(shape_t).transpose(inv)
    else:
        out, valid = out_v.reshape(out.shape), valid_v.reshape(valid.shape)
    return Weak(jnp.asarray(out, template.dtype), _weak(template)), valid


def _reduction_partial(name, ops, case):
    return compacted(name, ops, case, keeps_shape=False)


def _normalization_partial(name, ops, case):
    return compacted(name, ops, {"axis": -1, **case}, keeps_shape=True)


def contraction_terms(name, ops, case):
    """Contractions: the sum over jointly valid terms only, each term ``a_p * b_q`` formed by jnp
    in the operands' dtype (a masked term is never formed: a masked inf or NaN cannot reach a valid
    output, and a valid inf never meets a masked entry). Which terms reach which output is read off
    the function itself, applied to pairs of one-hot operands."""
    a, b = ops
    fn = jnp_fn(name)
    ad, bd = jnp.asarray(a.data), jnp.asarray(b.data)
    na, nb = ad.size, bd.size
    ea = jnp.eye(na).reshape((na,) + ad.shape)
    eb = jnp.eye(nb).reshape((nb,) + bd.shape)
    coef = jax.vmap(lambda u: jax.vmap(lambda v: call(name, fn, [u, v], case))(eb))(ea)  # (na, nb, out...)
    want = call(name, fn, [ad, bd], case)
    joint = np.asarray(a.mask).reshape(na, 1) & np.asarray(b.mask).reshape(1, nb)
    term_on = (np.asarray(coef) != 0) & joint.reshape(joint.shape + (1,) * np.ndim(want))
    left = jnp.conj(ad) if name == "vdot" else ad  # vdot conjugates its first operand
    terms = (left.reshape(na, 1) * bd.reshape(1, nb)).astype(want.dtype)
    terms = terms.reshape(terms.shape + (1,) * np.ndim(want))
    terms = jnp.where(jnp.asarray(term_on), terms, jnp.zeros((), want.dtype))
    out = jnp.sum(terms, axis=(0, 1), dtype=want.dtype)
    # an output of one term (outer's every output) is the term itself, its sign kept
    on = term_on.reshape((-1,) + term_on.shape[2:])
    first = jnp.take_along_axis(
        jnp.reshape(terms, (-1,) + terms.shape[2:]), jnp.asarray(np.argmax(on, axis=0))[None], axis=0
    )[0]
    out = jnp.where(jnp.asarray(on.sum(axis=0) == 1), first, out)
    return Weak(out, _weak(want)), term_on.any(axis=(0, 1))


def joined(name, ops, case):
    """Joins (concatenate, stack): jnp's join of the data, valid where the join of the masks is."""
    fn = jnp_fn(name)
    return call(name, fn, _plain(ops), case), [np.asarray(call(name, fn, [np.asarray(o.mask) for o in ops], case))]


def passthrough(name, ops, case):
    """Shape ops: jnp's function of the data, valid where the same function of the mask is."""
    fn = jnp_fn(name)
    x = ops[0]
    want = call(name, fn, [x.data] + list(ops[1:]), case)
    mask = call(name, fn, [x.mask] + list(ops[1:]), case)
    as_list = lambda v: list(v) if isinstance(v, (list, tuple)) else [v]
    return want, [np.asarray(v) for v in as_list(mask)]


def by_slice(default_axis="all", **how):
    """A partial-mask reference by compaction, placed as ``how`` says (see :func:`compacted`);
    ``default_axis``: the op's axis when the case gives none (``"all"``: every axis)."""

    def ref(name, ops, case):
        if default_axis != "all" and "axis" not in case:
            case = {**case, "axis": default_axis}
        return compacted(name, ops, case, **{"keeps_shape": False, **how})

    return ref


CHECK_PARTIAL.update(
    {
        "elementwise": _elementwise_partial,
        "binary": _elementwise_partial,
        "shape": passthrough,
        "reductions": _reduction_partial,
        "normalization": _normalization_partial,
        "linalg": contraction_terms,
    }
)


# -- the harness check ---------------------------------------------------------------------------------
FULL = os.environ.get("MJ_ORACLE") == "full"
# `make test` runs this sample; `make test-full` (MJ_ORACLE=full) runs every combination.
SAMPLE_JIT_DTYPES = ("float32",)
SAMPLE_DTYPES = ("bool", "int4", "int8", "uint32", "bfloat16", "float32", "complex64")


@quiet
def _plan(name):
    return list(_plan_cases(name))


def plan(name):
    """The (dtype, values, mask, poison, jit, scalar, case) cases the check runs for op ``name``."""
    return _plan(name)


def _plan_cases(name):
    """The (dtype, values, mask, poison, jit, scalar) cases the check runs for op ``name``."""
    spec = REGISTRY[name]
    o = oracle_rows().get(name)
    for dt in DTYPES if FULL else SAMPLE_DTYPES:
        dtype = np_dtype(dt)
        if o is not None and dt in o.skip_dtypes:
            continue
        # the sample: float32 runs every case of the row, the other dtypes its first case
        for case in cases(name) if FULL or dt == "float32" else cases(name)[:1]:
            if not accepts(name, dtype, case):
                continue
            jits = (False, True) if FULL or dt in SAMPLE_JIT_DTYPES else (False,)
            # the special set holds ordinary values too (every 4th entry); the ordinary set alone: full runs
            value_sets = ("special", "ordinary") if FULL else ("special",)
            if dtype.kind == "c" and o is not None and not o.complex_specials:
                value_sets = ("ordinary",)
            poisons = POISON if FULL else POISON[:1]
            for jit in jits:
                for values in value_sets if jit is False or FULL else value_sets[:1]:
                    yield dtype, values, "full", None, jit, False, case
                    for poison in poisons:
                        yield dtype, values, "partial", poison, jit, False, case
            if spec.family == "binary" and (FULL or dt in SAMPLE_JIT_DTYPES) and scalar_accepted(name, dtype, case):
                yield dtype, "special", "full", None, False, True, case


@quiet
def scalar_accepted(name, dtype, case):
    ops = operands(name, dtype, "ordinary", full=True, scalar=True)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            jax.block_until_ready(call(name, jnp_fn(name), _plain(ops), case))
    except Exception:  # noqa: BLE001 (jnp refuses a scalar operand: any error)
        return False
    return True


def check_oracle(name):
    """The op against jnp over its plan; every failure is collected, then reported together."""
    refused = REGISTRY[name].refused_dtypes
    failures, n = [], 0
    for dtype, values, mask, poison, jit, scalar, case in plan(name):
        if str(dtype) in refused:
            continue
        n += 1
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                if mask == "full":
                    check_full(name, dtype, values, case, jit=jit, scalar=scalar)
                else:
                    check_partial(name, dtype, values, case, jit=jit, poison=poison)
        except Exception as err:  # noqa: BLE001 (collected and reported below)
            failures.append(f"{type(err).__name__}: {err}")
    assert not failures, f"{name}: {len(failures)} of {n} jnp-oracle cases fail:\n" + "\n".join(failures[:8])
    assert n, (
        f"{name}: the jnp-oracle check plans no case (jnp refuses every dtype of its operands): give it "
        "operands or a reference in conformance_table.ORACLE, or exclude it with a reason"
    )
    return n


# -- public functions beyond the registry (compositions, the Array API's own functions) --------------
def _nan_undefined(want):
    """nan* reductions: a slice with nothing left is masked where jnp gives NaN (or -1 for arg)."""
    w = np.asarray(want)
    if kind(w.dtype) in "iu":
        return w == -1
    with np.errstate(all="ignore"):
        return np.isnan(w.astype(np.complex128))


def _one(f):
    return lambda m, x, y: f(m, x)


_SORTED = lambda m, x: m.sort(x.ravel())
FUNCTIONS = {
    **{
        f"nan{r}": (_one(lambda m, x, r=r: getattr(m, f"nan{r}")(x, axis=1)), _nan_undefined)
        for r in ("sum", "mean", "max", "min", "prod", "std", "var", "argmax", "argmin", "median")
    },
    "nancumsum": (_one(lambda m, x: m.nancumsum(x, axis=1)), None),
    "nancumprod": (_one(lambda m, x: m.nancumprod(x, axis=1)), None),
    "nanquantile": (_one(lambda m, x: m.nanquantile(x, 0.3, axis=1)), _nan_undefined),
    "nanpercentile": (_one(lambda m, x: m.nanpercentile(x, 30.0, axis=1)), _nan_undefined),
    "cumulative_sum": (_one(lambda m, x: m.cumulative_sum(x, axis=1)), None),
    "cumulative_prod": (_one(lambda m, x: m.cumulative_prod(x, axis=0)), None),
    "count_nonzero": (_one(lambda m, x: m.count_nonzero(x, axis=1)), None),
    "diff": (_one(lambda m, x: m.diff(x, axis=1)), None),
    "trace": (_one(lambda m, x: m.trace(x)), None),
    "diagonal": (_one(lambda m, x: m.diagonal(x, 1)), None),
    "matrix_transpose": (_one(lambda m, x: m.matrix_transpose(x)), None),
    "tril": (_one(lambda m, x: m.tril(x)), None),
    "triu": (_one(lambda m, x: m.triu(x, 1)), None),
    "unstack": (_one(lambda m, x: m.unstack(x, axis=1)), None),
    "array_split": (_one(lambda m, x: m.array_split(x, 3)), None),
    "hsplit": (_one(lambda m, x: m.hsplit(x, 3)), None),
    "vsplit": (_one(lambda m, x: m.vsplit(x, 2)), None),
    "dsplit": (lambda m, x, y: m.dsplit(m.stack([x, y], axis=-1), 2), None),
    "vecdot": (lambda m, x, y: m.vecdot(x, y), None),
    "cross": (lambda m, x, y: m.cross(x, y), None),
    "hstack": (lambda m, x, y: m.hstack([x, y]), None),
    "vstack": (lambda m, x, y: m.vstack([x, y]), None),
    "dstack": (lambda m, x, y: m.dstack([x, y]), None),
    "column_stack": (lambda m, x, y: m.column_stack([x, y]), None),
    "broadcast_arrays": (lambda m, x, y: m.broadcast_arrays(x, y[:1]), None),
    "isin": (lambda m, x, y: m.isin(x, y), None),
    "searchsorted": (lambda m, x, y: m.searchsorted(_SORTED(m, x), y), None),
    "digitize": (lambda m, x, y: m.digitize(y, _SORTED(m, x)), None),
    "convolve": (lambda m, x, y: m.convolve(x[0], y[1]), None),
    "correlate": (lambda m, x, y: m.correlate(x[0], y[1], mode="full"), None),
    "unique_values": (_one(lambda m, x: m.unique_values(x)), None),
    "unique_counts": (_one(lambda m, x: tuple(m.unique_counts(x))), None),
    "unique_inverse": (_one(lambda m, x: tuple(m.unique_inverse(x))), None),
    "unique_all": (_one(lambda m, x: tuple(m.unique_all(x))), None),
    "unique": (_one(lambda m, x: m.unique(x)), None),
    "nonzero": (_one(lambda m, x: m.nonzero(x)), None),
    "bincount": (_one(lambda m, x: m.bincount(x.ravel(), length=4)), None),
    "histogram": (_one(lambda m, x: m.histogram(x, bins=3, range=(-2.0, 2.0))), None),
    "interp": (lambda m, x, y: m.interp(x[0], _SORTED(m, y), m.arange(12.0)), None),
    "vector_norm": (_one(lambda m, x: m.linalg.vector_norm(x, axis=1)), None),
    "matrix_norm": (_one(lambda m, x: m.linalg.matrix_norm(x)), None),
    "one_hot": (lambda m, x, y: (mj.nn if m is not jnp else jax.nn).one_hot(x, 5), None),
    "dot_product_attention": (  # (B, T, N, H) = (1, 3, 2, 2); masked cases: tests/test_nn.py
        lambda m, x, y: (mj.nn if m is not jnp else jax.nn).dot_product_attention(
            x.reshape(1, 3, 2, 2), y.reshape(1, 3, 2, 2), x.reshape(1, 3, 2, 2), is_causal=True
        ),
        None,
    ),
    "zeros_like": (_one(lambda m, x: m.zeros_like(x)), None),
    "ones_like": (_one(lambda m, x: m.ones_like(x)), None),
    "full_like": (_one(lambda m, x: m.full_like(x, 2)), None),
    "asarray": (_one(lambda m, x: m.asarray(x)), None),
    "meshgrid": (lambda m, x, y: m.meshgrid(x[0], y[:, 0]), None),
    "diag": (_one(lambda m, x: (m.diag(x[0], 1), m.diag(x, -1))), None),
    "diagflat": (_one(lambda m, x: m.diagflat(x[:2])), None),
    "append": (lambda m, x, y: (m.append(x, y), m.append(x, y[:1], axis=0)), None),
    "select": (lambda m, x, y: m.select([x == y, x != x[0]], [x, y], default=x[1]), None),
    "allclose": (lambda m, x, y: m.allclose(x, x + y * 0), None),
    "matvec": (lambda m, x, y: m.matvec(x, y[0]), None),
    "vecmat": (lambda m, x, y: m.vecmat(y[:, 0], x), None),
    "kron": (lambda m, x, y: m.kron(x, y[:2, :2]), None),
    "ediff1d": (_one(lambda m, x: m.ediff1d(x, to_begin=x[0, :1])), None),
    "argwhere": (_one(lambda m, x: m.argwhere(x, size=12, fill_value=-1)), None),
    "flatnonzero": (_one(lambda m, x: m.flatnonzero(x, size=12, fill_value=-1)), None),
    "copy": (_one(lambda m, x: m.copy(x)), None),
    "shape": (_one(lambda m, x: m.asarray(m.shape(x))), None),
    "ndim": (_one(lambda m, x: m.asarray(m.ndim(x))), None),
    "size": (_one(lambda m, x: m.asarray([m.size(x), m.size(x, -1)])), None),
}
# Functions of no array operand (creation, dtype queries), compared once, with their dtypes.
CREATION = {
    "zeros": lambda m: m.zeros((2, 3), dtype=jnp.int16),
    "ones": lambda m: m.ones(4),
    "full": lambda m: m.full((2,), 7, dtype=jnp.uint8),
    "eye": lambda m: m.eye(3, k=1),
    "arange": lambda m: m.arange(1, 10, 3),
    "linspace": lambda m: m.linspace(0.0, 1.0, 5),
    "empty": lambda m: m.empty((2, 2)).shape,
    "empty_like": lambda m: m.empty_like(m.ones(3)).shape,
    "can_cast": lambda m: m.can_cast(jnp.int8, jnp.float16),
    "result_type": lambda m: m.result_type(jnp.int8, jnp.uint8),
    "isdtype": lambda m: m.isdtype(jnp.float32, "real floating"),
    "finfo": lambda m: m.finfo(jnp.bfloat16).eps,
    "iinfo": lambda m: m.iinfo(jnp.uint16).max,
    "from_dlpack": lambda m: m.from_dlpack(np.arange(3.0)),
}
# Functions checked eagerly only, and why.
EAGER_ONLY = {
    **{
        n: "its output size depends on the data (concrete arrays only, as in jnp)"
        for n in (
            "unique",
            "unique_values",
            "unique_counts",
            "unique_inverse",
            "unique_all",
            "nonzero",
            "bincount",
            "histogram",
        )
    },
    "digitize": "its bins must be concretely fully valid (a masked bin edge has no position)",
}
# Public callables the tables above leave out, and why.
NOT_ORACLE = {
    "masked_array": "builds a masked array from data and a mask: jnp has no counterpart",
    "as_masked": "wraps an array as a fully valid masked array: jnp has no counterpart",
}
# jnp refuses these inputs; the masked function is fed what jnp takes (values by dtype kind).
NEEDS = {
    "bincount": "iu",
    "one_hot": "iu",
    "dot_product_attention": "f",
    "histogram": "f",
    "interp": "f",
    "cross": "iuf",
    "digitize": "iuf",
    "searchsorted": "biuf",
    "isin": "biuf",
}


@quiet
def check_function(name, dtype, values, jit=False):
    """Public function ``name`` on fully valid operands equals jnp's, bit for bit (or within the
    rounding bound for sums); NaN-family functions may mask what jnp computes as NaN."""
    call_, undefined = FUNCTIONS[name]
    x = draw(dtype, values, np.ones(SHAPE, bool), (-3.0, 3.0), seed=1)
    y = draw(dtype, values, np.ones(SHAPE, bool), (-3.0, 3.0), seed=2)
    if name in ("bincount", "one_hot"):
        x = mj.as_masked(jnp.asarray(np.abs(np.asarray(x.data).astype(np.int64)) % 4, x.dtype))  # jnp.abs: no int4
    if name == "interp":
        x = mj.as_masked(jnp.where(jnp.isfinite(x.data), x.data, 0.5))
    try:
        want = call_(jnp, x.data, y.data)
        if jit:  # (XLA:CPU compiles no float16 dot with a float32 result, which eager jnp avoids)
            jax.jit(lambda a, b: call_(jnp, a, b))(x.data, y.data)
    except Exception:  # noqa: BLE001 (jnp refuses this dtype: so may the masked function)
        return False
    if name in ("unique", "unique_values", "unique_counts", "unique_inverse", "unique_all", "nonzero"):
        got = call_(mnp_module(), x, y)
    else:
        f = lambda a, b: call_(mnp_module(), a, b)
        got = jax.jit(f)(x, y) if jit else f(x, y)
    rounding = name in (
        "nansum",
        "nanmean",
        "nanstd",
        "nanvar",
        "nanprod",
        "nancumsum",
        "nancumprod",
        "vecdot",
        "matvec",
        "vecmat",
        "trace",
        "cumulative_sum",
        "cumulative_prod",
        "vector_norm",
        "matrix_norm",
        "convolve",
        "correlate",
        "interp",
        "nanquantile",
        "nanpercentile",
        "nanmedian",
    )
    g_leaves, w_leaves = _leaves(got), _leaves(want)
    assert len(g_leaves) == len(w_leaves), f"{name}: {len(g_leaves)} outputs, jnp gives {len(w_leaves)}"
    for k, ((gd, gm), (wd, _)) in enumerate(zip(g_leaves, w_leaves)):
        valid = None
        if undefined is not None and gm is not None:  # masked where jnp's value is undefined: accepted
            valid = np.asarray(jnp.broadcast_to(gm, gd.shape)) | ~undefined(wd)
        scale = _scale([x, y])
        bound = (scale * x.size, x.size) if rounding else None
        assert_equal_to_jnp(
            MaskedArrayLike(gd, gm),
            wd,
            f"{name}({np_dtype(dtype)}, {values}{', jit' if jit else ''}) [output {k}]",
            valid=valid,
            order_bound=bound,
            ulps=(JIT_ULPS, scale) if jit else 0,
        )
    return True


class MaskedArrayLike(mj.MaskedArray):
    """One output leaf of a masked function, as a masked array for the comparison."""

    def __init__(self, data, mask):  # no validation: a result already
        self._data, self._mask = data, (jnp.ones(jnp.shape(data), bool) if mask is None else mask)


def mnp_module():
    import masked_jax.numpy as mnp

    return mnp


# (function, dtype) pairs where jnp's result is no reference, and why (docs/semantics.md lists them)
_NAN_TO_NO_INF = (
    "jnp replaces NaN by -inf (+inf), which float8_e4m3fn does not hold: the cast gives NaN again, "
    "so jnp returns the index of a NaN"
)
_COMPLEX_DOT = (
    "jnp's complex dot forms its real and imaginary parts as sums of real products, so a valid ±max "
    "entry overflows there to inf - inf = NaN, where the masked contraction, summing the complex "
    "terms by parts as jnp.sum(x * v) does, gives the signed infinity"
)
FUNCTION_SKIPS = {
    ("nanargmax", "float8_e4m3fn"): _NAN_TO_NO_INF,
    ("nanargmin", "float8_e4m3fn"): _NAN_TO_NO_INF,
    **{(n, d): _COMPLEX_DOT for n in ("matvec", "vecmat") for d in ("complex64", "complex128")},
    ("searchsorted", "float8_e5m2"): "jnp places a NaN query after the NaN entries of a float8_e5m2 "
    "array (before them for every other float type, as numpy)",
}


def function_dtypes(name):
    kinds = NEEDS.get(name, "biufc")
    return [
        np_dtype(d)
        for d in (DTYPES if FULL else SAMPLE_DTYPES)
        if kind(np_dtype(d)) in kinds and (name, d) not in FUNCTION_SKIPS
    ]
