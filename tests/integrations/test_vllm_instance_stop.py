"""How a vLLM instance's process group is stopped, with real processes in vLLM's shape (no vLLM):
an API server (the group's leader, which exits at once on SIGTERM) and an engine core (a child in
the same group that holds a ``multiprocessing.shared_memory`` segment, as vLLM's message queues
do, and needs a moment to shut down). ``close`` lets the engine core finish (its segment is
unlinked by itself); a group that ignores SIGTERM is killed after the grace period and its
segment swept; so is the segment of an instance that was SIGKILLed before ``close``."""

from __future__ import annotations

import os
import re
import signal
import sys
import time
from pathlib import Path

from dualpath.config import ClusterConfig, VllmConfig
from dualpath.integrations.vllm.engines import instance as vllm_instance
from dualpath.integrations.vllm.engines.instance import VllmInstance, group_members, launch_plan
from tests.integrations.test_vllm_workers import fake_model, fake_python

# The engine core: a segment, SIGTERM handled by a shutdown of CORE_STOP_S (or ignored).
CORE = """
import signal, sys, time
from multiprocessing import shared_memory
segment = shared_memory.SharedMemory(create=True, size=1 << 20)
print("core segment", segment.name, flush=True)
stop = []
if sys.argv[1] == "ignore":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
else:
    signal.signal(signal.SIGTERM, lambda *a: stop.append(1))
while not stop:
    time.sleep(0.05)
time.sleep(float(sys.argv[1]))  # the engine core's shutdown
segment.close()
segment.unlink()
print("core: clean exit", flush=True)
"""
# The API server: starts the engine core in its own group, answers /health, dies on SIGTERM.
SERVER = """
import http.server, subprocess, sys
core = subprocess.Popen([sys.executable, "-c", sys.argv[2], sys.argv[3]])
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.send_header("Content-Length", "0"); self.end_headers()
    def log_message(self, *a): pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""
CORE_STOP_S = 1.5  # longer than the API server's exit, well inside STOP_GRACE_S


def start(tmp_path: Path, core_stop: str) -> VllmInstance:
    """A started fake instance whose engine core stops in ``core_stop`` seconds (``ignore``:
    never, on SIGTERM)."""
    server, core = tmp_path / "server.py", tmp_path / "core.py"
    server.write_text(SERVER)
    core.write_text(CORE)
    body = f'exec {sys.executable} {server} $PORT "$(cat {core})" {core_stop}'
    vllm = VllmConfig(python=str(fake_python(tmp_path, body)), start_timeout_s=30)
    plan = launch_plan(fake_model(tmp_path), ClusterConfig(vllm=vllm), "decode", "127.0.0.1",
                       "de1", log_path=tmp_path / "de1.vllm.log")
    instance = VllmInstance.start(plan, vllm)
    deadline = time.monotonic() + 30
    while segment_of(instance) is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert segment_of(instance) is not None, instance.log_tail()
    return instance


def segment_of(instance: VllmInstance) -> Path | None:
    """The engine core's segment, once its log names it."""
    found = re.search(r"core segment (psm_\w+)", instance.log_tail())
    return Path("/dev/shm") / found.group(1) if found else None


def test_close_lets_the_engine_core_exit_cleanly(tmp_path):
    instance = start(tmp_path, str(CORE_STOP_S))
    segment = segment_of(instance)
    assert segment.exists()
    started = time.monotonic()
    instance.close()
    assert "core: clean exit" in instance.log_tail()  # not SIGKILLed after the server's exit
    assert CORE_STOP_S <= time.monotonic() - started < vllm_instance.STOP_GRACE_S
    assert not segment.exists() and group_members(instance.proc.pid) == []


def test_a_group_deaf_to_sigterm_is_killed_after_the_grace_and_swept(tmp_path, monkeypatch):
    monkeypatch.setattr(vllm_instance, "STOP_GRACE_S", 2.0)
    instance = start(tmp_path, "ignore")
    segment = segment_of(instance)
    started = time.monotonic()
    instance.close()
    assert 2.0 <= time.monotonic() - started < 10
    assert "clean exit" not in instance.log_tail()
    assert group_members(instance.proc.pid) == []
    assert not segment.exists()  # the sweep after the kill


def test_an_instance_sigkilled_before_close_leaves_no_segment(tmp_path):
    instance = start(tmp_path, str(CORE_STOP_S))
    segment = segment_of(instance)
    os.killpg(instance.proc.pid, signal.SIGKILL)  # as the vLLM fault tests kill an instance
    instance.proc.wait(10)
    assert vllm_instance.wait_group(instance.proc, 10)
    assert segment.exists(), "the killed group left its segment (what the sweep is for)"
    instance.close()
    assert not segment.exists()
