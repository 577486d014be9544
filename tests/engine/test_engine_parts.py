"""The engine process's seam (``engine/parts.py``): a start that fails leaves nothing running —
the parts are closed, and so are the storage client and the traffic manager built for them."""

from __future__ import annotations

import pytest

from dualpath.config import ClusterConfig, StorageConfig
from dualpath.control_keys import ClusterKeys
from dualpath.engine.loop import EngineIdentity, EngineProcess
from dualpath.errors import TransferError
from dualpath.kv.host_pool import HostPool
from dualpath.kv.layout import KVLayout
from dualpath.protocol import Failed, Tokens
from dualpath.traffic.lanes import Lane

LAYOUT = KVLayout(num_layers=2, num_kv_heads=1, head_dim=4, dtype="float32", block_size=4)


class BrokenParts:
    """Parts whose worker cannot be built (a model server that never answers, say)."""

    engine = None
    instance = None
    ep = None

    def __init__(self, config: ClusterConfig) -> None:
        self.config, self.layout = config, LAYOUT
        self.host_pool = HostPool(LAYOUT.full_block_bytes, 2, pin=False)
        self.built_with: tuple | None = None
        self.closed = 0

    def regions(self) -> list[tuple[int, int]]:
        return [(self.host_pool.base_address, self.host_pool.nbytes)]

    def worker(self, storage, traffic):
        self.built_with = (storage, traffic)
        raise RuntimeError("the model server never answered")

    def failure(self, wait_s: float = 0.0) -> str | None:
        return None

    def close(self) -> None:
        self.closed += 1
        self.host_pool.close()


def test_a_failed_start_closes_the_parts_the_storage_client_and_the_traffic_manager(tmp_path):
    parts = BrokenParts(ClusterConfig(storage=StorageConfig(root=str(tmp_path / "store"))))
    key = ClusterKeys.generate(["e0"]).engine_key("e0")
    with pytest.raises(RuntimeError, match="never answered"):
        EngineProcess(EngineIdentity("e0", "decode", 0), parts, "tcp://127.0.0.1:1", key)
    storage, traffic = parts.built_with
    assert parts.closed == 1
    assert storage._closing.is_set()  # its writer thread drains and stops
    with pytest.raises(TransferError, match="closed"):  # the traffic manager takes nothing more
        traffic.submit("write", "127.0.0.1:1", [(parts.host_pool.base_address, 0, 8)], Lane.HIGH)


def test_a_store_that_cannot_open_still_closes_the_parts(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    parts = BrokenParts(ClusterConfig(storage=StorageConfig(root=str(blocker / "store"))))
    key = ClusterKeys.generate(["e0"]).engine_key("e0")
    with pytest.raises(OSError):
        EngineProcess(EngineIdentity("e0", "decode", 0), parts, "tcp://127.0.0.1:1", key)
    assert parts.closed == 1 and parts.built_with is None


class DyingParts:
    """Parts whose model server dies (``failure`` says so) while the worker works; ``dying``:
    its sockets are closed and its exit shows only to a caller that waits for it."""

    def __init__(self) -> None:
        self.dead = self.dying = False
        self.waits_s: list[float] = []

    def failure(self, wait_s: float = 0.0) -> str | None:
        self.waits_s.append(wait_s)
        if self.dead or (self.dying and wait_s > 0):
            return "the vLLM instance exited with -9"
        return None


def test_an_engine_whose_instance_died_sends_none_of_the_answers_its_calls_broke_into():
    engine = EngineProcess.__new__(EngineProcess)  # only the parts matter here
    engine.parts = parts = DyingParts()
    answers = [Failed(7, "vllm decode instance: connection reset")]
    assert engine._speakable(answers) == answers  # alive: its failures are the router's news
    parts.dead = True
    assert engine._speakable(answers) == []  # dead: its exit speaks for every request
    assert engine._speakable([]) == []


def test_a_failed_call_waits_for_a_dying_instance_and_other_answers_do_not():
    engine = EngineProcess.__new__(EngineProcess)
    engine.parts = parts = DyingParts()
    parts.dying = True
    tokens = [Tokens(((7, 0, (5, 6)),))]
    assert engine._speakable(tokens) == tokens and parts.waits_s == [0.0]  # no wait for these
    assert engine._speakable([*tokens, Failed(7, "connection reset")]) == []
    assert parts.waits_s[-1] > 0
