"""The public Array API test suite (data-apis/array-api-tests), a subset of it, against jax.numpy and
masked_jax.numpy in the same run: every test jax.numpy passes must pass for masked_jax.numpy.

`make array-api-suite` runs the whole suite (a few minutes per module on 2 cores); this subset
covers the array object (scalar conversions, indexing), constants, dtype functions, creation
functions and a sample of the elementwise functions and reductions.
"""

from __future__ import annotations

import array_api_suite

SUBSET = [
    "array_api_tests/test_constants.py",
    "array_api_tests/test_array_object.py",
    "array_api_tests/test_data_type_functions.py",
    "array_api_tests/test_creation_functions.py::test_zeros",
    "array_api_tests/test_creation_functions.py::test_ones_like",
    "array_api_tests/test_creation_functions.py::test_arange",
    "array_api_tests/test_operators_and_elementwise_functions.py::test_abs",
    "array_api_tests/test_operators_and_elementwise_functions.py::test_add",
    "array_api_tests/test_operators_and_elementwise_functions.py::test_exp",
    "array_api_tests/test_statistical_functions.py::test_sum",
    "array_api_tests/test_statistical_functions.py::test_max",
    "array_api_tests/test_searching_functions.py::test_argmax",
]


def test_masked_numpy_passes_every_suite_test_jax_numpy_passes(capsys):
    suite = array_api_suite.suite_dir(None)
    results = {m: array_api_suite.run(m, suite, SUBSET, max_examples=5, workers=1) for m in array_api_suite.MODULES}
    ref = results["jax.numpy"]
    assert sum(o == "passed" for o in ref.values()) > 40, f"the subset ran too little: {ref}"
    lost = array_api_suite.compare(results)
    with capsys.disabled():
        print(
            f"\nArray API suite subset: jax.numpy passed {sum(o == 'passed' for o in ref.values())}, "
            f"masked_jax.numpy passed {sum(o == 'passed' for o in results['masked_jax.numpy'].values())}, "
            f"passed by jax.numpy only: {len(lost)}"
        )
    assert not lost, f"passed by jax.numpy and not by masked_jax.numpy: {lost}"
