"""``/health``'s answer: whether the cluster serves, and which engines a client may see."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from dualpath.server.router.client import Router
from dualpath.vocab import Role

# A router thread that cannot answer /health's query this fast is stuck: its loop polls every
# 5 ms, and its own queries wait 10 s (a probe thread of its own, one probe at a time).
HEALTH_TIMEOUT_S = 2.0


def shown(engines: list[dict[str, Any]], unauthenticated: bool) -> list[dict[str, Any]]:
    """The engines as /health shows them: no transfer endpoint to an unauthenticated client."""
    if not unauthenticated:
        return engines
    return [{k: v for k, v in e.items() if k != "endpoint"} for e in engines]


class HealthProbe:
    """Whether the cluster serves: the router thread runs and answers, and every role has an
    engine heard from within the engine timeout. The router's queries block (10 s on a stuck
    thread), so they run on a thread of their own, one at a time, and /health waits at most
    ``HEALTH_TIMEOUT_S`` for them."""

    def __init__(self, router: Router) -> None:
        self.router = router
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="health")
        self._asking: asyncio.Future[dict[str, float]] | None = None

    async def check(self) -> tuple[str | None, list[dict[str, Any]]]:
        """What keeps the cluster from serving (None: nothing), and its engines."""
        if not self.router.alive:
            return "the router thread is not running", []
        if self._asking is None or self._asking.done():
            self._asking = asyncio.get_running_loop().run_in_executor(
                self._pool, self.router.heartbeat_ages)
            self._asking.add_done_callback(lambda f: f.cancelled() or f.exception())
        try:
            ages = await asyncio.wait_for(asyncio.shield(self._asking), HEALTH_TIMEOUT_S)
        except Exception:  # TimeoutError: stuck; or the router stopped meanwhile
            return f"the router thread does not answer within {HEALTH_TIMEOUT_S:g} s", []
        timeout_s = self.router.config.engine_timeout_s
        engines = sorted(({"name": e.name, "role": e.role, "node_id": e.node_id,
                           "endpoint": e.endpoint, "heartbeat_age_s": round(ages[e.name], 3)}
                          for e in self.router.engines.values() if e.name in ages),
                         key=lambda e: e["name"])
        live = {e["role"] for e in engines if e["heartbeat_age_s"] < timeout_s}
        missing = [role for role in Role if role not in live]
        if missing:
            return f"no live {' or '.join(missing)} engine", engines
        return None, engines
