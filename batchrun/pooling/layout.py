"""How a model directory says to pool: the sentence-transformers layout (modules.json, its
Pooling and Normalize modules, sentence_bert_config.json's max_seq_length,
config_sentence_transformers.json's prompts), read into a frozen PoolingSpec.

A module batchrun does not run (Dense, a sparse or multi-vector head, ...) is refused by name;
so is a pooling mode other than mean / CLS / last token."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from batchrun.errors import ModelConfigError

POOLING_MODES = ("mean", "cls", "last")
# sentence-transformers' names of a pooling mode -> ours
_MODE_NAMES = {"mean": "mean", "cls": "cls", "lasttoken": "last", "last": "last"}
# the pre-v5 Pooling config's flags -> ours
_MODE_FLAGS = {
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_cls_token": "cls",
    "pooling_mode_lasttoken": "last",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len",
    "pooling_mode_weightedmean_tokens": "weightedmean",
}
_RUN_MODULES = ("Transformer", "Pooling", "Normalize")
# bge-m3's sparse and multi-vector heads, beside its dense model: batchrun gives the dense vector
OTHER_HEADS = ("sparse_linear.pt", "colbert_linear.pt")


@dataclass(frozen=True)
class PoolingSpec:
    pooling: str | None  # mean / cls / last; None: the folder does not say
    normalize: bool  # a Normalize module follows the pooling
    max_seq_length: int | None  # sentence-transformers' truncation length; None: the model's
    prompts: dict[str, str] = field(default_factory=dict)  # prompt name -> its text
    default_prompt_name: str | None = None
    is_sentence_transformers: bool = False
    # heads in the folder that batchrun does not run (bge-m3's sparse / multi-vector), for the
    # start-up log: the vectors are the dense ones
    other_heads: tuple[str, ...] = ()


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ModelConfigError(f"{path}: not readable JSON ({e})") from None


def _pooling_mode(cfg: dict[str, Any], path: Path) -> str:
    if "pooling_mode" in cfg:
        names = [cfg["pooling_mode"]]
    else:
        names = [mode for flag, mode in _MODE_FLAGS.items() if cfg.get(flag)]
    modes = [_MODE_NAMES.get(n, n) for n in names]
    if len(modes) != 1 or modes[0] not in POOLING_MODES:
        raise ModelConfigError(
            f"{path}: pooling {' + '.join(map(str, names)) or 'none'} is not supported; batchrun "
            f"pools by one of: mean, cls, lasttoken"
        )
    if cfg.get("include_prompt", True) is False:
        raise ModelConfigError(
            f"{path}: include_prompt false (pooling that leaves the prompt's tokens out) is not "
            "supported; batchrun pools over every token, the prompt's included"
        )
    return modes[0]


def read_layout(model_dir: Path) -> PoolingSpec:
    """The folder's PoolingSpec; a folder without modules.json gives no pooling and no
    normalization (the command line or the architecture says)."""
    modules_path = model_dir / "modules.json"
    if not modules_path.is_file():
        return PoolingSpec(pooling=None, normalize=False, max_seq_length=None)
    pooling, normalize = None, False
    for module in json.loads(modules_path.read_text()):
        kind = str(module.get("type", "")).rsplit(".", 1)[-1]
        if kind not in _RUN_MODULES:
            raise ModelConfigError(
                f"{modules_path}: module {module.get('type')!r} is not supported; batchrun runs "
                f"sentence-transformers models made of {', '.join(_RUN_MODULES)} (dense vectors "
                "only: no Dense projection, sparse or multi-vector head)"
            )
        if kind == "Pooling":
            path = model_dir / module.get("path", "") / "config.json"
            pooling = _pooling_mode(_read_json(path), path)
        elif kind == "Normalize":
            normalize = True
        elif module.get("path"):
            raise ModelConfigError(
                f"{modules_path}: the Transformer module lives in {module['path']!r}; batchrun "
                'reads it from the folder itself (path "")'
            )
    st_config = model_dir / "config_sentence_transformers.json"
    st = _read_json(st_config) if st_config.is_file() else {}
    bert_config = model_dir / "sentence_bert_config.json"
    max_len = _read_json(bert_config).get("max_seq_length") if bert_config.is_file() else None
    if max_len is None:
        tok_config = model_dir / "tokenizer_config.json"
        tok_max = _read_json(tok_config).get("model_max_length") if tok_config.is_file() else None
        # NOTE: a tokenizer without a limit writes a huge sentinel (int(1e30))
        max_len = tok_max if isinstance(tok_max, int) and tok_max < 1_000_000 else None
    return PoolingSpec(
        pooling=pooling,
        normalize=normalize,
        max_seq_length=max_len,
        prompts={k: v for k, v in (st.get("prompts") or {}).items() if isinstance(v, str)},
        default_prompt_name=st.get("default_prompt_name"),
        is_sentence_transformers=True,
        other_heads=tuple(h for h in OTHER_HEADS if (model_dir / h).is_file()),
    )
