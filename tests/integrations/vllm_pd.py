"""One prompt through a prefill and a decode vLLM instance with dualpath's connector, the
decode engine's buffer hosted here (run by the peers' python, not by pytest).

What a dualpath decode engine does around the two instances, in one process: a layer-major
buffer in a shared-memory file registered with Mooncake; on the DE read path the hit blocks are
read from the store into it; the prefill instance (``max_tokens=1``) loads the hit (PE: store,
DE: pulled from the buffer) and pushes the prompt's KV into the buffer layer by layer, then
seals it; the decode instance copies the buffer in and decodes ``prompt + [first token]``.
Writes ``{"first": id, "output": ids, "sealed": bool}``; ``--plain`` runs plain vLLM instead.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
from pathlib import Path

BLOCK_SIZE = 32


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--prompt", required=True, help="a JSON file with token ids")
    parser.add_argument("--store", required=True)
    parser.add_argument("--read-path", default="pe")
    parser.add_argument("--hit-blocks", type=int, default=0)
    parser.add_argument("--mode", default="layerwise")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--plain", action="store_true")
    parser.add_argument("--trace", default="", help="the prefill connector's hook trace file")
    parser.add_argument("--recv-cap-mb-s", type=float, default=None,
                        help="cap the prefill's compute-NIC receive side (NIC emulation)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    prompt = json.loads(Path(args.prompt).read_text())

    import torch
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    common = dict(model=args.model, dtype="bfloat16", enforce_eager=True, max_model_len=1024,
                  block_size=BLOCK_SIZE, enable_prefix_caching=False, seed=0,
                  kv_cache_memory_bytes=1 << 30)  # not 92% of the memory: two run at once
    if args.plain:
        llm = LLM(**common)
        out = llm.generate([TokensPrompt(prompt_token_ids=prompt)],
                           SamplingParams(temperature=0.0, max_tokens=args.max_tokens))[0]
        ids = list(out.outputs[0].token_ids)
        args.out.write_text(json.dumps({"first": ids[0], "output": ids}))
        return

    from dualpath.config import StorageConfig, TrafficConfig
    from dualpath.integrations.vllm_launch import transfer_config
    from dualpath.integrations.vllm_plan import SEAL_BYTES, seal_of, seal_offset
    from dualpath.kv.hashing import KeySpace
    from dualpath.kv.layout import KVLayout
    from dualpath.model.spec import load_spec, model_id
    from dualpath.storage import open_store
    from dualpath.storage.client import StorageClient
    from dualpath.transfer.mooncake import MooncakeBackend

    spec = load_spec(args.model)
    layout = KVLayout.from_spec(spec, "bfloat16", BLOCK_SIZE)
    num_blocks = -(-len(prompt) // BLOCK_SIZE)
    shm = f"/dev/shm/dualpath-pd-test-{os.getpid()}"
    size = seal_offset(num_blocks, layout.full_block_bytes) + 4096
    fd = os.open(shm, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)  # as a pool file is made
    with os.fdopen(fd, "w+b") as file:
        file.truncate(size)
        mapped = mmap.mmap(file.fileno(), size)
    buffer = torch.frombuffer(mapped, dtype=torch.uint8)
    backend = MooncakeBackend("127.0.0.1", "tcp")
    backend.register(buffer.data_ptr(), size)
    storage = StorageConfig(backend="fs", root=args.store)
    mid = model_id(Path(args.model))
    if args.read_path == "de" and args.hit_blocks:
        space = KeySpace(mid, layout.vllm_layout_id, BLOCK_SIZE)
        client = StorageClient(open_store(storage, layout), BLOCK_SIZE, storage)
        layers = buffer[: num_blocks * layout.full_block_bytes].view(
            layout.num_layers, num_blocks, layout.layer_block_bytes)
        keys = space.keys(prompt)[: args.hit_blocks]
        ok = client.read(keys, [list(layers[:, b].unbind(0)) for b in range(args.hit_blocks)])
        assert all(ok), ok
        client.close()
    config = transfer_config(storage=storage, role="prefill", model_id=mid,
                             traffic=TrafficConfig(compute_recv_cap_mb_s=args.recv_cap_mb_s,
                                                   chunk_bytes=64 << 10, burst_chunks=1),
                             trace_path=args.trace)
    prefill = LLM(**common, kv_transfer_config=config)
    params = {"dualpath": {"req_id": 7, "read_path": args.read_path,
                           "num_hit_blocks": args.hit_blocks, "de_endpoint": backend.endpoint,
                           "de_buffer_addr": buffer.data_ptr(), "num_blocks": num_blocks,
                           "mode": args.mode}}
    first = prefill.generate([TokensPrompt(prompt_token_ids=prompt)], SamplingParams(
        temperature=0.0, max_tokens=1, extra_args={"kv_transfer_params": params}))[0]
    first_id = first.outputs[0].token_ids[0]
    where = seal_offset(num_blocks, layout.full_block_bytes)
    sealed = bytes(mapped[where : where + SEAL_BYTES]) == seal_of(7)
    del prefill
    decode = LLM(**common, kv_transfer_config=transfer_config(storage=storage, role="decode",
                                                               model_id=mid))
    params = {"dualpath": {"req_id": 7, "shm_path": shm, "buffer_offset": 0,
                           "num_blocks": num_blocks, "num_tokens": len(prompt),
                           "num_stored_blocks": args.hit_blocks}}
    out = decode.generate([TokensPrompt(prompt_token_ids=[*prompt, first_id])], SamplingParams(
        temperature=0.0, max_tokens=args.max_tokens - 1,
        extra_args={"kv_transfer_params": params}))[0]
    ids = [first_id, *out.outputs[0].token_ids]
    args.out.write_text(json.dumps({"first": first_id, "output": ids, "sealed": sealed}))
    os.unlink(shm)


if __name__ == "__main__":
    main()
