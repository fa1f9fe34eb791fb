"""Quantized checkpoints of the hybrids (Qwen3.5 dense and MoE, Qwen3-Next) and of Gemma 4 (dense,
MoE, the E-model) on the CPU, in the compressed-tensors layouts batchrun reads: FP8 per channel
with dynamic per-token activations (FP8_DYNAMIC), FP8 in 128x128 blocks (FP8_BLOCK, on shapes
whose fused parts fall on blocks) and INT4 W4A16 (pack-quantized), written by
tests/quant_model_checkpoints.py over the tiny models' own checkpoints. The linears the `ignore`
list names (the linear layers' small in_proj_b / in_proj_a / in_proj_ba, or all of linear_attn;
routers, the shared expert's gate, Gemma 4's per-layer input projections) stay plain; the rest
load quantized. batchrun's logits equal the fp32 transformers model holding the dequantized
weights, with the format's activation fake-quantization on the quantized linears' inputs, and its
greedy tokens equal the reference's. (Block FP8 runs on Gemma 4 dense, not MoE: on the tiny MoE an
FP8 rounding step now and then routes a token to another expert, past any useful bound; the
experts and routers are plain in every format, so the MoE runs W4A16 and FP8 per channel.)

Bounds as tests/e2e/test_quant_fp8.py's: 1e-5 relative on the logits for W4A16; where the
activations are quantized per token at run time a ~1e-6 difference before a quantization now and
then rounds a value to the neighbouring FP8 step, so the logits' bound is 5e-2 and a greedy token
may take the reference's runner-up at a near-tie (at most two of the run's 48 tokens)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from gemma4_models import make_gemma4  # noqa: E402
from hybrid_models import make_hybrid_model  # noqa: E402
from quant_model_checkpoints import FORMATS, ignored, quantize_saved  # noqa: E402
from test_quant_fp8 import EXACT, TIE, check_greedy, engine_for, rel  # noqa: E402
from tiny_models import random_prompts  # noqa: E402

from batchrun.errors import ModelConfigError  # noqa: E402
from batchrun.params import GenerateRequest, SamplingParams  # noqa: E402

DYNAMIC_BOUND = 5e-2
NEW_TOKENS = 16
# the linears of the shipped checkpoints' ignore lists
HYBRID_IGNORE = ["lm_head", r"re:.*in_proj_(a|b|ba)$", r"re:.*mlp\.gate$",
                 r"re:.*shared_expert_gate$"]  # fmt: skip
LINEAR_ATTN_IGNORE = ["lm_head", r"re:.*linear_attn\..*", r"re:.*mlp\.gate$",
                      r"re:.*shared_expert_gate$"]  # fmt: skip
# a multimodal checkpoint's ignore list names its modules as stored (model.language_model.*)
MULTIMODAL_IGNORE = [
    "lm_head",
    r"re:.*visual\..*",
    r"re:.*mlp\.gate$",
    r"re:.*shared_expert_gate$",
] + [f"model.language_model.layers.{i}.linear_attn.in_proj_{x}" for i in (0, 2, 3) for x in "ab"]
# the Qwen "-FP8" form (quant_method fp8): each linear layer's small projections by full name
QWEN_FP8_IGNORE = ["lm_head"] + [
    f"model.layers.{i}.linear_attn.in_proj_{x}" for i in (0, 2, 3) for x in "ab"
]
GEMMA4_IGNORE = ["lm_head", r"re:.*router\..*", r"re:.*per_layer_.*"]
# INT4 groups of 32 columns: the shared expert 64 wide (not 48)
HYBRID_SHAPES = dict(shared_expert_intermediate_size=64)
# every fused part a multiple of the 128-row blocks: gated q 2 x 64 x 2, k / v 2 x 64, MLP 128
HYBRID_BLOCK = dict(head_dim=64, num_attention_heads=2, intermediate_size=128,
                    shared_expert_intermediate_size=128)  # fmt: skip
# q, k and v 4 heads of 32 in every layer, MLP 128 (wider heads make the tiny model, whose
# attention is unscaled, amplify an FP8 rounding step past any tie bound)
GEMMA4_BLOCK = dict(head_dim=32, global_head_dim=32, num_key_value_heads=4,
                    num_global_key_value_heads=4, intermediate_size=128)  # fmt: skip

# (model kind, format, ignore list); the default tier holds one case a model and format family
CASES = [
    pytest.param(("qwen3_5_text", "ct-fp8-channel", HYBRID_IGNORE), id="qwen3_5-fp8"),
    pytest.param(("qwen3_5_text", "ct-fp8-block", HYBRID_IGNORE), id="qwen3_5-fp8-block"),
    pytest.param(
        ("qwen3_5_text", "pack-quantized", HYBRID_IGNORE),
        id="qwen3_5-w4a16",
        marks=pytest.mark.slow,
    ),
    pytest.param(("qwen3_5_moe_text", "pack-quantized", HYBRID_IGNORE), id="qwen3_5_moe-w4a16"),
    pytest.param(
        ("qwen3_5_moe_text", "ct-fp8-channel", HYBRID_IGNORE),
        id="qwen3_5_moe-fp8",
        marks=pytest.mark.slow,
    ),
    pytest.param(("qwen3_5_moe", "ct-fp8-channel", MULTIMODAL_IGNORE), id="qwen3_5_moe-mm-fp8"),
    pytest.param(("qwen3_next", "ct-fp8-channel", HYBRID_IGNORE), id="qwen3_next-fp8"),
    pytest.param(("qwen3_5_text", "fp8-block", QWEN_FP8_IGNORE), id="qwen3_5-qwen-fp8-block"),
    pytest.param(
        ("qwen3_next", "pack-quantized", LINEAR_ATTN_IGNORE),
        id="qwen3_next-w4a16-plain-linear-attn",
    ),
    pytest.param(("gemma4-dense", "ct-fp8-channel", GEMMA4_IGNORE), id="gemma4-fp8"),
    pytest.param(("gemma4-dense", "pack-quantized", GEMMA4_IGNORE), id="gemma4-w4a16"),
    pytest.param(("gemma4-dense", "ct-fp8-block", GEMMA4_IGNORE), id="gemma4-fp8-block"),
    pytest.param(("gemma4-moe", "pack-quantized", GEMMA4_IGNORE), id="gemma4_moe-w4a16"),
    pytest.param(
        ("gemma4-moe", "ct-fp8-channel", GEMMA4_IGNORE), id="gemma4_moe-fp8", marks=pytest.mark.slow
    ),
    pytest.param(
        ("gemma4-e-model", "ct-fp8-channel", GEMMA4_IGNORE),
        id="gemma4_e-fp8",
        marks=pytest.mark.slow,
    ),
]


def make_model(kind: str, fmt: str, path: Path):
    block = fmt.endswith("fp8-block")
    if kind.startswith("gemma4-"):
        return make_gemma4(kind.removeprefix("gemma4-"), path, **(GEMMA4_BLOCK if block else {}))
    return make_hybrid_model(kind, path, **(HYBRID_BLOCK if block else HYBRID_SHAPES))


@pytest.fixture(scope="module", params=CASES)
def written(request, tmp_path_factory):
    kind, fmt, ignore = request.param
    path = tmp_path_factory.mktemp(f"{kind}-{fmt}")
    hf = quantize_saved(make_model(kind, fmt, path), fmt, path, ignore)
    return fmt, ignore, path, hf, engine_for(path)


def our_linears(model, multimodal: bool):
    """(checkpoint linear as stored, our module holding it) of every decoder layer's quantizable
    linear."""
    from batchrun.models.quant_loader import layer_linears

    prefix = "model.language_model" if multimodal else "model"
    for i, layer in enumerate(model.layers):
        for ours, parts, _ in layer_linears(model.config, i):
            for part, _ in parts:
                yield f"{prefix}.layers.{i}.{part}", layer.get_submodule(ours)


def test_ignored_linears_stay_plain_and_the_rest_load_quantized(written):
    fmt, ignore, _, hf, engine = written
    multimodal = engine.model_config.architecture.endswith("ConditionalGeneration")
    seen = 0
    for name, module in our_linears(engine.runner.model, multimodal):
        assert (module.quant is None) == ignored(name, ignore), name
        if module.quant is not None:
            assert name in hf.quantized
            seen += 1
    assert seen


def test_logits_match_the_dequantized_reference(written):
    fmt, _, _, hf, engine = written
    bound = DYNAMIC_BOUND if FORMATS[fmt] == "dynamic" else EXACT
    for prompt in random_prompts(3, seed=1, min_len=8, max_len=60):
        ours = engine.score(prompt)
        with torch.no_grad():
            ref = hf(torch.tensor([prompt])).logits[0]
        assert rel(ours, ref) <= bound, f"{fmt}: relative error {rel(ours, ref):.2e}"
    engine.check_integrity()


def test_greedy_tokens_match_the_reference(written):
    fmt, _, _, hf, engine = written
    prompts = random_prompts(3, seed=2, max_len=50)
    params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    reqs = [GenerateRequest(str(i), p, params) for i, p in enumerate(prompts)]
    results = {r.rid: r.output_ids for r in engine.generate(reqs)}
    tie = TIE if FORMATS[fmt] == "dynamic" else 0.0
    ties = sum(check_greedy(hf, p, results[str(i)], tie) for i, p in enumerate(prompts))
    assert ties <= 2, f"{fmt}: {ties} near-ties in {len(prompts) * NEW_TOKENS} tokens"


def test_an_untested_format_is_refused_by_name(tmp_path):
    """AWQ (like GPTQ, ModelOpt and static FP8) is not among the hybrids' tested formats."""
    import json

    make_hybrid_model("qwen3_5_text", tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    raw["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": 32,
                                  "zero_point": True, "version": "gemm"}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(
        ModelConfigError, match="AWQ GEMM.* is not supported; supported for Qwen3.5"
    ):
        engine_for(tmp_path)


def test_gemma4_with_a_quantized_router_is_refused(tmp_path):
    hf = make_gemma4("moe", tmp_path)
    quantize_saved(hf, "ct-fp8-channel", tmp_path, ["lm_head"])
    with pytest.raises(ModelConfigError, match=r"quantizes model\.layers\.0\.router\.proj"):
        engine_for(tmp_path)
