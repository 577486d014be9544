"""What several commands' ``add_arguments`` share: argument types (pure conversions such as a
size in GB) and the engine flags with their options dataclass."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from dualpath.config import EngineConfig

if TYPE_CHECKING:
    from argparse import ArgumentParser

DEVICE_HELP = ("the engines' device: cpu, cuda, cuda:N or auto (cuda where this host has a GPU, "
               "else cpu); a local cluster puts each engine on its own GPU, round robin")


def gigabytes(raw: str) -> float:
    """An argument type: a size in GB, > 0."""
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not value > 0:
        raise ValueError(f"expected a size in GB > 0, got {raw!r}")
    return value


def positive_int(raw: str) -> int:
    """An argument type: a whole number >= 1."""
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"expected a whole number >= 1, got {raw!r}")
    return value


def names(raw: str) -> tuple[str, ...]:
    """An argument type: comma-separated names, blanks dropped (``'a, b,'`` -> ``('a', 'b')``)."""
    return tuple(part.strip() for part in raw.split(",") if part.strip())


def optional(raw: str) -> str | None:
    """An argument type: a path, or None for ``''`` (``--json ''``: write none)."""
    return raw or None


def add_device_argument(parser: ArgumentParser, default: str | None) -> None:
    parser.add_argument("--device", default=default,
                        help=DEVICE_HELP + (f" (default {default})" if default else ""))


def add_engine_arguments(parser: ArgumentParser) -> None:
    """The flags of :class:`EngineOptions`."""
    parser.add_argument("--model", default=None, help="HF model folder (Llama/Qwen2/Mistral); "
                        "default: SmolLM2-135M-Instruct")
    parser.add_argument("--dtype", default="auto", help="compute dtype: auto, float32, bfloat16")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--block-size", type=int, default=64, help="KV block size in tokens")
    add_device_argument(parser, "auto")
    parser.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                        help="override an EngineConfig field, e.g. --set kv_cache_mb=256")


@dataclass(frozen=True, kw_only=True)
class EngineOptions:
    """The engine flags of a command that runs engines of its own."""

    model: str | None = None
    dtype: str = "auto"
    threads: int = 1
    block_size: int = 64
    device: str = "auto"
    sets: tuple[str, ...] = ()

    def engine_config(self) -> EngineConfig:
        """The EngineConfig of the flags plus each ``--set``; a device of ``auto`` is resolved
        against this host's GPUs."""
        config = EngineConfig.with_overrides(self.sets, dtype=self.dtype, threads=self.threads,
                                             block_size=self.block_size, device=self.device)
        if config.device == "cpu":
            return config
        from dataclasses import replace

        from dualpath.local_devices import resolve_local_device

        return replace(config, device=resolve_local_device(config.device))
