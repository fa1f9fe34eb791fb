"""The Gated DeltaNet layer's GPU path (KernelPlan.linear_attention "fla"): the conv on
kernels/causal_conv1d.py, the delta rule on fla-core's Triton kernels, each request's states read
from and written back to its StatePool slot on the device: no host sync, no loop over requests.

    decode step (one token a request)   fla's fused_recurrent_gated_delta_rule over [B, 1]
    any other step (prefill chunks,     fla's chunk_gated_delta_rule over the packed tokens
    mixed prefill + decode)             (cu_seqlens; a decode row is a sequence of one token)

    h0 = ssm[rows]  ->  kernel(initial_state=h0)  ->  ssm[rows] = final state

A decode step launches the same kernels on the same buffers whatever the batch holds (rows and
cu_seqlens are the pool's step tensors), so a CUDA graph captures it (engine/cuda_graph.py).
fla-core and the Triton kernels import here, lazily: the module is imported only where the plan
says "fla" (CUDA, Triton and fla-core present; engine/kernel_choice.py's linear_rule).
"""

from __future__ import annotations

import torch
from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule

from batchrun.engine.state_pool import StatePool
from batchrun.kernels.causal_conv1d import causal_conv1d

CHUNK = 64  # fla's chunk of tokens (chunk_gated_delta_rule's default chunk_size)


def conv(qkv: torch.Tensor, weight: torch.Tensor, conv_states: torch.Tensor, states: StatePool):
    """silu(causal conv1d) of the step's packed qkv [T, C] after each request's conv state in
    `conv_states` [R, C, K-1] (one layer's), advanced in place. weight: the Conv1d's [C, 1, K]."""
    return causal_conv1d(
        qkv, weight[:, 0], conv_states, states.rows, states.cu_seqlens, states.max_len
    )


def delta_rule(q, k, v, g, beta, ssm: torch.Tensor, states: StatePool) -> torch.Tensor:
    """q, k [T, Hk, Dk], v [T, Hv, Dv], g (log decay, fp32), beta [T, Hv] of the step's packed
    tokens; `ssm` [R, Hv, Dk, Dv] one layer's delta states, each request's advanced in place.
    -> out [T, Hv, Dv] in v's dtype."""
    rows = states.rows
    h0 = ssm[rows]  # [B, Hv, Dk, Dv]
    if states.is_decode:
        out, final = fused_recurrent_gated_delta_rule(
            q[:, None], k[:, None], v[:, None], g[:, None], beta[:, None],
            initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True,
        )  # fmt: skip
        out = out[:, 0]
    else:
        out, final = chunk_gated_delta_rule(
            q[None], k[None], v[None], g[None], beta[None],
            initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True,
            cu_seqlens=states.cu_seqlens, chunk_indices=chunk_indices(states),
        )  # fmt: skip
        out = out[0]
    ssm.index_copy_(0, rows, final.to(ssm.dtype))
    return out


def chunk_indices(states: StatePool) -> torch.Tensor:
    """fla's chunk_indices [num_chunks, 2] (each chunk's request, its index in the request) of
    the step, on the device from cu_seqlens and the host's lengths: fla's own builds them on the
    host and copies them over. Built once a step (the pool's step cache serves every layer)."""
    cached = states.step_cache.get("fla_chunk_indices")
    if cached is not None:
        return cached
    num_chunks = sum(-(-n // CHUNK) for n in states.extend_lens_cpu)
    cu = states.cu_seqlens
    counts = (cu[1:] - cu[:-1] + CHUNK - 1) // CHUNK  # [B]
    seq = torch.arange(counts.shape[0], device=cu.device)
    seq = torch.repeat_interleave(seq, counts, output_size=num_chunks)  # [num_chunks]
    first = counts.cumsum(0) - counts
    index = torch.arange(num_chunks, device=cu.device) - first[seq]
    out = torch.stack([seq, index], 1).to(cu.dtype)
    states.step_cache["fla_chunk_indices"] = out
    return out
