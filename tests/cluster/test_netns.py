"""Several hosts on one machine: ``dualpath serve`` and its engines in their own network namespaces.

A router host and three engine hosts (1 PE + 2 DE), each a namespace with one veth link to a
bridge; the store is a shared folder. The router serves with ``--launcher none`` and the
engines join it from their hosts with ``dualpath engine --router tcp://HOST:PORT`` (their config
comes from the router). Checked: greedy tokens across hosts equal the single-process engine's,
with hits from turn 2; cutting a decode host's link loses that engine (heartbeat), every
request still gets an answer (right tokens or a clear error: none is lost) and the cluster
serves on; restoring the link lets the engine rejoin and serve again. Needs root (skipped
cleanly otherwise), as CI runs.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx2 as httpx
import pytest
from multiturn import make_conversations, reference_outputs

from dualpath.bench.netns import NetnsHosts, netns_unavailable
from dualpath.config import EngineConfig
from dualpath.control_keys import ClusterKeys
from dualpath.request import SamplingParams
from dualpath.server.launch import engine_command, engine_env

pytestmark = pytest.mark.skipif(netns_unavailable() is not None,
                                reason=netns_unavailable() or "")

HOSTS = ["router", "h0", "h1", "h2"]
ENGINES = [("pe0", "prefill", 0, "h0"), ("de1", "decode", 1, "h1"), ("de2", "decode", 2, "h2")]
ROUTER_PORT, HTTP_PORT = 47011, 8011
GEN_TOKENS = 8
CUT_GEN_TOKENS = 600  # long enough to be mid-decode when the link is cut
STARTUP_TIMEOUT_S = 180.0
API_KEY = "sk-netns"
SETTINGS = ["engine_timeout_s=3.0", "heartbeat_s=0.5", "router_timeout_s=60.0",
            "engine.kv_cache_mb=64", "host_pool_blocks=128", "serve.model_name=m"]


@dataclass
class Hosts:
    """The namespaces, the serve process, the engine processes and an HTTP client."""

    net: NetnsHosts
    base: str
    model_dir: Path
    logs: Path
    procs: dict[str, subprocess.Popen]
    client: httpx.Client

    def health(self) -> dict:
        """/health's answer, 200 or 503 (with the key, both list the engines that are in)."""
        response = self.client.get(f"{self.base}/health", timeout=5)
        return response.json() if response.status_code in (200, 503) else {}

    def engines(self) -> set[str]:
        return {e["name"] for e in self.health().get("engines", [])}

    def complete(self, prompt: list[int], max_tokens: int = GEN_TOKENS,
                 timeout_s: float = 120.0) -> httpx.Response:
        body = {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True, "return_token_ids": True}
        return self.client.post(f"{self.base}/v1/completions", json=body, timeout=timeout_s)

    def wait_engines_where(self, holds, timeout_s: float) -> None:
        """Until the engines that are in satisfy ``holds``."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                if holds(self.engines()):
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.3)
        raise AssertionError(f"engines {self.engines()} never got there; logs in {self.logs}")

    def wait_engines(self, want: set[str], timeout_s: float) -> None:
        self.wait_engines_where(lambda names: names == want, timeout_s)


def _spawn(net: NetnsHosts, host: str, argv: list[str], log: Path) -> subprocess.Popen:
    with log.open("w") as out:
        return subprocess.Popen(net.exec_argv(host, argv), stdout=out, stderr=subprocess.STDOUT,
                                env=engine_env())


@pytest.fixture(scope="module")
def hosts(tiny_with_tokenizer, tmp_path_factory) -> Iterator[Hosts]:
    tmp = tmp_path_factory.mktemp("netns")
    net = NetnsHosts(HOSTS, tag="dpt", net=7)
    net.up()
    router_ip = net.address("router")
    procs: dict[str, subprocess.Popen] = {}
    # with a key, /health shows its holder the engines' transfer endpoints
    client = httpx.Client(trust_env=False, headers={"authorization": f"Bearer {API_KEY}"})
    try:
        serve = [sys.executable, "-m", "dualpath.cli", "serve", "--launcher", "none",
                 "--router-host", router_ip, "--router-port", str(ROUTER_PORT),
                 "--host", router_ip, "--port", str(HTTP_PORT), "--model",
                 str(tiny_with_tokenizer), "--storage", str(tmp / "kv"), "--api-key", API_KEY]
        # the operator's keys: the router's folder, and each engine's own file on its host
        # (and a spare, de9's, for the engine with other weights)
        names = [*(name for name, _, _, _ in ENGINES), "de9"]
        keys = ClusterKeys.generate(names).write(tmp / "keys")
        for item in [*SETTINGS, f"control_keys={keys}"]:
            serve += ["--set", item]
        procs["serve"] = _spawn(net, "router", serve, tmp / "serve.log")
        for name, role, node_id, host in ENGINES:
            argv = engine_command(name, role, node_id, f"tcp://{router_ip}:{ROUTER_PORT}",
                                  tiny_with_tokenizer)
            argv += ["--key", str(keys / "engines" / f"{name}.json")]
            procs[name] = _spawn(net, host, argv, tmp / f"{name}.log")
        hosts = Hosts(net, f"http://{router_ip}:{HTTP_PORT}", tiny_with_tokenizer, tmp, procs,
                      client)
        hosts.wait_engines({"pe0", "de1", "de2"}, STARTUP_TIMEOUT_S)
        yield hosts
    finally:
        client.close()
        _stop(procs)
        net.down()


def _stop(procs: dict[str, subprocess.Popen]) -> None:
    serve = procs.get("serve")
    if serve is not None and serve.poll() is None:
        serve.send_signal(2)  # SIGINT: serve tells its engines to shut down
        try:
            serve.wait(30)
        except subprocess.TimeoutExpired:
            serve.kill()
    for proc in procs.values():
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _ids(response: httpx.Response) -> list[int]:
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["token_ids"]


def test_netns_engines_join_from_their_hosts_and_advertise_their_own_address(hosts):
    engines = {e["name"]: e for e in hosts.health()["engines"]}
    for name, _, node_id, host in ENGINES:
        assert engines[name]["node_id"] == node_id
        assert engines[name]["endpoint"].split(":")[0] == hosts.net.address(host)


def test_netns_multi_turn_tokens_equal_single_process_with_hits_from_turn_two(hosts):
    convs = make_conversations(256, [150, 200], [70, 90], seed=11)
    params = SamplingParams(max_tokens=GEN_TOKENS, ignore_eos=True)
    want = reference_outputs(hosts.model_dir, EngineConfig(kv_cache_mb=64), convs, params)
    prompts = [c.first for c in convs]
    for turn in range(3):
        with cf.ThreadPoolExecutor(len(prompts)) as pool:
            responses = list(pool.map(hosts.complete, prompts))
        for i, response in enumerate(responses):
            assert _ids(response) == want[i][turn], (turn, i)
            cached = response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
            assert (cached > 0) == (turn > 0), (turn, i, cached)
        if turn < 2:
            prompts = [p + _ids(r) + c.appended[turn]
                       for p, r, c in zip(prompts, responses, convs, strict=True)]


def test_netns_cut_link_loses_the_engine_loses_no_request_and_the_engine_rejoins(hosts):
    convs = make_conversations(256, [130] * 6, [], seed=12)
    prompts = [c.first for c in convs]
    params = SamplingParams(max_tokens=CUT_GEN_TOKENS, ignore_eos=True)
    want = [o[0] for o in reference_outputs(hosts.model_dir, EngineConfig(kv_cache_mb=64),
                                            convs, params)]
    with cf.ThreadPoolExecutor(len(prompts)) as pool:
        futures = [pool.submit(hosts.complete, p, CUT_GEN_TOKENS) for p in prompts]
        _wait_decoding(hosts.logs / "de2.log")
        hosts.net.cut("h2")  # while de2 decodes some of them
        try:
            # heartbeat silence: de2 is lost. A PE caught in a transfer to de2 makes no
            # progress either (until Mooncake drops the connection, 30 s) and is declared stuck
            # meanwhile: it rejoins once its loop moves
            hosts.wait_engines_where(lambda names: "de1" in names and "de2" not in names, 30)
        finally:
            hosts.net.restore("h2")  # de2 still decodes what the router took from it
        responses = [f.result(timeout=180) for f in futures]  # none hangs, none lost
    for response, expected in zip(responses, want, strict=True):
        if response.status_code == 200:
            assert _ids(response) == expected
        else:  # failed clearly, in OpenAI's error shape
            assert response.json()["error"]["message"], response.text
    assert _ids(hosts.complete(prompts[0], CUT_GEN_TOKENS)) == want[0]  # serves on
    hosts.wait_engines({"pe0", "de1", "de2"}, 40)  # de2 hears the router again and rejoins
    assert hosts.procs["de2"].poll() is None
    assert "rejoining" in (hosts.logs / "de2.log").read_text()
    with cf.ThreadPoolExecutor(len(prompts)) as pool:
        again = list(pool.map(lambda p: hosts.complete(p, CUT_GEN_TOKENS), prompts))
    assert [_ids(r) for r in again] == want


def _wait_decoding(log: Path, timeout_s: float = 30.0) -> None:
    """Until the engine's log shows it started decoding a request."""
    deadline = time.monotonic() + timeout_s
    while "decode started" not in log.read_text():
        assert time.monotonic() < deadline, log.read_text()[-2000:]
        time.sleep(0.05)


def test_netns_engine_with_other_weights_is_refused(hosts, tiny_llama_dir, tmp_path):
    argv = engine_command("de9", "decode", 9, f"tcp://{hosts.net.address('router')}:"
                          f"{ROUTER_PORT}", tiny_llama_dir)  # same weights, other folder name
    argv += ["--key", str(hosts.logs / "keys" / "engines" / "de9.json")]
    done = subprocess.run(hosts.net.exec_argv("h1", argv), capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert done.returncode == 2
    assert "give --model the same checkpoint" in done.stderr
    assert "de9" not in hosts.engines()
