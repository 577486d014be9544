"""``make gpu-check``: the GPU acceptance in one command, on a fresh machine with no network.

Builds random-weight models of real architectures on the spot (``model/dummy.py``: no weights
travel), then runs, each step in its own process under the time left:

1. the HBM bandwidth (a device-to-device copy: bytes read + written / time);
2. the ``gpu``-marked tests (the CUDA hook-order test among them);
3. ``bench engine`` on CUDA, Llama-3-8B's shape in bf16, against ``transformers`` on the same
   GPU: prefill of a 4K-token prompt and decode at batches 1, 8, 32; decode at batch 1 as a
   fraction of the HBM roofline (weight bytes per step / step time / the measured bandwidth);
4. ``bench agents`` on CUDA (offline; oracle, basic, layerwise, dualpath; 1 PE + 2 DE on the
   one GPU) for SmolLM2-135M's shape and for Llama-3-8B's in bf16.

It prints one table with every ratio beside its floor (the issue's acceptance) and writes
``results/gpu_check.json`` (top-level ``summary``), with what it skipped and why: no CUDA, a
step that failed (its log's tail), or a step that did not fit in the time left. The whole
check is meant to finish in 8 minutes on an H200 (``--budget-s``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.table import Table

from dualpath.commands.args import names

if TYPE_CHECKING:
    from argparse import ArgumentParser

FLOORS = {
    "layerwise_vs_basic": 1.0,
    "dualpath_vs_basic": 1.5,
    "dualpath_of_oracle": 0.85,
    "decode_b1_of_roofline": 0.6,
    "vs_transformers": 1.0,
}
AGENT_MODES = ("oracle", "basic", "layerwise", "dualpath")
GPU_TEST_MARKER = "mark.gpu"


@dataclass(frozen=True)
class CheckOptions:
    """What the check runs and within how long."""

    budget_s: float = 480.0
    json_path: str = "results/gpu_check.json"
    work_dir: str | None = None
    skip: tuple[str, ...] = ()  # steps not to run: tests, engine, agents-smollm2, agents-llama3
    # bench agents workloads: (agents, turns, token-count divisor) per shape
    smollm2_workload: tuple[int, int, float] = (16, 4, 8.0)
    llama3_workload: tuple[int, int, float] = (8, 4, 16.0)
    llama3_layers: int | None = None  # None: all 32
    engine_repeats: int = 2


@dataclass
class StepResult:
    """One step: passed/failed/skipped, its time, its figures and, failing, why."""

    name: str
    status: str = "skipped"
    seconds: float = 0.0
    figures: dict[str, Any] = field(default_factory=dict)
    reason: str = ""


# --- figures from the benches' JSON (pure: tested without a GPU) ---------------------------

def agents_ratios(summary: dict[str, Any]) -> dict[str, float]:
    """``bench agents`` summary → the ladder's ratios: each mode vs basic (basic JCT / its
    JCT) and dualpath as a fraction of the oracle (oracle JCT / dualpath JCT)."""
    jct = summary.get("jct_s") or {}
    out: dict[str, float] = {}
    basic = jct.get("basic")
    for mode in ("layerwise", "dualpath", "oracle"):
        if basic and jct.get(mode):
            out[f"{mode}_vs_basic"] = basic / jct[mode]
    if jct.get("oracle") and jct.get("dualpath"):
        out["dualpath_of_oracle"] = jct["oracle"] / jct["dualpath"]
    return out


def engine_ratios(result: dict[str, Any], hbm_bytes_s: float | None) -> dict[str, float]:
    """``bench engine`` result → dualpath vs transformers per figure, and decode at batch 1 as
    a fraction of the HBM roofline (weights read once per step)."""
    summary = result.get("summary", {})
    out = {k: float(v) for k, v in summary.items()
           if k.startswith(("prefill_ratio_vs_transformers", "decode_ratio_vs_transformers"))}
    ours = result.get("measured", {}).get("dualpath", {})
    weights_mb = ours.get("weights_mb")
    b1 = (ours.get("decode_tok_s") or {}).get("1", {}).get("median")
    if weights_mb and b1:
        weight_bytes = weights_mb * 2**20
        out["decode_b1_weight_bytes_s"] = weight_bytes * b1
        if hbm_bytes_s:
            out["decode_b1_of_roofline"] = weight_bytes * b1 / hbm_bytes_s
    return out


def floor_of(name: str) -> float | None:
    """The floor a figure must reach (every ratio against transformers shares one), or None."""
    if "vs_transformers" in name:
        return FLOORS["vs_transformers"]
    return next((f for key, f in FLOORS.items() if name.startswith(key)), None)


def verdicts(figures: dict[str, float]) -> dict[str, bool]:
    """Each figure with a floor: whether it meets it."""
    return {name: value >= floor for name, value in figures.items()
            if (floor := floor_of(name)) is not None}


def gpu_test_files(root: Path) -> list[str]:
    """Test files that hold a ``gpu``-marked test (collecting only those keeps the check off
    the suite's CPU-only dependencies)."""
    return sorted(str(p.relative_to(root)) for p in (root / "tests").rglob("test_*.py")
                  if GPU_TEST_MARKER in p.read_text())


# --- steps ------------------------------------------------------------------------------------

def _run(cmd: list[str], log: Path, timeout_s: float) -> tuple[int, str]:
    """Run ``cmd``; its exit status (124 past ``timeout_s``) and the tail of its output."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}
    with log.open("w") as out:
        try:
            code = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, env=env,
                                  timeout=timeout_s).returncode
        except subprocess.TimeoutExpired:
            code = 124
    return code, log.read_text()[-2500:]


def hbm_bandwidth() -> dict[str, Any]:
    """A 4 GiB device-to-device copy, timed with CUDA events (best of 5): bytes read and
    written per second, and the device's name."""
    import torch

    src = torch.empty(2**31, dtype=torch.uint16, device="cuda")
    dst = torch.empty_like(src)
    best_ms = float("inf")
    for _ in range(6):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        best_ms = min(best_ms, start.elapsed_time(end))
    moved = 2 * src.numel() * src.element_size()
    del src, dst
    torch.cuda.empty_cache()
    return {"device": torch.cuda.get_device_name(), "hbm_bytes_s": moved / (best_ms / 1e3),
            "method": "device-to-device copy of 4 GiB, bytes read + written, best of 6"}


class GpuCheck:
    """Runs the steps in order under one deadline, then reports."""

    def __init__(self, options: CheckOptions, root: Path) -> None:
        self.options = options
        self.root = root
        self.deadline_s = time.monotonic() + options.budget_s
        self.work = Path(options.work_dir or tempfile.mkdtemp(prefix="dualpath-gpu-check-"))
        self.work.mkdir(parents=True, exist_ok=True)
        self.steps: list[StepResult] = []
        self.hbm: dict[str, Any] = {}

    def left_s(self) -> float:
        return self.deadline_s - time.monotonic()

    def run(self) -> dict[str, Any]:
        """Every step, the table, the JSON; returns the result."""
        import torch

        console = Console()
        if not torch.cuda.is_available():
            self.steps.append(StepResult("all", reason="no CUDA device: nothing to check"))
            return self._finish(console)
        self.hbm = hbm_bandwidth()
        console.print(f"{self.hbm['device']}: HBM {self.hbm['hbm_bytes_s'] / 1e12:.2f} TB/s "
                      f"(copy), torch {torch.__version__}")
        models = self._models()
        plan = [("tests", 150.0, self._tests),
                ("engine", 150.0, lambda t: self._engine(models["llama-3-8b"], t)),
                ("agents-smollm2", 120.0,
                 lambda t: self._agents(models["smollm2-135m"], "float32",
                                        self.options.smollm2_workload, t)),
                ("agents-llama3", 150.0,
                 lambda t: self._agents(models["llama-3-8b"], "bfloat16",
                                        self.options.llama3_workload, t))]
        for name, want_s, step in plan:
            result = StepResult(name)
            if name in self.options.skip:
                result.reason = "skipped by --skip"
            elif self.left_s() < min(want_s, 60.0):
                result.reason = f"{self.left_s():.0f} s left of the budget"
            else:
                started = time.monotonic()
                console.print(f"[bold]{name}[/bold] ({self.left_s():.0f} s left)")
                step(result)
                result.seconds = time.monotonic() - started
            self.steps.append(result)
        return self._finish(console)

    def _models(self) -> dict[str, Path]:
        from dualpath.model.dummy import write_dummy_model

        layers = {} if self.options.llama3_layers is None else {
            "num_hidden_layers": self.options.llama3_layers}
        return {"smollm2-135m": write_dummy_model(self.work / "smollm2-135m", "smollm2-135m"),
                "llama-3-8b": write_dummy_model(self.work / "llama-3-8b", "llama-3-8b",
                                                **layers)}

    def _budget(self, want_s: float) -> float:
        return max(30.0, min(want_s, self.left_s() - 10))

    def _tests(self, result: StepResult) -> None:
        files = gpu_test_files(self.root)
        cmd = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider",
               "-o", "addopts=", *files]
        code, tail = _run(cmd, self.work / "tests.log", self._budget(200))
        result.status = "passed" if code == 0 else "failed"
        result.figures = {"files": files, "summary_line": tail.strip().splitlines()[-1:]}
        if code:
            result.reason = tail

    def _engine(self, model: Path, result: StepResult) -> None:
        out = self.work / "engine.json"
        cmd = [sys.executable, "-m", "dualpath.cli", "bench", "engine", "--json", str(out),
               "--model", str(model), "--dtype", "bfloat16", "--device", "cuda",
               "--prompt-tokens", "4096", "--decode-batches", "1,8,32",
               "--decode-tokens", "64", "--decode-prompt-tokens", "128",
               "--repeats", str(self.options.engine_repeats), "--against", "transformers"]
        code, tail = _run(cmd, self.work / "engine.log", self._budget(180))
        if code or not out.is_file():
            result.status, result.reason = "failed", tail
            return
        result.figures = engine_ratios(json.loads(out.read_text()), self.hbm.get("hbm_bytes_s"))
        result.status = "passed" if all(verdicts(result.figures).values()) else "below floor"

    def _agents(self, model: Path, dtype: str, workload: tuple[int, int, float],
                result: StepResult) -> None:
        agents, turns, scale = workload
        out = self.work / f"agents-{model.name}.json"
        cmd = [sys.executable, "-m", "dualpath.cli", "bench", "agents", "--model", str(model),
               "--dtype", dtype, "--device", "cuda", "--modes", ",".join(AGENT_MODES),
               "--online-modes", "", "--agents", str(agents), "--turns", str(turns),
               "--scale", str(scale), "--json", str(out), "--dir", str(self.work / model.name)]
        code, tail = _run(cmd, self.work / f"agents-{model.name}.log", self._budget(200))
        if code or not out.is_file():
            result.status, result.reason = "failed", tail
            return
        summary = json.loads(out.read_text())["summary"]
        result.figures = {"jct_s": summary.get("jct_s"), **agents_ratios(summary)}
        ratios = {k: v for k, v in result.figures.items() if k != "jct_s"}
        result.status = "passed" if all(verdicts(ratios).values()) else "below floor"

    def _finish(self, console: Console) -> dict[str, Any]:
        console.print(render_table(self.steps))
        figures = {f"{s.name}.{k}": v for s in self.steps for k, v in s.figures.items()
                   if isinstance(v, float)}
        result = {"benchmark": "gpu-check", "hbm": self.hbm,
                  "steps": [vars(s) for s in self.steps], "work_dir": str(self.work),
                  "summary": {"figures": figures,
                              "meets_floor": {k: ok for k, ok in verdicts(
                                  {k.split(".", 1)[1]: v for k, v in figures.items()}).items()},
                              "statuses": {s.name: s.status for s in self.steps},
                              "skipped": {s.name: s.reason for s in self.steps
                                          if s.status == "skipped"},
                              "floors": FLOORS}}
        path = Path(self.options.json_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2, default=str) + "\n")
        console.print(f"results: {path} (logs in {self.work})")
        return result


def render_table(steps: list[StepResult]) -> Table:
    """One row per figure: its value, its floor, and whether it meets it; one per skip."""
    table = Table(title="gpu-check")
    for column in ("step", "figure", "value", "floor", "ok"):
        table.add_column(column)
    for step in steps:
        ratios = {k: v for k, v in step.figures.items() if isinstance(v, float)}
        ok = verdicts(ratios)
        for name, value in ratios.items():
            floor = floor_of(name)
            table.add_row(step.name, name, f"{value:.3g}", "" if floor is None else f"{floor}",
                          {True: "yes", False: "NO"}.get(ok.get(name), ""))
        if not ratios:
            table.add_row(step.name, step.status, "", "", (step.reason or "")[-80:])
    return table


def add_arguments(p: ArgumentParser) -> None:
    """The options: fields of :class:`CheckOptions`."""
    p.add_argument("--budget-s", type=float, default=CheckOptions.budget_s)
    p.add_argument("--json", dest="json_path", default=CheckOptions.json_path)
    p.add_argument("--dir", dest="work_dir", default=None,
                   help="work folder (models, logs), kept")
    p.add_argument("--skip", type=names, default=(), help="comma-separated steps: tests, "
                   "engine, agents-smollm2, agents-llama3")
    p.add_argument("--llama3-layers", type=int, default=None,
                   help="fewer Llama-3-8B layers (same layer shape), for a shorter check")


def run(options: CheckOptions) -> int:
    """Run the check: exit status 0 when every step passed its floors."""
    result = GpuCheck(options, Path(__file__).resolve().parents[2]).run()
    statuses = result["summary"]["statuses"]
    return 0 if statuses and all(s == "passed" for s in statuses.values()) else 1


def main(argv: list[str] | None = None) -> int:
    """``python -m dualpath.bench.gpu_check`` is ``dualpath bench gpu-check``."""
    from dualpath.cli import main as cli_main

    return cli_main(["bench", "gpu-check", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
