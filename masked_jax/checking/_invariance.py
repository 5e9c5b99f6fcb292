"""``check_invariance``: does a function of padded inputs ignore its padding?

The inputs' ``MaskedArray`` leaves carry the padding: along ``axis``, a position of a row is valid
when any element of it is valid (a ``(B, L, D)`` array with a ``(B, L, 1)`` token mask: the
tokens). The checker re-pads every such leaf in the same way (the valid positions of each row keep
their order and move together; every leaf with the same valid pattern moves identically): pads
of other lengths (none at all, the given length, longer), at other positions (after the valid
positions, before them, or scattered between them), holding other content (zeros, NaN, +-inf, a
huge value: the content of *every* masked-out element, pads and masked features alike). For each
re-padding it calls the function eagerly, under ``jit`` and under ``vmap`` (over the contents),
and compares

* every output, its valid entries at their valid positions (an output with the padded axis is
  compacted first, by its own mask or, for a plain array, by the inputs' valid positions);
* the gradients with respect to ``params`` of a fixed random weighting of those valid outputs;

with the function's outputs and gradients at the given inputs. Hand-masked model code that takes
``(padded array, mask)`` or ``(padded array, lengths)`` is checked through a lambda that unpacks a
``MaskedArray``: ``lambda p, x: model.apply(p, x.data, x.mask)``.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import functools
import html
import os
import threading

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jcore

from masked_jax._core import MaskedArray
from masked_jax._maskify import reusing_traces
from masked_jax.checking._compile import _callbacks, _has_own_rules, _lift_constants, fast_jit
from masked_jax.checking._report import TABLE_STYLE, styled, write_page

FILLS = {"zero": 0.0, "nan": float("nan"), "inf": float("inf"), "-inf": float("-inf"), "huge": None}
POSITIONS = ("end", "start", "scattered")
TRANSFORMS = ("eager", "jit", "vmap")


@dataclasses.dataclass
class InvarianceCase:
    """One re-padding under one transform: what changed, if anything.

    ``first`` is ``None`` when nothing changed, else ``(what, index, expected, got)``: the first
    output (``out...``) or parameter gradient (``grad args[i]...``) whose valid entry moved, the
    index of that entry, and its values at the given and at the re-padded inputs.
    """

    padding: str
    transform: str
    passed: bool
    first: tuple | None = None


@dataclasses.dataclass
class InvarianceReport:
    """What :func:`masked_jax.check_invariance` found; ``bool(report)`` is True when every case passed.

    Examples:
        >>> import jax.numpy as jnp, masked_jax as mj, masked_jax.numpy as mnp
        >>> x = mj.masked_array(jnp.ones((2, 4)), jnp.array([[1, 1, 0, 0], [1, 1, 1, 0]], bool))
        >>> report = mj.check_invariance(lambda v: mnp.mean(v, axis=1), (x,), axis=1)
        >>> bool(report), len(report.cases) > 10
        (True, True)
    """

    cases: list
    rtol: float

    def __bool__(self) -> bool:
        return all(c.passed for c in self.cases)

    def failures(self) -> list:
        return [c for c in self.cases if not c.passed]

    @property
    def first_failure(self):
        """The first failing :class:`InvarianceCase`, or ``None``."""
        bad = self.failures()
        return bad[0] if bad else None

    def __repr__(self) -> str:
        bad = self.failures()
        head = (
            f"InvarianceReport({'PASSED' if not bad else 'FAILED'}: {len(self.cases) - len(bad)} of "
            f"{len(self.cases)} re-paddings x transforms unchanged; rtol={self.rtol:g})"
        )
        lines = [head]
        for c in bad[:12]:
            what, index, expected, got = c.first
            where = f"{what} shape" if index == "shape" else f"{what}{list(index)}"
            lines.append(f"  [FAIL] {c.padding}, {c.transform}: {where} changed: {_show(expected)} -> {_show(got)}")
        if len(bad) > 12:
            lines.append(f"  ... and {len(bad) - 12} more failing cases")
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        return self.to_html()

    def to_html(self) -> str:
        """The report as HTML: the verdict and a table of every case that changed something (what,
        at which index, from what to what)."""
        e = html.escape
        bad = self.failures()
        colour = "#2e7d32" if not bad else "#c62828"
        out = [
            f"<div><b style='color:{colour}'>Invariance check {'passed' if not bad else 'FAILED'}</b>: "
            f"{len(self.cases) - len(bad)} of {len(self.cases)} re-paddings x transforms unchanged"
            f"<br><small>rtol {self.rtol:g}</small>"
        ]
        if bad:
            out.append(
                f"<table style='{TABLE_STYLE}'><tr><th>re-padding</th><th>transform</th><th>what changed</th>"
                "<th>index</th><th>given</th><th>re-padded</th></tr>"
            )
            for c in bad:
                what, index, expected, got = c.first
                out.append(
                    f"<tr><td>{e(c.padding)}</td><td>{e(c.transform)}</td><td>{e(what)}</td>"
                    f"<td>{e('shape' if index == 'shape' else str(list(index)))}</td>"
                    f"<td>{e(_show(expected))}</td><td>{e(_show(got))}</td></tr>"
                )
            out.append("</table>")
        out.append("</div>")
        return styled("".join(out))

    def save_html(self, path) -> None:
        """Write the report as a standalone HTML page.

        Examples:
            >>> import pathlib, tempfile, jax.numpy as jnp, masked_jax as mj
            >>> x = mj.masked_array(jnp.ones((1, 3)), jnp.array([[True, True, False]]))
            >>> r = mj.check_invariance(lambda v: jnp.sum(v.filled(0), axis=1), (x,), axis=1)
            >>> path = pathlib.Path(tempfile.mkdtemp()) / "report.html"
            >>> r.save_html(path)
            >>> "Invariance check passed" in path.read_text()
            True
        """
        write_page(path, "Invariance check", self.to_html())


def _show(v):
    return f"{v:.6g}" if isinstance(v, float) else str(v)


class InvarianceError(AssertionError):
    """A padding-invariance check failed; ``err.report`` is the :class:`InvarianceReport`.

    Examples:
        >>> import jax.numpy as jnp, masked_jax as mj
        >>> x = mj.masked_array(jnp.ones((1, 3)), jnp.array([[True, True, False]]))
        >>> try:  # a mean over the padded length: the padding counts
        ...     mj.check_invariance(lambda v: jnp.mean(v.filled(0), axis=1), (x,), axis=1)
        ... except mj.InvarianceError as err:
        ...     print(err.report.first_failure.first[0])
        out
    """

    def __init__(self, report: InvarianceReport):
        super().__init__(repr(report))
        self.report = report


def check_invariance(
    f,
    args,
    *,
    axis=-1,
    params=(),
    out_axis=None,
    lengths=("tight", "same", "longer"),
    positions=("end", "start"),
    fills=("zero", "nan", "inf", "-inf", "huge"),
    transforms=TRANSFORMS,
    rtol=None,
    seed=0,
    raise_exception=True,
) -> InvarianceReport:
    """Check that ``f``'s valid outputs and parameter gradients do not depend on the padding.

    Every ``MaskedArray`` leaf of ``args`` is re-padded along ``axis`` (see the module
    documentation: its valid positions keep their order, pads change length, place and content),
    ``f`` is called eagerly, under ``jit`` and under ``vmap``, and each output's valid entries and
    the gradients with respect to ``params`` are compared with those at the given ``args``.

    Args:
        f: the function, called as ``f(*args)``; hand-masked code that takes ``(array, mask)`` or
            ``(array, lengths)`` goes through a lambda unpacking a ``MaskedArray``.
        args: a tuple of arguments (a single non-tuple argument is wrapped). At least one leaf is a
            ``MaskedArray`` with ``axis``.
        axis: the padded axis of the masked inputs.
        params: the positions in ``args`` of the arguments (pytrees of float arrays, such as flax
            or equinox parameters) whose gradients must not change; ``()`` checks outputs only.
        out_axis: the padded axis of the outputs: ``None`` compares plain array outputs whole and
            compacts a ``MaskedArray`` output along ``axis`` when that axis has the inputs'
            padded length; an int compacts every output along it (a plain array by the inputs'
            valid positions, a ``MaskedArray`` by its own mask).
        lengths: pad lengths: ``"tight"`` (no pad beyond the longest row), ``"same"`` (as given),
            ``"longer"`` (three more positions).
        positions: where pads go: ``"end"`` (right padding), ``"start"`` (left padding),
            ``"scattered"`` (random positions between the valid ones; order kept).
        fills: what every masked-out element holds: ``"zero"``, ``"nan"``, ``"inf"``, ``"-inf"``,
            ``"huge"`` (the square root of the dtype's largest value).
        transforms: any of ``"eager"``, ``"jit"``, ``"vmap"`` (``vmap`` over the contents of one
            layout, stacked, compiled). Eagerly, the outputs are compared at every re-padding and
            the gradients at the given pad length with the first non-finite content (an eager
            ``jax.grad`` of masked code is slow: each op compiles its derivative); under ``jit`` and
            ``vmap``, all.
        rtol: relative tolerance of the comparison (scaled by each output's largest magnitude);
            by default 1e-10 for float64, 1e-5 for float32, 1e-2 for 16-bit floats.
        seed: seed of the scattered positions and of the gradient's output weights.
        raise_exception: raise :class:`InvarianceError` (carrying the report) on failure.

    Returns:
        An :class:`InvarianceReport`, truthy when nothing changed.

    Examples:
        >>> import jax.numpy as jnp, masked_jax as mj, masked_jax.numpy as mnp
        >>> x = mj.masked_array(jnp.arange(8.0).reshape(2, 4),
        ...                     jnp.array([[1, 1, 1, 0], [1, 0, 0, 0]], bool))
        >>> w = jnp.array(2.0)
        >>> report = mj.check_invariance(lambda w, v: w * mnp.sum(v, axis=1), (w, x), axis=1,
        ...                              params=(0,))
        >>> bool(report)
        True
    """
    if not callable(f):
        raise TypeError(f"check_invariance: f must be callable; got {type(f).__name__}.")
    args = tuple(args) if isinstance(args, (tuple, list)) else (args,)
    params = (params,) if isinstance(params, int) else tuple(params)
    for p in params:
        if not isinstance(p, int) or not -len(args) <= p < len(args):
            raise ValueError(f"check_invariance: params must hold positions of args (0..{len(args) - 1}); got {p!r}.")
    params = tuple(sorted({p % len(args) for p in params}))
    lengths = _choose("lengths", lengths, ("tight", "same", "longer"))
    positions = _choose("positions", positions, POSITIONS)
    fills = _choose("fills", fills, tuple(FILLS))
    transforms = _choose("transforms", transforms, TRANSFORMS)
    if not isinstance(axis, (int, np.integer)) or isinstance(axis, bool):
        raise TypeError(f"check_invariance: axis must be an int; got {type(axis).__name__}.")
    if out_axis is not None and (not isinstance(out_axis, (int, np.integer)) or isinstance(out_axis, bool)):
        raise TypeError(f"check_invariance: out_axis must be None or an int; got {type(out_axis).__name__}.")
    if rtol is not None:
        try:
            rtol = float(rtol)
        except (TypeError, ValueError):
            raise TypeError(f"check_invariance: rtol must be a number; got {type(rtol).__name__}.") from None
        if not np.isfinite(rtol) or rtol < 0:
            raise ValueError(f"check_invariance: rtol must be a finite number >= 0; got {rtol!r}.")

    flat, treedef = jax.tree_util.tree_flatten(args, is_leaf=lambda x: isinstance(x, MaskedArray))
    padded = [i for i, x in enumerate(flat) if isinstance(x, MaskedArray)]
    if not padded:
        raise TypeError(
            "check_invariance: no MaskedArray in args: the padded inputs must be MaskedArrays "
            "(their masks say what is padding); wrap hand-masked code in a lambda that unpacks them."
        )
    ax = {}
    for i in padded:
        x = flat[i]
        if not -x.ndim <= axis < x.ndim:
            raise ValueError(f"check_invariance: axis {axis} is out of range for a padded input of shape {x.shape}.")
        ax[i] = axis % x.ndim
    length = {flat[i].shape[ax[i]] for i in padded}
    if len(length) != 1:
        raise ValueError(
            f"check_invariance: the padded inputs disagree on the length of axis {axis}: "
            f"{sorted(length)}; they must share one padded length."
        )
    length = length.pop()
    keeps = {i: _kept(flat[i], ax[i]) for i in padded}
    longest = max(int(k.sum(-1).max(initial=0)) for k in keeps.values())
    dtypes = [np.dtype(flat[i].dtype) for i in padded if jnp.issubdtype(flat[i].dtype, jnp.floating)]
    dtype = min(dtypes, key=lambda d: d.itemsize) if dtypes else np.dtype(np.float32)
    rtol = _default_rtol(dtype) if rtol is None else rtol

    # maskify traces on shapes, never on values: the eager calls of a maskify'd f at one padded
    # length, whatever the pads' positions and contents, share one trace
    with reusing_traces():
        rng = np.random.default_rng(seed)
        ref_keeps = keeps[padded[0]]
        outs_ref, ks = _valid_outputs(f(*args), out_axis, axis, length, ref_keeps, xp=np)
        weights = [
            None
            if not jnp.issubdtype(v.dtype, jnp.floating)
            else jnp.asarray((rng.normal(size=v.shape) * (1 if m is None else m)).astype(v.dtype))
            for (v, m), _ in outs_ref
        ]
        run = _Run(f, flat, treedef, params, out_axis, axis, ks, weights, [name for _, name in outs_ref])
        names = [
            "args" + jax.tree_util.keystr(path)
            for path, _ in jax.tree_util.tree_flatten_with_path(args, is_leaf=lambda x: isinstance(x, MaskedArray))[0]
        ]

        # Every case as a job: the compiled ones grouped by padded length (one group's programs are
        # one shape's, compiled once), the eager ones apart; see _run_jobs.
        jobs: list = []  # (transform, group, thunk)
        if run.diff:  # the reference gradients
            jobs.append(("reference", length, functools.partial(run.evaluate, flat, "given", length, ref_keeps, True)))
        labels = []
        eager_grad = next((k for k, fill in enumerate(fills) if fill not in ("zero", "huge")), 0)
        sizes = {"tight": longest, "same": length, "longer": length + 3}
        seen = set()
        for name in lengths:
            for pos in positions:
                new_len = sizes[name]
                if (new_len, pos) in seen:  # "tight" is "same" when the longest row fills the padded length
                    continue
                seen.add((new_len, pos))
                slots = _slots(keeps, new_len, pos, np.random.default_rng(rng.integers(2**31)))
                variants = [_repad(flat, padded, ax, slots, new_len, fill) for fill in fills]
                new_keeps = slots[padded[0]][1]
                layout = (new_len, pos)
                for transform in transforms:
                    if transform == "vmap":
                        job = functools.partial(run.vmapped, variants, padded, layout, new_len, new_keeps)
                    else:  # eager gradients (slow): one content, at the given length
                        jit = transform == "jit"
                        grads = [jit or (k == eager_grad and new_len == length) for k in range(len(variants))]
                        job = functools.partial(_each, run.evaluate, variants, layout, new_len, new_keeps, jit, grads)
                    jobs.append((transform, None if transform == "eager" else new_len, job))
                    labels.append((f"pad to {new_len} ({name}) at {pos}", transform))
        done = _run_jobs([(group, job) for _, group, job in jobs])
        grad_ref = done.pop(0)[1] if run.diff else None
        cases = []
        for (label, transform), results in zip(labels, done):
            for fill, (outs, grads) in zip(fills, results):
                first = _first_change(outs_ref, outs, grad_ref if grads is not None else None, grads, rtol, names)
                cases.append(InvarianceCase(f"{label}, {fill} content", transform, first is None, first))
        report = InvarianceReport(cases, rtol)
        if raise_exception and not report:
            raise InvarianceError(report)
        return report


def _choose(name, given, allowed):
    """``given`` (one name or a sequence of them) as a tuple without repeats, each in ``allowed``."""
    given = (given,) if isinstance(given, str) else tuple(given)
    bad = [g for g in given if g not in allowed]
    if not given or bad:
        raise ValueError(f"check_invariance: {name} must be a non-empty sequence of {allowed}; got {given!r}.")
    return tuple(dict.fromkeys(given))


def _default_rtol(dtype):
    if dtype == np.float64:
        return 1e-10
    if dtype == np.float32:
        return 1e-5
    return 1e-2


def _kept(x, axis, xp=np):
    """``(rows, length)`` bool: the valid positions of each row along ``axis`` (a position with any
    valid element is valid; rows: the positions of the axes before ``axis``)."""
    m = xp.moveaxis(xp.broadcast_to(xp.asarray(x.mask), x.shape), axis, -1)  # (lead..., trail..., L)
    lead = x.shape[:axis]
    rows, trail = (int(np.prod(s, dtype=np.int64)) for s in (lead, m.shape[len(lead) : -1]))
    return m.reshape((rows, trail, x.shape[axis])).any(1)


def _slots(keeps, new_len, pos, rng):
    """Per padded leaf: ``(source index, new kept)``: for each row and new position, the old position
    it takes its slice from (-1: a pad), and the new valid pattern. Leaves with the same valid
    pattern get the same placement (one draw per distinct count and row)."""
    out, memo = {}, {}
    for i, kept in keeps.items():
        rows = kept.shape[0]
        src = np.full((rows, new_len), -1, np.int64)
        for r in range(rows):  # rows of the (small, host-side) test inputs
            old = np.flatnonzero(kept[r])
            k = old.size
            key = (r, k)
            if key not in memo:
                if pos == "end":
                    memo[key] = np.arange(k)
                elif pos == "start":
                    memo[key] = np.arange(new_len - k, new_len)
                else:
                    memo[key] = np.sort(rng.choice(new_len, size=k, replace=False))
            src[r, memo[key]] = old
        out[i] = (src, src >= 0)
    return out


def _repad(flat, padded, ax, slots, new_len, fill):
    """The leaves with every padded ``MaskedArray`` laid out by ``slots`` and its masked-out
    elements holding ``fill``."""
    leaves = list(flat)
    for i in padded:
        x = flat[i]
        a = ax[i]
        src, _ = slots[i]
        data = np.asarray(x.data)
        mask = np.broadcast_to(np.asarray(x.mask), x.shape)
        value = FILLS[fill]
        if jnp.issubdtype(data.dtype, jnp.floating):
            if value is None:
                value = float(np.sqrt(float(jnp.finfo(data.dtype).max)))
        elif data.dtype == np.bool_:  # bool data: pads hold False or True
            value = fill != "zero"
        else:  # integer data: pads hold the dtype's extreme instead
            value = 0 if fill == "zero" else int(jnp.iinfo(data.dtype).max)
        d = np.moveaxis(data, a, -1)
        m = np.moveaxis(mask, a, -1)
        lead = x.shape[:a]
        trail = d.shape[len(lead) : -1]
        n_rows = int(np.prod(lead, dtype=np.int64))
        d = d.reshape((n_rows,) + trail + (x.shape[a],))
        m = m.reshape((n_rows,) + trail + (x.shape[a],))
        if x.shape[a] == 0:  # nothing to take: every new position is a pad (one slot to index)
            d, m = np.zeros(d.shape[:-1] + (1,), d.dtype), np.zeros(m.shape[:-1] + (1,), bool)
        take = np.clip(src, 0, None)  # (rows, new_len)
        rows = np.arange(np.shape(d)[0])[:, None]
        nd = np.moveaxis(np.moveaxis(d, -1, 1)[rows, take], 1, -1)  # (rows, trail..., new_len)
        nm = np.moveaxis(np.moveaxis(m, -1, 1)[rows, take], 1, -1)
        pad = np.broadcast_to((src < 0).reshape((src.shape[0],) + (1,) * len(trail) + (new_len,)), nm.shape)
        nm = nm & ~pad
        nd = np.where(nm, nd, np.asarray(value).astype(data.dtype))
        nd = np.moveaxis(nd.reshape(lead + trail + (new_len,)), -1, a)
        nm = np.moveaxis(nm.reshape(lead + trail + (new_len,)), -1, a)
        compact = np.shape(x.mask) if np.ndim(x.mask) == x.ndim else x.shape
        for d, n in enumerate(compact):  # the mask keeps its compact dims ((B, L, 1) tokens)
            if n == 1 and nm.shape[d] != 1 and (nm == nm.take([0], axis=d)).all():
                nm = nm.take([0], axis=d)
        leaves[i] = MaskedArray.tree_unflatten(None, (jnp.asarray(nd), jnp.asarray(nm)))
    return leaves


def _valid_outputs(out, out_axis, axis, length, kept, ks=None, xp=jnp):
    """``([((values, mask or None), name)], ks)`` per output leaf: compacted along its padded axis
    (valid positions first, in order, ``ks[j]`` slots: the longest row of the reference) with
    masked-out entries set to 0. ``ks=None`` (the reference, concrete) measures ``ks``; traceable
    otherwise. ``xp``: ``jnp`` (inside a compiled program), or ``np`` for concrete outputs (no
    operation compiled)."""
    flat, _ = jax.tree_util.tree_flatten_with_path(out, is_leaf=lambda x: isinstance(x, MaskedArray))
    result, measured = [], []
    for j, (path, leaf) in enumerate(flat):
        name = "out" + jax.tree_util.keystr(path)
        own = isinstance(leaf, MaskedArray)
        data = xp.asarray(leaf.data if own else leaf)
        mask = xp.broadcast_to(xp.asarray(leaf.mask), leaf.shape) if own else None
        a = out_axis
        if (
            a is None
            and own
            and data.ndim
            and -data.ndim <= axis < data.ndim
            and data.shape[axis] == length
            and (ks is None or ks[j] is not None)
        ):  # as the reference decided (lengths may coincide)
            a = axis
        k = None
        if a is not None:
            if not -data.ndim <= a < data.ndim:
                raise ValueError(
                    f"check_invariance: out_axis {a} is out of range for output {name} of shape {data.shape}."
                )
            a %= data.ndim
            pos_valid = _kept(leaf, a, xp) if own else xp.asarray(kept)
            if pos_valid.shape[0] != int(np.prod(data.shape[:a], dtype=np.int64)):
                raise ValueError(
                    f"check_invariance: output {name} of shape {data.shape} does not have the "
                    f"inputs' {pos_valid.shape[0]} rows before its padded axis {a}; give out_axis."
                )
            k = max(int(np.asarray(pos_valid).sum(-1).max(initial=0)), 1) if ks is None else ks[j]
            data, mask = _compact(data, mask, a, pos_valid, k, xp)
        measured.append(k)
        result.append(((data if mask is None else xp.where(mask, data, 0), mask), name))
    return result, measured


def _compact(data, mask, a, pos_valid, k, xp=jnp):
    """``data`` (and ``mask``) along axis ``a`` as ``(rows, trailing..., k)``: each row's valid
    positions first, in order; slots past a row's valid count are masked."""
    rows = pos_valid.shape[0]
    d = xp.moveaxis(data, a, -1)
    trail = d.shape[len(data.shape[:a]) : -1]
    d = d.reshape((rows,) + trail + (data.shape[a],))
    m = None if mask is None else xp.moveaxis(mask, a, -1).reshape(d.shape)
    if data.shape[a] < k:  # fewer positions than the reference's valid ones: pad (masked)
        widths = [(0, 0)] * (d.ndim - 1) + [(0, k - data.shape[a])]
        d = xp.pad(d, widths)
        m = None if m is None else xp.pad(m, widths)
        pos_valid = xp.pad(pos_valid, [(0, 0), (0, k - data.shape[a])])
    order = xp.argsort(~pos_valid, axis=-1, stable=True)[:, :k]  # valid positions first, in order
    ok = xp.take_along_axis(pos_valid, order, -1)
    idx = xp.broadcast_to(order.reshape((rows,) + (1,) * len(trail) + (k,)), (rows,) + trail + (k,))
    ok = xp.broadcast_to(ok.reshape((rows,) + (1,) * len(trail) + (k,)), idx.shape)
    if m is not None:
        ok = ok & xp.take_along_axis(m, idx, -1)
    return xp.take_along_axis(d, idx, -1), ok


# The compiled programs of every check, by the structure of ``f`` at one padded length (its jaxpr with the
# constants it captured lifted into inputs, see ``_Traced``) and what the program computes from it:
# a function with the same code (a re-run notebook cell, other parameters or captured numbers)
# finds them compiled.
_PROGRAMS: collections.OrderedDict = collections.OrderedDict()
_PROGRAMS_SIZE = 256


def _each(evaluate, variants, layout, length, kept, jit, grads):
    """``evaluate`` of every content variant of one layout (``grads[k]``: with gradients)."""
    return [evaluate(leaves, layout, length, kept, jit, g) for leaves, g in zip(variants, grads)]


def _run_jobs(jobs):
    """The results of ``jobs`` (``(group, thunk)``), in order. Compiled jobs (a group: their padded
    length) run group by group in worker threads, one thread per group at most as many as there
    are cores, while the eager ones (group ``None``) run here: XLA compiles without holding the
    GIL, so each padded length's programs compile beside the others and beside the eager calls
    (on 2 cores, a quarter off the first check of a flax MLP). ``MJ_CHECK_BACKGROUND=0`` runs all
    of them here, in order."""
    groups: dict = {}
    for k, (group, _) in enumerate(jobs):
        if group is not None:
            groups.setdefault(group, []).append(k)
    workers = min(len(groups), os.cpu_count() or 1)
    serial = workers == 0 or (workers < 2 and all(group is not None for group, _ in jobs))  # nothing beside
    if serial or os.environ.get("MJ_CHECK_BACKGROUND") == "0":
        return [thunk() for _, thunk in jobs]
    out: list = [None] * len(jobs)

    def run_group(ks):
        return [(k, jobs[k][1]()) for k in ks]

    with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
        futures = [pool.submit(run_group, ks) for ks in groups.values()]
        for k, (group, thunk) in enumerate(jobs):
            if group is None:
                out[k] = thunk()
        for future in futures:
            for k, result in future.result():
                out[k] = result
    return out


_PROGRAMS_LOCK = threading.Lock()


def _program(key, build):
    """The program cached under ``key``, built by ``build()`` when missing."""
    with _PROGRAMS_LOCK:  # (checks compile in worker threads; building a program is cheap)
        if key in _PROGRAMS:
            _PROGRAMS.move_to_end(key)
            return _PROGRAMS[key]
        _PROGRAMS[key] = program = build()
        while len(_PROGRAMS) > _PROGRAMS_SIZE:
            _PROGRAMS.popitem(last=False)
        return program


class _Traced:
    """``call`` traced at one padded length, its constants (arrays and Python numbers) lifted into inputs:
    ``fn(lifted, arrays)`` evaluates it, ``lifted`` holds this function's constants, ``key`` is the
    structure (printed jaxpr, the lifted values' shapes and dtypes, the input and output trees, the
    host callbacks it makes). ``None`` (see :meth:`of`) when ``call`` does not trace (it reads values
    in Python) or has custom derivative rules of its own, which print by name only."""

    def __init__(self, jaxpr, lifted, out_tree, key):
        self.lifted, self.key = lifted, key
        run = jcore.jaxpr_as_fun(jaxpr)
        self.fn = lambda lifted, arrays: jax.tree_util.tree_unflatten(
            out_tree, run(*lifted, *jax.tree_util.tree_leaves(arrays))
        )

    @classmethod
    def of(cls, call, arrays):
        try:
            closed, shapes = jax.make_jaxpr(call, return_shape=True)(arrays)
        except Exception:  # noqa: BLE001 - f reads values in Python: it runs uncached
            return None
        if _has_own_rules(closed.jaxpr):
            return None
        jaxpr, lifted = _lift_constants(closed)
        out_tree = jax.tree_util.tree_structure(shapes)
        key = (
            str(jaxpr.jaxpr),
            tuple((np.shape(v), str(np.result_type(v))) for v in lifted),
            str(jax.tree_util.tree_structure(arrays)),
            str(out_tree),
            tuple(_callbacks(jaxpr.jaxpr)),
        )
        return cls(jaxpr, lifted, out_tree, key)


class _Run:
    """How one re-padded input set is evaluated: the outputs, and the gradients of their weighted
    valid entries with respect to the float leaves of the ``params`` arguments. Leaves that are not
    arrays (flags, sizes) are static. Compiled evaluations run ``f`` traced once per padded length
    (:class:`_Traced`), through programs cached by its structure (``_PROGRAMS``), so every content
    and position of the pads at that length, and a later check of a function with the same code, reuses them."""

    def __init__(self, f, flat, treedef, params, out_axis, axis, ks, weights, names):
        self.f, self.treedef, self.params, self.names = f, treedef, params, names
        self.out_axis, self.axis, self.ks, self.weights = out_axis, axis, ks, weights
        self.dynamic = [i for i, x in enumerate(flat) if isinstance(x, (jax.Array, np.ndarray, MaskedArray))]
        self.static = {i: x for i, x in enumerate(flat) if i not in self.dynamic}
        # the float leaves of the params arguments, by position in the flat leaves
        owner = jax.tree_util.tree_unflatten(treedef, list(range(len(flat))))
        mine = sorted(i for p in params for i in jax.tree_util.tree_leaves(owner[p]))
        self.diff = [i for i in mine if _inexact(flat[i]) and not isinstance(flat[i], MaskedArray)]
        self.where = [self.dynamic.index(i) for i in self.diff]
        self._traced = {}  # (padded length, the arrays' shapes) -> _Traced or None
        self._uncached = {}  # programs of a function that does not trace: this check's own

    def call(self, arrays):
        leaves = [None] * (len(self.dynamic) + len(self.static))
        for i, x in zip(self.dynamic, arrays):
            leaves[i] = x
        for i, x in self.static.items():
            leaves[i] = x
        return self.f(*jax.tree_util.tree_unflatten(self.treedef, leaves))

    def arrays(self, leaves):
        return [leaves[i] for i in self.dynamic]

    def outputs(self, out, length, kept):
        """The valid outputs of concrete outputs ``out``, compacted on the host (no program)."""
        return _valid_outputs(out, self.out_axis, self.axis, length, kept, self.ks, np)[0]

    def valid(self, out, length, kept):
        """The valid outputs' ``(values, mask)`` pairs, traceable (inside a compiled program)."""
        return _weighted(out, kept, None, out_axis=self.out_axis, axis=self.axis, length=length, ks=tuple(self.ks))[1]

    def named(self, pairs):
        """Compacted ``(values, mask)`` pairs from a program, on the host and with their names."""
        pairs = jax.tree_util.tree_map(np.asarray, pairs)
        return [(pair, name) for pair, name in zip(pairs, self.names)]

    def loss_of(self, fn, length):
        """``loss(floats, lifted, arrays, kept, weights) -> (loss, valid)``: the weighted valid
        outputs of ``fn``, with those outputs (:meth:`valid`)."""

        def loss(floats, lifted, arrays, kept, weights):
            arrays = list(arrays)
            for j, v in zip(self.where, floats):
                arrays[j] = v
            config = {"out_axis": self.out_axis, "axis": self.axis, "length": length, "ks": tuple(self.ks)}
            return _weighted(fn(lifted, arrays), kept, weights, **config)

        return loss

    def programs(self, layout, arrays, length):
        """``(lifted, call, both, vmapped)`` for one layout, compiled: ``call(lifted, arrays)`` (the
        outputs), ``both(floats, lifted, arrays, kept, weights) -> ((loss, outputs), gradients)``,
        and ``vmapped(axes)``: the one of them a check needs (``both`` when it compares gradients)
        vmapped over the stacked contents (the arrays' axes ``axes``)."""
        # traced once per shape: the layouts of one padded length (pads at the end, at the start,
        # scattered) differ in values only
        shapes = (length, tuple((np.shape(a), str(a.dtype)) for a in jax.tree_util.tree_leaves(arrays)))
        if shapes not in self._traced:
            self._traced[shapes] = _Traced.of(self.call, arrays)
        traced = self._traced[shapes]
        if traced is None:
            key, lifted, fn, store = shapes, [], lambda _, arrays: self.call(arrays), self._uncached
        else:
            config = (self.out_axis, self.axis, length, tuple(self.ks), tuple(self.where))
            key, lifted, fn, store = traced.key + config, traced.lifted, traced.fn, None
        both = jax.value_and_grad(self.loss_of(fn, length), has_aux=True)

        def call(lifted, arrays, kept):
            return self.valid(fn(lifted, arrays), length, kept)

        def cached(kind, build):
            if store is None:
                return _program((kind,) + key, build)
            if (kind,) + key not in store:
                store[(kind,) + key] = build()
            return store[(kind,) + key]

        def vmapped(axes):
            if not self.diff:
                return cached(
                    ("vcall", tuple(axes)), lambda: fast_jit(jax.vmap(call, in_axes=(None, list(axes), None)))
                )
            in_axes = ([axes[j] for j in self.where], None, list(axes), None, None)
            return cached(("vboth", tuple(axes)), lambda: fast_jit(jax.vmap(both, in_axes=in_axes)))

        return lifted, cached("call", lambda: fast_jit(call)), cached("both", lambda: fast_jit(both)), vmapped

    def evaluate(self, leaves, layout, length, kept, jit, grads=True):
        """The valid outputs, and the gradients (``{leaf position: gradient}``) when ``grads`` and
        the check has parameters: compiled (one program computes both), or eagerly (``f`` itself,
        its gradient by an eager ``jax.grad``)."""
        arrays = self.arrays(leaves)
        grads = bool(self.diff) and grads
        floats, extra = [leaves[i] for i in self.diff], (jnp.asarray(kept), self.weights)
        if jit:
            lifted, call, both, _ = self.programs(layout, arrays, length)
            if grads:
                (_, valid), g = both(floats, lifted, arrays, *extra)
            else:
                valid = call(lifted, arrays, extra[0])
            outs = self.named(valid)
        elif grads:
            eager = jax.value_and_grad(self.loss_of(lambda _, arrays: self.call(arrays), length), has_aux=True)
            (_, valid), g = eager(floats, [], arrays, *extra)
            outs = self.named(valid)
        else:
            outs = self.outputs(self.call(arrays), length, kept)
        return outs, dict(zip(self.diff, g)) if grads else None

    def vmapped(self, variants, padded, layout, length, kept):
        """Every content of one layout at once: ``vmap`` over the stacked padded leaves (others shared)."""
        stacked = list(variants[0])
        axes: list[int | None] = [None] * len(variants[0])
        for i in padded:
            stacked[i] = jax.tree_util.tree_map(lambda *xs: jnp.asarray(np.stack(xs)), *[v[i] for v in variants])
            axes[i] = 0
        arr_axes = [axes[i] for i in self.dynamic]
        lifted, _, _, vmapped = self.programs(layout, self.arrays(variants[0]), length)
        program = vmapped(arr_axes)
        grads = None
        if self.diff:
            floats = [stacked[i] for i in self.diff]
            (_, valid), grads = program(floats, lifted, self.arrays(stacked), jnp.asarray(kept), self.weights)
            grads = dict(zip(self.diff, jax.tree_util.tree_map(np.asarray, grads)))
        else:
            valid = program(lifted, self.arrays(stacked), jnp.asarray(kept))
        valid = jax.tree_util.tree_map(np.asarray, valid)
        take = lambda tree, j: jax.tree_util.tree_map(lambda x: x[j], tree)  # noqa: E731
        return [(self.named(take(valid, j)), None if grads is None else take(grads, j)) for j in range(len(variants))]


@functools.partial(jax.jit, static_argnames=("out_axis", "axis", "length", "ks"))
def _weighted(out, kept, weights, *, out_axis, axis, length, ks):
    """``(loss, valid)``: the outputs ``out`` compacted to their valid entries (``(values, mask)``
    pairs) and their sum weighted by ``weights`` (0 without weights). Compiled once per output
    shapes and settings, for every check: an eager gradient of ``f`` runs ``f`` op by op and this
    as one program."""
    valid = [pair for pair, _ in _valid_outputs(out, out_axis, axis, length, kept, list(ks))[0]]
    if weights is None:
        return jnp.zeros(()), valid
    return sum((jnp.sum(v * w) for (v, _), w in zip(valid, weights) if w is not None), jnp.zeros(())), valid


def _inexact(v):
    return hasattr(v, "dtype") and jnp.issubdtype(v.dtype, jnp.inexact)


def _first_change(outs_ref, outs, grad_ref, grads, rtol, names):
    for ((ref, ref_m), name), ((got, got_m), _) in zip(outs_ref, outs):
        change = _changed(
            np.asarray(ref),
            None if ref_m is None else np.asarray(ref_m),
            np.asarray(got),
            None if got_m is None else np.asarray(got_m),
            rtol,
        )
        if change is not None:
            return (name,) + change
    if grad_ref is not None:
        # a gradient that is 0 but for round-off (a bias that a softmax cancels) is compared on the
        # scale of the whole gradient: its round-off comes from terms of that size
        floor = max((_magnitude(np.asarray(r)) for r in grad_ref.values()), default=0.0)
        for i, r in grad_ref.items():
            change = _changed(np.asarray(r), None, np.asarray(grads[i]), None, rtol, floor)
            if change is not None:
                return (f"grad {names[i]}",) + change
    return None


def _magnitude(a) -> float:
    """The largest finite magnitude in ``a`` (0 for non-float arrays)."""
    if not np.issubdtype(a.dtype, np.floating):
        return 0.0
    return float(np.max(np.abs(a[np.isfinite(a)]), initial=0.0))


def _changed(ref, ref_m, got, got_m, rtol, floor=0.0):
    """``(index, expected, got)`` of the first valid entry that moved (or whose mask changed); an
    entry may move by ``rtol`` times its magnitude plus the largest of ``ref`` (at least ``floor``)."""
    if ref.shape != got.shape:
        return ("shape", ref.shape, got.shape)
    if ref_m is not None and got_m is not None:
        diff_mask = ref_m != got_m
        if diff_mask.any():
            i = tuple(int(j) for j in np.argwhere(diff_mask)[0])
            return (i, float(ref_m[i]), float(got_m[i]))
    if not np.issubdtype(ref.dtype, np.floating):
        bad = ref != got
    else:
        scale = max(_magnitude(ref), floor)
        tol = rtol * (np.abs(ref) + scale)
        same = (ref == got) | (np.isnan(ref) & np.isnan(got))
        bad = ~same & ~(np.abs(got - ref) <= tol)
    if ref_m is not None:
        bad = bad & ref_m
    if not bad.any():
        return None
    i = tuple(int(j) for j in np.argwhere(bad)[0])
    return (i, float(ref[i]), float(got[i]))
