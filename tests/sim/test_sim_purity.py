"""``import dualpath.sim`` (and its modules) pulls in no torch, engine or model code."""

import subprocess
import sys

MODULES = ["dualpath.sim", "dualpath.sim.cluster", "dualpath.sim.presets",
           "dualpath.sim.commands", "dualpath.sim.planner", "dualpath.sim.profiles"]


def test_sim_imports_no_torch_or_engine():
    code = ("import sys\n" + "".join(f"import {m}\n" for m in MODULES)
            + "bad = [m for m in sys.modules if m == 'torch' or m.startswith(('torch.', "
            "'dualpath.engine', 'dualpath.model'))]\nprint(bad)\nassert not bad, bad\n")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_sim_source_has_no_clock_reads():
    from pathlib import Path

    import dualpath.sim
    root = Path(dualpath.sim.__file__).parent
    for path in root.glob("*.py"):
        text = path.read_text()
        assert "import time" not in text and "datetime" not in text, path
