"""load_pooling_model: a model directory -> a PoolingModel that tokenizes rows as
sentence-transformers / transformers do and runs packed batches of them.

    architecture                          kind      tasks             default
    an encoder's base model (BERT, ...)   encoder   embed             embed
    its ...ForSequenceClassification      encoder   score, rerank,    score
    (models/registry.py ENCODERS)                   classify
    <decoder>Model (Qwen3Model, ...)      decoder   embed             embed
    <decoder>ForSequenceClassification    decoder   classify, score   classify
    <decoder>ForCausalLM                  decoder   rerank, score     generate (yes/no reranker
                                                    (Qwen3-Reranker)  with --task rerank)
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from batchrun.errors import ModelConfigError
from batchrun.models.registry import ARCHITECTURES, ENCODERS
from batchrun.pooling.decoder import causal_architecture, load_decoder
from batchrun.pooling.heads import finish_embeddings, pool, scores, yes_no_score
from batchrun.pooling.layout import POOLING_MODES, PoolingSpec, read_layout
from batchrun.pooling.shared_prefix import PrefixPlan, plan_shared_prefixes

log = logging.getLogger(__name__)

# a classification head's output rows, one per label
_HEAD_TENSORS = ("score.weight", "classifier.weight", "classifier.out_proj.weight")
# Qwen3-Reranker's documented prompt around "<Instruct>: ...\n<Query>: ...\n<Document>: ..."
RERANK_PREFIX = (
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query "
    'and the Instruct provided. Note that the answer can only be "yes" or "no".<|im_end|>\n'
    "<|im_start|>user\n"
)
RERANK_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
RERANK_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"


@dataclass(frozen=True)
class TokenRow:
    input_ids: tuple[int, ...]
    token_type_ids: tuple[int, ...] | None = None
    truncated: bool = False  # the text was longer than max_seq_length and was cut


class RowTokenizer:
    """A row's texts -> TokenRow, as sentence-transformers and transformers tokenize them:
    special tokens added, truncated to `max_len` (counted in TokenRow.truncated)."""

    def __init__(self, tokenizer, max_len: int, kind: str):
        self.tokenizer, self.max_len, self.kind = tokenizer, max_len, kind

    def tokenize(self, text: str, pair: str | None = None, prompt: str | None = None) -> TokenRow:
        """`text` (and a second text for a cross-encoder) truncated to max_seq_length;
        `prompt` (an instruction, a prompt of the folder's) goes before the text, as
        sentence-transformers puts it."""
        if prompt:
            text = prompt + text
        if not text or (pair is not None and not pair):
            raise ValueError("an empty text: nothing to embed or score")
        enc = self.tokenizer(text, pair, truncation=False)
        truncated = len(enc["input_ids"]) > self.max_len
        if truncated:  # cut as sentence-transformers does (the longest text first)
            enc = self.tokenizer(text, pair, truncation=True, max_length=self.max_len)
        types = enc.get("token_type_ids") if self.kind == "encoder" else None
        return TokenRow(tuple(enc["input_ids"]), None if types is None else tuple(types), truncated)

    def tokenize_yes_no(self, query: str, document: str, instruction: str | None) -> TokenRow:
        """Qwen3-Reranker's prompt of (query, document), the pair cut to fit as its card does."""
        tok = self.tokenizer
        prefix = tok.encode(RERANK_PREFIX, add_special_tokens=False)
        suffix = tok.encode(RERANK_SUFFIX, add_special_tokens=False)
        body = (
            f"<Instruct>: {instruction or RERANK_INSTRUCTION}\n<Query>: {query}\n"
            f"<Document>: {document}"
        )
        ids = tok.encode(body, add_special_tokens=False)
        room = self.max_len - len(prefix) - len(suffix)
        return TokenRow(tuple(prefix + ids[:room] + suffix), truncated=len(ids) > room)


class PoolingModel:
    """One model's prefill-only forward: `hidden(rows)` -> packed hidden states, and what each
    task makes of them (`embed`, `classify_logits`, `yes_no`)."""

    def __init__(self, net, kind: str, head: str, spec: PoolingSpec, tokenizer, max_len: int,
                 device: str, labels: tuple[str, ...], hidden_size: int):  # fmt: skip
        self.net, self.kind, self.head, self.spec = net, kind, head, spec
        self.hidden_size = hidden_size
        self.tokenizer, self.max_len, self.device, self.labels = tokenizer, max_len, device, labels
        self.row_tokenizer = RowTokenizer(tokenizer, max_len, kind)

    def tokenize(self, text: str, pair: str | None = None, prompt: str | None = None) -> TokenRow:
        return self.row_tokenizer.tokenize(text, pair, prompt)

    def tokenize_yes_no(self, query: str, document: str, instruction: str | None) -> TokenRow:
        return self.row_tokenizer.tokenize_yes_no(query, document, instruction)

    def prompt(self, name: str) -> str:
        """The folder's prompt `name` (config_sentence_transformers.json's prompts)."""
        if name not in self.spec.prompts:
            have = ", ".join(self.spec.prompts) or "none"
            raise ModelConfigError(f"prompt {name!r} is not one of the model's prompts ({have})")
        return self.spec.prompts[name]

    # --- the forward
    def shares_prefixes(self, task: str, pooling: str | None = None) -> bool:
        """Whether a step computes its sequences' shared prefixes once: a causal model whose
        result reads the last token only (pooling/shared_prefix.py)."""
        if self.kind != "decoder":
            return False
        return task != "embed" or (pooling or self.spec.pooling) == "last"

    def plan(self, rows: list[TokenRow], share: bool = True) -> PrefixPlan:
        """A decoder step's packing of `rows`, consecutive shared prefixes once where `share`."""
        return plan_shared_prefixes([r.input_ids for r in rows], share)

    def hidden(self, rows: list[TokenRow]) -> tuple[torch.Tensor, tuple[int, ...]]:
        seq_lens = tuple(len(r.input_ids) for r in rows)
        if self.kind == "decoder":
            return self.net.hidden_states(self.plan(rows, share=False)), seq_lens
        ids = torch.tensor([t for r in rows for t in r.input_ids], device=self.device)
        types = None
        if any(r.token_type_ids is not None for r in rows):
            types = torch.tensor(
                [t for r in rows for t in (r.token_type_ids or (0,) * len(r.input_ids))],
                device=self.device,
            )
        return self.net.hidden_states(ids, seq_lens, types), seq_lens

    def last_hidden(self, rows: list[TokenRow], plan: PrefixPlan | None = None) -> torch.Tensor:
        """A decoder's final hidden state [B, hidden] at each row's last token, by `plan` (each
        row alone if None)."""
        plan = plan or self.plan(rows, share=False)
        last = torch.tensor(plan.last_rows, device=self.device)
        return self.net.hidden_states(plan)[last]

    def embed(
        self,
        rows: list[TokenRow],
        pooling: str | None = None,
        normalize: bool | None = None,
        dimensions: int | None = None,
        plan: PrefixPlan | None = None,
    ) -> torch.Tensor:
        """[B, D] fp32: pooled by `pooling` (the folder's by default), normalized as the folder
        says unless `normalize` is given; a decoder's last-token vectors by `plan` if given."""
        mode = pooling or self.spec.pooling
        if mode is None:
            raise ModelConfigError(
                "the model folder gives no pooling (no sentence-transformers modules.json with a "
                f"Pooling module): pass --pooling ({', '.join(POOLING_MODES)})"
            )
        if self.kind == "decoder" and mode == "last":
            vectors = self.last_hidden(rows, plan).float()
        else:
            hidden, seq_lens = self.hidden(rows)
            vectors = pool(hidden, seq_lens, mode)
        norm = self.spec.normalize if normalize is None else normalize
        return finish_embeddings(vectors, norm, dimensions)

    def classify_logits(self, rows: list[TokenRow], plan: PrefixPlan | None = None):
        """The classification head's logits [B, num_labels], fp32."""
        if self.kind == "decoder":
            return self.net.classify(self.last_hidden(rows, plan)).float()
        hidden, seq_lens = self.hidden(rows)
        return self.net.classify(hidden, seq_lens).float()

    def scores(
        self, rows: list[TokenRow], raw: bool = False, plan: PrefixPlan | None = None
    ) -> torch.Tensor:
        """A cross-encoder's or a yes/no reranker's score per row [B] (CrossEncoder.predict's)."""
        if self.head == "lm":
            return self.yes_no(rows, plan)
        return scores(self.classify_logits(rows, plan), raw)

    def yes_no(self, rows: list[TokenRow], plan: PrefixPlan | None = None) -> torch.Tensor:
        tok = self.tokenizer
        ids = (tok.convert_tokens_to_ids("no"), tok.convert_tokens_to_ids("yes"))
        logits = self.net.token_logits(self.last_hidden(rows, plan), ids)
        return yes_no_score(logits[:, 0], logits[:, 1])


def load_pooling_model(
    model_dir: str | Path,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    load_format: str = "auto",
) -> PoolingModel:
    from transformers import AutoTokenizer

    model_dir = Path(model_dir)
    raw = json.loads((model_dir / "config.json").read_text())
    arch = (raw.get("architectures") or [""])[0]
    spec = read_layout(model_dir)
    labels = _labels(raw, model_dir, load_format)
    encoder = ENCODERS.get(arch)
    if encoder is not None:
        num_labels = len(labels) if encoder.head == "classify" else 0
        net = encoder.build(raw, num_labels, str(model_dir))
        _load_encoder(net, model_dir, load_format, dtype, device, encoder.checkpoint_prefix)
        kind, head, model_max = "encoder", encoder.head, net.config.max_tokens
    elif causal_architecture(arch) is not None:
        net, dcfg = load_decoder(model_dir, raw, arch, len(labels), dtype, device, load_format)
        kind, head, model_max = (
            "decoder",
            causal_architecture(arch)[1],
            dcfg.max_position_embeddings,
        )
    else:
        raise ModelConfigError(
            f"{model_dir}: architecture {arch or '(none)'} is not supported for embed / rerank / "
            f"score / classify; supported: the encoders {', '.join(ENCODERS)}, and the "
            "decoders' <Arch>Model, "
            "<Arch>ForSequenceClassification and <Arch>ForCausalLM (a yes/no reranker) for "
            f"{', '.join(sorted({a.removesuffix('ForCausalLM') for a in _decoders()}))}"
        )
    if spec.other_heads:
        log.info(
            "%s: %s not run: batchrun gives the dense vectors only (no sparse or multi-vector "
            "output)", model_dir, ", ".join(spec.other_heads),
        )  # fmt: skip
    max_len = min(spec.max_seq_length or model_max, model_max)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    hidden = int(raw["hidden_size"])
    return PoolingModel(net, kind, head, spec, tokenizer, max_len, device, labels, hidden)


def _decoders() -> tuple[str, ...]:
    return tuple(a for a in ARCHITECTURES if a.endswith("ForCausalLM"))


def _labels(raw: dict[str, Any], model_dir: Path, load_format: str) -> tuple[str, ...]:
    """The head's label names in index order: config.json's id2label, else as many as the
    checkpoint's head has rows (transformers leaves the default two labels out of config.json)."""
    from batchrun.models.checkpoint import Checkpoint

    id2label = raw.get("id2label") or {}
    n = int(raw.get("num_labels") or len(id2label) or 0)
    if not n and load_format != "dummy":
        with Checkpoint(model_dir) as ckpt:
            heads = [h for h in _HEAD_TENSORS if h in ckpt]
            n = ckpt.get(heads[0]).shape[0] if heads else 1
    return tuple(str(id2label.get(str(i), f"LABEL_{i}")) for i in range(n or 1))


def _load_encoder(net: nn.Module, model_dir: Path, load_format: str, dtype, device,
                  prefix: str) -> None:  # fmt: skip
    """The encoder's weights from the folder's safetensors (their names less `prefix`), or
    random ones with load_format dummy."""
    from safetensors.torch import load_file

    from batchrun.models.checkpoint import safetensors_files
    from batchrun.models.dummy import init_dummy_
    from batchrun.models.loader import WeightLoadError

    net.to_empty(device=device).to(dtype)
    if load_format == "dummy":
        init_dummy_(net, "normal", seed=0)
        return
    state: dict[str, torch.Tensor] = {}
    for path in safetensors_files(model_dir):
        for name, t in load_file(str(path)).items():
            state[name.removeprefix(prefix)] = t
    ours = net.state_dict()
    missing = [n for n in ours if n not in state]
    if missing:
        raise WeightLoadError(
            f"{model_dir}: checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}; the "
            "safetensors files are incomplete or belong to another model"
        )
    net.load_state_dict({n: state[n] for n in ours}, strict=True)
    net.eval()
