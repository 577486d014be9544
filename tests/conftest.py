"""Shared fixtures: tiny random HF checkpoints (Llama, Qwen2, Mistral) and the default model."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

torch.set_num_threads(1)


def _save_tiny(folder: Path, config, seed: int) -> Path:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".bias"):  # HF initializes biases to zero: make them matter
                param.normal_(0.0, 0.5)
            elif "norm" in name:
                param.uniform_(0.5, 1.5)
    model.save_pretrained(folder)
    return folder


TINY = dict(vocab_size=300, hidden_size=64, intermediate_size=160, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
            rms_norm_eps=1e-5, eos_token_id=299)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    from transformers import LlamaConfig

    cfg = LlamaConfig(**TINY, rope_theta=10000.0, tie_word_embeddings=False)
    return _save_tiny(tmp_path_factory.mktemp("tiny-llama"), cfg, seed=1)


@pytest.fixture(scope="session")
def tiny_llama3_rope_dir(tmp_path_factory) -> Path:
    from transformers import LlamaConfig

    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64}
    cfg = LlamaConfig(**TINY, rope_parameters=rope, tie_word_embeddings=True)
    return _save_tiny(tmp_path_factory.mktemp("tiny-llama3"), cfg, seed=2)


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory) -> Path:
    from transformers import Qwen2Config

    cfg = Qwen2Config(**TINY, rope_theta=1000000.0, tie_word_embeddings=True,
                      use_sliding_window=False)
    return _save_tiny(tmp_path_factory.mktemp("tiny-qwen2"), cfg, seed=3)


@pytest.fixture(scope="session")
def tiny_mistral_dir(tmp_path_factory) -> Path:
    from transformers import MistralConfig

    cfg = MistralConfig(**TINY, rope_theta=10000.0, sliding_window=24)
    return _save_tiny(tmp_path_factory.mktemp("tiny-mistral"), cfg, seed=4)


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The converted default model (``make test`` prepares it before the suite runs)."""
    from dualpath.model.default_model import ensure_default_model

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    return ensure_default_model(verbose=False)


def pytest_collection_modifyitems(config, items):
    """Tests marked ``gpu`` skip cleanly on machines without CUDA."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_chaotic_dir(tmp_path_factory) -> Path:
    """A tiny Llama with large weights, so greedy text varies (a KV mistake shows)."""
    from transformers import LlamaConfig

    cfg = LlamaConfig(**TINY, rope_theta=10000.0, initializer_range=0.3)
    return _save_tiny(tmp_path_factory.mktemp("tiny-chaotic"), cfg, seed=6)


@pytest.fixture(scope="session")
def tiny_long_dir(tmp_path_factory) -> Path:
    """Like ``tiny_chaotic_dir`` with 8,192 positions, for requests that must stay decoding
    while a test acts on them (900 tokens of the 1,024-position model took 0.45 s)."""
    from transformers import LlamaConfig

    cfg = LlamaConfig(**{**TINY, "max_position_embeddings": 8192}, rope_theta=10000.0,
                      initializer_range=0.3)
    return _save_tiny(tmp_path_factory.mktemp("tiny-long"), cfg, seed=6)


@pytest.fixture(scope="session")
def tiny_deep_dir(tmp_path_factory) -> Path:
    """Like ``tiny_chaotic_dir`` with 6 layers, so a 2-layer window is reused three times."""
    from transformers import LlamaConfig

    cfg = LlamaConfig(**{**TINY, "num_hidden_layers": 6}, rope_theta=10000.0,
                      initializer_range=0.3)
    return _save_tiny(tmp_path_factory.mktemp("tiny-deep"), cfg, seed=7)


# The real traces are found only through DUALPATH_TRACES_DIR
# (dualpath.workloads.trace_files.trace_dir);
# point it at <repo>/../shared/traces, where this dev checkout and CI keep them, unless the
# caller chose a folder. It is set even when that folder is absent, so that modules calling
# trace_dir() at import still load and the tests needing the traces skip on the missing folder.
os.environ.setdefault("DUALPATH_TRACES_DIR",
                      str(Path(__file__).resolve().parents[2] / "shared" / "traces"))


@pytest.fixture(scope="session")
def tiny_with_tokenizer(tiny_llama_dir, smollm2_dir, tmp_path_factory) -> Path:
    """The tiny Llama with the default model's tokenizer beside it (``dualpath serve`` needs
    one to start; token ids below the tiny vocabulary decode like any others)."""
    import shutil

    folder = tmp_path_factory.mktemp("tiny-tok")
    shutil.copytree(tiny_llama_dir, folder, dirs_exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smollm2_dir / name, folder / name)
    return folder
