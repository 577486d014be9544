"""vLLM integration, the parts that run in our engine process: the prefill and decode workers
that drive vLLM instances (``prefill``, ``decode``), their HTTP client (``http``), and the
instances' launch plan and lifetime (``launch``, ``instance``)."""
