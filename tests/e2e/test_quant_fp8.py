"""FP8 checkpoints end to end on the CPU: each format written in its exact on-disk layout by
tests/quant_checkpoints.py (tiny Llama, and Qwen2 with q/k/v biases) runs in batchrun as the fp32
transformers model built from the dequantized weights, with the same activation fake-quantization
applied by hooks, computes it.

Bounds. Every quantized linear, given the same input, gives the reference's output within 1e-6
relative (the same math: dequantized weight, the same activation rounding). The whole model's
logits: within 1e-5 relative where activations are static or unquantized; where they are
quantized per token at run time, two fp32 implementations that differ by ~1e-6 before a
quantization (attention and norms are computed differently) now and then round one value to
the neighbouring FP8 step (1/16 of it apart), which moves that token's later logits by up to
~1e-2: the bound there is 3e-2, and the per-linear check stands for exactness."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from quant_checkpoints import FP8_FORMATS, write_quantized  # noqa: E402
from tiny_models import random_prompts  # noqa: E402

from batchrun.config import EngineConfig  # noqa: E402
from batchrun.engine.engine import Engine  # noqa: E402
from batchrun.params import GenerateRequest, SamplingParams  # noqa: E402

NEW_TOKENS = 32
EXACT = 1e-5
DYNAMIC_BOUND = 3e-2
# a greedy step may pick the reference's second token where the two logits are this close:
# within what one FP8 rounding step of an activation moves them (see above)
TIE = 0.05


def engine_for(path: Path, **kw) -> Engine:
    return Engine(
        EngineConfig(model=str(path), device="cpu", dtype="float32", kv_budget=4096, **kw)
    )


def logits_bound(fmt: str) -> float:
    return DYNAMIC_BOUND if FP8_FORMATS[fmt].activations == "dynamic" else EXACT


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def check_linears(engine: Engine, hf, prompt: list[int]) -> None:
    """Each of batchrun's linears, on the input it got, against the reference's linears (the
    fused ones' parts concatenated) on that same input."""
    captured = []
    hooks = []
    for i, layer in enumerate(engine.runner.model.layers):
        for path, parts in (
            ("self_attn.qkv_proj", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
            ("self_attn.o_proj", ("self_attn.o_proj",)),
            ("mlp.gate_up_proj", ("mlp.gate_proj", "mlp.up_proj")),
            ("mlp.down_proj", ("mlp.down_proj",)),
        ):
            ours = layer.get_submodule(path)
            refs = [hf.get_submodule(f"model.layers.{i}.{p}") for p in parts]
            hooks.append(
                ours.register_forward_hook(
                    lambda mod, args, out, refs=refs, name=f"{i}.{path}": captured.append(
                        (name, args[0].clone(), out.clone(), refs)
                    )
                )
            )
    try:
        engine.score(prompt)
    finally:
        for h in hooks:
            h.remove()
    assert captured
    for name, x, y, refs in captured:
        with torch.no_grad():
            want = torch.cat([ref(x[None])[0] for ref in refs], dim=-1)
        assert rel(y, want) <= 1e-6, f"linear {name}: relative error {rel(y, want):.2e}"


def check_greedy(hf, prompt: list[int], tokens: list[int], tie: float) -> int:
    """batchrun's greedy `tokens` after `prompt` against the reference, teacher-forced: at each
    step the reference's own choice given batchrun's tokens so far, or (FP8 activations) a token
    whose reference logit is within `tie` of the top one. Returns the number of such ties."""
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + tokens[:-1]])).logits[0, len(prompt) - 1 :]
    ties = 0
    for step, (token, row) in enumerate(zip(tokens, logits)):
        best = int(row.argmax())
        if token != best:
            gap = float(row[best] - row[token])
            assert gap <= tie, f"step {step}: token {token}, the reference's {best} (gap {gap:.3f})"
            ties += 1
    return ties


@pytest.fixture(scope="module", params=[(f, k) for f in FP8_FORMATS for k in ("llama", "qwen2")])
def written(request, tmp_path_factory):
    fmt, kind = request.param
    path = tmp_path_factory.mktemp(f"{fmt}-{kind}")
    hf = write_quantized(fmt, kind, path)
    return fmt, kind, path, hf


def test_logits_match_the_dequantized_reference(written):
    fmt, _, path, hf = written
    engine = engine_for(path)
    assert engine.model_config.quantization.method == json.loads(
        (path / "config.json").read_text()
    )["quantization_config"]["quant_method"]
    prompts = random_prompts(3, seed=1, min_len=8, max_len=60)
    check_linears(engine, hf, prompts[0])
    for prompt in prompts:
        ours = engine.score(prompt)
        with torch.no_grad():
            ref = hf(torch.tensor([prompt])).logits[0]
        assert rel(ours, ref) <= logits_bound(fmt), f"{fmt}: relative error {rel(ours, ref):.2e}"
    engine.check_integrity()


def test_greedy_tokens_match_the_reference(written):
    fmt, _, path, hf = written
    engine = engine_for(path)
    prompts = random_prompts(3, seed=2)
    params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    reqs = [GenerateRequest(str(i), p, params) for i, p in enumerate(prompts)]
    results = {r.rid: r.output_ids for r in engine.generate(reqs)}
    tie = TIE if FP8_FORMATS[fmt].activations != "none" else 0.0
    ties = 0
    for i, prompt in enumerate(prompts):
        assert len(results[str(i)]) == NEW_TOKENS
        ties += check_greedy(hf, prompt, results[str(i)], tie)
    assert ties <= 1, f"{fmt}: {ties} near-ties in {len(prompts) * NEW_TOKENS} tokens"


def test_kv_cache_scales_are_kept_on_the_attention(tmp_path):
    write_quantized("modelopt-fp8", "llama", tmp_path)
    attn = engine_for(tmp_path).runner.model.layers[0].self_attn
    assert (attn.k_scale, attn.v_scale) == pytest.approx((0.0125, 0.025))
