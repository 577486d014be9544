"""``dualpath sim``: run a preset, print tables and, with ``--json``, write the full result (and
a PNG figure beside it). ``dualpath plan`` (``sim/plan_command.py``) shares the printing.

Every run ends with the regime of the paper's setting and, when a ``dualpath demo`` result is
at hand (``--demo PATH``, by default ``results/demo.json`` where it exists), the testbed's
beside it, with the testbed's own configuration simulated (``sim/shared_cores.py``): each
mode's predicted JCT beside the measured one, and the basic/dualpath ratio flagged when it
misses the measured one by more than 15%. ``dualpath sim --demo PATH`` without a preset
prints only that."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dualpath.sim.config import SimConfig
from dualpath.sim.demo_run import load_demo_run
from dualpath.sim.presets import DS660B, DS660B_QUOTA_ALL, run_preset
from dualpath.sim.regime import demo_regime, sim_regime
from dualpath.sim.shared_cores import describe, predict

DEFAULT_DEMO = "results/demo.json"  # what make demo writes

if TYPE_CHECKING:
    from argparse import ArgumentParser

    from rich.console import Console

PRESETS = ("paper-fig7", "paper-ablation", "paper-scale", "paper-online", "testbed")


@dataclass(frozen=True)
class SimOptions:
    """The ``dualpath sim`` command line (see :func:`add_arguments`)."""

    preset: str | None = None  # None: only the regimes (with --demo)
    json: str | None = None
    agents: str | None = None
    aps: str | None = None
    workload: str | None = None
    trace_dir: str | None = None
    testbed: str | None = None
    real: str | None = None
    baseline_batcher: str | None = None
    read_queue: str | None = None
    token_budget: int | None = None
    storage_eff: float | None = None
    basic_prefetch: bool = False
    lengths: str | None = None
    demo: str | None = None  # a dualpath demo JSON (None: results/demo.json where it exists)


def add_arguments(parser: ArgumentParser) -> None:
    """The options of :class:`SimOptions`."""
    parser.add_argument("--preset", default=None, choices=PRESETS,
                        help="the experiment to run (required unless --demo is given)")
    parser.add_argument("--demo", default=None,
                        help="a dualpath demo result: print the testbed's regime beside the "
                        "paper's and the testbed's own configuration simulated against it "
                        f"(default: {DEFAULT_DEMO} where it exists)")
    parser.add_argument("--json", default=None,
                        help="write the full result as JSON here, a PNG figure beside it "
                        "(the terminal gets tables of the main numbers)")
    parser.add_argument("--agents", default=None, help="comma-separated agent counts (fig7, "
                        "ablation)")
    parser.add_argument("--aps", default=None, help="comma-separated agents/s (online)")
    parser.add_argument("--workload", default=None,
                        help="32k, 48k, 64k (PAPER Table 2), tiny (testbed scale) or a real "
                        "trace: weka, mooncake (default: 64k; tiny for the testbed preset)")
    parser.add_argument("--trace-dir", default=None,
                        help="the traces folder for --workload weka/mooncake (default: "
                        "$DUALPATH_TRACES_DIR)")
    parser.add_argument("--testbed", default=None,
                        help="profile JSON from dualpath profile (the testbed preset)")
    parser.add_argument("--real", default=None, help="testbed: a dualpath bench cluster JSON "
                        "to compare the predicted dualpath/basic JCT ratio with")
    parser.add_argument("--baseline-batcher", default=None, choices=("stock", "quota"),
                        help="paper presets: how basic, layerwise and round_robin batch — the "
                        "stock chunked prefill (default, the paper's definition) or DualPath's "
                        "compute quota")
    parser.add_argument("--read-queue", default=None, choices=("fifo", "shared"),
                        help="paper presets: a node's storage reads one request at a time in "
                        "FIFO order (default) or all queued reads sharing the NIC")
    parser.add_argument("--token-budget", type=int, default=None,
                        help="paper presets: new tokens per PE forward of the stock batcher "
                        "(default 8192)")
    parser.add_argument("--storage-eff", type=float, default=None,
                        help="paper presets: storage goodput as a fraction of the storage "
                        "NIC's line rate (default 0.8, 3FS's published peak)")
    parser.add_argument("--basic-prefetch", action="store_true",
                        help="paper presets: basic reads KV into PE HBM ahead of its forward as "
                        "far as HBM allows, instead of reading each forward's KV before it")
    parser.add_argument("--lengths", default=None, choices=("same", "varied"),
                        help="paper presets: every agent replays one trajectory (default) or "
                        "trajectories of varied length with Table 2's means")


def run(options: SimOptions) -> int:
    """``dualpath sim``."""
    from dualpath.workloads.trace_files import ENV_DIR

    if options.trace_dir:  # where the weka and mooncake workloads are read from
        os.environ[ENV_DIR] = options.trace_dir
    run_sim(options)
    return 0


def _write(path: str | None, result: dict[str, Any]) -> None:
    """Write ``result`` as JSON at ``path`` and its figure beside it (same name, ``.png``)."""
    if not path:
        return
    from dualpath.sim.plots import plot_result, png_path_for

    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(result, indent=2, default=str) + "\n")
    plot_result(result, png_path_for(path))


def _console() -> Console:
    """A rich console; 132 columns when stdout is not a terminal, so that tables piped to a
    file or a log are not squeezed into 80."""
    from rich.console import Console

    console = Console()
    return console if console.is_terminal else Console(width=132)


def _print(console: Console, tables: list[Any], json_path: str | None,
           lines: tuple[str, ...] = ()) -> None:
    """Print ``tables`` (each caption as a line under its table, so that it is not wrapped to
    the table's width) and ``lines``, then where the JSON went (or how to get it)."""
    for table in tables:
        caption, table.caption = table.caption, None
        console.print(table)
        if caption:
            console.print(caption, style="dim")
    for line in lines:
        console.print(line)
    if json_path:
        from dualpath.sim.plots import png_path_for

        console.print(f"wrote {json_path} and {png_path_for(json_path)}")
    else:
        console.print("[dim](--json PATH writes the full result and a PNG figure)[/]")


# ``dualpath sim`` options that change the DS 660B configuration of the paper presets
PAPER_OPTIONS = ("baseline_batcher", "read_queue", "token_budget", "storage_eff",
                 "basic_prefetch", "lengths")


def _paper_base(options: SimOptions) -> SimConfig | None:
    """The DS 660B configuration with the :data:`PAPER_OPTIONS` given applied (``None`` when
    none is given: the presets' own base)."""
    given = [o for o in PAPER_OPTIONS if getattr(options, o) is not None
             and getattr(options, o) is not False]  # `is`: a --token-budget of 0 is given
    if not given:
        return None
    if options.preset == "testbed":
        flags = ", ".join("--" + o.replace("_", "-") for o in given)
        raise ValueError(f"{flags}: these options apply to the paper presets")
    base = DS660B_QUOTA_ALL if options.baseline_batcher == "quota" else DS660B
    if options.read_queue == "shared":
        base = replace(base, read_streams=None)
    if options.token_budget is not None:
        if options.token_budget <= 0:
            raise ValueError(f"--token-budget must be positive, got {options.token_budget}")
        base = replace(base, token_budget=options.token_budget)
    if options.storage_eff is not None:
        if not 0 < options.storage_eff <= 1:
            raise ValueError(f"--storage-eff must be in (0, 1], got {options.storage_eff}")
        base = replace(base, storage_eff=options.storage_eff)
    if options.basic_prefetch:
        base = replace(base, basic_prefetch=True)
    if options.lengths:
        base = replace(base, workload=replace(base.workload, lengths=options.lengths))
    return base


def run_sim(options: SimOptions) -> dict[str, Any]:
    """Run ``options.preset`` with a rich progress bar (if given); print its tables, the
    regimes and the testbed's prediction; with ``--json``, write the result."""
    from dualpath.sim.report import sim_tables

    if options.preset is None:
        if options.demo is None:
            raise ValueError("--preset is required (or --demo PATH alone: the regimes only)")
        given = [f for f in ("agents", "aps", "workload", "testbed", "real", *PAPER_OPTIONS)
                 if getattr(options, f) not in (None, False)]
        if given:
            flags = ", ".join("--" + f.replace("_", "-") for f in given)
            raise ValueError(f"{flags}: these options go with a --preset")
    testbed, testbed_lines = _testbed(options.demo)  # a bad --demo fails before any run
    result = _run_preset(options) if options.preset else {"preset": None}
    result["regime"] = {"paper": sim_regime(DS660B)}
    if testbed is not None:
        result["regime"]["testbed"] = testbed
    if options.preset:
        _write(options.json, result)
    elif options.json:
        Path(options.json).parent.mkdir(parents=True, exist_ok=True)
        Path(options.json).write_text(json.dumps(result, indent=2, default=str) + "\n")
    console = _console()
    if options.preset:
        _print(console, sim_tables(result), options.json)
    for line in (_paper_line(result), *testbed_lines):
        console.print(line)
    return result


def _testbed(demo: str | None) -> tuple[dict[str, Any] | None, list[str]]:
    """The testbed's regime and prediction (``result.regime.testbed``) from ``--demo``
    (ValueError when it cannot be read), else from :data:`DEFAULT_DEMO` where it exists and
    reads, and the lines to print (else None and a line saying why)."""
    path = demo or DEFAULT_DEMO
    if not Path(path).is_file():
        if demo is not None:
            raise ValueError(f"--demo {demo}: no such file")
        return None, [f"[dim]regime of the testbed: no {DEFAULT_DEMO} here (make demo writes "
                      "it; --demo PATH reads another)[/]"]
    try:
        run = load_demo_run(path)
        regime, prediction = demo_regime(run), predict(run)
    except ValueError as exc:
        if demo is not None:
            raise
        return None, [f"[yellow]regime of the testbed: {exc}[/]"]
    return {**regime, "prediction": prediction.as_dict()}, [
        f"regime of the testbed ({run.path}: {run.describe()}; {run.cpu_model}): "
        f"{regime['line']}", *describe(prediction)]


def _paper_line(result: dict[str, Any]) -> str:
    """The paper's regime, as printed."""
    return (f"regime of the paper's setting (DeepSeek-V3.2, 64K agents, Hopper nodes): "
            f"{result['regime']['paper']['line']} (h: hit rate; κ: loading a token over one "
            "storage NIC / recomputing it; ρ: Basic's storage demand / supply)")


def _run_preset(options: SimOptions) -> dict[str, Any]:
    """Run ``options.preset`` (its options checked) with a rich progress bar."""
    from rich.progress import Progress

    assert options.preset is not None
    kwargs: dict[str, Any] = {}
    if options.workload:
        kwargs["workload"] = options.workload
    if (options.preset == "testbed") != bool(options.testbed):
        raise ValueError("--testbed PROFILE.json goes with --preset testbed (and only with it)")
    if options.testbed:
        kwargs["profile"] = options.testbed
    if options.real:
        if options.preset != "testbed":
            raise ValueError("--real goes with --preset testbed")
        kwargs["real"] = options.real
    base = _paper_base(options)
    if base is not None:
        kwargs["base"] = base
    if options.agents and options.preset not in ("paper-fig7", "paper-ablation", "testbed"):
        raise ValueError(f"--agents applies to paper-fig7 and paper-ablation, not {options.preset}")
    if options.aps and options.preset != "paper-online":
        raise ValueError(f"--aps applies to paper-online, not {options.preset}")
    try:
        if options.agents:
            kwargs["agents"] = tuple(int(a) for a in options.agents.split(","))
        if options.aps:
            kwargs["aps"] = tuple(float(a) for a in options.aps.split(","))
    except ValueError as exc:
        raise ValueError(f"--agents/--aps must be comma-separated numbers: {exc}") from None
    with Progress(transient=True) as bar:
        tasks: dict[str, Any] = {}

        def progress(label: str, done: int, total: int) -> None:
            if label not in tasks:
                tasks[label] = bar.add_task(label, total=total)
            bar.update(tasks[label], completed=done)

        return run_preset(options.preset, progress=progress, **kwargs)
