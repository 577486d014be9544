"""``dualpath bench storage``: full-block reads and writes of the stores, side by side.

Blocks have the default model's full-block size (64 tokens × 30 layers ≈ 1.5 MB). The same
blocks are written to every backend of ``--backends`` (``fs``, ``mooncake_store``) and read
back in rounds. Our ``fs`` ``get_into`` (O_DIRECT, parallel workers, header and checksum
verified) is also compared with a raw sequential O_DIRECT read of the same files with no
parsing. Reads are interleaved chunk by chunk, the order rotating, because a virtual disk's
speed drifts by 2× within seconds. ``fs`` writes are timed up to ``os.sync()``, so they are
durable; ``mooncake_store`` writes end in the memory of a segment holder that the bench starts
(with its master) and stops, reached over Mooncake TCP on loopback.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from rich.console import Console
from rich.progress import track
from rich.table import Table

from dualpath.bench.report import bar_chart, machine_profile, write_json
from dualpath.kv.hashing import KeySpace
from dualpath.kv.host_pool import HostPool
from dualpath.kv.layout import KVLayout
from dualpath.model.spec import load_spec
from dualpath.storage.base import StorageBackend
from dualpath.storage.block_file import HEADER_BYTES
from dualpath.storage.fs import O_DIRECT, FsStore

if TYPE_CHECKING:
    from argparse import ArgumentParser

BACKENDS = ("fs", "mooncake_store")
RAW = "raw"  # the raw O_DIRECT reader of the fs files
MOONCAKE_FILL = 0.8  # the master evicts at 90% of the segments: keep the blocks below that
Reader = Callable[[slice], float]  # reads one chunk of the blocks; returns seconds


def parse_backends(text: str) -> list[str]:
    """The comma-separated backends of ``--backends``, checked against ``BACKENDS``."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = sorted(set(names) - set(BACKENDS))
    if unknown or not names:
        raise ValueError(f"--backends: unknown {unknown or 'none given'} "
                         f"(of {', '.join(BACKENDS)})")
    return list(dict.fromkeys(names))


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


def _store_read(store: StorageBackend, keys: list, buffers: list) -> float:
    start = time.perf_counter()
    ok = store.get_into(keys, buffers)
    elapsed = time.perf_counter() - start
    if not all(ok):
        raise RuntimeError(f"{ok.count(False)} blocks failed to read back")
    return elapsed


def _write(name: str, store: StorageBackend, keys: list, buffers: list) -> float:
    """Seconds to store every block (fs: up to ``os.sync()``, so durably)."""
    start = time.perf_counter()
    if not all(store.put_from(keys, buffers)):
        raise RuntimeError(f"{name}: writes failed")
    if name == "fs":
        os.sync()
    return time.perf_counter() - start


def _interleaved_reads(readers: dict[str, Reader], num_blocks: int,
                       options: StorageBenchOptions) -> dict[str, float]:
    """Total read seconds per reader over ``rounds`` passes, chunk by chunk, each chunk read
    by every reader in an order that rotates from chunk to chunk."""
    seconds = dict.fromkeys(readers, 0.0)
    names = list(readers)
    step = options.chunk_blocks
    chunks = [slice(c, c + step) for c in range(0, num_blocks, step)]
    steps = [(r, i, c) for r in range(options.rounds) for i, c in enumerate(chunks)]
    for r, i, chunk in track(steps, description="read rounds"):
        shift = (r + i) % len(names)
        for name in names[shift:] + names[:shift]:
            seconds[name] += readers[name](chunk)
    return seconds


def _open_stores(stack: contextlib.ExitStack, backends: list[str], layout: KVLayout,
                 root: Path, options: StorageBenchOptions) -> dict[str, StorageBackend]:
    """Each backend's store; ``mooncake_store`` with a master and segment holder of its own."""
    stores: dict[str, StorageBackend] = {}
    for name in backends:
        if name == "fs":
            stores[name] = stack.enter_context(
                FsStore(root, layout, o_direct=True, workers=options.workers))
            continue
        from dualpath.storage.mooncake_service import local_mooncake
        from dualpath.storage.mooncake_store import MooncakeStore

        object_bytes = options.blocks * (HEADER_BYTES + layout.full_block_bytes)
        segment_mb = -(-object_bytes // int(MOONCAKE_FILL * (1 << 20))) + 16
        master = stack.enter_context(local_mooncake(segment_mb, log_dir=root / "mooncake-logs"))
        stores[name] = stack.enter_context(MooncakeStore(layout, master=master,
                                                         key_prefix="bench"))
    return stores


def _readers(stores: dict[str, StorageBackend], keys: list, buffers: list,
             layout: KVLayout) -> dict[str, Reader]:
    readers: dict[str, Reader] = {
        name: (lambda chunk, store=store: _store_read(store, keys[chunk], buffers[chunk]))
        for name, store in stores.items()}
    fs = stores.get("fs")
    if isinstance(fs, FsStore):
        paths = [fs.path_for(k) for k in keys]
        file_bytes = HEADER_BYTES + layout.full_block_bytes
        readers[RAW] = lambda chunk: _raw_read(paths[chunk], file_bytes)
    return readers


@dataclass(frozen=True)
class StorageBenchOptions:
    """The ``dualpath bench storage`` command line."""

    json: str
    backends: str = "fs"
    model: str | None = None
    dir: str | None = None
    blocks: int = 256
    rounds: int = 4
    chunk_blocks: int = 32
    workers: int = 4
    keep: bool = False


def add_arguments(parser: ArgumentParser) -> None:
    """The options of :class:`StorageBenchOptions`."""
    parser.add_argument("--json", required=True, help="where to write the results")
    parser.add_argument("--backends", default="fs",
                        help="comma-separated: fs, mooncake_store (starts its own master and "
                        "segment holder); the same blocks on each, reads side by side")
    parser.add_argument("--model", default=None, help="model whose full-block size to use")
    parser.add_argument("--dir", default=None,
                        help="store folder (default: cache/bench-storage)")
    parser.add_argument("--blocks", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--chunk-blocks", type=int, default=32,
                        help="blocks per interleaved chunk")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--keep", action="store_true", help="keep the files afterwards")


def run(options: StorageBenchOptions) -> int:
    """``dualpath bench storage``."""
    run_storage_bench(options)
    return 0


def run_storage_bench(options: StorageBenchOptions) -> dict:
    """Write the blocks to each backend, then time interleaved read rounds; print, write JSON
    and PNG."""
    from dualpath.model.default_model import cache_dir, resolve_model

    backends = parse_backends(options.backends)
    spec = load_spec(resolve_model(options.model))
    layout = KVLayout.from_spec(spec, "bfloat16", 64)
    root = Path(options.dir) if options.dir else cache_dir() / "bench-storage"
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    keys = KeySpace("bench", layout.layout_id, layout.block_size).keys(
        list(range(options.blocks * layout.block_size)))
    pool = HostPool(layout.full_block_bytes, options.blocks, pin=False)
    pool.slab.copy_(torch.randint(0, 256, (pool.nbytes,), dtype=torch.uint8))
    buffers = [pool.buffer(s) for s in pool.alloc(options.blocks)]
    with contextlib.ExitStack() as stack:
        stores = _open_stores(stack, backends, layout, root, options)
        write_s = {name: _write(name, store, keys, buffers) for name, store in stores.items()}
        read_s = _interleaved_reads(_readers(stores, keys, buffers, layout), len(keys), options)
    if not options.keep:
        shutil.rmtree(root, ignore_errors=True)
    total_bytes = options.blocks * layout.full_block_bytes
    result = _result(options, backends, layout, root, total_bytes, write_s, read_s)
    _report(result, Path(options.json))
    return result


def _result(options: StorageBenchOptions, backends: list[str], layout: KVLayout, root: Path,
            total_bytes: int, write_s: dict[str, float], read_s: dict[str, float]) -> dict:
    read_bytes = options.rounds * total_bytes
    summary: dict[str, float] = {}
    for name in backends:
        summary[f"read_gb_s_{name}"] = read_bytes / read_s[name] / 1e9
        summary[f"write_gb_s_{name}"] = total_bytes / write_s[name] / 1e9
    if "fs" in backends:  # the fs figures under their original names, and raw O_DIRECT
        summary["read_gb_s"] = summary["read_gb_s_fs"]
        summary["write_gb_s"] = summary["write_gb_s_fs"]
        summary["raw_read_gb_s"] = read_bytes / read_s[RAW] / 1e9
        summary["read_ratio_vs_raw"] = summary["read_gb_s"] / summary["raw_read_gb_s"]
    if {"fs", "mooncake_store"} <= set(backends):
        summary["read_ratio_mooncake_store_vs_fs"] = (summary["read_gb_s_mooncake_store"]
                                                      / summary["read_gb_s_fs"])
    return {
        "benchmark": "storage",
        "setup": {"backends": backends, "blocks": options.blocks,
                  "block_bytes": layout.full_block_bytes, "layout": layout.layout_id,
                  "workers": options.workers, "rounds": options.rounds,
                  "chunk_blocks": options.chunk_blocks, "root": str(root),
                  "o_direct": bool(O_DIRECT),
                  "mooncake_store": "master + 1 segment holder on this host, TCP loopback"},
        "machine": machine_profile(),
        "measured": {"read_s": read_s, "write_s": write_s},
        "summary": summary,
    }


def _report(result: dict, out: Path) -> None:
    s, backends = result["summary"], result["setup"]["backends"]
    table = Table(title=f"storage benchmark ({result['setup']['blocks']} full blocks of "
                        f"{result['setup']['block_bytes'] / 1e6:.2f} MB)")
    for col in ("metric", "GB/s"):
        table.add_column(col)
    for label, value in _rows(s, backends):
        table.add_row(label, f"{value:.2f}")
    Console().print(table)
    write_json(out, result)
    series = {name: [s[f"read_gb_s_{name}"] * 1000, s[f"write_gb_s_{name}"] * 1000]
              for name in backends}
    if "fs" in backends:
        series["raw O_DIRECT"] = [s["raw_read_gb_s"] * 1000, 0.0]
    bar_chart(out.with_suffix(".png"), "store throughput (full blocks)", ["read", "write"],
              series, "MB/s")


def _rows(s: dict[str, Any], backends: list[str]) -> list[tuple[str, float]]:
    """The table's rows: reads side by side, then ratios, then writes."""
    what = {"fs": "dualpath fs (O_DIRECT, verified)",
            "mooncake_store": "dualpath mooncake_store (TCP, verified)"}
    rows = [(f"read, {what[name]}", s[f"read_gb_s_{name}"]) for name in backends]
    if "fs" in backends:
        rows += [("read, raw sequential O_DIRECT", s["raw_read_gb_s"]),
                 ("read ratio (fs / raw)", s["read_ratio_vs_raw"])]
    if "read_ratio_mooncake_store_vs_fs" in s:
        rows.append(("read ratio (mooncake_store / fs)", s["read_ratio_mooncake_store_vs_fs"]))
    durable = {"fs": "durable (to os.sync)", "mooncake_store": "in the holder's memory"}
    rows += [(f"write, {name}, {durable[name]}", s[f"write_gb_s_{name}"]) for name in backends]
    return rows
