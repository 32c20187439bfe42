"""The router: OpenAI-compatible HTTP API, KV-aware worker choice, token streams."""
