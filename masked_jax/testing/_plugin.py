"""The pytest plugin of masked_jax (registered through the ``pytest11`` entry point, so pytest
loads it wherever masked_jax is installed).

``pytest --mj-report DIR`` writes, for each test that fails with a :class:`masked_jax.JacobianError`
or :class:`masked_jax.InvarianceError` (raised by ``assert_jacobian``, ``assert_invariant``, or by
``check_jacobian`` / ``check_invariance`` themselves), the failing check's report as a standalone
HTML page in ``DIR``, named after the test, and names the file in the test's report.
"""

from __future__ import annotations

import pathlib
import re

import pytest


def pytest_addoption(parser):
    group = parser.getgroup("masked_jax")
    group.addoption(
        "--mj-report",
        metavar="DIR",
        default=None,
        help="write the HTML report of each masked_jax check that fails a test "
        "(check_jacobian, check_invariance, assert_jacobian, assert_invariant) into DIR",
    )


def report_path(directory, nodeid: str) -> pathlib.Path:
    """The file the report of test ``nodeid`` goes to: its node id with every character outside
    letters, digits, ``.``, ``_`` and ``-`` replaced by ``_``."""
    return pathlib.Path(directory) / (re.sub(r"[^A-Za-z0-9._-]+", "_", nodeid).strip("_") + ".html")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    result = outcome.get_result()
    directory = item.config.getoption("mj_report", default=None)
    if not directory or call.excinfo is None or not result.failed:
        return
    report = getattr(call.excinfo.value, "report", None)
    if report is None or not callable(getattr(report, "save_html", None)):
        return
    path = report_path(directory, item.nodeid)
    path.parent.mkdir(parents=True, exist_ok=True)
    report.save_html(path)
    result.user_properties.append(("mj_report", str(path)))
    result.sections.append(("masked_jax", f"check report written to {path}"))
