"""Prompts through a prefill and a decode vLLM instance with dualpath's connector, the decode
engine's buffers hosted here (run by the peers' python, not by pytest).

What a dualpath decode engine does around the two instances, in one process: a layer-major
buffer in a shared-memory file registered with Mooncake (a fresh one per run); on the DE read
path the hit blocks are read from the store into it; the prefill instance (``max_tokens=1``)
loads the hit (PE: store, DE: pulled from the buffer) and pushes the prompt's KV into the buffer
layer by layer, then seals it; the decode instance copies the buffer in and decodes
``prompt + [first token]``. ``--runs`` names the runs in order, each on the same two instances
(started once: prefix caching is off, so no run reuses another's KV inside vLLM): ``plain``
(one plain vLLM instance), ``miss`` (its decode side stores the prompt's blocks), ``pe`` and
``de`` (each hits ``--hit-blocks`` of them). Writes ``{run: {"first", "output", "sealed"}}``;
each run's lines in the log start after a ``=== run NAME`` line.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import sys
import time
from pathlib import Path

BLOCK_SIZE = 32
RUNS = ("plain", "miss", "pe", "de")
STORED_WAIT_S = 60.0  # the miss run's decode side persists the hit blocks after its steps


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--prompt", required=True, help="a JSON file with token ids")
    parser.add_argument("--store", required=True)
    parser.add_argument("--runs", default=",".join(RUNS))
    parser.add_argument("--hit-blocks", type=int, default=0)
    parser.add_argument("--mode", default="layerwise")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--trace", default="", help="the prefill connector's hook trace file")
    parser.add_argument("--recv-cap-mb-s", type=float, default=None,
                        help="cap the prefill's compute-NIC receive side (NIC emulation)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    unknown = set(args.runs.split(",")) - set(RUNS)
    if unknown:
        parser.error(f"--runs takes {', '.join(RUNS)}, got {sorted(unknown)}")
    return args


def banner(name: str) -> None:
    """Mark where a run's log lines start (the instances' processes share this output)."""
    sys.stderr.flush()
    print(f"=== run {name}", flush=True)


class PDHarness:
    """A prefill and a decode instance with dualpath's connector, and the decode engine's part
    of each run (its buffer, its DE-path reads) done here."""

    def __init__(self, args: argparse.Namespace, common: dict) -> None:
        from vllm import LLM

        from dualpath.config import StorageConfig, TrafficConfig
        from dualpath.integrations.vllm.engines.launch import transfer_config
        from dualpath.kv.hashing import KeySpace
        from dualpath.kv.layout import KVLayout
        from dualpath.model.spec import load_spec, model_id
        from dualpath.storage import open_store
        from dualpath.storage.client import StorageClient
        from dualpath.transfer.mooncake import MooncakeBackend

        self.args = args
        self.layout = KVLayout.from_spec(load_spec(args.model), "bfloat16", BLOCK_SIZE)
        self.storage = StorageConfig(backend="fs", root=args.store)
        mid = model_id(Path(args.model))
        self.space = KeySpace(mid, self.layout.vllm_layout_id, BLOCK_SIZE)
        self.client = StorageClient(open_store(self.storage, self.layout), BLOCK_SIZE,
                                    self.storage)
        self.backend = MooncakeBackend("127.0.0.1", "tcp")
        traffic = TrafficConfig(compute_recv_cap_mb_s=args.recv_cap_mb_s,
                                chunk_bytes=64 << 10, burst_chunks=1)
        self.prefill = LLM(**common, kv_transfer_config=transfer_config(
            storage=self.storage, role="prefill", model_id=mid, traffic=traffic,
            trace_path=args.trace))
        self.decode = LLM(**common, kv_transfer_config=transfer_config(
            storage=self.storage, role="decode", model_id=mid))

    def buffer(self, name: str, size: int):
        """A fresh zeroed buffer file (as a pool file is made), registered with Mooncake."""
        import torch

        path = f"/dev/shm/dualpath-pd-test-{os.getpid()}-{name}"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w+b") as file:
            file.truncate(size)
            mapped = mmap.mmap(file.fileno(), size)
        buffer = torch.frombuffer(mapped, dtype=torch.uint8)
        self.backend.register(buffer.data_ptr(), size)
        return path, mapped, buffer

    def read_hit(self, buffer, prompt: list[int], num_blocks: int) -> None:
        """The DE read path: the hit blocks from the store into the buffer."""
        layers = buffer[: num_blocks * self.layout.full_block_bytes].view(
            self.layout.num_layers, num_blocks, self.layout.layer_block_bytes)
        hit = self.args.hit_blocks
        ok = self.client.read(self.space.keys(prompt)[:hit],
                              [list(layers[:, b].unbind(0)) for b in range(hit)])
        assert all(ok), ok

    def wait_stored(self, prompt: list[int], num_blocks: int) -> None:
        """Until the decode side's saves of the prompt's first ``num_blocks`` have landed."""
        keys = self.space.keys(prompt)[:num_blocks]
        deadline = time.monotonic() + STORED_WAIT_S
        while self.client.exists_prefix(keys) < len(keys):
            assert time.monotonic() < deadline, "the miss run's blocks were never stored"
            time.sleep(0.1)

    def run(self, name: str, req_id: int, prompt: list[int]) -> dict:
        """One prompt through both instances on the read path ``name`` names."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        from dualpath.integrations.vllm.plan import SEAL_BYTES, seal_of, seal_offset

        read_path, hit = ("pe", 0) if name == "miss" else (name, self.args.hit_blocks)
        num_blocks = -(-len(prompt) // BLOCK_SIZE)
        where = seal_offset(num_blocks, self.layout.full_block_bytes)
        path, mapped, buffer = self.buffer(name, where + 4096)
        if read_path == "de" and hit:
            self.read_hit(buffer, prompt, num_blocks)
        params = {"dualpath": {"req_id": req_id, "read_path": read_path, "num_hit_blocks": hit,
                               "de_endpoint": self.backend.endpoint,
                               "de_buffer_addr": buffer.data_ptr(), "num_blocks": num_blocks,
                               "mode": self.args.mode}}
        first = self.prefill.generate([TokensPrompt(prompt_token_ids=prompt)], SamplingParams(
            temperature=0.0, max_tokens=1, extra_args={"kv_transfer_params": params}))[0]
        first_id = first.outputs[0].token_ids[0]
        sealed = bytes(mapped[where : where + SEAL_BYTES]) == seal_of(req_id)
        params = {"dualpath": {"req_id": req_id, "shm_path": path, "buffer_offset": 0,
                               "num_blocks": num_blocks, "num_tokens": len(prompt),
                               "num_stored_blocks": hit}}
        out = self.decode.generate([TokensPrompt(prompt_token_ids=[*prompt, first_id])],
                                   SamplingParams(temperature=0.0,
                                                  max_tokens=self.args.max_tokens - 1,
                                                  extra_args={"kv_transfer_params": params}))[0]
        os.unlink(path)
        if name == "miss":
            self.wait_stored(prompt, num_blocks - 1)  # the full blocks, before the hits
        return {"first": first_id, "output": [first_id, *out.outputs[0].token_ids],
                "sealed": sealed}


def run_plain(common: dict, prompt: list[int], max_tokens: int) -> dict:
    """The prompt on one plain vLLM instance, stopped after."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(**common)
    out = llm.generate([TokensPrompt(prompt_token_ids=prompt)],
                       SamplingParams(temperature=0.0, max_tokens=max_tokens))[0]
    del llm  # its engine core stops with it
    ids = list(out.outputs[0].token_ids)
    return {"first": ids[0], "output": ids}


def main() -> None:
    args = parse_args()
    prompt = json.loads(Path(args.prompt).read_text())
    common = dict(model=args.model, dtype="bfloat16", enforce_eager=True, max_model_len=1024,
                  block_size=BLOCK_SIZE, enable_prefix_caching=False, seed=0,
                  kv_cache_memory_bytes=1 << 30)  # not 92% of the memory: several run at once
    results: dict[str, dict] = {}
    runs = args.runs.split(",")
    if "plain" in runs:
        banner("plain")
        results["plain"] = run_plain(common, prompt, args.max_tokens)
    harness = PDHarness(args, common) if set(runs) - {"plain"} else None
    for req_id, name in enumerate((r for r in runs if r != "plain"), start=7):
        banner(name)
        results[name] = harness.run(name, req_id, prompt)
    args.out.write_text(json.dumps(results))


if __name__ == "__main__":
    main()
