"""vLLM integration. This package holds what runs inside vLLM's own processes: the KV
connector (``connector``, loaded by vLLM from ``kv_connector_module_path``), its per-step plan
and the request contract (``plan``), its moves, fences and setup. ``engines/`` holds what runs
in our engine process."""
