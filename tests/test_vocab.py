"""The vocabularies: one table for the ladder and one for the policies, members that parse at
the boundaries and still travel as the same strings."""

from __future__ import annotations

import json

import pytest

from dualpath.config import ClusterConfig, cluster_config_from_json, cluster_config_to_json
from dualpath.protocol import Hello, Prefill, decode, encode
from dualpath.scheduler.global_scheduler import POLICIES
from dualpath.scheduler.rules import SchedulerParams
from dualpath.sim.config import SimConfig
from dualpath.vocab import LADDER, Mode, Policy, PrefillMode, ReadPath, Role, Rung


def test_the_ladder_names_a_mode_and_a_policy_for_every_rung_in_order():
    assert list(LADDER) == list(Rung)
    assert [str(r) for r in Rung] == ["recompute", "basic", "layerwise", "round_robin",
                                      "dualpath", "oracle"]
    assert (Rung.ROUND_ROBIN.mode, Rung.ROUND_ROBIN.policy) == (Mode.DUALPATH, Policy.ROUND_ROBIN)
    assert all(r.policy == Policy.DUALPATH for r in Rung if r != Rung.ROUND_ROBIN)
    assert Rung.RECOMPUTE.mode == Mode.RECOMPUTE  # the bottom rung: no KV reuse at all
    assert [r for r in Rung if not r.reuses_kv] == [Rung.RECOMPUTE]


def test_every_policy_has_one_entry_in_the_scheduler_table():
    assert set(POLICIES) == set(Policy)


def test_the_prefill_mode_of_each_serving_mode():
    assert [PrefillMode.of(m) for m in Mode] == [
        PrefillMode.BASIC, PrefillMode.LAYERWISE, PrefillMode.LAYERWISE, PrefillMode.ORACLE,
        PrefillMode.LAYERWISE]


def test_configs_parse_strings_into_members_and_write_the_same_strings():
    config = ClusterConfig(mode="basic", read_path="pe", policy="round_robin")
    assert (config.mode, config.read_path, config.policy) == (
        Mode.BASIC, ReadPath.PE, Policy.ROUND_ROBIN)
    assert type(config.mode) is Mode
    data = json.loads(cluster_config_to_json(config))
    assert (data["mode"], data["read_path"], data["policy"]) == ("basic", "pe", "round_robin")
    assert cluster_config_from_json(cluster_config_to_json(config)) == config
    assert type(SchedulerParams(1, 1, policy="round_robin").policy) is Policy
    assert type(SimConfig(mode="round_robin").mode) is Rung


@pytest.mark.parametrize("field", ["mode", "read_path", "policy"])
def test_a_config_names_the_field_of_an_unknown_word(field):
    with pytest.raises(ValueError, match=field):
        ClusterConfig(**{field: "nope"})


def test_messages_decode_enum_fields_as_members_and_encode_plain_strings():
    msg = decode(encode(Prefill(1, (1, 2), 0, ReadPath.SPLIT, "de", 0, PrefillMode.BASIC)))
    assert isinstance(msg, Prefill)
    assert type(msg.read_path) is ReadPath and type(msg.mode) is PrefillMode
    assert (msg.read_path, msg.mode) == ("split", "basic")
    hello = decode(encode(Hello("pe0", "prefill", 0, "tcp://x")))
    assert isinstance(hello, Hello) and type(hello.role) is Role
    # on the wire the same bytes as plain strings
    assert encode(Hello("pe0", Role.PREFILL, 0, "tcp://x")) == encode(
        Hello("pe0", "prefill", 0, "tcp://x"))
