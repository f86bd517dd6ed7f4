"""Certificates for the TLS tests, made fresh by each test session with ``trustme``: a CA that
signs the simulator's server certificate and the worker's client certificate, and another CA
that signs nothing the simulator serves (the "wrong CA")."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import trustme


@dataclass(frozen=True)
class Certs:
    ca: str  # the CA of the server and client certificates (PEM)
    other_ca: str  # a CA that signed neither
    server: str  # the server's key and certificate chain, one PEM
    client_cert: str  # the worker's client certificate (mTLS)
    client_key: str


def make_certs(directory: Path) -> Certs:
    ca, other = trustme.CA(), trustme.CA()
    server = ca.issue_cert("127.0.0.1", "localhost")
    client = ca.issue_cert("pipeline-worker")
    paths = {name: str(directory / f"{name}.pem") for name in Certs.__dataclass_fields__}
    ca.cert_pem.write_to_path(paths["ca"])
    other.cert_pem.write_to_path(paths["other_ca"])
    server.private_key_and_cert_chain_pem.write_to_path(paths["server"])
    client.cert_chain_pems[0].write_to_path(paths["client_cert"])
    client.private_key_pem.write_to_path(paths["client_key"])
    return Certs(**paths)
