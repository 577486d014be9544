"""``python -m dualpath.bench.soak`` (``make soak``): agents against ``dualpath serve`` for
minutes, watching every process's memory, the latencies and the errors.

It starts the real stack users run, ``dualpath serve`` (a subprocess: the router and the API,
plus its engine processes, 1 prefill + 2 decode by default; the KV store in a temporary
folder), then runs ``--agents`` concurrent agents until ``--duration-s`` is over. Each agent
replays multi-turn trajectories through streamed token-id completions
(:func:`dualpath.bench.agents.http.run_agent_http`): a first prompt of ``--first-tokens`` random
ids, then turns appending ``--append-tokens`` and generating ``--gen-tokens``, each prompt being
the context so far plus the new ids (so every later turn hits the store). A trajectory whose
next turn would pass ``--max-context-tokens`` ends and the agent starts a fresh one. No turn
starts after the deadline; the turns in flight then get ``--drain-s`` to finish, and those
still running are cut off (closed, so the server aborts them): counted apart, not as errors.

Every ``--sample-s`` the resident memory (RSS) of the serve process and of each of its child
processes is sampled. The report (JSON, default ``results/soak.json``, and a PNG beside it)
has per-window latency percentiles (TTFT, turn latency) and errors, the RSS samples, and a
``summary``: requests, errors, TTFT and latency percentiles, each process's RSS after the
warm-up (the first ``--warmup-fraction`` of the run) and at the end, its growth between the two
and the largest growth; ``ok`` when there was no error and no process grew more than
``--max-rss-growth``. The exit status is 1 when not ok.
"""
