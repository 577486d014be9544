"""Decoder-only Llama-family model: spec, layers, paged attention, forward, weight loading."""
