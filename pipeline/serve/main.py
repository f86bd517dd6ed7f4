"""Building and running the service: settings from the environment, the file store, the
background work, and uvicorn on the given address (loopback only without API keys)."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping

from ..batch import Batches, BatchSettings, Files
from ..client import Pipeline
from ..config import load_settings
from ..errors import ConfigError
from ..redact import redact_url
from .app import Service, create_app
from .auth import LOOPBACK, ApiKeys
from .background import Background

log = logging.getLogger("pipeline.serve")


def build_service(env: Mapping[str, str] | None = None) -> Service:
    """The service from ``PIPELINE_*`` variables (``PIPELINE_API_KEYS``,
    ``PIPELINE_FILES_DIR``, the pipeline's own). Its background work is not started."""
    env = dict(os.environ if env is None else env)
    settings = load_settings(env)
    pipeline = Pipeline(settings)
    bsettings = BatchSettings.from_env(settings, env)
    files = Files(pipeline.store, bsettings)
    batches = Batches(pipeline, bsettings, files)
    if bsettings.queue not in settings.queues:
        raise ConfigError(f"PIPELINE_BATCH_QUEUE: no queue named {bsettings.queue!r}")
    keys_path = env.get("PIPELINE_API_KEYS")
    keys = ApiKeys.load(keys_path) if keys_path else None
    return Service(batches, files, keys, Background(batches))


def serve(host: str = "127.0.0.1", port: int = 8080, log_level: str = "info") -> None:
    """Run the service until interrupted. Without ``PIPELINE_API_KEYS`` it binds only to a
    loopback address (ConfigError otherwise)."""
    import uvicorn

    svc = build_service()
    if svc.keys is None and host not in LOOPBACK:
        raise ConfigError(
            f"refusing to serve on {host} without API keys: set PIPELINE_API_KEYS to a file of "
            "'key tenant' lines, or bind to 127.0.0.1"
        )
    settings = svc.batches.pipeline.settings
    log.info(
        "serving on %s:%d (redis %s, files in %s, %s)",
        host,
        port,
        redact_url(settings.redis_url),
        svc.batches.settings.files_dir,
        f"{len(svc.keys.tenants)} API key(s)" if svc.keys else "no API keys: loopback only",
    )
    svc.background.start()
    try:
        uvicorn.run(create_app(svc), host=host, port=port, log_level=log_level)
    finally:
        svc.background.stop()
