"""The attention backend interface.

A backend is told once per step what the batch looks like (`prepare`), then called once per layer
with the new tokens' q, k, v. It stores k, v into the token-indexed KV pool at `out_cache_loc` and
attends each request's new queries over all of that request's KV (cached prefix + new tokens):

    request i, KV positions:  [0 ........ prefix_len_i ........ seq_len_i)
                              |<- cached (radix / earlier) ->|<- new: extend_len_i ->|
    queries of request i are its extend_len_i new tokens, at positions prefix_len_i .. seq_len_i-1

A layer with a sliding window (`window` > 0) attends only over the last `window` positions: the
query at position p sees the keys at positions p - window < k <= p (transformers' convention: the
query's own token and the window - 1 before it). window 0 is the whole context.

`sinks` (gpt-oss: [num_heads] fp32, this rank's heads) adds a learned logit per head to each
softmax's denominator: softmax over [q.k scores, sink] with the sink's share dropped, so the
weights of the keys sum to less than 1.

k and v None: attend over the KV at `layer_id` as it is, storing nothing (a layer that reads
another layer's KV: ModelConfig.kv_sources).

`forward_rotary` is `forward` of q and k before rotary: by default it rotates them and calls
`forward`; a backend may do the rotation inside its KV store (TritonAttentionBackend: one kernel).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from batchrun.layers.rotary import RotaryEmbedding


@dataclass(frozen=True)
class AttentionInputs:
    req_pool_indices: torch.Tensor  # [B] int64, rows of req_to_token
    seq_lens: torch.Tensor  # [B] int64, KV length after this step
    extend_lens: torch.Tensor  # [B] int64, new tokens per request
    out_cache_loc: torch.Tensor  # [T] int64, KV slots of the new tokens
    # host copies, so backends plan without reading device memory
    seq_lens_cpu: tuple[int, ...]
    extend_lens_cpu: tuple[int, ...]
    # [T] int64, the new tokens' slots in the sliding layers' pool (engine/window_pool.py);
    # None where every layer keeps every position
    window_out_cache_loc: torch.Tensor | None = None

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def is_decode(self) -> bool:
        return all(n == 1 for n in self.extend_lens_cpu)


class AttentionBackend:
    """Interface. `forward` returns [T, num_heads * head_dim]; given `out` ([T, num_heads,
    head_dim], contiguous), it writes there and returns out's view."""

    def prepare(self, inputs: AttentionInputs) -> None:
        raise NotImplementedError

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer_id: int,
        scaling: float,
        out: torch.Tensor | None = None,
        window: int = 0,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        raise NotImplementedError

    def forward_rotary(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer_id: int,
        scaling: float,
        positions: torch.Tensor,
        rotary: RotaryEmbedding,
        out: torch.Tensor | None = None,
        window: int = 0,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`forward` of q and k before rotary: `rotary(positions, q, k)` first. q and k may be
        rotated in place (strided views of the qkv projection included)."""
        q, k = rotary(positions, q, k)
        return self.forward(q, k, v, layer_id, scaling, out, window, sinks)

    def graph_static_inputs(self) -> tuple[tuple[torch.Tensor, ...], int, int] | None:
        """For CUDA-graph runners that fill the decode graphs' inputs themselves, in one kernel
        (kernels/graph_inputs.py): the static (req_pool_indices, seq_lens, out_cache_loc)
        buffers, the padding rows' request row and KV slot. None: the runner calls
        `load_graph_inputs` (a backend with more to prepare per replay, or none)."""
        return None


def refuse_sinks(sinks, backend: str) -> None:
    """Attention sinks (gpt-oss) are the torch backend's; engine/kernel_choice.py picks it."""
    if sinks is not None:
        raise ValueError(
            f"the {backend} attention backend runs no attention sinks (gpt-oss's); use "
            "--attention-backend torch"
        )
