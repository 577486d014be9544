"""The regime a KV-cache benchmark runs in (pure): is reloading KV worth it, and is Basic
storage-bound? Four numbers, printed above every ladder and kept at ``summary.regime``:

- ``hit_rate`` (h): prompt tokens loaded from storage / prompt tokens.
- ``hit_per_computed``: hit tokens / computed (prefilled) tokens, h / (1 - h). The paper's
  98.7% is 76 hit tokens per computed one; our old workloads' 80% was 4.
- ``kappa`` (κ): the seconds one token's KV takes over one node's storage NIC / the seconds a
  prefill engine takes to recompute that token at the workload's context lengths. Below 1,
  loading beats recomputing; in the paper's setting it is a few percent.
- ``rho`` (ρ): Basic's storage demand over its prefill nodes' storage supply,
  hit_per_computed × κ. A prefill node computing at full speed needs ``hit_per_computed`` hit
  tokens per computed token, each holding its storage NIC for κ of a computed token's time. ρ >
  1: Basic is storage-bound, the premise of the paper's second read path; ρ < 1: Basic is
  compute-bound and DualPath has little to add. Demand and supply are both per prefill node,
  so ρ does not depend on how many there are (hits spread over them alike).

Pure: no torch, sockets or clocks; the ladders (``bench/``), ``dualpath sim`` and the tests
share it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from dualpath.vocab import Mode


class RegimeError(ValueError):
    """Counts or rates that describe no run (negative, or more hits than prompt tokens)."""


@dataclass(frozen=True)
class Regime:
    """The four regime figures of one workload on one testbed (None: not measured)."""

    hit_rate: float
    hit_per_computed: float | None  # None when nothing was computed (every token a hit)
    kappa: float | None  # None when the NIC is uncapped or no compute was measured
    rho: float | None

    def as_dict(self) -> dict[str, float | None]:
        """The JSON form, ``summary.regime``."""
        return asdict(self)

    def describe(self) -> str:
        """One line for a table's header: ``h 95.2%, 19.8 hit/computed, κ 0.08, ρ 1.58``."""
        parts = [f"h {self.hit_rate:.1%}",
                 f"{_fmt(self.hit_per_computed, '.1f')} hit/computed",
                 f"κ {_fmt(self.kappa, '.3g')}", f"ρ {_fmt(self.rho, '.3g')}"]
        return ", ".join(parts)


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def load_s_per_token(kv_bytes_per_token: float, snic_bytes_s: float) -> float:
    """Seconds one token's KV takes over a storage NIC of ``snic_bytes_s``."""
    if kv_bytes_per_token <= 0 or snic_bytes_s <= 0:
        raise RegimeError("KV bytes per token and the NIC's bytes/s must be > 0, got "
                          f"{kv_bytes_per_token} and {snic_bytes_s}")
    return kv_bytes_per_token / snic_bytes_s


def snic_bytes_s_for(kappa: float, kv_bytes_per_token: float,
                     recompute_s_per_token: float) -> float:
    """The storage-NIC bandwidth at which loading a token costs ``kappa`` times recomputing it
    (the inverse of ``load_s_per_token`` / ``recompute_s_per_token``)."""
    if not (kappa > 0 and kv_bytes_per_token > 0 and recompute_s_per_token > 0):
        raise RegimeError(f"kappa, KV bytes per token and recompute seconds per token must be "
                          f"> 0, got {kappa}, {kv_bytes_per_token} and {recompute_s_per_token}")
    return kv_bytes_per_token / (kappa * recompute_s_per_token)


def recompute_s_per_token(compute_s: float, computed_tokens: int) -> float | None:
    """A prefill engine's seconds per computed token (None when it computed nothing)."""
    if compute_s < 0 or computed_tokens < 0:
        raise RegimeError(f"compute time and tokens must be >= 0, got {compute_s} s and "
                          f"{computed_tokens}")
    if computed_tokens == 0 or compute_s == 0:
        return None
    return compute_s / computed_tokens


def regime(hit_tokens: int, prompt_tokens: int, load_s: float | None = None,
           recompute_s: float | None = None) -> Regime:
    """The regime of a run that loaded ``hit_tokens`` of ``prompt_tokens``; ``load_s`` and
    ``recompute_s``: seconds per token to load over one node's storage NIC and to recompute."""
    if hit_tokens < 0 or prompt_tokens < 0 or hit_tokens > prompt_tokens:
        raise RegimeError(f"hit tokens must be in [0, prompt tokens], got {hit_tokens} of "
                          f"{prompt_tokens}")
    for name, value in (("load", load_s), ("recompute", recompute_s)):
        if value is not None and not (value > 0 and math.isfinite(value)):
            raise RegimeError(f"{name} seconds per token must be > 0, got {value}")
    computed = prompt_tokens - hit_tokens
    hit_per_computed = hit_tokens / computed if computed else None
    kappa = load_s / recompute_s if load_s is not None and recompute_s is not None else None
    rho = hit_per_computed * kappa if hit_per_computed is not None and kappa is not None \
        else None
    return Regime(hit_tokens / max(1, prompt_tokens), hit_per_computed, kappa, rho)


def ladder_regime(modes: Mapping[str, Mapping[str, Any]], kv_bytes_per_token: int,
                  snic_mb_s: float) -> dict[str, Any]:
    """A ladder's regime (``summary.regime``) from its modes' figures (each with
    ``hit_tokens``, ``prompt_tokens`` and ``recompute_s_per_token``, the prefill engines'
    seconds per computed token), and what it rests on: the hit rate of the first mode that
    reuses KV; the seconds per computed token measured in ``recompute`` when it ran (every
    prompt token computed, at the workload's context lengths), else in the first mode that
    computed; loading over one node's storage NIC of ``snic_mb_s``."""
    reuse = next((m for m in modes if m != Mode.RECOMPUTE), None)
    by_preference = sorted(modes, key=lambda m: m != Mode.RECOMPUTE)
    compute_of = next((m for m in by_preference if modes[m].get("recompute_s_per_token")), None)
    load_s = load_s_per_token(kv_bytes_per_token, snic_mb_s * 1e6)
    recompute_s = modes[compute_of]["recompute_s_per_token"] if compute_of else None
    hit, prompt = (modes[reuse]["hit_tokens"], modes[reuse]["prompt_tokens"]) if reuse else (0, 0)
    figures = regime(hit, prompt, load_s, recompute_s)
    return {**figures.as_dict(), "hit_rate_of": reuse, "recompute_s_of": compute_of,
            "kv_bytes_per_token": kv_bytes_per_token, "snic_mb_s": snic_mb_s,
            "load_s_per_token": load_s, "recompute_s_per_token": recompute_s,
            "line": figures.describe()}
