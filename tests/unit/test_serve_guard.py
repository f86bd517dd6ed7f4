"""The front door's rules as pure functions: which ``Host`` a ``pipeline serve`` answers, what
``PIPELINE_ALLOWED_HOSTS`` accepts, which browser requests count as another origin's.
(tests/integration/front_doors/ drives them over HTTP and in Chromium.)"""

from __future__ import annotations

import pytest
from starlette.datastructures import Headers

from pipeline.errors import ConfigError
from pipeline.serve.guard import AllowedHosts, cross_site

LOOPBACK_ONLY = AllowedHosts()
LISTED = AllowedHosts.parse("batch.example.com, 10.0.0.5:8443,[fd00::1]:9000")


@pytest.mark.parametrize(
    ("hosts", "host", "served"),
    [
        (LOOPBACK_ONLY, "127.0.0.1:8080", True),
        (LOOPBACK_ONLY, "localhost:8080", True),
        (LOOPBACK_ONLY, "LOCALHOST.:8080", True),
        (LOOPBACK_ONLY, "[::1]:8080", True),
        (LOOPBACK_ONLY, "127.0.0.1:8081", False),  # another port: another service
        (LOOPBACK_ONLY, "localhost", False),  # port 80, not this one
        (LOOPBACK_ONLY, "evil.test:8080", False),  # a DNS-rebound name
        (LOOPBACK_ONLY, "127.0.0.2:8080", False),
        (LOOPBACK_ONLY, "127.0.0.1:8080@evil.test", False),
        (LOOPBACK_ONLY, "", False),
        (LISTED, "batch.example.com", True),
        (LISTED, "Batch.Example.Com:443", True),  # a name without a port: any port
        (LISTED, "10.0.0.5:8443", True),
        (LISTED, "10.0.0.5:8080", False),  # listed with another port
        (LISTED, "[fd00::1]:9000", True),
        (LISTED, "127.0.0.1:8080", True),  # the loopback names stay
        (LISTED, "example.com:8080", False),
    ],
)
def test_hosts_served(hosts: AllowedHosts, host: str, served: bool) -> None:
    assert hosts.allows(host, own_port=8080) is served


@pytest.mark.parametrize("text", ["http://batch.example.com", "a b", "host:port", "x/y", "[::1"])
def test_a_bad_allowed_hosts_entry_is_a_config_error(text: str) -> None:
    with pytest.raises(ConfigError, match="PIPELINE_ALLOWED_HOSTS"):
        AllowedHosts.parse(text)


def test_no_allowed_hosts_setting_is_none() -> None:
    assert AllowedHosts.from_env({}) is None
    assert AllowedHosts.from_env({"PIPELINE_ALLOWED_HOSTS": " "}) is None


@pytest.mark.parametrize(
    ("method", "headers", "refused"),
    [
        ("POST", {}, False),  # an API client: no Sec-Fetch-Site, no Origin
        ("POST", {"sec-fetch-site": "same-origin"}, False),
        ("POST", {"sec-fetch-site": "same-site"}, True),  # another port of 127.0.0.1
        ("POST", {"sec-fetch-site": "cross-site"}, True),
        ("POST", {"sec-fetch-site": "cross-site", "sec-fetch-mode": "navigate"}, True),  # a form
        ("GET", {"sec-fetch-site": "cross-site", "sec-fetch-mode": "navigate"}, False),  # a link
        ("GET", {"sec-fetch-site": "cross-site", "sec-fetch-mode": "no-cors"}, True),  # <img>
        ("GET", {"sec-fetch-site": "none"}, False),  # typed in the address bar
        ("POST", {"origin": "http://127.0.0.1:8080"}, False),
        ("POST", {"origin": "http://127.0.0.1:9999"}, True),
        ("POST", {"origin": "null"}, True),
        ("DELETE", {"origin": "https://batch.example.com"}, True),
        ("POST", {"origin": "http://localhost:8080", "sec-fetch-site": "same-origin"}, False),
    ],
)
def test_cross_origin_requests(method: str, headers: dict[str, str], refused: bool) -> None:
    got = cross_site(method, Headers({"host": "127.0.0.1:8080", **headers}))
    assert (got is not None) is refused, got
