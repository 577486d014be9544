"""The fast path's prepacked weights replace the dense ones: a packed model holds each weight
once (``pack_weights`` drops every linear's dense matrix; a head tied to the embeddings is
packed once, in a layout the embedding look-up reads too)."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from dualpath.errors import ModelLoadError
from dualpath.model.kernels import load_kernels
from dualpath.model.loader import load_model, load_weights

DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]
MODELS = [pytest.param("tiny_llama_dir", id="own-head"),
          pytest.param("tiny_qwen2_dir", id="tied-head")]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fixture", MODELS)
def test_packing_replaces_the_dense_weights_instead_of_copying_them(fixture, dtype, request):
    model = load_model(request.getfixturevalue(fixture), dtype)
    dense_bytes = sum(p.nbytes for p in model.parameters())
    matrices = {name: weakref.ref(p) for name, p in model.named_parameters() if p.dim() == 2}
    model.pack_weights()
    model.use_kernels(load_kernels())
    gc.collect()
    kept = {name for name, p in model.named_parameters() if p.dim() == 2}
    if model.lm_head is not None or load_kernels() is not None:
        assert kept <= {"model.embed_tokens.weight"}  # an embedding table, never a head copy
    alive = sorted(name for name, ref in matrices.items() if ref() is not None)
    assert alive == sorted(kept), "dense weights still held beside their packed form"
    held = model.weight_bytes()
    assert dense_bytes <= held <= 1.02 * dense_bytes  # packing pads a little, copies nothing


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fixture", MODELS)
def test_the_packed_weights_read_back_as_the_loaded_ones(fixture, dtype, request):
    model_dir = request.getfixturevalue(fixture)
    model = load_model(model_dir, dtype)
    dense = {name: p.detach().clone() for name, p in model.named_parameters()}
    model.pack_weights()
    model.use_kernels(load_kernels())
    got = model.dense_weights()
    assert set(got) == set(dense)
    for name, tensor in dense.items():
        assert torch.equal(got[name], tensor), name
    ids = torch.tensor([0, 5, 299, 17])
    assert torch.equal(model.embed(ids), dense["model.embed_tokens.weight"][ids])
    with pytest.raises(ModelLoadError, match="packed"):
        load_weights(model, model_dir)  # weights load before packing, never into it
