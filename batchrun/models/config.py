"""ModelConfig: the numbers the Llama-family decoder needs, read from an HF config.json, and the
quantization its checkpoint is stored in (batchrun/quant/formats)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from batchrun.errors import ModelConfigError
from batchrun.models.gemma_config import GEMMA3_ARCHITECTURES, Gemma3Text, parse_gemma3
from batchrun.models.gptoss_config import GPT_OSS, GptOss, parse_gpt_oss
from batchrun.models.moe_config import MoeConfig, gpt_oss_experts, parse_moe
from batchrun.models.rope_config import (
    canonical_rope_type,
    longrope_parameters,
    rotary_dim,
    yarn_parameters,
)
from batchrun.quant.formats import Scheme, parse_quant_config

# architecture name in config.json -> (qkv bias by default, q/k RMSNorm)
SUPPORTED_ARCHITECTURES: dict[str, tuple[bool, bool]] = {
    "LlamaForCausalLM": (False, False),
    "MistralForCausalLM": (False, False),
    "Qwen2ForCausalLM": (True, False),
    "Qwen3ForCausalLM": (False, True),
    # mixtures of experts (models/moe_config.py)
    "Qwen2MoeForCausalLM": (True, False),
    "Qwen3MoeForCausalLM": (False, True),
    "MixtralForCausalLM": (False, False),
    # Phi-3 / Phi-4: checkpoints with fused qkv_proj and gate_up_proj (loader.py), partial
    # rotary and LongRoPE (rope_config.py)
    "Phi3ForCausalLM": (False, False),
    # Gemma 3 (models/gemma_config.py): the text model of either
    "Gemma3ForCausalLM": (False, True),
    "Gemma3ForConditionalGeneration": (False, True),
    # gpt-oss (models/gptoss_config.py): attention sinks, sliding and full layers, biased experts
    GPT_OSS: (True, False),
}
# architectures whose layers have no biases, whatever attention_bias / mlp_bias say
# (transformers' Phi3Attention and Phi3MLP)
NO_BIAS = frozenset({"Phi3ForCausalLM"})
# architectures whose attention_bias also gives o_proj a bias (transformers' modeling files);
# the others' attention_bias is on q, k and v only
O_PROJ_BIAS = frozenset({"LlamaForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM", GPT_OSS})
# model_type -> the architecture batchrun runs for it when config.json lists no architectures
# (what transformers' AutoModelForCausalLM does)
MODEL_TYPES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "gemma3": "Gemma3ForConditionalGeneration",
    "gpt_oss": GPT_OSS,
}
# architectures whose every layer attends within config.json's sliding_window unless it is null
WINDOWED = ("MistralForCausalLM", "MixtralForCausalLM", "Phi3ForCausalLM")
# architectures with a window only where use_sliding_window is true (_sliding_windows says on
# which layers)
WINDOW_IF_USED = (
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen2MoeForCausalLM",
    "Qwen3MoeForCausalLM",
)
# "dynamic": NTK scaling, in effect only past max_position_embeddings, which batchrun does not
# serve (batchrun/models/context.py)
SUPPORTED_ROPE_TYPES = ("default", "llama3", "linear", "longrope", "yarn", "dynamic")
REQUIRED_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
)


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False  # o_proj's bias (O_PROJ_BIAS architectures with attention_bias)
    qk_norm: bool = False
    mlp_bias: bool = False
    rope_scaling: dict[str, Any] = field(default_factory=dict)  # rope_type + its parameters
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    torch_dtype: str | None = None
    # how the checkpoint's decoder linears are quantized (config.json's quantization_config, or
    # --quantization); None: plain weights
    quantization: Scheme | None = None
    # the experts of a mixture-of-experts model (models/moe_config.py); None: a dense model
    moe: MoeConfig | None = None
    # each layer's sliding window (attention over the last W positions; 0: the whole context);
    # empty: every layer attends over the whole context
    sliding_windows: tuple[int, ...] = ()
    # the dims of each head that rotate, the first ones (head_dim * partial_rotary_factor); 0:
    # the whole head
    partial_rotary_dim: int = 0
    # the gated MLP's activation: silu (SwiGLU) or gelu_pytorch_tanh (Gemma 3)
    hidden_act: str = "silu"
    # Gemma 3: the embeddings times sqrt(hidden_size) (in the model's dtype); every RMSNorm
    # weight stored as its offset from 1 (the loader adds the 1); the attention's output and the
    # MLP's normed before their residual adds, and the MLP's input by a norm of its own
    # (pre_feedforward_layernorm); scaling query_pre_attn_scalar ** -0.5 (None: head_dim's);
    # the sliding layers' rotary base (default rope; None: every layer uses rope_theta's)
    embed_scale: bool = False
    norm_plus_one: bool = False
    sandwich_norms: bool = False
    query_pre_attn_scalar: float | None = None
    local_rope_theta: float | None = None
    # gpt-oss: a learned logit per head in each softmax's denominator (self_attn.sinks)
    attention_sinks: bool = False

    @property
    def rotary_dim(self) -> int:
        return self.partial_rotary_dim or self.head_dim

    def window(self, layer_id: int) -> int:
        """Layer layer_id's sliding window, 0 for the whole context."""
        return self.sliding_windows[layer_id] if self.sliding_windows else 0

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "config.json") -> ModelConfig:
        arch = _architecture(raw, source)
        gemma: Gemma3Text | None = None
        if arch in GEMMA3_ARCHITECTURES:
            gemma = parse_gemma3(raw, arch, source)
            raw = gemma.raw
        gpt_oss: GptOss | None = None
        if arch == GPT_OSS:
            gpt_oss = parse_gpt_oss(raw, source)
            raw = gpt_oss.raw
        missing = [k for k in REQUIRED_FIELDS if raw.get(k) is None]
        if missing:
            raise ModelConfigError(
                f"{source} ({_what_it_has(raw)}) lacks {', '.join(missing)}; a Hugging Face "
                "config.json of the model (as saved with the weights) has them"
            )
        act_field = "hidden_activation" if gemma is not None else "hidden_act"
        act = raw.get(act_field) or raw.get("hidden_act") or "silu"
        allowed = ("gelu_pytorch_tanh",) if gemma is not None else ("silu",)
        if act not in allowed:
            raise ModelConfigError(
                f"{source}: {act_field} {act!r} is not supported for {arch} (supported: "
                f"{', '.join(allowed)})"
            )
        default_bias, qk_norm = SUPPORTED_ARCHITECTURES[arch]
        num_heads = int(raw["num_attention_heads"])
        hidden = int(raw["hidden_size"])
        head_dim = int(raw.get("head_dim") or hidden // num_heads)
        rope = _rope_parameters(raw, arch, source)
        rotary = rotary_dim(raw, rope, arch, head_dim, source)
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        max_pos = int(raw.get("max_position_embeddings", 4096))
        if rope["rope_type"] == "longrope":
            rope = longrope_parameters(raw, rope, arch, rotary, max_pos, source)
        elif rope["rope_type"] == "yarn":
            rope = yarn_parameters(raw, rope, max_pos, source)
        num_layers = int(raw["num_hidden_layers"])
        if gemma is not None:
            windows = gemma.sliding_windows
        elif gpt_oss is not None:
            windows = gpt_oss.sliding_windows
        else:
            windows = _sliding_windows(raw, arch, num_layers, max_pos, source)
        moe = parse_moe(raw, arch, num_layers, source)
        if gpt_oss is not None and moe is not None:
            moe = gpt_oss_experts(moe, gpt_oss)
        quantization = parse_quant_config(raw, source)
        if gemma is not None and quantization is not None:
            raise ModelConfigError(
                f"{source}: a quantized Gemma 3 checkpoint ({quantization.describe()}) is not "
                "supported: batchrun runs Gemma 3 from bf16 / fp16 / fp32 weights"
            )
        # NOTE: transformers 5 writes Qwen2-MoE's qkv bias as qkv_bias
        bias = raw.get("attention_bias", raw.get("qkv_bias", default_bias))
        bias = bias and arch not in NO_BIAS
        return cls(
            architecture=arch,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
            head_dim=head_dim,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope.get("rope_theta", 10000.0)),
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=bool(bias),
            o_bias=bool(bias) and arch in O_PROJ_BIAS,
            qk_norm=qk_norm,
            mlp_bias=bool(raw.get("mlp_bias", False)) and arch not in NO_BIAS,
            rope_scaling={k: v for k, v in rope.items() if k != "rope_theta"},
            eos_token_ids=eos_ids,
            bos_token_id=raw.get("bos_token_id"),
            torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
            quantization=quantization,
            moe=moe,
            sliding_windows=windows,
            partial_rotary_dim=rotary if rotary != head_dim else 0,
            hidden_act=act,
            attention_sinks=gpt_oss is not None,
            **({} if gemma is None else _gemma_fields(gemma)),
        )

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ModelConfigError(
                f"{path} not found: --model must be a Hugging Face model directory with "
                "config.json and *.safetensors (or a .gguf file)"
            )
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ModelConfigError(f"{path}: not valid JSON ({e})") from None
        try:
            return cls.from_dict(raw, str(path))
        except (KeyError, TypeError, ValueError) as e:
            if isinstance(e, ModelConfigError):
                raise
            what = f"lacks the field {e}" if isinstance(e, KeyError) else f"has a bad value ({e})"
            raise ModelConfigError(f"{path} {what}; is it a Hugging Face config.json?") from None


def _gemma_fields(gemma: Gemma3Text) -> dict[str, Any]:
    return dict(
        embed_scale=True,
        norm_plus_one=True,
        sandwich_norms=True,
        query_pre_attn_scalar=gemma.query_pre_attn_scalar,
        local_rope_theta=gemma.local_rope_theta,
    )


def _architecture(raw: dict[str, Any], source: str) -> str:
    archs = raw.get("architectures") or []
    arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None and not archs:
        arch = MODEL_TYPES.get(raw.get("model_type"))  # type: ignore[arg-type]
    if arch is None:
        raise ModelConfigError(
            f"{source}: unsupported architecture: the file has {_what_it_has(raw)}; batchrun "
            f"supports the architectures {', '.join(SUPPORTED_ARCHITECTURES)}, or with no "
            f"architectures the model_type {', '.join(MODEL_TYPES)} (Llama 2/3/3.x, Mistral, "
            "Qwen2/2.5, Qwen3, SmolLM, Qwen3-MoE, Qwen1.5/2-MoE, Mixtral, Phi-3, Phi-4, Gemma 3, "
            "gpt-oss)"
        )
    return arch


def _sliding_windows(
    raw: dict[str, Any], arch: str, num_layers: int, max_pos: int, source: str
) -> tuple[int, ...]:
    """Each layer's sliding window as transformers' modeling files apply config.json (empty:
    none anywhere). Mistral and Mixtral: sliding_window on every layer unless it is null. The
    Qwen architectures only with use_sliding_window true: the layers its layer_types names
    "sliding_attention" (transformers 5 writes them), else Qwen2 / Qwen3 the layers at index
    >= max_window_layers, Qwen2-MoE the even layers below max_window_layers, Qwen3-MoE every
    layer. Phi-3: sliding_window on every layer unless it is null. Llama has no window
    (transformers ignores the keys there). A window of max_position_embeddings or more
    (Phi-3-medium-128k's 131072, Phi-4-mini's 262144) leaves out no key of a sequence that fits
    the model: none."""
    # NOTE: transformers' default where config.json lacks the key: 4096, Mixtral's and Phi-3's
    # null
    no_default = ("MixtralForCausalLM", "Phi3ForCausalLM")
    window = raw.get("sliding_window", None if arch in no_default else 4096)
    if arch in WINDOWED:
        used = window is not None
    else:
        used = arch in WINDOW_IF_USED and bool(raw.get("use_sliding_window")) and bool(window)
    if not used:
        return ()
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ModelConfigError(
            f"{source}: sliding_window {window!r} is not a positive whole number of tokens; "
            "supported: a window of 1 or more, or null for none"
        )
    if window >= max_pos:
        return ()
    max_window_layers = int(raw.get("max_window_layers", 28))
    layer_types = raw.get("layer_types")
    if arch in WINDOW_IF_USED and arch != "Qwen3MoeForCausalLM" and layer_types is not None:
        if len(layer_types) != num_layers:
            raise ModelConfigError(
                f"{source}: layer_types has {len(layer_types)} entries for "
                f"num_hidden_layers {num_layers}; it needs one a layer"
            )
        windowed = [t == "sliding_attention" for t in layer_types]
    elif arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        windowed = [i >= max_window_layers for i in range(num_layers)]
    elif arch == "Qwen2MoeForCausalLM":
        windowed = [i % 2 == 0 and i < max_window_layers for i in range(num_layers)]
    else:
        windowed = [True] * num_layers
    if not any(windowed):
        return ()
    return tuple(window if w else 0 for w in windowed)


def _what_it_has(raw: dict[str, Any]) -> str:
    has = []
    if raw.get("architectures"):
        has.append(f"architectures {raw['architectures']}")
    if raw.get("model_type") is not None:
        has.append(f"model_type {raw['model_type']!r}")
    return " and ".join(has) or "neither architectures nor model_type"


def _rope_parameters(raw: dict[str, Any], arch: str, source: str) -> dict[str, Any]:
    """Merge the transformers 4 (`rope_theta` + `rope_scaling`) and 5 (`rope_parameters`) forms."""
    params: dict[str, Any] = {}
    if "rope_theta" in raw:
        params["rope_theta"] = raw["rope_theta"]
    for key in ("rope_scaling", "rope_parameters"):
        if isinstance(raw.get(key), dict):
            params.update(raw[key])
    rope_type = params.pop("type", None) or params.get("rope_type") or "default"
    params["rope_type"] = rope_type = canonical_rope_type(rope_type, arch)
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelConfigError(
            f"{source}: rope type {rope_type!r} is not supported; "
            f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    return params
