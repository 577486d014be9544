"""Linux scheduler counters of an engine process: how its compute shares a small host's cores.

On a testbed whose engines and emulated NICs share a few cores, the prefill engine's forwards
slow down without computing more: its loop thread waits for a core (schedstat) each time a
thread that moves KV wakes up on its core and preempts it. These counters say how often:
``loop_preemptions`` (the loop thread's involuntary context switches) and ``thread_wakeups``
(voluntary context switches summed over every thread of the process: each is a sleep that a
later wake-up ends, so a data plane that hands each chunk between threads shows here). Where
the kernel keeps neither file, the counters are left out.
"""

from __future__ import annotations

import os

_TASKS = "/proc/self/task"


def loop_thread_counters() -> dict[str, float]:
    """The calling thread's time on a CPU and runnable but waiting for one (seconds,
    ``loop_cpu_s``, ``loop_runqueue_wait_s``) and how often it was preempted
    (``loop_preemptions``); empty where the kernel does not keep them."""
    out: dict[str, float] = {}
    try:
        with open("/proc/thread-self/schedstat") as f:
            run_ns, wait_ns, _ = (int(v) for v in f.read().split())
        out.update(loop_cpu_s=run_ns / 1e9, loop_runqueue_wait_s=wait_ns / 1e9)
    except (OSError, ValueError):
        pass
    switches = _switches("/proc/thread-self/status")
    if switches is not None:
        out["loop_preemptions"] = switches[1]
    return out


def process_wakeups() -> dict[str, float]:
    """``thread_wakeups``: voluntary context switches of every live thread of this process
    (threads that ended are not counted); empty where the kernel does not keep them."""
    try:
        tids = os.listdir(_TASKS)
    except OSError:
        return {}
    total = 0
    for tid in tids:
        switches = _switches(f"{_TASKS}/{tid}/status")
        total += switches[0] if switches is not None else 0
    return {"thread_wakeups": total}


def _switches(status_path: str) -> tuple[int, int] | None:
    """(voluntary, involuntary) context switches from a ``/proc`` status file, or None."""
    counts: dict[str, int] = {}
    try:
        with open(status_path) as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in ("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches"):
                    counts[key] = int(value)
    except (OSError, ValueError):
        return None
    if len(counts) < 2:
        return None
    return counts["voluntary_ctxt_switches"], counts["nonvoluntary_ctxt_switches"]
