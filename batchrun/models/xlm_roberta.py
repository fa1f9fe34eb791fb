"""XLM-RoBERTa (XLMRobertaModel: bge-m3's dense vectors; XLMRobertaForSequenceClassification:
bge-reranker-v2-m3): BERT's blocks (models/blocks/encoder.py) with positions from
pad_token_id + 1; the classification head reads the first token through classifier.dense (tanh)
into classifier.out_proj."""

from __future__ import annotations

from typing import Any

from batchrun.models.blocks.encoder import Encoder, EncoderConfig
from batchrun.models.encoder_spec import EncoderSpec


def build(raw: dict[str, Any], num_labels: int, source: str) -> Encoder:
    return Encoder(EncoderConfig.from_dict(raw, True, num_labels, source), roberta=True)


SPEC = EncoderSpec("XLMRobertaModel", "xlm-roberta", "XLM-RoBERTa", "base", build, "roberta.")
CLASSIFIER_SPEC = EncoderSpec("XLMRobertaForSequenceClassification", "xlm-roberta",
                              "XLM-RoBERTa", "classify", build, "roberta.")  # fmt: skip
