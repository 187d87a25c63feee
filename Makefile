# The whole set-up on a fresh machine: `make demo` and `make test`.
# Each creates .venv when missing and installs what it needs; a second run reuses it.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check -q

.PHONY: demo test bench clean

$(VENV)/.installed-core: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -e '.[examples]'
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed-core
	$(PIP) install -e '.[test,examples,checkpoint]'
	# test-only oracle; the CPU wheel of this version is what the test machines carry
	$(PIP) install 'torch==2.13.0' || echo "torch oracle not installed: parity tests will be skipped"
	touch $@

demo: $(VENV)/.installed-core
	$(PY) examples/demo.py

# Two worker processes: the suite is mostly XLA compiles, which two cores share well.
test: $(VENV)/.installed-test
	$(PY) -m pytest -q -n 2

# Not part of the set-up: the speed benchmarks, with the peers they are measured against.
bench: $(VENV)/.installed-test
	$(PIP) install -e '.[bench]'
	cd benchmarks && ../$(PY) scaler_overhead.py && ../$(PY) autocast_overhead.py && ../$(PY) residual_memory.py && ../$(PY) sharded_memory.py

clean:
	rm -rf $(VENV) build *.egg-info
