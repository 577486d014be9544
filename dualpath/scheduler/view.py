"""Snapshots the global scheduler decides on, and its decisions (pure: no clocks or sockets).

On every fetch each engine reports its role, node, group, ``seq`` (assigned, unfinished
requests), ``tok`` (tokens over those requests) and its free device KV in tokens; each node
reports its storage-read queue in tokens (docs/paper.md §5.1). A waiting request carries its prompt
length and its hit (the leading tokens whose KV storage holds). An :class:`Assignment` is one
decision: the (PE, DE) pair and where the hit is read. Everything has a JSON-safe
``to_dict``/``from_dict`` so sequences of views and decisions can be recorded and replayed.

:class:`EngineLoad` is the one mutable type: the scheduler's working copy of an engine's
counters inside one decision.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from dualpath.vocab import ReadPath, Role

READ_PATHS = ("pe", "de", "split")  # an assignment's: never auto


def _check_fields(cls: type, data: Mapping[str, Any]) -> None:
    names = {f.name for f in fields(cls) if f.init}
    unknown = set(data) - names
    if unknown:
        raise ValueError(f"{cls.__name__}: unknown fields {sorted(unknown)}")


def _non_negative(owner: str, **values: int) -> None:
    for name, value in values.items():
        if value < 0:
            raise ValueError(f"{owner}: {name} must be >= 0, got {value}")


@dataclass(frozen=True)
class EngineView:
    """One engine as it reported itself at the last fetch."""

    name: str
    role: Role
    node_id: int
    group: str
    seq: int = 0  # assigned, unfinished requests
    tok: int = 0  # tokens over those requests (prompt lengths)
    free_kv_tokens: int = 0  # device KV free for new requests (what a DE can still admit)
    # a PE's host-pool blocks not held by a request (None: not bounded): a hit the PE would
    # read into more than this goes to the DE (``rules.read_plan``)
    free_host_blocks: int | None = None

    def __post_init__(self) -> None:
        if self.role not in tuple(Role):
            raise ValueError(f"engine {self.name!r}: role must be one of {tuple(map(str, Role))}")
        object.__setattr__(self, "role", Role(self.role))
        if self.seq < 0 or self.tok < 0 or self.free_kv_tokens < 0:  # the message only then
            _non_negative(f"engine {self.name!r}", seq=self.seq, tok=self.tok,
                          free_kv_tokens=self.free_kv_tokens)

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe fields."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> EngineView:
        """Inverse of :meth:`to_dict`."""
        _check_fields(cls, data)
        return cls(**data)


@dataclass(frozen=True)
class NodeView:
    """One node's storage-read queue: tokens waiting to be read through its storage NIC."""

    node_id: int
    read_queue_tokens: int = 0

    def __post_init__(self) -> None:
        if self.read_queue_tokens < 0:
            _non_negative(f"node {self.node_id}", read_queue_tokens=self.read_queue_tokens)

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe fields."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> NodeView:
        """Inverse of :meth:`to_dict`."""
        _check_fields(cls, data)
        return cls(**data)


@dataclass(frozen=True)
class ClusterView:
    """All engines and nodes at one instant; indexed by name, group and node on construction.

    Rules checked (ValueError): engine names are unique, a group holds one role, and all
    engines of a node are in the same group (docs/paper.md §5.1). A node without a :class:`NodeView`
    has an empty read queue.
    """

    engines: tuple[EngineView, ...]
    nodes: tuple[NodeView, ...] = ()
    _by_name: dict[str, EngineView] = field(init=False, repr=False, compare=False)
    _groups: dict[str, dict[str, tuple[EngineView, ...]]] = field(
        init=False, repr=False, compare=False)
    _read_q: dict[int, int] = field(init=False, repr=False, compare=False)
    _group_tok: dict[str, int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "engines", tuple(self.engines))
        object.__setattr__(self, "nodes", tuple(self.nodes))
        by_name = {e.name: e for e in self.engines}
        if len(by_name) != len(self.engines):
            raise ValueError("engine names must be unique")
        read_q = {n.node_id: n.read_queue_tokens for n in self.nodes}
        if len(read_q) != len(self.nodes):
            raise ValueError("node ids must be unique")
        object.__setattr__(self, "_by_name", by_name)
        object.__setattr__(self, "_read_q", read_q)
        object.__setattr__(self, "_groups", self._index())
        object.__setattr__(self, "_group_tok", {
            name: sum(e.tok for e in members)
            for groups in self._groups.values() for name, members in groups.items()})

    def _index(self) -> dict[str, dict[str, tuple[EngineView, ...]]]:
        role_of: dict[str, str] = {}
        group_of_node: dict[int, str] = {}
        members: dict[str, list[EngineView]] = {}
        for e in self.engines:
            if role_of.setdefault(e.group, e.role) != e.role:
                raise ValueError(f"group {e.group!r} mixes prefill and decode engines")
            if group_of_node.setdefault(e.node_id, e.group) != e.group:
                raise ValueError(f"node {e.node_id} has engines in two groups")
            members.setdefault(e.group, []).append(e)
        groups: dict[str, dict[str, tuple[EngineView, ...]]] = {role: {} for role in Role}
        for name in sorted(members):
            groups[role_of[name]][name] = tuple(sorted(members[name], key=lambda e: e.name))
        return groups

    @classmethod
    def from_groups(cls, groups: Mapping[str, Mapping[str, tuple[EngineView, ...]]],
                    nodes: tuple[NodeView, ...],
                    by_name: Mapping[str, EngineView] | None = None,
                    group_tok: Mapping[str, int] | None = None) -> ClusterView:
        """A view from an index the caller already keeps: ``{role: {group: engines}}`` with
        groups and engines in name order, every group of one role and each node's engines in
        one group (the rules ``__init__`` checks are the caller's to keep). For callers that
        rebuild a large view many times a second (the simulator); same result as ``cls(...)``.
        A caller that also keeps the engines by name and each group's tokens (the sums of its
        engines' ``tok``) passes them; they are copied.
        """
        view = object.__new__(cls)
        index = {role: dict(groups.get(role, {})) for role in Role}
        engines = tuple(e for role in Role for members in index[role].values() for e in members)
        if by_name is None:
            by_name = {e.name: e for e in engines}
        if group_tok is None:
            group_tok = {name: sum(e.tok for e in members)
                         for by_group in index.values() for name, members in by_group.items()}
        object.__setattr__(view, "engines", engines)
        object.__setattr__(view, "nodes", tuple(nodes))
        object.__setattr__(view, "_by_name", dict(by_name))
        object.__setattr__(view, "_read_q", {n.node_id: n.read_queue_tokens for n in nodes})
        object.__setattr__(view, "_groups", index)
        object.__setattr__(view, "_group_tok", dict(group_tok))
        return view

    def engine(self, name: str) -> EngineView:
        """The engine called ``name`` (KeyError if there is none)."""
        return self._by_name[name]

    def has_engine(self, name: str) -> bool:
        """Whether an engine called ``name`` is in the view."""
        return name in self._by_name

    def groups(self, role: str) -> dict[str, tuple[EngineView, ...]]:
        """Groups of ``role`` by name, in name order; each group's engines in name order."""
        return self._groups[role]

    def group(self, name: str) -> tuple[EngineView, ...]:
        """The engines of group ``name`` in name order (KeyError if there is none)."""
        for groups in self._groups.values():
            if name in groups:
                return groups[name]
        raise KeyError(name)

    def group_tokens(self, name: str) -> int:
        """Σ ``tok`` over the engines of group ``name`` (KeyError if there is none)."""
        return self._group_tok[name]

    def read_queue(self, node_id: int) -> int:
        """Tokens in node ``node_id``'s storage-read queue (0 for an unknown node)."""
        return self._read_q.get(node_id, 0)

    def read_queues(self) -> dict[int, int]:
        """A fresh ``node_id -> read queue tokens`` dict the caller may change."""
        return dict(self._read_q)

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe form: lists of engine and node dicts."""
        return {"engines": [e.to_dict() for e in self.engines],
                "nodes": [n.to_dict() for n in self.nodes]}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ClusterView:
        """Inverse of :meth:`to_dict`."""
        return cls(tuple(EngineView.from_dict(e) for e in data["engines"]),
                   tuple(NodeView.from_dict(n) for n in data.get("nodes", ())))


@dataclass(frozen=True)
class PendingRequest:
    """A request waiting for a (PE, DE) pair: prompt length and hit (tokens to load)."""

    req_id: int
    num_tokens: int
    num_hit_tokens: int = 0
    read_path: ReadPath = ReadPath.AUTO  # the request's own path (auto: the scheduler's choice)
    pe_only: bool = False  # its mode reads every hit on the PE (basic, layerwise)
    # the decode engine that keeps its agent session's blocks warm in DRAM ("": none known):
    # placed there, the request reads its hit on the DE path without the storage NIC
    warm_engine: str = ""
    # the decode engine a moved stream left (it failed or lost the stream: its model server may
    # be dying): another DE takes it when one has room, that one only when none other can
    left_engine: str = ""

    def __post_init__(self) -> None:
        if self.num_tokens <= 0:
            raise ValueError(f"request {self.req_id}: num_tokens must be > 0")
        if not 0 <= self.num_hit_tokens <= self.num_tokens:
            raise ValueError(f"request {self.req_id}: need 0 <= num_hit_tokens <= num_tokens")
        object.__setattr__(self, "read_path", ReadPath(self.read_path))

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe fields."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PendingRequest:
        """Inverse of :meth:`to_dict`."""
        _check_fields(cls, data)
        return cls(**data)


@dataclass(frozen=True)
class Assignment:
    """A decision: prefill engine, decode engine, and how many hit tokens each side reads."""

    req_id: int
    prefill: str
    decode: str
    read_path: ReadPath  # pe | de | split
    num_hit_tokens: int
    pe_read_tokens: int
    de_read_tokens: int

    def __post_init__(self) -> None:
        if self.read_path not in READ_PATHS:
            raise ValueError(f"read_path must be one of {READ_PATHS}, got {self.read_path!r}")
        object.__setattr__(self, "read_path", ReadPath(self.read_path))
        if self.pe_read_tokens < 0 or self.de_read_tokens < 0:
            _non_negative(f"assignment {self.req_id}", pe_read_tokens=self.pe_read_tokens,
                          de_read_tokens=self.de_read_tokens)
        if self.pe_read_tokens + self.de_read_tokens != self.num_hit_tokens:
            raise ValueError(f"assignment {self.req_id}: the two reads must add up to the hit")

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe fields."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Assignment:
        """Inverse of :meth:`to_dict`."""
        _check_fields(cls, data)
        return cls(**data)


@dataclass(slots=True)
class EngineLoad:
    """Mutable working copy of an engine's counters while one decision is being made."""

    name: str
    node_id: int
    seq: int
    tok: int
    free_kv_tokens: int

    @classmethod
    def of(cls, engine: EngineView, extra_tok: int = 0) -> EngineLoad:
        """A working copy of ``engine``, plus ``extra_tok`` tokens the scheduler holds for it."""
        return cls(engine.name, engine.node_id, engine.seq, engine.tok + extra_tok,
                   engine.free_kv_tokens)
