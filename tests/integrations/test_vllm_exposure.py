"""A vLLM instance as an engine starts it, facing a client that is not its engine (issue 42):
one real decode-role instance with dualpath's connector (SmolLM2, one vLLM start, about a
minute here; skipped where ``make peers`` has not run).

- It answers ``/v1`` only to the key its engine holds (``VLLM_API_KEY`` in its environment,
  never on its command line), and inherits none of the engine's secrets.
- ``kv_transfer_params`` with a huge ``num_tokens`` (which tripped an ``assert`` in vLLM's
  scheduler and ended the instance) are ignored: that request is computed, with the tokens it
  gets without them, and the instance serves on.
- vLLM refuses our salts (256 characters with ``/``) and takes their digest.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

from dualpath.config import ClusterConfig, EngineConfig, StorageConfig, VllmConfig
from dualpath.integrations.vllm.engines.instance import VllmInstance, launch_plan
from dualpath.integrations.vllm.plan import vllm_salt
from dualpath.transfer.listeners import process_tree
from dualpath.vocab import Role
from tests.integrations.test_vllm_env import peers_python

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

SECRETS = {"DUALPATH_ENGINE_KEY": "engine-secret-0123", "DUALPATH_API_KEY": "api-secret-4567",
           "HF_TOKEN": "hf-secret-89ab"}
PROMPT = [(7 * i + 3) % 2000 + 10 for i in range(70)]
SALT = "tenant/" + "a/b@c\\" * 42  # 259 characters, with what vLLM refuses


@pytest.fixture(scope="module")
def instance(tmp_path_factory, smollm2_dir) -> Iterator[VllmInstance]:
    python = peers_python()
    tmp = tmp_path_factory.mktemp("vllm-exposure")
    config = ClusterConfig(engine=EngineConfig(block_size=32),
                           storage=StorageConfig(root=str(tmp / "store")),
                           vllm=VllmConfig(python=str(python), max_model_len=1024,
                                           extra_args=("--enforce-eager",)))
    plan = launch_plan(smollm2_dir, config, Role.DECODE, "127.0.0.1", "exposure",
                       log_path=tmp / "decode.vllm.log", environ={**os.environ, **SECRETS})
    started = VllmInstance.start(plan, config.vllm)
    yield started
    started.close()


def post(instance: VllmInstance, body: dict, key: str | None) -> requests.Response:
    """POST /v1/completions with ``key`` as the bearer token (None: no header)."""
    headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
    return requests.post(f"{instance.url}/v1/completions", json=body, headers=headers,
                         timeout=300)


def completion(instance: VllmInstance, **extra: object) -> dict:
    """A greedy completion of ``PROMPT``."""
    return {"model": instance.http.model_name(), "prompt": PROMPT, "max_tokens": 6,
            "temperature": 0, "return_token_ids": True, **extra}


def key_of(instance: VllmInstance) -> str:
    """The key the engine's client sends ("" when it sends none)."""
    return instance.http._auth.get("Authorization", "").removeprefix("Bearer ")


def environ_of(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    return dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0")
                if "=" in item)


def test_an_instance_answers_only_its_engines_key_and_inherits_no_secret(instance):
    assert post(instance, completion(instance), None).status_code == 401
    assert post(instance, completion(instance), "not-the-key").status_code == 401
    key = key_of(instance)
    assert len(key) >= 32
    assert post(instance, completion(instance), key).status_code == 200
    assert instance.http.model_name()  # the engine's own client sends the key
    assert instance.proc is not None
    tree = process_tree(instance.proc.pid)
    assert len(tree) >= 2  # the API server and its engine core
    for pid in tree:
        env = environ_of(pid)
        assert not set(SECRETS) & env.keys(), pid
        assert not any(v in SECRETS.values() for v in env.values()), pid
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        assert key not in cmdline
    assert environ_of(instance.proc.pid)["VLLM_API_KEY"] == key


def test_a_huge_num_tokens_is_computed_and_the_instance_serves_on(instance, tmp_path):
    key = key_of(instance)
    want = post(instance, completion(instance), key).json()["choices"][0]["token_ids"]
    pool = Path("/dev/shm" if os.path.isdir("/dev/shm") else "/tmp") / f"dualpath-x-{os.getpid()}"
    pool.write_bytes(bytes(1 << 20))  # a real pool file: only the sizes are wrong
    try:
        huge = {"dualpath": {"role": "decode", "req_id": 1, "shm_path": str(pool),
                             "buffer_offset": 0, "num_blocks": 10**6, "num_tokens": 10**9,
                             "num_stored_blocks": 0}}
        reply = post(instance, completion(instance, kv_transfer_params=huge), key)
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["token_ids"] == want  # computed, as without them
    finally:
        pool.unlink()
    assert instance.alive()
    again = post(instance, completion(instance), key)
    assert again.status_code == 200 and again.json()["choices"][0]["token_ids"] == want


def test_vllm_refuses_our_salts_and_takes_their_digest(instance):
    key = key_of(instance)
    refused = post(instance, completion(instance, cache_salt=SALT), key)
    assert refused.status_code == 400, refused.text
    taken = post(instance, completion(instance, cache_salt=vllm_salt(SALT)), key)
    assert taken.status_code == 200, taken.text
