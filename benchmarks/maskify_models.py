"""maskify on real models against the same models masked by hand, side by side in one run.

Each model is written once for dense arrays and once with the masks a user would place by hand:

* **flax linen encoder classifier**: a linear embedding, ``LAYERS`` pre-norm transformer blocks
  (``nn.MultiHeadDotProductAttention``, a GELU MLP), mean pooling over the tokens and a linear head.
  Hand-masked: NaN padding zeroed at the input, ``nn.make_attention_mask`` in every block, a masked
  mean pool. maskify'd: the plain model (no mask anywhere) on a ``MaskedArray`` batch whose mask
  is the (B, L, 1) token mask.
* **equinox encoder**: per-sequence ``eqx.nn.MultiheadAttention``, layer norm and an MLP, vmapped
  over the batch, mean pooled. Hand-masked: zeroed input, a key mask, a masked mean.
* **GRU classifier** (flax ``nn.RNN(GRUCell)``), mean-pooled, and its final carry: the plain model
  passes no ``seq_lengths``; by hand, ``seq_lengths`` and a masked mean.
* **message passing** on padded graphs (``segment_sum`` of messages into receivers, two rounds),
  with the updates ``concat([h, agg]) @ W``, ``h @ W1 + agg @ W2`` and ``h + agg``. maskify'd: node
  and edge masks on the features and the edge lists; by hand: zeroed features and messages.
* **1-D CNN text classifier**: SAME convolutions, a max-pool over the tokens.
* ``jax.nn.dot_product_attention`` at 2048 tokens (batch 2); by hand with ``mask=``.

The batch has random lengths with NaN in the padding. For each model and version it prints the
jitted train-step time (loss, parameter gradients and an ``optax.adam`` update), the XLA temporary
memory of the step (``compiled.memory_analysis().temp_size_in_bytes``), the trace-and-lower and
compile times (medians of three, the versions interleaved) and the eager first forward call; then
each measure's ratio maskify / hand-masked. Saves ``results/maskify_models.png``.

    python benchmarks/maskify_models.py [--quick] [--only GRU ...]
"""

from __future__ import annotations

import argparse
import time

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import jaxlib
import numpy as np
from _families import FAMILIES, _train_entries, family
from _timing import interleaved_rounds, progress, result_path

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


class GRUClassifier(nn.Module):
    """``nn.RNN(GRUCell)`` over the tokens, mean-pooled or its final carry, then a linear head.
    ``tokens`` (B, L) switches on the hand masks: zeroed input, ``seq_lengths`` for the final carry
    (what flax asks of padded batches), a masked mean."""

    final: bool = False
    seq_lengths: bool = True  # the hand version's final carry: seq_lengths (else a gather by length)

    @nn.compact
    def __call__(self, x, tokens=None):
        if tokens is not None:
            x = jnp.where(tokens[..., None], x, 0.0)
        rnn = nn.RNN(nn.GRUCell(D_MODEL), return_carry=True)
        if self.final:  # the natural code: the carry after the last step
            lengths = None if tokens is None else jnp.sum(tokens, axis=1)
            pooled, _ = rnn(x, seq_lengths=lengths)
        else:
            _, hs = rnn(x)
            pooled = jnp.mean(hs, axis=1) if tokens is None else _masked_mean(hs, tokens)
        return nn.Dense(CLASSES)(pooled)


class CNNClassifier(nn.Module):
    """A 1-D CNN text classifier: two SAME convolutions (width 5) with ReLU, a max-pool over the
    tokens, a linear head. By hand: zeroed input, the padding zeroed again after the first
    convolution (the second reads it as the unpadded run's zeros), a max over the valid tokens."""

    @nn.compact
    def __call__(self, x, tokens=None):
        keep = None if tokens is None else tokens[..., None]
        if keep is not None:
            x = jnp.where(keep, x, 0.0)
        h = nn.relu(nn.Conv(D_MODEL, kernel_size=(5,), padding="SAME")(x))
        if keep is not None:
            h = jnp.where(keep, h, 0.0)
        h = nn.relu(nn.Conv(D_MODEL, kernel_size=(5,), padding="SAME")(h))
        pooled = jnp.max(h, axis=1) if keep is None else jnp.max(jnp.where(keep, h, -jnp.inf), axis=1)
        return nn.Dense(CLASSES)(pooled)


class Attention(nn.Module):
    """Projections to ``HEADS`` heads, ``jax.nn.dot_product_attention``, a mean pool and a head.
    By hand: zeroed input, the key mask as ``mask=``, a masked mean."""

    @nn.compact
    def __call__(self, x, tokens=None):
        if tokens is not None:
            x = jnp.where(tokens[..., None], x, 0.0)
        b, length, _ = x.shape
        q, k, v = (nn.Dense(D_MODEL, use_bias=False)(x).reshape(b, length, HEADS, -1) for _ in range(3))
        mask = None if tokens is None else tokens[:, None, None, :]
        o = jax.nn.dot_product_attention(q, k, v, mask=mask).reshape(b, length, D_MODEL)
        pooled = jnp.mean(o, axis=1) if tokens is None else _masked_mean(o, tokens)
        return nn.Dense(CLASSES)(pooled)


def _masked_mean(h, tokens):
    w = tokens[..., None].astype(h.dtype)
    return jnp.sum(h * w, axis=1) / jnp.maximum(jnp.sum(w, axis=1), 1.0)


MP_ROUNDS = 2


def message_passing(p, h, senders, receivers, update, node_mask=None, edge_mask=None):
    """Message passing on one padded graph: ``MP_ROUNDS`` rounds of messages ``tanh(h[s] @ Wm)``
    summed into their receivers (``segment_sum``), the update ``update`` (``concat``: ``concat([h,
    agg]) @ W``; ``two``: ``h @ W1 + agg @ W2``; ``sum``: ``h + agg``), then a mean over the nodes
    and a linear head. The masks switch on the hand version: zeroed features, messages of padded
    edges zeroed, a masked mean."""
    n = h.shape[0]
    if node_mask is not None:
        h = jnp.where(node_mask[:, None], h, 0.0)
    h = jnp.tanh(h @ p["embed"])
    for r in range(MP_ROUNDS):
        msg = jnp.tanh(h[senders] @ p["msg"][r])
        if edge_mask is not None:
            msg = jnp.where(edge_mask[:, None], msg, 0.0)
        agg = jax.ops.segment_sum(msg, receivers, n)
        w = p["update"][r]
        if update == "concat":
            h = jnp.tanh(jnp.concatenate([h, agg], -1) @ w)
        elif update == "two":
            h = jnp.tanh(h @ w[:D_MODEL] + agg @ w[D_MODEL:])
        else:
            h = jnp.tanh(h + agg)
    if node_mask is None:
        pooled = jnp.mean(h, axis=0)
    else:
        pooled = jnp.sum(jnp.where(node_mask[:, None], h, 0.0), 0) / jnp.maximum(jnp.sum(node_mask), 1)
    return pooled @ p["head"]


def graphs(b, nodes, edges, features, seed=0):
    """``b`` padded graphs of up to ``nodes`` nodes and ``edges`` edges: features (NaN padding),
    senders, receivers, node and edge masks; padded edges point at node 0."""
    rng = np.random.default_rng(seed)
    n = rng.integers(nodes // 2, nodes + 1, size=b)
    e = rng.integers(edges // 2, edges + 1, size=b)
    node_mask = np.arange(nodes)[None, :] < n[:, None]
    edge_mask = np.arange(edges)[None, :] < e[:, None]
    senders = np.where(edge_mask, rng.integers(0, nodes, (b, edges)) % n[:, None], 0).astype(np.int32)
    receivers = np.where(edge_mask, rng.integers(0, nodes, (b, edges)) % n[:, None], 0).astype(np.int32)
    h = np.where(node_mask[..., None], rng.normal(size=(b, nodes, features)), np.nan).astype(np.float32)
    return tuple(jnp.asarray(a) for a in (h, senders, receivers, node_mask, edge_mask))


def batch(b, length, features, seed=0):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, length + 1, size=b)
    tokens = np.arange(length)[None, :] < lengths[:, None]
    x = rng.normal(size=(b, length, features)).astype(np.float32)
    x = np.where(tokens[..., None], x, np.nan)
    labels = rng.integers(0, CLASSES, size=b)
    return jnp.asarray(x), jnp.asarray(tokens), jnp.asarray(labels)


def versions(apply_plain, apply_hand, params, x, tokens, labels, masked=None, hand=None):
    """``{name: Entry}`` for the hand-masked and maskify'd model: ``apply_plain(params, *masked)``
    (the plain model; by default on the (B, L, F) batch ``x`` with its (B, L, 1) token mask) and
    ``apply_hand(params, *hand)`` (by default ``x, tokens``)."""
    masked = masked if masked is not None else (mj.masked_array(x, tokens[..., None]),)
    hand = hand if hand is not None else (x, tokens)
    return _train_entries(apply_plain, apply_hand, params, labels, masked, hand)


def _linen(model, x, tokens, labels, features):
    params = model.init(jax.random.key(0), jnp.zeros((1, 4, features)))
    return versions(lambda p, v: model.apply(p, v), lambda p, v, t: model.apply(p, v, t), params, x, tokens, labels)


def _graph_model(update, b, nodes, edges, features, labels):
    h, s, r, node_mask, edge_mask = graphs(b, nodes, edges, features)
    k = jax.random.split(jax.random.key(4), 4)
    width = 2 * D_MODEL if update in ("concat", "two") else D_MODEL
    params = {
        "embed": jax.random.normal(k[0], (features, D_MODEL)) / np.sqrt(features),
        "msg": jax.random.normal(k[1], (MP_ROUNDS, D_MODEL, D_MODEL)) / np.sqrt(D_MODEL),
        "update": jax.random.normal(k[2], (MP_ROUNDS, width, D_MODEL)) / np.sqrt(width),
        "head": jax.random.normal(k[3], (D_MODEL, CLASSES)) / np.sqrt(D_MODEL),
    }

    def plain(p, h, s, r):
        return jax.vmap(lambda a, b_, c: message_passing(p, a, b_, c, update))(h, s, r)

    def hand(p, h, s, r, nm, em):
        return jax.vmap(lambda a, b_, c, d, e: message_passing(p, a, b_, c, update, d, e))(h, s, r, nm, em)

    masked = (
        mj.masked_array(h, node_mask[..., None]),
        mj.masked_array(s, edge_mask),
        mj.masked_array(r, edge_mask),
    )
    return versions(plain, hand, params, None, None, labels, masked=masked, hand=(h, s, r, node_mask, edge_mask))


MODELS = (
    "flax linen encoder",
    "equinox encoder",
    "GRU, mean-pooled",
    "GRU, final carry",
    "message passing, concat",
    "message passing, two matmuls",
    "message passing, h + agg",
    "1-D CNN, max-pool",
    "dot_product_attention",
    *FAMILIES,
)


def tables(b=32, length=128, features=64, models=MODELS, attention_length=2048):
    """``{model: {version: Entry}}`` for each of ``models`` on one padded batch (B, L, F); the graphs
    have ``length`` nodes and ``2 * length`` edges; attention runs at ``attention_length`` tokens
    (batch 2)."""
    x, tokens, labels = batch(b, length, features)
    tag_labels = jnp.asarray(np.random.default_rng(7).integers(0, CLASSES, size=(b, length)))
    out = {}
    for name in models:
        if name in FAMILIES:
            out[name] = family(name, x, tokens, labels, tag_labels, features)
        elif name == "flax linen encoder":
            out[name] = _linen(Encoder(), x, tokens, labels, features)
        elif name == "equinox encoder":
            eparams, static = eqx.partition(EqxEncoder(features, jax.random.key(1)), eqx.is_array)
            out[name] = versions(
                lambda p, v, static=static: jax.vmap(eqx.combine(p, static))(v),
                lambda p, v, t, static=static: jax.vmap(eqx.combine(p, static))(v, t),
                eparams,
                x,
                tokens,
                labels,
            )
        elif name.startswith("GRU"):
            out[name] = _linen(GRUClassifier(final="final" in name), x, tokens, labels, features)
        elif name.startswith("message passing"):
            update = {"concat": "concat", "two matmuls": "two", "h + agg": "sum"}[name.split(", ")[1]]
            out[name] = _graph_model(update, b, length, 2 * length, features, labels)
        elif name.startswith("1-D CNN"):
            out[name] = _linen(CNNClassifier(), x, tokens, labels, features)
        else:
            xa, ta, la = batch(2, attention_length, features, seed=1)
            out[name] = _linen(Attention(), xa, ta, la, features)
    return out


def _lower_and_compile(table, repeats):
    """``{version: (compiled, median lower s, median compile s)}``: each version lowered and compiled
    ``repeats`` times from cleared caches, the versions interleaved (one compile here varies by
    +-0.1 s or more from run to run)."""
    times = {version: ([], []) for version in table}
    compiled = {}
    for _ in range(repeats):
        for version, entry in table.items():
            jax.clear_caches()
            t0 = time.perf_counter()
            lowered = jax.jit(entry.step, donate_argnums=entry.donate).lower(*entry.args)
            times[version][0].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            compiled[version] = lowered.compile()
            times[version][1].append(time.perf_counter() - t0)
    return {v: (compiled[v], float(np.median(lo)), float(np.median(co))) for v, (lo, co) in times.items()}


def _equations(jaxpr):
    """The number of equations of ``jaxpr``, those of the jaxprs inside its equations included."""
    count = 0
    for eqn in jaxpr.eqns:
        count += 1
        for value in eqn.params.values():
            for sub in value if isinstance(value, (list, tuple)) else (value,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    count += _equations(inner)
    return count


def _agreement(table, outputs):
    """How far the maskify'd step's result is from the hand-masked one: the loss's relative
    difference, or the fraction of generated tokens that differ."""
    a, b = (np.asarray(outputs[v]) for v in ("maskify", "hand-masked"))
    if a.dtype.kind in "iu":
        return float(np.mean(a != b))
    return float(np.max(np.abs(a - b)) / max(float(np.max(np.abs(b))), 1e-12))


def measure(name, table, repeats=3, rounds=7):
    out = {}
    steps = {}
    outputs = {}
    built = _lower_and_compile(table, repeats)
    for version, entry in table.items():
        compiled, t_lower, t_compile = built[version]
        mem = compiled.memory_analysis()
        temp = getattr(mem, "temp_size_in_bytes", float("nan"))
        hlo_lines = len(compiled.as_text().splitlines())
        equations = _equations(jax.make_jaxpr(entry.step)(*entry.args).jaxpr)
        jax.clear_caches()
        t0 = time.perf_counter()
        jax.block_until_ready(entry.forward(*entry.fargs))
        t_eager = time.perf_counter() - t0
        live = [jax.tree_util.tree_map(lambda a: a.copy() if isinstance(a, jax.Array) else a, entry.args)]

        def run(compiled=compiled, live=live, donated=bool(entry.donate)):
            if not donated:
                return compiled(*live[0])
            p, s, *rest = live[0]
            p, s, value = compiled(p, s, *rest)
            live[0] = (p, s, *rest)
            return value

        outputs[version] = run()
        steps[version] = run
        out[version] = {
            "lower s": t_lower,
            "compile s": t_compile,
            "temp MiB": temp / 2**20,
            "HLO lines": hlo_lines,
            "jaxpr eqns": equations,
            "eager first call s": t_eager,
        }
    per_round = {v: [float(np.median(r)) for r in ts] for v, ts in interleaved_rounds(steps, rounds, block=3).items()}
    ratios = np.asarray(per_round["maskify"]) / np.asarray(per_round["hand-masked"])
    for version in table:
        out[version] = {"step ms": 1e3 * float(np.median(per_round[version])), **out[version]}
    out["step ratio spread"] = (float(np.min(ratios)), float(np.max(ratios)))
    out["differs"] = _agreement(table, outputs)
    return out


COLUMNS = ["step ms", "temp MiB", "compile s", "lower s", "HLO lines", "jaxpr eqns", "eager first call s"]


def print_rows(name, res):
    print(f"\n{name}")
    print(f"{'':14}" + "".join(f"{c:>20}" for c in COLUMNS))
    for version in ("hand-masked", "maskify"):
        print(f"{version:14}" + "".join(f"{res[version][c]:>20.3f}" for c in COLUMNS))
    print(f"{'ratio':14}" + "".join(f"{res['maskify'][c] / res['hand-masked'][c]:>19.2f}x" for c in COLUMNS))
    lo, hi = res["step ratio spread"]
    print(f"step ratio per round: {lo:.2f}x .. {hi:.2f}x; maskify differs from hand-masked by {res['differs']:.2g}")


def plot(results):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = ["step ms", "temp MiB", "compile s", "lower s", "eager first call s"]
    fig, ax = plt.subplots(figsize=(13, 4.5))
    width = 0.8 / len(results)
    for i, (name, res) in enumerate(results.items()):
        ratios = [res["maskify"][c] / res["hand-masked"][c] for c in cols]
        ax.bar(np.arange(len(cols)) + i * width, ratios, width, label=name)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.axhline(1.1, color="r", lw=0.8, ls="--", label="1.10x target (step, memory)")
    ax.axhline(1.5, color="m", lw=0.8, ls=":", label="1.5x target (compile)")
    ax.set_xticks(np.arange(len(cols)) + width * (len(results) - 1) / 2, cols)
    ax.set_ylabel("maskify / hand-masked")
    ax.legend(fontsize=6, ncol=3)
    fig.tight_layout()
    fig.savefig(result_path("maskify_models"), dpi=120)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="batch 8 x 32 tokens (a smoke run)")
    parser.add_argument("--only", nargs="*", help="run the models whose names contain one of these")
    args = parser.parse_args()
    b, length, features = (8, 32, 16) if args.quick else (32, 128, 64)
    attention_length = 256 if args.quick else 2048
    models = [m for m in MODELS if args.only is None or any(o in m for o in args.only)]
    print(
        f"jax {jax.__version__}, jaxlib {jaxlib.__version__}, device {jax.devices()[0].device_kind} "
        f"({jax.default_backend()}); batch {b} x {length} tokens x {features} features (graphs: {length} "
        f"nodes, {2 * length} edges; attention: 2 x {attention_length} tokens), d_model {D_MODEL}, "
        f"{HEADS} heads, {LAYERS} encoder layers"
    )
    repeats = 1 if args.quick else 3
    results = {}
    for model in progress(models, "model"):
        table = tables(b, length, features, (model,), attention_length)[model]
        results[model] = measure(model, table, repeats, rounds=3 if args.quick else 7)
        print_rows(model, results[model])
    summary(results)
    plot(results)


def summary(results):
    """One line per model: the ratios maskify / hand-masked of each measure, the step's spread."""
    cols = ["step ms", "temp MiB", "compile s", "lower s", "HLO lines", "jaxpr eqns"]
    print("\nmaskify / hand-masked (targets: step <= 1.10x, temp memory <= 1.10x, compile <= 1.5x, lower <= 2x)")
    print("| model | " + " | ".join(cols) + " | step spread |")
    print("|---" * (len(cols) + 2) + "|")
    for name, res in results.items():
        ratios = " | ".join(f"{res['maskify'][c] / res['hand-masked'][c]:.2f}x" for c in cols)
        lo, hi = res["step ratio spread"]
        print(f"| {name} | {ratios} | {lo:.2f}-{hi:.2f}x |")


if __name__ == "__main__":
    main()
