"""``dualpath bench transfer``: layer blocks vs one large transfer over Mooncake (TCP).

Two OS processes (``multiprocessing`` spawn; the peer sends its endpoint and buffer address
over a pipe as JSON), each with its own Mooncake Transfer Engine. The sender writes the same
bytes — ``blocks`` full blocks of the model — four ways, interleaved round by round with the
order rotating, because loopback TCP speed drifts:

* ``large``: one segment of all the bytes, one backend call (``large_tm``: the same through
  the ``TrafficManager``);
* ``layer_tm``: what layerwise prefill sends — every layer block (64 tokens of one layer, 48 KB
  for SmolLM2) from a paged cache into a layer-major DE buffer, one submission per layer through
  the ``TrafficManager``, which coalesces a layer's adjacent blocks into one segment;
* ``layer``: the same layer blocks between full blocks laid back to back, each its own segment,
  in ONE batched backend call — the per-block-segment alternative, kept for comparison.

Before timing, the receiver's buffer is read back after each layout's write and compared with
what was sent, so every byte really moves where it should.
"""

from __future__ import annotations

import ctypes
import json
import mmap
import multiprocessing as mp
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console
from rich.progress import track
from rich.table import Table

from dualpath.bench.report import bar_chart, machine_profile, write_json
from dualpath.config import TrafficConfig
from dualpath.errors import TransferError
from dualpath.kv.layout import KVLayout
from dualpath.traffic.lanes import Lane
from dualpath.traffic.manager import TrafficManager
from dualpath.transfer.base import Segment

if TYPE_CHECKING:
    from argparse import ArgumentParser

VARIANTS = ("large", "layer", "large_tm", "layer_tm")
PEER_START_S = 60.0


def _address(buf: mmap.mmap) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(buf))


def _peer_main(conn: Connection, nbytes: int) -> None:
    """The receiving process: register a buffer, announce it, serve until told to stop."""
    from dualpath.transfer.mooncake import MooncakeBackend

    backend = MooncakeBackend()
    buf = mmap.mmap(-1, nbytes)
    backend.register(_address(buf), nbytes)
    conn.send_bytes(json.dumps({"endpoint": backend.endpoint, "addr": _address(buf)}).encode())
    conn.recv_bytes()
    backend.close()


class _Peer:
    """The receiver process and what it announced."""

    def __init__(self, nbytes: int) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_peer_main, args=(child, nbytes), daemon=True)
        self.proc.start()
        if not self.conn.poll(PEER_START_S):
            self.stop()
            raise TransferError("the benchmark's peer process did not start")
        info = json.loads(self.conn.recv_bytes())
        self.endpoint: str = info["endpoint"]
        self.addr: int = info["addr"]

    def stop(self) -> None:
        if self.proc.is_alive():
            self.conn.send_bytes(b"stop")
            self.proc.join(30)
        if self.proc.is_alive():
            self.proc.kill()


def layer_segments(layout: KVLayout, blocks: int, src: int, dst: int) -> list[Segment]:
    """One segment per (layer, block) between full blocks laid back to back on both sides."""
    lb, fb = layout.layer_block_bytes, layout.full_block_bytes
    return [(src + j * fb + i * lb, dst + j * fb + i * lb, lb)
            for i in range(layout.num_layers) for j in range(blocks)]


def engine_layer_segments(layout: KVLayout, blocks: int, src: int,
                          dst: int) -> list[list[Segment]]:
    """Per layer, the layer blocks the engine sends: from a paged cache with room for
    ``2 × blocks`` blocks per layer (blocks 0..n-1 in use) into a layer-major DE buffer."""
    lb, n = layout.layer_block_bytes, blocks
    return [[(src + (i * 2 * n + j) * lb, dst + (i * n + j) * lb, lb) for j in range(n)]
            for i in range(layout.num_layers)]


def _expected_engine_layout(src: mmap.mmap, layout: KVLayout, blocks: int) -> bytes:
    lb, n = layout.layer_block_bytes, blocks
    return b"".join(src[(i * 2 * n + j) * lb : (i * 2 * n + j + 1) * lb]
                    for i in range(layout.num_layers) for j in range(n))


def _timed_rounds(ops: dict[str, Callable[[], None]], repeats: int) -> dict[str, list[float]]:
    """Seconds of each op per round; one untimed warm-up round; order rotates each round."""
    for op in ops.values():
        op()  # warm-up: handshake, page faults
    times: dict[str, list[float]] = {name: [] for name in ops}
    names = list(ops)
    for r in track(range(repeats), description="transfer rounds"):
        for k in range(len(names)):
            name = names[(r + k) % len(names)]
            start = time.perf_counter()
            ops[name]()
            times[name].append(time.perf_counter() - start)
    return times


def _measure(layout: KVLayout, blocks: int, repeats: int) -> dict[str, list[float]]:
    """Start the peer, check each variant moves the right bytes, time them, stop the peer."""
    from dualpath.transfer.mooncake import MooncakeBackend

    total = blocks * layout.full_block_bytes
    src, check = mmap.mmap(-1, 2 * total), mmap.mmap(-1, total)
    src[:] = os.urandom(2 * total)
    peer = _Peer(total)
    backend = MooncakeBackend()
    try:
        s_addr, c_addr = _address(src), _address(check)
        backend.register(s_addr, 2 * total)
        backend.register(c_addr, total)
        large = [(s_addr, peer.addr, total)]
        per_block = layer_segments(layout, blocks, s_addr, peer.addr)
        per_layer = engine_layer_segments(layout, blocks, s_addr, peer.addr)
        with TrafficManager(backend, TrafficConfig()) as tm:
            ops: dict[str, Callable[[], None]] = {
                "large": lambda: backend.write(peer.endpoint, large),
                "layer": lambda: backend.write(peer.endpoint, per_block),
                "large_tm": lambda: tm.write(peer.endpoint, large, Lane.KV_FORWARD),
                "layer_tm": lambda: _per_layer(tm, peer.endpoint, per_layer),
            }
            def read_back() -> bytes:
                backend.read(peer.endpoint, [(c_addr, peer.addr, total)])
                return check[:]

            _verify(ops["layer_tm"], read_back, _expected_engine_layout(src, layout, blocks))
            _verify(ops["layer"], read_back, src[:total])
            times = _timed_rounds(ops, repeats)
    finally:
        peer.stop()
        backend.close()
    return times


def _per_layer(tm: TrafficManager, peer: str, per_layer: list[list[Segment]]) -> None:
    """What layerwise prefill does: one submission per layer, all in flight, then wait."""
    futures = [tm.submit("write", peer, segs, Lane.KV_FORWARD) for segs in per_layer]
    for future in futures:
        future.result()


def _verify(op: Callable[[], None], read_back: Callable[[], bytes], expected: bytes) -> None:
    op()
    if read_back() != expected:
        raise TransferError("the peer's buffer does not hold the bytes that were written")


@dataclass(frozen=True)
class TransferBenchOptions:
    """The ``dualpath bench transfer`` command line."""

    json: str
    model: str | None = None
    blocks: int = 32
    repeats: int = 10


def add_arguments(parser: ArgumentParser) -> None:
    """The options of :class:`TransferBenchOptions`."""
    parser.add_argument("--json", required=True, help="where to write the results")
    parser.add_argument("--model", default=None, help="model whose layer-block size to use")
    parser.add_argument("--blocks", type=int, default=32,
                        help="full blocks (x layers = segments)")
    parser.add_argument("--repeats", type=int, default=10, help="timed rounds")


def run(options: TransferBenchOptions) -> int:
    """``dualpath bench transfer``."""
    run_transfer_bench(options)
    return 0


def run_transfer_bench(options: TransferBenchOptions) -> dict:
    """Measure, then print a table and write the JSON and PNG."""
    from dualpath.model.default_model import resolve_model
    from dualpath.model.spec import load_spec

    layout = KVLayout.from_spec(load_spec(resolve_model(options.model)), "bfloat16", 64)
    times = _measure(layout, options.blocks, options.repeats)
    result = _result(options, layout, times)
    _report(result, Path(options.json))
    return result


def _result(options: TransferBenchOptions, layout: KVLayout, times: dict[str, list[float]]) -> dict:
    total = options.blocks * layout.full_block_bytes
    gb_s = {name: total * len(ts) / sum(ts) / 1e9 for name, ts in times.items()}
    return {
        "benchmark": "transfer",
        "setup": {"backend": "mooncake", "protocol": "tcp", "processes": 2,
                  "layers": layout.num_layers, "blocks": options.blocks,
                  "segments": layout.num_layers * options.blocks,
                  "segment_bytes": layout.layer_block_bytes, "total_bytes": total,
                  "repeats": options.repeats, "chunk_bytes": TrafficConfig().chunk_bytes,
                  "inflight_chunks": TrafficConfig().inflight_chunks,
                  "layout": layout.layout_id},
        "machine": machine_profile(),
        "measured": {"seconds": times, "gb_s": gb_s},
        "summary": {"large_gb_s": gb_s["large"], "layer_block_gb_s": gb_s["layer_tm"],
                    "layer_block_ratio_vs_large": gb_s["layer_tm"] / gb_s["large"],
                    "per_block_segments_gb_s": gb_s["layer"],
                    "per_block_segments_ratio_vs_large": gb_s["layer"] / gb_s["large"],
                    "large_tm_gb_s": gb_s["large_tm"]},
    }


def _report(result: dict, out: Path) -> None:
    s, setup = result["summary"], result["setup"]
    table = Table(title=f"transfer benchmark: {setup['total_bytes'] / 1e6:.1f} MB as one "
                        f"segment or {setup['segments']} layer blocks of "
                        f"{setup['segment_bytes'] / 1e3:.1f} KB (Mooncake TCP, 2 processes)")
    for col in ("transfer", "GB/s", "vs large"):
        table.add_column(col)
    rows = [("one large segment (backend)", s["large_gb_s"]),
            ("one large segment (traffic manager)", s["large_tm_gb_s"]),
            ("layer blocks as the engine sends them: per layer, coalesced (traffic manager)",
             s["layer_block_gb_s"]),
            ("layer blocks as separate segments, one batch (backend)",
             s["per_block_segments_gb_s"])]
    for name, value in rows:
        table.add_row(name, f"{value:.2f}", f"{value / s['large_gb_s']:.2f}")
    Console().print(table)
    write_json(out, result)
    bar_chart(out.with_suffix(".png"), "Mooncake TCP loopback, two processes",
              ["one large segment", "layer blocks"],
              {"backend": [s["large_gb_s"] * 1000, s["per_block_segments_gb_s"] * 1000],
               "traffic manager": [s["large_tm_gb_s"] * 1000, s["layer_block_gb_s"] * 1000]},
              "MB/s")
