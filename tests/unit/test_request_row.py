"""submit.lua reads a RequestRow by position: the names in pipeline/store/rows.py, the script's
header and the record fields it writes from each position must agree."""

from __future__ import annotations

import json
import re
from importlib import resources

import orjson
from hypothesis import given
from hypothesis import strategies as st

from pipeline.store import RequestRow
from pipeline.store.rows import FINGERPRINT_PARTS, differs, fingerprint

SUBMIT = resources.files("pipeline.store").joinpath("lua/submit.lua").read_text()


def test_the_header_names_the_fields_in_the_rows_order() -> None:
    header = SUBMIT.split("in its order:", 1)[1].split(". ", 1)[0]
    names = [n.strip() for n in re.sub(r"--", " ", header).split(",")]
    assert names == list(RequestRow._fields)


def test_every_record_field_comes_from_the_row_field_of_its_name() -> None:
    pairs = re.findall(r"'(\w+)', r\[(\d+)\]", SUBMIT)
    custom = re.search(r"'custom_id'\s+fields\[#fields \+ 1\] = r\[(\d+)\]", SUBMIT)
    assert custom is not None
    pairs.append(("custom_id", custom.group(1)))
    assert len(pairs) >= 10
    for field, position in pairs:
        assert RequestRow._fields[int(position) - 1] == field, (field, position)
    first = re.search(r"local id, queue, pool = r\[(\d)\], r\[(\d)\], r\[(\d)\]", SUBMIT)
    assert first is not None
    assert [RequestRow._fields[int(i) - 1] for i in first.groups()] == ["id", "queue", "pool"]


def test_a_row_goes_out_as_a_json_array_in_field_order() -> None:
    row = RequestRow(*(f"v{i}" for i in range(len(RequestRow._fields))))
    assert json.loads(json.dumps([row])) == [list(row)]
    assert orjson.loads(orjson.dumps([row], default=list)) == [list(row)]


@given(
    parts=st.lists(st.text(max_size=40), min_size=4, max_size=4),
    changed=st.sets(st.sampled_from(FINGERPRINT_PARTS), min_size=1),
)
def test_a_fingerprint_names_exactly_the_parts_that_changed(
    parts: list[str], changed: set[str]
) -> None:
    named = zip(FINGERPRINT_PARTS, parts, strict=True)
    other = [p + "!" if name in changed else p for name, p in named]
    ours, theirs = fingerprint(*parts), fingerprint(*other)
    assert ours == fingerprint(*parts) and ours != theirs
    assert differs(ours, theirs) == [n for n in FINGERPRINT_PARTS if n in changed]
