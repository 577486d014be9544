"""The fault suite: real local clusters, a multi-agent workload, and one fault per case.

Every case checks the same three things: no request is lost (each ends with the fault-free
greedy tokens of the single-process engine — one mid-stream on a decode engine that died or
stopped moves to another and streams on), the cluster serves the turns after the fault, and
once idle every router counter is back to zero and every engine's host pool is free again.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from concurrent.futures import Future
from pathlib import Path

import pytest
from multiturn import (
    assert_store_verified,
    make_conversations,
    reference_outputs,
    wait_for,
)

from dualpath.config import ClusterConfig, EngineConfig, StorageConfig
from dualpath.engine.llm_engine import LLMEngine
from dualpath.engine.loop import FAULT_HANG_ENV, ROUTER_GONE_EXIT
from dualpath.errors import RequestError
from dualpath.request import SamplingParams
from dualpath.server.launch import LocalCluster
from dualpath.server.router.client import RequestAborted
from dualpath.storage.block_file import HEADER_BYTES

pytestmark = pytest.mark.faults

ENGINE = EngineConfig(dtype="float32", block_size=16, num_kv_blocks=512)
PARAMS = SamplingParams(max_tokens=8, ignore_eos=True)
LONG = SamplingParams(max_tokens=3000, ignore_eos=True)  # decodes for a second or more
CONVS = make_conversations(300, first_lengths=[45, 70, 101, 60], append_lengths=[19, 27, 13],
                           seed=11)
VICTIM_PROMPT = list(range(5, 60))


def config(tmp_path: Path, **overrides) -> ClusterConfig:
    base = dict(engine=ENGINE, storage=StorageConfig(root=str(tmp_path / "kv")),
                host_pool_blocks=64, heartbeat_s=0.2, engine_timeout_s=2.0,
                router_timeout_s=6.0)
    base.update(overrides)
    return ClusterConfig(**base)


@pytest.fixture(scope="module")
def want(tiny_long_dir) -> list[list[list[int]]]:
    return reference_outputs(tiny_long_dir, ENGINE, CONVS, PARAMS)


@pytest.fixture(scope="module")
def victim_want(tiny_long_dir) -> list[int]:
    return LLMEngine(tiny_long_dir, ENGINE).generate([VICTIM_PROMPT], LONG)[0].output_ids


# -- the workload and the checks ------------------------------------------------------------------


class Agents:
    """The conversations, turn by turn; every turn must end with the fault-free tokens."""

    def __init__(self, cluster: LocalCluster, want: list[list[list[int]]]) -> None:
        self.cluster = cluster
        self.want = want
        self.prompts = [c.first for c in CONVS]
        self.turn = 0
        self.outputs = []

    def submit_turn(self) -> list[Future]:
        return [self.cluster.submit(p, PARAMS) for p in self.prompts]

    def finish_turn(self, futures: list[Future]) -> None:
        results = []
        for i, future in enumerate(futures):
            out = future.result(120)
            assert out.output_ids == self.want[i][self.turn], f"agent {i} turn {self.turn} differs"
            results.append(out)
        self.outputs.extend(results)
        if self.turn + 1 < len(self.want[0]):
            self.prompts = [p + o.output_ids + c.appended[self.turn]
                            for p, o, c in zip(self.prompts, results, CONVS, strict=True)]
        self.turn += 1

    def run_turn(self) -> None:
        self.finish_turn(self.submit_turn())

    def run_rest(self) -> None:
        while self.turn < len(self.want[0]):
            self.run_turn()




def in_phase(cluster: LocalCluster, req_id: int, phase: str) -> tuple[str, str, str] | None:
    state = cluster.router.phases().get(req_id)
    return state if state and state[0] == phase else None


def assert_idle(cluster: LocalCluster, host_pool_blocks: int = 64) -> None:
    """Router counters at zero (no buffer fenced, no request ever corrected: a fault loses an
    engine, never a message); each engine's own report shows its host pool free; every block in
    the store holds its own chain's KV (``dualpath store verify``)."""
    def idle():
        counters = cluster.router.counters()
        busy = {k: v for k, v in counters.items()
                if v and k not in ("dropped_messages", "bad_messages", "refused_messages",
                                   "stuck", "refused_peers", "moved", "local_prefills")}
        reports = cluster.router.reports()
        pools = {n: r.free_host_slots for n, r in reports.items() if r is not None}
        leaks = {n: free for n, free in pools.items() if free != host_pool_blocks}
        return (busy, leaks) if busy or leaks or len(pools) < len(reports) else "idle"
    deadline = time.monotonic() + 20
    state = idle()
    while state != "idle" and time.monotonic() < deadline:
        time.sleep(0.1)
        state = idle()
    assert state == "idle", f"not idle: {state}"
    assert cluster.router.counters()["bad_messages"] == 0
    assert_store_verified(cluster.model_dir, Path(cluster.config.storage.root))


# -- engines dying --------------------------------------------------------------------------------


def test_killing_a_decode_engine_mid_decode_moves_its_stream(tiny_long_dir, tmp_path, want,
                                                             victim_want):
    with LocalCluster(tiny_long_dir, config(tmp_path), log_dir=tmp_path / "logs") as cluster:
        agents = Agents(cluster, want)
        agents.run_turn()
        streamed: list[int] = []
        victim = cluster.submit(VICTIM_PROMPT, LONG, on_tokens=streamed.extend)
        _, _, de = wait_for(lambda: in_phase(cluster, victim.req_id, "decoding"), what="decode")
        wait_for(lambda: len(streamed) > 100, what="a hundred tokens")
        turn = agents.submit_turn()
        cluster.process(de).send_signal(signal.SIGKILL)
        out = victim.result(120)
        assert out.output_ids == victim_want and streamed == victim_want
        assert out.decode_engine != de and out.num_attempts == 2
        assert out.num_hit_tokens >= 100 // 16 * 16  # the dead engine's blocks were hits
        agents.finish_turn(turn)
        agents.run_rest()
        assert de not in cluster.router.engines
        assert all(o.decode_engine != de for o in agents.outputs[-len(CONVS):])
        assert_idle(cluster)


def test_killing_a_prefill_engine_after_prefill_lets_its_requests_finish(
        tiny_long_dir, tmp_path, want, victim_want):
    cfg = config(tmp_path, num_prefill=2, num_decode=1)
    with LocalCluster(tiny_long_dir, cfg, log_dir=tmp_path / "logs") as cluster:
        agents = Agents(cluster, want)
        victim = cluster.submit(VICTIM_PROMPT, LONG)
        _, pe, _ = wait_for(lambda: in_phase(cluster, victim.req_id, "decoding"), what="decode")
        cluster.process(pe).send_signal(signal.SIGKILL)
        wait_for(lambda: pe not in cluster.router.engines, what="the PE to be declared lost")
        assert victim.result(60).output_ids == victim_want
        agents.run_rest()
        assert all(o.prefill_engine != pe for o in agents.outputs)
        assert_idle(cluster)


def test_killing_a_prefill_engine_mid_prefill_places_its_requests_again(tiny_long_dir,
                                                                        tmp_path, want):
    # slow storage reads keep a turn's requests reading on their PE long enough to kill it
    storage = StorageConfig(root=str(tmp_path / "kv"), read_cap_mb_s=0.1)
    cfg = config(tmp_path, num_prefill=2, num_decode=1, storage=storage, read_path="pe")
    with LocalCluster(tiny_long_dir, cfg, log_dir=tmp_path / "logs") as cluster:
        agents = Agents(cluster, want)
        agents.run_turn()
        turn = agents.submit_turn()
        phase = wait_for(lambda: next((s for s in cluster.router.phases().values()
                                       if s[0] == "prefilling"), None), what="a prefill")
        pe = phase[1]
        cluster.process(pe).send_signal(signal.SIGKILL)
        agents.finish_turn(turn)
        assert any(o.num_attempts > 1 for o in agents.outputs[-len(CONVS):])
        agents.run_rest()
        assert_idle(cluster)


def test_a_stopped_decode_engine_is_detected_then_rejoins_without_corrupting_anything(
        tiny_long_dir, tmp_path, want, victim_want):
    with LocalCluster(tiny_long_dir, config(tmp_path), log_dir=tmp_path / "logs") as cluster:
        agents = Agents(cluster, want)
        agents.run_turn()
        victim = cluster.submit(VICTIM_PROMPT, LONG)
        _, _, de = wait_for(lambda: in_phase(cluster, victim.req_id, "decoding"), what="decode")
        cluster.process(de).send_signal(signal.SIGSTOP)
        try:
            stopped_at = time.monotonic()
            wait_for(lambda: de not in cluster.router.engines, what="the heartbeat timeout")
            detected_s = time.monotonic() - stopped_at
            out = victim.result(60)  # moved to the other decode engine
            assert out.output_ids == victim_want and out.decode_engine != de
            agents.run_turn()  # served by the other decode engine meanwhile
        finally:
            cluster.process(de).send_signal(signal.SIGCONT)
        wait_for(lambda: de in cluster.router.engines, what="the engine to rejoin")
        assert detected_s < 2.0 + 1.5
        agents.run_rest()
        assert_idle(cluster)


def test_a_decode_engine_whose_loop_is_stuck_is_declared_stuck_and_its_stream_moves(
        tiny_long_dir, tmp_path, want, victim_want, monkeypatch):
    """The engine's heartbeat thread goes on beating while its work loop hangs (the test-only
    fault hook): the router declares it stuck within engine_timeout_s + a beat, the stream
    moves with the fault-free tokens, and once the loop moves again the engine rejoins."""
    hang = tmp_path / "hang"
    hang.mkdir()
    monkeypatch.setenv(FAULT_HANG_ENV, str(hang))
    with LocalCluster(tiny_long_dir, config(tmp_path), log_dir=tmp_path / "logs") as cluster:
        agents = Agents(cluster, want)
        agents.run_turn()
        victim = cluster.submit(VICTIM_PROMPT, LONG)
        _, _, de = wait_for(lambda: in_phase(cluster, victim.req_id, "decoding"), what="decode")
        (hang / de).touch()
        hung_at = time.monotonic()
        wait_for(lambda: de not in cluster.router.engines, what="the engine declared stuck")
        detected_s = time.monotonic() - hung_at
        assert cluster.process(de).poll() is None  # alive all along, beating
        out = victim.result(60)
        assert out.output_ids == victim_want and out.decode_engine != de
        assert cluster.router.counters()["stuck"] == 1
        agents.run_turn()  # served by the other decode engine meanwhile
        (hang / de).unlink()
        wait_for(lambda: de in cluster.router.engines, what="the engine to rejoin")
        assert detected_s < 2.0 + 0.2 + 1.0  # engine_timeout_s + a beat + the loop's slack
        agents.run_rest()
        assert_idle(cluster)


def test_engines_stop_when_their_router_is_gone(tiny_long_dir, tmp_path, want):
    cluster = LocalCluster(tiny_long_dir, config(tmp_path, router_timeout_s=1.5),
                           log_dir=tmp_path / "logs")
    cluster.start()
    try:
        Agents(cluster, want).run_turn()
        procs = [cluster.process(name) for name in cluster.router.engines]
        cluster.router.shutdown(notify_engines=False)  # as if the router process crashed
        started = time.monotonic()
        for proc in procs:
            assert proc.wait(timeout=20) == ROUTER_GONE_EXIT  # they noticed, stopped, exited
        assert time.monotonic() - started < 1.5 + 0.5 + 1.5 + 5  # silence + beat + grace
    finally:
        cluster.router = None
        cluster.stop()


# -- full buffers ---------------------------------------------------------------------------------


def test_tiny_buffers_make_requests_wait_never_fail(tiny_long_dir, tmp_path, want):
    # 14 host-buffer blocks hold one prompt at a time; 24 KV blocks one decode at a time
    engine = EngineConfig(dtype="float32", block_size=16, num_kv_blocks=24)
    cfg = config(tmp_path, engine=engine, host_pool_blocks=16, save_staging_blocks=2)
    with LocalCluster(tiny_long_dir, cfg, log_dir=tmp_path / "logs") as cluster:
        agents = Agents(cluster, want)
        agents.run_rest()
        started = time.monotonic()
        too_big = cluster.submit([5] * 400, PARAMS)
        with pytest.raises(RequestError, match="exceeds"):
            too_big.result(1.0)
        assert time.monotonic() - started < 1.0
        assert_idle(cluster, host_pool_blocks=16)


# -- cancellation ---------------------------------------------------------------------------------


def test_abort_in_every_phase_frees_everything(tiny_long_dir, tmp_path, want):
    storage = StorageConfig(root=str(tmp_path / "kv"), read_cap_mb_s=0.05)
    with LocalCluster(tiny_long_dir, config(tmp_path, storage=storage),
                      log_dir=tmp_path / "logs") as cluster:
        agents = Agents(cluster, want)
        agents.run_turn()
        seen = set()
        for phase, path in [("buffering", "de"), ("prefilling", "pe"), ("decoding", "auto")]:
            # a second-turn prompt has hit blocks: its reads are slow at 0.05 MB/s
            prompt = agents.prompts[0] + want[0][0] + CONVS[0].appended[0]
            params = LONG if phase == "decoding" else PARAMS
            future = cluster.submit(prompt, params, read_path=path)
            wait_for(lambda f=future, p=phase: in_phase(cluster, f.req_id, p), what=phase)
            cluster.abort(future)
            with pytest.raises(RequestAborted):
                future.result(5)
            seen.add(phase)
        # 4 requests reserving 4,085 tokens of KV each fill both decode engines: a 5th queues
        huge = SamplingParams(max_tokens=4030, ignore_eos=True)
        fill = [cluster.submit(VICTIM_PROMPT, huge) for _ in range(5)]
        wait_for(lambda: in_phase(cluster, fill[-1].req_id, "queued"), what="queued")
        seen.add("queued")
        for f in reversed(fill):
            cluster.abort(f)
        for f in fill:
            with pytest.raises(RequestAborted):
                f.result(5)
        with pytest.raises(TimeoutError):  # generate's timeout aborts what it gave up on
            cluster.generate([VICTIM_PROMPT], LONG, timeout_s=0.1)
        assert seen == {"queued", "buffering", "prefilling", "decoding"}
        assert_idle(cluster)
        agents.run_rest()
        assert_idle(cluster)


# -- storage faults -------------------------------------------------------------------------------


def _block_files(root: Path) -> list[Path]:
    return sorted(root.rglob("*.kvb"))


@pytest.mark.parametrize("damage", ["missing", "truncated", "corrupted"])
def test_damaged_blocks_are_recomputed(tiny_long_dir, tmp_path, want, damage):
    root = tmp_path / "kv"
    with LocalCluster(tiny_long_dir, config(tmp_path), log_dir=tmp_path / "logs") as cluster:
        agents = Agents(cluster, want)
        agents.run_turn()
        files = _block_files(root)
        assert files
        for path in files[::2]:
            if damage == "missing":
                path.unlink()
            elif damage == "truncated":
                os.truncate(path, path.stat().st_size // 2)
            else:
                data = bytearray(path.read_bytes())
                data[-10] ^= 0xFF
                path.write_bytes(bytes(data))
        agents.run_rest()
        if damage != "missing":
            corrupt = sum(m.get("storage_corrupt") or 0 for m in cluster.metrics().values())
            assert corrupt > 0  # the reads saw the damage and recomputed
        assert_idle(cluster)


def test_a_store_made_read_only_mid_run_costs_only_its_writes(tiny_long_dir, tmp_path, want):
    if os.geteuid() != 0:
        pytest.skip("a read-only bind mount needs root")
    root = tmp_path / "kv"
    root.mkdir()
    with LocalCluster(tiny_long_dir, config(tmp_path), log_dir=tmp_path / "logs") as cluster:
        agents = Agents(cluster, want)
        agents.run_turn()
        subprocess.run(["mount", "--bind", str(root), str(root)], check=True)
        try:
            subprocess.run(["mount", "-o", "remount,bind,ro", str(root)], check=True)
            agents.run_rest()
            assert_idle(cluster)
            metrics = cluster.metrics().values()
        finally:
            subprocess.run(["umount", str(root)], check=True)
    errors = sum(m.get("storage_write_errors") or 0 for m in metrics)
    assert errors > 0  # the decode engines tried, failed, counted, and went on


def test_reads_slower_than_the_deadline_are_recomputed(tiny_long_dir, tmp_path, want):
    storage = StorageConfig(root=str(tmp_path / "kv"), read_cap_mb_s=0.02, read_deadline_s=0.3)
    with LocalCluster(tiny_long_dir, config(tmp_path, storage=storage),
                      log_dir=tmp_path / "logs") as cluster:
        agents = Agents(cluster, want)
        started = time.monotonic()
        agents.run_rest()
        elapsed_s = time.monotonic() - started
        later = agents.outputs[len(CONVS):]
        for out in later:  # what was not read in time was computed
            assert out.num_computed_tokens == len(out.prompt_ids) - out.num_hit_tokens
        assert any(o.num_hit_tokens < (len(o.prompt_ids) - 1) // 16 * 16 for o in later)
        assert elapsed_s < 60
        assert_idle(cluster)


def test_engines_sharing_a_capped_store_keep_it_within_the_cap(tiny_long_dir, tmp_path, want):
    root = tmp_path / "kv"
    block_bytes = LLMEngine(tiny_long_dir, ENGINE).layout.full_block_bytes + HEADER_BYTES
    cap_blocks = 12
    storage = StorageConfig(root=str(root), capacity_gb=cap_blocks * block_bytes / 1e9)
    with LocalCluster(tiny_long_dir, config(tmp_path, storage=storage),
                      log_dir=tmp_path / "logs") as cluster:
        agents = Agents(cluster, want)
        agents.run_rest()
        assert_idle(cluster)
    writers = 3
    assert len(_block_files(root)) <= cap_blocks + writers
