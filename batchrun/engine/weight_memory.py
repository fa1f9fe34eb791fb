"""How much GPU memory a model's weights take in bf16, and the shares of it that decide whether a
quantized model is dequantized at load (engine/kernel_choice.py's rules)."""

from __future__ import annotations

from batchrun.config import decoder_params

# a quantized model's weights are dequantized to bf16 at load where that takes at most this
# fraction of the GPU's memory (the rest: the KV pool and activations)
DEQUANT_MAX_MEMORY = 0.5
# int4_matmul "dequant-gemv" keeps the packed INT4 weight beside the bf16 one: a quarter of its
# bytes and the group scales and zeros (1/64 at group 128)
INT4_COPY = 0.27
# a quantized mixture of experts has no kernel for its experts: they run dequantized to bf16
# wherever the decoder's bf16 weights take at most this fraction of the GPU (gpt-oss-120b's
# 116 GB a rank at --tp 2 on an H200's 141 GiB leave about 20 GB to the KV pool)
EXPERTS_MAX_MEMORY = 0.85


def bf16_weight_bytes(model_cfg, tp_size: int) -> int:
    """The bytes of one rank's decoder weights in bf16."""
    return 2 * decoder_params(model_cfg) // tp_size


def mxfp4_experts(model_cfg) -> bool:
    """Whether the checkpoint's experts are gpt-oss's MXFP4 (dequantized at load)."""
    return model_cfg.moe is not None and model_cfg.moe.mxfp4


def experts_too_large(model_cfg, tp_size: int, memory: int) -> str:
    """The refusal of a quantized mixture of experts whose dequantized weights do not fit."""
    need, share = bf16_weight_bytes(model_cfg, tp_size), EXPERTS_MAX_MEMORY * memory
    scheme = (
        "quantization_config mxfp4 (gpt-oss's experts)"
        if mxfp4_experts(model_cfg)
        else model_cfg.quantization.describe()
    )
    fits = next((tp for tp in (2, 4, 8, 16) if bf16_weight_bytes(model_cfg, tp) <= share), None)
    larger = (
        f"--tp {fits} ({bf16_weight_bytes(model_cfg, fits) / 1e9:.1f} GB a rank) fits"
        if fits is not None and fits > tp_size
        else "no --tp up to 16 fits"
    )
    return (
        f"{scheme}: a quantized mixture of experts runs its experts "
        f"dequantized to bf16, and the decoder's bf16 weights take {need / 1e9:.1f} GB a rank at "
        f"--tp {tp_size}, more than {EXPERTS_MAX_MEMORY:.0%} of this GPU's {memory / 1e9:.1f} GB "
        f"({share / 1e9:.1f} GB); {larger}"
    )
