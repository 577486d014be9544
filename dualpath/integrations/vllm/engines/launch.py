"""How a vLLM instance is told to use dualpath's KV connector (imports neither vLLM nor torch:
the engine processes that start or drive vLLM instances run in dualpath's own environment).

``transfer_config`` is the ``--kv-transfer-config`` of an instance; its
``kv_connector_extra_config`` is what
``dualpath.integrations.vllm.connector.DualPathConnector`` reads:

- ``store`` (the backend name) and any other ``StorageConfig`` field (``root``, caps, ...);
- ``model_id``: the checkpoint's fingerprint (``dualpath.model.spec.model_id``), when the
  instance's model is not a local folder the connector can fingerprint itself;
- ``role``: ``prefill`` (loads the hit, pushes the prompt's KV to a decode engine's buffer
  layer by layer), ``decode`` (copies a prompt's KV from its node's buffer, persists full
  blocks) or ``both`` (one instance on the store: PE-path loads and full-block saves);
- ``host``: the address its Mooncake transfer engine advertises (prefill role);
- ``traffic``: ``TrafficConfig`` fields (compute-NIC caps, lane weights) for its transfers;
- ``open_listeners``: leave its Mooncake listeners unfenced (``transfer_open_listeners``).

``instance_environ`` is the environment an engine hands its instance: its own, without our
secrets or anything named like a secret (``SECRET_NAME``), plus the instance's API key
(``API_KEY_ENV``: vLLM takes ``--api-key`` from there, so it is on no command line).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Any

from dualpath.config import StorageConfig, TrafficConfig
from dualpath.vocab import Role

CONNECTOR = "DualPathConnector"
MODULE = "dualpath.integrations.vllm.connector"  # the module vLLM loads the connector from
BOTH = "both"  # the role of a lone instance on the store (no decode engine)
_KV_ROLES = {Role.PREFILL.value: "kv_producer", Role.DECODE.value: "kv_consumer",
             BOTH: "kv_both"}
API_KEY_ENV = "VLLM_API_KEY"  # vLLM's --api-key, from the environment
# names an instance never inherits: DUALPATH_ENGINE_KEY, DUALPATH_API_KEY, HF_TOKEN, ...
SECRET_NAME = re.compile(r"(KEY|SECRET|TOKEN|PASSWORD|PASSWD|CREDENTIALS?)(_ID)?$",
                         re.IGNORECASE)


def instance_environ(environ: Mapping[str, str], api_key: str = "") -> dict[str, str]:
    """``environ`` without the names that look secret (``SECRET_NAME``), with the instance's
    ``api_key`` as ``VLLM_API_KEY`` when there is one."""
    env = {name: value for name, value in environ.items() if not SECRET_NAME.search(name)}
    if api_key:
        env[API_KEY_ENV] = api_key
    return env


def transfer_config(store_root: str | Path | None = None, *, store: str = "fs",
                    storage: StorageConfig | None = None, role: str = BOTH,
                    traffic: TrafficConfig | None = None, **extra: Any) -> dict[str, Any]:
    """The ``kv_transfer_config`` that loads the connector in ``role`` on a store: ``storage``
    (every field), or ``store`` at ``store_root``; ``extra``: more connector keys (module
    docstring). Load failures are recomputed (vLLM's default, ``fail``, fails the request)."""
    if role not in _KV_ROLES:
        raise ValueError(f"role must be one of {', '.join(_KV_ROLES)}, got {role!r}")
    if storage is not None:
        values: dict[str, Any] = {k: v for k, v in asdict(storage).items() if k != "backend"}
        values["store"] = storage.backend
    else:
        values = {"store": store, "root": str(store_root)}
    values["role"] = role
    if traffic is not None:
        values["traffic"] = asdict(traffic)
    return {"kv_connector": CONNECTOR, "kv_connector_module_path": MODULE,
            "kv_role": _KV_ROLES[role], "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {**values, **extra}}
