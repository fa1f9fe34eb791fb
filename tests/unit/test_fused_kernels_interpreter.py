"""The fused RMSNorm / rotary / SiLU-and-mul / KV-store / gemv Triton kernels under Triton's CPU
interpreter, against batchrun's torch code (the blocks of `batchrun.layers` built with
KernelPlan.reference()), and a tiny model built with the Triton kernels against the same model
on the torch path.

Skipped where triton is not installed (CI does not install it). The kernels run in a subprocess
because TRITON_INTERPRET must be set before triton is first imported. The interpreter casts fp32 to
bf16 by truncation (the GPU rounds to nearest even), so only fp32 and fp16 run here; tests/gpu
covers bf16 on the GPU.
"""

from __future__ import annotations

import importlib.util
import sys
import tempfile
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow  # CI's slow tier (BATCHRUN_SLOW_TESTS=1)

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))
from spies import count_calls  # noqa: E402
from triton_interpreter import INTERPRETER_KERNELS  # noqa: E402

MANTISSA_BITS = {torch.float32: 23, torch.float16: 10, torch.bfloat16: 7}


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")
def test_fused_kernels_under_interpreter():
    from triton_interpreter import run_under_interpreter

    run_under_interpreter(__file__)


def max_ulps(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max |out - ref| in units of the last place of ref in ref's dtype."""
    bits = MANTISSA_BITS[ref.dtype]
    ref32 = ref.float()
    exponent = torch.floor(torch.log2(ref32.abs().clamp_min(torch.finfo(ref.dtype).tiny)))
    ulp = torch.exp2(exponent - bits)
    return ((out.float() - ref32).abs() / ulp).max().item()


def _strided(shape, dtype, gen, pad: int = 7) -> torch.Tensor:
    """A [T, N] view with row stride N + pad, so kernels must honour strides."""
    num_rows, n_cols = shape
    base = torch.randn(num_rows, n_cols + pad, generator=gen) * 3
    return base.to(dtype)[:, :n_cols]


def _check_norm(dtype, max_ulp) -> None:
    from batchrun.kernels.fused_norm import fused_add_rms_norm, rms_norm

    from batchrun.layers.norm import RMSNorm

    gen = torch.Generator().manual_seed(0)
    for num_rows, n_cols in ((5, 576), (3, 64), (2, 1000), (1, 2048)):
        norm = RMSNorm(n_cols, 1e-5, dtype, "cpu")
        with torch.no_grad():
            norm.weight.copy_(torch.rand(n_cols, generator=gen) + 0.5)
        x = _strided((num_rows, n_cols), dtype, gen)
        residual = (torch.randn(num_rows, n_cols, generator=gen) * 3).to(dtype)
        ref = norm(x)
        out = rms_norm(x, norm.weight.detach(), norm.eps)
        assert max_ulps(out, ref) <= max_ulp, ("rms_norm", dtype, n_cols, max_ulps(out, ref))

        ref_x, ref_residual = norm.forward_with_residual(x, residual)  # the torch path
        x_, residual_ = x.clone(), residual.clone()
        out_x, out_residual = fused_add_rms_norm(x_, residual_, norm.weight.detach(), norm.eps)
        assert out_x is x_ and out_residual is residual_
        assert torch.equal(residual_, ref_residual), ("residual", dtype, n_cols)
        assert max_ulps(x_, ref_x) <= max_ulp, ("fused_add", dtype, n_cols, max_ulps(x_, ref_x))


def _check_norm_heads(dtype) -> None:
    """rms_norm_heads (Qwen3's q and k norms in one launch, in place on the qkv projection's
    heads) has the bits of rms_norm on each head copied out, q's weight on the q heads, k's on
    the k heads; v's columns are not touched."""
    from batchrun.kernels.fused_norm import rms_norm, rms_norm_heads

    gen = torch.Generator().manual_seed(5)
    for tokens, num_q, num_kv, head_dim in ((3, 4, 2, 64), (1, 32, 4, 128), (2, 3, 1, 80)):
        qkv = torch.randn(tokens, (num_q + 2 * num_kv) * head_dim, generator=gen).to(dtype)
        wq, wk = (torch.rand(head_dim, generator=gen).to(dtype) + 0.5 for _ in range(2))
        q_size, kv_size = num_q * head_dim, num_kv * head_dim
        want_q = rms_norm(qkv[:, :q_size].reshape(-1, head_dim), wq, 1e-6)
        want_k = rms_norm(qkv[:, q_size : q_size + kv_size].reshape(-1, head_dim), wk, 1e-6)
        v = qkv[:, q_size + kv_size :].clone()
        heads = qkv[:, : q_size + kv_size].view(tokens, num_q + num_kv, head_dim)
        assert rms_norm_heads(heads, wq, wk, num_q, 1e-6) is heads
        assert torch.equal(qkv[:, :q_size].reshape(-1, head_dim), want_q)
        assert torch.equal(qkv[:, q_size : q_size + kv_size].reshape(-1, head_dim), want_k)
        assert torch.equal(qkv[:, q_size + kv_size :], v)


def _check_rotary(dtype, max_ulp) -> None:
    from batchrun.kernels.fused_rotary import apply_rotary_

    from batchrun.layers.rotary import RotaryEmbedding

    gen = torch.Generator().manual_seed(1)
    for num_tokens, num_heads, num_kv_heads, head_dim in (
        (7, 6, 2, 64),
        (3, 4, 1, 128),
        (5, 3, 3, 80),
    ):
        rotary = RotaryEmbedding(head_dim, 300, 10000.0, {}, "cpu")
        q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
        qkv = torch.randn(num_tokens, q_size + 2 * kv_size, generator=gen).to(dtype)
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(num_tokens, num_heads, head_dim)  # strided views, as in llama.py
        k = k.view(num_tokens, num_kv_heads, head_dim)
        v_before = v.clone()
        positions = torch.randint(0, 300, (num_tokens,), generator=gen)
        ref_q, ref_k = rotary(positions, q, k)  # the torch path: new tensors
        apply_rotary_(q, k, positions, rotary.cos_cache, rotary.sin_cache)
        assert torch.equal(v, v_before), "v was written"
        for name, out, ref in (("q", q, ref_q), ("k", k, ref_k)):
            assert max_ulps(out, ref) <= max_ulp, ("rotary", name, dtype, head_dim)


def _check_silu_and_mul(dtype, max_ulp) -> None:
    import torch.nn.functional as F
    from batchrun.kernels.activation import silu_and_mul

    gen = torch.Generator().manual_seed(2)
    for num_tokens, inter_size in ((4, 128), (3, 576), (2, 1500)):
        x = _strided((num_tokens, 2 * inter_size), dtype, gen, pad=5)
        gate, up = x.chunk(2, dim=-1)
        ref = F.silu(gate) * up
        out = silu_and_mul(x)
        assert max_ulps(out, ref) <= max_ulp, ("silu_and_mul", dtype, inter_size)


# gelu_tanh_and_mul's tolerance against torch, relative: torch's 1 + tanh(u) cancels in the
# negative tail (~1e-5 of fp32), where the kernel's x / (1 + exp(-2u)) does not; in fp16 / bf16
# a 1-ulp different activation gives up to 2 ulps in the product (fp16: 2^-9)
GELU_RTOL = {torch.float32: 1e-5, torch.float16: 2e-3}


def _check_gelu_tanh_and_mul(dtype) -> None:
    """Gemma's gate, gelu_pytorch_tanh(gate) * up, against torch's."""
    import torch.nn.functional as F
    from batchrun.kernels.activation import gelu_tanh_and_mul

    gen = torch.Generator().manual_seed(3)
    for num_tokens, inter_size in ((4, 128), (3, 576), (2, 1500)):
        x = _strided((num_tokens, 2 * inter_size), dtype, gen, pad=5)
        gate, up = x.chunk(2, dim=-1)
        ref = (F.gelu(gate, approximate="tanh") * up).float()
        out = gelu_tanh_and_mul(x).float()
        ok = torch.allclose(out, ref, rtol=GELU_RTOL[dtype], atol=1e-5)
        assert ok, ("gelu_tanh_and_mul", dtype, inter_size, (out - ref).abs().max())


def _check_store_kv(dtype) -> None:
    """store_kv from strided k/v views of a fused qkv tensor, as llama.py slices them: the written
    rows equal k/v exactly, every other row (of both buffers) is untouched."""
    from batchrun.kernels.kv_store import store_kv

    gen = torch.Generator().manual_seed(4)
    for num_tokens, num_heads, num_kv_heads, head_dim in (
        (5, 4, 2, 64),
        (7, 6, 3, 16),  # KV * D not a power of two
        (3, 2, 1, 128),
        (0, 4, 2, 64),
    ):
        num_slots = 40
        q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
        qkv = torch.randn(num_tokens, q_size + 2 * kv_size, generator=gen).to(dtype)
        k = qkv[:, q_size : q_size + kv_size].view(num_tokens, num_kv_heads, head_dim)
        v = qkv[:, q_size + kv_size :].view(num_tokens, num_kv_heads, head_dim)
        shape = (num_slots + 1, num_kv_heads, head_dim)
        k_buf = torch.randn(shape, generator=gen).to(dtype)
        v_buf = torch.randn(shape, generator=gen).to(dtype)
        k_ref, v_ref = k_buf.clone(), v_buf.clone()
        # distinct slots including the last (dummy) one
        loc = torch.randperm(num_slots, generator=gen)[: max(num_tokens - 1, 0)]
        loc = torch.cat([loc, torch.tensor([num_slots])])[:num_tokens]
        for loc_dtype in (torch.int64, torch.int32):
            k_buf.copy_(k_ref)
            v_buf.copy_(v_ref)
            store_kv(k_buf, v_buf, loc.to(loc_dtype), k, v)
            written = torch.zeros(num_slots + 1, dtype=torch.bool)
            written[loc] = True
            assert torch.equal(k_buf[loc], k) and torch.equal(v_buf[loc], v), (dtype, head_dim)
            assert torch.equal(k_buf[~written], k_ref[~written]), ("k rows touched", dtype)
            assert torch.equal(v_buf[~written], v_ref[~written]), ("v rows touched", dtype)


def _check_model_wiring(tmp_dir: Path) -> None:
    """The tiny model on an engine with the Triton kernels (CPU tensors, interpreter) and the
    torch attention against one on the torch path: checks the residual-stream restructuring,
    the in-place rotary on qkv views and the KV store from qkv views."""
    from dataclasses import replace

    from tiny_models import make_tiny_model, random_prompts

    from batchrun.config import EngineConfig, KernelPlan
    from batchrun.engine.engine import Engine

    triton = replace(INTERPRETER_KERNELS, attention="torch")
    for kind in ("llama", "qwen3", "gemma3"):  # gemma3: GELU's gate, four norms a layer
        path = Path(tempfile.mkdtemp(dir=tmp_dir))
        make_tiny_model(kind, path)
        base = dict(model=str(path), device="cpu", dtype="float32", kv_budget=512)
        ref_engine = Engine(EngineConfig(**base), kernels=KernelPlan.reference())
        engine = Engine(EngineConfig(**base), kernels=triton)
        assert engine.kernels == triton == engine.runner.model.norm.kernels
        for prompt in random_prompts(2, seed=3, min_len=5, max_len=20):
            ref, fused = ref_engine.score(prompt), engine.score(prompt)
            rel = ((fused - ref).norm() / ref.norm()).item()
            assert rel <= 1e-5, (kind, rel)
    _check_decode_gemv_wiring(tmp_dir)


def _runner(path: Path, kernels, dtype: str = "float16"):
    """A ModelRunner (model, KV pool, attention backend) of the model at `path` in `dtype`, built
    with `kernels` as given: an Engine on the CPU refuses decode_gemv "triton", which runs here
    on the interpreter."""
    from batchrun.config import EngineConfig, resolve_sizes
    from batchrun.engine.model_runner import ModelRunner
    from batchrun.models.config import ModelConfig

    model_cfg = ModelConfig.from_dir(path)
    config = EngineConfig(model=str(path), device="cpu", dtype=dtype, kv_budget=512, overlap=False)
    config = resolve_sizes(config, model_cfg)
    return ModelRunner(config, kernels, model_cfg, path, model_cfg.max_position_embeddings)


def _check_decode_gemv_wiring(tmp_dir: Path) -> None:
    """Forwards of a few tokens and of one token with decode_gemv "triton" (fp16, the tiny
    llama, the torch attention) give the torch path's logits. Rows of up to 16 take
    kernels/gemv.py for every matmul; one row, with decode_norms other than "off", takes
    the fused decode (models/fused_decode.py): "all" the residual adds and norms inside the
    gemvs before them, "fold-all" both norms inside the matmuls after them (qkv's and
    gate_up's), on the folded weights that its prepare makes."""
    from dataclasses import replace

    from tiny_models import make_tiny_model, random_prompts

    import batchrun.layers.linear as linear
    from batchrun.config import KernelPlan
    from batchrun.models.fused_decode import FusedDecode

    path = Path(tempfile.mkdtemp(dir=tmp_dir))
    make_tiny_model("llama", path)
    ref_runner = _runner(path, KernelPlan.reference())
    prompts = random_prompts(3, seed=4, min_len=3, max_len=16) + [[5], [60]]
    refs = [ref_runner.all_logits(p, torch.arange(len(p))) for p in prompts]
    for mode in ("off", "all", "fold-all"):
        kernels = replace(
            INTERPRETER_KERNELS, attention="torch", decode_gemv="triton", decode_norms=mode
        )
        runner = _runner(path, kernels)
        model = runner.model
        fused_mode = "off" if model.fused is None else model.fused.mode
        assert runner.kernels.decode_norms == fused_mode == mode  # folds fit the CPU
        folds = model.fused is not None and len(model.fused.gate_up_rms) == len(model.layers)
        assert folds == (mode == "fold-all"), (mode, folds)
        for prompt, ref in zip(prompts, refs):
            with pytest.MonkeyPatch.context() as mp:
                one_row = count_calls(mp, FusedDecode, "forward")
                matmuls = count_calls(mp, linear, "linear")  # a layer's forward, not its gemv
                fused = runner.all_logits(prompt, torch.arange(len(prompt)))
            takes = mode != "off" and len(prompt) == 1
            assert bool(one_row["n"]) == takes, (mode, len(prompt))
            assert bool(matmuls["n"]) == (not takes), (mode, len(prompt))
            rel = ((fused - ref).norm() / ref.norm()).item()
            assert rel <= 5e-3, (mode, len(prompt), rel)


def _check_token_bitmask() -> None:
    """kernels/token_bitmask.py vs the torch unpacking, -inf past the tokenizer's vocabulary."""
    from batchrun.kernels.token_bitmask import apply_token_bitmask_

    from batchrun.engine.grammar import apply_mask_torch

    gen = torch.Generator().manual_seed(3)
    for vocab, mask_vocab in ((5000, 5000), (5000, 3001), (70, 40)):
        logits = torch.randn(9, vocab, generator=gen)
        words = (mask_vocab + 31) // 32
        bitmask = torch.randint(-(2**31), 2**31 - 1, (9, words), generator=gen).to(torch.int32)
        indices = torch.tensor([0, 4, 8], dtype=torch.int32)
        want = logits.clone()
        apply_mask_torch(want[:, :mask_vocab], bitmask, indices)
        want[indices.long(), mask_vocab:] = float("-inf")
        got = logits.clone()
        apply_token_bitmask_(got, bitmask, indices, mask_vocab)
        assert torch.equal(got, want), (vocab, mask_vocab)


def _check_gemv() -> None:
    """kernels/gemv.py vs x @ w.T (fp32 and fp16; the interpreter's bf16 dot is wrong): M from
    1 to 16, ragged N and K, split-K on and off."""
    from batchrun.kernels.gemv import GemvConfig, gemv, split_counters

    gen = torch.Generator().manual_seed(6)
    cases = [(1, 100, 300, None), (3, 64, 512, GemvConfig(32, 128, 2)),
             (16, 50, 1000, GemvConfig(16, 64, 4)), (5, 33, 70, GemvConfig(16, 32, 1)),
             (2, 40, 1000, GemvConfig(16, 64, 5)), (1, 20, 100, GemvConfig(16, 32, 8))]  # fmt: skip
    for dtype, tol in ((torch.float32, 1e-5), (torch.float16, 2e-3)):
        for m, n, k, cfg in cases:
            x = torch.randn(m, k, generator=gen).to(dtype)
            w = torch.randn(n, k, generator=gen).to(dtype)
            got = gemv(x, w, cfg)
            ref = x.float() @ w.float().T
            assert got.shape == (m, n) and got.dtype == dtype
            assert ((got.float() - ref).norm() / ref.norm()).item() <= tol, (dtype, m, n, k)
            # the split counters are left at zero for the next call, which gives the same bits
            assert not split_counters(x.device).any()
            assert torch.equal(gemv(x, w, cfg), got)
    _check_gemv_swiglu()
    _check_gemv_rms()


def _check_gemv_rms() -> None:
    """gemv_rms (the RMSNorm inside the matmul: rstd * (h @ (w * g).T)) against rms_norm then
    x @ w.T in fp32 (fp32 and fp16): ragged N and K, K splits (each slice scales its partial
    sums), and with the SwiGLU epilogue (silu(gate) * up of the normed row's sums)."""
    from batchrun.kernels.fused_norm import rms_norm
    from batchrun.kernels.gemv import GemvConfig, gemv_rms, rms_fold_weight, split_counters

    gen = torch.Generator().manual_seed(14)
    cases = [(100, 300, None), (64, 512, GemvConfig(32, 128, 4)), (40, 1000, GemvConfig(16, 64)),
             (48, 1000, GemvConfig(16, 128, 3))]  # fmt: skip
    for dtype, tol in ((torch.float32, 1e-5), (torch.float16, 2e-3)):
        for n, k, cfg in cases:
            for swiglu in (False, True):
                h = (torch.randn(1, k, generator=gen) * 3).to(dtype)
                w = (torch.randn(n, k, generator=gen) * 0.1).to(dtype)
                g = (torch.rand(k, generator=gen) + 0.5).to(dtype)
                ref = rms_norm(h, g, 1e-5).float() @ w.float().T
                if swiglu:  # the rounding of the unfused path: gate, up, silu to the dtype
                    gate, up = ref[:, : n // 2].to(dtype).float(), ref[:, n // 2 :].to(dtype)
                    ref = (gate * torch.sigmoid(gate)).to(dtype).float() * up.float()
                got = gemv_rms(h, rms_fold_weight(w, g), 1e-5, cfg, swiglu=swiglu)
                assert got.shape == (1, n // 2 if swiglu else n) and got.dtype == dtype
                err = ((got.float() - ref).norm() / ref.norm()).item()
                assert err <= tol, (dtype, n, k, cfg, swiglu, err)
                assert not split_counters(h.device).any()


def _check_gemv_swiglu() -> None:
    """gemv(swiglu=True) vs the [M, 2I] matmul rounded to fp16 then silu_and_mul's numerics:
    split-K on and off, ragged I and K."""
    import torch.nn.functional as F
    from batchrun.kernels.gemv import GemvConfig, gemv, split_counters

    gen = torch.Generator().manual_seed(9)
    dtype = torch.float16
    cases = [(1, 48, 300, None), (3, 40, 512, GemvConfig(16, 128, 3)), (16, 32, 64, None),
             (2, 70, 1000, GemvConfig(32, 64, 4))]  # fmt: skip
    for m, inter, k, cfg in cases:
        x = torch.randn(m, k, generator=gen).to(dtype)
        w = (torch.randn(2 * inter, k, generator=gen) * 0.1).to(dtype)
        gate, up = (x.float() @ w.float().T).to(dtype).float().chunk(2, dim=-1)
        ref = F.silu(gate).to(dtype).float() * up
        got = gemv(x, w, cfg, swiglu=True)
        assert got.shape == (m, inter) and got.dtype == dtype
        assert ((got.float() - ref).norm() / ref.norm()).item() <= 2e-3, (m, inter, k, cfg)
        assert not split_counters(x.device).any()


def _check_gemv_residual_and_norm() -> None:
    """gemv_residual (fp16): h = gemv(x, w) + residual bit for bit (M up to 16), and for one row
    the norm computed by the last column tile: within an ulp of kernels/fused_norm.py's
    rms_norm (the same formula; the sum of squares may reduce in another order). Split-K on and
    off, ragged N and K; the counters left at zero."""
    from batchrun.kernels.fused_norm import rms_norm
    from batchrun.kernels.gemv import GemvConfig, gemv, gemv_residual, split_counters

    gen = torch.Generator().manual_seed(10)
    dtype = torch.float16
    cases = [(1, 300, 200, GemvConfig(32, 64, 1)), (1, 512, 130, GemvConfig(16, 64, 4)),
             (1, 1000, 96, None), (3, 512, 130, GemvConfig(16, 64, 4)),
             (16, 64, 96, GemvConfig(32, 32, 1))]  # fmt: skip
    for m, k, hidden, cfg in cases:
        x = torch.randn(m, k, generator=gen).to(dtype)
        w = (torch.randn(hidden, k, generator=gen) * 0.1).to(dtype)
        residual = torch.randn(m, hidden, generator=gen).to(dtype)
        norm_w = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(dtype)
        want_h = (gemv(x, w, cfg).float() + residual.float()).to(dtype)
        h, normed = gemv_residual(x, w, residual, config=cfg)
        assert torch.equal(h, want_h) and normed is None, (m, k, hidden)
        if m == 1:
            h, normed = gemv_residual(x, w, residual, norm=(norm_w, 1e-5), config=cfg)
            assert torch.equal(h, want_h)
            assert max_ulps(normed, rms_norm(want_h, norm_w, 1e-5)) <= 1, (k, hidden)
        assert not split_counters(x.device).any()


def _check_graph_inputs() -> None:
    """kernels/graph_inputs.py: ids (placeholders < 0 read from the token pool by request row),
    positions, rows, sequence lengths and slots copied into larger static buffers, the rows
    [n, bs) padded with 0, 0, the dummy row, 1 and the dummy slot; nothing past bs written."""
    from batchrun.kernels.graph_inputs import load_decode_graph_inputs

    gen = torch.Generator().manual_seed(11)
    token_pool = torch.randint(0, 1000, (40,), generator=gen)
    for n, bs in ((1, 1), (3, 4), (5, 8), (300, 1100)):
        rows = torch.randperm(39, generator=gen)[: min(n, 39)].repeat(n // 39 + 1)[:n]
        ids = torch.randint(0, 1000, (n,), generator=gen)
        ids[::2] = -1  # placeholders
        src = (ids, torch.arange(n) + 7, rows, torch.arange(n) + 9, torch.arange(n) + 100)
        dst = tuple(torch.full((bs + 3,), -5, dtype=torch.int64) for _ in range(5))
        load_decode_graph_inputs(src, dst, token_pool, n, bs, 39, 77)
        want_ids = torch.where(ids < 0, token_pool[rows], ids)
        pads = (0, 0, 39, 1, 77)
        for i, (got, want) in enumerate(zip(dst, (want_ids, *src[1:]))):
            assert torch.equal(got[:n], want), (i, n, bs)
            assert (got[n:bs] == pads[i]).all() and (got[bs:] == -5).all(), (i, n, bs)


def _check_argmax() -> None:
    """kernels/argmax.py vs torch's argmax: ties across and within chunks go to the lowest id,
    a vocabulary that is not a multiple of the chunk, a row of -inf."""
    from batchrun.kernels.argmax import CHUNK, argmax

    gen = torch.Generator().manual_seed(8)
    for vocab in (5000, CHUNK, 3 * CHUNK + 7, 100):
        for dtype in (torch.float32, torch.float16):
            logits = (torch.randn(5, vocab, generator=gen) * 2).round().to(dtype)  # many ties
            logits[1, :] = float("-inf")
            logits[2, vocab - 1] = 50.0  # the max in the last, partial chunk
            got = argmax(logits)
            assert got.dtype == torch.int64 and torch.equal(got, logits.argmax(dim=-1)), vocab


def _check_masked_argmax() -> None:
    """token_bitmask.masked_argmax vs the mask kernel + argmax: unmasked rows, ties, a row with
    nothing allowed, a vocabulary longer than one block."""
    from batchrun.kernels.token_bitmask import apply_token_bitmask_, masked_argmax

    gen = torch.Generator().manual_seed(5)
    for vocab, mask_vocab in ((5000, 5000), (9000, 4100), (300, 77)):
        logits = (torch.randn(6, vocab, generator=gen) * 3).round()  # ties
        words = (mask_vocab + 31) // 32
        bitmask = torch.randint(-(2**31), 2**31 - 1, (6, words), generator=gen).to(torch.int32)
        bitmask[2] = 0
        flags = torch.tensor([1, 0, 1, 1, 0, 1], dtype=torch.int32)
        want = logits.clone()
        apply_token_bitmask_(want, bitmask, flags.nonzero().flatten().int(), mask_vocab)
        got = masked_argmax(logits, bitmask, flags, mask_vocab)
        assert torch.equal(got, want.argmax(dim=-1)), (vocab, got, want.argmax(dim=-1))
        assert got[2] == 0


def _run_checks() -> None:
    # fp16: every kernel rounds where the torch code rounds, so at most one ulp from a different
    # fp32 reduction order / rsqrt / exp; rotary is exact (products of fp16 values are exact)
    for dtype, ulps in ((torch.float32, 8), (torch.float16, 1)):
        _check_norm(dtype, ulps)
        _check_norm_heads(dtype)
        _check_rotary(dtype, 0 if dtype == torch.float16 else ulps)
        _check_silu_and_mul(dtype, ulps)
        _check_gelu_tanh_and_mul(dtype)
        _check_store_kv(dtype)
    _check_token_bitmask()
    _check_masked_argmax()
    _check_argmax()
    _check_graph_inputs()
    _check_gemv()
    _check_gemv_residual_and_norm()
    with tempfile.TemporaryDirectory() as tmp_dir:
        _check_model_wiring(Path(tmp_dir))
    print("ok")


if __name__ == "__main__":
    _run_checks()
