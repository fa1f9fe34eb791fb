"""Duplicate ids while reading: which rows repeat an id, what their errors say, and the OpenAI
Batch pre-pass."""

from __future__ import annotations

from collections.abc import Iterator

from batchrun.io.readers import RawRow
from batchrun.io.rows import RowSpec
from batchrun.job.duplicates import DuplicateIds, find_openai_duplicates


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


def test_openai_pre_pass_lists_the_first_duplicates() -> None:
    batches = [
        raws(None, openai("a"), openai("b"), openai("a")),
        raws(*[openai(f"c{i % 5}") for i in range(20)], start=4),
    ]
    found = find_openai_duplicates(iter(batches), show=3)
    assert found.count == 1 + 15
    assert found.examples == [("a", 1, 3), ("c0", 4, 9), ("c1", 5, 10)]
    text = found.message("in.jsonl")
    assert "16 request(s) repeat" in text and "'a' in rows 1 and 3" in text
    assert "and 13 more" in text and "custom_id" in text
    assert find_openai_duplicates(iter(batches[1:2][:0])) is None  # no rows
    assert find_openai_duplicates(iter([raws(openai("a"), openai("b"))])) is None


def test_openai_pre_pass_reads_one_batch_of_other_inputs() -> None:
    def batches() -> Iterator[list[RawRow]]:
        yield raws(None)
        yield raws({"id": "a", "prompt": "x"}, {"id": "a", "prompt": "y"}, start=1)
        raise AssertionError("read past the first row that parses")

    assert find_openai_duplicates(batches()) is None
