"""MoeConfig: the mixture-of-experts numbers of Qwen3-MoE, Qwen2-MoE and Mixtral, read from an HF
config.json (ModelConfig.moe; None for a dense model).

The fields read, per architecture, and what each does:

    Qwen3MoeForCausalLM / Qwen2MoeForCausalLM
        num_experts (transformers 5 writes num_local_experts)   experts per MoE layer
        num_experts_per_tok                                      top-k
        moe_intermediate_size                                    each expert's width
        norm_topk_prob                                           renormalize the top-k weights
        decoder_sparse_step, mlp_only_layers                     which layers are MoE; the
                                                                 others a dense MLP of
                                                                 intermediate_size
        shared_expert_intermediate_size (Qwen2-MoE only)         the shared expert's width;
                                                                 its output times a sigmoid gate
    MixtralForCausalLM
        num_local_experts, num_experts_per_tok                   experts, top-k (renormalized)
        intermediate_size                                        each expert's width; every
                                                                 layer is MoE
    GptOssForCausalLM
        as Mixtral's (the softmax over the top-k logits is the renormalized top-k of the
        softmax), with a router bias, expert biases and the clamped SwiGLU of
        swiglu_alpha / swiglu_limit (models/gptoss_config.py)

Fields not read change nothing at inference: router_aux_loss_coef and output_router_logits (the
training loss on the router), router_jitter_noise (Mixtral's noise on the inputs, training only),
max_window_layers (read by transformers only with use_sliding_window, which ModelConfig reads).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from batchrun.errors import ModelConfigError
from batchrun.models.gptoss_config import GPT_OSS, GptOss

# architecture -> how its checkpoint names the MoE block and the experts' three matrices
# (gate, up, down)
MOE_ARCHITECTURES: dict[str, tuple[str, tuple[str, str, str]]] = {
    "Qwen3MoeForCausalLM": ("mlp", ("gate_proj", "up_proj", "down_proj")),
    "Qwen2MoeForCausalLM": ("mlp", ("gate_proj", "up_proj", "down_proj")),
    "MixtralForCausalLM": ("block_sparse_moe", ("w1", "w3", "w2")),
    # stacked in the checkpoint: models/gptoss_weights.py reads them
    GPT_OSS: ("mlp", ("gate_up_proj", "gate_up_proj", "down_proj")),
}


@dataclass(frozen=True)
class MoeConfig:
    num_experts: int
    top_k: int
    intermediate_size: int  # each expert's width
    norm_topk_prob: bool  # the top-k weights divided by their sum
    layers: tuple[int, ...]  # the layers whose MLP is the experts
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE's shared expert; 0: none
    block_name: str = "mlp"  # the checkpoint's module name of the MoE block
    expert_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    # gpt-oss: the router's bias, the experts' biases (b13 [E, 2I], b2 [E, H]), the clamped
    # SwiGLU (swiglu_limit 0: plain SiLU), and MXFP4 expert weights in the checkpoint
    router_bias: bool = False
    expert_bias: bool = False
    swiglu_alpha: float = 1.0
    swiglu_limit: float = 0.0
    mxfp4: bool = False

    def is_moe_layer(self, layer_id: int) -> bool:
        return layer_id in self.layers


def parse_moe(raw: dict[str, Any], arch: str, num_layers: int, source: str) -> MoeConfig | None:
    """The MoE part of config.json for `arch`; None for a dense architecture, or a Qwen-MoE
    config whose every layer is dense."""
    if arch not in MOE_ARCHITECTURES:
        return None
    block_name, expert_names = MOE_ARCHITECTURES[arch]
    mixtral = arch in ("MixtralForCausalLM", GPT_OSS)  # the same fields
    num_experts = raw.get("num_local_experts" if mixtral else "num_experts")
    if num_experts is None:
        num_experts = raw.get("num_experts" if mixtral else "num_local_experts")
    width = raw.get("intermediate_size" if mixtral else "moe_intermediate_size")
    needed = {
        "num_local_experts" if mixtral else "num_experts": num_experts,
        "num_experts_per_tok": raw.get("num_experts_per_tok"),
        "intermediate_size" if mixtral else "moe_intermediate_size": width,
    }
    missing = [k for k, v in needed.items() if v is None]
    if missing:
        raise ModelConfigError(
            f"{source}: {arch} needs {', '.join(missing)} (the experts' count, top-k and width); "
            "use the config.json saved with the weights"
        )
    num_experts, top_k, width = int(num_experts), int(raw["num_experts_per_tok"]), int(width)
    if mixtral:
        layers = tuple(range(num_layers))
        norm, shared = True, 0
    else:
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
            i
            for i in range(num_layers)
            if num_experts > 0 and (i + 1) % step == 0 and i not in dense
        )
        norm = bool(raw.get("norm_topk_prob", False))
        shared = 0
        if arch == "Qwen2MoeForCausalLM":
            shared = raw.get("shared_expert_intermediate_size")
            if shared is None:
                raise ModelConfigError(
                    f"{source}: Qwen2MoeForCausalLM needs shared_expert_intermediate_size "
                    "(the shared expert's width)"
                )
            shared = int(shared)
    if not layers:
        return None
    if num_experts < 1 or not 1 <= top_k <= num_experts:
        raise ModelConfigError(
            f"{source}: num_experts_per_tok {top_k} must be in [1, number of experts {num_experts}]"
        )
    if width < 1 or (arch == "Qwen2MoeForCausalLM" and shared < 1):
        raise ModelConfigError(
            f"{source}: the experts' width ({width}) and the shared expert's ({shared}) must "
            "be >= 1"
        )
    return MoeConfig(
        num_experts=num_experts,
        top_k=top_k,
        intermediate_size=width,
        norm_topk_prob=norm,
        layers=layers,
        shared_expert_intermediate_size=shared,
        block_name=block_name,
        expert_names=expert_names,
    )


def gpt_oss_experts(moe: MoeConfig, gpt_oss: GptOss) -> MoeConfig:
    """`moe` with what gpt-oss's experts add."""
    return replace(
        moe,
        router_bias=True,
        expert_bias=True,
        swiglu_alpha=gpt_oss.swiglu_alpha,
        swiglu_limit=gpt_oss.swiglu_limit,
        mxfp4=gpt_oss.mxfp4,
    )
