"""The device-KV regime of ``bench agents --engine vllm``: how much KV each vLLM instance may
hold, so that the workload's working set is several times what all the instances hold together.

On a GPU, device memory holds a small fraction of an agent fleet's contexts; that is why a
storage tier exists. A CPU testbed has the opposite: every instance's KV fits in DRAM, and a
prefix cache that holds the whole working set wins by never missing. So every vLLM instance of
the run, plain or carrying our connector, gets the same bounded budget:

* the **working set** is the KV bytes of every session's final context (the last turn's prompt
  and generated tokens, :func:`working_set_tokens`);
* the **budget** of each of the N instances (N = the cluster's engines, prefill + decode) is the
  largest whole number of blocks at which the working set is at least
  ``min_working_set_over_budget`` (default :data:`MIN_WORKING_SET_OVER_BUDGET`) × N × budget
  (:func:`bounded_kv_budget`);
* vLLM refuses to start an instance whose KV cache cannot hold one request of
  ``max_model_len`` tokens plus the null block it keeps back (``v1/core/kv_cache_utils.py``,
  ``check_enough_kv_cache_memory``), so ``max_model_len`` is the workload's longest request
  (warm-up included) rounded up to a block (:func:`max_model_len_for`), and a budget below that
  floor (:func:`vllm_floor_blocks`) is refused with :class:`KvBudgetError`: the workload is too
  small for the regime (more agents, or sessions of more even lengths).

vLLM takes the budget byte-exact (``--kv-cache-memory-bytes``) and rounds it down to whole
blocks of all layers; the budgets here are whole blocks already. The oracle's instances get an
unbounded budget instead (:func:`unbounded_kv_bytes`): room for every block their sessions and
the warm-up ever write, so every hit is a device hit.

Sessions are pinned to instances, agent ``i`` on instance ``i mod N`` (:func:`sticky_instance`),
as RL frameworks pin a trajectory to one server with a session id.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from dualpath.errors import DualPathError
from dualpath.workloads.agents import agent_sim_turns
from dualpath.workloads.turns import AgentTurn

MIN_WORKING_SET_OVER_BUDGET = 5.0
PLAIN_ROW = "vllm"  # the plain vLLM row of the ladder (bench/agents/plain_vllm.py)


class KvBudgetError(DualPathError):
    """The working set cannot be the asked multiple of the instances' total device KV: the
    budget that would make it so is below what vLLM accepts for the longest request."""


def sticky_instance(agent: int, instances: int) -> int:
    """The instance agent ``agent`` is pinned to: ``agent mod instances``."""
    if instances < 1:
        raise ValueError(f"instances must be >= 1, got {instances}")
    return agent % instances


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def working_set_tokens(agents: Sequence[Sequence[AgentTurn]], block_size: int) -> int:
    """Tokens of every agent's final context: its last turn's prompt plus generated tokens."""
    total = 0
    for turns in agents:
        sim = agent_sim_turns(turns, block_size)
        total += sim[-1].prompt + sim[-1].gen if sim else 0
    return total


def longest_request_tokens(agents: Sequence[Sequence[AgentTurn]], block_size: int) -> int:
    """The most tokens one turn holds at its end (prompt plus generated), over every agent."""
    return max((t.prompt + t.gen for turns in agents for t in agent_sim_turns(turns, block_size)),
               default=0)


def max_model_len_for(longest_tokens: int, block_size: int) -> int:
    """``max_model_len`` for requests of up to ``longest_tokens``: whole blocks."""
    return max(1, _cdiv(longest_tokens, block_size)) * block_size


def vllm_floor_blocks(max_model_len: int, block_size: int) -> int:
    """The fewest KV blocks vLLM starts an instance with: one request of ``max_model_len``
    tokens and the null block."""
    return _cdiv(max_model_len, block_size) + 1


@dataclass(frozen=True)
class KvBudget:
    """The device KV of each of ``instances`` vLLM instances against the workload's working
    set."""

    instances: int
    kv_budget_bytes_each: int
    working_set_bytes: int
    block_bytes: int
    max_model_len: int
    min_working_set_over_budget: float

    @property
    def total_budget_bytes(self) -> int:
        """What all the instances hold together."""
        return self.instances * self.kv_budget_bytes_each

    @property
    def working_set_over_budget(self) -> float:
        """The working set over the instances' total budget."""
        return self.working_set_bytes / self.total_budget_bytes

    def summary(self) -> dict[str, Any]:
        """``summary.plain_vllm`` of the result."""
        return {"instances": self.instances, "kv_budget_bytes_each": self.kv_budget_bytes_each,
                "kv_budget_blocks_each": self.kv_budget_bytes_each // self.block_bytes,
                "working_set_bytes": self.working_set_bytes,
                "working_set_over_budget": self.working_set_over_budget,
                "min_working_set_over_budget": self.min_working_set_over_budget,
                "max_model_len": self.max_model_len, "routing": "sticky: agent i on instance "
                "i mod instances"}

    def line(self) -> str:
        """One line for the console and the table's title."""
        return (f"device KV {self.kv_budget_bytes_each / 1e6:,.1f} MB per vLLM instance "
                f"({self.kv_budget_bytes_each // self.block_bytes} blocks) x {self.instances}; "
                f"working set {self.working_set_bytes / 1e6:,.1f} MB = "
                f"{self.working_set_over_budget:.1f}x their total")


def bounded_kv_budget(working_set_bytes: int, instances: int, block_bytes: int,
                      max_model_len: int, block_size: int,
                      min_working_set_over_budget: float = MIN_WORKING_SET_OVER_BUDGET
                      ) -> KvBudget:
    """The largest whole-block budget per instance at which ``working_set_bytes`` is at least
    ``min_working_set_over_budget`` × the instances' total; :class:`KvBudgetError` when that is
    below vLLM's floor for ``max_model_len`` (:func:`vllm_floor_blocks`)."""
    if instances < 1 or block_bytes < 1 or not min_working_set_over_budget > 0:
        raise ValueError(f"instances and block_bytes must be >= 1 and the ratio > 0, got "
                         f"{instances}, {block_bytes}, {min_working_set_over_budget}")
    blocks = int(working_set_bytes // (min_working_set_over_budget * instances * block_bytes))
    floor = vllm_floor_blocks(max_model_len, block_size)
    if blocks < floor:
        most = working_set_bytes / (instances * floor * block_bytes)
        raise KvBudgetError(
            f"the working set ({working_set_bytes / 1e6:,.1f} MB) cannot be "
            f"{min_working_set_over_budget:g}x the device KV of {instances} vLLM instances: "
            f"{min_working_set_over_budget:g}x needs {blocks} blocks each, and vLLM starts an "
            f"instance with no fewer than {floor} (one {max_model_len}-token request, the "
            f"longest, plus its null block; {block_bytes / 1e6:.2f} MB a block), which gives "
            f"at most {most:.2f}x. Use a workload with more agents or more even sessions (e.g. "
            f"--workload 48k --agents 20 --turns 3 --scale 32), or a lower "
            f"--min-working-set-over-budget")
    return KvBudget(instances, blocks * block_bytes, working_set_bytes, block_bytes,
                    max_model_len, min_working_set_over_budget)


def instance_blocks(agents: Sequence[Sequence[AgentTurn]], block_size: int) -> int:
    """Every block the turns of ``agents`` can write: each turn's prompt and generated tokens
    in blocks (an upper bound of the distinct blocks, compactions included)."""
    return sum(_cdiv(t.prompt + t.gen, block_size)
               for turns in agents for t in agent_sim_turns(turns, block_size))


def unbounded_kv_bytes(agents: Sequence[Sequence[AgentTurn]],
                       warmup: Sequence[Sequence[AgentTurn]], instances: int, block_size: int,
                       block_bytes: int, max_model_len: int,
                       primers: Sequence[AgentTurn] = ()) -> int:
    """A budget per instance (the oracle's) that never evicts: the blocks of every turn of the
    busiest instance's sessions (sticky routing; agent i's primer on its instance too) and of
    the warm-up (run on every instance), plus vLLM's floor."""
    pinned: list[list[Sequence[AgentTurn]]] = [[] for _ in range(instances)]
    for i, turns in enumerate(agents):
        pinned[sticky_instance(i, instances)].append(turns)
    for i, primer in enumerate(primers):
        pinned[sticky_instance(i, instances)].append([primer])
    busiest = max(instance_blocks(group, block_size) for group in pinned)
    blocks = busiest + instance_blocks(warmup, block_size) + vllm_floor_blocks(max_model_len,
                                                                               block_size)
    return blocks * block_bytes
