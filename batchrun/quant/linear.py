"""The matmul of a quantized linear layer: what it keeps of a decoded weight (batchrun/quant/
weights.py) and how it multiplies, by device and kernel config.

    FP8, per tensor / channel, CUDA sm_89+   float8 weight kept; activations quantized per token
    (fp8_matmul "scaled_mm", bf16)           (or with the static input_scale) on the device;
                                             torch._scaled_mm (cuBLASLt): row-wise scales, or
                                             tensor-wise where every scale is one; decode
                                             batches (M <= 16) with decode_gemv "triton" on
                                             kernels/fp8_gemv.py (the quantization inside)
    everything else                          the weight dequantized at load into the compute
                                             dtype, F.linear; on the CPU the FP8 activations
                                             are fake-quantized as the checkpoint says (the
                                             exact model of its kernels); on CUDA they are not

torch._scaled_mm's rules: operand A row-major float8 [M, K], operand B column-major (the
weight [N, K] transposed), K and N multiples of 16; row-wise scales float32 A [M, 1] and B
[1, N] with a bf16 output; tensor-wise scales one float32 value each. M is free (no padding).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from batchrun.config import KernelConfig
from batchrun.errors import ModelConfigError
from batchrun.quant.act_quant import (
    ReduceMax,
    fake_quant_dynamic,
    fake_quant_static,
    quant_per_token,
    quant_static,
)
from batchrun.quant.weights import FP8_DTYPE, Fp8Weight, QuantizedWeight

try:
    from batchrun.kernels.fp8_gemv import fp8_gemv, row_amax
except ImportError:  # no Triton (CPU-only installs): KernelConfig.decode_gemv is "cublas"
    fp8_gemv = row_amax = None

SCALED_MM_ALIGN = 16  # torch._scaled_mm: K and N multiples of this
FP8_GEMV_MAX_ROWS = 16  # kernels/fp8_gemv.py's MAX_M


@dataclass(frozen=True)
class QuantSpec:
    """How one quantized linear runs, decided when the model is built."""

    family: str  # "fp8" | "int4"
    activations: str  # "none" | "dynamic" | "static" (the scheme's)
    block: tuple[int, int] | None  # FP8 weight blocks
    scaled_mm: bool  # float8 weight kept, torch._scaled_mm; else a dense dequantized weight
    describe: str  # the scheme's one line


def plan_linear(
    scheme,
    fp8_matmul: str,
    dtype: torch.dtype,
    modules: tuple[str, ...],
    out_features: int,
    in_features: int,
) -> QuantSpec | None:
    """The QuantSpec of the linear that fuses the checkpoint linears `modules` (q, k, v_proj;
    gate, up_proj; or one), [out_features, in_features] on this rank; None when the scheme
    leaves them unquantized. Fused linears are quantized all or none."""
    if scheme is None:
        return None
    flags = [scheme.is_quantized(m) for m in modules]
    if not any(flags):
        return None
    if not all(flags):
        plain = [m for m, f in zip(modules, flags) if not f]
        raise ModelConfigError(
            f"the quantization_config leaves {', '.join(plain)} unquantized but quantizes the "
            f"rest of {', '.join(modules)}, which batchrun fuses into one matmul; quantize all "
            "of them or none"
        )
    scaled_mm = (
        scheme.family == "fp8"
        and fp8_matmul == "scaled_mm"
        and scheme.block is None
        and scheme.activations in ("dynamic", "static")
        and dtype == torch.bfloat16
        and out_features % SCALED_MM_ALIGN == 0
        and in_features % SCALED_MM_ALIGN == 0
    )
    return QuantSpec(scheme.family, scheme.activations, scheme.block, scaled_mm, scheme.describe())


class QuantMatmul(nn.Module):
    """x @ W^T for this rank's quantized W [out_features, in_features]; its tensors are buffers
    (not parameters: the plain-weight loaders leave them alone), filled by `load`."""

    def __init__(
        self,
        out_features: int,
        in_features: int,
        spec: QuantSpec,
        dtype,
        device,
        reduce_max: ReduceMax = None,
        kernels: KernelConfig | None = None,
    ):
        """reduce_max: a row-parallel layer's maximum over the tensor-parallel ranks (its input
        columns are split over them); None for a column-parallel layer or one rank. kernels:
        decode_gemv "triton" runs the decode batches of a scaled_mm layer on
        kernels/fp8_gemv.py."""
        super().__init__()
        self.spec, self.dtype = spec, dtype
        kernels = kernels or KernelConfig.reference()
        self.fp8_gemv = spec.scaled_mm and kernels.decode_gemv == "triton"
        self.pdl = bool(kernels.pdl)
        # NOTE: per-token scales of a row-parallel input come from all its columns, on every
        # rank: one all-reduce of [M] floats per such layer makes TP=N quantize as TP=1
        self.reduce_max = reduce_max if spec.activations == "dynamic" and not spec.block else None
        self.out_features, self.in_features = out_features, in_features
        shape = (out_features, in_features)
        wdtype = FP8_DTYPE if spec.scaled_mm else dtype
        self.register_buffer("weight", torch.empty(shape, dtype=wdtype, device=device))
        scale = torch.empty(1, out_features, dtype=torch.float32, device=device)
        self.register_buffer("weight_scale", scale if spec.scaled_mm else None)
        static = spec.activations == "static"
        self.register_buffer(
            "input_scale",
            torch.empty((), dtype=torch.float32, device=device) if static else None,
        )
        self.tensorwise = False  # scaled_mm with one weight scale and a static input scale
        self.fake_quant = False  # the CPU's model of FP8 activations (set by `load`)

    def load(self, qw: QuantizedWeight, where: str) -> None:
        """Take this rank's decoded weight (sliced and fused by the loader)."""
        if (qw.out_features, qw.in_features) != (self.out_features, self.in_features):
            raise ValueError(
                f"{where}: decoded weight is [{qw.out_features}, {qw.in_features}], the layer "
                f"[{self.out_features}, {self.in_features}]"
            )
        device = self.weight.device
        with torch.no_grad():
            if self.input_scale is not None:
                self.input_scale.copy_(qw.input_scale)
            if self.spec.scaled_mm:
                assert isinstance(qw, Fp8Weight) and qw.block is None
                self.weight.copy_(qw.weight)
                self.weight_scale.copy_(qw.scale.reshape(1, -1))
                self.tensorwise = self.input_scale is not None and bool(
                    (qw.scale == qw.scale[0]).all()
                )
            else:
                self.weight.copy_(qw.dequantize(self.dtype))
        self.fake_quant = (
            device.type == "cpu" and self.spec.family == "fp8" and self.spec.activations != "none"
        )

    def takes_gemv(self, x: torch.Tensor) -> bool:
        """Whether x [M, K] runs on kernels/fp8_gemv.py: a decode batch (M <= 16, unit stride
        along K) of a scaled_mm layer with decode_gemv "triton"."""
        return (
            self.fp8_gemv
            and x.dim() == 2
            and x.shape[0] <= FP8_GEMV_MAX_ROWS
            and x.stride(-1) == 1
            and x.dtype == self.dtype
        )

    def gemv(self, x: torch.Tensor, swiglu: bool = False) -> torch.Tensor:
        """x @ W^T on kernels/fp8_gemv.py (`takes_gemv`); with swiglu, W is a fused gate_up
        and the result silu(gate) * up [M, out_features / 2]."""
        amax = None
        if self.input_scale is None and self.reduce_max is not None:
            amax = self.reduce_max(row_amax(x))  # every rank's columns: TP=N quantizes as TP=1
        return fp8_gemv(
            x,
            self.weight,
            self.weight_scale.view(-1),
            self.input_scale,
            amax=amax,
            swiglu=swiglu,
            pdl=self.pdl,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.spec.scaled_mm:
            if self.takes_gemv(x):
                return self.gemv(x)
            return self._scaled_mm(x)
        if self.fake_quant:
            x = self._fake_quant(x)
        return F.linear(x, self.weight)

    def _fake_quant(self, x: torch.Tensor) -> torch.Tensor:
        if self.input_scale is not None:
            return fake_quant_static(x, self.input_scale)
        shape = x.shape
        group = self.spec.block[1] if self.spec.block is not None else None
        return fake_quant_dynamic(x.reshape(-1, shape[-1]), group, self.reduce_max).view(shape)

    def _scaled_mm(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])  # [M, K]
        if self.input_scale is None:
            xq, scale_a = quant_per_token(x2, self.reduce_max)
        else:
            xq = quant_static(x2, self.input_scale)
            scale_a = self.input_scale
        if self.tensorwise:
            y = torch._scaled_mm(
                xq,
                self.weight.t(),
                scale_a=scale_a,
                scale_b=self.weight_scale[0, 0],
                out_dtype=self.dtype,
            )
        else:
            if scale_a.dim() == 0:  # the static scale, one per row ([M, 1], unit strides)
                scale_a = scale_a.reshape(1, 1).repeat(x2.shape[0], 1)
            y = torch._scaled_mm(
                xq,
                self.weight.t(),
                scale_a=scale_a,
                scale_b=self.weight_scale,
                out_dtype=torch.bfloat16,
            )
        return y.view(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        path = "scaled_mm" if self.spec.scaled_mm else "dequantized"
        if self.fp8_gemv:
            path += ", fp8_gemv for decode"
        return f"{self.out_features}x{self.in_features}, {path}, {self.spec.describe}"
