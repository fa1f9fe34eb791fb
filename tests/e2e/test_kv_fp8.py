"""The FP8 KV cache (--kv-cache-dtype fp8_e4m3) on the CPU: the pool holds float8_e4m3fn and
sizes by one byte an element; a tiny Llama runs as the fp32 transformers model does with the
same quantization applied to its K (after rotary) and V; a ModelOpt checkpoint's k/v scales
quantize what is stored; the CLI option end to end; bad values refused.

Bound. K and V are quantized to e4m3 (1/16 relative steps): batchrun's fp32 K and the
reference's differ by ~1e-7 (another order of operations), which lands on the other side of a
rounding boundary for about one element in 10^6, so the logits match within fp32 rounding on
these seeds (1e-4 relative) and the greedy tokens are equal."""

from __future__ import annotations

import json
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from quant_checkpoints import write_quantized  # noqa: E402
from tiny_models import hf_greedy, make_tiny_model, random_prompts, save_byte_tokenizer  # noqa: E402

from batchrun.cli import main  # noqa: E402
from batchrun.config import EngineConfig  # noqa: E402
from batchrun.engine.engine import Engine  # noqa: E402
from batchrun.engine.kv_pool import KVPool  # noqa: E402
from batchrun.params import GenerateRequest, SamplingParams  # noqa: E402

FP8 = torch.float8_e4m3fn
NEW_TOKENS = 32


def fake_fp8(x: torch.Tensor, scale: float) -> torch.Tensor:
    """What an FP8 KV cache gives back for x: e4m3(clamp(x * (1 / scale))) * scale."""
    inv = float(torch.tensor(1.0 / scale, dtype=torch.float32))
    return (x.float() * inv).clamp(-448.0, 448.0).to(FP8).float().to(x.dtype) * scale


@contextmanager
def kv_fake_quant(hf, k_scale: float = 1.0, v_scale: float = 1.0):
    """The transformers Llama with its attention's K (after rotary) and V quantized as an FP8
    KV cache stores them."""
    from transformers.models.llama import modeling_llama

    rotate = modeling_llama.apply_rotary_pos_emb

    def rotate_and_quantize(q, k, cos, sin, *args, **kwargs):
        q, k = rotate(q, k, cos, sin, *args, **kwargs)
        return q, fake_fp8(k, k_scale)

    hooks = [
        layer.self_attn.v_proj.register_forward_hook(lambda m, a, out: fake_fp8(out, v_scale))
        for layer in hf.model.layers
    ]
    modeling_llama.apply_rotary_pos_emb = rotate_and_quantize
    try:
        yield hf
    finally:
        modeling_llama.apply_rotary_pos_emb = rotate
        for h in hooks:
            h.remove()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    hf = make_tiny_model("llama", path)
    return path, hf


def engine_for(path: Path, **kw) -> Engine:
    cfg = dict(model=str(path), device="cpu", dtype="float32", kv_budget=4096)
    return Engine(EngineConfig(**{**cfg, **kw}))


def test_bytes_per_token_is_one_byte_an_element():
    bf16 = KVPool.bytes_per_token(32, 8, 128, torch.bfloat16)
    assert bf16 == 2 * 32 * 8 * 128 * 2
    assert KVPool.bytes_per_token(32, 8, 128, FP8) * 2 == bf16


def test_the_same_memory_budget_holds_more_tokens(tiny, monkeypatch):
    """The pool sized from memory (no kv_budget): float8 slots are 1 byte, fp32's 4, bf16's 2."""
    from batchrun.engine import kv_sizing

    class Memory:
        available = 8 * 3 * 1024 * 1024  # the CPU pool takes an eighth: 3 MiB

    monkeypatch.setattr(kv_sizing.psutil, "virtual_memory", lambda: Memory)
    path, _ = tiny
    slots = {}
    for dtype, kv in (("float32", "auto"), ("float32", "fp8_e4m3"), ("bfloat16", "auto")):
        runner = engine_for(path, kv_budget=None, dtype=dtype, kv_cache_dtype=kv).runner
        slots[dtype, kv] = runner.num_slots
        assert runner.kv_pool.k_buffers[0].dtype == (FP8 if kv == "fp8_e4m3" else runner.dtype)
    fp32, fp8, bf16 = slots.values()
    per_token_fp32 = 2 * 3 * 2 * 16 * 4  # k and v, 3 layers, 2 KV heads, head dim 16
    assert fp32 == 3 * 1024 * 1024 // per_token_fp32 == 4096
    assert fp8 == 4 * fp32 and bf16 == 2 * fp32


def test_gpu_memory_utilization_gives_twice_the_bf16_tokens(monkeypatch):
    """On CUDA the pool takes gpu_memory_utilization of the free memory: in float8, twice the
    tokens of bf16 (kv_budget, in tokens, stays as given)."""
    from types import SimpleNamespace

    from batchrun.engine.kv_sizing import kv_slots

    free = 10 * 2**30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, 2 * free))

    model_cfg = SimpleNamespace(num_layers=4, head_dim=64, kv_layers=(0, 1, 2, 3))

    def slots(**config):
        # every layer in the one pool (no window pool): (its slots, 0)
        num_slots, num_window = kv_slots(
            EngineConfig(**config), model_cfg, ((2, 64),) * 4, (),
            device=torch.device("cuda"), dtype=torch.bfloat16, prefill_budget=4096,
        )  # fmt: skip
        assert num_window == 0
        return num_slots

    bf16 = slots(gpu_memory_utilization=0.5)
    assert bf16 == int(free * 0.5) // (2 * 4 * 2 * 64 * 2)
    assert slots(gpu_memory_utilization=0.5, kv_cache_dtype="fp8_e4m3") == 2 * bf16
    assert slots(kv_budget=1000, kv_cache_dtype="fp8_e4m3") == 1000


def test_logits_and_greedy_tokens_match_the_quantized_reference(tiny):
    path, hf = tiny
    engine = engine_for(path, kv_cache_dtype="fp8_e4m3")
    assert engine.runner.kv_pool.is_fp8
    prompts = random_prompts(3, seed=2)
    with torch.no_grad(), kv_fake_quant(hf):
        for prompt in random_prompts(3, seed=1, min_len=8, max_len=60):
            ours = engine.score(prompt)
            ref = hf(torch.tensor([prompt])).logits[0].float()
            rel = float((ours - ref).norm() / ref.norm())
            assert rel <= 1e-4, rel
        params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
        reqs = [GenerateRequest(str(i), p, params) for i, p in enumerate(prompts)]
        results = {r.rid: r.output_ids for r in engine.generate(reqs)}
        for i, prompt in enumerate(prompts):
            assert results[str(i)] == hf_greedy(hf, prompt, NEW_TOKENS), f"prompt {i}"
    engine.check_integrity()


def test_the_reference_without_quantization_differs(tiny):
    """The comparison above can fail: the same model with a compute-dtype cache gives other
    logits than the FP8 one, far beyond the bound."""
    path, _ = tiny
    prompt = random_prompts(1, seed=1, min_len=40, max_len=60)[0]
    fp8 = engine_for(path, kv_cache_dtype="fp8_e4m3").score(prompt)
    plain = engine_for(path).score(prompt)
    assert float((fp8 - plain).norm() / plain.norm()) > 1e-3


def test_checkpoint_scales_quantize_what_is_stored(tmp_path):
    """A ModelOpt checkpoint's k_scale 0.0125 / v_scale 0.025 (tests/quant_checkpoints.py)
    reach the pool: what is stored is e4m3(k / 0.0125), e4m3(v / 0.025)."""
    write_quantized("modelopt-fp8", "llama", tmp_path)
    engine = engine_for(tmp_path, kv_cache_dtype="fp8_e4m3")
    pool = engine.runner.kv_pool
    for layer in range(len(pool.k_buffers)):
        scale = pool.scales(layer)
        assert (scale.k, scale.v) == pytest.approx((0.0125, 0.025))
    stored = []
    store = pool.store

    def spy(layer_id, loc, k, v):
        store(layer_id, loc, k, v)
        stored.append((layer_id, loc.clone(), k.clone(), v.clone()))

    pool.store = spy
    engine.score(random_prompts(1, seed=4, min_len=20, max_len=21)[0])
    assert stored
    for layer_id, loc, k, v in stored:
        k_buf, v_buf = pool.buffers(layer_id)
        for buf, x, scale in ((k_buf, k, 0.0125), (v_buf, v, 0.025)):
            want = (x * float(torch.tensor(1 / scale))).clamp(-448, 448).to(FP8)
            assert torch.equal(buf[loc].view(torch.uint8), want.view(torch.uint8))
            # and not what a scale of 1.0 stores
            unscaled = x.clamp(-448, 448).to(FP8)
            assert not torch.equal(want.view(torch.uint8), unscaled.view(torch.uint8))


def test_compressed_tensors_kv_cache_scheme_scales_reach_the_pool(tmp_path):
    """llm-compressor's kv_cache_scheme: per-layer self_attn.k_scale / v_scale tensors, as it
    writes them (a one-element tensor) next to the weights; layer 2 without them runs at 1.0."""
    from safetensors.torch import load_file, save_file

    write_quantized("ct-fp8-tensor", "llama", tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["quantization_config"]["kv_cache_scheme"] = {
        "num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True,
    }  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    shard = "model-00002-of-00002.safetensors"
    tensors = load_file(str(tmp_path / shard))
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    for layer, (k, v) in enumerate([(0.5, 0.25), (2.0, 0.125)]):
        for kind, value in (("k_scale", k), ("v_scale", v)):
            name = f"model.layers.{layer}.self_attn.{kind}"
            tensors[name] = torch.tensor([value])
            index["weight_map"][name] = shard
    save_file(tensors, str(tmp_path / shard))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    engine = engine_for(tmp_path, kv_cache_dtype="fp8_e4m3")
    pool = engine.runner.kv_pool
    got = [(pool.scales(i).k, pool.scales(i).v) for i in range(3)]
    assert got == [(0.5, 0.25), (2.0, 0.125), (1.0, 1.0)]
    engine.score(random_prompts(1, seed=5)[0])


def test_checkpoint_scales_without_the_option_run_a_plain_cache(tmp_path):
    write_quantized("modelopt-fp8", "llama", tmp_path)
    pool = engine_for(tmp_path).runner.kv_pool
    assert not pool.is_fp8 and pool.k_buffers[0].dtype == torch.float32


def test_tp2_gives_tp1_tokens(tmp_path):
    """--tp 2 (gloo): each rank stores its KV heads with the layer's scales (a ModelOpt
    checkpoint's) and gives TP=1's greedy tokens."""
    from batchrun.engine_process.tp_launcher import start_tp_engine

    write_quantized("modelopt-fp8", "llama", tmp_path)
    cfg = EngineConfig(model=str(tmp_path), device="cpu", dtype="float32", kv_budget=4096,
                       kv_cache_dtype="fp8_e4m3")  # fmt: skip
    params = SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True)
    prompts = random_prompts(4, seed=6)
    reqs = [GenerateRequest(str(i), p, params) for i, p in enumerate(prompts)]
    ref = {r.rid: r.output_ids for r in Engine(cfg).generate(reqs)}
    with start_tp_engine(cfg, tp_size=2, timeout_s=120) as engine:
        pool = engine.runner.kv_pool
        assert pool.is_fp8 and pool.k_buffers[0].shape[1] == 1
        assert (pool.scales(0).k, pool.scales(0).v) == pytest.approx((0.0125, 0.025))
        assert {r.rid: r.output_ids for r in engine.generate(reqs)} == ref


def test_bad_value_refused():
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, fp8_e4m3; got 'fp8'"):
        EngineConfig(kv_cache_dtype="fp8").validate()


def test_gpu_below_sm89_refused(monkeypatch):
    """On CUDA the float8 conversions need sm_89+: an older GPU is refused at start-up, saying
    what to use."""
    from tiny_models import llama3_model_config

    from batchrun.engine import kernel_choice

    monkeypatch.setattr(kernel_choice, "supports_fp8_matmul", lambda device: False)
    config = EngineConfig(kv_cache_dtype="fp8_e4m3", chunked_prefill_size=64)
    with pytest.raises(ValueError, match="needs an sm_89\\+ GPU.*use kv_cache_dtype 'auto'"):
        kernel_choice.resolve_kernels(config, llama3_model_config("tiny"), torch.device("cuda"))


def test_bad_checkpoint_scale_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    from batchrun.errors import WeightLoadError

    write_quantized("modelopt-fp8", "llama", tmp_path)
    for f in tmp_path.glob("*.safetensors"):
        tensors = load_file(str(f))
        name = "model.layers.1.self_attn.v_proj.v_scale"
        if name in tensors:
            tensors[name] = torch.tensor(0.0)
            save_file(tensors, str(f))
    with pytest.raises(WeightLoadError, match=r"model.layers.1.self_attn's v_scale is 0.0"):
        engine_for(tmp_path, kv_cache_dtype="fp8_e4m3")
    engine_for(tmp_path)  # without the FP8 cache the scale is not read


# -- the CLI -------------------------------------------------------------------------------------


def submit(model: Path, tmp_path: Path, *extra: str):
    data = tmp_path / "in.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"row {i}"}) + "\n" for i in range(3)))
    args = ["submit", str(data), "--out", str(tmp_path / "out"), "--model", str(model)]
    args += ["--device", "cpu", "--max-tokens", "4", "--quiet", "--no-chat-template", *extra]
    return CliRunner().invoke(main, args)


def test_cli_runs_with_an_fp8_kv_cache_and_records_it(tiny, tmp_path):
    path, _ = tiny
    save_byte_tokenizer(path)
    result = submit(path, tmp_path, "--kv-cache-dtype", "fp8_e4m3", "--in-process")
    assert result.exit_code == 0, result.output
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["status"] == "complete"
    assert manifest["config"]["engine"]["kv_cache_dtype"] == "fp8_e4m3"
    assert manifest["counts"]["rows_ok"] == 3


def test_cli_refuses_a_bad_value(tiny, tmp_path):
    result = submit(tiny[0], tmp_path, "--kv-cache-dtype", "int8")
    assert result.exit_code == 2
    assert "'int8' is not one of 'auto', 'fp8_e4m3'" in result.output
