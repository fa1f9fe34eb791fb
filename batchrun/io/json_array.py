"""A ``.json`` file holding one JSON array of row objects, streamed element by element.

The file is decoded through a window that holds the current element plus at most one read ahead
(the window grows for a larger element), so memory follows the largest row, never the file. The
row number is the element's index in the array. An element that is not an object becomes a
``RawRow`` with ``error`` set and the job goes on; JSON that does not parse cannot be split into
rows, so it fails the whole input with the character position (``count_rows`` reads the whole
array before a run starts, so such a file never half-runs).
"""

from __future__ import annotations

import codecs
import gzip
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

from batchrun.io.source import BadInputError, DatasetSource, RawRow

READ_BYTES = 1 << 20
MAX_ELEMENT_CHARS = 1 << 30  # a row larger than this is not a row: refuse the file
_raw_decode = json.JSONDecoder().raw_decode
_SPACE = " \t\r\n"
_CUT_MARGIN = 16  # characters from the window's end where a decode error may be a cut


def open_maybe_gzip(path: Path) -> BinaryIO:
    return gzip.open(path, "rb") if path.name.endswith(".gz") else open(path, "rb")


def first_char(path: Path) -> str:
    """The first character that is not whitespace (or a UTF-8 BOM); "" for an empty file."""
    with open_maybe_gzip(path) as f:
        head = f.read(4096).lstrip(b"\xef\xbb\xbf" + _SPACE.encode())
    return head[:1].decode("latin-1")


class JsonArraySource(DatasetSource):
    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.format = "json.gz" if path.name.endswith(".gz") else "json"

    def iter_batches(self, batch_size: int = 1024) -> Iterator[list[RawRow]]:
        batch: list[RawRow] = []
        with open_maybe_gzip(self.path) as f:
            try:
                for index, value in _Window(f, self.path).elements():
                    batch.append(_raw_row(index, value))
                    if len(batch) >= batch_size:
                        yield batch
                        batch = []
            except (OSError, EOFError) as e:  # truncated or corrupt gzip stream
                raise BadInputError(
                    f"{self.path}: cannot read: {e}; the file is truncated or corrupt"
                ) from e
        if batch:
            yield batch


def _raw_row(index: int, value: Any) -> RawRow:
    if isinstance(value, dict):
        return RawRow(index, value, None)
    kind = "null" if value is None else type(value).__name__
    return RawRow(index, None, f"element {index}: expected a JSON object, got {kind}")


class _Window:
    """Text of the file from the current position on: ``text[pos:]`` is not consumed yet."""

    def __init__(self, f: BinaryIO, path: Path) -> None:
        self.f = f
        self.path = path
        self.decoder = codecs.getincrementaldecoder("utf-8-sig")(errors="strict")
        self.text = ""
        self.pos = 0
        self.consumed = 0  # characters dropped from the front of the window
        self.eof = False

    def more(self) -> bool:
        """Read more (at least as much as the window holds: linear time for a big element)."""
        if self.eof:
            return False
        data = self.f.read(max(READ_BYTES, len(self.text) - self.pos))
        self.eof = not data
        try:
            chunk = self.decoder.decode(data, final=self.eof)
        except UnicodeDecodeError as e:
            raise BadInputError(f"{self.path}: not UTF-8 text ({e}); save it as UTF-8") from e
        self.consumed += self.pos
        self.text = self.text[self.pos :] + chunk
        self.pos = 0
        return True

    def peek(self) -> str:
        """The next character that is not whitespace ("" at the end), left unconsumed."""
        while True:
            while self.pos < len(self.text) and self.text[self.pos] in _SPACE:
                self.pos += 1
            if self.pos < len(self.text) or not self.more():
                return self.text[self.pos : self.pos + 1]

    def fail(self, what: str) -> BadInputError:
        where = self.consumed + self.pos
        return BadInputError(
            f"{self.path}: {what} at character {where}; a .json input is one JSON array of row "
            "objects ([{...}, {...}]) or JSON Lines (one object per line)"
        )

    def elements(self) -> Iterator[tuple[int, Any]]:
        if self.peek() != "[":
            raise self.fail("expected '['")
        self.pos += 1
        if self.peek() == "]":
            self.pos += 1
            return self.end()
        index = 0
        while True:
            self.peek()
            yield index, self.value(index)
            index += 1
            sep = self.peek()
            if sep == "]":
                self.pos += 1
                return self.end()
            if sep != ",":
                raise self.fail(f"expected ',' or ']' after element {index - 1}")
            self.pos += 1

    def value(self, index: int) -> Any:
        while True:
            try:
                value, end = _raw_decode(self.text, self.pos)
            except json.JSONDecodeError as e:
                # NOTE: an error near the window's end (a cut literal "tru", a cut escape) or an
                # unterminated string may be the read boundary: read on. Anything else is wrong
                # JSON, reported without reading the rest of the file.
                cut = e.pos >= len(e.doc) - _CUT_MARGIN or e.msg.startswith("Unterminated")
                if not (cut and self.read_on(index)):
                    self.pos = e.pos
                    raise self.fail(f"element {index}: invalid JSON ({e.msg})") from None
                continue
            # a value that ends exactly at the window's end may go on (a number: 12|34)
            if end < len(self.text) or not self.read_on(index):
                self.pos = end
                return value

    def read_on(self, index: int) -> bool:
        if len(self.text) - self.pos > MAX_ELEMENT_CHARS:
            raise self.fail(f"element {index} is larger than {MAX_ELEMENT_CHARS:,} characters")
        return self.more()

    def end(self) -> None:
        if self.peek() != "":
            raise self.fail("unexpected data after the array")
