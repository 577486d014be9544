"""Pure model specification derived from a Hugging Face ``config.json``.

No torch here: the storage layout, the scheduler and the simulator size things from a
``ModelSpec`` without loading any weights.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dualpath.errors import ModelSpecError
from dualpath.model.fingerprint import weight_digests, weight_files

SUPPORTED_ARCHITECTURES = {"llama", "qwen2", "mistral"}
SUPPORTED_ROPE_TYPES = {"default", "linear", "llama3"}
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class RopeSpec:
    """Rotary embedding parameters (theta and optional scaling)."""

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192


@dataclass(frozen=True)
class ModelSpec:
    """Sizes and options of one decoder-only model of the Llama family."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position: int
    rope: RopeSpec = field(default_factory=RopeSpec)
    qkv_bias: bool = False
    o_bias: bool = False
    tie_word_embeddings: bool = False
    sliding_window: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str = "bfloat16"

    def kv_bytes_per_token_per_layer(self, kv_dtype: str) -> int:
        """Bytes of K and V together for one token of one layer."""
        return 2 * self.num_kv_heads * self.head_dim * DTYPE_BYTES[kv_dtype]

    def kv_bytes_per_token(self, kv_dtype: str) -> int:
        """Bytes of K and V of all layers for one token."""
        return self.num_layers * self.kv_bytes_per_token_per_layer(kv_dtype)


def _rope_from_config(cfg: dict[str, Any]) -> RopeSpec:
    params = dict(cfg.get("rope_parameters") or {})
    scaling = cfg.get("rope_scaling") or {}
    params = {**scaling, **params}
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelSpecError(f"unsupported rope scaling type {rope_type!r}")
    return RopeSpec(
        theta=theta,
        rope_type=rope_type,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position=int(params.get("original_max_position_embeddings", 8192)),
    )


def _eos_ids(cfg: dict[str, Any]) -> tuple[int, ...]:
    eos = cfg.get("eos_token_id")
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (int(eos),)


def _sliding_window(cfg: dict[str, Any]) -> int | None:
    """Mistral honours ``sliding_window``; Qwen2 only with ``use_sliding_window`` (default off)."""
    window = cfg.get("sliding_window")
    if cfg.get("model_type") == "qwen2":
        if cfg.get("use_sliding_window", False):
            raise ModelSpecError("qwen2 use_sliding_window=true (per-layer windows) is "
                                 "not supported")
        return None
    if window is None or cfg.get("use_sliding_window") is False:
        return None
    return int(window)


def spec_from_config(cfg: dict[str, Any]) -> ModelSpec:
    """Build a ``ModelSpec`` from a parsed HF config dict; raise ``ModelSpecError`` if unusable."""
    model_type = cfg.get("model_type")
    if model_type not in SUPPORTED_ARCHITECTURES:
        raise ModelSpecError(
            f"model_type {model_type!r} is not supported (supported: "
            f"{sorted(SUPPORTED_ARCHITECTURES)})"
        )
    try:
        hidden = int(cfg["hidden_size"])
        heads = int(cfg["num_attention_heads"])
        spec = ModelSpec(
            model_type=model_type,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            max_position=int(cfg.get("max_position_embeddings", 4096)),
            rope=_rope_from_config(cfg),
            qkv_bias=model_type == "qwen2" or bool(cfg.get("attention_bias", False)),
            o_bias=model_type != "qwen2" and bool(cfg.get("attention_bias", False)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            sliding_window=_sliding_window(cfg),
            eos_token_ids=_eos_ids(cfg),
            torch_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"),
        )
    except KeyError as exc:
        raise ModelSpecError(f"config.json lacks the field {exc.args[0]!r}") from exc
    if "head_dim" not in cfg and hidden % heads:
        raise ModelSpecError("hidden_size is not a multiple of num_attention_heads")
    if cfg.get("mlp_bias"):
        raise ModelSpecError("mlp_bias=true is not supported")
    if spec.num_heads % spec.num_kv_heads:
        raise ModelSpecError("num_attention_heads must be a multiple of num_key_value_heads")
    return spec


def load_spec(model_dir: str | Path) -> ModelSpec:
    """Read ``config.json`` from a model folder into a ``ModelSpec``."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ModelSpecError(f"{path} does not exist")
    return spec_from_config(json.loads(path.read_text()))


def model_id(model_dir: str | Path) -> str:
    """A storage-safe id of a checkpoint: folder name plus a fingerprint of config and weights.

    The fingerprint covers ``config.json`` and every byte of every weight file (by name and
    full-content digest), so two checkpoints of one architecture that differ anywhere (say, a
    base model and its fine-tune) never share KV-cache keys. The weight digests come from
    ``fingerprint.weight_digests``, which caches them by file identity: the default model's
    269 MB take 0.4-0.8 s to hash on first use, under a millisecond afterwards.
    """
    folder = Path(model_dir)
    digest = hashlib.blake2b(digest_size=6)
    digest.update((folder / "config.json").read_bytes())
    files = weight_files(folder)
    for path, content in zip(files, weight_digests(files), strict=True):
        digest.update(f"{path.name}:{content}".encode())
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", folder.name).strip("-.")[:48] or "model"
    return f"{name}-{digest.hexdigest()}"


def resolve_dtype(requested: str, spec: ModelSpec) -> str:
    """Compute dtype: ``auto`` is the checkpoint's when it is a half type, else float32."""
    if requested != "auto":
        if requested not in DTYPE_BYTES:
            raise ValueError(f"unsupported dtype {requested!r} (auto, {', '.join(DTYPE_BYTES)})")
        return requested
    return spec.torch_dtype if spec.torch_dtype in ("bfloat16", "float16") else "float32"


def resolve_kv_dtype(requested: str, compute_dtype: str) -> str:
    """KV-cache dtype: ``auto`` follows the compute dtype."""
    if requested == "auto":
        return compute_dtype
    if requested not in DTYPE_BYTES:
        raise ValueError(f"unsupported kv dtype {requested!r}")
    return requested
