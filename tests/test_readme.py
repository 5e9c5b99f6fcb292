"""The README stays true: its Python blocks run, and the results its comments promise hold."""

import pathlib
import re

import jax
import numpy as np

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def _blocks():
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_python_blocks_run_and_promises_hold():
    jax.config.update("jax_enable_x64", False)
    try:
        ns = {}
        blocks = _blocks()
        assert len(blocks) >= 2
        for block in blocks:
            exec(compile(block, str(README), "exec"), ns)
        mnp, mj, jnp = ns["mnp"], ns["mj"], ns["jnp"]
        mean = mnp.mean(ns["x"], axis=1)
        assert repr(mean) == "MaskedArray([2.0 --], dtype=float32)"
        trap = jax.grad(lambda v: jnp.where(ns["m"], jnp.log(v), 0.0).sum())(ns["v"])
        ours = jax.grad(lambda v: mnp.sum(mnp.log(mj.masked_array(v, ns["m"]))).data)(ns["v"])
        assert np.isnan(trap[1])
        np.testing.assert_array_equal(ours, [0.5, 0.0])
        np.testing.assert_allclose(np.asarray(ns["normed"].data[0, :2]), [-1.0, 1.0], atol=1e-4)
        np.testing.assert_array_equal(np.asarray(ns["probs"].mask), [[True, True, False]])
        assert ns["softmax_report"].satisfies == ("masked",) and ns["leak_report"].satisfies == ("dense",)
        table = ns["sharded_params"]["table"]
        assert table.sharding.spec == jax.sharding.PartitionSpec("rows") and np.isfinite(float(ns["sharded_loss"]))
        assert float(table[3, 0]) != np.float32(0.01) and float(table[5, 0]) == np.float32(0.01)  # touched rows only
    finally:
        jax.config.update("jax_enable_x64", True)


MASKIFY_DOC = README.parent / "docs" / "maskify.md"


def test_maskify_page_runs_and_lists_every_unsupported_primitive():
    """docs/maskify.md: its example runs, and its table names every primitive and jax function
    that maskify refuses by design (the lists the error messages come from)."""
    from masked_jax.ops import primitives

    text = MASKIFY_DOC.read_text()
    ns = {}
    for block in re.findall(r"```python\n(.*?)```", text, flags=re.S):
        exec(compile(block, str(MASKIFY_DOC), "exec"), ns)
    table = text[text.index("## Not supported"):text.index("## What is tested")]
    for prim in primitives.UNSUPPORTED:
        assert f"`{prim.name}`" in table, prim.name
    for name in primitives.UNSUPPORTED_CALLS:
        assert f"`jnp.{name}`" in table, name
