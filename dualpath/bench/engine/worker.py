"""The processes of ``dualpath bench engine`` for dualpath and ``transformers``.

``python -m dualpath.bench.engine.worker dualpath|transformers --spec S --out O`` builds the
system on the spec's model, dtype and thread count and runs ``engine_method``'s measurement.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from dualpath.bench.engine.method import Generate, run_system


def dualpath_system(spec: dict[str, Any]) -> tuple[Generate, dict[str, Any]]:
    """Our ``LLMEngine`` as configured (``--set`` included; no prefix caching: every repeat
    computes its prompt)."""
    from dualpath.config import EngineConfig
    from dualpath.engine.llm_engine import LLMEngine
    from dualpath.request import SamplingParams

    batches = spec["decode_prompts"]
    longest = max(len(spec["prefill_prompt"]), *(len(p[0]) for p in batches.values()))
    config = EngineConfig(**{**spec["engine"], "enable_prefix_caching": False,
                             "max_num_batched_tokens": max(512, longest),
                             "max_num_seqs": max(64, *map(int, batches))})
    engine = LLMEngine(spec["model"], config)

    def generate(prompts: list[list[int]], new_tokens: int) -> None:
        outs = engine.generate(prompts, SamplingParams(max_tokens=new_tokens, ignore_eos=True))
        assert all(len(o.output_ids) == new_tokens for o in outs)

    model = engine.runner.model
    return generate, {"dtype": engine.dtype, "threads": torch.get_num_threads(),
                      "fast_path": model.kernels is not None,
                      "weights_mb": model.weight_bytes() / 2**20,
                      "cores": "one torch thread; the engine's step loop runs on it too"}


def _transformers_model(model_dir: str, dtype: torch.dtype, device: torch.device) -> Any:
    """The HF model of ``model_dir`` on ``device``: its checkpoint, or for a random-weight
    folder (``model/dummy.py``) HF's own random initialization of that config."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from dualpath.model.dummy import dummy_settings

    if dummy_settings(model_dir) is None:
        return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device)
    config = AutoConfig.from_pretrained(model_dir)
    with device:
        return AutoModelForCausalLM.from_config(config, dtype=dtype)


def transformers_system(spec: dict[str, Any]) -> tuple[Generate, dict[str, Any]]:
    """``transformers`` ``generate``, greedy, exactly N tokens (EOS never stops it), on the
    device our engine runs on (``--set device=...``)."""
    import transformers

    torch.set_num_threads(spec["threads"])
    device = torch.device(spec.get("engine", {}).get("device", "cpu"))
    model = _transformers_model(spec["model"], getattr(torch, spec["dtype"]), device).eval()
    model.generation_config.eos_token_id = None

    @torch.inference_mode()
    def generate(prompts: list[list[int]], new_tokens: int) -> None:
        ids = torch.tensor(prompts, device=device)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0)
        if device.type == "cuda":  # the timer stops when the tokens exist, not when queued
            torch.cuda.synchronize(device)
        assert out.shape[1] == ids.shape[1] + new_tokens

    return generate, {"dtype": spec["dtype"], "threads": torch.get_num_threads(),
                      "version": transformers.__version__, "device": str(device),
                      "cores": "one torch thread; generate's loop runs on it too"}


SYSTEMS = {"dualpath": dualpath_system, "transformers": transformers_system}


def main(argv: list[str] | None = None) -> int:
    """``engine_worker SYSTEM --spec S --out O``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in SYSTEMS:
        sys.exit(f"usage: engine_worker {{{','.join(SYSTEMS)}}} --spec S --out O")
    return run_system(argv[0], SYSTEMS[argv[0]], argv[1:])


if __name__ == "__main__":
    sys.exit(main())
