"""The Ray launcher on a local three-node Ray cluster (``ray.cluster_utils.Cluster``).

Ray node N offers the resource ``dualpath_node_N``; a ``RayCluster`` of 1 prefill + 2 decode
engines (config nodes 0, 1, 2) must land each engine on its node, serve a multi-turn chat with
the single-process engine's greedy tokens (and storage hits from turn 2 on), turn a
``ray.kill`` of a decode engine's actor into an engine loss the router learns at once (well
before the heartbeat timeout), move the stream it was decoding to the other decode engine and
serve on with the engines left; a config node that no Ray node
offers, or whose resource is used up, fails ``start()`` with an error naming the resource, and
an engine that exits before joining fails it at once.
The Ray cluster and the RayCluster are shared by the module's tests (the last one stops the
RayCluster, SIGSTOPping an engine first: stop must kill it) and always torn down.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import psutil
import pytest
from multiturn import cluster_outputs, make_conversations, reference_outputs, wait_for

from dualpath.config import ClusterConfig, EngineConfig, StorageConfig
from dualpath.engine.llm_engine import LLMEngine
from dualpath.errors import DualPathError
from dualpath.request import SamplingParams
from dualpath.server.launch import engine_command, engine_roles
from dualpath.server.router.client import ClusterOutput

ray = pytest.importorskip("ray")
from ray.cluster_utils import Cluster  # noqa: E402
from ray.util.placement_group import placement_group, remove_placement_group  # noqa: E402

from dualpath.server import launch_ray  # noqa: E402
from dualpath.server.launch_ray import RayCluster, node_resource  # noqa: E402

ENGINE = EngineConfig(dtype="float32", block_size=16, num_kv_blocks=512)
PARAMS = SamplingParams(max_tokens=8, ignore_eos=True)
LONG = SamplingParams(max_tokens=3000, ignore_eos=True)  # decodes for a second or more
CONVS = make_conversations(300, first_lengths=[45, 70, 101], append_lengths=[19, 27], seed=13)
VICTIM_PROMPT = list(range(5, 60))
ENGINE_TIMEOUT_S = 60.0  # heartbeats cannot tell a loss within a test: only Ray's report can
RAY_NODES = 3
OBJECT_STORE_BYTES = 80 * 1024 * 1024  # the router carries no KV through Ray: keep it small


def config(root: Path, **overrides) -> ClusterConfig:
    base = dict(engine=ENGINE, storage=StorageConfig(root=str(root / "kv")), host_pool_blocks=64,
                heartbeat_s=0.2, engine_timeout_s=ENGINE_TIMEOUT_S, router_timeout_s=6.0)
    return ClusterConfig(**{**base, **overrides})


def _node_args(node_id: int) -> dict:
    return {"num_cpus": 1, "resources": {node_resource(node_id): 1.0},
            "object_store_memory": OBJECT_STORE_BYTES}


@pytest.fixture(scope="module")
def ray_nodes():
    """Head + 2 Ray nodes on this machine, node N offering ``dualpath_node_N``; this process
    is connected to it (so ``RayCluster`` uses that connection and leaves it open)."""
    nodes = Cluster(initialize_head=True,
                    head_node_args={**_node_args(0), "include_dashboard": False})
    try:
        for node_id in range(1, RAY_NODES):
            nodes.add_node(**_node_args(node_id))
        ray.init(address=nodes.address)
        yield nodes
    finally:
        ray.shutdown()
        nodes.shutdown()


@pytest.fixture(scope="module")
def ray_cluster(ray_nodes, tiny_long_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("ray-cluster")
    cluster = RayCluster(tiny_long_dir, config(root), log_dir=root / "logs",
                         ray_address=ray_nodes.address)
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="module")
def want(tiny_long_dir) -> list[list[list[int]]]:
    return reference_outputs(tiny_long_dir, ENGINE, CONVS, PARAMS)


# -- helpers --------------------------------------------------------------------------------------




def ray_node_of(resource: str) -> str:
    """The id of the alive Ray node that offers ``resource``."""
    return next(n["NodeID"] for n in ray.nodes() if n["Alive"] and resource in n["Resources"])


def decoding_on(cluster: RayCluster, req_id: int) -> str | None:
    """The decode engine of request ``req_id`` once it is decoding."""
    state = cluster.router.phases().get(req_id)
    return state[2] if state and state[0] == "decoding" else None


def finish_turn(cluster: RayCluster, futures, prompts: list[list[int]],
                want_turn: list[list[int]]) -> list[ClusterOutput]:
    """Every request's output, each the single-process tokens (one on a lost decode engine
    too: its stream moves)."""
    outputs = []
    for i, future in enumerate(futures):
        out = future.result(120)
        assert out.output_ids == want_turn[i], f"conversation {i} differs"
        outputs.append(out)
    return outputs


def next_prompts(prompts, outputs, turn: int) -> list[list[int]]:
    return [p + o.output_ids + c.appended[turn] for p, o, c in zip(prompts, outputs, CONVS,
                                                                     strict=True)]


def assert_idle(cluster: RayCluster) -> None:
    """Every router counter of held resources back at zero."""
    def busy():
        return {k: v for k, v in cluster.router.counters().items()
                if v and k not in ("dropped_messages", "bad_messages", "refused_messages",
                                   "stuck", "refused_peers", "moved", "local_prefills")}
    deadline = time.monotonic() + 20
    while busy() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not busy(), f"not idle: {busy()}"


def free_node_resources() -> dict[str, float]:
    free = ray.available_resources()
    return {node_resource(n): round(free.get(node_resource(n), 0.0), 4) for n in range(RAY_NODES)}


# -- the tests ------------------------------------------------------------------------------------


def test_ray_engines_land_on_their_nodes_and_serve_single_process_tokens(ray_cluster, want):
    for name, _, node_id in engine_roles(ray_cluster.config):
        assert ray_cluster.placement(name)["ray_node"] == ray_node_of(node_resource(node_id))
    assert set(ray_cluster.router.engines) == {"pe0", "de1", "de2"}
    got, hits = cluster_outputs(ray_cluster, CONVS, PARAMS, "dualpath", "auto")
    assert got == want
    assert all(h > 0 for conv in hits for h in conv[1:]), f"turns >= 2 must hit: {hits}"


def gcs_tables() -> bytes:
    """Ray's GCS actor table and task events, raw: what its dashboard, ``ray list actors
    --detail`` and any client of the cluster can read."""
    from ray._private.state import state

    accessor = state._connect_and_get_accessor()
    return b"".join([*accessor.get_actor_table(None, None), *accessor.get_task_events()])


def test_ray_keeps_no_engine_secret_in_its_gcs(ray_cluster, monkeypatch):
    keys = ray_cluster.router.keys
    secrets = [keys.engines[name].secret for name in ray_cluster.router.engines]
    assert len(secrets) == 3
    tables = gcs_tables()
    assert b"dualpath.server.launch_ray" in tables or b"EngineActor" in tables  # read them
    assert [s for s in secrets if s.encode() in tables] == []
    assert keys.router.secret.encode() not in tables
    monkeypatch.setenv("DUALPATH_API_KEY", "sk-serve-key")  # never forwarded to an actor
    monkeypatch.setenv("DUALPATH_CACHE_DIR", "/somewhere")
    forwarded = launch_ray.actor_env_vars(os.environ)
    assert "DUALPATH_API_KEY" not in forwarded and "DUALPATH_ENGINE_KEY" not in forwarded
    assert forwarded["DUALPATH_CACHE_DIR"] == "/somewhere"


def test_ray_kill_of_a_decode_actor_is_an_engine_loss_and_the_cluster_serves_on(ray_cluster,
                                                                               want):
    cluster = ray_cluster
    victim = cluster.submit(VICTIM_PROMPT, LONG)
    de = wait_for(lambda: decoding_on(cluster, victim.req_id), what="the victim to decode")
    prompts = [c.first for c in CONVS]
    futures = [cluster.submit(p, PARAMS) for p in prompts]
    pid = cluster.placement(de)["pid"]
    killed_at = time.monotonic()
    ray.kill(cluster.actor(de))
    wait_for(lambda: de not in cluster.router.engines, timeout_s=ENGINE_TIMEOUT_S / 4,
             what=f"the router to learn {de} is lost")
    assert time.monotonic() - killed_at < ENGINE_TIMEOUT_S / 4  # Ray's report, not silence
    wait_for(lambda: not psutil.pid_exists(pid), timeout_s=10, what="the engine's process to end")
    moved = victim.result(60)  # on the other decode engine, with the fault-free tokens
    assert moved.decode_engine != de and moved.num_attempts == 2
    engine = LLMEngine(cluster.model_dir, ENGINE)
    assert moved.output_ids == engine.generate([VICTIM_PROMPT], LONG)[0].output_ids
    outputs = finish_turn(cluster, futures, prompts, [w[0] for w in want])
    later = []
    for turn in range(1, len(want[0])):
        prompts = next_prompts(prompts, outputs, turn - 1)
        outputs = finish_turn(cluster, [cluster.submit(p, PARAMS) for p in prompts], prompts,
                              [w[turn] for w in want])
        later += outputs
    assert all(o.decode_engine != de for o in later)
    assert_idle(cluster)


def test_ray_start_fails_clearly_when_no_node_offers_a_config_node(ray_nodes, tiny_long_dir,
                                                                   tmp_path):
    cfg = config(tmp_path, num_decode=RAY_NODES)  # config node 3: no Ray node offers it
    started = time.monotonic()
    with pytest.raises(DualPathError, match=node_resource(RAY_NODES)):
        RayCluster(tiny_long_dir, cfg, log_dir=tmp_path / "logs",
                   ray_address=ray_nodes.address).start()
    assert time.monotonic() - started < 10


def test_ray_start_fails_clearly_when_a_node_resource_is_used_up(ray_nodes, tiny_long_dir,
                                                                 tmp_path):
    before = free_node_resources()
    hog = placement_group([{node_resource(2): before[node_resource(2)]}])
    ray.get(hog.ready(), timeout=30)
    try:
        with pytest.raises(DualPathError, match=f"within 3 s.*de2 needs .* of {node_resource(2)}"):
            RayCluster(tiny_long_dir, config(tmp_path), log_dir=tmp_path / "logs",
                       ray_address=ray_nodes.address, placement_timeout_s=3).start()
    finally:
        remove_placement_group(hog)
    # the failed start killed the actors it had asked for: their shares are free again
    wait_for(lambda: free_node_resources() == before, timeout_s=20,
             what=f"{before}, not {free_node_resources()}")


def test_ray_start_fails_at_once_when_an_engine_exits_before_joining(ray_nodes, tiny_long_dir,
                                                                     tmp_path, monkeypatch):
    def bad_command(*args, **kwargs) -> list[str]:
        return [*engine_command(*args, **kwargs), "--no-such-option"]

    monkeypatch.setattr(launch_ray, "engine_command", bad_command)
    started = time.monotonic()
    with pytest.raises(DualPathError, match=r"exited with status 2 before joining"):
        RayCluster(tiny_long_dir, config(tmp_path, num_decode=1), log_dir=tmp_path / "logs",
                   ray_address=ray_nodes.address).start()
    assert time.monotonic() - started < 60  # not the startup timeout


def test_ray_stop_kills_an_engine_that_does_not_exit(ray_cluster, monkeypatch):
    """Runs last: it stops the module's cluster (the fixture's own stop is then a no-op)."""
    monkeypatch.setattr(launch_ray, "STOP_GRACE_S", 1.0)
    names = sorted(ray_cluster.router.engines)
    pids = [ray_cluster.placement(name)["pid"] for name in names]
    os.kill(pids[0], signal.SIGSTOP)  # it cannot obey the router's Shutdown
    started = time.monotonic()
    ray_cluster.stop()
    assert time.monotonic() - started < 10
    wait_for(lambda: not any(psutil.pid_exists(pid) for pid in pids), timeout_s=10,
             what=f"the processes of {names} to end")
