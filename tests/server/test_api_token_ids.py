"""The ``return_token_ids`` extension: generated ids (and the prompt's) back with the text.

A real ``LocalCluster`` of a tiny random Llama (1 PE + 1 DE) behind the app, served by uvicorn
on a loopback port. The ids returned are the cluster's own greedy output for the same prompt;
a stream's chunks joined equal the whole response; without the flag no id field appears.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx2 as httpx
import pytest

from dualpath.config_file import ServeConfig
from dualpath.request import SamplingParams
from dualpath.server.api.app import ModelInfo, build_app
from dualpath.server.launch import LocalCluster
from dualpath.server.metrics import ServeMetrics

from .test_api_errors import MODEL, byte_model, serving, tiny_cluster_config

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
PROMPT = [17, 200, 5, 91, 240, 33, 128, 7, 250, 64, 12, 199]
GEN_TOKENS = 12


class Served:
    """The app's URL, an HTTP client, the cluster behind it and the model as the API sees it."""

    def __init__(self, url: str, cluster: LocalCluster, model: ModelInfo) -> None:
        self.cluster, self.model = cluster, model
        self.client = httpx.Client(base_url=url, timeout=60)

    def post(self, path: str, **body: Any) -> dict[str, Any]:
        """A whole (non-streamed) response."""
        response = self.client.post(path, json={"model": MODEL, **body})
        assert response.status_code == 200, response.text
        return response.json()

    def stream(self, path: str, **body: Any) -> list[dict[str, Any]]:
        """Every SSE chunk of a streamed response, up to ``[DONE]``."""
        chunks = []
        with self.client.stream("POST", path, json={"model": MODEL, "stream": True,
                                                    **body}) as response:
            assert response.status_code == 200, response.read()
            for line in response.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunks.append(json.loads(line[len("data: "):]))
        return chunks

    def greedy(self, prompt: list[int], max_tokens: int) -> list[int]:
        """The cluster's greedy output for ``prompt`` (no EOS stop)."""
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        return list(self.cluster.generate([prompt], params, timeout_s=60)[0].output_ids)


@pytest.fixture(scope="module")
def served(tiny_chaotic_dir, tmp_path_factory) -> Iterator[Served]:
    tmp = tmp_path_factory.mktemp("api-token-ids")
    with LocalCluster(tiny_chaotic_dir, tiny_cluster_config(tmp / "kv"),
                      log_dir=tmp / "logs") as cluster:
        router = cluster.router
        model = byte_model(tiny_chaotic_dir, router)
        app = build_app(router, model, ServeConfig(), ServeMetrics(router))
        with serving(app) as (url, _):
            api = Served(url, cluster, model)
            yield api
            api.client.close()


def _streamed_ids(chunks: list[dict[str, Any]]) -> tuple[list[int], str]:
    """The generated ids and the text of a stream's chunks, joined."""
    ids: list[int] = []
    text = []
    for chunk in chunks:
        for choice in chunk["choices"]:
            ids.extend(choice["token_ids"])
            delta = choice.get("delta", {})
            text.append(choice.get("text") or delta.get("content") or "")
    return ids, "".join(text)


def test_completion_returns_the_clusters_greedy_ids(served):
    whole = served.post(COMPLETIONS, prompt=PROMPT, max_tokens=GEN_TOKENS, temperature=0,
                        ignore_eos=True, return_token_ids=True)
    choice = whole["choices"][0]
    assert choice["token_ids"] == served.greedy(PROMPT, GEN_TOKENS)
    assert whole["prompt_token_ids"] == PROMPT
    assert whole["usage"]["completion_tokens"] == len(choice["token_ids"]) == GEN_TOKENS
    assert choice["text"] == served.model.decode(choice["token_ids"])


def test_streamed_ids_joined_equal_the_whole_response(served):
    prompt = [*PROMPT, 3, 141, 59]
    body = dict(prompt=prompt, max_tokens=GEN_TOKENS, temperature=0, ignore_eos=True,
                return_token_ids=True)
    whole = served.post(COMPLETIONS, **body)
    chunks = served.stream(COMPLETIONS, stream_options={"include_usage": True}, **body)
    assert chunks[0]["prompt_token_ids"] == prompt
    assert all("prompt_token_ids" not in c for c in chunks[1:])
    ids, text = _streamed_ids(chunks)
    assert ids == whole["choices"][0]["token_ids"] == served.greedy(prompt, GEN_TOKENS)
    assert text == whole["choices"][0]["text"]
    assert chunks[-1]["usage"]["completion_tokens"] == GEN_TOKENS


def test_chat_returns_ids_whole_and_streamed(served):
    messages = [{"role": "user", "content": "ids, please"}]
    body = dict(messages=messages, max_tokens=8, temperature=0, ignore_eos=True,
                return_token_ids=True)
    whole = served.post(CHAT, **body)
    prompt = served.model.encode_chat(messages)
    assert whole["prompt_token_ids"] == prompt
    assert whole["choices"][0]["token_ids"] == served.greedy(prompt, 8)
    chunks = served.stream(CHAT, **body)
    assert chunks[0]["prompt_token_ids"] == prompt
    ids, text = _streamed_ids(chunks)
    assert ids == whole["choices"][0]["token_ids"]
    assert text == whole["choices"][0]["message"]["content"]


@pytest.mark.parametrize("flag", [{}, {"return_token_ids": False}], ids=["absent", "false"])
def test_without_the_flag_no_id_field_appears(served, flag):
    body = dict(prompt=PROMPT, max_tokens=4, temperature=0, **flag)
    whole = served.post(COMPLETIONS, **body)
    assert "prompt_token_ids" not in whole and "token_ids" not in whole["choices"][0]
    for chunk in served.stream(COMPLETIONS, **body):
        assert "prompt_token_ids" not in chunk
        assert all("token_ids" not in choice for choice in chunk["choices"])
    chat = served.post(CHAT, messages=[{"role": "user", "content": "hi"}], max_tokens=4, **flag)
    assert "prompt_token_ids" not in chat and "token_ids" not in chat["choices"][0]
