"""One replay of agent turns through a cluster, shared by every benchmark that runs agents.

:func:`run_turns` runs each agent's :class:`~dualpath.workloads.turns.AgentTurn` list on a
cluster through its Python API (:class:`~dualpath.server.launch.LocalCluster` or anything with
its ``submit``/``abort``): each turn's prompt is :meth:`AgentTurn.prompt` of the agent's context
so far (the previous prompt and the tokens it generated), the turn generates exactly ``gen``
tokens (``ignore_eos``), and the agent submits its next turn as soon as the previous one
returned (zero think time); agents run concurrently from their start offsets. Every turn yields
a :class:`TurnRecord`. A :class:`Pacing` replays more of an agent's life: its recorded tool time
before each turn, a bound on the agents running at once (the next one starts when one ends),
and a session per agent (its id on every turn, ``end_of_session`` on its last). ``bench
cluster``, ``bench agents`` (``--via python``), ``bench layerwise`` and the demo use it; the
replay through a server's OpenAI API (:mod:`dualpath.bench.agents.http`, also under ``bench
soak``) talks HTTP from an event loop instead of threads, but builds every prompt by the same
:meth:`AgentTurn.prompt`.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from dualpath.errors import DualPathError
from dualpath.request import SamplingParams
from dualpath.sessions import AgentHint, Session
from dualpath.workloads.turns import AgentTurn

if TYPE_CHECKING:
    from dualpath.server.launch import LocalCluster


@dataclass(frozen=True)
class TurnRecord:
    """How one turn was served: sizes, the hit, the time from submit to its first token
    (TTFT: the prefill engine's token, streamed) and to its last."""

    prompt_tokens: int
    hit_tokens: int
    computed_tokens: int
    ttft_s: float
    latency_s: float
    read_path: str
    attempts: int = 1  # placements it took (> 1: an engine failed it or lost track of it)
    submitted_s: float = 0.0  # since the run started
    ttst_s: float | None = None  # submit to the second token (None: one token generated)
    tpot_s: float | None = None  # first to last token / (tokens - 1)
    timings: dict[str, float] = field(default_factory=dict)  # the router's TTFT breakdown


@dataclass(frozen=True)
class Pacing:
    """How a replay paces its agents beyond "each turn as soon as the last returned"."""

    think_factor: float = 0.0  # wait each turn's recorded tool time times this (0: none)
    max_think_s: float = 5.0  # ... but never longer than this (traces hold day-long gaps)
    max_agents: int | None = None  # agents running at once (None: all, by their offsets)
    sessions: bool = False  # each agent names its session; its last turn ends it
    # with sessions: each turn hints when the next comes (``next_turn_in_s``: the tool time
    # the replay is about to wait, which a harness knows as it starts its tools)
    hint_returns: bool = False
    end_sessions: bool = True  # the last turn ends its session (False: it comes back later)
    # without ending: agent i's last turn hints its return in ``returns_s[i]`` seconds
    returns_s: tuple[float, ...] = ()

    def think_s(self, turn: AgentTurn) -> float:
        """How long the agent runs its tools before ``turn``."""
        return min(self.max_think_s, turn.think_s * self.think_factor)

    def hint(self, turns: list[AgentTurn], turn: int, agent: int) -> AgentHint | None:
        """What agent ``agent`` tells the server with its turn ``turn`` (with sessions)."""
        if turn < len(turns) - 1:
            return (AgentHint(next_turn_in_s=self.think_s(turns[turn + 1]))
                    if self.hint_returns else None)
        if self.end_sessions:
            return AgentHint(end_of_session=True)
        if agent < len(self.returns_s):
            return AgentHint(next_turn_in_s=self.returns_s[agent])
        return None


NO_PACING = Pacing()  # each turn as soon as the last returned, every agent by its offset


def _pool(runs: list[_Agent], max_agents: int) -> list[float]:
    """Start offsets that run at most ``max_agents`` at once: the first ones at 0, the others
    (-1: no timer) each started when an earlier one ends."""
    waiting = list(runs[max_agents:])
    lock = threading.Lock()

    def next_one() -> None:
        with lock:
            run = waiting.pop(0) if waiting else None
        if run is not None:
            run.start()

    for run in runs:
        run.on_done = next_one
    return [0.0 if i < max_agents else -1.0 for i in range(len(runs))]


class _Agent:
    """One agent's trajectory: submits turn after turn, records when it finished.

    With ``cut_after_s``, ``done`` is set once the agent submits a turn more than that many
    seconds after ``began`` (every earlier turn has returned: turns go one at a time); it goes on
    submitting until :meth:`stop` aborts the turn in flight.
    """

    def __init__(self, cluster: LocalCluster, turns: list[AgentTurn], mode: str,
                 done: threading.Event, progress: Any, context: list[int] | None = None,
                 began: float = 0.0, cut_after_s: float | None = None,
                 pacing: Pacing = NO_PACING, session_id: str = "", index: int = 0) -> None:
        self.cluster, self.turns, self.mode = cluster, turns, mode
        self.pacing, self.session_id = pacing, session_id
        self.index = index  # the agent's place in its run (its ``Pacing.returns_s``)
        self.on_done: Any = None  # called once, when the agent ends (a pool starts the next)
        self._timer: threading.Timer | None = None  # a tool call under way
        self.done, self.progress, self.began = done, progress, began
        self.cut_after_s = cut_after_s
        self.context: list[int] = list(context or [])  # prompt + output of the last turn
        self.turn = 0
        self.records: list[TurnRecord] = []
        self.token_times: dict[int, list[float]] = {}  # turn -> arrival time of each token
        self.finished_at: float | None = None
        self.done_at: float | None = None  # when ``done`` was set
        self.error: BaseException | None = None
        self._lock = threading.RLock()  # a future done at submit calls back in this thread
        self._future: Any = None  # the turn in flight
        self._stopped = False

    def stop(self) -> None:
        """Submit nothing more and abort the turn in flight (its result is ignored)."""
        with self._lock:
            self._stopped, future = True, self._future
            if self._timer is not None:
                self._timer.cancel()
        if future is not None and not future.done():
            self.cluster.abort(future)

    def _set_done(self) -> None:
        self.done_at = time.perf_counter()
        self.done.set()
        if self.on_done is not None:
            self.on_done()

    def start(self) -> None:
        """Submit the next turn: the first, or one after its tool time (a turn that cannot be
        built ends the agent with its error)."""
        try:
            with self._lock:
                self._submit()
        except Exception as exc:  # reported by run_turns
            self.error = exc
            self._set_done()

    def _submit(self) -> None:
        """Submit the next turn (``_lock`` held)."""
        if self._stopped:
            return
        turn = self.turns[self.turn]
        try:
            self.prompt = turn.prompt(self.context)
        except ValueError as exc:
            raise DualPathError(f"turn {self.turn}: {exc}") from exc
        self.submitted = time.perf_counter()
        params = SamplingParams(max_tokens=turn.gen, ignore_eos=True)
        past_cut = (self.cut_after_s is not None
                    and self.submitted - self.began > self.cut_after_s)
        self._future = self.cluster.submit(
            self.prompt, params, mode=self.mode,
            on_tokens=lambda t, n=self.turn: self._streamed(n, t), session=self._session())
        if past_cut and not self.done.is_set():
            self._set_done()
        self._future.add_done_callback(self._returned)

    def _session(self) -> Session | None:
        """The session this turn names (with ``Pacing.sessions``)."""
        if not self.pacing.sessions:
            return None
        return Session(self.session_id, "body",
                       self.pacing.hint(self.turns, self.turn, self.index))

    def _after_tools(self) -> None:
        """The next turn, once the tool time the trace recorded before it has passed."""
        think_s = self.pacing.think_s(self.turns[self.turn])
        if think_s <= 0:
            self._submit()
            return
        self._timer = threading.Timer(think_s, self.start)
        self._timer.daemon = True
        self._timer.start()

    def _streamed(self, turn: int, tokens: tuple[int, ...]) -> None:
        """Note when turn ``turn``'s tokens arrived (tokens come in order, per turn)."""
        now = time.perf_counter()
        self.token_times.setdefault(turn, []).extend([now] * len(tokens))

    def _returned(self, future: Any) -> None:
        with self._lock:
            if not self._stopped:
                self._record(future)

    def _record(self, future: Any) -> None:
        """Record a returned turn and submit the next (``_lock`` held)."""
        try:
            out = future.result()
            now = time.perf_counter()
            times = self.token_times.pop(self.turn, None) or [now]
            tpot = (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else None
            self.records.append(TurnRecord(
                len(self.prompt), out.num_hit_tokens, out.num_computed_tokens,
                times[0] - self.submitted, now - self.submitted, out.read_path,
                out.num_attempts, self.submitted - self.began,
                times[1] - self.submitted if len(times) > 1 else None, tpot, out.timings))
            self.progress()
            self.context = self.prompt + list(out.output_ids)
            self.turn += 1
            if self.turn == len(self.turns):
                self.finished_at = time.perf_counter()
                self._set_done()
                return
            self._after_tools()
        except Exception as exc:  # reported by run_turns
            self.error = exc
            self._set_done()


def run_turns(cluster: LocalCluster, agents: list[list[AgentTurn]], mode: str,
              progress: Any = lambda: None, timeout_s: float = 3600.0,
              label: str = "bench cluster",
              contexts: list[list[int]] | None = None,
              start_offsets_s: list[float] | None = None,
              cut_after_s: float | None = None, pacing: Pacing = NO_PACING) -> dict[str, Any]:
    """Run every agent to its last turn, each turn as soon as its previous one returned;
    ``contexts`` are the agents' contexts before their first turn here (default: empty);
    agent i starts ``start_offsets_s[i]`` seconds after the run (default: all at once).
    With ``cut_after_s``, the run ends once every turn submitted up to that many seconds
    after its start has returned: agents keep submitting until then (the load does not
    change), and the turns then in flight are aborted, unrecorded. ``pacing``: tool times, a
    bound on the agents at once (then offsets are not used) and sessions (:class:`Pacing`).

    Returns the mode, the JCT (until the last agent's last turn, or the cut), the turn count,
    the prompt, hit and computed token totals, every agent's :class:`TurnRecord` list
    (``records``) and its context after its last recorded turn (``contexts``: prompt and
    generated tokens).
    """
    events = [threading.Event() for _ in agents]
    starts = contexts if contexts is not None else [[] for _ in agents]
    start = time.perf_counter()
    runs = [_Agent(cluster, turns, mode, ev, progress, context, start, cut_after_s, pacing,
                   f"{label}-{mode}-agent{i}", i)
            for i, (turns, ev, context) in enumerate(zip(agents, events, starts, strict=True))]
    offsets = start_offsets_s or [0.0] * len(runs)
    if pacing.max_agents is not None:
        offsets = _pool(runs, pacing.max_agents)
    timers = [threading.Timer(offset, run.start)
              for run, offset in zip(runs, offsets, strict=True) if offset >= 0]
    for timer in timers:
        timer.daemon = True
        timer.start()
    for ev in events:
        if not ev.wait(max(0.0, timeout_s - (time.perf_counter() - start))):
            for timer in timers:
                timer.cancel()
            raise DualPathError(f"{label}: {mode} did not finish in {timeout_s:.0f} s")
    for run in runs:
        run.stop()
    errors = [a.error for a in runs if a.error is not None]
    if errors:
        raise DualPathError(f"{label}: {mode}: a request failed: {errors[0]}")
    ends = [a.done_at for a in runs if a.done_at is not None]
    records = [a.records for a in runs]
    flat = [r for recs in records for r in recs]
    return {"mode": mode, "agents": len(runs), "jct_s": max(ends) - start, "turns": len(flat),
            "prompt_tokens": sum(r.prompt_tokens for r in flat),
            "hit_tokens": sum(r.hit_tokens for r in flat),
            "computed_tokens": sum(r.computed_tokens for r in flat), "records": records,
            "contexts": [a.context for a in runs]}
