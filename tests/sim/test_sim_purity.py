"""``import dualpath.sim`` (and its modules) pulls in no torch, engine or model code;
the figure module loads matplotlib only when drawing, the trace loader is stdlib only."""

import subprocess
import sys

import pytest

MODULES = ["dualpath.sim", "dualpath.sim.cluster", "dualpath.sim.presets",
           "dualpath.sim.commands", "dualpath.sim.planner", "dualpath.sim.profiles",
           "dualpath.sim.online", "dualpath.sim.hops", "dualpath.sim.links",
           "dualpath.sim.reads", "dualpath.sim.plan_command", "dualpath.sim.regime",
           "dualpath.sim.demo_run", "dualpath.sim.shared_cores"]
ENGINE = ("torch", "dualpath.engine", "dualpath.model")


@pytest.mark.parametrize(("modules", "forbidden"), [
    (MODULES, ENGINE),
    (["dualpath.sim.plots"], (*ENGINE, "matplotlib")),
    (["dualpath.workloads.sim_traces"], (*ENGINE, "numpy", "socket")),
])
def test_sim_imports_stay_light(modules, forbidden):
    code = ("import sys\n" + "".join(f"import {m}\n" for m in modules)
            + f"bad = [m for m in sys.modules if any(m == f or m.startswith(f + '.') "
            f"for f in {forbidden!r})]\nassert not bad, bad\n")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_sim_source_has_no_clock_reads():
    from pathlib import Path

    import dualpath.sim
    root = Path(dualpath.sim.__file__).parent
    for path in root.glob("*.py"):
        text = path.read_text()
        assert "import time" not in text and "datetime" not in text, path
