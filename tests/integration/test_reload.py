"""Hot reload of the queue and pool files on a running worker node (``pipeline reload`` and
``SIGHUP``): queues added and changed, gate limits and types swapped under live reservations
(threads and prefork pools), files that do not validate rejected with the old config serving
on, and a queue with waiting requests kept. Real worker nodes, a real Redis and the simulator
over HTTP; every test ends with the leak check."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from pipeline.cli.services import wait_until
from pipeline.client import Pipeline
from pipeline.config import (
    PoolConfig,
    QueueConfig,
    Settings,
    diff_config,
    from_snapshot,
    load_settings,
    parse_pools,
    parse_queues,
    reload_queue_files,
    to_snapshot,
)
from pipeline.errors import ConfigError
from pipeline.gates import AcquireContext, same_attempt_gate
from pipeline.sim import SimConfig, SimServer
from pipeline.worker import Runtime
from pipeline.worker.handover import Handover
from pipeline.worker.reservation import Reservation
from tests.conftest import ROOT, assert_idle, held, local_limit
from tests.observability import FAST, Isolated, isolated, scrape, total


def write_queues(iso: Isolated, entries: list[dict[str, Any]]) -> Pipeline:
    """Rewrite the node's queue file (names tagged as ``isolated`` does); returns a client
    that knows the new queues."""
    out = []
    for q in entries:
        e = {**FAST, **q}
        e["queue_name"] = iso.queue(q["queue_name"])
        e["worker_pool_id"] = iso.pool(q.get("worker_pool_id", "p"))
        out.append(e)
    Path(iso.env["PIPELINE_QUEUES"]).write_text(json.dumps(out))
    return Pipeline(load_settings(iso.env))


def reload(iso: Isolated) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pipeline", "reload", "--timeout", "30"],
        env=iso.env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )


def reloads(port: int, result: str) -> float:
    return total(scrape(port), "pipeline_queue_config_reloads_total", result=result)


@pytest.fixture
def slow_sim() -> Iterator[SimServer]:
    """A simulator of this test's own, whose concurrency the test reads; the tests hold their
    requests there (``x-sim-hold``) until they have looked."""
    with SimServer(SimConfig()) as server:
        yield server


# -- the pieces ------------------------------------------------------------------------------
def test_diff_and_same_gate_tell_what_a_reload_changes() -> None:
    def settings(*entries: dict[str, Any]) -> Settings:
        return Settings(queues=parse_queues(list(entries), "q.json"))

    base = {"igw_base_url": "http://a"}
    old = settings({"queue_name": "a", **base, **local_limit(2)}, {"queue_name": "b", **base})
    new = settings(
        {"queue_name": "a", **base, **local_limit(4)},
        {"queue_name": "c", **base},
    )
    change = diff_config(old, new)
    assert (change.added, change.removed, change.changed) == (("c",), ("b",), ("a",))
    assert change.describe() == "added c; changed a; removed b"
    assert not diff_config(old, old)
    assert not same_attempt_gate(old, new, "a")  # a new limit: a new gate object
    timeout = settings({"queue_name": "a", **base, **local_limit(2), "request_timeout_s": 9})
    assert same_attempt_gate(old, timeout, "a")  # same gate: the object (and keys) stay


def test_reload_reads_the_files_again_and_names_what_is_wrong(tmp_path: Path) -> None:
    qfile = tmp_path / "q.json"
    qfile.write_text(json.dumps([{"queue_name": "a", "igw_base_url": "http://a"}]))
    env = {"PIPELINE_QUEUES": str(qfile), "PIPELINE_LEASE_S": "7"}
    current = load_settings(env)
    qfile.write_text(json.dumps([{"queue_name": "b", "igw_base_url": "http://b"}]))
    new = reload_queue_files(current, env)
    assert list(new.queues) == ["b"] and new.lease_s == 7
    assert isinstance(new.queues["b"], QueueConfig)
    qfile.write_text("[{")
    with pytest.raises(ConfigError, match="is not valid JSON"):
        reload_queue_files(current, env)
    qfile.write_text(json.dumps([{"queue_name": "b", "igw_base_url": "ftp://b"}]))
    with pytest.raises(ConfigError, match=r"queue #0 \(b\): igw_base_url"):
        reload_queue_files(current, env)
    with pytest.raises(ConfigError, match="PIPELINE_QUEUES is not set"):
        reload_queue_files(current, {})


def test_the_snapshot_children_follow_round_trips_every_field() -> None:
    """What a node writes for its prefork children reads back as the same config, with
    every field at its default and every field set (a field added later is covered)."""
    plain = {"queue_name": "plain", "igw_base_url": "https://a"}
    full = {
        "queue_name": "full", "igw_base_url": "https://b", "id": "full-id",
        "request_path_url": "/v1/chat/completions", "inference_objective": "o",
        "worker_pool_id": "p2", **local_limit(3), "labels": {"tier": "batch"},
        "result_queue_name": "full-results", "default_timeout_s": 10, "request_timeout_s": 5,
        "retry_base_delay_s": 0.5, "retry_max_delay_s": 9, "max_attempts": 4, "api_key_env": "K",
        "tls_ca_file": "/ca.pem", "tls_cert_file": "/c.pem", "tls_key_file": "/k.pem",
        "tls_insecure_skip_verify": True, "follow_redirects": True, "max_response_bytes": 99,
        "redirect_origins": ["https://c:8443"],
        "result_list": False, "result_list_max_len": 7,
        "result_ttl_seconds": 60, "ingest": "llm-d-async", "weight": 3, "fair_share": True,
        "engine_priority": True, "group_prefixes": False, "prefix_field": "doc",
        "group_slack_s": 30, "engine_hints": True,
    }  # fmt: skip
    # every field of a queue is set here: a new one must be added (and round-trip too)
    assert set(full) == set(QueueConfig.__dataclass_fields__)
    queues = parse_queues([plain, full], "q.json")
    pools = parse_pools(
        [{"id": "default"}, {"id": "p2", "workers": 3, **local_limit(2)}], "p.json", queues
    )
    settings = Settings(queues=queues, pool_configs=pools)
    back = from_snapshot(Settings(), json.loads(json.dumps(to_snapshot(settings))), "snap")
    assert back.queues == settings.queues and back.pool_configs == settings.pool_configs
    assert isinstance(back.pool_configs["p2"], PoolConfig)


def test_a_slot_of_a_replaced_gate_is_released_not_handed_over(env: dict[str, str]) -> None:
    """Limit 1 → 3 while an attempt holds the slot and another is parked for it: the holder
    releases its slot (the parked one is rung and asks the new gate) instead of handing it
    over under the old gate's limit, whose transfer would fail after the taker had already
    left for the server — one request more at the server than the gate counts."""
    prefix = f"plrl{uuid.uuid4().hex[:6]}:"
    base = Settings(redis_url=env["PIPELINE_REDIS_URL"], key_prefix=prefix, lease_s=30)

    def with_limit(n: int) -> Settings:
        entry = {"queue_name": "q", "igw_base_url": "http://127.0.0.1:9", **local_limit(n)}
        return Settings(**{**base.__dict__, "queues": parse_queues([entry], "q.json")})

    rt = Runtime(with_limit(1))

    def ctx(rid: str) -> AcquireContext:
        return AcquireContext(rid, "t", "q", "w@test", 30.0, time.time() + 60)

    try:
        old = rt.gate("q")
        assert old.acquire(ctx("holder")).admitted
        parked: list[Any] = []
        gen = rt.bell.generation("q")
        waiter = threading.Thread(
            target=lambda: parked.append(rt.bell.park("q", gen, 10.0, ctx("waiter"), old))
        )
        waiter.start()
        wait_until(lambda: rt.bell.waiting("q") == 1, 5, "the parked attempt")
        rt.apply(with_limit(3))
        new = rt.gate("q")
        assert new is not old and new.acquire(ctx("newcomer")).admitted  # 2 of 3
        res = Reservation(rt, "q", "holder:t", old)
        res.bind(ctx("holder"))
        assert res.ask().admitted  # the slot it holds of the old gate, acquired above
        handed: list[bool] = []

        def finish(handover: Handover) -> Any:
            handed.append(handover.handed_over)  # (a finish of a request not there: a no-op)
            return rt.store.finish_call(
                "holder", "t", attempted=False, status_code=None, payload=""
            )

        assert rt.store.finished(res.release_with(finish)) is None
        assert handed == [False]
        waiter.join(10)
        (ticket,) = parked
        assert ticket is not None and ticket.rang and not ticket.granted
        assert [h["request_id"] for h in new.holders()] == ["newcomer"]
        new.release("newcomer:t")
        assert new.in_flight() == 0
    finally:
        rt.stop()


# -- on a running node -----------------------------------------------------------------------
def test_queues_added_by_reload_and_by_sighup_serve_requests(
    env: dict[str, str], sim: SimServer, tmp_path: Path, nodes: Callable[..., Any]
) -> None:
    a = {"queue_name": "a", "igw_base_url": sim.url}
    iso = isolated(env, tmp_path, [a])
    w, port = nodes(iso, concurrency=2)
    assert reloads(port, "success") == 0 and reloads(port, "error") == 0
    started = total(scrape(port), "pipeline_queue_config_last_success_timestamp_seconds")
    assert started > 0
    pl = write_queues(iso, [a, {"queue_name": "b", "igw_base_url": sim.url}])
    out = reload(iso)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.strip() == f"{w.name}: success: added {iso.queue('b')}"
    assert pl.submit({"prompt": "new"}, queue=iso.queue("b")).result(timeout=20).ok
    # an unchanged file: nothing to do, nothing counted
    out = reload(iso)
    assert out.returncode == 0 and out.stdout.strip() == f"{w.name}: unchanged"
    # SIGHUP: the node alone, same reload
    pl = write_queues(iso, [a, {"queue_name": "b", "igw_base_url": sim.url},
                            {"queue_name": "c", "igw_base_url": sim.url}])  # fmt: skip
    w.proc.send_signal(signal.SIGHUP)
    wait_until(
        lambda: f"config reloaded (SIGHUP): added {iso.queue('c')}" in w.log.read_text(),
        15,
        "the SIGHUP reload",
    )
    assert pl.submit({"prompt": "hup"}, queue=iso.queue("c")).result(timeout=20).ok
    assert pl.submit({"prompt": "old"}, queue=iso.queue("a")).result(timeout=20).ok
    assert w.proc.poll() is None  # reloaded, not restarted
    samples = scrape(port)
    assert total(samples, "pipeline_queue_config_reloads_total", result="success") == 2
    assert total(samples, "pipeline_queue_config_last_success_timestamp_seconds") > started
    # the new queues' series are there too
    assert total(samples, "pipeline_request_total", queue_name=iso.queue("c")) == 1
    assert_idle(pl)


@pytest.mark.parametrize("pool_impl", ["threads", "prefork"])
def test_a_new_limit_applies_while_reservations_are_held(
    env: dict[str, str],
    slow_sim: SimServer,
    tmp_path: Path,
    nodes: Callable[..., Any],
    pool_impl: str,
) -> None:
    """Limit 2 → 5 in the middle of a batch: the holders of the old gate stay valid and
    release normally, the server sees up to 5 at once after the reload and never more, and no
    reservation is left behind."""
    q = {"queue_name": "lim", "igw_base_url": slow_sim.url}
    iso = isolated(env, tmp_path, [{**q, **local_limit(2)}])
    w, _ = nodes(iso, concurrency=8, pool_impl=pool_impl)
    pl = iso.pl
    hold = held(iso.tag)  # every request stays at the server until the test releases them
    ids = [
        pl.submit({"prompt": f"p{i}"}, queue=iso.queue("lim"), headers=hold).id for i in range(30)
    ]
    slow_sim.wait_held(iso.tag, 2)
    assert pl.inspect()[iso.queue("lim")]["gate"]["in_flight"] == 2
    pl = write_queues(iso, [{**q, **local_limit(5)}])
    out = reload(iso)
    assert out.returncode == 0, out.stdout + out.stderr
    slow_sim.wait_held(iso.tag, 5)  # the old gate's two still held, three more by the new one
    assert slow_sim.stats()["in_flight"] == 5
    slow_sim.release(iso.tag)
    for rid in ids:
        assert pl.wait(rid, timeout=60).ok
    stats = slow_sim.stats()
    assert stats["max_concurrency_observed"] == 5, stats
    assert stats["requests"] == 30  # nothing sent twice
    assert_idle(pl)


def test_a_new_gate_type_keeps_old_holders_releasing_on_the_old_gate(
    env: dict[str, str], slow_sim: SimServer, tmp_path: Path, nodes: Callable[..., Any]
) -> None:
    """local-max-concurrency → global-max-concurrency (other Redis keys) mid-batch: attempts
    admitted by the old gate release on it, the new one counts from zero; both end empty."""
    q = {"queue_name": "swap", "igw_base_url": slow_sim.url}
    iso = isolated(env, tmp_path, [{**q, **local_limit(2)}])
    w, _ = nodes(iso, concurrency=6)
    pl = iso.pl
    hold = held(iso.tag)  # every request stays at the server until the test releases them
    ids = [
        pl.submit({"prompt": f"p{i}"}, queue=iso.queue("swap"), headers=hold).id for i in range(16)
    ]
    slow_sim.wait_held(iso.tag, 2)  # the old gate's two: held until after the reload
    glob = {"gate_type": "global-max-concurrency", "gate_params": {"limit": 3}}
    pl = write_queues(iso, [{**q, **glob}])
    out = reload(iso)
    assert out.returncode == 0, out.stdout + out.stderr
    slow_sim.release(iso.tag)
    for rid in ids:
        assert pl.wait(rid, timeout=60).ok
    stats = slow_sim.stats()
    # the old gate's 2 and the new gate's 3 may overlap once, never more
    assert stats["max_concurrency_observed"] <= 5 and stats["requests"] == 16, stats
    assert pl.inspect()[iso.queue("swap")]["gate"]["type"] == "global-max-concurrency"
    assert_idle(pl)  # every gate key under the prefix, old and new, holds nothing


def test_a_file_that_does_not_validate_is_rejected_and_the_old_config_serves(
    env: dict[str, str], sim: SimServer, tmp_path: Path, nodes: Callable[..., Any]
) -> None:
    a = {"queue_name": "a", "igw_base_url": sim.url}
    iso = isolated(env, tmp_path, [a])
    w, port = nodes(iso, concurrency=2)
    qfile = Path(iso.env["PIPELINE_QUEUES"])
    good = qfile.read_text()
    bad_files = [
        ("[{", "is not valid JSON"),
        (json.dumps([{**a, "queue_name": iso.queue("a"), "gate_type": "nope"}]),
         f"queue '{iso.queue('a')}': unknown gate_type 'nope'"),
        (json.dumps([{**a, "queue_name": iso.queue("a"), "api_key_env": "PIPELINE_NO_SUCH_KEY"}]),
         f"queue '{iso.queue('a')}': api_key_env: the environment variable PIPELINE_NO_SUCH_KEY"),
        (json.dumps([{**a, "queue_name": iso.queue("a"), "worker_pool_id": iso.pool(),
                      "retry_base_delay_s": -1}]), "retry_base_delay_s must be a positive"),
    ]  # fmt: skip
    for text, reason in bad_files:
        qfile.write_text(text)
        out = reload(iso)
        assert out.returncode == 1, out.stdout
        assert out.stdout.startswith(f"{w.name}: error: ") and reason in out.stdout, out.stdout
        assert "rejected, the old config stays" in w.log.read_text()
    assert reloads(port, "error") == len(bad_files) and reloads(port, "success") == 0
    assert iso.pl.submit({"prompt": "still"}, queue=iso.queue("a")).result(timeout=20).ok
    qfile.write_text(good)
    assert reload(iso).stdout.strip() == f"{w.name}: unchanged"
    assert_idle(iso.pl)


def test_removing_a_queue_with_waiting_requests_is_refused(
    env: dict[str, str], sim: SimServer, tmp_path: Path, nodes: Callable[..., Any]
) -> None:
    a = {"queue_name": "a", "igw_base_url": sim.url}
    # no node serves pool "held": its requests wait until the test cancels them
    held = {"queue_name": "held", "igw_base_url": sim.url, "worker_pool_id": "held"}
    iso = isolated(env, tmp_path, [a, held])
    w, port = nodes(iso, concurrency=2)
    waiting = [iso.pl.submit({"prompt": "w"}, queue=iso.queue("held")).id for _ in range(3)]
    write_queues(iso, [a])
    out = reload(iso)
    assert out.returncode == 1
    assert out.stdout.strip() == (
        f"{w.name}: error: queue '{iso.queue('held')}' cannot be removed: it still has 3 "
        "request(s) (3 pending, 0 retry_wait, 0 running); remove it from the clients' queue "
        "file, let it drain, then reload"
    )
    assert iso.pl.submit({"prompt": "a"}, queue=iso.queue("a")).result(timeout=20).ok
    for rid in waiting:
        assert iso.pl.cancel(rid)
    out = reload(iso)
    assert out.returncode == 0 and out.stdout.strip() == f"{w.name}: success: removed " + (
        iso.queue("held")
    ), out.stdout
    assert reloads(port, "error") == 1 and reloads(port, "success") == 1
    assert_idle(iso.pl)


def test_reload_with_no_node_says_so(env: dict[str, str], sim: SimServer, tmp_path: Path) -> None:
    iso = isolated(env, tmp_path, [{"queue_name": "a", "igw_base_url": sim.url}])
    out = reload(iso)
    assert out.returncode == 1 and "no live worker node" in out.stderr
