"""The session check of tests/conftest.py: a pytest run that leaves a file in /dev/shm fails,
naming it; one that leaves nothing passes, and a file that another run's live process holds
is not counted against it. Each case is a real pytest run in a child process."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

CONFTEST = Path(__file__).with_name("conftest.py")
SHM = Path("/dev/shm")

# serial: each inner run checks /dev/shm, where a parallel worker's files come and go
pytestmark = [pytest.mark.skipif(not SHM.is_dir(), reason="no /dev/shm"), pytest.mark.serial]

LEAKY = """
from pathlib import Path
def test_leaks():
    Path("{path}").write_bytes(b"x" * 4096)
"""
TIDY = """
from pathlib import Path
def test_tidy():
    path = Path("{path}")
    path.write_bytes(b"x")
    path.unlink()
"""
# Another run's process: creates a file while the checked run goes on, and holds it.
OTHER_RUN = """
import os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600)
print("holding", flush=True)
time.sleep(600)
"""
WAIT_FOR_OTHER = """
import subprocess, sys
def test_another_run_makes_a_file_meanwhile():
    proc = subprocess.Popen([sys.executable, "-c", {code!r}, "{path}"], stdout=subprocess.PIPE,
                            text=True, env={{"PATH": "/usr/bin:/bin"}}, start_new_session=True)
    assert proc.stdout.readline().strip() == "holding"
    open("{pid_file}", "w").write(str(proc.pid))
"""


def run_pytest(folder: Path, test: str) -> subprocess.CompletedProcess[str]:
    """pytest on ``test`` (a module's text) with this suite's conftest, in ``folder``."""
    shutil.copy(CONFTEST, folder / "conftest.py")
    (folder / "test_inner.py").write_text(test)
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "--rootdir", str(folder), str(folder)], cwd=folder, text=True,
                          capture_output=True, timeout=300)


@pytest.fixture
def shm_name(tmp_path):
    path = SHM / f"dualpath-check-{tmp_path.name}"
    yield path
    path.unlink(missing_ok=True)


def test_a_run_that_leaves_a_file_in_dev_shm_fails_naming_it(tmp_path, shm_name):
    done = run_pytest(tmp_path, LEAKY.format(path=shm_name))
    assert done.returncode != 0, done.stdout
    assert "1 passed, 1 error" in done.stdout
    assert "/dev/shm holds 1 more files after the tests than before" in done.stdout
    assert f"{shm_name.name} (4,096 bytes; no process holds it)" in done.stdout


def test_a_tidy_run_passes(tmp_path, shm_name):
    done = run_pytest(tmp_path, TIDY.format(path=shm_name))
    assert done.returncode == 0, done.stdout + done.stderr


def test_a_file_another_runs_live_process_holds_is_not_counted(tmp_path, shm_name):
    import os
    import signal

    pid_file = tmp_path / "other.pid"
    done = run_pytest(tmp_path, WAIT_FOR_OTHER.format(code=OTHER_RUN, path=shm_name,
                                                      pid_file=pid_file))
    try:
        assert shm_name.exists()
        assert done.returncode == 0, done.stdout + done.stderr
    finally:
        if pid_file.exists():
            os.killpg(int(pid_file.read_text()), signal.SIGKILL)
