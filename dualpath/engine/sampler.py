"""Token selection: greedy argmax, or temperature + top-p sampling with per-request seeds."""

from __future__ import annotations

import torch

from dualpath.request import SamplingParams


def top_p_filter(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Zero all but the smallest set of most likely tokens whose mass reaches ``top_p``."""
    if top_p >= 1.0:
        return probs
    sorted_probs, order = probs.sort(descending=True)
    mass_before = sorted_probs.cumsum(-1) - sorted_probs
    sorted_probs[mass_before >= top_p] = 0.0
    return torch.zeros_like(probs).scatter_(-1, order, sorted_probs)


class Sampler:
    """Picks the next token of each row of a logits batch."""

    def __init__(self, seed: int = 0) -> None:
        self._default = torch.Generator().manual_seed(seed)
        self._generators: dict[int, torch.Generator] = {}

    def sample(self, logits: torch.Tensor, params: list[SamplingParams],
               seq_ids: list[int]) -> list[int]:
        """Next token ids for ``logits [rows, vocab]`` (fp32)."""
        tokens = logits.argmax(-1).tolist()
        logits = logits.cpu()  # generators live on the CPU; sampling rows is cheap there
        for row, (p, seq_id) in enumerate(zip(params, seq_ids, strict=True)):
            if p.greedy:
                continue
            probs = torch.softmax(logits[row] / p.temperature, dim=-1)
            probs = top_p_filter(probs, p.top_p)
            tokens[row] = int(torch.multinomial(probs, 1, generator=self._generator(p, seq_id)))
        return tokens

    def release(self, seq_id: int) -> None:
        """Forget a finished sequence's generator."""
        self._generators.pop(seq_id, None)

    def _generator(self, params: SamplingParams, seq_id: int) -> torch.Generator:
        if params.seed is None:
            return self._default
        if seq_id not in self._generators:
            self._generators[seq_id] = torch.Generator().manual_seed(params.seed)
        return self._generators[seq_id]
