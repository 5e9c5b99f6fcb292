"""Numerical Jacobians: perturbations of every input batched with ``vmap``, Richardson extrapolation,
random projections of large Jacobians, the round-off scale, and the tables each check compares.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from masked_jax.checking._inputs import ALL, N_DIRECTIONS, random_directions
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

    owns = [leaf.kind != "array" for leaf in leaves]  # inputs that can have masked-out elements (a map each)
    if leak_map == "only":  # at the fills, as in the whole check (the same seed)
        base = [e[0] for e in jax.vmap(lambda vs: outputs(vs, [None] * n))([f[None] for f in fills])]
        return {"leak_map": [_leak_map(outputs, specs, fills, base, modes, i) if owns[i] else None for i in range(n)]}
    points = [fills] if specified else [fills, alts] + ([vals] if "dense" in sems else [])
    joint_ok = not fast and "dense" in sems and n > 1 and all(leaf.kind in ("array", "masked") for leaf in leaves)
    if joint_ok:  # these points and the joint tables' perturbed ones: one batch, one evaluation of f
        perturbed, evals = _joint_evaluations(outputs, leaves, vals, eps, richardson, points)
    else:
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
            out["leak_map"] = [
                _leak_map(outputs, specs, fills, base_m, modes, i) if owns[i] else None for i in range(n)
            ]
    same = specified and plain[0] and not fast and "dense" in sems  # the two semantics: one check
    joint = None
    if joint_ok:  # every input's dense tables from one batch of evaluations over all inputs at once
        keep = not same and _shares_tables(leaves[0], sems, fast, probes)
        joint = _joint_tables(outputs, leaves, vals, modes, eps, perturbed, evals[2][-1], richardson, keep)
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
                if f"{i}/{sem}" not in out:  # every set in one batch; a sparse input's sets apart
                    sets = _projection_sets(leaves, sems)
                    sparse = any(lf.kind not in ("array", "masked") for lf in leaves)
                    for batch in [[st] for st in sets] if sparse else [sets]:
                        out.update(
                            _projections(
                                outputs,
                                {"dense": vals, "masked": fills},
                                leaves,
                                batch,
                                specs,
                                modes,
                                eps,
                                out["valid"],
                                rng,
                                richardson,
                                {s: out[f"scale/{s}"] for s in sems},
                            )  # fmt: skip
                        )
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


def _joint_evaluations(outputs, leaves, vals, eps, richardson, points):
    """The evaluations :func:`_joint_tables` differences (every input element perturbed by
    ``+-eps``, and ``+-2 eps`` with ``richardson``: the perturbed element specified, by its index in
    its own input; an out-of-range index, none, for the others), and ``outputs`` at ``points``
    (lists of every input's values, nothing specified on top), in one batch: ``(the perturbed
    points' filled outputs, the points' (filled, raw, mask) stacked)``."""
    sizes = [leaf.size for leaf in leaves]
    starts, total = _starts(sizes), sum(sizes)
    dtype = jnp.result_type(*vals)
    x0 = jnp.concatenate([v.astype(dtype) for v in vals])
    steps = jnp.eye(total, dtype=dtype) * eps
    rows = [x0 + steps, x0 - steps] + ([x0 + 2 * steps, x0 - 2 * steps] if richardson else [])
    rows += [jnp.stack([jnp.concatenate([v.astype(dtype) for v in p]) for p in points])]
    ks = jnp.concatenate([jnp.tile(jnp.arange(total), len(rows) - 1), jnp.full(len(points), total)])

    def one(x, k):
        extras = [jnp.where((k >= a) & (k < a + size), k - a, size) for a, size in zip(starts, sizes)]
        return outputs(_split(x, starts, sizes, vals), extras)

    evals = jax.vmap(one)(jnp.concatenate(rows), ks)
    cut = ks.shape[0] - len(points)
    return evals[0][:cut], tuple(e[cut:] for e in evals)


def _joint_tables(outputs, leaves, vals, modes, eps, evals, valid, richardson=False, keep_raw=False):
    """:func:`_tables` under dense semantics for every input at once, as a list of their results:
    central differences of ``evals`` (:func:`_joint_evaluations`), and ``jacfwd`` / ``jacrev`` of
    the outputs in all the inputs' elements, split into each input's columns. One evaluation of
    ``f``, one JVP and one VJP in the program, however many inputs (pytree leaves) ``f`` takes.
    ``valid``: the output mask at ``vals`` (with ``keep_raw``), from the caller's evaluations."""
    n = len(leaves)
    sizes = [leaf.size for leaf in leaves]
    starts = _starts(sizes)
    total = sum(sizes)
    x0 = jnp.concatenate([v.astype(jnp.result_type(*vals)) for v in vals])

    d1 = (evals[:total] - evals[total : 2 * total]) / (2 * eps)
    res = [{"num": d1.T[:, a : a + s]} for a, s in zip(starts, sizes)]
    if richardson:
        err = _richardson(d1, (evals[2 * total : 3 * total] - evals[3 * total :]) / (4 * eps)).T
        for r, a, s in zip(res, starts, sizes):
            r["fd_err"] = err[:, a : a + s]
    none = [None] * n
    g = lambda x: outputs(_split(x, starts, sizes, vals), none)[1 if keep_raw else 0]  # noqa: E731
    valid = valid[:, None] if keep_raw else None
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


def _split(x, starts, sizes, like):
    """The vector ``x`` of every input's elements end to end, as the inputs, each in the dtype of
    its counterpart in ``like``."""
    return [x[a : a + size].astype(v.dtype) for a, size, v in zip(starts, sizes, like)]


def _richardson(d1, d2):
    """The error of the central difference ``d1`` (step h), estimated from ``d2`` (step 2h):
    their truncation errors are c h^2 and 4 c h^2, so ``|d1 - d2| / 3`` (Richardson's estimate,
    as numdifftools and scipy.differentiate use), which also picks up their rounding noise."""
    return jnp.abs(d1 - d2) / 3


def _projection_sets(leaves, sems):
    """The ``(semantics, group)`` sets of :func:`_projections` one check needs: under masked
    semantics every input in one group; under dense semantics the arrays together (they have no
    pattern) and each other input alone (it is taken fully specified, the others keep theirs)."""
    sets = []
    for sem in sems:
        if sem == "masked":
            sets.append((sem, tuple(range(len(leaves)))))
            continue
        arrays = tuple(i for i, leaf in enumerate(leaves) if leaf.kind == "array")
        sets += [(sem, arrays)] if arrays else []
        sets += [(sem, (i,)) for i, leaf in enumerate(leaves) if leaf.kind != "array"]
    return sets


def _projections(outputs, bases, leaves, sets, specs, modes, eps, valid, rng, richardson=False, scales=None):
    """Random-direction checks ``v^T J u`` (and, under masked semantics, the leaks) of the inputs
    of every ``(semantics, group)`` set in ``sets`` (see :func:`_projection_sets`), as
    ``{"<position>/<semantics>": result}``, at the point ``bases[semantics]``. ``scales``: the
    outputs' magnitudes per semantics; ``res["scale"]`` is ``|v| . scale`` per direction, what the
    rounding of the outputs can move a projected central difference by (times :func:`_roundoff`).

    Each input has its own directions (seeded by its position, the same under both semantics),
    and all the sets' evaluations run in one batch: every perturbed point, every tangent and every
    cotangent of every input of every set at once, so the program holds one evaluation of ``f``,
    one JVP and one VJP however many inputs and sets there are. The vector they act on is every
    input's elements end to end; each row of the batch carries its own base point and the patterns
    its set takes the inputs at (a ``MaskedArray`` input's mask is an operand: all of it specified,
    for the input under dense semantics, or its own). Sparse inputs change structure when fully
    specified, so a set with one runs as a batch of its own (``sets`` of one element)."""
    n = len(leaves)
    out_size = valid.shape[0]
    sizes = [leaf.size for leaf in leaves]
    starts = _starts(sizes)
    dtype = jnp.result_type(*(b for base in bases.values() for b in base))
    # per set: the base vector, and what each input's ``extra`` is for its evaluations and Jacobians
    x0s = {sem: jnp.concatenate([b.astype(dtype) for b in base]) for sem, base in bases.items()}
    single = len(sets) == 1
    masks = [leaf.kind == "masked" for leaf in leaves]  # inputs whose extra can be an operand

    def extra(i, sem, group, analytic):
        if sem == "dense" and i in group:
            return analytic_pattern(leaves[i], sem) if analytic else ALL
        return None

    def static_extras(sem, group, analytic):
        return [extra(i, sem, group, analytic) for i in range(n)]

    # per input: U, V, U_off, V_out under each semantics. Two draws for all inputs (each input's
    # directions are its own columns of U_all, its own slice of V_all): one random-number
    # program instead of two per input, which compiled to most of a many-input check
    total = sum(sizes)
    ku, kv = jax.random.split(rng)
    U_all = random_directions(ku, (N_DIRECTIONS, total), dtype)
    V_all = random_directions(kv, (n, N_DIRECTIONS, out_size), dtype)
    per = {}
    for i in range(n):
        U = U_all[:, starts[i] : starts[i] + sizes[i]]
        V = V_all[i].astype(bases[sets[0][0]][i].dtype)
        per[i, "dense"] = (U, V, U, V)
        spec = specs[i].astype(dtype)
        per[i, "masked"] = (U * spec, V * valid, U * (1 - spec), V * ~valid)

    def place(i, d):  # directions ``d`` of input ``i`` as directions of the vector of all inputs
        return jnp.pad(d, ((0, 0), (starts[i], total - starts[i] - sizes[i])))

    def batch(rows):
        """Rows ``(set index, vector)`` -> (base points, raw-output flags, extras, analytic extras)
        per row of ``N_DIRECTIONS``."""
        reps = [v.shape[0] for _, v in rows]
        where = [k for (k, _), r in zip(rows, reps) for _ in range(r)]
        x0 = jnp.stack([x0s[sets[k][0]] for k in where])
        raw = jnp.asarray([sets[k][0] == "masked" for k in where])
        ex = [  # a MaskedArray input's extra: the elements specified on top of its pattern
            None
            if single or not masks[i]
            else jnp.stack([jnp.full(sizes[i], extra(i, sets[k][0], sets[k][1], a) is ALL) for k in where])
            for a in (False, True)
            for i in range(n)
        ]
        return x0, raw, ex[:n], ex[n:]

    def F(x, ex, analytic=False):  # (filled, raw) outputs at the vector ``x``
        extras = static_extras(sets[0][0], sets[0][1], analytic) if single else ex
        return outputs(_split(x, starts, sizes, leaves), extras)[:2]

    def pick(pair, raw):  # each row's outputs: raw under masked semantics, else filled
        return jnp.where(raw[:, None], pair[1], pair[0])

    mults = [1.0] + ([2.0] if richardson else [])
    # the directions: (set, input, multiple of eps, off-mask?) in this order
    dirs = [(k, i, m, False) for k, (_, group) in enumerate(sets) for i in group for m in mults]
    dirs += [(k, i, 1.0, True) for k, (sem, group) in enumerate(sets) if sem == "masked" for i in group]
    rows = [(k, place(i, per[i, sets[k][0]][2 if off else 0]) * (m * eps)) for k, i, m, off in dirs]
    x0, raw, ex, _ = batch(rows)
    steps = jnp.concatenate([v for _, v in rows])
    points = jnp.concatenate([x0 + steps, x0 - steps])
    both = jax.tree_util.tree_map(lambda *a: None if a[0] is None else jnp.concatenate(a), ex, ex)
    evals = pick(jax.vmap(F)(points, both), jnp.concatenate([raw, raw]))
    evals = evals.reshape((2, len(dirs), N_DIRECTIONS, out_size))
    diffs = {
        d: jnp.sum(per[d[1], sets[d[0]][0]][1] * (evals[0, j] - evals[1, j]), axis=1) / (2 * d[2] * eps)
        for j, d in enumerate(dirs)
    }
    res = {(k, i): {"num": diffs[(k, i, 1.0, False)]} for k, (_, group) in enumerate(sets) for i in group}
    for (k, i), r in res.items():
        sem = sets[k][0]
        V = per[i, sem][1]
        if scales is not None:
            r["scale"] = jnp.abs(V) @ scales[sem].astype(V.dtype)
        if richardson:
            r["fd_err"] = _richardson(diffs[(k, i, 1.0, False)], diffs[(k, i, 2.0, False)])
        if sem == "masked":
            r["num_off"] = diffs[(k, i, 1.0, True)]  # per direction; the leak is what rounding cannot explain
    keys = list(res)  # (set, input), in the order of the rows below
    off_keys = [(k, i) for k, i in keys if sets[k][0] == "masked"]

    def derivatives(rows, fn):
        """``fn(base point, vector, extras, raw outputs?)`` for every row, one batch (the primal
        point shared when there is one set); and each row's raw-output flag."""
        x, raw, _, ex = batch(rows)
        vecs = jnp.concatenate([v for _, v in rows])
        if single:
            return jax.vmap(lambda v, r: fn(x0s[sets[0][0]], v, None, r))(vecs, raw), raw
        return jax.vmap(fn)(x, vecs, ex, raw), raw

    if "fwd" in modes:
        rows = [(k, place(i, per[i, sets[k][0]][0])) for k, i in keys]
        rows += [(k, place(i, per[i, "masked"][2])) for k, i in off_keys]
        t = pick(*derivatives(rows, lambda x, u, e, _: jax.jvp(lambda y: F(y, e, True), (x,), (u,))[1]))
        t = t.reshape((len(rows), N_DIRECTIONS, out_size))
        for j, key in enumerate(keys):
            V = per[key[1], sets[key[0]][0]][1]
            res[key]["fwd"] = jnp.sum(t[j] * V, axis=1)
        for j, key in enumerate(off_keys):
            V = per[key[1], "masked"][1]
            res[key]["fwd_leak_in"] = jnp.max(jnp.abs(jnp.sum(t[len(keys) + j] * V, axis=1)), initial=0)
            res[key]["fwd_leak_out"] = jnp.max(jnp.abs(t[keys.index(key)] * ~valid), initial=0)
    if "rev" in modes:
        rows = [(k, per[i, sets[k][0]][1]) for k, i in keys] + [(k, per[i, "masked"][3]) for k, i in off_keys]

        def pull(x, v, e, raw):  # the cotangent ``v`` on the raw outputs, or on the filled ones
            (filled, raw_out), vjp = jax.vjp(lambda y: F(y, e, True), x)
            return vjp((jnp.where(raw, 0, v).astype(filled.dtype), jnp.where(raw, v, 0).astype(raw_out.dtype)))[0]

        c, _ = derivatives(rows, pull)
        c = c.reshape((len(rows), N_DIRECTIONS, c.shape[-1]))
        for j, (k, i) in enumerate(keys):
            mine = lambda a, i=i: a[:, starts[i] : starts[i] + sizes[i]]  # noqa: E731
            U = per[i, sets[k][0]][0]
            res[k, i]["rev"] = jnp.sum(mine(c[j]) * U, axis=1)
            if sets[k][0] == "masked":
                spec = specs[i].astype(dtype)
                res[k, i]["rev_leak_in"] = jnp.max(jnp.abs(mine(c[j]) * (1 - spec)), initial=0)
                res[k, i]["rev_leak_out"] = jnp.max(jnp.abs(mine(c[len(keys) + off_keys.index((k, i))])), initial=0)
    return {f"{i}/{sets[k][0]}": r for (k, i), r in res.items()}


def _roundoff(dtype, eps) -> float:
    """Per unit of output magnitude, the rounding error a central difference with step ``eps``
    can carry in ``dtype`` (each evaluation is off by about one ulp of the output; the difference
    of two divided by ``2 eps``), with a safety factor of 4: an output of magnitude ``F`` gets
    ``F * roundoff`` more tolerance, so ``var(30 * x)`` in float32 is not failed for rounding."""
    return 4.0 * float(jnp.finfo(dtype).eps) / float(eps)
