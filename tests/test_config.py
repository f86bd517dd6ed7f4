"""Queue configuration: the reference's field names, and startup errors naming the entry."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline.config import load_settings
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
