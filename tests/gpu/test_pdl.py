"""Programmatic dependent launch (kernels/pdl.py) on the GPU: the kernels carry the grid
dependency instructions when launched with it, and a decode step gives the same bits with it as
without, eager and in CUDA graphs, with cuBLAS or kernels/gemv.py for the matmuls.

A kernel that read an earlier kernel's output before its wait would race with it: the values it
read would depend on timing, and the outputs would differ from the PDL-off run, from replay to
replay. Chains of real model steps, replayed many times, are where such a race shows."""

from __future__ import annotations

import gc
import json

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def _hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9


needs_hopper = pytest.mark.skipif(not _hopper(), reason="PDL needs sm_90+")

CHAIN_HIDDEN = 2048


def make_decode_chain(layers: int = 24, inter: int = 4096):
    """chain(x, residual, pdl) -> (argmax ids, residual) over [2, CHAIN_HIDDEN] bf16 rows: norm
    -> gemv -> SwiGLU -> gemv, `layers` times, then the norm, an LM-head gemv and the argmax, on
    seeded weights, every kernel launched with PDL or without. gemv is looked up in its module
    at every call, so a patched pick_config applies."""
    import batchrun.kernels.gemv as gemv_module
    from batchrun.kernels.activation import silu_and_mul
    from batchrun.kernels.argmax import argmax
    from batchrun.kernels.fused_norm import fused_add_rms_norm

    g = torch.Generator(device="cuda").manual_seed(0)
    hidden, bf16 = CHAIN_HIDDEN, torch.bfloat16
    ups = [
        torch.randn(2 * inter, hidden, device="cuda", generator=g).to(bf16) * 0.02 for _ in range(2)
    ]
    downs = [
        torch.randn(hidden, inter, device="cuda", generator=g).to(bf16) * 0.02 for _ in range(2)
    ]
    norm_w = torch.ones(hidden, device="cuda", dtype=bf16)
    head = torch.randn(32000, hidden, device="cuda", generator=g).to(bf16) * 0.02

    def chain(x, residual, pdl: bool):
        gemv = gemv_module.gemv
        for i in range(layers):
            h, residual = fused_add_rms_norm(x, residual, norm_w, 1e-5, pdl=pdl)
            up = gemv(h, ups[i % 2], pdl=pdl)
            x = gemv(silu_and_mul(up, pdl=pdl), downs[i % 2], pdl=pdl)
        h, _ = fused_add_rms_norm(x, residual, norm_w, 1e-5, pdl=pdl)
        return argmax(gemv(h, head, pdl=pdl), pdl=pdl), residual

    return chain


def capture_chain(chain, pdl: bool):
    """(graph, x_in, res_in, out, buffers): chain (launched with PDL or without) captured in a
    CUDA graph that first copies the static inputs x_in and res_in (zeros; write new ones before
    each replay) into its own buffers; out is the graph's (ids, residual). One eager call first
    compiles outside the capture. Keep `buffers` as long as the graph: every replay writes into
    them."""
    # NOTE: the graph's x buffer is written in place by its first norm: were it a local dropped
    # on return, the caching allocator would hand its memory to the caller's later tensors (the
    # replay loop's clones), which every later replay would overwrite
    x = torch.zeros(2, CHAIN_HIDDEN, device="cuda", dtype=torch.bfloat16)
    res = torch.zeros_like(x)
    x_in, res_in = x.clone(), res.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        chain(x.clone(), res.clone(), pdl)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            x.copy_(x_in)
            res.copy_(res_in)
            out = chain(x, res, pdl)
    torch.cuda.current_stream().wait_stream(stream)
    return graph, x_in, res_in, out, (x, res)


def feed_chain_inputs(x_in, res_in, step: int) -> None:
    """Step `step`'s seeded random inputs into the chain's static x_in and res_in."""
    gi = torch.Generator(device="cuda").manual_seed(100 + step)
    x_in.copy_(torch.randn(x_in.shape, device="cuda", generator=gi).to(x_in.dtype))
    res_in.copy_(torch.randn(res_in.shape, device="cuda", generator=gi).to(res_in.dtype))


def test_pdl_kwargs_follow_the_flag():
    """pdl_launch_kwargs: the PDL constexpr and the launch attribute together for a CUDA tensor
    when asked; neither without, nor for a CPU tensor. supports_pdl: sm_90+."""
    from batchrun.kernels.pdl import pdl_launch_kwargs

    from batchrun.engine.kernel_choice import supports_pdl

    x = torch.zeros(1, device="cuda")
    assert pdl_launch_kwargs(True, x) == {"PDL": True, "launch_pdl": True}
    assert pdl_launch_kwargs(False, x) == {"PDL": False}
    assert pdl_launch_kwargs(True, torch.zeros(1)) == {"PDL": False}
    assert supports_pdl(torch.device("cuda")) == _hopper()
    assert not supports_pdl(torch.device("cpu"))


@needs_hopper
def test_gemv_launched_with_pdl_waits_on_the_grid_dependency():
    """The compiled gemv carries griddepcontrol.wait (and the launch attribute) with PDL, and
    not without: the flag and the instruction travel together."""
    from batchrun.kernels.gemv import _gemv_kernel, gemv

    x = torch.randn(1, 512, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(256, 512, device="cuda", dtype=torch.bfloat16)
    for pdl in (True, False):
        gemv(x, w, pdl=pdl)
        torch.cuda.synchronize()
        kernels = [k for cache in _gemv_kernel.device_caches.values() for k in cache[0].values()]
        found = [
            k
            for k in kernels
            if ("griddepcontrol.wait" in k.asm["ptx"]) == pdl
            and bool(getattr(k.metadata, "launch_pdl", False)) == pdl
        ]
        assert found, f"no gemv compiled with launch_pdl={pdl}"


# a small Llama 3: big enough that its kernels run for a while, 4 layers
MODEL = dict(
    architectures=["LlamaForCausalLM"],
    model_type="llama",
    hidden_act="silu",
    rope_theta=500000.0,
    rms_norm_eps=1e-5,
    attention_bias=False,
    mlp_bias=False,
    initializer_range=0.02,
    torch_dtype="bfloat16",
    vocab_size=32000,
    hidden_size=1024,
    intermediate_size=4096,
    num_hidden_layers=4,
    num_attention_heads=16,
    num_key_value_heads=4,
    head_dim=64,
    max_position_embeddings=4096,
    bos_token_id=1,
    eos_token_id=2,
    tie_word_embeddings=False,
)


@needs_hopper
@pytest.mark.parametrize("decode_gemv", ["cublas", "triton"])
def test_engine_tokens_and_logits_identical_with_and_without_pdl(decode_gemv, tmp_path):
    """Greedy tokens of batches of 1 and 5 (decode CUDA graphs, piecewise graphs for the
    prefills) and teacher-forced logits: bit for bit the same with PDL on and off
    (KernelPlan.pdl), with the decode matmuls on cuBLAS and on kernels/gemv.py (with the
    one-row decode's norms inside the matmuls, decode_norms "all" for this hidden size)."""
    from batchrun.config import EngineConfig, KernelPlan
    from batchrun.engine.engine import Engine
    from batchrun.params import GenerateRequest, SamplingParams

    (tmp_path / "config.json").write_text(json.dumps(MODEL))
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 32000, (n,), generator=g).tolist() for n in (300, 5, 77, 130, 9)]

    def run(pdl: bool):
        kernels = KernelPlan(
            pdl=pdl, decode_gemv=decode_gemv, cuda_graph_max_bs=8, piecewise_graphs=True
        )
        config = EngineConfig(
            model=str(tmp_path),
            load_format="dummy",
            device="cuda",
            dtype="bfloat16",
            kv_budget=16384,
        )
        engine = Engine(config, kernels)
        try:
            assert engine.kernels.pdl is pdl and engine.kernels.decode_gemv == decode_gemv
            norms = "all" if decode_gemv == "triton" else "off"
            assert engine.kernels.decode_norms == norms
            params = SamplingParams(max_new_tokens=40, temperature=0.0, ignore_eos=True)
            (alone,) = [
                r.output_ids for r in engine.generate([GenerateRequest("a", prompts[0], params)])
            ]
            reqs = [GenerateRequest(str(i), p, params) for i, p in enumerate(prompts)]
            outs = {r.rid: r.output_ids for r in engine.generate(reqs)}
            logits = engine.score(prompts[1] + alone[:10])
            return alone, [outs[str(i)] for i in range(len(prompts))], logits
        finally:
            del engine
            gc.collect()
            torch.cuda.empty_cache()

    ref_alone, ref_batch, ref_logits = run(False)
    for _ in range(2):  # a race would not show every time
        alone, batch, logits = run(True)
        assert alone == ref_alone
        assert batch == ref_batch
        assert torch.equal(logits, ref_logits)


@needs_hopper
def test_decode_chain_replays_identical_with_pdl():
    """A chain of dependent kernels in one CUDA graph (norm -> gemv -> SwiGLU -> gemv, 24 times,
    then the argmax), replayed with new inputs: the same bits as the chain without PDL. The
    gemvs of 2048 x 4096 split K in 8 (the slices' sums meet in the kernel): the split counters
    are zero before and after."""
    from batchrun.kernels.gemv import pick_config, split_counters

    counters = split_counters(torch.device("cuda"))
    assert pick_config(2, 2048, 4096).split_k > 1
    assert not counters.any(), "an earlier call left a split counter set"
    chain = make_decode_chain()

    runs = {}
    for pdl in (False, True):
        graph, x_in, res_in, out, _buffers = capture_chain(chain, pdl)  # buffers live with it
        results = []
        for step in range(20):
            feed_chain_inputs(x_in, res_in, step)
            graph.replay()
            results.append((out[0].clone(), out[1].clone()))
        torch.cuda.synchronize()
        runs[pdl] = results
    assert not counters.any()
    for (ids0, res0), (ids1, res1) in zip(runs[False], runs[True]):
        assert ((ids0 >= 0) & (ids0 < 32000)).all(), ids0  # token ids, not overwritten memory
        assert torch.equal(ids0, ids1)
        assert torch.equal(res0, res1)
