"""Chaos: what "at once" means at the server (issue 48, item 10; docs/gates.md, "What at once
means"). A gate's slot is freed when the pipeline gives up on a call (a time-out, an abort, a
lease that could lapse) and closes its connection, not when the server stops working on it. A
server that notices a closed connection only when it writes its answer (the simulator's
``x-sim-hangup-notice: write``) still runs the abandoned call while the next attempt runs: it
counts more than the limit. The bound the docs give, measured here: the calls whose client
still waits never exceed the limit; all the server runs is at most the limit plus the calls
given up on that it has not noticed yet — here each request's earlier attempts, so at most
limit x attempts."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest

from pipeline.cli.services import wait_until
from pipeline.sim import SimServer
from tests.conftest import assert_idle, give_up_after, held
from tests.observability import isolated, start_node

LIMIT, TRIES = 2, 3
GIVE_UP_S = 0.5  # the queue's request_timeout_s: the pipeline gives up on a held call


def test_a_server_that_notices_hang_ups_late_holds_more_than_the_limit(
    env: dict[str, str],
    tmp_path: Path,
    sim: SimServer,
    start_worker: Any,
    record_property: Any,
) -> None:
    gate = {"gate_type": "global-max-concurrency", "gate_params": {"limit": LIMIT}}
    entry = {
        "queue_name": "late",
        "igw_base_url": sim.url,
        "request_timeout_s": GIVE_UP_S,
        "retry_base_delay_s": 0.05,
        "retry_max_delay_s": 0.1,
        **gate,
    }
    iso = isolated(env, tmp_path, [entry])
    queue = iso.queue("late")
    node = start_node(start_worker, iso, concurrency=4)[0]
    sim.reset()
    name = f"late-{uuid.uuid4().hex[:6]}"
    headers = {**held(name), "x-sim-hangup-notice": "write"}
    items = [
        {"payload": {"i": i}, "id": f"{name}-{i}", "queue": queue, "timeout": 600,
         "headers": headers}
        for i in range(LIMIT)
    ]  # fmt: skip
    try:
        ids = [r.id for r in iso.pl.submit_many(items)]

        def tried() -> bool:
            sent = sim.stats()["attempts_by_request_id"]
            return all(sent.get(rid, 0) >= TRIES for rid in ids)

        # every attempt is held, given up on after GIVE_UP_S, and runs on at the server
        wait_until(tried, 60, f"{TRIES} attempts of each request")
        seen = sim.stats()
        sim.release(name)  # the server answers them all (and the attempts to come at once)
        results = list(iso.pl.iter_results(ids, on_poll=give_up_after(60, "results")))
    finally:
        sim.release_all()
        node.stop()
    assert len(results) == LIMIT and all(r.ok for r in results)
    attempts = max(seen["attempts_by_request_id"].values())
    most, live = seen["max_concurrency_observed"], seen["max_live_concurrency_observed"]
    record_property("server_at_once", most)
    record_property("server_at_once_live", live)
    print(f"\nlimit {LIMIT}: the server held {most} at once ({live} with a client waiting)")
    assert live <= LIMIT  # the pipeline's promise: calls it waits on
    assert LIMIT < most <= LIMIT * attempts  # what a late-noticing server counts
    assert_idle(iso.pl)


@pytest.mark.parametrize("notice", ["write", "close"])
def test_the_simulator_counts_an_unnoticed_hang_up(sim: SimServer, notice: str) -> None:
    """The simulator's side: a held call whose client hangs up keeps its slot until its
    answer is written (late notice), or frees it at once."""
    sim.reset()
    name = f"hang-{uuid.uuid4().hex[:6]}"
    headers = {"x-sim-hold": name, "x-sim-hangup-notice": notice}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{sim.url}/v1/completions", json={"prompt": "x"}, headers=headers,
                   timeout=0.3)  # fmt: skip
    if notice == "write":
        wait_until(lambda: sim.stats()["unnoticed_hangups"] == 1, 5, "the hang-up")
        assert sim.stats()["in_flight"] == 1
        sim.release(name)
    wait_until(lambda: sim.stats()["in_flight"] == 0, 5, "the slot freed")
    assert sim.stats()["unnoticed_hangups"] == 0
