"""The patches in ``tasks.compat`` to kombu's Redis transport and billiard's tracebacks."""

from __future__ import annotations

import json
import pickle
import traceback
import types
import uuid

from billiard.einfo import ExceptionInfo

from tasks import compat
from tasks.app import app


def test_a_channel_publishes_through_one_cached_client() -> None:
    with app.connection_for_write() as conn:
        channel = conn.default_channel
        client = channel._create_client()
        assert channel._create_client() is client  # not a new redis.Redis per publish
        assert channel._create_client(asynchronous=True) is not client
        assert client.ping()
    with app.connection_for_write() as conn:
        assert conn.default_channel._create_client() is not client  # a new channel, a new one


def _einfo_of_a_raise() -> ExceptionInfo:
    def inner() -> None:
        raise ValueError("boom")

    try:
        inner()
    except ValueError:
        return ExceptionInfo()
    raise AssertionError("unreachable")


def test_tracebacks_copy_code_positions_only_when_read_or_pickled() -> None:
    einfo = _einfo_of_a_raise()
    frame = einfo.tb.tb_next.tb_frame  # billiard's copy of inner()'s frame
    code = frame.f_code
    assert "_co_positions" in vars(code) and not vars(code)["_co_positions"]  # not copied yet
    assert isinstance(code, types.CodeType) and code.co_name == "inner"
    # pickled (a prefork child sending it to its parent): the positions travel with it
    copy = pickle.loads(pickle.dumps(einfo))
    positions = list(copy.tb.tb_next.tb_frame.f_code.co_positions())
    assert positions and all(len(p) == 4 for p in positions)
    assert list(code.co_positions()) == positions  # read here: listed from the real code
    # formatted again, both name the raise with its line, as before the patch
    for e in (einfo, copy):
        text = "".join(traceback.format_tb(e.tb))
        assert 'raise ValueError("boom")' in text and ", in inner" in text
    assert "ValueError: boom" in einfo.traceback


def test_a_no_ack_brpop_takes_a_batch_bounded_by_free_slots() -> None:
    """A no-ack consumer's BRPOP has an RPOP with a count behind it: the messages come in the
    list's order, at most the node's free slots in all; with no bound, one per BRPOP."""
    name = f"compat-batch-{uuid.uuid4().hex[:8]}"
    got: list[int] = []
    before = compat._room
    with app.connection_for_write() as conn:
        channel = conn.default_channel
        try:
            for i in range(6):
                channel.basic_publish(channel.prepare_message(json.dumps({"i": i})), "", name)
            channel.basic_consume(
                name, True, lambda m: got.append(json.loads(m.body)["i"]), "compat-batch"
            )
            compat.bound_batches(lambda: 3)
            conn.drain_events(timeout=5)
            assert got == [0, 1, 2]  # the BRPOP's and two more
            compat.bound_batches(None)
            conn.drain_events(timeout=5)
            assert got == [0, 1, 2, 3]  # one
            compat.bound_batches(lambda: 100)
            conn.drain_events(timeout=5)
            assert got == [0, 1, 2, 3, 4, 5]  # what was left
            assert channel.client.llen(name) == 0
        finally:
            compat.bound_batches(before)
            channel.client.delete(name)
