# `make demo`, `make test` and `make docs` create .venv when it is missing, install, and run
# (`make demo`: the runtime dependencies only; `make test`: with the test extra, which includes
# the docs extra; `make docs`: the docs extra).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
EXTRAS ?= test
STAMP := $(VENV)/.installed-$(EXTRAS)
RUNTIME_STAMP := $(VENV)/.installed-runtime

DOCS_STAMP := $(VENV)/.installed-docs

.PHONY: demo browser lint test test-slow test-full test-package array-api-suite docs notebooks bench bench-gpu-compile clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip

$(STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install -e ".[$(EXTRAS)]"
	touch $@ $(RUNTIME_STAMP) $(DOCS_STAMP)  # the extras include the runtime and docs dependencies

$(RUNTIME_STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install -e .
	touch $@

$(DOCS_STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install -e ".[docs]"
	touch $@ $(RUNTIME_STAMP)

# the tour needs the runtime dependencies only (jax, optax, numpy)
demo: $(RUNTIME_STAMP)
	JAX_PLATFORMS=$${JAX_PLATFORMS:-cpu} $(PY) -m masked_jax.demo

# Headless Chromium, for the test that renders the Jacobian report: Debian's package, installed
# when no Chromium or Chrome is on PATH (as root, or through sudo).
browser:
	@command -v chromium >/dev/null || command -v chromium-browser >/dev/null || command -v google-chrome >/dev/null || \
		{ SUDO=$$([ "$$(id -u)" = 0 ] || echo sudo); $$SUDO apt-get update -qq && \
		  DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq chromium >/dev/null; }

# ruff's lint and format check, pyright (basic) on the package, the layers contract (no import
# cycle, imports point down the layers of docs/architecture.md, which lists every module) and the
# docs against the code (tests/test_docs_agree.py). The same hooks: .pre-commit-config.yaml.
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/pyright --pythonpath $(PY) masked_jax
	JAX_PLATFORMS=cpu $(PY) -m pytest -q -p no:cacheprovider tests/test_layers.py tests/test_docs_agree.py

# The test loop: every test but the heavy tier (marker `slow`, declared in pyproject.toml).
test: $(STAMP)
	JAX_PLATFORMS=$${JAX_PLATFORMS:-cpu} $(PY) -m pytest tests -m "not slow" -n $${MJ_TEST_WORKERS:-auto} --dist worksteal

# The heavy tier: the tests marked slow (the docs site build, which runs the notebooks, the demo,
# pyright on a user script, the public Array API suite, the 8-device suite, headless Chromium
# renderings, the real models, the second half of the sampled sweeps, the sparse-storage sweep of
# every op on every layout), then the full jnp oracle:
# every registered op and public function against jax.numpy in every dtype, value set, mask,
# poison and eager/jit case (MJ_ORACLE=full), then the maskify program fuzzer with 40 examples
# (3 in `make test`; each example compiles several programs, about 15 s on 2 cores).
test-slow: $(STAMP) browser
	JAX_PLATFORMS=$${JAX_PLATFORMS:-cpu} $(PY) -m pytest tests -m slow -n $${MJ_TEST_WORKERS:-auto} --dist worksteal
	MJ_ORACLE=full JAX_PLATFORMS=$${JAX_PLATFORMS:-cpu} $(PY) -m pytest tests/test_conformance.py \
		-k "oracle or equals_jnp" -n $${MJ_TEST_WORKERS:-auto} --dist worksteal
	MJ_FUZZ_EXAMPLES=$${MJ_FUZZ_EXAMPLES:-40} JAX_PLATFORMS=$${JAX_PLATFORMS:-cpu} $(PY) -m pytest -q \
		tests/test_program_fuzz.py -k random_program

# The heavier sweeps: every (op, dtype, value set, mask, eager/jit) case of the jnp oracle, and
# more hypothesis examples, over both tiers. `make test` runs a documented sample of the oracle
# (see docs/semantics.md).
test-full: $(STAMP) browser
	MJ_ORACLE=full MJ_HYPOTHESIS_EXAMPLES=$${MJ_HYPOTHESIS_EXAMPLES:-20} JAX_PLATFORMS=$${JAX_PLATFORMS:-cpu} \
		$(PY) -m pytest tests -n $${MJ_TEST_WORKERS:-auto} --dist worksteal

# The public Array API test suite against jax.numpy and masked_jax.numpy in one run: every test that
# jax.numpy passes must pass for masked_jax.numpy (about 20 minutes per module on 2 cores). The
# suite's checkout: ARRAY_API_TESTS_DIR, by default ../shared/array-api-tests beside this checkout (or
# beside the local checkout it was cloned from).
array-api-suite: $(STAMP)
	$(PY) tests/array_api_suite.py --workers $${MJ_TEST_WORKERS:-2} $${ARRAY_API_TESTS_DIR:+--suite "$$ARRAY_API_TESTS_DIR"}

# The package as users get it: a wheel and an sdist built from this checkout, installed into a
# fresh venv with the oldest versions pyproject admits; a user script runs from outside the
# repository against the installed wheel, and a smoke suite runs from the unpacked sdist.
OLDEST := jax==0.8.0 jaxlib==0.8.0 optax==0.2.4 numpy==2.0.2 chex==0.1.89
SMOKE := tests/test_core.py tests/test_validation.py
test-package: $(STAMP)
	rm -rf dist .venv-oldest
	$(PY) -m build --outdir dist .
	$(PYTHON) -m venv .venv-oldest
	.venv-oldest/bin/python -m pip install -q $(OLDEST) pytest hypothesis dist/*.whl
	cd "$$(mktemp -d)" && JAX_PLATFORMS=cpu "$(CURDIR)/.venv-oldest/bin/python" "$(CURDIR)/.ci/user_script.py"
	src="$$(mktemp -d)" && tar xzf dist/*.tar.gz -C "$$src" && cd "$$src"/masked_jax-* && \
		JAX_PLATFORMS=cpu "$(CURDIR)/.venv-oldest/bin/python" -m pytest -q -p no:cacheprovider $(SMOKE)

# The site, into docs/_build/html: warnings are errors; the notebooks run at build time.
docs: $(DOCS_STAMP)
	JAX_PLATFORMS=$${JAX_PLATFORMS:-cpu} $(PY) -m sphinx -W --keep-going -b html docs docs/_build/html

# Re-run the notebooks in place, so that notebooks/ holds them with their outputs.
notebooks: $(DOCS_STAMP)
	JAX_PLATFORMS=$${JAX_PLATFORMS:-cpu} $(PY) -m jupyter execute --inplace notebooks/*.ipynb

bench: $(STAMP)
	$(PY) benchmarks/ops.py

# The maskify_models train steps compiled for an H100 and an H200 without a GPU (their temporary
# memory), in .venv-cuda: JAX's CUDA plugin at this venv's JAX version (several GB of downloads).
bench-gpu-compile: $(STAMP)
	[ -x .venv-cuda/bin/python ] || $(PYTHON) -m venv .venv-cuda
	.venv-cuda/bin/python -m pip install -q "jax[cuda13]==$$($(PY) -c 'import jax; print(jax.__version__)')" \
		"$$($(PY) -m pip freeze | grep -i '^flax==')" "$$($(PY) -m pip freeze | grep -i '^equinox==')" \
		"$$($(PY) -m pip freeze | grep -i '^optax==')" matplotlib
	PYTHONPATH=$(CURDIR) .venv-cuda/bin/python benchmarks/gpu_compile.py

clean:
	rm -rf $(VENV) .venv-oldest .venv-cuda build dist *.egg-info docs/_build docs/notebooks docs/benchmarks.md
