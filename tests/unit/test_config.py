"""Queue configuration: the reference's field names, and startup errors naming the entry."""

from __future__ import annotations

import json
from pathlib import Path
from urllib.parse import urlencode

import pytest
from hypothesis import given
from hypothesis import strategies as st
from kombu.utils.url import parse_url as kombu_parse_url

from pipeline.batch.config import BatchSettings
from pipeline.config import celery_url, load_settings
from pipeline.errors import ConfigError
from pipeline.gates import check_gates


def settings_from(tmp_path: Path, data: object) -> object:
    f = tmp_path / "queues.json"
    f.write_text(json.dumps(data) if not isinstance(data, str) else data)
    return check_gates(load_settings({"PIPELINE_QUEUES": str(f)}))


def test_reference_fields_are_read(tmp_path: Path) -> None:
    s = settings_from(
        tmp_path,
        [
            {
                "queue_name": "q1",
                "igw_base_url": "http://gw:8080",
                "request_path_url": "/v1/chat/completions",
                "inference_objective": "batch",
                "worker_pool_id": "p1",
                "gate_type": "constant",
                "gate_params": {},
                "labels": {"tier": "batch"},
                "result_queue_name": "results-q1",
                "default_timeout_s": 60,
                "request_timeout_s": 10,
                "retry_base_delay_s": 1,
                "retry_max_delay_s": 5,
            }
        ],
    )
    q = s.queues["q1"]  # type: ignore[attr-defined]
    assert q.request_path_url == "/v1/chat/completions" and q.worker_pool_id == "p1"
    assert q.labels == {"tier": "batch"} and q.result_queue_name == "results-q1"


def test_default_queue_from_endpoint() -> None:
    s = load_settings({"PIPELINE_ENDPOINT": "http://127.0.0.1:9999"})
    assert list(s.queues) == ["default"]
    assert s.queues["default"].igw_base_url == "http://127.0.0.1:9999"


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ("{not json", "not valid JSON"),
        ([], "non-empty JSON list"),
        ([{"igw_base_url": "http://x"}], "queue #0: queue_name"),
        ([{"queue_name": "a", "igw_base_url": "ftp://x"}], "queue #0 (a): igw_base_url"),
        ([{"queue_name": "a", "igw_base_url": "http://x", "gate_typo": 1}], "unknown field"),
        (
            [
                {"queue_name": "a", "igw_base_url": "http://x"},
                {"queue_name": "a", "igw_base_url": "http://y"},
            ],
            "queue #1: duplicate queue_name",
        ),
        (
            [{"queue_name": "a", "igw_base_url": "http://x", "gate_type": "nope"}],
            "queue 'a': unknown gate_type 'nope'",
        ),
        (
            [{"queue_name": "a", "igw_base_url": "http://x", "request_timeout_s": 0}],
            "request_timeout_s",
        ),
    ],
)
def test_bad_queue_file_names_the_entry(tmp_path: Path, data: object, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        settings_from(tmp_path, data)
    assert message in str(info.value)


def test_lookahead_and_park_settings() -> None:
    assert load_settings({}).lookahead == -1 and load_settings({}).park_s == 10.0
    assert load_settings({"PIPELINE_LOOKAHEAD": "auto"}).lookahead == -1
    s = load_settings({"PIPELINE_LOOKAHEAD": "3", "PIPELINE_PARK_S": "0.5"})
    assert (s.lookahead, s.park_s) == (3, 0.5)
    for bad in ("-1", "two", "1.5"):
        with pytest.raises(ConfigError, match="PIPELINE_LOOKAHEAD"):
            load_settings({"PIPELINE_LOOKAHEAD": bad})


# Every variable docs/configuration.md names is read where it says: each one set here reaches its
# setting, and a value that is not a number is a startup error naming the variable.
@pytest.mark.parametrize(
    ("var", "value", "field", "expected"),
    [
        ("PIPELINE_MAX_PAYLOAD_BYTES", "2048", "max_payload_bytes", 2048),
        ("PIPELINE_FAIRNESS_ATTRIBUTE", "tenant", "fairness_attribute", "tenant"),
        ("PIPELINE_FAIRNESS_HEADER", "x-team", "fairness_header", "x-team"),
        ("PIPELINE_FAIRNESS_HEADER", "", "fairness_header", ""),
    ],
)
def test_documented_variables_reach_their_settings(
    var: str, value: str, field: str, expected: object
) -> None:
    assert getattr(load_settings({var: value}), field) == expected


@pytest.mark.parametrize(
    ("var", "value", "field", "expected"),
    [
        ("PIPELINE_BATCH_RETENTION_S", "3600", "retention_s", 3600.0),
        ("PIPELINE_BATCH_MAX_LINES", "500", "max_lines", 500),
        ("PIPELINE_FILE_TTL_S", "86400", "file_ttl_s", 86400.0),
        ("PIPELINE_BATCH_MAX_ACTIVE", "7", "max_active", 7),
    ],
)
def test_documented_batch_variables_reach_their_settings(
    var: str, value: str, field: str, expected: object
) -> None:
    settings = BatchSettings.from_env(load_settings({}), {var: value})
    assert getattr(settings, field) == expected
    with pytest.raises(ConfigError, match=var):
        BatchSettings.from_env(load_settings({}), {var: "lots"})


def test_max_payload_bytes_refuses_a_larger_body_naming_the_field() -> None:
    from pipeline.client.api import _check_payload
    from pipeline.errors import InvalidRequest

    limit = load_settings({"PIPELINE_MAX_PAYLOAD_BYTES": "64"}).max_payload_bytes
    assert _check_payload({"prompt": "x" * 10}, limit)
    with pytest.raises(InvalidRequest, match="payload.*max_payload_bytes \\(64\\)"):
        _check_payload({"prompt": "x" * 100}, limit)
    with pytest.raises(ConfigError, match="PIPELINE_MAX_PAYLOAD_BYTES"):
        load_settings({"PIPELINE_MAX_PAYLOAD_BYTES": "big"})


@given(
    password=st.text(min_size=1, max_size=30),
    username=st.one_of(st.none(), st.text(min_size=1, max_size=20)),
)
def test_celery_url_puts_query_credentials_where_kombu_reads_them(
    password: str, username: str | None
) -> None:
    """redis-py reads ``?password=`` (and ``?username=``); kombu's parser raises on it. The
    URL Celery gets carries them in its userinfo, as kombu decodes them, with the rest of
    the query kept."""
    query = {"password": password, "socket_timeout": "3"}
    if username is not None:
        query["username"] = username
    url = celery_url(f"redis://127.0.0.1:6380/2?{urlencode(query)}")
    parts = kombu_parse_url(url)
    assert parts["password"] == password
    assert parts["userid"] == (username or None)
    assert (parts["hostname"], parts["port"], parts["virtual_host"]) == ("127.0.0.1", 6380, "2")
    assert "socket_timeout=3" in url and "password=" not in url


@pytest.mark.parametrize(
    "url",
    [
        "redis://:pw@127.0.0.1:6379/0",
        "redis://127.0.0.1/0?socket_timeout=3",
        "sentinel://h1:26379;sentinel://h2:26379/0",
        "redis+cluster://:pw@h:7000,h:7001",
        "unix:///tmp/redis.sock?password=x",
    ],
)
def test_celery_url_leaves_other_urls_alone(url: str) -> None:
    assert celery_url(url) == url


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"redirect_origins": ["http://other:9090"]}, "redirect_origins needs follow_redirects"),
        (
            {"follow_redirects": True, "redirect_origins": ["http://other:9090/path"]},
            "is not an origin",
        ),
        ({"follow_redirects": True, "redirect_origins": "http://other:9090"}, "must be a list"),
    ],
)
def test_a_metric_gates_redirect_origins_are_checked(
    tmp_path: Path, params: dict[str, object], message: str
) -> None:
    gate = {"url": "http://prom:9090", "query": "q", **params}
    entry = {"queue_name": "q", "igw_base_url": "http://gw:8080"}
    entry.update(gate_type="prometheus-query", gate_params=gate)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=message) as info:
        settings_from(tmp_path, [entry])
    assert "redirect_origins" in str(info.value)
