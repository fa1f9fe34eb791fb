"""The MoE block with moe "triton" (batchrun.kernels.fused_moe; its decode batches also on
batchrun.kernels.moe_gemv, every batch on batchrun.kernels.moe_grouped_mm) under Triton's CPU
interpreter: the tiny Qwen3-MoE, Qwen2-MoE and Mixtral give transformers' prefill logits and the
torch loop's greedy tokens, in fp32 (the interpreter's tl.dot is wrong for bf16); their
one-token decode with the norms inside the GEMVs (decode_norms) gives the logits of "off", in
fp16. Skipped where
triton or the fused MoE module is not installed; runs in a subprocess (TRITON_INTERPRET must be
set before triton is first imported)."""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow  # CI's slow tier (BATCHRUN_SLOW_TESTS=1)

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))


def _has_fused_moe() -> bool:
    try:
        return importlib.util.find_spec("batchrun.kernels.fused_moe") is not None
    except ImportError:
        return False


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")
@pytest.mark.skipif(not _has_fused_moe(), reason="batchrun.kernels.fused_moe not installed")
def test_moe_models_under_interpreter():
    from triton_interpreter import run_under_interpreter

    run_under_interpreter(__file__)


def _check_model(kind: str, root: Path) -> None:
    from batchrun.kernels import moe_grouped_mm
    from tiny_models import make_tiny_model, random_prompts

    from batchrun.config import EngineConfig, KernelPlan
    from batchrun.engine.engine import Engine
    from batchrun.params import GenerateRequest, SamplingParams

    path = root / kind
    hf = make_tiny_model(kind, path)
    outs = []
    # every batch that is not a GEMV's on torch._grouped_mm (its rule's threshold at 0 rows)
    moe_grouped_mm.MIN_ROWS_PER_EXPERT = 0
    for moe, decode, prefill in (
        ("triton", "grouped", "triton"), ("triton", "gemv", "triton"),
        ("triton", "grouped", "grouped_mm"), ("torch", "grouped", "triton"),
    ):  # fmt: skip
        kernels = replace(KernelPlan.reference(), moe=moe, moe_decode=decode, moe_prefill=prefill)
        engine = Engine(EngineConfig(model=str(path), device="cpu", dtype="float32",
                                     kv_budget=4096), kernels=kernels)  # fmt: skip
        resolved = engine.runner.kernels
        assert (resolved.moe, resolved.moe_decode, resolved.moe_prefill) == (moe, decode, prefill)
        prompts = random_prompts(3, seed=4, min_len=6, max_len=40)
        with torch.no_grad():
            ref = hf(torch.tensor([prompts[0]])).logits[0]
        logits = engine.score(prompts[0])
        rel = float((logits - ref).norm() / ref.norm())
        assert rel <= 1e-4, f"{kind} moe={moe} {decode} {prefill}: relative error {rel:.2e}"
        params = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
        reqs = [GenerateRequest(str(i), p, params) for i, p in enumerate(prompts)]
        outs.append({r.rid: r.output_ids for r in engine.generate(reqs)})
    assert outs[0] == outs[1] == outs[2] == outs[3], kind


def _check_decode_norms(root: Path) -> None:
    """The one-token decode of the tiny Qwen3-MoE (its layer 1 dense) and Mixtral in fp16 with
    decode_gemv "triton": the fused decode (models/fused_decode.py) with decode_norms "all" (the
    experts' residual add and the next norm inside their down GEMV, MoE.forward_residual, once
    an expert layer) gives the logits of "off"."""
    from spies import count_calls
    from test_fused_kernels_interpreter import _runner
    from tiny_models import make_tiny_model, random_prompts
    from triton_interpreter import INTERPRETER_KERNELS

    from batchrun.layers.moe import MoE

    base = replace(INTERPRETER_KERNELS, attention="torch", decode_gemv="triton", moe="triton",
                   moe_decode="gemv")  # fmt: skip
    for kind in ("qwen3_moe", "mixtral"):
        path = root / f"{kind}-norms"
        make_tiny_model(kind, path)
        prompts = random_prompts(2, seed=5, min_len=3, max_len=16) + [[5], [60]]
        ref_runner = _runner(path, replace(base, decode_norms="off"))
        refs = [ref_runner.all_logits(p, torch.arange(len(p))) for p in prompts]
        for mode in ("all",):
            runner = _runner(path, replace(base, decode_norms=mode))
            assert runner.kernels.decode_norms == runner.model.fused.mode == mode
            experts = sum(isinstance(layer.mlp, MoE) for layer in runner.model.layers)
            for prompt, ref in zip(prompts, refs):
                with pytest.MonkeyPatch.context() as mp:
                    calls = count_calls(mp, MoE, "forward_residual")
                    got = runner.all_logits(prompt, torch.arange(len(prompt)))
                assert calls["n"] == (experts if len(prompt) == 1 else 0), (kind, mode)
                rel = ((got - ref).norm() / ref.norm()).item()
                assert rel <= 5e-3, (kind, mode, len(prompt), rel)


if __name__ == "__main__":
    import tempfile

    from tiny_models import MOE_KINDS

    with tempfile.TemporaryDirectory() as tmp:
        for kind in MOE_KINDS:
            _check_model(kind, Path(tmp))
        _check_decode_norms(Path(tmp))
    print("ok")
