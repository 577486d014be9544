"""``dualpath serve --engine vllm``: our router and API in front of a prefill and two decode
vLLM instances with dualpath's connector (issue 36), against plain vLLM on the same 2-turn chat;
a ``cache_salt`` vLLM itself refuses, and what a stranger on this machine sees of the cluster's
listeners (issue 42).

Four vLLM starts (plain vLLM offline for the reference tokens, then the cluster's three, about
two minutes together here); skipped where ``make peers`` has not run. The module's last test
kills a decode instance, so it runs last.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

from dualpath.transfer.firewall import fence_unavailable, fenced_ports
from dualpath.transfer.listeners import listeners, process_tree
from tests.integrations.test_vllm_connector import TURNS, chat
from tests.integrations.test_vllm_env import ROOT, peers_python

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]  # several vLLM starts in one fixture

BLOCK_SIZE = 32  # as vllm_chat.py's reference instance
MAX_TOKENS = 24
LONG_TOKENS = 160  # the stream a decode instance dies under
READY_S = 420.0
VLLM_LOG = re.compile(r"starting vLLM \((\w+)\) at (\S+), log (\S+)")


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serve_vllm(tmp: Path, model_dir: Path, prefill: int, decode: int,
               *sets: str, environ: dict[str, str] | None = None) -> Iterator[dict]:
    """``dualpath serve --engine vllm`` on ``tmp/store`` until the block ends: its URL, run
    folder and store. ``environ``: more of serve's environment (the instances inherit it)."""
    port = free_port()
    cmd = [str(ROOT / ".venv" / "bin" / "python"), "-m", "dualpath.cli", "serve",
           "--engine", "vllm", "--prefill", str(prefill), "--decode", str(decode),
           "--model", str(model_dir), "--storage", str(tmp / "store"), "--port", str(port),
           "--set", "vllm.extra_args=['--enforce-eager']",
           # vLLM's prefix cache (on by default, the tier above our store) off: these tests
           # repeat prompts to check the store and both read paths, and a device hit would
           # skip them (the bench's bounded budget is where both tiers work together)
           "--set", "vllm.prefix_caching=false"]
    for item in sets:
        cmd += ["--set", item]
    log = (tmp / "serve.log").open("w")
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "DUALPATH_VLLM_PYTHON": str(peers_python()),
                                     **(environ or {})},
                            start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, proc, tmp / "serve.log")
        yield {"url": url, "store": tmp / "store", "run": run_folder(tmp / "serve.log")}
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, smollm2_dir):
    peers_python()  # skip before starting anything
    tmp = tmp_path_factory.mktemp("vllm-serve")
    (tmp / "model.json").write_text(json.dumps(str(smollm2_dir)))
    # vllm_chat.py's max_tokens: MAX_TOKENS; and the first prompt's long stream
    plain, _ = chat(tmp, "plain", TURNS, None, None, "--long-tokens", str(LONG_TOKENS))
    long = json.loads((tmp / "plain.json").read_text())["long"]
    with serve_vllm(tmp, smollm2_dir, 1, 2, f"engine.block_size={BLOCK_SIZE}",
                    "vllm.max_model_len=1024") as served:
        yield {**served, "plain": plain, "long": long}


def wait_ready(url: str, proc: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + READY_S
    while time.monotonic() < deadline:
        assert proc.poll() is None, log.read_text()[-3000:]
        try:
            if requests.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except requests.RequestException:
            pass
        time.sleep(2)
    raise AssertionError("serve --engine vllm not ready: " + log.read_text()[-3000:])


def run_folder(log: Path) -> Path:
    found = re.search(r"logs and resolved config: (\S+)", log.read_text())
    assert found
    return Path(found.group(1))


def vllm_instances(cluster: dict) -> list[tuple[str, str, Path]]:
    """Each engine's vLLM instance: its role, URL and log."""
    found = []
    for engine_log in sorted(cluster["run"].glob("*.log")):
        match = VLLM_LOG.search(engine_log.read_text())
        if match:
            found.append((match.group(1), match.group(2), Path(match.group(3))))
    return found


def vllm_logs(cluster: dict) -> dict[str, str]:
    """The vLLM instances' logs, joined by role."""
    logs: dict[str, str] = {}
    for role, _, log in vllm_instances(cluster):
        logs[role] = logs.get(role, "") + log.read_text()
    return logs


def complete(cluster: dict, prompt: list[int], read_path: str | None) -> dict:
    body = {"model": "SmolLM2-135M-Instruct", "prompt": prompt, "max_tokens": MAX_TOKENS,
            "temperature": 0}
    if read_path:
        body["dualpath"] = {"read_path": read_path}
    reply = requests.post(f"{cluster['url']}/v1/completions", json=body, timeout=300)
    assert reply.status_code == 200, reply.text
    return reply.json()


def expected_text(smollm2_dir: Path, output: list[int]) -> str:
    from dualpath.model.tokenizer import Tokenizer

    return Tokenizer(smollm2_dir).decode([t for t in output if t != 2])


@pytest.mark.parametrize("read_path", ["pe", "de", None])
def test_greedy_tokens_equal_plain_vllm_on_each_read_path(cluster, smollm2_dir, read_path):
    """Each turn through the router, the prefill instance, the PD push and the decode
    instance gives plain vLLM's text and token count; turn 2 hits turn 1's persisted KV."""
    for i, turn in enumerate(cluster["plain"]):
        reply = complete(cluster, turn["prompt"], read_path)
        assert reply["choices"][0]["text"] == expected_text(smollm2_dir, turn["output"])
        assert reply["usage"]["completion_tokens"] == len(turn["output"])
        cached = reply["usage"]["prompt_tokens_details"]["cached_tokens"]
        if i == 1 or read_path != "pe":  # the first request of all misses
            assert cached >= 2 * BLOCK_SIZE, reply["usage"]


def test_each_path_moved_the_hit(cluster, smollm2_dir):
    """The prefill instance read hit blocks from the store (PE path) and pulled them from the
    decode engine's buffer (DE path); every buffer it pushed was sealed."""
    logs = vllm_logs(cluster)
    prefill = logs["prefill"]
    loaded = [int(n) for n in re.findall(r"loaded (\d+) blocks", prefill)]
    pulled = [int(n) for n in re.findall(r"pulled (\d+), pushed", prefill)]
    assert sum(loaded) > 0 and sum(pulled) > 0
    assert "not sealed" not in prefill
    assert "saved" in logs["decode"]


def test_random_kv_under_valid_checksums_changes_the_tokens(cluster, smollm2_dir):
    """The loaded KV is used: random values stored under the same keys (valid checksums)
    change turn 2's tokens, on the DE path."""
    rewrite_store(cluster["store"], random_values=True)
    turn = cluster["plain"][1]
    reply = complete(cluster, turn["prompt"], "de")
    assert reply["choices"][0]["text"] != expected_text(smollm2_dir, turn["output"])


def test_corrupt_bytes_are_misses_and_tokens_stay_right(cluster, smollm2_dir):
    """Random bytes over every stored payload: checksum misses, recomputed, right tokens."""
    rewrite_store(cluster["store"], random_values=False)
    turn = cluster["plain"][1]
    for read_path in ("pe", "de"):
        reply = complete(cluster, turn["prompt"], read_path)
        assert reply["choices"][0]["text"] == expected_text(smollm2_dir, turn["output"])


def rewrite_store(root: Path, random_values: bool) -> None:
    """Random bf16 values near 1 under valid checksums, or random bytes (bad checksums), over
    every stored block."""
    import random

    from dualpath.kv.layout import KVLayout
    from dualpath.storage.block_file import HEADER_BYTES
    from dualpath.storage.fs import FsStore

    rng = random.Random(2)
    if not random_values:
        for path in sorted(root.rglob("*.kvb")):
            with path.open("r+b") as f:
                f.seek(HEADER_BYTES)
                f.write(rng.randbytes(path.stat().st_size - HEADER_BYTES))
        return
    layout = KVLayout(30, 3, 64, "bfloat16", BLOCK_SIZE)
    with FsStore(root, layout) as store:
        keys = [k for k in store.stored_keys() if k.layout_id == layout.vllm_layout_id]
        assert keys
        depth = {k.block_hash: 0 for k in keys}
        by_hash = {k.block_hash: k for k in keys}
        for key in keys:
            parent, d = key.parent, 0
            while parent in by_hash:
                d, parent = d + 1, by_hash[parent].parent
            depth[key.block_hash] = d
        keys.sort(key=lambda k: depth[k.block_hash])  # parents first
        store.delete(keys)
        payload = [bytearray(b for _ in range(layout.full_block_bytes // 2)
                             for b in (rng.randrange(256), 0x3F | rng.choice((0, 0x80))))
                   for _ in keys]
        assert all(store.put_from(keys, payload))


SALT = "tenant/" + "x/y" * 83  # 256 characters, with "/": vLLM itself refuses it (issue 42)
SALT_PROMPT = [(11 * i + 5) % 3000 + 20 for i in range(100)]  # 3 full blocks and a partial one


def salted(url: str, salt: str | None) -> dict:
    body = {"model": "SmolLM2-135M-Instruct", "prompt": SALT_PROMPT, "max_tokens": 8,
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


def test_a_salt_vllm_refuses_works_and_hits_only_itself(cluster):
    """The salted request gets the unsalted request's tokens; the blocks the decode instance
    stored under the salt are the router's hit for the same salt next time (the connector's
    keys and ours agree) and not for another salt; ``ss -ltnp`` shows no listener of the serve
    process, its engines or their vLLM instances on a wildcard address a fence does not
    cover."""
    url = cluster["url"]
    plain = salted(url, None)
    first = salted(url, SALT)
    second = salted(url, SALT)
    other = salted(url, SALT[:-1] + "z")
    tree = process_tree(serve_pid(url))
    opened = [item for item in listeners(tree) if item.wildcard]
    fences = fenced_ports()
    want = plain["choices"][0]["text"]
    assert [r["choices"][0]["text"] for r in (first, second, other)] == [want] * 3
    assert cached(first) == 0  # the salt's first request: nothing stored under it yet
    assert cached(second) >= 2 * BLOCK_SIZE  # what the decode instance stored, keyed on SALT
    assert cached(other) == 0  # another salt: another key space
    assert len(tree) >= 6  # serve, the engines, their instances and the instances' children
    assert opened, "Mooncake listens on every interface"
    if fence_unavailable() is None:
        covered = {port for ports in fences.values() for port in ports}
        assert {item.port for item in opened} <= covered, (opened, fences)


def kill_instance(url: str) -> None:
    """SIGKILL the vLLM instance serving ``url``: its whole process group (API server, engine
    core and worker; the worker would otherwise finish its step after the server died)."""
    port = url.rsplit(":", 1)[1]
    pids = subprocess.run(["pgrep", "-f", f"api_server.*--port {port} "],
                          capture_output=True, text=True).stdout.split()
    assert pids
    for group in {os.getpgid(int(pid)) for pid in pids}:
        os.killpg(group, signal.SIGKILL)


def running_requests(url: str) -> float:
    """``vllm:num_requests_running`` of an instance."""
    text = requests.get(f"{url}/metrics", timeout=10).text
    found = re.search(r"^vllm:num_requests_running\{[^}]*\} ([0-9.]+)", text, re.M)
    return float(found.group(1)) if found else 0.0


def test_decode_instance_killed_mid_stream_moves_the_stream(cluster):
    """The decode vLLM instance that streams a request dies: the stream goes on from the other
    decode engine (the router moves it, as in our own cluster) to its full length, no hang, and
    the caller's tokens are plain vLLM's, none repeated or skipped where the stream moved."""
    long = cluster["long"]
    body = {"model": "SmolLM2-135M-Instruct", "prompt": long["prompt"],
            "max_tokens": LONG_TOKENS, "temperature": 0, "ignore_eos": True, "stream": True,
            "return_token_ids": True}
    decodes = [url for role, url, _ in vllm_instances(cluster) if role == "decode"]
    assert len(decodes) == 2
    moved_before = router_counter(cluster, "dualpath:router_moved_streams_total")
    started = time.monotonic()
    tokens: list[int] = []
    chunks, killed, finish = 0, None, None
    with requests.post(f"{cluster['url']}/v1/completions", json=body, timeout=180,
                       stream=True) as reply:
        assert reply.status_code == 200
        for line in reply.iter_lines(decode_unicode=True):
            if not line.startswith("data: {"):
                continue
            chunks += 1
            choice = json.loads(line[6:])["choices"][0]
            tokens.extend(choice.get("token_ids") or ())
            finish = choice.get("finish_reason") or finish
            if chunks == 5:
                killed = next(url for url in decodes if running_requests(url) > 0)
                kill_instance(killed)
    assert killed is not None
    assert time.monotonic() - started < 180
    assert finish == "length"  # it streamed on to max_tokens
    log = (cluster["store"].parent / "serve.log").read_text()
    moves = [line for line in log.splitlines() if "stream moves off" in line]
    assert router_counter(cluster, "dualpath:router_moved_streams_total") == moved_before + 1, \
        "\n".join(moves) or log[-3000:]
    assert tokens == long["output"]  # plain vLLM's: nothing repeated or skipped at the move


def router_counter(cluster: dict, name: str) -> float:
    """One series of ``dualpath serve``'s ``/metrics``."""
    text = requests.get(f"{cluster['url']}/metrics", timeout=30).text
    found = re.search(rf"^{re.escape(name)} ([0-9.e+]+)$", text, re.M)
    assert found, f"no {name} in /metrics"
    return float(found.group(1))
