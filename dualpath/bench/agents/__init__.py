"""``dualpath bench agents``: agentic workloads through the real cluster, the whole mode ladder."""
