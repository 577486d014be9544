"""The Mooncake build check (``transfer/mooncake_build.py``): an engine on CUDA refuses a build
that cannot move GPU memory, naming the package to install; a CPU engine takes either build.
Fake installed distributions and a fake library loader: no GPU needed."""

from __future__ import annotations

import importlib.metadata
import re
import tomllib
from pathlib import Path

import pytest

from dualpath.errors import TransferError
from dualpath.transfer import mooncake_build as mb
from dualpath.transfer.mooncake_build import (
    CPU_DIST,
    CUDA_DIST,
    CUDA_RUNTIME,
    CUDA_RUNTIME_DIST,
    VERSION,
    MooncakeBuildError,
    check_build,
    installed_builds,
    load_cuda_runtime,
    require_mooncake_for,
)

ROOT = Path(__file__).resolve().parents[2]
CPU_ONLY = {CPU_DIST: VERSION}
CUDA_ONLY = {CUDA_DIST: VERSION}


def _versions(found: dict[str, str]):
    def version_of(name: str) -> str:
        if name not in found:
            raise importlib.metadata.PackageNotFoundError(name)
        return found[name]
    return version_of


def test_installed_builds_reads_the_distributions():
    assert installed_builds(_versions({CPU_DIST: "0.3.13.post1", "numpy": "2"})) == CPU_ONLY
    assert installed_builds(_versions({})) == {}
    both = {CPU_DIST: "1", CUDA_DIST: "2"}
    assert installed_builds(_versions(both)) == both


def test_a_cpu_engine_takes_either_build():
    for installed in (CPU_ONLY, CUDA_ONLY, {}):
        check_build("cpu", installed)


def test_a_cuda_engine_with_the_non_cuda_build_is_told_which_package_to_install():
    with pytest.raises(MooncakeBuildError) as err:
        check_build("cuda", CPU_ONLY)
    message = str(err.value)
    assert f"pip install {CUDA_DIST}=={VERSION}" in message
    assert f"pip uninstall -y {CPU_DIST}" in message
    assert "Bad address" in message
    assert isinstance(err.value, TransferError)
    with pytest.raises(MooncakeBuildError, match=re.escape(CUDA_DIST)):
        check_build("cuda:1", CPU_ONLY)


def test_a_cuda_engine_takes_the_cuda_build_alone():
    check_build("cuda", CUDA_ONLY)
    check_build("cuda", {}, module_found=True)  # a source build: taken as it is
    with pytest.raises(MooncakeBuildError, match="both"):
        check_build("cuda", {**CPU_ONLY, **CUDA_ONLY})
    with pytest.raises(MooncakeBuildError, match=re.escape(f"pip install {CUDA_DIST}==")):
        check_build("cuda", {}, module_found=False)


def test_the_cuda_runtime_comes_from_the_library_path_first():
    loaded = []
    assert load_cuda_runtime([], loaded.append) == CUDA_RUNTIME
    assert loaded == [CUDA_RUNTIME]


def _missing_soname(loaded: list[str]):
    def load(path: str) -> None:
        if path == CUDA_RUNTIME:
            raise OSError(f"{CUDA_RUNTIME}: cannot open shared object file")
        loaded.append(path)
    return load


def test_the_cuda_runtime_comes_from_its_wheel_when_the_library_path_lacks_it(tmp_path):
    lib = tmp_path / "site" / "nvidia" / "cuda_runtime" / "lib"
    lib.mkdir(parents=True)
    (lib / CUDA_RUNTIME).write_bytes(b"")
    loaded: list[str] = []
    got = load_cuda_runtime([str(tmp_path / "elsewhere"), str(tmp_path / "site")],
                            _missing_soname(loaded))
    assert got == str(lib / CUDA_RUNTIME)
    assert loaded == [got]


def test_no_cuda_runtime_anywhere_says_what_to_install(tmp_path):
    with pytest.raises(MooncakeBuildError, match=re.escape(f"pip install {CUDA_RUNTIME_DIST}")):
        load_cuda_runtime([str(tmp_path)], _missing_soname([]))


def test_require_checks_nothing_for_the_cpu(monkeypatch):
    def fail(*_a, **_k):
        raise AssertionError("a CPU engine checks no build")
    monkeypatch.setattr(mb, "installed_builds", fail)
    require_mooncake_for("cpu")


def test_require_loads_the_runtime_for_the_cuda_build(monkeypatch):
    calls = []
    monkeypatch.setattr(mb, "installed_builds", lambda: dict(CUDA_ONLY))
    monkeypatch.setattr(mb, "load_cuda_runtime", lambda: calls.append("runtime"))
    require_mooncake_for("cuda")
    assert calls == ["runtime"]
    monkeypatch.setattr(mb, "installed_builds", lambda: dict(CPU_ONLY))
    with pytest.raises(MooncakeBuildError, match=re.escape(CUDA_DIST)):
        require_mooncake_for("cuda")
    assert calls == ["runtime"]


def test_this_environments_build_fits_its_engines():
    """Here (``make setup``): the build installed is the one this machine's engines need."""
    installed = installed_builds()
    assert len(installed) == 1, installed
    check_build("cpu", installed)
    if CPU_DIST in installed:
        with pytest.raises(MooncakeBuildError, match=re.escape(CUDA_DIST)):
            require_mooncake_for("cuda")


def test_each_machines_lock_pins_one_build_at_the_version_the_check_names():
    assert "mooncake" not in (ROOT / "requirements.lock").read_text()
    cpu = (ROOT / "requirements-cpu.lock").read_text().splitlines()
    cuda = (ROOT / "requirements-cuda.lock").read_text().splitlines()
    assert f"{CPU_DIST}=={VERSION}" in cpu and not any(CUDA_DIST + "==" in x for x in cpu)
    assert f"{CUDA_DIST}=={VERSION}" in cuda and not any(CPU_DIST in x for x in cuda)
    assert any(x.startswith(f"{CUDA_RUNTIME_DIST}==") for x in cuda)
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    assert extras["cpu"] == [f"{CPU_DIST}=={VERSION}"]
    assert f"{CUDA_DIST}=={VERSION}" in extras["cuda"]
    assert any(dep.startswith(CUDA_RUNTIME_DIST) for dep in extras["cuda"])
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert not any("mooncake" in dep for dep in project["dependencies"])  # an extra, one build
