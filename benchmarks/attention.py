"""Masked attention against the hand-written fused call: ``masked_jax.nn.dot_product_attention``
on masked queries, keys and values, against ``jax.nn.dot_product_attention(q, k, v,
key_value_seq_lengths=...)`` on the padded arrays (what a JAX user writes for padded batches).

B = 2 sequences of length L (one full, one half padded), 4 heads of 64 features, float32 (bfloat16
with ``implementation="cudnn"`` on a GPU). For L in 1k, 2k, 4k (and 8k, 16k on a GPU, where cuDNN
holds no L x L array) it prints, in one run, the median time of one call (jitted; implementations
take turns), the compiled call's temporary memory, and the ratios to the hand-written call, for
right padding and for scattered padding (the same number of valid tokens at random places, which
the hand-written call cannot express with lengths: on the XLA path the masked call passes the
keys' padding as a mask, with cuDNN it moves the valid tokens to the front), and ``maskify`` of
the plain ``jax.nn.dot_product_attention(q, k, v)`` on the scattered padding (it runs as the
masked call). Saves ``benchmarks/results/attention.png``.

Run: ``.venv/bin/python benchmarks/attention.py`` (``--quick`` for L = 1k only).
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from _timing import interleaved_medians, result_path

import masked_jax as mj
import masked_jax.nn as mnn


def _case(length, gpu):
    dtype = jnp.bfloat16 if gpu else jnp.float32
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.normal(size=(2, length, 4, 64)), dtype) for _ in range(3))
    lengths = jnp.array([length, length // 2], jnp.int32)
    right = jnp.arange(length)[None] < lengths[:, None]
    scattered = jnp.asarray(np.stack([np.ones(length, bool), rng.permutation(length) < length // 2]))
    impl = "cudnn" if gpu else None

    def hand(q, k, v, n):
        return jax.nn.dot_product_attention(q, k, v, key_value_seq_lengths=n, implementation=impl)

    def masked(q, k, v, tokens):
        m = tokens[:, :, None, None]
        x = [mj.masked_array(a, m) for a in (q, k, v)]
        return mnn.dot_product_attention(*x, implementation=impl).data

    def plain(q, k, v):  # the code a user writes for dense arrays, run by maskify
        return jax.nn.dot_product_attention(q, k, v, implementation=impl)

    def maskified(q, k, v, tokens):
        m = tokens[:, :, None, None]
        return mj.maskify(plain)(*(mj.masked_array(a, m) for a in (q, k, v))).data

    calls = {
        "hand-written (lengths)": (jax.jit(hand), (q, k, v, lengths)),
        "masked, right padding": (jax.jit(masked), (q, k, v, right)),
        "masked, scattered padding": (jax.jit(masked), (q, k, v, scattered)),
        "maskify, scattered padding": (jax.jit(maskified), (q, k, v, scattered)),
    }
    memory = {}
    for name, (fn, args) in calls.items():
        stats = fn.lower(*args).compile().memory_analysis()
        memory[name] = stats.temp_size_in_bytes / 2**20 if stats is not None else float("nan")
    times = interleaved_medians({name: (lambda fn=fn, args=args: fn(*args)) for name, (fn, args) in calls.items()})
    return times, memory


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    gpu = jax.default_backend() == "gpu"
    lengths = [1024] if args.quick else [1024, 2048, 4096] + ([8192, 16384] if gpu else [])
    rows = []
    for length in lengths:
        times, memory = _case(length, gpu)
        base_t, base_m = times["hand-written (lengths)"], memory["hand-written (lengths)"]
        for name in times:
            rows.append((length, name, times[name], memory[name], times[name] / base_t, memory[name] / base_m))
    print(f"backend={jax.default_backend()}; median ms of one call, temporary MiB, ratios to the hand-written call")
    print(f"{'L':>6}  {'call':28s} {'ms':>9} {'MiB':>9} {'time x':>7} {'mem x':>6}")
    for length, name, t, m, rt, rm in rows:
        print(f"{length:>6}  {name:28s} {1000 * t:9.2f} {m:9.1f} {rt:6.2f}x {rm:5.2f}x")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for name in dict.fromkeys(r[1] for r in rows):
        mine = [r for r in rows if r[1] == name]
        axes[0].plot([r[0] for r in mine], [1000 * r[2] for r in mine], marker="o", label=name)
        axes[1].plot([r[0] for r in mine], [r[3] for r in mine], marker="o", label=name)
    for ax, label in zip(axes, ("ms per call", "temporary MiB")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length L")
        ax.set_ylabel(label)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"masked attention vs the hand-written fused call ({jax.default_backend()})")
    fig.tight_layout()
    path = result_path("attention")
    fig.savefig(path)
    print(f"plot saved to {path}")


if __name__ == "__main__":
    main()
