"""Building and running the service: settings from the environment, the file store, the
background work, and uvicorn on the given address (loopback only without API keys)."""

from __future__ import annotations

import logging
import os

from ..batch import Batches, BatchSettings, Files
from ..client import Pipeline
from ..config import load_settings
from ..errors import ConfigError
from ..redact import redact_url
from .app import Service, create_app
from .auth import LOOPBACK, ApiKeys
from .background import Background
from .guard import AllowedHosts

log = logging.getLogger("pipeline.serve")


def serve(host: str = "127.0.0.1", port: int = 8080, log_level: str = "info") -> None:
    """Run the service until interrupted, set up from ``PIPELINE_*`` variables
    (``PIPELINE_API_KEYS``, ``PIPELINE_ALLOWED_HOSTS``, ``PIPELINE_FILES_DIR``, the pipeline's
    own). Without ``PIPELINE_API_KEYS`` it binds only to a loopback address (ConfigError
    otherwise) and answers only requests whose ``Host`` is a loopback name on ``port`` or
    one of ``PIPELINE_ALLOWED_HOSTS``; with keys, any ``Host`` unless that list is set."""
    import uvicorn

    settings = load_settings()
    pipeline = Pipeline(settings)
    bsettings = BatchSettings.from_env(settings)
    files = Files(pipeline.store, bsettings)
    batches = Batches(pipeline, bsettings, files)
    if bsettings.queue not in settings.queues:
        raise ConfigError(f"PIPELINE_BATCH_QUEUE: no queue named {bsettings.queue!r}")
    keys_path = os.environ.get("PIPELINE_API_KEYS")
    keys = ApiKeys.load(keys_path) if keys_path else None
    if keys is None and host not in LOOPBACK:
        raise ConfigError(
            f"refusing to serve on {host} without API keys: set PIPELINE_API_KEYS to a file of "
            "'key tenant' lines, or bind to 127.0.0.1"
        )
    # no Redis: one line naming the fix (RedisUnavailable), not a retry logged every second
    pipeline.store.client.ping()
    hosts = AllowedHosts.from_env(os.environ)
    if keys is None and hosts is None:
        hosts = AllowedHosts()  # the loopback names on this port only
    log.info(
        "serving on %s:%d (redis %s, files in %s: file store %s, %s, %s)",
        host,
        port,
        redact_url(settings.redis_url),
        bsettings.files_dir,
        files.store_id,
        f"{len(keys.tenants)} API key(s)" if keys else "no API keys: loopback only",
        "any Host" if hosts is None else "Host: loopback names and PIPELINE_ALLOWED_HOSTS",
    )
    background = Background(batches)
    try:
        uvicorn.run(
            create_app(Service(batches, files, keys, background), hosts, port or None),
            host=host,
            port=port,
            log_level=log_level,
        )
    finally:
        background.stop()
