"""The Gated DeltaNet recurrence in plain torch: the reference, and the CPU path.

Per value head, with a state S [Dk, Dv] and per token t a query q, key k (both L2-normed, q
scaled by Dk ** -0.5), value v, decay g <= 0 (log space) and write strength beta in (0, 1):

    S  <- exp(g) * S
    S  <- S + k (beta * (v - S^T k))^T        the delta rule: write the part S does not predict
    o   = S^T q

`recurrent` runs it token by token (decode: one token a request); `chunked` runs blocks of
CHUNK tokens with matmuls (prefill). Inside a chunk whose tokens are 0..C-1, with cumulative
decay c_i = g_0 + ... + g_i, the C updates reduce to one triangular solve (the WY form):

    L      = I + strict_lower(beta_i k_i . k_j exp(c_i - c_j))          [C, C]
    U      = L^-1 (beta v)           W = L^-1 (beta k exp(c))            the writes, the reads
    V'     = U - W S0                                                    the corrections
    out    = (q exp(c)) S0 + lower(q_i . k_j exp(c_i - c_j)) V'
    S1     = exp(c_last) S0 + (k exp(c_last - c))^T V'

Both compute in fp32 and take a state in and give it back, so a request's prefill may be split
at any token (chunked prefill, prefix snapshots) and resumed by either form.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK = 64


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def _prepare(q, k, v, g, beta):
    """[N, T, Hk|Hv, D] inputs -> fp32 [N, Hv, T, D] (q, k repeated over their value heads, L2
    normed, q scaled), g and beta [N, Hv, T]."""
    group = v.shape[2] // k.shape[2]
    if group > 1:
        q, k = q.repeat_interleave(group, dim=2), k.repeat_interleave(group, dim=2)
    q, k, v = (x.transpose(1, 2).float() for x in (q, k, v))
    q, k = l2norm(q), l2norm(k)
    q = q * q.shape[-1] ** -0.5
    return q, k, v, g.transpose(1, 2).float(), beta.transpose(1, 2).float()


def recurrent(q, k, v, g, beta, state: torch.Tensor):
    """q, k [N, T, Hk, Dk], v [N, T, Hv, Dv], g, beta [N, T, Hv], state [N, Hv, Dk, Dv] fp32
    -> (out [N, T, Hv, Dv] in v's dtype, the state after the T tokens)."""
    dtype = v.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta)
    s = state.float().clone()
    outs = []
    for t in range(q.shape[2]):
        s = s * g[:, :, t, None, None].exp()
        predicted = (s * k[:, :, t, :, None]).sum(-2)  # [N, Hv, Dv]
        delta = (v[:, :, t] - predicted) * beta[:, :, t, None]
        s = s + k[:, :, t, :, None] * delta[:, :, None, :]
        outs.append((s * q[:, :, t, :, None]).sum(-2))
    out = torch.stack(outs, dim=2)  # [N, Hv, T, Dv]
    return out.transpose(1, 2).to(dtype), s


def chunked(q, k, v, g, beta, state: torch.Tensor):
    """`recurrent` in blocks of CHUNK tokens (same arguments and results)."""
    dtype, n_tok = v.dtype, v.shape[1]
    q, k, v, g, beta = _prepare(q, k, v, g, beta)
    pad = -n_tok % CHUNK
    if pad:  # padded tokens: k = v = 0 and g = 0 change neither the state nor the real outputs
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = F.pad(g, (0, pad)), F.pad(beta, (0, pad))
    n, h, t, dk = k.shape
    split = (n, h, t // CHUNK, CHUNK)
    q, k, v = (x.reshape(*split, -1) for x in (q, k, v))  # [N, H, nC, C, D]
    c = g.reshape(split).cumsum(-1)  # [N, H, nC, C]
    beta = beta.reshape(split)[..., None]
    upper = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=q.device).triu(1)
    decay = (c[..., :, None] - c[..., None, :]).masked_fill(upper, float("-inf")).exp()
    kb = k * beta
    lower = (kb @ k.transpose(-1, -2)) * decay
    eye = torch.eye(CHUNK, dtype=q.dtype, device=q.device)
    system = eye + lower.tril(-1)
    writes = torch.linalg.solve_triangular(system, v * beta, upper=False, unitriangular=True)
    reads = torch.linalg.solve_triangular(system, kb * c[..., None].exp(), upper=False,
                                          unitriangular=True)  # fmt: skip
    attn = (q @ k.transpose(-1, -2)) * decay  # lower incl. the diagonal (decay is 0 above)
    q_decayed = q * c[..., None].exp()
    last = c[..., -1:]  # [N, H, nC, 1]
    k_decayed = k * (last - c).exp()[..., None]
    s = state.float()
    out = torch.empty_like(v)
    for i in range(t // CHUNK):
        fix = writes[:, :, i] - reads[:, :, i] @ s  # [N, H, C, Dv]
        out[:, :, i] = q_decayed[:, :, i] @ s + attn[:, :, i] @ fix
        s = s * last[:, :, i, :, None].exp() + k_decayed[:, :, i].transpose(-1, -2) @ fix
    out = out.reshape(n, h, t, -1)[:, :, :n_tok]
    return out.transpose(1, 2).to(dtype), s


def causal_conv(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor):
    """The depthwise causal conv1d with SiLU of one request's new tokens x [T, C] after its
    `state` [C, K-1] (the K-1 inputs before them, zeros at the start) -> (out [T, C], the state
    after them). weight [C, 1, K]."""
    window = torch.cat([state.to(x.dtype), x.transpose(0, 1)], dim=-1)  # [C, K-1+T]
    out = F.conv1d(window[None], weight.to(x.dtype), groups=x.shape[1])[0]  # [C, T]
    return F.silu(out).transpose(0, 1), window[:, window.shape[1] - state.shape[1] :]
