"""The ``<think> ... </think>`` family: a completion's token ids split into the reasoning and
the answer.

    [<think>] reasoning ... </think> answer ...      -> reasoning, answer
    reasoning ... </think> answer ...                -> the prompt opened the block (or the
                                                        model skipped <think>): reasoning, answer
    <think> reasoning ...  (no </think>)             -> the thinking never ended: reasoning,
                                                        no answer
    answer ...  (no marker, block not open)          -> no reasoning, the answer
"""

from __future__ import annotations

from typing import NamedTuple

from batchrun.chat.markers import ThinkMarkers


class Split(NamedTuple):
    reasoning_ids: list[int] | None  # None: the output has no thinking block
    answer_ids: list[int]
    unfinished: bool  # the output ended inside the thinking block


def find(ids: list[int], seq: tuple[int, ...], start: int = 0, stop: int | None = None) -> int:
    """The first index i in [start, stop) where ids[i:i+len(seq)] == seq, or -1."""
    stop = len(ids) if stop is None else stop
    n = len(seq)
    first = seq[0]
    i = start
    while i < stop:
        try:
            i = ids.index(first, i, stop)
        except ValueError:
            return -1
        if tuple(ids[i : i + n]) == seq:
            return i
        i += 1
    return -1


def split_think(ids: list[int], markers: ThinkMarkers, prompt_open: bool) -> Split:
    """`ids`: the output tokens; `prompt_open`: the prompt left a thinking block open."""
    try:
        end = ids.index(markers.end_id)
    except ValueError:
        end = -1
    start = find(ids, markers.start_ids, 0, end if end >= 0 else None)
    body = start + len(markers.start_ids) if start >= 0 else 0
    if end >= 0:
        return Split(ids[body:end], ids[end + 1 :], False)
    if start >= 0 or prompt_open:
        return Split(ids[body:], [], True)
    return Split(None, ids, False)
