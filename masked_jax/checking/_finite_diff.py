"""Numerical Jacobians: perturbations of every input batched with ``vmap``, Richardson extrapolation,
random projections of large Jacobians, the round-off scale, and the tables each check compares.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from masked_jax.checking._inputs import ALL, N_DIRECTIONS
from masked_jax.checking._probes import _leak_map, _probes, analytic_pattern


def _random_fills(specs, values, key, lo, hi):
    """``values`` with the unspecified elements replaced by uniform random values in [lo, hi)."""
    keys = jax.random.split(key, len(specs))
    return [jnp.where(s, v, jax.random.uniform(k, v.shape, v.dtype, lo, hi)) for s, v, k in zip(specs, values, keys)]


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
    seed,
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
    # the dense-semantics point: unspecified elements 0 (a masked input's data, as given, may hold anything)
    vals = [jnp.where(s, v.astype(leaf.dtype).ravel(), 0) for leaf, v, s in zip(leaves, vals, specs)]
    k_fill, k_alt, rng = jax.random.split(jax.random.PRNGKey(seed), 3)
    fills = _random_fills(specs, vals, k_fill, 0.5, 1.5)  # masked semantics: data under masks is random
    alts = _random_fills(specs, vals, k_alt, -2.0, -1.0)  # ... and different: valid outputs must not move
    out = {}
    # Nothing unspecified in the inputs (``specified``): masked semantics perturbs what dense
    # semantics perturbs at the same point, no fill or probe can move anything, and with plain
    # array outputs the masked tables are the dense ones.
    plain = []

    def outputs(vs, extras):
        vectors, is_plain = evaluate(vs, extras)
        plain.append(is_plain)
        return vectors

    if leak_map == "only":  # at the fills, as in the whole check (the same seed)
        base = [e[0] for e in jax.vmap(lambda vs: outputs(vs, [None] * n))([f[None] for f in fills])]
        return {"leak_map": [_leak_map(outputs, specs, fills, base, modes, i) for i in range(n)]}
    points = [fills] if specified else [fills, alts] + ([vals] if "dense" in sems else [])
    evals = jax.vmap(lambda vs: outputs(vs, [None] * n))([jnp.stack(p) for p in zip(*points)])  # one batch
    base_m, alt_m = ([e[min(j, len(points) - 1)] for e in evals] for j in (0, 1))
    out["valid"] = base_m[2]
    out["scale/masked"] = jnp.abs(base_m[0])  # output magnitudes, for the rounding tolerance
    out["scale/dense"] = jnp.abs(evals[0][-1]) if "dense" in sems else out["scale/masked"]
    out["value_leak"] = jnp.where(base_m[2] & alt_m[2], jnp.abs(base_m[0] - alt_m[0]), 0)
    out["mask_changed"] = jnp.any(base_m[2] != alt_m[2])
    if "masked" in sems and probes and not specified:
        out["probes"] = _probes(outputs, leaves, specs, fills, base_m, modes, jax.random.fold_in(rng, n + 1))
        if leak_map and not fast:
            out["leak_map"] = [_leak_map(outputs, specs, fills, base_m, modes, i) for i in range(n)]
    same = specified and plain[0] and not fast and "dense" in sems  # the two semantics: one check
    joint = None
    if not fast and "dense" in sems and n > 1 and all(leaf.kind in ("array", "masked") for leaf in leaves):
        # every input's dense tables from one batch of evaluations over all inputs at once
        keep = not same and _shares_tables(leaves[0], sems, fast, probes)
        joint = _joint_tables(outputs, leaves, vals, modes, eps, richardson, keep_raw=keep)
    for i, leaf in enumerate(leaves):
        for sem in sems:
            base = vals if sem == "dense" else fills
            which = 0 if sem == "dense" else 1  # analytical: filled outputs (dense) or raw data (masked)

            def F(v, extra, which, base=base):
                vs = list(base)
                vs[i] = v
                extras = [None] * n
                extras[i] = extra
                return outputs(vs, extras)[which]

            x0 = base[i]
            shared = not same and _shares_tables(leaf, sems, fast, probes)
            if sem == "dense" and joint is not None:
                out[f"{i}/dense"] = joint[i]
            elif sem == "masked" and same:
                out[f"{i}/masked"] = out[f"{i}/dense"]
            elif sem == "masked" and shared:
                out[f"{i}/masked"] = _masked_share(out[f"{i}/dense"], specs[i], modes)
            elif fast:
                if f"{i}/{sem}" not in out:  # masked: every input at once; dense: the arrays, or one input
                    together = sem == "masked" or leaf.kind == "array"
                    group = (
                        [j for j, o in enumerate(leaves) if sem == "masked" or o.kind == "array"] if together else [i]
                    )
                    found = _projections(
                        outputs, base, leaves, group, specs, sem, modes, eps, out["valid"], rng, richardson,
                        out[f"scale/{sem}"],
                    )  # fmt: skip
                    out.update({f"{j}/{sem}": r for j, r in found.items()})
            else:
                out[f"{i}/{sem}"] = _tables(F, x0, leaf, sem, modes, eps, which, richardson, keep_raw=shared)
    out["specs"] = specs
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
        res["fd_err"] = _richardson(d1, (evals[2 * size : 3 * size] - evals[3 * size :]) / (4 * eps)).T
    pattern = analytic_pattern(leaf, sem)
    g = lambda v: F(v, pattern, 1 if keep_raw else which)  # noqa: E731
    for mode, jac in (("fwd", jax.jacfwd), ("rev", jax.jacrev)):
        if mode in modes:
            res[mode] = jac(g)(x0)
            if keep_raw:
                res[f"raw/{mode}"] = res[mode]
                res[mode] = jnp.where(F(x0, pattern, 2)[:, None], res[mode], 0)
    return res


def _joint_tables(outputs, leaves, vals, modes, eps, richardson=False, keep_raw=False):
    """:func:`_tables` under dense semantics for every input at once, as a list of their results:
    the inputs' elements perturbed in one batch (the perturbed element specified, by its index in
    its own input; an out-of-range index, none, for the others), and ``jacfwd`` / ``jacrev`` of
    the outputs in all the inputs' elements, split into each input's columns. One evaluation of
    ``f``, one JVP and one VJP in the program, however many inputs (pytree leaves) ``f`` takes."""
    n = len(leaves)
    sizes = [leaf.size for leaf in leaves]
    starts = _starts(sizes)
    total = sum(sizes)
    x0 = jnp.concatenate([v.astype(jnp.result_type(*vals)) for v in vals])

    def split(x):
        return [x[a : a + s].astype(v.dtype) for a, s, v in zip(starts, sizes, vals)]

    def extras(k):
        return [jnp.where((k >= a) & (k < a + s), k - a, s) for a, s in zip(starts, sizes)]

    steps = jnp.eye(total, dtype=x0.dtype) * eps
    points = [x0 + steps, x0 - steps] + ([x0 + 2 * steps, x0 - 2 * steps] if richardson else [])
    ks = jnp.tile(jnp.arange(total), len(points))
    evals = jax.vmap(lambda x, k: outputs(split(x), extras(k))[0])(jnp.concatenate(points), ks)
    d1 = (evals[:total] - evals[total : 2 * total]) / (2 * eps)
    res = [{"num": d1.T[:, a : a + s]} for a, s in zip(starts, sizes)]
    if richardson:
        err = _richardson(d1, (evals[2 * total : 3 * total] - evals[3 * total :]) / (4 * eps)).T
        for r, a, s in zip(res, starts, sizes):
            r["fd_err"] = err[:, a : a + s]
    none = [None] * n
    g = lambda x: outputs(split(x), none)[1 if keep_raw else 0]  # noqa: E731
    valid = outputs(vals, none)[2][:, None] if keep_raw else None
    for mode, jac in (("fwd", jax.jacfwd), ("rev", jax.jacrev)):
        if mode in modes:
            table = jac(g)(x0)
            for r, a, s in zip(res, starts, sizes):
                r[mode] = table[:, a : a + s]
                if valid is not None:  # keep_raw
                    r[f"raw/{mode}"] = r[mode]
                    r[mode] = jnp.where(valid, r[mode], 0)
    return res


def _starts(sizes):
    """Where each input begins in the concatenation of inputs of ``sizes`` elements."""
    return [sum(sizes[:k]) for k in range(len(sizes))]


def _richardson(d1, d2):
    """The error of the central difference ``d1`` (step h), estimated from ``d2`` (step 2h):
    their truncation errors are c h^2 and 4 c h^2, so ``|d1 - d2| / 3`` (Richardson's estimate,
    as numdifftools and scipy.differentiate use), which also picks up their rounding noise."""
    return jnp.abs(d1 - d2) / 3


def _projections(outputs, base, leaves, group, specs, sem, modes, eps, valid, rng, richardson=False, scale=None):
    """Random-direction checks ``v^T J u`` (and, under masked semantics, the leaks) of the inputs
    in ``group`` (their positions), as ``{position: result}``, at the point ``base``. ``scale``: the
    outputs' magnitudes; ``res["scale"]`` is ``|v| . scale`` per direction, what the rounding of the
    outputs can move a projected central difference by (times :func:`_roundoff`).

    Each input has its own directions (seeded by its position), but the group's evaluations run
    in one batch: every perturbed point, every tangent and every cotangent of every input of the
    group at once, so the program holds one evaluation of ``f``, one JVP and one VJP for the group.
    Under dense semantics the perturbed input is taken fully specified (array inputs have no
    pattern, so they share a group; any other input is a group of its own); under masked semantics
    every input keeps its pattern, and all share one group."""
    n = len(leaves)
    dense = sem == "dense"
    out_size = valid.shape[0]
    sizes = [leaves[i].size for i in group]
    starts = _starts(sizes)
    dtype = jnp.result_type(*(base[i] for i in group))
    x0 = jnp.concatenate([base[i].astype(dtype) for i in group])
    extras: list = [None] * n
    which = 0 if dense else 1
    analytic: list = [None] * n
    for i in group:
        extras[i] = ALL if dense else None
        analytic[i] = analytic_pattern(leaves[i], sem)

    def F(x, ex, which):
        vs = list(base)
        for i, a, size in zip(group, starts, sizes):
            vs[i] = x[a : a + size].astype(base[i].dtype)
        return outputs(vs, ex)[which]

    def place(k, d):  # directions ``d`` of input ``group[k]`` as directions of the group's vector
        return jnp.zeros((d.shape[0], x0.shape[0]), dtype).at[:, starts[k] : starts[k] + sizes[k]].set(d)

    per = []  # per input: U, V, U_off, V_out
    for k, i in enumerate(group):
        spec = specs[i].astype(dtype)
        ku, kv = jax.random.split(jax.random.fold_in(rng, i))
        U = jax.random.normal(ku, (N_DIRECTIONS, sizes[k]), base[i].dtype).astype(dtype)
        V = jax.random.normal(kv, (N_DIRECTIONS, out_size), base[i].dtype)
        U_off, V_out = U, V
        if not dense:
            V_out, V = V * ~valid, V * valid
            U_off, U = U * (1 - spec), U * spec
        per.append((U, V, U_off, V_out))
    mults = [1.0] + ([2.0] if richardson else [])
    # the directions of every input: (input, multiple of eps, off-mask?) in this order
    dirs = [(k, m, False) for k in range(len(group)) for m in mults]
    if not dense:
        dirs += [(k, 1.0, True) for k in range(len(group))]
    steps = jnp.concatenate([place(k, per[k][2] if off else per[k][0]) * (m * eps) for k, m, off in dirs])
    evals = jax.vmap(lambda x: F(x, extras, 0))(jnp.concatenate([x0 + steps, x0 - steps]))
    evals = evals.reshape((2, len(dirs), N_DIRECTIONS, out_size))
    diffs = {
        d: jnp.sum(per[d[0]][1] * (evals[0, j] - evals[1, j]), axis=1) / (2 * d[1] * eps) for j, d in enumerate(dirs)
    }
    res = {i: {"num": diffs[(k, 1.0, False)]} for k, i in enumerate(group)}
    for k, i in enumerate(group):
        V = per[k][1]
        if scale is not None:
            res[i]["scale"] = jnp.abs(V) @ scale.astype(V.dtype)
        if richardson:
            res[i]["fd_err"] = _richardson(diffs[(k, 1.0, False)], diffs[(k, 2.0, False)])
        if not dense:
            res[i]["num_off"] = diffs[(k, 1.0, True)]  # per direction; the leak is what rounding cannot explain
    g = lambda x: F(x, analytic, which)  # noqa: E731
    if "fwd" in modes:
        tangents = [place(k, per[k][0]) for k in range(len(group))]
        if not dense:
            tangents += [place(k, per[k][2]) for k in range(len(group))]
        t = jax.vmap(lambda u: jax.jvp(g, (x0,), (u,))[1])(jnp.concatenate(tangents))
        t = t.reshape((len(tangents), N_DIRECTIONS, out_size))
        for k, i in enumerate(group):
            V = per[k][1]
            res[i]["fwd"] = jnp.sum(t[k] * V, axis=1)
            if not dense:
                res[i]["fwd_leak_in"] = jnp.max(jnp.abs(jnp.sum(t[len(group) + k] * V, axis=1)), initial=0)
                res[i]["fwd_leak_out"] = jnp.max(jnp.abs(t[k] * ~valid), initial=0)
    if "rev" in modes:
        _, pull = jax.vjp(g, x0)
        cotangents = [per[k][1] for k in range(len(group))] + ([] if dense else [per[k][3] for k in range(len(group))])
        c = jax.vmap(lambda v: pull(v)[0])(jnp.concatenate(cotangents))
        c = c.reshape((len(cotangents), N_DIRECTIONS, x0.shape[0]))
        for k, i in enumerate(group):
            mine = lambda a, k=k: a[:, starts[k] : starts[k] + sizes[k]]  # noqa: E731
            res[i]["rev"] = jnp.sum(mine(c[k]) * per[k][0], axis=1)
            if not dense:
                spec = specs[i].astype(dtype)
                res[i]["rev_leak_in"] = jnp.max(jnp.abs(mine(c[k]) * (1 - spec)), initial=0)
                res[i]["rev_leak_out"] = jnp.max(jnp.abs(mine(c[len(group) + k])), initial=0)
    return res


def _roundoff(dtype, eps) -> float:
    """Per unit of output magnitude, the rounding error a central difference with step ``eps``
    can carry in ``dtype`` (each evaluation is off by about one ulp of the output; the difference
    of two divided by ``2 eps``), with a safety factor of 4: an output of magnitude ``F`` gets
    ``F * roundoff`` more tolerance, so ``var(30 * x)`` in float32 is not failed for rounding."""
    return 4.0 * float(jnp.finfo(dtype).eps) / float(eps)
