"""A decode engine taking over a moved stream: the outputs an earlier engine generated count
as this sequence's own — for ``max_tokens``, stop rules and the next draw's index — and when they
had already ended the request (the lost engine died before saying so) the new first token is
dropped, not streamed."""

from __future__ import annotations

from dualpath.config import EngineConfig
from dualpath.engine.llm_engine import LLMEngine
from dualpath.request import SamplingParams

PROMPT = list(range(10, 40))
PRIOR = [101, 102, 103]
EOS = 299  # the tiny models' eos_token_id


def _engine(model_dir) -> LLMEngine:
    return LLMEngine(model_dir, EngineConfig(block_size=16, num_kv_blocks=16, dtype="float32"))


def test_prior_outputs_count_and_the_first_token_follows_them(tiny_llama_dir):
    engine = _engine(tiny_llama_dir)
    seq = engine.reserve_prefilled(PROMPT, SamplingParams(max_tokens=5, ignore_eos=True), PRIOR)
    assert len(seq.block_table) == -(-(len(PROMPT) + len(PRIOR) + 1) // 16)
    engine.start_prefilled(seq, 7)
    assert seq.output_ids == [*PRIOR, 7] and not seq.is_finished
    assert seq.num_computed_tokens == len(PROMPT) + len(PRIOR)
    while not seq.is_finished:
        engine.step()
    assert len(seq.output_ids) == 5 and seq.finish_reason == "length"  # 3 prior + 2 here


def test_prior_outputs_that_already_ended_the_request_drop_the_first_token(tiny_llama_dir):
    engine = _engine(tiny_llama_dir)
    done = engine.reserve_prefilled(PROMPT, SamplingParams(max_tokens=3, ignore_eos=True), PRIOR)
    engine.start_prefilled(done, 7)
    assert done.is_finished and done.finish_reason == "length" and done.output_ids == PRIOR
    eos = engine.reserve_prefilled(PROMPT, SamplingParams(max_tokens=50), [*PRIOR, EOS])
    engine.start_prefilled(eos, 7)
    assert eos.is_finished and eos.finish_reason == "stop" and eos.output_ids[-1] == EOS
    assert engine.pool.num_free_blocks == 16 and not engine.has_unfinished

