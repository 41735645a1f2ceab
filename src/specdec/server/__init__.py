"""OpenAI-compatible HTTP server for specdec (needs the `server` extra: fastapi, uvicorn, prometheus-client)."""

from __future__ import annotations


def create_app(*args, **kwargs):
    """Build the FastAPI app; see specdec.server.app.create_app."""
    from specdec.server.app import create_app as _create_app

    return _create_app(*args, **kwargs)


__all__ = ["create_app"]
