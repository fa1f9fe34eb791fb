"""Prefill-only tasks on the GPU: the batchrun job (`batchrun submit --task ...` in this process:
packed steps, no padding, shared rerank prefixes, tokenization in worker processes, shards)
against sentence-transformers in the same run, both end to end from text.

    python scripts/bench_pooling.py                                   # the full set (below)
    python scripts/bench_pooling.py --scale 0.05 --st-batch-sizes 32,128   # one 10-minute call
    python scripts/bench_pooling.py --cases bert-base --scale 0.1     # one case, fewer rows
    python scripts/bench_pooling.py --device cpu --tiny --scale 0.0001   # CPU smoke test

Cases (random weights of each shape, saved with a synthetic word-level tokenizer to a temp dir, so
both sides load the same folder):
  bert-base          200,000 passages of 32-512 words, mean pooling, vs SentenceTransformer.encode
  qwen3-embed-0.6b   the same passages on Qwen3-Embedding-0.6B's shape (last-token pooling)
  qwen3-rerank-0.6b  20,000 rows of (query, 10 documents) on Qwen3-Reranker-0.6B's shape (the
                     yes/no score), vs CrossEncoder.predict on its sequence-classification twin
                     (the yes - no row of the LM head as a one-label head, as the community's
                     Qwen3-Reranker-*-seq-cls checkpoints are made: sigmoid of it = P(yes))
  reward-llama-8b    20,000 texts of 64-512 words on Llama-3.1-8B's shape with a one-label
                     classification head (dummy weights; batchrun only): its prefill TFLOP/s
                     (linear layers' model FLOPs) against the engine's W5 in docs/benchmarks.md
--scale runs that fraction of each case's rows. The baseline runs in fp16 at each of
--st-batch-sizes and reports its best; batchrun in fp16 with --tokenizer-workers processes, timed
by the job's summary (the model load left out, as the baseline's). Rows/s, tokens/s and the job's
notes (which of tokenizer and engine bounds it, the shared-prefix tokens) are printed and
written as JSON to --out. The rerank case also checks the scores: the job's results for the first
rows against CrossEncoder.predict's for the same pairs (max abs difference, under "check").
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
import tempfile
import time
from pathlib import Path

import torch

SHAPES = {
    "bert-base": dict(kind="bert", hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                      intermediate_size=3072, vocab_size=30522, max_position_embeddings=512),
    "qwen3-embed-0.6b": dict(kind="qwen3", hidden_size=1024, num_hidden_layers=28,
                             num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                             intermediate_size=3072, vocab_size=151669,
                             max_position_embeddings=32768),
    "qwen3-rerank-0.6b": dict(kind="qwen3-lm", hidden_size=1024, num_hidden_layers=28,
                              num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                              intermediate_size=3072, vocab_size=151669,
                              max_position_embeddings=32768),
    "reward-llama-8b": dict(kind="llama-reward", hidden_size=4096, num_hidden_layers=32,
                            num_attention_heads=32, num_key_value_heads=8,
                            intermediate_size=14336, vocab_size=128256,
                            max_position_embeddings=8192),
}  # fmt: skip
TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=128, vocab_size=2000, head_dim=16)  # fmt: skip


# the chat markers are special tokens (split out before the whitespace split), as in Qwen's
# tokenizer: a document followed by the rerank suffix's "<|im_end|>" stays its own words
CHAT_MARKERS = ["<|im_start|>", "<|im_end|>", "<think>", "</think>"]
SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "yes", "no", *CHAT_MARKERS]


def save_word_tokenizer(path: Path, vocab_size: int, family: str) -> None:
    """Words w0..wN as tokens, whitespace split; BERT's [CLS] / [SEP], an end token after
    ("decoder", as Qwen3-Embedding's), or nothing added ("reranker", as Qwen3-Reranker's)."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {s: i for i, s in enumerate(SPECIALS)}
    vocab.update({f"w{i}": i + len(SPECIALS) for i in range(vocab_size - len(SPECIALS))})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens([AddedToken(m, normalized=False) for m in CHAT_MARKERS])
    if family == "bert":
        tok.post_processor = processors.TemplateProcessing(
            single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
            special_tokens=[("[CLS]", 2), ("[SEP]", 3)],
        )  # fmt: skip
    elif family == "decoder":
        tok.post_processor = processors.TemplateProcessing(
            single="$A [SEP]", pair="$A $B [SEP]", special_tokens=[("[SEP]", 3)]
        )
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]")
    fast.padding_side = "right" if family == "bert" else "left"
    fast.save_pretrained(path)


def make_model(root: Path, case: str, tiny: bool, device: str) -> Path:
    """The case's model folder: random weights saved (or config.json alone for dummy weights),
    a word tokenizer, for the embedders a sentence-transformers layout, and for the reranker its
    sequence-classification twin beside it (`seq_cls_twin`)."""
    import transformers

    shape = dict(SHAPES[case])
    kind = shape.pop("kind")
    if tiny:
        shape.update(TINY)
        if kind == "bert":
            shape.pop("head_dim", None)
            shape.pop("num_key_value_heads", None)
    path = root / case
    torch.manual_seed(0)
    if kind == "bert":
        model = transformers.BertModel(transformers.BertConfig(**shape), add_pooling_layer=False)
    elif kind == "qwen3":
        model = transformers.Qwen3Model(transformers.Qwen3Config(**shape))
    elif kind == "qwen3-lm":
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**shape))
    else:  # the reward model's weights are batchrun's dummy ones: config.json alone
        cfg = transformers.LlamaConfig(**shape, num_labels=1)
        cfg.architectures = ["LlamaForSequenceClassification"]
        path.mkdir(parents=True)
        cfg.save_pretrained(path)
        save_word_tokenizer(path, shape["vocab_size"], "decoder")
        return path
    model.half().save_pretrained(path)
    family = {"bert": "bert", "qwen3": "decoder", "qwen3-lm": "reranker"}[kind]
    save_word_tokenizer(path, shape["vocab_size"], family)
    if kind == "qwen3-lm":
        save_seq_cls_twin(model, seq_cls_twin(path))
        save_word_tokenizer(seq_cls_twin(path), shape["vocab_size"], family)
    if kind in ("bert", "qwen3"):
        from sentence_transformers import SentenceTransformer
        from sentence_transformers.sentence_transformer import modules

        word = modules.Transformer(str(path), max_seq_length=512 + 2)
        pooling = modules.Pooling(shape["hidden_size"], "mean" if kind == "bert" else "lasttoken")
        st = SentenceTransformer(modules=[word, pooling, modules.Normalize()], device="cpu")
        st.save(str(root / f"{case}-st"))
        return root / f"{case}-st"
    return path


def seq_cls_twin(path: Path) -> Path:
    return path.with_name(path.name + "-seq-cls")


def save_seq_cls_twin(causal, path: Path) -> None:
    """A yes/no reranker as `Qwen3ForSequenceClassification` with one label: the same decoder,
    and `score.weight` = lm_head[yes] - lm_head[no] (P(yes) of the two-way softmax is the sigmoid
    of that logit), pooled at the last non-pad token. The row is saved in fp32 (the other tensors
    in the folder's fp16): loaded in fp32 the twin scores as the causal model does to fp32
    rounding, loaded in fp16 it is rounded as a seq-cls checkpoint's is."""
    import transformers

    cfg = transformers.Qwen3Config(**causal.config.to_dict())
    cfg.num_labels, cfg.pad_token_id, cfg.tie_word_embeddings = 1, SPECIALS.index("[PAD]"), False
    cfg.architectures = ["Qwen3ForSequenceClassification"]
    twin = transformers.Qwen3ForSequenceClassification(cfg).to(causal.dtype)
    twin.model.load_state_dict(causal.model.state_dict())
    head = causal.lm_head.weight.float()
    yes, no = SPECIALS.index("yes"), SPECIALS.index("no")
    twin.score.weight.data = (head[yes] - head[no])[None]
    twin.save_pretrained(path)


def passages(n: int, vocab: int, seed: int, lo: int = 32, hi: int = 512) -> list[str]:
    rng = random.Random(seed)
    words = vocab - len(SPECIALS)
    return [
        " ".join(f"w{rng.randrange(words)}" for _ in range(rng.randint(lo, hi))) for _ in range(n)
    ]


def _dtype(args) -> torch.dtype:
    return torch.float16 if args.device == "cuda" else torch.float32


def job_dir(path: Path, task: str) -> Path:
    """Where run_job writes the input and the run folder (`out/`) of `task` on `path`."""
    return path.with_name(f"{path.name}-{task}-job")


def run_job(path: Path, rows: list[dict], task: str, args, extra: tuple[str, ...] = ()) -> dict:
    """`batchrun submit --task TASK` in this process over a JSONL file of `rows`, end to end:
    reading, tokenization in --tokenizer-workers processes, steps, Parquet / JSONL shards (in
    `job_dir`). The time is the job's own (its summary's elapsed: the model load is not in it)."""
    from click.testing import CliRunner

    from batchrun.cli.main import main as cli

    work = job_dir(path, task)
    work.mkdir()
    data = work / "in.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    dtype = "float16" if args.device == "cuda" else "float32"
    argv = ["submit", str(data), "--model", str(path), "--task", task, "--out", str(work / "out"),
            "--in-process", "--device", args.device, "--dtype", dtype, "--tokenizer-workers",
            str(args.tokenizer_workers), *extra]  # fmt: skip
    result = CliRunner().invoke(cli, argv)
    if result.exit_code != 0:
        raise RuntimeError(f"batchrun submit failed ({result.exit_code}): {result.output}")
    out = result.output
    elapsed = float(re.search(r"output tokens in ([\d.]+) s", out).group(1))
    if not elapsed:
        raise RuntimeError(f"the {task} job ran in under a millisecond: raise --scale to time it")
    manifest = json.loads((work / "out" / "manifest.json").read_text())
    counts = manifest["counts"]
    n, tokens = counts["rows_ok"], counts["prompt_tokens"]
    notes = [line for line in out.splitlines() if line.startswith(("rates:", "shared prefixes:"))]
    return {"rows": n, "seconds": elapsed, "rows_per_s": n / elapsed,
            "tokens_per_s": tokens / elapsed, "cached_tokens": counts["cached_tokens"],
            "notes": notes}  # fmt: skip


def run_st(path, texts, args) -> dict:
    from sentence_transformers import SentenceTransformer

    kwargs = {"dtype": _dtype(args)}
    st = SentenceTransformer(str(path), device=args.device, model_kwargs=kwargs)
    best = None
    for bs in args.st_batch_sizes:
        t0 = time.perf_counter()
        st.encode(texts, batch_size=bs)
        dt = time.perf_counter() - t0
        if best is None or dt < best["seconds"]:
            best = {"batch_size": bs, "seconds": dt, "rows_per_s": len(texts) / dt}
    return best


def rerank_pairs(query: str, documents: list[str]) -> list[tuple[str, str]]:
    """(query, document) pairs as CrossEncoder texts whose tokens are batchrun's rerank prompt:
    the first text is the prefix, instruction and query, the second the document and the suffix
    (the reranker's tokenizer adds nothing around a pair)."""
    from batchrun.pooling.model import RERANK_INSTRUCTION, RERANK_PREFIX, RERANK_SUFFIX

    first = f"{RERANK_PREFIX}<Instruct>: {RERANK_INSTRUCTION}\n<Query>: {query}\n<Document>: "
    return [(first, d + RERANK_SUFFIX) for d in documents]


def run_cross_encoder(path: Path, pairs: list[tuple[str, str]], args) -> tuple[dict, object]:
    """CrossEncoder.predict (sigmoid of the one-label head) over the pairs at each of
    --st-batch-sizes; its best, and the loaded CrossEncoder (for the score check)."""
    from sentence_transformers import CrossEncoder

    ce = CrossEncoder(str(path), device=args.device, model_kwargs={"dtype": _dtype(args)})
    best = None
    for bs in args.st_batch_sizes:
        t0 = time.perf_counter()
        ce.predict(pairs, batch_size=bs, show_progress_bar=False)
        dt = time.perf_counter() - t0
        if best is None or dt < best["seconds"]:
            best = {"batch_size": bs, "seconds": dt, "pairs_per_s": len(pairs) / dt,
                    "rows_per_s": len(pairs) / dt / 10}  # fmt: skip
    return best, ce


def check_rerank(out: Path, ce, rows: list[dict], n: int = 4) -> dict:
    """The job's scores of its first `n` rows (its results shards) against
    CrossEncoder.predict's for the same pairs: the max abs difference of P(yes)."""
    shards = sorted(out.glob("results-*"))
    records = [json.loads(line) for f in shards for line in f.read_text().splitlines()]
    job = {r["id"]: r["scores"] for r in records}
    rows = rows[:n]
    pairs = [p for r in rows for p in rerank_pairs(r["query"], r["documents"])]
    ours = torch.tensor([s for r in rows for s in job[r["id"]]], dtype=torch.float64)
    theirs = torch.as_tensor(ce.predict(pairs, show_progress_bar=False), dtype=torch.float64)
    return {"pairs": len(pairs), "max_abs_diff": float((ours - theirs).abs().max())}


def linear_tflop(case: str, tiny: bool, tokens: int) -> float:
    """Model FLOPs of a decoder's linear layers over `tokens` (2 per weight per token), in TFLOP
    (attention left out: these sequences are short)."""
    shape = {**SHAPES[case], **(TINY if tiny else {})}
    h, inter, layers = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"]
    head_dim = shape.get("head_dim") or h // shape["num_attention_heads"]
    q, kv = shape["num_attention_heads"] * head_dim, shape["num_key_value_heads"] * head_dim
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * inter
    return 2 * layers * per_layer * tokens / 1e12


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--cases", default=",".join(SHAPES), help="comma-separated, of " + ", ".join(SHAPES)
    )
    p.add_argument(
        "--scale", type=float, default=1.0, help="the fraction of each case's rows to run"
    )
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="tiny shapes (CPU smoke test)")
    p.add_argument("--tokenizer-workers", type=int, default=8)
    p.add_argument("--st-batch-sizes", type=lambda s: [int(x) for x in s.split(",")],
                   default=[32, 64, 128, 256])  # fmt: skip
    p.add_argument("--no-baseline", action="store_true")
    p.add_argument("--out", type=Path, default=Path("bench_pooling.json"))
    args = p.parse_args(argv)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for case in args.cases.split(","):
            path = make_model(Path(tmp), case, args.tiny, args.device)
            vocab = TINY["vocab_size"] if args.tiny else SHAPES[case]["vocab_size"]
            hi = 64 if args.tiny else 512
            row: dict = {
                "case": case,
                "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
            }
            if case in ("bert-base", "qwen3-embed-0.6b"):
                texts = passages(max(1, round(200_000 * args.scale)), vocab, 0, hi=hi)
                data = [{"id": str(i), "text": t} for i, t in enumerate(texts)]
                row["batchrun"] = run_job(path, data, "embed", args)
                if not args.no_baseline:
                    row["sentence_transformers"] = run_st(path, texts, args)
            elif case == "qwen3-rerank-0.6b":
                n = max(1, round(20_000 * args.scale))
                queries = passages(n, vocab, 1, 8, 32)
                docs = passages(n * 10, vocab, 2, 32, hi)
                data = [{"id": str(i), "query": q, "documents": docs[10 * i : 10 * i + 10]}
                        for i, q in enumerate(queries)]  # fmt: skip
                row["batchrun"] = run_job(path, data, "rerank", args)
                if not args.no_baseline:
                    pairs = [p for r in data for p in rerank_pairs(r["query"], r["documents"])]
                    best, ce = run_cross_encoder(seq_cls_twin(path), pairs, args)
                    row["sentence_transformers"] = best
                    row["check"] = check_rerank(job_dir(path, "rerank") / "out", ce, data)
                    del ce
            else:
                n = max(1, round(20_000 * args.scale))
                data = [
                    {"id": str(i), "text": t} for i, t in enumerate(passages(n, vocab, 3, 64, hi))
                ]
                job = run_job(path, data, "classify", args, ("--load-format", "dummy"))
                tokens = job["tokens_per_s"] * job["seconds"]
                job["prefill_tflop_per_s"] = linear_tflop(case, args.tiny, tokens) / job["seconds"]
                job["compare"] = "docs/benchmarks.md, W5 on llama-8b: prefill TFLOP/s"
                row["batchrun"] = job
            print(json.dumps(row), flush=True)
            results.append(row)
            args.out.write_text(json.dumps({"results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
