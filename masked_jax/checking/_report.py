"""The report of a Jacobian check: truthy when it passed, readable as text and as HTML."""

from __future__ import annotations

import dataclasses
import html
from typing import Any

import numpy as np


@dataclasses.dataclass
class Check:
    """One comparison: input x output x mode x semantics.

    ``worst`` lists up to five entries ``(output index, input index, numerical, analytical,
    failed)``, worst first (in fast mode: one row per random direction). ``leaks`` (masked
    semantics only) maps what was measured off the masks to its largest absolute value: each
    must stay within ``atol``. ``diff`` is ``|numerical - analytical|`` (outputs x inputs, NaN
    where not compared), full mode only.
    """

    input: str
    output: str
    mode: str
    semantics: str
    passed: bool
    max_abs: float
    max_rel: float
    worst: list
    leaks: dict
    diff: Any = None
    numerical: Any = None
    analytical: Any = None


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
        head = (f"JacobianReport({'PASSED' if self else 'FAILED'}: {self._verdict()})\n"
                f"  backend={self.backend} dtype={self.dtype} eps={self.eps:g} atol={self.atol:g} "
                f"rtol={self.rtol:g} method={'random projections (fast)' if self.fast else 'full Jacobian'}")
        lines = [head]
        for note in self.notes:
            lines.append(f"  note: {note}")
        for c in self.checks:
            lines.append(f"  [{'pass' if c.passed else 'FAIL'}] {c.semantics:6s} {c.mode} d{c.output}/d{c.input}: "
                         f"max abs err {c.max_abs:.3g}, max rel err {c.max_rel:.3g}")
            for name, value in c.leaks.items():
                flag = "" if np.isfinite(value) and value <= self.atol else "  <-- leak"
                lines.append(f"      off-mask {name}: {value:.3g}{flag}")
            if any(w[4] for w in c.worst):
                for out_idx, in_idx, num, an, bad in c.worst:
                    where = out_idx if self.fast else f"out{list(out_idx)} in{list(in_idx)}"
                    lines.append(f"      {where}: numerical {num:.6g}  analytical {an:.6g}"
                                 f"{'  <-- mismatch' if bad else ''}")
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        return self.to_html(heatmap=True)

    def to_html(self, heatmap: bool = True, max_heatmap: int = 40) -> str:
        """The report as HTML tables, with a heatmap of ``|numerical - analytical|`` per failing
        full-mode check (at most ``max_heatmap`` x ``max_heatmap`` cells)."""
        e = html.escape
        colour = "#2e7d32" if self else "#c62828"
        out = [f"<div><b style='color:{colour}'>Jacobian check {'passed' if self else 'FAILED'}</b>: "
               f"{e(self._verdict())}<br><small>backend {e(self.backend)}, dtype {e(self.dtype)}, "
               f"eps {self.eps:g}, atol {self.atol:g}, rtol {self.rtol:g}, "
               f"{'random projections (fast)' if self.fast else 'full Jacobian'}</small>"]
        for note in self.notes:
            out.append(f"<br><small>note: {e(note)}</small>")
        out.append("<table><tr><th>semantics</th><th>mode</th><th>output</th><th>input</th><th>result</th>"
                   "<th>max abs err</th><th>max rel err</th><th>off-mask leak</th></tr>")
        for c in self.checks:
            leak = max(c.leaks.values()) if c.leaks else None
            out.append(f"<tr><td>{c.semantics}</td><td>{c.mode}</td><td>{e(c.output)}</td><td>{e(c.input)}</td>"
                       f"<td style='color:{'#2e7d32' if c.passed else '#c62828'}'>{'pass' if c.passed else 'FAIL'}</td>"
                       f"<td>{c.max_abs:.3g}</td><td>{c.max_rel:.3g}</td>"
                       f"<td>{'' if leak is None else f'{leak:.3g}'}</td></tr>")
        out.append("</table>")
        for c in self.failures():
            out.append(f"<p><b>{c.semantics} {c.mode} d{e(c.output)}/d{e(c.input)}</b>: worst entries</p>"
                       "<table><tr><th>output</th><th>input</th><th>numerical</th><th>analytical</th></tr>")
            for out_idx, in_idx, num, an, bad in c.worst:
                style = " style='background:#ffcdd2'" if bad else ""
                out.append(f"<tr{style}><td>{e(str(out_idx))}</td><td>{e(str(in_idx))}</td>"
                           f"<td>{num:.6g}</td><td>{an:.6g}</td></tr>")
            out.append("</table>")
            if heatmap and c.diff is not None:
                out.append(_heatmap(c.diff, max_heatmap))
        out.append("</div>")
        return "".join(out)


def _heatmap(diff, limit):
    """``|numerical - analytical|`` as a grid of coloured cells (rows: outputs, columns: inputs)."""
    d = diff[:limit, :limit]
    top = np.nanmax(d) if np.isfinite(d).any() else 0.0
    cells = []
    for row in d:
        tds = []
        for v in row:
            if np.isnan(v):
                tds.append("<td style='background:#eeeeee' title='not compared'></td>")
            else:
                a = 0.0 if top == 0 else min(1.0, float(v) / top)
                tds.append(f"<td style='background:rgba(198,40,40,{a:.2f})' title='{v:.3g}'></td>")
        cells.append("<tr>" + "".join(tds) + "</tr>")
    return ("<p><small>|numerical - analytical| (rows: output elements, columns: input elements; grey: "
            f"not compared; darkest = {top:.3g})</small></p>"
            "<table class='mj-heatmap' style='border-collapse:collapse'>" + "".join(cells) + "</table>")


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
