"""Storage fixtures: a Mooncake Store service (master + segment holder) for the whole session."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from dualpath.errors import StorageError

MOONCAKE_SEGMENT_MB = 256  # the contract suite stores a few MB; the damage tests a few KB


@pytest.fixture(scope="session")
def mooncake_store_master(tmp_path_factory) -> Iterator[str]:
    """``host:port`` of a mooncake_master with one segment holder, both stopped at the end;
    skips when the ``mooncake`` package or its ``mooncake_master`` binary is missing."""
    pytest.importorskip("mooncake.store", reason="the mooncake package is not installed")
    from dualpath.storage.mooncake_service import local_mooncake, master_binary

    try:
        master_binary()
    except StorageError as exc:
        pytest.skip(str(exc))
    with local_mooncake(MOONCAKE_SEGMENT_MB,
                        log_dir=tmp_path_factory.mktemp("mooncake-logs")) as master:
        yield master
