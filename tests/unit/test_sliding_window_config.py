"""ModelConfig.sliding_windows: each layer's window as transformers 5 applies config.json, for
configs as transformers writes them (with layer_types) and as older hub configs hold them
(without); a window that is off gives none; a window batchrun cannot read is refused."""

from __future__ import annotations

import pytest

from batchrun.models.config import ModelConfig, ModelConfigError

BASE = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=2,
)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)


def _transformers_windows(cls_name: str, **kw) -> tuple[int, ...]:
    """The window of each layer of transformers' model built from this config."""
    import transformers

    cfg = getattr(transformers, cls_name)(**BASE, **kw)
    window = cfg.sliding_window
    types = getattr(cfg, "layer_types", None)
    if cls_name in ("MistralConfig", "MixtralConfig", "Qwen3MoeConfig"):
        # every layer's attention gets config.sliding_window (the modeling files)
        windows = [window or 0] * BASE["num_hidden_layers"]
    else:
        windows = [window if t == "sliding_attention" else 0 for t in types]
    return tuple(windows) if any(windows) else ()


CASES = {
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=8)),
    "mistral-default": ("MistralConfig", "MistralForCausalLM", {}),  # transformers' 4096
    "mistral-null": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=None)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(sliding_window=16)),
    "mixtral-default": ("MixtralConfig", "MixtralForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM",
              dict(use_sliding_window=True, sliding_window=8, max_window_layers=4)),
    "qwen2-all": ("Qwen2Config", "Qwen2ForCausalLM",
                  dict(use_sliding_window=True, sliding_window=8, max_window_layers=0)),
    "qwen2-off": ("Qwen2Config", "Qwen2ForCausalLM", dict(sliding_window=8)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM",
              dict(use_sliding_window=True, sliding_window=32, max_window_layers=2)),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  dict(use_sliding_window=True, sliding_window=8, max_window_layers=5, **MOE)),
    "qwen2_moe-off": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(**MOE)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(use_sliding_window=True, sliding_window=8, **MOE)),
}  # fmt: skip


# what transformers gives, spelled out for some (the comparison above is not vacuous)
EXPECTED = {
    "mistral": (8,) * 6,
    "mistral-default": (4096,) * 6,
    "qwen2": (0, 0, 0, 0, 8, 8),
    "qwen2-off": (),
    "qwen2_moe": (8, 0, 8, 0, 8, 0),
    "qwen3_moe": (8,) * 6,
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("layer_types", [True, False], ids=["written", "hub"])
def test_windows_as_transformers_applies_them(case, layer_types):
    transformers = pytest.importorskip("transformers")

    cls_name, arch, kw = CASES[case]
    want = _transformers_windows(cls_name, **kw)
    assert want == EXPECTED.get(case, want)
    # the config.json transformers writes (layer_types included where it has them) ...
    raw = {**getattr(transformers, cls_name)(**BASE, **kw).to_dict(), "architectures": [arch]}
    if not layer_types:  # ... or a hub config of transformers 4: no layer_types
        raw.pop("layer_types", None)
        if case == "mistral-default":  # nor the key the user left to its default
            raw.pop("sliding_window")
    assert ModelConfig.from_dict(raw).sliding_windows == want, case


def test_llama_has_no_window():
    raw = dict(BASE, architectures=["LlamaForCausalLM"], sliding_window=8,
               use_sliding_window=True)  # fmt: skip
    assert ModelConfig.from_dict(raw).sliding_windows == ()


def test_explicit_layer_types_decide():
    raw = dict(BASE, architectures=["Qwen2ForCausalLM"], sliding_window=8,
               use_sliding_window=True,
               layer_types=["sliding_attention", "full_attention"] * 3)  # fmt: skip
    assert ModelConfig.from_dict(raw).sliding_windows == (8, 0) * 3
    raw["layer_types"] = raw["layer_types"][:4]
    with pytest.raises(ModelConfigError, match="layer_types has 4 entries.*num_hidden_layers 6"):
        ModelConfig.from_dict(raw)


@pytest.mark.parametrize("window", [0, -8, "8", 8.5, True])
def test_a_window_that_is_not_a_count_is_refused(window):
    raw = dict(BASE, architectures=["MistralForCausalLM"], sliding_window=window)
    with pytest.raises(ModelConfigError, match=r"config.json: sliding_window .* is not a positive"):
        ModelConfig.from_dict(raw)
