# The two commands of the README: `make test` (set-up + the whole test suite) and, once the
# demo issue lands, `make demo`. Both set up everything on a fresh machine (scripts/setup.sh).
PY := .venv/bin/python
export ROS_AUTOMATIC_DISCOVERY_RANGE := LOCALHOST

.PHONY: setup test lint build clean

setup:
	./scripts/setup.sh

build:
	$(PY) setup.py --quiet build_ext --inplace

test: setup
	$(PY) -m ruff check edgevlm_ros test
	PYTHONPATH=$(CURDIR) $(PY) -m pytest test -q -rs

lint:
	$(PY) -m ruff check edgevlm_ros test

clean:
	rm -rf build edgevlm_ros/_engine*.so
