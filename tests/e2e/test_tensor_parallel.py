"""Tensor parallel on the CPU: TP=2 over gloo (two processes) gives TP=1's greedy tokens and,
within fp32 noise, its logits, for each way a model can split: KV heads divided between ranks
(llama), one KV head replicated on both with tied embeddings and a vocabulary that does not
divide by 2 (mqa_tied: padding on rank 1), qkv bias (qwen2), q/k norm (qwen3), Phi-3's fused
qkv_proj / gate_up_proj checkpoint tensors (each rank reads its q, k, v rows and its gate and up
rows of one tensor), the mixtures of experts (every expert split along its width, the router
replicated; qwen2_moe's shared expert summed into the experts' one all-reduce), Gemma 3 (its
four norms a layer and sliding layers replicated on each rank's heads), and gpt-oss (attention
sinks split by heads, the experts' gate / up biases by width, their down bias added by one
rank)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import msgspec
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tiny_models import COMMON, make_tiny_model, random_prompts  # noqa: E402

from batchrun.config import EngineConfig  # noqa: E402
from batchrun.engine.engine import Engine  # noqa: E402
from batchrun.engine_process.lockstep import FollowerDiedError  # noqa: E402
from batchrun.engine_process.tp_launcher import start_tp_engine  # noqa: E402
from batchrun.models.config import ModelConfigError  # noqa: E402
from batchrun.params import GenerateRequest, SamplingParams  # noqa: E402

# fp32 on the CPU: the split matmuls only reorder sums
LOGITS_ATOL = 1e-4
NEW = 8


def make_model(kind: str, path: Path) -> str:
    """tiny_models kinds, plus `mqa_tied`: one KV head, tied embeddings, an odd vocab."""
    if kind != "mqa_tied":
        make_tiny_model(kind, path)
        return str(path)
    import transformers
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        **{**COMMON, "num_key_value_heads": 1, "vocab_size": 259, "tie_word_embeddings": True}
    )
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval().save_pretrained(path)
    return str(path)


def config(model_dir: str, **kw) -> EngineConfig:
    return EngineConfig(
        model=model_dir,
        device="cpu",
        dtype="float32",
        kv_budget=4096,
        chunked_prefill_size=64,
        **kw,
    )


def workload() -> list[GenerateRequest]:
    """Prompts with and without a shared prefix (radix hits, chunked prefill of the long ones)."""
    params = SamplingParams(max_new_tokens=NEW, temperature=0.0, ignore_eos=True)
    prompts = random_prompts(6, seed=3, max_len=90)
    prompts += [prompts[0][:30] + p[:10] for p in prompts[1:4]]
    return [GenerateRequest(f"r{i}", p, params) for i, p in enumerate(prompts)]


def greedy(engine) -> dict[str, list[int]]:
    out = {}
    for res in engine.generate(workload()):
        assert res.finish_reason == "length" and not res.error, res
        out[res.rid] = res.output_ids
    return out


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> str:
    return make_model("llama", tmp_path_factory.mktemp("llama"))


@pytest.mark.parametrize(
    "kind",
    [
        "llama",
        "mqa_tied",
        "qwen2",
        "qwen3",
        "llama-bias",
        "mistral-nemo",
        "phi3",
        "qwen3_moe",
        "qwen2_moe",
        "mixtral",
        "gemma3",
        "gpt_oss",
    ],
)
def test_tp2_matches_tp1(kind, tmp_path, llama_dir):
    model_dir = llama_dir if kind == "llama" else make_model(kind, tmp_path / kind)
    if kind == "mqa_tied":
        raw = json.loads((tmp_path / kind / "config.json").read_text())
        assert raw["num_key_value_heads"] == 1 and raw["tie_word_embeddings"]
    ref_engine = Engine(config(model_dir))
    ref = greedy(ref_engine)
    probe = workload()[0].input_ids
    ref_logits = ref_engine.score(probe)
    with start_tp_engine(config(model_dir), tp_size=2, timeout_s=120, check_sync=True) as engine:
        assert engine.tp_size == 2
        # the KV pool holds only this rank's KV heads: 2 split in two, or mqa's one replicated
        # (a sliding layer's in the window pool, engine/window_pool.py)
        runner = engine.runner
        pools = [runner.kv_pool] + ([runner.window_pool] if runner.window is not None else [])
        assert sum(p.k_buffers[0].shape[1] for p in pools) == 1
        assert greedy(engine) == ref
        # rank 0's counters are the job's: the same counts as one engine's (but for time)
        timeless = msgspec.structs.replace(engine.counters, forward_time=0.0)
        assert timeless == msgspec.structs.replace(ref_engine.counters, forward_time=0.0)
        logits = engine.score(probe)
        engine.check_integrity()
    assert logits.shape == ref_logits.shape
    torch.testing.assert_close(logits, ref_logits, atol=LOGITS_ATOL, rtol=0)


def test_drop_waiting_replays_and_a_dead_follower_fails_the_next_step(llama_dir):
    """A graceful stop (drop_waiting mid-run) leaves every rank with the same requests; then a
    follower that dies makes rank 0 raise, not hang."""

    def run(engine) -> dict[str, list[int]]:
        for req in workload():
            engine.add_request(req)
        out = {r.rid: r.output_ids for r in engine.step()}
        engine.drop_waiting()
        engine.add_request(GenerateRequest("late", [5, 6, 7, 8], workload()[0].params))
        while engine.has_work:
            out.update({r.rid: r.output_ids for r in engine.step()})
        return out

    ref = run(Engine(config(llama_dir, max_running=3)))
    assert "late" in ref and len(ref) < len(workload())
    engine = start_tp_engine(
        config(llama_dir, max_running=3), tp_size=2, timeout_s=60, check_sync=True
    )
    try:
        assert run(engine) == ref
        follower = engine.followers[0]
        follower.kill()
        follower.join(timeout=10)
        engine.add_request(workload()[0])
        with pytest.raises(FollowerDiedError, match="rank 1"):
            engine.step()
    finally:
        engine.close()
    assert all(p.exitcode is not None for p in engine.followers)


def test_model_that_does_not_split_fails_before_spawning(llama_dir):  # 4 heads, 2 KV heads
    with pytest.raises(ModelConfigError, match="4 attention heads do not split evenly over 3"):
        start_tp_engine(config(llama_dir), tp_size=3)


def test_start_up_failure_raises_and_ends_the_followers(tmp_path, llama_dir):
    """Every rank fails to load the weights: rank 0 raises its error, no process is left."""
    import multiprocessing

    from batchrun.models.loader import WeightLoadError

    model_dir = tmp_path / "broken"  # config.json without weights
    model_dir.mkdir()
    (model_dir / "config.json").write_text((Path(llama_dir) / "config.json").read_text())
    with pytest.raises(WeightLoadError, match="no \\*.safetensors"):
        start_tp_engine(config(str(model_dir)), tp_size=2, timeout_s=60, check_sync=True)
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("batchrun-tp")]


def test_tp1_is_a_plain_engine(llama_dir):
    with start_tp_engine(config(llama_dir), tp_size=1) as engine:
        assert engine.tp_size == 1 and isinstance(engine.engine, Engine)
        assert greedy(engine) == greedy(Engine(config(llama_dir)))
