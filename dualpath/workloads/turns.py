"""The turn schemas of every workload: recorded, simulated, token-level.

Three levels, each derived from the one before:

* **Recorded** (:class:`Request` in a :class:`Trajectory`, a :class:`Session` being a top-level
  trajectory and its sub-agents): what a trace file holds, token counts and block hash ids, as
  :mod:`dualpath.workloads.weka` and :mod:`dualpath.workloads.mooncake` read them.
* **Simulated** (:class:`Turn`: ``prompt``, ``hit``, ``gen`` tokens): what the simulator replays.
  From a recorded trajectory, :func:`dualpath.workloads.sim_traces.chain_turns` credits each
  request with the whole blocks of hash ids it shares with the request before it; a Table 2
  preset (:mod:`dualpath.workloads.presets`) makes them directly.
* **Token-level** (:class:`AgentTurn`: keep ``keep`` tokens of the context, append ``new``,
  generate ``gen``): what a real cluster replays (:func:`dualpath.bench.replay.run_turns`, and
  through the OpenAI API :mod:`dualpath.bench.agents.http`); :meth:`AgentTurn.prompt` is the
  prompt it sends. A token-level agent gives back its simulated turns by the hit rule of
  :func:`dualpath.workloads.agents.agent_sim_turns`: an engine stores every full block of a
  turn's prompt and generated tokens but the last generated one, so turn i hits
  ``floor(min(kept, C − 1) / block) · block`` tokens (``kept`` the kept prefix, ``C`` the
  previous prompt + gen, 0 on the first turn), leaving at least one prompt token to compute;
  ``prompt`` is ``kept + len(new)`` and ``gen`` is unchanged. For a trace, turning hash blocks
  into tokens (:mod:`dualpath.workloads.trace_tokens`) keeps the hash-shared prefix, so the
  two routes from a recorded trajectory agree up to block rounding.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Request:
    """One recorded request: input and output tokens, its block hash ids, and the agent's
    tool time before it (the trace's ``think_time``, seconds; 0 when not recorded)."""

    tokens_in: int
    tokens_out: int
    ids: tuple[int, ...]
    think_s: float = 0.0


@dataclass(frozen=True)
class Trajectory:
    """One agent's recorded requests in order; ``block`` trace tokens per hash id."""

    name: str
    block: int
    requests: tuple[Request, ...]


@dataclass(frozen=True)
class SubAgent:
    """A sub-agent's trajectory and how many top-level requests were listed before it."""

    listed_after: int
    trajectory: Trajectory


@dataclass(frozen=True)
class Session:
    """A recorded session: its top-level trajectory and its sub-agents (none outside Weka)."""

    parent: Trajectory
    subagents: tuple[SubAgent, ...] = ()

    def subagents_within(self, parent_turns: int, first_listed: int = 0) -> list[Trajectory]:
        """The sub-agents listed before top-level request ``parent_turns`` (the first one a
        workload dropped) and after the first ``first_listed`` (those a window of the parent
        starts past): the ones that ran while the kept part of the parent did."""
        return [s.trajectory for s in self.subagents
                if first_listed <= s.listed_after <= parent_turns]


@dataclass(frozen=True)
class Turn:
    """One simulated turn, in tokens: the prompt, the part of it served from the cache, and
    the tokens generated."""

    prompt: int
    hit: int
    gen: int

    @property
    def miss(self) -> int:
        """Tokens the prefill computes."""
        return self.prompt - self.hit


@dataclass(frozen=True)
class AgentTurn:
    """One turn of an agent: the first ``keep`` tokens of its context so far (the previous
    turn's prompt and generated tokens; None keeps all of it), then ``new`` tokens; generates
    exactly ``gen`` tokens. A ``keep`` shorter than the context replays a compaction.
    ``think_s``: the agent's tool time before the turn (the trace's, scaled like its tokens),
    which a replay waits out only when asked to (``bench agents --think-times``)."""

    new: list[int]
    gen: int
    keep: int | None = None
    think_s: float = 0.0

    def prompt(self, context: Sequence[int]) -> list[int]:
        """The prompt this turn sends after ``context`` (the previous prompt and its output).

        Raises ``ValueError`` when ``keep`` exceeds the context.
        """
        if self.keep is not None and self.keep > len(context):
            raise ValueError(f"the turn keeps {self.keep} tokens of a {len(context)}-token "
                             "context")
        kept = context if self.keep is None else context[:self.keep]
        return list(kept) + list(self.new)
