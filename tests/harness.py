"""The conformance harness: every registered op, from one args-maker, through every check.

Built the way ``jax.experimental.sparse``'s ``test_util`` is: one args-maker per op (its row in
``conformance_table``), and checks that each take an op and assert one property:

* ``reference``: values and masks against ``numpy.ma`` (or the row's documented reference), for
  every dtype of the row;
* ``oracle``: ``jax.numpy`` itself as the oracle (``tests/oracle.py``): every dtype jnp accepts,
  special values (±0, ±inf, NaN, extremes) as valid entries, NaN/inf under the mask; with a full
  mask bit for bit (dtype and weak type too), with a partial mask jnp on each slice's valid
  entries alone;
* ``transforms``: eager, ``jit`` (no retrace when only mask values change), ``vmap`` and ``scan``
  give the same values and masks;
* ``jacobians``: ``mj.jacfwd`` and ``mj.jacrev`` agree, equal central differences on the valid
  entries, and are exactly zero (and masked) at masked inputs and outputs;
* ``poison``: NaN, +inf and -inf under the mask change no valid value and no gradient;
* ``layouts``: BCOO (flat, batched, hybrid, with duplicates) and row-sparse (with duplicates),
  each with NaN/inf in padding slots and negative padding indices, give the dense-layout result,
  eager, under ``jit`` and under ``vmap`` (a batch of each layout in, its results out), and the
  same gradients per stored slot (exact zeros at padding). ``make test`` samples: eagerly three
  layouts per op (the two with duplicates and poisoned padding, and one more in turn), under
  ``jit`` every layout for the first case and those two for the others; ``make test-full`` runs all.
  Operands with a zero-size axis (no rows; rows of no entries) too, eagerly, in the same layouts;
* ``compact``: masks stored compact ((n, 1) for whole rows, (1, m) for whole columns) give the
  full-mask results and gradients, eager and under ``jit``; operands without a mask (statically
  valid) give the results of all-True masks;
* ``maskify``: ``mj.maskify`` of the plain jax function equals the op, eager and under ``jit``,
  and so does the function as the body of a ``lax.scan`` with missing steps (every input of the
  step masked), forward and reversed, under ``jit``: the carry skips them and their outputs are
  masked.

An op is left out of a check only by its registry entry (``OpSpec.excluded``, with the reason).
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import oracle
from conformance_table import ROWS
from jax.extend import core as jcore

import masked_jax as mj
import masked_jax.numpy as mnp
from masked_jax._validate import dtype_kind
from masked_jax.layouts import BCOOMaskedArray, RowSparseArray, SparseMasked, rows_from_parts
from masked_jax.numpy import _frontend
from masked_jax.ops import REGISTRY
from masked_jax.ops._base import normalize_axis
from masked_jax.ops.reductions import empty_slices, identity_over_empty

MASK_A = np.array([[1, 0, 1], [1, 1, 1], [0, 0, 0], [0, 1, 1]], bool)  # partial, full and empty rows
MASK_B = np.array([[1, 1, 0], [0, 1, 1], [1, 0, 1], [1, 1, 1]], bool)
ROWS_A = np.repeat(np.array([1, 0, 1, 1], bool)[:, None], 3, 1)  # whole rows: every layout holds it
ROWS_B = np.repeat(np.array([1, 1, 0, 1], bool)[:, None], 3, 1)
COLS_A = np.repeat(np.array([[1, 0, 1]], bool), 4, 0)  # whole columns: a (1, 3) compact mask
COLS_B = np.repeat(np.array([[1, 1, 0]], bool), 4, 0)
LAYOUTS = ("bcoo", "bcoo_dup", "bcoo_batch", "bcoo_hybrid", "rows", "rows_dup")
POISONS = (np.nan, np.inf, -np.inf)
VMAP_LAYOUTS = ("bcoo_dup", "rows_dup")  # vmapped in and out: duplicates and poisoned padding, both kinds
# `make test` vmaps the layouts of every reduction, normalization and contraction (the segment kernels
# and batched rules) and of a sample of the other ops (VMAP_SAMPLE); `make test-full` (MJ_ORACLE=full)
# of every op.
VMAP_FAMILIES = ("reductions", "normalization", "linalg")


# Ops of the other families share one batching path per family: `make test` vmaps a sample of them.
VMAP_SAMPLE = ("exp", "gelu", "add", "where", "clip", "sort", "take", "concatenate", "reshape")


LAYOUT_CORE = ("sum", "mean", "var", "max", "argmax", "softmax", "logsumexp", "quantile", "cumsum", "matmul")


def in_sample(name, check):
    """Whether ``make test`` runs ``check`` on ``name``: every check of every op, except ``layouts``
    and ``compact`` of the elementwise and binary ops, whose stored values and compact masks all go
    through one rule per family (every fourth of them, and those of VMAP_SAMPLE), and ``layouts`` of
    the other families, whose ops share their family's segment kernels and batched rules (every
    fourth of them, another fourth than the elementwise ops', and those of VMAP_SAMPLE and
    LAYOUT_CORE); ``make test-full`` runs all."""
    if oracle.FULL or check not in ("layouts", "compact") or name in VMAP_SAMPLE:
        return True
    index = sorted(REGISTRY).index(name)
    if REGISTRY[name].family in ("elementwise", "binary"):
        return index % 4 == 0
    return check == "compact" or name in LAYOUT_CORE or index % 4 == 1


def in_quick_sample(name, check):
    """Whether ``make test`` (the test loop) runs a case of :func:`in_sample`: all of them but half
    of the sampled ``layouts`` and ``compact`` checks (every eighth op instead of every fourth, the
    named samples kept); ``make test-slow`` runs the other half, so that CI runs all of
    :func:`in_sample`."""
    if oracle.FULL or check not in ("layouts", "compact") or name in VMAP_SAMPLE or name in LAYOUT_CORE:
        return True
    index = sorted(REGISTRY).index(name)
    if REGISTRY[name].family in ("elementwise", "binary"):
        return index % 8 == 0
    return check == "compact" and index % 2 == 0 or index % 8 == 1


def vmaps_layouts(name):
    spec = REGISTRY[name]
    return oracle.FULL or spec.family in VMAP_FAMILIES or name in VMAP_SAMPLE


def masked(rng, dtype, mask, domain, poison=np.nan):
    """A MaskedArray of ``mask``'s shape with values in ``domain`` and ``poison`` under the mask."""
    dtype = np.dtype(dtype)
    shape = np.shape(mask)
    if dtype == np.bool_:
        data = rng.random(shape) > 0.5
        data[~mask] = True
    elif dtype_kind(dtype) in "iu":
        lo, hi = domain
        data = rng.integers(int(np.ceil(lo)), int(np.floor(hi)) + 1, shape).astype(dtype)
        data[~mask] = 7
    else:
        data = rng.uniform(*domain, shape).astype(dtype)
        data[~mask] = poison
    return mj.masked_array(jnp.asarray(data), jnp.asarray(mask))


def operands(name, dtype, masks=(MASK_A, MASK_B), seed=0):
    """The op's operands (its row's ``make``, or its family's default), NaN under the masks."""
    spec, row = REGISTRY[name], ROWS[name]
    rng = np.random.default_rng(seed)
    if row.make is not None:
        return row.make(rng, dtype, masks)
    domain = lambda i: row.domain[min(i, len(row.domain) - 1)]
    n = 2 if spec.family == "binary" else 1
    return [masked(rng, dtype, masks[i], domain(i)) for i in range(n)]


def call(name, fn, ops, case):
    row = ROWS[name]
    return row.call(fn, list(ops), **case) if row.call is not None else fn(*ops, **case)


def public(name):
    return _frontend.function(name)


def repoison(ops, value):
    """``ops`` with every float MaskedArray's masked-out data replaced by ``value``."""

    def one(o):
        if isinstance(o, mj.MaskedArray) and jnp.issubdtype(o.dtype, jnp.floating):
            return mj.masked_array(jnp.where(o.mask, o.data, jnp.asarray(value, o.dtype)), o.mask)
        return o

    return [one(o) for o in ops]


# -- comparing results -----------------------------------------------------------------------------
def _dense(x):
    return x.todense() if isinstance(x, SparseMasked) else x


class Pairs(list):
    """A result already as ``(data, valid)`` numpy pairs."""


def as_pairs(out) -> Pairs:
    """A result (masked array in any layout, plain array, or a list of them) as ``(data, valid)`` pairs."""
    if isinstance(out, Pairs):
        return out
    if isinstance(out, (list, tuple)):
        return Pairs(p for o in out for p in as_pairs(o))
    out = _dense(out)
    if isinstance(out, mj.MaskedArray):
        return Pairs([(np.asarray(out.data), np.asarray(out.mask))])
    arr = np.asarray(out)
    return Pairs([(arr, np.ones(arr.shape, bool))])


def ref_pairs(ref) -> Pairs:
    """A reference result (numpy.ma array, ``(data, valid)``, list of them, or plain array) as pairs."""
    if isinstance(ref, np.ma.MaskedArray):
        return Pairs([(np.ma.getdata(ref), ~np.ma.getmaskarray(ref))])
    if isinstance(ref, tuple) and len(ref) == 2 and isinstance(ref[0], list):  # split: (datas, masks)
        return Pairs((np.asarray(d), np.asarray(v, bool)) for d, v in zip(*ref))
    if isinstance(ref, tuple) and len(ref) == 2:
        return Pairs([(np.asarray(ref[0]), np.asarray(ref[1], bool))])
    if isinstance(ref, list):
        return Pairs(p for r in ref for p in ref_pairs(r))
    arr = np.asarray(ref)
    return Pairs([(arr, np.ones(arr.shape, bool))])


def assert_same(got, want, rtol=1e-9, what=""):
    """Same masks, and the same data on valid entries (NaN matching NaN)."""
    got, want = as_pairs(got), as_pairs(want)
    assert len(got) == len(want), f"{what}: {len(got)} outputs against {len(want)}"
    for (gd, gv), (wd, wv) in zip(got, want):
        wv = np.broadcast_to(wv, np.shape(wd))
        assert np.shape(gd) == np.shape(wd), f"{what}: shape {np.shape(gd)} against {np.shape(wd)}"
        np.testing.assert_array_equal(np.broadcast_to(gv, np.shape(gd)), wv, err_msg=f"{what}: mask differs")
        g, w = np.where(wv, gd, 0), np.where(wv, wd, 0)
        if jnp.issubdtype(g.dtype, jnp.inexact) or jnp.issubdtype(w.dtype, jnp.inexact):
            real = np.complex128 if np.iscomplexobj(g) or np.iscomplexobj(w) else np.float64
            np.testing.assert_allclose(
                g.astype(real), w.astype(real), rtol=rtol, atol=rtol, equal_nan=True, err_msg=f"{what}: data differs"
            )
        else:
            np.testing.assert_array_equal(g, w, err_msg=f"{what}: data differs")


def _stack(trees):
    return jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *trees)


def _index(tree, i):
    return jax.tree_util.tree_map(lambda x: x[i], tree)


def _float_out(out):
    """Whether every output (a masked array, plain array or a list of them) has float data."""
    outs = out if isinstance(out, (list, tuple)) else [out]
    datas = [_dense(o).data if isinstance(_dense(o), mj.MaskedArray) else o for o in outs]
    return bool(datas) and all(jnp.issubdtype(jnp.result_type(d), jnp.floating) for d in datas)


# -- the checks -----------------------------------------------------------------------------------
def check_reference(name):
    row = ROWS[name]
    for dtype in row.dtypes:
        ops = operands(name, dtype)
        for case in row.cases:
            got = call(name, public(name), ops, case)
            ref = row.ref(*[o.to_numpy_ma() if isinstance(o, mj.MaskedArray) else o for o in ops], **case)
            tol = row.rtol if np.dtype(dtype) == np.float64 else 1e-6
            # NaN from masked-out values in a valid output fails here: NaN matches only NaN.
            assert_same(got, ref_pairs(ref), rtol=tol, what=f"{name}({dtype.__name__}, {case})")


def check_transforms(name):
    row = ROWS[name]
    dtype = row.dtypes[0]
    ops, ops2 = operands(name, dtype), operands(name, dtype, masks=(MASK_B, MASK_A))
    for case in row.cases:
        f = lambda *o, case=case: call(name, public(name), o, case)
        eager, eager2 = f(*ops), f(*ops2)
        traces = []

        def counted(*o, f=f, traces=traces):
            traces.append(1)
            return f(*o)

        jf = jax.jit(counted)
        assert_same(jf(*ops), eager, row.rtol, f"{name} jit")
        assert_same(jf(*ops2), eager2, row.rtol, f"{name} jit, other masks")
        assert len(traces) == 1, f"{name}: jit retraced when only mask values changed"
        batch = _stack([ops, ops2])
        vm, sc = jax.jit(lambda b, f=f: (jax.vmap(f)(*b), jax.lax.scan(lambda c, o: (c, f(*o)), 0, b)[1]))(batch)
        for i, want in enumerate((eager, eager2)):
            assert_same(_index(vm, i), want, row.rtol, f"{name} vmap[{i}]")
            assert_same(_index(sc, i), want, row.rtol, f"{name} scan[{i}]")


def diff_position(ops):
    """The operand differentiated: the first float MaskedArray (``where``'s is its ``x``)."""
    return next(i for i, o in enumerate(ops) if isinstance(o, mj.MaskedArray) and jnp.issubdtype(o.dtype, jnp.floating))


def _replace(ops, i, v):
    return [v if j == i else o for j, o in enumerate(ops)]


def check_jacobians(name):
    row = ROWS[name]
    dtype = row.dtypes[0]
    ops = operands(name, dtype)
    pos = diff_position(ops)
    x = ops[pos]
    for case in row.cases:
        whole = lambda v, case=case: call(name, public(name), _replace(ops, pos, v), case)
        for k in range(len(_parts(whole(x)))):  # each result of a multi-result op (modf) in turn
            _check_jacobian_of(name, lambda v, k=k, whole=whole: _parts(whole(v))[k], x, row, case)


def _parts(out):
    """The results of an op: a list of its results (one, or each of a pair or list)."""
    return list(out) if isinstance(out, (list, tuple)) else [out]


def _check_jacobian_of(name, g, x, row, case):
    """``mj.jacfwd``/``mj.jacrev`` of ``g`` at ``x``: masked where input or output is, finite, equal
    to each other and (``row.smooth``) to central differences on the valid entries."""
    out = g(x)
    jf, jr = jax.jit(lambda v: (mj.jacfwd(g)(v), mj.jacrev(g)(v)))(x)
    out_mask = np.asarray(_dense(out).mask)
    want_mask = out_mask.reshape(out_mask.shape + (1,) * x.ndim) & np.asarray(x.mask)
    for jac, mode in ((jf, "jacfwd"), (jr, "jacrev")):
        np.testing.assert_array_equal(np.asarray(jac.mask), want_mask, err_msg=f"{name} {mode} mask")
        d = np.asarray(jac.data)
        assert np.all(d[~want_mask] == 0), f"{name} {mode}: nonzero entries where masked"
        assert np.all(np.isfinite(d)), f"{name} {mode}: NaN/inf in the Jacobian"
    np.testing.assert_allclose(
        np.asarray(jf.data), np.asarray(jr.data), rtol=1e-9, atol=1e-12, err_msg=f"{name}: jacfwd != jacrev"
    )
    if not row.smooth:
        return
    eps = 1e-6
    idx = np.flatnonzero(np.asarray(x.mask))
    base = np.asarray(x.data)

    def filled(d):
        return _dense(g(mj.masked_array(d, x.mask))).filled(0)

    steps = np.zeros((len(idx),) + base.shape)
    steps.reshape(len(idx), -1)[np.arange(len(idx)), idx] = eps
    plus, minus = jax.jit(jax.vmap(filled))(jnp.asarray(np.concatenate([base + steps, base - steps]))).reshape(
        (2, len(idx)) + out_mask.shape
    )
    num = np.moveaxis(np.asarray((plus - minus) / (2 * eps)), 0, -1)  # out..., k
    an = np.asarray(jf.data).reshape(out_mask.shape + (-1,))[..., idx]
    num = np.where(out_mask[..., None], num, 0)
    np.testing.assert_allclose(
        an, num, rtol=1e-5, atol=1e-6, err_msg=f"{name} ({case}): Jacobian != central differences on valid entries"
    )


def _loss(name, case, ops, out_shapes, pos):
    """``v -> sum(op(..., v, ...) * w)`` for a fixed random ``w``, ``v`` at position ``pos`` (summed
    over the results of a multi-result op; ``out_shapes``: the results' shapes)."""
    rng = np.random.default_rng(7)
    ws = [jnp.asarray(rng.uniform(0.5, 1.5, shape)) for shape in out_shapes]

    def loss(v):
        outs = _parts(call(name, public(name), _replace(ops, pos, v), case))
        return sum(mnp.sum(mnp.multiply(_dense(out), w)) for out, w in zip(outs, ws))

    return loss


def check_poison(name):
    """NaN, +inf and -inf under the mask: the values and the gradient equal those with a finite fill
    (one jitted function of the operands, called with each poison: the same program every time)."""
    spec, row = REGISTRY[name], ROWS[name]
    dtype = row.dtypes[0]
    clean = repoison(operands(name, dtype), 0.5)
    for case in row.cases:
        want = call(name, public(name), clean, case)
        grads = "jacobians" not in spec.excluded and _float_out(want)
        pos = diff_position(clean) if grads else None
        shape = [np.shape(_dense(p).data) for p in _parts(want)] if grads else None

        def run(*o, case=case, shape=shape, pos=pos, grads=grads):
            out = call(name, public(name), o, case)
            return (out, mj.grad(_loss(name, case, list(o), shape, pos))(o[pos])) if grads else (out, None)

        if case is row.cases[0]:  # eagerly too (values): the same answer as with a finite fill
            for poison in POISONS:
                assert_same(
                    call(name, public(name), repoison(clean, poison), case),
                    want,
                    row.rtol,
                    f"{name} eagerly with {poison} under the mask",
                )
        run = jax.jit(run)
        want, g_want = run(*clean)
        for poison in POISONS:
            got, g = run(*repoison(clean, poison))
            assert_same(got, want, row.rtol, f"{name} with {poison} under the mask")
            if grads:
                assert np.all(np.isfinite(np.asarray(g.data))), f"{name}: gradient not finite with {poison}"
                assert_same(g, g_want, 1e-12, f"{name} gradient with {poison} under the mask")


# -- sparse layouts with duplicates and poisoned padding -------------------------------------------
def _with_padding(x, data_pad, index_pad):
    leaves = jax.tree_util.tree_leaves(x)
    data, indices = leaves[0], leaves[1]
    axis = 0 if isinstance(x, RowSparseArray) else indices.ndim - 2
    data = jnp.concatenate([data, data_pad.astype(data.dtype)], axis=axis)
    indices = jnp.concatenate([indices, index_pad.astype(indices.dtype)], axis=axis)
    if isinstance(x, RowSparseArray):
        return rows_from_parts(x.shape, data, indices)
    return BCOOMaskedArray.tree_unflatten(x.shape, (data, indices))


def _bad(dtype, shape):
    """Poison for padding slots: NaN then +inf for floats, garbage for integers."""
    if jnp.issubdtype(dtype, jnp.floating):
        vals = np.array([np.nan, np.inf] * (shape[0] // 2 + 1))[: shape[0]]
        return jnp.asarray(np.broadcast_to(vals.reshape((-1,) + (1,) * (len(shape) - 1)), shape).astype(dtype))
    return jnp.full(shape, 7 if dtype != jnp.bool_ else True, dtype)


def layout(kind, x):
    """``x`` (2-D, whole rows valid) in sparse layout ``kind``, with NaN/inf padding slots at an
    index past the end and at a negative index (padding by the one index convention)."""
    n, m = x.shape
    dup = kind.endswith("_dup") and jnp.issubdtype(x.dtype, jnp.floating)
    if kind.startswith("rows"):
        r = RowSparseArray.from_masked(x)
        if dup:
            r = rows_from_parts(
                r.shape, jnp.concatenate([r.data * 0.25, r.data * 0.75]), jnp.concatenate([r.indices, r.indices])
            )
        return _with_padding(r, _bad(x.dtype, (2, m)), jnp.array([n, -1]))
    if kind == "bcoo_batch":
        b = BCOOMaskedArray.from_masked(x, nse=m + 1, n_batch=1)
        return BCOOMaskedArray.tree_unflatten(
            b.shape,
            (
                jnp.where(b.block().mask, b.data, _bad(x.dtype, b.data.shape)),
                jnp.where(b.entry_valid()[..., None], b.indices, -1),
            ),
        )
    if kind == "bcoo_hybrid":
        b = BCOOMaskedArray.from_masked(x, nse=n, n_dense=1)
        return _with_padding(b, _bad(x.dtype, (2, m)), jnp.array([[n], [-2]]))
    b = BCOOMaskedArray.from_masked(x)
    if dup:
        b = BCOOMaskedArray.tree_unflatten(
            b.shape, (jnp.concatenate([b.data * 0.5, b.data * 0.5]), jnp.concatenate([b.indices, b.indices]))
        )
    return _with_padding(b, _bad(x.dtype, (2,)), jnp.array([[n, 0], [-1, 1]]))


def eager_layouts(name):
    if oracle.FULL:
        return LAYOUTS
    others = [k for k in LAYOUTS if k not in VMAP_LAYOUTS]
    return VMAP_LAYOUTS + (others[sorted(REGISTRY).index(name) % len(others)],)


def slot_values(lay, dense):
    """``dense`` read at every stored slot of ``lay`` that holds the first stored copy of its entry
    (later duplicates and padding slots: 0), as a gradient is kept: read as an array, it is then
    the dense gradient once."""
    dense = jnp.asarray(dense)
    mask = lay.block().mask
    first = lay.first_copies()
    mask = mask & jnp.reshape(first, first.shape + (1,) * (np.ndim(mask) - first.ndim))
    if isinstance(lay, RowSparseArray):
        return jnp.where(mask, jnp.take(dense, lay.clean_indices(), axis=0, mode="fill", fill_value=0), 0)
    idx = lay.clean_indices()  # (batch..., nse, n_sparse); duplicates each read the element
    batch = [jax.lax.broadcasted_iota(jnp.int32, idx.shape[:-1], d) for d in range(lay.n_batch)]
    coords = tuple(batch) + tuple(idx[..., j] for j in range(idx.shape[-1]))
    return jnp.where(mask, dense.at[coords].get(mode="fill", fill_value=0), 0)


def check_layouts(name):
    """Every layout against the dense result: eagerly (first case), under jit (every case, all
    layouts in one program), and the gradient per stored slot (all layouts in one program; eagerly
    too for the first case, on the layouts with duplicates)."""
    spec, row = REGISTRY[name], ROWS[name]
    dtype = row.dtypes[0]
    ops = operands(name, dtype, masks=(ROWS_A, ROWS_B))
    sparse_pos = [i for i, o in enumerate(ops) if isinstance(o, mj.MaskedArray)][: 2 if spec.family == "binary" else 1]
    lays = {kind: [layout(kind, o) if i in sparse_pos else o for i, o in enumerate(ops)] for kind in LAYOUTS}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", mj.StorageFallbackWarning)
        for c, case in enumerate(row.cases):
            want = call(name, public(name), ops, case)
            if c == 0:  # eagerly: every layout in `make test-full`; in `make test` the layouts with duplicates
                # and poisoned padding and one more, in turn by op (under jit every layout runs, below)
                for kind in eager_layouts(name):
                    assert_same(
                        call(name, public(name), lays[kind], case), want, row.rtol, f"{name} on {kind} ({case})"
                    )
            grads = "jacobians" not in spec.excluded and _float_out(want)
            pos = diff_position(ops) if grads else None
            grads = grads and pos in sparse_pos
            shape = [np.shape(_dense(p).data) for p in _parts(want)] if grads else None

            def values_and_grads(
                ls, case=case, shape=shape, pos=pos, grads=grads
            ):  # every layout, values and gradients: one program
                vals = {k: call(name, public(name), v, case) for k, v in ls.items()}
                return vals, {
                    k: mj.grad(_loss(name, case, v, shape, pos))(v[pos]) for k, v in ls.items()
                } if grads else {}

            # every layout in the first case's program; later cases (other axes, parameters) run the
            # layouts with duplicates and poisoned padding in `make test`, every layout in `make test-full`
            case_lays = lays if c == 0 or oracle.FULL else {k: lays[k] for k in VMAP_LAYOUTS}
            jitted, g_all = jax.jit(values_and_grads)(case_lays)
            for kind, got in jitted.items():
                assert_same(got, want, row.rtol, f"{name} on {kind} under jit ({case})")
            if c == 0 and vmaps_layouts(name):  # vmap over a batch of a layout (in), its layout out: one program
                batched = jax.jit(
                    jax.vmap(lambda ls, case=case: {k: call(name, public(name), v, case) for k, v in ls.items()})
                )(_stack([{k: lays[k] for k in VMAP_LAYOUTS}] * 2))
                for kind, got in batched.items():
                    for i in range(2):
                        assert_same(_index(got, i), want, row.rtol, f"{name} on {kind} under vmap[{i}] ({case})")
            if not grads:
                continue
            g_want = mj.grad(_loss(name, case, ops, shape, pos))(ops[pos])
            if c == 0:  # eagerly too, on the layouts with duplicates and poisoned padding
                g_all = {
                    **g_all,
                    **{
                        f"{k} (eager)": mj.grad(_loss(name, case, lays[k], shape, pos))(lays[k][pos])
                        for k in ("bcoo_dup", "rows_dup")
                    },
                }
            for kind, g in g_all.items():
                lay = lays[kind.split(" ")[0]][pos]
                assert type(g) is type(lay), f"{name} on {kind}: gradient in {type(g).__name__}"
                gd = np.asarray(g.data)
                assert np.all(np.isfinite(gd)), f"{name} on {kind}: gradient not finite"
                np.testing.assert_allclose(
                    gd,
                    np.asarray(slot_values(lay, g_want.filled(0))),
                    rtol=1e-9,
                    atol=1e-12,
                    err_msg=f"{name} on {kind}: gradient per stored slot (0 at padding and later duplicates)",
                )
        _check_zero_size_layouts(name, spec, row, dtype)


ZERO_SIZE = ((0, 3), (4, 0))  # no rows; rows of no entries


def _check_zero_size_layouts(name, spec, row, dtype):
    """Operands with a zero-size axis in the sparse layouts (padding slots still poisoned) give the
    dense result, eagerly, for the shapes the op takes (those its dense call accepts)."""
    for shape in ZERO_SIZE:
        try:
            ops = operands(name, dtype, masks=(np.zeros(shape, bool),) * 2)
        except ValueError:  # the op's maker builds operands of fixed shapes (the contractions)
            continue
        if spec.family == "reductions":
            _check_reduction_of_nothing(name, spec, row, ops, shape)
        case = row.cases[0]
        try:
            want = call(name, public(name), ops, case)
        except (ValueError, TypeError, IndexError):  # the op refuses such shapes, densely too
            continue
        sparse_pos = [i for i, o in enumerate(ops) if isinstance(o, mj.MaskedArray)][
            : 2 if spec.family == "binary" else 1
        ]
        for kind in eager_layouts(name):
            lays = [layout(kind, o) if i in sparse_pos else o for i, o in enumerate(ops)]
            assert_same(call(name, public(name), lays, case), want, row.rtol, f"{name} on {kind}, shape {shape}")


def _check_reduction_of_nothing(name, spec, row, ops, shape):
    """The rule for a reduction over a slice with no element (every case of the op's row): where
    the reduction has an identity, jnp's value, valid (a sum 0, ``all`` True, ``logsumexp``
    ``-inf``, a norm 0); where it has none (a mean, a maximum, a median), masked, with no NaN."""
    x = ops[0]
    for case in row.cases:
        axes = normalize_axis(case.get("axis"), x.ndim)
        if not empty_slices(x.shape, axes) or row.call is not None:
            continue
        try:
            got = call(name, public(name), ops, case)
        except (ValueError, TypeError, IndexError):  # refused densely (jnp refuses it too)
            continue
        valid = np.asarray(got.mask) if isinstance(got, mj.MaskedArray) else np.ones(np.shape(got), bool)
        data = np.asarray(got.data if isinstance(got, mj.MaskedArray) else got)
        if identity_over_empty(name, case, x.ndim):
            assert valid.all(), f"{name}{case} over {shape}: the reduction of nothing is its identity, valid"
            ref = (  # jnp's function; a count (no jnp function) of nothing is 0
                spec.fn(x.data, **case)
                if spec.fn is not None
                else np.sum(np.ones(x.shape, np.int64), axis=axes, keepdims=case.get("keepdims", False))
            )
            np.testing.assert_array_equal(data, np.asarray(ref), err_msg=f"{name}{case}")
        else:
            assert not valid.any(), f"{name}{case} over {shape}: no identity, so masked"
            assert not np.isnan(data.astype(np.float64) if data.dtype.kind != "c" else data).any()


def compact_form(mask):
    """``mask`` at its compact shape: size 1 along every axis it does not vary along."""
    m = np.asarray(mask)
    for axis in range(m.ndim):
        if m.shape[axis] > 1 and (m == m.take([0], axis=axis)).all():
            m = m.take([0], axis=axis)
    return jnp.asarray(m)


def check_compact(name):
    """Compact masks as one more layout: the operands with whole rows valid (a (n, 1) mask) and with
    whole columns valid (a (1, m) mask) give the results and the gradients of the same operands with
    full masks, NaN under the mask; every case eagerly, the first case under ``jit`` too. Operands
    with no mask at all (statically valid) give the results of all-True full masks, every case
    eagerly and under ``jit``."""
    spec, row = REGISTRY[name], ROWS[name]
    dtype = row.dtypes[0]
    compact_seen = False
    for masks in ((ROWS_A, ROWS_B), (COLS_A, COLS_B)):
        ops = operands(name, dtype, masks=masks)
        small = [mj.masked_array(o.data, compact_form(o.mask)) if isinstance(o, mj.MaskedArray) else o for o in ops]
        compact_seen |= any(isinstance(o, mj.MaskedArray) and o.compact_mask.shape != o.shape for o in small)
        for c, case in enumerate(row.cases):
            want = call(name, public(name), ops, case)
            assert_same(call(name, public(name), small, case), want, row.rtol, f"{name} with compact masks ({case})")
            if c:
                continue
            assert_same(
                jax.jit(lambda o, case=case: call(name, public(name), o, case))(small),
                want,
                row.rtol,
                f"{name} with compact masks under jit ({case})",
            )
            if "jacobians" in spec.excluded or not _float_out(want):
                continue
            pos = diff_position(ops)
            shape = [np.shape(_dense(p).data) for p in _parts(want)]
            g_want = mj.grad(_loss(name, case, ops, shape, pos))(ops[pos])
            g = mj.grad(_loss(name, case, small, shape, pos))(small[pos])
            np.testing.assert_allclose(
                np.asarray(g.filled(0)),
                np.asarray(g_want.filled(0)),
                rtol=1e-9,
                atol=1e-12,
                err_msg=f"{name} with compact masks: gradient",
            )
    assert compact_seen, f"{name}: no operand of its row took a compact mask"
    # statically valid operands (no mask stored, compact_mask None) are the all-True full masks
    full = np.ones_like(MASK_A)
    ops = operands(name, dtype, masks=(full, full))
    bare = [mj.masked_array(o.data) if isinstance(o, mj.MaskedArray) else o for o in ops]
    assert any(isinstance(o, mj.MaskedArray) and o.compact_mask is None for o in bare), name
    for case in row.cases:
        want = call(name, public(name), ops, case)
        assert_same(
            call(name, public(name), bare, case), want, row.rtol, f"{name} with statically valid operands ({case})"
        )
        assert_same(
            jax.jit(lambda o, case=case: call(name, public(name), o, case))(bare),
            want,
            row.rtol,
            f"{name} with statically valid operands under jit ({case})",
        )


# ops whose result is a stored position or reads stored positions (a reversal, an argmax): under
# maskify's default they mean positions among the valid entries (tested against unpadded runs in
# tests/test_maskify_positions.py); against masked_jax.numpy, stored positions
POSITIONAL = frozenset(("argmax", "argmin", "flip", "fliplr", "flipud", "rot90", "argsort", "argpartition", "roll"))


def _maskify(name, fun):
    return mj.maskify(fun, positions="padded" if name in POSITIONAL else "unpadded")


def check_maskify(name):
    spec, row = REGISTRY[name], ROWS[name]
    fn = row.jax or spec.fn
    dtype = row.dtypes[0]
    ops = operands(name, dtype)
    for case in row.cases:
        want = call(name, public(name), ops, case)
        plain = _maskify(name, lambda *o, case=case: call(name, fn, o, case))
        assert_same(plain(*ops), want, row.rtol, f"maskify({name}) ({case})")
        assert_same(jax.jit(plain)(*ops), want, row.rtol, f"jit(maskify({name})) ({case})")
        _check_maskify_scan(name, fn, ops, operands(name, dtype, masks=(MASK_B, MASK_A)), case, row.rtol)


def _all_masked(ops):
    return [mj.masked_array(o.data, jnp.zeros(o.shape, bool)) if isinstance(o, mj.MaskedArray) else o for o in ops]


def _check_maskify_scan(name, fn, ops, ops2, case, rtol):
    """The op as the body of a ``lax.scan`` under ``maskify``, over steps ``ops``, a missing step
    (every masked operand fully masked), ``ops2``, a missing step. The steps hold one row each (a
    leading axis of 1), so a step is missing exactly when all its masked inputs are. A missing step
    leaves the carry as it was and masks its outputs: the outputs of the other steps are the op's,
    the final carry is the op of the last step that is not missing (forward: ``ops2``; with
    ``reverse=True``: ``ops``). Under ``jit`` (the check above runs the op eagerly too)."""
    if not any(isinstance(o, mj.MaskedArray) for o in ops):
        return
    steps = [ops, _all_masked(ops), ops2, _all_masked(ops2)]
    xs = _stack([[o[None] if hasattr(o, "shape") else o for o in step] for step in steps])
    on_data = lambda *o: call(name, fn, o, case)
    shapes = jax.eval_shape(on_data, *(o.data if isinstance(o, mj.MaskedArray) else o for o in ops))
    init = jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
    wants = [call(name, public(name), o, case) for o in (ops, ops2)]
    for reverse in (False, True):

        def scanned(*xs, reverse=reverse):
            def body(carry, x):
                y = call(name, fn, [v[0] for v in x], case)
                return y, y

            return jax.lax.scan(body, init, list(xs), reverse=reverse)

        for label, f in (("jit", jax.jit(_maskify(name, scanned))),):
            carry, ys = f(*xs)
            what = f"maskify({name}) in a scan with missing steps ({case}, {label}, reverse={reverse})"
            assert_same(carry, wants[0] if reverse else wants[1], rtol, f"{what}: final carry")
            for (yd, yv), (d0, v0), (d2, v2) in zip(as_pairs(ys), as_pairs(wants[0]), as_pairs(wants[1])):
                assert not np.any(yv[1]) and not np.any(yv[3]), f"{what}: a missing step's outputs are valid"
                assert_same(
                    Pairs([(yd[0], yv[0]), (yd[2], yv[2])]), Pairs([(d0, v0), (d2, v2)]), rtol, f"{what}: outputs"
                )


def check_oracle(name):
    return oracle.check_oracle(name)


CHECKS = {
    "reference": check_reference,
    "oracle": check_oracle,
    "transforms": check_transforms,
    "jacobians": check_jacobians,
    "poison": check_poison,
    "layouts": check_layouts,
    "compact": check_compact,
    "maskify": check_maskify,
}


def sub_jaxprs(params):
    """The jaxprs inside an equation's parameters (``jcore.jaxprs_in_params`` where jax has it)."""
    if hasattr(jcore, "jaxprs_in_params"):
        return list(jcore.jaxprs_in_params(params))
    out = []
    for value in params.values():
        for v in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(v, jcore.ClosedJaxpr):
                out.append(v.jaxpr)
            elif isinstance(v, jcore.Jaxpr):
                out.append(v)
    return out


def primitive_count(jaxpr, name, shape=None):
    """How many equations of primitive ``name`` (with an output of ``shape``, if given) a jaxpr runs,
    inner jaxprs included (a jitted ``jnp.where`` is printed once however often it is called)."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    return sum(
        int(e.primitive.name == name and (shape is None or tuple(e.outvars[0].aval.shape) == tuple(shape)))
        + sum(primitive_count(j, name, shape) for j in sub_jaxprs(e.params))
        for e in jaxpr.eqns
    )


def answer_cudnn_probes_as_an_h100(monkeypatch):
    """Let jax lower its cuDNN attention for CUDA with no GPU: its cuDNN version and
    compute-capability probes answer as an H100 with cuDNN 9.10 would; the lowering is jax's."""
    from jax._src.cudnn import fused_attention_stablehlo as cudnn

    monkeypatch.setattr(cudnn, "check_cudnn_version", lambda: 91000)
    monkeypatch.setattr(cudnn, "check_compute_capability", lambda capability: True)
    monkeypatch.setattr(cudnn, "is_cuda_compute_capability_equal", lambda capability: False)


def cuda_squares(text, length):
    """The ``length x length`` tensors in a lowered program's text."""
    import re

    return re.findall(rf"tensor<[^>]*{length}x{length}[^>]*>", text)


def backend_compiles(call):
    """``(call(), number of programs XLA compiled while it ran)``."""
    events = []
    listener = lambda event, duration, **kw: events.append(event)
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        out = call()
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    return out, sum(e == "/jax/core/compile/backend_compile_duration" for e in events)
