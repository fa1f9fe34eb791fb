"""INT4 checkpoints end to end on the CPU: a tiny Llama / Qwen2 (biases) quantized by the test's
reference quantizer and saved in each format's exact layout (AWQ GEMM, GPTQ v1 / v2 with and
without act-order, compressed-tensors pack-quantized), sharded; batchrun's logits equal those of
the fp32 model built from the dequantized weights, greedy tokens are equal for 32 tokens, TP=2
(gloo) gives TP=1's tokens, dummy weights run in every format, and the compressed-tensors
checkpoint gives what transformers (with compressed-tensors installed) makes of it."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from quant_checkpoints_int4 import (  # noqa: E402
    int4_quantization_config,
    reference_int4_model,
    write_int4_checkpoint,
)
from tiny_models import COMMON, hf_greedy, make_hf_config, random_prompts  # noqa: E402

from batchrun.config import EngineConfig  # noqa: E402
from batchrun.engine.engine import Engine  # noqa: E402
from batchrun.engine_process.tp_launcher import start_tp_engine  # noqa: E402
from batchrun.params import GenerateRequest, SamplingParams  # noqa: E402

NEW_TOKENS = 32
# weight-only formats: batchrun runs the dequantized weights in fp32, as the reference does;
# only the order of the sums differs
MAX_REL_ERROR = 1e-5
# hidden 128 / intermediate 256: room for a group size of 128
WIDE = {"hidden_size": 128, "intermediate_size": 256}

# name -> (format, model kind, dims, write_int4_checkpoint's settings)
CASES = {
    "awq": ("awq", "llama", {}, dict(group_size=32, symmetric=False)),
    "awq-qwen2-g128": ("awq", "qwen2", WIDE, dict(group_size=128, symmetric=False)),
    "awq-not-converted": (
        "awq",
        "llama",
        {},
        dict(group_size=32, symmetric=False, skip=("mlp.down_proj", "layers.1.self_attn.")),
    ),
    "gptq": ("gptq", "llama", {}, dict(group_size=32, symmetric=True)),
    "gptq-qwen2-actorder": (
        "gptq",
        "qwen2",
        {},
        dict(group_size=32, act_order=True, symmetric=False),
    ),
    "gptq-v2-g128": ("gptq", "llama", WIDE, dict(group_size=128, symmetric=False, gptq_v2=True)),
    "gptq-per-row-actorder": ("gptq", "qwen2", {}, dict(group_size=-1, act_order=True)),
    "gptq-dynamic-skip": ("gptq", "llama", {}, dict(group_size=32, skip=("self_attn.o_proj",))),
    "ct": ("pack-quantized", "llama", {}, dict(group_size=32)),
    "ct-qwen2-asym": ("pack-quantized", "qwen2", {}, dict(group_size=32, symmetric=False)),
    "ct-channel-g128": ("pack-quantized", "qwen2", WIDE, dict(group_size=-1, symmetric=False)),
    "ct-actorder-g128": ("pack-quantized", "llama", WIDE, dict(group_size=128, act_order=True)),
    "ct-ignore": ("pack-quantized", "qwen2", {}, dict(group_size=32, skip=("layers.0.mlp.",))),
}
# one case per format in the default tier; the rest, and every TP=2 run, in CI's slow tier
FAST_CASES = ("awq", "gptq-qwen2-actorder", "ct-qwen2-asym")
# the cases that also run under tensor parallelism (each split needs in / 2 % group == 0)
TP_CASES = ["awq", "gptq-qwen2-actorder", "ct-qwen2-asym"]
slow = pytest.mark.slow  # CI's slow tier (BATCHRUN_SLOW_TESTS=1)


def make_hf_model(kind: str, dims: dict, seed: int = 0):
    from transformers import AutoModelForCausalLM

    cfg = make_hf_config(kind)
    for key, value in dims.items():
        setattr(cfg, key, value)
    cfg.head_dim = cfg.hidden_size // cfg.num_attention_heads
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()


def write_case(name: str, path: Path):
    """The checkpoint of CASES[name] at `path`; returns the reference model (fp32)."""
    fmt, kind, dims, settings = CASES[name]
    hf = make_hf_model(kind, dims)
    return reference_int4_model(hf, write_int4_checkpoint(fmt, hf, path, **settings))


def engine_config(model_dir: Path, **kw) -> EngineConfig:
    return EngineConfig(
        model=str(model_dir),
        device="cpu",
        dtype="float32",
        kv_budget=4096,
        chunked_prefill_size=64,
        **kw,
    )


def greedy_requests(num: int = 3, seed: int = 2) -> list[GenerateRequest]:
    params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    return [GenerateRequest(str(i), p, params) for i, p in enumerate(random_prompts(num, seed))]


def greedy(engine, requests: list[GenerateRequest]) -> dict[str, list[int]]:
    out = {}
    for res in engine.generate(requests):
        assert res.finish_reason == "length" and not res.error, res
        out[res.rid] = res.output_ids
    return out


def relative_error(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return float((ours.float() - ref.float()).norm() / ref.float().norm())


@pytest.fixture(
    scope="module",
    params=[pytest.param(n, marks=() if n in FAST_CASES else slow) for n in CASES],
)
def case(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    reference = write_case(request.param, path)
    return request.param, path, reference


def test_logits_and_greedy_tokens_match_the_dequantized_model(case):
    name, path, reference = case
    raw = json.loads((path / "config.json").read_text())
    assert raw["quantization_config"]["quant_method"] in ("awq", "gptq", "compressed-tensors")
    names = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    for part in CASES[name][3].get("skip", ()):  # plain weights, the config says so
        assert any(part in n and n.endswith(".weight") for n in names), part
        assert not any(part in n and n.endswith(("qweight", "weight_packed")) for n in names)
    engine = Engine(engine_config(path))
    for prompt in random_prompts(3, seed=1, min_len=8, max_len=60):
        ours = engine.score(prompt)
        with torch.no_grad():
            ref = reference(torch.tensor([prompt])).logits[0]
        rel = relative_error(ours, ref)
        assert rel <= MAX_REL_ERROR, f"{name}: relative error {rel:.2e}"
    requests = greedy_requests()
    got = greedy(engine, requests)
    for req in requests:
        assert got[req.rid] == hf_greedy(reference, req.input_ids, NEW_TOKENS), (name, req.rid)
    engine.check_integrity()


@slow
@pytest.mark.parametrize("name", TP_CASES)
def test_tp2_matches_tp1(name, tmp_path):
    write_case(name, tmp_path)
    requests = greedy_requests(4, seed=3)
    ref = greedy(Engine(engine_config(tmp_path)), requests)
    with start_tp_engine(engine_config(tmp_path), tp_size=2, timeout_s=120) as engine:
        assert greedy(engine, requests) == ref


@slow
def test_group_that_tensor_parallelism_would_split_is_refused(tmp_path):
    """down_proj's 384 input columns in groups of 128 cannot split over 2 ranks (192 each): a
    clear error naming the linear and the group size, before any row runs."""
    hf = make_hf_model("llama", {**WIDE, "intermediate_size": 384})
    write_int4_checkpoint("awq", hf, tmp_path, group_size=128, symmetric=False)
    with pytest.raises(Exception) as e:
        with start_tp_engine(engine_config(tmp_path), tp_size=2, timeout_s=120):
            pass
    msg = str(e.value)
    assert "mlp.down_proj" in msg and "multiples of 128" in msg, msg


def dummy_dir(fmt: str, path: Path) -> Path:
    """config.json of the tiny Llama with a quantization_config in format `fmt`, no weights."""
    config = {**make_hf_config("llama").to_dict(), **COMMON}
    config["quantization_config"] = int4_quantization_config(fmt, 32, False)
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.mark.parametrize("fmt", ["awq", "gptq", "pack-quantized"])
def test_dummy_weights(fmt, tmp_path):
    """--load-format dummy with a quantization_config: random INT4 weights in the scheme's
    shape run."""
    engine = Engine(engine_config(dummy_dir(fmt, tmp_path), load_format="dummy"))
    got = greedy(engine, greedy_requests(2, seed=4))
    assert all(len(ids) == NEW_TOKENS for ids in got.values())


@slow
def test_dummy_weights_tp2_match_tp1(tmp_path):
    """Dummy INT4 weights are drawn full size and sliced: TP=2 runs TP=1's weights."""
    config = engine_config(dummy_dir("gptq", tmp_path), load_format="dummy")
    requests = greedy_requests(2, seed=4)
    got = greedy(Engine(config), requests)
    with start_tp_engine(config, tp_size=2, timeout_s=120) as engine:
        assert greedy(engine, requests) == got


def test_compressed_tensors_against_transformers(tmp_path):
    """transformers with compressed-tensors 0.20.1 decompresses the checkpoint to the same
    weights: the same logits and greedy tokens. (Symmetric: compressed-tensors 0.20.1 builds a
    model for an asymmetric pack-quantized checkpoint with unpacked zero-point shapes and
    refuses its own packed weight_zero_point; test_quant_int4_decode.py checks the asymmetric
    layout against its compressor and decompressor.)"""
    pytest.importorskip("compressed_tensors")
    from transformers import AutoModelForCausalLM

    hf = make_hf_model("qwen2", {})
    write_int4_checkpoint("pack-quantized", hf, tmp_path, group_size=32, symmetric=True)
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    engine = Engine(engine_config(tmp_path))
    for prompt in random_prompts(2, seed=5, min_len=8, max_len=60):
        with torch.no_grad():
            ref = theirs(torch.tensor([prompt])).logits[0]
        rel = relative_error(engine.score(prompt), ref)
        assert rel <= MAX_REL_ERROR, f"relative error {rel:.2e}"
    requests = greedy_requests(2, seed=6)
    got = greedy(engine, requests)
    for req in requests:
        assert got[req.rid] == hf_greedy(theirs, req.input_ids, NEW_TOKENS), req.rid
