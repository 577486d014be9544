"""A measured ``dualpath demo`` run (the JSON it writes, ``results/demo.json``) as the
simulator reads it: the testbed's configuration, its agents' timed turns, and what each mode
measured. Pure: ``json`` and ``pathlib`` only.

What is read, and from where in the demo's JSON (``bench/demo.py::_result``):

- cores: ``machine.cpus``; engines: ``cluster.prefill`` and ``cluster.decode`` (one node each);
- KV bytes per token: ``summary.regime.kv_bytes_per_token``; NIC caps: ``caps_mb_s``;
- per mode (``modes`` and ``rows``): JCT, hit and prompt tokens, the prefill engines' compute
  (forward time less layer waits), forwards and computed tokens, and the bytes each node's
  storage NIC read (``rows[i].nodes``);
- per mode, optionally, the engine processes' CPU-seconds over the timed part at
  ``rows[i].cpu_s`` (a number, or a mapping of numbers, e.g. by role, which are summed); the
  demo does not write it yet, and the model falls back on measured defaults without it;
- the agents' timed turns from the first mode that reuses KV (``rows[i].records``: prompt and
  hit tokens per turn). Generated tokens per turn follow from the record's timings: ``tpot_s``
  is (last token − first token) / (tokens − 1), so tokens = 1 + (latency − TTFT) / TPOT, and 1
  when ``tpot_s`` is null.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dualpath.vocab import Mode, Role
from dualpath.workloads.turns import Turn


class DemoRunError(ValueError):
    """A JSON that is not a ``dualpath demo`` result the simulator can read (names the file)."""


@dataclass(frozen=True)
class ModeRun:
    """What one mode measured over the timed part."""

    mode: str
    jct_s: float
    hit_tokens: int
    prompt_tokens: int
    pe_computed_tokens: int  # tokens the prefill engines' forwards computed
    pe_compute_s: float  # their forward time less the waits for layer loads and sends
    pe_forwards: int
    pe_read_bytes: int  # through the prefill nodes' storage NICs
    de_read_bytes: int  # through the decode nodes'
    cpu_s: float | None  # engine processes' CPU-seconds (None: not in the JSON)

    @property
    def read_bytes(self) -> int:
        """Bytes read by every node's storage NIC together."""
        return self.pe_read_bytes + self.de_read_bytes


@dataclass(frozen=True)
class DemoRun:
    """The testbed's configuration and its measured modes."""

    path: str
    model: str
    cpu_model: str
    cores: int
    prefill_engines: int
    decode_engines: int
    block_size: int
    kv_bytes_per_token: int
    read_cap_mb_s: float
    compute_cap_mb_s: float
    agents: tuple[tuple[Turn, ...], ...]  # each agent's timed turns (prompt, hit, gen)
    modes: Mapping[str, ModeRun]
    raw_modes: Mapping[str, Mapping[str, Any]]  # the JSON's ``modes`` (for ``ladder_regime``)

    @property
    def computed_tokens(self) -> int:
        """Prompt tokens the timed turns compute (not hits)."""
        return sum(t.miss for turns in self.agents for t in turns)

    @property
    def decode_tokens(self) -> int:
        """Tokens the decode engines generated: each turn's first token is the prefill's."""
        return sum(t.gen - 1 for turns in self.agents for t in turns)

    def describe(self) -> str:
        """``1 PE + 2 DE on 2 cores, SmolLM2 (float32 KV 46,080 B/token), block 16, ...``."""
        return (f"{self.prefill_engines} PE + {self.decode_engines} DE on {self.cores} cores, "
                f"{self.model}, {self.kv_bytes_per_token:,} KV B/token, block "
                f"{self.block_size}, storage NIC {self.read_cap_mb_s:g} MB/s per node, "
                f"{len(self.agents)} agents x {max(map(len, self.agents), default=0)} "
                "timed turns")


def generated_tokens(record: Mapping[str, Any]) -> int:
    """Tokens a turn generated, from its record's timings (module docstring)."""
    tpot = record.get("tpot_s")
    if not tpot:
        return 1
    return 1 + round((float(record["latency_s"]) - float(record["ttft_s"])) / float(tpot))


def cpu_seconds(value: Any) -> float | None:
    """``rows[i].cpu_s``: a number, a mapping of numbers (summed), or absent (None)."""
    if value is None:
        return None
    if isinstance(value, Mapping):
        return float(sum(float(v) for v in value.values()))
    return float(value)


def _mode_run(row: Mapping[str, Any], summary: Mapping[str, Any]) -> ModeRun:
    """One mode's figures from its row (``nodes``) and its ``modes`` summary."""
    pes = [n for n in row["nodes"] if n["role"] == Role.PREFILL]
    des = [n for n in row["nodes"] if n["role"] == Role.DECODE]
    return ModeRun(
        mode=str(row["mode"]), jct_s=float(row["jct_s"]),
        hit_tokens=int(summary["hit_tokens"]), prompt_tokens=int(summary["prompt_tokens"]),
        pe_computed_tokens=sum(int(n["computed_tokens"]) for n in pes),
        pe_compute_s=sum(float(n["compute_s"]) for n in pes),
        pe_forwards=sum(int(n.get("forwards", 0)) for n in pes),
        pe_read_bytes=sum(int(n["read_bytes"]) for n in pes),
        de_read_bytes=sum(int(n["read_bytes"]) for n in des),
        cpu_s=cpu_seconds(row.get("cpu_s")))


def _agents(rows: list[Mapping[str, Any]]) -> tuple[tuple[Turn, ...], ...]:
    """The agents' timed turns, from the first mode that reuses KV (as ``ladder_regime``
    takes its hit rate), else the first mode."""
    row = next((r for r in rows if r["mode"] != Mode.RECOMPUTE), rows[0])
    return tuple(tuple(Turn(int(t["prompt_tokens"]), int(t["hit_tokens"]), generated_tokens(t))
                       for t in agent) for agent in row["records"])


def parse_demo_run(data: Mapping[str, Any], path: str = "<demo JSON>") -> DemoRun:
    """A :class:`DemoRun` of a demo result already parsed from JSON (DemoRunError naming
    ``path`` and the missing key when it is not one)."""
    try:
        rows = list(data["rows"])
        if not rows:
            raise DemoRunError(f"{path}: no mode ran")
        cluster, caps, machine = data["cluster"], data["caps_mb_s"], data["machine"]
        return DemoRun(
            path=path, model=str(data.get("model", "?")),
            cpu_model=str(machine.get("cpu_model", "?")), cores=int(machine["cpus"]),
            prefill_engines=int(cluster["prefill"]), decode_engines=int(cluster["decode"]),
            block_size=int(cluster["block_size"]),
            kv_bytes_per_token=int(data["summary"]["regime"]["kv_bytes_per_token"]),
            read_cap_mb_s=float(caps["read"]), compute_cap_mb_s=float(caps["compute"]),
            agents=_agents(rows),
            modes={str(r["mode"]): _mode_run(r, data["modes"][r["mode"]]) for r in rows},
            raw_modes=data["modes"])
    except (KeyError, TypeError, ValueError) as exc:
        if isinstance(exc, DemoRunError):
            raise
        raise DemoRunError(f"{path}: not a dualpath demo result ({type(exc).__name__}: "
                           f"{exc})") from None


def load_demo_run(path: str | Path) -> DemoRun:
    """Read a ``dualpath demo`` JSON (DemoRunError naming the file when it cannot)."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise DemoRunError(f"cannot read the demo result {path}: {exc}") from None
    return parse_demo_run(data, str(path))
