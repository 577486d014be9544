"""``dualpath serve`` end to end with the official ``openai`` client and the real default model.

One server (1 PE + 2 DE processes over a fresh fs store) per module: a 3-turn chat whose
greedy answers are right and equal whether streamed or not, with storage hits from turn 2;
``/v1/completions`` from text and from token ids; a stream closed mid-way aborts its request on
the engines; ``/metrics`` parses and its counters move; 64 concurrent streams from one
``AsyncOpenAI`` client all finish; SIGINT stops the server and every engine process.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx2 as httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from dualpath.model.default_model import cache_dir
from dualpath.model.tokenizer import Tokenizer

pytestmark = pytest.mark.slow

STARTUP_TIMEOUT_S = 240.0  # three engine processes load the model on a shared machine
SYSTEM = ("You are a concise geography assistant. Answer each question about a country with "
          "one short sentence that names its capital city. " * 8)  # ~200 tokens: full blocks
QUESTIONS = [("What is the capital of France?", "Paris"),
             ("What is the capital of Germany?", "Berlin"),
             ("What is the capital of Italy?", "Rome")]


@dataclass
class Serve:
    """A running ``dualpath serve`` process."""

    proc: subprocess.Popen
    base: str
    log: Path
    model: str = ""

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.base}/v1", api_key="unused", max_retries=0,
                             timeout=300)

    def metrics(self) -> dict[str, float]:
        """Every sample of /metrics by ``name{label="value",...}``."""
        text = httpx.get(f"{self.base}/metrics", timeout=60).text
        samples = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
                samples[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
        return samples


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _start(model_dir: Path, tmp: Path, attempt: int) -> Serve | None:
    """Start the server and wait until /health says ready; None if its port was taken."""
    port = _free_port()
    log = tmp / f"serve-{attempt}.log"
    env = {**os.environ, "DUALPATH_CACHE_DIR": str(cache_dir()), "PYTHONUNBUFFERED": "1"}
    with log.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "dualpath.cli", "serve", "--port", str(port),
             "--model", str(model_dir), "--storage", str(tmp / "kv")],
            stdout=out, stderr=subprocess.STDOUT, env=env)
    serve = Serve(proc, f"http://127.0.0.1:{port}", log)
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            if "address already in use" in log.read_text().lower():
                return None
            pytest.fail(f"dualpath serve exited with {proc.returncode}:\n{log.read_text()}")
        try:
            if httpx.get(f"{serve.base}/health", timeout=2).status_code == 200:
                return serve
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    proc.kill()
    pytest.fail(f"dualpath serve not ready within {STARTUP_TIMEOUT_S:g} s:\n{log.read_text()}")


@pytest.fixture(scope="module")
def serve(smollm2_dir, tmp_path_factory) -> Iterator[Serve]:
    tmp = tmp_path_factory.mktemp("serve")
    server = None
    for attempt in range(3):  # another job may take the port between our probe and the bind
        if (server := _start(smollm2_dir, tmp, attempt)) is not None:
            break
    assert server is not None, "no free port in three tries"
    server.model = server.client().models.list().data[0].id
    yield server
    if server.proc.poll() is None:  # a test failed before the SIGINT test stopped it
        server.proc.send_signal(signal.SIGINT)
        try:
            server.proc.wait(30)
        except subprocess.TimeoutExpired:
            server.proc.kill()
            server.proc.wait()


def _streamed(client: openai.OpenAI, **kwargs) -> tuple[str, str | None, object]:
    """Text, finish reason and usage of a streamed chat."""
    stream = client.chat.completions.create(stream=True, stream_options={"include_usage": True},
                                            **kwargs)
    text, finish, usage = [], None, None
    for chunk in stream:
        if chunk.choices:
            text.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
        if chunk.usage is not None:
            usage = chunk.usage
    return "".join(text), finish, usage


def test_three_turn_chat_is_right_same_streamed_and_hits_storage_from_turn_two(serve):
    client = serve.client()
    messages = [{"role": "system", "content": SYSTEM}]
    for turn, (question, capital) in enumerate(QUESTIONS):
        messages.append({"role": "user", "content": question})
        args = dict(model=serve.model, messages=messages, temperature=0, max_tokens=32)
        whole = client.chat.completions.create(**args)
        text, finish, usage = _streamed(client, **args)
        answer = whole.choices[0].message.content
        assert capital in answer, (turn, answer)
        assert text == answer, (turn, text, answer)
        assert finish == whole.choices[0].finish_reason
        assert usage.prompt_tokens == whole.usage.prompt_tokens > 150
        assert usage.completion_tokens == whole.usage.completion_tokens
        if turn > 0:  # earlier turns stored their full blocks
            assert whole.usage.prompt_tokens_details.cached_tokens > 0, turn
            assert usage.prompt_tokens_details.cached_tokens > 0, turn
        messages.append({"role": "assistant", "content": answer})


def test_completions_from_text_and_from_token_ids(serve, smollm2_dir):
    client = serve.client()
    prompt = "The capital of France is"
    by_text = client.completions.create(model=serve.model, prompt=prompt, max_tokens=8,
                                        temperature=0)
    ids = Tokenizer(smollm2_dir).encode(prompt)
    by_ids = client.completions.create(model=serve.model, prompt=ids, max_tokens=8,
                                       temperature=0)
    assert "Paris" in by_text.choices[0].text
    assert by_ids.choices[0].text == by_text.choices[0].text
    assert by_ids.usage.prompt_tokens == by_text.usage.prompt_tokens == len(ids)
    assert by_text.object == "text_completion"


def test_metrics_parse_and_their_counters_move(serve):
    before = serve.metrics()
    for name in ("dualpath:num_requests_running", "dualpath:num_requests_waiting",
                 "dualpath:time_to_first_token_seconds_count",
                 'dualpath:heartbeat_age_seconds{engine="pe0"}',
                 'dualpath:storage_total{counter="hits",engine="de1",node="1"}'):
        assert name in before, name
    reply = serve.client().completions.create(model=serve.model, prompt="Once upon a time",
                                              max_tokens=8, temperature=0,
                                              extra_body={"ignore_eos": True})
    after = serve.metrics()
    finished = 'dualpath:requests_total{outcome="finished"}'
    assert after[finished] == before.get(finished, 0) + 1
    assert after["dualpath:generation_tokens_total"] == (
        before["dualpath:generation_tokens_total"] + 8)
    assert after["dualpath:prompt_tokens_total"] == (
        before["dualpath:prompt_tokens_total"] + reply.usage.prompt_tokens)
    for histogram in ("time_to_first_token_seconds", "e2e_request_latency_seconds",
                      "time_per_output_token_seconds"):
        key = f"dualpath:{histogram}_count"
        assert after[key] == before[key] + 1, key
    for engine in ("pe0", "de1", "de2"):  # every engine's storage counters are scraped
        assert any(k.startswith("dualpath:storage_total") and f'engine="{engine}"' in k
                   for k in after), engine


def test_metrics_split_each_time_to_first_token_by_stage(serve):
    stages = ("request_queue_time_seconds", "request_storage_read_time_seconds",
              "request_prefill_time_seconds", "request_first_token_delivery_seconds")
    before = serve.metrics()
    serve.client().completions.create(model=serve.model, prompt="A stage by stage story",
                                      max_tokens=4, temperature=0)
    after = serve.metrics()
    for stage in stages:
        key = f"dualpath:{stage}_count"
        assert after[key] == before[key] + 1, key
    added = {s: after[f"dualpath:{s}_sum"] - before[f"dualpath:{s}_sum"] for s in stages}
    ttft = (after["dualpath:time_to_first_token_seconds_sum"]
            - before["dualpath:time_to_first_token_seconds_sum"])
    assert all(v >= 0 for v in added.values()) and added["request_prefill_time_seconds"] > 0
    assert sum(added.values()) == pytest.approx(ttft, rel=0.05, abs=0.01)


def test_closing_a_stream_midway_aborts_the_request_on_the_engines(serve):
    before = serve.metrics()
    stream = serve.client().chat.completions.create(
        model=serve.model, messages=[{"role": "user", "content": "Tell me a long story."}],
        max_tokens=2000, stream=True, extra_body={"ignore_eos": True})
    for count, _ in enumerate(stream, 1):
        if count == 5:  # a few tokens in
            break
    stream.close()
    aborted = 'dualpath:requests_total{outcome="aborted"}'
    deadline = time.monotonic() + 5  # 2,000 tokens would take minutes on a CPU
    while (after := serve.metrics())["dualpath:num_requests_running"] or (
            after.get(aborted, 0) == before.get(aborted, 0)):
        assert time.monotonic() < deadline, after
        time.sleep(0.2)
    assert after[aborted] == before.get(aborted, 0) + 1
    finished = 'dualpath:requests_total{outcome="finished"}'
    assert after.get(finished, 0) == before.get(finished, 0)
    assert after["dualpath:generation_tokens_total"] == before["dualpath:generation_tokens_total"]


def test_64_concurrent_streams_from_one_async_client_all_finish(serve, tmp_path):
    async def run() -> tuple[list[tuple[str, str | None, int]], float]:
        client = openai.AsyncOpenAI(base_url=f"{serve.base}/v1", api_key="unused",
                                    max_retries=0, timeout=600)

        async def one(i: int) -> tuple[str, str | None, int]:
            stream = await client.chat.completions.create(
                model=serve.model, max_tokens=32, temperature=0, stream=True,
                stream_options={"include_usage": True},
                messages=[{"role": "user", "content": f"Write one sentence about the number {i}."}])
            text, finish, tokens = [], None, 0
            async for chunk in stream:
                if chunk.choices:
                    text.append(chunk.choices[0].delta.content or "")
                    finish = chunk.choices[0].finish_reason or finish
                if chunk.usage is not None:
                    tokens = chunk.usage.completion_tokens
            return "".join(text), finish, tokens

        start = time.monotonic()
        async with client:
            results = await asyncio.gather(*(one(i) for i in range(64)))
        return results, time.monotonic() - start

    results, wall_s = asyncio.run(run())
    tokens = sum(r[2] for r in results)
    figures = {"streams": 64, "max_tokens": 32, "wall_s": round(wall_s, 1),
               "output_tokens": tokens, "output_tokens_per_s": round(tokens / wall_s, 1)}
    (tmp_path / "concurrent_streams.json").write_text(json.dumps(figures))
    print(f"\n64 concurrent streams: {figures}")
    for text, finish, count in results:
        assert text and finish in ("stop", "length") and 1 <= count <= 32


def _proc_stats() -> dict[int, tuple[int, str]]:
    """Every process on this host: pid -> (parent pid, start time) from /proc."""
    stats = {}
    for path in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = path.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # gone meanwhile
        stats[int(path.parent.name)] = (int(fields[1]), fields[19])  # ppid, starttime
    return stats


def _children(pid: int) -> dict[int, str]:
    """The descendants of ``pid``: pid -> start time (tells a reused pid apart)."""
    stats, found, todo = _proc_stats(), {}, [pid]
    while todo:
        parent = todo.pop()
        for child, (ppid, start) in stats.items():
            if ppid == parent and child not in found:
                found[child] = start
                todo.append(child)
    return found


def _alive(pid: int, start: str) -> bool:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return False
    return fields[19] == start and fields[0] != "Z"


def test_sigint_stops_the_server_and_every_engine(serve):
    engines = _children(serve.proc.pid)
    assert len(engines) >= 3, engines  # 1 prefill + 2 decode engine processes
    start = time.monotonic()
    serve.proc.send_signal(signal.SIGINT)
    assert serve.proc.wait(timeout=20) == 0, serve.log.read_text()
    print(f"\nSIGINT to exit: {time.monotonic() - start:.1f} s")
    deadline = time.monotonic() + 5
    while alive := [pid for pid, t in engines.items() if _alive(pid, t)]:
        assert time.monotonic() < deadline, f"left behind: {alive}"
        time.sleep(0.1)
