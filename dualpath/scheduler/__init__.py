"""Pure scheduling: engine snapshots, the global (PE, DE, read path) scheduler, PE batching.

Nothing here reads a clock, opens a socket or imports torch: the router and the simulator
adapt it to the world (``tests/test_layering.py`` enforces this).
"""

from dualpath.scheduler.batch import (
    DEFAULT_QUOTA_MS,
    AttentionCostModel,
    build_decode_batch,
    build_prefill_batch,
    build_token_batch,
    largest_chunk,
)
from dualpath.scheduler.global_scheduler import GlobalScheduler, log_step, replay
from dualpath.scheduler.rules import (
    SchedulerParams,
    choose_read_path,
    de_phase1,
    de_phase2,
    high_token_threshold,
    pe_fetch,
    read_plan,
    split_read,
)
from dualpath.scheduler.view import (
    Assignment,
    ClusterView,
    EngineLoad,
    EngineView,
    NodeView,
    PendingRequest,
)

__all__ = [
    "DEFAULT_QUOTA_MS", "Assignment", "AttentionCostModel", "ClusterView",
    "EngineLoad", "EngineView", "GlobalScheduler", "NodeView", "PendingRequest",
    "SchedulerParams", "build_decode_batch", "build_prefill_batch", "build_token_batch",
    "choose_read_path", "de_phase1", "de_phase2", "high_token_threshold", "largest_chunk",
    "log_step", "pe_fetch",
    "read_plan", "replay", "split_read",
]
