"""Numerical Jacobians: perturbations of every input batched with ``vmap``, Richardson extrapolation,
the round-off scale, and the tables each check compares; with ``fast=True``, the random
projections of :mod:`._projections` and the probes as rows of the check's batches (:mod:`._batch`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from masked_jax.checking._batch import Batch, batch_dtype, richardson_error, split, starts_of
from masked_jax.checking._probes import _leak, _leak_map, analytic_pattern, probe_rows
from masked_jax.checking._projections import projection_rows, projection_sets


def _random_fills(specs, values, draw):
    """``values`` with the unspecified elements replaced by the random ``draw`` (of every input's
    elements end to end)."""
    sizes = [v.shape[0] for v in values]
    parts = split(draw.astype(batch_dtype(values)), starts_of(sizes), sizes, values)
    return [jnp.where(s, v, r) for s, v, r in zip(specs, values, parts)]


def _run(
    evaluate,
    leaves,
    names,
    sems,
    modes,
    fast,
    eps,
    vals,
    specs,
    specified,
    draws,
    probes=True,
    richardson=False,
    leak_map: bool | str = False,
):
    """Everything numerical and analytical, as arrays (traced once under jit).

    ``evaluate(values, extras)``: ``f``'s flat outputs and whether they are plain arrays (see
    :func:`_evaluator`). ``specs``: the inputs' patterns of specified elements (operands of a lifted
    check, whose ``leaves`` hold none), or ``None`` for the leaves' own. ``specified``: every
    element of every input is specified. ``richardson``: the finite differences' error estimate;
    ``leak_map``: the leak map (full mode, masked semantics with probes), ``"only"``: nothing else;
    both for a second run.
    """
    n = len(leaves)
    specs = [jnp.asarray(leaf.spec) for leaf in leaves] if specs is None else [jnp.asarray(s) for s in specs]
    given = [v.astype(leaf.dtype).ravel() for leaf, v in zip(leaves, vals)]  # the user's data under the masks
    # the dense-semantics point: unspecified elements 0 (a masked input's data, as given, may hold anything)
    vals = [jnp.where(s, v, 0) for v, s in zip(given, specs)]
    fills = _random_fills(specs, vals, draws["fill"])  # masked semantics: data under masks is random
    alts = _random_fills(specs, vals, draws["alt"])  # ... and different: valid outputs must not move
    out = {}
    # Nothing unspecified in the inputs (``specified``): masked semantics perturbs what dense
    # semantics perturbs at the same point, no fill or probe can move anything, and with plain
    # array outputs the masked tables are the dense ones.
    plain = []

    def outputs(vs, extras):
        vectors, is_plain = evaluate(vs, extras)
        plain.append(is_plain)
        return vectors

    owns = [leaf.kind != "array" for leaf in leaves]  # inputs that can have masked-out elements (a map each)
    if leak_map == "only":  # at the fills, as in the whole check (the same draws)
        base = [e[0] for e in jax.vmap(lambda vs: outputs(vs, [None] * n))([f[None] for f in fills])]
        return {"leak_map": [_leak_map(outputs, specs, fills, base, modes, i) if owns[i] else None for i in range(n)]}
    # masked semantics: the valid outputs at the fills must be those at the other random fills, at
    # the user's own data under the masks and at zeros there (the dense point, last): a function
    # that finds its padding by a sentinel value (``v.data != 0``) moves between them
    points = [fills] if specified else [fills, alts, given, vals]
    out_size = sum(int(np.prod(shape)) for _, shape in names)
    with_probes = "masked" in sems and probes and not specified
    if fast:
        out.update(
            _fast(
                outputs,
                leaves,
                sems,
                modes,
                eps,
                {"dense": vals, "masked": fills},
                specs,
                points,
                with_probes,
                draws,
                richardson,
                out_size,
            )
        )
        out["specs"] = specs
        return out
    joint_ok = "dense" in sems and n > 1 and all(leaf.kind in ("array", "masked") for leaf in leaves)
    if joint_ok:  # these points and the joint tables' perturbed ones: one batch, one evaluation of f
        perturbed, evals = _joint_evaluations(outputs, leaves, vals, eps, richardson, points)
    else:
        evals = jax.vmap(lambda vs: outputs(vs, [None] * n))([jnp.stack(p) for p in zip(*points)])  # one batch
    out.update(_point_results(evals, len(points), sems))
    base_m = [e[0] for e in evals]
    same = specified and plain[0] and "dense" in sems  # the two semantics: one check
    keep = not same and _shares_tables(leaves[0], sems, False, probes)
    rev = None  # the joint tables' reverse-mode Jacobian, as rows of the probes' VJP batch
    if with_probes:
        batch = Batch(outputs, leaves, "vjp" if "rev" in modes else "jvp", out_size)
        finish = probe_rows(batch, leaves, specs, fills, modes, draws)
        if joint_ok and batch.kind == "vjp":
            # one cotangent per output at the dense point: the rows of jacrev, without a VJP of f of
            # their own in the program (one VJP of f however many rows)
            x0 = jnp.concatenate([v.astype(batch_dtype(vals)) for v in vals])
            eye = jnp.eye(out_size, dtype=x0.dtype)
            rev = batch.add(jnp.broadcast_to(x0, (out_size, x0.shape[0])), None, eye, keep)
        batch.run()
        out["probes"] = finish(base_m)
        if rev is not None:
            rev = batch[rev][1]
        if leak_map:
            out["leak_map"] = [
                _leak_map(outputs, specs, fills, base_m, modes, i) if owns[i] else None for i in range(n)
            ]
    joint = None
    if joint_ok:  # every input's dense tables from one batch of evaluations over all inputs at once
        joint = _joint_tables(outputs, leaves, vals, modes, eps, perturbed, evals[2][-1], richardson, keep, rev)
    for i, leaf in enumerate(leaves):
        for sem in sems:
            base = vals if sem == "dense" else fills
            which = 0 if sem == "dense" else 1  # analytical: filled outputs (dense) or raw data (masked)

            def F(v, extra, which, base=base, i=i):
                vs = list(base)
                vs[i] = v
                extras = [None] * n
                extras[i] = extra
                return outputs(vs, extras)[which]

            x0 = base[i]
            shared = not same and _shares_tables(leaf, sems, False, probes)
            if sem == "dense" and joint is not None:
                out[f"{i}/dense"] = joint[i]
            elif sem == "masked" and same:
                out[f"{i}/masked"] = out[f"{i}/dense"]
            elif sem == "masked" and shared:
                out[f"{i}/masked"] = _masked_share(out[f"{i}/dense"], specs[i], modes)
            else:
                out[f"{i}/{sem}"] = _tables(F, x0, leaf, sem, modes, eps, which, richardson, keep_raw=shared)
    out["specs"] = specs
    return out


# the leak each point after the first shows (see :func:`_run`), as the report names it
POINT_LEAKS = (
    "valid outputs vs masked-out data",  # the other random fills
    "valid outputs vs the given masked-out data",  # the user's own data under the masks
    "valid outputs vs masked-out zeros",
)


def _point_results(evals, count, sems):
    """What the check reads from ``f``'s ``(filled, raw, mask)`` outputs at its ``count`` points
    (the fills, the other random fills, the given data, the dense point; the fills alone when
    every element is specified): the output mask, the outputs' magnitudes (for the rounding
    tolerance), how far the valid outputs (``value_leak``, one row per point after the first: NaN
    or infinite where one of them is and they differ) and the mask move with the data under the
    masks."""
    base = [e[0] for e in evals]
    if count == 1:  # every element specified: nothing under a mask
        others = [e[:0] for e in evals]
    else:
        others = [e[1:count] for e in evals]
    both = base[2][None] & others[2]
    return {
        "valid": base[2],
        "scale/masked": jnp.abs(base[0]),
        "scale/dense": jnp.abs(evals[0][count - 1] if "dense" in sems else base[0]),
        "value_leak": jnp.where(both, _leak(others[0], base[0][None]), 0),
        "mask_changed": jnp.any(base[2][None] != others[2], axis=-1),
    }


def _fast(outputs, leaves, sems, modes, eps, bases, specs, points, probes, draws, richardson, out_size):
    """Everything ``fast=True`` computes: ``outputs`` at the ``points``, the leak probes (with
    ``probes``) and the random projections of every input under each semantics. For array and
    ``MaskedArray`` inputs all of them are rows of at most two batches, a JVP's and a VJP's (the
    points are the outputs of one's forward pass): the program holds ``f`` twice, however many
    inputs, sets and probes. The projections' results come stacked (``"projections"``, see
    :func:`unstack_projections`). A sparse input's sets, the points and the probes take batches of
    their own (the sparse structure differs between them)."""
    merged = all(leaf.kind in ("array", "masked") for leaf in leaves)
    made: list = []

    def batches():
        if merged and made:
            return made[0]
        kinds = {
            kind: Batch(outputs, leaves, kind, out_size)
            for kind, mode in (("jvp", "fwd"), ("vjp", "rev"))
            if mode in modes
        }
        kinds["eval"] = (kinds.get("jvp") or kinds["vjp"]) if merged else Batch(outputs, leaves, "eval", out_size)
        made.append(kinds)
        return kinds

    first = batches()
    dtype = batch_dtype(bases["dense"])
    at_points = first["eval"].add(jnp.stack([jnp.concatenate([v.astype(dtype) for v in p]) for p in points]))
    finish_probes = None
    if probes:
        host = first["vjp"] if "rev" in modes else first["jvp"]
        finish_probes = probe_rows(host, leaves, specs, bases["masked"], modes, draws)
    sets = projection_sets(leaves, sems)
    finishers = [
        projection_rows(batches(), leaves, group, specs, modes, eps, draws, bases, richardson)
        for group in ([sets] if merged else [[st] for st in sets])
    ]
    for batch in {id(b): b for kinds in made for b in kinds.values()}.values():
        batch.run()
    evals = first["eval"][at_points][0]
    out = _point_results(evals, len(points), sems)
    if finish_probes is not None:
        out["probes"] = finish_probes([e[0] for e in evals])
    parts = [finish(out["valid"], {s: out[f"scale/{s}"] for s in sems}) for finish in finishers]
    # every set's results, stacked in the order of the sets (read by unstack_projections)
    out["projections"] = {
        name: jnp.concatenate([p[name] for p in parts if name in p]) for name in {k for p in parts for k in p}
    }
    return out


def _shares_tables(leaf, sems, fast, probes) -> bool:
    """Whether the masked-semantics tables of ``leaf`` are taken from the dense-semantics ones:
    full tables under both semantics, with leak probes, for an array or ``MaskedArray`` input.

    Both are then taken at the dense point (0 under the masks), where perturbing a valid element
    is the same evaluation under both semantics (specifying an element that is already specified
    changes nothing), and the Jacobian of the raw outputs gives both analytical tables (the dense
    one is zero on the masked-out outputs). The masked-out inputs are not perturbed: the random
    fills and the leak probes (NaN, +-inf and a huge value under every mask, with their VJPs)
    decide whether masked-out data reaches anything, and the leak map of a failed check locates
    it. Half the work of two separate sets of tables; sparse inputs keep them separate (their
    re-specified element is a padding slot, not the same evaluation).
    """
    return bool(not fast and probes and "dense" in sems and "masked" in sems and leaf.kind in ("array", "masked"))


def _masked_share(dense, spec, modes):
    """The masked-semantics tables from the dense ones (see :func:`_shares_tables`): the valid
    inputs' columns of the numerical table (the others 0, not perturbed) and the raw outputs'
    Jacobians, which :func:`_tables` kept aside (``keep_raw``)."""
    res = {"num": jnp.where(spec, dense["num"], 0)}
    if "fd_err" in dense:
        res["fd_err"] = jnp.where(spec, dense["fd_err"], 0)
    for mode in modes:
        res[mode] = dense.pop(f"raw/{mode}")
    return res


def _tables(F, x0, leaf, sem, modes, eps, which, richardson=False, keep_raw=False):
    """Full numerical and analytical Jacobians (outputs x input elements), and with ``richardson``
    the finite differences' estimated error. ``keep_raw``: the Jacobians are taken of the raw
    outputs (kept as ``"raw/<mode>"``), and the analytical tables are those with the outputs'
    masked-out rows zeroed (the Jacobians of the filled outputs)."""
    size = leaf.size
    dense = sem == "dense"

    # All perturbed points (steps eps, and 2 eps with ``richardson``) in one batch: one large
    # evaluation (e.g. one matmul) beats several.
    steps = jnp.eye(size, dtype=x0.dtype) * eps
    points = [x0 + steps, x0 - steps] + ([x0 + 2 * steps, x0 - 2 * steps] if richardson else [])
    ks = jnp.tile(jnp.arange(size), len(points))
    evals = jax.vmap(lambda v, k: F(v, k if dense else None, 0))(jnp.concatenate(points), ks)
    d1 = (evals[:size] - evals[size : 2 * size]) / (2 * eps)
    res = {"num": d1.T}
    if richardson:
        res["fd_err"] = richardson_error(d1, (evals[2 * size : 3 * size] - evals[3 * size :]) / (4 * eps)).T
    pattern = analytic_pattern(leaf, sem)
    g = lambda v: F(v, pattern, 1 if keep_raw else which)  # noqa: E731
    for mode, jac in (("fwd", jax.jacfwd), ("rev", jax.jacrev)):
        if mode in modes:
            res[mode] = jac(g)(x0)
            if keep_raw:
                res[f"raw/{mode}"] = res[mode]
                res[mode] = jnp.where(F(x0, pattern, 2)[:, None], res[mode], 0)
    return res


def _joint_evaluations(outputs, leaves, vals, eps, richardson, points):
    """The evaluations :func:`_joint_tables` differences (every input element perturbed by
    ``+-eps``, and ``+-2 eps`` with ``richardson``: the perturbed element specified, by its index in
    its own input; an out-of-range index, none, for the others), and ``outputs`` at ``points``
    (lists of every input's values, nothing specified on top), in one batch: ``(the perturbed
    points' filled outputs, the points' (filled, raw, mask) stacked)``."""
    sizes = [leaf.size for leaf in leaves]
    starts, total = starts_of(sizes), sum(sizes)
    dtype = jnp.result_type(*vals)
    x0 = jnp.concatenate([v.astype(dtype) for v in vals])
    steps = jnp.eye(total, dtype=dtype) * eps
    rows = [x0 + steps, x0 - steps] + ([x0 + 2 * steps, x0 - 2 * steps] if richardson else [])
    rows += [jnp.stack([jnp.concatenate([v.astype(dtype) for v in p]) for p in points])]
    ks = jnp.concatenate([jnp.tile(jnp.arange(total), len(rows) - 1), jnp.full(len(points), total)])

    def one(x, k):
        extras = [jnp.where((k >= a) & (k < a + size), k - a, size) for a, size in zip(starts, sizes)]
        return outputs(split(x, starts, sizes, vals), extras)

    evals = jax.vmap(one)(jnp.concatenate(rows), ks)
    cut = ks.shape[0] - len(points)
    return evals[0][:cut], tuple(e[cut:] for e in evals)


def _joint_tables(outputs, leaves, vals, modes, eps, evals, valid, richardson=False, keep_raw=False, rev=None):
    """:func:`_tables` under dense semantics for every input at once, as a list of their results:
    central differences of ``evals`` (:func:`_joint_evaluations`), and ``jacfwd`` / ``jacrev`` of
    the outputs in all the inputs' elements, split into each input's columns. One evaluation of
    ``f``, one JVP and one VJP in the program, however many inputs (pytree leaves) ``f`` takes.
    ``valid``: the output mask at ``vals`` (with ``keep_raw``), from the caller's evaluations.
    ``rev``: the reverse-mode Jacobian (outputs x every input's elements, of the raw outputs with
    ``keep_raw``), when the caller took it as rows of a VJP batch; ``None``: ``jacrev`` here."""
    n = len(leaves)
    sizes = [leaf.size for leaf in leaves]
    starts = starts_of(sizes)
    total = sum(sizes)
    x0 = jnp.concatenate([v.astype(jnp.result_type(*vals)) for v in vals])

    d1 = (evals[:total] - evals[total : 2 * total]) / (2 * eps)
    res = [{"num": d1.T[:, a : a + s]} for a, s in zip(starts, sizes)]
    if richardson:
        err = richardson_error(d1, (evals[2 * total : 3 * total] - evals[3 * total :]) / (4 * eps)).T
        for r, a, s in zip(res, starts, sizes):
            r["fd_err"] = err[:, a : a + s]
    none = [None] * n
    g = lambda x: outputs(split(x, starts, sizes, vals), none)[1 if keep_raw else 0]  # noqa: E731
    valid = valid[:, None] if keep_raw else None
    for mode, jac in (("fwd", jax.jacfwd), ("rev", jax.jacrev)):
        if mode in modes:
            table = rev if mode == "rev" and rev is not None else jac(g)(x0)
            for r, a, s in zip(res, starts, sizes):
                r[mode] = table[:, a : a + s]
                if valid is not None:  # keep_raw
                    r[f"raw/{mode}"] = r[mode]
                    r[mode] = jnp.where(valid, r[mode], 0)
    return res


def _roundoff(dtype, eps) -> float:
    """Per unit of output magnitude, the rounding error a central difference with step ``eps``
    can carry in ``dtype`` (each evaluation is off by about one ulp of the output; the difference
    of two divided by ``2 eps``), with a safety factor of 4: an output of magnitude ``F`` gets
    ``F * roundoff`` more tolerance, so ``var(30 * x)`` in float32 is not failed for rounding."""
    return 4.0 * float(jnp.finfo(dtype).eps) / float(eps)
