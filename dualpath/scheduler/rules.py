"""The selection rules of the global scheduler (pure; docs/paper.md §5.2–5.4 and Algorithm 1).

Each rule works on :class:`EngineLoad` working copies and changes the chosen engine's counters
in place, so a caller can run several rules over one decision. See
:mod:`dualpath.scheduler.global_scheduler` for how they are combined and for the decisions
where the paper is silent.
"""

from __future__ import annotations

import heapq
from bisect import bisect_right
from collections.abc import Callable, Iterable, Mapping, MutableMapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from dualpath.scheduler.view import EngineLoad, PendingRequest
from dualpath.vocab import Policy, ReadPath

FORCED_PATHS = (ReadPath.AUTO, ReadPath.PE, ReadPath.DE)  # what a caller may ask for


@dataclass(frozen=True)
class SchedulerParams:
    """Thresholds (tokens) and policy switches of the global scheduler."""

    alpha_tokens: int  # a node's read queue at or below this is "short" (class C2)
    beta_tokens: int  # a PE with more unfinished tokens than this is overloaded (class C1)
    z_factor: float = 1.05  # high-token DE threshold Z = z_factor × average
    policy: Policy = Policy.DUALPATH  # global_scheduler.POLICIES has what each one does
    split_read: bool = False  # read one request's hit partly on each side
    read_path: ReadPath = ReadPath.AUTO  # auto (shorter queue) | pe | de (Basic's baseline: pe)
    block_size: int = 64  # split-read granularity in tokens

    def __post_init__(self) -> None:
        if self.alpha_tokens < 0 or self.beta_tokens < 0:
            raise ValueError("alpha_tokens and beta_tokens must be >= 0")
        if self.z_factor <= 0 or self.block_size <= 0:
            raise ValueError("z_factor and block_size must be > 0")
        if self.policy not in tuple(Policy):
            raise ValueError(f"policy must be one of {tuple(map(str, Policy))}, "
                             f"got {self.policy!r}")
        if self.read_path not in FORCED_PATHS:
            raise ValueError(f"read_path must be one of {tuple(map(str, FORCED_PATHS))}, "
                             f"got {self.read_path!r}")
        object.__setattr__(self, "policy", Policy(self.policy))
        object.__setattr__(self, "read_path", ReadPath(self.read_path))

    @classmethod
    def from_rates(cls, read_tokens_per_s: float, prefill_tokens_per_s: float,
                   alpha_s: float = 3.0, beta_s: float = 5.0, **overrides: Any) -> SchedulerParams:
        """α = tokens a node reads in ``alpha_s``, β = tokens a PE prefills in ``beta_s`` (A.4)."""
        if read_tokens_per_s <= 0 or prefill_tokens_per_s <= 0:
            raise ValueError("profiled rates must be > 0")
        return cls(alpha_tokens=int(read_tokens_per_s * alpha_s),
                   beta_tokens=int(prefill_tokens_per_s * beta_s), **overrides)

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe fields."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> SchedulerParams:
        """Inverse of :meth:`to_dict`."""
        return cls(**data)


# --- the rules -------------------------------------------------------------------------------


def pe_fetch(waiting: Iterable[PendingRequest], group_engines: Sequence[EngineLoad],
             read_q: Mapping[int, int], params: SchedulerParams,
             ) -> list[tuple[PendingRequest, str]]:
    """Algorithm 1: one PE group's fetch from the head of ``waiting``; (request, PE) pairs.

    Engines with ``tok > β`` (C1) get nothing; the head request goes to the least-``tok``
    engine on a node whose read queue is ``<= α`` (C2), else to the least-``tok`` one of the
    rest (C3); the chosen engine's ``tok`` (and ``seq``) grow in place. The fetch ends when C2
    and C3 are both empty or ``waiting`` is. ``waiting`` itself is not consumed.
    """
    short: list[tuple[int, str, EngineLoad]] = []
    long: list[tuple[int, str, EngineLoad]] = []
    for e in group_engines:
        if e.tok <= params.beta_tokens:
            cls = short if read_q.get(e.node_id, 0) <= params.alpha_tokens else long
            cls.append((e.tok, e.name, e))
    heapq.heapify(short)
    heapq.heapify(long)
    out: list[tuple[PendingRequest, str]] = []
    for req in waiting:
        heap = short or long
        if not heap:
            break
        _, name, e = heap[0]
        e.tok += req.num_tokens
        e.seq += 1
        if e.tok <= params.beta_tokens:
            heapq.heapreplace(heap, (e.tok, name, e))
        else:
            heapq.heappop(heap)
        out.append((req, name))
    return out


def de_phase1(requests: Iterable[PendingRequest], group_tok: MutableMapping[str, int],
              warm_des: Mapping[str, tuple[str, int]] | None = None,
              ) -> list[tuple[PendingRequest, str]]:
    """Phase 1: each request to the DE group with the least total ``tok`` (ties: name); a
    request whose session is warm on a DE (``warm_engine``, a key of ``warm_des``: DE name ->
    its group and free KV tokens) to that DE's group, when the DE has room for it; a moved
    stream to a group other than its ``left_engine``'s when that DE is its group's only one
    and another group has a DE with room for it.

    ``group_tok`` (group -> Σ tok of its DEs) grows in place by each placed request's tokens.
    """
    heap = [(tok, group) for group, tok in group_tok.items()]
    heapq.heapify(heap)
    out: list[tuple[PendingRequest, str]] = []
    if not heap:
        return out
    for req in requests:
        warm_group, free = (warm_des or {}).get(req.warm_engine, ("", 0))
        if warm_group in group_tok and free >= req.num_tokens:
            group_tok[warm_group] += req.num_tokens
            heap = [(tok, group) for group, tok in group_tok.items()]
            heapq.heapify(heap)
            out.append((req, warm_group))
            continue
        elsewhere = _groups_elsewhere(req, heap[0][1], warm_des or {})
        if elsewhere:
            tok, group = min((t, g) for g, t in group_tok.items() if g in elsewhere)
            group_tok[group] = tok + req.num_tokens
            heap = [(t, g) for g, t in group_tok.items()]
            heapq.heapify(heap)
            out.append((req, group))
            continue
        tok, group = heap[0]
        tok += req.num_tokens
        heapq.heapreplace(heap, (tok, group))
        group_tok[group] = tok
        out.append((req, group))
    return out


def _groups_elsewhere(req: PendingRequest, least: str,
                      des: Mapping[str, tuple[str, int]]) -> set[str]:
    """For a moved stream whose ``left_engine`` is the only DE of ``least`` (the group phase 1
    would pick), the other groups with a DE that has room for it; otherwise none."""
    group = des.get(req.left_engine, ("", 0))[0]
    if group != least or sum(1 for g, _ in des.values() if g == group) > 1:
        return set()
    return {g for g, free in des.values() if free >= req.num_tokens and g != group}


def high_token_threshold(private_queue: Iterable[PendingRequest],
                         group_engines: Sequence[EngineLoad], z_factor: float = 1.05) -> float:
    """Z = z_factor × (Σ_{r∈R} len_r + Σ_e tok_e) / |E|.

    R is the longest head of the private queue whose tokens fit in the group's summed free KV
    (as if memory did not fragment).
    """
    free = sum(e.free_kv_tokens for e in group_engines)
    fitting = 0
    for req in private_queue:
        if fitting + req.num_tokens > free:
            break
        fitting += req.num_tokens
    return z_factor * (fitting + sum(e.tok for e in group_engines)) / len(group_engines)


def _pick_de(req: PendingRequest, engines: Sequence[EngineLoad], z: float) -> EngineLoad | None:
    need = req.num_tokens
    engines = without_left(req, engines)
    warm = next((e for e in engines if e.name == req.warm_engine), None)
    if warm is not None and warm.free_kv_tokens >= need and (
            warm.tok + need <= z or warm.tok <= need + min(e.tok for e in engines
                                                           if e.free_kv_tokens >= need)):
        return warm  # its session's blocks are in that DE's DRAM, and it is not overloaded
    best_low: tuple[int, int, str, EngineLoad] | None = None
    best_high: tuple[int, int, str, EngineLoad] | None = None
    for e in engines:
        if e.free_kv_tokens < need:
            continue
        if e.tok + need > z:
            key = (e.tok, e.seq, e.name, e)
            if best_high is None or key[:3] < best_high[:3]:
                best_high = key
        else:
            key = (e.seq, e.tok, e.name, e)
            if best_low is None or key[:3] < best_low[:3]:
                best_low = key
    best = best_low or best_high
    return None if best is None else best[3]


def without_left(req: PendingRequest, engines: Sequence[EngineLoad]) -> Sequence[EngineLoad]:
    """The DEs a request may go to: all but the one a moved stream left, unless no other has
    room for it."""
    if not req.left_engine:
        return engines
    others = [e for e in engines if e.name != req.left_engine]
    return others if any(e.free_kv_tokens >= req.num_tokens for e in others) else engines


def de_phase2(private_queue: Sequence[PendingRequest], group_engines: Sequence[EngineLoad],
              params: SchedulerParams) -> list[tuple[PendingRequest, str]]:
    """Phase 2: place the head of a DE group's private queue, request by request.

    Z is computed once (:func:`high_token_threshold`). A request whose agent session is warm on
    a DE (``warm_engine``) goes there when it has free KV and stays at or below Z, or holds
    no more than the request's own tokens beyond the least loaded DE with room: reading its
    hit from that DE's DRAM is worth a decode load that much less even. Otherwise,
    among DEs with free KV for the head request, those staying at or below Z are preferred,
    least ``seq`` first; else the least ``tok`` one above Z. A moved stream skips the DE it
    left (``left_engine``) while another has room. The chosen DE's ``seq``, ``tok``
    and free KV change in place. The fetch ends at the first request no DE has memory for.
    Returns a head of the queue.
    """
    if not group_engines:
        return []
    z = high_token_threshold(private_queue, group_engines, params.z_factor)
    out: list[tuple[PendingRequest, str]] = []
    for req in private_queue:
        de = _pick_de(req, group_engines, z)
        if de is None:
            break
        de.seq += 1
        de.tok += req.num_tokens
        de.free_kv_tokens -= req.num_tokens
        out.append((req, de.name))
    return out


def prefill_on_de(num_tokens: int, num_hit_tokens: int, free_kv_tokens: int,
                  max_local_tokens: int, de_tok: int = 0, least_tok: int = 0) -> bool:
    """Conditional disaggregation: whether a request is prefilled on the decode engine that
    keeps its session warm instead of on a prefill engine — when at most ``max_local_tokens``
    of its ``num_tokens`` are left to compute beyond its hit, the DE has free KV for all of
    it, and its load (``de_tok``) is no more than the request's tokens beyond the least loaded
    DE with room (``least_tok``; the slack :func:`de_phase2` gives a warm DE), so sessions
    stuck to one engine cannot pile onto it. A turn that appends a few hundred tokens to a
    long context then costs its decode batch one short step, and none of its KV crosses the
    compute network twice."""
    return (0 < num_tokens - num_hit_tokens <= max_local_tokens
            and free_kv_tokens >= num_tokens and de_tok <= least_tok + num_tokens)


def choose_read_path(pe_queue_tokens: int, de_queue_tokens: int) -> ReadPath:
    """The side whose node has the shorter read queue: ``pe`` or ``de`` (tie: ``pe``)."""
    return ReadPath.PE if pe_queue_tokens <= de_queue_tokens else ReadPath.DE


def split_read(hit_tokens: int, pe_queue_tokens: int, de_queue_tokens: int,
               block_size: int) -> tuple[int, int]:
    """Tokens of one hit read on the PE side and on the DE side: (pe, de).

    The PE part x levels the two queues, ``pe_q + x = de_q + (hit - x)``, i.e.
    ``x = (hit + de_q - pe_q) / 2``, so both parts finish together when the two storage NICs
    read equally fast; x is rounded to whole blocks (half a block rounds towards the PE) and
    clamped to ``[0, hit]``. When the queues differ by more than the hit the whole hit goes to
    the shorter side, as without splitting. A trailing partial block stays on the DE side.
    """
    if hit_tokens < 0 or block_size <= 0:
        raise ValueError("need hit_tokens >= 0 and block_size > 0")
    twice = hit_tokens + de_queue_tokens - pe_queue_tokens
    pe = (twice + block_size) // (2 * block_size) * block_size
    pe = min(max(pe, 0), hit_tokens)
    return pe, hit_tokens - pe


def read_plan(hit_tokens: int, pe_queue_tokens: int, de_queue_tokens: int,
              params: SchedulerParams, wish: ReadWish | None = None,
              scheduled: ReadPath | None = None) -> tuple[ReadPath, int, int]:
    """The read path of one request and the hit tokens each side reads:
    ``(read_path, pe_read_tokens, de_read_tokens)``; the one place a read path is decided.

    A request whose session is warm on its DE (``wish.warm_de``) reads there, on the DE path,
    unless its mode or its own path says otherwise or round robin has its turn. Else the
    scheduler's choice — ``scheduled`` (round robin's turn) or, by default, ``params``'
    forced path, else a split that levels the two nodes' read queues (``split_read``), else the
    shorter queue (Algorithm 1) — then the request's ``wish``: a mode that reads on the PE
    (basic, layerwise) always does; a path the request forces wins (a forced split halves the
    hit); a split that leaves one side nothing is no split; and a hit the PE's host pool cannot
    take now (``free_host_blocks``) goes to the DE, unless the request forced its path.
    """
    wish = wish or ReadWish()
    if wish.pe_only:
        return ReadPath.PE, hit_tokens, 0
    if wish.warm_de and wish.read_path == ReadPath.AUTO and scheduled is None:
        return ReadPath.DE, 0, hit_tokens  # from the DE's DRAM: no storage NIC to balance
    if scheduled is not None:
        chosen, pe_tokens = scheduled, hit_tokens if scheduled == ReadPath.PE else 0
    else:
        chosen, pe_tokens, _ = _queue_plan(hit_tokens, pe_queue_tokens, de_queue_tokens, params)
    forced = wish.read_path != ReadPath.AUTO
    path = wish.read_path if forced else chosen
    bs, hit_blocks, pe_blocks = params.block_size, hit_tokens // params.block_size, 0
    if path == ReadPath.SPLIT:
        pe_blocks = hit_blocks // 2 if forced else pe_tokens // bs
        if not hit_tokens or not 0 < pe_blocks < hit_blocks:
            return _sides(ReadPath.PE if forced or pe_blocks else ReadPath.DE, hit_tokens)
    wanted = pe_blocks or (hit_blocks if path == ReadPath.PE else 0)
    if (not forced and hit_tokens and wish.free_host_blocks is not None
            and wanted > wish.free_host_blocks):
        return ReadPath.DE, 0, hit_tokens
    if path == ReadPath.SPLIT:
        return path, pe_blocks * bs, hit_tokens - pe_blocks * bs
    return _sides(path, hit_tokens)


@dataclass(frozen=True)
class ReadWish:
    """What one request brings to its read plan besides the queues."""

    read_path: ReadPath = ReadPath.AUTO  # the request's own path (auto: the scheduler's)
    pe_only: bool = False  # its mode reads on the PE (basic, layerwise)
    free_host_blocks: int | None = None  # the chosen PE's host-pool room (None: unbounded)
    warm_de: bool = False  # the chosen DE keeps its session's blocks warm: read them there


def _queue_plan(hit_tokens: int, pe_queue_tokens: int, de_queue_tokens: int,
                params: SchedulerParams) -> tuple[ReadPath, int, int]:
    """The scheduler's own choice under ``params`` (forced, split or the shorter queue)."""
    if params.read_path != ReadPath.AUTO:
        path = params.read_path
    elif params.split_read and hit_tokens:
        pe, de = split_read(hit_tokens, pe_queue_tokens, de_queue_tokens, params.block_size)
        if pe and de:
            return ReadPath.SPLIT, pe, de
        path = ReadPath.PE if pe else ReadPath.DE
    else:
        path = choose_read_path(pe_queue_tokens, de_queue_tokens)
    return _sides(path, hit_tokens)


def _sides(path: ReadPath, hit_tokens: int) -> tuple[ReadPath, int, int]:
    """The whole hit on one side: the PE's for ``pe``, the DE's otherwise."""
    return (path, hit_tokens, 0) if path == ReadPath.PE else (path, 0, hit_tokens)


def next_in_rotation(names: Sequence[str], last: str | None,
                     eligible: Callable[[str], bool]) -> str | None:
    """The first eligible name after ``last`` in sorted ``names``, wrapping; None if none is."""
    start = 0 if last is None else bisect_right(names, last)
    for i in range(len(names)):
        name = names[(start + i) % len(names)]
        if eligible(name):
            return name
    return None
