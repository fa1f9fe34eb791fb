"""The Gated DeltaNet block (a hybrid model's linear attention), in the seat of a layer's
attention (PreNormLayer.self_attn):

    project(x)             -> (qkv [T, conv_dim], z [T, Hv, Dv], ba [T, 2, Hv])
    attend(qkv, z, ba, ..) -> [T, Hv * Dv]   conv1d, delta rule over the request's state, gated
                                             RMSNorm times silu(z)
    o_proj(out)            -> [T, hidden]    the checkpoint's out_proj

Two checkpoint layouts of the input projections: Qwen3-Next fuses them per key head
(in_proj_qkvz rows per key head [q | k | v of its value heads | z of them], in_proj_ba
[b | a]); Qwen3.5 stores in_proj_qkv ([q | k | v], the conv's channel order), in_proj_z,
in_proj_b, in_proj_a. The state of each request lives in the StatePool (engine/state_pool.py);
the conv and the recurrence run on the plan's path (KernelPlan.linear_attention): "torch"
delta_rule.py's (decode: the recurrent form, prefill: the chunked one, a request at a time),
"fla" delta_rule_fla.py's kernels over the whole packed step.

Tensor parallel: rank r holds key heads [r*Hk/tp, (r+1)*Hk/tp) and the value heads that group
with them, so everything but out_proj is local to the rank:

    in_proj_qkvz, in_proj_ba   one run of rows (grouped by key head)
    in_proj_qkv, conv1d        three runs: the rank's slices of q, k and v (the conv's channels)
    in_proj_z / b / a, dt_bias, A_log   one run (by value head); the gated norm's weight (per Dv)
                                        replicated
    out_proj                   row-parallel over the value heads' columns (one all-reduce)

The StatePool holds the rank's heads (conv_dim / tp channels, Hv / tp delta-rule states).
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from batchrun.engine.state_pool import StatePool
from batchrun.layers.linear import ColumnParallelLinear, RowParallelLinear
from batchrun.models.blocks import delta_rule
from batchrun.models.blocks.context import BuildContext
from batchrun.models.hybrid_config import LinearAttentionConfig
from batchrun.parallel.partition import Run, ShardSpec


class GatedDeltaNet(nn.Module):
    def __init__(self, ctx: BuildContext, layer_id: int, states: StatePool):
        super().__init__()
        cfg, full = ctx.cfg, ctx.cfg.linear_attention
        assert full is not None
        size, rank = ctx.tp.size, ctx.tp.rank
        self.layer_id = layer_id
        self.index = full.index(layer_id)
        self.states = states
        # this rank's heads (partition_model checks that they split evenly)
        self.lin = lin = replace(
            full, num_k_heads=full.num_k_heads // size, num_v_heads=full.num_v_heads // size
        )
        self.eps = cfg.rms_norm_eps
        self.fla = None  # the GPU path's module (imports fla-core and Triton), or plain torch
        if ctx.kernels.linear_attention == "fla":
            from batchrun.models.blocks import delta_rule_fla

            self.fla = delta_rule_fla
        hk, hv, dk, dv = lin.num_k_heads, lin.num_v_heads, lin.head_k_dim, lin.head_v_dim
        self.key_dim, self.value_dim = hk * dk, hv * dv
        prefix = f"model.layers.{layer_id}.linear_attn"

        def proj(name: str, spec: ShardSpec) -> ColumnParallelLinear:
            rows = spec.local_len
            quant = ctx.quant_plan((f"{prefix}.{name}",), rows, cfg.hidden_size)
            return ColumnParallelLinear(
                cfg.hidden_size, spec, rows, False, ctx.dtype, ctx.device, ctx.kernels, quant
            )

        # NOTE: the fused projections' rows are grouped by key head, so a rank's key heads
        # are one run of rows; the conv's channels (q | k | v of every head) are three
        conv = conv_spec(full, rank, size)
        if lin.fused_projections:
            qkvz = 2 * (full.num_k_heads * dk + full.num_v_heads * dv)
            self.in_proj_qkvz = proj("in_proj_qkvz", heads_spec(qkvz, rank, size))
            self.in_proj_ba = proj("in_proj_ba", heads_spec(2 * full.num_v_heads, rank, size))
        else:
            self.in_proj_qkv = proj("in_proj_qkv", conv)
            self.in_proj_z = proj("in_proj_z", heads_spec(full.num_v_heads * dv, rank, size))
            self.in_proj_b = proj("in_proj_b", heads_spec(full.num_v_heads, rank, size))
            self.in_proj_a = proj("in_proj_a", heads_spec(full.num_v_heads, rank, size))
        self.conv1d = nn.Conv1d(
            lin.conv_dim, lin.conv_dim, lin.conv_kernel, groups=lin.conv_dim, bias=False,
            dtype=ctx.dtype, device=ctx.device,
        )  # fmt: skip
        self.dt_bias = nn.Parameter(torch.empty(hv, dtype=ctx.dtype, device=ctx.device))
        self.A_log = nn.Parameter(torch.empty(hv, dtype=ctx.dtype, device=ctx.device))
        # the gated RMSNorm's weight (plain, not zero-centred: the checkpoint's linear_attn.norm),
        # per head dim: replicated
        self.gated_rms = nn.Module()
        self.gated_rms.weight = nn.Parameter(torch.empty(dv, dtype=ctx.dtype, device=ctx.device))
        values = heads_spec(full.num_v_heads * dv, rank, size)
        self.o_proj = RowParallelLinear(
            ShardSpec(1, values.full_size, values.runs), cfg.hidden_size, False, ctx.tp,
            ctx.dtype, ctx.device, ctx.kernels,
            ctx.quant_plan((f"{prefix}.out_proj",), cfg.hidden_size, self.value_dim),
        )  # fmt: skip
        heads = heads_spec(full.num_v_heads, rank, size)
        self._specs = {"conv1d.weight": conv, "dt_bias": heads, "A_log": heads}

    def param_shards(self) -> dict[str, ShardSpec]:
        return dict(self._specs)

    def project(self, x: torch.Tensor):
        lin, t = self.lin, x.shape[0]
        hk, hv, dv = lin.num_k_heads, lin.num_v_heads, lin.head_v_dim
        if not lin.fused_projections:
            z = self.in_proj_z(x).view(t, hv, dv)
            ba = torch.stack([self.in_proj_b(x), self.in_proj_a(x)], dim=1)  # [T, 2, Hv]
            return self.in_proj_qkv(x), z, ba
        group = hv // hk
        qkvz = self.in_proj_qkvz(x).view(t, hk, -1)
        dk = lin.head_k_dim
        q, k, v, z = qkvz.split([dk, dk, group * dv, group * dv], dim=-1)
        qkv = torch.cat([q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)], dim=-1)
        b, a = self.in_proj_ba(x).view(t, hk, 2, group).unbind(2)
        return qkv, z.reshape(t, hv, dv), torch.stack([b.reshape(t, hv), a.reshape(t, hv)], 1)

    def attend(self, qkv, z, ba, positions, rotary, backend, out=None) -> torch.Tensor:
        """The conv and the delta rule of each request from its state, which they advance;
        the gated RMSNorm. -> [T, Hv * Dv] (`positions`, `rotary`, `backend` unused: the
        state is the request's position)."""
        pool = self.states
        conv, ssm = pool.conv[self.index], pool.ssm[self.index]
        beta = ba[:, 0].sigmoid()
        g = -self.A_log.float().exp() * F.softplus(ba[:, 1].float() + self.dt_bias.float())
        rows, lens = pool.rows, pool.extend_lens_cpu
        weight = self.conv1d.weight
        if self.fla is not None:  # the packed step on the GPU kernels
            mixed = self.fla.conv(qkv, weight, conv, pool)
            q, k, v = (x[0] for x in self._heads(mixed[None], qkv.shape[0]))
            o = self.fla.delta_rule(q, k, v, g, beta, ssm, pool)
        elif pool.is_decode:  # every request's one token, batched
            window = torch.cat([conv[rows].float(), qkv.float()[:, :, None]], dim=-1)  # [B, C, K]
            conv[rows] = window[..., 1:].to(conv.dtype)
            mixed = F.silu((window * weight[:, 0].float()).sum(-1)).to(qkv.dtype)
            q, k, v = self._heads(mixed, 1)
            o, s = delta_rule.recurrent(q, k, v, g[:, None], beta[:, None], ssm[rows])
            ssm[rows] = s.to(ssm.dtype)
            o = o[:, 0]  # [B, Hv, Dv]
        else:
            outs, start = [], 0
            for b, n in enumerate(lens):
                row = rows[b : b + 1]
                seg = slice(start, start + n)
                mixed, conv[row[0]] = delta_rule.causal_conv(qkv[seg], weight, conv[row[0]])
                q, k, v = self._heads(mixed[None], n)
                rule = delta_rule.recurrent if n == 1 else delta_rule.chunked
                o, s = rule(q, k, v, g[None, seg], beta[None, seg], ssm[row])
                ssm[row] = s.to(ssm.dtype)
                outs.append(o[0])
                start += n
            o = torch.cat(outs)  # [T, Hv, Dv]
        return self._gated_norm(o, z).flatten(1)

    def _heads(self, mixed: torch.Tensor, n: int):
        """q, k [N, n, Hk, Dk], v [N, n, Hv, Dv] of the conv's output [N, n, C] ([B, C]: n 1)."""
        lin = self.lin
        mixed = mixed.reshape(-1, n, lin.conv_dim)
        q, k, v = mixed.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        shape = (mixed.shape[0], n)
        return (
            q.reshape(*shape, lin.num_k_heads, lin.head_k_dim),
            k.reshape(*shape, lin.num_k_heads, lin.head_k_dim),
            v.reshape(*shape, lin.num_v_heads, lin.head_v_dim),
        )

    def _gated_norm(self, o: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """RMSNorm over each head's Dv (fp32), times the weight, times silu(z)."""
        dtype = z.dtype
        x = o.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        x = self.gated_rms.weight * x.to(dtype)
        return (x * F.silu(z.float())).to(dtype)


def heads_spec(full_size: int, rank: int, size: int) -> ShardSpec:
    """Rank `rank`'s share of `full_size` rows grouped by head: one run, 1/size of them."""
    local = full_size // size
    return ShardSpec(0, full_size, (Run(rank * local, 0, local),))


def conv_spec(lin: LinearAttentionConfig, rank: int, size: int) -> ShardSpec:
    """Rank `rank`'s conv channels (Qwen3.5's in_proj_qkv rows): its q, k and v heads' slices
    of [q | k | v]."""
    key, value = lin.num_k_heads * lin.head_k_dim, lin.num_v_heads * lin.head_v_dim
    if size == 1:  # one run: a quantized in_proj_qkv is read whole, not in blocks of q / k / v
        return ShardSpec(0, lin.conv_dim, (Run(0, 0, lin.conv_dim),))
    lk, lv = key // size, value // size
    return ShardSpec(0, lin.conv_dim, (
        Run(rank * lk, 0, lk),
        Run(key + rank * lk, lk, lk),
        Run(2 * key + rank * lv, 2 * lk, lv),
    ))  # fmt: skip
