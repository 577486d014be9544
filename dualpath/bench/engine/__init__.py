"""``dualpath bench engine``: our single-engine runner against peers, each in its own process."""
