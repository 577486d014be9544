"""The peers' environment (``make peers``) holds dualpath beside vLLM: a connector inside vLLM's
processes can import dualpath's pure parts, the storage client and Mooncake, over vLLM's one
torch (issue 36). Skipped where ``make peers`` has not run."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from dualpath.bench.engine.compare import DEFAULT_PEERS_PYTHON

ROOT = Path(__file__).resolve().parents[2]
PEERS_PYTHON = ROOT / DEFAULT_PEERS_PYTHON
TORCH_PIN = "2.13.0"

# Run by the peers' python: what imports, from where, and every torch distribution it sees.
PROBE = """
import importlib.metadata as md, json, sys
import dualpath, dualpath.kv.hashing, dualpath.protocol, dualpath.storage, dualpath.storage.client
import dualpath.transfer.mooncake, mooncake, mooncake.engine, torch, vllm
space = dualpath.kv.hashing.KeySpace("m", "l", 4)
print(json.dumps({
    "dualpath": dualpath.__file__, "torch": torch.__file__, "prefix": sys.prefix,
    "vllm": vllm.__version__, "keys": len(space.keys(list(range(9)))),
    "torches": sorted(d.version for d in md.distributions()
                      if (d.metadata["Name"] or "").lower() == "torch"),
}))
"""


def peers_python(path: Path = PEERS_PYTHON) -> Path:
    """``path`` when it is an interpreter; else the calling test is skipped."""
    if not os.access(path, os.X_OK):
        pytest.skip(f"no peers' environment ({path} is missing: make peers)")
    return path


def test_missing_peers_environment_skips_the_test(tmp_path):
    with pytest.raises(pytest.skip.Exception, match="make peers"):
        peers_python(tmp_path / "no-such-venv" / "bin" / "python")


def test_peers_environment_imports_dualpath_mooncake_and_one_torch():
    python = peers_python()
    done = subprocess.run([str(python), "-c", PROBE], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert Path(found["dualpath"]).resolve().is_relative_to(ROOT / "dualpath")  # this checkout
    assert Path(found["torch"]).resolve().is_relative_to(Path(found["prefix"]).resolve())
    assert found["keys"] == 2  # two full blocks of four in nine tokens
    assert found["vllm"].startswith("0.32.")
    assert [v.split("+")[0] for v in found["torches"]] == [TORCH_PIN]
