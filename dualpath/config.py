"""Frozen configuration dataclasses, one per component."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, fields

from dualpath.vocab import EngineKind, Mode, Policy, ReadPath, Role


@dataclass(frozen=True)
class EngineConfig:
    """How one engine runs its model and sizes its paged KV cache."""

    block_size: int = 64
    kv_cache_mb: int = 512  # device memory for the paged KV cache
    num_kv_blocks: int | None = None  # overrides kv_cache_mb when set
    max_num_seqs: int = 64  # running sequences per step
    max_num_batched_tokens: int = 512  # tokens per step; longer prompts are chunked
    dtype: str = "auto"  # compute dtype: auto (bf16 on CPU with bf16 weights), float32, ...
    kv_dtype: str = "auto"  # KV cache dtype; auto follows the compute dtype
    enable_prefix_caching: bool = True
    # Device memory holds this many layers of each block (None: all). Only a layerwise prefill
    # engine runs with a window; the budget then holds num_layers / window times the blocks.
    layer_window: int | None = None
    # "cpu", "cuda", "cuda:N", or "auto": cuda where the engine's host has a GPU, else cpu.
    # Local launchers give each engine its GPU through CUDA_VISIBLE_DEVICES (dualpath/devices.py).
    device: str = "cpu"
    # The share of its GPU's memory an engine process may allocate (torch's per-process memory
    # fraction: weights, KV and activations; the paged KV takes kv_cache_mb of it). None: the
    # launcher's split, 1 / the engines it put on that GPU (all of it for an engine alone).
    gpu_memory_fraction: float | None = None
    threads: int = 1  # torch intra-op threads (one per engine process, see README)
    seed: int = 0
    # The CPU fast path: linear weights prepacked for oneDNN (model/linear.py) and the C
    # kernels of model/kernels.py. False runs plain torch ops, the reference both are tested
    # against.
    cpu_kernels: bool = True
    # An engine process's GIL switch interval (ms; Python's default is 5): how long a thread
    # that wants the GIL waits for the thread holding it. Every KV move hands off between the
    # compute thread and the traffic manager's dispatcher, grant and backend threads, several
    # times per layer; at 5 ms each hand-off can cost a layer's compute (dualpath offline on a
    # 2-core Xeon: 72-90 s at 5 ms, 49 s at 0.5 ms). None leaves Python's default.
    gil_switch_ms: float | None = 0.5

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.max_num_batched_tokens <= 0 or self.max_num_seqs <= 0:
            raise ValueError("block_size, max_num_seqs and max_num_batched_tokens must be > 0")
        if self.gil_switch_ms is not None and not self.gil_switch_ms > 0:
            raise ValueError(f"gil_switch_ms must be > 0 (or None), got {self.gil_switch_ms}")
        if not re.fullmatch(r"cpu|auto|cuda(:\d+)?", self.device):
            raise ValueError(f"device must be cpu, cuda, cuda:N or auto, got {self.device!r}")
        fraction = self.gpu_memory_fraction
        if fraction is not None and not 0 < fraction <= 1:
            raise ValueError(f"gpu_memory_fraction must be in (0, 1] (or None), got {fraction}")

    @classmethod
    def with_overrides(cls, sets: Sequence[str] = (), **values: object) -> EngineConfig:
        """An EngineConfig from ``values`` (field names) and then each ``KEY=VALUE`` of
        ``sets`` (``true``/``false``, int and float values are converted); an unknown field
        or a malformed item is a ValueError that names it. A device of ``auto`` stays ``auto``:
        the caller resolves it against its host."""
        names = {f.name for f in fields(cls)}
        for item in sets:
            key, sep, raw = item.partition("=")
            if not sep or key not in names:
                raise ValueError(f"--set {item!r}: expected KEY=VALUE with KEY in {sorted(names)}")
            values[key] = _parse_value(raw)
        return cls(**values)  # type: ignore[arg-type]


def _parse_value(raw: str) -> object:
    """``true``/``false`` as a bool, then an int, then a float, else the string itself."""
    if raw.lower() in ("true", "false"):
        return raw.lower() == "true"
    for cast in (int, float):
        try:
            return cast(raw)
        except ValueError:
            pass
    return raw


@dataclass(frozen=True)
class StorageConfig:
    """Where full KV blocks persist and how this node's storage NIC is emulated."""

    backend: str = "fs"  # fs | memory | mooncake_store
    root: str = ".cache/kv-store"  # a local disk or a shared POSIX mount
    capacity_gb: float | None = None  # LRU-evict whole suffixes beyond this
    fsync: bool = False  # fsync each block (and its directory) before it counts as written
    o_direct: bool = False  # read with O_DIRECT into aligned buffers (bypass the page cache)
    workers: int = 4  # parallel reads/writes per client
    read_cap_mb_s: float | None = None  # storage-NIC read cap (MB/s); None = uncapped
    write_cap_mb_s: float | None = None  # storage-NIC write cap (MB/s); None = uncapped
    # A read's result is due this long after it was submitted at the latest; blocks not read
    # by then are misses, recomputed (docs/design.md §9: a slow or hung store never stalls a
    # request). None = wait as long as the store takes.
    read_deadline_s: float | None = 5.0
    # Agent sessions (kv/retention.py): under capacity pressure, ended sessions' chains go
    # first and live ones last. A session is live this long after its last turn (longer with
    # a lease_s or next_turn_in_s hint). False: evict by recency alone.
    session_retention: bool = True
    session_window_s: float = 300.0
    # Warm sessions (storage/warm.py): each engine keeps the blocks it read or stored for an
    # agent session in DRAM, up to this many MB (whole sessions go, least recent first, leases
    # last), so the session's next turn placed there skips the storage NIC. 0: off.
    warm_session_mb: float = 256.0
    # ... and a session expected back (a next_turn_in_s hint, or its own past gaps) whose warm
    # copy went is read into a decode engine's DRAM during its tool time (our engines only)
    session_prefetch: bool = True
    # mooncake_store backend: blocks live in the memory segments of Mooncake Store clients
    # (segment holders: `python -m dualpath.storage.mooncake_store serve`), mapped by a master.
    mooncake_master: str = "127.0.0.1:50051"  # the master's RPC address, host:port
    mooncake_metadata_server: str = "P2PHANDSHAKE"  # or an HTTP metadata server's URL
    mooncake_local_host: str = "127.0.0.1"  # the address this client registers with peers
    mooncake_protocol: str = "tcp"  # tcp | rdma
    mooncake_device_name: str = ""  # RDMA devices (rdma only)
    mooncake_segment_mb: int = 0  # memory this client adds to the store (0: none, the default)
    mooncake_local_buffer_mb: int = 0  # Mooncake's registered staging buffer (TCP needs none)
    mooncake_key_prefix: str = "dualpath"  # namespace of this deployment's objects

    def __post_init__(self) -> None:
        if self.read_deadline_s is not None and not self.read_deadline_s > 0:
            raise ValueError(f"read_deadline_s must be > 0 (or None), got {self.read_deadline_s}")
        if not self.warm_session_mb >= 0:
            raise ValueError(f"warm_session_mb must be >= 0, got {self.warm_session_mb}")
        if not self.session_window_s >= 0:
            raise ValueError(f"session_window_s must be >= 0, got {self.session_window_s}")


@dataclass(frozen=True)
class TrafficConfig:
    """An engine's traffic manager: compute-NIC caps, chunk size and lane weights."""

    compute_send_cap_mb_s: float | None = None  # compute-NIC send cap (MB/s); None = uncapped
    compute_recv_cap_mb_s: float | None = None  # compute-NIC receive cap (MB/s); None = uncapped
    chunk_bytes: int = 1 << 20  # arbitration unit: lanes take turns chunk by chunk
    # The KV lanes' chunk (None: chunk_bytes). A KV chunk still waiting out its pacing yields
    # to a high-lane item, so on a capped NIC a larger one costs the high lane no wait, and
    # it cuts the per-byte work (dispatcher turns, grant round trips) of bulk KV traffic.
    kv_chunk_bytes: int | None = None
    # A capped NIC may run this many chunks ahead of its average rate. One chunk would lose
    # bandwidth every time the dispatcher thread is scheduled late (measured: a busy CPU cut a
    # 200 MB/s link to 72-95%); four (5 ms at 200 MB/s) kept it at 100%. 0: no chunk ever
    # moves faster than the rate, not even on an idle NIC (exact wire time, for measuring
    # latency; a late dispatcher loses what it was late by). Peers hold up to this many of
    # this NIC's grants at once (at least two: ``grant_credit``).
    burst_chunks: int = 4
    lane_weights: tuple[tuple[str, int], ...] = (
        ("high", 99), ("kv_load", 1), ("kv_forward", 1), ("kv_save", 1))
    qos_lanes: bool = True  # False: one FIFO for every lane (the ablation of the lanes)
    # Chunks each NIC direction keeps in flight (transfers through a backend with an
    # asynchronous API; copies and grants run one at a time). Measured on an idle 2-core EPYC,
    # uncapped Mooncake TCP (`dualpath bench transfer`'s layer_block_ratio_vs_large, and a
    # 64 KB high-lane write beside a busy KV lane): 1 in flight 0.44-0.62 and 0.8 ms; 2: 0.65
    # and 0.9 ms; 4: 0.82-1.06 and 1.3 ms; 8: 0.9-1.15 and 3.3 ms. A high-lane chunk waits
    # for one slot and then shares the wire with what is in flight, so more costs it latency.
    inflight_chunks: int = 4
    # A transfer whose peer does not grant its NIC's share this long fails (peer dead or hung).
    grant_timeout_s: float = 5.0
    # A layerwise prefill moves a request's KV in groups of consecutive layers of at least
    # this many bytes, as far as the PE's layer window allows (``kv/layer_groups.py``): each
    # move costs a submission, grants, a completion poll and futures whatever its size, so
    # small layers (a short context of a small model) moved one by one spend more CPU on that
    # than on their bytes. 0: one layer per move.
    layer_group_bytes: int = 4 << 20
    # Expert-parallel traffic generator (testbed): bytes per token each prefill forward and
    # decode step exchanges with the other engines of its group on the high lane (0: off).
    ep_bytes_per_token: int = 0

    @property
    def grant_credit(self) -> int:
        """How many of this NIC's grants a peer may hold at once: ``burst_chunks``, and at least
        two, so that this NIC paces a peer's next chunk while the peer paces the one granted
        (with one, the two ends would take turns: half the rate)."""
        return max(2, self.burst_chunks)

    def lane_chunk_bytes(self, lane: str) -> int:
        """The chunk a transfer or copy on ``lane`` (a ``Lane`` value) is cut into."""
        return self.chunk_bytes if lane == "high" else (self.kv_chunk_bytes or self.chunk_bytes)

    def __post_init__(self) -> None:
        if self.chunk_bytes <= 0 or self.burst_chunks < 0:
            raise ValueError("chunk_bytes must be > 0 and burst_chunks >= 0")
        if self.inflight_chunks < 1:
            raise ValueError("inflight_chunks must be >= 1")
        if self.kv_chunk_bytes is not None and self.kv_chunk_bytes <= 0:
            raise ValueError("kv_chunk_bytes must be > 0 (or None for chunk_bytes)")
        if self.layer_group_bytes < 0:
            raise ValueError(f"layer_group_bytes must be >= 0, got {self.layer_group_bytes}")
        if self.ep_bytes_per_token < 0 or not self.grant_timeout_s > 0:
            raise ValueError("ep_bytes_per_token must be >= 0 and grant_timeout_s > 0")
        for cap in (self.compute_send_cap_mb_s, self.compute_recv_cap_mb_s):
            if cap is not None and cap <= 0:
                raise ValueError("compute-NIC caps must be > 0 MB/s (or None for uncapped)")


@dataclass(frozen=True)
class VllmConfig:
    """vLLM instances behind the engine processes (``engine_kind = "vllm"``;
    docs/vllm-connector.md): each engine process starts its own ``vllm serve`` with dualpath's
    KV connector, or drives one the user started (``dualpath engine --vllm-url``)."""

    # the peers' python that has vLLM ("": $DUALPATH_VLLM_PYTHON, else .venv-peers/bin/python
    # in the project checkout)
    python: str = ""
    kv_cache_gb: float = 1.0  # each instance's device KV cache, GiB (--kv-cache-memory-bytes)
    # the same, byte-exact; overrides kv_cache_gb when set (vLLM rounds it down to whole blocks)
    kv_cache_bytes: int | None = None
    max_model_len: int = 4096
    start_timeout_s: float = 300.0  # a `vllm serve` not healthy by then fails the engine
    request_timeout_s: float = 600.0  # one HTTP call to an instance
    extra_args: tuple[str, ...] = ()  # more `vllm serve` flags, e.g. ("--enforce-eager",)
    # vLLM's own prefix cache in each instance, with dualpath's store as the tier below it:
    # what the device holds is a local hit, the rest comes through the store and read paths.
    # Off: every hit comes through the store, as with our engines (whose device memory keeps
    # no prefix across requests)
    prefix_caching: bool = True

    def __post_init__(self) -> None:
        if self.kv_cache_gb <= 0 or self.max_model_len < 1:
            raise ValueError("vllm.kv_cache_gb and vllm.max_model_len must be positive")
        if self.kv_cache_bytes is not None and self.kv_cache_bytes <= 0:
            raise ValueError(f"vllm.kv_cache_bytes must be > 0 (or unset), got "
                             f"{self.kv_cache_bytes}")
        if self.start_timeout_s <= 0 or self.request_timeout_s <= 0:
            raise ValueError("vllm timeouts must be positive")

    @property
    def kv_cache_memory_bytes(self) -> int:
        """Each instance's device KV budget in bytes: ``kv_cache_bytes``, else
        ``kv_cache_gb`` GiB."""
        if self.kv_cache_bytes is not None:
            return self.kv_cache_bytes
        return int(self.kv_cache_gb * 2**30)


@dataclass(frozen=True)
class ClusterConfig:
    """A local PD cluster: engines, their storage and traffic, and how requests flow."""

    engine: EngineConfig = EngineConfig()
    storage: StorageConfig = StorageConfig()
    traffic: TrafficConfig = TrafficConfig()
    mode: Mode = Mode.DUALPATH
    read_path: ReadPath = ReadPath.AUTO  # auto (the shorter node read queue) | pe | de
    policy: Policy = Policy.DUALPATH  # global scheduler: dualpath (docs/paper.md §5) | round_robin
    alpha_tokens: int | None = None  # short read queue; default: tokens a node reads in 3 s
    beta_tokens: int | None = None  # PE overload; default: unlimited until profiled
    profile_path: str | None = None  # `dualpath profile` output: α, β and the PE cost model
    prefill_quota_ms: float = 300.0  # predicted time per PE forward batch (docs/paper.md §5.5)
    # Layerwise prefill (every mode but basic) keeps this many layers of a forward's KV in the
    # PE's device memory: the layer computing and the one loading (docs/design.md §9).
    prefill_layer_window: int = 2
    prefill_kv_cache_mb: int | None = None  # the PE's device-KV budget (None: engine.kv_cache_mb)
    split_read: bool = False  # read one request's hit partly on each side (docs/design.md §9)
    # Conditional disaggregation: an agent session's turn with at most this many tokens to
    # compute beyond its hit is prefilled on the decode engine that keeps the session warm, in
    # its decode batch, so no KV crosses the compute network (0: every turn goes to a prefill
    # engine; our engines only). docs/agents.md
    local_prefill_tokens: int = 512
    host_pool_blocks: int = 512  # full-block slots of each engine's DRAM buffer
    save_staging_blocks: int = 16  # of those, slots a DE keeps for persisting blocks
    heartbeat_s: float = 0.5  # engines report their state this often
    engine_timeout_s: float = 5.0  # an engine silent this long is lost (hung, dead, cut off)
    router_timeout_s: float = 10.0  # an engine whose router is silent this long stops
    num_prefill: int = 1
    num_decode: int = 2
    # The router's engine endpoint: the address it binds (0.0.0.0: every interface) and its
    # port (0: any free one). Engines on other hosts join with `dualpath engine --router`.
    router_host: str = "127.0.0.1"
    router_port: int = 0
    # How engines move KV between each other: Mooncake "tcp", or "rdma" (each engine names
    # its RDMA devices with `dualpath engine --rdma-devices`).
    transfer_protocol: str = "tcp"
    # Mooncake listens on every interface whatever address it is given: engines fence its ports
    # to the cluster's hosts (nftables, as root); true leaves them open (your own firewall
    # keeps them, or a non-root engine on a non-loopback address could not start)
    transfer_open_listeners: bool = False
    # A folder of control-plane keys (`dualpath keys`: router.json, engines/NAME.json); None:
    # the router makes keys for the engines its config names (control_keys.py)
    control_keys: str | None = None
    # What computes behind each engine process: our engine, or a vLLM instance with the KV
    # connector (`dualpath serve --engine vllm`)
    engine_kind: EngineKind = EngineKind.DUALPATH
    vllm: VllmConfig = VllmConfig()

    def __post_init__(self) -> None:
        for name, vocab in (("mode", Mode), ("read_path", ReadPath), ("policy", Policy),
                            ("engine_kind", EngineKind)):
            value = getattr(self, name)
            if value not in tuple(vocab):
                raise ValueError(f"{name} must be one of {', '.join(vocab)}, got {value!r}")
            object.__setattr__(self, name, vocab(value))
        if self.transfer_protocol not in ("tcp", "rdma"):
            raise ValueError(f"transfer_protocol must be tcp or rdma, got "
                             f"{self.transfer_protocol!r}")
        if not 0 <= self.router_port < 65536:
            raise ValueError(f"router_port must be in 0..65535, got {self.router_port}")
        if not 0 < self.save_staging_blocks < self.host_pool_blocks:
            raise ValueError("save_staging_blocks must be > 0 and below host_pool_blocks "
                             f"({self.save_staging_blocks} of {self.host_pool_blocks})")
        if self.local_prefill_tokens < 0:
            raise ValueError(f"local_prefill_tokens must be >= 0, got {self.local_prefill_tokens}")
        if self.prefill_layer_window < 1:
            raise ValueError(f"prefill_layer_window must be >= 1, got {self.prefill_layer_window}")
        if not 0 < self.heartbeat_s < min(self.engine_timeout_s, self.router_timeout_s):
            raise ValueError("heartbeat_s must be > 0 and below engine_timeout_s and "
                             "router_timeout_s")


def engine_config_for(config: ClusterConfig, role: Role) -> EngineConfig:
    """The engine config of a role: a prefill engine runs layerwise prefill (every mode but
    basic) with a window of layers in device memory, and may have its own KV budget."""
    from dataclasses import replace

    if role != Role.PREFILL:
        return config.engine
    budget = ({} if config.prefill_kv_cache_mb is None
              else {"kv_cache_mb": config.prefill_kv_cache_mb, "num_kv_blocks": None})
    window = None if config.mode == Mode.BASIC else config.prefill_layer_window
    return replace(config.engine, layer_window=window, **budget)


def cluster_config_to_json(config: ClusterConfig) -> str:
    """Serialize a cluster config (engines receive theirs this way)."""
    import json
    from dataclasses import asdict

    return json.dumps(asdict(config))


def cluster_config_from_json(text: str) -> ClusterConfig:
    """Parse what ``cluster_config_to_json`` wrote."""
    import json

    data = json.loads(text)
    traffic = dict(data.pop("traffic"))
    traffic["lane_weights"] = tuple(tuple(w) for w in traffic["lane_weights"])
    vllm = dict(data.pop("vllm"))
    vllm["extra_args"] = tuple(vllm["extra_args"])
    return ClusterConfig(engine=EngineConfig(**data.pop("engine")),
                         storage=StorageConfig(**data.pop("storage")),
                         traffic=TrafficConfig(**traffic), vllm=VllmConfig(**vllm), **data)


def engine_roles(config: ClusterConfig) -> list[tuple[str, str, int]]:
    """``(name, role, node_id)`` of every engine the config asks for, prefill first."""
    roles = [Role.PREFILL] * config.num_prefill + [Role.DECODE] * config.num_decode
    return [(f"{role[0]}e{node_id}", role, node_id) for node_id, role in enumerate(roles)]
