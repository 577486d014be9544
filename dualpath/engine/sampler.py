"""Token selection: greedy argmax, or temperature + top-p sampling with per-request seeds."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch

from dualpath.model.kernels import argmax_rows
from dualpath.request import SamplingParams


def top_p_filter(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Zero all but the smallest set of most likely tokens whose mass reaches ``top_p``."""
    if top_p >= 1.0:
        return probs
    sorted_probs, order = probs.sort(descending=True)
    mass_before = sorted_probs.cumsum(-1) - sorted_probs
    sorted_probs[mass_before >= top_p] = 0.0
    return torch.zeros_like(probs).scatter_(-1, order, sorted_probs)


def draw_seed(seed: int, index: int) -> int:
    """Generator seed for output token ``index`` of a request seeded with ``seed``.

    A stable mix (the same in every process and on every engine), so whichever engine samples
    token ``index`` of a request draws the same random numbers.
    """
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


class Sampler:
    """Picks the next token of each row of a logits batch."""

    def __init__(self, seed: int = 0) -> None:
        self._default = torch.Generator().manual_seed(seed)  # unseeded requests share it
        self._num_draws: dict[int, int] = {}  # seeded seq_id -> draws, when no index is given

    def sample(self, logits: torch.Tensor, params: list[SamplingParams], seq_ids: list[int],
               num_outputs: Sequence[int] | None = None) -> list[int]:
        """Next token ids for ``logits [rows, vocab]`` (fp32, or the model's dtype: greedy
        rows take its argmax, sampled rows are converted to fp32 first).

        ``num_outputs[row]`` is how many output tokens the row's sequence already has, i.e. the
        index of the token drawn now. A seeded row's draw depends only on its seed and that
        index, so a request whose first token is sampled on one engine (prefill) and the rest
        on another (decode) gets the tokens one engine would give. Without ``num_outputs`` the
        index is the number of draws this sampler made for the seq id since its ``release``,
        which is right only when this sampler draws every output token of the sequence.
        """
        indices: Sequence[int | None] = [None] * len(params) if num_outputs is None else num_outputs
        if not len(params) == len(seq_ids) == len(indices) == logits.shape[0]:
            raise ValueError(f"{logits.shape[0]} logit rows need as many params, seq ids and "
                             f"indices, got {len(params)}, {len(seq_ids)}, {len(indices)}")
        tokens = argmax_rows(logits)
        if all(p.greedy for p in params):
            return tokens
        logits = logits.cpu()  # generators live on the CPU; sampling rows is cheap there
        for row, (p, seq_id, index) in enumerate(zip(params, seq_ids, indices, strict=True)):
            if p.greedy:
                continue
            probs = torch.softmax(logits[row].float() / p.temperature, dim=-1)
            probs = top_p_filter(probs, p.top_p)
            generator = self._generator(p, seq_id, index)
            tokens[row] = int(torch.multinomial(probs, 1, generator=generator))
        return tokens

    def release(self, seq_id: int) -> None:
        """Forget a finished sequence's draw count."""
        self._num_draws.pop(seq_id, None)

    def _generator(self, params: SamplingParams, seq_id: int,
                   index: int | None) -> torch.Generator:
        if params.seed is None:
            return self._default
        if index is None:
            index = self._num_draws.get(seq_id, 0)
            self._num_draws[seq_id] = index + 1
        # a fresh generator per seeded draw costs about 3 us, against ~1.4 ms for multinomial
        # over a 49k vocabulary
        return torch.Generator().manual_seed(draw_seed(params.seed, index))
