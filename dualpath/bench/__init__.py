"""Benchmarks: each writes a JSON result (with a top-level ``summary``) and a PNG beside it."""
