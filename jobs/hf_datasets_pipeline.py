"""Example: a HuggingFace `datasets` pipeline through batchrun's Python API.

Load a dataset, generate a completion per row, get a `datasets.Dataset` back, save it:

    python jobs/hf_datasets_pipeline.py prompts.jsonl --out runs/completions \\
        --model ~/models/Llama-3.1-8B-Instruct --max-tokens 256
    python jobs/hf_datasets_pipeline.py my_saved_dataset/ --out runs/c --split test
    python jobs/hf_datasets_pipeline.py org/name --out runs/c --prompt-column question  # Hub

On Slurm: `srun --gres=gpu:1 python jobs/hf_datasets_pipeline.py ...`, or inside an sbatch
script. The result is written with `save_to_disk` (and `--parquet FILE` writes a Parquet copy);
read it back with `datasets.load_from_disk`. Nothing resumes here: for big or preemptible runs
use `batchrun submit` (jobs/batchrun-array.sbatch).
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def load(source: str, split: str):
    import datasets

    if os.path.isdir(source):  # a save_to_disk directory
        loaded = datasets.load_from_disk(source)
        return loaded[split] if isinstance(loaded, datasets.DatasetDict) else loaded
    for suffix, builder in (
        (".jsonl", "json"),
        (".json", "json"),
        (".parquet", "parquet"),
        (".csv", "csv"),
        (".jsonl.gz", "json"),
    ):
        if source.endswith(suffix):
            return datasets.load_dataset(builder, data_files=source, split="train")
    return datasets.load_dataset(source, split=split)  # a Hub dataset name


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("source", help=".jsonl / .parquet / .csv file, save_to_disk dir or Hub name")
    p.add_argument("--out", required=True, help="where to save_to_disk the result")
    p.add_argument("--parquet", help="also write the result to this Parquet file")
    p.add_argument("--split", default="train")
    p.add_argument("--prompt-column", default="prompt", help="text prompts ('' for none)")
    p.add_argument("--messages-column", default="messages", help="chat messages ('' for none)")
    p.add_argument("--system-prompt", default=None)
    p.add_argument(
        "--model",
        default=None,
        help="HF dir, .gguf or ORG/NAME in the local hub cache (default: embedded demo model)",
    )
    p.add_argument("--revision", default=None, help="with --model ORG/NAME: branch, tag, commit")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--limit", type=int, default=None, help="first N rows only")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--kv-budget", type=int, default=None, help="KV pool size in tokens")
    args = p.parse_args(argv)

    from batchrun.job.datasets_api import generate_dataset
    from batchrun.params import SamplingParams

    ds = load(args.source, args.split)
    if args.limit is not None:
        ds = ds.select(range(min(args.limit, len(ds))))
    start = time.perf_counter()
    out = generate_dataset(
        ds,
        prompt_column=args.prompt_column or None,
        messages_column=args.messages_column or None,
        system_prompt=args.system_prompt,
        model=args.model,
        revision=args.revision,
        sampling=SamplingParams(
            max_new_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed
        ),
        device=args.device,
        kv_budget=args.kv_budget,
    )
    out.save_to_disk(args.out)
    if args.parquet:
        out.to_parquet(args.parquet)
    num_ok = sum(f != "error" for f in out["finish_reason"])
    print(
        f"{num_ok}/{len(out)} rows, {sum(out['completion_tokens'])} tokens in "
        f"{time.perf_counter() - start:.1f} s -> {args.out}",
        file=sys.stderr,
    )
    return 0 if num_ok == len(out) else 1


if __name__ == "__main__":
    sys.exit(main())
