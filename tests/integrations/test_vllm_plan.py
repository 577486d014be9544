"""The vLLM connector's per-step plan (``dualpath.integrations.vllm.plan``, no vLLM needed):
which blocks a prefill loads, pulls and pushes, the seal, and what a request's parameters may
not make the connector do."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from dualpath.integrations.vllm.plan import (
    SEAL_BYTES,
    Bounds,
    DecodeParams,
    PrefillParams,
    PrefillPlan,
    key_salt,
    parsed,
    seal_of,
    seal_offset,
    shared_pool_path,
    vllm_salt,
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
        "req_id": 1, "read_path": "de", "num_hit_blocks": 1, "de_endpoint": "127.0.0.1:1",
        "de_buffer_addr": 0, "num_blocks": 1}}).read_path == ReadPath.DE


def test_only_a_decode_engines_pool_is_mapped():
    assert shared_pool_path("/dev/shm/dualpath-de1-123") == "/dev/shm/dualpath-de1-123"
    for path in ("/etc/passwd", "/dev/shm/other", "/dev/shm/sub/dualpath-x",
                 "/dev/shm/../etc/dualpath-x", "dualpath-x"):
        with pytest.raises(ValueError, match="shared pool"):
            shared_pool_path(path)


# -- bounds: every field against the prompt and the pool file ------------------------------------
BLOCK_BYTES = 1000
PROMPT = 19  # tokens: 5 blocks of BS
BOUNDS = Bounds(PROMPT, BS, BLOCK_BYTES)
PREFILL = {"req_id": 3, "read_path": "pe", "num_hit_blocks": 2, "de_endpoint": "10.0.0.2:16001",
           "de_buffer_addr": 1 << 20, "num_blocks": 5}


@pytest.fixture
def pool() -> Iterator[str]:
    """A decode engine's pool file with room for one 4-block buffer and its seal at 0."""
    path = Path("/dev/shm" if os.path.isdir("/dev/shm") else "/tmp") / f"dualpath-t-{os.getpid()}"
    path.write_bytes(bytes(seal_offset(4, BLOCK_BYTES) + SEAL_BYTES))
    yield str(path)
    path.unlink()


def decode(pool: str, **changes: object) -> dict:
    """Decode params of an 18-token buffer (prompt 19 = 18 + the first token) in ``pool``."""
    return {"dualpath": {"req_id": 3, "shm_path": pool, "buffer_offset": 0, "num_blocks": 5,
                         "num_tokens": 18, "num_stored_blocks": 2, **changes}}


def test_params_inside_the_prompt_and_the_pool_are_taken(pool):
    assert parsed(PrefillParams, {"dualpath": PREFILL}, BOUNDS) is not None
    assert parsed(PrefillParams, {"dualpath": {**PREFILL, "de_endpoint": "[fd00::2]:7"}},
                  BOUNDS) is not None
    small = Bounds(17, BS, BLOCK_BYTES)  # 16 tokens in the buffer: 4 blocks, as the file has
    assert parsed(DecodeParams, decode(pool, num_blocks=4, num_tokens=16), small) is not None


@pytest.mark.parametrize("changes", [
    {"num_blocks": 6}, {"num_blocks": 4}, {"num_blocks": 10**12},  # not the prompt's blocks
    {"num_hit_blocks": 6},  # a hit past the buffer
    {"de_buffer_addr": 0}, {"de_buffer_addr": 2**64 - 100},  # outside the address space
    {"de_endpoint": "x"}, {"de_endpoint": "h:0"}, {"de_endpoint": "h:70000"},
    {"de_endpoint": ":1"}, {"de_endpoint": "a b:1"}, {"de_endpoint": "h:1\n"},
    {"num_blocks": 5.0}, {"num_blocks": True}, {"req_id": 2**64}, {"req_id": "3"},
    {"mode": "sideways"}, {"de_endpoint": "h" * 5000 + ":1"}, {"de_endpoint": "\u00e9:1"},
])
def test_prefill_params_out_of_bounds_are_ignored(changes):
    assert parsed(PrefillParams, {"dualpath": {**PREFILL, **changes}}, BOUNDS) is None


@pytest.mark.parametrize("changes", [
    {"num_tokens": 10**12, "num_blocks": 250_000_000_000},  # the POST that ended vLLM
    {"num_tokens": 10**12},
    {"num_tokens": 19, "num_blocks": 5},  # no prompt token left to compute
    {"num_blocks": 4}, {"num_blocks": 6},  # not the tokens' blocks
    {"num_stored_blocks": 5},  # more stored blocks than the prompt has full ones
    {"buffer_offset": 8},  # the seal past the end of the file
    {"shm_path": "/etc/passwd"}, {"shm_path": "/dev/shm/dualpath-missing-0"},
    {"buffer_offset": -1}, {"num_tokens": 1.5},
])
def test_decode_params_out_of_bounds_are_ignored(pool, changes):
    small = Bounds(PROMPT, BS, BLOCK_BYTES)
    params = decode(pool, **({"num_blocks": 5} | changes))
    assert parsed(DecodeParams, params, small) is None
    assert parsed(DecodeParams, decode(pool, num_blocks=5), small) is None  # file too small
    assert parsed(DecodeParams, decode(pool, num_blocks=4, num_tokens=16),
                  Bounds(17, BS, BLOCK_BYTES)) is not None


def test_a_salt_vllm_refuses_goes_to_vllm_as_a_digest_and_keys_stay_on_the_salt():
    salt = "tenant/" + "é@/\\" * 63  # 259 characters, most of them ones vLLM refuses
    digest = vllm_salt(salt)
    assert len(salt) >= 256 and len(digest) == 64 and set(digest) <= set("0123456789abcdef")
    ours = {"dualpath": {"cache_salt": salt}}
    assert key_salt(digest, ours) == salt  # what our engines sent: keyed on the salt itself
    assert key_salt("plain", ours) == "plain"  # a salt that is not its digest: vLLM's own
    assert key_salt("plain", None) == "plain" and key_salt(None, ours) == ""
    assert vllm_salt("a") != vllm_salt("b")


@pytest.mark.parametrize("read_path,pe_read", [("pe", 0), ("de", 0), ("split", 1)])
def test_the_params_the_engine_writes_are_what_the_connector_reads(read_path, pe_read):
    from dualpath.vocab import PrefillMode

    store = {"pe": 2, "de": 0, "split": pe_read}[read_path]
    sent = PrefillParams(3, ReadPath(read_path), 2, store, "10.0.0.2:16001", 1 << 20, 5,
                         PrefillMode.LAYERWISE, "", "tenant")
    wire = sent.to_params()
    assert wire["dualpath"]["role"] == "prefill" and key_salt(vllm_salt("tenant"), wire) == "tenant"
    assert PrefillParams.parse(wire) == sent
    assert parsed(PrefillParams, wire, BOUNDS) == sent


def test_the_decode_params_the_engine_writes_are_what_the_connector_reads(pool):
    sent = DecodeParams(3, pool, 0, 4, 16, 2, "tenant")
    wire = sent.to_params()
    assert wire["dualpath"]["role"] == "decode" and key_salt(vllm_salt("tenant"), wire) == "tenant"
    assert DecodeParams.parse(wire) == sent
    assert parsed(DecodeParams, wire, Bounds(17, BS, BLOCK_BYTES)) == sent
