"""Which layers of a decoder attend within a sliding window, read from config.json as
transformers' modeling files apply it. An architecture's spec (models/spec.py) picks its rule
with `sliding_windows`' keywords."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from batchrun.errors import ModelConfigError

# transformers' max_window_layers where config.json lacks it
MAX_WINDOW_LAYERS = 28


def checked_window(window: Any, source: str) -> int:
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ModelConfigError(
            f"{source}: sliding_window {window!r} is not a positive whole number of tokens; "
            "supported: a window of 1 or more, or null for none"
        )
    return window


def from_max_window_layers(raw: dict[str, Any], num_layers: int) -> list[bool]:
    """The layers at index >= max_window_layers slide."""
    first = int(raw.get("max_window_layers", MAX_WINDOW_LAYERS))
    return [i >= first for i in range(num_layers)]


def sliding_windows(
    raw: dict[str, Any],
    num_layers: int,
    max_pos: int,
    source: str,
    *,
    default: int | None = None,
    if_used: bool = False,
    layer_types: bool = False,
    windowed: Callable[[dict[str, Any], int], list[bool]] | None = None,
) -> tuple[int, ...]:
    """Each layer's window (empty: none anywhere). `default`: transformers' sliding_window where
    config.json lacks the key. `if_used`: a window only with use_sliding_window true (else:
    unless sliding_window is null). Which layers: those config.json's layer_types names
    "sliding_attention" when `layer_types` and the file has them (transformers 5 writes them),
    else `windowed`'s, else every layer. A window of max_position_embeddings or more leaves out
    no key of a sequence that fits the model: none."""
    window = raw.get("sliding_window", default)
    if if_used:
        used = bool(raw.get("use_sliding_window")) and bool(window)
    else:
        used = window is not None
    if not used:
        return ()
    window = checked_window(window, source)
    if window >= max_pos:
        return ()
    types = raw.get("layer_types") if layer_types else None
    if types is not None:
        if len(types) != num_layers:
            raise ModelConfigError(
                f"{source}: layer_types has {len(types)} entries for "
                f"num_hidden_layers {num_layers}; it needs one a layer"
            )
        flags = [t == "sliding_attention" for t in types]
    elif windowed is not None:
        flags = windowed(raw, num_layers)
    else:
        flags = [True] * num_layers
    if not any(flags):
        return ()
    return tuple(window if w else 0 for w in flags)
