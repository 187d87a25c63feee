# The whole set-up on a fresh machine: `make demo` and `make test`.
# Each creates .venv when missing and installs what it needs; a second run reuses it.
#
# `make test PYTHON=python3.12` runs the suite on another Python, in a venv of its own
# (.venv-3.12), leaving .venv alone. A `pythonX.Y` that pyenv has installed but not selected
# (its shim then refuses to run) is taken from pyenv.
PYTHON ?= python3
INTERPRETER := $(shell $(PYTHON) -c 'import sys; print(sys.executable)' 2>/dev/null || \
	{ prefix=$$(pyenv prefix $(patsubst python%,%,$(notdir $(PYTHON))) 2>/dev/null) \
	  && echo "$$prefix/bin/python3"; })
ifeq ($(INTERPRETER),)
$(error PYTHON=$(PYTHON) is neither a Python interpreter on PATH nor a version pyenv has installed)
endif
VENV := $(if $(filter python3,$(PYTHON)),.venv,.venv-$(shell $(INTERPRETER) -c \
	'import sys; print("%d.%d" % sys.version_info[:2])'))
PY := $(VENV)/bin/python
# --no-compile: pip would byte-compile every file of every package (torch's thousands); Python
# compiles the modules a run imports, once, when it first imports them.
PIP_INSTALL := $(PY) -m pip --disable-pip-version-check -q install --no-compile
# The test-only oracle: torch's CPU build (`+cpu` names only that build, so where pip finds
# none it installs nothing rather than the multi-GB CUDA build, and the parity tests skip),
# and torchao, whose float8 training (emulated on the CPU) the fp8 recipes are checked against.
# `make test ORACLE=` leaves them out.
ORACLE ?= torch==2.13.0+cpu torchao==0.18.0

.PHONY: demo test lint bench clean

$(PY):
	$(INTERPRETER) -m venv $(VENV)

$(VENV)/.installed-core: pyproject.toml | $(PY)
	$(PIP_INSTALL) -e '.[examples]'
	touch $@

# One install of everything the suite needs (the examples' extra included), so that a first
# `make test` resolves and builds jamp once; it stands for the core install too.
$(VENV)/.installed-test: pyproject.toml | $(PY)
	$(PIP_INSTALL) -e '.[test,examples,checkpoint]'
	$(foreach pkg,$(ORACLE),$(PIP_INSTALL) '$(pkg)' \
	    || echo "no $(pkg) for this Python: its parity tests will be skipped";)
	touch $(VENV)/.installed-core $@

demo: $(VENV)/.installed-core
	$(PY) examples/demo.py

# Two worker processes: the suite is mostly XLA compiles, which two cores share well.
# `--dist loadgroup` hands each worker a test or two at a time, so that both finish together,
# and keeps the tests of one `xdist_group` mark on one worker: runs that they share through a
# module-scoped fixture (tests/examples/test_multihost.py) are then made once.
test: $(VENV)/.installed-test
	$(PY) -m pytest -q -n 2 --dist loadgroup

$(VENV)/.installed-lint: pyproject.toml | $(PY)
	$(PIP_INSTALL) -e '.[lint]'
	touch $@

# Lint and type-check the package (seconds): the settings are in pyproject.toml.
lint: $(VENV)/.installed-lint
	$(VENV)/bin/ruff check jamp
	$(VENV)/bin/mypy jamp

# Not part of the set-up: the speed benchmarks, with the peers they are measured against.
bench: $(VENV)/.installed-test
	$(PIP_INSTALL) -e '.[bench]'
	cd benchmarks && ../$(PY) scaler_overhead.py && ../$(PY) autocast_overhead.py && ../$(PY) residual_memory.py && ../$(PY) sharded_memory.py && ../$(PY) anomaly_overhead.py && ../$(PY) precision_report_cost.py && ../$(PY) fp8_overhead.py

clean:
	rm -rf .venv .venv-* build *.egg-info
