# `make demo` and `make test` create .venv when it is missing, install, and run (`make demo`:
# the runtime dependencies only; `make test`: with the test extra).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
EXTRAS ?= test
STAMP := $(VENV)/.installed-$(EXTRAS)
RUNTIME_STAMP := $(VENV)/.installed-runtime

.PHONY: demo test test-oldest bench clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip

$(STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install -e ".[$(EXTRAS)]"
	touch $@ $(RUNTIME_STAMP)  # the extras include the runtime dependencies

$(RUNTIME_STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install -e .
	touch $@

# the tour needs the runtime dependencies only (jax, optax, numpy)
demo: $(RUNTIME_STAMP)
	JAX_PLATFORMS=$${JAX_PLATFORMS:-cpu} $(PY) -m masked_jax.demo

test: $(STAMP)
	JAX_PLATFORMS=$${JAX_PLATFORMS:-cpu} $(PY) -m pytest tests -n $${MJ_TEST_WORKERS:-auto}

# The oldest versions pyproject admits, in their own venv, through a smoke suite (not part of
# `make test`: it downloads a second jax).
OLDEST := jax==0.8.0 jaxlib==0.8.0 optax==0.2.4 numpy==2.0.2 chex==0.1.89
test-oldest:
	$(PYTHON) -m venv .venv-oldest
	.venv-oldest/bin/python -m pip install $(OLDEST) pytest hypothesis
	.venv-oldest/bin/python -m pip install --no-deps -e .
	JAX_PLATFORMS=cpu .venv-oldest/bin/python -m pytest -p no:cacheprovider tests/test_core.py tests/test_ad.py \
		tests/test_transform.py tests/test_maskify_coverage.py tests/test_validation.py tests/test_layouts.py

bench: $(STAMP)
	$(PY) benchmarks/ops.py

clean:
	rm -rf $(VENV) .venv-oldest build *.egg-info
