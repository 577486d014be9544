"""KV-cache management: block hashing, the block pool and the paged device cache."""
