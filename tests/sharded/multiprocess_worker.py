"""One process of the row-sharded training run across processes (``tests/test_sharding.py`` starts
two): ``python multiprocess_worker.py PROCESS_ID COORDINATOR_PORT``.

Each process has 4 CPU devices; ``jax.distributed`` joins them into one mesh of 8 (CPU collectives
over gloo). Each case trains a row-sharded model for a few steps with
``optim.make_train_step(..., mesh=mesh, axis="rows")`` and compares every shard this process holds
(parameters and optimizer state) with the same training on one local device. It prints ``OK
<case>`` per case and exits non-zero on any difference.
"""

from __future__ import annotations

import os
import sys

os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"

import jax

jax.config.update("jax_cpu_collectives_implementation", "gloo")

import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import masked_jax as mj
from masked_jax import optim

N, DIM, BATCH, STEPS = 1024, 8, 64, 4


def _data(seed):
    rng = np.random.default_rng(seed)
    params = {
        "user": (0.1 * rng.normal(size=(N, DIM))).astype(np.float32),
        "item": (0.1 * rng.normal(size=(N, DIM))).astype(np.float32),
        "bias": np.zeros((), np.float32),
    }
    # Zipf-like ids (repeats within a batch), a different batch per step
    batches = [
        (
            (rng.zipf(1.3, BATCH) % N).astype(np.int32),
            (rng.zipf(1.3, BATCH) % N).astype(np.int32),
            rng.normal(size=BATCH).astype(np.float32),
        )
        for _ in range(STEPS)
    ]
    return params, batches


def _separate(params):
    def loss(p, users, items, ratings):
        pred = jnp.sum(mj.lookup(p["user"], users) * mj.lookup(p["item"], items), axis=-1) + p["bias"]
        return jnp.mean((pred - ratings) ** 2)

    return params, loss, {"user": True, "item": True, "bias": False}


def _stacked(params):
    stack, table = mj.stack_tables({"user": jnp.asarray(params["user"]), "item": jnp.asarray(params["item"])})

    def loss(p, users, items, ratings):
        rows = stack.lookup(p["table"], {"user": users, "item": items})
        pred = jnp.sum(rows["user"] * rows["item"], axis=-1) + p["bias"]
        return jnp.mean((pred - ratings) ** 2)

    return {"table": np.asarray(table), "bias": params["bias"]}, loss, {"table": True, "bias": False}


CASES = {
    "stacked table, lazy adam": (_stacked, lambda: optim.lazy(optax.adam(0.05))),
    "two tables, lazy adam with catch-up": (_separate, lambda: optim.lazy(optax.adam(0.05), catch_up=True)),
}


def _global(x, mesh, spec):
    """The host array ``x`` as a global array over ``mesh`` (each process supplies its shards)."""
    x = np.asarray(x)
    return jax.make_array_from_callback(x.shape, NamedSharding(mesh, spec), lambda index: x[index])


def main(process_id, port):
    jax.distributed.initialize(coordinator_address=f"localhost:{port}", num_processes=2, process_id=process_id)
    try:
        assert jax.process_count() == 2 and len(jax.devices()) == 8 and len(jax.local_devices()) == 4
        mesh = Mesh(np.array(jax.devices()), ("rows",))
        for name, (build, make_opt) in CASES.items():
            params, batches = _data(0)
            params, loss, tables = build(params)
            opt = make_opt()
            # the reference: one local device, no mesh
            local = jax.local_devices()[0]
            step = optim.make_train_step(loss, opt, row_sparse=tables)
            p1 = jax.device_put({k: jnp.asarray(v) for k, v in params.items()}, local)
            s1 = opt.init(p1)
            for users, items, ratings in batches:
                p1, s1, l1 = step(p1, s1, *jax.device_put((users, items, ratings), local))
            # the same training, row-sharded over both processes' 8 devices
            sharded_step = optim.make_train_step(loss, opt, row_sparse=tables, mesh=mesh, axis="rows")
            p8 = {k: _global(v, mesh, P("rows") if tables[k] else P()) for k, v in params.items()}
            s8 = optim.init_sharded(opt, p8)
            for batch in batches:
                p8, s8, l8 = sharded_step(p8, s8, *(_global(v, mesh, P()) for v in batch))
            np.testing.assert_allclose(np.asarray(l8.addressable_data(0)), np.asarray(l1), rtol=1e-6)
            checked = 0
            for got, want in zip(jax.tree_util.tree_leaves((p8, s8)), jax.tree_util.tree_leaves((p1, s1))):
                want = np.asarray(want)
                for shard in got.addressable_shards:
                    np.testing.assert_allclose(np.asarray(shard.data), want[shard.index], rtol=2e-6, atol=1e-7)
                    checked += 1
            assert p8[next(k for k in tables if tables[k])].sharding.spec == P("rows")
            print(f"OK {name} ({checked} shards)", flush=True)
    finally:
        jax.distributed.shutdown()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
