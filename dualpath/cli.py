"""The ``dualpath`` command line: a table of commands, each a module that owns its arguments.

A command's module has ``add_arguments(parser)``, a frozen options dataclass and
``run(options) -> int``. The parsed flags become that dataclass by name (an argument's ``dest``
is a field), so argparse never leaves this file. A module is imported only when its command
runs or its help is asked for: ``dualpath --help`` imports none of them."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any, get_type_hints

from dualpath.errors import DualPathError


@dataclass(frozen=True)
class Command:
    """One row of the table: the module that owns the command, its line in ``--help``, and
    the prefix of the module's functions (``master_`` for ``master_add_arguments`` and
    ``master_run``) where one module has several commands."""

    module: str
    help: str
    prefix: str = ""


COMMANDS: dict[tuple[str, ...], Command] = {
    ("generate",): Command("dualpath.commands.generate",
                           "answer one prompt with the single-engine runner"),
    ("demo",): Command("dualpath.bench.demo", "replay real agent sessions on a local cluster in "
                       "basic and dualpath mode; print JCT, TTFT, hit rate, reads and speed-up"),
    ("prepare-model",): Command("dualpath.commands.prepare_model",
                                "convert the default model once and print its path"),
    ("serve",): Command("dualpath.server.serve",
                        "run a local cluster behind an OpenAI-compatible API"),
    ("engine",): Command("dualpath.commands.engine",
                         "run one prefill or decode engine process"),
    ("store", "verify"): Command("dualpath.commands.store_verify", "recompute sampled stored "
                                 "chains with the model and compare their KV; exit status 1 on "
                                 "a mismatch"),
    ("keys",): Command("dualpath.commands.keys", "make control-plane keys for a router and its "
                       "engines (engines on other hosts: `serve --set control_keys=DIR`, "
                       "`engine --key DIR/engines/NAME.json`)"),
    ("profile",): Command("dualpath.bench.profile",
                          "measure prefill cost and storage read rate (α, β)"),
    ("sim",): Command("dualpath.sim.commands",
                      "cluster simulator: reproduce the paper's experiments"),
    ("plan",): Command("dualpath.sim.plan_command",
                       "bottleneck-free P/D range (eq. 9) and simulated JCT"),
    ("bench", "engine"): Command("dualpath.bench.engine.compare", "prefill/decode tokens/s "
                                 "against transformers and vLLM, each in its own process "
                                 "(JSON + PNG)"),
    ("bench", "storage"): Command("dualpath.bench.storage", "store read/write (fs, "
                                  "mooncake_store) vs raw O_DIRECT reads"),
    ("bench", "transfer"): Command("dualpath.bench.transfer",
                                   "Mooncake: layer blocks vs one large transfer"),
    ("bench", "cluster"): Command("dualpath.bench.cluster", "multi-turn agents on a local "
                                  "cluster: JCT per mode (the simulator's testbed cross-check)"),
    ("bench", "agents"): Command("dualpath.bench.agents.command", "agentic workloads (Table 2 "
                                 "presets, Weka, Mooncake) through the cluster or its OpenAI "
                                 "API: every mode, offline JCT, online APS, TTFT breakdown, "
                                 "NICs (JSON + PNG)"),
    ("bench", "sessions"): Command("dualpath.bench.sessions", "agent sessions with their tool "
                                   "times: DRAM copies off vs on (TTFT), and a store at half "
                                   "the working set evicting by recency vs by session (hit "
                                   "rate, JCT) (JSON + PNG)"),
    ("bench", "layerwise"): Command("dualpath.bench.layerwise.mechanisms", "the paper's "
                                    "mechanisms: layerwise memory, QoS lanes under EP traffic, "
                                    "split reads (JSON + PNG)"),
    ("bench", "scheduler"): Command("dualpath.bench.scheduler",
                                    "global scheduler decisions/s at 48P96D scale"),
    ("bench", "soak"): Command("dualpath.bench.soak.command", "agents against `dualpath "
                               "serve` for a long run: errors, latency drift, RSS growth "
                               "(make soak)"),
    ("bench", "gpu-check"): Command("dualpath.bench.gpu_check", "the GPU acceptance: GPU "
                                    "tests, bench engine and bench agents against floors "
                                    "(make gpu-check)"),
    ("workloads", "sample"): Command("dualpath.workloads.sample",
                                     "remake the shipped Weka sample from the traces"),
    ("mooncake", "master"): Command("dualpath.storage.mooncake_service",
                                    "run mooncake_master until SIGTERM", "master_"),
    ("mooncake", "serve"): Command("dualpath.storage.mooncake_service",
                                   "contribute a Mooncake Store memory segment until SIGTERM",
                                   "segment_"),
    ("mooncake", "wheel"): Command("dualpath.transfer.mooncake_wheel", "trim: drop what "
                                   "dualpath never loads from Mooncake wheels"),
}

GROUPS: dict[tuple[str, ...], str] = {
    ("bench",): "benchmarks", ("store",): "the KV store",
    ("workloads",): "the shipped workload files", ("mooncake",): "Mooncake processes and wheels"}


def _command_path(argv: list[str]) -> tuple[str, ...] | None:
    """The table's command that ``argv`` names (its leading words), or None."""
    for path in COMMANDS:
        if tuple(argv[:len(path)]) == path:
            return path
    return None


def _typed_errors(parser: argparse.ArgumentParser) -> None:
    """A ValueError of one of dualpath's argument types is argparse's error with its message
    (the types stay free of argparse)."""
    for action in parser._actions:
        kind = action.type
        if callable(kind) and getattr(kind, "__module__", "").startswith("dualpath."):
            def checked(raw: str, kind: Any = kind) -> Any:
                try:
                    return kind(raw)
                except ValueError as exc:
                    raise argparse.ArgumentTypeError(str(exc)) from exc
            checked.__name__ = kind.__name__
            action.type = checked


def build_parser(only: tuple[str, ...] | None = None) -> argparse.ArgumentParser:
    """The ``dualpath`` parser: every command of the table with its help line; the arguments
    of the command ``only`` (``()``: of none; default: of every command, which imports every
    command's module)."""
    listing = "\n".join(f"  {' '.join(path):<20} {command.help}"
                        for path, command in COMMANDS.items())
    parser = argparse.ArgumentParser(prog="dualpath", description=__doc__.splitlines()[0],
                                     epilog=f"every command:\n{listing}",
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    groups: dict[tuple[str, ...], Any] = {
        (): parser.add_subparsers(dest="_command", required=True, metavar="COMMAND")}
    for path, command in COMMANDS.items():
        for depth in range(1, len(path)):
            group = path[:depth]
            if group not in groups:
                holder = groups[group[:-1]].add_parser(group[-1], help=GROUPS[group])
                groups[group] = holder.add_subparsers(dest=f"_command{depth}", required=True,
                                                      metavar="COMMAND")
        sub = groups[path[:-1]].add_parser(path[-1], help=command.help,
                                           description=command.help)
        sub.set_defaults(_path=path)
        if only is None or only == path:
            _function(path, "add_arguments")(sub)
            _typed_errors(sub)
    return parser


def _function(path: tuple[str, ...], name: str) -> Callable[..., Any]:
    """The command's ``add_arguments`` or ``run`` (its module is imported now)."""
    command = COMMANDS[path]
    return getattr(importlib.import_module(command.module), command.prefix + name)


def options_type(path: tuple[str, ...]) -> type:
    """The options dataclass of a command: the annotation of its ``run``."""
    return get_type_hints(_function(path, "run"))["options"]


def to_options(path: tuple[str, ...], parsed: dict[str, Any]) -> Any:
    """The command's options dataclass of its parsed arguments (dests are field names; lists
    become tuples). A dest that is not a field is a programming error, named."""
    kind = options_type(path)
    names = {f.name for f in fields(kind)}
    values = {k: tuple(v) if isinstance(v, list) else v for k, v in parsed.items()
              if not k.startswith("_")}
    unknown = sorted(set(values) - names)
    if unknown:
        raise TypeError(f"{COMMANDS[path].module}: arguments {unknown} are not fields of "
                        f"{kind.__name__}")
    return kind(**values)


def parse(argv: list[str]) -> tuple[tuple[str, ...], Any]:
    """The command ``argv`` names and its options (nothing runs)."""
    namespace = build_parser(_command_path(argv) or ()).parse_args(argv)
    path = namespace._path
    return path, to_options(path, vars(namespace))


def main(argv: list[str] | None = None) -> int:
    """Entry point; bad input ends with a one-line error and exit status 2."""
    argv = sys.argv[1:] if argv is None else list(argv)
    namespace = build_parser(_command_path(argv) or ()).parse_args(argv)
    try:  # an options dataclass checks its values too
        options = to_options(namespace._path, vars(namespace))
        return _function(namespace._path, "run")(options)
    except (DualPathError, ValueError) as exc:
        print(f"dualpath: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
