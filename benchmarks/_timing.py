"""Timing helpers shared by the benchmarks: warm up, then the median of repeated runs."""

from __future__ import annotations

import os
import statistics
import sys
import time

import jax

RESULTS = os.path.join(os.path.dirname(__file__), "results")


def progress(items, label):
    """``items``, printing ``[i/n] label: item (elapsed)`` to stderr as each one starts, so a long
    run shows where it is (the tables come at the end)."""
    items = list(items)
    start = time.perf_counter()
    for i, item in enumerate(items, 1):
        print(
            f"[{i}/{len(items)}] {label}: {item} ({time.perf_counter() - start:.0f} s elapsed)",
            file=sys.stderr,
            flush=True,
        )
        yield item
    print(f"[done] {label} in {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)


def result_path(stem):
    """``results/<stem>.png``, with ``_<backend>`` appended off the CPU (``optim_gpu.png``)."""
    backend = jax.default_backend()
    os.makedirs(RESULTS, exist_ok=True)
    return os.path.join(RESULTS, stem + ("" if backend == "cpu" else f"_{backend}") + ".png")


def torch_device():
    """Where torch baselines run: the GPU when JAX runs on one and torch sees CUDA, else the CPU."""
    import torch

    return "cuda" if jax.default_backend() == "gpu" and torch.cuda.is_available() else "cpu"


def median_seconds(fn, *args, repeats=20, warmup=3):
    """Median wall time of ``fn(*args)``, blocking on JAX results."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def interleaved_rounds(fns, rounds=5, block=5, warmup=2, settle=0):
    """``{name: [[seconds of each timed call] per round]}`` of each ``fns[name]()``.

    Implementations take turns in ``rounds``, each timing ``block`` consecutive
    calls, so every implementation sees the same slow drift of this shared
    machine (up to 3x between runs). Each block may start with ``settle`` untimed
    calls: the first call after another library's runs pays for that library's
    after-effects (torch's OpenMP threads spin for a while after a call, a dense
    step evicts the caches, idle thread pools go to sleep), which is not the cost
    of a call in steady use. Every implementation gets the same treatment.
    """
    for fn in fns.values():
        for _ in range(warmup):
            jax.block_until_ready(fn())
    times = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            for _ in range(settle):
                jax.block_until_ready(fn())
            block_times = []
            for _ in range(block):
                t0 = time.perf_counter()
                jax.block_until_ready(fn())
                block_times.append(time.perf_counter() - t0)
            times[name].append(block_times)
    return times


def interleaved_medians(fns, rounds=5, block=5, warmup=2, settle=0):
    """Median seconds of each ``fns[name]()`` over every call timed by :func:`interleaved_rounds`."""
    times = interleaved_rounds(fns, rounds, block, warmup, settle)
    return {name: statistics.median(t for r in ts for t in r) for name, ts in times.items()}


def print_table(title, rows, baseline_cols):
    """``rows``: {op: {impl: seconds}}; prints ms medians and ratios impl/masked_jax."""
    impls = list(next(iter(rows.values())).keys())
    print(f"\n{title}")
    head = (
        "| op | "
        + " | ".join(f"{i} (ms)" for i in impls)
        + " | "
        + " | ".join(f"{b} / masked_jax" for b in baseline_cols)
        + " |"
    )
    print(head)
    print("|" + "---|" * (1 + len(impls) + len(baseline_cols)))
    for op, res in rows.items():
        ms = " | ".join(f"{res[i] * 1e3:.2f}" if res.get(i) is not None else "n/a" for i in impls)
        ratios = " | ".join(
            f"{res[b] / res['masked_jax']:.2f}x" if res.get(b) is not None else "n/a" for b in baseline_cols
        )
        print(f"| {op} | {ms} | {ratios} |")


def save_bar_plot(rows, path, title):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    os.makedirs(os.path.dirname(path), exist_ok=True)
    impls = list(next(iter(rows.values())).keys())
    ops = list(rows)
    width = 0.8 / len(impls)
    fig, ax = plt.subplots(figsize=(9, 4))
    for k, impl in enumerate(impls):
        vals = [rows[o].get(impl) or np.nan for o in ops]
        ax.bar(np.arange(len(ops)) + k * width, np.array(vals) * 1e3, width, label=impl)
    ax.set_xticks(np.arange(len(ops)) + width * (len(impls) - 1) / 2, ops)
    ax.set_yscale("log")
    ax.set_ylabel("median time (ms, log scale)")
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot saved to {path}")
