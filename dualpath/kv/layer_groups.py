"""Groups of consecutive layers that a layerwise prefill moves as one submission.

Each move of KV (a load before a layer, a forward after it) costs a fixed amount of CPU
whatever its size: the submission, the grants of its chunks, the poll that sees it complete,
its futures. On a GPU a request's layer is megabytes and that cost vanishes; a short context
of a small model has a few hundred KB per layer, and moved layer by layer most of the CPU goes
to the cost of the moves, not their bytes. So a request's layers move in groups of at least
``group_bytes`` where the layer window allows: a window of W resident layers must hold the
group computing and the group loading, so a group is at most W / 2 layers and divides W (then
the layers a group's slots held before it form one earlier group, whose send frees them all).

Pure arithmetic: no torch, no clock.
"""

from __future__ import annotations


def layers_per_move(layer_bytes: int, group_bytes: int, window: int, num_layers: int) -> int:
    """How many consecutive layers one move of a request carries.

    ``layer_bytes``: the request's bytes per layer in its larger move (loads or forwards);
    ``window``: the PE cache's resident layers (``num_layers`` or more: every layer resident).
    One when a layer already reaches ``group_bytes`` (or ``group_bytes`` is 0), else the
    fewest layers that reach it, at most every layer; under a window, the largest divisor of
    ``window`` that is at most that and at most ``window // 2`` (so 1 for the default window
    of 2). Raises ``ValueError`` on a negative size or a window or layer count below one.
    """
    if layer_bytes < 0 or group_bytes < 0 or window < 1 or num_layers < 1:
        raise ValueError(f"bad sizes: layer {layer_bytes} B, group {group_bytes} B, "
                         f"window {window}, {num_layers} layers")
    if layer_bytes == 0 or group_bytes <= layer_bytes:
        return 1
    wanted = min(-(-group_bytes // layer_bytes), num_layers)
    if window >= num_layers:
        return wanted
    fits = min(wanted, window // 2)
    return max((d for d in range(1, fits + 1) if window % d == 0), default=1)


def group_of(layer_idx: int, group: int, num_layers: int) -> range:
    """The layers moved together with ``layer_idx`` in groups of ``group`` from layer 0."""
    start = layer_idx - layer_idx % group
    return range(start, min(start + group, num_layers))
