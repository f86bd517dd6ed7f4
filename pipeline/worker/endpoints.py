"""A queue's endpoint credentials: the API key from the variable ``api_key_env`` names (only
ever in the outgoing header) and its TLS settings, checked at start and on reload."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from functools import partial

from ..config import QueueConfig, Settings
from ..errors import ConfigError
from ..http.call import TLS
from ..http.classify import Outcome, send
from ..redact import redact_url


def queue_tls(q: QueueConfig) -> TLS | None:
    """The queue's TLS settings; None for the system's CAs and no client certificate."""
    if not (q.tls_ca_file or q.tls_cert_file or q.tls_insecure_skip_verify):
        return None
    return TLS(q.tls_ca_file, q.tls_cert_file, q.tls_key_file, q.tls_insecure_skip_verify)


def queue_send(q: QueueConfig) -> Callable[[str, str, dict[str, str], float], Outcome]:
    return partial(
        send,
        tls=queue_tls(q),
        follow_redirects=q.follow_redirects,
        max_response_bytes=q.max_response_bytes,
        redirect_origins=q.redirect_origins,
    )


def authorization(q: QueueConfig, environ: Mapping[str, str] = os.environ) -> str | None:
    if not q.api_key_env:
        return None
    return f"Bearer {environ.get(q.api_key_env, '')}"


def check_endpoints(settings: Settings, environ: Mapping[str, str] = os.environ) -> list[str]:
    """``ConfigError`` unless every queue's key variable is set and its TLS files load;
    returns warnings to log (a queue that skips certificate verification)."""
    warnings: list[str] = []
    for q in settings.queues.values():
        if q.api_key_env and not environ.get(q.api_key_env):
            raise ConfigError(
                f"queue {q.queue_name!r}: api_key_env: the environment variable "
                f"{q.api_key_env} is not set (or empty) in this worker"
            )
        tls = queue_tls(q)
        if tls is None:
            continue
        try:
            tls.context()
        except ValueError as exc:
            raise ConfigError(f"queue {q.queue_name!r}: {exc}") from None
        if tls.insecure_skip_verify:
            warnings.append(
                f"queue {q.queue_name!r}: tls_insecure_skip_verify is on: the certificate of "
                f"{redact_url(q.igw_base_url)} is not verified (anyone on the path can read "
                "the requests)"
            )
    return warnings
