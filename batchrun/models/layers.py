"""Building blocks of the Llama-family decoder: RMSNorm, rotary embedding, fused projections."""

from __future__ import annotations

import functools
import math
import os
import zlib

import torch
from torch import nn


@functools.cache
def _has_triton() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def use_fused_kernels(x: torch.Tensor) -> bool:
    """Whether the Triton kernels of `batchrun.kernels` replace the torch ops here: on CUDA with
    triton installed, unless BATCHRUN_NO_FUSED is set (read on every call, so tests can flip it).
    """
    return x.is_cuda and not os.environ.get("BATCHRUN_NO_FUSED") and _has_triton()


# NOTE: measured on the H200 (docs/benchmarks.md): "triton" sends the decode matmuls of large
# matrices to kernels/gemv.py, "all" every decode matmul; any other value (e.g. "cublas"): none.
# Set, it overrides the model's own default (`EngineConfig.decode_gemv`). Read on every call, as
# use_fused_kernels; a decode graph reads it once, at capture. (The eighth session's "fused" and
# "fused-all", the norms inside the following matmul's loop, lost to the separate kernels and
# are gone: the tenth's in-kernel norm, `gemv_norm_fusion`, sits in the matmul before.)
GEMV_ENV = "BATCHRUN_GEMV"
GEMV_MODES = ("triton", "all")


def decode_gemv_mode(x: torch.Tensor, default: str | None = None) -> str | None:
    """The Triton decode-matmul mode (one of GEMV_MODES) for x, a [M, K] activation: M <= 16,
    bf16 / fp16, on CUDA. BATCHRUN_GEMV if set, else `default`; None for any other x."""
    # NOTE: the shape checks first: every matmul of every forward asks (a prefill is turned
    # away before any environment lookup)
    if not (
        x.dim() == 2
        and x.shape[0] <= 16
        and x.stride(-1) == 1
        and x.dtype in (torch.float16, torch.bfloat16)
    ):
        return None
    mode = os.environ.get(GEMV_ENV) or default
    return mode if mode in GEMV_MODES and use_fused_kernels(x) else None


# NOTE: where kernels/gemv.py beat cuBLAS on the H200 (scripts/bench_gemv.py, M = 1): llama-8b's
# o_proj 4096 x 4096 11.2 vs 13.1 µs and down_proj 4096 x 14336 30.2 vs 31.2; on llama-1b's
# smaller matrices cuBLAS was as fast or faster (o 6.0 vs 6.0, down 14.2 vs 13.9)
GEMV_MIN_DIM = 4096


def takes_gemv(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, decode_gemv: str | None
) -> bool:
    """Whether x @ weight.T goes to kernels/gemv.py: a decode-sized x in a decode_gemv_mode
    (BATCHRUN_GEMV, else `decode_gemv`, the layer's default), no bias, and any weight in "all",
    one whose sides are both >= GEMV_MIN_DIM in "triton"."""
    if bias is not None:
        return False
    mode = decode_gemv_mode(x, decode_gemv)
    return mode == "all" or (mode is not None and min(weight.shape) >= GEMV_MIN_DIM)


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    decode_gemv: str | None = None,
):
    """F.linear, or kernels/gemv.py where `takes_gemv`."""
    if takes_gemv(x, weight, bias, decode_gemv):
        from batchrun.kernels.gemv import gemv

        return gemv(x, weight)
    return torch.nn.functional.linear(x, weight, bias)


# NOTE: "0" keeps the SwiGLU gate in its own kernel after a gemv gate_up (to measure the fusion)
GEMV_SWIGLU_ENV = "BATCHRUN_GEMV_SWIGLU"


def swiglu_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    decode_gemv: str | None = None,
) -> torch.Tensor | None:
    """silu(x @ w_gate.T) * (x @ w_up.T) in one kernel (kernels/gemv.py's SwiGLU epilogue)
    where the gate_up matmul `takes_gemv`, for weight = [gate rows | up rows]; None otherwise
    (the caller runs the matmul and the gate apart)."""
    if os.environ.get(GEMV_SWIGLU_ENV) == "0" or not takes_gemv(x, weight, bias, decode_gemv):
        return None
    from batchrun.kernels.gemv import gemv

    return gemv(x, weight, swiglu=True)


# NOTE: "0" keeps the residual adds and norms of a one-row gemv decode batch in kernels of their
# own, "1" moves both of a layer into the matmuls before them, "post" only the one after the
# attention (into o_proj); unset: both for hidden sizes up to GEMV_NORM_MAX_HIDDEN, "fold-all"
# above.
# On the H200 (W3, docs/benchmarks.md) both took llama-1b (hidden 2048) from 1.03-1.04 to 1.00
# ms per token; on llama-8b (4096) both read 4.44-4.47 against 4.40-4.41 without (the last
# column tile's norm of a 4096-wide row cost more than the kernel it saved after down_proj;
# bench_gemv: down -> qkv 46.8 -> 48.8 µs, o -> gate_up 69.2 -> 67.9), and "post" 4.34 / 4.34
# against 4.38-4.39 (eleventh session). "fold": "post", and each input norm inside the qkv
# matmul after it (kernels/gemv.py's gemv_rms, on a copy of qkv's weight times the norm's):
# llama-8b 4.29 / 4.29 / 4.29 against 4.33 / 4.33 / 4.33 for "post"; llama-1b 0.99 / 0.98
# against 0.96 / 0.96 for "all" (thirteenth session, call 3), hence the width rule. "fold-all":
# each post-attention norm inside the gate_up matmul after it too (o_proj then only adds the
# residual; gate_up's folded copy is 7.5 GB on llama-8b): W3 llama-8b 4.16 against 4.20 for
# "fold", and 4.07 against 4.14 with qkv's matmul split in two (fourteenth session, call 3).
GEMV_NORM_ENV = "BATCHRUN_GEMV_NORM"
# the modes with folded weights (LlamaForCausalLM.fold_norms)
FOLD_MODES = ("fold", "fold-all")
GEMV_NORM_MAX_HIDDEN = 2048


def norm_fusion_mode(hidden: int) -> str | None:
    """BATCHRUN_GEMV_NORM, else the width rule: "all" up to GEMV_NORM_MAX_HIDDEN, "fold-all"
    above; None for "0"."""
    switch = os.environ.get(GEMV_NORM_ENV)
    if switch == "0":
        return None
    if switch in (*FOLD_MODES, "post"):
        return switch
    return "all" if switch == "1" or hidden <= GEMV_NORM_MAX_HIDDEN else "fold-all"


def gemv_norm_fusion(x: torch.Tensor, decode_gemv: str | None) -> str | None:
    """Which of a layer's residual adds and RMSNorms a forward of x (the embeddings [T, hidden])
    runs inside the decoder matmuls next to them, every matmul on kernels/gemv.py ("all"
    decode_gemv mode): "all" (after o_proj and after down_proj, gemv_residual), "post" (after
    o_proj only), "fold" ("post", and each input norm inside qkv's matmul: gemv_rms),
    "fold-all" (both norms inside the matmul after them: qkv's and gate_up's), or None."""
    if decode_gemv_mode(x, decode_gemv) != "all":
        return None
    return norm_fusion_mode(x.shape[-1])


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if use_fused_kernels(x) and x.dtype == self.weight.dtype:
            from batchrun.kernels.fused_norm import rms_norm

            # NOTE: reshape copies a strided view (q/k norm of Qwen3); the kernel writes a new
            # tensor anyway
            x2d = x.reshape(-1, x.shape[-1])
            return rms_norm(x2d, self.weight, self.eps).view(x.shape)
        # NOTE: normalize in fp32 and cast back before the weight, as HF transformers does, so
        # bf16/fp16 results match the reference bit for bit where possible.
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dtype)

    def forward_with_residual(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual) for x, residual [T, N]. On CUDA one kernel writes
        both in place, into x and residual: callers must not read them afterwards.
        """
        if use_fused_kernels(x) and x.dtype == residual.dtype == self.weight.dtype:
            from batchrun.kernels.fused_norm import fused_add_rms_norm

            return fused_add_rms_norm(x, residual, self.weight, self.eps)
        residual = x + residual
        return self(residual), residual


def rope_inv_freq(head_dim: int, theta: float, scaling: dict) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] in fp32, with llama3 / linear scaling applied."""
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (theta**exponent)
    rope_type = scaling.get("rope_type", "default")
    if rope_type == "linear":
        inv_freq = inv_freq / float(scaling["factor"])
    elif rope_type == "llama3":
        factor = float(scaling["factor"])
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        old_len = float(scaling.get("original_max_position_embeddings", 8192))
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        inv_freq = torch.where(is_medium, smoothed, scaled)
    return inv_freq


class RotaryEmbedding(nn.Module):
    """Neox-style (rotate-half) rotary embedding with a cos/sin table indexed by position."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict, device):
        super().__init__()
        inv_freq = rope_inv_freq(head_dim, theta, scaling)
        pos = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(pos, inv_freq)  # [P, D/2]
        emb = torch.cat([freqs, freqs], dim=-1)  # [P, D]
        self.register_buffer("cos_cache", emb.cos().to(device), persistent=False)
        self.register_buffer("sin_cache", emb.sin().to(device), persistent=False)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotated (q, k). On CUDA one kernel rotates q and k in place (strided views allowed)
        and returns them; elsewhere new tensors.
        """
        # q: [T, H, D], k: [T, KV, D], positions: [T]
        if use_fused_kernels(q):
            from batchrun.kernels.fused_rotary import apply_rotary_

            apply_rotary_(q, k, positions, self.cos_cache, self.sin_cache)
            return q, k
        cos = self.cos_cache[positions].unsqueeze(1)  # [T, 1, D] fp32
        sin = self.sin_cache[positions].unsqueeze(1)
        return _apply_rotary(q, cos, sin), _apply_rotary(k, cos, sin)


def _apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    # NOTE: HF multiplies in the activation dtype with cos/sin cast to it; do the same.
    return x * cos.to(x.dtype) + rotated * sin.to(x.dtype)


# NOTE: "uniform" draws every floating parameter (the norms too) from U(-1e-3, 1e-3), as the
# dummy loaders of vLLM and SGLang do, for figures comparable with theirs; the default
# ("normal") draws normal(0, 0.02) with the norms at 1, nearer a real checkpoint's spread. At
# the H200's power cap the matmuls' speed depends a little on the values they multiply: W1
# llama-8b read 0.3-0.6 % higher with "uniform" (docs/benchmarks.md, eighteenth session).
DUMMY_INIT_ENV = "BATCHRUN_DUMMY_INIT"
DUMMY_INITS = ("normal", "uniform")
UNIFORM_DUMMY_BOUND = 1e-3


def dummy_init_kind() -> str:
    """BATCHRUN_DUMMY_INIT, else "normal"; an unknown name raises with the choices."""
    kind = os.environ.get(DUMMY_INIT_ENV) or "normal"
    if kind not in DUMMY_INITS:
        raise ValueError(
            f"dummy init {kind!r} (from {DUMMY_INIT_ENV}?) is not one of {', '.join(DUMMY_INITS)}"
        )
    return kind


def init_dummy_(module: nn.Module, seed: int = 0, std: float = 0.02, shards=None) -> None:
    """Random weights for benchmarks (`load_format="dummy"`): normal(0, std), norms at 1; or,
    with BATCHRUN_DUMMY_INIT=uniform (see DUMMY_INIT_ENV), every parameter U(-1e-3, 1e-3).

    `shards` (name -> ShardSpec, from a tensor-parallel model's `param_shards()`): such a
    parameter holds a slice of a full tensor; the full tensor is drawn as at TP=1 and sliced, so
    every TP size gets the same logical weights.
    """
    uniform = dummy_init_kind() == "uniform"
    bound = UNIFORM_DUMMY_BOUND
    shards = shards or {}
    gen = torch.Generator(device="cpu").manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("norm.weight") and not uniform:
                p.fill_(1.0)
                continue
            spec = shards.get(name)
            shape = list(p.shape)
            if spec is not None:
                shape[spec.dim] = spec.full_size
            if p.device.type == "cpu":
                if uniform:
                    full = torch.rand(shape, generator=gen, dtype=torch.float32) * 2 * bound - bound
                else:
                    full = torch.randn(shape, generator=gen, dtype=torch.float32) * std
            else:
                # NOTE: generate on the device: an 8B model is too slow to make on the host.
                dev_gen = torch.Generator(device=p.device).manual_seed(
                    seed + zlib.crc32(name.encode())
                )
                full = p if spec is None else torch.empty(shape, dtype=p.dtype, device=p.device)
                if uniform:
                    full.uniform_(-bound, bound, generator=dev_gen)
                else:
                    full.normal_(0.0, std, generator=dev_gen)
                if spec is None:
                    continue
            if spec is None:
                p.copy_(full)
                continue
            for run in spec.runs:
                p.narrow(spec.dim, run.local_start, run.length).copy_(
                    full.narrow(spec.dim, run.full_start, run.length)
                )
