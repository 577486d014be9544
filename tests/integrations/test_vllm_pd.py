"""A prompt through a prefill and a decode vLLM instance with dualpath's connector (issue 36):
the PD transfer layer by layer into a decode engine's buffer, both read paths, and the order of
the connector's hooks against the transfers.

``vllm_pd.py`` (the peers' python) hosts the decode engine's buffers and runs every case on
one pair of instances: three vLLM starts in all. Skipped where ``make peers`` has not run.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

from tests.integrations.test_vllm_env import ROOT, peers_python

# several vLLM starts in one fixture; serial: the hook order is timed against a capped pull,
# which a busy neighbour on the cores outruns
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900), pytest.mark.serial]

SCRIPT = Path(__file__).with_name("vllm_pd.py")
MAX_TOKENS = 24
HIT_BLOCKS = 3  # of the prompt's 32-token blocks, stored by the first PD run's decode side
# NIC emulation (64 KiB chunks, a burst of one): a layer's pull outlasts its attention
RECV_CAP_MB_S = 4.0
MESSAGES = [{"role": "system", "content": "You are a careful assistant for a storage "
             "engineering team. Answer in plain words, name the component you mean, and keep "
             "every answer short. The team runs a cluster of prefill and decode nodes that share "
             "a disaggregated KV-cache store. Each node has a storage NIC and a compute NIC; the "
             "decode nodes read cached blocks for the prefill nodes when their own storage NICs "
             "are busy. Questions are about reading, writing and verifying cached blocks, about "
             "checksums, and about what the engines do when a block is missing or damaged."},
            {"role": "user", "content": "How do we verify a stored KV block before a prefill "
             "engine uses it, and what happens when the checksum fails?"}]


def run_pd(tmp: Path, *args: str) -> tuple[dict, str]:
    """Run ``vllm_pd.py``: its results by run, and its log."""
    out = tmp / "runs.json"
    cmd = [str(peers_python()), str(SCRIPT), "--model", json.loads((tmp / "model.json")
           .read_text()), "--prompt", str(tmp / "prompt.json"), "--store", str(tmp / "store"),
           "--max-tokens", str(MAX_TOKENS), "--out", str(out), *args]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=900)  # lines in order
    (tmp / "pd.log").write_text(done.stdout)
    assert done.returncode == 0, done.stdout[-3000:]
    return json.loads(out.read_text()), done.stdout


def run_logs(log: str) -> dict[str, str]:
    """Each run's lines: from its ``=== run NAME`` line to the next."""
    parts = re.split(r"^=== run (\w+)$", log, flags=re.M)
    return dict(zip(parts[1::2], parts[2::2], strict=True))


@pytest.fixture(scope="module")
def runs(tmp_path_factory, smollm2_dir):
    peers_python()  # skip before preparing anything
    from tokenizers import Tokenizer as FastTokenizer

    from dualpath.model.tokenizer import Tokenizer

    tmp = tmp_path_factory.mktemp("vllm-pd")
    (tmp / "model.json").write_text(json.dumps(str(smollm2_dir)))
    text = Tokenizer(smollm2_dir).render_chat(MESSAGES)
    fast = FastTokenizer.from_file(str(smollm2_dir / "tokenizer.json"))
    prompt = fast.encode(text, add_special_tokens=False).ids
    (tmp / "prompt.json").write_text(json.dumps(prompt))
    trace = tmp / "trace.jsonl"
    # one process, three vLLM starts: plain, then miss, pe and de on one PD pair whose prefill
    # side's receive is capped (only the DE path's pulls use it)
    results, log = run_pd(tmp, "--runs", "plain,miss,pe,de", "--hit-blocks",
                             str(HIT_BLOCKS), "--trace", str(trace), "--recv-cap-mb-s",
                             str(RECV_CAP_MB_S))
    results["prompt"] = prompt
    results["trace"] = [json.loads(line) for line in trace.read_text().splitlines()]
    results["logs"] = run_logs(log)
    return results


def test_the_prompt_spans_the_hit_and_more(runs):
    assert len(runs["prompt"]) > (HIT_BLOCKS + 1) * 32
    assert len(runs["plain"]["output"]) > 8  # a real answer, not an immediate stop


@pytest.mark.parametrize("name", ["miss", "pe", "de"])
def test_pd_greedy_tokens_equal_plain_vllm(runs, name):
    """Prefill on one instance, KV pushed layer by layer into the buffer, sealed, copied into
    the decode instance: the same greedy tokens as one plain vLLM instance."""
    assert runs[name]["sealed"]
    assert runs[name]["output"] == runs["plain"]["output"]


def test_the_hit_is_loaded_on_each_path(runs):
    logs = runs["logs"]
    assert "saved" in logs["miss"]  # the decode side persisted the prompt's full blocks
    assert f"loaded {HIT_BLOCKS} blocks" in logs["pe"]  # PE path: from the store
    assert f"pulled {HIT_BLOCKS}, pushed" in logs["de"]  # DE path: from the decode's buffer
    assert "pulled 0, pushed" in logs["pe"]


def layer_times(steps: list) -> dict[str, dict[int, float]]:
    """The prefill step's trace as event -> layer -> time (the step that pulled)."""
    step = next(s for s in steps if any(e == "pull-queued" for _, e, _ in s))
    times: dict[str, dict[int, float]] = {}
    for t, event, layer in step:
        times.setdefault(event, {}).setdefault(layer, t)
    return times


def check_hook_order(times: dict[str, dict[int, float]]) -> list[str]:
    """What breaks the layerwise order: layer i's pull landed before its attention, layer
    i+1's pull in flight during it, layer i's push queued before layer i+1's attention."""
    wrong = []
    attention, landed = times["attention"], times["pull-landed"]
    layers = sorted(attention)
    for i in layers:
        if landed[i] > attention[i]:
            wrong.append(f"layer {i}: attention before its pull landed")
    for i in layers[:-1]:
        if not (times["pull-queued"][i + 1] < times["computed"][i] and
                landed[i + 1] > times["wait"][i]):
            wrong.append(f"layer {i + 1}: its pull was not in flight during layer {i}")
        if not times["push-queued"][i] < attention[i + 1]:
            wrong.append(f"layer {i}: its push left after layer {i + 1}'s attention")
    return wrong


def test_hook_order_layer_by_layer(runs):
    """On the DE path with the prefill's receive side capped, each layer waits for its own
    pull only, the next layer's pull runs while it computes, and its KV leaves at once."""
    times = layer_times(runs["trace"])
    assert len(times["attention"]) == 30
    assert check_hook_order(times) == []


def test_the_hook_order_check_fails_on_a_basic_order():
    """The check itself: a trace where everything loads before the forward and everything is
    pushed after it (basic mode) breaks it."""
    times: dict[str, dict[int, float]] = {k: {} for k in (
        "pull-queued", "pull-landed", "wait", "attention", "computed", "push-queued")}
    for i in range(4):
        times["pull-queued"][i], times["pull-landed"][i] = 0.0, 1.0
        times["wait"][i], times["attention"][i], times["computed"][i] = 2 + i, 2 + i, 2.5 + i
        times["push-queued"][i] = 10.0
    wrong = check_hook_order(times)
    assert any("not in flight" in w for w in wrong)
    assert any("push left after" in w for w in wrong)
