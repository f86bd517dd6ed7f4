"""``pipeline serve``: OpenAI's Files and Batches API, request status and a batch page, on
Starlette and uvicorn (docs/batches.md)."""

from .main import serve

__all__ = ["serve"]
