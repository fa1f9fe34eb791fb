"""ModernBERT (ModernBertModel, ModernBertForSequenceClassification): pre-norm encoder blocks with
rotary positions, a GeGLU MLP and global / local bidirectional attention
(models/blocks/modernbert.py); its head pools (cls or mean) through dense, act and norm."""

from __future__ import annotations

from typing import Any

from batchrun.models.blocks.modernbert import ModernBert, ModernBertConfig
from batchrun.models.encoder_spec import EncoderSpec


def build(raw: dict[str, Any], num_labels: int, source: str) -> ModernBert:
    return ModernBert(ModernBertConfig.from_dict(raw, num_labels, source))


SPEC = EncoderSpec("ModernBertModel", "modernbert", "ModernBERT", "base", build, "model.")
CLASSIFIER_SPEC = EncoderSpec("ModernBertForSequenceClassification", "modernbert", "ModernBERT",
                              "classify", build, "model.")  # fmt: skip
