"""KVLayout: byte sizes, shapes, layer offsets and zero-copy layer views of a full block."""

import pytest

from dualpath.kv.layout import KVLayout
from dualpath.model.spec import ModelSpec

SMOL = KVLayout(num_layers=30, num_kv_heads=3, head_dim=64, dtype="bfloat16", block_size=64)
SMALL = KVLayout(4, 2, 8, "float16", 16)


def _smollm2_spec() -> ModelSpec:
    return ModelSpec(model_type="llama", vocab_size=49152, hidden_size=576,
                     intermediate_size=1536, num_layers=30, num_heads=9, num_kv_heads=3,
                     head_dim=64, rms_norm_eps=1e-5, max_position=8192)


def test_smollm2_byte_sizes():
    assert SMOL.bytes_per_token_per_layer == 768
    assert SMOL.layer_block_bytes == 49_152
    assert SMOL.full_block_bytes == 1_474_560


def test_small_byte_sizes():
    assert SMALL.bytes_per_token_per_layer == 2 * 2 * 8 * 2
    assert SMALL.layer_block_bytes == 16 * 64
    assert SMALL.full_block_bytes == 4096


def test_shapes():
    assert SMOL.full_block_shape == (30, 64, 768)
    assert SMOL.layer_block_shape == (1, 64, 768)
    layers, tokens, per_token = SMOL.full_block_shape
    assert layers * tokens * per_token == SMOL.full_block_bytes


def test_layer_offsets():
    assert [SMOL.layer_offset(i) for i in (0, 1, 29)] == [0, 49_152, 29 * 49_152]
    assert SMOL.layer_offset(29) + SMOL.layer_block_bytes == SMOL.full_block_bytes


@pytest.mark.parametrize("layer", [-1, 30, 31, 1000])
def test_layer_offset_out_of_range(layer):
    with pytest.raises(IndexError):
        SMOL.layer_offset(layer)


def test_layer_view_out_of_range():
    buf = bytearray(SMALL.full_block_bytes)
    with pytest.raises(IndexError):
        SMALL.layer_view(memoryview(buf), SMALL.num_layers)


def test_layer_view_is_zero_copy():
    buf = bytearray(SMALL.full_block_bytes)
    view = SMALL.layer_view(memoryview(buf), 2)
    assert view.nbytes == SMALL.layer_block_bytes
    assert not view.readonly
    view[:] = b"\xab" * view.nbytes
    start = SMALL.layer_offset(2)
    assert buf[start : start + SMALL.layer_block_bytes] == b"\xab" * SMALL.layer_block_bytes
    assert buf[:start] == bytes(start)
    assert buf[start + SMALL.layer_block_bytes :] == bytes(SMALL.layer_block_bytes)
    buf[start] = 7  # and the other way round
    assert view[0] == 7


@pytest.mark.parametrize("size", [0, 4095, 4097, 8192])
def test_layer_view_rejects_wrong_size(size):
    with pytest.raises(ValueError, match="full block"):
        SMALL.layer_view(memoryview(bytearray(size)), 0)


def test_full_block_is_layer_blocks_concatenated():
    layers = [bytes([i + 1]) * SMOL.layer_block_bytes for i in range(SMOL.num_layers)]
    full = bytearray(b"".join(layers))
    assert len(full) == SMOL.full_block_bytes
    for i, layer in enumerate(layers):
        assert SMOL.layer_view(memoryview(full), i) == layer


def test_from_spec():
    layout = KVLayout.from_spec(_smollm2_spec(), "bfloat16", 64)
    assert layout == SMOL
    assert layout.full_block_bytes == 1_474_560


def test_layout_id_names_every_dimension():
    ids = {
        SMALL.layout_id,
        KVLayout(4, 2, 8, "bfloat16", 16).layout_id,
        KVLayout(4, 2, 8, "float32", 16).layout_id,
        KVLayout(4, 2, 8, "float16", 32).layout_id,
        KVLayout(5, 2, 8, "float16", 16).layout_id,
        KVLayout(4, 1, 8, "float16", 16).layout_id,
        KVLayout(4, 2, 16, "float16", 16).layout_id,
    }
    assert len(ids) == 7
    assert SMALL.layout_id == KVLayout(4, 2, 8, "float16", 16).layout_id


@pytest.mark.parametrize("dtype", ["int8", "fp8", "float64", "", "Float16"])
def test_invalid_dtype(dtype):
    with pytest.raises(ValueError, match="dtype"):
        KVLayout(4, 2, 8, dtype, 16)


@pytest.mark.parametrize("sizes", [(0, 2, 8, 16), (4, 0, 8, 16), (4, 2, 0, 16), (4, 2, 8, -1)])
def test_non_positive_sizes(sizes):
    layers, heads, head_dim, block = sizes
    with pytest.raises(ValueError):
        KVLayout(layers, heads, head_dim, "float16", block)
