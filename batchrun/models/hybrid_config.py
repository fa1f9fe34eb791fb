"""LinearAttentionConfig: the Gated DeltaNet numbers of a hybrid model's config.json
(ModelConfig.linear_attention; None for a model of attention layers only), read by `read` for
the Qwen3-Next / Qwen3.5 / Qwen3.6 configs (models/qwen3_next.py, models/qwen3_5.py).

    layer_types                 per layer "linear_attention" or "full_attention"; without it
    (or full_attention_interval) every full_attention_interval-th layer is full (default 4)
    linear_num_key_heads        the q / k heads of a linear layer (Hk)
    linear_num_value_heads      its value heads (Hv, a multiple of Hk)
    linear_key_head_dim         Dk
    linear_value_head_dim       Dv
    linear_conv_kernel_dim      the causal conv1d's width over q, k and v (K)

A linear layer's state a request: the conv's last K-1 inputs [2 Hk Dk + Hv Dv, K-1] and the
delta rule's [Hv, Dk, Dv] (docs/hybrid.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from batchrun.errors import ModelConfigError

LAYER_TYPES = ("linear_attention", "full_attention")
# the state's bytes an element, by EngineConfig.linear_state_dtype (engine/state_pool.py)
STATE_ELEMENT_BYTES = {"float32": 4, "bfloat16": 2}
FIELDS = (
    "linear_num_key_heads",
    "linear_num_value_heads",
    "linear_key_head_dim",
    "linear_value_head_dim",
    "linear_conv_kernel_dim",
)


@dataclass(frozen=True)
class LinearAttentionConfig:
    layers: tuple[int, ...]  # the linear-attention layers; the others are full attention
    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_kernel: int
    fused_projections: bool  # Qwen3-Next's in_proj_qkvz / in_proj_ba; else Qwen3.5's four

    @property
    def conv_dim(self) -> int:
        """The conv's channels: q, k and v of every head."""
        return 2 * self.num_k_heads * self.head_k_dim + self.num_v_heads * self.head_v_dim

    def is_linear(self, layer_id: int) -> bool:
        return layer_id in self.layers

    def index(self, layer_id: int) -> int:
        """Linear layer `layer_id`'s index among the linear layers (its state's)."""
        return self.layers.index(layer_id)

    def state_bytes(self, tp_size: int = 1, dtype: str = "float32") -> int:
        """The state of one request over every linear layer (one rank's heads), its elements
        `dtype` (EngineConfig.linear_state_dtype)."""
        conv = self.conv_dim * (self.conv_kernel - 1)
        ssm = self.num_v_heads * self.head_k_dim * self.head_v_dim
        return (conv + ssm) // tp_size * STATE_ELEMENT_BYTES[dtype] * len(self.layers)


def read(raw: dict[str, Any], where: str, fused_projections: bool) -> LinearAttentionConfig:
    num_layers = int(raw["num_hidden_layers"])
    types = raw.get("layer_types")
    if types is None:
        every = int(raw.get("full_attention_interval", 4))
        if every < 1:
            raise ModelConfigError(f"{where}: full_attention_interval must be >= 1; got {every}")
        types = [
            "full_attention" if (i + 1) % every == 0 else "linear_attention"
            for i in range(num_layers)
        ]
    bad = sorted({str(t) for t in types if t not in LAYER_TYPES})
    if bad or len(types) != num_layers:
        raise ModelConfigError(
            f"{where}: layer_types must list {num_layers} layers (num_hidden_layers), each one "
            f"of {', '.join(LAYER_TYPES)}; got {len(types)} with unsupported {bad}"
        )
    missing = [k for k in FIELDS if raw.get(k) is None]
    if missing:
        raise ModelConfigError(f"{where}: a hybrid model needs {', '.join(missing)}")
    cfg = LinearAttentionConfig(
        layers=tuple(i for i, t in enumerate(types) if t == "linear_attention"),
        num_k_heads=int(raw["linear_num_key_heads"]),
        num_v_heads=int(raw["linear_num_value_heads"]),
        head_k_dim=int(raw["linear_key_head_dim"]),
        head_v_dim=int(raw["linear_value_head_dim"]),
        conv_kernel=int(raw["linear_conv_kernel_dim"]),
        fused_projections=fused_projections,
    )
    if cfg.num_v_heads % cfg.num_k_heads or cfg.conv_kernel < 1:
        raise ModelConfigError(
            f"{where}: linear_num_value_heads ({cfg.num_v_heads}) must be a multiple of "
            f"linear_num_key_heads ({cfg.num_k_heads}) and linear_conv_kernel_dim >= 1"
        )
    return cfg
