"""``dualpath bench storage``: full-block reads and writes of the ``fs`` store.

Blocks have the default model's full-block size (64 tokens × 30 layers ≈ 1.5 MB). Our
``get_into`` (O_DIRECT, parallel workers, header and checksum verified) is compared with a raw
sequential O_DIRECT read of the same files with no parsing, interleaved chunk by chunk (who goes
first alternates) because a virtual disk's speed drifts by 2× within seconds. Writes are timed
up to ``os.sync()``, so they are durable.
"""

from __future__ import annotations

import argparse
import mmap
import os
import shutil
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import track
from rich.table import Table

from dualpath.bench.report import bar_chart, machine_profile, write_json
from dualpath.kv.hashing import KeySpace
from dualpath.kv.host_pool import HostPool
from dualpath.kv.layout import KVLayout
from dualpath.model.spec import load_spec
from dualpath.storage.block_file import HEADER_BYTES
from dualpath.storage.fs import O_DIRECT, FsStore


def _raw_read(paths: list[Path], file_bytes: int) -> float:
    """Seconds to read every file whole, one after another, with O_DIRECT."""
    buf = mmap.mmap(-1, file_bytes)
    start = time.perf_counter()
    for path in paths:
        fd = os.open(path, os.O_RDONLY | O_DIRECT)
        try:
            if os.preadv(fd, [buf], 0) != file_bytes:
                raise RuntimeError(f"short read of {path}")
        finally:
            os.close(fd)
    return time.perf_counter() - start


def _our_read(store: FsStore, keys, buffers) -> float:
    start = time.perf_counter()
    ok = store.get_into(keys, buffers)
    elapsed = time.perf_counter() - start
    if not all(ok):
        raise RuntimeError(f"{ok.count(False)} blocks failed to read back")
    return elapsed


def _interleaved_reads(store, keys, buffers, paths, layout, args) -> tuple[float, float]:
    """Total seconds of our reads and of raw reads over ``rounds`` passes, chunk by chunk."""
    ours = raw = 0.0
    file_bytes = HEADER_BYTES + layout.full_block_bytes
    chunks = [slice(c, c + args.chunk_blocks) for c in range(0, len(keys), args.chunk_blocks)]
    steps = [(r, i, c) for r in range(args.rounds) for i, c in enumerate(chunks)]
    for r, i, chunk in track(steps, description="read rounds"):
        ours_first = (r + i) % 2 == 0
        if not ours_first:
            raw += _raw_read(paths[chunk], file_bytes)
        ours += _our_read(store, keys[chunk], buffers[chunk])
        if ours_first:
            raw += _raw_read(paths[chunk], file_bytes)
    return ours, raw


def run_storage_bench(args: argparse.Namespace) -> dict:
    """Write blocks, then time alternating read rounds; print, write JSON and PNG."""
    from dualpath.model.default_model import cache_dir, resolve_model

    spec = load_spec(resolve_model(args.model))
    layout = KVLayout.from_spec(spec, "bfloat16", 64)
    root = Path(args.dir) if args.dir else cache_dir() / "bench-storage"
    shutil.rmtree(root, ignore_errors=True)
    keys = KeySpace("bench", layout.layout_id, layout.block_size).keys(
        list(range(args.blocks * layout.block_size)))
    pool = HostPool(layout.full_block_bytes, args.blocks, pin=False)
    pool.slab.copy_(torch.randint(0, 256, (pool.nbytes,), dtype=torch.uint8))
    buffers = [pool.buffer(s) for s in pool.alloc(args.blocks)]
    total_bytes = args.blocks * layout.full_block_bytes
    with FsStore(root, layout, o_direct=True, workers=args.workers) as store:
        start = time.perf_counter()
        if not all(store.put_from(keys, buffers)):
            raise RuntimeError("writes failed")
        os.sync()
        write_s = time.perf_counter() - start
        paths = [store.path_for(k) for k in keys]
        ours, raw = _interleaved_reads(store, keys, buffers, paths, layout, args)
    if not args.keep:
        shutil.rmtree(root, ignore_errors=True)
    result = _result(args, layout, root, total_bytes, write_s, ours, raw)
    _report(result, Path(args.json))
    return result


def _result(args, layout, root, total_bytes, write_s, ours, raw) -> dict:
    read_gb_s = args.rounds * total_bytes / ours / 1e9
    raw_gb_s = args.rounds * total_bytes / raw / 1e9
    return {
        "benchmark": "storage",
        "setup": {"blocks": args.blocks, "block_bytes": layout.full_block_bytes,
                  "layout": layout.layout_id, "workers": args.workers, "rounds": args.rounds,
                  "chunk_blocks": args.chunk_blocks,
                  "root": str(root), "o_direct": bool(O_DIRECT)},
        "machine": machine_profile(),
        "measured": {"read_s": ours, "raw_read_s": raw, "write_s": write_s},
        "summary": {"read_gb_s": read_gb_s, "raw_read_gb_s": raw_gb_s,
                    "read_ratio_vs_raw": read_gb_s / raw_gb_s,
                    "write_gb_s": total_bytes / write_s / 1e9},
    }


def _report(result: dict, out: Path) -> None:
    s = result["summary"]
    table = Table(title=f"storage benchmark ({result['setup']['blocks']} full blocks of "
                        f"{result['setup']['block_bytes'] / 1e6:.2f} MB)")
    for col in ("metric", "GB/s"):
        table.add_column(col)
    table.add_row("read, dualpath fs (O_DIRECT, verified)", f"{s['read_gb_s']:.2f}")
    table.add_row("read, raw sequential O_DIRECT", f"{s['raw_read_gb_s']:.2f}")
    table.add_row("read ratio (ours / raw)", f"{s['read_ratio_vs_raw']:.2f}")
    table.add_row("write, durable (to os.sync)", f"{s['write_gb_s']:.2f}")
    Console().print(table)
    write_json(out, result)
    bar_chart(out.with_suffix(".png"), "fs store throughput (full blocks)",
              ["read", "write"],
              {"dualpath fs": [s["read_gb_s"] * 1000, s["write_gb_s"] * 1000],
               "raw O_DIRECT": [s["raw_read_gb_s"] * 1000, 0.0]}, "MB/s")
