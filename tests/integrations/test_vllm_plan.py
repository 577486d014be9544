"""The vLLM connector's per-step plan (``dualpath.integrations.vllm_plan``, no vLLM needed):
which blocks a prefill loads, pulls and pushes, the seal, and what a request's parameters may
not make the connector do."""

from __future__ import annotations

import pytest

from dualpath.integrations.vllm_plan import (
    DecodeParams,
    PrefillParams,
    PrefillPlan,
    parsed,
    seal_of,
    shared_pool_path,
)
from dualpath.vocab import ReadPath

BS = 4


def plan(read_path: str, hit: int, num_blocks: int = 5, pe_read: int = 0) -> PrefillPlan:
    params = PrefillParams.parse({"dualpath": {
        "req_id": 3, "read_path": read_path, "num_hit_blocks": hit, "num_pe_read_blocks": pe_read,
        "de_endpoint": "127.0.0.1:1", "de_buffer_addr": 4096, "num_blocks": num_blocks}})
    assert params is not None
    return PrefillPlan(params, num_blocks * BS - 1)


def test_pe_path_pushes_every_block_de_path_only_what_the_buffer_lacks():
    pe, de = plan("pe", 3), plan("de", 3)
    pe.pending_load = de.pending_load = (0, 3)
    assert pe.loads() == ((0, 3), (3, 3))  # all from the store
    assert de.loads() == ((0, 0), (0, 3))  # all pulled
    assert pe.pushes(19, BS) == [0, 1, 2, 3, 4]
    assert de.pushes(19, BS) == [3, 4]  # the decode engine read 0..2 itself


def test_a_split_read_loads_the_head_and_pulls_the_rest():
    split = plan("split", 3, pe_read=1)
    split.pending_load = (0, 3)
    assert split.loads() == ((0, 1), (1, 3))
    assert split.pushes(19, BS) == [0, 3, 4]


def test_chunked_prefill_pushes_a_partial_block_again_whole():
    de = plan("de", 1)
    assert de.pushes(6, BS) == [1]  # block 1 half done
    assert de.pushes(13, BS) == [1, 2, 3]  # block 1 again, whole; 3 partial
    assert de.pushes(19, BS) == [3, 4]


def test_the_seal_is_never_the_zeroed_one():
    assert seal_of(0) != bytes(8) and seal_of(2**64 - 1) != bytes(8)
    assert seal_of(5) != seal_of(6)


@pytest.mark.parametrize("params", [
    {"dualpath": {"req_id": 1}},  # fields missing
    {"dualpath": {"req_id": 1, "read_path": "sideways", "num_hit_blocks": 1,
                  "de_endpoint": "x", "de_buffer_addr": 0, "num_blocks": 1}},
    {"dualpath": {"req_id": -1, "read_path": "pe", "num_hit_blocks": 1,
                  "de_endpoint": "x", "de_buffer_addr": 0, "num_blocks": 1}},
    {"dualpath": {"req_id": 1, "read_path": "pe", "num_hit_blocks": [2],
                  "de_endpoint": "x", "de_buffer_addr": 0, "num_blocks": 1}},
])
def test_malformed_params_are_no_transfer_not_an_error(params):
    """Whoever can post to the instance sends kv_transfer_params: a bad one is ignored (the
    request is computed), never an exception in vLLM's scheduler."""
    assert parsed(PrefillParams, params) is None
    assert parsed(DecodeParams, params) is None
    assert parsed(PrefillParams, None) is None
    assert parsed(PrefillParams, {"dualpath": {
        "req_id": 1, "read_path": "de", "num_hit_blocks": 1, "de_endpoint": "x",
        "de_buffer_addr": 0, "num_blocks": 1}}).read_path == ReadPath.DE


def test_only_a_decode_engines_pool_is_mapped():
    assert shared_pool_path("/dev/shm/dualpath-de1-123") == "/dev/shm/dualpath-de1-123"
    for path in ("/etc/passwd", "/dev/shm/other", "/dev/shm/sub/dualpath-x",
                 "/dev/shm/../etc/dualpath-x", "dualpath-x"):
        with pytest.raises(ValueError, match="shared pool"):
            shared_pool_path(path)
