"""Whole-file reads that survive short reads (FUSE, NFS), for the ``fs`` store.

A ``preadv`` may return fewer bytes than asked without reaching the end of the file: FUSE
daemons (3FS, s3fs, ...) and NFS clients do, for a large read or under load. Taking that for a
truncated file would count a good block as damaged and delete it. So a short read goes on from
where it stopped; a read that returns nothing re-stats the open file: a file shorter than asked
for is truncated (the caller judges it damaged), and one whose size says the bytes are there is
read again a few times, then given up as a transient ``ShortReadError`` (a miss that leaves the
file alone), never as damage.
"""

from __future__ import annotations

import errno
import fcntl
import os
import time
from collections.abc import Sequence
from typing import Any

O_DIRECT = getattr(os, "O_DIRECT", 0)
STALLED_READ_RETRIES = 3  # reads that return nothing, with the file long enough, before giving up
STALL_PAUSE_S = 0.002  # the pause before the first of them (doubled each time)


class ShortReadError(OSError):
    """Reads of a file stopped short although its size says the bytes are there (transient:
    the file is left alone)."""


def read_file_into(path: str, buffers: Sequence[Any], extra_flags: int = 0) -> int:
    """Read the file at ``path`` from offset 0 into ``buffers`` (in order); returns the bytes
    read: all of them, or fewer only when the file is shorter."""
    fd = os.open(path, os.O_RDONLY | extra_flags)
    try:
        return preadv_full(fd, buffers, 0)
    finally:
        os.close(fd)


def preadv_full(fd: int, buffers: Sequence[Any], offset: int = 0) -> int:
    """Fill ``buffers`` from ``fd`` at ``offset``, going on after short reads; returns the bytes
    read, fewer than the buffers hold only when the file ends first. ``ShortReadError`` when
    reads return nothing though the file is long enough, ``STALLED_READ_RETRIES`` times."""
    views = [memoryview(b).cast("B") for b in buffers]
    want = sum(v.nbytes for v in views)
    got = os.preadv(fd, views, offset)
    stalls = 0
    if got < want and O_DIRECT:
        _drop_o_direct(fd)  # the rest may start unaligned: read it through the page cache
    while got < want:
        n = os.preadv(fd, _after(views, got), offset + got)
        if n > 0:
            got += n
            continue
        if os.fstat(fd).st_size < offset + want:
            return got  # the file ends here: truncated
        stalls += 1
        if stalls > STALLED_READ_RETRIES:
            raise ShortReadError(errno.EIO, f"reads stop at byte {offset + got} of a file of "
                                 f"{os.fstat(fd).st_size} bytes")
        time.sleep(STALL_PAUSE_S * 2 ** (stalls - 1))
    return got


def _after(views: Sequence[memoryview], skip: int) -> list[memoryview]:
    """``views`` without their first ``skip`` bytes."""
    out = []
    for view in views:
        if skip >= view.nbytes:
            skip -= view.nbytes
            continue
        out.append(view[skip:])
        skip = 0
    return out


def _drop_o_direct(fd: int) -> None:
    """Clear O_DIRECT on ``fd`` (Linux allows it with F_SETFL), if it is set."""
    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    if flags & O_DIRECT:
        fcntl.fcntl(fd, fcntl.F_SETFL, flags & ~O_DIRECT)
