"""Random-weight models of real architectures, made on the device at load time (no checkpoint).

A folder holding a model's ``config.json`` and a ``dummy_weights.json`` (``{"seed": S,
"std": σ}``) instead of safetensors loads as that architecture with random weights, drawn on
the engine's device in its dtype (vLLM's ``--load-format dummy`` does the same). Benchmarks of
speed need no trained weights, and a machine without network or disk room for 16 GB of
Llama-3-8B still runs every engine, bench and check on the real shapes. The tokens such a model
generates are meaningless; everything else (sizes, KV bytes, time) is the real model's.

``ARCHITECTURES`` names the shapes the GPU check builds: SmolLM2-135M (the default model) and
Llama-3-8B, with their published ``config.json`` values.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

DUMMY_FILE = "dummy_weights.json"

_LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
          "attention_bias": False, "mlp_bias": False, "rms_norm_eps": 1e-5}

ARCHITECTURES: dict[str, dict[str, Any]] = {
    "smollm2-135m": {**_LLAMA, "vocab_size": 49152, "hidden_size": 576,
                     "intermediate_size": 1536, "num_hidden_layers": 30,
                     "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
                     "max_position_embeddings": 8192, "rope_theta": 100000.0,
                     "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2,
                     "torch_dtype": "bfloat16"},
    "llama-3-8b": {**_LLAMA, "vocab_size": 128256, "hidden_size": 4096,
                   "intermediate_size": 14336, "num_hidden_layers": 32,
                   "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
                   "max_position_embeddings": 8192, "rope_theta": 500000.0,
                   "tie_word_embeddings": False, "bos_token_id": 128000,
                   "eos_token_id": 128001, "torch_dtype": "bfloat16"},
}


def write_dummy_model(folder: str | Path, architecture: str, seed: int = 0,
                      std: float = 0.02, **overrides: Any) -> Path:
    """A model folder of ``architecture`` (a key of ``ARCHITECTURES``) with random weights.

    ``overrides`` replace config fields (e.g. ``num_hidden_layers``). Raises ``KeyError`` for
    an unknown architecture, naming the known ones.
    """
    if architecture not in ARCHITECTURES:
        raise KeyError(f"unknown architecture {architecture!r}; known: {sorted(ARCHITECTURES)}")
    path = Path(folder)
    path.mkdir(parents=True, exist_ok=True)
    config = {**ARCHITECTURES[architecture], **overrides}
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (path / DUMMY_FILE).write_text(json.dumps({"seed": seed, "std": std}) + "\n")
    return path


def dummy_settings(model_dir: str | Path) -> dict[str, float] | None:
    """``{"seed", "std"}`` of a random-weight folder, or None for a real checkpoint."""
    path = Path(model_dir) / DUMMY_FILE
    if not path.is_file():
        return None
    raw = json.loads(path.read_text())
    return {"seed": int(raw.get("seed", 0)), "std": float(raw.get("std", 0.02))}


def fill_random(params: list[tuple[str, Any]], seed: int, std: float) -> None:
    """Fill each ``(name, tensor)`` in place: norms around 1, biases and every other weight
    normal with ``std``; drawn on the tensor's own device from ``seed``."""
    import torch

    for index, (name, tensor) in enumerate(params):
        g = torch.Generator(device=tensor.device).manual_seed(seed * 1_000_003 + index)
        if "norm" in name:
            tensor.uniform_(0.8, 1.2, generator=g)
        else:
            tensor.normal_(0.0, std, generator=g)
