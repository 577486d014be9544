"""``VllmHttp`` on a real local HTTP server (no vLLM): the instance key goes as a bearer token
on every call (and none without one), and each call records when its first and its latest
response bytes arrived, so a call that has received nothing tells from one that streams."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from dualpath.integrations.vllm.engines.http import HttpCall, VllmHttp, VllmStatusError

DELAY_S = 0.3


class Server:
    """Answers after ``DELAY_S``: a completion, or two streamed chunks ``DELAY_S`` apart; 401
    unless the bearer token is ``key`` (when one is set). Records the Authorization headers."""

    def __init__(self, key: str = "") -> None:
        self.key = key
        self.auth: list[str | None] = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                server.auth.append(self.headers.get("Authorization"))
                if server.key and self.headers.get("Authorization") != f"Bearer {server.key}":
                    self._send(401, b'{"error": "Unauthorized"}')
                    return
                time.sleep(DELAY_S)
                if not body.get("stream"):
                    self._send(200, b'{"choices": [{"token_ids": [1]}]}')
                    return
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                for chunk in (b'data: {"n": 1}\n\n', b'data: {"n": 2}\n\n', b"data: [DONE]\n\n"):
                    self.wfile.write(chunk)
                    self.wfile.flush()
                    time.sleep(DELAY_S)

            def _send(self, status: int, data: bytes) -> None:
                self.send_response(status)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def keyed() -> Iterator[Server]:
    server = Server(key="k-123")
    yield server
    server.close()


def test_the_instance_key_goes_with_every_call_and_none_without_one(keyed):
    assert VllmHttp(keyed.url, 5, api_key="k-123").completions({})["choices"]
    with pytest.raises(VllmStatusError, match="401"):
        VllmHttp(keyed.url, 5).completions({})
    assert keyed.auth == ["Bearer k-123", None]


def test_a_call_records_when_its_first_and_latest_bytes_arrived(keyed):
    http = VllmHttp(keyed.url, 5, api_key="k-123")
    call = HttpCall()
    seen: list[float | None] = []
    started = time.monotonic()
    waiter = threading.Thread(target=lambda: (time.sleep(DELAY_S / 3),
                                              seen.append(call.first_byte_s)))
    waiter.start()
    http.completions({}, call)
    waiter.join()
    assert seen == [None]  # nothing had arrived a moment into the call
    assert call.first_byte_s is not None and call.first_byte_s >= started + DELAY_S * 0.9
    assert call.last_byte_s is not None and call.last_byte_s >= call.first_byte_s

    stream_call = HttpCall()
    with http.stream_completions({}, stream_call) as stream:
        first = stream_call.first_byte_s
        chunks = list(stream)
    assert [c["n"] for c in chunks] == [1, 2]
    assert first is not None and stream_call.last_byte_s is not None
    assert stream_call.last_byte_s - first >= 2 * DELAY_S * 0.9  # it streamed
