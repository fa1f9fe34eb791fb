"""Two backends behind one: the full layers over the full pool, the sliding layers over the
window pool (engine/window_pool.py), each with its own request-to-token table and its own slots
for the step's new tokens (AttentionInputs.window_out_cache_loc). The kernels run unchanged.

CUDA graphs: both backends' static buffers are loaded per replay (`load_graph_inputs`); there
are no static inputs for the one-kernel input load (`graph_static_inputs` is None), whose
kernel fills one backend's buffers."""

from __future__ import annotations

from dataclasses import replace

from batchrun.attention.base import AttentionBackend, AttentionInputs


class WindowedAttentionBackend(AttentionBackend):
    def __init__(self, full: AttentionBackend, window: AttentionBackend, sliding: tuple[int, ...]):
        self.full = full
        self.window = window
        self.sliding = frozenset(sliding)  # the KV pool indices of the sliding layers

    def _pick(self, layer_id: int) -> AttentionBackend:
        return self.window if layer_id in self.sliding else self.full

    @staticmethod
    def _window_inputs(inputs: AttentionInputs) -> AttentionInputs:
        assert inputs.window_out_cache_loc is not None, "a step without its window slots"
        return replace(inputs, out_cache_loc=inputs.window_out_cache_loc)

    def prepare(self, inputs: AttentionInputs) -> None:
        self.full.prepare(inputs)
        self.window.prepare(self._window_inputs(inputs))

    def forward(self, q, k, v, layer_id, scaling, out=None, window=0, sinks=None):
        return self._pick(layer_id).forward(q, k, v, layer_id, scaling, out, window, sinks)

    def forward_rotary(
        self, q, k, v, layer_id, scaling, positions, rotary, out=None, window=0, sinks=None
    ):
        backend = self._pick(layer_id)
        return backend.forward_rotary(
            q, k, v, layer_id, scaling, positions, rotary, out, window, sinks
        )

    # -- CUDA graphs (decode): each backend's static buffers ---------------------------------

    def init_graph_buffers(self, max_bs: int) -> None:
        self.full.init_graph_buffers(max_bs)
        self.window.init_graph_buffers(max_bs)

    def prepare_graph(self, bs: int) -> None:
        self.full.prepare_graph(bs)
        self.window.prepare_graph(bs)

    def load_graph_inputs(self, inputs: AttentionInputs, bs: int) -> None:
        self.full.load_graph_inputs(inputs, bs)
        self.window.load_graph_inputs(self._window_inputs(inputs), bs)
