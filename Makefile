# normbook: two commands do all setup on a fresh machine.
#   make book   execute every chapter headless (papermill), then build the HTML in _build/html
#   make test   unit tests + nbval over every chapter (stored outputs must match re-execution)
#   make notebooks   re-execute the chapters in place, refreshing their stored outputs

PYTHON      ?= python3
VENV        := .venv
VPY         := $(VENV)/bin/python
STAMP       := $(VENV)/.normbook-installed
CHAPTERS    := $(sort $(wildcard book/*.ipynb))
BUILD_SRC   := _build/src
CELL_TIMEOUT ?= 600
PYTEST_ARGS ?=
export PYTHONHASHSEED := 0
# OpenMP threads sleep instead of spinning while idle: on a shared 2-core machine spinning
# threads made small CPU models up to 20x slower, with identical results.
export OMP_WAIT_POLICY := PASSIVE
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: all setup book execute html test unit nbval notebooks clean

all: test book

setup: $(STAMP)

# The environment: a venv with the project and every extra. Where no CUDA is present the CPU
# build of torch is installed first (on these machines torch==2.13.0 comes from local disk);
# an unpinned torch would pull a multi-GB CUDA build.
$(STAMP): pyproject.toml
	test -x $(VPY) || $(PYTHON) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	if ! command -v nvidia-smi >/dev/null 2>&1; then $(VPY) -m pip install -q torch==2.13.0; fi
	$(VPY) -m pip install -q -e ".[hf,book,test]"
	touch $(STAMP)

# --- the book ---------------------------------------------------------------------------
# Chapters are executed into a copy of the book's sources under _build/src, so the stored
# notebooks (and `git status`) are untouched; Sphinx then renders that copy, executing nothing.
book: execute html

execute: $(STAMP)
	rm -rf $(BUILD_SRC)
	mkdir -p $(BUILD_SRC)
	cp -r _config.yml _toc.yml book kernels bench $(BUILD_SRC)/
	set -e; for nb in $(CHAPTERS); do \
	  echo "executing $$nb"; \
	  $(VPY) -m normtools.book.build execute $$nb $(BUILD_SRC)/$$nb --cell-timeout $(CELL_TIMEOUT); \
	done

html: $(STAMP)
	test -d $(BUILD_SRC) || { echo "run 'make execute' first"; exit 1; }
	# refresh everything but the executed notebooks (pages, config, vendored JS, kernels, results)
	tar --exclude='*.ipynb' -cf - _config.yml _toc.yml book kernels bench | tar -xf - -C $(BUILD_SRC)
	rm -rf _build/html _build/.doctrees
	$(VENV)/bin/jupyter-book build $(BUILD_SRC) --path-output . -W --keep-going
	@echo "book: $(CURDIR)/_build/html/index.html"

# Refresh the outputs stored in book/*.ipynb (then review and commit them).
notebooks: $(STAMP)
	set -e; for nb in $(CHAPTERS); do \
	  echo "executing $$nb in place"; \
	  $(VPY) -m normtools.book.build execute $$nb $$nb --cell-timeout $(CELL_TIMEOUT); \
	done

# --- tests ------------------------------------------------------------------------------
test: $(STAMP)
	$(VPY) -m pytest tests $(CHAPTERS) --nbval --nbval-current-env \
	  --nbval-sanitize-with tests/nbval_sanitize.cfg --nbval-cell-timeout $(CELL_TIMEOUT) \
	  -p no:cacheprovider --durations=20 $(PYTEST_ARGS)

unit: $(STAMP)
	$(VPY) -m pytest tests -p no:cacheprovider $(PYTEST_ARGS)

clean:
	rm -rf _build
