"""Pure-PyTorch attention over the paged KV pool: the reference backend, and the CPU one.

A step's requests are gathered into one padded batch when padding wastes little:

    q_pad   [B, H, max_q, D]     request b's new tokens, padded to the longest extend
    kv_pad  [B, KV, max_kv, D]   request b's KV slots (prefix + new), padded to the longest
    mask    [B, 1, max_q, max_kv] key k visible to query j iff k <= prefix_b + j and k < seq_b
            (and, in a layer with a sliding window W, k > prefix_b + j - W)

Otherwise (one long prefill next to many short ones, or a padded batch over MAX_PADDED_SCORES
query-key pairs, whose mask and scores would take gigabytes for long prompts) each request gets
its own scaled_dot_product_attention call.

Attention sinks (gpt-oss) run as an explicit softmax over [scores, sink] (`attend_with_sinks`):
scaled_dot_product_attention has no term for them.

A float8_e4m3fn pool's K and V convert to q's dtype (exact); the layer's k scale is folded into
the softmax scale and its v scale multiplies the output, as the Triton kernels do.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F

from batchrun.attention.base import AttentionBackend, AttentionInputs

# pad when the padded work is at most this many times the real work
MAX_PADDING_WASTE = 4.0
# a padded batch of more query-key pairs runs as a loop: its mask holds one byte a pair and the
# scores four a pair and head (a step of three 32k-token prompts: 3 GB of mask, 25 GB of scores)
MAX_PADDED_SCORES = 1 << 24


class TorchAttentionBackend(AttentionBackend):
    def __init__(self, kv_pool, req_to_token: torch.Tensor):
        self.kv_pool = kv_pool
        self.req_to_token = req_to_token
        self._inputs: AttentionInputs | None = None
        self._plan = None
        self._masks: dict[int, object] = {}  # window -> the plan's masks (0: the whole context)

    def prepare(self, inputs: AttentionInputs) -> None:
        self._inputs = inputs
        self._masks = {}
        seq, ext = inputs.seq_lens_cpu, inputs.extend_lens_cpu
        max_q, max_kv = max(ext), max(seq)
        real = sum(n * s for n, s in zip(ext, seq))
        padded = len(seq) * max_q * max_kv
        if len(seq) == 1 or padded > min(MAX_PADDING_WASTE * real + 4096, MAX_PADDED_SCORES):
            self._plan = ("loop", self._plan_loop(inputs))
        else:
            self._plan = ("padded", *self._plan_padded(inputs, max_q, max_kv))

    def _plan_padded(self, inputs: AttentionInputs, max_q: int, max_kv: int):
        dev = self.req_to_token.device
        ext_t = inputs.extend_lens  # [B]
        seq_t = inputs.seq_lens
        slots = self.req_to_token[inputs.req_pool_indices, :max_kv].long()  # [B, S]
        j = torch.arange(max_q, device=dev)
        k = torch.arange(max_kv, device=dev)
        q_valid = j[None, :] < ext_t[:, None]  # [B, Q]
        q_pos = (seq_t - ext_t)[:, None] + j[None, :]  # [B, Q]
        mask = (k[None, None, :] <= q_pos[:, :, None]) & (k[None, None, :] < seq_t[:, None, None])
        # padded query rows see key 0 so that softmax stays finite; their output is dropped
        pad = (~q_valid)[:, :, None] & (k == 0)[None, None, :]
        window_mask = WindowMask(mask, pad, q_pos[:, :, None], k[None, None, :])
        starts = torch.cumsum(ext_t, 0) - ext_t  # [B]
        q_index = (starts[:, None] + j[None, :]).clamp(max=inputs.out_cache_loc.numel() - 1)
        flat = [b * max_q + t for b, n in enumerate(inputs.extend_lens_cpu) for t in range(n)]
        out_index = torch.tensor(flat, dtype=torch.int64).to(dev, non_blocking=True)
        return slots, window_mask, q_index, out_index

    def _plan_loop(self, inputs: AttentionInputs):
        per_req = []
        start = 0
        for b, (seq_len, n) in enumerate(zip(inputs.seq_lens_cpu, inputs.extend_lens_cpu)):
            slots = self.req_to_token[inputs.req_pool_indices[b], :seq_len].long()
            # queries sit at the end of the KV: bottom-right causal
            q_pos = torch.arange(seq_len - n, seq_len, device=slots.device)[:, None]
            k_pos = torch.arange(seq_len, device=slots.device)[None, :]
            per_req.append((start, n, slots, WindowMask(None, None, q_pos, k_pos)))
            start += n
        return per_req

    def forward(
        self, q, k, v, layer_id: int, scaling: float, out=None, window=0, sinks=None
    ) -> torch.Tensor:
        result = self._forward(q, k, v, layer_id, scaling, window, sinks)
        if out is None:
            return result
        return out.view_as(result).copy_(result)

    def _forward(self, q, k, v, layer_id: int, scaling: float, window: int, sinks) -> torch.Tensor:
        inputs = self._inputs
        assert inputs is not None, "prepare() must run before forward()"
        if k is not None:  # None: a layer that reads another layer's KV
            self.kv_pool.store(layer_id, inputs.out_cache_loc, k, v)
        k_buf, v_buf = self.kv_pool.buffers(layer_id)
        scale = scaling * self.kv_pool.scales(layer_id).k
        out = self._attend(q, k_buf, v_buf, scale, window, sinks)
        if self.kv_pool.is_fp8:
            out = out * self.kv_pool.scales(layer_id).v
        return out

    def _attend(self, q, k_buf, v_buf, scaling: float, window: int, sinks) -> torch.Tensor:
        sdpa = (
            F.scaled_dot_product_attention if sinks is None else partial(attend_with_sinks, sinks)
        )
        num_tokens, num_heads, head_dim = q.shape
        if self._plan[0] == "padded":
            _, slots, window_mask, q_index, out_index = self._plan
            mask = self._masks.get(window)
            if mask is None:
                mask = self._masks[window] = window_mask.padded(window)
            qp = q[q_index].transpose(1, 2)  # [B, H, Q, D]
            keys = k_buf[slots].to(q.dtype).transpose(1, 2)  # [B, KV, S, D]
            values = v_buf[slots].to(q.dtype).transpose(1, 2)
            out = sdpa(
                qp, keys, values, attn_mask=mask, scale=scaling, enable_gqa=True
            )  # [B, H, Q, D]
            out = out.transpose(1, 2).reshape(-1, num_heads * head_dim)
            return out[out_index]
        out = torch.empty_like(q)
        masks = self._masks.get(window)
        if masks is None:
            masks = self._masks[window] = [wm.single(window) for _, _, _, wm in self._plan[1]]
        for (start, n, slots, _), mask in zip(self._plan[1], masks):
            # NOTE: 4-d: the CPU's fused (flash) kernel takes only a batch dim; 3-d inputs run
            # the math path, whose [H, n, S] scores take gigabytes for a long prompt
            qi = q[start : start + n].transpose(0, 1)[None]  # [1, H, n, D]
            keys = k_buf[slots].to(q.dtype).transpose(0, 1)[None]  # [1, KV, S, D]
            values = v_buf[slots].to(q.dtype).transpose(0, 1)[None]
            oi = sdpa(
                qi,
                keys,
                values,
                attn_mask=mask,
                is_causal=mask is None and n > 1,
                scale=scaling,
                enable_gqa=True,
            )
            out[start : start + n] = oi[0].transpose(0, 1)
        return out.reshape(num_tokens, num_heads * head_dim)


def attend_with_sinks(
    sinks, q, k, v, attn_mask=None, is_causal=False, scale=1.0, enable_gqa=True
) -> torch.Tensor:
    """scaled_dot_product_attention's result with a sink logit per head in each softmax's
    denominator (transformers' gpt-oss eager attention): q [..., H, Q, D], k and v
    [..., KV, S, D], attn_mask bool (True: visible) or is_causal; sinks [H]. fp32 inside."""
    num_heads, num_kv = q.shape[-3], k.shape[-3]
    if num_kv != num_heads:
        k = k.repeat_interleave(num_heads // num_kv, dim=-3)
        v = v.repeat_interleave(num_heads // num_kv, dim=-3)
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale  # [..., H, Q, S]
    if is_causal:
        n, s = scores.shape[-2:]
        attn_mask = torch.ones(n, s, dtype=torch.bool, device=q.device).tril(s - n)
    if attn_mask is not None:
        scores = scores.masked_fill(~attn_mask, float("-inf"))
    sink = sinks.float().view(num_heads, 1, 1).expand(*scores.shape[:-1], 1)
    probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    return torch.matmul(probs, v.float()).to(q.dtype)


class WindowMask:
    """A plan's causal mask (`causal`: key visible to query; None: k_pos <= q_pos, made when
    needed), made per sliding window: keys at positions k_pos <= q_pos - window are hidden too.
    `pad`: the padded batch's dummy query rows, which see key 0 so that softmax stays finite
    (their output is dropped)."""

    def __init__(self, causal, pad, q_pos, k_pos):
        self.causal, self.pad, self.q_pos, self.k_pos = causal, pad, q_pos, k_pos

    def _visible(self, window: int):
        causal = self.k_pos <= self.q_pos if self.causal is None else self.causal
        if window <= 0:
            return causal
        return causal & (self.k_pos > self.q_pos - window)

    def padded(self, window: int):
        """[B, 1, Q, S] for the padded batch."""
        return (self._visible(window) | self.pad)[:, None]

    def single(self, window: int):
        """[n, S] for one request, or None where is_causal says it (n == S, no window)."""
        n, s = self.q_pos.shape[0], self.k_pos.shape[1]
        if n == 1 and (window <= 0 or window >= s):
            return None  # decode over the whole KV
        if window <= 0 and n == s:
            return None
        return self._visible(window)
