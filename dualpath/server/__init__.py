"""The router (global scheduling of requests over engines) and the local cluster launcher."""
