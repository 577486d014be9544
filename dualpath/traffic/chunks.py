"""Transfers as NIC chunks: coalesce contiguous segments, pack them into chunk-sized batches."""

from __future__ import annotations

from collections.abc import Sequence

from dualpath.transfer.base import Segment


def coalesce(segments: Sequence[Segment]) -> list[Segment]:
    """Merge each segment into the previous one when both sides continue contiguously.

    Layer-major placement (layer i of a request's blocks side by side in the PE cache and the DE
    buffer) turns a layer's many layer blocks into one segment on the wire.
    """
    merged: list[Segment] = []
    for local, remote, nbytes in segments:
        if merged:
            p_local, p_remote, p_bytes = merged[-1]
            if p_local + p_bytes == local and p_remote + p_bytes == remote:
                merged[-1] = (p_local, p_remote, p_bytes + nbytes)
                continue
        merged.append((local, remote, nbytes))
    return merged


def split_chunks(segments: Sequence[Segment], chunk_bytes: int) -> list[list[Segment]]:
    """Pack segments, in order, into chunks of at most ``chunk_bytes``.

    A segment that fits in a chunk is never split (it starts a new chunk if the current one
    lacks room); a larger one is cut to fill the current chunk, whole chunks, then a tail.
    Zero-length segments are dropped.
    """
    chunks: list[list[Segment]] = []
    current: list[Segment] = []
    room = chunk_bytes
    for local, remote, nbytes in segments:
        if current and room < nbytes <= chunk_bytes:
            chunks.append(current)
            current, room = [], chunk_bytes
        offset = 0
        while offset < nbytes:
            take = min(room, nbytes - offset)
            current.append((local + offset, remote + offset, take))
            offset += take
            room -= take
            if room == 0:
                chunks.append(current)
                current, room = [], chunk_bytes
    if current:
        chunks.append(current)
    return chunks


def validated(segments: Sequence[Segment]) -> list[Segment]:
    """The segments as tuples; ``ValueError`` unless each is three ints >= 0."""
    out = [tuple(s) for s in segments]
    for seg in out:
        if len(seg) != 3 or any(not isinstance(v, int) or v < 0 for v in seg):
            raise ValueError(f"a segment is (local_addr, remote_addr, nbytes) of ints >= 0: {seg}")
    return out  # type: ignore[return-value]
