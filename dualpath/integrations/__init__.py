"""Adapters that bring dualpath's storage tier to other engines (each imports its engine)."""
