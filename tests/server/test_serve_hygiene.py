"""What ``dualpath serve`` leaves on a machine stays bounded: the store's default capacity, the
last run folders only, rotated engine logs, and no storage-NIC files of dead clusters."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from collections import namedtuple
from pathlib import Path
from types import SimpleNamespace

import pytest

from dualpath.config import ClusterConfig, StorageConfig
from dualpath.config_file import AppConfig, ServeConfig
from dualpath.server import launch
from dualpath.server import serve as serve_mod
from dualpath.server.launch import LocalCluster
from dualpath.storage.node_nic import account_folder

GB = 10**9
DiskUsage = namedtuple("DiskUsage", "total used free")


class _Stopped(Exception):
    """Raised instead of starting a cluster: serve() got as far as its launcher."""


@pytest.fixture
def launched(tmp_path, monkeypatch):
    """Runs ``serve(config)`` up to its launcher; returns what the launcher was given."""
    monkeypatch.setenv("DUALPATH_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(serve_mod, "resolve_model", lambda name: tmp_path / "model")
    seen: dict = {}

    def launcher(model_dir, config, log_dir):
        seen.update(config=config, log_dir=log_dir)
        raise _Stopped

    monkeypatch.setattr(serve_mod, "_launcher", launcher)
    listen = serve_mod.listen_socket  # any free port, not serve.port (8000 may be taken here)
    monkeypatch.setattr(serve_mod, "listen_socket", lambda host, port: listen(host, 0))

    def run(config: AppConfig) -> dict:
        with pytest.raises(_Stopped):
            serve_mod.serve(config)
        return seen

    return run


def _free_disk(monkeypatch, free_bytes: int) -> None:
    monkeypatch.setattr(shutil, "disk_usage", lambda path: DiskUsage(4 * free_bytes,
                                                                     3 * free_bytes, free_bytes))


# -- the store's capacity -----------------------------------------------------------------------


def test_serve_caps_its_default_store_at_half_the_free_disk(launched, monkeypatch, capsys):
    _free_disk(monkeypatch, 100 * GB)
    seen = launched(AppConfig())
    storage = seen["config"].cluster.storage
    assert storage.capacity_gb == 50.0
    assert storage.root == str(Path(os.environ["DUALPATH_CACHE_DIR"]) / "kv-store")
    assert "capped at 50 GB (50% of 100.0 GB free + 0.0 GB stored" in capsys.readouterr().out
    written = json.loads((seen["log_dir"] / "config.json").read_text())
    assert written["cluster"]["storage"]["capacity_gb"] == 50.0  # engines get it too


def test_the_default_capacity_counts_what_the_store_already_holds(launched, monkeypatch,
                                                                  tmp_path):
    root = tmp_path / "kv"
    block = root / "m" / "l" / "bs64" / "ab" / "cd" / ("ab" * 16 + ".kvb")
    block.parent.mkdir(parents=True)
    with block.open("wb") as f:
        f.truncate(2 * GB)  # sparse: 2 GB by size, none on disk
    _free_disk(monkeypatch, 10 * GB)
    config = AppConfig(ClusterConfig(storage=StorageConfig(root=str(root))))
    assert launched(config)["config"].cluster.storage.capacity_gb == 6.0  # half of 10 + 2


@pytest.mark.parametrize("storage, serve, expected", [
    (StorageConfig(capacity_gb=3.0), ServeConfig(), 3.0),  # explicit wins
    (StorageConfig(capacity_gb=3.0), ServeConfig(store_capacity_fraction=0.9), 3.0),
    (StorageConfig(), ServeConfig(store_capacity_fraction=0.0), None),  # opted out
    (StorageConfig(), ServeConfig(store_capacity_fraction=0.25), 25.0),
    (StorageConfig(backend="memory"), ServeConfig(), None),  # not a disk
])
def test_an_explicit_capacity_always_wins(launched, monkeypatch, storage, serve, expected):
    _free_disk(monkeypatch, 100 * GB)
    config = AppConfig(ClusterConfig(storage=storage), serve)
    assert launched(config)["config"].cluster.storage.capacity_gb == expected


def test_the_default_capacity_is_rounded_down_to_a_tenth_of_a_gb():
    assert serve_mod.default_capacity_gb(10**9 + 999, 0, 0.5) == 0.5
    assert serve_mod.default_capacity_gb(1_234_567_890, 0, 0.5) == 0.6
    assert serve_mod.default_capacity_gb(0, 0, 0.5) == 0.0


def test_store_capacity_fraction_is_checked():
    with pytest.raises(ValueError, match="store_capacity_fraction"):
        ServeConfig(store_capacity_fraction=1.0)
    with pytest.raises(ValueError, match="keep_runs"):
        ServeConfig(keep_runs=0)


# -- run folders -------------------------------------------------------------------------------


def _old_runs(parent: Path, count: int) -> list[Path]:
    folders = [parent / f"20250101-0000{i:02d}" for i in range(count)]
    for folder in folders:
        folder.mkdir(parents=True)
        (folder / "pe0.log").write_text("old\n")
    return folders


def test_serve_keeps_the_last_runs_and_any_a_live_server_uses(launched, monkeypatch,
                                                              tmp_path):
    _free_disk(monkeypatch, 100 * GB)
    parent = tmp_path / "cache" / "serve"
    old = _old_runs(parent, 14)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (old[1] / serve_mod.PID_FILE).write_text(f"{dead.pid}\n")
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (old[0] / serve_mod.PID_FILE).write_text(f"{live.pid}\n")
        (parent / "notes").mkdir()  # not a run folder: never touched
        (parent / "20250101-000000.txt").write_text("neither")
        current = launched(AppConfig())["log_dir"]
    finally:
        live.kill()
        live.wait()
    left = sorted(p.name for p in parent.iterdir())
    assert current.parent == parent and current.name in left
    kept = [f.name for f in old[-9:]]  # nine old ones and this run: ten
    assert left == sorted([old[0].name, *kept, current.name, "notes", "20250101-000000.txt"])
    assert (current / serve_mod.PID_FILE).read_text().split()[0] == str(os.getpid())


def test_a_pid_file_whose_process_started_at_another_time_is_not_in_use(tmp_path):
    run = tmp_path / "20250101-000000"
    run.mkdir()
    (run / serve_mod.PID_FILE).write_text(f"{os.getpid()} 12.00\n")  # a reused pid
    assert not serve_mod.run_in_use(run)
    (run / serve_mod.PID_FILE).write_text(f"{os.getpid()} {serve_mod._started(os.getpid())}\n")
    assert serve_mod.run_in_use(run)
    assert not serve_mod.run_in_use(tmp_path)  # no pid file


def test_two_servers_starting_in_one_second_get_their_own_folders(tmp_path):
    first = serve_mod.new_run_folder(tmp_path, 10)
    second = serve_mod.new_run_folder(tmp_path, 10)
    if first.name[:15] == second.name[:15]:  # same second
        assert second != first and second.name == f"{first.name}-{os.getpid()}"


# -- engine logs and storage-NIC files: a local cluster whose engines are stand-ins ----------


class _StandIns(LocalCluster):
    """A LocalCluster whose engine processes run ``script`` instead of an engine."""

    script = "pass"

    def _engine_argv(self, name: str, role: str, node_id: int) -> list[str]:
        return [sys.executable, "-c", self.script]

    def _engine_env(self, name: str) -> dict[str, str]:
        return launch.engine_env()  # no router: no control-plane key to hand out


def _run_stand_ins(tmp_path: Path, script: str) -> ClusterConfig:
    config = ClusterConfig(num_prefill=1, num_decode=1)
    cluster = _StandIns(tmp_path / "model", config, log_dir=tmp_path / "logs")
    cluster.script = script
    cluster.log_dir.mkdir(parents=True)
    cluster.router = SimpleNamespace(address="tcp://127.0.0.1:1", shutdown=lambda: None,
                                     engine_lost=lambda name: None)  # a stand-in, unused
    cluster._start_engines()
    for name in ("pe0", "de1"):
        assert cluster.process(name).wait(timeout=60) == 0
    cluster.stop()
    return config


CHATTY = "for i in range(20000): print(f'{i:08d} ' + 'x' * 42)"  # 20,000 lines of 52 bytes


def test_engine_logs_rotate_and_stay_under_their_bound(tmp_path, monkeypatch):
    monkeypatch.setattr(launch, "LOG_MAX_BYTES", 64 << 10, raising=False)
    monkeypatch.setattr(launch, "LOG_BACKUPS", 2, raising=False)
    _run_stand_ins(tmp_path, CHATTY)
    logs = tmp_path / "logs"
    for name in ("pe0", "de1"):
        files = sorted(logs.glob(f"{name}.log*"))
        sizes = {f.name: f.stat().st_size for f in files}
        assert set(sizes) == {f"{name}.log", f"{name}.log.1", f"{name}.log.2"}, sizes
        assert max(sizes.values()) <= 64 << 10, sizes
        text = (logs / f"{name}.log").read_text()
        assert text.endswith("00019999 " + "x" * 42 + "\n")  # the newest lines, whole
        for f in files:
            assert all(len(line) == 52 for line in f.read_text().splitlines(keepends=True))


def test_a_rotating_log_splits_only_a_line_longer_than_a_file(tmp_path):
    log = launch.RotatingLog(tmp_path / "x.log", max_bytes=10, backups=1)
    log.write(b"abc\n" + b"z" * 25 + b"\nend\n")
    log.close()
    assert (tmp_path / "x.log").read_bytes() == b"zzzzz\nend\n"
    assert (tmp_path / "x.log.1").read_bytes() == b"z" * 10
    assert not (tmp_path / "x.log.2").exists()


def test_a_local_cluster_start_removes_storage_nic_files_of_dead_processes(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    run = f"test{os.getpid()}"
    account = account_folder() / f"dualpath-nic-{run}-node0-read"
    holder = account_folder() / f"{account.name}.{dead.pid}.0badf00d.pid"
    kept = account_folder() / f"dualpath-nic-{run}-node1-read"
    kept_holder = account_folder() / f"{kept.name}.{os.getpid()}.0badf00d.pid"
    for path in (account, holder, kept, kept_holder):
        path.touch()
    try:
        _run_stand_ins(tmp_path, "pass")
        assert not account.exists() and not holder.exists()
        assert kept.exists() and kept_holder.exists()  # this process is alive
    finally:
        for path in (account, holder, kept, kept_holder):
            path.unlink(missing_ok=True)


def test_an_engines_last_words_reach_its_log(tmp_path):
    _run_stand_ins(tmp_path, "import sys; print('out'); sys.stderr.write('err\\n')")
    assert sorted((tmp_path / "logs" / "de1.log").read_text().split()) == ["err", "out"]


# A killed vLLM decode engine, as a stand-in: its shared pool (named as vllm_instance.shm_path_for
# names it) and a multiprocessing segment whose resource tracker died with it, then SIGKILL.
KILLED_VLLM_ENGINE = """
import os, signal
from multiprocessing import resource_tracker, shared_memory
from dualpath.integrations.vllm.engines.instance import shm_path_for
from dualpath.kv.host_pool import HostPool
pool = HostPool(4096, 4, pin=False, shm_path=shm_path_for("de1"))
segment = shared_memory.SharedMemory(create=True, size=1 << 16)
resource_tracker.unregister(segment._name, "shared_memory")  # as if the tracker was killed too
print(pool.shm_path, segment.name, flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_local_cluster_stop_sweeps_a_killed_engines_shared_memory(tmp_path):
    from multiprocessing import shared_memory

    live = shared_memory.SharedMemory(create=True, size=4096)  # this process maps it: kept
    config = ClusterConfig(num_prefill=1, num_decode=1)
    cluster = _StandIns(tmp_path / "model", config, log_dir=tmp_path / "logs")
    cluster.script = KILLED_VLLM_ENGINE
    cluster.log_dir.mkdir(parents=True)
    cluster.router = SimpleNamespace(address="tcp://127.0.0.1:1", shutdown=lambda: None,
                                     engine_lost=lambda name: None)
    try:
        cluster._start_engines()
        for name in ("pe0", "de1"):
            assert cluster.process(name).wait(timeout=60) == -9
        for pump in cluster._pumps:  # each engine's line reached its log
            pump.join(timeout=10)
        left = []
        for name in ("pe0", "de1"):
            pool, segment = (tmp_path / "logs" / f"{name}.log").read_text().split()
            left += [Path(pool), Path("/dev/shm") / segment]
        assert all(path.exists() for path in left), "the killed engines left nothing to sweep"
        cluster.stop()
        assert [path for path in left if path.exists()] == []
        assert Path(f"/dev/shm/{live.name}").exists()
    finally:
        live.close()
        live.unlink()


# -- secrets: the run folder, config.json, where API keys come from --------------------------


def test_the_run_folder_is_owner_only_and_config_json_redacts_every_key(launched, monkeypatch,
                                                                        tmp_path):
    from dualpath.config import VllmConfig

    _free_disk(monkeypatch, 100 * GB)
    os.umask(0o002)  # a permissive umask must not open the folder (restored below)
    try:
        config = AppConfig(
            ClusterConfig(vllm=VllmConfig(extra_args=("--enforce-eager", "--api-key",
                                                      "sk-vllm-secret", "--token=sk-tok"))),
            ServeConfig(api_key="sk-main-secret", api_keys=("sk-tenant-a", "sk-tenant-b"),
                        salt_by_api_key=True))
        seen = launched(config)
    finally:
        os.umask(0o022)
    folder = seen["log_dir"]
    assert folder.stat().st_mode & 0o777 == 0o700
    assert folder.parent.stat().st_mode & 0o777 == 0o700  # serve created <cache>/serve too
    written = folder / "config.json"
    assert written.stat().st_mode & 0o777 == 0o600
    text = written.read_text()
    for secret in ("sk-main-secret", "sk-tenant-a", "sk-tenant-b", "sk-vllm-secret", "sk-tok"):
        assert secret not in text
    data = json.loads(text)
    assert data["serve"]["api_key"] == "<redacted>"
    assert data["serve"]["api_keys"] == ["<redacted>", "<redacted>"]
    assert data["serve"]["salt_by_api_key"] is True  # a setting, not a secret
    assert data["cluster"]["vllm"]["extra_args"] == ["--enforce-eager", "--api-key",
                                                     "<redacted>", "--token=<redacted>"]
    assert data["cluster"]["storage"]["capacity_gb"] == 50.0  # the rest as it was
    assert seen["config"].serve.api_key == "sk-main-secret"  # the server still has it


def test_api_keys_come_from_a_file_one_a_line(launched, monkeypatch, tmp_path):
    _free_disk(monkeypatch, 100 * GB)
    monkeypatch.setenv("DUALPATH_API_KEY", "sk-from-env")  # a file wins over the environment
    keys = tmp_path / "keys"
    keys.write_text("sk-first\n\n  sk-second  \n")
    keys.chmod(0o600)
    config = AppConfig(serve=ServeConfig(api_key_file=str(keys), api_keys=("sk-config",)))
    served = launched(config)["config"].serve
    assert served.api_key == "sk-first"
    assert served.api_keys == ("sk-second", "sk-config")
    assert served.api_key_file is None


def test_the_api_key_can_come_from_the_environment(launched, monkeypatch):
    _free_disk(monkeypatch, 100 * GB)
    monkeypatch.setenv("DUALPATH_API_KEY", "sk-from-env\n")
    assert launched(AppConfig())["config"].serve.api_key == "sk-from-env"
    explicit = AppConfig(serve=ServeConfig(api_key="sk-flag"))
    assert launched(explicit)["config"].serve.api_key == "sk-flag"  # a given key wins
    monkeypatch.delenv("DUALPATH_API_KEY")
    assert launched(AppConfig())["config"].serve.api_key is None  # no key: no guard


def test_a_bad_api_key_file_is_a_clear_error(tmp_path, capsys):
    from dualpath.config_file import ConfigError, read_api_key_file

    with pytest.raises(ConfigError, match="cannot read the API key file"):
        read_api_key_file(tmp_path / "missing")
    empty = tmp_path / "empty"
    empty.write_text("\n  \n")
    with pytest.raises(ConfigError, match="holds no key"):
        read_api_key_file(empty)
    shared = tmp_path / "shared"
    shared.write_text("sk-x\n")
    shared.chmod(0o644)
    assert read_api_key_file(shared) == ("sk-x",)
    assert f"open to other users (mode -rw-r--r--): chmod 600 {shared}" in capsys.readouterr().err
    with pytest.raises(ValueError, match="not both"):
        ServeConfig(api_key="sk", api_key_file=str(shared))


def test_serve_takes_an_api_key_file_flag(tmp_path, monkeypatch):
    from dualpath.cli import main

    seen = []
    monkeypatch.setattr(serve_mod, "serve", lambda config: seen.append(config))
    assert main(["serve", "--api-key-file", str(tmp_path / "k")]) == 0
    assert seen[0].serve.api_key_file == str(tmp_path / "k")
    assert main(["serve", "--api-key-file", "k", "--api-key", "sk"]) == 2  # one or the other


# -- the API's port -----------------------------------------------------------------------------


def test_a_taken_port_stops_serve_before_any_engine_starts(tmp_path, monkeypatch):
    monkeypatch.setenv("DUALPATH_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(serve_mod, "resolve_model", lambda name: tmp_path / "model")
    started = []
    monkeypatch.setattr(serve_mod, "_launcher", lambda *args: started.append(args))
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        with pytest.raises(serve_mod.PortInUseError,
                           match=f"127.0.0.1:{port}: address already in use"):
            serve_mod.serve(AppConfig(serve=ServeConfig(port=port)))
    assert started == []


def test_the_listener_is_bound_before_the_engines_and_not_inherited():
    sock = serve_mod.listen_socket("127.0.0.1", 0)
    with sock:
        assert not sock.get_inheritable()  # no engine or vLLM instance holds the API's port
        with socket.socket() as other, pytest.raises(OSError):
            other.bind(sock.getsockname())
