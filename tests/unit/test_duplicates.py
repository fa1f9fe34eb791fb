"""Duplicate ids while reading: which rows repeat an id, what their errors say, and the OpenAI
Batch pre-pass."""

from __future__ import annotations

import json
from collections.abc import Iterator

from batchrun.io.readers import DatasetSource, RawRow, open_dataset
from batchrun.io.rows import RowSpec
from batchrun.job.duplicates import DuplicateIds, find_repeats
from batchrun.job.pipeline import openai_duplicates


def raws(*datas: dict | None, start: int = 0) -> list[RawRow]:
    return [RawRow(start + i, d, None if d is not None else "bad") for i, d in enumerate(datas)]


def test_later_rows_with_an_id_fail_naming_the_first() -> None:
    seen = DuplicateIds(RowSpec())
    first = raws({"id": "g1"}, {"id": "g2"}, {"id": "g1"}, {"prompt": "no id"}, None, {"id": 7})
    out = seen.check(first, openai=False)
    assert [e is None for e in out] == [True, True, False, True, True, True]
    e = out[2]
    assert (e.id, e.row, e.type) == ("g1", 2, "duplicate_id")
    assert e.message.startswith("row 2: id 'g1' repeats row 0 (id 'g1')")
    # across batches, an int id and its string are one id; rows without an id never repeat
    later = raws({"id": "7"}, {"id": "g2"}, {"prompt": "no id"}, {"id": ""}, start=10)
    out = seen.check(later, openai=False)
    assert [(e.row, e.message.split(":")[1]) for e in out if e] == [
        (10, " id '7' repeats row 5 (id '7'), which runs under it; give every row its own id"),
        (11, " id 'g2' repeats row 1 (id 'g2'), which runs under it; give every row its own id"),
    ]
    assert seen.num_duplicates == 3


def test_id_column_and_custom_id() -> None:
    seen = DuplicateIds(RowSpec(id_column="key"))
    out = seen.check(raws({"key": 1, "id": "a"}, {"key": 2, "id": "a"}, {"key": 1}), False)
    assert [e.row for e in out if e] == [2] and "key '1' repeats row 0" in out[2].message
    seen = DuplicateIds(RowSpec(id_column="key"))
    rows = raws({"custom_id": "x", "key": 1}, {"custom_id": "x", "key": 2}, {"custom_id": None})
    out = seen.check(rows, openai=True)  # OpenAI Batch rows: custom_id, whatever --id-column
    assert [e.row for e in out if e] == [1] and "custom_id 'x' repeats row 0" in out[1].message


def openai(cid: str) -> dict:
    return {"custom_id": cid, "method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}}


def test_repeated_custom_ids_listed_first_ones_first() -> None:
    batches = [
        raws(None, openai("a"), openai("b"), openai("a")),
        raws(*[openai(f"c{i % 5}") for i in range(20)], start=4),
    ]
    found = find_repeats(iter(batches), show=3)
    assert found.count == 1 + 15
    assert found.examples == [("a", 1, 3), ("c0", 4, 9), ("c1", 5, 10)]
    text = found.message("in.jsonl")
    assert "16 request(s) repeat" in text and "'a' in rows 1 and 3" in text
    assert "and 13 more" in text and "custom_id" in text
    assert find_repeats(iter([])) is None
    assert find_repeats(iter([raws(openai("a"), openai("b"))])) is None


class Source(DatasetSource):
    """Batches as given; fails when read past `readable` batches."""

    def __init__(self, batches: list[list[RawRow]], readable: int) -> None:
        super().__init__(None)
        self.batches, self.readable = batches, readable

    def iter_batches(self, batch_size: int = 1024) -> Iterator[list[RawRow]]:
        for i, batch in enumerate(self.batches):
            assert i < self.readable, "read past the first row that parses"
            yield batch


def test_openai_pre_pass_reads_one_batch_of_other_inputs() -> None:
    rows = [raws(None), raws({"id": "a", "prompt": "x"}, {"id": "a", "prompt": "y"}, start=1)]
    assert openai_duplicates(Source(rows + [raws(None)], readable=2), None) is None
    rows = [raws(None), raws(openai("a"), openai("b"), start=1), raws(openai("a"), start=3)]
    found = openai_duplicates(Source(rows, readable=99), None)
    assert found.count == 1 and found.examples == [("a", 1, 3)]
    assert openai_duplicates(Source(rows, readable=99), limit=2) is None  # --limit: 2 rows


def test_jsonl_field_pass_numbers_rows_as_the_full_read(tmp_path) -> None:
    lines = [
        b"\xef\xbb\xbf" + json.dumps(openai("a")).encode(),
        b"",
        b"{not json",
        b"[1, 2]",
        json.dumps({"custom_id": {"nested": 1}}).encode(),
        json.dumps({"body": {"custom_id": "inner"}, "custom_id": 7}).encode(),
        b"   ",
        json.dumps({"x": 1}).encode(),
    ]
    path = tmp_path / "in.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    source = open_dataset(path)
    full = [(r.row, r.data and r.data.get("custom_id")) for b in source.iter_batches(3) for r in b]
    only = [
        (r.row, r.data and r.data["custom_id"])
        for b in source.iter_field("custom_id", 3)
        for r in b
    ]
    assert only == full == [(0, "a"), (2, None), (3, None), (4, {"nested": 1}), (5, 7), (7, None)]
