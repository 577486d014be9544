"""Runs of blocks that move together: where a copy's destination and source blocks both
advance by one, one strided copy moves the whole stretch (a layer of a 1,640-block hit is
then a few copies, not 1,640 copies of 24 KB, each a Python call and a tensor view)."""

from __future__ import annotations

from collections.abc import Sequence


def paired_runs(dst: Sequence[int], src: Sequence[int]) -> list[tuple[int, int, int]]:
    """``(dst start, src start, count)`` of the maximal stretches over which ``dst[j]`` and
    ``src[j]`` both go up by one, in order; together they cover every pair exactly once.

    Raises ``ValueError`` when the two lists differ in length.
    """
    if len(dst) != len(src):
        raise ValueError(f"{len(dst)} destination blocks for {len(src)} source blocks")
    runs: list[tuple[int, int, int]] = []
    for d, s in zip(dst, src, strict=True):
        if runs:
            d0, s0, n = runs[-1]
            if d == d0 + n and s == s0 + n:
                runs[-1] = (d0, s0, n + 1)
                continue
        runs.append((d, s, 1))
    return runs
