"""ModelConfig: the description of a model that its blocks are built from, read from an HF
config.json by the architecture's spec (models/registry.py maps `architectures` to it), and the
quantization its checkpoint is stored in (batchrun/quant/formats)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from batchrun.errors import ModelConfigError
from batchrun.models.hybrid_config import LinearAttentionConfig
from batchrun.models.moe_config import MoeConfig
from batchrun.models.rope_config import longrope_parameters, rotary_dim, yarn_parameters
from batchrun.quant.formats import Scheme, parse_quant_config

if TYPE_CHECKING:
    from batchrun.models.spec import ArchSpec

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
    o_bias: bool = False  # o_proj's bias (where the spec's attention_bias covers o_proj)
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
    # the gated MLP's activation: silu (SwiGLU) or gelu_pytorch_tanh
    hidden_act: str = "silu"
    # the embeddings times sqrt(hidden_size) (in the model's dtype); every RMSNorm weight stored
    # as its offset from 1 (the loader adds the 1); sandwich norms: the attention's output and
    # the MLP's normed before their residual adds, and the MLP's input by a norm of its own
    # (pre_feedforward_layernorm); scaling query_pre_attn_scalar ** -0.5 (None: head_dim's);
    # the sliding layers' rotary base (default rope; None: every layer uses rope_theta's)
    embed_scale: bool = False
    norm_plus_one: bool = False
    sandwich_norms: bool = False
    query_pre_attn_scalar: float | None = None
    local_rope_theta: float | None = None
    # a learned logit per head in each softmax's denominator (self_attn.sinks)
    attention_sinks: bool = False
    # a hybrid model's Gated DeltaNet layers (models/hybrid_config.py); None: attention only.
    # attn_output_gate: q_proj also gives a gate per head dim, the attention's output times its
    # sigmoid (q_proj's rows per head: [query | gate])
    linear_attention: LinearAttentionConfig | None = None
    attn_output_gate: bool = False
    # per layer: its head_dim and KV heads (empty: every layer has head_dim and num_kv_heads),
    # and the layer whose KV it attends over (itself where it writes its own; empty: all do)
    layer_head_dims: tuple[int, ...] = ()
    layer_kv_heads: tuple[int, ...] = ()
    kv_sources: tuple[int, ...] = ()
    # the forward runs whole: no piecewise graphs (it carries more than (x, residual) from
    # layer to layer, as Gemma 4's per-layer inputs)
    whole_forward: bool = False
    # elements of a table whose rows the forward gathers by token id and that may live in pinned
    # host memory (KernelPlan.per_layer_table: Gemma 4's per-layer embeddings); 0: none
    host_table_elements: int = 0
    # what only the architecture's own blocks read (a frozen object of its file; None: none)
    arch_options: Any = None

    @property
    def rotary_dim(self) -> int:
        return self.partial_rotary_dim or self.head_dim

    def window(self, layer_id: int) -> int:
        """Layer layer_id's sliding window, 0 for the whole context."""
        return self.sliding_windows[layer_id] if self.sliding_windows else 0

    def head_dim_of(self, layer_id: int) -> int:
        return self.layer_head_dims[layer_id] if self.layer_head_dims else self.head_dim

    def kv_heads_of(self, layer_id: int) -> int:
        return self.layer_kv_heads[layer_id] if self.layer_kv_heads else self.num_kv_heads

    def kv_source(self, layer_id: int) -> int:
        """The layer whose KV layer_id attends over (layer_id where it writes its own)."""
        return self.kv_sources[layer_id] if self.kv_sources else layer_id

    @property
    def max_head_dim(self) -> int:
        """The widest head of any layer (the attention kernels' limit)."""
        return max(self.layer_head_dims or (self.head_dim,))

    @property
    def kv_layers(self) -> tuple[int, ...]:
        """The layers that write KV, in order: the KV pool holds one buffer pair for each. A
        layer that reads another layer's KV writes none, nor does a hybrid's linear-attention
        layer (its state is a recurrent one: engine/state_pool.py)."""
        lin = self.linear_attention
        return tuple(
            i
            for i in range(self.num_layers)
            if self.kv_source(i) == i and (lin is None or not lin.is_linear(i))
        )

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def spec(self) -> ArchSpec:
        """The architecture's spec (models/registry.py)."""
        from batchrun.models.registry import spec_of  # NOTE: the registry imports the blocks

        return spec_of(self.architecture)

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "config.json") -> ModelConfig:
        from batchrun.models.registry import partial_rotary_names, spec_for

        spec = spec_for(raw, source)
        arch, own = spec.name, {}
        if spec.prepare is not None:  # the fields the architecture reads itself
            raw, own = spec.prepare(raw, source)
        missing = [k for k in REQUIRED_FIELDS if raw.get(k) is None]
        if missing:
            raise ModelConfigError(
                f"{source} ({what_it_has(raw)}) lacks {', '.join(missing)}; a Hugging Face "
                "config.json of the model (as saved with the weights) has them"
            )
        act = raw.get(spec.act_field) or raw.get("hidden_act") or "silu"
        if act not in spec.activations:
            raise ModelConfigError(
                f"{source}: {spec.act_field} {act!r} is not supported for {arch} (supported: "
                f"{', '.join(spec.activations)})"
            )
        num_heads = int(raw["num_attention_heads"])
        hidden = int(raw["hidden_size"])
        head_dim = int(raw.get("head_dim") or hidden // num_heads)
        rope = _rope_parameters(raw, spec, source)
        rotary = rotary_dim(raw, rope, arch, head_dim, source, partial_rotary_names())
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        max_pos = int(raw.get("max_position_embeddings", 4096))
        if rope["rope_type"] == "longrope":
            rope = longrope_parameters(raw, rope, rotary, max_pos, source, spec.longrope_original)
        elif rope["rope_type"] == "yarn":
            rope = yarn_parameters(raw, rope, max_pos, source)
        num_layers = int(raw["num_hidden_layers"])
        if "sliding_windows" not in own:
            own["sliding_windows"] = spec.windows(raw, num_layers, max_pos, source)
        if "moe" not in own:
            own["moe"] = spec.moe(raw, num_layers, source)
        quantization = parse_quant_config(raw, source, spec.names.text_name)
        if quantization is not None and not spec.quantizable:
            raise ModelConfigError(
                f"{source}: a quantized {spec.family} checkpoint ({quantization.describe()}) is "
                f"not supported: batchrun runs {spec.family} from bf16 / fp16 / fp32 weights"
            )
        formats = spec.quant_formats
        if quantization is not None and formats is not None:
            key = (quantization.method, quantization.family, quantization.activations)
            if key not in formats:
                raise ModelConfigError(
                    f"{source}: a {spec.family} checkpoint in {quantization.describe()} is not "
                    f"supported; supported for {spec.family}: "
                    + ", ".join(f"{m} {f} ({a} activations)" for m, f, a in formats)
                )
        # NOTE: transformers 5 writes the qkv bias of some architectures as qkv_bias
        bias = raw.get("attention_bias", raw.get("qkv_bias", spec.qkv_bias))
        bias = bool(bias) and spec.biases
        fields: dict[str, Any] = dict(
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
            qkv_bias=bias,
            o_bias=bias and spec.o_proj_bias,
            qk_norm=spec.qk_norm,
            mlp_bias=bool(raw.get("mlp_bias", False)) and spec.biases,
            rope_scaling={k: v for k, v in rope.items() if k != "rope_theta"},
            eos_token_ids=eos_ids,
            bos_token_id=raw.get("bos_token_id"),
            torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
            quantization=quantization,
            partial_rotary_dim=rotary if rotary != head_dim else 0,
            hidden_act=act,
        )
        return cls(**{**fields, **own})

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


def what_it_has(raw: dict[str, Any]) -> str:
    has = []
    if raw.get("architectures"):
        has.append(f"architectures {raw['architectures']}")
    if raw.get("model_type") is not None:
        has.append(f"model_type {raw['model_type']!r}")
    return " and ".join(has) or "neither architectures nor model_type"


def _rope_parameters(raw: dict[str, Any], spec: ArchSpec, source: str) -> dict[str, Any]:
    """Merge the transformers 4 (`rope_theta` + `rope_scaling`) and 5 (`rope_parameters`) forms."""
    params: dict[str, Any] = {}
    if "rope_theta" in raw:
        params["rope_theta"] = raw["rope_theta"]
    for key in ("rope_scaling", "rope_parameters"):
        if isinstance(raw.get(key), dict):
            params.update(raw[key])
    rope_type = params.pop("type", None) or params.get("rope_type") or "default"
    params["rope_type"] = rope_type = spec.rope_aliases.get(rope_type, rope_type)
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelConfigError(
            f"{source}: rope type {rope_type!r} is not supported; "
            f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    return params
