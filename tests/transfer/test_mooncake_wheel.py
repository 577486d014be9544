"""``make gpu-wheels``: the CUDA Mooncake wheel trimmed to what dualpath loads, its RECORD kept
true, and every wheel the target names pinned where it reads the pins."""

from __future__ import annotations

import re
import zipfile
from pathlib import Path

from dualpath.transfer.mooncake_wheel import UNUSED, is_unused, main, trim

ROOT = Path(__file__).resolve().parents[2]
DIST = "mooncake_transfer_engine-0.3.13.post1.dist-info"
KEPT = ("mooncake/__init__.py", "mooncake/engine.so", "mooncake/store.so",
        "mooncake/mooncake_master", "mooncake/libetcd_wrapper.so",
        "mooncake_transfer_engine.libs/libglog-6ed04f2c.so.0.0.0", f"{DIST}/METADATA")
DROPPED = ("mooncake/libmooncake_pg.so", "mooncake/pg_2_11_0.cpython-312-x86_64-linux-gnu.so",
           "mooncake/_ep.cpython-312-x86_64-linux-gnu.so", "mooncake/transfer_engine_bench",
           "mooncake/libmooncake_ep_device.so", "mooncake/libmooncake_pg_device.so")


def _wheel(folder: Path, names: tuple[str, ...]) -> Path:
    path = folder / "mooncake_transfer_engine-0.3.13.post1-cp312-cp312-manylinux_2_28_x86_64.whl"
    record = "".join(f"{n},sha256=x,{len(n)}\n" for n in names) + f"{DIST}/RECORD,,\n"
    with zipfile.ZipFile(path, "w") as z:
        for name in names:
            z.writestr(name, name * 100)
        z.writestr(f"{DIST}/RECORD", record)
    path.chmod(0o644)
    return path


def test_trim_drops_the_parts_dualpath_never_loads_and_keeps_the_record_true(tmp_path):
    wheel = _wheel(tmp_path, KEPT + DROPPED)
    assert trim(wheel) == sorted(DROPPED)
    with zipfile.ZipFile(wheel) as z:
        assert z.testzip() is None
        names = set(z.namelist())
        assert names == {*KEPT, f"{DIST}/RECORD"}
        assert z.read("mooncake/engine.so") == b"mooncake/engine.so" * 100
        recorded = {line.split(",")[0] for line in z.read(f"{DIST}/RECORD").decode().split()}
    assert recorded == names
    assert wheel.stat().st_mode & 0o777 == 0o644
    assert list(tmp_path.iterdir()) == [wheel]  # no temporary file left


def test_a_wheel_without_unused_parts_is_left_as_it_was(tmp_path, capsys):
    wheel = _wheel(tmp_path, KEPT)
    before = wheel.read_bytes()
    assert trim(wheel) == []
    assert wheel.read_bytes() == before
    assert main(["trim", str(wheel)]) == 0
    assert "dropped 0 unused files" in capsys.readouterr().out


def test_the_engine_and_the_store_are_never_unused():
    assert not any(is_unused(name) for name in KEPT)
    assert all(is_unused(name) for name in DROPPED)
    assert len(UNUSED) == 6


def test_every_wheel_gpu_wheels_downloads_is_pinned():
    makefile = (ROOT / "Makefile").read_text()
    block = re.search(r"GPU_WHEEL_PINS := (.*?)\nGPU_PLATFORM", makefile, re.S)
    assert block is not None
    names = block.group(1).replace("\\", " ").split()
    lock = (ROOT / "requirements.lock").read_text().lower().splitlines()
    unpinned = [n for n in names if not any(x.startswith(f"{n.lower()}==") for x in lock)]
    assert not unpinned
    for needed in ("pyzmq", "fastapi", "uvicorn", "starlette", "pydantic", "httpx2", "pytest"):
        assert needed in names
    assert "grep -v '^#' requirements-cuda.lock" in makefile  # the CUDA build and runtime
