"""The OpenAI-compatible server: `create_app(pool, ServerConfig(...))`, run by `specrouter serve`.

Needs the `serve` extra (fastapi, uvicorn, prometheus-client)."""

from specrouter.server.app import ServerConfig, create_app

__all__ = ["ServerConfig", "create_app"]
