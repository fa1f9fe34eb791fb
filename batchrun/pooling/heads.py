"""What a pooled model's hidden states become: a vector per sequence (mean / CLS / last-token
pooling, L2 normalization, Matryoshka truncation) or scores (a classification head's logits as
sentence-transformers' CrossEncoder.predict gives them)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def seq_starts(seq_lens: tuple[int, ...], device) -> torch.Tensor:
    """Where each packed sequence begins [B]."""
    return torch.tensor((0, *seq_lens[:-1]), device=device).cumsum(0)


def last_indices(seq_lens: tuple[int, ...], device) -> torch.Tensor:
    """Each packed sequence's last token [B]."""
    return torch.tensor(seq_lens, device=device).cumsum(0) - 1


def pool(hidden: torch.Tensor, seq_lens: tuple[int, ...], mode: str) -> torch.Tensor:
    """[B, hidden] from the packed hidden states [T, hidden], in fp32."""
    if mode == "cls":
        return hidden[seq_starts(seq_lens, hidden.device)].float()
    if mode == "last":
        return hidden[last_indices(seq_lens, hidden.device)].float()
    if mode == "mean":
        seq_ids = torch.repeat_interleave(
            torch.arange(len(seq_lens), device=hidden.device),
            torch.tensor(seq_lens, device=hidden.device),
        )
        sums = torch.zeros(len(seq_lens), hidden.shape[1], device=hidden.device)
        sums.index_add_(0, seq_ids, hidden.float())
        return sums / torch.tensor(seq_lens, device=hidden.device, dtype=torch.float32)[:, None]
    raise ValueError(f"pooling {mode!r}; supported: mean, cls, last")


def finish_embeddings(vectors: torch.Tensor, normalize: bool, dimensions: int | None):
    """The first `dimensions` of each vector (all if None), L2-normalized where asked."""
    if dimensions is not None:
        vectors = vectors[:, :dimensions]
    return F.normalize(vectors, p=2.0, dim=-1) if normalize else vectors


def scores(logits: torch.Tensor, raw: bool) -> torch.Tensor:
    """CrossEncoder.predict's scores of a head's logits [B, L]: the sigmoid of a one-label head,
    the logits of a wider one (and `raw` logits either way)."""
    logits = logits.float()
    if logits.shape[1] == 1:
        return logits[:, 0] if raw else torch.sigmoid(logits[:, 0])
    return logits


def yes_no_score(logits_no: torch.Tensor, logits_yes: torch.Tensor) -> torch.Tensor:
    """Qwen3-Reranker's score: P(yes) of the two-way softmax over the 'no' and 'yes' logits."""
    pair = torch.stack([logits_no.float(), logits_yes.float()], dim=1)
    return torch.softmax(pair, dim=1)[:, 1]
