"""OpenAI Batch `/v1/embeddings` rows: string or list input, dimensions, encoding_format float /
base64 (float32 little-endian, as the OpenAI client decodes it), the response's shape."""

from __future__ import annotations

import base64

import msgspec
import numpy as np
import pytest

from batchrun.pooling.openai_embeddings import read_body, response_body


def test_body_reads_a_string_or_a_list():
    assert read_body({"input": "hi"}).texts == ("hi",)
    body = read_body({"input": ["a", "b"], "dimensions": 8, "encoding_format": "base64"})
    assert body.texts == ("a", "b") and body.dimensions == 8 and body.encoding_format == "base64"


@pytest.mark.parametrize(
    "body,message",
    [
        ({"input": []}, "non-empty list of strings"),
        ({"input": [1, 2]}, "token-id inputs are not supported"),
        ({"input": "a", "encoding_format": "int8"}, "supported: float, base64"),
        ({"input": "a", "dimensions": 0}, "positive integer"),
    ],
)
def test_bad_bodies_name_what_is_wrong(body, message):
    with pytest.raises(ValueError, match=message):
        read_body(body)


def test_response_shape_float_and_base64():
    vectors = np.array([[0.5, -1.25, 3.0], [1.0, 0.0, -0.5]], dtype=np.float32)
    out = msgspec.json.decode(msgspec.json.encode(response_body(vectors, "m", 7, "float")))
    assert out["object"] == "list" and out["model"] == "m"
    assert out["usage"] == {"prompt_tokens": 7, "total_tokens": 7}
    assert out["data"][1] == {"index": 1, "embedding": [1.0, 0.0, -0.5], "object": "embedding"}
    b64 = msgspec.json.decode(msgspec.json.encode(response_body(vectors, "m", 7, "base64")))
    raw = base64.b64decode(b64["data"][0]["embedding"])
    assert np.array_equal(np.frombuffer(raw, dtype="<f4"), vectors[0])
