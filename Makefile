# anelab: two entry points on a fresh machine — `make reproduce` and `make test`.
PYTHON ?= python3.11
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: reproduce test lab install clean benchmarks docs measure

$(PY):
	@command -v $(PYTHON) >/dev/null 2>&1 || { echo "error: $(PYTHON) not found; install Python 3.11 or run 'make PYTHON=/path/to/python3.11 ...'"; exit 2; }
	$(PYTHON) -m venv $(VENV)

$(STAMP): $(PY) pyproject.toml
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]'
	$(PY) -m ipykernel install --sys-prefix --name anelab --display-name "anelab (.venv)" >/dev/null
	@touch $(STAMP)

install: $(STAMP)

## Reproduce the studies and figures (the main job).
reproduce: $(STAMP)
	$(PY) -m anelab reproduce

## On a Mac: measure everything fresh (records in data/measured/; re-runs skip what is recorded).
measure: $(STAMP)
	$(PY) -m anelab measure

## Run the linter and the test suite (CI calls this).
test: $(STAMP)
	$(PY) -m ruff check anelab tests benchmarks
	$(PY) -m ruff format --check anelab tests benchmarks
	$(PY) -m pytest -n 2 -q

## Figure gallery for the docs: build/docs/index.html (runs the studies first if build/html is missing).
docs: $(STAMP)
	@test -d build/html || $(PY) -m anelab reproduce
	$(PY) -m anelab docs

## Open the notebooks in JupyterLab with the project's kernel (figures go to build/lab/figures; publish with
## `anelab run NN --publish` or `make reproduce`, or set figures_dir = "figures" in the parameters cell).
lab: $(STAMP)
	$(VENV)/bin/jupyter lab notebooks/

## Performance benchmarks (ratios measured in one run; not part of the tests; also re-runs the studies).
benchmarks: $(STAMP)
	$(PY) benchmarks/run_all.py --reproduce

clean:
	rm -rf build .pytest_cache
