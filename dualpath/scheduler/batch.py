"""Intra-engine batching: the prefill engine's compute quota (pure; docs/paper.md §5.5, Fig. 6).

Data-parallel attention ranks wait for each other before the MoE/FFN stage, so every PE keeps
the predicted attention time of its forward batch within a compute quota (300 ms in the
paper): requests are packed first-come first-served while the prediction stays within the
quota; the first request that does not fit is cut to the largest chunk that still fits (binary
search) and the rest of it is prefilled in later batches. Decode engines batch everything.

The prediction comes from :class:`AttentionCostModel`, fitted to timings that ``dualpath
profile`` measures on the actual engine and stored with the config.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, TypeVar

DEFAULT_QUOTA_MS = 300.0

Pair = tuple[int, int]  # (cached, bsz)
T = TypeVar("T")
K = TypeVar("K", bound=Hashable)


@dataclass(frozen=True)
class AttentionCostModel:
    """Predicted attention time of a forward batch, in ms: the sum over its requests of
    ``a·bsz·(cached + bsz/2) + b·bsz + c``.

    A request computes ``bsz`` new tokens on top of ``cached`` ones; with causal attention the
    i-th new token attends to ``cached + i`` keys, so the score/value work is
    ``Σ_i (cached + i) ≈ bsz·(cached + bsz/2)`` (the quadratic term, ``a``); ``b`` covers the
    per-token work (projections, KV writes) and ``c`` the per-request overhead.
    """

    a: float
    b: float = 0.0
    c: float = 0.0

    def request_ms(self, cached: int, bsz: int) -> float:
        """Predicted time of one request's share of the batch."""
        return self.a * bsz * (cached + bsz / 2) + self.b * bsz + self.c

    def predict_ms(self, pairs: Sequence[Pair]) -> float:
        """Predicted attention time of a batch of ``(cached, bsz)`` pairs."""
        return sum(self.request_ms(cached, bsz) for cached, bsz in pairs)

    @classmethod
    def fit(cls, samples: Sequence[tuple[Sequence[Pair], float]]) -> AttentionCostModel:
        """Least-squares fit to ``(pairs, measured ms)`` samples (ValueError if degenerate)."""
        rows = [_features(pairs) for pairs, _ in samples]
        ys = [float(ms) for _, ms in samples]
        if len(rows) < 3:
            raise ValueError("fitting three coefficients needs at least three samples")
        normal = [[sum(r[i] * r[j] for r in rows) for j in range(3)] for i in range(3)]
        rhs = [sum(r[i] * y for r, y in zip(rows, ys, strict=True)) for i in range(3)]
        a, b, c = _solve3(normal, rhs)
        return cls(a, b, c)

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe fields."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> AttentionCostModel:
        """Inverse of :meth:`to_dict`."""
        return cls(float(data["a"]), float(data.get("b", 0.0)), float(data.get("c", 0.0)))


def _features(pairs: Sequence[Pair]) -> tuple[float, float, float]:
    return (sum(bsz * (cached + bsz / 2) for cached, bsz in pairs),
            float(sum(bsz for _, bsz in pairs)), float(len(pairs)))


def _solve3(m: list[list[float]], v: list[float]) -> tuple[float, float, float]:
    """Gaussian elimination with partial pivoting on a 3×3 system (columns scaled first)."""
    scale = [max(abs(m[i][j]) for i in range(3)) or 1.0 for j in range(3)]
    rows = [[m[i][j] / scale[j] for j in range(3)] + [v[i]] for i in range(3)]
    for col in range(3):
        pivot = max(range(col, 3), key=lambda r: abs(rows[r][col]))
        if abs(rows[pivot][col]) < 1e-12 * max(1.0, max(abs(x) for x in rows[pivot][:3])):
            raise ValueError("samples do not determine the cost model (vary cached and bsz)")
        rows[col], rows[pivot] = rows[pivot], rows[col]
        for r in range(col + 1, 3):
            f = rows[r][col] / rows[col][col]
            rows[r] = [x - f * y for x, y in zip(rows[r], rows[col], strict=True)]
    x = [0.0, 0.0, 0.0]
    for i in (2, 1, 0):
        x[i] = (rows[i][3] - sum(rows[i][j] * x[j] for j in range(i + 1, 3))) / rows[i][i]
    return x[0] / scale[0], x[1] / scale[1], x[2] / scale[2]


def largest_chunk(cached: int, remaining: int, budget_ms: float, model: AttentionCostModel,
                  align: int = 1) -> int:
    """The largest ``bsz <= remaining`` (a multiple of ``align``, or ``remaining`` itself)
    whose predicted time fits ``budget_ms``; 0 if none does. Binary search (cost grows with bsz).
    """
    if remaining <= 0 or align <= 0:
        raise ValueError("need remaining > 0 and align > 0")
    if model.request_ms(cached, remaining) <= budget_ms:
        return remaining
    lo, hi = 0, (remaining - 1) // align  # in units of align; remaining itself does not fit
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if model.request_ms(cached, mid * align) <= budget_ms:
            lo = mid
        else:
            hi = mid - 1
    return lo * align


def build_prefill_batch(fifo: Iterable[tuple[K, int, int]], quota_ms: float,
                        model: AttentionCostModel, align: int = 1,
                        ) -> list[tuple[K, int, int]]:
    """One PE forward batch from ``(req_id, cached, remaining)`` in FIFO order.

    Whole requests are packed while the predicted attention time stays within ``quota_ms``; the
    first one that does not fit gets the largest chunk that does (:func:`largest_chunk`) and
    packing stops there. Returns ``(req_id, cached, bsz)``; the caller prefills the rest of a
    chunked request in later batches. If not even ``align`` tokens of the head request fit an
    empty batch, the batch is that minimal chunk anyway, so the engine always makes progress.
    """
    if quota_ms < 0:
        raise ValueError("quota_ms must be >= 0")
    batch: list[tuple[K, int, int]] = []
    used = 0.0
    for req_id, cached, remaining in fifo:
        cost = model.request_ms(cached, remaining)
        if used + cost <= quota_ms:
            batch.append((req_id, cached, remaining))
            used += cost
            continue
        bsz = largest_chunk(cached, remaining, quota_ms - used, model, align)
        if not batch and bsz == 0:
            bsz = min(align, remaining)
        if bsz > 0:
            batch.append((req_id, cached, bsz))
        break
    return batch


def build_token_batch(fifo: Iterable[tuple[K, int, int]], budget_tokens: int,
                      ) -> list[tuple[K, int, int]]:
    """The baseline's PE batch (no compute quota): ``(req_id, cached, remaining)`` packed in
    FIFO order while the new tokens fit ``budget_tokens`` (chunked prefill of the last one),
    whatever their contexts cost. Returns ``(req_id, cached, bsz)``.
    """
    if budget_tokens <= 0:
        raise ValueError("budget_tokens must be > 0")
    batch: list[tuple[K, int, int]] = []
    left = budget_tokens
    for req_id, cached, remaining in fifo:
        bsz = min(remaining, left)
        batch.append((req_id, cached, bsz))
        left -= bsz
        if not left:
            break
    return batch


def build_decode_batch(running: Sequence[T]) -> list[T]:
    """Decode engines put every running request in every forward batch (docs/paper.md §5.5)."""
    return list(running)
