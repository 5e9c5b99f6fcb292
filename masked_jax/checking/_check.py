"""``check_jacobian``: finite differences against ``jax.jacfwd`` / ``jax.jacrev``, under dense and
masked semantics, as one jit-compiled XLA computation.

Dense semantics (``jax.experimental.sparse`` and gradcheck's default): an unspecified element
is 0. Every element is perturbed; perturbing an unspecified element makes it specified (a
masked element becomes valid, a sparse array gains an entry). The analytical Jacobian is taken
at the original pattern for masked layouts (specifying a masked-out element moves the point, so
a function with masked semantics fails here, as ``torch.sparse.mm`` does in PyTorch's gradcheck discussion) and at the fully
specified equivalent for a jax BCOO (whose unspecified elements are zeros). Outputs are compared
everywhere, unspecified outputs read as 0.

Masked semantics: an unspecified element does not exist. Only specified elements are
perturbed and only valid outputs compared, and the check also verifies that the function *has*
masked semantics, so that a function reading masked-out data cannot pass by accident:

* the data under an input's mask is replaced by random values (twice, differently), by the data
  the user passed and by zeros: the valid outputs and the output mask must not change (a function
  that finds its padding by a sentinel value, ``v.data != 0``, moves between them);
* leak probes: the data under every mask is set to NaN, +inf, -inf and a huge value in turn; the
  valid outputs, the output mask and the VJP to valid inputs must stay what they are at a
  finite fill, and the VJP to masked-out inputs must stay 0 (with ``modes=("fwd",)``, the JVP of
  valid outputs along valid inputs instead) (``jnp.where(m, log(x), 0)``, ``0 * x``
  and a stabiliser taken over masked-out data all fail here); a sparse input gets one padding
  slot holding the probe value too, so reading a sparse array's padding data fails as well;
* perturbing masked-out data must not change any valid output (numerical leak), where the masked
  tables are taken on their own (:func:`_shares_tables`);
* analytical Jacobian entries at masked-out inputs, and tangents of masked-out outputs, are 0.

All perturbations of one input are batched with ``vmap``; numerical and analytical Jacobians of
every input are computed inside one ``jit``-compiled function, cached per function and input
pattern, and judged by a second small program where they are (:func:`_judge`), so a repeated
check costs two XLA calls on CPU, GPU or TPU and copies back numbers, not tables.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from masked_jax._core import MaskedArray
from masked_jax.checking._compile import _compiled
from masked_jax.checking._finite_diff import _roundoff
from masked_jax.checking._inputs import FULL_MAX_ELEMENTS, MODES, SEMANTICS, describe, is_leaf, output_vectors
from masked_jax.checking._projections import projection_sets, unstack_projections
from masked_jax.checking._report import JacobianError, JacobianReport
from masked_jax.checking._verdict import _compare, _judge, _judged


def default_tolerances(dtype):
    """``(eps, atol, rtol)`` for central differences in ``dtype``."""
    dtype = np.dtype(dtype)
    if dtype == np.float64:
        return 1e-6, 1e-5, 1e-3
    if dtype == np.float32:
        return 1e-3, 1e-2, 1e-2
    return 3e-2, 1e-1, 1e-1  # float16 / bfloat16 (the check itself runs their inputs in float32)


def check_jacobian(
    f,
    args,
    *,
    semantics="both",
    modes=("fwd", "rev"),
    eps=None,
    atol=None,
    rtol=None,
    fast=None,
    raise_exception=True,
    seed=0,
    leak_probes=True,
    compile=None,
    order=1,
) -> JacobianReport:
    """Compare finite-difference Jacobians of ``f`` with ``jax.jacfwd``/``jax.jacrev``.

    Inputs (the array leaves of ``args``) and outputs may be pytrees of float arrays,
    ``MaskedArray`` objects, BCOO-backed masked arrays, row-sparse arrays and
    ``jax.experimental.sparse.BCOO`` objects. Integer and bool leaves (masks, indices) are constants,
    other Python values are static.

    * ``semantics="dense"`` perturbs every element (unspecified = 0) and compares every output.
    * ``semantics="masked"`` perturbs specified elements only, compares valid outputs, and checks
      that the function implements masked semantics: changing masked-out data changes no valid
      output, and analytical entries at masked-out inputs and outputs are 0.
    * ``semantics="both"`` runs both; :attr:`JacobianReport.satisfies` names the semantics the
      function implements, and the report is truthy when it implements at least one.

    Args:
        f: the function, called as ``f(*args)``.
        args: a tuple of arguments (a single non-tuple argument is wrapped).
        semantics: ``"dense"``, ``"masked"`` or ``"both"``.
        modes: any of ``"fwd"`` (``jacfwd``/``jvp``) and ``"rev"`` (``jacrev``/``vjp``). A
            function with a ``custom_vjp`` has its forward check skipped, with a note.
        eps: finite-difference step; default by dtype (1e-6 for float64, 1e-3 for float32).
        atol, rtol: tolerances, ``|num - an| <= atol + rtol * |num|``; default by dtype.
        fast: ``True`` compares random projections ``v^T J u`` (cost independent of the
            Jacobian's size), ``False`` full Jacobian tables, ``None`` chooses by size (full up
            to 2048 input elements).
        raise_exception: raise :class:`JacobianError` (carrying the report) on failure.
        seed: seed of the random fill under masks and of the random directions.
        leak_probes: under masked semantics, also set the data under the masks to NaN, +-inf
            and a huge value and check that nothing valid changes (the default). ``False``
            skips them (a faster first call); the finite-fill checks remain.
        order: ``2`` checks second derivatives, as torch's ``gradgradcheck``: the Jacobian of
            the gradient of ``f`` (its VJP with a fixed random cotangent on the valid outputs;
            a ``MaskedArray`` input's gradient keeps its mask), by ``jacfwd`` of it
            (forward-over-reverse) and ``jacrev`` (reverse-over-reverse), against finite
            differences of the gradient. Inputs: arrays and ``MaskedArray`` objects.
        compile: ``None`` (default) compiles the whole check with ``jit`` (one XLA call per
            later check of the same function), except that a new function whose input and
            output shapes have been checked eagerly before runs eagerly, op by op, at once (jax's
            compiled primitives serve it); in interactive sessions the check then compiles in a
            background thread (``MJ_CHECK_BACKGROUND=1`` or ``0`` decides elsewhere). ``True``
            always compiles, ``False`` always runs eagerly, op by op: for debugging ``f`` inside
            the check (a breakpoint, a print), many times slower than either. A function with the same code as one
            checked before (a re-run notebook cell, other captured arrays or numbers, another
            mask of the same shapes) finds that one's check and runs it on its own constants
            (for sparse inputs: only with the same captured values).

    Returns:
        A :class:`JacobianReport`, truthy when the check passed.

    Examples:
        >>> import jax.numpy as jnp, masked_jax as mj, masked_jax.numpy as mnp
        >>> x = mj.masked_array(jnp.array([1.0, 2.0, 3.0]), jnp.array([True, False, True]))
        >>> report = mj.check_jacobian(lambda v: mnp.sum(mnp.exp(v)), (x,), raise_exception=False)
        >>> report.satisfies
        ('masked',)
        >>> bool(mj.check_jacobian(lambda v: jnp.sum(v.data ** 2), (x,), semantics="dense"))
        True
    """
    if not callable(f):
        raise TypeError(f"check_jacobian: f must be callable; got {type(f).__name__}.")
    if order not in (1, 2):
        raise ValueError(f"check_jacobian: order must be 1 or 2; got {order!r}.")
    if order == 2:
        report = check_jacobian(
            _gradient_of(f, seed),
            args,
            semantics=semantics,
            modes=modes,
            eps=eps,
            atol=atol,
            rtol=rtol,
            fast=fast,
            raise_exception=False,
            seed=seed,
            leak_probes=leak_probes,
            compile=compile,
        )
        report.notes.insert(
            0,
            "second order: the Jacobian of f's gradient (its VJP with a fixed random cotangent "
            "on the valid outputs): forward-over-reverse (fwd), reverse-over-reverse (rev)",
        )
        if raise_exception and not report:
            raise JacobianError(report)
        return report
    if semantics not in ("dense", "masked", "both"):
        raise ValueError(f"semantics must be 'dense', 'masked' or 'both'; got {semantics!r}.")
    modes = (modes,) if isinstance(modes, str) else tuple(modes)
    if not modes or any(m not in MODES for m in modes):
        raise ValueError(f"modes must be a non-empty sequence of 'fwd' and 'rev'; got {modes!r}.")
    if compile not in (None, True, False):
        raise ValueError(f"check_jacobian: compile must be None, True or False; got {compile!r}.")
    sems = SEMANTICS if semantics == "both" else (semantics,)
    args = tuple(args) if isinstance(args, (tuple, list)) else (args,)

    flat, treedef = jax.tree_util.tree_flatten_with_path(args, is_leaf=is_leaf)
    x64 = bool(jax.config.read("jax_enable_x64"))
    leaves, positions, values, consts, const_pos, static = [], [], [], [], [], []
    for pos, (path, x) in enumerate(flat):
        name = "args" + jax.tree_util.keystr(path)
        if is_leaf(x) or isinstance(x, (jax.Array, np.ndarray)):
            d = describe(name, x, "float64" if x64 else None)
            if d is not None:
                leaves.append(d[0])
                positions.append(pos)
                values.append(d[1])
                continue
            consts.append(x)
            const_pos.append(pos)
        else:
            static.append((pos, x))
    if not leaves:
        raise TypeError(
            "check_jacobian: no differentiable input: every array leaf of args has an integer "
            "or bool dtype. Pass float arrays (or masked / sparse arrays with float data)."
        )
    dtype = min((np.dtype(leaf.dtype) for leaf in leaves), key=lambda d: d.itemsize)
    d_eps, d_atol, d_rtol = default_tolerances(dtype)
    eps = d_eps if eps is None else _positive(eps, "eps", strict=True)
    atol = d_atol if atol is None else _positive(atol, "atol")
    rtol = d_rtol if rtol is None else _positive(rtol, "rtol")
    tol = (atol, rtol, _roundoff(dtype, eps))  # operands of the program that takes the verdict
    total = sum(leaf.size for leaf in leaves)
    fast = total > FULL_MAX_ELEMENTS if fast is None else bool(fast)

    def call(vals, extras, const_vals, patterns=None):
        objs = [None] * len(flat)
        for k, (leaf, pos, v, e) in enumerate(zip(leaves, positions, vals, extras)):
            objs[pos] = leaf.build(v, e, None if patterns is None else patterns[k])
        for pos, c in zip(const_pos, const_vals):
            objs[pos] = c
        for pos, s in static:
            objs[pos] = s
        return f(*jax.tree_util.tree_unflatten(treedef, objs))

    notes = []
    run_modes = modes
    try:
        entry, operands = _compiled(
            f, call, treedef, leaves, static, sems, run_modes, fast, eps, values, consts, leak_probes
        )
        raw = entry(operands, seed, compile)
    except TypeError as err:
        if "fwd" not in modes or "custom_vjp" not in str(err):
            raise
        run_modes = tuple(m for m in modes if m != "fwd")
        notes.append("forward mode skipped: f uses a jax.custom_vjp function, which has no JVP rule")
        if not run_modes:
            raise TypeError(
                "check_jacobian: f uses a jax.custom_vjp function, so forward mode cannot be "
                "checked; ask for modes=('rev',)."
            ) from None
        entry, operands = _compiled(
            f, call, treedef, leaves, static, sems, run_modes, fast, eps, values, consts, leak_probes
        )
        raw = entry(operands, seed, compile)
    names = entry.names
    notes += [f"output {s} skipped" for s in entry.skipped]
    raw = _unpacked(_fetch(raw, fast, tol, names, sems, run_modes, compile), leaves, sems)
    checks = _compare(raw, leaves, names, sems, run_modes, fast, *tol, probes=leak_probes)
    # A second run where the first one calls for it: for a derivative just off the finite differences,
    # their error estimate (steps eps and 2 eps: twice the work, so only where a check would fail
    # without it, by at most NEAR_MISS times its tolerance; no step error of a smooth function is
    # larger); for a failed masked check in full mode, the leak map that locates the leak (an
    # evaluation and a Jacobian per input element, paid by failing checks only: the probes, the
    # random fills and the perturbed masked-out elements have already found the leak).
    near = any(c.near_miss for c in checks)
    locate = (
        not fast
        and leak_probes
        and "masked" in sems
        and not all(lf.spec.all() for lf in leaves)
        and any(c.semantics == "masked" and not c.passed for c in checks)
    )
    if near or locate:  # the map alone is a small program; with the estimate, the whole check again
        second, second_operands = _compiled(
            f,
            call,
            treedef,
            leaves,
            static,
            sems,
            run_modes,
            fast,
            eps,
            values,
            consts,
            leak_probes,
            richardson=near,
            leak_map="only" if locate and not near else locate,
        )
        again = _fetch(second(second_operands, seed, compile), fast, tol, names, sems, run_modes, compile)
        raw = {**raw, **_unpacked(again, leaves, sems)}
        checks = _compare(raw, leaves, names, sems, run_modes, fast, *tol, probes=leak_probes)
    report = JacobianReport(
        checks=checks,
        semantics=sems,
        backend=jax.default_backend(),
        dtype=dtype.name,
        eps=eps,
        atol=atol,
        rtol=rtol,
        fast=fast,
        notes=notes,
    )
    entry.background(operands, seed, compile)
    if raise_exception and not report:
        raise JacobianError(report)
    return report


HOST_JUDGE_MAX = 2**22  # table entries in all: up to this many, the CPU judges them with numpy


def _fetch(raw, fast, tol, names, sems, modes, compile):
    """``raw`` copied to the host, except the full tables (``"<input>/<semantics>"``), which are
    judged where they are (:func:`_judge`) and read by a report on demand."""
    tables = set() if fast else {k for k in raw if k.split("/")[0].isdigit()}
    rest = {k: v for k, v in raw.items() if k not in tables}
    if not tables:
        return jax.device_get(rest)
    needs = {k: raw[k] for k in (*tables, "valid", "specs", *(f"scale/{s}" for s in sems))}
    del rest["specs"]  # the host has them
    # On the CPU the tables are already in host memory: numpy judges them there, where a program
    # to judge them would take a compile of its own (0.7 s for a flax transformer block's tables);
    # on an accelerator, a compiled program judges them where they are (no transfer of the tables).
    size = sum(np.size(x) for t in tables for x in jax.tree_util.tree_leaves(raw[t]))
    host = jax.default_backend() == "cpu" and size <= HOST_JUDGE_MAX
    if compile is False or host:  # numpy judges them on the host
        needs = jax.device_get(needs)
        judged = _judge(needs, tol, tuple(names), sems, modes, xp=np)
        return {**jax.device_get(rest), "judged": judged, **{k: needs[k] for k in tables}}
    leaves, treedef = jax.tree_util.tree_flatten(rest)
    judged, flat = _judged(needs, tol, leaves, names=tuple(names), sems=sems, modes=modes)
    got = np.split(np.asarray(flat), np.cumsum([np.size(x) for x in leaves])[:-1]) if leaves else []
    rest = jax.tree_util.tree_unflatten(treedef, [g.reshape(np.shape(x)).astype(x.dtype) for g, x in zip(got, leaves)])
    return {**rest, "judged": np.asarray(judged), **{k: needs[k] for k in tables}}


def _unpacked(raw, leaves, sems):
    """``raw`` on the host with what the program computed for all inputs at once split per input:
    the probes' VJP leaks (every input's elements end to end) and the stacked projections."""
    probes = raw.get("probes")
    if probes is not None:
        sizes = [leaf.size for leaf in leaves]
        cuts = np.cumsum(sizes)[:-1]
        raw["probes"] = {
            **probes,
            **{k: np.split(np.asarray(probes[k]), cuts, axis=-1) for k in ("vjp", "vjp_off")},
        }
    if "projections" in raw:
        raw.update(unstack_projections(raw.pop("projections"), projection_sets(leaves, sems)))
    return raw


def _gradient_of(f, seed):
    """``f``'s gradient as a function of the same arguments: the VJP of its raw outputs with a fixed
    random cotangent on the valid ones, per float array (a plain array) or ``MaskedArray`` input
    (a ``MaskedArray`` with the input's mask); other leaves are constants."""

    def grad(*args):
        leaves, treedef = jax.tree_util.tree_flatten(args, is_leaf=is_leaf)
        idx = []
        for i, x in enumerate(leaves):
            if is_leaf(x) and not isinstance(x, MaskedArray):
                raise TypeError(
                    f"check_jacobian(order=2): input {type(x).__name__} is not supported; second-order "
                    "checks take float arrays and MaskedArrays."
                )
            data = x.data if isinstance(x, MaskedArray) else x
            if hasattr(data, "dtype") and jnp.issubdtype(data.dtype, jnp.floating):
                idx.append(i)

        def inner(*datas):
            ls = list(leaves)
            for i, d in zip(idx, datas):
                ls[i] = (
                    MaskedArray.tree_unflatten(None, (d, leaves[i].mask)) if isinstance(leaves[i], MaskedArray) else d
                )
            _, raw, mask = output_vectors(f(*jax.tree_util.tree_unflatten(treedef, ls)))
            return raw, mask

        datas = [leaves[i].data if isinstance(leaves[i], MaskedArray) else leaves[i] for i in idx]
        raw, pull, mask = jax.vjp(inner, *datas, has_aux=True)
        cotangent = jax.random.normal(jax.random.PRNGKey(seed + 1), raw.shape, raw.dtype) * mask
        grads = pull(cotangent)
        return tuple(
            MaskedArray.tree_unflatten(None, (g, leaves[i].mask)) if isinstance(leaves[i], MaskedArray) else g
            for i, g in zip(idx, grads)
        )

    return grad


def _positive(value, name, strict=False):
    """``value`` as a float that is > 0 (``strict``) or >= 0 and finite; a ``ValueError`` otherwise."""
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise TypeError(f"check_jacobian: {name} must be a number; got {type(value).__name__}.") from None
    if not np.isfinite(v) or v < 0 or (strict and v == 0):
        raise ValueError(
            f"check_jacobian: {name} must be a finite number {'> 0' if strict else '>= 0'}; got {value!r}."
        )
    return v
