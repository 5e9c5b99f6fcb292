"""Every registered op through every check of the harness (``tests/harness.py``).

The cases are generated from the registry: adding an op adds its cases. An op leaves a check
only through ``OpSpec.excluded`` (with its reason); ``test_exclusions_have_reasons`` lists them,
and the terminal summary prints the case count.
"""

from __future__ import annotations

import pytest

import masked_jax  # noqa: F401
from masked_jax.ops import REGISTRY
from masked_jax.ops._registry import CHECKS

import harness
from conformance_table import ROWS

CASES = [(name, check) for name in REGISTRY for check in CHECKS if check not in REGISTRY[name].excluded]


def test_every_registered_op_has_a_table_row_and_every_check_a_function():
    assert set(harness.CHECKS) == set(CHECKS)
    missing = sorted(set(REGISTRY) - set(ROWS))
    assert not missing, f"ops without a row in tests/conformance_table.py: {missing}"
    assert not set(ROWS) - set(REGISTRY), "rows for ops that are not registered"


def test_exclusions_have_reasons():
    for spec in REGISTRY.values():
        for check, why in spec.excluded.items():
            assert check in CHECKS and isinstance(why, str) and len(why) > 10, (spec.name, check)


@pytest.mark.parametrize("name,check", CASES, ids=[f"{n}-{c}" for n, c in CASES])
def test_conformance(name, check):
    harness.CHECKS[check](name)
