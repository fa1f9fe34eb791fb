"""A pooling job's rows tokenized by worker processes equal the job's own process's, in input
order, a bad row's error in its place; until a worker has started, the job's process tokenizes."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from batchrun.io.readers import open_dataset
from batchrun.io.rows import RowError, RowSpec
from batchrun.pooling.job_options import PoolingJobOptions
from batchrun.pooling.job_rows import PoolingRows, TokenizerPool
from batchrun.pooling.model import load_pooling_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from pooling_models import TEXTS, make_encoder, make_sentence_transformer  # noqa: E402


def test_worker_processes_give_the_in_process_rows_in_order(tmp_path):
    make_encoder(tmp_path / "hf", "bert")
    st = tmp_path / "st"
    make_sentence_transformer(tmp_path / "hf", st, "mean", True, 48)
    rows = [json.dumps({"id": f"id{i}", "text": TEXTS[i % 16] * (1 + i % 3)}) for i in range(700)]
    rows[5] = json.dumps({"id": "empty", "text": ""})
    rows[300] = "{not json"
    data = tmp_path / "in.jsonl"
    data.write_text("\n".join(rows) + "\n")
    model = load_pooling_model(st)
    options = PoolingJobOptions("embed")

    def read(pool: TokenizerPool) -> tuple[list, PoolingRows]:
        reader = PoolingRows(open_dataset(data), RowSpec(id_column="id"), options, model, None,
                             64, str(st), pool)  # fmt: skip
        return list(reader), reader

    want, _ = read(TokenizerPool(str(st), 0))
    pool = TokenizerPool(str(st), 2)
    try:
        for future in pool.warming:
            future.result(timeout=300)
        assert pool.is_ready  # every batch goes to the workers
        got, reader = read(pool)
    finally:
        pool.close()
    assert got == want and len(got) == 700
    assert [type(r) is RowError for r in got].count(True) == 2
    assert reader.tokenize_s > 0 and reader.num_tokens == sum(
        len(t.input_ids) for r in want if not isinstance(r, RowError) for t in r.token_rows
    )
