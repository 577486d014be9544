"""Write fences and liveness on real local clusters (the issue's fault cases).

- A prefill engine stopped mid-forward past its timeout, while another request waits for its
  DE buffer, then resumed: its late writes land in no other request's buffer (the other
  request's tokens are the reference's, and ``store verify`` finds every block right).
- Requests placed behind multi-second forwards: no correction, one attempt each.
- One prompt whose layers each take longer than ``engine_timeout_s``: it completes, and no
  engine is declared stuck.
- A lone decode engine killed: the requests waiting for one fail with a clear error within
  2 × ``engine_timeout_s``.
"""

from __future__ import annotations

import contextlib
import signal
import time
from pathlib import Path

import pytest
import torch
from multiturn import wait_for
from test_faults import ENGINE, assert_idle, config, in_phase

from dualpath.config import EngineConfig
from dualpath.engine.faults import FAULT_HANG_ENV
from dualpath.engine.llm_engine import LLMEngine
from dualpath.request import SamplingParams
from dualpath.server.launch import LocalCluster
from dualpath.server.router.client import RequestAborted, RequestFailed

pytestmark = pytest.mark.faults

PARAMS = SamplingParams(max_tokens=8, ignore_eos=True)


def tokens(n: int, seed: int, vocab: int = 300) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab - 1, (n,), generator=g).tolist()


def reference(model_dir: Path, engine: EngineConfig, prompts: list[list[int]],
              params: SamplingParams = PARAMS) -> list[list[int]]:
    outputs = LLMEngine(model_dir, engine).generate(prompts, params)
    return [o.output_ids for o in outputs]


def test_a_prefill_engine_stopped_mid_forward_past_its_timeout_writes_into_no_other_request(
        tiny_long_dir, tmp_path, monkeypatch):
    """The issue's case: request A's PE stops after a layer of its forward (SIGSTOP) and is
    declared lost; B (DE read path, a hit) needs the DE room A's buffer holds; the PE resumes.
    Before, A's buffer was free after a timer, B's hit was read into it, and the resumed PE
    pushed the rest of A over it: B decoded on A's KV and stored wrong blocks. Now two things
    stop that, each enough alone (the test passes with either disabled, fails with both): the
    resumed PE sends nothing after the layer under way once it hears it was dropped, and B
    waits for A's fenced buffer until the PE has answered for A."""
    hang = tmp_path / "hang"
    hang.mkdir()
    monkeypatch.setenv(FAULT_HANG_ENV, str(hang))
    prefix, a_prompt = tokens(69, seed=1), tokens(90, seed=2)  # 6 blocks each, with B
    [ref_prefix] = reference(tiny_long_dir, ENGINE, [prefix])
    b_prompt = prefix + ref_prefix + tokens(11, seed=3)
    [ref_b] = reference(tiny_long_dir, ENGINE, [b_prompt])
    # the DE's pool holds one 6-block buffer beside its 2 staging slots
    cfg = config(tmp_path, num_prefill=2, num_decode=1, host_pool_blocks=8,
                 save_staging_blocks=2, engine_timeout_s=3.0)
    with LocalCluster(tiny_long_dir, cfg, log_dir=tmp_path / "logs") as cluster:
        assert cluster.submit(prefix, PARAMS).result(60).output_ids == ref_prefix  # B's hit
        for pe in ("pe0", "pe1"):
            (hang / f"{pe}.forward").touch()
        a = cluster.submit(a_prompt, PARAMS)
        hanging = wait_for(lambda: [p for p in ("pe0", "pe1")
                                    if (hang / f"{p}.forward.hanging").exists()],
                           what="A's forward to stop after a layer")
        writer, other = hanging[0], {"pe0": "pe1", "pe1": "pe0"}[hanging[0]]
        (hang / f"{other}.forward").unlink()
        cluster.process(writer).send_signal(signal.SIGSTOP)
        try:
            (hang / f"{writer}.forward").unlink()  # once resumed, it goes on sending
            wait_for(lambda: writer not in cluster.router.engines, timeout_s=60,
                     what="the writer lost")
            cluster.abort(a)  # A is not placed again: B is the next to need the DE's room
            (hang / other).touch()  # B's prefill engine holds B for a moment
            b = cluster.submit(b_prompt, PARAMS, read_path="de")
            # before fences: B's hit is read into A's old buffer; fenced, there is no room
            with contextlib.suppress(AssertionError):
                wait_for(lambda: in_phase(cluster, b.req_id, "prefilling"), timeout_s=1.0)
        finally:
            cluster.process(writer).send_signal(signal.SIGCONT)
        time.sleep(1.5)  # the rest of the writer's layer lands now
        (hang / other).unlink()
        assert b.result(60).output_ids == ref_b
        with pytest.raises(RequestAborted):
            a.result(60)
        wait_for(lambda: writer in cluster.router.engines, what="the writer to rejoin")
        assert cluster.router.counters()["corrected"] == 0
        assert_idle(cluster, host_pool_blocks=8)  # store verify: every block is its chain's


def random_llama(folder: Path, hidden: int, layers: int, seed: int) -> Path:
    """A random-weight Llama of the given width and depth (8K+ positions)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(vocab_size=300, hidden_size=hidden, intermediate_size=hidden * 11 // 4,
                      num_hidden_layers=layers, num_attention_heads=hidden // 64,
                      num_key_value_heads=hidden // 256, max_position_embeddings=16384,
                      rms_norm_eps=1e-5, eos_token_id=299, rope_theta=10000.0)
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def wide_dir(tmp_path_factory) -> Path:
    """Wide enough that one layer over 8K tokens takes seconds on a core (2 layers)."""
    return random_llama(tmp_path_factory.mktemp("tiny-wide"), 1024, 2, seed=8)


@pytest.fixture(scope="module")
def deep_dir(tmp_path_factory) -> Path:
    """Layers of a fraction of a second over 3K tokens, twelve of them: a forward of seconds
    whose progress moves layer by layer (as SmolLM2's 30 layers do)."""
    return random_llama(tmp_path_factory.mktemp("tiny-deep12"), 512, 12, seed=9)


def wide_engine(batched_tokens: int) -> EngineConfig:
    return EngineConfig(dtype="float32", block_size=16, num_kv_blocks=1200,
                        max_num_batched_tokens=batched_tokens)


def test_requests_behind_multi_second_forwards_are_never_corrected(deep_dir, tmp_path):
    """Three 3,000-token prompts, each one forward of seconds (no chunking), and a short one
    0.3 s later, with the default heartbeat and timeout: before, every request reaching the PE
    mid-forward was taken as lost (corrected, placed again, its buffer freed under the
    forward); now none is, each takes one attempt, and the short one waits for the forwards
    ahead of it only."""
    engine = wide_engine(4096)
    longs = [tokens(3000, seed=10 + i) for i in range(3)]
    short = tokens(200, seed=20)
    want = reference(deep_dir, engine, [*longs, short])
    cfg = config(tmp_path, engine=engine, num_prefill=1, num_decode=1, host_pool_blocks=256,
                 heartbeat_s=0.5, engine_timeout_s=5.0, router_timeout_s=10.0)
    with LocalCluster(deep_dir, cfg, log_dir=tmp_path / "logs") as cluster:
        started = time.monotonic()
        futures = [cluster.submit(p, PARAMS) for p in longs]
        time.sleep(0.3)
        futures.append(cluster.submit(short, PARAMS))
        outputs = [f.result(300) for f in futures]
        took_s = time.monotonic() - started
        assert [o.output_ids for o in outputs] == want
        assert [o.num_attempts for o in outputs] == [1, 1, 1, 1]
        assert cluster.router.counters()["corrected"] == 0
        assert cluster.router.counters()["stuck"] == 0
        forwards_s = sum(o.timings["prefill_s"] for o in outputs[:3])
        assert outputs[3].timings["ttft_s"] <= forwards_s + 0.3 * took_s
        assert_idle(cluster, host_pool_blocks=256)


def test_a_prompt_whose_layers_outlast_the_engine_timeout_completes_with_no_engine_stuck(
        wide_dir, tmp_path):
    engine = wide_engine(8192)
    prompt = tokens(8192, seed=30)
    [want] = reference(wide_dir, engine, [prompt], SamplingParams(max_tokens=2,
                                                                 ignore_eos=True))
    cfg = config(tmp_path, engine=engine, num_prefill=1, num_decode=1, host_pool_blocks=600,
                 heartbeat_s=0.3, engine_timeout_s=1.5, router_timeout_s=6.0)
    with LocalCluster(wide_dir, cfg, log_dir=tmp_path / "logs") as cluster:
        out = cluster.submit(prompt, SamplingParams(max_tokens=2, ignore_eos=True)).result(600)
        assert out.output_ids == want and out.num_attempts == 1
        layer_s = out.timings["prefill_s"] / 2
        assert layer_s > cfg.engine_timeout_s, f"a layer took {layer_s:.1f} s: not the case"
        assert cluster.router.counters()["stuck"] == 0
        assert cluster.router.counters()["corrected"] == 0


def test_requests_waiting_for_a_lone_decode_engine_that_died_fail_clearly(tiny_long_dir,
                                                                          tmp_path):
    cfg = config(tmp_path, num_prefill=1, num_decode=1, engine_timeout_s=2.0)
    with LocalCluster(tiny_long_dir, cfg, log_dir=tmp_path / "logs") as cluster:
        victim = cluster.submit(tokens(40, seed=40), SamplingParams(max_tokens=3000,
                                                                    ignore_eos=True))
        wait_for(lambda: in_phase(cluster, victim.req_id, "decoding"), what="decode")
        cluster.process("de1").send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        late = cluster.submit(tokens(30, seed=41), PARAMS)
        for future in (victim, late):
            with pytest.raises(RequestFailed, match="no live decode engine"):
                future.result(4 * cfg.engine_timeout_s)
        assert time.monotonic() - killed_at <= 2 * cfg.engine_timeout_s + 0.5
