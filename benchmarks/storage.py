"""Row-sparse vs dense-layout masked ops on a 1M x 64 float32 array with 1% and 10% of rows stored.

Ops: elementwise ``exp``, a reduction within rows (``sum(axis=1)``), a reduction across rows
(``sum(axis=0)``) and ``softmax`` along the last axis, all under ``jit``. The dense layout is
a ``MaskedArray`` holding the same valid rows. Prints medians, the speedup of row-sparse over
dense, and the time per stored row (about constant when time grows linearly with stored rows);
saves a plot to ``benchmarks/results/storage.png``.

Run: ``.venv/bin/python benchmarks/storage.py`` (``--quick`` for a small smoke run).
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
import masked_jax as mj  # noqa: E402
import masked_jax.nn as mnn  # noqa: E402
import masked_jax.numpy as mnp  # noqa: E402
from _timing import RESULTS, interleaved_medians  # noqa: E402

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
    for frac in fractions:
        k = int(n * frac)
        idx = jnp.asarray(np.sort(rng.choice(n, size=k, replace=False)).astype(np.int32))
        vals = jnp.asarray(rng.normal(size=(k, d)).astype(np.float32))
        rsp = mj.row_sparse(vals, idx, (n, d), unique_indices=True)
        dense = rsp.todense()
        for name, op in OPS.items():
            f = jax.jit(op)
            got, want = f(rsp), f(dense)  # same answer before timing
            got = got.todense() if hasattr(got, "todense") else got
            np.testing.assert_allclose(np.asarray(got.filled(0)), np.asarray(want.filled(0)), rtol=1e-4, atol=1e-2)  # float32 sums over 10^4+ rows, different order
            t = interleaved_medians({"row_sparse": lambda: f(rsp), "dense": lambda: f(dense)},
                                    rounds=3, block=3, warmup=1)
            rows[(name, frac)] = (k, t["row_sparse"], t["dense"])
    print(f"{n} x {d} float32, backend {jax.default_backend()}")
    print("| op | stored rows | row_sparse (ms) | dense layout (ms) | dense / row_sparse | row_sparse ns per stored row |")
    print("|---|---|---|---|---|---|")
    for (name, frac), (k, ts, td) in rows.items():
        print(f"| {name} | {k} ({frac:.0%}) | {ts * 1e3:.3f} | {td * 1e3:.2f} | {td / ts:.1f}x | {ts / k * 1e9:.1f} |")
    _plot(rows, fractions)
    return rows


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
