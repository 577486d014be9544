"""When a request ends: the one stop rule and the one end-of-sequence set both engine kinds
apply (our decode engine in ``engine/llm_engine.py``, the vLLM decode worker in
``integrations/vllm/engines/decode.py``), so a request ends on the same token on either.

Pure: no torch, sockets or clocks (``tests/test_layering.py``). Stop strings need the text and
stay with the engine that has a tokenizer (ours; vLLM applies its own).
"""

from __future__ import annotations

from collections.abc import Iterable

from dualpath.request import SamplingParams


def eos_ids(spec_eos: Iterable[int], tokenizer_eos: int | None) -> frozenset[int]:
    """The end-of-sequence ids: the checkpoint's (``config.json``/``generation_config.json``)
    and the tokenizer's own, when it names one."""
    ids = set(spec_eos)
    if tokenizer_eos is not None:
        ids.add(tokenizer_eos)
    return frozenset(ids)


def finish_reason(params: SamplingParams, num_outputs: int, last_token: int,
                  num_tokens: int, eos: frozenset[int],
                  max_position: int | None) -> str | None:
    """Why a request ends after its latest token ``last_token`` (its ``num_outputs``-th, the
    sequence ``num_tokens`` long), or None: ``stop`` on an EOS once ``min_tokens`` are out
    (unless ``ignore_eos``), ``length`` at ``max_tokens`` or at the model's context."""
    if num_outputs >= params.min_tokens and not params.ignore_eos and last_token in eos:
        return "stop"
    if num_outputs >= params.max_tokens:
        return "length"
    if max_position is not None and num_tokens >= max_position:
        return "length"
    return None
