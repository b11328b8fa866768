PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: install test run bench clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	# torch pinned: 2.13.0 is the CPU build on local disk; any other spec pulls a multi-GB CUDA build.
	$(PY) -m pip install torch==2.13.0

install: $(PY)
	$(PY) -m pip install -e '.[test,bench]'
	# build the C++ CPU kernels now, not on the first request; a build error fails the install
	$(PY) -m tokenmill.kernels

test: install
	$(PY) -m pytest -q

run: install
	$(VENV)/bin/tokenmill serve

bench: install
	$(PY) bench/decode_prefill.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
