"""Row-sparse optimizer steps on an N x 64 float32 embedding table with K touched rows.

For N in {200k, 2M} and K in {1k, 10k, 100k} (ids drawn with replacement, so duplicates
occur as in real batches) it times one optimizer step (update + apply, jitted, params and
state donated) of

* ``masked_adagrad`` and ``lazy(optax.adam)`` on a row-sparse gradient,
* dense ``optax.adagrad`` / ``optax.adam`` on the same gradient as a dense array (jit + donation),
* hand-written lazy Adam and row-sparse Adagrad in plain JAX (sort-based coalescing, gather,
  update, scatter; checked against masked_jax on a small table first),
* ``torch.optim.Adagrad`` and ``torch.optim.SparseAdam`` on a sparse COO gradient,

and a memory-bandwidth bound: bytes the lazy step must touch (K rows of gradient, and of
parameters and state, read and written) divided by the measured copy bandwidth.
Implementations take turns in blocks of calls, each block starting with one untimed call (so
that the cache and thread-pool after-effects of the previous implementation are not timed).
Prints a table of medians and ratios, and saves a log-log plot of time against K to
``benchmarks/results/optim.png``.

Run: ``.venv/bin/python benchmarks/optim.py`` (``--quick`` for a small smoke run). On a GPU
(``JAX_PLATFORMS=cuda``) torch runs there too when it sees CUDA, its steps end in
``torch.cuda.synchronize()``, the bandwidth is a device-memory copy, and the plot is
``optim_gpu.png``.

``--reuse-memory`` reruns the script with glibc's malloc told never to hand memory back
(``MALLOC_MMAP_MAX_=0``, ``MALLOC_TRIM_THRESHOLD_`` = 4 GB). XLA:CPU allocates all temporaries
of a program as one block per execution; above glibc's 32 MB mmap ceiling that block is a
fresh mapping every step, and every 4 KiB page of it faults on first touch (~10 ms per K x 64
temporary at K = 100k). torch allocates its temporaries one by
one, under that ceiling, and reuses them from the heap. Both libraries run in the same process,
so both get the same allocator in either configuration.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

sys.path.insert(0, os.path.dirname(__file__))
from _timing import interleaved_medians, progress, result_path, torch_device

import masked_jax as mj
from masked_jax import optim
from masked_jax.optim._fused import DEFAULT_CONFIG, fused_update

DIM = 64
LR = 1e-2
REUSE_MEMORY_ENV = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(4 * 2**30)}


def reusing_memory(requested: bool, script: str, argv) -> bool:
    """Is glibc's malloc keeping freed memory (``REUSE_MEMORY_ENV``)? When ``requested`` and it is
    not, re-execute ``script`` with it (malloc reads its tunables at process start)."""
    reuse = all(os.environ.get(k) == v for k, v in REUSE_MEMORY_ENV.items())
    if requested and not reuse:
        os.execve(
            sys.executable,
            [sys.executable, os.path.abspath(script), *(argv or sys.argv[1:])],
            {**os.environ, **REUSE_MEMORY_ENV},
        )
    return reuse


def copy_bandwidth(nbytes=None, repeats=7):
    """Bytes per second of a large array copy (one read plus one write per byte copied).

    On CPU a numpy copy of 256 MiB; on an accelerator a jitted copy of 1 GiB in device memory
    (large enough that the launch does not count).
    """
    on_cpu = jax.default_backend() == "cpu"
    nbytes = nbytes or (256 if on_cpu else 1024) * 2**20
    if on_cpu:
        src = np.ones(nbytes // 4, np.float32)
        dst = np.empty_like(src)
        copy = lambda: np.copyto(dst, src)  # noqa: E731
    else:
        src = jnp.ones(nbytes // 4, jnp.float32)
        copy = functools.partial(jax.jit(lambda a: a + 1), src)  # one read, one write per element
        jax.block_until_ready(copy())
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(copy())
        times.append(time.perf_counter() - t0)
    return 2 * nbytes / float(np.median(times))


def _hand_coalesce(n, ids, vals):
    """Distinct ids (padded with ``n``) and their summed rows: sort, first of each run, searchsorted."""
    k = ids.shape[0]
    ordered = jnp.sort(ids)
    first = jnp.concatenate([jnp.ones(1, bool), ordered[1:] != ordered[:-1]])
    uniq = jnp.full(max(k, 2), n, ids.dtype).at[jnp.cumsum(first) - 1].min(ordered)
    return uniq, jax.ops.segment_sum(vals, jnp.searchsorted(uniq, ids), num_segments=uniq.shape[0])


def adam_rows(m_rows, v_rows, g, count, b1=0.9, b2=0.999, eps=1e-8):
    """Adam on gathered rows (``count``: the step, from 1): the parameter update and the new moments."""
    m_rows = b1 * m_rows + (1 - b1) * g
    v_rows = b2 * v_rows + (1 - b2) * g * g
    m_hat = m_rows / (1 - b1**count)
    v_hat = v_rows / (1 - b2**count)
    return -LR * m_hat / (jnp.sqrt(v_hat) + eps), m_rows, v_rows


def hand_lazy_adam_step(p, m, v, count, ids, vals):
    """Lazy Adam in plain JAX: what a user would write by hand."""
    uniq, g = _hand_coalesce(p.shape[0], ids, vals)
    count = count + 1
    take = lambda a: jnp.take(a, uniq, axis=0, mode="fill", fill_value=0)  # noqa: E731 (padding reads 0)
    step, m_rows, v_rows = adam_rows(take(m), take(v), g, count)
    p = p.at[uniq].add(step, mode="drop")
    return p, m.at[uniq].set(m_rows, mode="drop"), v.at[uniq].set(v_rows, mode="drop"), count


def hand_adagrad_step(p, s, ids, vals, eps=1e-7):
    """Row-sparse Adagrad in plain JAX (optax's eps placement), written by hand: sums grow by a
    scatter-add, then the touched rows of the sums are gathered for the update."""
    uniq, g = _hand_coalesce(p.shape[0], ids, vals)
    s = s.at[uniq].add(g * g, mode="drop")
    rows = jnp.take(s, uniq, axis=0, mode="fill", fill_value=1)
    return p.at[uniq].add(-LR * g * jax.lax.rsqrt(rows + eps), mode="drop"), s


def check_hand_steps(n=1000, k=300):
    """The hand-written baselines compute what masked_jax computes (two steps, small table)."""
    rng = np.random.default_rng(1)
    table = jnp.asarray(rng.normal(size=(n, DIM)).astype(np.float32))
    ids = jnp.asarray(rng.integers(0, n, size=k).astype(np.int32))
    vals = jnp.asarray(rng.normal(size=(k, DIM)).astype(np.float32))
    grad = mj.row_sparse(vals, ids, (n, DIM))
    for opt, hand, state in [
        (optim.masked_adagrad(LR), hand_adagrad_step, (table, jnp.full((n, DIM), 0.1))),
        (optim.lazy(optax.adam(LR)), hand_lazy_adam_step, (table, jnp.zeros((n, DIM)), jnp.zeros((n, DIM)), 0.0)),
    ]:
        p, s = table, opt.init(table)
        for _ in range(2):
            u, s = opt.update(grad, s, p)
            p = optim.apply_updates(p, u)
            state = jax.jit(hand)(*state, ids, vals)
        np.testing.assert_allclose(np.asarray(state[0]), np.asarray(p), rtol=1e-5, atol=1e-6)


class Stepper:
    """Holds donated buffers; each call runs one step and keeps the outputs for the next."""

    def __init__(self, step, *carry, args=()):
        self.step, self.carry, self.args = step, carry, args

    def __call__(self):
        self.carry = self.step(*self.carry, *self.args)
        return self.carry


def update_step(opt):
    """``(p, s, g) -> (p, s)``: ``opt.update`` and ``apply_updates`` in one call (what
    ``make_train_step`` runs without chunks or a fused kernel)."""

    def step(p, s, g):
        u, s = opt.update(g, s, p)
        return optim.apply_updates(p, u), s

    return step


def fused_step(opt, config=DEFAULT_CONFIG):
    """``(p, s, g) -> (p, s)``: the fused update of ``make_train_step(..., fused_rows=True)`` on a
    CUDA GPU, its kernel cut by ``config``."""
    return lambda p, s, g: fused_update(opt, g, s, p, optim.apply_updates, config=config)


def optax_stepper(opt, table, grad, step=None):
    """A donated, jitted step (``update_step(opt)`` unless given) on ``table`` and fresh state."""
    return Stepper(jax.jit(step or update_step(opt), donate_argnums=(0, 1)), table, opt.init(table), args=(grad,))


def torch_stepper(make, table_np, ids, vals):
    import torch

    dev = torch_device()
    param = torch.nn.Parameter(torch.tensor(table_np, device=dev))
    opt = make([param])
    with torch.sparse.check_sparse_tensor_invariants():
        grad = torch.sparse_coo_tensor(torch.tensor(ids, device=dev)[None], torch.tensor(vals, device=dev), param.shape)

    def step():
        param.grad = grad
        opt.step()
        if dev == "cuda":
            torch.cuda.synchronize()  # time the step, not its launch
        return None

    return step


def run(n, k, bandwidth, with_torch=True, rounds=3):
    import torch

    rng = np.random.default_rng(0)
    table_np = (0.1 * rng.normal(size=(n, DIM))).astype(np.float32)
    ids = rng.integers(0, n, size=k).astype(np.int32)
    vals = rng.normal(size=(k, DIM)).astype(np.float32)
    grad = mj.row_sparse(jnp.asarray(vals), jnp.asarray(ids), (n, DIM))
    dense_grad = grad.todense().filled(0)
    fresh = lambda: jnp.asarray(table_np)  # noqa: E731  (each stepper owns its donated table)
    fns = {
        "masked_adagrad": optax_stepper(optim.masked_adagrad(LR), fresh(), grad),
        "lazy_adam": optax_stepper(optim.lazy(optax.adam(LR)), fresh(), grad),
        "hand_scatter_adam": Stepper(
            jax.jit(hand_lazy_adam_step, donate_argnums=(0, 1, 2)),
            fresh(),
            jnp.zeros((n, DIM)),
            jnp.zeros((n, DIM)),
            jnp.zeros(()),
            args=(jnp.asarray(ids), jnp.asarray(vals)),
        ),
        "hand_scatter_adagrad": Stepper(
            jax.jit(hand_adagrad_step, donate_argnums=(0, 1)),
            fresh(),
            jnp.full((n, DIM), 0.1, jnp.float32),
            args=(jnp.asarray(ids), jnp.asarray(vals)),
        ),
        "dense_adagrad": optax_stepper(optax.adagrad(LR), fresh(), dense_grad),
        "dense_adam": optax_stepper(optax.adam(LR), fresh(), dense_grad),
    }
    if with_torch:
        if torch_device() == "cpu":
            torch.set_num_threads(os.cpu_count() or 1)
        fns["torch_adagrad"] = torch_stepper(lambda ps: torch.optim.Adagrad(ps, lr=LR), table_np, ids, vals)
        fns["torch_sparse_adam"] = torch_stepper(lambda ps: torch.optim.SparseAdam(ps, lr=LR), table_np, ids, vals)
    slow = {"dense_adagrad", "dense_adam"}
    t = interleaved_medians({k_: f for k_, f in fns.items() if k_ not in slow}, rounds=rounds, block=5, settle=1)
    t.update(interleaved_medians({k_: f for k_, f in fns.items() if k_ in slow}, rounds=2, block=2, warmup=1, settle=1))
    touched = min(k, n) * DIM * 4
    t["bound_adam"] = 7 * touched / bandwidth  # grad read; param, mu, nu read + written
    t["bound_adagrad"] = 5 * touched / bandwidth  # grad read; param, sum read + written
    return t


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument(
        "--reuse-memory",
        action="store_true",
        help="rerun under a glibc malloc that keeps freed memory (see the module notes)",
    )
    args = parser.parse_args(argv)
    reuse = reusing_memory(args.reuse_memory, __file__, argv)
    sizes = (20_000, 200_000) if args.quick else (200_000, 2_000_000)
    ks = (1_000, 10_000) if args.quick else (1_000, 10_000, 100_000)
    check_hand_steps()
    bandwidth = copy_bandwidth()
    backend = jax.default_backend()
    where = f"{os.cpu_count()} cores" if backend == "cpu" else jax.devices()[0].device_kind
    print(
        f"backend {backend} ({where}), torch on {torch_device()}, copy bandwidth {bandwidth / 1e9:.1f} GB/s, "
        f"malloc {'reusing freed memory' if reuse else 'glibc default'}"
    )
    results = {(n, k): run(n, k, bandwidth) for n, k in progress([(n, k) for n in sizes for k in ks], "(N, K)")}
    cols = [
        "masked_adagrad",
        "lazy_adam",
        "hand_scatter_adagrad",
        "hand_scatter_adam",
        "dense_adagrad",
        "dense_adam",
        "torch_adagrad",
        "torch_sparse_adam",
        "bound_adam",
    ]
    print("\nmedian ms per step (update + apply, jit, donated)")
    print(
        "| N | K | " + " | ".join(cols) + " | dense_adam / lazy_adam | dense_adagrad / masked_adagrad | "
        "dense / hand (adagrad, adam) | masked_adagrad / hand | lazy_adam / hand | "
        "torch_adagrad / masked_adagrad | torch_sparse_adam / lazy_adam |"
    )
    print("|" + "---|" * (len(cols) + 9))
    for (n, k), t in results.items():
        ms = " | ".join(f"{t[c] * 1e3:.3f}" for c in cols)
        print(
            f"| {n:,} | {k:,} | {ms} | {t['dense_adam'] / t['lazy_adam']:.0f}x | "
            f"{t['dense_adagrad'] / t['masked_adagrad']:.0f}x | "
            f"{t['dense_adagrad'] / t['hand_scatter_adagrad']:.0f}x, {t['dense_adam'] / t['hand_scatter_adam']:.0f}x | "
            f"{t['masked_adagrad'] / t['hand_scatter_adagrad']:.2f}x | "
            f"{t['lazy_adam'] / t['hand_scatter_adam']:.2f}x | "
            f"{t['torch_adagrad'] / t['masked_adagrad']:.1f}x | {t['torch_sparse_adam'] / t['lazy_adam']:.1f}x |"
        )
    lo, hi = sizes
    print(f"\nstep time growth N={lo:,} -> N={hi:,} (same K)")
    for k in ks:
        print(
            f"  K={k:,}: masked_adagrad {results[(hi, k)]['masked_adagrad'] / results[(lo, k)]['masked_adagrad']:.2f}x,"
            f" lazy_adam {results[(hi, k)]['lazy_adam'] / results[(lo, k)]['lazy_adam']:.2f}x"
        )
    plot(results, sizes, ks, result_path("optim_reuse_memory" if reuse else "optim"))


def plot(results, sizes, ks, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(os.path.dirname(path), exist_ok=True)
    fig, axes = plt.subplots(1, len(sizes), figsize=(11, 4), sharey=True)
    for ax, n in zip(axes, sizes):
        for impl in next(iter(results.values())):
            ax.plot(
                ks,
                [results[(n, k)][impl] * 1e3 for k in ks],
                marker="o",
                label=impl,
                linestyle="--" if impl.startswith("bound") else "-",
            )
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("K (touched rows)")
        ax.set_title(f"N = {n:,} x {DIM}")
    axes[0].set_ylabel("median ms per step")
    axes[-1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot saved to {path}")


if __name__ == "__main__":
    main()
