"""Assertions for test suites: :func:`assert_jacobian` and :func:`assert_invariant` raise an
``AssertionError`` that carries the check's report, and a pytest plugin (installed with the
package) writes the HTML report of each failing check beside the test results
(``pytest --mj-report DIR``)."""

from masked_jax.testing._assertions import assert_invariant as assert_invariant
from masked_jax.testing._assertions import assert_jacobian as assert_jacobian

__all__ = ["assert_jacobian", "assert_invariant"]
