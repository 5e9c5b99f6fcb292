"""Shared test set-up: float64 available (x64 on), strict numerics, hypothesis profiles."""

import os

import jax
import numpy as np
import pytest
from hypothesis import HealthCheck, settings

jax.config.update("jax_enable_x64", True)
jax.config.update("jax_numpy_rank_promotion", "allow")

settings.register_profile(
    "default",
    max_examples=int(os.environ.get("MJ_HYPOTHESIS_EXAMPLES", "20")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    derandomize=True,
    print_blob=True,
)
settings.load_profile("default")


@pytest.fixture
def rng():
    return np.random.default_rng(0)


# tests/sharded/ needs 8 devices, so it runs in its own process (tests/test_sharding.py starts it).
collect_ignore = [] if os.environ.get("MASKED_JAX_SHARDED_TESTS") else ["sharded"]
