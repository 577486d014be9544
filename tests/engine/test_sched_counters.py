"""The scheduler counters an engine reports (``engine/sched_counters.py``)."""

from __future__ import annotations

import sys
import threading
import time

import pytest

from dualpath.engine.sched_counters import _switches, loop_thread_counters, process_wakeups

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc counters")


def test_switches_read_both_counts(tmp_path):
    status = tmp_path / "status"
    status.write_text("Name:\tpython\nvoluntary_ctxt_switches:\t12\n"
                      "nonvoluntary_ctxt_switches:\t3\n")
    assert _switches(str(status)) == (12, 3)
    status.write_text("Name:\tpython\nvoluntary_ctxt_switches:\t12\n")  # one count missing
    assert _switches(str(status)) is None
    assert _switches(str(tmp_path / "gone")) is None


@linux_only
def test_every_sleep_of_every_thread_is_a_wakeup():
    before = process_wakeups()["thread_wakeups"]
    sleeping = threading.Event()
    done = threading.Event()

    def naps() -> None:  # another thread of the process: it is counted too (while alive)
        for _ in range(20):
            time.sleep(0.001)
        sleeping.set()
        done.wait()

    thread = threading.Thread(target=naps)
    thread.start()
    sleeping.wait()
    for _ in range(20):
        time.sleep(0.001)
    after = process_wakeups()["thread_wakeups"]
    done.set()
    thread.join()
    assert after - before >= 40


@linux_only
def test_the_loop_thread_reports_its_time_and_preemptions():
    counters = loop_thread_counters()
    assert counters["loop_preemptions"] >= 0
    assert counters.get("loop_cpu_s", 0.0) >= 0  # schedstat may be off in this kernel
