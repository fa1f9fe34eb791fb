"""ArchSpec: what the registry (models/registry.py) holds for one `architectures` name, written
in the architecture's own file (models/llama.py, models/gemma3.py, ...).

A spec says
  - how its config.json reads into ModelConfig: the knobs ModelConfig.from_dict reads (biases,
    q/k norm, activation, rope aliases, partial rotary), and hooks for what is the
    architecture's own (`prepare`: fields it reads itself; `windows`: which layers slide;
    `moe`: its experts);
  - its checkpoint's tensor-name quirks (`names`, `fused_checkpoint`, `experts_reader`);
  - what it refuses (`quantizable`, and the hooks' errors);
  - where its layers' quantizable linears sit (`layer_linears`, for a quantized checkpoint);
  - which blocks build it (`build`: ModelConfig and a BuildContext -> the model).
Tensor-parallel rules follow from the blocks (parallel/partition.py splits heads, MLP widths and
expert widths by the description alone).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import nn

    from batchrun.models.blocks.context import BuildContext
    from batchrun.models.config import ModelConfig
    from batchrun.models.moe_config import MoeConfig

# the formats Gemma 4 runs (tests/e2e/test_quant_hybrid_gemma4.py): compressed-tensors FP8 with
# dynamic activations (per channel or in 128x128 blocks) and W4A16; the hybrids also Qwen's own
# block FP8 (quant_method fp8, dynamic activations)
COMPRESSED_TENSORS_FORMATS = (
    ("compressed-tensors", "fp8", "dynamic"),
    ("compressed-tensors", "int4", "none"),
)
HYBRID_QUANT_FORMATS = (*COMPRESSED_TENSORS_FORMATS, ("fp8", "fp8", "dynamic"))
# config.json's older names of rope types -> the name batchrun runs ("su": LongRoPE's first name)
ROPE_ALIASES: Mapping[str, str] = MappingProxyType({"su": "longrope"})


def no_windows(raw: dict[str, Any], num_layers: int, max_pos: int, source: str) -> tuple[int, ...]:
    """Every layer attends over the whole context (transformers ignores sliding_window)."""
    return ()


def no_experts(raw: dict[str, Any], num_layers: int, source: str) -> MoeConfig | None:
    return None


@dataclass(frozen=True)
class TensorNames:
    """How a checkpoint's tensor names map onto the text model's (`text_name`)."""

    # prefix in the checkpoint -> the text model's prefix (a multimodal model's language_model)
    renames: tuple[tuple[str, str], ...] = ()
    # prefixes of tensors batchrun does not run (a vision tower)
    skipped: tuple[str, ...] = ()
    # inside a decoder layer: the checkpoint's module prefix -> ours
    layer_renames: tuple[tuple[str, str], ...] = ()

    def text_name(self, name: str) -> str | None:
        """The text model's name of checkpoint tensor `name`; None for a skipped one."""
        if name.startswith(self.skipped):
            return None
        for prefix, text in self.renames:
            if name.startswith(prefix):
                return text + name[len(prefix) :]
        return name

    def layer_name(self, rest: str) -> str:
        """Our name of a decoder layer's tensor `rest` (the part after model.layers.{i}.)."""
        for prefix, ours in self.layer_renames:
            if rest.startswith(prefix):
                return ours + rest[len(prefix) :]
        return rest


@dataclass(frozen=True)
class ArchSpec:
    name: str  # config.json's `architectures` entry
    model_type: str  # config.json's model_type, for a file that lists no architectures
    family: str  # what users call it, for messages
    build: Callable[[ModelConfig, BuildContext], nn.Module]
    # --- config.json
    qkv_bias: bool = False  # attention_bias's default
    o_proj_bias: bool = False  # attention_bias also gives o_proj a bias
    biases: bool = True  # False: no biases, whatever attention_bias / mlp_bias say
    qk_norm: bool = False  # RMSNorm over each q and k head
    act_field: str = "hidden_act"
    activations: tuple[str, ...] = ("silu",)  # the gated MLP's supported activations
    rope_aliases: Mapping[str, str] = field(default_factory=lambda: ROPE_ALIASES)
    partial_rotary: bool = False  # partial_rotary_factor rotates the first dims only
    # LongRoPE's original_max_position_embeddings when the file's top level has none (None:
    # the rope parameters', else max_position_embeddings)
    longrope_original: int | None = None
    # (raw, source) -> (raw as the common fields read it, ModelConfig fields it sets itself)
    prepare: Callable[[dict[str, Any], str], tuple[dict[str, Any], dict[str, Any]]] | None = None
    windows: Callable[[dict[str, Any], int, int, str], tuple[int, ...]] = no_windows
    moe: Callable[[dict[str, Any], int, str], MoeConfig | None] = no_experts
    quantizable: bool = True  # False: a quantization_config is refused
    # the (quant_method, family, activations) of the checkpoint formats it runs; None: every
    # format batchrun reads
    quant_formats: tuple[tuple[str, str, str], ...] | None = None
    # (cfg, layer index) -> the layer's quantizable linears (models/quant_loader.py's
    # layer_linears form); None: attention's q/k/v/o and the MLP's gate/up/down
    layer_linears: Callable[[ModelConfig, int], list] | None = None
    # --- the checkpoint
    names: TensorNames = TensorNames()
    fused_checkpoint: bool = False  # qkv_proj and gate_up_proj stored fused (plain only)
    # (params, param shards, cfg) -> a reader of its own expert tensors (models/loader.py
    # gives it each tensor first: take(name, get, path) -> bool, check_complete(), filled);
    # the experts it reads are plain in a quantized checkpoint (they are no linears)
    experts_reader: Callable[..., Any] | None = None
