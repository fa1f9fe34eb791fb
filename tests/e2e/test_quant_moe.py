"""Quantized mixtures of experts end to end on the CPU: a tiny Qwen3-MoE written by
tests/quant_moe_checkpoints.py in each format's on-disk layout (block FP8 as Qwen3-30B-A3B-FP8
ships it; compressed-tensors FP8 per channel, weight-only; GPTQ and AWQ INT4) runs in batchrun as
the fp32 transformers model holding the dequantized weights computes it, with the format's
activation fake-quantization on its quantized linears that are not experts.

Bounds as tests/e2e/test_quant_fp8.py's: 1e-5 relative on the logits for weight-only formats;
3e-2 where the attention's activations are quantized per token at run time (a ~1e-6 difference
before a quantization now and then rounds a value to the neighbouring FP8 step), and greedy
tokens equal but for a near-tie there. `--tp 2` gives TP=1's tokens; `plan` on the real
Qwen3-30B-A3B-FP8 config.json reports its format and counts."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from moe_configs import QWEN3_30B_A3B_FP8  # noqa: E402
from quant_moe_checkpoints import FORMATS, write_quantized_moe  # noqa: E402
from test_quant_fp8 import (  # noqa: E402
    DYNAMIC_BOUND,
    EXACT,
    NEW_TOKENS,
    TIE,
    check_greedy,
    engine_for,
    greedy,
    rel,
    tp_config,
)
from tiny_models import random_prompts, save_byte_tokenizer  # noqa: E402

from batchrun.cli.main import main  # noqa: E402
from batchrun.engine.engine import Engine  # noqa: E402
from batchrun.params import GenerateRequest, SamplingParams  # noqa: E402

# block FP8 (the headline format) and GPTQ in the default tier, the others in the slow one;
# Qwen2-MoE (a shared expert, quantized as a dense MLP; q/k/v biases) weight-only
CASES = [
    pytest.param(
        (f, "qwen3_moe"), marks=[] if f in ("fp8-block", "gptq") else [pytest.mark.slow], id=f
    )
    for f in FORMATS
] + [pytest.param(("ct-fp8-channel", "qwen2_moe"), marks=[pytest.mark.slow], id="qwen2-moe")]


@pytest.fixture(scope="module", params=CASES)
def written(request, tmp_path_factory):
    fmt, kind = request.param
    path = tmp_path_factory.mktemp(f"{fmt}-{kind}")
    return fmt, path, write_quantized_moe(fmt, path, kind=kind)


def test_logits_match_the_dequantized_reference(written):
    fmt, path, hf = written
    engine = engine_for(path)
    model = engine.runner.model
    for i in engine.model_config.moe.layers:
        mlp = model.layers[i].mlp
        assert torch.equal(mlp.w13, hf.dequantized[f"model.layers.{i}.mlp.experts.gate_up_proj"])
        assert model.layers[i].self_attn.qkv_proj.quant is not None
        if mlp.shared_expert is not None:
            assert mlp.shared_expert.gate_up_proj.quant is not None
    bound = DYNAMIC_BOUND if FORMATS[fmt] == "dynamic" else EXACT
    for prompt in random_prompts(3, seed=1, min_len=8, max_len=60):
        ours = engine.score(prompt)
        with torch.no_grad():
            ref = hf(torch.tensor([prompt])).logits[0]
        assert rel(ours, ref) <= bound, f"{fmt}: relative error {rel(ours, ref):.2e}"
    engine.check_integrity()


def test_greedy_tokens_match_the_reference(written):
    fmt, path, hf = written
    engine = engine_for(path)
    prompts = random_prompts(3, seed=2)
    params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    reqs = [GenerateRequest(str(i), p, params) for i, p in enumerate(prompts)]
    results = {r.rid: r.output_ids for r in engine.generate(reqs)}
    tie = TIE if FORMATS[fmt] == "dynamic" else 0.0
    ties = 0
    for i, prompt in enumerate(prompts):
        assert len(results[str(i)]) == NEW_TOKENS
        ties += check_greedy(hf, prompt, results[str(i)], tie)
    assert ties <= 1, f"{fmt}: {ties} near-ties in {len(prompts) * NEW_TOKENS} tokens"


def test_dummy_weights(tmp_path):
    """--load-format dummy with the block-FP8 quantization_config (only config.json read):
    seeded, the same run twice gives the same tokens."""
    write_quantized_moe("fp8-block", tmp_path)
    for f in tmp_path.glob("*.safetensors*"):
        f.unlink()
    params = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    outs = []
    for _ in range(2):
        engine = engine_for(tmp_path, load_format="dummy")
        assert engine.runner.model.layers[0].self_attn.qkv_proj.quant is not None
        outs.append(
            [r.output_ids for r in engine.generate([GenerateRequest("a", [5, 6, 7], params)])]
        )
    assert outs[0] == outs[1] and len(outs[0][0]) == 8


@pytest.mark.slow
@pytest.mark.parametrize("kw", [{}, {"load_format": "dummy"}], ids=["checkpoint", "dummy"])
def test_tp2_gives_tp1_tokens(kw, tmp_path):
    """TP=2 over gloo: each rank's experts a slice (96 rows, half a 128-block) of the
    dequantized ones, the attention's FP8 blocks split between the ranks."""
    from batchrun.engine_process.tp_launcher import start_tp_engine

    write_quantized_moe("fp8-block", tmp_path)
    ref = greedy(Engine(tp_config(tmp_path, **kw)))
    with start_tp_engine(tp_config(tmp_path, **kw), tp_size=2, timeout_s=120) as engine:
        assert greedy(engine) == ref


def test_plan_reports_qwen3_30b_a3b_fp8(tmp_path):
    """`plan` reads config.json and the tokenizer only: the real config.json resolves."""
    model = tmp_path / "Qwen3-30B-A3B-FP8"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(QWEN3_30B_A3B_FP8))
    save_byte_tokenizer(model)
    data = tmp_path / "in.jsonl"
    data.write_text(json.dumps({"id": "a", "prompt": "Hello"}) + "\n")
    r = CliRunner().invoke(main, ["plan", str(data), "--model", str(model)])
    assert r.exit_code == 0, r.output
    lines = {x.split()[0]: x for x in r.output.splitlines() if x.strip()}
    assert lines["weights"].startswith(
        "weights      fp8 (fp8, 128x128-block weights, dynamic per-token activations in groups "
        "of 128); the experts dequantized at load (run in the model's dtype)"
    ), lines["weights"]
    assert lines["parameters"] == (
        "parameters   30.53 B parameters, 3.35 B active a token (8 of 128 experts a token in "
        "48 of 48 layers)"
    )
