"""``mj.check_jacobian`` against ``torch.autograd.gradcheck`` and ``jax.test_util.check_grads``.

Two float64 functions of n inputs (n = 10, 100, 400): ``sum(tanh(A @ x))`` (scalar output) and
an elementwise-heavy ``sin(x) * exp(-x**2) + log1p(x**2)`` (n outputs). Every checker verifies
reverse mode under dense semantics, as gradcheck does by default:

* masked_jax full: ``check_jacobian(..., semantics="dense", modes=("rev",), fast=False)``: the
  whole numerical Jacobian (2n perturbed evaluations, batched by ``vmap``) and ``jacrev``, in one
  jit-compiled XLA call;
* masked_jax fast: the same with ``fast=True`` (random projections);
* torch gradcheck (default: full) and ``fast_mode=True``;
* ``jax.test_util.check_grads(order=1, modes=["rev"])`` (random directions, eager).

The first masked_jax call compiles; its time is reported separately from the cached time (the
same function checked again: one XLA call). Checkers take turns in blocks of 3 timed calls, each
block after one untimed call (torch's OpenMP threads spin after its calls, and a thread pool
idle for a while wakes slowly). Prints medians and the ratios torch / masked_jax,
and saves a plot to ``benchmarks/results/jacobian.png``.

A second table, **latency**, times what a notebook user waits for, with ``check_jacobian``'s
defaults (``semantics="both"``, forward and reverse mode, leak probes), side by side with
torch ``gradcheck`` (and ``fast_mode``) and ``check_grads`` on the same functions: a dense
``sum(tanh(A @ x))`` (scalar output), a dense ``sin(c x) exp(-x^2) + log1p(x^2)`` (n outputs) and
the same as a masked op (70% valid; torch checks the dense function times the mask):

* cold: the first function of these shapes in the process (the whole check compiles);
* new function: a function never checked before with the code of one checked before (new
  captured arrays and numbers, and for the masked op a new mask): the compiled check of that
  code runs on its constants (the median over fresh functions; the background work of the
  previous check is waited for first, as a user reads a report);
* new code: a function whose code (here: a composition of two elementwise functions drawn from
  a list) was never checked, once a function of the same shapes has been: it runs eagerly, op
  by op, at once;
* re-run cell: a new lambda with the same code and captured values as one checked before;
* repeat: the same function again (the compiled check, one XLA call).

``MJ_CHECK_BACKGROUND=1`` (the default in notebooks) is set for this table.

Run: ``.venv/bin/python benchmarks/jacobian.py`` (``--quick`` for a small smoke run,
``--latency-only`` for the second table alone). On a GPU
(``JAX_PLATFORMS=cuda``) torch checks CUDA tensors when it sees CUDA (gradcheck synchronizes
when it compares), and the plot is ``jacobian_gpu.png``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("MJ_CHECK_BACKGROUND", "1")  # as in a notebook (see the latency table)
import jax

jax.config.update("jax_enable_x64", True)
import jax.numpy as jnp
import numpy as np
from jax.test_util import check_grads

sys.path.insert(0, os.path.dirname(__file__))
from _timing import interleaved_medians, progress, result_path, save_bar_plot, torch_device

import masked_jax as mj
import masked_jax.numpy as mnp
from masked_jax.checking import _compile as _check


def functions(n, rng):
    a = rng.normal(size=(n, n)) / np.sqrt(n)
    aj = jnp.asarray(a)

    def jax_matvec(x):
        return jnp.sum(jnp.tanh(aj @ x))

    def jax_elementwise(x):
        return jnp.sin(x) * jnp.exp(-(x**2)) + jnp.log1p(x**2)

    import torch

    at = torch.from_numpy(a).to(torch_device())

    def torch_matvec(x):
        return torch.tanh(at @ x).sum()

    def torch_elementwise(x):
        return torch.sin(x) * torch.exp(-(x**2)) + torch.log1p(x**2)

    return {
        "sum(tanh(A @ x))": (jax_matvec, torch_matvec),
        "sin*exp+log1p (n outputs)": (jax_elementwise, torch_elementwise),
    }


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--latency-only", action="store_true", help="only the latency table")
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(2)
    sizes = (10, 50) if args.quick else (10, 100, 400)
    rng = np.random.default_rng(0)
    rows, compile_rows = {}, {}
    for n in progress(() if args.latency_only else sizes, "input size"):
        for name, (fj, ft) in functions(n, rng).items():
            x = jnp.asarray(rng.uniform(-1.0, 1.0, n))
            xt = torch.tensor(np.asarray(x), requires_grad=True, device=torch_device())
            full = lambda fj=fj, x=x: mj.check_jacobian(fj, (x,), semantics="dense", modes=("rev",), fast=False)  # noqa: E731
            fast = lambda fj=fj, x=x: mj.check_jacobian(fj, (x,), semantics="dense", modes=("rev",), fast=True)  # noqa: E731
            _check._CACHE.clear()
            t0 = time.perf_counter()
            assert full()
            t_compile_full = time.perf_counter() - t0
            t0 = time.perf_counter()
            assert fast()
            t_compile_fast = time.perf_counter() - t0
            assert torch.autograd.gradcheck(ft, (xt,))
            impls = {
                "masked_jax": full,
                "masked_jax fast": fast,
                "torch gradcheck": lambda ft=ft, xt=xt: torch.autograd.gradcheck(ft, (xt,)),
                "torch fast_mode": lambda ft=ft, xt=xt: torch.autograd.gradcheck(ft, (xt,), fast_mode=True),
                "jax check_grads": lambda fj=fj, x=x: check_grads(fj, (x,), order=1, modes=["rev"]),
            }
            rounds = 8 if n >= 400 else 5  # n = 400: the headline ratio, more samples (torch ~0.1 s a call)
            res = interleaved_medians(
                {k: _returns_none(v) for k, v in impls.items()}, rounds=rounds, block=3, warmup=1, settle=1
            )
            rows[f"{name} n={n}"] = res
            compile_rows[f"{name} n={n}"] = (t_compile_full, t_compile_fast)
    if rows:
        _print(rows, compile_rows)
        save_bar_plot(
            rows, result_path("jacobian"), f"Jacobian checks, cached (float64, {jax.default_backend().upper()})"
        )
    lat = latency(sizes, trials=3 if args.quick else 7)
    save_bar_plot(
        lat,
        result_path("jacobian_latency"),
        f"Jacobian checks, first call on a new function (float64, {jax.default_backend().upper()})",
    )
    return rows, lat


KINDS = ("dense, scalar", "dense, n outputs", "masked, n outputs")
CODE = ("sin", "cos", "tanh", "exp", "expm1", "arctan", "sinh")  # new code: g(u) = b(a(u)), a != b


def _composition(ns, k):
    """The ``k``-th composition ``b(a(u))`` of two different functions of :data:`CODE` from the
    namespace ``ns`` (``jax.numpy`` or ``masked_jax.numpy``): new code for every ``k``."""
    pairs = [(a, b) for a in CODE for b in CODE if a != b]
    a, b = pairs[k % len(pairs)]
    return lambda u: getattr(ns, b)(getattr(ns, a)(u))


def latency(sizes, trials):
    """The latency table (see the module docstring): medians in seconds per (function, n)."""
    import torch

    rows = {}
    for n in progress(sizes, "latency, input size"):
        for kind in KINDS:

            def make(seed, kind=kind, n=n, code=None):
                """(masked_jax function, args, torch function, torch input) for a new function; ``code``:
                an index into the compositions of :data:`CODE` for new code instead."""
                r = np.random.default_rng(seed)
                x = r.uniform(-1.0, 1.0, n)
                c = float(r.uniform(1.0, 2.0))
                ns = mnp if kind == KINDS[2] else jnp
                g = (lambda u: u) if code is None else _composition(ns, code)
                if kind == KINDS[0]:
                    a = r.normal(size=(n, n)) / np.sqrt(n)
                    aj, at = jnp.asarray(a), torch.from_numpy(a).to(torch_device())
                    return (
                        (lambda v: jnp.sum(jnp.tanh(g(aj @ v)))),
                        (jnp.asarray(x),),
                        (lambda v: torch.tanh(at @ v).sum()),
                        x,
                    )
                if kind == KINDS[1]:
                    return (
                        (lambda v: jnp.sin(c * v) * jnp.exp(-(v**2)) + jnp.log1p(g(v) ** 2)),
                        (jnp.asarray(x),),
                        (lambda v: torch.sin(c * v) * torch.exp(-(v**2)) + torch.log1p(v**2)),
                        x,
                    )
                m = r.uniform(size=n) < 0.7
                mt = torch.from_numpy(m).to(torch_device())
                return (
                    (lambda v: mnp.sin(c * v) * mnp.exp(-(v**2)) + mnp.log1p(g(v) ** 2)),
                    (mj.masked_array(jnp.asarray(x), jnp.asarray(m)),),
                    (lambda v: (torch.sin(c * v) * torch.exp(-(v**2)) + torch.log1p(v**2)) * mt),
                    x,
                )

            def first_call(seed, code=None):
                f, a, _, _ = make(seed, code=code)
                _check.wait_for_compiles()  # the previous check's background work: done while the user read
                t0 = time.perf_counter()
                assert mj.check_jacobian(f, a)
                return time.perf_counter() - t0

            cold = first_call(10_000 * n)
            new = statistics.median(first_call(10_000 * n + k) for k in range(1, trials + 1))
            new_code = statistics.median(first_call(10_000 * n + k, code=k) for k in range(1, trials + 1))
            rerun = statistics.median(first_call(10_000 * n + k) for k in range(1, trials + 1))  # same code+values
            f, a, ft, x = make(10_000 * n + 1)
            _check.wait_for_compiles()
            xt = torch.tensor(x, requires_grad=True, device=torch_device())
            fj_dense = f if kind != KINDS[2] else (lambda v, m=a[0].mask, f=f: f(mj.masked_array(v, m)).data)
            timed = interleaved_medians(
                {
                    "masked_jax repeat": lambda f=f, a=a: mj.check_jacobian(f, a) and None,
                    "torch gradcheck": lambda ft=ft, xt=xt: torch.autograd.gradcheck(ft, (xt,)) and None,
                    "torch fast_mode": lambda ft=ft, xt=xt: (
                        torch.autograd.gradcheck(ft, (xt,), fast_mode=True) and None
                    ),
                    "jax check_grads": lambda fj_dense=fj_dense, a=a: check_grads(
                        fj_dense, (a[0].data if hasattr(a[0], "data") else a[0],), order=1, modes=["rev"]
                    ),
                },
                rounds=3,
                block=3,
                warmup=1,
                settle=1,
            )
            rows[f"{kind} n={n}"] = {
                "masked_jax cold": cold,
                "masked_jax new function": new,
                "masked_jax new code": new_code,
                "masked_jax re-run cell": rerun,
                **timed,
            }
    _print_latency(rows)
    return rows


def _print_latency(rows):
    print(f"\nlatency on {jax.default_backend()}, float64, check_jacobian defaults; medians in ms")
    impls = list(next(iter(rows.values())))
    print(
        "| function | " + " | ".join(impls) + " | gradcheck / new function | gradcheck / new code | "
        "gradcheck / repeat |"
    )
    print("|---|" + "---|" * (len(impls) + 3))
    for key, res in rows.items():
        cells = " | ".join(f"{res[i] * 1e3:.1f}" for i in impls)
        print(
            f"| {key} | {cells} | {res['torch gradcheck'] / res['masked_jax new function']:.1f}x | "
            f"{res['torch gradcheck'] / res['masked_jax new code']:.2f}x | "
            f"{res['torch gradcheck'] / res['masked_jax repeat']:.0f}x |"
        )


def _returns_none(fn):
    def run():
        fn()

    return run


def _print(rows, compile_rows):
    dev = jax.devices()[0].device_kind
    print(
        f"\nbackend {jax.default_backend()} ({dev}), torch on {torch_device()}, float64; medians in ms "
        "(cached: the compiled check reused)"
    )
    impls = list(next(iter(rows.values())))
    print(
        "| function | " + " | ".join(impls) + " | gradcheck / masked_jax | fast_mode / masked_jax fast |"
        " masked_jax compile (full, fast) |"
    )
    print("|---|" + "---|" * (len(impls) + 3))
    for key, res in rows.items():
        cells = " | ".join(f"{res[i] * 1e3:.2f}" for i in impls)
        cf, cq = compile_rows[key]
        print(
            f"| {key} | {cells} | {res['torch gradcheck'] / res['masked_jax']:.1f}x | "
            f"{res['torch fast_mode'] / res['masked_jax fast']:.2f}x | {cf * 1e3:.0f}, {cq * 1e3:.0f} ms |"
        )


if __name__ == "__main__":
    main()
