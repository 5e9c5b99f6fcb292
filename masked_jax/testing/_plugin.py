"""The pytest plugin of masked_jax (registered through the ``pytest11`` entry point, so pytest
loads it wherever masked_jax is installed).

``pytest --mj-report DIR`` writes, for each test that fails with a :class:`masked_jax.JacobianError`
or :class:`masked_jax.InvarianceError` (raised by ``assert_jacobian``, ``assert_invariant``, or by
``check_jacobian`` / ``check_invariance`` themselves), the failing check's report as a standalone
HTML page in ``DIR``, named after the test (:func:`report_path`), and names the file in the test's report.
"""

from __future__ import annotations

import hashlib
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


PREFIX_MAX = 100  # characters of the readable part of a report's file name


def report_path(directory, nodeid: str) -> pathlib.Path:
    """The file the report of test ``nodeid`` goes to: a readable part, the node id with every run
    of characters outside letters, digits, ``.``, ``_`` and ``-`` replaced by ``_`` and cut to
    :data:`PREFIX_MAX` characters, then ``-`` and a digest of the whole node id. The name stays
    far below the file systems' 255-byte limit however long the test id (a parametrized test's
    can run to thousands of characters), and two ids that differ only in punctuation, or only
    past the cut, get two files.

    Examples:
        >>> report_path("reports", "tests/test_model.py::test_encoder[x-1]").name
        'tests_test_model.py_test_encoder_x-1-748f8666f861.html'
        >>> len(report_path("reports", "tests/t.py::test[" + "a" * 1000 + "]").name)
        118
    """
    readable = re.sub(r"[^A-Za-z0-9._-]+", "_", nodeid).strip("_")[:PREFIX_MAX].rstrip("_") or "test"
    digest = hashlib.blake2b(nodeid.encode("utf-8", "surrogatepass"), digest_size=6).hexdigest()
    return pathlib.Path(directory) / f"{readable}-{digest}.html"


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
