"""QoS lanes and their weighted-round-robin arbiter (pure: no clocks, threads or sockets).

Every transfer travels on a lane. Latency-critical traffic takes the high lane; KV loads, KV
forwarding and KV saves take low lanes. The arbiter decides, one fixed-size chunk at a time,
which backlogged lane sends next, by smooth weighted round robin (the nginx upstream
algorithm): with the default weights the high lane gets 99 chunks in 100 while it has demand
and the low lanes are never starved; with only low lanes busy they share the link by weight.
This mirrors the paper's InfiniBand VL arbitration that reserves about 99% to inference traffic.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from enum import StrEnum


class Lane(StrEnum):
    """A traffic class of the compute network."""

    HIGH = "high"  # latency-critical (model execution, control of a running step)
    KV_LOAD = "kv_load"  # hit KV on its way into a prefill engine
    KV_FORWARD = "kv_forward"  # prefill → decode KV of a finished layer
    KV_SAVE = "kv_save"  # KV on its way to storage


DEFAULT_LANE_WEIGHTS: Mapping[Lane, int] = {
    Lane.HIGH: 99, Lane.KV_LOAD: 1, Lane.KV_FORWARD: 1, Lane.KV_SAVE: 1,
}


def validate_weights(weights: Mapping[Lane, int]) -> dict[Lane, int]:
    """The weights as a dict in lane order; ``ValueError`` unless every lane has a positive int."""
    missing = [lane.value for lane in Lane if lane not in weights]
    unknown = [key for key in weights if not isinstance(key, Lane)]
    if missing or unknown:
        raise ValueError(f"lane weights need exactly the lanes {[lane.value for lane in Lane]}"
                         f" (missing {missing}, unknown {unknown})")
    for lane, weight in weights.items():
        if isinstance(weight, bool) or not isinstance(weight, int) or weight <= 0:
            raise ValueError(f"lane {lane.value!r}: weight must be a positive int, got {weight!r}")
    return {lane: weights[lane] for lane in Lane}


def weights_from_pairs(pairs: Collection[tuple[str, int]]) -> dict[Lane, int]:
    """Lane weights from ``(lane name, weight)`` pairs, as configs hold them; validated."""
    try:
        weights = {Lane(name): weight for name, weight in pairs}
    except ValueError as exc:
        raise ValueError(f"unknown lane in weights {list(pairs)}: {exc}") from exc
    if len(weights) != len(pairs):
        raise ValueError(f"a lane appears twice in weights {list(pairs)}")
    return validate_weights(weights)


class LaneArbiter:
    """Smooth weighted round robin over the lanes that have demand; deterministic, O(lanes).

    A lane keeps its running credit while it is idle, so a low lane that is backlogged only at
    some picks still gets its share of those picks. Ties go to the lane declared first.
    """

    def __init__(self, weights: Mapping[Lane, int] = DEFAULT_LANE_WEIGHTS) -> None:
        self.weights = validate_weights(weights)
        self._current = {lane: 0 for lane in self.weights}

    def pick(self, backlogged: Collection[Lane]) -> Lane | None:
        """The lane that sends the next chunk, among ``backlogged``; None if none has demand."""
        best: Lane | None = None
        total = 0
        for lane, weight in self.weights.items():
            if lane not in backlogged:
                continue
            self._current[lane] += weight
            total += weight
            if best is None or self._current[lane] > self._current[best]:
                best = lane
        if best is not None:
            self._current[best] -= total
        return best
