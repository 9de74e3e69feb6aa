# Two entry points for a new user: `make demo` and `make test`.
# Each creates .venv when missing and installs what it needs.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: demo test docs bench install-test install-demo install-docs clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

# The deviceless H100 and TPU compiles of tests/test_deviceless.py need the
# CUDA plugin, ptxas and libtpu at the versions the installed jaxlib takes
# (compile-only: no CUDA runtime libraries); tests/deviceless.py lists them.
install-test: $(PY)
	$(PY) -m pip install --quiet -e ".[test,docs]"
	$(PY) tests/deviceless.py > $(VENV)/deviceless-requirements.txt
	$(PY) -m pip install --quiet -r $(VENV)/deviceless-requirements.txt

install-docs: $(PY)
	$(PY) -m pip install --quiet -e ".[docs]"

install-demo: $(PY)
	$(PY) -m pip install --quiet -e ".[demo]"

demo: install-demo
	$(PY) examples/demo.py

# One pytest worker per core (pytest-xdist): the tests mostly compile XLA
# programs, each on one thread; the deviceless tests of one target share
# their programs in one worker (--dist loadgroup: tests/test_deviceless.py).
# The numerics tests, and the distributed ones that reach the norm kernel,
# run once more through the GPU/TPU kernel, the leaves grouped as on a TPU
# (OPTAXCLIP_KERNEL=one_pass_tpu: docs/design.md, Platforms; a GPU's groups
# and the CPU's: tests/test_kernel_thresholds.py).
test: install-test
	$(PY) -m ruff check optaxclip tests benchmarks examples docs/scripts
	$(VENV)/bin/pyright
	$(PY) -m pytest -q -n auto --dist loadgroup
	OPTAXCLIP_KERNEL=one_pass_tpu $(PY) -m pytest -q -n auto tests/test_global_norm.py \
	  tests/test_distributed.py -k "not test_distributed or shard_map or gspmd_gives or gspmd_moves or single_axis"

# The site only: mkdocs, its theme and mkdocstrings (which reads the
# docstrings without importing optaxclip).
docs: install-docs
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict

bench: $(PY)
	$(PY) -m pip install --quiet -e ".[bench]"
	$(PY) benchmarks/run.py

clean:
	rm -rf $(VENV) build *.egg-info
