"""The report of a Jacobian check: truthy when it passed, readable as text and as HTML."""

from __future__ import annotations

import dataclasses
import functools
import html
from collections.abc import Callable
from typing import Any

import numpy as np


def leak_summary(entries, input_name, output_name, max_elements=24):
    """Lines that summarise a leak map (``entries`` from :func:`_leak_entries`): how many masked-out
    input elements reach how many valid outputs; for an input of two or more dimensions, every
    (batch, position) pair (its first two indices) that leaks; then, per leaking input element, the
    outputs it reaches and through what, for the first ``max_elements`` elements, saying how many
    more there are (``leak_map`` lists them all)."""
    by_input: dict = {}
    for in_idx, out_idx, kinds in entries:
        by_input.setdefault(tuple(in_idx), []).append((tuple(out_idx), kinds))
    outputs = {o for targets in by_input.values() for o, _ in targets}
    lines = [
        f"leak map: {len(by_input)} masked-out element{'s' * (len(by_input) != 1)} of {input_name} "
        f"reach{'es' * (len(by_input) == 1)} "
        f"{len(outputs)} valid element{'s' * (len(outputs) != 1)} of {output_name} ({len(entries)} pairs)"
    ]
    if by_input and len(next(iter(by_input))) >= 2:
        pairs = sorted({idx[:2] for idx in by_input})
        lines.append(f"  at (batch, position) of {input_name}: " + ", ".join(f"({b}, {p})" for b, p in pairs))
    for idx, targets in list(by_input.items())[:max_elements]:
        groups: dict = {}
        for o, kinds in targets:
            groups.setdefault(kinds, []).append(f"{output_name}{list(o)}")
        reached = "; ".join(f"{', '.join(outs)}: {', '.join(kinds)}" for kinds, outs in groups.items())
        lines.append(f"  {input_name}{list(idx)} -> {reached}")
    if len(by_input) > max_elements:
        lines.append(
            f"  ... and {len(by_input) - max_elements} more masked-out elements (the check's leak_map lists all)"
        )
    return lines


@dataclasses.dataclass
class Check:
    """One comparison: input x output x mode x semantics.

    ``worst`` lists up to five entries ``(output index, input index, numerical, analytical,
    failed)``, worst first (in fast mode: one row per random direction). ``leaks`` (masked
    semantics only) maps what was measured off the masks to its largest absolute value: each
    must stay within ``atol``. ``leak_map`` (masked semantics, full mode) locates the leaks: every
    ``(input index, output index, kinds)``, a masked-out input element and the valid output
    it reaches, by its value (the output moves when that element alone is NaN), its gradient (a
    Jacobian entry with NaN under the masks is not 0) or numerically (perturbing it moves the
    output); ``leak_cells`` is the whole map as an (outputs x inputs) array of those kinds as
    bits 1, 2 and 4 (the value and gradient kinds are taken when a masked check failed).
    ``fd_error`` is the largest Richardson estimate of the finite differences' own error (from
    steps eps and 2 eps; twice it is added to each entry's tolerance), taken when a derivative
    would fail without it by at most 100 tolerances (``None`` otherwise; ``near_miss`` says such
    a failure); ``mismatch`` says a derivative failed (not only a leak), and ``reason`` says in
    words why a failing check failed. ``diff`` is ``|numerical - analytical|`` (outputs x
    inputs, NaN where not compared), full mode only.

    The verdict is taken where the check ran (on the accelerator, for a GPU; by numpy, on the CPU); ``worst``,
    ``diff``, ``numerical``, ``analytical``, ``leak_map`` and ``leak_cells`` are numpy arrays and
    lists copied from there when first read, so a check nobody looks into costs no transfer of
    its tables.
    """

    input: str
    output: str
    mode: str
    semantics: str
    passed: bool
    max_abs: float
    max_rel: float
    leaks: dict
    fd_error: Any = None
    reason: str = ""
    mismatch: bool = False
    near_miss: bool = False
    details: Callable[[], dict] = dataclasses.field(default=dict, repr=False, compare=False)

    @functools.cached_property
    def _shown(self) -> dict:
        return self.details()

    worst = property(lambda self: self._shown.get("worst", []))
    diff = property(lambda self: self._shown.get("diff"))
    numerical = property(lambda self: self._shown.get("numerical"))
    analytical = property(lambda self: self._shown.get("analytical"))
    leak_map = property(lambda self: self._shown.get("leak_map", []))
    leak_cells = property(lambda self: self._shown.get("leak_cells"))


@dataclasses.dataclass
class JacobianReport:
    """What :func:`masked_jax.check_jacobian` found. ``bool(report)`` is True when it passed.

    With one semantics asked for, it passed when every check of that semantics passed. With
    ``"both"``, it passed when the function implements at least one of them; :attr:`satisfies`
    names which.

    Examples:
        >>> import jax.numpy as jnp, masked_jax as mj
        >>> r = mj.check_jacobian(jnp.sin, (jnp.array([0.5, 1.0]),), semantics="dense")
        >>> bool(r), r.satisfies
        (True, ('dense',))
    """

    checks: list
    semantics: tuple
    backend: str
    dtype: str
    eps: float
    atol: float
    rtol: float
    fast: bool
    notes: list

    @property
    def satisfies(self) -> tuple:
        """The semantics every check of which passed."""
        return tuple(s for s in self.semantics if all(c.passed for c in self.checks if c.semantics == s))

    def __bool__(self) -> bool:
        return bool(self.satisfies)

    def failures(self) -> list:
        return [c for c in self.checks if not c.passed]

    def _verdict(self) -> str:
        failed = [s for s in self.semantics if s not in self.satisfies]
        parts = []
        if self.satisfies:
            parts.append("satisfies " + " and ".join(f"{s} semantics" for s in self.satisfies))
        if failed:
            parts.append("fails " + " and ".join(f"{s} semantics" for s in failed))
        return "; ".join(parts)

    def __repr__(self) -> str:
        head = (
            f"JacobianReport({'PASSED' if self else 'FAILED'}: {self._verdict()})\n"
            f"  backend={self.backend} dtype={self.dtype} eps={self.eps:g} atol={self.atol:g} "
            f"rtol={self.rtol:g} method={'random projections (fast)' if self.fast else 'full Jacobian'}"
        )
        lines = [head]
        for note in self.notes:
            lines.append(f"  note: {note}")
        for c in self.checks:
            lines.append(
                f"  [{'pass' if c.passed else 'FAIL'}] {c.semantics:6s} {c.mode} d{c.output}/d{c.input}: "
                f"max abs err {c.max_abs:.3g}, max rel err {c.max_rel:.3g}"
                + ("" if c.fd_error is None else f", finite-difference error estimate {c.fd_error:.2g}")
            )
            if c.reason:
                lines.append(f"      why: {c.reason}")
            for name, value in c.leaks.items():
                flag = "" if np.isfinite(value) and value <= self.atol else "  <-- leak"
                lines.append(f"      off-mask {name}: {value:.3g}{flag}")
            if not c.passed and c.leak_map:
                lines += ["      " + line for line in leak_summary(c.leak_map, c.input, c.output)]
            if c.mismatch:  # the worst entries: read from the tables only for a failed derivative
                for out_idx, in_idx, num, an, bad in c.worst:
                    where = out_idx if self.fast else f"out{list(out_idx)} in{list(in_idx)}"
                    lines.append(
                        f"      {where}: numerical {num:.6g}  analytical {an:.6g}{'  <-- mismatch' if bad else ''}"
                    )
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        return self.to_html(heatmap=True)

    def to_html(self, heatmap: bool = True, max_heatmap: int = 40) -> str:
        """The report as HTML tables, with a heatmap of ``|numerical - analytical|`` per failing
        full-mode check (at most ``max_heatmap`` x ``max_heatmap`` cells)."""
        e = html.escape
        colour = "#2e7d32" if self else "#c62828"
        out = [
            f"<div><b style='color:{colour}'>Jacobian check {'passed' if self else 'FAILED'}</b>: "
            f"{e(self._verdict())}<br><small>backend {e(self.backend)}, dtype {e(self.dtype)}, "
            f"eps {self.eps:g}, atol {self.atol:g}, rtol {self.rtol:g}, "
            f"{'random projections (fast)' if self.fast else 'full Jacobian'}</small>"
        ]
        for note in self.notes:
            out.append(f"<br><small>note: {e(note)}</small>")
        out.append(
            f"<table style='{TABLE_STYLE}'><tr><th>semantics</th><th>mode</th><th>output</th><th>input</th><th>result</th>"
            "<th>max abs err</th><th>max rel err</th><th>off-mask leak</th></tr>"
        )
        for c in self.checks:
            leak = max(c.leaks.values()) if c.leaks else None
            out.append(
                f"<tr><td>{c.semantics}</td><td>{c.mode}</td><td>{e(c.output)}</td><td>{e(c.input)}</td>"
                f"<td style='color:{'#2e7d32' if c.passed else '#c62828'}'>{'pass' if c.passed else 'FAIL'}</td>"
                f"<td>{c.max_abs:.3g}</td><td>{c.max_rel:.3g}</td>"
                f"<td>{'' if leak is None else f'{leak:.3g}'}</td></tr>"
            )
        out.append("</table>")
        for c in self.failures():
            out.append(
                f"<p><b>{c.semantics} {c.mode} d{e(c.output)}/d{e(c.input)}</b>: {e(c.reason)}. Worst entries</p>"
                f"<table style='{TABLE_STYLE}'><tr><th>output</th><th>input</th><th>numerical</th><th>analytical</th></tr>"
            )
            for out_idx, in_idx, num, an, bad in c.worst:
                style = " style='background:#ffcdd2'" if bad else ""
                out.append(
                    f"<tr{style}><td>{e(str(out_idx))}</td><td>{e(str(in_idx))}</td>"
                    f"<td>{num:.6g}</td><td>{an:.6g}</td></tr>"
                )
            out.append("</table>")
            if c.leak_map:
                summary = leak_summary(c.leak_map, c.input, c.output, max_elements=0)
                out.append(
                    f"<p><b>{e(summary[0])}</b>{''.join(f'<br>{e(line.strip())}' for line in summary[1:2])}</p>"
                    f"<table style='{TABLE_STYLE}'><tr><th>masked-out input</th><th>valid output"
                    "</th><th>through</th></tr>"
                )
                for in_idx, out_idx, kinds in c.leak_map:
                    out.append(
                        f"<tr style='background:{_LEAK}33'><td>{e(str(in_idx))}</td><td>{e(str(out_idx))}</td>"
                        f"<td>{e(', '.join(kinds))}</td></tr>"
                    )
                out.append("</table>")
            if heatmap and c.diff is not None:
                out.append(_heatmap(c.diff, max_heatmap, c.leak_cells))
        out.append("</div>")
        return styled("".join(out))

    def save_html(self, path, heatmap: bool = True) -> None:
        """Write the report as a standalone HTML page that any browser shows as Jupyter does.

        Examples:
            >>> import pathlib, tempfile, jax.numpy as jnp, masked_jax as mj
            >>> r = mj.check_jacobian(jnp.sin, (jnp.array([0.5, 1.0]),), semantics="dense")
            >>> path = pathlib.Path(tempfile.mkdtemp()) / "report.html"
            >>> r.save_html(path)
            >>> "Jacobian check passed" in path.read_text()
            True
        """
        write_page(path, "Jacobian check", self.to_html(heatmap=heatmap))

    def plot(self, checks=None, max_cells: int = 60):
        """``|numerical - analytical|`` of full-mode checks as matplotlib heatmaps, one panel each.

        Args:
            checks: the checks to draw; by default the failing ones that have a full Jacobian,
                or every check with one when none failed.
            max_cells: at most this many output and input elements per panel.

        Returns:
            A ``matplotlib.figure.Figure`` (matplotlib must be installed).

        Examples:
            >>> import jax.numpy as jnp, masked_jax as mj
            >>> r = mj.check_jacobian(jnp.sin, (jnp.array([0.5, 1.0]),), semantics="dense")
            >>> fig = r.plot()
            >>> [ax.get_xlabel() for ax in fig.axes[:1]]
            ['input element']
        """
        try:
            import matplotlib.pyplot as plt
            from matplotlib.ticker import MaxNLocator
        except ImportError as err:  # pragma: no cover - matplotlib is an optional dependency
            raise ImportError("JacobianReport.plot needs matplotlib: pip install matplotlib") from err
        if checks is None:
            with_diff = [c for c in self.checks if c.diff is not None]
            checks = [c for c in with_diff if not c.passed] or with_diff
        checks = [c for c in checks if c.diff is not None]
        if not checks:
            raise ValueError(
                "no check to plot: fast mode (random projections) keeps no full Jacobian; "
                "run check_jacobian with fast=False"
            )
        fig, axes = plt.subplots(1, len(checks), figsize=(4.2 * len(checks), 3.6), squeeze=False)
        for ax, c in zip(axes[0], checks):
            d = np.ma.masked_invalid(np.asarray(c.diff, dtype=float)[:max_cells, :max_cells])
            cmap = plt.get_cmap("Reds").with_extremes(bad="#dddddd")
            im = ax.imshow(
                d,
                cmap=cmap,
                vmin=0.0,
                vmax=max(float(d.max()) if d.count() else 0.0, self.atol),
                interpolation="nearest",
                aspect="auto",
            )
            if c.leak_cells is not None and np.any(c.leak_cells):  # the leak map, over the greyed-out columns
                rows, cols = np.nonzero(np.asarray(c.leak_cells)[:max_cells, :max_cells])
                ax.scatter(cols, rows, marker="s", s=60, color=_LEAK, label="leak")
                ax.legend(loc="upper right", fontsize=7)
            ax.set_title(f"{c.semantics} {c.mode} d{c.output}/d{c.input}: {'pass' if c.passed else 'FAIL'}", fontsize=9)
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            ax.yaxis.set_major_locator(MaxNLocator(integer=True))
            ax.set_xlabel("input element")
            ax.set_ylabel("output element")
            fig.colorbar(im, ax=ax, label="|numerical - analytical|")
        fig.tight_layout()
        return fig


def write_page(path, title: str, body: str) -> None:
    """Write ``body`` (HTML) as a standalone page titled ``title``."""
    with open(path, "w", encoding="utf-8") as f:
        f.write(
            f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title></head>"
            f"<body style='font:14px sans-serif;margin:16px;background:#ffffff;color:#111111'>{body}</body></html>"
        )


def styled(table_html: str) -> str:
    """``table_html`` with the reports' cell style on every ``td`` and ``th``."""
    return table_html.replace("<td>", f"<td style='{_TD}'>").replace("<th>", f"<th style='{_TD}'>")


TABLE_STYLE = "border-collapse:collapse;margin:6px 0;font:12px sans-serif"
_TD = "border:1px solid #cccccc;padding:2px 6px;text-align:left"
_LEAK = "#7b1fa2"  # leak-map cells: purple, apart from the error scale's reds and the greys
_CELL = 18  # heatmap cell size in pixels, set inline so the report needs no style sheet


def _heatmap(diff, limit, leak_cells=None):
    """``|numerical - analytical|`` as a grid of sized, coloured cells with axis labels and a
    colour scale (rows: output elements, columns: input elements; grey: not compared; purple: a
    masked-out input element reaching a valid output, from the leak map)."""
    d = np.asarray(diff)[:limit, :limit]
    leaks = None if leak_cells is None else np.asarray(leak_cells)[:limit, :limit]
    top = float(np.nanmax(d)) if np.isfinite(d).any() else 0.0
    cell = f"width:{_CELL}px;height:{_CELL}px;min-width:{_CELL}px;padding:0;border:1px solid #ffffff"
    label = "font:10px sans-serif;color:#333333;padding:0 3px;text-align:right"
    rows = [
        "<tr><td style=''></td>"
        + "".join(f"<td class='mj-axis' style='{label};text-align:center'>{j}</td>" for j in range(d.shape[1]))
        + "</tr>"
    ]
    for i, row in enumerate(d):
        tds = [f"<td class='mj-axis' style='{label}'>{i}</td>"]
        for j, v in enumerate(row):
            if leaks is not None and leaks[i, j]:
                kinds = ", ".join(
                    name for bit, name in ((1, "value"), (2, "gradient"), (4, "numerical")) if leaks[i, j] & bit
                )
                tds.append(f"<td class='mj-leak' style='{cell};background:{_LEAK}' title='leak: {kinds}'></td>")
            elif np.isnan(v):
                tds.append(f"<td style='{cell};background:#dddddd' title='not compared'></td>")
            else:
                tds.append(f"<td style='{cell};background:{_red(v, top)}' title='{v:.3g}'></td>")
        rows.append("<tr>" + "".join(tds) + "</tr>")
    steps = np.linspace(0.0, 1.0, 11)
    scale = (
        "<div class='mj-scale' style='display:inline-block;vertical-align:top;margin-left:16px;"
        "font:11px sans-serif;color:#333333'><div>|error|</div>"
        + "".join(
            f"<div style='display:flex;align-items:center;height:{_CELL}px'>"
            f"<span style='{cell};display:inline-block;background:{_red(s * top, top)}'></span>"
            f"<span style='margin-left:4px'>{s * top:.2g}</span></div>"
            for s in steps[::-1]
        )
        + f"<div style='display:flex;align-items:center;margin-top:4px'><span style='{cell};"
        "display:inline-block;background:#dddddd'></span><span style='margin-left:4px'>not compared"
        "</span></div>"
        + (
            f"<div style='display:flex;align-items:center;margin-top:4px'><span style='{cell};"
            f"display:inline-block;background:{_LEAK}'></span><span style='margin-left:4px'>leak</span></div>"
            if leaks is not None and leaks.any()
            else ""
        )
        + "</div>"
    )
    clipped = "" if d.shape == np.shape(diff) else f" (first {limit} x {limit} shown)"
    return (
        "<div class='mj-heatmap-block' style='margin:8px 0'>"
        f"<div class='mj-axis' style='font:12px sans-serif;color:#333333;margin-left:24px'>"
        f"input element &rarr;{clipped}</div>"
        "<div style='display:flex;align-items:flex-start'>"
        "<div class='mj-axis' style='font:12px sans-serif;color:#333333;writing-mode:vertical-rl;"
        "transform:rotate(180deg);margin-right:4px'>output element &rarr;</div>"
        "<table class='mj-heatmap' style='border-collapse:collapse;table-layout:fixed'>"
        + "".join(rows)
        + "</table>"
        + scale
        + "</div></div>"
    )


def _red(value, top):
    """The heatmap's colour scale: from very light red at 0 to dark red at ``top``."""
    a = 0.0 if top == 0 else min(1.0, max(0.0, float(value) / top))
    lo, hi = (255, 245, 240), (103, 0, 13)
    return "rgb({},{},{})".format(*(int(round(c0 + a * (c1 - c0))) for c0, c1 in zip(lo, hi)))


class JacobianError(AssertionError):
    """A Jacobian check failed; ``err.report`` is the :class:`JacobianReport`.

    Examples:
        >>> import jax, jax.numpy as jnp, masked_jax as mj
        >>> @jax.custom_vjp
        ... def f(x):
        ...     return jnp.sin(x)
        >>> f.defvjp(lambda x: (jnp.sin(x), x), lambda x, g: (g * 2.0 * jnp.cos(x),))  # wrong: 2x
        >>> try:
        ...     mj.check_jacobian(f, (jnp.array([0.3, 0.7]),), semantics="dense")
        ... except mj.JacobianError as err:
        ...     print(bool(err.report), err.report.notes[0][:20])
        False forward mode skipped
    """

    def __init__(self, report: JacobianReport):
        super().__init__(repr(report))
        self.report = report
