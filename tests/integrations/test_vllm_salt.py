"""``dualpath serve --engine vllm`` (1 prefill + 1 decode vLLM instance) with a ``cache_salt``
vLLM itself refuses (256 characters, with ``/``; issue 42), and what a stranger on this machine
sees of the cluster's listeners. Two vLLM starts, a few minutes here; skipped where ``make
peers`` has not run.

Checked: the salted request gets the unsalted request's tokens; the blocks the decode instance
stored under the salt are the router's hit for the same salt next time (the connector's keys
and ours agree) and not for another salt; ``ss -ltnp`` shows no listener of the serve process,
its engines or their vLLM instances on a wildcard address that a fence does not cover.
"""

from __future__ import annotations

import subprocess

import pytest
import requests

from dualpath.transfer.firewall import fence_unavailable, fenced_ports
from dualpath.transfer.listeners import listeners, process_tree
from tests.integrations.test_vllm_env import peers_python
from tests.integrations.test_vllm_serve import serve_vllm

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

BLOCK_SIZE = 32
SALT = "tenant/" + "x/y" * 83  # 256 characters, with "/"
PROMPT = [(11 * i + 5) % 3000 + 20 for i in range(100)]  # 3 full blocks and a partial one


def complete(url: str, salt: str | None) -> dict:
    body = {"model": "SmolLM2-135M-Instruct", "prompt": PROMPT, "max_tokens": 8,
            "temperature": 0, "return_token_ids": True}
    if salt is not None:
        body["cache_salt"] = salt
    reply = requests.post(f"{url}/v1/completions", json=body, timeout=300)
    assert reply.status_code == 200, reply.text
    return reply.json()


def cached(reply: dict) -> int:
    return reply["usage"]["prompt_tokens_details"]["cached_tokens"]


def serve_pid(url: str) -> int:
    """The process listening on ``url``'s port."""
    port = url.rsplit(":", 1)[1]
    out = subprocess.run(["ss", "-ltnpH", f"sport = :{port}"], capture_output=True, text=True,
                         check=True).stdout
    return int(out.split("pid=", 1)[1].split(",", 1)[0])


def test_a_salt_vllm_refuses_works_and_hits_only_itself(tmp_path, smollm2_dir):
    peers_python()
    with serve_vllm(tmp_path, smollm2_dir, 1, 1, f"engine.block_size={BLOCK_SIZE}",
                    "vllm.max_model_len=1024") as served:
        url = served["url"]
        plain = complete(url, None)
        first = complete(url, SALT)
        second = complete(url, SALT)
        other = complete(url, SALT[:-1] + "z")
        tree = process_tree(serve_pid(url))
        opened = [item for item in listeners(tree) if item.wildcard]
        fences = fenced_ports()
    want = plain["choices"][0]["text"]
    assert [r["choices"][0]["text"] for r in (first, second, other)] == [want] * 3
    assert cached(first) == 0  # the salt's first request: nothing stored under it yet
    assert cached(second) >= 2 * BLOCK_SIZE  # what the decode instance stored, keyed on SALT
    assert cached(other) == 0  # another salt: another key space
    assert len(tree) >= 6  # serve, two engines, their instances and the instances' children
    assert opened, "Mooncake listens on every interface"
    if fence_unavailable() is None:
        covered = {port for ports in fences.values() for port in ports}
        assert {item.port for item in opened} <= covered, (opened, fences)
