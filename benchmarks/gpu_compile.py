"""The maskify_models train steps compiled for a GPU on a machine without one: XLA temporary memory.

XLA can compile for a CUDA GPU it does not have ("deviceless" ahead-of-time compilation, from a
target description of the GPU). A compiled program's temporary memory
(``compiled.memory_analysis().temp_size_in_bytes``) is fixed by the compile, not by a run, so the
temporary-memory target of ``maskify_models.py`` (maskify / hand-masked <= 1.10x) can be checked
for a GPU here; times cannot. For the two models of ``maskify_models.py`` (the same batch, the same
hand-masked and maskify'd train steps), this prints per GPU target the temporary memory, the
number of kernels (fusions and library calls) in the optimised program, the bytes those kernels
read and write (their operands and outputs: an estimate of the memory traffic, caches ignored),
the program's length, and the maskify / hand-masked ratios; it saves a bar chart of the memory
ratios to ``results/gpu_compile.png``.

Then, per target, the lazy row-sparse update of an 8M x 32 float32 table (Adam; K ids drawn with
replacement) as ``make_train_step`` runs it on a GPU, the one-call update against the fused
kernel of ``fused_rows=True``: temporary memory and kernels. And the fused kernel compiled (Pallas
to Triton, for the target) with each entrywise optax optimizer, on a small table: the lowering a
CPU cannot check.

It needs JAX's CUDA plugin, several GB that the project does not install. In a separate venv:

    python -m venv .venv-cuda
    .venv-cuda/bin/pip install "jax[cuda13]==$(.venv/bin/python -c 'import jax; print(jax.__version__)')" \\
        flax equinox optax matplotlib
    PYTHONPATH=$PWD .venv-cuda/bin/python benchmarks/gpu_compile.py [--target h100|h200|all]

The targets describe the GPUs by their public specifications (streaming multiprocessors, memory,
bandwidth); the numbers this prints for the hand-masked steps on an H200 equalled those measured
on one (95.4 and 43.1 MiB).
"""

from __future__ import annotations

import argparse
import os
import re
import sys

os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")  # no driver to check against

import jax
import numpy as np
import optax
from jax.experimental import topologies
from jax.sharding import NamedSharding, PartitionSpec

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import maskify_models as mm
from _timing import RESULTS
from optim import fused_step, update_step

import masked_jax as mj
from masked_jax import optim
from masked_jax.optim._fused import fusable
from masked_jax.optim._state import lazy_inner

_DEVICE = """
gpu_device_info {{
  threads_per_block_limit: 1024 threads_per_warp: 32 shared_memory_per_block: 49152
  shared_memory_per_core: 233472 threads_per_core_limit: 2048 core_count: 132 fpus_per_core: 128
  block_dim_limit_x: 2147483647 block_dim_limit_y: 65535 block_dim_limit_z: 65535
  memory_bandwidth: {bandwidth} l2_cache_size: 52428800 clock_rate_ghz: 1.98
  device_memory_size: {memory} shared_memory_per_block_optin: 232448
  cuda_compute_capability {{ major: 9 }} registers_per_core_limit: 65536 registers_per_block_limit: 65536
}}
platform_name: "CUDA"
dnn_version_info {{ major: 9 minor: 8 }}
runtime_version {{ major: 13 minor: 0 }}
device_description_str: "{name}"
"""
TARGETS = {
    "h100": _DEVICE.format(name="NVIDIA H100 80GB HBM3", bandwidth=3352320000000, memory=84929347584),
    "h200": _DEVICE.format(name="NVIDIA H200", bandwidth=4800000000000, memory=150754820096),
}


def sharding_for(target):
    """A one-device sharding on the described GPU: arrays abstracted to it compile for it."""
    topology = topologies.get_topology_desc(platform="cuda", target_config=TARGETS[target], topology="1x1x1")
    return NamedSharding(topologies.make_mesh(topology, (1,), ("x",)), PartitionSpec())


_BYTES = {
    "pred": 1,
    "s8": 1,
    "u8": 1,
    "bf16": 2,
    "f16": 2,
    "s16": 2,
    "u16": 2,
    "f32": 4,
    "s32": 4,
    "u32": 4,
    "f64": 8,
    "s64": 8,
    "u64": 8,
}


def _nbytes(shape_text):
    """Bytes of the arrays an HLO shape (or tuple of shapes) names."""
    total = 0
    for dtype, dims in re.findall(r"\b(" + "|".join(_BYTES) + r")\[([0-9,]*)\]", shape_text):
        total += _BYTES[dtype] * int(np.prod([int(d) for d in dims.split(",") if d]))
    return total


def kernel_traffic(hlo_text):
    """``(kernels, bytes)``: the entry computation's kernels (fusions and library calls) and the
    bytes of their operands and outputs, an estimate of the memory traffic that ignores caches."""
    shapes, kernels, traffic = {}, 0, 0
    for line in hlo_text[hlo_text.index("\nENTRY ") :].splitlines():
        m = re.match(r"\s*(?:ROOT )?%(\S+) = (.*?) ([\w-]+)\((.*)", line)
        if not m:
            continue
        name, shape, op, rest = m.groups()
        shapes[name] = shape
        if op in ("fusion", "custom-call"):
            operands = re.findall(r"%([\w.\-]+)", rest.split("kind=")[0].split("custom_call_target=")[0])
            kernels += 1
            traffic += _nbytes(shape) + sum(_nbytes(shapes.get(o, "")) for o in operands)
    return kernels, traffic


def compiled_stats(step, args, sharding):
    """``(temporary MiB, kernels, kernel traffic MiB, HLO lines)`` of the donated ``step`` compiled
    for ``sharding``."""
    abstract = jax.tree_util.tree_map(
        lambda a: (
            jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding)
            if isinstance(a, (jax.Array, jax.ShapeDtypeStruct))
            else a
        ),
        args,
    )
    compiled = jax.jit(step, donate_argnums=(0, 1)).lower(*abstract).compile()
    text = compiled.as_text()
    kernels, traffic = kernel_traffic(text)
    return compiled.memory_analysis().temp_size_in_bytes / 2**20, kernels, traffic / 2**20, len(text.splitlines())


FUSED_OPTIMIZERS = {
    "sgd": lambda: optax.sgd(0.1),
    "momentum": lambda: optax.sgd(0.1, momentum=0.9),
    "nesterov": lambda: optax.sgd(0.1, momentum=0.9, nesterov=True),
    "adam": lambda: optax.adam(1e-2),
    "adamw": lambda: optax.adamw(1e-2, weight_decay=0.1),
    "adam (bf16 mu)": lambda: optax.adam(1e-2, mu_dtype="bfloat16"),
    "adagrad": lambda: optax.adagrad(0.1),
    "rmsprop": lambda: optax.rmsprop(1e-2),
    "lion": lambda: optax.lion(1e-3),
    "yogi": lambda: optax.yogi(1e-2),
    "schedule adam": lambda: optax.adam(optax.exponential_decay(1e-2, 10, 0.5)),
    "inject adam": lambda: optax.inject_hyperparams(optax.adam)(learning_rate=1e-2),
    "decay + momentum": lambda: optax.chain(optax.add_decayed_weights(0.1), optax.sgd(0.1, momentum=0.5)),
    "nadam": lambda: optax.nadam(1e-2),
    "amsgrad": lambda: optax.amsgrad(1e-2),
    "adamax": lambda: optax.adamax(1e-2),
    "adabelief": lambda: optax.adabelief(1e-2),
    "adadelta": lambda: optax.adadelta(1.0),
    "masked_adagrad": lambda: optim.masked_adagrad(0.1),
}


# tables: shape, dtype, gradient rows flagged unique
FUSED_TABLES = [
    ((100_000, 4, 6), "float32", False),
    ((100_000, 256), "bfloat16", False),
    ((100_000, 3), "float16", False),
    ((100_000,), "float32", False),
    ((100_000, 1000), "float32", True),
]


def row_sparse_update(opt, shape, k, fused, dtype="float32", unique=False):
    """``(step, abstract arguments)``: the lazy update of a ``shape`` table by ``k`` gradient rows
    (flagged ``unique`` or not), as ``make_train_step`` runs it on a GPU: the one-call update, or
    (``fused``) the kernel of ``fused_rows=True``."""
    inner = fused_step(opt) if fused else update_step(opt)

    def step(p, s, data, idx):
        return inner(p, s, mj.row_sparse(data, idx, shape, unique_indices=unique))

    p = jax.ShapeDtypeStruct(shape, dtype)
    return step, (
        p,
        jax.eval_shape(opt.init, p),
        jax.ShapeDtypeStruct((k, *shape[1:]), dtype),
        jax.ShapeDtypeStruct((k,), np.int32),
    )


def _compiling(cases, sharding):
    """``(compiled, failed)``: the names of the ``{name: make}`` cases whose ``make()`` (a fused step
    and its arguments) compiles for ``sharding``, and of those that fail, with their errors."""
    compiled, failed = [], []
    for name, make in cases.items():
        try:
            compiled_stats(*make(), sharding)
            compiled.append(name)
        except Exception as e:  # noqa: BLE001 - report every case's outcome
            failed.append(f"{name} ({type(e).__name__}: {str(e).splitlines()[0][:200]})")
    return compiled, failed


def _fused_optimizer(make):
    """A fused step of the optimizer ``make()`` (lifted by ``lazy`` unless it is a lazy lift
    already, as ``masked_adagrad``) on a small table, checked to be one ``make_train_step`` would
    fuse."""
    opt = make()
    opt = opt if lazy_inner(opt) is not None else optim.lazy(opt)
    table = np.zeros((4096, 24), np.float32)
    if not fusable(opt, mj.row_sparse(table[:1000], np.arange(1000), table.shape), opt.init(table), table):
        raise ValueError("make_train_step would not fuse it")
    return row_sparse_update(opt, table.shape, 1000, True)


def fused_rows_stats(target, sharding):
    """Print the one-call and fused row-sparse updates' temporary memory and kernels at 8M x 32,
    and which optimizers' and tables' fused kernels compile for ``target``."""
    for k in (1_000_000, 4_000_000):
        stats = {}
        for version, fused in (("one call", False), ("fused_rows", True)):
            stats[version] = compiled_stats(
                *row_sparse_update(optim.lazy(optax.adam(1e-2)), (8_000_000, 32), k, fused), sharding
            )
            temp, kernels, _, lines = stats[version]
            print(
                f"{target:6s} {'lazy adam, K=' + format(k, ','):20s} {version:12s} {temp:9.2f} {kernels:8d} "
                f"{'':>12s} {lines:10d}",
                flush=True,
            )
        print(
            f"{target:6s} {'':20s} {'ratio':12s} {stats['fused_rows'][0] / stats['one call'][0]:8.3f}x "
            f"{stats['fused_rows'][1] / stats['one call'][1]:7.2f}x (fused / one call)"
        )
    compiled, failed = _compiling(
        {name: lambda make=make: _fused_optimizer(make) for name, make in FUSED_OPTIMIZERS.items()}, sharding
    )
    print(
        f"{target}: the fused kernel compiles with {', '.join(compiled) or 'none'}"
        + (f"; fails with {'; '.join(failed)}" if failed else "")
    )
    compiled, failed = _compiling(
        {
            f"{dtype} {shape}{' unique' if unique else ''}": lambda shape=shape, dtype=dtype, unique=unique: (
                row_sparse_update(optim.lazy(optax.adam(1e-2)), shape, 5000, True, dtype, unique)
            )
            for shape, dtype, unique in FUSED_TABLES
        },
        sharding,
    )
    print(
        f"{target}: adam's fused kernel compiles for tables {', '.join(compiled) or 'none'}"
        + (f"; fails for {'; '.join(failed)}" if failed else "")
    )


def plot(ratios):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3))
    labels = list(ratios)
    ax.barh(labels, [ratios[k] for k in labels], color="tab:blue")
    ax.axvline(1.0, color="k", lw=0.8)
    ax.axvline(1.10, color="tab:red", ls="--", lw=0.8, label="target 1.10x")
    ax.set_xlabel("temporary memory, maskify / hand-masked")
    ax.legend(loc="lower right")
    fig.tight_layout()
    os.makedirs(RESULTS, exist_ok=True)
    path = os.path.join(RESULTS, "gpu_compile.png")
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", choices=[*TARGETS, "all"], default="all")
    args = parser.parse_args()
    targets = list(TARGETS) if args.target == "all" else [args.target]
    built = mm.tables(models=mm.MODELS[:2])  # the two encoders, at the benchmark's full size
    print(f"jax {jax.__version__}; compiled for {', '.join(targets)} without a GPU")
    print(
        f"{'target':6s} {'model':20s} {'version':12s} {'temp MiB':>9s} {'kernels':>8s} {'traffic MiB':>12s} "
        f"{'HLO lines':>10s}"
    )
    ratios = {}
    for target in targets:
        sharding = sharding_for(target)
        for model, versions in built.items():
            stats = {}
            for version, (step, step_args, _, _) in versions.items():
                jax.clear_caches()
                stats[version] = compiled_stats(step, step_args, sharding)
                temp, kernels, traffic, lines = stats[version]
                print(
                    f"{target:6s} {model:20s} {version:12s} {temp:9.2f} {kernels:8d} {traffic:12.1f} {lines:10d}",
                    flush=True,
                )
            (temp, kernels, traffic, _), (temp0, kernels0, traffic0, _) = stats["maskify"], stats["hand-masked"]
            ratios[f"{target} {model}"] = temp / temp0
            print(
                f"{target:6s} {model:20s} {'ratio':12s} {temp / temp0:8.3f}x {kernels / kernels0:7.2f}x "
                f"{traffic / traffic0:11.2f}x (temporary memory target <= 1.10x)"
            )
        fused_rows_stats(target, sharding)
    plot(ratios)


if __name__ == "__main__":
    main()
