"""The masked-semantics probes: NaN, +inf, -inf and a huge value under every mask (and in one
padding slot of a sparse input), the analytical pattern of masked entries, and leak maps.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from masked_jax.checking._inputs import ALL, PADDED, random_directions


def _leak(a, b):
    """``|a - b|``, infinite where either is NaN or infinite and they differ."""
    same = (a == b) | (jnp.isnan(a) & jnp.isnan(b))
    return jnp.where(same, 0, jnp.where(jnp.isfinite(a) & jnp.isfinite(b), jnp.abs(a - b), jnp.inf))


def _probes(outputs, leaves, specs, fills, base, modes, rng):
    """Leak probes: every masked-out element set to NaN, +inf, -inf and a huge value in turn (one
    ``vmap`` over the probes). A function with masked semantics gives the same valid outputs, the
    same output mask, the same tangents of valid outputs along valid inputs (JVP) and the same
    cotangents of valid inputs (VJP) as at the finite fill, and no cotangent (a NaN included) at
    masked-out inputs. Returns, per probe, the leak of each
    output element (values and JVP) and of each input element (VJP)."""
    n = len(leaves)
    valid = base[2]
    keys = jax.random.split(rng, 2 * n)
    tangents = [random_directions(keys[i], f.shape, f.dtype) * s for i, (f, s) in enumerate(zip(fills, specs))]
    cotangent = random_directions(keys[n], valid.shape, base[1].dtype) * valid

    # sparse inputs get one padding slot holding the probe value too (its data: a masked-out
    # element's), so that a function reading padding data is caught as one reading masked data
    padded = [PADDED] * n

    def raw(vs):  # the raw outputs, and the filled ones and the mask aside
        o = outputs(vs, padded)
        return o[1], (o[0], o[2])

    # With reverse mode the VJP probes see every leak a JVP probe would (J^T v at valid and at
    # masked-out inputs covers every entry of J a NaN could sit in); the JVP probe runs alone.
    forward = "fwd" in modes and "rev" not in modes

    def one(value, probe):  # at the fills (probe False), or with ``value`` under every mask
        vs = [jnp.where(s | ~probe, f, value.astype(f.dtype)) for f, s in zip(fills, specs)]
        jvp, vjp = jnp.zeros_like(valid, base[1].dtype), [jnp.zeros_like(v) for v in vs]
        if "rev" in modes:  # the outputs are the VJP's forward pass: one evaluation of f
            out, pull, (filled, mask) = jax.vjp(raw, vs, has_aux=True)
            vjp = pull(cotangent)[0]
        elif forward:
            out, jvp, (filled, mask) = jax.jvp(raw, (vs,), (tangents,), has_aux=True)
        else:
            out, (filled, mask) = raw(vs)
        return (filled, out, mask), (jvp, vjp)

    dtype = min((np.dtype(leaf.dtype) for leaf in leaves), key=lambda d: d.itemsize)
    values = jnp.array([0, np.nan, np.inf, -np.inf, float(np.sqrt(float(jnp.finfo(dtype).max)))], dtype)
    # the fills' derivatives and the probes' in one batch: one evaluation, JVP and VJP in the program
    o, (jvp, vjp) = jax.vmap(one)(values, jnp.arange(len(values)) > 0)
    jvp0, vjp0 = jvp[0], [a[0] for a in vjp]
    o, jvp, vjp = [x[1:] for x in o], jvp[1:], [a[1:] for a in vjp]
    return {
        "value": jnp.where(valid, _leak(o[0], base[0]), 0),
        "mask": jnp.any(o[2] != valid, axis=-1),
        "jvp": jnp.where(valid, _leak(jvp, jvp0), 0),
        "vjp": [jnp.where(s, _leak(a, b), 0) for a, b, s in zip(vjp, vjp0, specs)],
        # and no cotangent, not even a NaN, reaches the masked-out elements
        "vjp_off": [jnp.where(s, 0, _leak(a, jnp.zeros_like(a))) for a, s in zip(vjp, specs)],
    }


PROBE_NAMES = ("NaN", "+inf", "-inf", "a huge value")


def _leak_map(outputs, specs, fills, base, modes, i):
    """How much the masked-out elements of input ``i`` reach the valid outputs (full mode; past
    ``atol`` it is a leak): ``value`` (outputs x elements): how far the output moves when that
    element alone holds NaN (infinite when it turns NaN); ``gradient``: the Jacobian entry, taken
    with NaN under every mask (infinite when NaN). Valid elements' columns are 0."""
    n = len(specs)
    spec, valid = specs[i], base[2]
    nan = jnp.asarray(np.nan, fills[i].dtype)

    def one(k):  # every element in turn (the pattern may be an operand); valid ones keep their fill
        vs = list(fills)
        vs[i] = fills[i].at[k].set(jnp.where(spec[k], fills[i][k], nan))
        return jnp.where(valid & ~spec[k], _leak(outputs(vs, [None] * n)[0], base[0]), 0)

    value = jax.vmap(one)(jnp.arange(spec.shape[0])).T
    poisoned = [jnp.where(s, f, nan) for s, f in zip(specs, fills)]

    def raw(v):
        vs = list(poisoned)
        vs[i] = v
        return outputs(vs, [None] * n)[1]

    jac = (jax.jacrev if "rev" in modes else jax.jacfwd)(raw)(poisoned[i])
    gradient = jnp.where(valid[:, None] & ~spec, jnp.where(jnp.isnan(jac), jnp.inf, jnp.abs(jac)), 0)
    return {"value": value, "gradient": gradient}  # sizes of the leaks; past atol they are leaks


def analytic_pattern(leaf, sem):
    """The pattern the analytical Jacobian is taken at: the original one, except for a jax BCOO under
    dense semantics, whose unspecified elements *are* zeros (so all are specified, as explicit 0s).
    A masked layout keeps its pattern: specifying a masked-out element would move the point."""
    return ALL if sem == "dense" and leaf.kind == "bcoo" else None


LEAK_KINDS = ((1, "value"), (2, "gradient"), (4, "numerical"))


def _leak_cells(cells, num, ok_rows, spec, atol):
    """(outputs x input elements) bit set: 1 value, 2 gradient (the NaN probes of the leak map), 4
    numerical (perturbing the masked-out element moves the valid output by more than ``atol``)."""
    out = np.zeros(num.shape, np.uint8) if cells is None else cells.copy()
    off = ~spec
    moved = np.zeros(num.shape, bool)
    moved[np.ix_(ok_rows, off)] = ~(np.abs(num[np.ix_(ok_rows, off)]) <= atol)
    out |= moved.astype(np.uint8) << 2
    return out


def _leak_entries(full, oshape, ishape):
    """The leak map ``full`` (see :func:`_leak_cells`) as ``[(input index, output index, kinds)]``:
    every leaking pair, by input element, then output element."""
    entries = []
    for k, r in zip(*np.nonzero(np.asarray(full).T)):
        kinds = tuple(name for bit, name in LEAK_KINDS if full[r, k] & bit)
        entries.append((_unravel(int(k), ishape), _unravel(int(r), oshape), kinds))
    return entries


def _leak_passed(leaks, atol):
    return all(np.isfinite(v) and v <= atol for v in leaks.values())


def _unravel(i, shape):
    """``np.unravel_index(i, shape)`` as a tuple of ints, without numpy's per-call overhead."""
    out = []
    for d in reversed(shape):
        i, r = divmod(i, d)
        out.append(r)
    return tuple(reversed(out))
