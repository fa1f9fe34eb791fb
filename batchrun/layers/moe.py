"""The mixture-of-experts MLP: a router picks top-k of E experts per token, each a SwiGLU MLP, and
the token's output is their weighted sum (plus, with a shared expert, its output times a sigmoid
gate).

    logits  = x @ router^T (+ bias)         fp32, [T, E]
    probs   = softmax(logits)               fp32
    w, ids  = topk(probs, k)                renormalized to sum 1 where the model says
                                            (the fused experts: kernels/moe_route.py, one kernel)
    out[t]  = sum_j w[t, j] * down_ids[t,j](silu(gate(x[t])) * up(x[t]))

With KernelPlan.moe_decode "gemv", a decode batch (kernels/moe_gemv.py's `takes_gemv`) runs the
router in one kernel (moe_route.py's `route_gemv`) and the experts as GEMVs (moe_gemv.py); with
moe_prefill "grouped_mm", a batch past 32 routed rows an expert (kernels/moe_grouped_mm.py's
`takes_grouped_mm`) runs the experts' matmuls on torch._grouped_mm (moe_grouped_mm.py).

Where MoeConfig says so, router and experts have biases (b13 [E, 2I] on gate and up, b2 [E, H] on
down) and the gate is a clamped SwiGLU (`swiglu`), or GELU-tanh (MoeConfig.act, Gemma 4's).

The experts' weights are stacked: w13 [E, 2I, H] (each expert's gate rows, then its up rows) and
w2 [E, H, I]. Under tensor parallelism each rank holds a slice of every expert's width I
(batchrun/parallel/partition.py), the router whole; the experts' and the shared expert's partial
outputs are summed locally and all-reduced once.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from batchrun.parallel.partition import ShardSpec

if TYPE_CHECKING:
    from batchrun.models.blocks.context import BuildContext


def route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] float32, expert ids [T, k] int64) from fp32 router logits [T, E], as
    transformers' routers compute them: softmax in fp32, torch.topk (which breaks ties as
    transformers does, being the same call), the top-k divided by their sum if `renormalize`."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


class ExpertExtras(NamedTuple):
    """The experts' biases (None: none), the clamped SwiGLU's alpha and limit (limit 0: plain
    SiLU) and the gate's activation (MoeConfig.act: "silu", or Gemma 4's "gelu_pytorch_tanh")."""

    b13: torch.Tensor | None = None  # [E, 2I] gate then up, of this rank's width
    b2: torch.Tensor | None = None  # [E, H]; under TP on one rank only (added once)
    alpha: float = 1.0
    limit: float = 0.0
    act: str = "silu"


def swiglu(gate: torch.Tensor, up: torch.Tensor, extras: ExpertExtras) -> torch.Tensor:
    """silu(gate) * up, gelu_tanh(gate) * up (act "gelu_pytorch_tanh"), or the clamped form
    (transformers' GptOssExperts._apply_gate): gate clamped to <= limit, up to [-limit, limit],
    (up + 1) * gate * sigmoid(alpha * gate)."""
    if extras.act == "gelu_pytorch_tanh":
        return F.gelu(gate, approximate="tanh") * up
    if not extras.limit:
        return F.silu(gate) * up
    gate = gate.clamp(max=extras.limit)
    up = up.clamp(min=-extras.limit, max=extras.limit)
    return (up + 1) * (gate * torch.sigmoid(gate * extras.alpha))


def moe_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    backend: str,
    extras: ExpertExtras | None = None,
    decode: str = "grouped",
    prefill: str = "triton",
    pdl: bool = False,
) -> torch.Tensor:
    """sum_j topk_weights[t, j] * down_e(silu(gate_e(x[t])) * up_e(x[t])), e = topk_ids[t, j],
    as [T, H] in x's dtype. x [T, H]; w13 [E, 2I, H] (gate rows, then up rows); w2 [E, H, I];
    topk_weights [T, k] float32; topk_ids [T, k] int. backend "torch": a per-expert loop (the
    reference; it reads the routing on the host); "triton": batchrun.kernels.fused_moe
    (CUDA, no host sync), or with decode "gemv" batchrun.kernels.moe_gemv (a decode batch), with
    prefill "grouped_mm" batchrun.kernels.moe_grouped_mm (a prefill batch): MoE.forward decides
    by their rules. `extras`: the experts' biases and clamped SwiGLU; `pdl`: the GEMVs launched with
    programmatic dependent launch (kernels/pdl.py)."""
    if backend == "triton":  # Triton: imported on CUDA only
        if decode == "gemv":
            from batchrun.kernels.moe_gemv import moe_gemv

            return moe_gemv(x, w13, w2, topk_weights, topk_ids, extras=extras, pdl=pdl)
        if prefill == "grouped_mm":
            from batchrun.kernels.moe_grouped_mm import grouped_mm_moe

            return grouped_mm_moe(x, w13, w2, topk_weights, topk_ids, extras=extras)
        from batchrun.kernels.fused_moe import fused_moe

        return fused_moe(x, w13, w2, topk_weights, topk_ids, extras=extras)
    extras = extras or ExpertExtras()
    if backend != "torch":
        raise ValueError(f"moe backend must be torch or triton; got {backend!r}")
    return _experts_loop(x, w13, w2, topk_weights, topk_ids, extras)


def _experts_loop(x, w13, w2, topk_weights, topk_ids, extras: ExpertExtras) -> torch.Tensor:
    """The experts one at a time over the tokens routed to each, in expert order (the order
    transformers adds them in, so fp32 sums agree to the bit)."""
    out = torch.zeros_like(x)  # [T, H]
    if x.shape[0] == 0:
        return out
    num_experts = w13.shape[0]
    counts = torch.bincount(topk_ids.reshape(-1), minlength=num_experts).tolist()
    by_slot = topk_ids.t()  # [k, T]: where() lists an expert's rows by slot, then token
    for e, count in enumerate(counts):
        if not count:
            continue
        slot, token = torch.where(by_slot == e)
        b13 = None if extras.b13 is None else extras.b13[e]
        b2 = None if extras.b2 is None else extras.b2[e]
        gate, up = F.linear(x[token], w13[e], b13).chunk(2, dim=-1)
        h = F.linear(swiglu(gate, up, extras), w2[e], b2)  # [n, H]
        h = h.float() * topk_weights[token, slot, None]
        out.index_add_(0, token, h.to(out.dtype))
    return out


def experts_take_norms(moe, backend: str, decode: str) -> bool:
    """Whether a mixture's one-token decode can run the residual add and the next norm inside
    its experts' down GEMV (MoE.forward_residual): the experts alone (no shared expert, no
    biases, plain SiLU) on kernels/moe_gemv.py (backend "triton", decode "gemv"). moe: the
    model's MoeConfig."""
    if backend != "triton" or decode != "gemv":
        return False
    from batchrun.kernels.moe_gemv import takes_gemv  # backend "triton": Triton is installed

    alone = not (moe.shared_expert_intermediate_size or moe.expert_bias or moe.swiglu_limit)
    alone = alone and moe.act == "silu"
    return alone and takes_gemv(1, moe.top_k, moe.num_experts)


class Router(nn.Module):
    """The router's weight [E, H] (and its bias [E], where the model has one), kept in fp32: its
    logits and softmax are fp32 whatever the model's dtype."""

    def __init__(self, num_experts: int, hidden: int, device, bias: bool = False):
        super().__init__()
        self.weight = nn.Parameter(
            torch.empty(num_experts, hidden, dtype=torch.float32, device=device)
        )
        self.bias = (
            nn.Parameter(torch.empty(num_experts, dtype=torch.float32, device=device))
            if bias
            else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.float(), self.weight, self.bias)  # [T, E] fp32


class MoE(nn.Module):
    """A decoder layer's MLP as experts: router (`gate`), stacked experts (`w13`, `w2`), and an
    optional `shared_expert` with its `shared_expert_gate` [1, H]. The shared expert is a dense
    MLP built with a TP=1 group for its down_proj: its partial sums join the experts' in this
    block's one all-reduce."""

    def __init__(self, ctx: BuildContext, shared_expert: nn.Module | None = None):
        super().__init__()
        cfg, part, tp, kernels = ctx.cfg, ctx.part, ctx.tp, ctx.kernels
        dtype, device = ctx.dtype, ctx.device
        moe = cfg.moe
        assert moe is not None
        self.tp, self.backend, self.decode = tp, kernels.moe, kernels.moe_decode
        self.pdl = kernels.pdl
        self.top_k, self.renormalize = moe.top_k, moe.norm_topk_prob
        self._part, self._cfg = part, cfg
        hidden, local = cfg.hidden_size, part.moe_intermediate_size
        self.gate = Router(moe.num_experts, hidden, device, moe.router_bias)
        self.w13 = nn.Parameter(
            torch.empty(moe.num_experts, 2 * local, hidden, dtype=dtype, device=device)
        )
        self.w2 = nn.Parameter(
            torch.empty(moe.num_experts, hidden, local, dtype=dtype, device=device)
        )
        self.b13 = self.b2 = None
        if moe.expert_bias:
            self.b13 = nn.Parameter(
                torch.empty(moe.num_experts, 2 * local, dtype=dtype, device=device)
            )
            self.b2 = nn.Parameter(torch.empty(moe.num_experts, hidden, dtype=dtype, device=device))
        self.alpha, self.limit = moe.swiglu_alpha, moe.swiglu_limit
        self.shared_expert = shared_expert
        self.shared_expert_gate = None
        if shared_expert is not None:
            self.shared_expert_gate = nn.Linear(hidden, 1, bias=False, dtype=dtype, device=device)
        self._rows_for = None  # the fused experts' graph-invariant row count (see _router_input)
        self._route = route
        self._takes_gemv = None  # moe_decode "gemv": whether a batch of T tokens takes it
        self._takes_grouped_mm = None  # moe_prefill "grouped_mm": the same
        if self.backend == "triton":  # Triton: imported on CUDA only
            from batchrun.kernels.fused_moe import tile_tokens
            from batchrun.kernels.moe_route import topk_softmax

            self._rows_for, self._route = tile_tokens, topk_softmax
            if self.decode == "gemv":
                from batchrun.kernels.moe_gemv import takes_gemv
                from batchrun.kernels.moe_route import route_gemv

                self._takes_gemv, self._route_gemv = takes_gemv, route_gemv
            if kernels.moe_prefill == "grouped_mm":
                from batchrun.kernels.moe_grouped_mm import takes_grouped_mm

                self._takes_grouped_mm = takes_grouped_mm

    def param_shards(self) -> dict[str, ShardSpec]:
        width = self._cfg.moe.intermediate_size
        specs = {
            "w13": self._part.gate_up_spec(self._cfg, width, dim=1),
            "w2": self._part.down_spec(self._cfg, width, dim=2),
        }
        if self.b13 is not None:
            specs["b13"] = self._part.gate_up_spec(self._cfg, width, dim=1)
        return specs

    def extras(self) -> ExpertExtras | None:
        """The experts' biases and clamped SwiGLU; None where they have neither. Under TP every rank
        adds its slice of b13; b2 is added by rank 0 alone, its output's one share of the
        all-reduce."""
        if self.b13 is None and not self.limit and self._cfg.moe.act == "silu":
            return None
        b2 = self.b2 if self.tp.rank == 0 else None
        return ExpertExtras(self.b13, b2, self.alpha, self.limit, self._cfg.moe.act)

    def _router_input(self, x: torch.Tensor) -> torch.Tensor:
        """x, padded where the experts run fused with zero rows to fused_moe's tile_tokens(T): the
        router's matmul (and the shared-expert gate) then runs at a shape that a CUDA
        graph's padding of the step does not change. cuBLAS picks its kernel, and with it the
        order of a row's sums, by the shape: an fp32 router of a 30B mixture's widths gives rows
        whose last bits differ between T = 300 and 512 rows, enough to flip a
        near-tie of the top-k and the greedy tokens between a graph and the eager step. Each row
        of one shape's matmul is computed alone, so the padding rows do not touch the others."""
        if self._rows_for is None:
            return x
        rows = self._rows_for(x.shape[0])
        return x if rows == x.shape[0] else F.pad(x, (0, 0, 0, rows - x.shape[0]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        num_tokens, padded = x.shape[0], None
        num_experts = self.w13.shape[0]
        if self._takes_gemv is not None and self._takes_gemv(num_tokens, self.top_k, num_experts):
            # a decode batch: the router in one kernel, the experts as GEMVs
            weights, ids = self._route_gemv(
                x, self.gate.weight, self.gate.bias, self.top_k, self.renormalize
            )
            decode = "gemv"
        else:
            padded = self._router_input(x)
            weights, ids = self._route(self.gate(padded)[:num_tokens], self.top_k, self.renormalize)
            decode = "grouped"
        prefill = "triton"
        if self._takes_grouped_mm is not None and self._takes_grouped_mm(
            num_tokens, num_experts, self.top_k, x.shape[1], self.w2.shape[2]
        ):
            prefill = "grouped_mm"
        out = moe_experts(
            x, self.w13, self.w2, weights, ids, self.backend, self.extras(), decode, prefill,
            self.pdl,
        )  # fmt: skip
        if self.shared_expert is not None:
            padded = self._router_input(x) if padded is None else padded
            gate = torch.sigmoid(self.shared_expert_gate(padded)[:num_tokens])  # [T, 1]
            out = out + gate * self.shared_expert(x)
        return self.tp.all_reduce(out) if self.tp.is_parallel else out

    def takes_residual(self) -> bool:
        """Whether `forward_residual` runs here: `experts_take_norms`, whole (TP=1)."""
        return not self.tp.is_parallel and experts_take_norms(
            self._cfg.moe, self.backend, self.decode
        )

    def forward_residual(self, x, residual, norm: tuple[torch.Tensor, float] | None):
        """A one-token decode batch's experts with the residual add after them, and the next
        norm (weight, eps) of its sum where given, inside the down GEMV's kernel
        (kernels/moe_gemv.py's moe_gemv_residual): (h = experts(x) + residual, rmsnorm(h) * weight
        or None). The one-row fused decode (models/fused_decode.py); needs `takes_residual`."""
        from batchrun.kernels.moe_gemv import moe_gemv_residual

        weights, ids = self._route_gemv(
            x, self.gate.weight, self.gate.bias, self.top_k, self.renormalize
        )
        return moe_gemv_residual(x, self.w13, self.w2, weights, ids, residual, norm, pdl=self.pdl)
