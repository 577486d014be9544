"""Full-content digests of a checkpoint's weight files, cached so start-up stays fast.

``spec.model_id`` names the KV-cache keys of a checkpoint, so it must change when any byte of
the weights does: a fine-tune that differs anywhere must never reuse another model's KV.
Hashing every byte runs at about 0.5 GB/s (blake2b, one core), so each file's digest is kept in
a small JSON file in the dualpath cache folder, keyed by the file's real path and trusted only
while the file's size, mtime, ctime and inode are those it had when it was hashed. ctime and
inode are there because ``cp -p``, ``rsync -a`` and ``tar`` restore an old mtime on new
content; a user can set neither back, so a file rewritten or swapped in since is hashed again.

Torch-free, clock-free and single-threaded: ``spec`` (a pure module) imports it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

CACHE_FILE = "weight-digests.json"
CACHE_VERSION = 1
# what loader.load_weights reads (no .bin/.pt loader), and a random-weight folder's settings
WEIGHT_PATTERNS = ("*.safetensors", "dummy_weights.json")


def weight_files(model_dir: str | Path) -> list[Path]:
    """The weight files of a checkpoint folder, sorted by name."""
    folder = Path(model_dir)
    return sorted(p for pattern in WEIGHT_PATTERNS for p in folder.glob(pattern))


def default_cache_path() -> Path | None:
    """``weight-digests.json`` in the dualpath cache folder, or None if there is no home.

    The folder is ``default_model.cache_dir()``'s (``$DUALPATH_CACHE_DIR``, default
    ``~/.cache/dualpath``), found again here because ``default_model`` imports torch to
    convert and this module must stay torch-free; a test keeps the two in step.
    """
    root = os.environ.get("DUALPATH_CACHE_DIR")
    if root:
        return Path(root) / CACHE_FILE
    try:
        return Path.home() / ".cache" / "dualpath" / CACHE_FILE
    except RuntimeError:  # no $HOME and no passwd entry
        return None


def hash_file(path: Path) -> str:
    """blake2b (32 bytes, hex) of every byte of ``path``, read in 256 KiB chunks."""
    with path.open("rb") as f:
        return hashlib.file_digest(f, lambda: hashlib.blake2b(digest_size=32)).hexdigest()


def weight_digests(paths: list[Path], cache_path: Path | None = None) -> list[str]:
    """The full-content digest of each file in ``paths``, from the cache while it is unchanged.

    ``cache_path`` defaults to ``default_cache_path()``. A missing, corrupt or unwritable cache
    only costs hashing again.
    """
    cache_path = cache_path or default_cache_path()
    cached = _load(cache_path) if cache_path else {}
    fresh: dict[str, dict[str, Any]] = {}
    digests = []
    for path in paths:
        real = path.resolve()  # Hugging Face hub snapshots link to shared blobs
        stat = _identity(real)
        entry = cached.get(str(real))
        if (isinstance(entry, dict) and entry.get("stat") == stat
                and isinstance(entry.get("blake2b"), str)):
            digests.append(entry["blake2b"])
            continue
        digest = hash_file(real)
        # kept under the identity read *before* hashing: a write during the read changes the
        # identity, so the next look-up misses and hashes the new bytes
        fresh[str(real)] = {"stat": stat, "blake2b": digest}
        digests.append(digest)
    if fresh and cache_path:
        _save(cache_path, fresh)
    return digests


def _identity(path: Path) -> list[int]:
    st = path.stat()
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]


def _load(cache_path: Path) -> dict[str, Any]:
    """The cached entries by real path; empty when the file is missing or not ours."""
    try:
        data = json.loads(cache_path.read_text())
    except (OSError, ValueError):  # missing, unreadable, or half-written by an old writer
        return {}
    if not isinstance(data, dict) or data.get("version") != CACHE_VERSION:
        return {}
    files = data.get("files")
    return files if isinstance(files, dict) else {}


def _save(cache_path: Path, fresh: dict[str, dict[str, Any]]) -> None:
    """Merge ``fresh`` into the cache file by writing a temp file and renaming it over.

    Readers never see a half-written file. Two processes saving at once both succeed; the later
    rename wins and the other's new entries are lost, which only costs hashing them again.
    Entries of files that no longer exist are dropped, so the cache does not grow forever.
    """
    entries = {p: e for p, e in _load(cache_path).items() if os.path.exists(p)}
    entries.update(fresh)
    text = json.dumps({"version": CACHE_VERSION, "files": entries}, indent=1, sort_keys=True)
    # a read-only or full cache folder is no error: fingerprints still work, just slower
    with contextlib.suppress(OSError):
        cache_path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{cache_path.name}.", suffix=".tmp",
                                   dir=cache_path.parent)
        try:
            with os.fdopen(fd, "w") as f:
                f.write(text)
            os.replace(tmp, cache_path)
        except OSError:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
