"""API keys: ``PIPELINE_API_KEYS`` names a file of ``key tenant`` lines; a request's key names
its tenant (docs/batches.md, "Keys and tenants"). Keys are kept only as SHA-256 digests."""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import re
from dataclasses import dataclass

from ..errors import ConfigError

TENANT = re.compile(r"^[A-Za-z0-9_.@\-]{1,128}$")


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8")).digest()


@dataclass(frozen=True)
class ApiKeys:
    """Digest of each key → its tenant."""

    tenants: dict[bytes, str]

    @classmethod
    def load(cls, path: str) -> ApiKeys:
        try:
            with open(path, encoding="utf-8") as fh:
                text = fh.read()
        except OSError as exc:
            raise ConfigError(f"PIPELINE_API_KEYS: cannot read {path}: {exc.strerror}") from None
        tenants: dict[bytes, str] = {}
        for n, raw in enumerate(text.splitlines(), 1):
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            parts = line.split()
            if len(parts) != 2 or not TENANT.match(parts[1]) or len(parts[0]) < 8:
                raise ConfigError(
                    f"PIPELINE_API_KEYS: {path} line {n}: expected 'key tenant' (a key of at "
                    "least 8 characters, a tenant of [A-Za-z0-9_.@-])"
                )
            d = _digest(parts[0])
            if d in tenants:
                raise ConfigError(f"PIPELINE_API_KEYS: {path} line {n}: a key listed twice")
            tenants[d] = parts[1]
        if not tenants:
            raise ConfigError(f"PIPELINE_API_KEYS: {path} lists no key")
        return cls(tenants)

    def tenant(self, authorization: str | None) -> str | None:
        """The tenant of a request's ``Authorization`` header, or None."""
        key = _key_of(authorization or "")
        if not key:
            return None
        d = _digest(key)
        for known, tenant in self.tenants.items():  # compare every digest: no early exit
            if hmac.compare_digest(known, d):
                return tenant
        return None


def _key_of(authorization: str) -> str:
    scheme, _, value = authorization.strip().partition(" ")
    if scheme.lower() == "bearer":
        return value.strip()
    if scheme.lower() == "basic":
        try:
            decoded = base64.b64decode(value.strip(), validate=True).decode("utf-8")
        except (binascii.Error, UnicodeDecodeError):
            return ""
        return decoded.partition(":")[2]
    return ""


LOOPBACK = frozenset({"127.0.0.1", "localhost", "::1"})
