"""Multi-turn conversations replayed through the single-process runner and through a cluster."""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from dualpath.config import EngineConfig
from dualpath.engine.llm_engine import LLMEngine
from dualpath.request import SamplingParams
from dualpath.server.launch import LocalCluster
from dualpath.server.router.client import ClusterOutput


@dataclass(frozen=True)
class Conversation:
    """The first prompt and what each later turn appends (lengths not multiples of a block)."""

    first: list[int]
    appended: list[list[int]]


def make_conversations(vocab: int, first_lengths: list[int], append_lengths: list[int],
                       seed: int) -> list[Conversation]:
    g = torch.Generator().manual_seed(seed)

    def rand(n: int) -> list[int]:
        return torch.randint(3, vocab - 1, (n,), generator=g).tolist()

    return [Conversation(rand(n), [rand(m + i) for m in append_lengths])
            for i, n in enumerate(first_lengths)]


def reference_outputs(model_dir: Path, config: EngineConfig, convs: list[Conversation],
                      params: SamplingParams) -> list[list[list[int]]]:
    """Greedy outputs per conversation and turn from one in-process engine."""
    engine = LLMEngine(model_dir, config)
    prompts = [c.first for c in convs]
    outputs: list[list[list[int]]] = [[] for _ in convs]
    for turn in range(1 + len(convs[0].appended)):
        results = engine.generate(prompts, params)
        for i, out in enumerate(results):
            outputs[i].append(out.output_ids)
        if turn < len(convs[0].appended):
            prompts = [p + o.output_ids + c.appended[turn]
                       for p, o, c in zip(prompts, results, convs, strict=True)]
    return outputs


def cluster_outputs(cluster: LocalCluster, convs: list[Conversation], params: SamplingParams,
                    mode: str, read_path: str, served: list[ClusterOutput] | None = None,
                    ) -> tuple[list[list[list[int]]], list[list[int]]]:
    """Outputs and hit tokens per conversation and turn, conversations running concurrently
    (every ``ClusterOutput`` is appended to ``served`` when given). A fault-free run: no request
    was ever taken for lost (corrected) or placed twice."""
    prompts = [c.first for c in convs]
    outputs: list[list[list[int]]] = [[] for _ in convs]
    hits: list[list[int]] = [[] for _ in convs]
    for turn in range(1 + len(convs[0].appended)):
        results = cluster.generate(prompts, params, mode=mode, read_path=read_path)
        if served is not None:
            served.extend(results)
        for i, out in enumerate(results):
            outputs[i].append(out.output_ids)
            hits[i].append(out.num_hit_tokens)
        if turn < len(convs[0].appended):
            prompts = [p + o.output_ids + c.appended[turn]
                       for p, o, c in zip(prompts, results, convs, strict=True)]
        assert all(out.num_attempts == 1 for out in results), "a turn was placed twice"
    assert cluster.router.counters()["corrected"] == 0
    return outputs, hits


def wipe(store_root: Path) -> None:
    """Empty the shared store between modes (engines recreate folders as they write)."""
    shutil.rmtree(store_root, ignore_errors=True)
    store_root.mkdir(parents=True)


def node_sum(metrics: dict[str, dict], role: str, key: str) -> float:
    """Sum of one counter over the engines of a role."""
    return sum(m.get(key) or 0 for m in metrics.values() if m["role"] == role)


def wait_for(condition: Callable[[], object], timeout_s: float = 30.0,
             what: str = "condition") -> object:
    """Poll ``condition`` (a cheap query) until it returns something truthy; that value."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def assert_store_verified(model_dir: Path, store_root: Path) -> None:
    """``dualpath store verify`` over every stored block: each one's KV is its own chain's."""
    from dualpath.storage.verify import verify_fs_root

    report = verify_fs_root(store_root, model_dir, sample=None)
    assert report.ok, report.to_dict()
    assert report.num_checked > 0, report.to_dict()
