"""An engine forced onto the GPU attention path (``DUALPATH_ATTENTION=flex``: flex attention
and SDPA, eager on the CPU) computes what the CPU path computes: the same greedy tokens and
prompt logits on random-weight models, through chunked prefill, prefix reuse, mixed batches,
a sliding window and decode batches replayed through the decode-graph machinery
(``EagerCapture`` standing in for CUDA's capture)."""

from __future__ import annotations

import pytest
import torch

from dualpath.config import EngineConfig
from dualpath.engine.llm_engine import LLMEngine
from dualpath.model import attention_flex
from dualpath.model.attention_graphs import EagerCapture
from dualpath.request import SamplingParams

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")

# chunks of 40 tokens: prompts longer than that prefill over their own earlier chunks
CONFIG = dict(dtype="float32", block_size=16, max_num_batched_tokens=40, num_kv_blocks=96)
PROMPTS = [list(range(3, 70)), [*range(3, 50), 7, 8, 9], list(range(100, 112)), [5]]


def _engine(model_dir, monkeypatch, attention: str) -> LLMEngine:
    monkeypatch.setenv(attention_flex.ENV_SWITCH, attention)
    return LLMEngine(model_dir, EngineConfig(**CONFIG))


def _greedy(engine: LLMEngine, prompts: list[list[int]],
            tokens: tuple[int, ...] = (12,) * 4) -> list[list[int]]:
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in tokens[: len(prompts)]]
    return [o.output_ids for o in engine.generate(prompts, params)]


@pytest.mark.parametrize("model", ["tiny_chaotic_dir", "tiny_mistral_dir"])
def test_flex_engine_gives_the_cpu_paths_greedy_tokens(model, request, monkeypatch):
    model_dir = request.getfixturevalue(model)
    want = _greedy(_engine(model_dir, monkeypatch, "auto"), PROMPTS)
    flex = _engine(model_dir, monkeypatch, "flex")
    assert flex.runner.model.kernels is None  # forced flex: the C kernels stand aside
    assert _greedy(flex, PROMPTS) == want
    # the prompts again: their prefixes are cached, so prefills start past position 0
    assert _greedy(flex, PROMPTS) == want


def test_flex_prompt_logits_match_over_a_cached_prefix(tiny_chaotic_dir, monkeypatch):
    prompt = list(range(7, 95))
    ref = _engine(tiny_chaotic_dir, monkeypatch, "reference")
    flex = _engine(tiny_chaotic_dir, monkeypatch, "flex")
    for engine in (ref, flex):
        engine.prompt_logits(prompt[:50])  # caches three blocks of the prompt
    want, want_cached = ref.prompt_logits(prompt)
    got, cached = flex.prompt_logits(prompt)
    assert cached == want_cached == 48
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_decode_graph_replays_give_the_eager_tokens(tiny_chaotic_dir, monkeypatch):
    lengths = (20, 14, 9, 3)  # decode batches of 4, 3 (padded to 4), 2, then 1
    want = _greedy(_engine(tiny_chaotic_dir, monkeypatch, "auto"), PROMPTS, lengths)
    flex = _engine(tiny_chaotic_dir, monkeypatch, "flex")
    flex.runner.graphs = graphs = flex.runner.decode_graphs(EagerCapture())
    assert _greedy(flex, PROMPTS, lengths) == want
    assert set(graphs.replays) == {1, 2, 4}
    assert _greedy(flex, PROMPTS, lengths) == want  # replays of captured sizes only


def test_decode_graphs_stand_aside_on_the_reference_path(tiny_chaotic_dir, monkeypatch):
    engine = _engine(tiny_chaotic_dir, monkeypatch, "reference")
    engine.runner.graphs = graphs = engine.runner.decode_graphs(EagerCapture())
    _greedy(engine, PROMPTS[:2], (4, 4))
    assert not graphs.replays


def test_step_inputs_reach_a_device_in_one_packed_upload(tiny_chaotic_dir, monkeypatch):
    from dualpath.engine import runner as runner_module

    engine = _engine(tiny_chaotic_dir, monkeypatch, "auto")
    for prompt in PROMPTS[:3]:
        engine.add_request(prompt, SamplingParams(max_tokens=3, ignore_eos=True))
    engine.step()  # the first chunk of 40 tokens
    items = engine.batcher.schedule().items  # the second chunk, and a short prompt's prefill
    host = engine.runner.prepare(items)
    copies = []
    real_upload = runner_module.upload
    monkeypatch.setattr(runner_module, "upload",
                        lambda parts, device: copies.append(len(parts)) or
                        real_upload(parts, device))
    moved = runner_module.to_device(host, torch.device("meta"))  # a read-back would raise
    assert copies == [3 + len(host.batch.prefills) + (3 if host.batch.decode else 0)]
    assert moved.input_ids.is_meta and moved.input_ids.shape == host.input_ids.shape
    for got, want in zip(moved.batch.prefills, host.batch.prefills, strict=True):
        assert (got.q_start, got.q_len, got.pos0, got.slot_ids.shape) == \
            (want.q_start, want.q_len, want.pos0, want.slot_ids.shape)
    decode_step = engine.runner.prepare([(s, 1) for s in engine.batcher.running[:2]])
    assert decode_step.decode_only and decode_step.batch.decode.max_ctx is not None
    d = runner_module.to_device(decode_step, torch.device("meta")).batch.decode
    assert d.block_table.dtype == d.ctx_lens.dtype == torch.int32
    assert d.block_table.shape == decode_step.batch.decode.block_table.shape
    assert d.max_ctx == decode_step.batch.decode.max_ctx
