# normbook: two commands do all setup on a fresh machine.
#   make book   execute every chapter headless (papermill, two at a time), then build the HTML
#               in _build/html
#   make test   unit tests + nbval over every chapter (stored outputs must match re-execution)
#   make notebooks   re-execute the chapters in place, refreshing their stored outputs (and the
#                    Colab edition, `make colab`)
#   make lock   rewrite constraints.txt, the locked environment, from the venv
#   make diagrams    render new mermaid diagrams to book/_diagrams (headless Chromium)
#   make nbval-perturbed   nbval again under another numerical path (CI runs it after make test)
#   make atlas  re-probe every transformers family into normtools/cards/data/atlas.json

PYTHON      ?= python3
VENV        := .venv
VPY         := $(VENV)/bin/python
STAMP       := $(VENV)/.normbook-installed
CHAPTERS    := $(sort $(wildcard book/*.ipynb))
BUILD_SRC   := _build/src
# Each chapter's wall and CPU seconds, written by every execution, read by the time-budget test.
CHAPTER_TIMES := _build/chapter_times.json
CELL_TIMEOUT ?= 600
# The locked environment (exact versions, `make lock` regenerates it); LOCK= installs from
# pyproject.toml's ranges instead.
LOCK        ?= constraints.txt
LOCK_ARGS   := $(if $(LOCK),-c $(LOCK))
LOCK_PYTHON := $(if $(LOCK),$(shell sed -n 's/^\# python: *//p' $(LOCK)))
TORCH_PIN   := $(if $(LOCK),$(shell grep '^torch==' $(LOCK)),torch)
PYTEST_ARGS ?=
export PYTHONHASHSEED := 0
# OpenMP threads sleep instead of spinning while idle: on a shared 2-core machine spinning
# threads made small CPU models up to 20x slower, with identical results.
export OMP_WAIT_POLICY := PASSIVE
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: all setup lock book execute html diagrams colab colab-reader atlas test unit nbval nbval-perturbed notebooks clean

all: test book

setup: $(STAMP)

# The environment: a venv with the project and every extra, at the lock's exact versions. Where
# no CUDA is present the CPU build of torch is installed first (on these machines it comes from
# local disk; elsewhere pass TORCH_INDEX=https://download.pytorch.org/whl/cpu): otherwise pip
# would pull a multi-GB CUDA build. The lock's torch line has no +cpu label, so it fits both.
TORCH_INDEX ?=
$(STAMP): pyproject.toml $(LOCK)
	test -x $(VPY) || $(PYTHON) -m venv $(VENV)
	@if [ -n "$(LOCK_PYTHON)" ]; then have=$$($(VPY) -c 'import sys; print("%d.%d" % sys.version_info[:2])'); \
	  [ "$$have" = "$(LOCK_PYTHON)" ] || { echo "$(LOCK) was made on Python $(LOCK_PYTHON), $(VENV) has $$have:" \
	  "rerun with PYTHON=python$(LOCK_PYTHON), or LOCK= to install from pyproject's ranges"; exit 1; }; fi
	$(VPY) -m pip install -q $(LOCK_ARGS) --upgrade pip
	if ! command -v nvidia-smi >/dev/null 2>&1; then \
	  $(VPY) -m pip install -q $(LOCK_ARGS) $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX)) "$(TORCH_PIN)"; fi
	$(VPY) -m pip install -q $(LOCK_ARGS) -e ".[hf,book,test]"
	touch $(STAMP)

# Regenerate the lock from the current venv (after a deliberate upgrade; review, commit, rerun).
lock:
	$(VPY) -m normtools.book.build lock $(or $(LOCK),constraints.txt)

# --- the book ---------------------------------------------------------------------------
# Chapters are executed into a copy of the book's sources under _build/src, so the stored
# notebooks (and `git status`) are untouched; Sphinx then renders that copy, executing nothing.
# BOOK_WORKERS chapters run at once (each in its own kernel; a failing one fails the build);
# their timings then record it, and the time-budget test judges their CPU seconds.
BOOK_WORKERS ?= 2
book: execute html

execute: $(STAMP)
	rm -rf $(BUILD_SRC)
	mkdir -p $(BUILD_SRC)
	cp -r _config.yml _toc.yml book kernels bench $(BUILD_SRC)/
	printf '%s\n' $(CHAPTERS) | xargs -P $(BOOK_WORKERS) -I CHAPTER \
	  $(VPY) -m normtools.book.build execute CHAPTER $(BUILD_SRC)/CHAPTER \
	    --cell-timeout $(CELL_TIMEOUT) --times $(CHAPTER_TIMES) --side-by-side $(BOOK_WORKERS)

html: $(STAMP) diagrams
	test -d $(BUILD_SRC) || { echo "run 'make execute' first"; exit 1; }
	# refresh everything but the executed notebooks (pages, config, vendored JS, kernels, results)
	tar --exclude='*.ipynb' -cf - _config.yml _toc.yml book kernels bench | tar -xf - -C $(BUILD_SRC)
	rm -rf _build/html _build/.doctrees
	$(VENV)/bin/jupyter-book build $(BUILD_SRC) --path-output . -W --keep-going
	@echo "book: $(CURDIR)/_build/html/index.html"

# Mermaid diagrams as static SVG (headless Chromium): renders the new ones into the committed
# cache book/_diagrams and deletes those no page uses (commit the change).
diagrams: $(STAMP)
	$(VPY) -m normtools.book.diagrams

# Refresh the outputs stored in book/*.ipynb and the Colab edition made from them (then review
# and commit both).
notebooks: $(STAMP)
	set -e; for nb in $(CHAPTERS); do \
	  echo "executing $$nb in place"; \
	  $(VPY) -m normtools.book.build execute $$nb $$nb --cell-timeout $(CELL_TIMEOUT) --times $(CHAPTER_TIMES); \
	done
	$(MAKE) colab

# The Colab edition colab/book/*.ipynb, from the stored chapters (roles resolved, includes inlined,
# diagrams as images); tests/book/test_colab.py checks that it is in sync.
colab: $(STAMP)
	$(VPY) -m normtools.book.colab

# A new Colab reader (CI's last step, ~6-8 min on 2 cores): a fresh venv with only what Colab has
# (torch, a kernel) and what the edition's setup cell installs, every colab/book chapter run in it.
colab-reader: $(STAMP)
	NORMBOOK_COLAB_READER=1 $(VPY) -m pytest tests/book/test_colab_reader.py -p no:cacheprovider -v -s $(PYTEST_ARGS)

# The atlas: every causal-LM family of the installed transformers probed from its running code
# (a few minutes on 2 cores); review the diff (`normtools atlas --compare`) and commit.
atlas: $(STAMP)
	$(VENV)/bin/normtools atlas --refresh

# --- tests ------------------------------------------------------------------------------
NBVAL_ARGS := --nbval --nbval-current-env --nbval-sanitize-with $(CURDIR)/tests/nbval_sanitize.cfg \
  --nbval-cell-timeout $(CELL_TIMEOUT)
# Test files and chapters run in TEST_WORKERS processes (pytest-xdist), each file whole in one of
# them (a chapter's cells share one kernel; a module's fixtures run once). 0: one process. The
# chapters, the longest files, go first, so that neither process is left with one at the end.
TEST_WORKERS ?= 2
XDIST_ARGS := $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile)

test: $(STAMP)
	$(VPY) -m pytest $(CHAPTERS) tests $(NBVAL_ARGS) $(XDIST_ARGS) -p no:cacheprovider --durations=20 $(PYTEST_ARGS)

# nbval alone: re-execute every chapter and compare with the stored outputs (NBVAL_ENV: extra
# environment for the run).
NBVAL_ENV ?=
nbval: $(STAMP)
	$(NBVAL_ENV) $(VPY) -m pytest $(CHAPTERS) $(NBVAL_ARGS) $(XDIST_ARGS) -p no:cacheprovider $(PYTEST_ARGS)

# The same stored outputs must survive another numerical path (CI runs this after `make test`):
# ATen's scalar kernels instead of AVX2/AVX-512 ones, MKL's ISA-independent GEMM path (its
# results differ from the AVX2/AVX-512 paths in the last bits), and one thread instead of the
# chapters' two (another summation order in parallel reductions). Each of these changes the bits
# of torch results here (tests/book/test_book_pipeline.py checks it); none pins anything.
PERTURBED_ENV := ATEN_CPU_CAPABILITY=default MKL_CBWR=COMPATIBLE NORMBOOK_THREADS=1 OMP_NUM_THREADS=1
nbval-perturbed: $(STAMP)
	$(MAKE) nbval NBVAL_ENV="$(PERTURBED_ENV)"

unit: $(STAMP)
	$(VPY) -m pytest tests $(XDIST_ARGS) -p no:cacheprovider $(PYTEST_ARGS)

clean:
	rm -rf _build
