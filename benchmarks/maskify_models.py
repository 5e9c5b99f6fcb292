"""maskify on real models against the same models masked by hand, side by side in one run.

Two models, each written once for dense arrays and once with the masks a user would place by hand:

* **flax linen encoder classifier**: a linear embedding, ``LAYERS`` pre-norm transformer blocks
  (``nn.MultiHeadDotProductAttention``, a GELU MLP), mean pooling over the tokens and a linear head.
  Hand-masked: NaN padding zeroed at the input, ``nn.make_attention_mask`` in every block, a masked
  mean pool. maskify'd: the plain model (no mask anywhere) on a ``MaskedArray`` batch whose mask
  is the (B, L, 1) token mask.
* **equinox encoder**: per-sequence ``eqx.nn.MultiheadAttention``, layer norm and an MLP, vmapped
  over the batch, mean pooled. Hand-masked: zeroed input, a key mask, a masked mean.

The batch has random lengths with NaN in the padding. For each model and version it prints the
jitted train-step time (loss, parameter gradients and an ``optax.adam`` update), the XLA temporary
memory of the step (``compiled.memory_analysis().temp_size_in_bytes``), the trace-and-lower and
compile times (medians of three, the versions interleaved) and the eager first forward call; then
each measure's ratio maskify / hand-masked. Saves ``results/maskify_models.png``.

    python benchmarks/maskify_models.py [--quick]
"""

from __future__ import annotations

import argparse
import time

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from _timing import interleaved_medians, result_path

import masked_jax as mj

LAYERS, D_MODEL, HEADS, CLASSES = 2, 128, 4, 10


class _Block(nn.Module):
    @nn.compact
    def __call__(self, x, mask=None):
        h = nn.LayerNorm()(x)
        x = x + nn.MultiHeadDotProductAttention(num_heads=HEADS, qkv_features=D_MODEL)(h, mask=mask)
        h = nn.Dense(2 * D_MODEL)(nn.LayerNorm()(x))
        return x + nn.Dense(D_MODEL)(nn.gelu(h))


class Encoder(nn.Module):
    """The model as written for dense arrays; ``tokens`` (B, L) bool switches on the hand masks."""

    @nn.compact
    def __call__(self, x, tokens=None):
        if tokens is not None:
            x = jnp.where(tokens[..., None], x, 0.0)
        x = nn.Dense(D_MODEL)(x)
        attn = None if tokens is None else nn.make_attention_mask(tokens, tokens)
        for _ in range(LAYERS):
            x = _Block()(x, attn)
        if tokens is None:
            pooled = jnp.mean(x, axis=1)
        else:
            w = tokens[..., None].astype(x.dtype)
            pooled = jnp.sum(x * w, axis=1) / jnp.maximum(jnp.sum(w, axis=1), 1.0)
        return nn.Dense(CLASSES)(pooled)


class EqxEncoder(eqx.Module):
    embed: eqx.nn.Linear
    attn: eqx.nn.MultiheadAttention
    norm: eqx.nn.LayerNorm
    mlp: eqx.nn.MLP
    head: eqx.nn.Linear

    def __init__(self, features, key):
        k = jax.random.split(key, 4)
        self.embed = eqx.nn.Linear(features, D_MODEL, key=k[0])
        self.attn = eqx.nn.MultiheadAttention(HEADS, D_MODEL, key=k[1])
        self.norm = eqx.nn.LayerNorm(D_MODEL)
        self.mlp = eqx.nn.MLP(D_MODEL, D_MODEL, 2 * D_MODEL, 1, key=k[2])
        self.head = eqx.nn.Linear(D_MODEL, CLASSES, key=k[3])

    def __call__(self, x, tokens=None):
        """One sequence (L, F) -> logits; ``tokens`` (L,) bool switches on the hand masks."""
        if tokens is not None:
            x = jnp.where(tokens[:, None], x, 0.0)
        h = jax.vmap(self.embed)(x)
        h = h + self.attn(h, h, h, mask=None if tokens is None else jnp.broadcast_to(tokens, (len(x), len(x))))
        h = h + jax.vmap(lambda v: self.mlp(self.norm(v)))(h)
        if tokens is None:
            pooled = jnp.mean(h, axis=0)
        else:
            pooled = jnp.sum(jnp.where(tokens[:, None], h, 0), 0) / jnp.maximum(jnp.sum(tokens), 1)
        return self.head(pooled)


def batch(b, length, features, seed=0):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, length + 1, size=b)
    tokens = np.arange(length)[None, :] < lengths[:, None]
    x = rng.normal(size=(b, length, features)).astype(np.float32)
    x = np.where(tokens[..., None], x, np.nan)
    labels = rng.integers(0, CLASSES, size=b)
    return jnp.asarray(x), jnp.asarray(tokens), jnp.asarray(labels)


def versions(apply_plain, apply_hand, params, x, tokens, labels):
    """``{name: (train_step, args, forward, forward_args)}`` for the hand-masked and maskify'd model."""
    opt = optax.adam(1e-3)
    xm = mj.masked_array(x, tokens[..., None])

    def hand_loss(p, x, tokens, labels):
        return optax.softmax_cross_entropy_with_integer_labels(apply_hand(p, x, tokens), labels).mean()

    def mask_loss(p, xm, labels):
        logits = mj.maskify(apply_plain)(p, xm)
        logits = logits.data if isinstance(logits, mj.MaskedArray) else logits
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

    def stepper(loss):
        def step(p, s, *batch):
            value, g = jax.value_and_grad(loss)(p, *batch)
            updates, s = opt.update(g, s, p)
            return optax.apply_updates(p, updates), s, value

        return step

    state = opt.init(params)
    return {
        "hand-masked": (stepper(hand_loss), (params, state, x, tokens, labels), apply_hand, (params, x, tokens)),
        "maskify": (stepper(mask_loss), (params, state, xm, labels), mj.maskify(apply_plain), (params, xm)),
    }


def tables(b=32, length=128, features=64):
    """``{model: versions(...)}`` for the flax and the equinox encoder on one padded batch."""
    x, tokens, labels = batch(b, length, features)
    model = Encoder()
    params = model.init(jax.random.key(0), jnp.zeros((1, 4, features)))
    eqx_model = EqxEncoder(features, jax.random.key(1))
    eparams, static = eqx.partition(eqx_model, eqx.is_array)
    return {
        "flax linen encoder": versions(
            lambda p, v: model.apply(p, v), lambda p, v, t: model.apply(p, v, t), params, x, tokens, labels
        ),
        "equinox encoder": versions(
            lambda p, v: jax.vmap(eqx.combine(p, static))(v),
            lambda p, v, t: jax.vmap(eqx.combine(p, static))(v, t),
            eparams,
            x,
            tokens,
            labels,
        ),
    }


def _lower_and_compile(table, repeats):
    """``{version: (compiled, median lower s, median compile s)}``: each version lowered and compiled
    ``repeats`` times from cleared caches, the versions interleaved (one compile here varies by
    +-0.1 s or more from run to run)."""
    times = {version: ([], []) for version in table}
    compiled = {}
    for _ in range(repeats):
        for version, (step, args, _, _) in table.items():
            jax.clear_caches()
            t0 = time.perf_counter()
            lowered = jax.jit(step, donate_argnums=(0, 1)).lower(*args)
            times[version][0].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            compiled[version] = lowered.compile()
            times[version][1].append(time.perf_counter() - t0)
    return {v: (compiled[v], float(np.median(lo)), float(np.median(co))) for v, (lo, co) in times.items()}


def measure(name, table, repeats=3):
    out = {}
    steps = {}
    built = _lower_and_compile(table, repeats)
    for version, (_step, args, forward, fargs) in table.items():
        compiled, t_lower, t_compile = built[version]
        mem = compiled.memory_analysis()
        temp = getattr(mem, "temp_size_in_bytes", float("nan"))
        hlo_lines = len(compiled.as_text().splitlines())
        jax.clear_caches()
        t0 = time.perf_counter()
        jax.block_until_ready(forward(*fargs))
        t_eager = time.perf_counter() - t0
        live = [jax.tree_util.tree_map(lambda a: a.copy() if isinstance(a, jax.Array) else a, args)]

        def run(compiled=compiled, live=live):
            p, s, *rest = live[0]
            p, s, value = compiled(p, s, *rest)
            live[0] = (p, s, *rest)
            return value

        steps[version] = run
        out[version] = {
            "lower s": t_lower,
            "compile s": t_compile,
            "temp MiB": temp / 2**20,
            "HLO lines": hlo_lines,
            "eager first call s": t_eager,
        }
    times = interleaved_medians(steps, rounds=5, block=4, warmup=2)
    for version in table:
        out[version] = {"step ms": 1e3 * times[version], **out[version]}
    return out


def print_rows(name, res):
    cols = list(res["hand-masked"])
    print(f"\n{name}")
    print(f"{'':14}" + "".join(f"{c:>20}" for c in cols))
    for version, row in res.items():
        print(f"{version:14}" + "".join(f"{row[c]:>20.3f}" for c in cols))
    print(f"{'ratio':14}" + "".join(f"{res['maskify'][c] / res['hand-masked'][c]:>19.2f}x" for c in cols))


def plot(results):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = ["step ms", "temp MiB", "compile s", "lower s", "eager first call s"]
    fig, ax = plt.subplots(figsize=(8, 3.5))
    width = 0.8 / len(results)
    for i, (name, res) in enumerate(results.items()):
        ratios = [res["maskify"][c] / res["hand-masked"][c] for c in cols]
        ax.bar(np.arange(len(cols)) + i * width, ratios, width, label=name)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.axhline(1.1, color="r", lw=0.8, ls="--", label="1.10x target (step, memory)")
    ax.set_xticks(np.arange(len(cols)) + width * (len(results) - 1) / 2, cols)
    ax.set_ylabel("maskify / hand-masked")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(result_path("maskify_models"), dpi=120)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="batch 8 x 32 tokens (a smoke run)")
    args = parser.parse_args()
    b, length, features = (8, 32, 16) if args.quick else (32, 128, 64)
    print(
        f"batch {b} x {length} tokens x {features} features, d_model {D_MODEL}, {HEADS} heads, "
        f"{LAYERS} layers; backend {jax.default_backend()}"
    )
    repeats = 1 if args.quick else 3
    results = {model: measure(model, table, repeats) for model, table in tables(b, length, features).items()}
    for name, res in results.items():
        print_rows(name, res)
    plot(results)


if __name__ == "__main__":
    main()
