"""Piecewise CUDA graphs for prefill and mixed steps: everything but the attention replays from
graphs; the attention, whose launches depend on the batch's requests and lengths, runs eagerly
between them.

    step of T tokens (not all decodes) -> bucket b = smallest captured size >= T (multiples of
                                          256; a mixture of experts also 1, 2, 4, ..., 128)
    static input_ids / positions [0, T) <- batch   (rows T..b: stale ids and positions, computed
                                                    and never read)
    piece 0           embed, model.piece(0): layer 0's norm, qkv (q/k norm)
                                                              -> static q, k, v, residual
    attention 0       model.attention(0, q[:T], k[:T], v[:T], positions[:T])
                                                              -> static attn_out[:T]  (eager)
    piece i (1..L-1)  model.piece(i): layer i-1's o_proj, norm, MLP, then layer i's norm, qkv
    attention i ...
    piece L           model.piece(L): layer L-1's o_proj, norm, MLP -> static hidden, residual
    logits            model.logits(hidden[:T], residual[:T])  (eager: the rows vary)

The pieces and the attention are the model's own (models/blocks/model.py), the ones its eager
forward runs.

Why: an eager forward of a mixed step launches ~10 kernels a layer from Python, and on the GPU
machine's host that costs ~8-17 ms of main-thread time per mixed step of llama-1b, while the GPU
runs the step in less (`scripts/bench_throughput.py --models llama-1b --variants
batchrun,no-piecewise`). With pieces, a layer costs one replay and its attention's launches.
Rotary is the attention's (forward_rotary): the Triton backend rotates inside its KV store, one
kernel, the same one as a decode step's, so a token's keys have the same bits whichever step
stored them.

Every piece reads and writes only the static buffers (made outside the graph pool), so the
memory a piece allocates while captured is free again when it ends: all pieces of all sizes
share one pool, whose size is that of the largest piece's intermediates. Pieces replay in the
order they were captured, one step at a time, so one piece's intermediates never outlive it.
"""

from __future__ import annotations

import bisect
import logging
import time

import torch

from batchrun.engine.gc_pause import no_gc

log = logging.getLogger(__name__)

BUCKET = 256  # tokens: captured sizes are multiples of this (a step pads up to the next one)
# the largest size captured: a bigger step runs eagerly (its GPU time dwarfs its launches), and
# every size costs capture time (a graph per layer)
MAX_TOKENS = 8192


def token_buckets(max_tokens: int, step: int = BUCKET, small: bool = False) -> list[int]:
    """Captured token counts: step, 2 * step, ... up to max_tokens rounded up to a step; with
    `small`, first the powers of two below step (1, 2, 4, ...)."""
    top = -(-max(max_tokens, 1) // step) * step
    below = [1 << i for i in range(step.bit_length()) if 1 << i < step] if small else []
    return below + list(range(step, top + 1, step))


def _store(src: torch.Tensor, dst: torch.Tensor) -> None:
    """dst <- src, skipped when src is dst already (a kernel that wrote its result in place)."""
    if src.data_ptr() != dst.data_ptr() or src.stride() != dst.stride():
        dst.copy_(src)


class PiecewiseGraphRunner:
    def __init__(self, model, backend, max_tokens: int, device: torch.device, bucket: int = BUCKET):
        self.model = model
        self.backend = backend
        self.device = device
        # a mixture of experts pads a small step to a power of two, not to a whole bucket: each
        # padded row runs through top_k experts, and its expert tiles are picked per power of two
        # below the bucket (kernels/fused_moe.py tile_tokens)
        self.buckets = token_buckets(max_tokens, bucket, small=model.config.moe is not None)
        self.max_tokens = n = self.buckets[-1]
        attn = model.layers[0].self_attn
        self.num_heads, self.head_dim = attn.num_heads, attn.head_dim
        self.q_size, self.kv_size = attn.q_size, attn.kv_size
        dtype = model.embed_tokens.weight.dtype
        hidden = model.config.hidden_size

        def zeros(*shape, dtype=dtype):
            return torch.zeros(shape, dtype=dtype, device=device)

        self.input_ids = zeros(n, dtype=torch.int64)
        self.positions = zeros(n, dtype=torch.int64)
        self.qkv = zeros(n, self.q_size + 2 * self.kv_size)  # after q/k norm, before rotary
        self.residual = zeros(n, hidden)
        self.hidden = zeros(n, hidden)  # the last piece's output
        self.attn_out = zeros(n, self.q_size)  # the eager attention writes here
        self.graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}
        self.capture_time = 0.0
        if device.type == "cuda":
            self._capture()
        # else (tests on the CPU): run() runs the same pieces eagerly, through the same buffers

    def can_run(self, num_tokens: int) -> bool:
        return num_tokens <= self.max_tokens

    def _qkv_views(self, rows: int):
        q, k, v = self.qkv[:rows].split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        kv_heads = self.kv_size // self.head_dim
        return (
            q.view(rows, self.num_heads, self.head_dim),
            k.view(rows, kv_heads, self.head_dim),
            v.view(rows, kv_heads, self.head_dim),
        )

    def _piece(self, b: int, i: int) -> None:
        """Piece i of a b-token forward, from and into the static buffers."""
        model = self.model
        residual = self.residual[:b]
        if i == 0:
            x, res = model.embed(self.input_ids[:b]), None
        else:
            x, res = self.attn_out[:b], residual
        if i == len(model.layers):
            x, res = model.piece(i, x, res)
            _store(x, self.hidden[:b])
            _store(res, residual)
            return
        q, k, v, res = model.piece(i, x, res)
        for got, static in zip((q, k, v), self._qkv_views(b)):
            _store(got, static)
        _store(res, residual)

    @torch.inference_mode()
    def _capture(self) -> None:
        t0 = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        num_pieces = len(self.model.layers) + 1
        with torch.cuda.stream(stream), no_gc():
            for b in reversed(self.buckets):  # largest first: the pool's size is set at once
                graphs = []
                for i in range(num_pieces):
                    self._piece(b, i)  # warm-up: Triton's JIT, cuBLAS's choice for this shape
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=pool, stream=stream):
                        self._piece(b, i)
                    graphs.append(graph)
                self.graphs[b] = graphs
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)
        self.capture_time = time.perf_counter() - t0
        log.info(
            "captured piecewise CUDA graphs for %d token counts up to %d (%d pieces each) in %.1fs",
            len(self.buckets),
            self.max_tokens,
            num_pieces,
            self.capture_time,
        )

    @torch.inference_mode()
    def run(self, input_ids, positions, logits_indices) -> torch.Tensor:
        """Logits of a prepared (backend.prepare) non-decode batch of at most max_tokens."""
        t = input_ids.shape[0]
        b = self.buckets[bisect.bisect_left(self.buckets, t)]
        self.input_ids[:t].copy_(input_ids, non_blocking=True)
        self.positions[:t].copy_(positions, non_blocking=True)
        graphs = self.graphs.get(b)
        q, k, v = self._qkv_views(t)
        out = self.attn_out[:t].view(t, self.num_heads, self.head_dim)
        positions = self.positions[:t]
        for i in range(len(self.model.layers)):
            self._replay(graphs, b, i)
            self.model.attention(i, q, k, v, positions, self.backend, out=out)
        self._replay(graphs, b, len(self.model.layers))
        return self.model.logits(self.hidden[:t], self.residual[:t], logits_indices)

    def _replay(self, graphs: list | None, b: int, i: int) -> None:
        if graphs:
            graphs[i].replay()
        else:
            self._piece(b, i)
