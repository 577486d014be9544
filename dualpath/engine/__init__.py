"""Engines: model runner, step scheduling, sampling and the single-engine loop."""
