"""The serve config file: TOML, overrides, and errors that name the key."""

from __future__ import annotations

import json

import pytest

from dualpath.config_file import ConfigError, config_to_json, load_config


def test_file_then_overrides(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('mode = "basic"\nnum_decode = 3\n[storage]\nread_cap_mb_s = 200\n'
                    '[traffic]\nlane_weights = [["high", 9], ["kv_load", 1]]\n'
                    '[serve]\nport = 9000\n')
    config = load_config(path, ["storage.read_cap_mb_s=50", "serve.api_key=secret",
                                "engine.block_size=32", 'read_path="de"'])
    assert config.cluster.mode == "basic" and config.cluster.num_decode == 3
    assert config.cluster.storage.read_cap_mb_s == 50.0
    assert config.cluster.traffic.lane_weights == (("high", 9), ("kv_load", 1))
    assert config.cluster.engine.block_size == 32 and config.cluster.read_path == "de"
    assert config.serve.port == 9000 and config.serve.api_key == "secret"
    assert json.loads(config_to_json(config))["cluster"]["storage"]["read_cap_mb_s"] == 50.0


def test_defaults_without_a_file():
    config = load_config()
    assert config.cluster.num_prefill == 1 and config.cluster.num_decode == 2
    assert config.serve.host == "127.0.0.1"


@pytest.mark.parametrize("override, names", [
    ("storage.read_cap_gb=1", "storage.'read_cap_gb'"),
    ("nmu_decode=2", "'nmu_decode'"),
    ("serve.port=eighty", "serve.port must be int"),
    ("engine.block_size=1.5", "engine.block_size must be int"),
    ("storage=3", "storage must be a table"),
    ("num_decode", "key=value"),
    ("serve.port=70000", "serve.port must be in"),
    ('serve.allowed_modes=["dualpath", "warp"]', "serve.allowed_modes takes some of"),
    ("serve.allowed_modes=[]", "serve.allowed_modes takes some of"),
    ("serve.request_timeout_s=0", "serve.request_timeout_s must be > 0"),
    ('serve.api_keys=["a", ""]', "serve.api_key and serve.api_keys must be non-empty"),
    ("serve.salt_by_api_key=1", "serve.salt_by_api_key must be bool"),
])
def test_bad_keys_and_values_are_named(override, names):
    with pytest.raises(ConfigError, match=names.replace("(", r"\(")):
        load_config(overrides=[override])


def test_serve_guards_from_the_file(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('[serve]\nallowed_modes = ["dualpath", "basic"]\nrequest_timeout_s = 30\n'
                    'api_keys = ["sk-a", "sk-b"]\nsalt_by_api_key = true\n')
    serve = load_config(path).serve
    assert serve.allowed_modes == ("dualpath", "basic") and serve.request_timeout_s == 30.0
    assert serve.api_keys == ("sk-a", "sk-b") and serve.salt_by_api_key
    defaults = load_config().serve
    assert defaults.allowed_modes is None and defaults.request_timeout_s == 600.0
    assert defaults.api_keys == () and not defaults.salt_by_api_key


def test_a_broken_file_is_named(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text("mode = \n")
    with pytest.raises(ConfigError, match=r"bad\.toml"):
        load_config(path)
