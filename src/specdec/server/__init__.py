"""OpenAI-compatible HTTP server for specdec (needs the `server` extra: fastapi, uvicorn, prometheus-client)."""

from specdec.server.app import create_app

__all__ = ["create_app"]
