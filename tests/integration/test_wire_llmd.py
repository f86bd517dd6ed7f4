"""Wire compatibility with the llm-d-async reference: a queue with ``"ingest": "llm-d-async"``
serves requests that a reference producer wrote into its sorted set, byte for byte as that
producer writes them (its envelope, score and generation keys), and answers on the result list
the reference's consumer ``BRPOP``s, in the reference's result format. Through a real worker
node and the simulator; the producer and the consumer here are written from the reference's
wire contract (``shared/reference/llm-d-async-changes.md`` §1)."""

from __future__ import annotations

import json
import secrets
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from pipeline.cli.services import wait_until
from pipeline.config import load_settings
from pipeline.errors import ConfigError
from pipeline.sim import SimServer
from pipeline.store import wire
from tests.conftest import WorkerProc, assert_idle, held
from tests.observability import Isolated, isolated, start_node

# the reference producer's submit (§1.1): sequence per (queue, deadline), generation keys, ZADD
# of the envelope with the sequence spliced in, score D + min(S, 2^21 - 1) / 2^21 as %.17g
PRODUCER_SUBMIT = """
local q, id, token, d = KEYS[1], ARGV[1], ARGV[2], tonumber(ARGV[3])
local seqkey = 'request-seq:' .. q .. ':' .. ARGV[3]
local s = redis.call('INCR', seqkey)
redis.call('EXPIREAT', seqkey, d + 3600)
redis.call('DEL', 'request-cancel:' .. id)
local t = redis.call('TIME')
local ms = math.max(1, d * 1000 - (tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)))
redis.call('SET', 'request-active:' .. id, token, 'PX', ms)
local member = string.gsub(ARGV[4], '"enqueue_seq":%-1', '"enqueue_seq":' .. s, 1)
local score = string.format('%.17g', d + math.min(s, 2097151) / 2097152)
redis.call('ZADD', q, score, member)
return {s, score, member}
"""
# the producer's CancelRequests (§1.1): copy the live generation's token into the cancel key
PRODUCER_CANCEL = """
local active = redis.call('GET', KEYS[1])
if not active then return 0 end
redis.call('SET', KEYS[2], active, 'EX', ARGV[1])
return 1
"""


def go_json(value: Any) -> str:
    """JSON as Go's encoding/json writes it: compact, <, >, & and U+2028/9 escaped (maps
    come pre-sorted and structs in field order from the caller)."""
    text = json.dumps(value, ensure_ascii=False, separators=(",", ":"))
    for raw, esc in (("<", "\\u003c"), (">", "\\u003e"), ("&", "\\u0026"),
                     ("\u2028", "\\u2028"), ("\u2029", "\\u2029")):  # fmt: skip
        text = text.replace(raw, esc)
    return text


def envelope(
    rid: str,
    deadline: int,
    payload: dict[str, Any] | None,
    *,
    token: str,
    queue: str,
    results: str,
    created: int = 1790000000,
    metadata: dict[str, str] | None = None,
    headers: dict[str, str] | None = None,
    endpoint: str = "",
    model: str = "",
    seq: bool = True,
    payload_ref: str = "",
) -> str:
    """The member a reference producer writes: internal (Go field order, empties left out),
    request_kind, data (id, created, deadline, payload, then metadata, headers, endpoint, model
    when set; maps with sorted keys). ``seq``: the #463 placeholder the script replaces."""
    internal: dict[str, Any] = {"request_token": token, "request_queue_name": queue,
                                "result_queue_name": results}  # fmt: skip
    if seq:
        internal["enqueue_seq"] = -1
    if payload_ref:
        internal["payload_ref"] = payload_ref
    data: dict[str, Any] = {"id": rid, "created": created, "deadline": deadline,
                            "payload": payload}  # fmt: skip
    if metadata:
        data["metadata"] = dict(sorted(metadata.items()))
    if headers:
        data["headers"] = dict(sorted(headers.items()))
    if endpoint:
        data["endpoint"] = endpoint
    if model:
        data["model"] = model
    return go_json({"internal": internal, "request_kind": "plain", "data": data})


class Producer:
    """The reference's Go producer, as far as Redis sees it."""

    def __init__(self, client: redis.Redis, queue: str, results: str) -> None:
        self.client, self.queue, self.results = client, queue, results
        self.submit_script = client.register_script(PRODUCER_SUBMIT)
        self.cancel_script = client.register_script(PRODUCER_CANCEL)

    def submit(self, rid: str, payload: dict[str, Any] | None, timeout: int = 600,
               **kw: Any) -> tuple[str, str]:  # fmt: skip
        """Returns (token, member as stored)."""
        token = secrets.token_hex(16)
        deadline = int(time.time()) + timeout
        member = envelope(rid, deadline, payload, token=token, queue=self.queue,
                          results=kw.pop("results", self.results), **kw)  # fmt: skip
        _, _, stored = self.submit_script(keys=[self.queue], args=[rid, token, deadline, member])
        return token, stored

    def submit_pre_463(self, rid: str, payload: dict[str, Any], timeout: int = 600) -> str:
        """The producer before #463: score = the bare deadline, no sequence, EX seconds."""
        token = secrets.token_hex(16)
        deadline = int(time.time()) + timeout
        member = envelope(rid, deadline, payload, token=token, queue=self.queue,
                          results=self.results, seq=False)  # fmt: skip
        with self.client.pipeline(transaction=True) as p:
            p.delete(f"request-cancel:{rid}")
            p.set(f"request-active:{rid}", token, ex=timeout)
            p.zadd(self.queue, {member: deadline})
            p.execute()
        return token

    def cancel(self, rid: str) -> int:
        keys = [f"request-active:{rid}", f"request-cancel:{rid}"]
        return int(self.cancel_script(keys=keys, args=[7 * 24 * 3600]))


class Consumer:
    """The reference's GetResult: BRPOP the result list, parse the record."""

    def __init__(self, client: redis.Redis, results: str) -> None:
        self.client, self.results = client, results

    def get(self, timeout: float = 20.0) -> tuple[str, dict[str, Any]]:
        popped = self.client.brpop([self.results], timeout=timeout)
        assert popped is not None, f"no result on {self.results} within {timeout} s"
        raw = popped[1]
        record = json.loads(raw)
        # the reference's ResultMessage field order; omitted when empty, except id and payload
        order = ["id", "status_code", "payload", "error_code", "error_message", "request_token"]
        assert list(record) == [k for k in order if k in record], raw
        assert isinstance(record["id"], str) and isinstance(record["payload"], str)
        return raw, record

    def all(self, n: int, timeout: float = 20.0) -> dict[str, dict[str, Any]]:
        out = {}
        for _ in range(n):
            _, record = self.get(timeout)
            out[record["id"]] = record
        return out


@pytest.fixture
def ref(env: dict[str, str], sim: SimServer, tmp_path: Path) -> Iterator[tuple[Isolated, str]]:
    """An isolated pipeline with one ingesting queue (its name is the reference's sorted set)
    and a result list of its own (named by the messages, not the config)."""
    iso = isolated(env, tmp_path, [
        {"queue_name": "rq", "igw_base_url": sim.url, "ingest": "llm-d-async"},
        {"queue_name": "rqcfg", "igw_base_url": sim.url, "ingest": "llm-d-async",
         "result_queue_name": f"{env['PIPELINE_KEY_PREFIX']}cfg-results"},
    ])  # fmt: skip
    results = f"{iso.env['PIPELINE_KEY_PREFIX']}results:{iso.tag}"
    yield iso, results
    client = iso.pl.store.client
    for key in (iso.queue("rq"), iso.queue("rqcfg"), results,
                f"{env['PIPELINE_KEY_PREFIX']}cfg-results"):  # fmt: skip
        client.delete(key)
    assert_idle(iso.pl)


def rid() -> str:
    return f"acme:{uuid.uuid4().hex[:10]}"


def test_the_test_producer_writes_the_documented_bytes() -> None:
    """The envelope writer above reproduces the reference contract's example byte for byte."""
    member = envelope(
        "acme:job-1", 1790003600, {"model": "m", "prompt": "hi", "max_tokens": 8},
        token="9f86d081884c7d659a2feaa0c55ad015", queue="request-sortedset",
        results="results:acme:job-1", metadata={"userid": "acme"}, model="m",
    ).replace('"enqueue_seq":-1', '"enqueue_seq":1')  # fmt: skip
    assert member == (
        '{"internal":{"request_token":"9f86d081884c7d659a2feaa0c55ad015","request_queue_name":'
        '"request-sortedset","result_queue_name":"results:acme:job-1","enqueue_seq":1},'
        '"request_kind":"plain","data":{"id":"acme:job-1","created":1790000000,"deadline":'
        '1790003600,"payload":{"model":"m","prompt":"hi","max_tokens":8},"metadata":'
        '{"userid":"acme"},"model":"m"}}'
    )
    assert "%.17g" % (1790003600 + 1 / 2097152) == "1790003600.0000005"
    assert "%.17g" % (1790003600 + 2 / 2097152) == "1790003600.000001"


def test_reference_producer_requests_are_served_and_answered_in_its_format(
    ref: tuple[Isolated, str], start_worker: Callable[..., WorkerProc], sim: SimServer
) -> None:
    iso, results = ref
    client = iso.pl.store.client
    producer = Producer(client, iso.queue("rq"), results)
    consumer = Consumer(client, results)
    plain, retried, chat, old = rid(), rid(), rid(), rid()
    tokens = {
        plain: producer.submit(plain, {"model": "m", "prompt": "hi <b> & co", "max_tokens": 3},
                               metadata={"userid": "acme"}, model="m")[0],
        retried: producer.submit(retried, {"prompt": "again", "max_tokens": 2},
                                 headers={"x-sim-fail-first": "1", "x-sim-fail-status": "503"})[0],
        chat: producer.submit(chat, {"messages": [{"role": "user", "content": "hi"}],
                                     "max_tokens": 2}, endpoint="/v1/chat/completions")[0],
        old: producer.submit_pre_463(old, {"prompt": "from v0.9", "max_tokens": 1}),
    }  # fmt: skip
    start_node(start_worker, iso, pools="p", concurrency=4)
    got = consumer.all(4)
    assert set(got) == set(tokens)
    for request_id, record in got.items():
        assert record["status_code"] == 200, record
        assert record["request_token"] == tokens[request_id]
        assert "error_code" not in record and "error_message" not in record
        assert json.loads(record["payload"])["choices"]
        # the generation keys are cleaned once the result is out
        assert not client.exists(f"request-active:{request_id}")
    assert json.loads(got[chat]["payload"])["object"] == "chat.completion"
    assert sim.stats()["attempts_by_request_id"][retried] == 2
    assert client.zcard(iso.queue("rq")) == 0
    # our own API sees them too: the record and its result
    assert iso.pl.wait(plain, 5).ok and iso.pl.wait(retried, 5).attempts == 2


def test_unservable_entries_get_a_terminal_result_never_a_silent_drop(
    ref: tuple[Isolated, str], start_worker: Callable[..., WorkerProc]
) -> None:
    iso, results = ref
    client = iso.pl.store.client
    q = iso.queue("rq")
    producer = Producer(client, q, results)
    consumer = Consumer(client, results)
    expired = rid()
    token = producer.submit(expired, {"prompt": "late"}, timeout=1)[0]
    bad_payload, bad_header, bad_deadline = rid(), rid(), rid()
    producer.submit(bad_payload, None)  # no payload and no payload key
    producer.submit(bad_header, {"prompt": "x"}, headers={"bad header": "v"})
    client.zadd(q, {envelope(bad_deadline, 0, {}, token="t", queue=q, results=results): 1})
    client.zadd(q, {"this is not json": 2, '{"data": {"id": "no-kind"}}': 3})
    deadline = int(time.time()) + 1  # (the entry's whole-second deadline is at most this)
    wait_until(lambda: time.time() > deadline, 5, "the first deadline to pass")
    start_node(start_worker, iso, pools="p", concurrency=2)
    raw, record = consumer.get()
    by_id = {record["id"]: (raw, record)}
    for _ in range(3):
        raw, record = consumer.get()
        by_id[record["id"]] = (raw, record)
    # a deadline that passed while it waited: exactly the reference's record
    raw, _ = by_id[expired]
    assert raw == (f'{{"id":"{expired}","payload":"{{\\"error\\":\\"deadline exceeded\\"}}",'
                   f'"error_code":"DEADLINE_EXCEEDED","error_message":"deadline exceeded",'
                   f'"request_token":"{token}"}}')  # fmt: skip
    for bad in (bad_payload, bad_header, bad_deadline):
        _, record = by_id[bad]
        assert record["error_code"] == "INVALID_REQUEST"
        assert record["error_message"].startswith("malformed queue entry")
        assert json.loads(record["payload"]) == {"error": record["error_message"]}
    # unparsable entries name no result list: the reference's default one
    fallback = Consumer(client, wire.DEFAULT_RESULT_LIST)
    try:
        garbled = fallback.all(2)
    finally:
        client.delete(wire.DEFAULT_RESULT_LIST)
    assert set(garbled) == {"this is not json", "no-kind"}  # the id, when it can be read
    assert all(r["error_code"] == "INVALID_REQUEST" for r in garbled.values())
    assert client.zcard(q) == 0


def test_cancelled_by_the_producer_before_or_after_ingest(
    ref: tuple[Isolated, str], start_worker: Callable[..., WorkerProc], sim: SimServer
) -> None:
    iso, results = ref
    client = iso.pl.store.client
    producer = Producer(client, iso.queue("rq"), results)
    consumer = Consumer(client, results)
    early = rid()
    token = producer.submit(early, {"prompt": "x"})[0]
    assert producer.cancel(early) == 1
    start_node(start_worker, iso, pools="p", concurrency=1)
    _, record = consumer.get()
    assert (record["id"], record["error_code"], record["request_token"]) == (
        early,
        "CANCELLED",
        token,
    )
    assert not client.exists(f"request-cancel:{early}")  # cleaned with the generation
    assert sim.stats()["attempts_by_request_id"].get(early) is None


def test_a_duplicate_member_is_served_once_and_a_new_generation_waits_its_turn(
    ref: tuple[Isolated, str], start_worker: Callable[..., WorkerProc], sim: SimServer
) -> None:
    iso, results = ref
    client = iso.pl.store.client
    q = iso.queue("rq")
    producer = Producer(client, q, results)
    consumer = Consumer(client, results)
    rid1 = rid()
    t1, member = producer.submit(rid1, {"prompt": "one"}, headers=held(rid1))
    start_node(start_worker, iso, pools="p", concurrency=2)
    sim.wait_held(rid1, timeout_s=30)  # the first generation runs until the test releases it
    client.zadd(q, {member: 1})  # the same entry again (a re-add by another dispatcher)
    t2, _ = producer.submit(rid1, {"prompt": "two"})  # a new generation of the live id
    sim.release(rid1)
    first = consumer.get()[1]
    second = consumer.get()[1]
    assert [first["request_token"], second["request_token"]] == [t1, t2]
    assert first["status_code"] == second["status_code"] == 200
    assert client.llen(results) == 0 and client.zcard(q) == 0
    assert sim.stats()["attempts_by_request_id"][rid1] == 2  # one per generation, not three


def test_payload_keys_and_a_payload_that_is_gone(
    ref: tuple[Isolated, str], start_worker: Callable[..., WorkerProc]
) -> None:
    """``WithPayloadKeys()``: the payload sits in ``request-payload:<id>:<token>``, the
    envelope's ``data.payload`` is null; a missing key ends the request PAYLOAD_UNAVAILABLE."""
    iso, results = ref
    client = iso.pl.store.client
    producer = Producer(client, iso.queue("rqcfg"), results)  # the config's result list wins
    cfg = Consumer(client, iso.settings.queues[iso.queue("rqcfg")].result_queue_name or "")
    keyed, gone = rid(), rid()
    body = b'{"prompt":"kept as sent","max_tokens":1,"seed":12345678901234567}'
    client.set(f"request-payload:{keyed}:pre", body)
    producer.submit(keyed, None, payload_ref=f"request-payload:{keyed}:pre")
    producer.submit(gone, None, payload_ref=f"request-payload:{gone}:never-written")
    start_node(start_worker, iso, pools="p", concurrency=2)
    got = cfg.all(2)
    assert got[keyed]["status_code"] == 200
    assert got[gone]["error_code"] == "PAYLOAD_UNAVAILABLE"
    assert client.llen(results) == 0  # the message named `results`; the config won
    assert iso.pl.record(keyed)["payload"] == body.decode()  # the caller's bytes, unchanged
    assert not client.exists(f"request-payload:{keyed}:pre")


def test_ingest_must_name_a_known_format(env: dict[str, str], tmp_path: Path) -> None:
    qfile = tmp_path / "q.json"
    qfile.write_text(json.dumps([{"queue_name": "a", "igw_base_url": "http://x",
                                  "ingest": "kafka"}]))  # fmt: skip
    with pytest.raises(ConfigError, match=r"queue #0 \(a\): ingest must be one of llm-d-async"):
        load_settings({**env, "PIPELINE_QUEUES": str(qfile)})
