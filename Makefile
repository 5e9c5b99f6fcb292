# `make demo` and `make test` create .venv when it is missing, install, and run (`make demo`:
# the runtime dependencies only; `make test`: with the test extra).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
EXTRAS ?= test
STAMP := $(VENV)/.installed-$(EXTRAS)
RUNTIME_STAMP := $(VENV)/.installed-runtime

.PHONY: demo test bench clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip

$(STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install -e ".[$(EXTRAS)]"
	touch $@

$(RUNTIME_STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install -e .
	touch $@

# the tour needs the runtime dependencies only (jax, optax, numpy)
demo: $(RUNTIME_STAMP)
	JAX_PLATFORMS=$${JAX_PLATFORMS:-cpu} $(PY) -m masked_jax.demo

test: $(STAMP)
	JAX_PLATFORMS=$${JAX_PLATFORMS:-cpu} $(PY) -m pytest tests -n $${MJ_TEST_WORKERS:-auto}

bench: $(STAMP)
	$(PY) benchmarks/ops.py

clean:
	rm -rf $(VENV) build *.egg-info
