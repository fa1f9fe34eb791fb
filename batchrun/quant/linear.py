"""The matmul of a quantized linear layer: what it keeps of a decoded weight (batchrun/quant/
weights.py) and how it multiplies, by device and kernel plan.

    QuantSpec.kernel                         what the layer keeps, how it multiplies
    "scaled_mm": FP8 per tensor / channel,   float8 weight kept; activations quantized per token
    static or dynamic activations, CUDA      (or with the static input_scale) by one Triton
    sm_89+ (fp8_matmul "scaled_mm"), bf16    kernel (kernels/fp8_quant.py); torch._scaled_mm
                                             (cuBLASLt): row-wise scales, or tensor-wise where
                                             every scale is one; decode
                                             batches (M <= 16) with decode_gemv "triton" on
                                             kernels/fp8_gemv.py
    "fp8_block": FP8 in 128 x 128 blocks,    float8 weight and block scales kept; activations
    dynamic activations, CUDA sm_90 with     quantized per token and group of 128 columns
    cuBLASLt's block matmul (fp8_matmul      (kernels/fp8_quant.py), then cuBLASLt's block-
    "scaled_mm"), K a multiple of 128, N     scaled F.scaled_mm; decode batches as
    of 16                                    "scaled_mm"'s, block-scaled
    "int4": INT4 (int4_matmul "triton":      the weight packed at load (batchrun/quant/
    CUDA, or CPU tensors under Triton's      int4_layout.py); on CUDA, where the tensor-core
    interpreter)                             decode GEMV takes it (no act-order, groups of
                                             whole 64-row steps, 64-row blocks), in its order
                                             (mma_pack) and decode batches (M <= 16) on
                                             kernels/int4_gemv_mma.py (the SwiGLU gate inside
                                             for a gate_up); the rest and act-order weights on
                                             kernels/int4_matmul.py (which reads both orders:
                                             one copy of the weight)
    "int4_dense": INT4 (int4_matmul          the weight dequantized at load (F.linear, as
    "dequant-gemv")                          "dense") and, where kernels/int4_gemv_mma.py
                                             takes it on CUDA, also kept in its order for the
                                             decode batches (M <= 16): a quarter more bytes
                                             than bf16, bf16's speed above 16 rows and the
                                             INT4 GEMV's below
    "dense": everything else                 the weight dequantized at load into the compute
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

from batchrun.config import KernelPlan
from batchrun.errors import ModelConfigError
from batchrun.quant.act_quant import (
    ReduceMax,
    fake_quant_dynamic,
    fake_quant_static,
    quant_per_token,
    quant_static,
)
from batchrun.quant.int4_layout import (
    Int4MmaPacked,
    Int4Packed,
    can_mma_pack,
    can_pack,
    mma_pack,
    pack_int4,
)
from batchrun.quant.weights import FP8_DTYPE, Fp8Weight, Int4Weight, QuantizedWeight

try:
    from batchrun.kernels import int4_matmul as int4_kernel
except ImportError:  # no Triton (CPU-only installs): KernelPlan.int4_matmul is "dequant"
    int4_kernel = None

try:
    from batchrun.kernels import int4_gemv_mma
except ImportError:  # no Triton, or one without Gluon (triton.experimental.gluon, from 3.5)
    int4_gemv_mma = None

try:
    from batchrun.kernels import fp8_quant
except ImportError:  # no Triton (CPU-only installs): FP8 blocks are dequantized, and the
    fp8_quant = None  # activations quantized by the torch ops

try:
    from batchrun.kernels.fp8_gemv import fp8_gemv, row_amax
except ImportError:  # no Triton (CPU-only installs): KernelPlan.decode_gemv is "cublas"
    fp8_gemv = row_amax = None

SCALED_MM_ALIGN = 16  # torch._scaled_mm: K and N multiples of this
KERNELS = ("scaled_mm", "fp8_block", "int4", "int4_dense", "dense")  # QuantSpec.kernel
INT4_KERNELS = ("int4", "int4_dense")  # those that keep the packed INT4 weight
# the layout's tensors (Int4Packed's fields), buffers of an INT4 QuantMatmul
INT4_BUFFERS = ("qweight", "scales", "zeros", "perm", "groups")
FP8_GEMV_MAX_ROWS = 16  # kernels/fp8_gemv.py's MAX_M


@dataclass(frozen=True)
class QuantSpec:
    """How one quantized linear runs, decided when the model is built."""

    family: str  # "fp8" | "int4"
    activations: str  # "none" | "dynamic" | "static" (the scheme's)
    block: tuple[int, int] | None  # FP8 weight blocks
    kernel: str  # one of KERNELS (the module docstring's table)
    describe: str  # the scheme's one line

    @property
    def keeps_fp8(self) -> bool:
        """The float8 weight and its scales are kept (not dequantized at load)."""
        return self.kernel in ("scaled_mm", "fp8_block")


def plan_linear(
    scheme,
    fp8_matmul: str,
    dtype: torch.dtype,
    modules: tuple[str, ...],
    out_features: int,
    in_features: int,
    int4_matmul: str = "dequant",
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
    kernel = _kernel(scheme, fp8_matmul, int4_matmul, dtype, out_features, in_features)
    return QuantSpec(scheme.family, scheme.activations, scheme.block, kernel, scheme.describe())


def _kernel(
    scheme,
    fp8_matmul: str,
    int4_matmul: str,
    dtype: torch.dtype,
    out_features: int,
    in_features: int,
):
    """The QuantSpec.kernel of a quantized linear (the module docstring's table)."""
    if scheme.family == "int4":
        if not can_pack(out_features):
            return "dense"
        return {"triton": "int4", "dequant-gemv": "int4_dense"}.get(int4_matmul, "dense")
    if fp8_matmul != "scaled_mm":
        return "dense"
    if scheme.block is not None:  # cuBLASLt's block matmul (kernel_choice's fp8_rule)
        fits = scheme.block == (128, 128) and scheme.activations == "dynamic"
        aligned = in_features % 128 == 0 and out_features % SCALED_MM_ALIGN == 0
        return "fp8_block" if fits and aligned and fp8_quant is not None else "dense"
    if (
        scheme.activations in ("dynamic", "static")
        and dtype == torch.bfloat16
        and out_features % SCALED_MM_ALIGN == 0
        and in_features % SCALED_MM_ALIGN == 0
    ):
        return "scaled_mm"
    return "dense"


def cublaslt_block_scale(scale: torch.Tensor) -> torch.Tensor:
    """A weight's 128 x 128 block scales [ceil(N / 128), K / 128] as cuBLASLt's BlockWise128x128
    operand of w.t(): [L4, ceil(N / 128)] with strides (1, L4), L4 = K / 128 rounded up to a
    multiple of 4 (the library's padding; the padded scales are never read against data)."""
    blocks_k = scale.shape[1]
    padded = F.pad(scale, (0, -blocks_k % 4), value=1.0).contiguous()
    return padded.t()


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
        kernels: KernelPlan | None = None,
    ):
        """reduce_max: a row-parallel layer's maximum over the tensor-parallel ranks (its input
        columns are split over them); None for a column-parallel layer or one rank. kernels:
        decode_gemv "triton" runs the decode batches of a scaled_mm layer on
        kernels/fp8_gemv.py; pdl launches the decode kernels (FP8 and INT4) with PDL."""
        super().__init__()
        self.spec, self.dtype = spec, dtype
        kernels = kernels or KernelPlan.reference()
        # kernels/fp8_gemv.py takes bf16 / fp16 activations (an fp32 model decodes on the
        # matmuls of its larger batches)
        self.fp8_gemv = (
            spec.kernel in ("scaled_mm", "fp8_block")
            and kernels.decode_gemv == "triton"
            and dtype in (torch.bfloat16, torch.float16)
        )
        self.pdl = bool(kernels.pdl)
        self.fast_accum = kernels.fp8_fast_accum
        # NOTE: per-token scales of a row-parallel input come from all its columns, on every
        # rank: one all-reduce of [M] floats per such layer makes TP=N quantize as TP=1
        self.reduce_max = reduce_max if spec.activations == "dynamic" and not spec.block else None
        self.out_features, self.in_features = out_features, in_features
        shape = (out_features, in_features)
        wdtype = FP8_DTYPE if spec.keeps_fp8 else dtype
        weight = None if spec.kernel == "int4" else torch.empty(shape, dtype=wdtype, device=device)
        self.register_buffer("weight", weight)
        scale = None
        if spec.kernel == "scaled_mm":
            scale = torch.empty(1, out_features, dtype=torch.float32, device=device)
        elif spec.kernel == "fp8_block":  # [ceil(out / 128), ceil(in / 128)]
            bo, bi = spec.block
            scale_shape = (-(-out_features // bo), -(-in_features // bi))
            scale = torch.empty(scale_shape, dtype=torch.float32, device=device)
        self.register_buffer("weight_scale", scale)
        self.group_size = 0
        self.mma = False  # the INT4 weight in Int4MmaPacked's order (set by `load`)
        if spec.kernel in INT4_KERNELS:  # shapes and presence known once loaded (Int4Packed)
            for name in INT4_BUFFERS:
                self.register_buffer(name, None)
        static = spec.activations == "static"
        self.register_buffer(
            "input_scale",
            torch.empty((), dtype=torch.float32, device=device) if static else None,
        )
        self.tensorwise = False  # scaled_mm with one weight scale and a static input scale
        self.fake_quant = False  # the CPU's model of FP8 activations (set by `load`)
        # scaled_mm's activations quantized by kernels/fp8_quant.py (CUDA), else by torch ops
        self.triton_quant = False

    def load(self, qw: QuantizedWeight, where: str) -> None:
        """Take this rank's decoded weight (sliced and fused by the loader)."""
        if (qw.out_features, qw.in_features) != (self.out_features, self.in_features):
            raise ValueError(
                f"{where}: decoded weight is [{qw.out_features}, {qw.in_features}], the layer "
                f"[{self.out_features}, {self.in_features}]"
            )
        if self.spec.kernel in INT4_KERNELS:
            assert isinstance(qw, Int4Weight)
            self._keep_int4(qw, mma_only=self.spec.kernel == "int4_dense")
            if self.spec.kernel == "int4":
                return
        device = self.weight.device
        with torch.no_grad():
            if self.input_scale is not None:
                self.input_scale.copy_(qw.input_scale)
            if self.spec.kernel == "scaled_mm":
                assert isinstance(qw, Fp8Weight) and qw.block is None
                self.weight.copy_(qw.weight)
                self.weight_scale.copy_(qw.scale.reshape(1, -1))
                self.tensorwise = self.input_scale is not None and bool(
                    (qw.scale == qw.scale[0]).all()
                )
            elif self.spec.kernel == "fp8_block":
                assert isinstance(qw, Fp8Weight) and qw.block == self.spec.block
                self.weight.copy_(qw.weight)
                self.weight_scale.copy_(qw.scale)
                self.register_buffer("cublaslt_scale", cublaslt_block_scale(self.weight_scale))
            else:
                self.weight.copy_(qw.dequantize(self.dtype))
        self.fake_quant = (
            device.type == "cpu" and self.spec.family == "fp8" and self.spec.activations != "none"
        )
        self.triton_quant = device.type == "cuda" and fp8_quant is not None

    def _keep_int4(self, qw: Int4Weight, mma_only: bool) -> None:
        """Pack the INT4 weight: in kernels/int4_gemv_mma.py's order where that kernel takes it
        (CUDA, bf16 / fp16, no act-order, groups of whole 64-row steps, whole 64-row programs),
        else in the plain order unless mma_only (int4_dense keeps only that kernel's copy)."""
        packed = pack_int4(qw)
        self.mma = (
            packed.qweight.is_cuda
            and int4_gemv_mma is not None
            and self.dtype in int4_gemv_mma.EXP_BITS
            and can_mma_pack(packed)
            and packed.out_features % int4_gemv_mma.ROWS == 0
        )
        if self.mma:
            packed = mma_pack(packed)
        elif mma_only:
            return
        for name in INT4_BUFFERS:
            setattr(self, name, getattr(packed, name, None))
        self.group_size = packed.group_size
        int4_kernel.prepare(packed.qweight.device)

    def takes_gemv(self, x: torch.Tensor) -> bool:
        """Whether x [M, K] runs on a decode kernel that can fuse the SwiGLU gate (`gemv`):
        kernels/fp8_gemv.py for a decode batch (M <= 16, unit stride along K) of a scaled_mm or
        fp8_block layer with decode_gemv "triton" (block FP8: a gate_up's halves whole 128-row
        blocks); kernels/int4_gemv_mma.py for one of an INT4 layer kept in its order
        (`_int4_gemv_takes`)."""
        if x.dim() != 2 or x.stride(-1) != 1 or x.dtype != self.dtype:
            return False
        if self.spec.kernel in INT4_KERNELS:
            return self._int4_gemv_takes(x.shape[0], swiglu=True)
        # block FP8: a fused gate_up's halves of whole 128-row blocks
        halves = self.spec.kernel != "fp8_block" or self.out_features % (2 * 128) == 0
        return self.fp8_gemv and halves and x.shape[0] <= FP8_GEMV_MAX_ROWS

    def gemv(self, x: torch.Tensor, swiglu: bool = False) -> torch.Tensor:
        """x @ W^T on the decode kernel (`takes_gemv`); with swiglu, W is a fused gate_up
        and the result silu(gate) * up [M, out_features / 2]."""
        if self.spec.kernel in INT4_KERNELS:  # (takes_gemv: only in the tensor-core GEMV's order)
            return int4_gemv_mma.int4_gemv_mma(x, self._packed(), swiglu=swiglu, pdl=self.pdl)
        return fp8_gemv(x, self.weight, swiglu=swiglu, **self._fp8_operands(x))

    def _fp8_operands(self, x: torch.Tensor) -> dict:
        """kernels/fp8_gemv.py's arguments for x besides the weight: its scales, the static
        input scale, or the per-token maxima over every rank (a row-parallel layer's)."""
        if self.spec.kernel == "fp8_block":
            return {"w_scale": self.weight_scale, "blocks": True, "pdl": self.pdl}
        amax = None
        if self.input_scale is None and self.reduce_max is not None:
            amax = self.reduce_max(row_amax(x))  # every rank's columns: TP=N quantizes as TP=1
        return {"w_scale": self.weight_scale.view(-1), "input_scale": self.input_scale,
                "amax": amax, "pdl": self.pdl}  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.spec.kernel == "scaled_mm":
            if self.takes_gemv(x):
                return self.gemv(x)
            return self._scaled_mm(x)
        if self.spec.kernel == "fp8_block":
            if self.takes_gemv(x):
                return self.gemv(x)
            return self._block_matmul(x)
        if self.spec.kernel == "int4":
            return self._int4(x)
        if self.mma and x.dim() == 2 and self.takes_gemv(x):  # int4_dense's decode batches
            return self.gemv(x)
        if self.fake_quant:
            x = self._fake_quant(x)
        return F.linear(x, self.weight)

    def _fake_quant(self, x: torch.Tensor) -> torch.Tensor:
        if self.input_scale is not None:
            return fake_quant_static(x, self.input_scale)
        shape = x.shape
        group = self.spec.block[1] if self.spec.block is not None else None
        return fake_quant_dynamic(x.reshape(-1, shape[-1]), group, self.reduce_max).view(shape)

    def _block_matmul(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1]).contiguous()  # [M, K]
        m = x2.shape[0]
        if m % 4:  # cuBLASLt's rows of x: a multiple of 4
            x2 = F.pad(x2, (0, 0, 0, -m % 4))
        xq, scale_x = fp8_quant.quant_per_token_group(x2, self.spec.block[1])
        y = F.scaled_mm(
            xq,
            self.weight.t(),
            scale_x,  # [M, K / 128], column-major: BlockWise1x128
            F.ScalingType.BlockWise1x128,
            self.cublaslt_scale,
            F.ScalingType.BlockWise128x128,
            output_dtype=self.dtype,
        )[:m]
        return y.view(*shape[:-1], self.out_features)

    def _quant_input(self, x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x2 [M, K] as float8 and its scale: [M, 1] per token, or the static scale (a scalar
        where the matmul is tensor-wise, else repeated to [M, 1])."""
        if not self.triton_quant:
            if self.input_scale is None:
                return quant_per_token(x2, self.reduce_max)
            scale = self.input_scale
            if not self.tensorwise:  # one per row ([M, 1], unit strides)
                scale = scale.reshape(1, 1).repeat(x2.shape[0], 1)
            return quant_static(x2, self.input_scale), scale
        x2 = x2.contiguous()
        if self.input_scale is not None:
            xq, scale = fp8_quant.quant_static(x2, self.input_scale)
            return xq, self.input_scale if self.tensorwise else scale
        amax = None
        if self.reduce_max is not None:  # the whole row's maximum, over every rank's columns
            amax = self.reduce_max(x2.abs().amax(dim=-1, keepdim=True).float())
        return fp8_quant.quant_per_token(x2, amax)

    def _scaled_mm(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])  # [M, K]
        xq, scale_a = self._quant_input(x2)
        if self.tensorwise:
            y = torch._scaled_mm(
                xq,
                self.weight.t(),
                scale_a=scale_a,
                scale_b=self.weight_scale[0, 0],
                out_dtype=self.dtype,
                use_fast_accum=self.fast_accum,
            )
        else:
            y = torch._scaled_mm(
                xq,
                self.weight.t(),
                scale_a=scale_a,
                scale_b=self.weight_scale,
                out_dtype=torch.bfloat16,
                use_fast_accum=self.fast_accum,
            )
        return y.view(*shape[:-1], self.out_features)

    def _packed(self) -> Int4Packed | Int4MmaPacked:
        if self.mma:
            return Int4MmaPacked(self.qweight, self.scales, self.zeros, self.group_size)
        return Int4Packed(
            self.qweight, self.scales, self.zeros, self.group_size, self.perm, self.groups
        )

    def _int4_gemv_takes(self, m: int, swiglu: bool = False) -> bool:
        """Whether an INT4 layer's x [m, K] runs on kernels/int4_gemv_mma.py: its `takes`, where
        the weight is in its order."""
        return self.mma and int4_gemv_mma.takes(self._packed(), m, swiglu=swiglu)

    def _int4(self, x: torch.Tensor) -> torch.Tensor:
        """Decode batches (M <= 16) on the tensor-core decode GEMV (`gemv`) where the weight is
        in its order, the rest (and act-order weights) on kernels/int4_matmul.py."""
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])  # [M, K]
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        # (the tensor-core GEMV multiplies in the layer's dtype; int4_matmul takes any)
        if x2.dtype == self.dtype and self._int4_gemv_takes(x2.shape[0]):
            y = self.gemv(x2)
        else:
            y = int4_kernel.int4_matmul(x2, self._packed())
        return y.view(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        dequantized = self.spec.kernel in ("dense", "int4_dense")
        path = "dequantized" if dequantized else self.spec.kernel
        if self.fp8_gemv:
            path += ", fp8_gemv for decode"
        if self.mma:
            path += ", int4_gemv_mma for decode"
        return f"{self.out_features}x{self.in_features}, {path}, {self.spec.describe}"
