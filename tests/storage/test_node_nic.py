"""One storage-NIC account per node: engine processes of a node share its token bucket."""

from __future__ import annotations

import multiprocessing as mp

import pytest

from dualpath.storage.node_nic import SharedBucket, node_nic_account
from dualpath.storage.throttle import TokenBucket

RATE, BURST, BLOCK = 1000.0, 100.0, 100


def test_two_holders_of_one_account_pace_together_like_one_bucket(tmp_path):
    a = SharedBucket(tmp_path / "nic-read", RATE, BURST)
    b = SharedBucket(tmp_path / "nic-read", RATE, BURST)
    alone = TokenBucket(RATE, BURST)
    waits, alone_waits = [], []
    for i in range(10):  # the two engines alternate, at the same instants
        waits.append((a if i % 2 else b).reserve(BLOCK, now_s=0.0))
        alone_waits.append(alone.reserve(BLOCK, now_s=0.0))
    assert waits == pytest.approx(alone_waits)
    assert waits[-1] == pytest.approx(0.9)  # 1,000 bytes past a 100-byte burst at 1,000 B/s
    a.close()
    b.close(unlink=True)
    assert not (tmp_path / "nic-read").exists()


def test_separate_accounts_do_not_share(tmp_path):
    a = SharedBucket(tmp_path / "n0-read", RATE, BURST)
    b = SharedBucket(tmp_path / "n1-read", RATE, BURST)
    for _ in range(5):
        a.reserve(BLOCK, now_s=0.0)
    assert b.reserve(BLOCK, now_s=0.0) == 0.0
    a.close(unlink=True)
    b.close(unlink=True)


def _hammer(path: str, count: int) -> None:
    from pathlib import Path

    bucket = SharedBucket(Path(path), RATE * 1000, BURST)
    for _ in range(count):
        bucket.reserve(BLOCK, now_s=0.0)
    bucket.close()


def test_processes_update_the_account_atomically(tmp_path):
    path = tmp_path / "n0-read"
    procs = [mp.get_context("spawn").Process(target=_hammer, args=(str(path), 500))
             for _ in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    bucket = SharedBucket(path, RATE * 1000, BURST)
    tokens, _ = _state(bucket)
    assert tokens == pytest.approx(BURST - 1500 * BLOCK)  # no reservation was lost
    bucket.close(unlink=True)


def _state(bucket: SharedBucket) -> tuple[float, float]:
    bucket.reserve(0, now_s=0.0)
    return bucket._bucket.state  # the shared state as last loaded


def test_account_names_are_per_run_and_node_and_checked():
    a = node_nic_account("abc123", 0).prefix
    assert a != node_nic_account("abc123", 1).prefix != node_nic_account("def456", 0).prefix
    with pytest.raises(ValueError):
        node_nic_account("../../etc", 0)
