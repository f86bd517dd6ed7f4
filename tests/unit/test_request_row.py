"""submit.lua reads a RequestRow by position: the names in pipeline/store/rows.py, the script's
header and the record fields it writes from each position must agree."""

from __future__ import annotations

import json
import re
from importlib import resources

import orjson

from pipeline.store import RequestRow
from pipeline.store.rows import CONTENT

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


def test_a_conflict_compares_the_row_fields_of_the_content_in_its_order() -> None:
    """submit.lua names what differs between a live request and a submission of its id from
    its CONTENT table, by comparing row positions: both follow rows.CONTENT."""
    table = re.search(r"local CONTENT = \{([^}]*)\}", SUBMIT)
    positions = re.search(r"for j, mine in ipairs\(\{([^}]*)\}\)", SUBMIT)
    assert table is not None and positions is not None
    assert tuple(re.findall(r"'(\w+)'", table.group(1))) == CONTENT
    compared = [RequestRow._fields[int(n) - 1] for n in re.findall(r"r\[(\d+)\]", positions[1])]
    assert tuple(compared) == CONTENT
