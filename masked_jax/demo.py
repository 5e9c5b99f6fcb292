"""A tour of the three jobs masked_jax is for; ``make demo`` runs it (``python -m masked_jax.demo``).

1. an optax chain that updates only the valid entries of masked gradients;
2. a jitted embedding training step with row-sparse gradients, against the dense step;
3. a Jacobian check that tells masked semantics from dense semantics;
and ``maskify`` running a small plain-JAX model on padded sequences.
It needs the runtime dependencies only (jax, optax, numpy).
"""

from __future__ import annotations

import time
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np
import optax

import masked_jax as mj
import masked_jax.numpy as mnp
from masked_jax import optim


def _median_step_ms(step, params, state, ids, repeats=15):
    """Median time of ``step`` (warmed up), carrying params and state from call to call (the
    row-sparse step donates them)."""
    params, state, _ = jax.block_until_ready(step(params, state, ids))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        params, state, _ = jax.block_until_ready(step(params, state, ids))
        times.append(time.perf_counter() - t0)
    return 1e3 * float(np.median(times))


def _show(a):
    return np.asarray(a, np.float64).round(3).tolist()


def masked_optax_chain() -> None:
    print("1. A masked optax chain")
    print("   The gradient is valid at three entries (the Adagrad tutorial of torch.masked):")
    params = jnp.array([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    grad = mj.masked_array(
        jnp.array([[0.5, jnp.nan, 0.1], [jnp.nan, jnp.nan, 0.2]]),
        jnp.array([[True, False, True], [False, False, True]]),
    )
    opt = optim.lazy(optax.chain(optax.clip_by_global_norm(1.0), optax.adam(0.1)))  # norms over valid entries
    state = opt.init(params)
    updates, state = opt.update(grad, state, params)
    new = optim.apply_updates(params, updates)
    print("   params after one step:", _show(new))
    print("   entries that changed: ", np.asarray(new != params).tolist(), "<- exactly the valid ones")
    adam_state = cast(Any, state)[1][0]  # chain(clip, adam)'s state: (clip's, (adam's, ...))
    print("   adam's mu:            ", _show(adam_state.mu), "<- NaN never entered\n")


def embedding_training(steps: int = 30) -> None:
    print("2. Embedding training with row-sparse gradients (jitted, the table donated)")
    n, dim, batch = 100_000, 32, 256
    key = jax.random.key(0)
    table = jax.random.normal(key, (n, dim)) * 0.1
    target = jax.random.normal(jax.random.key(1), (n, dim))
    ids_all = jax.random.randint(jax.random.key(2), (steps, batch), 0, n)

    def loss(t, ids):
        return jnp.mean((cast(jax.Array, mj.lookup(t, ids)) - target[ids]) ** 2)  # plain ids: plain rows

    opt = optim.lazy(optax.adam(0.05))
    step = optim.make_train_step(loss, opt, row_sparse=True)
    state = opt.init(table)
    params = jnp.array(table)  # a copy: the step donates (consumes) the arrays it is given
    losses = []
    for i in range(steps):
        ids = ids_all[i % 3]  # three batches, revisited: the loss on them goes down
        params, state, value = step(params, state, ids)
        losses.append(float(value))
    print("   loss:", " ".join(f"{v:.3f}" for v in losses[::5]), "(every 5th step)")

    dense_opt = optax.adam(0.05)

    @jax.jit
    def dense_step(p, s, ids):
        value, g = jax.value_and_grad(loss)(p, ids)
        u, s = dense_opt.update(g, s, p)
        return optax.apply_updates(p, u), s, value

    t_sparse = _median_step_ms(step, params, state, ids_all[0])
    t_dense = _median_step_ms(dense_step, table, dense_opt.init(table), ids_all[0])
    print(
        f"   step time, {n:,} x {dim} table, {batch} ids: row-sparse {t_sparse:.2f} ms, dense adam "
        f"{t_dense:.2f} ms ({t_dense / t_sparse:.1f}x)\n"
    )


def jacobian_check() -> None:
    print("3. A Jacobian check that tells masked from dense semantics")
    x = mj.masked_array(jnp.array([0.5, 1.5, 2.0]), jnp.array([True, True, False]))

    report = mj.check_jacobian(lambda v: mj.nn.softmax(v), (x,), raise_exception=False)
    print("   mnn.softmax on a masked input satisfies:", " and ".join(report.satisfies) or "neither")
    leaky = mj.check_jacobian(lambda v: mj.masked_array(jax.nn.softmax(v.data), v.mask), (x,), raise_exception=False)
    print(
        "   jax.nn.softmax of the data (masked entries leak in) satisfies:",
        " and ".join(leaky.satisfies) or "neither",
        "\n",
    )


def maskify_model() -> None:
    print("4. maskify: a plain-JAX model on padded sequences")
    lengths = jnp.array([4, 2])
    x = jax.random.normal(jax.random.key(3), (2, 4, 3))
    valid = (jnp.arange(4)[None, :] < lengths[:, None])[..., None] & jnp.ones((1, 1, 3), bool)
    padded = mj.masked_array(jnp.where(valid, x, jnp.nan), valid)
    w = jax.random.normal(jax.random.key(4), (3, 3))

    def model(h):  # written for unpadded data: layer norm, a dense layer, a mean over tokens
        h = (h - h.mean(-1, keepdims=True)) / jnp.sqrt(h.var(-1, keepdims=True) + 1e-5)
        return jnp.mean(jax.nn.gelu(h @ w), axis=1)

    out = jax.jit(mj.maskify(model))(padded)
    ref = model(x[1:, :2])[0]
    print("   sequence 1 (2 tokens + padding):", _show(out.data[1]))
    print("   sequence 1 unpadded, no mask:   ", _show(ref))
    print("   valid:", np.asarray(out.mask).all(), "| any NaN:", bool(jnp.isnan(out.data).any()))


def main() -> None:
    print(f"masked_jax {mj.__version__} on {jax.default_backend()}")
    print("Mask convention: True = valid (numpy.ma uses the opposite, and conversions invert it).")
    x = mj.masked_array(
        jnp.array([[1.0, jnp.nan, 3.0], [4.0, 5.0, -jnp.inf]]), jnp.array([[True, False, True], [False, False, False]])
    )
    print("mean over rows    ", mnp.mean(x, axis=1), " <- a fully masked row is masked, not NaN\n")
    masked_optax_chain()
    embedding_training()
    jacobian_check()
    maskify_model()


if __name__ == "__main__":
    main()
