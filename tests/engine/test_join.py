"""Joining a router from any host: bad addresses, a silent router, a busy port, overrides."""

from __future__ import annotations

import socket
import time

import pytest

from dualpath.cli import main
from dualpath.config import ClusterConfig
from dualpath.config_file import ConfigError, override_cluster_config
from dualpath.control_keys import ENGINE_KEY_ENV, ClusterKeys
from dualpath.engine.join import (
    EngineJoinError,
    Joined,
    check_model,
    join_router,
    local_address_towards,
    router_host,
)
from dualpath.errors import DualPathError
from dualpath.server.router.client import Router


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.parametrize("address", ["127.0.0.1:5000", "tcp://:5000", "tcp://host", "http://h:1"])
def test_malformed_router_addresses_are_named(address):
    with pytest.raises(EngineJoinError, match="tcp://HOST:PORT"):
        router_host(address)


def test_a_silent_router_fails_the_join_in_bounded_time():
    start = time.monotonic()
    with pytest.raises(EngineJoinError, match="no answer from the router"):
        join_router(f"tcp://127.0.0.1:{_free_port()}", "de1", "decode", 1, timeout_s=1.5,
                    key=ClusterKeys.generate(["de1"]).engine_key("de1"))
    assert time.monotonic() - start < 5


def test_engine_cli_reports_a_silent_router_as_an_error(tiny_llama_dir, tmp_path, capsys,
                                                        monkeypatch):
    monkeypatch.delenv(ENGINE_KEY_ENV, raising=False)
    argv = ["engine", "--router", f"tcp://127.0.0.1:{_free_port()}", "--role", "decode",
            "--node-id", "1", "--model", str(tiny_llama_dir), "--join-timeout-s", "1"]
    assert main(argv) == 2
    assert "no engine key: pass --key FILE" in capsys.readouterr().err
    keys = ClusterKeys.generate(["de1", "de2"]).write(tmp_path / "keys")
    assert main([*argv, "--key", str(keys / "engines" / "de2.json"), "--name", "de1"]) == 2
    assert "the key is for engine 'de2', not 'de1'" in capsys.readouterr().err
    assert main([*argv, "--key", str(keys / "engines" / "de1.json")]) == 2
    assert "no answer from the router" in capsys.readouterr().err


def test_a_router_answers_with_its_config_model_and_run(tiny_llama_dir, tmp_path):
    config = ClusterConfig(router_port=_free_port(), mode="layerwise", num_decode=3)
    router = Router(tiny_llama_dir, config)
    try:
        assert router.address == f"tcp://127.0.0.1:{config.router_port}"
        joined = join_router(router.address, "de2", "decode", 2, timeout_s=10,
                             key=router.keys.engine_key("de2"))
        assert joined.config == config
        assert joined.model_id == router.model_id and joined.cluster_id == router.cluster_id
        with pytest.raises(EngineJoinError, match="role must be one of prefill, decode"):
            join_router(router.address, "x1", "encode", 1, timeout_s=10,
                        key=router.keys.engine_key("de2"))
        with pytest.raises(DualPathError, match="cannot bind"):  # the port is taken
            Router(tiny_llama_dir, config)
    finally:
        router.shutdown()


def test_another_checkpoint_is_refused():
    joined = Joined(ClusterConfig(), "modelA-123", "run1")
    check_model(joined, "modelA-123", "/m")
    with pytest.raises(EngineJoinError, match="same checkpoint"):
        check_model(joined, "modelB-456", "/m")


def test_host_local_overrides_apply_on_the_routers_config():
    config = override_cluster_config(ClusterConfig(), ["storage.root=/mnt/kv",
                                                      "engine_timeout_s=7"])
    assert config.storage.root == "/mnt/kv" and config.engine_timeout_s == 7.0
    with pytest.raises(ConfigError, match="unknown config key"):
        override_cluster_config(ClusterConfig(), ["storage.rot=/x"])


def test_local_address_towards_loopback_is_loopback():
    assert local_address_towards("127.0.0.1") == "127.0.0.1"


def test_a_mooncake_store_client_registers_with_the_engines_address():
    from dualpath.config import StorageConfig
    from dualpath.engine.join import Advertised, localized

    here = Advertised("10.77.3.2")
    store = ClusterConfig(storage=StorageConfig(backend="mooncake_store"))
    assert localized(store, here).storage.mooncake_local_host == "10.77.3.2"
    named = override_cluster_config(store, ["storage.mooncake_local_host=10.78.3.2"])
    assert localized(named, here).storage.mooncake_local_host == "10.78.3.2"
    assert localized(ClusterConfig(), here) == ClusterConfig()  # fs: nothing to do
