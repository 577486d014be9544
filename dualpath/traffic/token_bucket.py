"""Token-bucket bandwidth cap (pure: the caller passes the time and does the waiting).

Used to emulate a storage or compute NIC of a given bandwidth on machines without one: every
transfer reserves its bytes first and starts after the returned delay, so a stream of
transfers moves at most ``rate`` bytes per second on average, with bursts up to ``burst``.
"""

from __future__ import annotations


class TokenBucket:
    """Bytes-per-second budget with a bounded burst; debt is allowed and paid by waiting."""

    def __init__(self, rate_bytes_s: float, burst_bytes: float) -> None:
        if rate_bytes_s <= 0 or burst_bytes < 0:
            raise ValueError("rate must be positive and burst non-negative")
        self.rate_bytes_s = rate_bytes_s
        self.burst_bytes = burst_bytes
        self._tokens = burst_bytes
        self._last: float | None = None

    @property
    def state(self) -> tuple[float, float | None]:
        """``(tokens, last reservation time)``: all a bucket remembers (to share it)."""
        return self._tokens, self._last

    def restore(self, tokens: float, last_s: float | None) -> None:
        """Continue from a ``state`` another holder of the same NIC left."""
        self._tokens, self._last = tokens, last_s

    def reserve(self, nbytes: int, now_s: float) -> float:
        """Take ``nbytes`` at time ``now_s``; return the seconds to wait before sending them."""
        if self._last is not None:
            refill = (now_s - self._last) * self.rate_bytes_s
            self._tokens = min(self.burst_bytes, self._tokens + max(0.0, refill))
        self._last = now_s
        self._tokens -= nbytes
        return max(0.0, -self._tokens / self.rate_bytes_s)

    def refund(self, nbytes: int) -> None:
        """Give back a reservation whose bytes were not sent (at most up to the burst)."""
        self._tokens = min(self.burst_bytes, self._tokens + nbytes)
