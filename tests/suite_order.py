"""Which test modules the suite starts first (``tests/conftest.py`` orders the run by it)."""

from __future__ import annotations

# The modules that take longest, longest first (seconds under `make test`'s two workers on the
# 2-core EPYC, 2026-12-07). They start first, so that the workers, which take whole modules
# (`--dist loadfile`), end together instead of one running a long module alone at the end.
LONGEST_FIRST = (
    "integrations/test_vllm_connector.py",  # 155
    "integrations/test_vllm_faults.py",  # 145
    "integrations/test_vllm_serve.py",  # 142
    "cluster/test_faults.py",  # 126
    "integrations/test_vllm_pd.py",  # 121
    "cluster/test_multiturn.py",  # 96
    "cluster/test_fences.py",  # 89
    "test_bench_layerwise.py",  # 68
    "test_bench_engine.py",  # 67
    "bench/test_bench_agents.py",  # 58
    "integrations/test_vllm_shm.py",  # 50
    "test_bench_cluster.py",  # 48
    "engine/test_engine.py",  # 48
    "server/test_api_stream_moves.py",  # 46
    "cluster/test_ray_launcher.py",  # 44
    "server/test_api_fuzz.py",  # 40
    "storage/test_mooncake_store.py",  # 40
)


def longest_first(path: str) -> int:
    """Where a test module (``tests/...`` relative path) starts: its rank in
    ``LONGEST_FIRST``, or after all of them."""
    rel = path.removeprefix("tests/")
    return LONGEST_FIRST.index(rel) if rel in LONGEST_FIRST else len(LONGEST_FIRST)
