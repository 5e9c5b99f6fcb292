"""``assert_jacobian`` and ``assert_invariant``: the checks of :mod:`masked_jax.checking` as test
assertions."""

from __future__ import annotations

from masked_jax.checking import (
    InvarianceError,
    InvarianceReport,
    JacobianError,
    JacobianReport,
    check_invariance,
    check_jacobian,
)


def assert_jacobian(f, args, *, semantics="masked", **options) -> JacobianReport:
    """Assert that ``f``'s derivatives match finite differences under ``semantics``.

    :func:`masked_jax.check_jacobian` with ``semantics="masked"`` by default (a function that
    reads the data under its inputs' masks fails, where the default ``"both"`` of
    ``check_jacobian`` would accept its dense semantics); every other option is
    ``check_jacobian``'s. On failure it raises :class:`masked_jax.JacobianError`, an
    ``AssertionError`` whose message is the report's text (the failing checks, the worst entries,
    the leak map) and whose ``report`` attribute is the :class:`masked_jax.JacobianReport`; the
    pytest plugin writes that report as HTML with ``--mj-report DIR``.

    Returns:
        The report, when the check passed.

    Examples:
        >>> import jax.numpy as jnp, masked_jax as mj, masked_jax.numpy as mnp
        >>> from masked_jax.testing import assert_jacobian
        >>> x = mj.masked_array(jnp.array([0.5, 1.0, 2.0]), jnp.array([True, True, False]))
        >>> bool(assert_jacobian(lambda v: mnp.sum(mnp.sin(v)), (x,)))
        True
        >>> try:  # reads the data under the mask
        ...     assert_jacobian(lambda v: jnp.sum(jnp.sin(v.data)), (x,))
        ... except AssertionError as err:
        ...     print(str(err).splitlines()[0])
        JacobianReport(FAILED: fails masked semantics)
    """
    report = check_jacobian(f, args, semantics=semantics, raise_exception=False, **options)
    if not report:
        raise JacobianError(report)
    return report


def assert_invariant(f, args, **options) -> InvarianceReport:
    """Assert that ``f``'s valid outputs and parameter gradients do not depend on its inputs'
    padding: :func:`masked_jax.check_invariance` with the same options (``axis``, ``params``,
    ``lengths``, ``positions``, ``fills``, ``transforms``, ...).

    On failure it raises :class:`masked_jax.InvarianceError`, an ``AssertionError`` whose message
    lists the re-paddings that changed something and whose ``report`` attribute is the
    :class:`masked_jax.InvarianceReport`; the pytest plugin writes that report as HTML with
    ``--mj-report DIR``.

    Returns:
        The report, when nothing changed.

    Examples:
        >>> import jax.numpy as jnp, masked_jax as mj, masked_jax.numpy as mnp
        >>> from masked_jax.testing import assert_invariant
        >>> x = mj.masked_array(jnp.ones((2, 4)), jnp.array([[1, 1, 0, 0], [1, 1, 1, 0]], bool))
        >>> bool(assert_invariant(lambda v: mnp.mean(v, axis=1), (x,), axis=1))
        True
        >>> try:  # a mean over the padded length
        ...     assert_invariant(lambda v: jnp.mean(v.filled(0), axis=1), (x,), axis=1)
        ... except AssertionError as err:
        ...     print(str(err).startswith("InvarianceReport(FAILED"), err.report.first_failure.first[0])
        True out
    """
    report = check_invariance(f, args, raise_exception=False, **options)
    if not report:
        raise InvarianceError(report)
    return report
