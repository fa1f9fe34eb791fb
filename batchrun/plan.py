"""`batchrun plan`: what a run would do, without loading weights.

Streams the dataset through the same row pipeline as `submit` (read -> prepare -> tokenize) and
keeps only a few integers per row, so it runs on files far larger than memory.
"""

from __future__ import annotations

from collections import Counter

import numpy as np

from batchrun.engine.params import SamplingParams
from batchrun.io.readers import BadInputError, open_dataset
from batchrun.io.rows import RowError, RowSpec
from batchrun.pipeline import RowPipeline


class PlanError(Exception):
    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


def load_tokenizer_and_context(model: str | None):
    """Tokenizer and context length of a model directory (converting a GGUF once if needed)."""
    from transformers import AutoTokenizer

    from batchrun.models.config import ModelConfig
    from batchrun.models.embedded import resolve_model_path

    try:
        path = resolve_model_path(model)
        cfg = ModelConfig.from_dir(path)
        tokenizer = AutoTokenizer.from_pretrained(str(path))
    except (ValueError, OSError) as e:
        raise PlanError(f"cannot load the model's tokenizer: {e}", 4) from e
    return tokenizer, cfg, path


def make_plan(
    dataset: str,
    *,
    model: str | None,
    split: str | None,
    spec: RowSpec,
    defaults: SamplingParams,
    limit: int | None,
    kv_budget: int | None,
    max_running: int,
    show_errors: int = 10,
) -> str:
    try:
        source = open_dataset(dataset, split)
    except BadInputError as e:
        raise PlanError(str(e), 3) from e
    tokenizer, cfg, _ = load_tokenizer_and_context(model)
    pipeline = RowPipeline(source, spec, defaults, tokenizer, cfg.max_position_embeddings, limit)
    prompt_lens: list[int] = []
    max_new: list[int] = []
    samples = 0
    errors: Counter[str] = Counter()
    examples: list[RowError] = []
    for item in pipeline:
        if isinstance(item, RowError):
            errors[item.type] += 1
            if len(examples) < show_errors:
                examples.append(item)
            continue
        prompt_lens.append(len(item.input_ids))
        max_new.append(item.prepared.params.max_new_tokens)
        samples += item.prepared.params.n
    rows = len(prompt_lens) + sum(errors.values())
    if rows == 0:
        raise PlanError(f"{dataset}: the input has no rows; nothing to do", 3)
    lines = [
        f"dataset      {dataset} ({source.format}{', OpenAI batch' if pipeline.openai else ''})",
        f"model        {model or 'embedded SmolLM2-135M-Instruct'} "
        f"(context {cfg.max_position_embeddings})",
        f"rows         {rows}: {len(prompt_lens)} would run, {sum(errors.values())} would fail",
    ]
    if prompt_lens:
        p = np.array(prompt_lens, dtype=np.int64)
        m = np.array(max_new, dtype=np.int64)
        need = np.sort(p + m)[::-1]
        peak = int(need[:max_running].sum())
        lines += [
            f"prompt tok   total {int(p.sum()):,}  min {p.min()}  mean {p.mean():.1f}  "
            f"p50 {int(np.percentile(p, 50))}  p95 {int(np.percentile(p, 95))}  max {p.max()}",
            f"max new tok  total {int(m.sum()):,} over {samples} completions "
            f"(mean {m.mean():.1f} per row)",
            f"KV need      {int(need[0]):,} tokens for the longest request; {peak:,} tokens to "
            f"run {min(max_running, len(need))} of the longest at once (--max-running "
            f"{max_running})",
        ]
        if kv_budget is not None:
            verdict = (
                "fits"
                if peak <= kv_budget
                else (
                    "runs, with fewer requests at once"
                    if need[0] <= kv_budget
                    else "TOO SMALL for the longest request"
                )
            )
            lines.append(f"KV budget    {kv_budget:,} tokens: {verdict}")
    if errors:
        lines.append("would fail   " + ", ".join(f"{k}: {v}" for k, v in errors.most_common()))
        for e in examples:
            lines.append(f"  row {e.row} (id {e.id}): {e.type}: {e.message}")
    return "\n".join(lines)
