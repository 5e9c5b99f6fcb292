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

.PHONY: demo test test-oldest docs notebooks bench clean

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

# The site, into docs/_build/html: warnings are errors; the notebooks run at build time.
docs: $(DOCS_STAMP)
	JAX_PLATFORMS=$${JAX_PLATFORMS:-cpu} $(PY) -m sphinx -W --keep-going -b html docs docs/_build/html

# Re-run the notebooks in place, so that notebooks/ holds them with their outputs.
notebooks: $(DOCS_STAMP)
	JAX_PLATFORMS=$${JAX_PLATFORMS:-cpu} $(PY) -m jupyter execute --inplace notebooks/*.ipynb

bench: $(STAMP)
	$(PY) benchmarks/ops.py

clean:
	rm -rf $(VENV) .venv-oldest build dist *.egg-info docs/_build docs/notebooks docs/benchmarks.md
