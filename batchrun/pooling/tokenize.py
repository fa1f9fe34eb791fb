"""Tokenization in worker processes, so the model's steps never wait on it: each worker loads the
model's tokenizer once and tokenizes chunks of texts as PoolingModel.tokenize does (truncation to
max_seq_length included); results come back in order."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from concurrent.futures import ProcessPoolExecutor
from functools import lru_cache, partial
from multiprocessing import get_context
from pathlib import Path

from batchrun.pooling.model import RowTokenizer, TokenRow


@lru_cache(maxsize=1)
def _worker_tokenizer(model_dir: str, max_len: int, kind: str) -> RowTokenizer:
    """The worker process's tokenizer, loaded by its first chunk."""
    from transformers import AutoTokenizer

    return RowTokenizer(AutoTokenizer.from_pretrained(model_dir), max_len, kind)


def _tokenize(
    where: tuple[str, int, str], chunk: list[tuple[str, str | None, str | None]]
) -> list[TokenRow | str]:
    """TokenRows, or the error message of a row that cannot be tokenized."""
    tok = _worker_tokenizer(*where)
    out: list[TokenRow | str] = []
    for text, pair, prompt in chunk:
        try:
            out.append(tok.tokenize(text, pair, prompt))
        except ValueError as e:
            out.append(str(e))
    return out


class ParallelTokenizer:
    """`map(items)` over (text, pair, prompt) triples -> TokenRow or an error message, in order,
    by `num_workers` processes (spawned: no CUDA state crosses), `chunk` rows a task."""

    def __init__(self, model_dir: str | Path, max_len: int, kind: str, num_workers: int = 4,
                 chunk: int = 256):  # fmt: skip
        self.chunk, self.num_workers = chunk, num_workers
        self.work = partial(_tokenize, (str(model_dir), max_len, kind))
        self.pool = ProcessPoolExecutor(num_workers, mp_context=get_context("spawn"))

    def map(self, items: Iterable[tuple[str, str | None, str | None]]) -> Iterator[TokenRow | str]:
        def chunks():
            buf = []
            for item in items:
                buf.append(item)
                if len(buf) == self.chunk:
                    yield buf
                    buf = []
            if buf:
                yield buf

        for rows in self.pool.map(self.work, chunks()):
            yield from rows

    def warm(self) -> None:
        """Start every worker and load its tokenizer (before a timed region)."""
        list(self.pool.map(self.work, [[("warm", None, None)]] * self.num_workers * 2))

    def close(self) -> None:
        self.pool.shutdown()

    def __enter__(self) -> ParallelTokenizer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
