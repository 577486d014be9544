"""Session-aware retention (``kv/retention.py``) and the index's ranked eviction order."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dualpath.kv.retention import (
    DEFAULT_RANK,
    MARK_KEPT_S,
    NS_PER_S,
    BadMark,
    Retention,
    SessionMark,
    block_ranks,
    mark_for,
    surviving_tip,
)
from dualpath.sessions import AgentHint
from dualpath.storage.index import PrefixLRUIndex

NOW = 1_000_000 * NS_PER_S


def chain(name: str, length: int, parent: bytes | None = None) -> dict[bytes, bytes | None]:
    """``length`` blocks named ``name0``, ``name1``, ... each extending the last."""
    blocks = {}
    for i in range(length):
        block = f"{name}{i}".encode()
        blocks[block] = parent
        parent = block
    return blocks


def live(tip: bytes, priority: int = 0) -> SessionMark:
    return SessionMark(tip, NOW - NS_PER_S, NOW + 60 * NS_PER_S, priority=priority)


def ended(tip: bytes) -> SessionMark:
    return SessionMark(tip, NOW - NS_PER_S, NOW + 60 * NS_PER_S, ended=True)


def expired(tip: bytes) -> SessionMark:
    return SessionMark(tip, NOW - 600 * NS_PER_S, NOW - 300 * NS_PER_S)


# -- marks --------------------------------------------------------------------------------------

def test_a_turn_without_a_hint_is_live_for_the_window():
    mark = mark_for(b"t", NOW, None, window_s=30)
    assert mark.live(NOW + 29 * NS_PER_S) and not mark.live(NOW + 30 * NS_PER_S)
    assert mark.priority == 0 and not mark.ended


@pytest.mark.parametrize("hint,live_s", [
    (AgentHint(lease_s=600), 600), (AgentHint(lease_s=5), 30),  # a short lease: the window
    (AgentHint(next_turn_in_s=100), 200), (AgentHint(lease_s=50, next_turn_in_s=100), 200),
    (AgentHint(priority=7), 30),
])
def test_hints_stretch_a_sessions_life(hint, live_s):
    mark = mark_for(b"t", NOW, hint, window_s=30)
    assert mark.live_until_ns == NOW + live_s * NS_PER_S
    assert mark.priority == hint.priority


def test_an_ended_session_is_never_live_and_its_mark_goes_a_day_later():
    mark = mark_for(b"t", NOW, AgentHint(end_of_session=True), window_s=30)
    assert mark.ended and not mark.live(NOW)
    assert not mark.stale(NOW + round(MARK_KEPT_S) * NS_PER_S)
    assert mark.stale(NOW + round(MARK_KEPT_S + 1) * NS_PER_S)


def test_a_mark_survives_json_and_damage_is_refused():
    mark = SessionMark(b"\x00\xfftip", 5, 9, ended=True, priority=-3)
    assert SessionMark.from_json(mark.to_json()) == mark
    for raw in (b"", b"{}", b"[1]", b'{"tip": "zz", "seen_ns": 1, "live_until_ns": 2, '
                b'"ended": false, "priority": 0}', b'{"tip": "", "seen_ns": 1, '
                b'"live_until_ns": 2, "ended": false, "priority": 0}', b"\xff\xfe"):
        with pytest.raises(BadMark):
            SessionMark.from_json(raw)


# -- ranks --------------------------------------------------------------------------------------

def test_a_prefix_takes_the_highest_claim_of_the_chains_through_it():
    blocks = {**chain("p", 2), **chain("a", 2, b"p1"), **chain("b", 2, b"p1"), **chain("c", 2)}
    ranks = block_ranks(blocks, [live(b"a1", priority=4), ended(b"b1")], NOW)
    assert ranks[b"p0"] == ranks[b"p1"] == ranks[b"a0"] == ranks[b"a1"] == (Retention.LIVE, 4)
    assert ranks[b"b0"] == ranks[b"b1"] == (Retention.ENDED, 0)
    assert b"c0" not in ranks and b"c1" not in ranks  # no session: DEFAULT_RANK


def test_a_prefix_two_ended_chains_share_is_kept_after_their_tails():
    blocks = {**chain("p", 2), **chain("a", 1, b"p1"), **chain("b", 1, b"p1")}
    ranks = block_ranks(blocks, [ended(b"a0"), expired(b"b0")], NOW)
    assert ranks[b"p0"] == ranks[b"p1"] == (Retention.SHARED, 0)
    assert ranks[b"a0"] == ranks[b"b0"] == (Retention.ENDED, 0)


def test_a_tip_that_is_not_stored_protects_nothing():
    blocks = chain("a", 3)
    assert block_ranks(blocks, [live(b"gone"), ended(b"nope")], NOW) == {}


def test_a_live_walk_raises_a_lower_priority_on_a_shared_prefix():
    blocks = {**chain("p", 1), **chain("a", 1, b"p0"), **chain("b", 1, b"p0")}
    ranks = block_ranks(blocks, [live(b"a0", 1), live(b"b0", 9)], NOW)
    assert ranks[b"p0"] == (Retention.LIVE, 9) and ranks[b"a0"] == (Retention.LIVE, 1)


def test_a_mark_moves_to_the_deepest_block_eviction_left():
    blocks = chain("a", 4)
    assert surviving_tip(blocks, b"a3", {b"a3", b"a2"}) == b"a1"
    assert surviving_tip(blocks, b"a3", set()) == b"a3"
    assert surviving_tip(blocks, b"a3", set(blocks)) is None
    assert surviving_tip(blocks, b"gone", set()) is None


# -- the index's order ----------------------------------------------------------------------------

def index_of(blocks: dict[bytes, bytes | None], order: list[bytes]) -> PrefixLRUIndex:
    """Blocks added in ``order`` (the recency), one byte each, no capacity."""
    index = PrefixLRUIndex(None)
    for block in order:
        index.add(block, blocks[block], 1)
    return index


def test_ended_then_anonymous_then_shared_then_live_each_tail_first():
    blocks = {**chain("live", 2), **chain("p", 1), **chain("e", 2, b"p0"),
              **chain("f", 1, b"p0"), **chain("anon", 2)}
    index = index_of(blocks, [b"live0", b"live1", b"p0", b"anon0", b"anon1", b"e0", b"e1",
                              b"f0"])
    index.set_ranks(block_ranks(blocks, [live(b"live1"), ended(b"e1"), ended(b"f0")], NOW))
    # the ended chains are the most recent and the live one the oldest; tails before prefixes
    assert [v.decode() for v in index.victims(target_bytes=0)] == [
        "e1", "e0", "f0", "anon1", "anon0", "p0", "live1", "live0"]


def test_without_ranks_the_order_is_plain_lru_of_leaves():
    blocks = {**chain("a", 2), **chain("b", 2)}
    index = index_of(blocks, [b"a0", b"a1", b"b0", b"b1"])
    index.set_ranks({})
    assert index.victims(target_bytes=0) == [b"a1", b"a0", b"b1", b"b0"]


def test_orphans_still_go_before_a_ranked_leaf():
    blocks = {**chain("a", 2), b"orphan": b"missing"}
    index = index_of(blocks, [b"a0", b"a1", b"orphan"])
    index.set_ranks({b"a0": (Retention.ENDED, 0), b"a1": (Retention.ENDED, 0),
                     b"orphan": (Retention.LIVE, 100)})
    assert index.victims(target_bytes=2) == [b"orphan"]


@st.composite
def forests(draw):
    """A random forest of blocks, and random live and ended marks on some of them."""
    count = draw(st.integers(1, 40))
    parents: dict[bytes, bytes | None] = {}
    for i in range(count):
        parent = draw(st.none() | st.integers(0, i - 1)) if i else None
        parents[b"%d" % i] = None if parent is None else b"%d" % parent
    tips = st.sampled_from(sorted(parents))
    marks = draw(st.lists(st.tuples(tips, st.sampled_from(["live", "ended", "expired"])),
                          max_size=8))
    recency = draw(st.permutations(sorted(parents)))
    return parents, marks, recency


@settings(max_examples=300, deadline=None)
@given(forests(), st.integers(0, 40))
def test_no_live_block_goes_while_an_ended_one_remains_and_the_store_stays_prefix_closed(
        forest, target):
    parents, marks, recency = forest
    made = {"live": live, "ended": ended, "expired": expired}
    ranks = block_ranks(parents, [made[kind](tip) for tip, kind in marks], NOW)
    index = PrefixLRUIndex(None)
    for block in sorted(parents, key=lambda b: int(b)):  # parents first: no orphans
        index.add(block, parents[block], 1)
    for block in recency:
        index.touch(block)
    index.set_ranks(ranks)
    gone = index.victims(target_bytes=target)
    kept = set(parents) - set(gone)
    assert len(kept) == min(target, len(parents))
    assert all(parents[b] is None or parents[b] in kept for b in kept)  # prefix-closed
    rank = {b: ranks.get(b, DEFAULT_RANK) for b in parents}
    if any(rank[b][0] == Retention.LIVE for b in gone):
        assert not any(rank[b][0] == Retention.ENDED for b in kept)
