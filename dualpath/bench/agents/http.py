"""Multi-turn agents replayed through an OpenAI-compatible server (``dualpath serve``).

The HTTP twin of :func:`dualpath.bench.replay.run_turns`: each agent runs its
:class:`~dualpath.workloads.turns.AgentTurn` list in order, the next turn as soon as the
previous one returned (zero think time), agents concurrently from their start offsets (all 0
offline; Poisson arrivals online, drawn by the caller). A turn is one streamed
``POST /v1/completions`` whose ``prompt`` is token ids (:meth:`AgentTurn.prompt`, as in the
Python replay: the kept context, then the turn's new tokens) with ``max_tokens=gen``,
``ignore_eos``, ``temperature=0`` and ``return_token_ids``; the next turn's context is that
prompt plus the ids the server returned. Every turn yields an :class:`HttpTurnRecord`
(timings from the SSE chunks, sizes, the cache hit from
``usage.prompt_tokens_details.cached_tokens``). A failed turn is
recorded with its HTTP status and message, and its agent stops.

The client is ``httpx2``'s async client (the HTTP library under the ``openai`` package): each
SSE line is one ``json.loads``, light enough for a hundred streams on the same small machine as
the server, and the extension fields need no wrapping.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx2

from dualpath.bench.replay import Pacing
from dualpath.workloads.turns import AgentTurn

COMPLETIONS_PATH = "/v1/completions"


@dataclass(frozen=True)
class HttpTurnRecord:
    """One turn as the client saw it. Times are seconds; ``submitted_s`` is ``time.monotonic()``
    when the request was sent, the others are measured from it (TPOT: between the first and the
    last token, per token after the first). A failed turn has ``error`` set (and ``status``, the
    HTTP status, when the server answered); its timings are None where they did not happen.
    ``cut_off``: it failed only because the run's deadline came while it was running."""

    agent: int
    turn: int
    submitted_s: float
    prompt_tokens: int
    generated_tokens: int = 0
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens, if reported
    ttft_s: float | None = None  # until the first chunk carrying generated tokens
    time_to_second_token_s: float | None = None
    tpot_s: float | None = None
    latency_s: float | None = None  # until the stream ended ([DONE])
    finish_reason: str | None = None
    status: int | None = None
    error: str | None = None
    cut_off: bool = False
    output_ids: tuple[int, ...] = field(default=(), repr=False)

    @property
    def ok(self) -> bool:
        """Whether the turn was served to its end."""
        return self.error is None

    @property
    def finished_s(self) -> float:
        """``time.monotonic()`` when the turn ended (its submission when it never answered)."""
        return self.submitted_s + (self.latency_s or 0.0)


class TurnFailed(Exception):
    """A turn that did not complete: the HTTP status (None without an answer) and why."""

    def __init__(self, status: int | None, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


def _ignore(_: HttpTurnRecord) -> None:
    """The default progress callback."""


def open_client(base_url: str, api_key: str | None = None, timeout_s: float = 3600.0,
                connections: int = 100) -> httpx2.AsyncClient:
    """An async client for ``base_url`` (the server's root, without ``/v1``), keeping up to
    ``connections`` connections alive; proxies from the environment are ignored."""
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx2.Limits(max_connections=None, max_keepalive_connections=connections)
    return httpx2.AsyncClient(base_url=base_url.rstrip("/"), headers=headers, limits=limits,
                              timeout=httpx2.Timeout(timeout_s), trust_env=False)


def turn_body(prompt: list[int], gen_tokens: int, model: str,
              extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """The request body of one turn; ``extra`` is merged last (it may override a field)."""
    return {"model": model, "prompt": prompt, "max_tokens": gen_tokens, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True},
            "return_token_ids": True, "temperature": 0, **(extra or {})}


class _Stream:
    """What the SSE chunks of one turn said: token ids with arrival times, finish, usage."""

    def __init__(self) -> None:
        self.ids: list[int] = []
        # monotonic arrival of the first, the second and the last id
        self.first_s: float | None = None
        self.second_s: float | None = None
        self.last_s: float | None = None
        self.finish_reason: str | None = None
        self.usage: dict[str, Any] | None = None
        self.done = False

    def take(self, data: str) -> None:
        """One ``data:`` payload; raises :class:`TurnFailed` on an error chunk."""
        if data == "[DONE]":
            self.done = True
            return
        chunk = json.loads(data)
        if "error" in chunk:
            raise TurnFailed(200, _message(chunk))
        now = time.monotonic()
        for choice in chunk.get("choices") or ():
            new = choice.get("token_ids")
            if new is None:
                raise TurnFailed(200, "a chunk carried no token_ids: does the server support "
                                      "return_token_ids?")
            if new:
                self._arrived(now, new)
            self.finish_reason = choice.get("finish_reason") or self.finish_reason
        if chunk.get("usage"):
            self.usage = chunk["usage"]

    def _arrived(self, now: float, ids: list[int]) -> None:
        """Take ids that arrived at ``now``."""
        self.ids.extend(ids)
        if self.first_s is None:
            self.first_s = now
        if self.second_s is None and len(self.ids) >= 2:
            self.second_s = now
        self.last_s = now

    def record(self, agent: int, turn: int, submitted_s: float,
               prompt_tokens: int) -> HttpTurnRecord:
        """The finished turn's record."""
        n = len(self.ids)
        first = None if self.first_s is None else self.first_s - submitted_s
        second = None if self.second_s is None else self.second_s - submitted_s
        tpot = None
        if n > 1 and self.first_s is not None and self.last_s is not None:
            tpot = (self.last_s - self.first_s) / (n - 1)
        details = (self.usage or {}).get("prompt_tokens_details") or {}
        return HttpTurnRecord(
            agent, turn, submitted_s, prompt_tokens, n, details.get("cached_tokens"),
            first, second, tpot, time.monotonic() - submitted_s, self.finish_reason, 200,
            output_ids=tuple(self.ids))


def _message(payload: Any) -> str:
    """The message of an OpenAI error object (or the payload itself)."""
    if isinstance(payload, dict) and isinstance(payload.get("error"), dict):
        return str(payload["error"].get("message", payload))
    return str(payload)


async def _failed_status(response: httpx2.Response) -> TurnFailed:
    """A non-200 answer as :class:`TurnFailed` with the server's message."""
    body = (await response.aread()).decode("utf-8", "replace")
    try:
        message = _message(json.loads(body))
    except json.JSONDecodeError:
        message = body[:500]
    return TurnFailed(response.status_code, message)


async def post_turn(client: httpx2.AsyncClient, prompt: list[int], gen_tokens: int, *,
                    model: str, agent: int = 0, turn: int = 0,
                    extra: dict[str, Any] | None = None,
                    headers: dict[str, str] | None = None) -> HttpTurnRecord:
    """Send one turn and read its stream to the end; the record of a served turn carries the
    generated ids (``output_ids``). Raises :class:`TurnFailed` when it was not served."""
    submitted = time.monotonic()
    stream = _Stream()
    try:
        async with client.stream("POST", COMPLETIONS_PATH, headers=headers,
                                 json=turn_body(prompt, gen_tokens, model, extra)) as response:
            if response.status_code != 200:
                raise await _failed_status(response)
            async for line in response.aiter_lines():
                if line.startswith("data:"):
                    stream.take(line[len("data:"):].strip())
                    if stream.done:
                        break
    except httpx2.HTTPError as exc:
        raise TurnFailed(None, f"{type(exc).__name__}: {exc}") from exc
    except json.JSONDecodeError as exc:
        raise TurnFailed(200, f"a chunk was not JSON: {exc}") from exc
    if not stream.done:
        raise TurnFailed(200, "the stream ended before [DONE]")
    return stream.record(agent, turn, submitted, len(prompt))


def _error_record(agent: int, turn: int, submitted_s: float, prompt_tokens: int,
                  status: int | None, message: str, cut_off: bool = False) -> HttpTurnRecord:
    return HttpTurnRecord(agent, turn, submitted_s, prompt_tokens,
                          latency_s=time.monotonic() - submitted_s, status=status, error=message,
                          cut_off=cut_off)


def _loop_time(monotonic_s: float | None) -> float | None:
    """A ``time.monotonic()`` instant on the running event loop's clock."""
    if monotonic_s is None:
        return None
    return asyncio.get_running_loop().time() + (monotonic_s - time.monotonic())


@dataclass(frozen=True)
class HttpSession:
    """An agent's session on the API: its id in ``X-Session-ID`` (what RL frameworks send;
    servers that know no sessions ignore it), and with ``hints`` the ``agent_hint``
    ``end_of_session`` on its last turn (dualpath's API); its tool times by ``pacing``."""

    session_id: str
    pacing: Pacing
    hints: bool = True

    def fields(self, extra: dict[str, Any] | None,
               last: bool) -> tuple[dict[str, Any] | None, dict[str, str]]:
        """A turn's body additions and headers."""
        headers = {"X-Session-ID": self.session_id}
        if not (self.hints and last):
            return extra, headers
        return {**(extra or {}), "agent_hint": {"end_of_session": True}}, headers


async def run_agent_http(client: httpx2.AsyncClient, turns: list[AgentTurn], *, model: str,
                         agent: int = 0, first_turn: int = 0, context: list[int] | None = None,
                         extra: dict[str, Any] | None = None,
                         progress: Callable[[HttpTurnRecord], None] = _ignore,
                         stop_s: float | None = None,
                         deadline_s: float | None = None,
                         on_send: Callable[[float], None] = _ignore,
                         session: HttpSession | None = None) -> tuple[
                             list[HttpTurnRecord], list[int]]:
    """One agent's turns in order, each as soon as the previous returned (or, with a
    ``session``, after the tool time recorded before it, naming the session); its records and
    its context after the last turn served. No turn starts at or after ``stop_s``
    (monotonic), and a turn still running at ``deadline_s`` is cut off and recorded as failed;
    after a failed turn the agent stops. Turns are numbered from ``first_turn``; ``on_send``
    gets the ``time.monotonic()`` each is sent at."""
    context, records = list(context or []), []
    for index, turn in enumerate(turns, first_turn):
        if session is not None and index > first_turn:
            await asyncio.sleep(session.pacing.think_s(turn))
        if stop_s is not None and time.monotonic() >= stop_s:
            break
        submitted = time.monotonic()
        try:
            prompt = turn.prompt(context)
        except ValueError as exc:
            records.append(_error_record(agent, index, submitted, 0, None, str(exc)))
            progress(records[-1])
            break
        on_send(submitted)
        try:
            async with asyncio.timeout_at(_loop_time(deadline_s)):
                last = index == first_turn + len(turns) - 1
                body, headers = (extra, None) if session is None else session.fields(extra, last)
                record = await post_turn(client, prompt, turn.gen, model=model, agent=agent,
                                         turn=index, extra=body, headers=headers)
        except TurnFailed as exc:
            record = _error_record(agent, index, submitted, len(prompt), exc.status,
                                   exc.message)
        except TimeoutError:
            record = _error_record(agent, index, submitted, len(prompt), None,
                                   "cut off: still running at the run's deadline", cut_off=True)
        records.append(record)
        progress(record)
        if not record.ok:
            break
        context = prompt + list(record.output_ids)
    return records, context


async def run_agents_http(base_url: str, agents: list[list[AgentTurn]], *, model: str,
                          api_key: str | None = None,
                          start_offsets_s: list[float] | None = None,
                          progress: Callable[[HttpTurnRecord], None] = _ignore,
                          timeout_s: float = 3600.0,
                          extra: dict[str, Any] | None = None,
                          cut_after_s: float | None = None,
                          pacing: Pacing | None = None,
                          session_hints: bool = True) -> list[list[HttpTurnRecord]]:
    """Replay every agent's turns through ``base_url`` (the server's root, e.g.
    ``http://127.0.0.1:8000``); per agent, its :class:`HttpTurnRecord` list.

    Agent i starts ``start_offsets_s[i]`` seconds after the call (default: all at once) and
    runs its turns back to back. ``extra`` is merged into every request body (e.g.
    ``{"dualpath": {"mode": "basic"}}``); ``progress`` gets each record as it is made. Turns
    still running ``timeout_s`` after the call are cut off and recorded as failed. With
    ``cut_after_s``, the replay ends once every turn sent up to that many seconds after the
    call has returned (agents keep sending until then); the turns then in flight are
    cancelled, unrecorded (the server aborts a request whose client went away). With
    ``pacing``, each agent names its session (``HttpSession``; ``session_hints``: and ends it
    on its last turn), waits its tool times, and at most ``pacing.max_agents`` run at once.
    """
    offsets = start_offsets_s if start_offsets_s is not None else [0.0] * len(agents)
    if len(offsets) != len(agents):
        raise ValueError(f"{len(offsets)} start offsets for {len(agents)} agents")
    start = time.monotonic()
    deadline = start + timeout_s
    window = _CutWindow(len(agents), start, cut_after_s)

    def note(record: HttpTurnRecord) -> None:
        window.records[record.agent].append(record)
        progress(record)

    slots = asyncio.Semaphore(pacing.max_agents if pacing and pacing.max_agents else
                              max(1, len(agents)))

    async def agent_run(client: httpx2.AsyncClient, index: int) -> None:
        session = None if pacing is None else HttpSession(f"agent-{index}", pacing,
                                                          session_hints)
        try:
            await asyncio.sleep(max(0.0, start + offsets[index] - time.monotonic()))
            async with slots:
                await run_agent_http(client, agents[index], model=model, agent=index,
                                     extra=extra, progress=note, stop_s=deadline,
                                     deadline_s=deadline, on_send=lambda t: window.sent(index, t),
                                     session=session)
        finally:
            window.measured(index)

    async with open_client(base_url, api_key, timeout_s, max(1, len(agents))) as client:
        tasks = [asyncio.create_task(agent_run(client, i)) for i in range(len(agents))]
        if cut_after_s is None:
            await asyncio.gather(*tasks)
            return window.records
        await window.all_measured.wait()
        for task in tasks:
            task.cancel()
        for outcome in await asyncio.gather(*tasks, return_exceptions=True):
            if isinstance(outcome, Exception):
                raise outcome
        return window.records


class _CutWindow:
    """Which agents still have a turn running that was sent by the cut (``cut_after_s`` after
    ``start``, monotonic); every record made so far, per agent (the replay's result)."""

    def __init__(self, agents: int, start: float, cut_after_s: float | None) -> None:
        self.start, self.cut_after_s = start, cut_after_s
        self.records: list[list[HttpTurnRecord]] = [[] for _ in range(agents)]
        self.pending = set(range(agents))
        self.all_measured = asyncio.Event()
        if not agents:
            self.all_measured.set()

    def sent(self, agent: int, sent_s: float) -> None:
        """Agent ``agent`` sent a turn at ``sent_s``: past the cut, all its measured turns
        have returned (an agent's turns go one at a time)."""
        if self.cut_after_s is not None and sent_s - self.start > self.cut_after_s:
            self.measured(agent)

    def measured(self, agent: int) -> None:
        """Agent ``agent`` has no turn sent by the cut still running."""
        self.pending.discard(agent)
        if not self.pending:
            self.all_measured.set()
