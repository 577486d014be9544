"""Which prompt blocks a prefill loads from its store, pulls from the decode engine's buffer and
pushes into it, by read path (pure) — the one rule both engine kinds follow.

A prompt of ``num_blocks`` blocks whose first ``num_hit_blocks`` are cached splits three ways:

- **loads**: the leading hit blocks the prefill engine reads from storage itself — every hit
  block on the PE path, none on the DE path, the first ``num_pe_read_blocks`` of a split read;
- **pulls**: the rest of the hit, which the decode engine read into its buffer and the prefill
  engine pulls from there;
- **pushes**: every block the decode engine's buffer lacks — the loaded hit blocks and every
  block the forward computes.

Our prefill engine's ``LayerPlan`` (``engine/layerwise.py``), its job's host-pool reads
(``engine/prefill.py``) and the vLLM connector's plan (``integrations/vllm/plan.py``) all derive
their block ranges from :class:`BlockPlan`.
"""

from __future__ import annotations

from dataclasses import dataclass

from dualpath.vocab import ReadPath


@dataclass(frozen=True)
class BlockPlan:
    """One request's prompt blocks by where their KV comes from and goes."""

    read_path: ReadPath
    num_hit_blocks: int
    num_blocks: int  # the prompt's (and the decode buffer's) blocks
    num_pe_read_blocks: int = 0  # split read: leading hit blocks the PE reads (else ignored)

    @property
    def num_load_blocks(self) -> int:
        """Leading hit blocks the prefill engine reads from storage."""
        return load_blocks(self.read_path, self.num_hit_blocks, self.num_pe_read_blocks)

    def loads(self) -> range:
        """Prompt blocks loaded from storage through the prefill engine."""
        return range(self.num_load_blocks)

    def pulls(self) -> range:
        """Prompt blocks pulled from the decode engine's buffer."""
        return range(self.num_load_blocks, self.num_hit_blocks)

    def pushes(self, stop: int | None = None) -> list[int]:
        """Prompt blocks pushed into the decode engine's buffer: the loaded hit blocks, then the
        computed ones below ``stop`` (default: the prompt's end)."""
        end = self.num_blocks if stop is None else stop
        return [*self.loads(), *range(self.num_hit_blocks, end)]


def load_blocks(read_path: ReadPath | str, num_hit_blocks: int, num_pe_read_blocks: int) -> int:
    """Leading hit blocks the prefill engine reads from storage on ``read_path``: the whole hit
    on the PE path, none on the DE path, ``num_pe_read_blocks`` (at most the hit) on a split."""
    if read_path == ReadPath.PE:
        return num_hit_blocks
    if read_path == ReadPath.SPLIT:
        return max(0, min(num_pe_read_blocks, num_hit_blocks))
    return 0
