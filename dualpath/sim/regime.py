"""The regime (``regime.py``: h, hit/computed, κ, ρ) of the paper's setting and of the
testbed: ``dualpath sim`` prints both, so that the mapping between them is visible.

The testbed's (:func:`demo_regime`) is what its ``dualpath demo`` run measured, computed as
the demo computes it (``regime.py::ladder_regime``): the first reusing mode's hit rate;
loading a token over one node's storage NIC at the read cap; recomputing it at the recompute
mode's prefill compute per computed token (else the first mode that computed).

The paper's (:func:`sim_regime`) comes from the configuration alone, nothing simulated:

- h and the prompt length come from the workload's trajectory (``workloads/presets.py``);
- loading a token over one prefill node's storage NIC takes ``kv_bytes_per_token /
  (snic_bps × storage_eff)``;
- recomputing a token takes the prefill cost model's time for the mean prompt computed from
  scratch, per token, divided by the node's GPUs (each prefills its own requests). For the
  paper's hardware that model is dense peak FLOP/s × ``prefill_eff`` (0.236 in the presets,
  chosen a priori); for a testbed it is the measured cost model at the testbed's core share.

For DeepSeek-V3.2 on the paper's Hopper nodes and its 64K workload (the presets' DS660B: 48,068
KV bytes per token, storage at 80% of a 50 GB/s NIC) this gives h 98.6% (71 hit tokens per
computed one), κ 0.036 (about 1/28: a 33K-token prompt prefills at 30K tokens/s per node) and ρ
2.5: loading costs a twenty-eighth of recomputing, and the hit rate is so high that Basic still
needs 2.5 times the storage bandwidth a prefill node has.
"""

from __future__ import annotations

from typing import Any

from dualpath.regime import ladder_regime, load_s_per_token, regime
from dualpath.sim.config import SimConfig
from dualpath.sim.demo_run import DemoRun
from dualpath.workloads.presets import trajectory


def sim_regime(cfg: SimConfig) -> dict[str, Any]:
    """The regime of ``cfg``'s workload on ``cfg``'s hardware and model, with its inputs."""
    turns = trajectory(cfg.workload)
    hit = sum(t.hit for t in turns)
    prompt = sum(t.hit + t.miss for t in turns)
    mean_prompt = max(1, round(prompt / max(1, len(turns))))
    hw, model = cfg.hw(), cfg.model_profile()
    load_s = load_s_per_token(model.kv_bytes_per_token, hw.snic_bps * cfg.storage_eff)
    per_gpu_s = cfg.prefill_cost().request_ms(0, mean_prompt) / 1e3 / mean_prompt
    recompute_s = per_gpu_s / hw.gpus_per_node
    figures = regime(hit, prompt, load_s, recompute_s)
    return {**figures.as_dict(), "line": figures.describe(), "model": model.name,
            "hardware": hw.name, "workload": cfg.workload.preset, "mean_prompt": mean_prompt,
            "load_s_per_token": load_s, "recompute_s_per_token": recompute_s}


def demo_regime(run: DemoRun) -> dict[str, Any]:
    """The regime a ``dualpath demo`` run measured (as its own header shows it), with what it
    rests on and the testbed it ran on."""
    figures = ladder_regime(run.raw_modes, run.kv_bytes_per_token, run.read_cap_mb_s)
    return {**figures, "source": run.path, "testbed": run.describe(), "cpu_model": run.cpu_model}
