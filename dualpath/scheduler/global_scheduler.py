"""The global scheduler: (PE, DE) pair and read path per request (pure; docs/paper.md §5.1–5.4).

Flow. ``submit`` appends to one FIFO waiting queue. On ``schedule(view)`` the fetching groups
pull work: each PE group runs Algorithm 1 over the head of the FIFO (:func:`pe_fetch`); a
request that got a PE holds it and moves to the DE global queue; phase 1 drains that queue,
each request to the DE group with the fewest tokens (:func:`de_phase1`); phase 2 places the
head of each group's private queue on a DE (:func:`de_phase2`). Once a request has both
engines its read path is chosen and its :class:`Assignment` returned; a request whose DE is
not found yet stays queued, in order, holding its PE.

Decisions where the paper is silent:

* ``tok`` is the prompt length (hit included): the paper's "total token count", its load proxy.
  β must be in the same unit (prompt tokens a PE gets through in 5 s at the usual hit rate).
  A DE needs ``num_tokens`` of free KV for a request (headroom for generated tokens is the
  reporter's business: it reports what is free for new requests).
* Tokens of requests that hold a PE but no DE count in that PE's ``tok`` until their
  Assignment is returned (afterwards the view the router reports counts them). Phase 1 counts a
  DE group's private queue in its load, so the outcome does not depend on how calls batch.
* ``read_q`` grows by the hit when a path is chosen (on the reading node, or both for a split),
  in a working copy: later path choices in the same call see it. Paths are chosen after every
  fetch of the call, in submission order, so α classes use the queues reported in the view
  (within one PE fetch no path is known yet, as in Algorithm 1).
* Unless ``fetching`` names some, every group fetches on every call; PE groups fetch in turn,
  the first one rotating by one per call. DE groups run phase 2 in name order.
* Ties: least ``tok`` then name (PE); least ``seq``, then ``tok``, then name among the DEs
  below Z, least ``tok``, then ``seq``, then name above it; equal read queues → the PE side.
* Split read (the paper's future work, off by default): see :func:`split_read`.
* A moved stream (``left_engine``: the DE it left, which failed or lost it) goes to another DE
  while one has room for it: its model server may be dying, and placed back there the stream
  would move a second time.
* ``round_robin`` (the paper's load-balance baseline): PEs and DEs each in name-order rotation,
  skipping a PE over β or a DE without memory for the request (safety, not balancing); the
  read path alternates PE, DE, PE, ... per request, ignoring queues.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Collection, Iterable, Mapping
from typing import Any

from dualpath.scheduler.rules import (
    ReadWish,
    SchedulerParams,
    choose_read_path,
    de_phase1,
    de_phase2,
    high_token_threshold,
    next_in_rotation,
    pe_fetch,
    read_plan,
    split_read,
    without_left,
)
from dualpath.scheduler.view import Assignment, ClusterView, EngineLoad, PendingRequest
from dualpath.vocab import Policy, ReadPath, Role

__all__ = [
    "POLICIES", "GlobalScheduler", "SchedulerParams", "choose_read_path", "de_phase1", "de_phase2",
    "high_token_threshold", "log_step", "pe_fetch", "read_plan", "replay", "split_read",
]


# --- the scheduler ---------------------------------------------------------------------------


class GlobalScheduler:
    """Holds the waiting FIFO and the DE queues; turns views into assignments.

    With ``record=True`` every submit and schedule call is kept in :attr:`log` (see
    :func:`replay` for its format), so a run can be replayed exactly.
    """

    def __init__(self, params: SchedulerParams, record: bool = False) -> None:
        self.params = params
        self._waiting: deque[PendingRequest] = deque()  # the PE FIFO
        self._global: deque[PendingRequest] = deque()  # holding a PE, no DE group yet
        self._private: dict[str, deque[PendingRequest]] = {}
        self._private_tok: dict[str, int] = {}
        self._pe_of: dict[int, str] = {}  # req_id -> the PE it holds
        self._held_tok: dict[str, int] = {}  # PE -> tokens of requests holding it
        self._order: dict[int, int] = {}  # req_id -> submission number, while queued
        self._submitted = 0
        self._turn = 0  # which PE group fetches first
        self._rr_last: dict[Role, str | None] = {Role.PREFILL: None, Role.DECODE: None}
        self._rr_next_path = ReadPath.PE
        self.log: dict[str, Any] | None = (
            {"params": params.to_dict(), "steps": []} if record else None)
        self._new: list[PendingRequest] = []
        self._host_taken: dict[str, int] = {}

    def __len__(self) -> int:
        """Requests submitted and not yet assigned."""
        return len(self._order)

    def queued(self) -> list[int]:
        """Ids of the requests not yet assigned, in submission order."""
        return sorted(self._order, key=self._order.__getitem__)

    def submit(self, request: PendingRequest) -> None:
        """Append a request to the waiting FIFO (ValueError if its id is already queued)."""
        if request.req_id in self._order:
            raise ValueError(f"request {request.req_id} is already queued")
        self._order[request.req_id] = self._submitted
        self._submitted += 1
        self._waiting.append(request)
        if self.log is not None:
            self._new.append(request)

    def cancel(self, req_id: int) -> bool:
        """Drop a queued request wherever it waits; returns whether it was queued."""
        if self._order.pop(req_id, None) is None:
            return False
        self._new = [r for r in self._new if r.req_id != req_id]
        queue, req = next((q, r) for q in (self._waiting, self._global, *self._private.values())
                          for r in q if r.req_id == req_id)
        queue.remove(req)
        self._private_tok = {g: sum(r.num_tokens for r in q) for g, q in self._private.items()}
        pe = self._pe_of.pop(req_id, None)
        if pe is not None:
            self._held_tok[pe] -= req.num_tokens
            if not self._held_tok[pe]:
                del self._held_tok[pe]
        return True

    def schedule(self, view: ClusterView,
                 fetching: Collection[str] | None = None) -> list[Assignment]:
        """Let the groups in ``fetching`` (default: all) fetch; the completed assignments.

        Assignments come in submission order. Requests not placed stay queued, in order.
        """
        self._reclaim(view)
        self._host_taken = {}  # PE -> host-pool blocks this call's assignments read into
        fetch = None if fetching is None else frozenset(fetching)
        out = POLICIES[self.params.policy](self, view, fetch)
        if self.log is not None:
            self.log["steps"].append(log_step(self._new, view, fetching, out))
            self._new = []
        return out

    # --- dualpath ---

    def _dualpath(self, view: ClusterView, fetch: frozenset[str] | None) -> list[Assignment]:
        self._fetch_prefill(view, fetch)
        return self._finish(view, self._fetch_decode(view, fetch))

    def _fetch_prefill(self, view: ClusterView, fetch: frozenset[str] | None) -> None:
        groups = view.groups(Role.PREFILL)
        names = [g for g in groups if fetch is None or g in fetch]
        if not self._waiting or not names:
            return
        start = self._turn % len(names)
        self._turn += 1
        read_q = view.read_queues()
        beta, held = self.params.beta_tokens, self._held_tok
        for group in names[start:] + names[:start]:
            if not self._waiting:
                break
            members = groups[group]
            if all(e.tok + held.get(e.name, 0) > beta for e in members):
                continue  # every engine is over β (C1): Algorithm 1 gives the group nothing
            loads = [EngineLoad.of(e, held.get(e.name, 0)) for e in members]
            for req, pe in pe_fetch(self._waiting, loads, read_q, self.params):
                self._waiting.popleft()
                self._pe_of[req.req_id] = pe
                self._held_tok[pe] = self._held_tok.get(pe, 0) + req.num_tokens
                self._global.append(req)

    def _fetch_decode(self, view: ClusterView,
                      fetch: frozenset[str] | None) -> list[tuple[PendingRequest, str]]:
        groups = view.groups(Role.DECODE)
        names = [g for g in groups if fetch is None or g in fetch]
        if self._global and names:
            group_tok = {g: view.group_tokens(g) + self._private_tok.get(g, 0) for g in groups}
            warm_des = {e.name: (g, e.free_kv_tokens) for g, des in groups.items() for e in des}
            for req, group in de_phase1(self._global, group_tok, warm_des):
                self._private.setdefault(group, deque()).append(req)
                self._private_tok[group] = self._private_tok.get(group, 0) + req.num_tokens
            self._global.clear()
        done: list[tuple[PendingRequest, str]] = []
        for group in names:
            queue = self._private.get(group)
            if not queue:
                continue
            need = queue[0].num_tokens
            if all(e.free_kv_tokens < need for e in groups[group]):
                continue  # no DE has memory for the head request: phase 2 places nothing
            loads = [EngineLoad.of(e) for e in groups[group]]
            for req, de in de_phase2(queue, loads, self.params):
                queue.popleft()
                self._private_tok[group] -= req.num_tokens
                done.append((req, de))
        return done

    def _finish(self, view: ClusterView,
                done: list[tuple[PendingRequest, str]]) -> list[Assignment]:
        done.sort(key=lambda pair: self._order[pair[0].req_id])
        read_q = view.read_queues()
        out = []
        for req, de in done:
            pe = self._pe_of.pop(req.req_id)
            self._held_tok[pe] -= req.num_tokens
            if not self._held_tok[pe]:
                del self._held_tok[pe]
            out.append(self._assign(view, req, pe, de, read_q, None))
        return out

    def _assign(self, view: ClusterView, req: PendingRequest, pe: str, de: str,
                read_q: dict[int, int], path: ReadPath | None) -> Assignment:
        """The read plan (round robin's turn as ``path``), the reading queues and the PE's
        host pool grown by it, the decision."""
        pe_view, de_node = view.engine(pe), view.engine(de).node_id
        pe_node, hit = pe_view.node_id, req.num_hit_tokens
        room = pe_view.free_host_blocks
        if room is not None:
            room -= self._host_taken.get(pe, 0)
        path, pe_read, de_read = read_plan(hit, read_q.get(pe_node, 0), read_q.get(de_node, 0),
                                           self.params,
                                           ReadWish(req.read_path, req.pe_only, room,
                                                    req.warm_engine == de), path)
        self._host_taken[pe] = self._host_taken.get(pe, 0) + pe_read // self.params.block_size
        read_q[pe_node] = read_q.get(pe_node, 0) + pe_read
        read_q[de_node] = read_q.get(de_node, 0) + de_read
        del self._order[req.req_id]
        return Assignment(req.req_id, pe, de, path, hit, pe_read, de_read)

    def _reclaim(self, view: ClusterView) -> None:
        """Requests holding an engine or DE group the view no longer has go back to queue.

        A lost DE group's requests return to the DE global queue; a request whose PE is gone
        returns to the waiting FIFO. Both queues stay in submission order.
        """
        lost = [g for g in self._private if g not in view.groups(Role.DECODE)]
        for group in lost:
            self._global.extend(self._private.pop(group))
            del self._private_tok[group]
        if lost:
            self._global = deque(sorted(self._global, key=self._key))
        if all(view.has_engine(pe) for pe in self._held_tok):  # O(PEs), not O(requests)
            return
        held = [self._global, *self._private.values()]
        orphans: list[PendingRequest] = []
        for queue in held:
            kept = []
            for req in queue:
                (kept if view.has_engine(self._pe_of[req.req_id]) else orphans).append(req)
            queue.clear()
            queue.extend(kept)
        self._private_tok = {g: sum(r.num_tokens for r in q) for g, q in self._private.items()}
        for req in orphans:
            self._held_tok.pop(self._pe_of.pop(req.req_id), None)
        self._waiting = deque(sorted([*orphans, *self._waiting], key=self._key))

    def _key(self, req: PendingRequest) -> int:
        return self._order[req.req_id]

    # --- round robin ---

    def _round_robin(self, view: ClusterView, fetch: frozenset[str] | None) -> list[Assignment]:
        engines = [e for e in view.engines if fetch is None or e.group in fetch]
        loads = {e.name: EngineLoad.of(e) for e in engines}
        pes = sorted(e.name for e in engines if e.role == Role.PREFILL)
        des = sorted(e.name for e in engines if e.role == Role.DECODE)
        read_q = view.read_queues()
        out = []
        while self._waiting and pes and des:
            req = self._waiting[0]
            pe = next_in_rotation(pes, self._rr_last[Role.PREFILL],
                                  lambda n: loads[n].tok <= self.params.beta_tokens)
            des_for = [e.name for e in without_left(req, [loads[n] for n in des])]
            de = next_in_rotation(des_for, self._rr_last[Role.DECODE],
                                  lambda n, need=req.num_tokens: loads[n].free_kv_tokens >= need)
            if pe is None or de is None:
                break
            self._waiting.popleft()
            self._rr_last[Role.PREFILL], self._rr_last[Role.DECODE] = pe, de
            for name in (pe, de):
                loads[name].tok += req.num_tokens
                loads[name].seq += 1
            loads[de].free_kv_tokens -= req.num_tokens
            path = self._rr_path()
            out.append(self._assign(view, req, pe, de, read_q, path))
        return out

    def _rr_path(self) -> ReadPath:
        if self.params.read_path != ReadPath.AUTO:
            return self.params.read_path
        path = self._rr_next_path
        self._rr_next_path = ReadPath.DE if path == ReadPath.PE else ReadPath.PE
        return path


# A policy is one entry: its name (``vocab.Policy``) -> how a schedule call places requests.
POLICIES: Mapping[Policy, Callable[[GlobalScheduler, ClusterView, frozenset[str] | None],
                                   list[Assignment]]] = {
    Policy.DUALPATH: GlobalScheduler._dualpath,
    Policy.ROUND_ROBIN: GlobalScheduler._round_robin,
}


# --- recording and replay --------------------------------------------------------------------


def log_step(submitted: Iterable[PendingRequest], view: ClusterView,
             fetching: Collection[str] | None, assignments: Iterable[Assignment],
             ) -> dict[str, Any]:
    """One JSON-safe log step: what was submitted before a schedule call, its inputs, output."""
    return {"submit": [r.to_dict() for r in submitted], "view": view.to_dict(),
            "fetching": None if fetching is None else sorted(fetching),
            "assignments": [a.to_dict() for a in assignments]}


def replay(log: Mapping[str, Any]) -> list[list[Assignment]]:
    """Feed a recorded log to a fresh scheduler; the assignments of every step.

    Log format: ``{"params": SchedulerParams dict, "steps": [{"submit": [PendingRequest
    dicts], "view": ClusterView dict, "fetching": null or [group names], "assignments":
    [Assignment dicts]}, ...]}``; each step submits its requests, then calls ``schedule``.
    """
    scheduler = GlobalScheduler(SchedulerParams.from_dict(log["params"]))
    out = []
    for step in log["steps"]:
        for req in step["submit"]:
            scheduler.submit(PendingRequest.from_dict(req))
        out.append(scheduler.schedule(ClusterView.from_dict(step["view"]), step["fetching"]))
    return out
