"""``dualpath serve --engine vllm`` under faults: a prefill instance still pushing a request
the cluster gave up on — the client aborted it, or the prefill engine's call timed out — never
writes into the DE buffer of the request that takes the room next (write fences); a prefill
instance that dies mid-prefill has its request re-placed on the other prefill engine (issue 36),
with the answer the cluster gave before the fault.

One cluster of two prefill and one decode vLLM instance (about a minute to start here), whose
decode engine's pool holds one 17-block buffer at a time and whose compute NICs are capped (NIC
emulation), so a 17-block prompt's pushes and pulls take seconds. For the fences, request B (DE
read path: its hit is read into the buffer, then pulled from it) waits for the room request A's
buffer holds, and A is given up on while its instance pushes: before fences the prefill engine
answered at once, B's hit was read into A's old buffer and A's late pushes overwrote it.
Skipped where ``make peers`` has not run. The module's last test kills an instance.
"""

from __future__ import annotations

import os
import signal
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
B_PROMPT = [(11 * i) % 40_000 + 100 for i in range(1_090)]  # 17 blocks and a tail
TIMEOUT_S = 14  # the prefill engines' call timeout (a 17-block prefill moves for ~6 s)


def a_prompt(seed: int) -> list[int]:
    return [(13 * i + 977 * seed) % 40_000 + 100 for i in range(1_080)]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, smollm2_dir):
    peers_python()  # skip before starting anything
    tmp = tmp_path_factory.mktemp("vllm-faults")
    # a 17-block prompt's pushes or pulls (25 MB over 30 layers) take about 6 s
    with serve_vllm(tmp, smollm2_dir, 2, 1, "vllm.max_model_len=2048",
                    f"vllm.request_timeout_s={TIMEOUT_S}", "host_pool_blocks=20",
                    "save_staging_blocks=2", "traffic.compute_send_cap_mb_s=4",
                    "traffic.compute_recv_cap_mb_s=4", "traffic.chunk_bytes=65536",
                    "traffic.burst_chunks=1", "traffic.grant_timeout_s=120") as served:
        yield served


def complete(cluster: dict, prompt: list[int], read_path: str = "auto") -> dict:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 12, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True, "dualpath": {"read_path": read_path}}
    reply = requests.post(f"{cluster['url']}/v1/completions", json=body, timeout=400)
    assert reply.status_code == 200, reply.text
    return reply.json()


def tokens(reply: dict) -> list[int]:
    return reply["choices"][0]["token_ids"]


def calls_in_flight(url: str) -> bool:
    """True while a client holds a connection to the instance: the prefill engine opens one
    per call, and this test polls nothing else on it."""
    port = url.rsplit(":", 1)[1]
    out = subprocess.run(["ss", "-Htn", "state", "established", f"( dport = :{port} )"],
                         capture_output=True, text=True).stdout
    return bool(out.strip())


def busy_instance(prefills: list[str], hold_s: float) -> str:
    """The prefill instance holding a connection on every poll for ``hold_s``: the call under
    way, not a short ``/metrics`` or ``/health`` call that happened to be open at one poll."""
    deadline = time.monotonic() + 60
    since: dict[str, float] = {}
    while time.monotonic() < deadline:
        now = time.monotonic()
        for url in prefills:
            if not calls_in_flight(url):
                since.pop(url, None)
            elif now - since.setdefault(url, now) >= hold_s:
                return url
        time.sleep(0.1)
    raise AssertionError("no prefill instance ran the request")


def pushing_instance(cluster: dict) -> str:
    """The prefill instance the request under way is on, a few seconds into its step."""
    prefills = [url for role, url, _ in vllm_instances(cluster) if role == "prefill"]
    return busy_instance(prefills, 2.0)  # its step is pushing layer by layer by now


def instance_group(url: str) -> int:
    """The process group of the instance serving ``url`` (its API server and engine core)."""
    port = url.rsplit(":", 1)[1]
    pids = subprocess.run(["pgrep", "-f", f"api_server.*--port {port} "],
                          capture_output=True, text=True).stdout.split()
    assert pids
    return os.getpgid(int(pids[0]))


def in_background(target) -> tuple[threading.Thread, dict]:
    result: dict = {}
    thread = threading.Thread(target=lambda: result.update(reply=target()), daemon=True)
    thread.start()
    return thread, result


def fenced_buffers(cluster: dict) -> float:
    text = requests.get(f"{cluster['url']}/metrics", timeout=30).text
    line = next(x for x in text.splitlines() if x.startswith("dualpath:router_fenced_buffers "))
    return float(line.split()[1])


@pytest.fixture(scope="module")
def b_reference(cluster) -> list[int]:
    """B's tokens on the fault-free cluster (its blocks are stored: B's later runs hit them)."""
    return tokens(complete(cluster, B_PROMPT))


def test_an_aborted_request_still_pushing_writes_into_no_other_buffer(cluster, b_reference):
    body = {"model": MODEL, "prompt": a_prompt(1), "max_tokens": 12, "temperature": 0,
            "stream": True}
    with requests.post(f"{cluster['url']}/v1/completions", json=body, timeout=400,
                       stream=True) as a:
        assert a.status_code == 200
        pushing_instance(cluster)
        b_thread, b = in_background(lambda: complete(cluster, B_PROMPT, "de"))
        time.sleep(1.0)  # B waits for the DE's room
    # the client went away: A is aborted while its instance pushes
    b_thread.join(400)
    assert tokens(b["reply"]) == b_reference
    assert b["reply"]["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert fenced_buffers(cluster) == 0


def test_a_timed_out_call_still_pushing_writes_into_no_other_buffer(cluster, b_reference):
    a_thread, a = in_background(lambda: complete(cluster, a_prompt(2)))
    group = instance_group(pushing_instance(cluster))
    os.killpg(group, signal.SIGSTOP)  # the instance hangs mid-step: A's call times out
    try:
        b_thread, b = in_background(lambda: complete(cluster, B_PROMPT, "de"))
        time.sleep(TIMEOUT_S + 2)
    finally:
        os.killpg(group, signal.SIGCONT)  # its step goes on pushing A
    b_thread.join(400)
    a_thread.join(400)
    assert tokens(b["reply"]) == b_reference
    assert len(tokens(a["reply"])) == 12  # A, placed again, is served too
    assert fenced_buffers(cluster) == 0


def test_prefill_instance_killed_mid_prefill_is_re_placed(cluster):
    first = complete(cluster, PROMPT, "pe")  # stores its blocks: the next request hits them
    reference = first["choices"][0]["text"]
    logs = {url: log for role, url, log in vllm_instances(cluster) if role == "prefill"}
    prefills = list(logs)
    assert len(prefills) == 2
    seen = {url: len(log.read_text()) for url, log in logs.items()}  # earlier tests' lines
    result: dict = {}
    call = threading.Thread(target=lambda: result.update(reply=complete(cluster, PROMPT, "de")))
    call.start()
    killed = busy_instance(prefills, 1.0)  # a few layers in
    kill_instance(killed)
    call.join(240)
    assert not call.is_alive(), "the request hung after its prefill instance died"
    # the killed instance never finished the prefill step: it pulled, pushed and sealed nothing
    other = next(url for url in prefills if url != killed)
    assert "pulled 17" not in logs[killed].read_text()[seen[killed]:]
    assert "pulled 17" in logs[other].read_text()[seen[other]:]
    reply = result["reply"]
    assert reply["choices"][0]["text"] == reference  # re-placed, the same greedy tokens
    assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert requests.get(f"{other}/health", timeout=5).status_code == 200
