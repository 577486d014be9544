"""Trim Mooncake's CUDA wheel to what dualpath loads, for machines that get wheels by hand.

``make gpu-wheels`` downloads the wheels a GPU machine without network needs; the CUDA build of
Mooncake is 93 MiB, of which 60 MiB are parts dualpath never loads: the torch process-group
backend (``libmooncake_pg*.so``, ``pg_*.so``), the expert-parallel kernels
(``libmooncake_ep_device.so``, ``_ep*.so``) and the ``transfer_engine_bench`` program. The
Transfer Engine (``engine.so``) and the Store (``store.so``, ``mooncake_master``) link none of
them (``readelf -d``). ``trim`` rewrites the wheel without them, under the same name, with its
``RECORD`` listing what is left, so ``pip install`` takes it as the same distribution and
version (``transfer/mooncake_build.py`` recognizes it as the CUDA build).

``python -m dualpath.transfer.mooncake_wheel trim WHEEL...`` (standard library only).
"""

from __future__ import annotations

import fnmatch
import os
import sys
import tempfile
import zipfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from argparse import ArgumentParser

# Files of the CUDA wheel that dualpath never loads (see the module doc).
UNUSED = ("mooncake/libmooncake_pg.so", "mooncake/libmooncake_pg_device.so",
          "mooncake/pg_*.so", "mooncake/libmooncake_ep_device.so", "mooncake/_ep.*.so",
          "mooncake/transfer_engine_bench")


def is_unused(name: str, patterns: Iterable[str] = UNUSED) -> bool:
    """Whether wheel member ``name`` matches one of ``patterns``."""
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in patterns)


def _record_without(record: str, dropped: set[str]) -> str:
    """A wheel's RECORD (``path,hash,size`` lines) without the lines of ``dropped`` paths."""
    kept = [line for line in record.splitlines() if line.split(",", 1)[0] not in dropped]
    return "\n".join(kept) + "\n"


def trim(wheel: Path, patterns: Sequence[str] = UNUSED) -> list[str]:
    """Rewrite ``wheel`` in place without its members matching ``patterns``; returns the
    members dropped (none: the file is left as it was)."""
    with zipfile.ZipFile(wheel) as src:
        members = src.infolist()
        dropped = {m.filename for m in members if is_unused(m.filename, patterns)}
        if not dropped:
            return []
        fd, tmp = tempfile.mkstemp(dir=wheel.parent, suffix=".whl.part")
        os.close(fd)
        try:
            with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as dst:
                for member in members:
                    if member.filename in dropped:
                        continue
                    data = src.read(member)
                    if member.filename.endswith(".dist-info/RECORD"):
                        data = _record_without(data.decode(), dropped).encode()
                    dst.writestr(member, data, compress_type=zipfile.ZIP_DEFLATED)
            os.chmod(tmp, wheel.stat().st_mode)
            os.replace(tmp, wheel)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    return sorted(dropped)


@dataclass(frozen=True)
class WheelOptions:
    """``dualpath mooncake wheel trim WHEEL...``."""

    command: str
    wheels: tuple[Path, ...]


def add_arguments(parser: ArgumentParser) -> None:
    """The options of :class:`WheelOptions`."""
    parser.add_argument("command", choices=("trim",))
    parser.add_argument("wheels", nargs="+", type=Path)


def run(options: WheelOptions) -> int:
    """Trim each wheel, printing what was dropped and the new size."""
    for wheel in options.wheels:
        before = wheel.stat().st_size
        dropped = trim(wheel)
        print(f"{wheel.name}: dropped {len(dropped)} unused files, "
              f"{before / 2**20:.1f} -> {wheel.stat().st_size / 2**20:.1f} MiB")
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m dualpath.transfer.mooncake_wheel trim WHEEL...``: ``dualpath mooncake wheel``."""
    from dualpath.cli import main as cli_main

    return cli_main(["mooncake", "wheel", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
