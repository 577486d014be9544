"""Single-engine runner: greedy parity with transformers, prefix reuse, batching, stop rules."""

from __future__ import annotations

import pytest
import torch

from dualpath.config import EngineConfig
from dualpath.engine.llm_engine import LLMEngine
from dualpath.errors import RequestError
from dualpath.request import SamplingParams

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in one sentence why the sky is blue.",
]


@pytest.fixture(scope="module")
def smol_fp32(smollm2_dir) -> LLMEngine:
    return LLMEngine(smollm2_dir, EngineConfig(dtype="float32", num_kv_blocks=128))


def _chat(engine: LLMEngine, text: str) -> list[int]:
    return engine.tokenizer.encode_chat([{"role": "user", "content": text}])


def test_greedy_32_tokens_equal_transformers_generate(smollm2_dir, smol_fp32):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    hf.generation_config.eos_token_id = None  # like ignore_eos: EOS may be picked, never stops
    for text in PROMPTS:
        ids = _chat(smol_fp32, text)
        with torch.no_grad():
            want = hf.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False,
                               pad_token_id=0)[0, len(ids):].tolist()
        got = smol_fp32.generate([ids], SamplingParams(max_tokens=32, ignore_eos=True))[0]
        assert got.output_ids == want


def test_chat_template_matches_transformers(smollm2_dir, smol_fp32):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(smollm2_dir)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    want = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert smol_fp32.tokenizer.render_chat(messages) == want


def test_prefix_reuse_logits_equal_full_prefill(smollm2_dir):
    g = torch.Generator().manual_seed(0)
    shared = torch.randint(0, 49000, (200,), generator=g).tolist()
    tail = torch.randint(0, 49000, (37,), generator=g).tolist()
    reuse = LLMEngine(smollm2_dir, EngineConfig(dtype="float32", num_kv_blocks=64))
    reuse.prompt_logits([*shared, 11, 12, 13])  # caches 3 full blocks of `shared`
    cached_logits, num_cached = reuse.prompt_logits(shared + tail)
    assert num_cached == 192
    fresh = LLMEngine(smollm2_dir, EngineConfig(dtype="float32", num_kv_blocks=64,
                                                enable_prefix_caching=False))
    full_logits, none_cached = fresh.prompt_logits(shared + tail)
    assert none_cached == 0
    assert cached_logits.shape[0] == len(shared + tail) - 192
    assert (cached_logits - full_logits[192:]).abs().max() <= 1e-4


def test_batch_of_8_decodes_like_each_alone(smollm2_dir):
    engine = LLMEngine(smollm2_dir, EngineConfig(dtype="float32", num_kv_blocks=128,
                                                 enable_prefix_caching=False))
    topics = ["cats", "rain", "chess", "bread", "rivers", "robots", "music", "winter"]
    prompts = [_chat(engine, f"Tell me one fact about {t}.") for t in topics]
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    together = [o.output_ids for o in engine.generate(prompts, params)]
    alone = [engine.generate([p], params)[0].output_ids for p in prompts]
    assert together == alone
    assert len({tuple(t) for t in together}) == 8


def test_continuous_batching_and_preemption_keep_tokens(tiny_llama_dir):
    prompts = [list(range(1 + i, 40 + 7 * i)) for i in range(6)]
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    roomy = LLMEngine(tiny_llama_dir, EngineConfig(dtype="float32", block_size=16,
                                                   num_kv_blocks=200))
    want = [o.output_ids for o in roomy.generate(prompts, params)]
    tight = LLMEngine(tiny_llama_dir, EngineConfig(dtype="float32", block_size=16,
                                                   num_kv_blocks=14, max_num_batched_tokens=32))
    seqs = [tight.add_request(p, params) for p in prompts[:2]]
    tight.step()
    seqs += [tight.add_request(p, params) for p in prompts[2:]]  # join running decodes
    while tight.has_unfinished:
        tight.step()
    assert tight.batcher.num_preemptions > 0
    assert [s.output_ids for s in seqs] == want
    assert tight.pool.num_free_blocks == 14


def test_stop_string_eos_and_max_tokens(smol_fp32):
    ids = _chat(smol_fp32, "What is the capital of France?")
    full = smol_fp32.generate([ids], SamplingParams(max_tokens=40))[0]
    assert "Paris" in full.text and full.finish_reason == "stop"
    assert full.output_ids[-1] in smol_fp32.eos_token_ids
    cut = smol_fp32.generate([ids], SamplingParams(max_tokens=40, stop=("Paris",)))[0]
    assert cut.finish_reason == "stop" and "Paris" not in cut.text
    assert full.text.startswith(cut.text)
    forced = smol_fp32.generate([ids], SamplingParams(max_tokens=25, ignore_eos=True))[0]
    assert len(forced.output_ids) == 25 and forced.finish_reason == "length"
    short = smol_fp32.generate([ids], SamplingParams(max_tokens=3))[0]
    assert len(short.output_ids) == 3 and short.finish_reason == "length"


def test_seeded_sampling_reproducible(smol_fp32):
    ids = _chat(smol_fp32, "Name a color.")
    a = SamplingParams(max_tokens=12, temperature=1.3, top_p=0.95, seed=7, ignore_eos=True)
    b = SamplingParams(max_tokens=12, temperature=1.3, top_p=0.95, seed=8, ignore_eos=True)
    outs = smol_fp32.generate([ids, ids, ids], [a, a, b])
    assert outs[0].output_ids == outs[1].output_ids
    assert outs[0].output_ids != outs[2].output_ids


def test_request_too_large_for_cache_is_rejected(tiny_llama_dir):
    engine = LLMEngine(tiny_llama_dir, EngineConfig(dtype="float32", block_size=16,
                                                    num_kv_blocks=4))
    with pytest.raises(RequestError, match="exceeds the KV cache"):
        engine.add_request(list(range(60)), SamplingParams(max_tokens=10))
    assert not engine.has_unfinished


def test_bf16_engine_answers(smollm2_dir):
    engine = LLMEngine(smollm2_dir, EngineConfig(dtype="bfloat16"))
    out = engine.generate([_chat(engine, "What is the capital of France?")],
                          SamplingParams(max_tokens=30))[0]
    assert "Paris" in out.text


def test_prefix_hashes_are_storage_keys(smollm2_dir, smol_fp32):
    ids = _chat(smol_fp32, "Tell me a long story about a lighthouse keeper and the sea.")
    out = smol_fp32.generate([ids], SamplingParams(max_tokens=100, ignore_eos=True))[0]
    tokens = out.prompt_ids + out.output_ids
    keys = smol_fp32.key_space.keys(tokens)
    assert len(keys) == len(tokens) // 64
    hits = smol_fp32.pool.match_prefix([k.block_hash for k in keys])
    assert len(hits) == len(keys)  # every full block the engine cached is named by its key
    smol_fp32.pool.free(hits)
    assert keys[0].model_id.startswith("SmolLM2-135M-Instruct-")
    assert keys[0].layout_id == "kv-float32-L30-kvh3-hd64-bs64"
