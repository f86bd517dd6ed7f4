"""No Redis where the client looks: one typed error naming where it looked and the fix (no
Redis needed: nothing listens on the port it is given)."""

from __future__ import annotations

import pickle

import pytest
import redis

import pipeline
from pipeline.cli.services import free_port
from pipeline.client import Pipeline
from pipeline.config import load_settings


def test_submit_without_redis_raises_one_typed_error_naming_the_fix() -> None:
    port = free_port()  # nothing listens there
    p = Pipeline(load_settings({"PIPELINE_REDIS_URL": f"redis://:pw@127.0.0.1:{port}/0"}))
    with pytest.raises(pipeline.RedisUnavailable) as caught:
        p.submit({"prompt": "hi"})
    exc = caught.value
    assert isinstance(exc, redis.ConnectionError)  # what retrying code catches still catches it
    assert isinstance(exc, pipeline.PipelineError)
    assert exc.where == f"127.0.0.1:{port}" and "refused" in exc.reason
    assert "`pipeline up`" in str(exc) and "PIPELINE_REDIS_URL" in str(exc)
    assert "pw" not in str(exc)
    assert exc.__cause__ is None and exc.__suppress_context__  # no redis-py chain above it
    again = pickle.loads(pickle.dumps(exc))
    assert str(again) == str(exc)
