"""Run the public Array API test suite (data-apis/array-api-tests) against ``jax.numpy`` and
``masked_jax.numpy`` in the same run, and compare: every test that ``jax.numpy`` passes must pass
for ``masked_jax.numpy`` too.

Usage (``make array-api-suite`` runs the whole suite; ``tests/test_array_api_suite.py`` a subset)::

    python tests/array_api_suite.py [--suite DIR] [--max-examples 5] [--workers N] [FILE_OR_NODE ...]

The suite's location comes from ``--suite``, else ``ARRAY_API_TESTS_DIR``, else
``../shared/array-api-tests`` beside the checkout (or beside the local checkout it was cloned from). Each module runs with
``ARRAY_API_TESTS_VERSION=2024.12`` (``--version`` for another) and ``JAX_ENABLE_X64=1``. Prints both pass counts and every test
``jax.numpy`` passes and ``masked_jax.numpy`` does not; exits 1 if there is one.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

MODULES = ("jax.numpy", "masked_jax.numpy")
SEED = 0
ROOT = Path(__file__).resolve().parent.parent


def _beside(checkout: Path) -> Path:
    return checkout.parent / "shared" / "array-api-tests"


def _origin() -> Path | None:
    """The local checkout this one was cloned from, if any (a clone in a temporary directory finds
    the suite beside its origin)."""
    try:
        url = subprocess.run(
            ["git", "-C", str(ROOT), "config", "--get", "remote.origin.url"],
            capture_output=True,
            text=True,
            check=False,
        ).stdout.strip()
    except OSError:
        return None
    return Path(url) if url and Path(url).is_dir() else None


def suite_dir(given: str | None) -> Path:
    given = given or os.environ.get("ARRAY_API_TESTS_DIR")
    path = Path(given) if given else _beside(ROOT)
    if not given and not (path / "array_api_tests").is_dir() and _origin() is not None:
        path = _beside(_origin().resolve())
    if not (path / "array_api_tests").is_dir():
        raise SystemExit(
            f"no Array API test suite at {path}: clone data-apis/array-api-tests (see "
            "docs/semantics.md for the commit) and pass --suite or set ARRAY_API_TESTS_DIR."
        )
    return path


def run(module: str, suite: Path, targets, max_examples: int, workers: int, version: str = "2024.12") -> dict[str, str]:
    """``{test id: outcome}`` of the suite's ``targets`` run against ``module``, at the standard's
    ``version``."""
    env = {
        **os.environ,
        "ARRAY_API_TESTS_MODULE": module,
        "ARRAY_API_TESTS_VERSION": version,
        "JAX_ENABLE_X64": "1",
        "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu"),
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        # No hypothesis deadline: a first call's compile time on a loaded machine is not conformance
        # (under the 800 ms default, jax.numpy itself fails unique_* and others at random). One seed
        # for both modules: they draw the same examples, so a difference is the module's.
        cmd = [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "--max-examples",
            str(max_examples),
            "--hypothesis-disable-deadline",
            f"--hypothesis-seed={SEED}",
            "--json-report",
            f"--json-report-file={report}",
            "--disable-warnings",
            "-o",
            "addopts=",
        ]
        if workers > 1:
            cmd += ["-n", str(workers)]
        subprocess.run(
            cmd + list(targets), cwd=suite, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False
        )
        if not report.exists():
            raise SystemExit(
                f"the suite wrote no report for {module} (does `pytest {' '.join(targets)}` collect in {suite}?)"
            )
        tests = json.loads(report.read_text())["tests"]
    return {t["nodeid"]: t["outcome"] for t in tests}


# Tests masked_jax.numpy fails on purpose: each is a difference docs/semantics.md lists, with its
# reason, and the library's own tests check the documented behaviour.
_EMPTY = (
    "the {} of an array with no element is undefined: masked, as numpy.ma gives it (one rule for every "
    "reduction of nothing), where the standard wants a valid NaN"
)
DELIBERATE = {
    f"array_api_tests/test_special_cases.py::test_empty_arrays[{name}]": _EMPTY.format(name)
    for name in ("mean", "std", "var")
}


def compare(results: dict[str, dict[str, str]]) -> list[str]:
    """Test ids ``jax.numpy`` passes and ``masked_jax.numpy`` does not, deliberate differences
    (:data:`DELIBERATE`) apart."""
    ref, ours = results["jax.numpy"], results["masked_jax.numpy"]
    return sorted(
        t for t, outcome in ref.items() if outcome == "passed" and ours.get(t) != "passed" and t not in DELIBERATE
    )


RERUNS = 5


def confirm(lost, suite: Path, max_examples: int, version: str = "2024.12") -> list[str]:
    """Of the tests ``jax.numpy`` passed and ``masked_jax.numpy`` failed, those ``jax.numpy`` fails
    itself when they run again (``RERUNS`` times): not reliable passes. Some tests draw their input
    with hypothesis' ``.example()``, which no seed fixes (``test_special_cases.py::test_unary``:
    ``sign(-0 - 0j)`` is ``-0 - 0j`` in both modules, where the standard wants ``0 + 0j``), so one
    run of each module may see different inputs."""
    unreliable = set()
    for _ in range(RERUNS if lost else 0):
        again = run("jax.numpy", suite, [t for t in lost if t not in unreliable], max_examples, 1, version)
        unreliable |= {t for t, outcome in again.items() if outcome != "passed"}
        if len(unreliable) == len(lost):
            break
    return sorted(unreliable)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("targets", nargs="*", default=["array_api_tests"])
    parser.add_argument("--suite")
    parser.add_argument("--max-examples", type=int, default=5)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--version", default="2024.12", help="ARRAY_API_TESTS_VERSION (default 2024.12)")
    args = parser.parse_args(argv)
    suite = suite_dir(args.suite)
    results = {m: run(m, suite, args.targets, args.max_examples, args.workers, args.version) for m in MODULES}
    lost = compare(results)
    unreliable = confirm(lost, suite, args.max_examples, args.version)
    lost = [t for t in lost if t not in unreliable]
    for m in MODULES:
        outcomes = results[m].values()
        print(
            f"{m}: {sum(o == 'passed' for o in outcomes)} passed, {sum(o == 'failed' for o in outcomes)} failed, "
            f"{sum(o == 'skipped' for o in outcomes)} skipped"
        )
    if unreliable:
        print(
            f"failed by masked_jax.numpy, and by jax.numpy too when run again ({RERUNS} more runs): {len(unreliable)}"
        )
        for t in unreliable:
            print(f"  {t}")
    deliberate = sorted(t for t in DELIBERATE if results["masked_jax.numpy"].get(t, "passed") != "passed")
    if deliberate:
        print(f"deliberate differences (docs/semantics.md): {len(deliberate)}")
        for t in deliberate:
            print(f"  {t}: {DELIBERATE[t]}")
    print(f"passed by jax.numpy and not by masked_jax.numpy: {len(lost)}")
    for t in lost:
        print(f"  {t}  ({results['masked_jax.numpy'].get(t, 'not run')})")
    return 1 if lost else 0


if __name__ == "__main__":
    sys.exit(main())
