"""The masked-semantics probes: NaN, +inf, -inf and a huge value under every mask (and in one
padding slot of a sparse input), the analytical pattern of masked entries, and leak maps.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from masked_jax.checking._batch import ON_VALID, batch_dtype
from masked_jax.checking._inputs import ALL, PADDED


def _leak(a, b):
    """``|a - b|``, infinite where either is NaN or infinite and they differ."""
    same = (a == b) | (jnp.isnan(a) & jnp.isnan(b))
    return jnp.where(same, 0, jnp.where(jnp.isfinite(a) & jnp.isfinite(b), jnp.abs(a - b), jnp.inf))


def probe_rows(batch, leaves, specs, fills, modes, draws):
    """Leak probes: every masked-out element set to NaN, +inf, -inf and a huge value in turn, as
    rows of ``batch`` (a :class:`Batch` of VJPs with ``"rev"`` in ``modes``, of JVPs with
    ``"fwd"`` alone). A function with masked semantics gives the same valid outputs, the same
    output mask, the same tangents of valid outputs along valid inputs (JVP) and the same
    cotangents of valid inputs (VJP) as at the finite fill, and no cotangent (a NaN included) at
    masked-out inputs. Returns ``finish(base)``: with ``base`` the ``(filled, raw, mask)`` outputs
    at the fills, per probe the leak of each output element (values and JVP) and of each input
    element (VJP)."""
    n = len(leaves)
    dtype = batch_dtype(fills)
    spec = jnp.concatenate(specs)
    tangent = draws["tangent"].astype(dtype) * spec
    # the cotangent is on the valid outputs: each row's own, which the probes must not move
    cotangent = draws["cotangent"].astype(dtype)
    # sparse inputs get one padding slot holding the probe value too (its data: a masked-out
    # element's), so that a function reading padding data is caught as one reading masked data
    padded = [PADDED] * n
    smallest = min((np.dtype(leaf.dtype) for leaf in leaves), key=lambda d: d.itemsize)
    values = jnp.array([0, np.nan, np.inf, -np.inf, float(np.sqrt(float(jnp.finfo(smallest).max)))], dtype)
    probe = jnp.arange(values.shape[0]) > 0  # row 0: at the fills
    fill = jnp.concatenate([f.astype(dtype) for f in fills])
    x = jnp.where(spec[None] | ~probe[:, None], fill[None], values[:, None])
    # With reverse mode the VJP probes see every leak a JVP probe would (J^T v at valid and at
    # masked-out inputs covers every entry of J a NaN could sit in); the JVP probe runs alone.
    if batch.kind == "vjp":
        handle = batch.add(x, padded, jnp.broadcast_to(cotangent, (x.shape[0],) + cotangent.shape), True, ON_VALID)
    elif batch.kind == "jvp" and "rev" not in modes:
        handle = batch.add(x, padded, jnp.broadcast_to(tangent, x.shape), True)
    else:
        handle = batch.add(x, padded)

    def finish(base):
        valid = base[2]
        o, d = batch[handle]
        jvp = d if batch.kind == "jvp" and "rev" not in modes else jnp.zeros(o[1].shape, o[1].dtype)
        vjp = d if batch.kind == "vjp" else jnp.zeros(x.shape, x.dtype)
        o, jvp0, jvp, vjp0, vjp = [v[1:] for v in o], jvp[0], jvp[1:], vjp[0], vjp[1:]
        return {
            "value": jnp.where(valid, _leak(o[0], base[0]), 0),
            "mask": jnp.any(o[2] != valid, axis=-1),
            "jvp": jnp.where(valid, _leak(jvp, jvp0), 0),
            # per element of every input end to end (split per input on the host)
            "vjp": jnp.where(spec, _leak(vjp, vjp0), 0),
            # and no cotangent, not even a NaN, reaches the masked-out elements
            "vjp_off": jnp.where(spec, 0, _leak(vjp, jnp.zeros_like(vjp))),
        }

    return finish


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
