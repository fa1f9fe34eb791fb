"""BERT (BertModel: all-MiniLM, bge-en; BertForSequenceClassification: cross-encoders): the
post-norm encoder blocks (models/blocks/encoder.py) with absolute positions from 0 and token
types; the classification head reads the first token through the pooler (tanh)."""

from __future__ import annotations

from typing import Any

from batchrun.models.blocks.encoder import Encoder, EncoderConfig
from batchrun.models.encoder_spec import EncoderSpec


def build(raw: dict[str, Any], num_labels: int, source: str) -> Encoder:
    return Encoder(EncoderConfig.from_dict(raw, False, num_labels, source), roberta=False)


SPEC = EncoderSpec("BertModel", "bert", "BERT", "base", build, "bert.")
CLASSIFIER_SPEC = EncoderSpec("BertForSequenceClassification", "bert", "BERT", "classify", build,
                              "bert.")  # fmt: skip
