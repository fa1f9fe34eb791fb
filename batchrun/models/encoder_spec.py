"""EncoderSpec: what the registry (models/registry.py ENCODERS) holds for one bidirectional
encoder's `architectures` name (embed / rerank / score / classify only: batchrun/pooling runs
them), written in the architecture's own file (models/bert.py, xlm_roberta.py, modernbert.py).

A spec says how config.json reads (its `build` refuses what the blocks do not implement), which
blocks build it, what its head is, and its checkpoint's name prefix."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import nn


@dataclass(frozen=True)
class EncoderSpec:
    name: str  # config.json's `architectures` entry
    model_type: str
    family: str  # what users call it, for messages
    head: str  # base (hidden states: vectors) or classify (a sequence-classification head)
    # (config.json, the head's labels (0 for base), where it came from) -> the net, on meta
    build: Callable[[dict[str, Any], int, str], nn.Module]
    # the checkpoint's prefix before the blocks' parameter names ("bert.", "roberta.", "model.")
    checkpoint_prefix: str = ""
