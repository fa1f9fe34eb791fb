"""One Llama-family decoder for Llama 2/3/3.x, Mistral, Qwen2/2.5 (qkv bias), Qwen3 (q/k norm),
SmolLM2 (tied embeddings), Phi-3 / Phi-4 (partial rotary, LongRoPE: layers/rotary.py), Gemma 3
(scaled embeddings, four norms a layer, a GELU-tanh gate, sliding layers with a rotary of their
own: ModelConfig's flags), and the mixtures of experts Qwen3-MoE, Qwen2-MoE (a shared expert) and
Mixtral, whose MoE layers' MLP is batchrun/layers/moe.py's block. Fused QKV and gate/up
projections (Phi-3's checkpoints ship them fused, the others' are fused at load:
models/loader.py); tokens of all requests are flattened into one [T, hidden] batch and attention
goes through an `AttentionBackend`.

Tensor parallel (`tp`, see batchrun/parallel): each rank holds its q/kv heads and MLP columns
(column-parallel qkv and gate_up, row-parallel o_proj and down_proj, one all-reduce after each)
and a slice of the vocabulary; logits are all-gathered, so every rank returns the full
[S, vocab] and samples the same tokens. The default TPGroup() is TP=1, a plain model.
"""

from __future__ import annotations

import logging
from functools import partial
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from batchrun.attention.base import AttentionBackend
from batchrun.config import KernelConfig
from batchrun.layers.linear import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    decode_gemv,
    decode_gemv_residual,
    linear,
    takes_decode_norms,
    takes_gemv,
)
from batchrun.layers.moe import MoE
from batchrun.layers.norm import RMSNorm, norm_heads_in_place
from batchrun.layers.rotary import RotaryEmbedding
from batchrun.models.config import ModelConfig
from batchrun.parallel.partition import Run, ShardSpec, TPPartition, partition_model
from batchrun.parallel.state import TPGroup
from batchrun.quant.linear import plan_linear

try:
    from batchrun.kernels.activation import gelu_tanh_and_mul, silu_and_mul
    from batchrun.kernels.gemv import gemv, gemv_rms, rms_fold_weight
except ImportError:  # no Triton (CPU-only installs): KernelConfig.triton_ops is off
    silu_and_mul = gelu_tanh_and_mul = gemv = gemv_rms = rms_fold_weight = None

log = logging.getLogger(__name__)

# the decode_norms modes with folded weights (LlamaForCausalLM.prepare_decode_norms)
FOLD_MODES = ("fold", "fold-all")
# NOTE: the folded decode weights are copies; they may take at most this share of the device's
# free memory after the model is loaded (an H200 with llama-8b: 9.1 GB of ~124; a 24 GB GPU
# folds none of gate_up's 7.5 GB and keeps its memory for the KV pool)
FOLD_MAX_FREE_SHARE = 0.25


def fold_budget(device: torch.device) -> float:
    """Bytes the folded weights may take on device: FOLD_MAX_FREE_SHARE of its free memory on a
    GPU, unbounded elsewhere."""
    if device.type != "cuda":
        return float("inf")
    free, _ = torch.cuda.mem_get_info(device)
    return FOLD_MAX_FREE_SHARE * free


class ForwardBatch(NamedTuple):
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    logits_indices: torch.Tensor | None  # [S] rows of T whose logits are wanted; None: all


class Attention(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        part: TPPartition,
        tp: TPGroup,
        layer_id: int,
        dtype,
        device,
        kernels: KernelConfig,
    ):
        super().__init__()
        self.layer_id = layer_id
        self.window = cfg.window(layer_id)  # 0: attention over the whole context
        # this rank's heads (all of them at TP=1)
        self.num_heads, self.num_kv_heads, self.head_dim = (
            part.num_heads,
            part.num_kv_heads,
            cfg.head_dim,
        )
        self.q_size, self.kv_size = part.q_size, part.kv_size
        # Gemma 3 scales by query_pre_attn_scalar (its hidden / heads on the 27b, not head_dim)
        scalar = cfg.query_pre_attn_scalar
        self.scaling = (cfg.head_dim if scalar is None else scalar) ** -0.5
        qkv_rows = part.q_size + 2 * part.kv_size
        # how the checkpoint's linears are quantized (None: plain weights)
        plan = partial(
            plan_linear,
            cfg.quantization,
            kernels.fp8_matmul,
            dtype,
            int4_matmul=kernels.int4_matmul,
        )
        prefix = f"model.layers.{layer_id}.self_attn"
        qkv = tuple(f"{prefix}.{n}_proj" for n in "qkv")
        self.qkv_proj = ColumnParallelLinear(
            cfg.hidden_size,
            part.qkv_spec(cfg),
            qkv_rows,
            bias=cfg.qkv_bias,
            dtype=dtype,
            device=device,
            kernels=kernels,
            quant=plan(qkv, qkv_rows, cfg.hidden_size),
        )
        o_quant = plan((f"{prefix}.o_proj",), cfg.hidden_size, part.q_size)
        self.o_proj = RowParallelLinear(
            part.o_spec(cfg), cfg.hidden_size, cfg.o_bias, tp, dtype, device, kernels, o_quant
        )
        # the FP8 KV cache's scales when the checkpoint has them (k_scale / v_scale), kept for
        # a KV cache that reads them; None: none in the checkpoint
        self.k_scale: float | None = None
        self.v_scale: float | None = None
        # NOTE: q/k norms are per head (weight [head_dim]): replicated, whatever the split
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype, device, kernels)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype, device, kernels)
        else:
            self.q_norm = self.k_norm = None
        # gpt-oss: a sink logit per head (this rank's heads), fp32 as the softmax reads it
        self.sinks = None
        self._sink_spec = None
        if cfg.attention_sinks:
            self.sinks = nn.Parameter(
                torch.empty(part.num_heads, dtype=torch.float32, device=device)
            )
            self._sink_spec = ShardSpec(
                0, cfg.num_heads, (Run(part.head_start, 0, part.num_heads),)
            )

    def param_shards(self) -> dict[str, ShardSpec]:
        return {} if self._sink_spec is None else {"sinks": self._sink_spec}

    def forward(self, x, positions, rotary: RotaryEmbedding, backend: AttentionBackend):
        return self.attend(self.qkv_proj(x), positions, rotary, backend)

    def attend(self, qkv, positions, rotary: RotaryEmbedding, backend: AttentionBackend):
        """Everything after the qkv projection: q/k norm, rotary, attention, o_proj."""
        return self.o_proj(self.attention(qkv, positions, rotary, backend))

    def attention(self, qkv, positions, rotary: RotaryEmbedding, backend: AttentionBackend):
        """[T, H * D] from the qkv projection: q/k norm, then rotary and attention by the
        backend, which may rotate inside its KV store (one kernel instead of two)."""
        q, k, v = self.split_heads(qkv)
        return backend.forward_rotary(
            q, k, v, self.layer_id, self.scaling, positions, rotary, window=self.window,
            sinks=self.sinks,
        )  # fmt: skip

    def split_heads(self, qkv):
        """q [T, H, D], k and v [T, KV, D] from the qkv projection, q/k norm applied (Qwen3
        normalizes before rotary)."""
        # NOTE: q, k, v are strided views of qkv; rotary may rotate q and k in place, which is safe
        # because nothing reads qkv afterwards (the q/k norms' kernel writes in place too)
        normed = self.q_norm is None or norm_heads_in_place(
            qkv[:, : self.q_size + self.kv_size].view(-1, self.num_heads + self.num_kv_heads,
                                                      self.head_dim),
            self.q_norm, self.k_norm, self.num_heads,
        )  # fmt: skip
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)  # [T, H, D]
        k = k.view(-1, self.num_kv_heads, self.head_dim)  # [T, KV, D]
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if not normed:
            q, k = self.q_norm(q), self.k_norm(k)
        return q, k, v


class MLP(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        part: TPPartition,
        tp: TPGroup,
        dtype,
        device,
        kernels: KernelConfig,
        layer_id: int = 0,
        width: int | None = None,
        name: str = "mlp",
    ):
        """An MLP of full `width` (the config's intermediate_size by default), named `name`
        in the checkpoint's layer (Qwen2-MoE's shared expert: "mlp.shared_expert")."""
        super().__init__()
        self.kernels = kernels
        # the SwiGLU gate runs inside the decode matmuls (kernels/gemv.py, fp8_gemv.py); GELU's
        # runs as a kernel of its own
        self.silu = cfg.hidden_act == "silu"
        width = cfg.intermediate_size if width is None else width
        self.intermediate_size = inter = width // part.size
        plan = partial(
            plan_linear,
            cfg.quantization,
            kernels.fp8_matmul,
            dtype,
            int4_matmul=kernels.int4_matmul,
        )
        prefix = f"model.layers.{layer_id}.{name}"
        gate_up = (f"{prefix}.gate_proj", f"{prefix}.up_proj")
        self.gate_up_proj = ColumnParallelLinear(  # local rows [gate of this rank | up of it]
            cfg.hidden_size,
            part.gate_up_spec(cfg, width),
            2 * inter,
            bias=cfg.mlp_bias,
            dtype=dtype,
            device=device,
            kernels=kernels,
            quant=plan(gate_up, 2 * inter, cfg.hidden_size),
        )
        down_quant = plan((f"{prefix}.down_proj",), cfg.hidden_size, inter)
        self.down_proj = RowParallelLinear(
            part.down_spec(cfg, width),
            cfg.hidden_size,
            cfg.mlp_bias,
            tp,
            dtype,
            device,
            kernels,
            down_quant,
        )

    def forward(self, x):
        proj, kernels = self.gate_up_proj, self.kernels
        if not self.silu:
            gate_up = proj(x)  # [T, 2 * I]
            if kernels.triton_ops:
                return self.down_proj(gelu_tanh_and_mul(gate_up, pdl=kernels.pdl))
            gate, up = gate_up.chunk(2, dim=-1)
            return self.down_proj(F.gelu(gate, approximate="tanh") * up)
        decode = (
            takes_gemv(x, proj.bias, kernels)
            if proj.quant is None
            else (proj.bias is None and proj.quant.takes_gemv(x))
        )
        if decode:
            # NOTE: a decode batch on kernels/gemv.py (an FP8 gate_up's on kernels/fp8_gemv.py):
            # the gate as the matmul's epilogue, one kernel a layer less (the gate's kernel costs
            # ~1.5 µs at batch 1 on the H200)
            return self.down_proj(decode_gemv(proj, x, swiglu=True))
        gate_up = proj(x)  # [T, 2 * I]
        if kernels.triton_ops:
            return self.down_proj(silu_and_mul(gate_up, pdl=kernels.pdl))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


def make_mlp(
    cfg: ModelConfig, part: TPPartition, tp: TPGroup, layer_id: int, dtype, device, kernels
) -> nn.Module:
    """Layer `layer_id`'s MLP: the experts (layers/moe.py) in a mixture of experts' MoE layers,
    else a dense MLP."""
    moe = cfg.moe
    if moe is None or not moe.is_moe_layer(layer_id):
        return MLP(cfg, part, tp, dtype, device, kernels, layer_id)
    shared = None
    if moe.shared_expert_intermediate_size:
        shared = MLP(
            cfg, part, TPGroup(), dtype, device, kernels, layer_id,
            width=moe.shared_expert_intermediate_size, name="mlp.shared_expert",
        )  # fmt: skip
    return MoE(cfg, part, tp, dtype, device, kernels, shared)


class DecoderLayer(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        part: TPPartition,
        tp: TPGroup,
        layer_id: int,
        dtype,
        device,
        kernels: KernelConfig,
    ):
        super().__init__()
        self.pdl = kernels.pdl
        eps = cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps, dtype, device, kernels)
        self.self_attn = Attention(cfg, part, tp, layer_id, dtype, device, kernels)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps, dtype, device, kernels)
        self.mlp = make_mlp(cfg, part, tp, layer_id, dtype, device, kernels)
        if cfg.sandwich_norms:  # Gemma 3's four norms a layer
            self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, eps, dtype, device, kernels)
            self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, eps, dtype, device, kernels)
        else:
            self.pre_feedforward_layernorm = self.post_feedforward_layernorm = None

    def forward(self, x, residual, positions, rotary, backend):
        """Residual-stream form of `h = x + attn(norm(x)); out = h + mlp(norm(h))`: takes and
        returns (hidden, residual) with out = hidden + residual, so each add fuses into the next
        norm. The first layer gets residual None and x = the embeddings.
        """
        attn = self.self_attn
        x, residual = self.input_norm(x, residual)
        # NOTE: rotary goes to the backend, which may rotate inside its KV store (one kernel)
        out = attn.attention(attn.qkv_proj(x), positions, rotary, backend)  # [T, H * D]
        return self.post_attention(out, residual)

    def input_norm(self, x, residual):
        """(norm(x + residual), x + residual); the first layer's residual is None (x alone)."""
        if residual is None:
            return self.input_layernorm(x), x
        return self.input_layernorm.forward_with_residual(x, residual)

    # the layer in two halves around its attention (what engine/piecewise_graph.py captures)

    def pre_attention(self, x, residual):
        """(q, k, v, residual): the input norm, the qkv projection and q/k norm; q and k before
        rotary, which is the attention's (`backend.forward_rotary`, eager between the halves)."""
        x, residual = self.input_norm(x, residual)
        q, k, v = self.self_attn.split_heads(self.self_attn.qkv_proj(x))
        return q, k, v, residual

    def post_attention(self, attn_out, residual):
        """(hidden, residual) from the attention's output [T, H * D]: o_proj, the norm, the MLP.
        With sandwich norms (Gemma 3) the attention's output is normed before the residual add,
        the MLP's input by pre_feedforward_layernorm and its output by post_feedforward's."""
        x = self.self_attn.o_proj(attn_out)
        if self.pre_feedforward_layernorm is not None:
            x = self.post_attention_layernorm(x)
            x, residual = self.pre_feedforward_layernorm.forward_with_residual(x, residual)
            return self.post_feedforward_layernorm(self.mlp(x)), residual
        x, residual = self.post_attention_layernorm.forward_with_residual(x, residual)
        return self.mlp(x), residual

    def forward_gemv(
        self, h, normed, next_norm: RMSNorm | None, positions, rotary, backend,
        fuse_next: bool = True, fold_post: bool = False,
    ):  # fmt: skip
        """The layer for a decode batch of one row with every matmul on kernels/gemv.py (an FP8
        layer's on kernels/fp8_gemv.py, with the same epilogues; `takes_decode_norms`), in 6
        kernels instead of 8 (5 with "fold"): each residual add and the norm after it run
        inside the matmul before (o_proj, down_proj: gemv_residual), the SwiGLU gate inside
        gate_up's. Takes h (the residual stream) and normed (this layer's input norm of it);
        returns the next h and next_norm (the next layer's input norm, or the final norm) of
        it. With fuse_next False that norm is a kernel of its own after down_proj (which still
        adds the residual). "fold" (`prepare_decode_norms`): normed None means this layer's
        input norm runs inside its qkv matmul (gemv_rms), and next_norm None that the next
        layer's does (returns h, None). fold_post ("fold-all"): the post-attention norm runs
        inside gate_up's matmul (gemv_rms with the SwiGLU gate), and o_proj only adds the
        residual. A mixture's layer (not with "fold-all") runs its router in one kernel and
        the experts' GEMVs in place of gate_up and down (MoE.forward_residual), the residual add
        and the next norm inside their down kernel."""
        attn, mlp, post, pdl = self.self_attn, self.mlp, self.post_attention_layernorm, self.pdl
        if normed is None:  # "fold": this layer's input norm inside the qkv matmul
            qkv = gemv_rms(h, attn.qkv_weight_rms, self.input_layernorm.eps, pdl=pdl)
        else:
            qkv = decode_gemv(attn.qkv_proj, normed)
        out = attn.attention(qkv, positions, rotary, backend)
        if fold_post:
            h = decode_gemv_residual(attn.o_proj, out, h)[0]
            act = gemv_rms(h, mlp.gate_up_weight_rms, post.eps, swiglu=True, pdl=pdl)
        else:
            h, normed = decode_gemv_residual(attn.o_proj, out, h, (post.weight, post.eps))
        norm = (next_norm.weight, next_norm.eps) if fuse_next else None
        if isinstance(mlp, MoE):  # the router and the experts' GEMVs, the add in their down's
            h, normed = mlp.forward_residual(normed, h, norm)
        else:
            if not fold_post:
                act = decode_gemv(mlp.gate_up_proj, normed, swiglu=True)
            h, normed = decode_gemv_residual(mlp.down_proj, act, h, norm)
        if fuse_next:
            return h, normed
        return h, None if next_norm is None else next_norm(h)


def make_rotaries(
    cfg: ModelConfig, max_positions: int, device, kernels: KernelConfig
) -> tuple[RotaryEmbedding, RotaryEmbedding | None]:
    """(the rotary embedding of rope_theta and rope_scaling, the sliding layers' one of
    local_rope_theta with default rope, or None where the config has none)."""
    rotary = RotaryEmbedding.for_model(cfg, max_positions, device, kernels)
    if cfg.local_rope_theta is None:
        return rotary, None
    local = RotaryEmbedding(
        cfg.rotary_dim, max_positions, cfg.local_rope_theta, {"rope_type": "default"}, device,
        kernels,
    )  # fmt: skip
    return rotary, local


class LlamaForCausalLM(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        dtype: torch.dtype,
        device: torch.device | str,
        max_positions: int | None = None,
        tp: TPGroup | None = None,
        kernels: KernelConfig | None = None,
    ):
        super().__init__()
        self.config = cfg
        self.kernels = kernels = kernels or KernelConfig.reference()
        # the one-row decode's norms in the gemvs: the kernel config's; a mode with folded
        # weights runs as "post" (which needs none) until prepare_decode_norms has made them
        self._wanted_norms = kernels.decode_norms
        self.decode_norms = "post" if kernels.decode_norms in FOLD_MODES else kernels.decode_norms
        self.tp = tp = tp or TPGroup()
        if self.decode_norms != "off" and (
            tp.is_parallel or cfg.qkv_bias or cfg.o_bias or cfg.mlp_bias or cfg.sandwich_norms
        ):  # fmt: skip
            # a bias or a row-parallel all-reduce sits between a matmul's sums and the residual;
            # Gemma's norms sit between the matmul and the add
            raise ValueError(
                "decode_norms other than 'off' need a model without biases at TP=1, with "
                "Llama's two norms a layer"
            )
        self.partition = part = partition_model(cfg, tp.rank, tp.size)
        self.num_kv_heads = part.num_kv_heads  # per rank: what the KV pool holds
        vocab = part.vocab_spec()
        self.embed_tokens = VocabParallelEmbedding(
            vocab, part.vocab_per_rank, cfg.hidden_size, tp, dtype, device
        )
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, part, tp, i, dtype, device, kernels) for i in range(cfg.num_layers)
        )
        matmuls = [
            proj
            for layer in self.layers
            for proj in (
                layer.self_attn.qkv_proj,
                layer.self_attn.o_proj,
                getattr(layer.mlp, "gate_up_proj", None),
                getattr(layer.mlp, "down_proj", None),
            )
            if proj is not None
        ]
        if kernels.decode_norms != "off" and not all(map(takes_decode_norms, matmuls)):
            # the residual add and the norm run in the epilogues of kernels/gemv.py and
            # kernels/fp8_gemv.py
            raise ValueError(
                "decode_norms other than 'off' need every decode matmul on kernels/gemv.py or, "
                "for an FP8 model, kernels/fp8_gemv.py (decode_gemv 'triton'); an INT4 model "
                "runs with 'off'"
            )
        quantized = any(proj.quant is not None for proj in matmuls)
        if kernels.decode_norms in FOLD_MODES and quantized:
            raise ValueError(
                f"decode_norms {kernels.decode_norms!r} folds the norms' weights into bf16 "
                "matmul weights, which a quantized model does not have; use 'all', 'post' or "
                "'off'"
            )
        experts = [layer.mlp for layer in self.layers if isinstance(layer.mlp, MoE)]
        if kernels.decode_norms != "off" and experts and (
            kernels.decode_norms == "fold-all" or not all(m.takes_residual() for m in experts)
        ):  # fmt: skip
            # the residual add and the next norm run inside the experts' down GEMV
            raise ValueError(
                "decode_norms other than 'off' on a mixture of experts need its experts alone "
                "(no shared expert, no biases) on kernels/moe_gemv.py (moe 'triton', moe_decode "
                "'gemv'), and not 'fold-all' (the experts are no one matmul to fold a norm into)"
            )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device, kernels)
        # SmolLM2 and other tied models reuse embed_tokens, whose vocab slice is the same
        self.lm_head = (
            None
            if cfg.tie_word_embeddings
            else ColumnParallelLinear(
                cfg.hidden_size, vocab, part.vocab_per_rank, False, dtype, device, kernels
            )
        )
        self.rotary, self.local_rotary = make_rotaries(
            cfg, max_positions or cfg.max_position_embeddings, device, kernels
        )
        # Gemma 3's embeddings times sqrt(hidden), the factor rounded to the model's dtype as
        # transformers' does (a Python float multiplies in fp32 and rounds once, as its 0-dim
        # tensor of the dtype does)
        self.embed_scale = (
            float(torch.tensor(cfg.hidden_size**0.5).to(dtype)) if cfg.embed_scale else None
        )

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The embeddings [T, hidden] of input_ids (scaled for Gemma 3)."""
        x = self.embed_tokens(input_ids)
        return x if self.embed_scale is None else x * self.embed_scale

    def rotary_of(self, layer_id: int) -> RotaryEmbedding:
        """Layer layer_id's rotary embedding: Gemma 3's sliding layers have a base of their own."""
        if self.local_rotary is not None and self.config.window(layer_id):
            return self.local_rotary
        return self.rotary

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def param_shards(self) -> dict[str, ShardSpec]:
        """Parameter name -> the slice of the full tensor it holds; absent: replicated."""
        specs = {}
        for prefix, module in self.named_modules():
            if module is not self and hasattr(module, "param_shards"):
                for name, spec in module.param_shards().items():
                    specs[f"{prefix}.{name}"] = spec
        return specs

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, backend: AttentionBackend) -> torch.Tensor:
        """Returns logits [S, vocab] for the rows in batch.logits_indices (all if None), in the
        model's dtype: the sampler upcasts to fp32 where it computes probabilities, and a greedy
        batch takes the argmax as they are (an fp32 copy of [256, 128k] logits costs ~200 MB of
        memory traffic a step)."""
        x, residual = self.embed(batch.input_ids), None  # [T, hidden]
        if x.shape[0] == 1 and self.decode_norms != "off" and takes_gemv(x, None, self.kernels):
            return self.forward_gemv(x, batch, backend)
        for i, layer in enumerate(self.layers):
            x, residual = layer(x, residual, batch.positions, self.rotary_of(i), backend)
        return self.logits(x, residual, batch.logits_indices)

    def prepare_decode_norms(self) -> str:
        """Make the folded weights decode_norms needs ("fold": each layer's qkv weight times
        its input norm's, for gemv_rms; "fold-all": also gate_up's times its post-attention
        norm's): copies, so the other paths keep theirs (llama-8b: 1.6 GB for qkv, 7.5 GB for
        gate_up), made after the weights are loaded and before the KV pool takes the free
        memory. Copies that would take more than FOLD_MAX_FREE_SHARE of the device's free
        memory are not made: gate_up's first ("fold-all" becomes "fold"), then qkv's ("fold"
        becomes "post"). Returns the mode the decode runs."""
        mode = self._wanted_norms
        if mode not in FOLD_MODES:
            return mode
        qkv = sum(layer.self_attn.qkv_proj.weight.nbytes for layer in self.layers)
        gate_up = sum(
            layer.mlp.gate_up_proj.weight.nbytes
            for layer in self.layers
            if not isinstance(layer.mlp, MoE)  # a mixture's decode_norms is never "fold-all"
        )
        budget = fold_budget(self.lm_head_weight.device)
        skipped = "%s's folded weights (%.1f GB) left out: over the budget of %.1f GB"
        if mode == "fold-all" and qkv + gate_up > budget:
            log.info(skipped, "gate_up", gate_up / 1e9, budget / 1e9)
            mode = "fold"
        if qkv > budget:
            log.info(skipped, "qkv", qkv / 1e9, budget / 1e9)
            mode = "post"
        for layer in self.layers if mode in FOLD_MODES else ():
            attn, mlp = layer.self_attn, layer.mlp
            attn.qkv_weight_rms = rms_fold_weight(
                attn.qkv_proj.weight.detach(), layer.input_layernorm.weight.detach()
            )
            if mode == "fold-all":
                mlp.gate_up_weight_rms = rms_fold_weight(
                    mlp.gate_up_proj.weight.detach(),
                    layer.post_attention_layernorm.weight.detach(),
                )
        if mode in FOLD_MODES and self.lm_head_weight.is_cuda:
            torch.cuda.empty_cache()  # the fp32 temporaries back to the driver, whose free
            # memory sizes the KV pool
        self.decode_norms = mode
        return mode

    def forward_gemv(
        self, x: torch.Tensor, batch: ForwardBatch, backend: AttentionBackend
    ) -> torch.Tensor:
        """`forward` of a one-row decode batch on kernels/gemv.py (DecoderLayer.forward_gemv),
        by decode_norms: "all": the first layer's input norm is a kernel, every later norm runs
        inside the matmul before it; "post": only the post-attention norms do, the input norms
        and the final norm are kernels after down_proj; "fold": the input norms run inside the
        qkv matmul after them instead; "fold-all": also the post-attention norms inside
        gate_up's. x: the embeddings [1, hidden]."""
        mode, layers = self.decode_norms, self.layers
        fuse_input_norms, fold_post = mode == "all", mode == "fold-all"
        if mode in FOLD_MODES:  # every input norm inside its qkv matmul; the final norm a kernel
            h, normed = x, None
            next_norms = [None] * (len(layers) - 1) + [self.norm]
        else:
            h, normed = x, layers[0].input_layernorm(x)
            next_norms = [layer.input_layernorm for layer in layers[1:]] + [self.norm]
        for layer, next_norm in zip(layers, next_norms):
            h, normed = layer.forward_gemv(
                h, normed, next_norm, batch.positions, self.rotary, backend, fuse_input_norms,
                fold_post,
            )  # fmt: skip
        if batch.logits_indices is not None:
            normed = normed[batch.logits_indices]
        return gemv(normed, self.lm_head_weight, pdl=self.kernels.pdl)

    def logits(self, x, residual, logits_indices: torch.Tensor | None) -> torch.Tensor:
        """The final norm and the LM head over the last layer's (hidden, residual), for the rows
        `logits_indices` (all if None)."""
        if logits_indices is not None:
            x, residual = x[logits_indices], residual[logits_indices]
        x, _ = self.norm.forward_with_residual(x, residual)
        logits = linear(x, self.lm_head_weight, kernels=self.kernels)  # [S, V / TP]
        if self.tp.is_parallel:
            # every rank gets the full logits, so all sample the same tokens
            logits = self.tp.all_gather(logits)[:, : self.config.vocab_size]
        return logits
