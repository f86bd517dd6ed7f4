"""Redaction: every URL form the pipeline accepts (docs/configuration.md) loses its password
wherever it is written, and ``redact_url`` never raises, whatever the text."""

from __future__ import annotations

from urllib.parse import quote

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from pipeline.config import load_settings, parse_cluster_url, parse_sentinel_url
from pipeline.errors import ConfigError
from pipeline.redact import MASK, redact_text, redact_url

# A password is marked so that no other part of a generated URL can contain it by chance.
MARK = "Zq"
passwords = st.text(min_size=1, max_size=30).map(lambda s: MARK + s)
hosts = st.sampled_from(["127.0.0.1", "redis.example", "[::1]", "localhost", "h-1.internal"])
ports = st.integers(1, 65535)
dbs = st.sampled_from(["", "/0", "/12"])
users = st.sampled_from(["", "default", "alice"])
other_params = st.lists(
    st.sampled_from(["ssl_cert_reqs=none", "db=3", "socket_timeout=5", "health_check_interval=2"]),
    max_size=2,
)


@st.composite
def url_with_password(draw: st.DrawFn) -> tuple[str, str]:
    """(a URL in one of the accepted forms carrying a password, the password). The password is
    percent-encoded, as a URL needs, or written raw, as a user may type it."""
    pw = draw(passwords)
    written = draw(st.sampled_from([quote(pw, safe=""), pw]))
    user = draw(users)
    host, port, db = draw(hosts), draw(ports), draw(dbs)
    form = draw(
        st.sampled_from(
            ["userinfo", "query", "unix", "sentinel", "cluster", "cluster-query", "http"]
        )
    )
    params = draw(other_params)
    if form == "userinfo":
        scheme = draw(st.sampled_from(["redis", "rediss"]))
        url = f"{scheme}://{user}:{written}@{host}:{port}{db}"
    elif form == "query":
        scheme = draw(st.sampled_from(["redis", "rediss"]))
        name = draw(st.sampled_from(["password", "PASSWORD", "requirepass", "token", "api_key"]))
        params = [*params, f"{name}={written}"]
        draw(st.randoms()).shuffle(params)
        url = f"{scheme}://{host}:{port}{db}"
    elif form == "unix":
        url = f"unix://{user}:{written}@/var/run/redis.sock"
    elif form == "sentinel":
        n = draw(st.integers(1, 3))
        url = ";".join(f"sentinel://:{written}@{host}:{port + i % 3}{db}" for i in range(n))
    elif form == "cluster":
        n = draw(st.integers(1, 4))
        nodes = ",".join(f"{host}:{port}" for _ in range(n))
        scheme = draw(st.sampled_from(["redis+cluster", "rediss+cluster"]))
        url = f"{scheme}://{user}:{written}@{nodes}"
    elif form == "cluster-query":
        url = f"redis+cluster://{host}:{port},{host}:{port}"
        params = [*params, f"password={written}"]
    else:
        url = f"https://{user}:{written}@{host}:{port}/v1"
    if params:
        url += "?" + "&".join(params)
    return url, pw


@given(url_with_password())
@example(("redis+cluster://:s3cret@127.0.0.1:7000,127.0.0.1:7001", "s3cret"))
@example(("redis://127.0.0.1:6379/0?password=s3cret", "s3cret"))
@example(("rediss://:s3cret@127.0.0.1:6380/0?ssl_cert_reqs=none", "s3cret"))
@example(("sentinel://:s3cret@h1:26379;sentinel://:s3cret@h2:26379/0", "s3cret"))
def test_no_password_survives_redaction(case: tuple[str, str]) -> None:
    url, pw = case
    out = redact_url(url)
    assert pw not in out and quote(pw, safe="") not in out, (url, out)
    assert MASK in out
    # inside a free text (an exception's message) too
    text = redact_text(f"Error connecting to {url}. Try again")
    assert pw not in text and quote(pw, safe="") not in text, (url, text)


@given(st.text())
@example("redis://:p@[::1:6379/0")
@example("rediss://u:p@h:99999/0")
@example("redis+cluster://:pw@h:1,h:2/0")
@example("sentinel://;;;")
@example("://@")
def test_redact_url_never_raises(text: str) -> None:
    assert isinstance(redact_url(text), str)
    assert isinstance(redact_text(text), str)


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        # nothing secret: unchanged
        ("redis://localhost:6379/0", "redis://localhost:6379/0"),
        ("http://vllm:8000/v1", "http://vllm:8000/v1"),
        ("unix:///tmp/redis.sock?db=1", "unix:///tmp/redis.sock?db=1"),
        ("localhost:6379", "localhost:6379"),
        # userinfo: all of it (a user name is half a login)
        ("redis://alice:pw@h:1/0", f"redis://{MASK}@h:1/0"),
        ("redis+cluster://:pw@h:1,h:2", f"redis+cluster://{MASK}@h:1,h:2"),
        ("unix://:pw@/tmp/r.sock", f"unix://{MASK}@/tmp/r.sock"),
        # credential parameters, the others kept
        ("redis://h:1/0?username=bob&password=pw&db=2", f"redis://h:1/0?username={MASK}&password={MASK}&db=2"),
        # each entry of a sentinel list
        ("sentinel://:a@h:1;sentinel://:b@g:2/0", f"sentinel://{MASK}@h:1;sentinel://{MASK}@g:2/0"),
        # a password with a character that ends the authority early: the whole URL
        ("redis://:pa/ss@h:1/0", f"redis://{MASK}"),
        ("redis://:p@[::1:6379/0", f"redis://{MASK}"),
    ],
)  # fmt: skip
def test_redaction_keeps_what_is_not_secret(url: str, expected: str) -> None:
    assert redact_url(url) == expected


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("http://:s3cret@h:6379/0", "not a Redis URL"),
        ("redis://:s3cret@h:99999/0", "port 1-65535"),
        ("redis://:s3cret@h:0/0", "port 1-65535"),
        ("redis://:s3cret@h:6379/zero", "database must be a number"),
        ("unix://:s3cret@", "socket's path"),
        ("redis+cluster://:s3cret@h:7000,h:7001/0?password=s3cret&user=x", "not user"),
        ("redis+cluster://h:7000,h:99999?password=s3cret", "node #2"),
        ("redis+cluster://h:7000/0?password=s3cret&ssl=1", "not ssl"),
        ("sentinel://:s3cret@h:x6379", "sentinel #1"),
    ],
)
def test_a_bad_redis_url_names_the_setting_not_the_password(url: str, says: str) -> None:
    env = {"PIPELINE_REDIS_URL": url, "PIPELINE_REDIS_SENTINEL_MASTER": "m"}
    with pytest.raises(ConfigError, match=says) as caught:
        load_settings(env)
    assert "PIPELINE_REDIS_URL" in str(caught.value) and "s3cret" not in str(caught.value)


def test_credentials_as_query_parameters() -> None:
    """redis-py reads ?password= and ?username= on a standalone URL; a cluster or Sentinel
    URL takes them too, for the same connection."""
    c = parse_cluster_url("redis+cluster://h:7000,g:7001?username=app&password=s%40cret")
    assert (c.username, c.password) == ("app", "s@cret")
    s = parse_sentinel_url("sentinel://h:26379/2?password=pw;sentinel://g:26379")
    assert (s.db, s.password, s.sentinels) == (2, "pw", (("h", 26379), ("g", 26379)))
