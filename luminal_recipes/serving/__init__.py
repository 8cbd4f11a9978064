"""`luminal-recipe serve`: an OpenAI-compatible HTTP server for a recipe (docs/serving.md).

``command`` (the CLI command), ``app`` (the FastAPI application), ``backends`` (the one adapter to the model
APIs), ``batching`` (the queue and worker between requests and the model), ``routes_*`` (one module per kind of
model, and the common routes), ``limits``, ``errors`` (OpenAI-style error objects), ``security`` (API key, body
size), ``metrics`` (Prometheus)."""
