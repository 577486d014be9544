"""The vLLM decode connector maps a decode engine's pool file only when it is one: a regular
file of this user, owner-only, named as a pool in /dev/shm, never through a symlink (a request's
``kv_transfer_params`` name the file). Real files, the connector's own ``Moves._buffer``."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from dualpath.integrations.vllm.moves import Moves
from dualpath.integrations.vllm.plan import SEAL_BYTES, Remote
from dualpath.kv.host_pool import HostPool
from dualpath.kv.shm_files import ShmFileError

FULL_BLOCK_BYTES = 4096 - SEAL_BYTES
SHM = Path("/dev/shm")

pytestmark = [pytest.mark.skipif(not SHM.is_dir(), reason="no /dev/shm"),
              # the connector's tensor over a read-only mapping, as in vLLM (never written)
              pytest.mark.filterwarnings("ignore:The given buffer is not writable")]


def buffer(path: Path) -> bytes:
    """What the connector reads of a one-block buffer at offset 0 of ``path``."""
    moves = SimpleNamespace(_maps={}, layout=SimpleNamespace(full_block_bytes=FULL_BLOCK_BYTES))
    remote = Remote(req_id=1, endpoint=str(path), buffer=0, num_blocks=1, pairs=[(0, 0)])
    return bytes(Moves._buffer(moves, remote)[:4].tolist())


@pytest.fixture
def paths():
    made: list[Path] = []

    def name(tag: str) -> Path:
        made.append(SHM / f"dualpath-{tag}-{os.getpid()}")
        return made[-1]

    yield name
    for path in made:
        path.unlink(missing_ok=True)


def test_a_decode_engines_pool_is_mapped(paths):
    pool = HostPool(FULL_BLOCK_BYTES + SEAL_BYTES, 2, pin=False, shm_path=str(paths("de7")))
    pool.buffer(0)[:4] = b"kv!!"
    try:
        assert buffer(Path(pool.shm_path)) == b"kv!!"
    finally:
        pool.close()


def test_a_symlink_named_as_a_pool_is_refused(paths, tmp_path):
    target = tmp_path / "elsewhere"
    target.write_bytes(b"not yours" + bytes(8192))
    target.chmod(0o600)
    link = paths("de8")
    link.symlink_to(target)
    with pytest.raises(ShmFileError, match="cannot open"):
        buffer(link)


def test_a_pool_file_open_to_others_is_refused(paths):
    path = paths("de9")
    path.write_bytes(bytes(8192))
    path.chmod(0o644)
    with pytest.raises(ShmFileError, match="open to others"):
        buffer(path)
