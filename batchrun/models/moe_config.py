"""MoeConfig: the mixture-of-experts numbers of a config.json (ModelConfig.moe; None for a dense
model), read by two rules that an architecture's spec picks (models/spec.py's `moe` hook):

    experts_every_layer   num_local_experts, num_experts_per_tok, intermediate_size (each
                          expert's width); every layer is MoE, the top-k renormalized
    experts_by_step       num_experts (transformers 5 writes num_local_experts),
                          num_experts_per_tok, moe_intermediate_size, norm_topk_prob;
                          decoder_sparse_step and mlp_only_layers say which layers are MoE (the
                          others a dense MLP of intermediate_size); with `shared_expert`,
                          shared_expert_intermediate_size, the shared expert's width (its output
                          times a sigmoid gate)

Fields not read change nothing at inference: router_aux_loss_coef and output_router_logits (the
training loss on the router), router_jitter_noise (noise on the inputs, training only).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from batchrun.errors import ModelConfigError

GATE_UP_DOWN = ("gate_proj", "up_proj", "down_proj")
# the experts' gate activations that the fused experts run (kernels/fused_moe.py's epilogues)
FUSED_ACTS = ("silu", "gelu_pytorch_tanh")


@dataclass(frozen=True)
class MoeConfig:
    num_experts: int
    top_k: int
    intermediate_size: int  # each expert's width
    norm_topk_prob: bool  # the top-k weights divided by their sum
    layers: tuple[int, ...]  # the layers whose MLP is the experts
    shared_expert_intermediate_size: int = 0  # a shared expert's width; 0: none
    block_name: str = "mlp"  # the checkpoint's module name of the MoE block
    expert_names: tuple[str, str, str] = GATE_UP_DOWN  # the experts' gate, up, down
    width_field: str = "moe_intermediate_size"  # config.json's name of the experts' width
    # biases on the router and the experts (b13 [E, 2I], b2 [E, H]), the clamped SwiGLU
    # (swiglu_limit 0: plain SiLU), and MXFP4 expert weights in the checkpoint
    router_bias: bool = False
    expert_bias: bool = False
    swiglu_alpha: float = 1.0
    swiglu_limit: float = 0.0
    mxfp4: bool = False
    # the experts' gate activation: one of FUSED_ACTS, which the fused experts'
    # epilogues run (kernels/fused_moe.py), the torch loop too
    act: str = "silu"

    def is_moe_layer(self, layer_id: int) -> bool:
        return layer_id in self.layers


def experts_every_layer(
    raw: dict[str, Any],
    arch: str,
    num_layers: int,
    source: str,
    block_name: str = "mlp",
    expert_names: tuple[str, str, str] = GATE_UP_DOWN,
) -> MoeConfig:
    num_experts = raw.get("num_local_experts")
    if num_experts is None:
        num_experts = raw.get("num_experts")
    counts = _counts(raw, arch, source, "num_local_experts", num_experts, "intermediate_size")
    return _checked(
        arch, source, *counts, norm=True, layers=tuple(range(num_layers)), shared=0,
        block_name=block_name, expert_names=expert_names, width_field="intermediate_size",
    )  # fmt: skip


def experts_by_step(
    raw: dict[str, Any], arch: str, num_layers: int, source: str, shared_expert: bool = False
) -> MoeConfig | None:
    """None for a config whose every layer is dense."""
    num_experts = raw.get("num_experts")
    if num_experts is None:
        num_experts = raw.get("num_local_experts")
    counts = _counts(raw, arch, source, "num_experts", num_experts, "moe_intermediate_size")
    step = int(raw.get("decoder_sparse_step", 1))
    if step < 1:
        raise ModelConfigError(f"{source}: decoder_sparse_step must be >= 1; got {step}")
    dense = raw.get("mlp_only_layers") or []
    bad = [i for i in dense if not (isinstance(i, int) and 0 <= i < num_layers)]
    if bad:
        raise ModelConfigError(
            f"{source}: mlp_only_layers has {bad}, not layer indices in [0, {num_layers})"
        )
    # transformers' rule: MoE where (i + 1) % decoder_sparse_step == 0, but mlp_only_layers
    layers = tuple(
        i for i in range(num_layers) if counts[0] > 0 and (i + 1) % step == 0 and i not in dense
    )
    shared = 0
    if shared_expert:
        shared = raw.get("shared_expert_intermediate_size")
        if shared is None:
            raise ModelConfigError(
                f"{source}: {arch} needs shared_expert_intermediate_size (the shared expert's "
                "width)"
            )
        shared = int(shared)
    if not layers:
        return None
    norm = bool(raw.get("norm_topk_prob", False))
    return _checked(
        arch, source, *counts, norm=norm, layers=layers, shared=shared,
        shared_required=shared_expert,
    )  # fmt: skip


def _counts(
    raw: dict[str, Any], arch: str, source: str, experts_key: str, num_experts, width_key: str
) -> tuple[int, int, int]:
    width = raw.get(width_key)
    needed = {
        experts_key: num_experts,
        "num_experts_per_tok": raw.get("num_experts_per_tok"),
        width_key: width,
    }
    missing = [k for k, v in needed.items() if v is None]
    if missing:
        raise ModelConfigError(
            f"{source}: {arch} needs {', '.join(missing)} (the experts' count, top-k and width); "
            "use the config.json saved with the weights"
        )
    return int(num_experts), int(raw["num_experts_per_tok"]), int(width)


def _checked(
    arch: str, source: str, num_experts: int, top_k: int, width: int, **fields: Any
) -> MoeConfig:
    if num_experts < 1 or not 1 <= top_k <= num_experts:
        raise ModelConfigError(
            f"{source}: num_experts_per_tok {top_k} must be in [1, number of experts {num_experts}]"
        )
    if width < 1 or (fields.pop("shared_required", False) and fields["shared"] < 1):
        raise ModelConfigError(
            f"{source}: the experts' width ({width}) and the shared expert's "
            f"({fields['shared']}) must be >= 1"
        )
    norm, layers, shared = fields.pop("norm"), fields.pop("layers"), fields.pop("shared")
    return MoeConfig(
        num_experts=num_experts,
        top_k=top_k,
        intermediate_size=width,
        norm_topk_prob=norm,
        layers=layers,
        shared_expert_intermediate_size=shared,
        **fields,
    )
