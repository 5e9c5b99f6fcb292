"""The verdict: a second small program that judges the tables where they are, and the comparison
of numerical and analytical Jacobians into the report's checks, failures and reasons.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from masked_jax.checking._compile import fast_jit
from masked_jax.checking._finite_diff import POINT_LEAKS, _shares_tables
from masked_jax.checking._inputs import NEAR_MISS, SPARSE_KINDS
from masked_jax.checking._probes import PROBE_NAMES, _leak_cells, _leak_entries, _leak_passed, _unravel
from masked_jax.checking._report import Check

JUDGED = (
    "passed",
    "max_abs",
    "near_miss",
    "max_rel",
    "fd_error",
    "numerical, masked-out inputs",
    "analytical, masked-out inputs",
    "analytical, masked-out outputs",
)


@functools.lru_cache(maxsize=256)
def _row_blocks(names):
    """The rows of each output in the flat output vector (``names``: a tuple)."""
    offsets = np.cumsum([0] + [int(np.prod(s, dtype=np.int64)) for _, s in names])
    return [slice(int(a), int(b)) for a, b in zip(offsets[:-1], offsets[1:])]


def _judge(out, tol, names, sems, modes, xp=jnp):
    """What decides every full-table check: one row of :data:`JUDGED` per input x semantics x output
    x mode (the order :func:`_compare` reads them in), in the array namespace ``xp``.

    With ``jnp`` it is a program of its own (:func:`_judged`), compiled once per table shape and
    run where the tables are; the host copies them only for the details a report shows on demand.
    Inside the check's program XLA would fuse the tables' computation into every reduction of them
    and compute each table many times; and all checks of one input and output take one (variadic)
    reduction, as many small reductions compile slowly.
    """
    atol, rtol, roundoff = tol
    judged = {}
    for i, spec in enumerate(out["specs"]):
        for j, rows in enumerate(_row_blocks(tuple(names))):
            terms, where = [], []  # per check: the entries whose largest values decide it
            for sem in sems:
                res = out[f"{i}/{sem}"]
                num = res["num"][rows]
                fd = res["fd_err"][rows] if "fd_err" in res else None
                scale = out[f"scale/{sem}"][rows].astype(num.dtype) * roundoff
                masked = sem == "masked"
                ok = (out["valid"][rows] if masked else xp.ones(num.shape[0], bool))[:, None]
                cols = (spec if masked else xp.ones(num.shape[1], bool))[None, :]
                compared = ok & cols
                abs_num = xp.abs(num)
                big = compared & (abs_num > atol)
                for mode in modes:
                    an = res[mode][rows]
                    err, allowed, excess = _errors(xp, num, an, 0 if fd is None else fd, scale, atol, rtol)
                    where.append((i, sem, j, mode))
                    terms.append(
                        [
                            compared & ~(excess <= 0),
                            xp.where(compared, err, 0),  # a NaN fails
                            compared & ~(err <= NEAR_MISS * allowed),
                            xp.where(big, err / xp.where(big, abs_num, 1), 0),
                            None if fd is None else xp.where(compared & ~xp.isnan(fd), fd, 0),
                            # perturbing a masked-out input moves a valid output more than rounding explains
                            xp.where(ok & ~cols, abs_num - scale[:, None], 0) if masked else None,
                            xp.where(~cols, xp.abs(an), 0) if masked else None,
                            xp.where(~ok, xp.abs(an), 0) if masked else None,
                        ]
                    )
            dtype = terms[0][1].dtype
            peaks = iter(_maxima(xp, [xp.asarray(t, dtype) for ts in terms for t in ts if t is not None]))
            for key, ts in zip(where, terms):
                fail, top, far, rel, fd_max, moved, leak_in, leak_out = (
                    xp.zeros((), dtype) if t is None else next(peaks) for t in ts
                )
                # a NaN among the entries is an infinite error (the relative one: where the absolute one is)
                inf = lambda v, nan: xp.where(xp.isnan(nan), xp.inf, v)  # noqa: E731
                judged[key] = xp.stack(
                    [
                        fail == 0,
                        inf(top, top),
                        (fail > 0) & (far == 0),
                        inf(rel, top),
                        fd_max,
                        inf(moved, moved),
                        inf(leak_in, leak_in),
                        inf(leak_out, leak_out),
                    ]
                ).astype(dtype)
    return xp.stack(
        [
            judged[(i, sem, j, mode)]
            for i in range(len(out["specs"]))
            for sem in sems
            for j in range(len(names))
            for mode in modes
        ]
    )


@functools.partial(fast_jit, static_argnames=("names", "sems", "modes"))
def _judged(out, tol, rest, names, sems, modes):
    """:func:`_judge` where the tables are, and the check's other (small) results ``rest`` as one
    float64 vector, so that one copy brings everything the host needs."""
    flat = [jnp.ravel(x).astype(jnp.float64 if jax.config.read("jax_enable_x64") else jnp.float32) for x in rest]
    return _judge(out, tol, names, sems, modes), jnp.concatenate(flat) if flat else jnp.zeros(0)


def _maxima(xp, arrays):
    """The largest entry (at least 0, NaN if one is NaN) of each of ``arrays``, all of one shape:
    one variadic reduction under ``jnp``."""
    if xp is np:
        return [np.max(a, initial=0) for a in arrays]
    return jax.lax.reduce(
        arrays,
        [jnp.zeros((), a.dtype) for a in arrays],
        lambda a, b: [jnp.maximum(x, y) for x, y in zip(a, b)],
        tuple(range(arrays[0].ndim)),
    )


def _errors(xp, num, an, fd, scale, atol, rtol):
    """``(|num - an|, tolerance, excess)`` of a full table, in the array namespace ``xp`` (``jnp``
    where the tables are, ``np`` on the host for an eager check and a report's details). The tolerance is
    ``atol + rtol |num|``, plus the outputs' rounding per row (``scale``) and twice the finite
    differences' estimated error ``fd``; an entry fails where ``excess`` is > 0 or NaN."""
    err = xp.abs(num - an)
    allowed = atol + rtol * xp.abs(num) + scale[:, None] + 2 * fd
    return err, allowed, err - allowed


def _compare(raw, leaves, names, sems, modes, fast, atol, rtol, roundoff=0.0, probes=True):
    padded_inputs = ", ".join(lf.name for lf in leaves if lf.kind in SPARSE_KINDS and not lf.spec.all())
    valid = np.asarray(raw["valid"], bool)
    value_leak = np.asarray(raw["value_leak"])
    judged = None if fast else iter(np.asarray(raw["judged"], np.float64).tolist())
    checks = []
    for i, leaf in enumerate(leaves):
        spec = leaf.spec
        for sem in sems:
            res = raw[f"{i}/{sem}"]
            for (oname, oshape), rows in zip(names, _row_blocks(tuple(names))):
                leaks = {}
                # What masked-out data does to the outputs is a leak of the inputs that have
                # masked-out data; an input with none (a parameter) is only charged with what the
                # probes do to its own gradient.
                owns = not bool(np.all(spec))
                if sem == "masked":
                    if owns:
                        # the random fills against the other points' data under the masks
                        for moved, key in zip(value_leak, POINT_LEAKS):
                            leaks[key] = float(np.max(moved[rows], initial=0))
                        if np.any(raw["mask_changed"]):
                            leaks["output mask depends on masked-out data"] = float("inf")
                    probes = raw.get("probes") or {}
                    for p, pname in enumerate(PROBE_NAMES if probes else ()):
                        under = f"{pname} under the masks"
                        if padded_inputs:  # a leak here may come from a padding slot as well
                            under += f" and in the padding slots of {padded_inputs}"
                        if owns:
                            leaks[f"valid outputs with {under}"] = float(
                                np.max(np.asarray(probes["value"][p])[rows], initial=0)
                            )
                            if bool(probes["mask"][p]):
                                leaks[f"output mask with {under}"] = float("inf")
                            if "fwd" in modes and "rev" not in modes:
                                leaks[f"JVP of valid outputs with {under}"] = float(
                                    np.max(np.asarray(probes["jvp"][p])[rows], initial=0)
                                )
                        if "rev" in modes:
                            leaks[f"VJP to valid inputs with {under}"] = float(
                                np.max(np.asarray(probes["vjp"][i][p]), initial=0)
                            )
                            if owns:
                                leaks[f"VJP to masked-out inputs with {under}"] = float(
                                    np.max(np.asarray(probes["vjp_off"][i][p]), initial=0)
                                )
                cells = None
                lm = raw["leak_map"][i] if sem == "masked" and raw.get("leak_map") is not None else None
                if lm is not None and owns:
                    over = lambda a, rows=rows: ~(np.asarray(a)[rows] <= atol)  # noqa: E731 - past atol, or NaN
                    cells = over(lm["value"]).astype(np.uint8) | (over(lm["gradient"]).astype(np.uint8) << 1)
                    leaks["masked-out inputs reaching valid outputs (leak map cells)"] = float(np.count_nonzero(cells))
                for mode in modes:
                    if fast:
                        c = _fast_check(res, mode, sem, leaks, atol, rtol, roundoff)
                    else:
                        table = _Table(
                            res,
                            mode,
                            sem,
                            rows,
                            valid[rows] if sem == "masked" else None,
                            spec,
                            cells,
                            raw[f"scale/{sem}"],
                            oshape,
                            leaf.shape,
                            (atol, rtol, roundoff),
                        )
                        assert judged is not None  # full tables are judged where they ran
                        c = _full_check(next(judged), table, leaks, atol, _shares_tables(leaf, sems, fast, probes))
                    checks.append(Check(input=leaf.name, output=oname, mode=mode, semantics=sem, **c))
    return checks


def _full_check(judged, table, leaks, atol, shared):
    """One full-table check from its row of :data:`JUDGED` (the verdict, taken where the check ran);
    the details a report shows (worst entries, tables, leak map) come from ``table`` when first
    read. ``shared``: the masked-out inputs were not perturbed (see :func:`_shares_tables`)."""
    row = dict(zip(JUDGED, judged))
    leaks = dict(leaks)
    if table.sem == "masked":
        leaks.update((k, row[k]) for k in (JUDGED[6:] if shared else JUDGED[5:]))  # shared: no numerical leak taken
    matched = bool(row["passed"])
    fd_max = row["fd_error"] if "fd_err" in table.res else None
    return dict(
        passed=matched and _leak_passed(leaks, atol),
        max_abs=row["max_abs"],
        max_rel=row["max_rel"],
        leaks=leaks,
        fd_error=fd_max,
        mismatch=not matched,
        near_miss=bool(row["near_miss"]),
        reason=_reason(matched, leaks, atol, table.mode, table.sem, row["max_abs"], fd_max),
        details=table.details,
    )


@dataclasses.dataclass
class _Table:
    """One full-table check's tables, still on the device, and what :meth:`details` needs to show
    them: ``ok`` the valid rows (``None``: all), ``cells`` the leak map's value and gradient bits."""

    res: dict
    mode: str
    sem: str
    rows: slice
    ok: object
    spec: np.ndarray
    cells: object
    scale: object
    oshape: tuple
    ishape: tuple
    tol: tuple  # (atol, rtol, roundoff), as check_jacobian passes them

    def details(self) -> dict:
        """The worst entries, ``|numerical - analytical|`` (NaN where not compared), both tables and
        the leak map, read from the device."""
        num = np.asarray(self.res["num"])[self.rows]
        an = np.asarray(self.res[self.mode])[self.rows]
        masked = self.sem == "masked"
        ok = np.ones(num.shape[0], bool) if self.ok is None else np.asarray(self.ok)
        cols = np.asarray(self.spec) if masked else np.ones(num.shape[1], bool)
        r_idx, c_idx = np.flatnonzero(ok), np.flatnonzero(cols)
        block = (lambda a: a) if ok.all() and cols.all() else (lambda a: a[np.ix_(r_idx, c_idx)])
        fd = block(np.asarray(self.res["fd_err"])[self.rows]) if "fd_err" in self.res else 0
        atol, rtol, roundoff = self.tol
        scale = np.asarray(self.scale)[self.rows][r_idx] * roundoff
        n_blk, a_blk = block(num), block(an)
        err, _, excess = _errors(np, n_blk, a_blk, fd, scale, atol, rtol)
        worst = []
        for flat_pos in _largest(excess.ravel(), 5):
            r, c = _unravel(flat_pos, excess.shape)
            worst.append(
                (
                    _unravel(int(r_idx[r]), self.oshape),
                    _unravel(int(c_idx[c]), self.ishape),
                    float(n_blk[r, c]),
                    float(a_blk[r, c]),
                    bool(not excess[r, c] <= 0),
                )
            )
        diff = np.full(num.shape, np.nan, err.dtype)
        diff[np.ix_(r_idx, c_idx)] = err
        cells = _leak_cells(self.cells, num, ok, self.spec, atol) if masked else None
        return dict(
            worst=worst,
            diff=diff,
            numerical=num,
            analytical=an,
            leak_cells=cells,
            leak_map=[] if cells is None else _leak_entries(cells, self.oshape, self.ishape),
        )


def _largest(a, k):
    """Flat positions of the ``k`` largest entries of 1-d ``a``, largest first, ties by position, NaN
    before all (``np.argmax`` returns the first NaN).

    ``k`` argmax passes: linear, and unlike a sort or ``argpartition`` not slowed by ties (a
    table whose off-diagonal entries all tie). Picked entries are set to -inf
    during the search and restored after it, so ``a`` (writable) is left as it was.
    """
    picks, saved = [], []
    for _ in range(min(k, a.size)):
        picks.append(int(np.argmax(a)))
        saved.append(a[picks[-1]])
        a[picks[-1]] = -np.inf
    for p, v in zip(reversed(picks), reversed(saved)):  # reversed: a position picked twice keeps its value
        a[p] = v
    return picks


def _fast_check(res, mode, sem, leaks, atol, rtol, roundoff=0.0):
    num, an = np.asarray(res["num"]), np.asarray(res[mode])
    leaks = dict(leaks)
    # the outputs' rounding through each direction's projection: two evaluations of a large
    # output can differ by an ulp even where nothing depends on the perturbed elements
    rounding = roundoff * np.asarray(res["scale"]) if "scale" in res else np.zeros(num.shape)
    if sem == "masked":
        leaks["numerical, masked-out inputs"] = _beyond(np.asarray(res["num_off"]), rounding)
        leaks["analytical, masked-out inputs"] = float(res[f"{mode}_leak_in"])
        leaks["analytical, masked-out outputs"] = float(res[f"{mode}_leak_out"])
    err = np.abs(num - an)
    abs_num = np.abs(num)
    fd = np.asarray(res["fd_err"]) if "fd_err" in res else np.zeros(num.shape)
    tol = atol + rtol * abs_num + 2 * fd + rounding
    bad = ~(err <= tol)
    has_nan = bool(np.isnan(err).any())
    worst = [(f"direction {d}", "", float(num[d]), float(an[d]), bool(bad[d])) for d in np.argsort(-err)]
    fd_max = float(np.nanmax(fd, initial=0))
    shown = dict(worst=worst, diff=None, numerical=num, analytical=an, leak_map=[], leak_cells=None)
    return dict(
        passed=bool(not bad.any()) and _leak_passed(leaks, atol),
        max_abs=_max_of(err, has_nan),
        max_rel=_max_of(_relative(err, abs_num, atol), has_nan),
        leaks=leaks,
        details=lambda: shown,
        fd_error=fd_max if "fd_err" in res else None,
        mismatch=bool(bad.any()),
        near_miss=bool(bad.any()) and bool(np.all(err <= NEAR_MISS * tol)),
        reason=_reason(
            not bad.any(), leaks, atol, mode, sem, _max_of(err, has_nan), fd_max if "fd_err" in res else None
        ),
    )


def _reason(matched, leaks, atol, mode, sem, top, fd_max):
    """Why a check failed, in words: the derivative against the finite differences' estimated
    error, and the leaks with the semantics they break (empty when it passed)."""
    why = []
    if not matched:
        what = "jacfwd / JVP" if mode == "fwd" else "jacrev / VJP"
        estimate = "" if fd_max is None else f" and beyond their estimated error ({fd_max:.2g}, Richardson)"
        why.append(
            f"the {what} derivative differs from finite differences by {top:.3g}, beyond the tolerance"
            f"{estimate}: a wrong derivative under {sem} semantics"
        )
    bad = [k for k, v in leaks.items() if not (np.isfinite(v) and v <= atol)]
    if bad:
        why.append(
            f"masked-out data reaches what it must not ({'; '.join(bad[:3])}"
            f"{'; ...' if len(bad) > 3 else ''}): it breaks masked semantics"
        )
    return "; ".join(why)


def _relative(err, abs_num, atol):
    """``err / |num|`` where ``|num| > atol`` (elsewhere the absolute error is what counts), else 0."""
    return np.divide(err, abs_num, out=np.zeros_like(err), where=abs_num > atol)


def _beyond(moved, allowed):
    """How far ``|moved|`` goes past ``allowed`` (what the outputs' rounding can explain) at most;
    infinity if it holds a NaN."""
    return _max_of(np.abs(moved) - allowed, bool(np.isnan(moved).any()))


def _max_of(a, has_nan):
    """Largest entry of ``a``; infinity when the errors it came from hold a NaN; 0 when empty."""
    if has_nan:
        return float("inf")
    return float(np.max(a, initial=0))
