"""The OpenAI-compatible server: `create_app(pool, ServerConfig(...))`, run by `specrouter serve`.

Needs the `serve` extra (fastapi, uvicorn, prometheus-client)."""

from specrouter.config import ServerConfig
from specrouter.server.app import create_app

__all__ = ["ServerConfig", "create_app"]
