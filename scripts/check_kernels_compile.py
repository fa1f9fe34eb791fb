"""Compile batchrun's quantization, MoE, attention, rotary and gated-MLP activation kernels for a
GPU target on a machine without that GPU (or any GPU): each kernel's Python wrapper runs on CPU
tensors, and every launch compiles for the target (Triton front end, LLVM, ptxas) without
running. Run it with the Triton version of the GPU machine, which may reject code a newer Triton
accepts (a module-level float used in a kernel must be a `tl.constexpr`; a @triton.jit function
with returns of two types):

    pip install --target /tmp/triton36 triton==3.6.0        # the H200 machine's Triton
    PYTHONPATH=/tmp/triton36 python scripts/check_kernels_compile.py     # sm_90 (Hopper)
    PYTHONPATH=/tmp/triton36 python scripts/check_kernels_compile.py --arch 89 --ptxas

It prints one line a kernel configuration (OK, or the compiler's error) and exits 1 on any
error; with --ptxas, each kernel's registers and spills from the bundled ptxas; with --sass, its
largest loop in SASS (the bundled nvdisasm): instructions, barriers, shared-memory traffic and
MMAs an iteration, which show a tile crossing shared memory more often than it needs to. The
kernels' numbers are not checked here: tests/gpu does that on the GPU.
"""

from __future__ import annotations

import argparse
import functools
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch


def _compile_only(arch: int, ptxas: bool, sass: bool = False) -> None:
    """Route every Triton launch to a compile for cuda sm_<arch>: a stand-in driver gives the
    target (no CUDA driver is loaded) and each launch becomes a warm-up."""
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction

    class CompileDriver:
        def get_current_target(self):
            return GPUTarget("cuda", arch, 32)

        def get_current_device(self):
            return 0

        def get_current_stream(self, device=None):
            return 0

        def get_active_torch_device(self):
            return torch.device("cpu")

    driver.set_active(CompileDriver())
    run = JITFunction.run

    def compile_run(self, *args, grid, warmup, **kwargs):
        if "ROUND" in kwargs:  # fp8_quant: the GPU's conversion, not the interpreter's
            kwargs["ROUND"] = False
        if "ASM" in kwargs:  # decode_attention: the GPU's inline PTX (rotary, float8 words)
            kwargs["ASM"] = True
        if "PDL" in kwargs and arch >= 90:  # the GPU's launch: PDL on sm_90+ (CPU tensors: off)
            kwargs["PDL"] = True
        kernel = run(self, *args, grid=grid, warmup=True, **kwargs)
        if ptxas:
            print(f"      {self.fn.__name__}: {_ptxas_info(kernel.asm['ptx'], arch)}")
        if sass:
            print(f"      {self.fn.__name__}: {_loop_info(kernel.asm['cubin'])}")
        return kernel

    JITFunction.run = compile_run


def _ptxas_info(ptx: str, arch: int) -> str:
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(ptx)
        f.flush()
        gpu = f"sm_{arch}a" if arch >= 90 else f"sm_{arch}"
        out = subprocess.run(
            [str(tool), "-v", "--gpu-name", gpu, f.name, "-o", "/dev/null"],
            capture_output=True,
            text=True,
        )
    lines = [ln.split("info    : ")[-1] for ln in out.stderr.splitlines()]
    return " | ".join(ln for ln in lines if "Used" in ln or "spill" in ln) or out.stderr[-200:]


def _loop_info(cubin: bytes) -> str:
    """The kernel's largest loop in SASS (the longest span from a label to a branch back to
    it): its instructions, and of them the CTA barriers, shared-memory stores and loads (and
    of the loads those of one byte), asynchronous global-to-shared copies and MMAs (HMMA,
    and HGMMA / QGMMA: Hopper's bf16 / fp16 and e4m3 wgmma)."""
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        lines = subprocess.run([str(tool), "-c", f.name], capture_output=True, text=True).stdout
    lines = lines.splitlines()
    labels = {m.group(1): i for i, ln in enumerate(lines) if (m := re.match(r"^(\.L_x_\d+):", ln))}
    spans = [
        (labels[m.group(1)], i)
        for i, ln in enumerate(lines)
        if (m := re.search(r"BRA `\((\.L_x_\d+)\)", ln)) and labels.get(m.group(1), i) < i
    ]
    if not spans:
        return "no loop"
    first, last = max(spans, key=lambda span: span[1] - span[0])
    ops = [
        m.group(1)
        for ln in lines[first : last + 1]
        if (m := re.match(r"\s*/\*[0-9a-f]+\*/\s*(?:@!?U?P[0-9T]\s+)?([A-Z][A-Z0-9_.]*)", ln))
    ]
    count = lambda *names: sum(op.split(".")[0] in names for op in ops)  # noqa: E731
    byte_loads = sum(op.startswith("LDS.U8") or op.startswith("LDS.S8") for op in ops)
    return (
        f"loop {len(ops)} instructions: {count('BAR')} barriers, {count('STS', 'STSM')} shared "
        f"stores, {count('LDS', 'LDSM')} shared loads ({byte_loads} of one byte), "
        f"{count('LDGSTS')} async copies, {count('HMMA', 'HGMMA', 'QGMMA')} MMAs"
    )


def cases() -> list[tuple[str, Callable[[], object]]]:
    """(name, call) for each kernel configuration: the llama-8b shapes at decode and prefill
    sizes, each scale mode and each INT4 scheme."""
    from batchrun.kernels import fp8_gemv, fp8_quant, int4_matmul

    from batchrun.quant.int4_layout import pack_int4
    from batchrun.quant.weights import Int4Weight

    f8 = torch.float8_e4m3fn
    out: list[tuple[str, Callable[[], object]]] = []
    w, sw = torch.randn(6144, 4096).to(f8), torch.rand(6144)
    gate_up, sw_gate_up = torch.randn(2 * 1024, 4096).to(f8), torch.rand(2 * 1024)
    for m in (1, 4, 16):
        x = torch.randn(m, 4096, dtype=torch.bfloat16)
        picked = fp8_gemv.pick_config(m, 6144, 4096)
        for cfg in (picked, picked._replace(block_n=128, block_k=512, split_k=1)):
            out.append((f"fp8_gemv M={m} {tuple(cfg)}", lambda x=x, cfg=cfg: fp8_gemv.fp8_gemv(
                x, w, sw, None, config=cfg, pdl=True)))  # fmt: skip
        out.append((f"fp8_gemv M={m} static", lambda x=x: fp8_gemv.fp8_gemv(
            x, w, sw, torch.tensor(0.1), pdl=True)))  # fmt: skip
        out.append((f"fp8_gemv M={m} given amax", lambda x=x, m=m: fp8_gemv.fp8_gemv(
            x, w, sw, None, amax=torch.rand(m), pdl=True)))  # fmt: skip
        out.append((f"fp8_gemv M={m} swiglu", lambda x=x: fp8_gemv.fp8_gemv(
            x, gate_up, sw_gate_up, None, swiglu=True, pdl=True)))  # fmt: skip
        out.append((f"fp8_gemv M={m} blocks", lambda x=x: fp8_gemv.fp8_gemv(
            x, w, torch.rand(48, 32), blocks=True, pdl=True)))  # fmt: skip
        out.append((f"fp8_gemv M={m} blocks swiglu", lambda x=x: fp8_gemv.fp8_gemv(
            x, gate_up, torch.rand(16, 32), blocks=True, swiglu=True, pdl=True)))  # fmt: skip
    for k in (4096, 20000):
        x = torch.randn(3, k, dtype=torch.bfloat16)
        out.append((f"fp8_quant per token K={k}", lambda x=x: fp8_quant.quant_per_token(x)))
    x = torch.randn(4, 4096, dtype=torch.bfloat16)
    out.append(("fp8_quant given amax", lambda: fp8_quant.quant_per_token(x, torch.rand(4, 1))))
    out.append(("fp8_quant per group", lambda: fp8_quant.quant_per_token_group(x)))
    out.append(("fp8_quant static", lambda: fp8_quant.quant_static(x, torch.tensor(0.1))))
    int4_matmul.prepare(torch.device("cpu"))
    for group, symmetric, act_order in ((128, False, False), (128, True, True), (32, True, False)):
        packed = pack_int4(_int4_weight(Int4Weight, 6144, 4096, group, symmetric, act_order))
        for m in (1, 16, 64, 2048):
            x = torch.randn(m, 4096, dtype=torch.bfloat16)
            name = f"int4_matmul group={group} sym={symmetric} act_order={act_order} M={m}"
            out.append((name, lambda x=x, p=packed: int4_matmul.int4_matmul(x, p)))
    out += _mma_gemv_cases(Int4Weight)
    # a row-parallel slice of an act-order weight: the kernel reads each column's group
    sliced = pack_int4(_int4_weight(Int4Weight, 4096, 14336, 128, False, True).narrow_in(0, 7168))
    for m in (1, 2048):
        x = torch.randn(m, 7168, dtype=torch.bfloat16)
        out.append((f"int4_matmul act-order slice M={m}", lambda x=x: (
            int4_matmul.int4_matmul(x, sliced))))  # fmt: skip
    from batchrun.quant.int4_layout import mma_pack

    for group, symmetric in ((128, False), (4096, True)):  # mma_pack order, as engines keep it
        wm = mma_pack(pack_int4(_int4_weight(Int4Weight, 6144, 4096, group, symmetric, False)))
        for m in (17, 64, 2048):
            x = torch.randn(m, 4096, dtype=torch.bfloat16)
            out.append((f"int4_matmul mma order group={group} sym={symmetric} M={m}",
                        lambda x=x, w=wm: int4_matmul.int4_matmul(x, w)))  # fmt: skip
    from batchrun.kernels.fused_norm import rms_norm_heads

    for tokens in (1, 300):  # Qwen3's q and k norms (Qwen3-30B-A3B: 32 + 4 heads of 128)
        qkv = torch.empty(tokens, 40 * 128, dtype=torch.bfloat16)
        out.append((f"rms_norm_heads T={tokens}", lambda qkv=qkv, t=tokens: rms_norm_heads(
            qkv[:, : 36 * 128].view(t, 36, 128), torch.empty(128, dtype=torch.bfloat16),
            torch.empty(128, dtype=torch.bfloat16), 32, 1e-6, pdl=True)))  # fmt: skip
    out += _moe_cases()
    out += _attention_cases()
    out += _rotary_cases()
    out += _activation_cases()
    return out


def _mma_gemv_cases(Int4Weight) -> list[tuple[str, Callable[[], object]]]:
    """kernels/int4_gemv_mma.py (Gluon): one and 16 rows, bf16 and fp16, group 128 (two-step
    chunks), 64 (one step) and one group a row, split-K and not, the SwiGLU epilogue."""
    from batchrun.kernels import int4_gemv_mma

    from batchrun.quant.int4_layout import mma_pack, pack_int4

    out = []
    for n, k, group, symmetric, swiglu, m, dtype, split in (
        (6144, 4096, 128, False, False, 1, torch.bfloat16, None),
        (4096, 14336, 64, True, False, 16, torch.float16, None),
        (4096, 4096, 4096, False, False, 4, torch.bfloat16, 1),  # one group a row
        (2 * 1024, 4096, 128, False, True, 1, torch.bfloat16, None),
    ):
        w = mma_pack(pack_int4(_int4_weight(Int4Weight, n, k, group, symmetric, False)))
        x = torch.randn(m, k, dtype=dtype)
        name = f"int4_gemv_mma {n}x{k} group={group} sym={symmetric} swiglu={swiglu} M={m}"
        out.append((name, lambda x=x, w=w, g=swiglu, s=split: int4_gemv_mma.int4_gemv_mma(
            x, w, swiglu=g, split_k=s)))  # fmt: skip
    return out


def _attention_cases() -> list[tuple[str, Callable[[], object]]]:
    """kernels/decode_attention.py and extend_attention.py at llama-8b's heads (32 / 8, D 128),
    bf16, without and with a sliding window; the decode kernel with its own rotary too, and over
    a float8 pool."""
    from batchrun.kernels.decode_attention import (
        DecodeRope,
        decode_attention_fwd,
        decode_counters,
        decode_workspace_numel,
    )
    from batchrun.kernels.extend_attention import extend_attention_fwd

    from batchrun.quant.kv_cache import KVScale

    bf16, bs = torch.bfloat16, 4
    k_buf = torch.empty(1025, 8, 128, dtype=bf16)
    v_buf = torch.empty(1025, 8, 128, dtype=bf16)
    k_fp8, v_fp8 = (torch.empty(1025, 8, 128, dtype=torch.float8_e4m3fn) for _ in range(2))
    table = torch.zeros(bs + 1, 512, dtype=torch.int32)
    rows, seq_lens = torch.arange(bs), torch.full((bs,), 300)
    q = torch.empty(bs, 32, 128, dtype=bf16)
    out: list[tuple[str, Callable[[], object]]] = []
    for window in (0, 4096):
        for splits in (1, 16):
            rope = None
            if splits == 16:
                kv, cos = torch.empty(bs, 8, 128, dtype=bf16), torch.empty(512, 128)
                rope = DecodeRope(kv, kv, rows, rows, cos, cos)

            def decode(window=window, splits=splits, rope=rope):
                workspace = torch.empty(decode_workspace_numel(bs, 32, 128, splits))
                decode_attention_fwd(
                    q, k_buf, v_buf, torch.empty_like(q), table, rows, seq_lens, 0.1, splits,
                    workspace, decode_counters(bs, 8, "cpu"), window=window, rope=rope,
                )  # fmt: skip

            out.append((f"decode_attention splits={splits} window={window}", decode))

            def decode_fp8(window=window, splits=splits, rope=rope):  # V read as int32 words
                workspace = torch.empty(decode_workspace_numel(bs, 32, 128, splits))
                decode_attention_fwd(
                    q, k_fp8, v_fp8, torch.empty_like(q), table, rows, seq_lens, 0.1, splits,
                    workspace, decode_counters(bs, 8, "cpu"), window=window, rope=rope,
                    kv_scale=KVScale(0.5, 0.25),
                )  # fmt: skip

            out.append((f"decode_attention fp8 splits={splits} window={window}", decode_fp8))

        for new in (64, 4096):  # the default tiles, and the long extends' (LONG_EXTEND)

            def extend(window=window, new=new):
                qe = torch.empty(bs * new, 32, 128, dtype=bf16)
                ext = torch.full((bs,), new)
                extend_attention_fwd(
                    qe, k_buf, v_buf, torch.empty_like(qe), table, rows, seq_lens, ext,
                    torch.cumsum(ext, 0) - ext, new, 0.1, window=window,
                )  # fmt: skip

            out.append((f"extend_attention window={window} new={new}", extend))
    out += _sink_cases()
    return out


def _sink_cases() -> list[tuple[str, Callable[[], object]]]:
    """The attention kernels with gpt-oss's sinks, at gpt-oss-20b's heads (64 / 8, D 64) and its
    window of 128."""
    from batchrun.kernels.decode_attention import (
        DecodeRope,
        decode_attention_fwd,
        decode_counters,
        decode_workspace_numel,
    )
    from batchrun.kernels.extend_attention import extend_attention_fwd

    bf16, bs = torch.bfloat16, 4
    k_buf = torch.empty(1025, 8, 64, dtype=bf16)
    v_buf = torch.empty(1025, 8, 64, dtype=bf16)
    table = torch.zeros(bs + 1, 512, dtype=torch.int32)
    rows, seq_lens = torch.arange(bs), torch.full((bs,), 300)
    q, sinks = torch.empty(bs, 64, 64, dtype=bf16), torch.empty(64)
    out: list[tuple[str, Callable[[], object]]] = []
    for splits in (1, 16):
        rope = None
        if splits == 16:
            kv, cos = torch.empty(bs, 8, 64, dtype=bf16), torch.empty(512, 64)
            rope = DecodeRope(kv, kv, rows, rows, cos, cos)

        def decode(splits=splits, rope=rope):
            workspace = torch.empty(decode_workspace_numel(bs, 64, 64, splits))
            decode_attention_fwd(
                q, k_buf, v_buf, torch.empty_like(q), table, rows, seq_lens, 0.125, splits,
                workspace, decode_counters(bs, 8, "cpu"), window=128, rope=rope, sinks=sinks,
            )  # fmt: skip

        out.append((f"decode_attention sinks splits={splits} window=128", decode))

    for new in (64, 4096):

        def extend(new=new):
            qe = torch.empty(bs * new, 64, 64, dtype=bf16)
            ext = torch.full((bs,), new)
            extend_attention_fwd(
                qe, k_buf, v_buf, torch.empty_like(qe), table, rows, seq_lens, ext,
                torch.cumsum(ext, 0) - ext, new, 0.125, window=128, sinks=sinks,
            )  # fmt: skip

        out.append((f"extend_attention sinks window=128 new={new}", extend))
    return out


def _rotary_cases() -> list[tuple[str, Callable[[], object]]]:
    """The in-place rotary over whole heads (llama-8b) and over the first 96 of 128 dims
    (Phi-4-mini's partial rotary: 24 q heads, 8 KV heads)."""
    from batchrun.kernels.fused_rotary import apply_rotary_

    out = []
    for name, heads, kv_heads, rotary_dim in (("llama-8b", 32, 8, 128), ("phi-4-mini", 24, 8, 96)):
        q = torch.randn(4, heads, 128, dtype=torch.bfloat16)
        k = torch.randn(4, kv_heads, 128, dtype=torch.bfloat16)
        cos = torch.rand(64, rotary_dim)  # cos and sin alike: only the compile is checked
        call = functools.partial(apply_rotary_, q, k, torch.arange(4), cos, cos, pdl=True)
        out.append((f"fused_rotary {name} rotary_dim={rotary_dim}", call))
    return out


def _activation_cases() -> list[tuple[str, Callable[[], object]]]:
    """The gated MLP's activations (kernels/activation.py): SwiGLU, and GELU-tanh (Gemma 3) at
    gemma-3-1b's and gemma-3-27b's widths."""
    from batchrun.kernels import activation

    out: list[tuple[str, Callable[[], object]]] = []
    for name, fn in (("silu_and_mul", activation.silu_and_mul),
                     ("gelu_tanh_and_mul", activation.gelu_tanh_and_mul)):  # fmt: skip
        for tokens, inter in ((1, 6912), (256, 21504)):
            x = torch.randn(tokens, 2 * inter, dtype=torch.bfloat16)
            out.append((f"{name} T={tokens} I={inter}", lambda x=x, fn=fn: fn(x, pdl=True)))
    return out


# (name, experts, top-k, hidden, intermediate) of the MoE models, and TP widths of the largest
MOE_SHAPES = (
    ("qwen3-30b-a3b", 128, 8, 2048, 768),
    ("qwen3-235b-a22b", 128, 8, 4096, 1536),
    ("qwen3-235b-a22b tp8", 128, 8, 4096, 192),
    ("qwen1.5-moe-a2.7b", 60, 4, 2048, 1408),
    ("mixtral-8x7b", 8, 2, 4096, 14336),
    ("mixtral-8x7b tp2", 8, 2, 4096, 7168),
)


def _moe_cases() -> list[tuple[str, Callable[[], object]]]:
    """kernels/fused_moe.py (and its alignment) at the tile buckets its rule picks,
    kernels/moe_gemv.py at decode sizes, kernels/moe_grouped_mm.py's kernels at a prefill size:
    torch.empty weights (no pages touched), every token routed to expert 0;
    kernels/moe_route.py's router."""
    from batchrun.kernels.fused_moe import fused_moe, pick_config, tile_tokens
    from batchrun.kernels.moe_gemv import moe_gemv, moe_gemv_residual
    from batchrun.kernels.moe_grouped_mm import grouped_mm_moe
    from batchrun.kernels.moe_route import route_gemv, topk_softmax

    out: list[tuple[str, Callable[[], object]]] = []
    for name, experts, top_k, hidden, inter in MOE_SHAPES:
        for renormalize in (True, False):

            def route(e=experts, k=top_k, r=renormalize):
                return topk_softmax(torch.empty(4, e), k, r)

            out.append((f"moe_route {name} renormalize={renormalize}", route))

        for tokens in (1, 16):

            def router(t=tokens, e=experts, k=top_k, h=hidden):
                x = torch.empty(t, h, dtype=torch.bfloat16)
                return route_gemv(x, torch.empty(e, h), None, k, True)

            out.append((f"route_gemv {name} T={tokens}", router))
        w13 = torch.empty(experts, 2 * inter, hidden, dtype=torch.bfloat16)
        w2 = torch.empty(experts, hidden, inter, dtype=torch.bfloat16)
        for tokens in (1, 64, 512, 1024, 16384):

            def call(t=tokens, k=top_k, h=hidden, w13=w13, w2=w2):
                x = torch.empty(t, h, dtype=torch.bfloat16)
                ids = torch.zeros(t, k, dtype=torch.int32)
                return fused_moe(x, w13, w2, torch.rand(t, k), ids)

            out.append((f"fused_moe {name} T={tokens}", call))
        for tokens in (512, 4096):  # the gathered rows through TMA descriptors

            def gathered(t=tokens, k=top_k, h=hidden, e=experts, i=inter, w13=w13, w2=w2):
                x = torch.empty(t, h, dtype=torch.bfloat16)
                ids = torch.zeros(t, k, dtype=torch.int32)
                config = pick_config(tile_tokens(t), e, k, h, i)._replace(gather=True)
                return fused_moe(x, w13, w2, torch.rand(t, k), ids, config=config)

            out.append((f"fused_moe gathered {name} T={tokens}", gathered))
        for tokens in (1, 2) if top_k > 2 else (1, 2, 8):

            def gemv_call(t=tokens, k=top_k, h=hidden, w13=w13, w2=w2):
                x = torch.empty(t, h, dtype=torch.bfloat16)
                ids = torch.zeros(t, k, dtype=torch.int32)
                return moe_gemv(x, w13, w2, torch.rand(t, k), ids)

            out.append((f"moe_gemv {name} T={tokens}", gemv_call))

        def residual_call(k=top_k, h=hidden, w13=w13, w2=w2):
            x = torch.empty(1, h, dtype=torch.bfloat16)
            ids = torch.zeros(1, k, dtype=torch.int32)
            norm = (torch.empty(h, dtype=torch.bfloat16), 1e-6)
            return moe_gemv_residual(x, w13, w2, torch.rand(1, k), ids, torch.empty_like(x), norm)

        out.append((f"moe_gemv_residual {name} T=1 (the next norm)", residual_call))

        def grouped(k=top_k, h=hidden, w13=w13, w2=w2):
            x = torch.empty(1024, h, dtype=torch.bfloat16)
            ids = torch.zeros(1024, k, dtype=torch.int32)
            return _with_empty_grouped_mm(grouped_mm_moe, x, w13, w2, torch.rand(1024, k), ids)

        out.append((f"grouped_mm_moe {name} T=1024", grouped))
    out += _gpt_oss_moe_cases()
    return out


def _with_empty_grouped_mm(fn, *args, **kwargs):
    """fn with torch._grouped_mm (the library's GEMM: nothing of batchrun's to compile) giving an
    empty result of its shape, so that the Triton kernels around it compile without the CPU
    computing the GEMMs."""

    def empty(a, b, offs=None):
        return torch.empty(a.shape[0], b.shape[-1], dtype=a.dtype)

    real, torch._grouped_mm = torch._grouped_mm, empty
    try:
        return fn(*args, **kwargs)
    finally:
        torch._grouped_mm = real


def _gpt_oss_moe_cases() -> list[tuple[str, Callable[[], object]]]:
    """fused_moe with gpt-oss-20b's experts (32, top-4, 2880 / 2880): biases and the clamped
    SwiGLU, with and without the down bias (TP ranks other than 0)."""
    from batchrun.kernels.fused_moe import fused_moe
    from batchrun.kernels.moe_gemv import moe_gemv
    from batchrun.kernels.moe_grouped_mm import grouped_mm_moe
    from batchrun.kernels.moe_route import route_gemv

    from batchrun.layers.moe import ExpertExtras

    experts, top_k, hidden, inter = 32, 4, 2880, 2880
    w13 = torch.empty(experts, 2 * inter, hidden, dtype=torch.bfloat16)
    w2 = torch.empty(experts, hidden, inter, dtype=torch.bfloat16)
    b13 = torch.empty(experts, 2 * inter, dtype=torch.bfloat16)
    b2 = torch.empty(experts, hidden, dtype=torch.bfloat16)
    out: list[tuple[str, Callable[[], object]]] = []
    for tokens in (1, 1024):
        for down_bias in (b2, None):
            extras = ExpertExtras(b13, down_bias, 1.702, 7.0)

            def call(t=tokens, extras=extras):
                x = torch.empty(t, hidden, dtype=torch.bfloat16)
                ids = torch.zeros(t, top_k, dtype=torch.int32)
                return fused_moe(x, w13, w2, torch.rand(t, top_k), ids, extras=extras)

            bias = "b2" if down_bias is not None else "no b2"
            out.append((f"fused_moe gpt-oss-20b {bias} T={tokens}", call))

            def gemv_call(extras=extras):
                x = torch.empty(1, hidden, dtype=torch.bfloat16)
                ids = torch.zeros(1, top_k, dtype=torch.int32)
                return moe_gemv(x, w13, w2, torch.rand(1, top_k), ids, extras=extras)

            if tokens == 1:
                out.append((f"moe_gemv gpt-oss-20b {bias} T=1", gemv_call))
            else:

                def grouped(t=tokens, extras=extras):
                    x = torch.empty(t, hidden, dtype=torch.bfloat16)
                    ids = torch.zeros(t, top_k, dtype=torch.int32)
                    weights = torch.rand(t, top_k)
                    return _with_empty_grouped_mm(
                        grouped_mm_moe, x, w13, w2, weights, ids, extras=extras
                    )

                out.append((f"grouped_mm_moe gpt-oss-20b {bias} T={tokens}", grouped))

    def router():
        x = torch.empty(1, hidden, dtype=torch.bfloat16)
        return route_gemv(x, torch.empty(experts, hidden), torch.empty(experts), top_k, True)

    out.append(("route_gemv gpt-oss-20b (bias) T=1", router))
    return out


def _int4_weight(cls, n: int, k: int, group: int, symmetric: bool, act_order: bool):
    groups = -(-k // group)
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8)
    scales = (torch.rand(n, groups) * 0.004 + 0.002).half()
    zeros = (
        torch.full((n, groups), 8, dtype=torch.uint8)
        if symmetric
        else torch.randint(1, 16, (n, groups), dtype=torch.uint8)
    )
    g_idx = None
    if act_order:
        g_idx = torch.empty(k, dtype=torch.int32)
        g_idx[torch.randperm(k)] = (torch.arange(k) // group).int()
    return cls(q, scales, zeros, group, g_idx)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--arch", type=int, default=90, help="CUDA compute capability, e.g. 90, 89")
    p.add_argument("--ptxas", action="store_true", help="registers and spills of each kernel")
    p.add_argument(
        "--sass", action="store_true", help="each kernel's largest loop in SASS (nvdisasm)"
    )
    args = p.parse_args(argv)
    import triton

    _compile_only(args.arch, args.ptxas, args.sass)
    print(f"triton {triton.__version__}, cuda sm_{args.arch}")
    failed = 0
    for name, call in cases():
        try:
            call()
            print(f"OK    {name}", flush=True)
        except Exception as e:  # a compile error: named, and the run goes on
            failed += 1
            cause = f" ({e.__cause__!r})" if e.__cause__ else ""
            print(f"FAIL  {name}: {type(e).__name__}: {str(e)[-600:]}{cause}", flush=True)
    print(f"{failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
