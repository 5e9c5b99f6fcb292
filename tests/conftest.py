"""Shared test set-up: float64 available (x64 on), strict numerics, hypothesis profiles."""

import os
import shutil

# XLA's compiled programs persist between runs in an on-disk cache (jax's persistent compilation
# cache): most of the suite's time is compiling, and a second `make test` with unchanged code
# compiles almost nothing (the conformance harness: 291 s cold, 114 s warm on 2 cores). Keys are
# hashes of the program, the compile options and the jax/XLA versions, so a change recompiles what
# it changed. MJ_TEST_COMPILE_CACHE moves it, or turns it off with 0. Set through the environment
# before jax is imported, so that the suite's subprocesses (notebooks, the 8-device suite, the
# Array API suite) share it. No size limit for jax to enforce (its limit rescans the directory
# at every write); pytest_configure empties the directory once it passes CACHE_LIMIT instead.
_CACHE_DIR = os.environ.get(
    "MJ_TEST_COMPILE_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "masked_jax", "xla-tests")
)
_CACHE_ON = _CACHE_DIR not in ("", "0")
CACHE_LIMIT = 2 << 30
# jax's options for it: every program is cached, however small or quick to compile
_CACHE_OPTIONS = {
    "jax_compilation_cache_dir": _CACHE_DIR,
    "jax_persistent_cache_min_compile_time_secs": 0.0,
    "jax_persistent_cache_min_entry_size_bytes": -1,
}
if _CACHE_ON:
    for _name, _value in _CACHE_OPTIONS.items():
        os.environ.setdefault(_name.upper(), str(_value))

import jax
import numpy as np
import pytest
from hypothesis import HealthCheck, settings

if _CACHE_ON:  # the same again, in case jax was imported before this file (by a plugin)
    for _name, _value in _CACHE_OPTIONS.items():
        jax.config.update(_name, type(_value)(os.environ[_name.upper()]))


def pytest_configure(config):
    """Empty the compilation cache when it has grown past CACHE_LIMIT (once, before the workers start)."""
    if not _CACHE_ON or hasattr(config, "workerinput") or not os.path.isdir(_CACHE_DIR):
        return
    with os.scandir(_CACHE_DIR) as entries:
        size = sum(e.stat().st_size for e in entries if e.is_file())
    if size > CACHE_LIMIT:
        shutil.rmtree(_CACHE_DIR, ignore_errors=True)


jax.config.update("jax_enable_x64", True)
# check_jacobian's background work is for interactive sessions; notebooks executed by the tests
# inherit this, so that no kernel compiles in the background while the suite runs on.
os.environ.setdefault("MJ_CHECK_BACKGROUND", "0")
jax.config.update("jax_numpy_rank_promotion", "allow")

settings.register_profile(
    "default",
    max_examples=int(os.environ.get("MJ_HYPOTHESIS_EXAMPLES", "5")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    derandomize=True,
    print_blob=True,
)
settings.load_profile("default")


# The compile-bound suites (the conformance harness, the property tests, the model and autodiff
# tests, the Jacobian checker's and the embeddings' tests) check semantics, not speed: they compile
# with XLA's optimization passes off, which made the layouts checks about a sixth faster and the
# checker's a quarter. MJ_XLA_OPTIMIZE=1 compiles them as users do, with every pass on.
_FAST_COMPILE = {
    "test_conformance.py",
    "test_differential.py",
    "test_layouts.py",
    "test_real_models.py",
    "test_ad.py",
    "test_registry.py",
    "test_linalg.py",
    "test_transform.py",
    "test_maskify_coverage.py",
    "test_regressions.py",
    "test_array_api.py",
    "test_tree.py",
    "test_nn.py",
    "test_numpy_ma.py",
    "test_checking.py",
    "test_invariance.py",
    "test_bags.py",
    "test_tables.py",
    "test_lookup.py",
}


@pytest.fixture(autouse=True)
def _fast_compile(request):
    if request.path.name not in _FAST_COMPILE or os.environ.get("MJ_XLA_OPTIMIZE") == "1":
        yield
        return
    jax.config.update("jax_disable_most_optimizations", True)
    try:
        yield
    finally:
        jax.config.update("jax_disable_most_optimizations", False)


@pytest.fixture
def rng():
    return np.random.default_rng(0)


# Two tiers. `make test` runs every test but those marked slow, which `make test-slow` runs (CI
# runs both): the docs site build (it executes the notebooks) and the docs pages' code blocks, the
# demo, pyright on a user script, the public Array API suite, the 8-device suite, headless Chromium
# renderings, the real models, a registration through every layer, the second half of three
# sampled sweeps (the conformance harness's layouts and compact checks, the maskify coverage of
# jax functions, the layouts' differential test: parametrised with the slow mark), and the
# optimizers beyond one of each kind of state in tests/test_optim.py's chunked-update tests. Every module
# and every registered op is still touched by `make test`; MJ_ORACLE=full runs every case
# (`make test-full`).
_SLOW_FILES = {
    "test_docs_site.py",
    "test_demo.py",
    "test_array_api_suite.py",
    "test_sharding.py",
    "test_real_models.py",
}
_SLOW_TESTS = {
    "test_pyright_reports_no_error_on_a_user_script",
    "test_every_array_class_has_an_html_view_that_renders",
    "test_html_report_renders_labelled_heatmap_in_headless_chromium",
    "test_docs_page_blocks_run",  # the docs pages' code blocks: the docs tier
    "test_a_new_op_is_one_registration_away_from_everywhere",  # one registration through every layer
    "test_layout_keeps_sparse_storage_where_the_op_allows",  # every op on every sparse layout: ~1 min
    "test_every_op_passes_check_jacobian_in_masked_semantics",  # the checker on every op: ~16 s
    "test_eager_compiled_and_background_checks_agree",  # three checker modes: ~8 s
    # maskify's sanitising and factor records against the general rules, op by op: ~50 s
    "test_a_chain_sanitised_once_equals_its_ops_sanitised_one_by_one",
    "test_attention_with_recorded_factors_equals_the_general_rule",
    "test_a_contraction_along_the_mask_of_two_chains_equals_its_ops_one_by_one",
    "test_bcoo_reductions_and_softmax_along_axes_stay_sparse_in_3d",  # 3-d BCOO layouts: ~18 s
}


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.name in _SLOW_FILES or getattr(item, "originalname", item.name) in _SLOW_TESTS:
            item.add_marker(pytest.mark.slow)


# tests/sharded/ needs 8 devices, so it runs in its own process (tests/test_sharding.py starts it).
collect_ignore = [] if os.environ.get("MASKED_JAX_SHARDED_TESTS") else ["sharded"]


# Sub-cases one (op, check) case of the conformance harness runs, per case of its table row.
_SUBCASES = {"transforms": 4, "jacobians": 2, "poison": 3 * 2, "maskify": 2 + 2}  # (+ the scans)
_LAYOUT_SUBCASES = 6 * 3  # six layouts x (eager, jit, gradient per stored slot)


def _sampled_out():
    import harness

    from masked_jax.ops import REGISTRY
    from masked_jax.ops._registry import CHECKS

    return sum(
        1
        for name in REGISTRY
        for check in CHECKS
        if check not in REGISTRY[name].excluded and not harness.in_sample(name, check)
    )


def pytest_terminal_summary(terminalreporter):
    """Print the conformance harness's case count (ops x checks x layouts x transforms x cases) and
    the outcomes of the maskify coverage test."""
    outcomes = {}
    for report in terminalreporter.stats.get("passed", []):
        for key, value in getattr(report, "user_properties", ()):
            if key == "maskify_outcome" and report.when == "call":
                outcomes[value] = outcomes.get(value, 0) + 1
    if outcomes:
        failed = sum(
            "test_masked_reference_or_maskify_error" in r.nodeid for r in terminalreporter.stats.get("failed", [])
        )
        terminalreporter.write_sep("-", "maskify coverage")
        terminalreporter.write_line(
            f"functions equal to their masked reference (eager and jit): {outcomes.get('equal', 0)}; "
            f"raising MaskifyError: {outcomes.get('MaskifyError', 0)}; failed: {failed}"
        )
    passed = [r.nodeid for r in terminalreporter.stats.get("passed", []) if "::test_conformance[" in r.nodeid]
    failed = [r.nodeid for r in terminalreporter.stats.get("failed", []) if "::test_conformance[" in r.nodeid]
    if not passed and not failed:
        return
    from conformance_table import ROWS

    from masked_jax.ops import REGISTRY

    by_check, sub, oracle_cases = {}, 0, 0
    for report in terminalreporter.stats.get("passed", []):
        oracle_cases += sum(v for k, v in getattr(report, "user_properties", ()) if k == "oracle_cases")
    for nodeid in passed:
        name, check = nodeid.split("[", 1)[1].rstrip("]").rsplit("-", 1)
        by_check[check] = by_check.get(check, 0) + 1
        row = ROWS[name]
        if check == "oracle":
            continue
        per = len(row.dtypes) if check == "reference" else _SUBCASES.get(check, _LAYOUT_SUBCASES)
        sub += per * len(row.cases)
    excluded = sum(len(s.excluded) for s in REGISTRY.values())
    terminalreporter.write_sep("-", "conformance harness")
    terminalreporter.write_line(
        f"{len(REGISTRY)} registered ops; (op, check) cases passed: {len(passed)}, failed: {len(failed)}, "
        f"excluded in the registry: {excluded}"
        + (f"; left to `make test-full` (MJ_ORACLE=full): {_sampled_out()}" if _sampled_out() else "")
    )
    terminalreporter.write_line("per check: " + ", ".join(f"{c} {n}" for c, n in sorted(by_check.items())))
    terminalreporter.write_line(f"sub-cases run (table cases x dtypes / transforms / poisons / layouts): {sub}")
    terminalreporter.write_line(
        f"jnp-oracle cases (ops x dtypes x value sets x full/partial mask x poison x eager/jit): {oracle_cases}"
        + ("" if os.environ.get("MJ_ORACLE") == "full" else " (the sample; MJ_ORACLE=full runs all)")
    )
