"""Host↔device copies as NIC work: pieces of at most ``chunk_bytes``, and how one piece runs.

docs/paper.md §4.2: every byte into or out of the device goes through the device's compute NIC, so a
copy is cut into chunk-sized pieces that queue in the lanes of the NIC direction it loads
(host → device: the receive side; device → host: the send side) beside that direction's
transfers. A piece is a flat ``uint8`` view when both sides are contiguous tensors of one
dtype (or plain buffers), else a slice along the leading dimension (``data[:, block]`` of a
paged cache). On CUDA the dispatcher thread issues ``copy_(non_blocking=True)`` on a dedicated
stream per device, after an event recorded on the submitter's stream at submit time (so the
copy sees the compute that produced its source), records an event of its own and leaves the
group in flight: the direction polls that event before it counts the group done. Pieces
smaller than a chunk (the blocks of one layer) share a work item (``group_pieces``): one queue
turn, and on CUDA one event, for the group.

A submitter that consumes the copy on a CUDA stream (the layerwise prefill's loads) need not
wait on the host for the bytes to land: with a ``CopyIssue`` in the context, each group's
event is handed over as soon as it is recorded, and ``CopyIssue.future`` resolves with all of
them once every group is issued; the consumer's stream waits on those events
(``cuda_events.stream_wait``). The submission's own future still means "landed" (whoever frees
a copy's source waits for that one).
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

Piece = tuple[Any, Any, int]
"""One piece of a copy: ``(dst view, src view, nbytes)``."""


def is_tensor(x: Any) -> bool:
    """Whether ``x`` looks like a torch tensor (duck-typed: torch is imported only if used)."""
    return hasattr(x, "copy_") and hasattr(x, "data_ptr")


def copy_pieces(dst: Any, src: Any, chunk_bytes: int) -> tuple[list[Piece], int]:
    """``dst`` ← ``src`` cut into pieces of at most ``chunk_bytes`` where possible, and the total.

    Tensors need equal shapes (or both contiguous with equal byte counts); buffers need equal
    byte counts. Raises ``ValueError`` otherwise.
    """
    if is_tensor(dst):
        if not is_tensor(src):
            raise ValueError("a copy into a tensor needs a tensor source")
        same_bytes = dst.nbytes == src.nbytes and dst.dtype == src.dtype
        if dst.shape != src.shape and not (same_bytes and _contiguous(dst, src)):
            raise ValueError(f"copy of a {tuple(src.shape)} tensor into {tuple(dst.shape)}")
        return _tensor_pieces(dst, src, chunk_bytes), int(dst.nbytes)
    out = memoryview(dst).cast("B")
    data = memoryview(src).cast("B")
    if out.nbytes != data.nbytes:
        raise ValueError(f"copy of {data.nbytes} bytes into a buffer of {out.nbytes}")
    pieces = [(out[i: i + chunk_bytes], data[i: i + chunk_bytes], min(chunk_bytes, out.nbytes - i))
              for i in range(0, out.nbytes, chunk_bytes)]
    return pieces, out.nbytes


def _contiguous(dst: Any, src: Any) -> bool:
    return bool(dst.is_contiguous() and src.is_contiguous())


def _tensor_pieces(dst: Any, src: Any, chunk_bytes: int) -> list[Piece]:
    nbytes = int(dst.nbytes)
    if nbytes <= chunk_bytes and dst.shape == src.shape:
        return [(dst, src, nbytes)]  # one piece as it is (e.g. a layer block)
    if dst.dtype == src.dtype and _contiguous(dst, src) and dst.dim() and src.dim():
        import torch

        flat_d, flat_s = dst.reshape(-1).view(torch.uint8), src.reshape(-1).view(torch.uint8)
        return [(flat_d[i: i + chunk_bytes], flat_s[i: i + chunk_bytes],
                 min(chunk_bytes, nbytes - i)) for i in range(0, nbytes, chunk_bytes)]
    if nbytes <= chunk_bytes or dst.dim() == 0:
        return [(dst, src, nbytes)]
    rows = int(dst.shape[0])
    row_bytes = nbytes // rows
    if row_bytes > chunk_bytes:
        return [p for r in range(rows) for p in _tensor_pieces(dst[r], src[r], chunk_bytes)]
    step = max(1, chunk_bytes // row_bytes)
    return [(dst[r: r + step], src[r: r + step], row_bytes * min(step, rows - r))
            for r in range(0, rows, step)]


class CopyIssue:
    """The CUDA events one copy submission's work items record on their copy streams.

    ``expect(n)`` says how many items will report; ``future`` resolves with the list of events
    once all ``n`` have (or at once for ``n == 0``), or with the submission's error. Thread-safe:
    items report from dispatcher threads.
    """

    def __init__(self) -> None:
        self.future: Future[list[Any]] = Future()
        self.future.set_running_or_notify_cancel()
        self._events: list[Any] = []
        self._expected: int | None = None
        self._lock = threading.Lock()

    def expect(self, num_items: int) -> None:
        """Set the number of work items that will report an event (once, before any runs)."""
        with self._lock:
            self._expected = num_items
        self._resolve_if_complete()

    def add(self, event: Any) -> None:
        """One work item's copies are issued; ``event`` completes when they have landed."""
        with self._lock:
            self._events.append(event)
        self._resolve_if_complete()

    def follow(self, landed: Future[Any]) -> None:
        """Settle with ``landed`` (the submission's future) if it settles first: its error, or,
        landed without every event (nothing to wait for then), the events seen so far."""
        landed.add_done_callback(self._on_landed)

    def _on_landed(self, landed: Future[Any]) -> None:
        exc = landed.exception()
        with self._lock:
            if self.future.done():
                return
            if exc is not None:
                self.future.set_exception(exc)
            else:
                self.future.set_result(list(self._events))

    def _resolve_if_complete(self) -> None:
        with self._lock:
            if self.future.done() or self._expected is None:
                return
            if len(self._events) >= self._expected:
                self.future.set_result(list(self._events))


@dataclass(frozen=True)
class TensorContext:
    """What a tensor copy takes from its submitter's thread: device, stream order, torch modes.

    Inference and grad modes are thread-local, and the dispatcher thread copies: an inference
    tensor can only be written inside inference mode.
    """

    device: Any | None  # the CUDA device the copy touches; None for a host copy
    ready: Any | None  # an event on the submitter's current stream of that device
    inference: bool
    grad: bool
    issue: CopyIssue | None = None  # where each group's copy-stream event is reported


def tensor_context(dst: Any, src: Any, issue: CopyIssue | None = None) -> TensorContext | None:
    """The submitter's context for a tensor copy (None for buffers); call on its thread.
    ``issue`` receives the copy-stream events of CUDA copies (ignored for host copies)."""
    if not is_tensor(dst):
        return None
    import torch

    device = next((t.device for t in (dst, src) if is_tensor(t) and t.is_cuda), None)
    ready = None
    if device is not None:
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(device))
    return TensorContext(device, ready, torch.is_inference_mode_enabled(),
                         torch.is_grad_enabled(), issue if device is not None else None)


def submission_context(pairs: list[tuple[Any, Any]],
                       issue: CopyIssue | None = None) -> TensorContext | None:
    """The one context a submission's copies share (one copy stream, one ready event), taken
    from a pair that touches CUDA if any; None for buffer copies. Raises ``ValueError`` when
    ``pairs`` mix tensors and buffers or span CUDA devices. Call on the submitter's thread."""
    if len({is_tensor(dst) for dst, _ in pairs}) > 1:
        raise ValueError("one submission's copies mix tensors and buffers")
    on_cuda = [pair for pair in pairs if any(is_tensor(t) and t.is_cuda for t in pair)]
    devices = {t.device for pair in on_cuda for t in pair if t.is_cuda}
    if len(devices) > 1:
        raise ValueError(f"one submission's copies span devices {sorted(map(str, devices))}")
    return tensor_context(*(on_cuda or pairs)[0], issue) if pairs else None


def group_pieces(pieces: list[Piece], chunk_bytes: int) -> list[list[Piece]]:
    """Consecutive pieces in groups of at most ``chunk_bytes`` (a larger piece stays alone):
    one NIC work item each."""
    groups: list[list[Piece]] = []
    group_bytes = chunk_bytes
    for piece in pieces:
        if group_bytes + piece[2] > chunk_bytes:
            groups.append([])
            group_bytes = 0
        groups[-1].append(piece)
        group_bytes += piece[2]
    return groups


class PieceCopier:
    """Runs pieces: host copies inline, CUDA copies on a dedicated stream per device and
    calling thread (threads that share a copier never share a stream)."""

    def __init__(self) -> None:
        self._local = threading.local()

    def stream(self, device: Any) -> Any:
        """This thread's copy stream on ``device`` (created on first use)."""
        streams: dict[Any, Any] | None = getattr(self._local, "streams", None)
        if streams is None:
            streams = self._local.streams = {}
        stream = streams.get(device)
        if stream is None:
            import torch

            stream = streams[device] = torch.cuda.Stream(device=device)
        return stream

    def issue(self, pieces: list[Piece], ctx: TensorContext | None) -> Any | None:
        """Copy ``pieces`` in order: host copies at once (returns None once they are done);
        CUDA copies issued on this thread's copy stream after the submitter's ``ready`` event,
        returning the event that completes when they have landed (also handed to
        ``ctx.issue`` at once). Never waits for the device."""
        if ctx is None:
            for dst, src, _ in pieces:
                dst[:] = src
            return None
        import torch

        with torch.inference_mode(ctx.inference), torch.set_grad_enabled(ctx.grad):
            if ctx.device is None:
                for dst, src, _ in pieces:
                    dst.copy_(src)
                return None
            stream = self.stream(ctx.device)
            with torch.cuda.stream(stream):
                if ctx.ready is not None:
                    stream.wait_event(ctx.ready)
                for dst, src, _ in pieces:
                    dst.copy_(src, non_blocking=True)
                done = torch.cuda.Event()
                done.record(stream)
        if ctx.issue is not None:
            ctx.issue.add(done)
        return done
