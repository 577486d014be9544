"""The router's session book (``server/router/sessions.py``): the mark a finished turn leaves."""

from __future__ import annotations

import pytest

from dualpath.kv.hashing import KeySpace
from dualpath.kv.retention import NS_PER_S
from dualpath.server.router.sessions import SessionBook, session_key
from dualpath.server.router.types import ClusterOutput
from dualpath.sessions import AgentHint, Session
from dualpath.vocab import Mode

SPACE = KeySpace("model", "layout", 4)
NOW = 10**18


def output(req_id: int, prompt: list[int], tokens: list[int]) -> ClusterOutput:
    return ClusterOutput(req_id, prompt, tokens, "length", 0, "pe", "p0", "d0")


def test_a_turn_marks_the_last_block_its_decode_engine_stores():
    book = SessionBook(SPACE, window_s=60)
    book.admit(1, Session("traj", "header"), Mode.DUALPATH, "")
    write = book.finish(1, output(1, list(range(10)), [50, 51, 52]), NOW)
    assert write is not None and write.session_key == session_key("traj", "")
    # 10 + 3 tokens, the last one's KV never computed: 12 -> 3 full blocks of 4
    assert write.mark.tip == SPACE.keys([*range(10), 50, 51])[-1].block_hash
    assert write.mark.live(NOW + 59 * NS_PER_S) and not write.mark.live(NOW + 60 * NS_PER_S)
    assert len(book) == 0


def test_the_salt_keeps_two_tenants_sessions_and_chains_apart():
    book = SessionBook(SPACE)
    book.admit(1, Session("traj", "body"), Mode.DUALPATH, "a")
    book.admit(2, Session("traj", "body"), Mode.DUALPATH, "b")
    one = book.finish(1, output(1, list(range(8)), [1]), NOW)
    two = book.finish(2, output(2, list(range(8)), [1]), NOW)
    assert one is not None and two is not None
    assert one.session_key != two.session_key and one.mark.tip != two.mark.tip
    assert one.mark.tip == SPACE.salted("a").keys(list(range(8)))[-1].block_hash


def test_an_ending_hint_ends_the_session():
    book = SessionBook(SPACE)
    book.admit(1, Session("t", "body", AgentHint(end_of_session=True, priority=5)),
               Mode.BASIC, "")
    write = book.finish(1, output(1, list(range(8)), [1]), NOW)
    assert write is not None and write.mark.ended and write.mark.priority == 5


@pytest.mark.parametrize("case", ["no session", "oracle", "recompute", "failed", "short",
                                  "unknown"])
def test_turns_that_store_nothing_or_failed_leave_no_mark(case):
    book = SessionBook(SPACE)
    mode = {"oracle": Mode.ORACLE, "recompute": Mode.RECOMPUTE}.get(case, Mode.DUALPATH)
    if case != "unknown":
        book.admit(1, None if case == "no session" else Session("t", "body"), mode, "")
    prompt = [1, 2] if case == "short" else list(range(8))
    result = RuntimeError("lost") if case == "failed" else output(1, prompt, [3])
    assert book.finish(1, result, NOW) is None
    assert len(book) == 0


def test_the_prompts_hashes_from_the_hit_lookup_give_the_same_tip():
    prompt = list(range(10))
    hashes = [k.block_hash for k in SPACE.salted("s").keys(prompt[:8])]
    book = SessionBook(SPACE)
    book.admit(1, Session("t", "body"), Mode.DUALPATH, "s", hashes)
    book.admit(2, Session("t", "body"), Mode.DUALPATH, "s")
    one = book.finish(1, output(1, prompt, [50, 51, 52]), NOW)
    two = book.finish(2, output(2, prompt, [50, 51, 52]), NOW)
    assert one is not None and two is not None and one.mark.tip == two.mark.tip
    assert one.mark.tip == SPACE.salted("s").keys([*prompt, 50, 51])[-1].block_hash


def test_a_mark_falls_back_on_its_prompts_and_its_hits_last_blocks():
    """Until the decode engine stores the output blocks the tip names, the prompt's last full
    block, the hit's and the chain's first stand for it (deepest first); a hinted return is
    kept."""
    prompt = list(range(14))  # 3 full blocks of 4, the hit 2 of them
    book = SessionBook(SPACE)
    book.admit(1, Session("t", "body", AgentHint(next_turn_in_s=3)), Mode.DUALPATH, "")
    result = ClusterOutput(1, prompt, [50, 51, 52, 53, 54], "length", 8, "pe", "p0", "d0")
    write = book.finish(1, result, NOW)
    keys = [k.block_hash for k in SPACE.keys([*prompt, 50, 51, 52, 53])]
    assert write is not None and write.mark.tip == keys[-1] == keys[3]
    assert write.mark.anchors == (keys[2], keys[1], keys[0])
    assert write.mark.return_ns == NOW + 3 * NS_PER_S
    # no hit, and a turn whose output fills no block past the prompt's: the first block only
    book.admit(2, Session("t", "body"), Mode.DUALPATH, "")
    write = book.finish(2, output(2, list(range(12)), [50]), NOW)
    assert write is not None and write.mark.anchors == (keys[0],)


def test_an_admitted_turn_marks_its_prompts_chain_anchored_along_the_way():
    """As it is admitted a turn's session mark moves to its prompt's last full block, live
    (never ended, even on its last turn, and with no expected return: it is in use), with
    anchors half of the way and at the hit's end (or the chain's first block), deepest
    first."""
    hashes = [k.block_hash for k in SPACE.keys(list(range(40)))]  # 10 blocks of 4
    book = SessionBook(SPACE, window_s=60)
    hint = AgentHint(priority=3, lease_s=900, end_of_session=False, next_turn_in_s=None)
    write = book.admit(1, Session("t", "body", hint), Mode.DUALPATH, "", hashes, 2, NOW)
    assert write is not None and write.session_key == session_key("t", "")
    mark = write.mark
    assert mark.tip == hashes[9] and mark.anchors == (hashes[4], hashes[1])
    assert mark.priority == 3 and mark.live(NOW + 899 * NS_PER_S) and mark.return_ns == 0
    ending = Session("u", "body", AgentHint(end_of_session=True))
    write = book.admit(2, ending, Mode.DUALPATH, "", hashes, 0, NOW)
    assert write is not None and not write.mark.ended and write.mark.live(NOW)
    assert write.mark.anchors == (hashes[4], hashes[0])  # stored from nothing
    assert len(book) == 2  # both still noted for their finish
    assert book.admit(3, None, Mode.DUALPATH, "", hashes, 0, NOW) is None
    assert book.admit(4, Session("t", "body"), Mode.ORACLE, "", hashes, 0, NOW) is None
    assert book.admit(5, Session("t", "body"), Mode.DUALPATH, "", (), 0, NOW) is None
    assert len(book) == 3  # the last one still leaves a mark when it ends
