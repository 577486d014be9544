"""Shared-memory files: opened only when they are ours, swept when their processes are gone.

Two kinds of file under ``/dev/shm`` (the temporary folder where there is none) outlive a
process that is killed:

- a vLLM decode engine's host pool, ``dualpath-NAME-PID`` (``HostPool(shm_path=...)`` at
  ``vllm_instance.shm_path_for``: GBs for a large model), which its vLLM instance maps
  read-only, and any file named the same way by the process that made it (a vLLM prefill
  engine's fence table, ``dualpath-fence-NAME-PID``, ``vllm/fence.py``);
- what Python's ``multiprocessing`` leaves in a vLLM instance's processes: shared-memory
  segments ``psm_XXXXXXXX`` (vLLM's message queues between its API server and engine core) and
  named semaphores ``sem.mp-XXXXXXXX``. A clean exit unlinks them; a SIGKILL does not.

**Ownership.** A file is a dead process's, and swept, only when all of these hold:

- it is a regular file (not a symlink) owned by this process's user;
- no live process maps it (``/proc/PID/maps``) or holds it open (``/proc/PID/fd``), matched by
  device and inode, so a mount namespace that sees the folder under another path still counts.
  The files are listed before ``/proc`` is scanned, so a file's creator (alive) is seen holding
  it; Python's ``SharedMemory`` and vLLM's queues keep their segments mapped for their whole
  life. No age is required: a segment in use is written all the time, so its times say nothing
  of its owner (a killed engine core's segments are seconds "old");
- for a pool file, the process its name gives is gone (or is this very process, which is about
  to create its pool afresh: a file with its pid that it neither maps nor holds is a dead
  process's that had the same pid).

Every process of this user is inspected. When one cannot be read (a process of this user that
is not dumpable, say), nothing is swept in that pass; the one exception is pid 1, the init of
the pid namespace (a container's or sandbox's supervisor, unreadable even to root in some),
which starts and reaps processes but does not map their shared memory. Processes of other
users are inspected when this process may read them (as root, all); those it may not read are
taken not to map this user's files when the file grants no access to others (``psm_``,
``sem.mp-`` and pool files are 0600): such a file is swept then; one open to others is kept.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import re
import stat
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from dualpath.errors import DualPathError

log = logging.getLogger("dualpath.shm")

SHM_FOLDER = Path("/dev/shm")
# dualpath-NAME-PID: an engine's pool or fence table (not the storage-NIC accounts, which
# node_nic.remove_dead_accounts sweeps by their holder files)
POOL_FILE = re.compile(r"dualpath-(?!nic-)(?P<name>[A-Za-z0-9_.-]+)-(?P<pid>[1-9][0-9]{0,9})")
PSM_FILE = re.compile(r"psm_[0-9a-f]{8}")  # multiprocessing.shared_memory's default names
SEM_FILE = re.compile(r"sem\.mp-[a-z0-9_]{8}")  # multiprocessing's named semaphores
INIT_PID = "1"  # the pid namespace's init: not inspected (see the module doc)
PRIVATE_MODE_BITS = 0o077  # access for the group or others


class ShmFileError(DualPathError):
    """A shared-memory file is not ours to use: a symlink, not a regular file, another user's,
    open to others, or an existing file where a new one must be created."""


# -- opening ---------------------------------------------------------------------------------


def open_owned(path: str | Path, flags: int = os.O_RDONLY) -> int:
    """A file descriptor of the existing file ``path``, opened with ``flags`` and never through
    a symlink (``O_NOFOLLOW``); ``ShmFileError`` unless it is a regular file owned by this
    process's user that grants no access to anyone else."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:  # ELOOP: a symlink
        raise ShmFileError(f"cannot open shared-memory file {path}: {exc}") from exc
    try:
        check_private(os.fstat(fd), path)
    except BaseException:
        os.close(fd)
        raise
    return fd


def check_private(info: os.stat_result, path: str | Path) -> None:
    """``ShmFileError`` unless ``info`` is a regular file of this process's user, private to
    it (mode 0600 or stricter)."""
    if not stat.S_ISREG(info.st_mode):
        raise ShmFileError(f"{path} is not a regular file")
    if info.st_uid != os.geteuid():
        raise ShmFileError(f"{path} belongs to uid {info.st_uid}, not to this user "
                           f"({os.geteuid()})")
    if info.st_mode & PRIVATE_MODE_BITS:
        raise ShmFileError(f"{path} is open to others (mode {stat.filemode(info.st_mode)})")


def map_readonly(path: str | Path) -> mmap.mmap:
    """A read-only shared mapping of the whole file ``path``, checked as ``open_owned`` does:
    how a vLLM decode instance maps its decode engine's pool file."""
    fd = open_owned(path, os.O_RDONLY)
    try:
        return mmap.mmap(fd, 0, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    finally:
        os.close(fd)  # the mapping keeps the pages


# -- who holds what --------------------------------------------------------------------------


@dataclass
class Holders:
    """What a scan of ``/proc`` found: the (device, inode) of every file on the folder's device
    that a process maps or holds open, and whether some process could not be read."""

    held: set[tuple[int, int]] = field(default_factory=set)
    unread_own: bool = False  # a process of this user could not be read: sweep nothing
    unread_other: bool = False  # one of another user could not be read


def shm_folder() -> Path:
    """Where shared-memory files live: ``/dev/shm``, else the temporary folder."""
    return SHM_FOLDER if SHM_FOLDER.is_dir() else Path(tempfile.gettempdir())


def scan_holders(folder: Path, proc: Path = Path("/proc")) -> Holders:
    """Every (device, inode) on ``folder``'s file system that a live process maps or holds."""
    device = os.stat(folder).st_dev
    found = Holders()
    for entry in os.scandir(proc):
        if not entry.name.isdigit() or entry.name == INIT_PID:
            continue
        try:
            found.held |= held_by(Path(entry.path), device)
        except PermissionError:
            if _runs_as_me(Path(entry.path) / "status"):
                found.unread_own = True
            else:
                found.unread_other = True
    return found


def held_by(process: Path, device: int) -> set[tuple[int, int]]:
    """(device, inode) of the files on ``device`` that the process at ``process``
    (``/proc/PID``) maps or holds open: empty once it exited, ``PermissionError`` when it may
    not be read."""
    try:
        return _mapped(process / "maps", device) | _open_files(process / "fd", device)
    except (FileNotFoundError, ProcessLookupError):
        return set()  # it exited meanwhile


def _mapped(maps: Path, device: int) -> set[tuple[int, int]]:
    """(device, inode) of the files on ``device`` that ``maps`` lists."""
    major, minor = os.major(device), os.minor(device)
    held = set()
    with open(maps, encoding="utf-8", errors="replace") as lines:
        for line in lines:
            fields = line.split(maxsplit=5)
            if len(fields) < 5 or fields[4] == "0":
                continue  # anonymous memory
            dev_major, _, dev_minor = fields[3].partition(":")
            if int(dev_major, 16) == major and int(dev_minor, 16) == minor:
                held.add((device, int(fields[4])))
    return held


def _open_files(fds: Path, device: int) -> set[tuple[int, int]]:
    """(device, inode) of the files on ``device`` that the descriptors in ``fds`` open."""
    held = set()
    for fd in os.listdir(fds):
        try:
            if not os.readlink(fds / fd).startswith("/"):
                continue  # a socket, a pipe, an anonymous inode
            info = os.stat(fds / fd)
        except (FileNotFoundError, ProcessLookupError):
            continue  # closed meanwhile
        if info.st_dev == device:
            held.add((info.st_dev, info.st_ino))
    return held


def _runs_as_me(status: Path) -> bool:
    """Whether any of the process's uids (real, effective, saved, file system) is this
    process's effective uid; True when that cannot be told."""
    try:
        for line in status.read_text().splitlines():
            if line.startswith("Uid:"):
                return str(os.geteuid()) in line.split()[1:]
    except OSError:
        pass
    return True


# -- sweeping --------------------------------------------------------------------------------


def pool_file_pid(name: str) -> int | None:
    """The pid in a pool file's name (``dualpath-NAME-PID``), or None for another name."""
    match = POOL_FILE.fullmatch(name)
    return int(match["pid"]) if match else None


def sweepable_name(name: str) -> bool:
    """Whether ``name`` is a kind of file the sweep considers (pool, ``psm_``, ``sem.mp-``)."""
    return any(p.fullmatch(name) for p in (POOL_FILE, PSM_FILE, SEM_FILE))


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists (one of another user, or a zombie, too)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    except OverflowError:
        return False
    return True


def _candidates(folder: Path,
                names: set[str] | None = None) -> list[tuple[Path, os.stat_result]]:
    """The files of ``folder`` the sweep may remove, before the scan of ``/proc``: of a swept
    kind, regular, this user's, and a pool file's process gone."""
    found = []
    try:
        listed = os.listdir(folder) if names is None else sorted(names)
    except OSError:
        return []
    for name in listed:
        if not sweepable_name(name):
            continue
        pid = pool_file_pid(name)
        if pid is not None and pid != os.getpid() and pid_alive(pid):
            continue
        try:
            info = os.lstat(folder / name)
        except OSError:
            continue
        if stat.S_ISREG(info.st_mode) and info.st_uid == os.geteuid():
            found.append((folder / name, info))
    return found


def dead_files(folder: Path | None = None, names: set[str] | None = None) -> list[Path]:
    """The files of ``folder`` (default ``shm_folder()``) that dead processes left (see the
    module doc); ``names``: consider only these."""
    folder = shm_folder() if folder is None else folder
    candidates = _candidates(folder, names)
    if not candidates:
        return []
    holders = scan_holders(folder)
    if holders.unread_own:
        log.warning("shm sweep: a process of this user could not be read: nothing swept")
        return []
    return [path for path, info in candidates
            if (info.st_dev, info.st_ino) not in holders.held
            and not (holders.unread_other and info.st_mode & PRIVATE_MODE_BITS)]


def sweep_dead(folder: Path | None = None, names: set[str] | None = None) -> list[Path]:
    """Remove the files ``dead_files`` finds; returns those removed (logged)."""
    removed = []
    for path in dead_files(folder, names):
        with contextlib.suppress(FileNotFoundError):
            size = path.stat().st_size
            path.unlink()
            removed.append(path)
            log.info("shm sweep: removed %s (%d bytes) of a dead process", path, size)
    return removed


def remove_if_dead(path: Path) -> bool:
    """Remove ``path`` if it is a file the sweep would remove; whether it went. How a new
    pool replaces a file a dead process with its name left."""
    return bool(sweep_dead(path.parent, names={path.name}))


def wait_unheld(paths: list[Path], timeout_s: float, poll_s: float = 0.2) -> None:
    """Wait until no live process maps or holds any of ``paths`` (those still there), at most
    ``timeout_s``: a dead engine's vLLM children may still be exiting."""
    deadline = time.monotonic() + timeout_s
    while True:
        infos = []
        for path in paths:
            with contextlib.suppress(OSError):
                info = os.lstat(path)
                infos.append((info.st_dev, info.st_ino))
        if not infos:
            return
        held = scan_holders(paths[0].parent).held
        if not held.intersection(infos) or time.monotonic() >= deadline:
            return
        time.sleep(poll_s)


def orphaned_pool_files(folder: Path | None = None) -> list[Path]:
    """Pool files whose named process is gone (held or not): what a cluster's stop waits on
    before it sweeps."""
    folder = shm_folder() if folder is None else folder
    try:
        names = os.listdir(folder)
    except OSError:
        return []
    return [folder / name for name in names
            if (pid := pool_file_pid(name)) is not None and not pid_alive(pid)]
