"""``pipeline serve``: OpenAI's Files and Batches API, request status and a batch page, on
Starlette and uvicorn (docs/batches.md)."""

from .app import Service, create_app
from .main import build_service, serve

__all__ = ["Service", "build_service", "create_app", "serve"]
