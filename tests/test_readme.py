"""The README and the docs pages stay true: their Python blocks run, and what their comments
promise holds."""

import os
import pathlib
import re

import jax
import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
# adding_ops.md registers example ops into the process-wide registry: tests/test_registry.py runs
# the same steps and unregisters them
RUNNABLE = [p for p in DOCS if p.name != "adding_ops.md"]
PRELUDE = (
    "import jax, jax.numpy as jnp, numpy as np, optax\nimport masked_jax as mj\n"
    "import masked_jax.numpy as mnp\nimport masked_jax.nn as mnn\nfrom masked_jax import optim\n"
)


def _run(path, prelude=""):
    """Run the Python blocks of ``path`` in order, in one namespace (float32, as users run them)."""
    blocks = re.findall(r"```python\n(.*?)```", path.read_text(), flags=re.S)
    ns = {}
    jax.config.update("jax_enable_x64", False)
    try:
        exec(compile(prelude, "prelude", "exec"), ns)
        for block in blocks:
            exec(compile(block, str(path), "exec"), ns)
    finally:
        jax.config.update("jax_enable_x64", True)
    return ns, len(blocks)


def test_readme_blocks_run_and_promises_hold():
    ns, count = _run(README)
    assert count >= 5
    mnp = ns["mnp"]
    assert repr(mnp.mean(ns["x"], axis=1)) == "MaskedArray([2.0 --], dtype=float32)"
    moved = np.asarray(ns["params"] != np.array([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]))
    np.testing.assert_array_equal(moved, [[True, False, True], [False, False, True]])
    assert np.isfinite(float(ns["value"])) and ns["table"].shape == (100_000, 32)
    assert ns["softmax_report"].satisfies == ("masked",)
    np.testing.assert_allclose(np.asarray(ns["normed"].data[0, :2]), [-1.0, 1.0], atol=1e-4)
    np.testing.assert_array_equal(np.asarray(ns["probs"].mask), [[True, True, False]])
    assert len(README.read_text().splitlines()) <= 200


@pytest.mark.parametrize("page", RUNNABLE, ids=[p.name for p in RUNNABLE])
def test_docs_page_blocks_run(page):
    ns, _ = _run(page, PRELUDE)
    if page.name == "gradients.md":
        mj, mnp, jnp = ns["mj"], ns["mnp"], ns["jnp"]
        trap = jax.grad(lambda v: jnp.where(ns["m"], jnp.log(v), 0.0).sum())(ns["v"])
        ours = jax.grad(lambda v: mnp.sum(mnp.log(mj.masked_array(v, ns["m"]))).data)(ns["v"])
        assert np.isnan(trap[1])
        np.testing.assert_array_equal(ours, [0.5, 0.0])
    if page.name == "jacobians.md":
        assert ns["softmax_report"].satisfies == ("masked",) and ns["leak_report"].satisfies == ("dense",)
        assert not ns["report"] and ns["report"].first_failure.first[0] == "out"  # the mean-pool bug, caught
    if page.name == "sharding.md":
        table = ns["sharded_params"]["table"]
        assert table.sharding.spec == jax.sharding.PartitionSpec("rows") and np.isfinite(float(ns["sharded_loss"]))
        assert float(table[3, 0]) != np.float32(0.01) and float(table[5, 0]) == np.float32(0.01)  # touched rows only


def test_user_text_refers_to_nothing_outside_the_repository():
    """The README, the docs and the benchmarks' notes speak to users: no internal document names."""
    for path in [README, ROOT / "benchmarks" / "README.md", *DOCS]:
        text = path.read_text()
        for word in ("../shared", "DESIGN.md", "seed 0", "the seed notebook", "the issue"):
            assert word not in text, f"{path.name} mentions {word!r}"


MASKIFY_DOC = ROOT / "docs" / "maskify.md"


def test_maskify_page_lists_every_unsupported_primitive():
    """docs/maskify.md's table names every primitive and jax function that maskify refuses by
    design (the lists the error messages come from)."""
    from masked_jax._maskify import _rules as primitives

    text = MASKIFY_DOC.read_text()
    table = text[text.index("## Not supported") : text.index("## What is tested")]
    for prim in primitives.UNSUPPORTED:
        assert f"`{prim.name}`" in table, prim.name
    for name in primitives.UNSUPPORTED_CALLS:
        assert f"`jnp.{name}`" in table, name


def test_the_suite_keeps_compiled_programs_where_the_readme_says():
    """`make test` caches XLA's programs on disk between runs (README, Install): in
    ~/.cache/masked_jax/xla-tests, or MJ_TEST_COMPILE_CACHE; a new program adds an entry."""
    where = os.environ.get("MJ_TEST_COMPILE_CACHE", str(pathlib.Path.home() / ".cache/masked_jax/xla-tests"))
    assert "~/.cache/masked_jax/xla-tests" in README.read_text()
    if where in ("", "0"):
        assert jax.config.jax_compilation_cache_dir is None
        return
    assert jax.config.jax_compilation_cache_dir == where
    before = set(os.listdir(where)) if os.path.isdir(where) else set()
    c = float(np.random.default_rng().uniform(1, 2))  # a new constant: a program no run has compiled
    np.testing.assert_allclose(jax.jit(lambda x: x * c + 1)(np.ones(3)), c + 1)
    assert set(os.listdir(where)) - before
