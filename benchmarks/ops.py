"""Masked softmax / sum / mean on a (4096, 1024) float32 array with a ~50% random mask, and a
vmapped masked matmul (attention weights times values: (B, L, L) @ (B, L, 32) per example, masks
varying along the contracted keys, B = 32, L = 128) against the zero-filled ``jnp.matmul``.

Compared with hand-written ``jnp.where`` code under jit, ``numpy.ma``, and torch's
``torch.masked`` (MaskedTensor and the functional ``torch.masked.*``). Prints medians
and ratios (baseline time / masked_jax time: > 1 means masked_jax is faster) and saves
a bar plot to ``benchmarks/results/ops.png``.

Run: ``.venv/bin/python benchmarks/ops.py`` (``--quick`` for a smaller smoke run).
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from _timing import RESULTS, interleaved_medians, print_table, progress, save_bar_plot

import masked_jax as mj
import masked_jax.nn as mnn
import masked_jax.numpy as mnp


# -- hand-written jnp.where baselines (what a careful user writes today) ---------------------------
@jax.jit
def where_softmax(x, m):
    top = jnp.max(jnp.where(m, x, -jnp.inf), axis=-1, keepdims=True)
    e = jnp.where(m, jnp.exp(jnp.where(m, x, 0.0) - top), 0.0)
    return e / jnp.sum(e, axis=-1, keepdims=True)


@jax.jit
def where_sum(x, m):
    return jnp.sum(jnp.where(m, x, 0.0), axis=-1)


@jax.jit
def where_mean(x, m):
    return jnp.sum(jnp.where(m, x, 0.0), axis=-1) / jnp.sum(m, axis=-1)


# Gradient of masked-softmax-then-sum: the double-where version.
def _where_loss(x, m, w):
    return jnp.sum(jnp.where(m, where_softmax(x, m), 0.0) * w)


where_grad = jax.jit(jax.grad(_where_loss))

mj_softmax = jax.jit(lambda x: mnn.softmax(x, axis=-1))
mj_sum = jax.jit(lambda x: mnp.sum(x, axis=-1))
mj_mean = jax.jit(lambda x: mnp.mean(x, axis=-1))
mj_grad = jax.jit(jax.grad(lambda d, m, w: mnp.sum(mnn.softmax(mj.masked_array(d, m), axis=-1) * w).data))
# per-example attention weights @ values under vmap (the masks vary along the contracted keys)
mj_vmatmul = jax.jit(jax.vmap(mnp.matmul))
where_vmatmul = jax.jit(jax.vmap(lambda p, pm, v, vm: jnp.matmul(jnp.where(pm, p, 0.0), jnp.where(vm, v, 0.0))))


def numpy_ma_impls(a):
    def softmax():
        e = np.ma.exp(a - a.max(axis=-1, keepdims=True))
        return e / e.sum(axis=-1, keepdims=True)

    return {"softmax": softmax, "sum": lambda: a.sum(axis=-1), "mean": lambda: a.mean(axis=-1)}


def torch_impls(x, m, w):
    try:
        import torch
        from torch.masked import masked_tensor
    except ImportError:
        print("torch not installed: torch.masked columns are n/a (pip install '.[compare]').")
        return {}, {}, None
    td, tm, tw = torch.from_numpy(x), torch.from_numpy(m), torch.from_numpy(w)
    mt = masked_tensor(td, tm)
    mtensor = {"softmax": lambda: torch.softmax(mt, -1), "sum": lambda: mt.sum(-1), "mean": lambda: mt.mean(-1)}
    functional = {
        "softmax": lambda: torch.masked.softmax(td, -1, mask=tm),
        "sum": lambda: torch.masked.sum(td, -1, mask=tm),
        "mean": lambda: torch.masked.mean(td, -1, mask=tm),
    }

    def autograd():
        leaf = masked_tensor(td.clone(), tm, requires_grad=True)
        out = torch.softmax(leaf, -1) * masked_tensor(tw, tm)
        out.sum().backward()
        return leaf.grad

    return mtensor, functional, autograd


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="small shape and few repeats")
    args = parser.parse_args(argv)
    shape, repeats = ((256, 128), 1) if args.quick else ((4096, 1024), 5)
    rng = np.random.default_rng(0)
    x = rng.normal(size=shape).astype(np.float32)
    m = rng.random(shape) > 0.5
    w = rng.normal(size=shape).astype(np.float32)
    xj, mj_mask, wj = jnp.asarray(x), jnp.asarray(m), jnp.asarray(w)
    xm = mj.masked_array(xj, mj_mask)
    a = np.ma.masked_array(x, mask=~m)
    t_mt, t_fn, t_grad = torch_impls(x, m, w)
    np_ma = numpy_ma_impls(a)

    ours = {"softmax": lambda: mj_softmax(xm), "sum": lambda: mj_sum(xm), "mean": lambda: mj_mean(xm)}
    where = {
        "softmax": lambda: where_softmax(xj, mj_mask),
        "sum": lambda: where_sum(xj, mj_mask),
        "mean": lambda: where_mean(xj, mj_mask),
    }
    rows = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.masked prototype warnings
        for op in progress(("softmax", "sum", "mean"), "ops"):
            impls = {"masked_jax": ours[op], "jnp.where": where[op], "numpy.ma": np_ma[op]}
            if t_mt:
                impls.update({"MaskedTensor": t_mt[op], "torch.masked.*": t_fn[op]})
            rows[op] = interleaved_medians(impls, rounds=repeats)
        impls = {"masked_jax": lambda: mj_grad(xj, mj_mask, wj), "jnp.where": lambda: where_grad(xj, mj_mask, wj)}
        if t_grad:
            impls["MaskedTensor"] = t_grad
        rows["grad softmax-sum"] = interleaved_medians(impls, rounds=repeats)
        batch, length = (4, 32) if args.quick else (32, 128)
        keys = rng.random((batch, 1, length)) > 0.3
        p = mj.masked_array(jnp.asarray(rng.random((batch, length, length)), jnp.float32), jnp.asarray(keys))
        v = mj.masked_array(
            jnp.asarray(rng.normal(size=(batch, length, 32)), jnp.float32), jnp.asarray(np.swapaxes(keys, 1, 2))
        )
        np.testing.assert_allclose(
            np.asarray(mj_vmatmul(p, v).filled(0)),
            np.asarray(where_vmatmul(p.data, p.mask, v.data, v.mask)),
            rtol=1e-5,
            atol=1e-5,
        )
        rows["vmapped matmul"] = interleaved_medians(
            {
                "masked_jax": lambda: mj_vmatmul(p, v),
                "jnp.where": lambda: where_vmatmul(p.data, p.mask, v.data, v.mask),
            },
            rounds=repeats,
        )
    for res in rows.values():
        for name in ("masked_jax", "jnp.where", "numpy.ma", "MaskedTensor", "torch.masked.*"):
            res.setdefault(name, None)
        order = ["masked_jax", "jnp.where", "numpy.ma", "MaskedTensor", "torch.masked.*"]
        res.update({k: res.pop(k) for k in order})
    # Results agree before we compare speed.
    np.testing.assert_allclose(
        np.asarray(mj_softmax(xm).filled()), np.asarray(where_softmax(xj, mj_mask)) * m, rtol=1e-5, atol=1e-7
    )
    np.testing.assert_allclose(
        np.asarray(mj_grad(xj, mj_mask, wj)), np.asarray(where_grad(xj, mj_mask, wj)), rtol=1e-4, atol=1e-6
    )

    print(f"shape {shape}, ~50% valid, float32, backend {jax.default_backend()}, devices {jax.devices()}")
    print_table(
        "Median time (ms); ratio = baseline / masked_jax (> 1: masked_jax faster)",
        rows,
        ["jnp.where", "numpy.ma", "MaskedTensor", "torch.masked.*"],
    )
    save_bar_plot(rows, os.path.join(RESULTS, "ops.png"), f"masked ops on {shape} float32")
    return rows


if __name__ == "__main__":
    main()
