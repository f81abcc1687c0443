"""Serving requests with deployed models: the one home every door uses (the
gateway, the REST generate action, the browser's chat, embed and rerank).
It reads the database and talks to Triton through triton_server.client; it
knows no door's request or answer shapes."""
