"""``pipeline serve``: OpenAI's Files and Batches API, single-request status and a batch page,
on Starlette and uvicorn (:mod:`.app`), with API keys (:mod:`.auth`), streamed uploads
(:mod:`.upload`) and the batches' background work (:mod:`.background`). Imports ``batch``,
``client``, ``store``, ``config``, ``errors`` and ``redact`` of the pipeline."""

from .app import Service, create_app
from .main import build_service, serve

__all__ = ["Service", "build_service", "create_app", "serve"]
