"""The project's vocabularies, one ``StrEnum`` each (pure: imports nothing of dualpath).

A member is a ``str``, so it goes onto the wire, into JSON and into a config file as the same
string it always was; code compares and dispatches on members, and the boundaries (config
loading, command-line values, decoded messages) parse strings into them.

The ablation ladder (docs/design.md §7) is one table, :data:`LADDER`: each :class:`Rung` names the
serving :class:`Mode` it runs and the scheduler :class:`Policy` it places with. ``round_robin``
is a rung, not a mode (DualPath's mode with the round-robin policy); ``recompute`` (no KV reuse
at all: every prompt token computed) is the ladder's bottom rung, what a cache tier is worth
against. The simulator models the reuse rungs only (:attr:`Rung.reuses_kv`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum


class Mode(StrEnum):
    """How a cluster serves a request: the ladder's modes plus ``recompute`` (no cache at all)."""

    BASIC = "basic"  # the PE reads the whole hit before its forward
    LAYERWISE = "layerwise"  # the PE streams the hit layer by layer
    DUALPATH = "dualpath"  # layerwise, the hit read on the PE or the DE side
    ORACLE = "oracle"  # a bench mode: the hit is taken as given, no KV moves
    RECOMPUTE = "recompute"  # no cache: every prompt token is computed


class ReadPath(StrEnum):
    """Where a request's hit is read: the scheduler's choice, or forced to one side."""

    AUTO = "auto"
    PE = "pe"
    DE = "de"
    SPLIT = "split"  # the PE reads the leading hit blocks, the DE the rest


class Phase(StrEnum):
    """Where a request is in its life."""

    QUEUED = "queued"
    BUFFERING = "buffering"
    PREFILLING = "prefilling"
    DECODING = "decoding"
    DRAINING = "draining"  # ended for the caller; the PE may still write the DE buffer
    MOVING = "moving"  # its decode engine was lost: its hit is looked up anew, then re-placed


class Role(StrEnum):
    """What an engine does in the cluster."""

    PREFILL = "prefill"
    DECODE = "decode"


class EngineKind(StrEnum):
    """What computes behind an engine process (``ClusterConfig.engine_kind``)."""

    DUALPATH = "dualpath"  # our engine: the model runs in the engine process
    VLLM = "vllm"  # a vLLM instance with dualpath's KV connector (docs/vllm-connector.md)


class Launcher(StrEnum):
    """Who places a served cluster's engines (``serve.launcher``)."""

    LOCAL = "local"  # child processes of the serve process
    RAY = "ray"  # Ray actors on the nodes whose custom resources name them
    NONE = "none"  # nobody: engines join with `dualpath engine --router`


class Policy(StrEnum):
    """How the global scheduler places requests (``scheduler.global_scheduler.POLICIES``)."""

    DUALPATH = "dualpath"  # docs/paper.md §5: load- and read-queue-aware placement and read path
    ROUND_ROBIN = "round_robin"  # the paper's load-balance baseline


class PrefillMode(StrEnum):
    """How a prefill engine moves a request's KV (``engine/layerwise.py``)."""

    BASIC = "basic"  # read the whole hit, then forward with the full cache
    LAYERWISE = "layerwise"  # load and save layer by layer around the forward
    ORACLE = "oracle"  # move nothing: the hit's KV is taken as given

    @classmethod
    def of(cls, mode: Mode) -> PrefillMode:
        """The prefill mode of a serving mode: its own for basic and oracle, else layerwise."""
        return {Mode.BASIC: cls.BASIC, Mode.ORACLE: cls.ORACLE}.get(mode, cls.LAYERWISE)


class Rung(StrEnum):
    """A step of the ablation ladder, in its order; :data:`LADDER` says what each runs."""

    RECOMPUTE = "recompute"
    BASIC = "basic"
    LAYERWISE = "layerwise"
    ROUND_ROBIN = "round_robin"
    DUALPATH = "dualpath"
    ORACLE = "oracle"

    @property
    def mode(self) -> Mode:
        """The serving mode this rung runs."""
        return LADDER[self].mode

    @property
    def policy(self) -> Policy:
        """The scheduler policy this rung places with."""
        return LADDER[self].policy

    @property
    def reuses_kv(self) -> bool:
        """Whether this rung serves hits from stored KV (every rung but ``recompute``)."""
        return self.mode != Mode.RECOMPUTE


@dataclass(frozen=True)
class RungSpec:
    """What one rung of the ladder runs."""

    mode: Mode
    policy: Policy


LADDER: Mapping[Rung, RungSpec] = {
    Rung.RECOMPUTE: RungSpec(Mode.RECOMPUTE, Policy.DUALPATH),
    Rung.BASIC: RungSpec(Mode.BASIC, Policy.DUALPATH),
    Rung.LAYERWISE: RungSpec(Mode.LAYERWISE, Policy.DUALPATH),
    Rung.ROUND_ROBIN: RungSpec(Mode.DUALPATH, Policy.ROUND_ROBIN),
    Rung.DUALPATH: RungSpec(Mode.DUALPATH, Policy.DUALPATH),
    Rung.ORACLE: RungSpec(Mode.ORACLE, Policy.DUALPATH),
}
