"""What the router tracks, as plain records (pure): a request's state and holds, an engine's
load, the capacities it admits against, and the effects a transition asks the I/O loop to carry
out. ``router/state.py`` has the transitions; the vocabularies are ``dualpath.vocab``'s.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dualpath.errors import DualPathError
from dualpath.protocol import Heartbeat, Message
from dualpath.request import SamplingParams
from dualpath.sessions import Session, warm_key, warm_lease_s
from dualpath.vocab import Mode, Phase, ReadPath, Role


class RequestFailed(DualPathError):
    """An engine could not serve a request."""


class RequestAborted(DualPathError):
    """A request was cancelled (by the caller or its deadline)."""


@dataclass(frozen=True)
class EngineInfo:
    """A registered engine."""

    name: str
    role: Role
    node_id: int
    endpoint: str
    nic_address: str = ""  # its compute NIC's grant address ("": none)
    ep_buffer_addr: int = 0  # its EP receive buffer (0: EP traffic off)
    ep_buffer_bytes: int = 0
    incarnation: str = ""  # its process's id (``Hello``): a rejoin of the same one lifts fences
    public_key: str = ""  # its CURVE public key (Z85), from the router's keys: sent in ``Peers``


@dataclass(frozen=True)
class ClusterOutput:
    """A finished request and how it was served."""

    req_id: int
    prompt_ids: list[int]
    output_ids: list[int]
    finish_reason: str
    num_hit_tokens: int
    read_path: str
    prefill_engine: str
    decode_engine: str
    num_computed_tokens: int = 0  # prompt tokens its prefill engine computed
    num_attempts: int = 1  # placements it took (> 1 after an engine was lost)
    # where the time to first token went, and the transfer to decode after it (seconds; see
    # :func:`timeline`): ttft_s, queue_s, read_s, prefill_s, other_s, transfer_s
    timings: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Capacity:
    """Per-engine sizes the router admits against (every engine is configured alike)."""

    block_size: int
    kv_tokens: int  # device KV of one engine
    host_pool_blocks: int  # host-pool slots of one engine
    save_staging_blocks: int  # slots a DE keeps for persisting blocks
    prefill_kv_tokens: int | None = None  # device KV of one PE (None: kv_tokens)

    @property
    def buffer_blocks(self) -> int:
        """Slots a DE can give prompt buffers."""
        return self.host_pool_blocks - self.save_staging_blocks


@dataclass
class Load:
    """What the router has placed on one engine and not yet seen released."""

    seq: int = 0
    tok: int = 0
    kv_tokens: int = 0  # DE: device KV reserved (prompt + max_tokens)
    buffer_blocks: int = 0  # DE: prompt-buffer slots reserved until decoding starts
    pool_blocks: int = 0  # PE: host-pool slots reserved for its reads

    def is_zero(self) -> bool:
        """True when nothing is counted on the engine."""
        return not (self.seq or self.tok or self.kv_tokens or self.buffer_blocks
                    or self.pool_blocks)


@dataclass
class Holds:
    """Everything one attempt of a request holds; released exactly once."""

    pe_load: bool = False
    de_load: bool = False
    de_kv_tokens: int = 0
    de_buffer_blocks: int = 0
    pe_pool_blocks: int = 0
    read_node: int | None = None
    read_tokens: int = 0
    de_read_node: int | None = None  # a split read's DE part
    de_read_tokens: int = 0


@dataclass
class RequestState:
    """One request as the router tracks it."""

    req_id: int
    prompt_ids: tuple[int, ...]
    params: SamplingParams
    mode: Mode
    read_path: ReadPath  # as requested
    num_hit_blocks: int = 0  # storage's hit at submission (then what the engines used)
    phase: Phase = Phase.QUEUED
    wire_id: int = 0  # the current attempt's id on the engines
    pe: str = ""
    de: str = ""
    path: ReadPath | None = None  # the chosen read path of this attempt (pe, de or split)
    num_pe_read_blocks: int = 0  # a split read: leading hit blocks the PE reads
    # this attempt is prefilled on its DE, which keeps its session warm (no PE: ``pe`` is "";
    # conditional disaggregation, ``scheduler.rules.prefill_on_de``)
    local: bool = False
    attempts: int = 0
    num_computed_tokens: int = 0
    output_ids: list[int] = field(default_factory=list)  # output tokens handed to the caller
    # of them, those an earlier attempt generated: the stream moved off a lost decode engine,
    # and this attempt continues from its KV (prompt + these tokens)
    num_prior_outputs: int = 0
    left_de: str = ""  # the DE the stream last moved off (the scheduler places it elsewhere)
    cache_salt: str = ""  # the tenant's salt of its block keys (kv/hashing.salted_seed)
    session: Session | None = None  # the agent session it continues (dualpath/sessions.py)
    holds: Holds = field(default_factory=Holds)
    unseen: dict[str, int] = field(default_factory=dict)  # engine -> heartbeats without it
    sent_s: dict[str, float] = field(default_factory=dict)  # engine -> router clock at the
    # last message of this attempt sent to it (a beat proves a loss only from a later read)
    # router clock (seconds) at submitted, dispatched (the last attempt), buffer_ready,
    # prefilled and first_decode (the DE's first tokens); the PE's own durations (Prefilled)
    marks: dict[str, float] = field(default_factory=dict)
    pe_timings: dict[str, float] = field(default_factory=dict)

    @property
    def num_streamed(self) -> int:
        """Output tokens handed to the caller."""
        return len(self.output_ids)

    @property
    def kv_ids(self) -> tuple[int, ...]:
        """The tokens whose KV this attempt assembles: the prompt, then earlier attempts'
        outputs."""
        return self.prompt_ids + tuple(self.output_ids[: self.num_prior_outputs])

    @property
    def warm(self) -> dict[str, str | float]:
        """The warm-session fields of its ``AllocBuffer`` and ``Prefill`` (none for modes
        that store and read nothing)."""
        if self.mode in (Mode.ORACLE, Mode.RECOMPUTE) or self.session is None:
            return {}
        return {"warm_session": warm_key(self.session, self.cache_salt),
                "warm_lease_s": warm_lease_s(self.session)}

    @property
    def reads(self) -> bool:
        """Whether this request reads its hit from storage at all."""
        return self.mode != Mode.ORACLE and self.num_hit_blocks > 0


def timeline(marks: dict[str, float], pe: dict[str, float]) -> dict[str, float]:
    """Where a request's time to first token went (seconds), from the router's marks of the
    last attempt and the PE's own durations: ``queue_s`` (submitted to placed, plus the PE's
    wait before its first forward), ``read_s`` (placed to the DE's buffer being ready, which
    holds the DE's storage read on the DE path, plus the PE's own read), ``prefill_s`` (the
    PE's forwards), ``other_s`` (messages and loop latency: the rest of ``ttft_s``); then
    ``transfer_s``, from the first token to the DE's first tokens (the KV copied into the
    decode engine and its first step). An earlier failed attempt counts as queueing."""
    if not {"submitted", "dispatched", "buffer_ready", "prefilled"} <= marks.keys():
        return {}
    ttft = marks["prefilled"] - marks["submitted"]
    queue = marks["dispatched"] - marks["submitted"] + pe.get("wait_s", 0.0)
    read = marks["buffer_ready"] - marks["dispatched"] + pe.get("read_s", 0.0)
    prefill = pe.get("forward_s", 0.0)
    out = {"ttft_s": ttft, "queue_s": queue, "read_s": read, "prefill_s": prefill,
           "other_s": ttft - queue - read - prefill,
           # the parts of queue_s and read_s: placement, the PE's wait, the PE's own read
           "queue_router_s": marks["dispatched"] - marks["submitted"],
           "queue_pe_s": pe.get("wait_s", 0.0), "read_pe_s": pe.get("read_s", 0.0)}
    if "first_decode" in marks:
        out["transfer_s"] = marks["first_decode"] - marks["prefilled"]
    return out


@dataclass
class Fence:
    """A DE prompt buffer that a prefill engine the router gave up on may still write: it stays
    out of the DE's pool until that writer is known to have stopped (it answered for the
    request, rejoined as the same process, or its process exited)."""

    pe: str  # the writer
    incarnation: str  # its process (a new process under the same name proves nothing)
    de: str  # the engine holding the buffer
    de_state: EngineState | None  # the DE's registration that counts the blocks (lift: uncount)
    buffer_blocks: int


@dataclass
class Effects:
    """What a transition asks the I/O loop to do."""

    sends: list[tuple[str, Message]] = field(default_factory=list)
    done: list[tuple[int, ClusterOutput | DualPathError]] = field(default_factory=list)
    streamed: list[tuple[int, tuple[int, ...]]] = field(default_factory=list)  # req, new tokens
    # requests to place again once their hit is looked up anew (``RouterState.resume``)
    lookups: list[int] = field(default_factory=list)

    def send(self, engine: str, msg: Message) -> None:
        """Queue a message to an engine."""
        self.sends.append((engine, msg))

    def stream(self, req_id: int, tokens: tuple[int, ...]) -> None:
        """Hand a request's next output tokens to its caller."""
        self.streamed.append((req_id, tokens))

    def lookup(self, req_id: int) -> None:
        """Look up a request's hit again (its ``kv_ids`` grew), then ``resume`` it."""
        self.lookups.append(req_id)

    def finish(self, req_id: int, result: ClusterOutput | DualPathError) -> None:
        """Complete a request for its caller."""
        self.done.append((req_id, result))


@dataclass
class EngineState:
    """A registered engine, its load and its last report."""

    info: EngineInfo
    last_heard_s: float
    load: Load = field(default_factory=Load)
    report: Heartbeat | None = None


@dataclass
class Records:
    """The tables every part of the router state reads and writes: registered engines, open
    requests by request id and by attempt, attempts draining, engines declared lost."""

    capacity: Capacity
    engines: dict[str, EngineState] = field(default_factory=dict)
    requests: dict[int, RequestState] = field(default_factory=dict)  # not yet completed
    draining: dict[int, RequestState] = field(default_factory=dict)  # done, its PE not let go
    by_wire: dict[int, RequestState] = field(default_factory=dict)  # the live attempts
    # engines declared lost (they hear so when they beat again), with the incarnation each was
    lost: dict[str, str] = field(default_factory=dict)
    now_s: float = 0.0  # the time of the input being applied (requests' timeline marks)

    def forget(self, req: RequestState) -> None:
        """Drop a request and its attempt from the tables."""
        self.requests.pop(req.req_id, None)
        self.by_wire.pop(req.wire_id, None)
