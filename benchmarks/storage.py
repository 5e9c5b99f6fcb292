"""Row-sparse vs dense-layout masked ops on a 1M x 64 float32 array with 1% and 10% of rows stored.

Ops: elementwise ``exp``, a reduction within rows (``sum(axis=1)``), a reduction across rows
(``sum(axis=0)``) and ``softmax`` along the last axis, all under ``jit``. The dense layout is
a ``MaskedArray`` holding the same valid rows. Prints medians, the speedup of row-sparse over
dense, and the time per stored row (about constant when time grows linearly with stored rows);
saves a plot to ``benchmarks/results/storage.png``.

A second table does the same for a BCOO-backed masked matrix (20k x 2k, 0.1% and 1% of entries
stored): reductions along each axis and softmax along rows, computed by segments of stored
entries, against the dense layout.

Run: ``.venv/bin/python benchmarks/storage.py`` (``--quick`` for a small smoke run).
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import sparse as jsparse

sys.path.insert(0, os.path.dirname(__file__))
from _timing import RESULTS, interleaved_medians, progress

import masked_jax as mj
import masked_jax.nn as mnn
import masked_jax.numpy as mnp

OPS = {
    "exp": lambda x: mnp.exp(x),
    "sum(axis=1)": lambda x: mnp.sum(x, axis=1),
    "sum(axis=0)": lambda x: mnp.sum(x, axis=0),
    "softmax(axis=-1)": lambda x: mnn.softmax(x, axis=-1),
}


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    n, d = (20_000, 64) if args.quick else (1_000_000, 64)
    fractions = (0.01, 0.10)
    rng = np.random.default_rng(0)
    rows = {}
    for frac in progress(fractions, "stored fraction"):
        k = int(n * frac)
        idx = jnp.asarray(np.sort(rng.choice(n, size=k, replace=False)).astype(np.int32))
        vals = jnp.asarray(rng.normal(size=(k, d)).astype(np.float32))
        rsp = mj.row_sparse(vals, idx, (n, d), unique_indices=True)
        # float32 sums over 10^4+ rows in a different order: atol 1e-2
        rows.update(_time_ops(OPS, rsp, frac, k, atol=1e-2))
    _print_table(f"{n} x {d} float32", "row_sparse", "stored rows", rows, ".0%", per_row=True)
    _plot(rows, fractions)
    bcoo_rows = bcoo_table(args.quick, rng)
    return rows, bcoo_rows


def _time_ops(ops, sparse, frac, stored, atol):
    """``{(op name, frac): (stored, sparse seconds, dense-layout seconds)}`` for each jitted op."""
    dense = sparse.todense()
    return {(name, frac): (stored, *_check_and_time(jax.jit(op), sparse, dense, atol)) for name, op in ops.items()}


def _print_table(title, layout, stored, rows, frac_format, per_row=False):
    """Markdown table of ``_time_ops`` results: medians in ms and the dense / sparse ratio."""
    print(f"{title}, backend {jax.default_backend()}")
    cols = ["op", stored, f"{layout} (ms)", "dense layout (ms)", f"dense / {layout}"]
    cols += [f"{layout} ns per stored row"] if per_row else []
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for (name, frac), (k, ts, td) in rows.items():
        cells = [name, f"{k} ({frac:{frac_format}})", f"{ts * 1e3:.3f}", f"{td * 1e3:.2f}", f"{td / ts:.1f}x"]
        cells += [f"{ts / k * 1e9:.1f}"] if per_row else []
        print("| " + " | ".join(cells) + " |")


def _check_and_time(f, sparse, dense, atol):
    """Median seconds of ``f`` on the sparse and the dense layout, after checking that both give
    the same masks and valid values."""
    got, want = f(sparse), f(dense)
    got = got.todense() if hasattr(got, "todense") else got
    np.testing.assert_array_equal(np.asarray(got.mask), np.asarray(want.mask))
    np.testing.assert_allclose(np.asarray(got.filled(0)), np.asarray(want.filled(0)), rtol=1e-4, atol=atol)
    t = interleaved_medians({"sparse": lambda: f(sparse), "dense": lambda: f(dense)}, rounds=3, block=3, warmup=1)
    return t["sparse"], t["dense"]


BCOO_OPS = {
    "sum(axis=1)": lambda x: mnp.sum(x, axis=1),
    "max(axis=0)": lambda x: mnp.max(x, axis=0),
    "softmax(axis=1)": lambda x: mnn.softmax(x, axis=1),
}


def bcoo_table(quick, rng):
    m, n = (2_000, 500) if quick else (20_000, 2_000)
    out = {}
    for frac in (0.001, 0.01):
        nse = int(m * n * frac)
        flat = np.sort(rng.choice(m * n, size=nse, replace=False))
        idx = jnp.asarray(np.stack(np.unravel_index(flat, (m, n)), -1).astype(np.int32))
        vals = jnp.asarray(rng.normal(size=nse).astype(np.float32))
        b = mj.from_bcoo(jsparse.BCOO((vals, idx), shape=(m, n), indices_sorted=True, unique_indices=True))
        out.update(_time_ops(BCOO_OPS, b, frac, nse, atol=1e-4))
    _print_table(f"\nBCOO-backed {m} x {n} float32", "bcoo", "stored entries", out, ".1%")
    return out


def _plot(rows, fractions):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(RESULTS, exist_ok=True)
    fig, ax = plt.subplots(figsize=(7, 4))
    for name in OPS:
        ks = [rows[(name, f)][0] for f in fractions]
        ax.loglog(ks, [rows[(name, f)][1] * 1e3 for f in fractions], "o-", label=f"{name} row_sparse")
        ax.loglog(ks, [rows[(name, f)][2] * 1e3 for f in fractions], "x--", label=f"{name} dense")
    ax.set_xlabel("stored rows")
    ax.set_ylabel("median time (ms)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    path = os.path.join(RESULTS, "storage.png")
    fig.savefig(path, dpi=120)
    print(f"plot saved to {path}")


if __name__ == "__main__":
    main()
