"""Weight loading, the tokenizer wrapper and the default-model cache check."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from dualpath.errors import ModelLoadError, ModelSpecError
from dualpath.model import default_model
from dualpath.model.default_model import resolve_model
from dualpath.model.loader import load_model
from dualpath.model.tokenizer import Tokenizer


def test_loader_fills_fused_shards_from_checkpoint(tiny_qwen2_dir):
    model = load_model(tiny_qwen2_dir)
    tensors = load_file(str(next(tiny_qwen2_dir.glob("*.safetensors"))))
    attn = model.model.layers[1].self_attn
    k_rows = attn.qkv_shard_rows("k")
    prefix = "model.layers.1.self_attn.k_proj"
    assert torch.equal(attn.qkv_proj.weight[k_rows], tensors[f"{prefix}.weight"])
    assert torch.equal(attn.qkv_proj.bias[k_rows], tensors[f"{prefix}.bias"])
    up = model.model.layers[0].mlp.gate_up_proj.weight[model.spec.intermediate_size :]
    assert torch.equal(up, tensors["model.layers.0.mlp.up_proj.weight"])


def test_missing_tensor_is_a_load_error(tiny_llama_dir, tmp_path):
    folder = tmp_path / "broken"
    shutil.copytree(tiny_llama_dir, folder)
    path = next(folder.glob("*.safetensors"))
    tensors = load_file(str(path))
    del tensors["model.layers.2.mlp.down_proj.weight"]
    save_file(tensors, str(path), metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match="lacks 1 tensors"):
        load_model(folder)


def test_wrong_shape_is_a_load_error(tiny_llama_dir, tmp_path):
    folder = tmp_path / "shape"
    shutil.copytree(tiny_llama_dir, folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["intermediate_size"] = 96
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="shape"):
        load_model(folder)


def test_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ModelSpecError, match="gpt2"):
        load_model(tmp_path)


def test_tokenizer_roundtrip_and_missing_template(smollm2_dir, tmp_path):
    tok = Tokenizer(smollm2_dir)
    ids = tok.encode("Hello, world!")
    assert tok.decode(ids) == "Hello, world!"
    assert tok.eos_token_id == 2
    shutil.copy(smollm2_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    with pytest.raises(ModelLoadError, match="no chat template"):
        Tokenizer(tmp_path).render_chat([{"role": "user", "content": "hi"}])


def test_default_model_cache_detects_damage(smollm2_dir, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(smollm2_dir, copy)
    assert default_model._is_complete(copy)
    weights = copy / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])  # truncated: must be re-converted
    assert not default_model._is_complete(copy)
    (copy / default_model.MANIFEST).unlink()
    assert not default_model._is_complete(copy)


def test_resolve_model(smollm2_dir, tmp_path):
    assert resolve_model(None) == smollm2_dir
    assert resolve_model(str(smollm2_dir)) == smollm2_dir
    with pytest.raises(ModelLoadError):
        resolve_model(str(tmp_path))


def test_model_id_fingerprints_config_and_weights(tiny_llama_dir, tmp_path):
    from dualpath.model.spec import model_id

    first = model_id(tiny_llama_dir)
    assert first == model_id(tiny_llama_dir)
    assert first.startswith(tiny_llama_dir.name[:20])
    copy = tmp_path / "same name"
    shutil.copytree(tiny_llama_dir, copy)
    path = next(copy.glob("*.safetensors"))
    tensors = load_file(str(path))
    tensors["model.norm.weight"] = tensors["model.norm.weight"] + 1  # a "fine-tune"
    save_file(tensors, str(path), metadata={"format": "pt"})
    other = model_id(copy)
    assert other.startswith("same-name-") and other[-12:] != first[-12:]
