"""Pure-PyTorch attention over the paged KV pool: the reference backend, and the CPU one.

Decode batches (one new token per request) are gathered into one padded batch; extend batches
(prefill chunks, possibly mixed with decodes) run one scaled_dot_product_attention per request.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from batchrun.attention.base import AttentionBackend, AttentionInputs


class TorchAttentionBackend(AttentionBackend):
    def __init__(self, kv_pool, req_to_token: torch.Tensor):
        self.kv_pool = kv_pool
        self.req_to_token = req_to_token
        self._inputs: AttentionInputs | None = None
        self._plan = None

    def prepare(self, inputs: AttentionInputs) -> None:
        self._inputs = inputs
        if inputs.is_decode:
            max_len = max(inputs.seq_lens_cpu)
            slots = self.req_to_token[inputs.req_pool_indices, :max_len].long()  # [B, S]
            pos = torch.arange(max_len, device=slots.device)
            valid = pos[None, :] < inputs.seq_lens[:, None]  # [B, S]
            self._plan = ("decode", slots, valid[:, None, None, :])
        else:
            per_req = []
            start = 0
            for b, (seq_len, n) in enumerate(zip(inputs.seq_lens_cpu, inputs.extend_lens_cpu)):
                slots = self.req_to_token[inputs.req_pool_indices[b], :seq_len].long()
                mask = None
                if n != seq_len:  # queries sit at the end of the KV: bottom-right causal mask
                    q_pos = torch.arange(seq_len - n, seq_len, device=slots.device)
                    k_pos = torch.arange(seq_len, device=slots.device)
                    mask = k_pos[None, :] <= q_pos[:, None]  # [n, S]
                per_req.append((start, n, slots, mask))
                start += n
            self._plan = ("extend", per_req)

    def forward(self, q, k, v, layer_id: int, scaling: float) -> torch.Tensor:
        inputs = self._inputs
        assert inputs is not None, "prepare() must run before forward()"
        self.kv_pool.store(layer_id, inputs.out_cache_loc, k, v)
        k_buf, v_buf = self.kv_pool.buffers(layer_id)
        num_tokens, num_heads, head_dim = q.shape
        if self._plan[0] == "decode":
            _, slots, valid = self._plan
            keys = k_buf[slots].transpose(1, 2)  # [B, KV, S, D]
            values = v_buf[slots].transpose(1, 2)
            out = F.scaled_dot_product_attention(
                q.unsqueeze(2), keys, values, attn_mask=valid, scale=scaling, enable_gqa=True
            )  # [B, H, 1, D]
            return out.reshape(num_tokens, num_heads * head_dim)
        out = torch.empty_like(q)
        for start, n, slots, mask in self._plan[1]:
            qi = q[start : start + n].transpose(0, 1)  # [H, n, D]
            keys = k_buf[slots].transpose(0, 1)  # [KV, S, D]
            values = v_buf[slots].transpose(0, 1)
            oi = F.scaled_dot_product_attention(
                qi,
                keys,
                values,
                attn_mask=mask,
                is_causal=mask is None and n > 1,
                scale=scaling,
                enable_gqa=True,
            )
            out[start : start + n] = oi.transpose(0, 1)
        return out.reshape(num_tokens, num_heads * head_dim)
