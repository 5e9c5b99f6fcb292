"""The checkers on models: what a notebook user waits for when checking a model's gradients.

Models (float64, padded batches, maskify'd plain code, the parameter pytree and the padded
inputs as the checked arguments):

* ``flax MLP``: ``Dense(8) -> tanh -> Dense(3)`` per token, mean-pooled, on 4 x 6 tokens of 4
  features (163 inputs);
* ``equinox MLP``: the same network as ``eqx.nn.MLP`` (163 inputs);
* ``flax transformer block``: pre-norm self-attention (2 heads) and an MLP, d_model 8, on 2 x 6
  tokens, mean-pooled;
* ``flax MLP, 400 sequences``: the flax MLP on 400 x 6 tokens (9,667 inputs; ``check_jacobian``
  then compares random projections, as ``fast=True`` does, and torch ``gradcheck`` runs with
  ``fast_mode=True``).

Checkers: ``mj.check_jacobian`` (default, and ``fast=True``), ``mj.check_invariance`` (default
cases, parameter gradients included), ``jax.test_util.check_grads`` (reverse mode, on the sum of
the valid outputs) and, for the MLPs, torch ``gradcheck`` of a port of the model (the dense padded
batch times its mask; its own process, one thread).

Each checker runs in a fresh process, after one check of an unrelated small function (so that
no checker pays for jax's or torch's start-up): **first** is the first check of the model,
**re-run** a new function with the same code and new parameter values (a re-run notebook cell;
median of 3), **repeat** the same function again (median of 3). Prints the table and the ratios to
``check_grads``'s first call, and saves ``benchmarks/results/jacobian_models.png``. The processes
see what a script sees: ``MJ_CHECK_BACKGROUND`` unset (``check_jacobian`` compiles nothing in the
background; ``check_invariance`` compiles its padded lengths side by side).

``--tiny``: the first check of the tiny model alone (the flax MLP: 4 -> 8 -> 3, tanh, per token, a
masked mean over 4 x 6 tokens, float64), as a notebook user meets it, against the first call of
``check_grads`` and torch's ``gradcheck``: each checker's first check in a fresh process (after one
check of an unrelated small function; the model is built before the clock starts), ``--rounds``
processes per checker, interleaved; the table gives the median, the spread (min - max) and the
ratios of the medians.

Run: ``.venv/bin/python benchmarks/jacobian_models.py`` (``--only NAME`` for models whose names
contain it, ``--quick`` for the flax MLP alone, ``--tiny`` for the first-call table).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

MODELS = ("flax MLP", "equinox MLP", "flax transformer block", "flax MLP, 400 sequences")
CHECKERS = ("check_jacobian", "check_jacobian fast", "check_invariance", "check_grads", "torch gradcheck")


def _lengths(model):
    """The valid lengths of the padded batch (6 positions): 4 sequences, or 400 (9,667 inputs in all)."""
    if model.endswith("400 sequences"):
        return tuple(n % 6 + 1 for n in range(400))
    return (6, 4, 3, 2)


def _build(model, seed):
    """``(f, params, x)``: the maskify'd model, its parameters (new values for each seed) and the
    padded batch."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    import masked_jax as mj

    rng = np.random.default_rng(seed)
    if model == "flax transformer block":
        import flax.linen as nn

        class Block(nn.Module):
            @nn.compact
            def __call__(self, x):
                h = x + nn.SelfAttention(num_heads=2, qkv_features=8)(nn.LayerNorm()(x))
                h = h + nn.Dense(8)(jax.nn.gelu(nn.Dense(16)(nn.LayerNorm()(h))))
                return jnp.mean(h, axis=1)

        lengths, features, net = (6, 4), 8, Block()
    else:
        lengths, features = _lengths(model), 4
    mask = jnp.asarray(np.arange(6)[None, :] < np.array(lengths)[:, None])[..., None]
    data = rng.normal(size=(len(lengths), 6, features))
    x = mj.masked_array(jnp.asarray(np.where(mask, data, np.nan)), jnp.broadcast_to(mask, data.shape))
    if model == "equinox MLP":
        import equinox as eqx

        mlp = eqx.nn.MLP(4, 3, 8, 1, activation=jnp.tanh, key=jax.random.key(seed))
        params, static = eqx.partition(mlp, eqx.is_inexact_array)

        def f(p, v):
            return jnp.mean(jax.vmap(jax.vmap(eqx.combine(p, static)))(v), axis=1)

    else:
        if model.startswith("flax MLP"):
            import flax.linen as nn

            class MLP(nn.Module):
                @nn.compact
                def __call__(self, x):
                    return jnp.mean(nn.Dense(3)(jnp.tanh(nn.Dense(8)(x))), axis=1)

            net = MLP()
        params = net.init(jax.random.key(seed), jnp.zeros((1, 6, features)))

        def f(p, v):
            return net.apply(p, v)

    params = jax.tree_util.tree_map(lambda a: a.astype(jnp.float64), params)  # flax initialises float32
    return mj.maskify(f), params, x


def _checker(name, model):
    """``check(seed)``: one check of the model built with ``seed`` (``seed=None``: the same
    function as the last call)."""
    import jax
    import jax.numpy as jnp
    from jax.test_util import check_grads

    import masked_jax as mj

    state = {}

    def build(seed):
        state["args"] = _build(model, seed)

    def check(seed):
        if seed is not None:
            build(seed)
        f, params, x = state["args"]
        if name == "check_jacobian":
            assert mj.check_jacobian(f, (params, x))
        elif name == "check_jacobian fast":
            assert mj.check_jacobian(f, (params, x), fast=True)
        elif name == "check_invariance":
            assert mj.check_invariance(f, (params, x), axis=1, params=(0,))
        else:
            mask = x.mask

            def loss(p, d):
                return jnp.sum(f(p, mj.masked_array(d, mask)).filled(0.0))

            check_grads(loss, (params, x.filled(0.0)), order=1, modes=["rev"])
        jax.effects_barrier()

    check.build = build
    return check


def _warm(name):
    """One check of an unrelated small function by the same checker."""
    import jax.numpy as jnp
    from jax.test_util import check_grads

    import masked_jax as mj

    x = mj.masked_array(jnp.array([[0.3, 0.5, 0.7]]), jnp.array([[True, True, False]]))
    g = lambda v: mj.numpy.sum(mj.numpy.sin(v), axis=1)  # noqa: E731
    if name.startswith("check_jacobian"):
        mj.check_jacobian(g, (x,), fast=name.endswith("fast"))
    elif name == "check_invariance":
        mj.check_invariance(g, (x,), axis=1)
    else:
        check_grads(lambda d: jnp.sum(jnp.sin(d)), (x.data,), order=1, modes=["rev"])


def _torch(model, seeds):
    """gradcheck of the MLP port: ``(first, re-run, repeat)`` seconds."""
    import numpy as np
    import torch

    torch.set_num_threads(1)
    torch.autograd.gradcheck(lambda a: torch.sin(a).sum(), (torch.rand(3, dtype=torch.float64, requires_grad=True),))
    lengths = _lengths(model)
    mask = torch.tensor(np.arange(6)[None, :] < np.array(lengths)[:, None], dtype=torch.float64)[..., None]

    def run(seed):
        g = torch.Generator().manual_seed(seed)
        w1, b1 = torch.randn(4, 8, generator=g, dtype=torch.float64), torch.zeros(8, dtype=torch.float64)
        w2, b2 = torch.randn(8, 3, generator=g, dtype=torch.float64), torch.zeros(3, dtype=torch.float64)
        x = torch.randn(len(lengths), 6, 4, generator=g, dtype=torch.float64) * mask
        inputs = tuple(t.requires_grad_() for t in (w1, b1, w2, b2, x))

        def f(w1, b1, w2, b2, x):
            out = torch.tanh(x @ w1 + b1) @ w2 + b2
            return (out * mask).sum(1) / mask.sum(1)

        # at about 10k inputs, torch's random projections (its full tables take minutes)
        return lambda: torch.autograd.gradcheck(f, inputs, fast_mode=len(lengths) > 100)

    times = []
    for seed in seeds:
        fn = run(seed) if seed is not None else fn  # noqa: F821 - set by the first seed
        t0 = time.perf_counter()
        assert fn()
        times.append(time.perf_counter() - t0)
    return times


TINY = "flax MLP"
TINY_CHECKERS = ("check_jacobian", "check_grads", "torch gradcheck")


def first_worker(model, name):
    """The first check of ``model`` by ``name`` in this process: seconds, the model built beforehand."""
    if name == "torch gradcheck":
        return _torch(model, [0])[0]
    import jax

    jax.config.update("jax_enable_x64", True)
    _warm(name)
    check = _checker(name, model)
    check.build(0)
    t0 = time.perf_counter()
    check(None)
    return time.perf_counter() - t0


def tiny(rounds, env):
    """``{checker: [first-check seconds, one per fresh process]}`` for the tiny model."""
    times: dict = {name: [] for name in TINY_CHECKERS}
    for _ in range(rounds):
        for name in TINY_CHECKERS:  # interleaved: the machine's load falls on every checker alike
            out = subprocess.run(
                [sys.executable, __file__, "--first-worker", TINY, name], capture_output=True, text=True, env=env
            )
            if out.returncode:
                raise RuntimeError(f"{TINY} / {name} failed:\n{out.stderr[-3000:]}")
            times[name].append(json.loads(out.stdout.strip().splitlines()[-1])["first"])
    return times


def _print_tiny(times):
    med = {name: statistics.median(t) for name, t in times.items()}
    print(
        f"\nfirst check of the tiny model ({TINY}, 4 x 6 tokens, float64), seconds, {len(times['check_grads'])} fresh processes each"
    )
    print(f"{'checker':18s} {'median':>8s} {'min':>8s} {'max':>8s} {'/ check_grads':>14s} {'/ gradcheck':>12s}")
    for name, t in times.items():
        print(
            f"{name:18s} {med[name]:8.3f} {min(t):8.3f} {max(t):8.3f} "
            f"{med[name] / med['check_grads']:13.2f}x {med[name] / med['torch gradcheck']:11.1f}x"
        )


def worker(model, name):
    seeds = [0, 1, 2, 3, None, None, None]  # first, three re-runs, three repeats
    if name == "torch gradcheck":
        times = _torch(model, seeds)
    else:
        import jax

        jax.config.update("jax_enable_x64", True)
        _warm(name)
        check = _checker(name, model)
        times = []
        for seed in seeds:
            t0 = time.perf_counter()
            check(seed)
            times.append(time.perf_counter() - t0)
    print(
        json.dumps({"first": times[0], "rerun": statistics.median(times[1:4]), "repeat": statistics.median(times[4:])})
    )


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--only", nargs="*", help="models whose names contain one of these")
    parser.add_argument("--quick", action="store_true", help="the flax MLP alone (a smoke run)")
    parser.add_argument(
        "--tiny", action="store_true", help="the first check of the tiny model, against check_grads and gradcheck"
    )
    parser.add_argument("--rounds", type=int, default=5, help="fresh processes per checker with --tiny")
    parser.add_argument("--worker", nargs=2, metavar=("MODEL", "CHECKER"), help=argparse.SUPPRESS)
    parser.add_argument("--first-worker", nargs=2, metavar=("MODEL", "CHECKER"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(*args.worker)
        return None
    if args.first_worker:
        print(json.dumps({"first": first_worker(*args.first_worker)}))
        return None
    models = [m for m in MODELS if not args.only or any(o in m for o in args.only)][: 1 if args.quick else None]
    rows = {}
    # the defaults a script sees (no background compiles of check_jacobian; check_invariance's
    # padded lengths compile side by side)
    env = dict(os.environ, JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"))
    env.pop("MJ_CHECK_BACKGROUND", None)
    if args.tiny:
        times = tiny(args.rounds, env)
        _print_tiny(times)
        return times
    for model in models:
        for name in CHECKERS:
            if name == "torch gradcheck" and "MLP" not in model:
                continue
            print(f"{model}: {name}", file=sys.stderr, flush=True)
            out = subprocess.run(
                [sys.executable, __file__, "--worker", model, name], capture_output=True, text=True, env=env
            )
            if out.returncode:
                raise RuntimeError(f"{model} / {name} failed:\n{out.stderr[-3000:]}")
            rows.setdefault(model, {})[name] = json.loads(out.stdout.strip().splitlines()[-1])
    _print(rows)
    _plot(rows)
    return rows


def _print(rows):
    print("\nseconds: first check of the model / re-run cell / repeat; ratio: first / check_grads first")
    print(f"{'model':24s} {'checker':22s} {'first':>8s} {'re-run':>8s} {'repeat':>8s} {'first ratio':>12s}")
    for model, res in rows.items():
        base = res["check_grads"]["first"]
        for name, t in res.items():
            print(
                f"{model:24s} {name:22s} {t['first']:8.2f} {t['rerun']:8.3f} {t['repeat']:8.3f} "
                f"{t['first'] / base:11.2f}x"
            )


def _plot(rows):
    sys.path.insert(0, os.path.dirname(__file__))
    from _timing import result_path, save_bar_plot

    bars = {
        f"{model}\n{kind}": {n: t[key] for n, t in res.items()}
        for model, res in rows.items()
        for kind, key in (("first", "first"), ("re-run", "rerun"))
    }
    save_bar_plot(bars, result_path("jacobian_models"), "Checking a model's gradients (float64, CPU)")


if __name__ == "__main__":
    main()
