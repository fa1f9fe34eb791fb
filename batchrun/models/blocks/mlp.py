"""The MLP blocks: a gated MLP (SwiGLU or GELU-tanh gate) and the mixture of experts
(batchrun/layers/moe.py) with or without a shared expert."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from batchrun.layers.linear import ColumnParallelLinear, RowParallelLinear, decode_gemv, takes_gemv
from batchrun.layers.moe import MoE
from batchrun.models.blocks.context import BuildContext
from batchrun.parallel.state import TPGroup

try:
    from batchrun.kernels.activation import gelu_tanh_and_mul, silu_and_mul
except ImportError:  # no Triton (CPU-only installs): KernelPlan.triton_ops is off
    silu_and_mul = gelu_tanh_and_mul = None

ACTIVATIONS = ("silu", "gelu_pytorch_tanh")


class GatedMLP(nn.Module):
    def __init__(
        self,
        ctx: BuildContext,
        layer_id: int,
        *,
        act: str = "silu",
        width: int | None = None,
        name: str = "mlp",
        tp: TPGroup | None = None,
    ):
        """down(act(gate(x)) * up(x)) of full `width` (the config's intermediate_size by
        default), named `name` in the checkpoint's layer; `tp`: the group its down_proj
        all-reduces over (ctx's by default; a shared expert's TPGroup() leaves the sum to its
        MoE block)."""
        super().__init__()
        if act not in ACTIVATIONS:
            raise ValueError(f"gated MLP activation {act!r}; supported: {', '.join(ACTIVATIONS)}")
        cfg, part = ctx.cfg, ctx.part
        self.kernels = ctx.kernels
        # the SwiGLU gate runs inside the decode matmuls (kernels/gemv.py, fp8_gemv.py); GELU's
        # runs as a kernel of its own
        self.silu = act == "silu"
        width = cfg.intermediate_size if width is None else width
        self.intermediate_size = inter = width // part.size
        prefix = f"model.layers.{layer_id}.{name}"
        gate_up = (f"{prefix}.gate_proj", f"{prefix}.up_proj")
        self.gate_up_proj = ColumnParallelLinear(  # local rows [gate of this rank | up of it]
            cfg.hidden_size,
            part.gate_up_spec(cfg, width),
            2 * inter,
            bias=cfg.mlp_bias,
            dtype=ctx.dtype,
            device=ctx.device,
            kernels=ctx.kernels,
            quant=ctx.quant_plan(gate_up, 2 * inter, cfg.hidden_size),
        )
        down_quant = ctx.quant_plan((f"{prefix}.down_proj",), cfg.hidden_size, inter)
        self.down_proj = RowParallelLinear(
            part.down_spec(cfg, width), cfg.hidden_size, cfg.mlp_bias, ctx.tp if tp is None else tp,
            ctx.dtype, ctx.device, ctx.kernels, down_quant, columns_tp=ctx.tp,
        )  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
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
            # the gate as the matmul's epilogue, one kernel a layer less
            return self.down_proj(decode_gemv(proj, x, swiglu=True))
        gate_up = proj(x)  # [T, 2 * I]
        if kernels.triton_ops:
            return self.down_proj(silu_and_mul(gate_up, pdl=kernels.pdl))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


def experts_or_dense(ctx: BuildContext, layer_id: int, act: str = "silu") -> nn.Module:
    """Layer `layer_id`'s MLP: the experts (layers/moe.py) in a mixture of experts' MoE layers,
    with a shared expert where the config has one, else a dense gated MLP."""
    moe = ctx.cfg.moe
    if moe is None or not moe.is_moe_layer(layer_id):
        return GatedMLP(ctx, layer_id, act=act)
    shared = None
    if moe.shared_expert_intermediate_size:
        shared = GatedMLP(
            ctx, layer_id, act=act, width=moe.shared_expert_intermediate_size,
            name="mlp.shared_expert", tp=TPGroup(),
        )  # fmt: skip
    return MoE(ctx, shared)
