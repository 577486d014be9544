"""One storage-NIC account per node: engine processes of a node share its token bucket."""

from __future__ import annotations

import multiprocessing as mp

import pytest

from dualpath.storage.node_nic import SharedBucket, node_nic_account
from dualpath.traffic.token_bucket import TokenBucket

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


def _dead_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_an_account_is_held_by_a_file_named_with_the_pid(tmp_path):
    import os

    bucket = SharedBucket(tmp_path / "dualpath-nic-run1-node0-read", RATE, BURST)
    holders = list(tmp_path.glob(f"dualpath-nic-run1-node0-read.{os.getpid()}.*.pid"))
    assert len(holders) == 1
    bucket.close()
    assert not holders[0].exists()
    assert (tmp_path / "dualpath-nic-run1-node0-read").exists()  # unlink=False keeps it


def test_accounts_no_live_process_holds_are_removed_and_held_ones_kept(tmp_path):
    import subprocess
    import sys

    from dualpath.storage.node_nic import remove_dead_accounts

    killed = tmp_path / "dualpath-nic-killed-node0-read"
    killed.write_bytes(b"\0" * 17)
    killed_holder = tmp_path / f"{killed.name}.{_dead_pid()}.0123abcd.pid"
    killed_holder.touch()
    unheld = tmp_path / "dualpath-nic-older-node1-write"  # from before holder files
    unheld.write_bytes(b"\0" * 17)
    live = SharedBucket(tmp_path / "dualpath-nic-live-node0-read", RATE, BURST)
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        other = tmp_path / "dualpath-nic-other-node2-read"  # held by another live process
        other.write_bytes(b"\0" * 17)
        (tmp_path / f"{other.name}.{sleeper.pid}.89abcdef.pid").touch()
        also_dead = tmp_path / f"{other.name}.{_dead_pid()}.00000000.pid"
        also_dead.touch()
        unrelated = tmp_path / "notes-dualpath-nic"
        unrelated.touch()
        assert remove_dead_accounts(tmp_path) == 4
        assert not killed.exists() and not killed_holder.exists() and not unheld.exists()
        assert not also_dead.exists()
        assert live.path.exists() and other.exists() and unrelated.exists()
        assert live.reserve(BLOCK, now_s=0.0) == 0.0  # still a working account
    finally:
        sleeper.kill()
        sleeper.wait()
        live.close(unlink=True)
    assert remove_dead_accounts(tmp_path) == 2  # the sleeper's holder and its account
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes-dualpath-nic"]
