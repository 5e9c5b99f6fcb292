"""A DLRM-like recommender training step: 8 embedding tables, multi-hot bags, an MLP.

Tables of 1M, 500k, 200k, 100k, 50k, 20k, 10k and 5k rows x 32 (float32), batch 1024, one bag
of 1 to 20 ids per table and example (ids uniform over the table), sum pooling with per-sample
weights on the two largest tables and mean pooling on the others, an MLP 256 -> 128 -> 64 -> 1,
a logistic loss, Adam (lr 1e-2) on everything. One jitted training step (forward, backward,
optimizer update, parameters and state donated) of

* ``mj_stacked``: ``mj.stack_tables`` + ``TableStack.embedding_bag`` (one gather for all tables),
  ``make_train_step(lazy(adam), row_sparse=...)`` (the table updated in chunks of 8192 rows);
* ``mj_stacked_one_call``: the same with ``chunk_rows=None`` (one update of every slot the
  gradient stores);
* ``mj_stacked_fused`` (on a CUDA GPU only): the same with ``fused_rows=True`` (one Pallas
  kernel per table sums the duplicate rows as it updates them);
* ``mj_separate``: 8 tables, 8 ``mj.embedding_bag`` calls, the same step;
* ``mj_one_table``: the cost bound of stacking: one table of the same total rows, read by one
  ``mj.embedding_bag`` call with the same ids (all bags of all tables in one padded id array);
* ``mj_stacked_catch_up``: ``mj_stacked`` with ``lazy(adam, catch_up=True)``;
* ``mj_stacked (twin)`` and ``mj_one_table (twin)``: the same two steps again on fresh buffers,
  timed alongside, so that each run shows how far two instances of one program drift apart on
  this machine: the yardstick for the stacked / one-table ratio;
* ``hand_jax``: the best plain-JAX step a user would write by hand: one stacked table, one
  ``jnp.take``, gradients with respect to the rows read, sort-based coalescing and a lazy Adam
  update by gather and scatter;
* ``dense_optax``: ``jax.value_and_grad`` of the stacked table (a dense gradient) and
  ``optax.adam``;
* ``torch_sparse_adam``: 8 ``torch.nn.EmbeddingBag(sparse=True)`` (flat ids and offsets,
  per-sample weights) with ``torch.optim.SparseAdam`` for the tables and ``Adam`` for the MLP;
* Adagrad: ``mj_stacked_adagrad`` (``masked_adagrad``), ``mj_stacked_lazy_adagrad`` (the same
  Adagrad through the generic ``lazy``), ``mj_stacked_rowwise_adagrad`` (``rowwise_adagrad``)
  and ``torch_sparse_adagrad`` (``torch.optim.Adagrad`` on the sparse gradients).

All variants start from the same parameters and data; their first losses are printed and must
agree. Then the optimizer step alone (lazy Adam on the stacked table's row-sparse gradient) in
GB/s of the bytes it must touch (gradient rows read; parameter, mu and nu rows read and written),
against the copy bandwidth measured in the same run. Prints tables of medians and ratios and
saves ``benchmarks/results/recsys.png``.

On an accelerator (or with ``--sweep``) it then times lazy Adam's step alone on an 8M x 32 table
at K = 100k, 1M and 4M ids, against the hand-written step and a fewest-bytes floor (gather,
update, scatter on sorted distinct ids), in GB/s of touched bytes; on a CUDA GPU also the fused update
(``make_train_step(..., fused_rows=True)``), checked first against the one-call update.

Run: ``.venv/bin/python benchmarks/recsys.py`` (``--quick``: tables 100x smaller, batch 128;
``--reuse-memory``: rerun under a glibc malloc that keeps freed memory, as in ``optim.py``: XLA:CPU
takes every step's temporaries as one fresh block, whose pages fault on first touch, where torch
reuses its heap; ``--sweep-only``: the optimizer sweep alone; ``--no-sweep``: without it).
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax

sys.path.insert(0, os.path.dirname(__file__))
from _timing import interleaved_medians, print_table, result_path, save_bar_plot, torch_device
from optim import (
    LR,
    Stepper,
    adam_rows,
    copy_bandwidth,
    fused_step,
    hand_lazy_adam_step,
    optax_stepper,
    reusing_memory,
    update_step,
)

import masked_jax as mj
from masked_jax import optim
from masked_jax.optim._chunked import chunked_update
from masked_jax.optim._fused import KernelConfig

ROWS = (1_000_000, 500_000, 200_000, 100_000, 50_000, 20_000, 10_000, 5_000)
DIM, MAX_BAG, HIDDEN = 32, 20, (128, 64)
NAMES = tuple(f"t{i}" for i in range(len(ROWS)))
WEIGHTED = {"t0", "t1"}  # sum pooling with per-sample weights; the rest: mean pooling


@functools.cache
def fused_runs() -> bool:
    """Does ``fused_rows=True`` run its kernel here (a CUDA GPU), and does it pass
    :func:`check_fused`? A failure is printed, and the fused variants are then left out."""
    if jax.default_backend() != "gpu" or "NVIDIA" not in jax.devices()[0].device_kind.upper():
        return False
    try:
        check_fused()
    except Exception as e:  # noqa: BLE001 - report it and time the rest
        print(f"fused update left out: {type(e).__name__}: {e}")
        return False
    return True


def check_fused(n=1000, k=700, steps=2, seed=0):
    """On a CUDA GPU, compiled: the fused update equals the one-call lazy Adam update (duplicates
    summed, untouched rows bit-identical) over ``steps`` steps, and then over a step of ids
    flagged unique; raises where it does not."""
    rng = np.random.default_rng(seed)
    table = jnp.asarray(rng.normal(size=(n, DIM)), jnp.float32)
    opt = optim.lazy(optax.adam(LR))
    one_call, fused = jax.jit(update_step(opt)), jax.jit(fused_step(opt))
    got = want = (table, opt.init(table))
    for step in range(steps + 1):
        unique = step == steps
        ids = rng.permutation(n // 3)[: k // 3] if unique else rng.integers(0, n // 3, size=k)  # many duplicates
        if not unique:
            ids[rng.permutation(k)[:300]] = 5  # and one hot id, over several kernel programs
        g = mj.row_sparse(
            jnp.asarray(rng.normal(size=(ids.size, DIM)), jnp.float32),
            jnp.asarray(ids),
            (n, DIM),
            unique_indices=unique,
        )
        got, want = fused(*got, g), one_call(*want, g)
    for x, y in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-6)
    assert (np.asarray(got[0])[n // 3 :] == np.asarray(table)[n // 3 :]).all()


def make_data(rows, batch, seed=0):
    """Padded bags (-1 past each bag's length), weights, labels, and the initial parameters."""
    rng = np.random.default_rng(seed)
    feats = {}
    for name, n in zip(NAMES, rows):
        lengths = rng.integers(1, MAX_BAG + 1, size=batch)
        ids = rng.integers(0, n, size=(batch, MAX_BAG)).astype(np.int32)
        ids[np.arange(MAX_BAG)[None, :] >= lengths[:, None]] = -1
        w = rng.uniform(0.5, 1.5, size=(batch, MAX_BAG)).astype(np.float32)
        feats[name] = (ids, w)
    tables = {name: (0.05 * rng.normal(size=(n, DIM))).astype(np.float32) for name, n in zip(NAMES, rows)}
    sizes = (len(NAMES) * DIM,) + HIDDEN + (1,)
    mlp = [
        ((rng.normal(size=(a, b)) / np.sqrt(a)).astype(np.float32), np.zeros(b, np.float32))
        for a, b in zip(sizes[:-1], sizes[1:])
    ]
    labels = (rng.random(batch) < 0.3).astype(np.float32)
    return feats, tables, mlp, labels


def mlp_apply(mlp, x):
    for i, (w, b) in enumerate(mlp):
        x = x @ w + b
        if i < len(mlp) - 1:
            x = jax.nn.relu(x)
    return x[:, 0]


def bce(logits, y):
    return jnp.mean(optax.sigmoid_binary_cross_entropy(logits, y))


def _requests(ids, w):
    return {
        k: {"ids": ids[k], **({"weights": w[k], "combiner": "sum"} if k in WEIGHTED else {"combiner": "mean"})}
        for k in NAMES
    }


def mj_variants(feats, tables, mlp, labels, only=None):
    """The masked_jax steps: (name -> (step, params, state, args)); ``only``: just these names."""
    ids = {k: jnp.asarray(v[0]) for k, v in feats.items()}
    w = {k: jnp.asarray(v[1]) for k, v in feats.items()}
    y = jnp.asarray(labels)
    stack, _ = mj.stack_tables({k: jnp.zeros((t.shape[0], DIM)) for k, t in tables.items()})
    mlp_j = [(jnp.asarray(a), jnp.asarray(b)) for a, b in mlp]

    def stacked_loss(p, ids, w, y):
        pooled = stack.embedding_bag(p["tables"], _requests(ids, w))
        return bce(mlp_apply(p["mlp"], jnp.concatenate([pooled[k].filled(0) for k in NAMES], -1)), y)

    def separate_loss(p, ids, w, y):
        pooled = [
            mj.embedding_bag(
                p["tables"][k],
                ids[k],
                weights=w[k] if k in WEIGHTED else None,
                combiner="sum" if k in WEIGHTED else "mean",
            )
            for k in NAMES
        ]
        return bce(mlp_apply(p["mlp"], jnp.concatenate([x.filled(0) for x in pooled], -1)), y)

    # one table, the same ids: every bag of every table in one (batch * 8, L) id array; the mean
    # tables' bags pooled with weights 1 / count, so one sum-combined call computes the same
    offsets = np.cumsum([0] + [t.shape[0] for t in tables.values()])[:-1]
    all_ids = np.stack([np.where(feats[k][0] >= 0, feats[k][0] + o, -1) for k, o in zip(NAMES, offsets)], 1)
    count = np.maximum((all_ids >= 0).sum(-1, keepdims=True), 1)
    all_w = np.stack([feats[k][1] if k in WEIGHTED else np.ones_like(feats[k][1]) for k in NAMES], 1)
    all_w = np.where(
        np.isin(np.arange(len(NAMES)), [NAMES.index(k) for k in WEIGHTED])[None, :, None], all_w, all_w / count
    ).astype(np.float32)
    batch = labels.shape[0]

    def one_table_loss(p, all_ids, all_w, y):
        pooled = mj.embedding_bag(
            p["tables"],
            all_ids.reshape(batch * len(NAMES), MAX_BAG),
            weights=all_w.reshape(batch * len(NAMES), MAX_BAG),
        )
        return bce(mlp_apply(p["mlp"], pooled.filled(0).reshape(batch, len(NAMES) * DIM)), y)

    stacked_np = np.concatenate([tables[k] for k in NAMES])
    sparse = {"tables": True, "mlp": False}
    out = {}

    def add(name, loss, opt, tables_value, *args, **kwargs):
        if only is not None and name not in only:
            return
        params = {"tables": tables_value, "mlp": [(jnp.array(a), jnp.array(b)) for a, b in mlp_j]}
        out[name] = (optim.make_train_step(loss, opt, row_sparse=sparse, **kwargs), params, opt.init(params), args)

    add("mj_stacked", stacked_loss, optim.lazy(optax.adam(LR)), jnp.asarray(stacked_np), ids, w, y)
    add(
        "mj_stacked_one_call",
        stacked_loss,
        optim.lazy(optax.adam(LR)),
        jnp.asarray(stacked_np),
        ids,
        w,
        y,
        chunk_rows=None,
    )
    if fused_runs():
        add(
            "mj_stacked_fused",
            stacked_loss,
            optim.lazy(optax.adam(LR)),
            jnp.asarray(stacked_np),
            ids,
            w,
            y,
            fused_rows=True,
        )
    add(
        "mj_separate",
        separate_loss,
        optim.lazy(optax.adam(LR)),
        {k: jnp.asarray(v) for k, v in tables.items()},
        ids,
        w,
        y,
    )
    add(
        "mj_one_table",
        one_table_loss,
        optim.lazy(optax.adam(LR)),
        jnp.asarray(stacked_np),
        jnp.asarray(all_ids),
        jnp.asarray(all_w),
        y,
    )
    add(
        "mj_stacked_catch_up",
        stacked_loss,
        optim.lazy(optax.adam(LR), catch_up=True),
        jnp.asarray(stacked_np),
        ids,
        w,
        y,
    )
    add(
        "mj_stacked_adagrad",
        stacked_loss,
        optim.masked_adagrad(LR, initial_accumulator_value=0.0, eps=1e-10, eps_placement="outside"),
        jnp.asarray(stacked_np),
        ids,
        w,
        y,
    )
    add(
        "mj_stacked_lazy_adagrad",
        stacked_loss,
        optim.lazy(optax.chain(optim.scale_by_rss(0.0, 1e-10, "outside"), optax.scale_by_learning_rate(LR))),
        jnp.asarray(stacked_np),
        ids,
        w,
        y,
    )
    add("mj_stacked_rowwise_adagrad", stacked_loss, optim.rowwise_adagrad(LR), jnp.asarray(stacked_np), ids, w, y)
    return out, stacked_loss, stack, (ids, w, y), (jnp.asarray(all_ids), jnp.asarray(all_w))


def hand_variant(feats, tables, mlp, labels, all_ids, all_w):
    """One stacked table, one take, gradients of the rows read, a hand-written lazy Adam."""
    n = sum(t.shape[0] for t in tables.values())
    batch = labels.shape[0]
    mlp_opt = optax.adam(LR)

    def step(table, m, v, count, mlp_p, mlp_s, all_ids, all_w, y):
        flat = jnp.where(all_ids >= 0, all_ids, n).reshape(-1)
        weights = jnp.where(all_ids >= 0, all_w, 0.0)
        rows = jnp.take(table, flat, axis=0, mode="fill", fill_value=0)

        def loss_of(rows, mlp_p):
            pooled = jnp.einsum("bfl,bfld->bfd", weights, rows.reshape(batch, len(NAMES), MAX_BAG, DIM))
            return bce(mlp_apply(mlp_p, pooled.reshape(batch, len(NAMES) * DIM)), y)

        loss, (g_rows, g_mlp) = jax.value_and_grad(loss_of, argnums=(0, 1))(rows, mlp_p)
        table, m, v, count = hand_lazy_adam_step(table, m, v, count, flat, g_rows)
        u, mlp_s = mlp_opt.update(g_mlp, mlp_s, mlp_p)
        return table, m, v, count, optax.apply_updates(mlp_p, u), mlp_s, loss

    stacked = jnp.asarray(np.concatenate([tables[k] for k in NAMES]))
    mlp_p = [(jnp.asarray(a), jnp.asarray(b)) for a, b in mlp]
    jitted = jax.jit(step, donate_argnums=(0, 1, 2, 3, 4, 5))
    carry = (stacked, jnp.zeros_like(stacked), jnp.zeros_like(stacked), jnp.zeros(()), mlp_p, mlp_opt.init(mlp_p))
    return HandTrain(jitted, carry, (all_ids, all_w, jnp.asarray(labels)))


class HandTrain:
    """The hand-written step with its donated carry: each call is one step."""

    def __init__(self, step, carry, args):
        self.step, self.carry, self.args, self.losses = step, carry, args, []

    def __call__(self):
        *self.carry, loss = self.step(*self.carry, *self.args)
        self.losses.append(loss)
        return loss


def dense_variant(stacked_loss, tables, mlp, data):
    opt = optax.adam(LR)
    params = {
        "tables": jnp.asarray(np.concatenate([tables[k] for k in NAMES])),
        "mlp": [(jnp.asarray(a), jnp.asarray(b)) for a, b in mlp],
    }

    def step(p, s, *data):
        loss, g = jax.value_and_grad(stacked_loss)(p, *data)
        u, s = opt.update(g, s, p)
        return optax.apply_updates(p, u), s, loss

    return jax.jit(step, donate_argnums=(0, 1)), params, opt.init(params)


def torch_variant(feats, tables, mlp, labels, adagrad=False):
    import torch

    dev = torch_device()
    torch.manual_seed(0)
    bags = torch.nn.ModuleList()
    inputs = []
    for k in NAMES:
        ids, w = feats[k]
        valid = ids >= 0
        flat = torch.tensor(ids[valid], dtype=torch.int64, device=dev)
        offsets = torch.tensor(np.concatenate([[0], np.cumsum(valid.sum(1))[:-1]]), dtype=torch.int64, device=dev)
        psw = torch.tensor(w[valid], device=dev) if k in WEIGHTED else None
        bag = torch.nn.EmbeddingBag(tables[k].shape[0], DIM, mode="sum" if k in WEIGHTED else "mean", sparse=True)
        bag.weight.data = torch.tensor(tables[k], device=dev)
        bags.append(bag.to(dev))
        inputs.append((flat, offsets, psw))
    layers = []
    for i, (a, b) in enumerate(mlp):
        lin = torch.nn.Linear(*a.shape).to(dev)
        lin.weight.data, lin.bias.data = torch.tensor(a.T.copy(), device=dev), torch.tensor(b, device=dev)
        layers += [lin] + ([torch.nn.ReLU()] if i < len(mlp) - 1 else [])
    net = torch.nn.Sequential(*layers)
    y = torch.tensor(labels, device=dev)
    emb_opt = (
        torch.optim.Adagrad(bags.parameters(), lr=LR)
        if adagrad
        else torch.optim.SparseAdam(list(bags.parameters()), lr=LR)
    )
    mlp_opt = torch.optim.Adam(net.parameters(), lr=LR)
    losses = []

    def step():
        emb_opt.zero_grad()
        mlp_opt.zero_grad()
        x = torch.cat([bag(f, o, per_sample_weights=p) for bag, (f, o, p) in zip(bags, inputs)], -1)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(net(x)[:, 0], y)
        loss.backward()
        emb_opt.step()
        mlp_opt.step()
        if dev == "cuda":
            torch.cuda.synchronize()
        losses.append(float(loss.detach()))

    return step, losses


class Train:
    """A donated training step that keeps its outputs: each call is one step."""

    def __init__(self, step, params, state, args):
        self.step, self.params, self.state, self.args, self.losses = step, params, state, args, []

    def __call__(self):
        self.params, self.state, loss = self.step(self.params, self.state, *self.args)
        self.losses.append(loss)
        return loss


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument(
        "--reuse-memory",
        action="store_true",
        help="rerun under a glibc malloc that keeps freed memory (see benchmarks/optim.py)",
    )
    parser.add_argument(
        "--no-sweep", action="store_true", help="leave the optimizer sweep out (also on an accelerator)"
    )
    parser.add_argument(
        "--sweep-only",
        action="store_true",
        help="time only the optimizer sweep (the 8M-row table), not the recommender step",
    )
    parser.add_argument(
        "--sweep",
        action="store_true",
        help="also time lazy Adam's step alone on an 8M-row table at K = 100k, 1M and 4M (always on an accelerator)",
    )
    args = parser.parse_args(argv)
    reuse = reusing_memory(args.reuse_memory, __file__, argv)
    rows = tuple(max(n // 100, 50) for n in ROWS) if args.quick else ROWS
    batch = 128 if args.quick else 1024
    bandwidth = copy_bandwidth()
    if args.sweep_only:
        print(f"backend {jax.default_backend()}, copy bandwidth {bandwidth / 1e9:.1f} GB/s")
        optimizer_sweep(bandwidth, quick=args.quick)
        return
    feats, tables, mlp, labels = make_data(rows, batch)
    backend = jax.default_backend()
    where = f"{os.cpu_count()} cores" if backend == "cpu" else jax.devices()[0].device_kind
    print(
        f"backend {backend} ({where}), torch on {torch_device()}, "
        f"malloc {'reusing freed memory' if reuse else 'glibc default'}, copy bandwidth {bandwidth / 1e9:.1f} GB/s; "
        f"{len(rows)} tables, {sum(rows):,} rows x {DIM}, batch {batch}, bags of 1-{MAX_BAG} ids"
    )
    import torch

    if torch_device() == "cpu":
        torch.set_num_threads(os.cpu_count() or 1)
    variants, stacked_loss, stack, data, one = mj_variants(feats, tables, mlp, labels)
    fns = {name: Train(*v) for name, v in variants.items()}
    # twins: the same two programs again on fresh buffers, timed alongside, so that each run shows
    # how far two instances of one step drift apart on this machine (placement of the 241 MB
    # tables, page state), the yardstick for the stacked / one-table ratio
    twins = mj_variants(feats, tables, mlp, labels, only=("mj_stacked", "mj_one_table"))[0]
    fns.update({f"{name} (twin)": Train(*v) for name, v in twins.items()})
    fns["hand_jax"] = hand_variant(feats, tables, mlp, labels, *one)
    dense_step, dense_params, dense_state = dense_variant(stacked_loss, tables, mlp, data)
    fns["dense_optax"] = Train(dense_step, dense_params, dense_state, data)
    torch_adam, torch_adam_losses = torch_variant(feats, tables, mlp, labels)
    torch_adagrad, torch_adagrad_losses = torch_variant(feats, tables, mlp, labels, adagrad=True)
    fns["torch_sparse_adam"] = torch_adam
    fns["torch_sparse_adagrad"] = torch_adagrad
    for fn in fns.values():  # the first step of each: its loss, from the same parameters and data
        fn()
    first = {k: float(f.losses[0]) for k, f in fns.items() if hasattr(f, "losses")}
    first["torch_sparse_adam"], first["torch_sparse_adagrad"] = torch_adam_losses[0], torch_adagrad_losses[0]
    print("first-step losses (same parameters and data): " + ", ".join(f"{k} {v:.6f}" for k, v in first.items()))
    spread = max(first.values()) - min(first.values())
    assert spread < 1e-4, f"the variants disagree on the first loss (spread {spread:.2e})"
    t = interleaved_medians(fns, rounds=3, block=3, warmup=1, settle=1)
    rows_table = {"train step": {"masked_jax": t["mj_stacked"], **t}}
    print_table(
        "median ms per training step (forward, backward, update; jit, donated)",
        rows_table,
        [
            "mj_stacked_one_call",
            "mj_separate",
            "mj_one_table",
            "mj_stacked_catch_up",
            "hand_jax",
            "dense_optax",
            "torch_sparse_adam",
        ],
    )
    print(
        f"\ntwo instances of one program: stacked {t['mj_stacked'] / t['mj_stacked (twin)']:.2f}x, one table "
        f"{t['mj_one_table'] / t['mj_one_table (twin)']:.2f}x; stacked / one table, each pairing of instances: "
        + ", ".join(
            f"{t[a] / t[b]:.2f}x"
            for a in ("mj_stacked", "mj_stacked (twin)")
            for b in ("mj_one_table", "mj_one_table (twin)")
        )
    )
    print(
        f"stacked / one table of the same rows and ids: {t['mj_stacked'] / t['mj_one_table']:.2f}x; "
        f"separate / stacked: {t['mj_separate'] / t['mj_stacked']:.2f}x; "
        f"one-call update / chunked (stacked): {t['mj_stacked_one_call'] / t['mj_stacked']:.2f}x; "
        f"stacked / hand-written JAX: {t['mj_stacked'] / t['hand_jax']:.2f}x; "
        f"dense optax / stacked: {t['dense_optax'] / t['mj_stacked']:.1f}x; "
        f"torch SparseAdam / stacked: {t['torch_sparse_adam'] / t['mj_stacked']:.2f}x; "
        f"torch sparse Adagrad / stacked masked_adagrad: {t['torch_sparse_adagrad'] / t['mj_stacked_adagrad']:.2f}x; "
        f"catch-up / plain lazy: {t['mj_stacked_catch_up'] / t['mj_stacked']:.2f}x; "
        f"masked_adagrad / lazy(adagrad): {t['mj_stacked_adagrad'] / t['mj_stacked_lazy_adagrad']:.2f}x; "
        f"rowwise_adagrad / masked_adagrad: {t['mj_stacked_rowwise_adagrad'] / t['mj_stacked_adagrad']:.2f}x"
    )
    if "mj_stacked_fused" in t:
        print(f"fused_rows=True / one-call update (stacked): {t['mj_stacked_fused'] / t['mj_stacked_one_call']:.2f}x")

    # the optimizer step alone, on the stacked table's row-sparse gradient
    params = {
        "tables": jnp.asarray(np.concatenate([tables[k] for k in NAMES])),
        "mlp": [(jnp.asarray(a), jnp.asarray(b)) for a, b in mlp],
    }
    grads = jax.jit(mj.grad(stacked_loss, row_sparse={"tables": True, "mlp": False}))(params, *data)
    g = grads["tables"]
    touched = int(np.unique(np.asarray(g.indices)[np.asarray(g.indices) < stack.num_rows]).size)
    opt = optim.lazy(optax.adam(LR))

    def chunked(p, s, g):  # what make_train_step runs on the CPU
        return chunked_update(opt, g, s, p, optim.apply_updates, 8192)

    table = np.asarray(params["tables"])
    updates = [("one call", update_step(opt)), ("chunks of 8192 rows", chunked)] + (
        [("fused kernel", fused_step(opt))] if fused_runs() else []
    )  # on a CUDA GPU with fused_rows=True
    steppers = {name: optax_stepper(opt, jnp.asarray(table), g, fn) for name, fn in updates}
    times = interleaved_medians(steppers, rounds=3, block=5, warmup=2)
    nbytes = 7 * touched * DIM * 4
    for name, tu in times.items():
        print(
            f"optimizer step alone, {name} (lazy Adam, {g.nse:,} stored rows, {touched:,} distinct): "
            f"{tu * 1e3:.2f} ms, {nbytes / tu / 1e9:.2f} GB/s of touched bytes = {nbytes / tu / bandwidth:.0%} of the "
            f"copy bandwidth ({bandwidth / 1e9:.1f} GB/s)"
        )
    save_bar_plot(
        rows_table,
        result_path("recsys_reuse_memory" if reuse else "recsys"),
        f"DLRM-like step, {len(rows)} tables, batch {batch}",
    )
    if (args.sweep or backend != "cpu") and not args.no_sweep:
        optimizer_sweep(bandwidth, quick=args.quick)


def _floor_adam_step(p, m, v, count, uniq, g):
    """The fewest-bytes lazy Adam: distinct sorted ids given, one gather, one update, one scatter
    of each array, with XLA told the ids are sorted and unique (what no coalescing step can
    promise for padding): the bandwidth a row-sparse step can reach on this device."""
    count = count + 1
    kw = dict(indices_are_sorted=True, unique_indices=True)
    step, m_rows, v_rows = adam_rows(m[uniq], v[uniq], g, count)
    return p.at[uniq].add(step, **kw), m.at[uniq].set(m_rows, **kw), v.at[uniq].set(v_rows, **kw), count


def optimizer_sweep(bandwidth, quick=False):
    """Lazy Adam's step alone on a large table at growing K, in GB/s of the bytes it must touch
    (K distinct rows: gradient read; parameter, mu and nu read and written) and as a share of the
    copy bandwidth: ``lazy(adam)`` on ids with duplicates (coalescing included) and on ids
    flagged unique, the hand-written step (coalescing included), the fewest-bytes floor and, on a
    CUDA GPU, the fused update (``fused_rows=True``) on both gradients."""
    n = 200_000 if quick else 8_000_000
    ks = (10_000, 100_000) if quick else (100_000, 1_000_000, 4_000_000)
    rng = np.random.default_rng(3)
    table = (0.05 * rng.normal(size=(n, DIM))).astype(np.float32)
    opt = optim.lazy(optax.adam(LR))
    print(
        f"\nlazy Adam step alone, {n:,} x {DIM} float32 table; ms, and GB/s of touched bytes (share of the "
        f"{bandwidth / 1e9:.0f} GB/s copy bandwidth)"
    )
    fused = fused_runs()
    print(
        "| K ids | distinct | lazy(adam), duplicates | lazy(adam), unique | hand-written | floor "
        "| fused, duplicates | fused, unique |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for k in ks:
        ids = rng.integers(0, n, size=k).astype(np.int32)
        vals = rng.normal(size=(k, DIM)).astype(np.float32)
        uniq = np.unique(ids)
        urows = rng.normal(size=(uniq.size, DIM)).astype(np.float32)
        fresh = lambda: jnp.asarray(table)  # noqa: E731  (each stepper owns its donated table)
        zeros = lambda: jnp.zeros((n, DIM), jnp.float32)  # noqa: E731
        dup = mj.row_sparse(jnp.asarray(vals), jnp.asarray(ids), (n, DIM))
        unique = mj.row_sparse(jnp.asarray(urows), jnp.asarray(uniq), (n, DIM), unique_indices=True)
        fns = {
            "dup": optax_stepper(opt, fresh(), dup),
            "unique": optax_stepper(opt, fresh(), unique),
            "hand": Stepper(
                jax.jit(hand_lazy_adam_step, donate_argnums=(0, 1, 2)),
                fresh(),
                zeros(),
                zeros(),
                jnp.zeros(()),
                args=(jnp.asarray(ids), jnp.asarray(vals)),
            ),
            "floor": Stepper(
                jax.jit(_floor_adam_step, donate_argnums=(0, 1, 2)),
                fresh(),
                zeros(),
                zeros(),
                jnp.zeros(()),
                args=(jnp.asarray(uniq), jnp.asarray(urows)),
            ),
        }
        if fused:
            for name, g in (("fused dup", dup), ("fused unique", unique)):
                fns[name] = optax_stepper(opt, fresh(), g, fused_step(opt))
        t = interleaved_medians(fns, rounds=3, block=5, warmup=2)
        nbytes = 7 * uniq.size * DIM * 4
        cells = " | ".join(
            "n/a (CUDA only)" if c not in t else _rate(t[c], nbytes, bandwidth)
            for c in ("dup", "unique", "hand", "floor", "fused dup", "fused unique")
        )
        print(f"| {k:,} | {uniq.size:,} | {cells} |", flush=True)
        del fns
    if fused:
        fused_skewed(opt, fresh, n, k, rng, bandwidth)
        fused_cuts(opt, fresh, dup, nbytes, bandwidth, k)


def _rate(seconds, nbytes, bandwidth):
    """``ms, GB/s (share of the copy bandwidth)`` of a step that must touch ``nbytes``."""
    return f"{seconds * 1e3:.3f} ms, {nbytes / seconds / 1e9:.0f} GB/s ({nbytes / seconds / bandwidth:.0%})"


# kernel cuts the fused update is timed with besides its default: (block entries, rows per program, warps)
CUTS = [
    KernelConfig(1024, 64, 4),
    KernelConfig(4096, 128, 4),
    KernelConfig(2048, 64, 8),
    KernelConfig(4096, 128, 8),
    KernelConfig(1024, 32, 2),
]


def fused_cuts(opt, fresh, grad, nbytes, bandwidth, k):
    """The fused update on ``grad`` (ids with duplicates) cut in other ways (``CUTS``) against its
    default and the one-call update, in one interleaved run."""
    fns = {"one call": optax_stepper(opt, fresh(), grad)}
    for cut in [KernelConfig()] + CUTS:
        fns[f"fused {tuple(cut)}"] = optax_stepper(opt, fresh(), grad, fused_step(opt, cut))
    t = interleaved_medians(fns, rounds=3, block=5, warmup=2)
    print(
        f"\nthe fused update at K = {k:,} with duplicates, cut in other ways (block entries, rows, warps; "
        f"the first is the default):"
    )
    for name, tu in t.items():
        print(f"  {name}: {_rate(tu, nbytes, bandwidth)}", flush=True)


def skewed_ids(rng, n, k, a=1.05):
    """``k`` ids of ``n`` rows drawn from a Zipf law of exponent ``a``, as recommender data are (the
    hottest row about 5 % of the ids at 1.05), the hot rows scattered over the table."""
    return rng.permutation(n)[(rng.zipf(a, size=k) - 1) % n].astype(np.int32)


def fused_skewed(opt, fresh, n, k, rng, bandwidth):
    """The one-call and fused updates on ``k`` Zipf-distributed ids: a hot row's run of duplicates
    spans thousands of kernel programs, which the carry kernel sums in parallel."""
    ids = skewed_ids(rng, n, k)
    grad = mj.row_sparse(jnp.asarray(rng.normal(size=(k, DIM)), jnp.float32), jnp.asarray(ids), (n, DIM))
    distinct, counts = np.unique(ids, return_counts=True)
    t = interleaved_medians(
        {"one call": optax_stepper(opt, fresh(), grad), "fused": optax_stepper(opt, fresh(), grad, fused_step(opt))},
        rounds=3,
        block=5,
        warmup=2,
    )
    nbytes = 7 * distinct.size * DIM * 4
    print(f"\nZipf ids (exponent 1.05), K = {k:,}: {distinct.size:,} distinct, the hottest {counts.max():,} times")
    for name, tu in t.items():
        print(f"  {name}: {_rate(tu, nbytes, bandwidth)}", flush=True)
    print(f"  fused / one call: {t['fused'] / t['one call']:.2f}x")


if __name__ == "__main__":
    main()
