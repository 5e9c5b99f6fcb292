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

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from masked_jax._core import MaskedArray

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

    rng = np.random.default_rng(seed)
    ref_keeps = keeps[padded[0]]
    outs_ref, ks = _valid_outputs(f(*args), out_axis, axis, length, ref_keeps)
    weights = [
        None
        if not jnp.issubdtype(v.dtype, jnp.floating)
        else jnp.asarray(rng.normal(size=v.shape), v.dtype) * (1 if m is None else m)
        for (v, m), _ in outs_ref
    ]
    run = _Run(f, flat, treedef, params, out_axis, axis, ks, weights)
    grad_ref = run.gradients(flat, "given", length, ref_keeps, jit=True) if run.diff else None
    names = [
        "args" + jax.tree_util.keystr(path)
        for path, _ in jax.tree_util.tree_flatten_with_path(args, is_leaf=lambda x: isinstance(x, MaskedArray))[0]
    ]

    cases = []
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
            for transform in transforms:
                layout = (new_len, pos)
                if transform == "vmap":
                    results = run.vmapped(variants, padded, layout, new_len, new_keeps)
                else:  # eager gradients (slow): one content, at the given length
                    jit = transform == "jit"
                    results = [
                        run.evaluate(
                            leaves, layout, new_len, new_keeps, jit, jit or (k == eager_grad and new_len == length)
                        )
                        for k, leaves in enumerate(variants)
                    ]
                for fill, (outs, grads) in zip(fills, results):
                    first = _first_change(outs_ref, outs, grad_ref if grads is not None else None, grads, rtol, names)
                    cases.append(
                        InvarianceCase(
                            f"pad to {new_len} ({name}) at {pos}, {fill} content", transform, first is None, first
                        )
                    )
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
        leaves[i] = MaskedArray.tree_unflatten(None, (jnp.asarray(nd), jnp.asarray(nm)))
    return leaves


def _valid_outputs(out, out_axis, axis, length, kept, ks=None):
    """``([((values, mask or None), name)], ks)`` per output leaf: compacted along its padded axis
    (valid positions first, in order, ``ks[j]`` slots: the longest row of the reference) with
    masked-out entries set to 0. ``ks=None`` (the reference, concrete) measures ``ks``; traceable
    otherwise."""
    flat, _ = jax.tree_util.tree_flatten_with_path(out, is_leaf=lambda x: isinstance(x, MaskedArray))
    result, measured = [], []
    for j, (path, leaf) in enumerate(flat):
        name = "out" + jax.tree_util.keystr(path)
        own = isinstance(leaf, MaskedArray)
        data = leaf.data if own else jnp.asarray(leaf)
        mask = jnp.broadcast_to(leaf.mask, leaf.shape) if own else None
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
            pos_valid = _kept(leaf, a, jnp) if own else jnp.asarray(kept)
            if pos_valid.shape[0] != int(np.prod(data.shape[:a], dtype=np.int64)):
                raise ValueError(
                    f"check_invariance: output {name} of shape {data.shape} does not have the "
                    f"inputs' {pos_valid.shape[0]} rows before its padded axis {a}; give out_axis."
                )
            k = max(int(np.asarray(pos_valid).sum(-1).max(initial=0)), 1) if ks is None else ks[j]
            data, mask = _compact(data, mask, a, pos_valid, k)
        measured.append(k)
        result.append(((data if mask is None else jnp.where(mask, data, 0), mask), name))
    return result, measured


def _compact(data, mask, a, pos_valid, k):
    """``data`` (and ``mask``) along axis ``a`` as ``(rows, trailing..., k)``: each row's valid
    positions first, in order; slots past a row's valid count are masked."""
    rows = pos_valid.shape[0]
    d = jnp.moveaxis(data, a, -1)
    trail = d.shape[len(data.shape[:a]) : -1]
    d = d.reshape((rows,) + trail + (data.shape[a],))
    m = None if mask is None else jnp.moveaxis(mask, a, -1).reshape(d.shape)
    if data.shape[a] < k:  # fewer positions than the reference's valid ones: pad (masked)
        widths = [(0, 0)] * (d.ndim - 1) + [(0, k - data.shape[a])]
        d = jnp.pad(d, widths)
        m = None if m is None else jnp.pad(m, widths)
        pos_valid = jnp.pad(pos_valid, [(0, 0), (0, k - data.shape[a])])
    order = jnp.argsort(~pos_valid, axis=-1, stable=True)[:, :k]  # valid positions first, in order
    ok = jnp.take_along_axis(pos_valid, order, -1)
    idx = jnp.broadcast_to(order.reshape((rows,) + (1,) * len(trail) + (k,)), (rows,) + trail + (k,))
    ok = jnp.broadcast_to(ok.reshape((rows,) + (1,) * len(trail) + (k,)), idx.shape)
    if m is not None:
        ok = ok & jnp.take_along_axis(m, idx, -1)
    return jnp.take_along_axis(d, idx, -1), ok


class _Run:
    """How one re-padded input set is evaluated: the outputs, and the gradients of their weighted
    valid entries with respect to the float leaves of the ``params`` arguments. Leaves that are not
    arrays (flags, sizes) are static; the jitted functions are built once per layout and serve
    every content."""

    def __init__(self, f, flat, treedef, params, out_axis, axis, ks, weights):
        self.f, self.treedef, self.params = f, treedef, params
        self.out_axis, self.axis, self.ks, self.weights = out_axis, axis, ks, weights
        self.dynamic = [i for i, x in enumerate(flat) if isinstance(x, (jax.Array, np.ndarray, MaskedArray))]
        self.static = {i: x for i, x in enumerate(flat) if i not in self.dynamic}
        # the float leaves of the params arguments, by position in the flat leaves
        owner = jax.tree_util.tree_unflatten(treedef, list(range(len(flat))))
        mine = sorted(i for p in params for i in jax.tree_util.tree_leaves(owner[p]))
        self.diff = [i for i in mine if _inexact(flat[i]) and not isinstance(flat[i], MaskedArray)]
        self.jit_call = jax.jit(self.call)
        self._grads = {}

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
        return _valid_outputs(out, self.out_axis, self.axis, length, kept, self.ks)[0]

    def grad_fn(self, layout, length, kept, jit):
        """``(floats, arrays) -> gradients``, built once per layout."""
        key = (layout, jit)
        if key not in self._grads:
            where = [self.dynamic.index(i) for i in self.diff]

            def loss(floats, arrays):
                arrays = list(arrays)
                for j, v in zip(where, floats):
                    arrays[j] = v
                pairs = zip(self.outputs(self.call(arrays), length, kept), self.weights)
                return sum(jnp.sum(v * w) for ((v, _), _), w in pairs if w is not None)

            g = jax.grad(loss)
            self._grads[key] = jax.jit(g) if jit else g
        return self._grads[key]

    def gradients(self, leaves, layout, length, kept, jit=False):
        """The gradients, as ``{leaf position: gradient}``."""
        g = self.grad_fn(layout, length, kept, jit)([leaves[i] for i in self.diff], self.arrays(leaves))
        return dict(zip(self.diff, g))

    def evaluate(self, leaves, layout, length, kept, jit, grads=True):
        out = (self.jit_call if jit else self.call)(self.arrays(leaves))
        grads = self.gradients(leaves, layout, length, kept, jit) if self.diff and grads else None
        return self.outputs(out, length, kept), grads

    def vmapped(self, variants, padded, layout, length, kept):
        """Every content of one layout at once: ``vmap`` over the stacked padded leaves (others shared)."""
        stacked = list(variants[0])
        axes: list[int | None] = [None] * len(variants[0])
        for i in padded:
            stacked[i] = jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *[v[i] for v in variants])
            axes[i] = 0
        arr_axes = [axes[i] for i in self.dynamic]
        outs = jax.jit(jax.vmap(self.call, in_axes=(arr_axes,)))(self.arrays(stacked))
        grads = None
        if self.diff:
            g = self.grad_fn(layout, length, kept, False)
            grads = jax.jit(jax.vmap(g, in_axes=([axes[i] for i in self.diff], arr_axes)))(
                [stacked[i] for i in self.diff], self.arrays(stacked)
            )
            grads = dict(zip(self.diff, grads))
        take = lambda tree, j: jax.tree_util.tree_map(lambda x: x[j], tree)  # noqa: E731
        return [
            (self.outputs(take(outs, j), length, kept), None if grads is None else take(grads, j))
            for j in range(len(variants))
        ]


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
        for i, r in grad_ref.items():
            change = _changed(np.asarray(r), None, np.asarray(grads[i]), None, rtol)
            if change is not None:
                return (f"grad {names[i]}",) + change
    return None


def _changed(ref, ref_m, got, got_m, rtol):
    """``(index, expected, got)`` of the first valid entry that moved (or whose mask changed)."""
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
        scale = float(np.max(np.abs(ref[np.isfinite(ref)]), initial=0.0))
        tol = rtol * (np.abs(ref) + scale)
        same = (ref == got) | (np.isnan(ref) & np.isnan(got))
        bad = ~same & ~(np.abs(got - ref) <= tol)
    if ref_m is not None:
        bad = bad & ref_m
    if not bad.any():
        return None
    i = tuple(int(j) for j in np.argwhere(bad)[0])
    return (i, float(ref[i]), float(got[i]))
