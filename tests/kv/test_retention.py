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
    block_recency,
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


def test_until_its_tip_lands_a_mark_protects_its_chain_from_its_deepest_stored_anchor():
    """The decode engine stores a turn's output blocks after the turn: meanwhile the prompt's
    last block (or the hit's) stands for the tip, so the chain is not left nobody's."""
    blocks = chain("a", 3)
    mark = SessionMark(b"out", NOW - NS_PER_S, NOW + 60 * NS_PER_S, anchors=(b"a2", b"a0"))
    assert block_ranks(blocks, [mark], NOW) == dict.fromkeys(blocks, (Retention.LIVE, 0))
    assert mark.start(blocks) == b"a2"
    assert SessionMark(b"out", 0, 1, anchors=(b"x", b"a1")).start(blocks) == b"a1"
    assert SessionMark(b"a0", 0, 1, anchors=(b"a2",)).start(blocks) == b"a0"  # tip first


def test_a_live_walk_raises_a_lower_priority_on_a_shared_prefix():
    blocks = {**chain("p", 1), **chain("a", 1, b"p0"), **chain("b", 1, b"p0")}
    ranks = block_ranks(blocks, [live(b"a0", 1), live(b"b0", 9)], NOW)
    assert ranks[b"p0"] == (Retention.LIVE, 9) and ranks[b"a0"] == (Retention.LIVE, 1)


def test_blocks_landing_below_an_anchor_are_the_pending_sessions_not_nobodys():
    """A live mark whose tip has not landed claims the blocks stored below its anchor (its
    prefill's blocks as they land), but not another mark's chain there, ended or live."""
    blocks = {**chain("a", 2), **chain("land", 2, b"a1"), **chain("gone", 2, b"a1"),
              **chain("other", 1, b"a1")}
    pending = SessionMark(b"tip", NOW - NS_PER_S, NOW + 60 * NS_PER_S, anchors=(b"a1",))
    ranks = block_ranks(blocks, [pending, ended(b"gone1"), live(b"other0", 5)], NOW)
    assert ranks[b"land0"] == ranks[b"land1"] == (Retention.LIVE, 0)
    assert ranks[b"a0"] == (Retention.LIVE, 5)  # the other live chain runs through it
    assert ranks[b"gone0"] == ranks[b"gone1"] == (Retention.ENDED, 0)
    assert ranks[b"other0"] == (Retention.LIVE, 5)
    landed = SessionMark(b"a1", NOW - NS_PER_S, NOW + 60 * NS_PER_S)  # its tip is stored
    assert block_ranks(blocks, [landed], NOW).keys() == {b"a0", b"a1"}


def test_a_hinted_return_is_kept_as_a_mark_and_in_its_json():
    mark = mark_for(b"t", NOW, AgentHint(next_turn_in_s=7), window_s=30, anchors=(b"t", b"p"))
    assert mark.return_ns == NOW + 7 * NS_PER_S and mark.anchors == (b"p",)
    assert SessionMark.from_json(mark.to_json()) == mark
    assert mark_for(b"t", NOW, AgentHint(lease_s=60)).return_ns == 0  # no return said
    old = b'{"tip": "aa", "seen_ns": 1, "live_until_ns": 2, "ended": false, "priority": 0}'
    assert SessionMark.from_json(old) == SessionMark(b"\xaa", 1, 2)  # marks of before
    too_many = mark.to_json().replace(b'"anchors": ["70"]', b'"anchors": ' + b'["70",' * 5)
    with pytest.raises(BadMark):
        SessionMark.from_json(too_many)
    with pytest.raises(BadMark):
        SessionMark.from_json(mark.to_json().replace(b'["70"]', b'"70"'))


def returning(tip: bytes, in_s: float, **kw) -> SessionMark:
    return SessionMark(tip, NOW - NS_PER_S, NOW + 600 * NS_PER_S,
                       return_ns=NOW + round(in_s * NS_PER_S), **kw)


def test_live_chains_go_in_order_of_their_expected_return_latest_first():
    """Among live chains, the one whose harness said it comes back last goes first, whatever
    LRU says: here the chain used least recently is the one due soonest."""
    blocks = {**chain("soon", 2), **chain("late", 2), **chain("later", 2)}
    index = index_of(blocks, [b"soon0", b"soon1", b"late0", b"late1", b"later0", b"later1"])
    marks = [returning(b"soon1", 1), returning(b"late1", 30), returning(b"later1", 90)]
    index.set_ranks(block_ranks(blocks, marks, NOW), block_recency(blocks, marks, NOW))
    assert [v.decode() for v in index.victims(target_bytes=0)] == [
        "later1", "later0", "late1", "late0", "soon1", "soon0"]


def test_a_hinted_return_stands_beside_lru_as_the_same_bet():
    """LRU expects a block unused for t back in about t: a chain due in 10 s outlasts one
    used 30 s ago and gives way to one used 2 s ago."""
    blocks = {**chain("old", 1), **chain("hinted", 1), **chain("fresh", 1)}
    used = {b"old0": NOW - 30 * NS_PER_S, b"hinted0": NOW - 60 * NS_PER_S,
            b"fresh0": NOW - 2 * NS_PER_S}
    index = PrefixLRUIndex(None)
    for block in blocks:
        index.add(block, None, 1, used[block])
    marks = [returning(b"hinted0", 10), live(b"old0"), live(b"fresh0")]
    index.set_ranks(block_ranks(blocks, marks, NOW), block_recency(blocks, marks, NOW))
    assert index.victims(target_bytes=0) == [b"old0", b"hinted0", b"fresh0"]


def test_a_shared_prefix_takes_the_soonest_return_and_an_overdue_one_ages_from_its_due_time():
    """The harness's forecast replaces the chain's own last use, a block used just now too
    (Belady's rule: due back in a minute goes before due back in a second); a session past
    its expected return ages from that moment (a queued agent whose slot is late gives way to
    one in a short tool call), never fresher than now, so a hint cannot outrank LRU's newest
    block by claiming an early return."""
    blocks = {**chain("p", 2), **chain("a", 1, b"p1"), **chain("b", 1, b"p1")}
    marks = [returning(b"a0", 50), returning(b"b0", 5)]
    recency = block_recency(blocks, marks, NOW)
    assert recency[b"p0"] == recency[b"p1"] == recency[b"b0"] == NOW - 5 * NS_PER_S
    assert recency[b"a0"] == NOW - 50 * NS_PER_S
    assert block_recency(blocks, [returning(b"a0", 0)], NOW)[b"a0"] == NOW  # due now
    assert block_recency(blocks, [returning(b"a0", -30)], NOW)[b"a0"] == NOW - 30 * NS_PER_S
    recency = block_recency(blocks, [returning(b"a0", -3), returning(b"b0", 2)], NOW)
    assert recency[b"a0"] < recency[b"b0"]  # 3 s late goes before due in 2 s
    # ended, expired and unhinted chains keep their own last use
    assert block_recency(blocks, [returning(b"a0", 5, ended=True), live(b"b0")], NOW) == {}
    overdue = SessionMark(b"a0", NOW - 900 * NS_PER_S, NOW - NS_PER_S, return_ns=NOW)
    assert block_recency(blocks, [overdue], NOW) == {}


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
