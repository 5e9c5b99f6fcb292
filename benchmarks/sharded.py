"""The row-sharded lazy Adam step on 8 simulated CPU devices against 1 device.

Table N x 64 float32 (N = 8M: 2 GiB, 6 GiB with Adam's mu and nu), K = 8k ids per step
(drawn with replacement). Each configuration runs in its own process, because the device
count is fixed when XLA starts:

* 1 device: ``lazy(optax.adam)`` on the whole table (update + apply, jitted, donated);
* 8 devices, ``optim.sharded_update``: every device updates the rows it owns (shard_map);
* 8 devices, plain jit: the same unsharded step on the row-sharded arrays, partitioned by
  XLA's SPMD partitioner (gathers of K rows of params and state are all-reduced);

each timed for the optimizer step alone (given a row-sparse gradient) and for the whole
training step (``make_train_step``: lookups, gradient, update). Also printed: the bytes of
parameters and optimizer state resident on one device. 8 simulated devices share this
machine's cores, so the 8-device times measure overhead, not speed-up: on real devices
each does 1/8 of the work. Prints a table of medians, saves ``benchmarks/results/sharded.png``.

Run: ``.venv/bin/python benchmarks/sharded.py`` (``--quick``: a 1M-row table).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

DIM, K, LR = 64, 8192, 1e-2


def child(n_rows: int, devices: int) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    sys.path.insert(0, os.path.dirname(__file__))
    from _timing import interleaved_medians

    import masked_jax as mj
    from masked_jax import optim

    assert jax.device_count() == devices
    mesh = Mesh(np.array(jax.devices()), ("rows",))
    rows, repl = NamedSharding(mesh, P("rows")), NamedSharding(mesh, P())
    opt = optim.lazy(optax.adam(LR))
    rng = np.random.default_rng(0)
    ids = jnp.asarray(rng.integers(0, n_rows, K), jnp.int32)
    grad = mj.row_sparse(jnp.asarray(rng.normal(size=(K, DIM)), jnp.float32), ids, (n_rows, DIM))
    y = jnp.asarray(rng.normal(size=K), jnp.float32)

    def loss(params, ids, y):
        pred = mj.lookup(params["table"], ids) @ params["w"]
        return jnp.mean((pred - y) ** 2)

    def fresh():
        table = jax.jit(lambda: jnp.full((n_rows, DIM), 0.01, jnp.float32), out_shardings=rows)()
        params = {"table": table, "w": jax.device_put(jnp.ones(DIM, jnp.float32), repl)}
        return params, optim.init_sharded(opt, params)

    def update_only(params, state, g):
        updates, state = opt.update(g, state, params)
        return optim.apply_updates(params, updates), state

    variants = {
        "one device" if devices == 1 else "plain jit (XLA SPMD)": (
            jax.jit(update_only, donate_argnums=(0, 1)),
            optim.make_train_step(loss, opt, row_sparse={"table": True, "w": False}),
        )
    }
    if devices > 1:
        variants["sharded_update"] = (
            jax.jit(lambda p, s, g: optim.sharded_update(opt, g, s, p, mesh=mesh, axis="rows"), donate_argnums=(0, 1)),
            optim.make_train_step(loss, opt, row_sparse={"table": True, "w": False}, mesh=mesh, axis="rows"),
        )
    grads = {"table": grad, "w": jnp.zeros(DIM, jnp.float32)}
    out = {}
    for name, (update, step) in variants.items():
        box = {"u": fresh()}

        def run_update(box=box, update=update):
            box["u"] = update(*box["u"], grads)
            return box["u"]

        times = interleaved_medians({"update": run_update}, rounds=5, block=5, warmup=2)
        params, state = box.pop("u")
        box["s"] = (params, state)

        def run_step(box=box, step=step):
            p, s, value = step(*box["s"], ids, y)
            box["s"] = (p, s)
            return value

        times.update(interleaved_medians({"step": run_step}, rounds=5, block=5, warmup=2))
        p, s = box.pop("s")
        dev0 = jax.devices()[0]
        resident = sum(
            sh.data.nbytes
            for x in jax.tree_util.tree_leaves((p, s))
            for sh in x.addressable_shards
            if sh.device == dev0
        )
        out[name] = {"update_ms": times["update"] * 1e3, "step_ms": times["step"] * 1e3, "device_gib": resident / 2**30}
        del p, s
    return out


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--child", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--rows", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print("RESULT " + json.dumps(child(args.rows, args.child)))
        return None
    n_rows = 1 << 20 if args.quick else 8 << 20
    results = {}
    for devices in (1, 8):
        env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
        proc = subprocess.run(
            [sys.executable, __file__, "--child", str(devices), "--rows", str(n_rows)],
            env=env,
            capture_output=True,
            text=True,
        )
        if proc.returncode:
            raise RuntimeError(proc.stdout[-4000:] + proc.stderr[-4000:])
        line = next(l for l in proc.stdout.splitlines() if l.startswith("RESULT "))
        for name, res in json.loads(line[7:]).items():
            results[f"{devices} dev, {name}"] = res
    base = results["1 dev, one device"]
    print(f"\nlazy(optax.adam) on a {n_rows:,} x {DIM} float32 table, K = {K} ids; CPU, medians")
    print(
        "| configuration | optimizer step (ms) | train step (ms) | train step vs 1 device | params + state per device (GiB) |"
    )
    print("|---|---|---|---|---|")
    for name, res in results.items():
        print(
            f"| {name} | {res['update_ms']:.2f} | {res['step_ms']:.2f} | {res['step_ms'] / base['step_ms']:.2f}x | "
            f"{res['device_gib']:.3f} |"
        )
    _plot(results, n_rows)
    return results


def _plot(results, n_rows):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    sys.path.insert(0, os.path.dirname(__file__))
    from _timing import RESULTS

    names = list(results)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    x = np.arange(len(names))
    axes[0].bar(x - 0.2, [results[n]["update_ms"] for n in names], 0.4, label="optimizer step")
    axes[0].bar(x + 0.2, [results[n]["step_ms"] for n in names], 0.4, label="train step")
    axes[0].set_ylabel("median ms")
    axes[0].legend()
    axes[1].bar(x, [results[n]["device_gib"] for n in names])
    axes[1].set_ylabel("params + state on one device (GiB)")
    for ax in axes:
        ax.set_xticks(x, names, rotation=15, fontsize=8)
    fig.suptitle(f"row-sharded lazy Adam, {n_rows:,} x {DIM}, K = {K} (simulated CPU devices)")
    fig.tight_layout()
    os.makedirs(RESULTS, exist_ok=True)
    fig.savefig(os.path.join(RESULTS, "sharded.png"), dpi=120)
    print(f"plot saved to {os.path.join(RESULTS, 'sharded.png')}")


if __name__ == "__main__":
    main()
