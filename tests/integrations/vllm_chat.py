"""Greedy chat turns through vLLM's offline ``LLM`` (run by the peers' python, not by pytest).

``--user A --user B`` runs the turns in one process; ``--history FILE`` continues a chat that
an earlier process wrote (``--out``), so with ``--store`` turn 2's hit can come only from the
store. ``--long-tokens N`` also runs the first turn's prompt for ``N`` tokens, EOS ignored
(the reference of a long stream). Prints nothing of interest; writes ``{"turns": [{"prompt":
ids, "output": ids}, ...], "long": {"prompt": ids, "output": ids}}``.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

BLOCK_SIZE = 32  # vLLM CPU's kernel unit; small, so short prompts span several blocks
SYSTEM = ("You are a careful assistant for a storage engineering team. Answer in plain words, "
          "name the component you mean, and keep every answer short. The team runs a cluster "
          "of prefill and decode nodes that share a disaggregated KV-cache store; questions "
          "are about reading, writing and verifying cached blocks.")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--user", action="append", required=True)
    parser.add_argument("--history", type=Path)
    parser.add_argument("--store", help="store root: run with dualpath's connector")
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--long-tokens", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()

    # One process: the engine core and its worker inside this one (vLLM's in-process core and
    # "uni" executor), not three processes each importing torch and vLLM (12 s a run, not 34).
    # The connector's scheduler and worker sides still talk only through its metadata; the
    # serve tests run vLLM's default multi-process layout.
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    extra: dict = {}
    if args.store:
        from dualpath.integrations.vllm.setup import transfer_config

        extra["kv_transfer_config"] = transfer_config(args.store)
    llm = LLM(model=args.model, dtype="bfloat16", enforce_eager=True, max_model_len=1024,
              block_size=BLOCK_SIZE, enable_prefix_caching=False, seed=0,
              kv_cache_memory_bytes=1 << 30,  # not 92% of the memory: peers run beside
              distributed_executor_backend="uni", **extra)
    tokenizer = llm.get_tokenizer()
    turns = json.loads(args.history.read_text())["turns"] if args.history else []
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    for message in args.user:
        if turns:
            last = turns[-1]
            tail = [] if last["output"][-1:] == [tokenizer.eos_token_id] else ["<|im_end|>"]
            text = "".join(tail) + f"\n<|im_start|>user\n{message}<|im_end|>\n" \
                "<|im_start|>assistant\n"
            prompt = last["prompt"] + last["output"] + tokenizer.encode(
                text, add_special_tokens=False)
        else:
            text = tokenizer.apply_chat_template(
                [{"role": "system", "content": SYSTEM}, {"role": "user", "content": message}],
                add_generation_prompt=True, tokenize=False)
            prompt = tokenizer.encode(text, add_special_tokens=False)
        out = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params)[0]
        turns.append({"prompt": prompt, "output": list(out.outputs[0].token_ids)})
    result: dict = {"turns": turns}
    if args.long_tokens:
        long_params = SamplingParams(temperature=0.0, max_tokens=args.long_tokens,
                                     ignore_eos=True)
        prompt = turns[0]["prompt"]
        out = llm.generate([TokensPrompt(prompt_token_ids=prompt)], long_params)[0]
        result["long"] = {"prompt": prompt, "output": list(out.outputs[0].token_ids)}
    args.out.write_text(json.dumps(result))


if __name__ == "__main__":
    main()
