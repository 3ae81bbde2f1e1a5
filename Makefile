# The two commands of the README: `make demo` (the main job on the embedded default model) and
# `make test` (the whole test suite). Both set up everything on a fresh machine (scripts/setup.sh).
PY := .venv/bin/python
export ROS_AUTOMATIC_DISCOVERY_RANGE := LOCALHOST

.PHONY: setup test demo lint build clean

setup:
	./scripts/setup.sh

build:
	$(PY) setup.py --quiet build_ext --inplace

test: setup
	$(PY) -m ruff check .
	PYTHONPATH=$(CURDIR) $(PY) -m pytest test -q -rs --durations=25

# The main job on the embedded default: camera -> node -> live descriptions, until Ctrl-C.
# make demo ARGS="--frames 30" stops after 30 described frames and prints a summary.
demo: setup
	$(PY) -m edgevlm_ros.cli demo $(ARGS)

lint:
	$(PY) -m ruff check .

clean:
	rm -rf build edgevlm_ros/_engine*.so
