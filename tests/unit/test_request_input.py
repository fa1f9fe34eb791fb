"""A request's input_ids are checked where the engine takes it (Engine.add_request, the engine
process's client and worker): a list of ints in [0, vocab size), else a ValueError that names
the request, what was passed and what is expected."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import BatchEncoding

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tiny_models import write_config_dir  # noqa: E402

from batchrun.config import EngineConfig  # noqa: E402
from batchrun.engine.engine import Engine  # noqa: E402
from batchrun.engine_process.worker import _add_requests  # noqa: E402
from batchrun.params import GenerateRequest, SamplingParams  # noqa: E402

VOCAB = 32000  # the "tiny" Llama 3 shape's vocabulary

BAD = [
    pytest.param(
        BatchEncoding({"input_ids": [1, 2, 3], "attention_mask": [1, 1, 1]}),
        ["BatchEncoding", "'input_ids', 'attention_mask'", '["input_ids"]', "return_dict=False"],
        id="batch-encoding",
    ),
    pytest.param({"input_ids": [1, 2]}, ["dict", 'its ["input_ids"]'], id="dict"),
    pytest.param(torch.tensor([1, 2, 3]), ["Tensor", ".tolist()"], id="tensor"),
    pytest.param(np.array([1, 2, 3]), ["ndarray", ".tolist()"], id="ndarray"),
    pytest.param("Hello there", ["a str", "tokenize it first"], id="text"),
    pytest.param([5, 6.0, 7], ["input_ids[1] is 6.0 (float)"], id="float"),
    pytest.param([5, True], ["input_ids[1] is True (bool)"], id="bool"),
    pytest.param([5, "7"], ["input_ids[1] is '7' (str)"], id="str-element"),
    pytest.param([3, -1], ["input_ids[1] is -1", f"[0, {VOCAB})"], id="negative"),
    pytest.param([3, 4, VOCAB], [f"input_ids[2] is {VOCAB}", f"[0, {VOCAB})"], id="too-large"),
    pytest.param([[1, 2, 3]], ["input_ids[0] is a list", "one sequence"], id="batch-of-lists"),
    pytest.param([], ["empty"], id="empty"),
]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    model = write_config_dir("tiny", tmp_path_factory.mktemp("tiny"))
    return Engine(EngineConfig(model=str(model), load_format="dummy", device="cpu", kv_budget=256))


@pytest.mark.parametrize(("input_ids", "fragments"), BAD)
def test_add_request_refuses_with_a_clear_message(engine, input_ids, fragments):
    request = GenerateRequest("q7", input_ids, SamplingParams(max_new_tokens=2))
    with pytest.raises(ValueError) as info:
        engine.add_request(request)
    message = str(info.value)
    assert message.startswith("request 'q7': "), message
    assert "list of token ids" in message, message  # what is expected
    for fragment in fragments:
        assert fragment in message, message
    assert not engine.has_work  # nothing was queued


def test_the_engine_process_worker_refuses_as_an_aborted_result(engine):
    """In the engine process a refusal comes back as one aborted result per sample."""
    bad = GenerateRequest("r1", [1, VOCAB + 5], SamplingParams(max_new_tokens=2, n=2))
    good = GenerateRequest("r2", [1, 2, 3], SamplingParams(max_new_tokens=2, temperature=0))
    refused = _add_requests(engine, [bad, good])
    assert [(r.rid, r.index, r.finish_reason) for r in refused] == [("r1", 0, "abort")] * 1 + [
        ("r1", 1, "abort")
    ]
    assert f"input_ids[1] is {VOCAB + 5}" in refused[0].error
    done = list(engine.generate([]))
    assert [r.rid for r in done] == ["r2"]


def test_good_input_runs_and_tuples_are_taken(engine):
    requests = [
        GenerateRequest("a", [1, 2, 3], SamplingParams(max_new_tokens=3, temperature=0)),
        GenerateRequest("b", (1, 2, 3), SamplingParams(max_new_tokens=3, temperature=0)),
    ]
    done = {r.rid: r for r in engine.generate(requests)}
    assert done["a"].output_ids == done["b"].output_ids
    assert done["a"].prompt_tokens == 3


def test_check_input_ids_returns_a_new_list():
    from batchrun.params import check_input_ids

    ids = [0, 5, VOCAB - 1]
    checked = check_input_ids("x", ids, VOCAB)
    assert checked == ids and checked is not ids
    assert check_input_ids("x", (4, 2), VOCAB) == [4, 2]
