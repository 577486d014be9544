"""The suite cannot hang: every test runs under pytest-timeout's default limit (pyproject.toml),
and a test past its limit fails on its own while the run goes on."""

from __future__ import annotations

import re
import subprocess
import sys
import time
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_test_has_a_default_timeout(request):
    assert request.config.pluginmanager.hasplugin("timeout"), "pytest-timeout is not installed"
    assert float(request.config.getini("timeout")) == 300
    assert request.config.getini("timeout_method") == "signal"


def test_pytest_timeout_is_pinned_where_make_test_installs_from():
    pins = (ROOT / "requirements.lock").read_text().splitlines()
    assert any(re.fullmatch(r"pytest-timeout==[0-9][0-9.]*", line) for line in pins)
    dev = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]["dev"]
    assert "pytest-timeout" in dev
    assert "-r requirements.lock" in (ROOT / "Makefile").read_text()


HANGS = '''
import time


def test_hangs():
    time.sleep(120)


def test_after_the_hang():
    pass
'''


def test_a_hanging_test_fails_at_its_limit_and_the_run_goes_on(tmp_path):
    (tmp_path / "test_hang.py").write_text(HANGS)
    start = time.monotonic()
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-c",
         str(ROOT / "pyproject.toml"), "--rootdir", str(tmp_path), "-o", "timeout=3",
         str(tmp_path / "test_hang.py")],
        capture_output=True, text=True, timeout=60, cwd=tmp_path)
    took = time.monotonic() - start
    assert run.returncode == 1, run.stdout + run.stderr
    assert "1 failed, 1 passed" in run.stdout and "Timeout" in run.stdout, run.stdout
    assert took < 30
