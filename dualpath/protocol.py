"""Control-plane messages between the router and the engines (msgpack over ZeroMQ).

Messages carry ids, token ids, counts and buffer addresses — never KV bytes (those move through
the storage and transfer backends). Each message is a frozen dataclass; on the wire it is a
msgpack map with a ``type`` field (a nested record, ``SamplingParams``, is a map in it). No
pickle crosses a socket. ``decode`` checks a frame against its message's schema
(``protocol_check``: every field's type, numbers finite and not negative, roles and names
valid) before anything reads it: a frame that does not fit is a ``ProtocolError``, never a
message. Each fact goes to an engine once: the DE keeps its ``AllocBuffer``'s tokens for the
request's ``Decode``.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field, fields
from typing import Any, ClassVar, NamedTuple

import msgpack

from dualpath.errors import DualPathError
from dualpath.protocol_check import check_fields
from dualpath.request import SamplingParams
from dualpath.vocab import PrefillMode, ReadPath, Role


class ProtocolError(DualPathError):
    """A control message is malformed or of an unknown type."""


_TYPES: dict[str, type[Message]] = {}
HEARTBEAT_SUFFIX = "/hb"  # an engine's heartbeat socket is its name plus this
JOIN_SUFFIX = "/join"  # ... and the socket it joins with (``Join``) its name plus this
ROLES = tuple(Role)
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


def check_engine(name: str, role: str | None = None, node_id: int = 0) -> None:
    """``ValueError`` unless ``name`` is a valid engine name (letters, digits, ``._-``, at most
    64), ``role`` (when given) a known role and ``node_id`` not negative."""
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ValueError(f"engine name {name!r} must match {_NAME.pattern}")
    if role is not None and role not in ROLES:
        raise ValueError(f"role must be one of {', '.join(ROLES)}, got {role!r}")
    if not isinstance(node_id, int) or node_id < 0:
        raise ValueError(f"node id must be an integer >= 0, got {node_id!r}")


@dataclass(frozen=True)
class Message:
    """Base of every control message."""

    type: ClassVar[str] = ""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        _TYPES[cls.type] = cls


def encode(message: Message) -> bytes:
    """Serialize a message with msgpack."""
    return msgpack.packb({"type": message.type, **asdict(message)}, use_bin_type=True)


def decode(raw: bytes) -> Message:
    """Parse bytes into the message class their ``type`` names, checked against its schema;
    ``ProtocolError`` for anything else."""
    try:
        data = msgpack.unpackb(raw, raw=False, strict_map_key=True, use_list=False)
        if not isinstance(data, dict):
            raise ValueError("not a map")
        cls = _TYPES[data.pop("type")]
        names = {f.name for f in fields(cls)}
        values = {k: v for k, v in data.items() if k in names}  # arrays come as tuples
        return cls(**check_fields(cls, values))
    except (KeyError, TypeError, ValueError, RecursionError, msgpack.UnpackException) as exc:
        raise ProtocolError(f"bad control message: {exc}") from exc


# -- engine -> router --------------------------------------------------------------------------
@dataclass(frozen=True)
class Join(Message):
    """A starting engine asks the router for the cluster's configuration (before its Hello)."""

    type: ClassVar[str] = "join"
    name: str
    role: Role
    node_id: int

    def __post_init__(self) -> None:
        check_engine(self.name, self.role, self.node_id)


@dataclass(frozen=True)
class Hello(Message):
    """An engine is up: who it is and how peers reach its registered host buffer."""

    type: ClassVar[str] = "hello"
    name: str
    role: Role
    node_id: int
    endpoint: str  # transfer-backend address of this engine
    nic_address: str = ""  # where peers ask this engine's compute NIC for a grant ("": none)
    ep_buffer_addr: int = 0  # the EP traffic generator's receive buffer (0: EP traffic off)
    ep_buffer_bytes: int = 0  # its size (a peer never writes past it)
    # this engine process's random id, the same for all its hellos: a hello after the router
    # declared it lost comes only once every transfer it had started has ended (it dropped
    # its requests first), so the same incarnation saying hello again lifts its write fences
    incarnation: str = ""

    def __post_init__(self) -> None:
        check_engine(self.name, self.role, self.node_id)
        if len(self.incarnation) > 64:
            raise ValueError("an incarnation is at most 64 characters")


@dataclass(frozen=True)
class BufferReady(Message):
    """DE: a request's buffer is allocated and its hit blocks (if asked) are loaded.

    The buffer is one contiguous region holding the prompt's KV layer-major: layer i of block
    b at ``buffer_addr + (i × num_blocks + b) × layer_block_bytes``.
    """

    type: ClassVar[str] = "buffer_ready"
    req_id: int
    buffer_addr: int
    num_blocks: int
    num_loaded_blocks: int  # leading hit blocks read and verified


@dataclass(frozen=True)
class ReadDone(Message):
    """PE: the storage read of a request finished (the node's read queue shrank)."""

    type: ClassVar[str] = "read_done"
    req_id: int
    num_loaded_blocks: int


@dataclass(frozen=True)
class Prefilled(Message):
    """PE: prompt KV is complete in the DE buffer; the first token is sampled."""

    type: ClassVar[str] = "prefilled"
    req_id: int
    first_token: int
    num_hit_blocks: int  # hit blocks actually used (after any read failure)
    num_computed_tokens: int = 0  # prompt tokens the PE's forwards really computed
    # where the PE's time went, by its own clock (seconds): from accepting the request to its
    # first forward, less its storage read (waiting for host-pool room or for the forwards of
    # requests ahead); the read (submitted to verified, PE path); the first forward's start to
    # the last one's end (layer loads and sends overlap the forwards)
    wait_s: float = 0.0
    read_s: float = 0.0
    forward_s: float = 0.0


@dataclass(frozen=True)
class Tokens(Message):
    """DE, once per decode step: each running request's new tokens, as
    ``(req_id, index of the first, token ids)`` (the index makes a repeat harmless)."""

    type: ClassVar[str] = "tokens"
    items: tuple[tuple[int, int, tuple[int, ...]], ...]


@dataclass(frozen=True)
class Finished(Message):
    """DE: a request ended."""

    type: ClassVar[str] = "finished"
    req_id: int
    output_ids: tuple[int, ...]
    finish_reason: str


@dataclass(frozen=True)
class Failed(Message):
    """Any engine: a request could not be served. From a prefill engine (as its ``Prefilled``
    and ``Aborted``): no write of this request into the DE buffer can still land."""

    type: ClassVar[str] = "failed"
    req_id: int
    error: str


@dataclass(frozen=True)
class Aborted(Message):
    """Any engine: it dropped a request it was told to abort and freed what it held; from a
    prefill engine, once no write of the request into the DE buffer can still land."""

    type: ClassVar[str] = "aborted"
    req_id: int


@dataclass(frozen=True)
class Heartbeat(Message):
    """Any engine, every ``heartbeat_s``: alive, and its real state (the router checks its own
    accounting against it)."""

    type: ClassVar[str] = "heartbeat"
    name: str
    free_kv_blocks: int  # device KV blocks not in use
    free_host_slots: int  # host-pool slots not in use
    read_queue_tokens: int  # the storage client's unfinished reads
    # req ids this engine held when its loop last read its inbox (``inbox_age_s`` ago): a
    # request the router sent before that read and that is not listed was lost on the way
    running: tuple[int, ...] = ()
    inbox_age_s: float = 0.0  # seconds since the work loop last read its inbox
    # seconds since its work last made progress (an inbox read, a finished layer, a vLLM call
    # that received bytes), and how long the step under way is expected to take: work that
    # does not move for ``engine_timeout_s`` beyond a few of these is stuck
    progress_age_s: float = 0.0
    step_budget_s: float = 0.0
    fenced: tuple[int, ...] = ()  # DE: req ids whose buffer it keeps for a writer (``Unfence``)
    # agent sessions whose warm DRAM copy it let go (room, expiry) since its last beat
    warm_dropped: tuple[str, ...] = ()


@dataclass(frozen=True)
class Metrics(Message):
    """An engine's counters (traffic, storage, engine)."""

    type: ClassVar[str] = "metrics"
    name: str
    values: dict[str, Any] = field(default_factory=dict)


# -- router -> engine --------------------------------------------------------------------------
@dataclass(frozen=True)
class AllocBuffer(Message):
    """DE: allocate a buffer for ``num_blocks`` and read the first ``num_read_blocks``.

    The DE keeps ``prompt_ids`` and ``cache_salt`` until the request's ``Decode``, which does not
    repeat them.
    """

    type: ClassVar[str] = "alloc_buffer"
    req_id: int
    prompt_ids: tuple[int, ...]
    num_blocks: int
    num_read_blocks: int
    read_from_block: int = 0  # split read: the DE reads [read_from_block, num_read_blocks)
    cache_salt: str = ""  # the tenant's salt of the block keys (kv/hashing.salted_seed)
    # an agent session's request: keep the blocks this DE reads and stores for it warm in DRAM
    # (storage/warm.py) under this key ("": none), leased for warm_lease_s
    warm_session: str = ""
    warm_lease_s: float = 0.0
    # conditional disaggregation (its Decode is local): the leading hit blocks this DE's own
    # device KV still holds (its prefix cache) are taken from there, the rest read
    local: bool = False


@dataclass(frozen=True)
class Prefill(Message):
    """PE: prefill a prompt layer by layer and assemble its KV in the DE buffer."""

    type: ClassVar[str] = "prefill"
    req_id: int
    prompt_ids: tuple[int, ...]
    num_hit_blocks: int
    read_path: ReadPath  # pe (PE reads the hit KV) | de (pull it from the DE buffer) | split
    de_endpoint: str
    de_buffer_addr: int  # the DE's layer-major buffer (see BufferReady)
    mode: PrefillMode = PrefillMode.LAYERWISE  # see engine/layerwise.py
    # the request's sampling parameters: the PE samples the first token with them (and applies
    # no stop rule: the DE does)
    params: SamplingParams = field(default_factory=SamplingParams)
    num_pe_read_blocks: int = 0  # split read: the PE reads this many leading hit blocks
    # a stream moved off a lost decode engine: the last this-many of ``prompt_ids`` are output
    # tokens already streamed, and the token sampled here is output token number this-many
    num_prior_outputs: int = 0
    cache_salt: str = ""  # the tenant's salt of the block keys (kv/hashing.salted_seed)
    warm_session: str = ""  # keep the blocks this PE reads warm (see AllocBuffer)
    warm_lease_s: float = 0.0


@dataclass(frozen=True)
class Decode(Message):
    """DE: the prompt KV sits in the buffer; decode from ``first_token``.

    Only what the DE does not have yet: its ``AllocBuffer`` gave the tokens and the salt.
    """

    type: ClassVar[str] = "decode"
    req_id: int
    first_token: int
    num_stored_blocks: int  # leading blocks already in storage (not re-saved)
    params: SamplingParams  # the request's sampling parameters and stop rules
    oracle: bool = False  # timing upper bound: no buffer copy-in, nothing persisted
    # a stream moved off a lost decode engine: the last this-many of the ``AllocBuffer``'s
    # ``prompt_ids`` are output tokens already streamed; stop rules, ``max_tokens`` and seeded
    # draws count them, and this engine streams from ``first_token`` on (which it drops if they
    # already ended the request)
    num_prior_outputs: int = 0
    # conditional disaggregation: no PE ran; only the buffer's ``num_stored_blocks`` leading
    # blocks hold KV, this engine prefills the rest and samples the first token itself (it
    # streams from there; ``first_token`` is ignored)
    local: bool = False


@dataclass(frozen=True)
class Prefetch(Message):
    """DE: read an agent session's stored chain into DRAM during its tool time
    (``StorageClient.prefetch``: lowest priority, gone at expiry unless used)."""

    type: ClassVar[str] = "prefetch"
    warm_session: str  # the key its next turn's messages carry (AllocBuffer.warm_session)
    token_ids: tuple[int, ...]  # the chain: the last turn's prompt and output
    cache_salt: str = ""
    warm_lease_s: float = 0.0
    expires_in_s: float = 60.0  # read nothing after this, and drop it then unless used


@dataclass(frozen=True)
class Abort(Message):
    """Any engine: stop a request in whatever phase it is, free what it holds, answer
    ``Aborted`` (a request the engine does not know is answered too)."""

    type: ClassVar[str] = "abort"
    req_id: int
    # DE: a prefill engine the router gave up on may still write the prompt buffer: keep it
    # (out of the pool) until ``Unfence`` names the request
    fenced: bool = False


@dataclass(frozen=True)
class Unfence(Message):
    """DE: no writer can reach these requests' fenced prompt buffers any more: free them."""

    type: ClassVar[str] = "unfence"
    req_ids: tuple[int, ...]


@dataclass(frozen=True)
class HeartbeatAck(Message):
    """The router heard a heartbeat. ``known`` is False when the router has declared this
    engine lost: the engine drops every request it holds and says hello again."""

    type: ClassVar[str] = "heartbeat_ack"
    known: bool = True


class PeerInfo(NamedTuple):
    """One registered engine as ``Peers`` lists it (on the wire: a plain array)."""

    name: str
    role: str  # "prefill" | "decode"
    node_id: int
    endpoint: str  # transfer-backend address
    nic_address: str  # compute-NIC grant address ("": none)
    ep_buffer_addr: int  # EP receive buffer (0: none)
    ep_buffer_bytes: int  # its size
    public_key: str = ""  # its CURVE public key (Z85): the others' grant servers admit it


@dataclass(frozen=True)
class Peers(Message):
    """Every registered engine (the receiver included), sent to each of them whenever the
    membership changes: an engine joined, rejoined or was lost. The engines learn each other's
    compute-NIC grant address and EP receive buffer from it."""

    type: ClassVar[str] = "peers"
    peers: tuple[PeerInfo, ...] = ()

    def __post_init__(self) -> None:
        # msgpack hands back plain arrays: give them their field names again
        object.__setattr__(self, "peers", tuple(PeerInfo(*p) for p in self.peers))
        for peer in self.peers:
            check_engine(peer.name, peer.role, peer.node_id)


@dataclass(frozen=True)
class JoinConfig(Message):
    """The router's answer to ``Join``: what every engine of this cluster runs with.

    ``model_id`` is the router's checkpoint id (an engine with other weights must not join: its
    KV keys would differ); ``cluster_id`` names this router's run, so that engines of one node
    find their shared storage-NIC account. A non-empty ``error`` refuses the engine.
    """

    type: ClassVar[str] = "join_config"
    config_json: str
    model_id: str
    cluster_id: str
    error: str = ""


@dataclass(frozen=True)
class GetMetrics(Message):
    """Ask an engine for its counters."""

    type: ClassVar[str] = "get_metrics"


@dataclass(frozen=True)
class Shutdown(Message):
    """Stop the engine process."""

    type: ClassVar[str] = "shutdown"
