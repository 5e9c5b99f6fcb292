"""Random projections ``v^T J u`` of large Jacobians (``fast=True``): their rows in the check's
batches, and what the check compares from them.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from masked_jax.checking._batch import ON_MASKED, ON_VALID, PLAIN, batch_dtype, richardson_error
from masked_jax.checking._inputs import ALL, N_DIRECTIONS
from masked_jax.checking._probes import analytic_pattern


def projection_sets(leaves, sems):
    """The ``(semantics, group)`` sets of :func:`projection_rows` one check needs: under masked
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


def projection_keys(sets):
    """``(keys, off_keys)``: the ``(set, input)`` pairs :func:`projection_rows` checks, in the order
    of its results' rows, and those under masked semantics (which also check the masked-out
    elements), in theirs."""
    keys = [(k, i) for k, (_, group) in enumerate(sets) for i in group]
    return keys, [(k, i) for k, i in keys if sets[k][0] == "masked"]


def projection_rows(batches, leaves, sets, specs, modes, eps, draws, bases, richardson=False):
    """Random-direction checks ``v^T J u`` (and, under masked semantics, the leaks) of the inputs
    of every ``(semantics, group)`` set in ``sets`` (see :func:`projection_sets`) at the point
    ``bases[semantics]``, as rows of ``batches`` (``{"eval", "jvp", "vjp"}`` to :class:`Batch`;
    one batch may serve several). Returns ``finish(valid, scales)``, which reads the run batches:
    the results of every ``(set, input)`` key of :func:`projection_keys` stacked, one row per key
    (``"num"``, ``"scale"``, ``"fwd"``, ``"rev"``, ``"fd_err"``: keys x directions) or per masked
    key (``"num_off"``: x directions; ``"fwd_leak_in"``, ``"fwd_leak_out"``, ``"rev_leak_in"``,
    ``"rev_leak_out"``). ``valid`` is the output mask at the fills and ``scales`` the outputs'
    magnitudes per semantics (``"scale"`` is ``|v| . scale`` per direction, what the rounding of
    the outputs can move a projected central difference by, times :func:`_roundoff`).

    Each input has its own directions (its columns of ``draws["u"]``, its slice of
    ``draws["v"]``: the same under both semantics). The vector they act on is every input's
    elements end to end; each row carries its own base point and the patterns its set takes the
    inputs at (a ``MaskedArray`` input is fully specified for the input under dense semantics;
    its own pattern otherwise). A cotangent on the valid outputs is one on the row's own valid
    outputs (:data:`ON_VALID`), so that the rows need no evaluation before them. Every step is
    one array operation over all keys: the program does not grow with the number of inputs.
    Sparse inputs change structure when fully specified: a set with one takes batches of its
    own."""
    n = len(leaves)
    out_size = batches["eval"].out_size
    sizes = [leaf.size for leaf in leaves]
    total = sum(sizes)
    dtype = batch_dtype([b for base in bases.values() for b in base])
    x0s = {sem: jnp.concatenate([b.astype(dtype) for b in base]) for sem, base in bases.items()}
    U_all, V_all = draws["u"].astype(dtype), draws["v"].astype(dtype)
    spec = jnp.concatenate(specs).astype(dtype)
    owner = jnp.asarray(np.repeat(np.arange(n, dtype=np.int32), sizes))  # the input of each element

    def extras(k, analytic):
        sem, group = sets[k]
        if sem != "dense":
            return [None] * n
        return [(analytic_pattern(leaves[i], sem) if analytic else ALL) if i in group else None for i in range(n)]

    def columns(inputs, on):  # per row: the inputs' elements, those specified (1), masked out (-1) or all (0)
        mine = (owner[None] == jnp.asarray(inputs, jnp.int32)[:, None]).astype(dtype)
        on = jnp.asarray(on, dtype)[:, None]
        return mine * jnp.where(on > 0, spec[None], jnp.where(on < 0, 1 - spec[None], 1))

    mults = [1.0] + ([2.0] if richardson else [])
    # the directions, a set's together: (set, input, multiple of eps, off-mask?)
    dirs = []
    for k, (sem, group) in enumerate(sets):
        dirs += [(k, i, m, False) for i in group for m in mults]
        dirs += [(k, i, 1.0, True) for i in group if sem == "masked"]
    keys, off_keys = projection_keys(sets)
    masked_keys = np.array([sets[k][0] == "masked" for k, _ in keys])
    d_masked = np.array([sets[k][0] == "masked" for k, *_ in dirs])
    d_on = [(-1 if off else 1) if sets[k][0] == "masked" else 0 for k, _, _, off in dirs]
    steps = (
        U_all[None]
        * columns([i for _, i, _, _ in dirs], d_on)[:, None]
        * jnp.asarray([m * eps for _, _, m, _ in dirs], dtype)[:, None, None]
    )
    span = {}

    def add(kind, k, rows, **kw):  # rows of set ``k``, after the same kind's rows of the sets before
        handle = batches[kind].add(
            rows.reshape((int(np.prod(rows.shape[:-1])), total)), extras(k, kind != "eval"), **kw
        )
        span[kind] = (span.get(kind, handle)[0], handle[1])

    for k, (sem, _) in enumerate(sets):  # each set's perturbed points, +step and -step per direction
        mine = np.array([d[0] == k for d in dirs])
        add("eval", k, jnp.stack([x0s[sem] + steps[mine], x0s[sem] - steps[mine]], axis=1))
    key_on = [1 if m else 0 for m in masked_keys]
    key_inputs = [i for _, i in keys]
    off_inputs = [i for _, i in off_keys]
    ks = np.array([k for k, _ in keys])
    for kind, mode in (("jvp", "fwd"), ("vjp", "rev")):
        if mode not in modes:
            continue
        for k, (sem, _) in enumerate(sets):
            mine = np.flatnonzero(ks == k)
            x = jnp.broadcast_to(x0s[sem], (len(mine) * N_DIRECTIONS, total))
            masked = sem == "masked"
            if kind == "jvp":
                u = U_all[None] * columns([key_inputs[j] for j in mine], [key_on[j] for j in mine])[:, None]
                add(kind, k, x, direction=u.reshape(x.shape), raw=masked)
            else:
                v = V_all[np.asarray([key_inputs[j] for j in mine], int)].reshape((x.shape[0], out_size))
                add(kind, k, x, direction=v, raw=masked, code=ON_VALID if masked else PLAIN)
        if off_keys:  # the masked-out elements' rows, after every set's
            k = off_keys[0][0]
            x = jnp.broadcast_to(x0s["masked"], (len(off_keys) * N_DIRECTIONS, total))
            if kind == "jvp":
                u = U_all[None] * columns(off_inputs, [-1] * len(off_keys))[:, None]
                span["jvp_off"] = batches[kind].add(x, extras(k, True), u.reshape(x.shape), True)
            else:
                v = V_all[np.asarray(off_inputs, int)].reshape((x.shape[0], out_size))
                span["vjp_off"] = batches[kind].add(x, extras(k, True), v, True, ON_MASKED)

    def finish(valid, scales):
        def V(inputs, masked, on=valid):  # the inputs' output directions, on ``on`` under masked semantics
            return V_all[np.asarray(inputs, int)] * jnp.where(jnp.asarray(masked)[:, None, None], on[None, None], True)

        o = batches["eval"][span["eval"]][0]
        e = jnp.where(
            jnp.asarray(d_masked)[:, None, None, None],
            o[1].reshape((len(dirs), 2, N_DIRECTIONS, out_size)),
            o[0].reshape((len(dirs), 2, N_DIRECTIONS, out_size)),
        )
        diffs = jnp.sum(V([i for _, i, _, _ in dirs], d_masked) * (e[:, 0] - e[:, 1]), axis=-1)
        diffs = diffs / (2 * eps * jnp.asarray([m for _, _, m, _ in dirs], dtype)[:, None])
        at = {d: j for j, d in enumerate(dirs)}
        Vk = V(key_inputs, masked_keys)
        either = next(iter(scales.values()))  # (a check of one semantics has one)
        masked_scale, dense_scale = scales.get("masked", either), scales.get("dense", either)
        scale = jnp.where(jnp.asarray(masked_keys)[:, None], masked_scale[None], dense_scale[None]).astype(dtype)
        res = {
            "num": diffs[np.array([at[k, i, 1.0, False] for k, i in keys])],
            "scale": jnp.sum(jnp.abs(Vk) * scale[:, None], -1),
        }
        if richardson:
            res["fd_err"] = richardson_error(res["num"], diffs[np.array([at[k, i, 2.0, False] for k, i in keys])])
        if off_keys:  # per direction; the leak is what rounding cannot explain
            res["num_off"] = diffs[np.array([at[k, i, 1.0, True] for k, i in off_keys])]
        on_off = np.flatnonzero(masked_keys)
        if "fwd" in modes:
            t = batches["jvp"][span["jvp"]][1].reshape((len(keys), N_DIRECTIONS, out_size))
            res["fwd"] = jnp.sum(t * Vk, axis=-1)
            if off_keys:
                t_off = batches["jvp"][span["jvp_off"]][1].reshape((len(off_keys), N_DIRECTIONS, out_size))
                res["fwd_leak_in"] = jnp.max(jnp.abs(jnp.sum(t_off * Vk[on_off], axis=-1)), axis=-1, initial=0)
                res["fwd_leak_out"] = jnp.max(jnp.abs(t[on_off] * ~valid), axis=(1, 2), initial=0)
        if "rev" in modes:
            c = batches["vjp"][span["vjp"]][1].reshape((len(keys), N_DIRECTIONS, total))
            res["rev"] = jnp.sum(c * U_all[None] * columns(key_inputs, key_on)[:, None], axis=-1)
            if off_keys:
                c_off = batches["vjp"][span["vjp_off"]][1].reshape((len(off_keys), N_DIRECTIONS, total))
                res["rev_leak_in"] = jnp.max(
                    jnp.abs(c[on_off] * columns(off_inputs, [-1] * len(off_keys))[:, None]), axis=(1, 2), initial=0
                )
                res["rev_leak_out"] = jnp.max(
                    jnp.abs(c_off * columns(off_inputs, [0] * len(off_keys))[:, None]), axis=(1, 2), initial=0
                )
        return res

    return finish


def unstack_projections(res, sets):
    """:func:`projection_rows`' results (on the host, each set's stacked after the one before) as
    ``{"<position>/<semantics>": result}``, the form the verdict reads."""
    keys, off_keys = projection_keys(sets)
    out = {}
    for j, (k, i) in enumerate(keys):
        r = {name: res[name][j] for name in ("num", "scale", "fd_err", "fwd", "rev") if name in res}
        if (k, i) in off_keys:
            o = off_keys.index((k, i))
            r.update({name: res[name][o] for name in OFF_NAMES if name in res})
        out[f"{i}/{sets[k][0]}"] = r
    return out


OFF_NAMES = ("num_off", "fwd_leak_in", "fwd_leak_out", "rev_leak_in", "rev_leak_out")
