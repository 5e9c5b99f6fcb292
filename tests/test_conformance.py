"""Every registered op through every check of the harness (``tests/harness.py``).

The cases are generated from the registry: adding an op adds its cases. An op leaves a check
only through ``OpSpec.excluded`` (with its reason); ``test_exclusions_have_reasons`` lists them,
and the terminal summary prints the case count.
"""

from __future__ import annotations

import harness
import jax.numpy as jnp
import numpy as np
import oracle
import pytest
from conformance_table import ROWS

import masked_jax
from masked_jax.ops import REGISTRY
from masked_jax.ops._registry import CHECKS

CASES = [
    (name, check)
    for name in REGISTRY
    for check in CHECKS
    if check not in REGISTRY[name].excluded and harness.in_sample(name, check)
]
# the test loop runs the quick sample; the rest of the sample is in the slow tier (`make test-slow`)
PARAMS = [
    pytest.param(
        name, check, id=f"{name}-{check}", marks=() if harness.in_quick_sample(name, check) else pytest.mark.slow
    )
    for name, check in CASES
]


def test_every_registered_op_has_a_table_row_and_every_check_a_function():
    assert set(harness.CHECKS) == set(CHECKS)
    missing = sorted(set(REGISTRY) - set(ROWS))
    assert not missing, f"ops without a row in tests/conformance_table.py: {missing}"
    assert not set(ROWS) - set(REGISTRY), "rows for ops that are not registered"


def test_exclusions_have_reasons():
    for spec in REGISTRY.values():
        for check, why in spec.excluded.items():
            assert check in CHECKS and isinstance(why, str) and len(why) > 10, (spec.name, check)


@pytest.mark.parametrize("name,check", PARAMS)
def test_conformance(name, check, record_property):
    n = harness.CHECKS[check](name)
    if check == "oracle":
        record_property("oracle_cases", n)


# -- public functions beyond the registry, against jnp ---------------------------------------------
FUNCTION_CASES = [(name, dtype) for name in oracle.FUNCTIONS for dtype in oracle.function_dtypes(name)]


@pytest.mark.parametrize("name", sorted(oracle.FUNCTIONS))
def test_public_function_equals_jnp(name):
    """Each function on fully valid operands, over every dtype jnp accepts, special values as valid
    entries: jnp's dtype and bits (eagerly; under jit too for the sample dtypes)."""
    ran = 0
    for dtype in oracle.function_dtypes(name):
        for values in ("special", "ordinary") if oracle.FULL or str(dtype) == "float32" else ("special",):
            ran += bool(oracle.check_function(name, dtype, values))
        if (oracle.FULL or str(dtype) in oracle.SAMPLE_JIT_DTYPES) and name not in oracle.EAGER_ONLY:
            oracle.check_function(name, dtype, "special", jit=True)
    assert ran, f"{name}: jnp accepted no dtype"


@pytest.mark.parametrize("name", sorted(oracle.CREATION))
def test_creation_and_dtype_functions_equal_jnp(name):
    import masked_jax.numpy as mnp

    got, want = oracle.CREATION[name](mnp), oracle.CREATION[name](jnp)
    if isinstance(got, masked_jax.MaskedArray):
        assert bool(got.mask.all()), f"{name}: a created array is fully valid"
        assert got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_array_equal(np.asarray(got.data), np.asarray(want))
    else:
        assert got == want


def test_every_public_function_is_checked_against_jnp():
    """Every public callable of masked_jax.numpy / masked_jax.nn is a registry op (the harness's
    oracle check), in a table of tests/oracle.py, or listed with the reason it has no jnp oracle."""
    import inspect

    import masked_jax.nn as mnn
    import masked_jax.numpy as mnp

    covered = set(REGISTRY) | set(oracle.FUNCTIONS) | set(oracle.CREATION) | set(oracle.NOT_ORACLE)
    missing = []
    for mod in (mnp, mnn):
        for n in mod.__all__:
            obj = getattr(mod, n)
            if not callable(obj) or inspect.isclass(obj) or getattr(obj, "spec", None) is not None:
                continue
            if n not in covered:
                missing.append(f"{mod.__name__}.{n}")
    assert not missing, f"public functions with no jnp-oracle check: {missing}"


def test_the_docs_list_every_difference_from_jnp():
    """docs/semantics.md's table of differences names exactly the ops of the oracle's one list."""
    import pathlib
    import re

    text = (pathlib.Path(__file__).resolve().parent.parent / "docs" / "semantics.md").read_text()
    table = text.split("### Where the result is not jnp's, bit for bit", 1)[1].split("## ", 1)[0]
    named = set()
    for line in table.splitlines():
        if line.startswith("| `"):
            named |= set(re.findall(r"[a-z_0-9]+", line.split("|")[1].replace("`", " ")))
    listed = (
        set(oracle.ROUNDING)
        | set(oracle.differences())
        | {name for name, o in oracle.oracle_rows().items() if o.undefined}
        | {name for name, _ in oracle.FUNCTION_SKIPS}
    )
    assert listed <= named, f"differences the docs do not list: {sorted(listed - named)}"
    assert "jit" in table and str(oracle.JIT_ULPS) + " ulp" in table
