"""``dualpath serve --engine vllm`` when a prefill instance dies mid-prefill (issue 36): the
router re-places the request on the other prefill engine, as in our own cluster, and the answer
is the one the cluster gave before the fault.

Two prefill and one decode vLLM instance (about a minute to start here). The prefill is made
long on purpose: the request reads its hit on the DE path and the prefill engines' compute-NIC
receive side is capped (NIC emulation), so every layer's pull takes a while. Skipped where
``make peers`` has not run.
"""

from __future__ import annotations

import subprocess
import threading
import time

import pytest
import requests

from tests.integrations.test_vllm_env import peers_python
from tests.integrations.test_vllm_serve import kill_instance, serve_vllm, vllm_instances

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

MODEL = "SmolLM2-135M-Instruct"
PROMPT = [(7 * i) % 40_000 + 100 for i in range(1_100)]  # 17 blocks of 64 tokens and a tail


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, smollm2_dir):
    peers_python()  # skip before starting anything
    tmp = tmp_path_factory.mktemp("vllm-faults")
    # the 17-block hit's pulls (25 MB over 30 layers) take seconds
    with serve_vllm(tmp, smollm2_dir, 2, 1, "vllm.max_model_len=2048",
                    "traffic.compute_recv_cap_mb_s=0.5", "traffic.chunk_bytes=65536",
                    "traffic.burst_chunks=1") as served:
        yield served


def complete(cluster: dict, read_path: str) -> dict:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 12, "temperature": 0,
            "ignore_eos": True, "dualpath": {"read_path": read_path}}
    reply = requests.post(f"{cluster['url']}/v1/completions", json=body, timeout=300)
    assert reply.status_code == 200, reply.text
    return reply.json()


def calls_in_flight(url: str) -> bool:
    """True while a client holds a connection to the instance: the prefill engine opens one
    per call, and this test polls nothing else on it."""
    port = url.rsplit(":", 1)[1]
    out = subprocess.run(["ss", "-Htn", "state", "established", f"( dport = :{port} )"],
                         capture_output=True, text=True).stdout
    return bool(out.strip())


def test_prefill_instance_killed_mid_prefill_is_re_placed(cluster):
    first = complete(cluster, "pe")  # stores the prompt's blocks: the next request hits them
    reference = first["choices"][0]["text"]
    logs = {url: log for role, url, log in vllm_instances(cluster) if role == "prefill"}
    prefills = list(logs)
    assert len(prefills) == 2
    result: dict = {}
    call = threading.Thread(target=lambda: result.update(reply=complete(cluster, "de")))
    started = time.monotonic()
    call.start()
    killed = None
    while killed is None and time.monotonic() - started < 30:  # the slow prefill is running
        killed = next((url for url in prefills if calls_in_flight(url)), None)
        time.sleep(0.1)
    assert killed is not None, "no prefill instance ran the request"
    time.sleep(1.0)  # a few layers in (vLLM's own gauges move only between steps)
    assert calls_in_flight(killed), "the prefill ended before the fault"
    kill_instance(killed)
    call.join(240)
    assert not call.is_alive(), "the request hung after its prefill instance died"
    # the killed instance never finished the prefill step: it pulled, pushed and sealed nothing
    assert "pulled 17" not in logs[killed].read_text()
    assert "pulled 17" in logs[next(url for url in prefills if url != killed)].read_text()
    reply = result["reply"]
    assert reply["choices"][0]["text"] == reference  # re-placed, the same greedy tokens
    assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    other = next(url for url in prefills if url != killed)
    assert requests.get(f"{other}/health", timeout=5).status_code == 200
