"""A peer's frame becomes a message only if it fits its schema: mistyped, negative, non-finite,
unknown or malformed frames are ``ProtocolError`` — never another exception, never a message
that reaches the router's state with a wrong type in it."""

from __future__ import annotations

import contextlib
import math

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dualpath.protocol import (
    _TYPES,
    Abort,
    Decode,
    Heartbeat,
    Hello,
    Join,
    Prefill,
    ProtocolError,
    Tokens,
    Unfence,
    decode,
    encode,
)
from dualpath.request import SamplingParams


def _frame(**fields) -> bytes:
    return msgpack.packb(fields, use_bin_type=True)


@pytest.mark.parametrize("frame", [
    _frame(type="hello", name="pe9", role="prefill", node_id="3", endpoint="e"),  # str id
    _frame(type="hello", name="pe9", role="prefill", node_id=True, endpoint="e"),  # bool id
    _frame(type="hello", name="pe9", role="prefill", node_id=-1, endpoint="e"),
    _frame(type="hello", name="pe9", role="encode", node_id=1, endpoint="e"),  # unknown role
    _frame(type="hello", name="../x", role="prefill", node_id=1, endpoint="e"),
    _frame(type="hello", name="pe9", role="prefill", node_id=1),  # a field missing
    _frame(type="hello", name="pe9", role="prefill", node_id=1, endpoint="e",
           incarnation="x" * 65),  # an incarnation too long
    _frame(type="unfence", req_ids=[1, -2]),
    _frame(type="heartbeat", name="de1", free_kv_blocks=1, free_host_slots=1,
           read_queue_tokens=0, progress_age_s=math.nan),
    _frame(type="heartbeat", name="de1", free_kv_blocks=1, free_host_slots=1,
           read_queue_tokens=0, running=[1, "2"]),
    _frame(type="tokens", items=[[1, 0, [5, 6]], [2, 0]]),  # a short row
    _frame(type="tokens", items=[[1, 0, [5, -6]]]),  # a negative token id
    _frame(type="finished", req_id=1, output_ids=[1, 2], finish_reason=7),
    _frame(type="prefilled", req_id=1, first_token=2, num_hit_blocks=0, wait_s=-1.0),
    _frame(type="no_such_message", req_id=1),
    _frame(req_id=1),  # no type
    msgpack.packb([1, 2, 3]),  # not a map
    msgpack.packb({"type": ["hello"]}),  # an unhashable type
    b"\xc1\xc1\xc1",  # not msgpack
    b"",
])
def test_a_frame_that_does_not_fit_its_schema_is_a_protocol_error(frame):
    with pytest.raises(ProtocolError):
        decode(frame)


def test_well_formed_frames_decode_as_before():
    for message in (Hello("pe0", "prefill", 0, "ep", "tcp://h:1", 1 << 40, 4096),
                    Join("de2", "decode", 2),
                    Heartbeat("de1", 10, 4, 0, (3, 4), inbox_age_s=0.5, progress_age_s=0.25,
                              step_budget_s=1.5, fenced=(7,)),
                    Hello("pe0", "prefill", 0, "ep", incarnation="a1b2"),
                    Abort(3, fenced=True), Unfence((3, 4)),
                    Tokens(((1, 0, (5, 6)), (2, 3, ())))):
        assert decode(encode(message)) == message
    # a whole-number float field may come as an integer
    assert decode(_frame(type="heartbeat", name="de1", free_kv_blocks=1, free_host_slots=1,
                         read_queue_tokens=0, progress_age_s=2)).progress_age_s == 2


def _decode_frame(**params) -> bytes:
    return _frame(type="decode", req_id=1, first_token=2, num_stored_blocks=0, params=params)


@pytest.mark.parametrize("frame", [
    _frame(type="decode", req_id=1, first_token=2, num_stored_blocks=0, params="greedy"),
    _frame(type="decode", req_id=1, first_token=2, num_stored_blocks=0, params=[4, 0.0]),
    _frame(type="decode", req_id=1, first_token=2, num_stored_blocks=0),  # no params
    _decode_frame(temperature="hot"),
    _decode_frame(temperature=math.inf),
    _decode_frame(temperature=-1.0),
    _decode_frame(max_tokens=True),  # a bool is not a count
    _decode_frame(max_tokens=0),  # SamplingParams' own check: at least one token
    _decode_frame(top_p=0.0),  # ... top_p in (0, 1]
    _decode_frame(min_tokens=9, max_tokens=4),
    _decode_frame(seed=1.5),
    _decode_frame(stop=["ok", 7]),
    _decode_frame(stop="ok"),  # one string is not an array of them
    _decode_frame(stop=[""]),
    _decode_frame(ignore_eos=1),
    _decode_frame(max_tokens=4, pickle="cos\nsystem"),  # a field SamplingParams does not have
    msgpack.packb({"type": "decode", "req_id": 1, "first_token": 2, "num_stored_blocks": 0,
                   "params": {b"max_tokens": 4}}, use_bin_type=True),  # a bytes key
    _frame(type="prefill", req_id=1, prompt_ids=[1, 2], num_hit_blocks=0, read_path="pe",
           de_endpoint="e", de_buffer_addr=0, params={"top_p": "all"}),
    _frame(type="prefill", req_id=1, prompt_ids=[1, 2], num_hit_blocks=0, read_path="pe",
           de_endpoint="e", de_buffer_addr=0, params={"seed": None, "temperature": math.nan}),
])
def test_malformed_nested_sampling_params_are_a_protocol_error(frame):
    with pytest.raises(ProtocolError):
        decode(frame)


def test_sampling_params_cross_the_wire_as_one_nested_record():
    params = SamplingParams(max_tokens=9, temperature=0.7, top_p=0.9, seed=-3, stop=("\n\n",),
                            ignore_eos=True, min_tokens=2)
    for message in (Prefill(4, (1, 2, 3), 0, "de", "ep", 4096, "layerwise", params),
                    Decode(4, 17, 1, params, num_prior_outputs=2)):
        back = decode(encode(message))
        assert back == message and isinstance(back.params, SamplingParams)
    raw = msgpack.unpackb(encode(Decode(4, 17, 1, params)))
    assert raw["params"]["seed"] == -3 and "prompt_ids" not in raw  # the DE has the tokens
    # a peer may leave out what has a default: the record's defaults stand in
    assert decode(_decode_frame(max_tokens=4)).params == SamplingParams(max_tokens=4)


_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.floats() | st.text(max_size=8)
    | st.binary(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner,
                                                                max_size=3),
    max_leaves=12)


@settings(max_examples=400, deadline=None)
@given(st.sampled_from(sorted(_TYPES)), st.dictionaries(
    st.sampled_from(["req_id", "name", "role", "node_id", "endpoint", "items", "output_ids",
                     "params", "num_stored_blocks", "prompt_ids",
                     "finish_reason", "error", "running", "values", "free_kv_blocks",
                     "free_host_slots", "read_queue_tokens", "progress_age_s", "first_token",
                     "inbox_age_s", "step_budget_s", "fenced", "incarnation", "req_ids",
                     "num_hit_blocks", "buffer_addr", "num_blocks", "num_loaded_blocks",
                     "peers", "known", "config_json", "model_id", "cluster_id"]),
    _VALUES, max_size=8))
def test_random_frames_decode_to_a_well_typed_message_or_a_protocol_error(kind, fields):
    try:
        message = decode(_frame(type=kind, **fields))
    except ProtocolError:
        return
    assert decode(encode(message)) == message  # what got through is a message of its kind


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=64))
def test_random_bytes_are_a_protocol_error_or_a_message(raw):
    with contextlib.suppress(ProtocolError):
        decode(raw)
