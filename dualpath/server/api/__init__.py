"""The OpenAI-compatible HTTP API: app, routes and their parts."""
