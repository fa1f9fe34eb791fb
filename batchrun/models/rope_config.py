"""The rotary settings of a config.json beyond the rope type: how many dims of a head rotate
(`partial_rotary_factor`), LongRoPE's and YaRN's parameters, read as transformers 5 reads them
(`modeling_rope_utils.py`). What differs by architecture comes from its spec (models/spec.py):
whether it rotates part of a head, its rope aliases, LongRoPE's default original length."""

from __future__ import annotations

import math
from typing import Any

from batchrun.errors import ModelConfigError


def rotary_dim(
    raw: dict[str, Any],
    rope: dict[str, Any],
    arch: str,
    head_dim: int,
    source: str,
    partial: tuple[str, ...] = (),
) -> int:
    """The dims of each head that rotate: head_dim * partial_rotary_factor (the rope parameters'
    or the top-level field), the first ones; the rest pass through. `partial`: the architectures
    that rotate part of a head (`arch` among them, or the factor is refused)."""
    factor = rope.get("partial_rotary_factor", raw.get("partial_rotary_factor"))
    if factor is None or float(factor) == 1.0:
        return head_dim
    factor = float(factor)
    if arch not in partial:
        raise ModelConfigError(
            f"{source}: partial_rotary_factor {factor} is not supported for {arch} (its "
            f"attention rotates the whole head); supported for {', '.join(sorted(partial))}"
        )
    dim = int(head_dim * factor)
    if not 0.0 < factor < 1.0 or dim < 2 or dim % 2:
        raise ModelConfigError(
            f"{source}: partial_rotary_factor {factor} gives {dim} rotary dims of head_dim "
            f"{head_dim}; supported: a factor in (0, 1] giving an even number of dims"
        )
    return dim


def longrope_parameters(
    raw: dict[str, Any],
    rope: dict[str, Any],
    rotary: int,
    max_pos: int,
    source: str,
    original_default: int | None = None,
) -> dict[str, Any]:
    """`rope` with LongRoPE's numbers resolved: short_factor and long_factor (rotary // 2 floats
    each), original_max_position_embeddings (config.json's top-level field first, as transformers
    gives it priority, else `original_default` where the architecture has one, else the rope
    parameters', else max_position_embeddings), and the
    attention_factor that scales cos and sin (given, else sqrt(1 + ln(factor) / ln(original))
    for a factor > 1, the factor being given or max_position_embeddings / original)."""
    out = dict(rope)
    for key in ("short_factor", "long_factor"):
        values = rope.get(key)
        if not isinstance(values, list) or not all(
            isinstance(v, (int, float)) and not isinstance(v, bool) for v in values
        ):
            raise ModelConfigError(
                f"{source}: rope type 'longrope' needs {key}, a list of {rotary // 2} numbers "
                f"(one per rotary frequency); the file has {key} {_short(values)}"
            )
        if len(values) != rotary // 2:
            raise ModelConfigError(
                f"{source}: longrope {key} has {len(values)} numbers; the model rotates "
                f"{rotary} dims of each head, which needs {rotary // 2}"
            )
        out[key] = [float(v) for v in values]
    original = raw.get("original_max_position_embeddings")
    if original is None:
        fallback = rope.get("original_max_position_embeddings", max_pos)
        original = fallback if original_default is None else original_default
    original = int(original)
    if original <= 0:
        raise ModelConfigError(
            f"{source}: original_max_position_embeddings {original} must be positive"
        )
    out["original_max_position_embeddings"] = original
    factor = rope.get("factor")
    factor = float(factor) if factor is not None else max_pos / original
    attention_factor = rope.get("attention_factor")
    if attention_factor is None:
        attention_factor = (
            1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
        )
    out["attention_factor"] = float(attention_factor)
    return out


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def yarn_parameters(
    raw: dict[str, Any], rope: dict[str, Any], max_pos: int, source: str
) -> dict[str, Any]:
    """`rope` with YaRN's numbers resolved as transformers' _compute_yarn_parameters takes them:
    original_max_position_embeddings (config.json's top-level field first, else the rope
    parameters', else max_position_embeddings), factor (given, else max_position_embeddings /
    original), beta_fast (32) and beta_slow (1) where absent or 0, truncate (true unless
    given), and attention_factor, the scale of cos and sin: given, else
    mscale(factor, mscale) / mscale(factor, mscale_all_dim) where both are given, else
    mscale(factor) (0.1 * ln(factor) + 1 for a factor > 1)."""
    out = dict(rope)
    original = raw.get("original_max_position_embeddings")
    if original is None:
        original = rope.get("original_max_position_embeddings", max_pos)
    original = int(original)
    if original <= 0:
        raise ModelConfigError(
            f"{source}: original_max_position_embeddings {original} must be positive"
        )
    factor = rope.get("factor")
    factor = float(factor) if factor is not None else max_pos / original
    if factor < 1.0:
        raise ModelConfigError(f"{source}: yarn factor {factor} must be >= 1")
    attention_factor = rope.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = rope.get("mscale"), rope.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = _mscale(factor, mscale) / _mscale(factor, mscale_all_dim)
        else:
            attention_factor = _mscale(factor)
    out.update(
        original_max_position_embeddings=original,
        factor=factor,
        beta_fast=float(rope.get("beta_fast") or 32),
        beta_slow=float(rope.get("beta_slow") or 1),
        truncate=bool(rope.get("truncate", True)),
        attention_factor=float(attention_factor),
    )
    return out


def _mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0
