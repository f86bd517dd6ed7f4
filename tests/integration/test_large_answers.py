"""Large answers (issue 48, item 9): a body longer than ``PIPELINE_BODY_INLINE_MAX`` (64 KiB by
default) is stored once in Redis, in a key of its own; the record's result, the Celery result
and the result-list entry name it (``payload_ref``), and every reader hands out the whole body.
Bytes are counted in Redis (STRLEN, MEMORY USAGE), never timed: bench/bigbody.py measures how
long a finish blocks Redis."""

from __future__ import annotations

import gc
import json
import tracemalloc
import uuid
from typing import Any

import pytest

import pipeline
from pipeline import UnknownRequest
from pipeline.cli.services import wait_until
from pipeline.client import Pipeline, Result
from pipeline.http import call as httpcall
from pipeline.store import Store
from pipeline.store.bodies import PIECE

BIG_TOKENS = 200_000  # the simulator's answer: ~1.2 MB (a " word" per completion token)
SMALL = 4 * 1024  # what a result holding only a reference may take, at most


def uid() -> str:
    return f"big-{uuid.uuid4().hex[:10]}"


def big(pl: Pipeline, rid: str, tokens: int = BIG_TOKENS) -> Any:
    return pl.submit({"model": "m", "prompt": "big", "max_tokens": tokens}, id=rid, timeout=120)


def list_entry(store: Store, pl: Pipeline, rid: str) -> str:
    """The default queue's result-list entry of ``rid`` (the newest are first)."""
    key = store.keys.result_list(pl.settings.queues["default"])
    for raw in store.client.lrange(key, 0, 200):
        if json.loads(raw)["id"] == rid:
            return str(raw)
    raise AssertionError(f"no result-list entry for {rid}")


def celery_meta_key(rid: str) -> str:
    return f"celery-task-meta-{rid}"


def test_a_large_answer_is_stored_once(served: Pipeline) -> None:
    rid = uid()
    res = big(served, rid).result(timeout=60)
    assert res.ok and res.status_code == 200
    body = res.payload
    assert len(body) > 1_000_000
    assert res.json()["usage"]["completion_tokens"] == BIG_TOKENS  # whole, parseable

    store = served.store_of("default")
    c = store.client
    rec = c.hgetall(store.keys.request(rid))
    stored = json.loads(rec["result"])
    assert "payload" not in stored and stored["payload_ref"] == rec["body"]
    # the body once, byte for byte, in its own key
    assert c.strlen(rec["body"]) == len(body.encode())
    assert c.get(rec["body"]) == body
    # every other copy of the result holds the reference only
    entry = list_entry(store, served, rid)
    assert json.loads(entry)["payload_ref"] == rec["body"]
    assert len(entry) < SMALL
    assert wait_until(lambda: c.exists(celery_meta_key(rid)), 10, "the Celery result")
    assert c.strlen(celery_meta_key(rid)) < SMALL
    record_bytes = int(c.memory_usage(store.keys.request(rid), samples=0))
    assert record_bytes < 4 * SMALL
    around = record_bytes + c.strlen(celery_meta_key(rid)) + len(entry)
    assert around < len(body) // 50  # all but the one body: a few KB, not three copies
    # and expires with the result (the record's TTL, or the result list's if longer)
    assert c.ttl(rec["body"]) >= c.ttl(store.keys.request(rid)) > 0

    # every reader hands out the whole body
    assert served.get(rid).result(timeout=60).payload == body
    assert served.wait(rid, timeout=60).payload == body
    assert [r.payload for r in served.iter_results([rid])] == [body]
    assert served.load_result(entry).payload == body
    assert pipeline.load_result(entry).payload == body
    assert served.load_result(rec["result"]).to_dict()["payload"] == body
    from tasks.app import app  # the pipeline's app: its result backend reads the body back

    got = app.AsyncResult(rid).get(timeout=10)
    assert got["payload"] == body and "payload_ref" not in got


def test_a_small_answer_stays_inline(served: Pipeline) -> None:
    rid = uid()
    res = big(served, rid, tokens=16).result(timeout=30)
    assert res.ok
    store = served.store_of("default")
    rec = store.client.hgetall(store.keys.request(rid))
    assert "body" not in rec
    assert json.loads(rec["result"])["payload"] == res.payload
    assert not list(store.client.scan_iter(store.keys.body(rid, "*")))


def test_a_fenced_off_finish_leaves_no_body(served: Pipeline) -> None:
    """A late finish of a stale attempt (its token no longer the request's) stores nothing:
    the body its attempt wrote first is deleted with the refusal."""
    rid = uid()
    first = big(served, rid).result(timeout=60)
    store = served.store_of("default")
    key = store.put_body(rid, "stale-token", "x" * 100_000)
    assert store.client.exists(key)
    late = store.finish(
        rid, "stale-token", attempted=True, status_code=200, payload="", body_key=key
    )
    assert late is None
    assert not store.client.exists(key)
    assert served.wait(rid, timeout=60).payload == first.payload  # the result stands


def test_a_new_request_on_the_id_drops_the_old_body(served: Pipeline) -> None:
    rid = uid()
    big(served, rid).result(timeout=60)
    store = served.store_of("default")
    old = store.client.hget(store.keys.request(rid), "body")
    assert old and store.client.exists(old)
    again = big(served, rid, tokens=16)  # the id is free again: a new request takes it
    assert again.created
    assert not store.client.exists(old)
    assert again.result(timeout=30).ok


def test_a_body_gone_before_its_result_is_an_unknown_request(served: Pipeline) -> None:
    rid = uid()
    big(served, rid).result(timeout=60)
    store = served.store_of("default")
    store.client.delete(store.client.hget(store.keys.request(rid), "body"))  # as if evicted
    with pytest.raises(UnknownRequest):
        served.wait(rid, timeout=5)


def test_an_answer_is_held_once_after_the_call(sim: Any) -> None:
    """The HTTP client keeps one copy of a body once the call returns: the chunks it was read
    in are let go at once, not when the cyclic GC frees the parser that holds them."""
    body = json.dumps({"model": "m", "prompt": "big", "max_tokens": BIG_TOKENS}).encode()
    url = f"{sim.url}/v1/completions"
    gc.disable()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        resp = httpcall.request("POST", url, body, {}, 60.0)
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
        gc.enable()
    assert len(resp.body) > 1_000_000
    assert held < len(resp.body) * 1.2, (held, len(resp.body))


def test_a_body_is_read_back_whole_across_its_pieces(pl: Pipeline) -> None:
    """Readers take a body a piece (1 MiB) at a time: characters of several bytes that a
    piece's end cuts in two come back whole."""
    store = pl.store_of("default")
    text = ("é€😀x" * 300_000)[: 2 * PIECE + 7]  # 1-4 bytes a character, over 3 pieces
    key = store.put_body("pieces", "tok", text)
    try:
        got = store.with_body({"id": "pieces", "payload_ref": key})
        assert got == {"id": "pieces", "payload": text}
    finally:
        store.client.delete(key)


def test_the_finish_script_never_gets_the_body(pl: Pipeline) -> None:
    """What makes a finish cost the same at any size: a body stored apart is not among the
    script's arguments (the attempt SETs it first), only its key."""
    store = pl.store_of("default")
    key = store.keys.body("r", "tok")
    call = store.finish_call(
        "r", "tok", attempted=True, status_code=200, payload="x" * 1_000_000, body_key=key
    )
    assert key in call.keys
    assert sum(len(str(a)) for a in call.args) < 1000


def test_a_reference_read_as_is_says_so() -> None:
    """``Result.from_json`` of a stored result whose body was not read back: no body, and
    the key that holds it (``Pipeline.load_result`` reads it)."""
    res = Result.from_json('{"id": "r", "status_code": 200, "payload_ref": "pl:body:r:t"}')
    assert res.payload == "" and res.extra == {"payload_ref": "pl:body:r:t"}
