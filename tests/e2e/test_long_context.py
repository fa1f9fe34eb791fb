"""Long documents on a tiny model with a 32k context: prompts of 8k-32k tokens through the CLI
give transformers' greedy tokens with any chunked prefill size, a row longer than
--max-model-len goes to the errors file while the others run, decodes run in every step while a
long prompt prefills in chunks, and the linear / dynamic rope variants equal transformers."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tiny_models import COMMON, hf_greedy, random_prompts, save_byte_tokenizer  # noqa: E402

from batchrun.cli import main  # noqa: E402
from batchrun.config import EngineConfig  # noqa: E402
from batchrun.engine.engine import Engine  # noqa: E402
from batchrun.errors import ModelConfigError  # noqa: E402
from batchrun.params import GenerateRequest, SamplingParams  # noqa: E402

CONTEXT = 32768
NEW_TOKENS = 6
# 8k, 16k and the whole context less the new tokens
LONG_LENGTHS = (8192, 16384, CONTEXT - NEW_TOKENS)


def save_model(path: Path, hf_config) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32).eval()
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="module")
def long_model(tmp_path_factory):
    """A 2-layer llama (hidden 32, vocab 260, byte tokenizer) with a 32k context."""
    import transformers

    path = tmp_path_factory.mktemp("long")
    cfg = transformers.LlamaConfig(
        **{
            **COMMON,
            "vocab_size": 260,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "eos_token_id": 257,
            "bos_token_id": 258,
            "pad_token_id": 259,
            "max_position_embeddings": CONTEXT,
        },
        rope_theta=500000.0,
    )
    hf = save_model(path, cfg)
    save_byte_tokenizer(path)
    return path, hf


def long_prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(3, 256, (n,), generator=g).tolist() for n in LONG_LENGTHS]


def write_rows(path: Path, prompts: list[list[int]]) -> Path:
    rows = [
        {"id": f"r{i}", "prompt_token_ids": p, "ignore_eos": True} for i, p in enumerate(prompts)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def submit(model: Path, dataset: Path, out: Path, *extra: str, code: int = 0):
    args = ["submit", str(dataset), "--out", str(out), "--model", str(model), "--device", "cpu",
            "--dtype", "float32", "--max-tokens", str(NEW_TOKENS), "--temperature", "0",
            "--token-ids", "--in-process", "--quiet", *extra]  # fmt: skip
    result = CliRunner().invoke(main, args)
    assert result.exit_code == code, (result.output, result.exception)
    return result


def records(out: Path, prefix: str) -> list[dict]:
    return [
        json.loads(line)
        for p in sorted(out.glob(f"{prefix}-*.jsonl"))
        for line in p.read_text().splitlines()
    ]


@pytest.fixture(scope="module")
def hf_tokens(long_model) -> dict[str, list[int]]:
    _, hf = long_model
    return {f"r{i}": hf_greedy(hf, p, NEW_TOKENS) for i, p in enumerate(long_prompts())}


@pytest.mark.slow
@pytest.mark.parametrize("chunk", ["512", "4096", "0"])
def test_long_prompts_through_the_cli_give_transformers_tokens(
    long_model, hf_tokens, tmp_path, chunk
):
    """8k, 16k and 32k-token prompts (the whole context) with the chunk budget 512, 4,096 and
    unlimited: each run gives transformers' greedy tokens, so the three are identical."""
    path, _ = long_model
    dataset = write_rows(tmp_path / "in.jsonl", long_prompts())
    out = tmp_path / "o"
    kv = str(sum(LONG_LENGTHS) + 64)
    submit(path, dataset, out, "--chunked-prefill-size", chunk, "--kv-budget", kv)
    got = {r["id"]: r["token_ids"] for r in records(out, "results")}
    assert got == hf_tokens
    assert not records(out, "errors")


def test_a_prompt_over_max_model_len_goes_to_the_errors_file(long_model, tmp_path):
    """--max-model-len 4096: the 5,000-token row fails with its length and the cap, the job goes
    on with the others."""
    path, _ = long_model
    prompts = random_prompts(2, seed=3, min_len=10, max_len=30)
    prompts.insert(1, [5] * 5000)
    dataset = write_rows(tmp_path / "in.jsonl", prompts)
    out = tmp_path / "o"
    r = submit(path, dataset, out, "--max-model-len", "4096", "--kv-budget", "8192")
    assert "1 context_length_exceeded" in r.output
    assert sorted(rec["id"] for rec in records(out, "results")) == ["r0", "r2"]
    (err,) = records(out, "errors")
    assert err["row"] == 1 and err["error"]["type"] == "context_length_exceeded"
    message = err["error"]["message"]
    assert "5000 tokens" in message and "(4096:" in message and "--max-model-len" in message


def test_max_model_len_changes_the_fingerprint(long_model, tmp_path):
    """A resume with another --max-model-len is refused: which rows fail as too long depends
    on it."""
    path, _ = long_model
    dataset = write_rows(tmp_path / "in.jsonl", random_prompts(2, seed=4, min_len=10, max_len=20))
    out = tmp_path / "o"
    submit(path, dataset, out, "--max-model-len", "4096", "--kv-budget", "1024")
    r = submit(path, dataset, out, "--max-model-len", "2048", "--kv-budget", "1024", code=1)
    assert "--max-model-len" in r.output


def test_max_model_len_over_the_model_context_is_refused(long_model, tmp_path):
    path, _ = long_model
    with pytest.raises(ModelConfigError, match=r"--max-model-len \(context_len\) 40000: .* 32768"):
        Engine(EngineConfig(model=str(path), device="cpu", kv_budget=64, context_len=40000))
    dataset = write_rows(tmp_path / "in.jsonl", [[5, 6, 7]])
    r = submit(path, dataset, tmp_path / "o", "--max-model-len", "40000", code=2)  # a bad option
    assert "give a length from 1 to 32768" in r.output


def test_decodes_run_in_every_step_while_a_long_prompt_prefills(long_model, monkeypatch):
    """A 6,000-token prompt prefills in 512-token chunks next to a decoding request: every step
    holds the short request's decode until it finishes, and no step more than 512 prefill
    tokens."""
    path, _ = long_model
    engine = Engine(
        EngineConfig(model=str(path), device="cpu", dtype="float32", kv_budget=8192,
                     chunked_prefill_size=512, overlap=False)
    )  # fmt: skip
    batches = []
    schedule = engine.scheduler.schedule

    def spy():
        batch = schedule()
        if batch is not None:
            batches.append([(r.rid, n) for r, n in zip(batch.reqs, batch.extend_lens)])
        return batch

    monkeypatch.setattr(engine.scheduler, "schedule", spy)
    params = SamplingParams(max_new_tokens=20, temperature=0.0, ignore_eos=True)
    engine.add_request(GenerateRequest("short", [5, 6, 7, 8], params))
    while not batches:
        engine.step()
    engine.add_request(GenerateRequest("long", [9] * 6000, params))
    while engine.has_work:
        engine.step()
    long_steps = [b for b in batches if any(rid == "long" and n > 1 for rid, n in b)]
    assert len(long_steps) >= 11  # 6,000 tokens in chunks of at most 512
    short_done = max(i for i, b in enumerate(batches) if any(rid == "short" for rid, _ in b))
    for i, batch in enumerate(batches):
        prefill = sum(n for _, n in batch if n > 1)
        assert prefill <= 512
        if 0 < i <= short_done:
            assert ("short", 1) in batch, (i, batch)
    assert short_done >= 11  # the short request decoded through the long prefill


# rope scaling variants against transformers on tiny configs (the llama3 and longrope ones:
# test_parity_tiny.py, test_parity_phi3.py)
ROPE_VARIANTS = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    # NTK scaling is in effect past max_position_embeddings only, which batchrun does not serve
    "dynamic": {"rope_type": "dynamic", "factor": 4.0},
}


@pytest.mark.parametrize("variant", list(ROPE_VARIANTS))
def test_rope_variant_gives_transformers_tokens(variant, tmp_path):
    import transformers

    cfg = transformers.LlamaConfig(
        **{**COMMON, "max_position_embeddings": 128},
        rope_scaling=ROPE_VARIANTS[variant],
        rope_theta=10000.0,
    )
    hf = save_model(tmp_path, cfg)
    engine = Engine(EngineConfig(model=str(tmp_path), device="cpu", dtype="float32",
                                 kv_budget=2048))  # fmt: skip
    if variant == "dynamic":
        with pytest.raises(ModelConfigError, match="rope type 'dynamic': transformers' NTK"):
            Engine(EngineConfig(model=str(tmp_path), device="cpu", context_len=129))
    # the last prompt and its tokens fill the whole context
    prompts = [*random_prompts(2, seed=5, min_len=8, max_len=40), [7] * 96]
    params = SamplingParams(max_new_tokens=32, temperature=0.0, ignore_eos=True)
    requests = [GenerateRequest(f"p{i}", p, params) for i, p in enumerate(prompts)]
    got = {r.rid: r.output_ids for r in engine.generate(requests)}
    for i, p in enumerate(prompts):
        assert got[f"p{i}"] == hf_greedy(hf, p, 32), (variant, i)


def test_plan_reports_the_kv_bytes_of_the_longest_rows(long_model, tmp_path):
    """128 bytes a token (2 layers x 1 KV head x head dim 16, K and V, 16-bit); the row over
    --max-model-len would fail; fp8_e4m3 halves the bytes."""
    path, _ = long_model
    dataset = write_rows(tmp_path / "in.jsonl", [[5] * 3000, [6] * 1000, [7] * 5000])
    base = ["plan", str(dataset), "--model", str(path), "--max-tokens", "96", "--max-running", "2"]
    base += ["--dtype", "bfloat16"]  # a GPU run's KV elements (on the CPU, auto is float32)
    r = CliRunner().invoke(main, [*base, "--max-model-len", "4096", "--kv-budget", "10000"])
    assert r.exit_code == 0, r.output
    assert "context 4,096, --max-model-len; the model's 32,768" in r.output
    assert "3: 2 would run, 1 would fail" in r.output and "context_length_exceeded: 1" in r.output
    # the longest: 3,096 tokens; the two at once: 4,192
    assert "KV need      3,096 tokens" in r.output
    assert "KV bytes     0.40 MB for the longest request, 0.54 MB for those at once" in r.output
    assert "KV budget    10,000 tokens (1.28 MB): fits" in r.output
    r = CliRunner().invoke(main, [*base, "--kv-cache-dtype", "fp8_e4m3"])
    assert r.exit_code == 0, r.output
    assert "KV bytes     0.33 MB for the longest request" in r.output  # 5,096 x 64 bytes
    assert "3: 3 would run" in r.output
    r = CliRunner().invoke(main, [*base, "--max-model-len", "40000"])
    assert r.exit_code == 2 and "give a length from 1 to 32768" in r.output, r.output
