"""Session marks in an ``fs`` store (``storage/session_marks.py``) and the eviction order they
give every process that shares the root: ended sessions' chains first, live ones last."""

from __future__ import annotations

import multiprocessing
import os
import stat
import time
from pathlib import Path

import pytest

from dualpath.kv.hashing import KeySpace
from dualpath.kv.layout import KVLayout
from dualpath.kv.retention import NS_PER_S, Retention, SessionMark
from dualpath.storage import session_marks
from dualpath.storage.block_file import HEADER_BYTES
from dualpath.storage.fs import FsStore
from dualpath.storage.fs_capacity import claims_evicted
from dualpath.storage.session_marks import FOLDER, SessionMarks, mark_name

SMALL = KVLayout(4, 2, 8, "float16", 16)  # 4096-byte full blocks
FILE_BYTES = HEADER_BYTES + SMALL.full_block_bytes
CAP_BLOCKS = 8


def _keys(count: int, salt: int):
    tokens = [salt * 7919 + i for i in range(SMALL.block_size * count)]
    return KeySpace("m", SMALL.layout_id, SMALL.block_size).keys(tokens)


def _put(store: FsStore, keys) -> None:
    for key in keys:  # one block per put, as the storage client writes
        assert store.put_from([key], [bytearray(os.urandom(SMALL.full_block_bytes))]) == [True]


def _stored(store: FsStore, keys) -> list[bool]:
    return [store.path_for(k).is_file() for k in keys]


def _mark(tip: bytes, *, ended: bool = False) -> SessionMark:
    now = time.time_ns()
    return SessionMark(tip, now, now + 3600 * NS_PER_S, ended=ended)


LIVE, ENDED = _keys(3, salt=1), _keys(3, salt=2)


def _agent_process(root: str, with_marks: bool) -> None:
    """Another process (a router and its engines): stores a live session's chain, then an
    ended one's, and marks both (``with_marks``)."""
    with FsStore(root, SMALL, workers=1, capacity_bytes=CAP_BLOCKS * FILE_BYTES) as store:
        _put(store, LIVE)  # the oldest chain: plain LRU would evict it first
        time.sleep(0.01)
        _put(store, ENDED)
        if with_marks:
            assert store.mark_session("\0live", _mark(LIVE[-1].block_hash))
            assert store.mark_session("\0ended", _mark(ENDED[-1].block_hash, ended=True))


def _run_agent(root: Path, with_marks: bool) -> None:
    proc = multiprocessing.get_context("fork").Process(target=_agent_process,
                                                       args=(str(root), with_marks))
    proc.start()
    proc.join(60)
    assert proc.exitcode == 0


def test_another_process_evicts_the_ended_session_first_and_keeps_the_live_one(tmp_path):
    _run_agent(tmp_path, with_marks=True)
    anonymous = _keys(4, salt=3)
    with FsStore(tmp_path, SMALL, workers=1, capacity_bytes=CAP_BLOCKS * FILE_BYTES) as store:
        _put(store, anonymous[:3])  # 9 blocks: one over
        assert _stored(store, ENDED) == [True, True, False]  # the tail before its prefix
        _put(store, anonymous[3:])
        assert _stored(store, ENDED) == [True, False, False]
        _put(store, _keys(3, salt=4))  # past every ended block: then the anonymous LRU
        assert _stored(store, ENDED) == [False, False, False]
        assert _stored(store, LIVE) == [True, True, True]
        assert _stored(store, anonymous) == [True, True, False, False]
        # the ended mark went with the last of its chain; the live one stays
        assert store.capacity is not None and store.capacity.last_pass_marks == 1
        assert store.stats["ended_blocks_evicted"] == 3
        assert store.stats["live_blocks_evicted"] == store.stats["live_evicted_before_ended"] == 0


def test_a_mark_follows_its_chain_when_eviction_takes_its_tip(tmp_path):
    with FsStore(tmp_path, SMALL, workers=1, capacity_bytes=CAP_BLOCKS * FILE_BYTES) as store:
        _put(store, ENDED)
        mark = _mark(ENDED[-1].block_hash, ended=True)
        store.mark_session("\0ended", mark)
        _put(store, _keys(6, salt=3))  # 9 blocks: the ended tail goes
        moved = SessionMark.from_json((tmp_path / FOLDER / mark_name("\0ended")).read_bytes())
        assert moved.tip == ENDED[1].block_hash and moved.seen_ns == mark.seen_ns
        _put(store, _keys(2, salt=4))  # the rest of the chain, then the mark
        assert _stored(store, ENDED) == [False] * 3
        assert not (tmp_path / FOLDER / mark_name("\0ended")).exists()


def test_a_mark_its_session_replaced_meanwhile_is_not_moved(tmp_path):
    marks = SessionMarks(tmp_path)
    old, new = _mark(b"old"), _mark(b"new")
    marks.write("\0s", old)
    loaded = marks.load(time.time_ns())
    marks.write("\0s", new)  # the session's next turn
    marks.retarget(mark_name("\0s"), loaded[mark_name("\0s")], b"parent")
    marks.retarget(mark_name("\0s"), loaded[mark_name("\0s")], None)
    assert list(marks.load(time.time_ns()).values()) == [new]


def test_by_recency_alone_the_live_chain_goes_first_and_is_counted(tmp_path):
    _run_agent(tmp_path, with_marks=True)
    with FsStore(tmp_path, SMALL, workers=1, capacity_bytes=CAP_BLOCKS * FILE_BYTES,
                 by_sessions=False) as store:
        _put(store, _keys(3, salt=3))
        assert _stored(store, LIVE) == [True, True, False]
        assert store.stats["live_evicted_before_ended"] == 1


def test_without_marks_the_oldest_chain_goes_whoever_it_belongs_to(tmp_path):
    _run_agent(tmp_path, with_marks=False)
    with FsStore(tmp_path, SMALL, workers=1, capacity_bytes=CAP_BLOCKS * FILE_BYTES) as store:
        _put(store, _keys(3, salt=3))
        assert _stored(store, LIVE) == [True, True, False]
        assert _stored(store, ENDED) == [True, True, True]


def test_a_session_whose_lease_ran_out_is_evicted_like_an_ended_one(tmp_path):
    with FsStore(tmp_path, SMALL, workers=1, capacity_bytes=CAP_BLOCKS * FILE_BYTES) as store:
        _put(store, LIVE)
        _put(store, ENDED)
        now = time.time_ns()
        store.mark_session("\0live", _mark(LIVE[-1].block_hash))
        store.mark_session("\0old", SessionMark(ENDED[-1].block_hash, now - 20 * NS_PER_S,
                                                now - 10 * NS_PER_S))
        _put(store, _keys(3, salt=3))
        assert _stored(store, ENDED) == [True, True, False]
        assert _stored(store, LIVE) == [True, True, True]
        assert store.stats["ended_blocks_evicted"] == 1


def test_a_pass_counts_live_blocks_it_took_while_an_ended_one_stayed():
    ranks = {b"l0": (Retention.LIVE, 0), b"l1": (Retention.LIVE, 0),
             b"e0": (Retention.ENDED, 0), b"e1": (Retention.ENDED, 0)}
    assert claims_evicted(ranks, [b"e1", b"e0", b"l1"]) == {
        "live_blocks_evicted": 1, "ended_blocks_evicted": 2, "live_evicted_before_ended": 0}
    assert claims_evicted(ranks, [b"l1", b"e1"]) == {
        "live_blocks_evicted": 1, "ended_blocks_evicted": 1, "live_evicted_before_ended": 1}
    assert claims_evicted({}, [b"x"]) == {
        "live_blocks_evicted": 0, "ended_blocks_evicted": 0, "live_evicted_before_ended": 0}


def test_a_store_without_a_capacity_keeps_no_marks(tmp_path):
    with FsStore(tmp_path, SMALL, workers=1) as store:
        assert not store.mark_session("\0s", _mark(b"t"))
    assert not (tmp_path / FOLDER).exists()


def test_marks_replace_each_other_and_any_session_id_is_a_safe_name(tmp_path):
    marks = SessionMarks(tmp_path)
    for key in ("\0../../etc/passwd", "salt\0/abs", "\0" + "x" * 256):
        marks.write(key, _mark(b"first"))
        marks.write(key, _mark(b"second"))
        assert (tmp_path / FOLDER / mark_name(key)).is_file()
    assert sorted(p.parent for p in tmp_path.rglob("*.mark")) == [tmp_path / FOLDER] * 3
    assert [m.tip for m in marks.load(time.time_ns()).values()] == [b"second"] * 3
    assert stat.S_IMODE((tmp_path / FOLDER).stat().st_mode) == 0o700
    assert {stat.S_IMODE(p.stat().st_mode) for p in (tmp_path / FOLDER).iterdir()} == {0o600}


def test_damaged_stale_and_surplus_marks_are_dropped(tmp_path, monkeypatch):
    marks = SessionMarks(tmp_path)
    now = time.time_ns()
    marks.write("\0stale", SessionMark(b"s", now - 3 * 86_400 * NS_PER_S,
                                       now - 2 * 86_400 * NS_PER_S))
    marks.write("\0damaged", _mark(b"d"))
    (tmp_path / FOLDER / mark_name("\0damaged")).write_bytes(b'{"tip": "00", "seen')
    (tmp_path / FOLDER / mark_name("\0huge")).write_bytes(b" " * 10_000)
    dead_temp = tmp_path / FOLDER / ".x.mark.1.tmp"
    dead_temp.write_bytes(b"")
    os.utime(dead_temp, ns=(now - 7200 * NS_PER_S,) * 2)
    for i in range(4):
        marks.write(f"\0s{i}", SessionMark(b"t%d" % i, now + i, now + NS_PER_S))
    monkeypatch.setattr(session_marks, "MAX_MARKS", 3)
    assert [m.tip for m in marks.load(now).values()] == [b"t3", b"t2", b"t1"]  # the newest three
    assert sorted(p.name for p in (tmp_path / FOLDER).iterdir()) == sorted(
        mark_name(f"\0s{i}") for i in (1, 2, 3))
    assert marks.dropped == 4


def test_an_unwritable_marks_folder_is_an_oserror_for_the_caller(tmp_path):
    (tmp_path / FOLDER).write_bytes(b"not a folder")
    with pytest.raises(OSError):
        SessionMarks(tmp_path).write("\0s", _mark(b"t"))
    assert SessionMarks(tmp_path).load(time.time_ns()) == {}


def test_orphans_of_a_live_chain_go_first_and_are_not_counted_as_live():
    ranks = {b"l0": (Retention.LIVE, 0), b"e0": (Retention.ENDED, 0)}
    assert claims_evicted(ranks, [b"l0"], {b"l0"})["live_evicted_before_ended"] == 0


def _returning(tip: bytes, in_s: float, anchors: tuple[bytes, ...] = ()) -> SessionMark:
    now = time.time_ns()
    return SessionMark(tip, now, now + 3600 * NS_PER_S, return_ns=now + round(in_s * NS_PER_S),
                       anchors=anchors)


def test_a_pass_takes_the_live_chain_due_back_last_though_it_was_used_last(tmp_path):
    """Three live sessions, the one stored last (LRU keeps it) due back in a minute, the
    others in seconds: a process that shares the store takes the minute's tail first."""
    soon, later, third = _keys(3, salt=5), _keys(3, salt=6), _keys(3, salt=7)
    with FsStore(tmp_path, SMALL, workers=1, capacity_bytes=100 * FILE_BYTES) as store:
        for keys in (soon, third, later):
            _put(store, keys)
            time.sleep(0.01)
        assert store.mark_session("\0soon", _returning(soon[-1].block_hash, 1))
        assert store.mark_session("\0third", _returning(third[-1].block_hash, 5))
        assert store.mark_session("\0later", _returning(later[-1].block_hash, 60))
    with FsStore(tmp_path, SMALL, workers=1, capacity_bytes=CAP_BLOCKS * FILE_BYTES) as store:
        assert store.capacity is not None and store.capacity.evict(force=True) == 1
        assert _stored(store, later) == [True, True, False]
        assert _stored(store, soon) == _stored(store, third) == [True, True, True]
        assert store.stats["live_blocks_evicted"] == 1


def test_a_mark_whose_tip_is_not_stored_yet_keeps_its_chain_live_from_an_anchor(tmp_path):
    """The router marks a turn before its decode engine stored the output blocks: the
    prompt's last block anchors the chain meanwhile, so an anonymous chain goes first."""
    prompt, anonymous = _keys(3, salt=8), _keys(3, salt=9)
    output = _keys(4, salt=10)[-1]  # a block nobody stored (yet)
    with FsStore(tmp_path, SMALL, workers=1, capacity_bytes=CAP_BLOCKS * FILE_BYTES) as store:
        _put(store, prompt)
        time.sleep(0.01)
        _put(store, anonymous)
        now = time.time_ns()
        store.mark_session("\0s", SessionMark(output.block_hash, now, now + 3600 * NS_PER_S,
                                              anchors=(prompt[-1].block_hash,)))
        _put(store, _keys(3, salt=11))  # 9 blocks: one over
        assert _stored(store, prompt) == [True, True, True]
        assert _stored(store, anonymous) == [True, True, False]
        assert store.stats["live_blocks_evicted"] == 0


def test_a_chain_stored_from_nothing_into_a_store_full_of_live_chains_is_kept_as_it_lands(
        tmp_path):
    """A session's turn that hit nothing, admitted into a store full of other live sessions'
    chains: its in-flight mark names the prompt's last block, anchored at the first, so each
    block is its session's as it lands and the oldest live chain's tail makes room. Unclaimed,
    its first block would go at once and every later one as an orphan."""
    from dualpath.kv.retention import in_flight_mark, spaced_anchors

    waiting = [_keys(4, salt=20 + i) for i in range(2)]
    new = _keys(4, salt=30)
    hashes = [k.block_hash for k in new]
    with FsStore(tmp_path, SMALL, workers=1, capacity_bytes=CAP_BLOCKS * FILE_BYTES) as store:
        for i, keys in enumerate(waiting):
            _put(store, keys)
            assert store.mark_session(f"\0w{i}", _mark(keys[-1].block_hash))
            time.sleep(0.01)
        assert store.mark_session("\0new", in_flight_mark(hashes[-1], time.time_ns(), None,
                                                          anchors=spaced_anchors(hashes, 0)))
        _put(store, new)  # 12 blocks: 4 over
        assert _stored(store, new) == [True] * 4
        assert _stored(store, waiting[0]) == [False] * 4
        assert _stored(store, waiting[1]) == [True] * 4
