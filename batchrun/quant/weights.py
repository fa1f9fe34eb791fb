"""Quantized weights in one layout whatever the checkpoint's: [out, in] like nn.Linear's weight,
one value per element (unpacked), with their scales. Every checkpoint format decodes into one of
these (batchrun/quant/formats/), tensor parallelism slices them (`narrow_out`, `narrow_in`),
fused projections concatenate them (`cat_out`: q | k | v, gate | up), and a linear layer turns
the result into what its device runs (batchrun/quant/linear.py).

    Fp8Weight   W = weight * scale            scale per output row, or per (row, column) block
    Int4Weight  W = (q - zero) * scale        per output row and group of input columns
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite e4m3fn value


@dataclass
class Fp8Weight:
    weight: torch.Tensor  # float8_e4m3fn [out, in]
    # float32: [out] per output row (a per-tensor scale is broadcast to every row), or
    # [ceil(out / block[0]), ceil(in / block[1])] with `block`
    scale: torch.Tensor
    block: tuple[int, int] | None = None
    # float32 scalar: the static per-tensor activation scale; None: activations are quantized
    # dynamically (per token, or per token and group of block[1] columns with `block`)
    input_scale: torch.Tensor | None = None

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    @property
    def in_features(self) -> int:
        return self.weight.shape[1]

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight the scales stand for, [out, in] in `dtype` (computed in fp32)."""
        w = self.weight.float()
        if self.block is None:
            return (w * self.scale.float()[:, None]).to(dtype)
        return (w * self.expanded_scale()).to(dtype)

    def expanded_scale(self) -> torch.Tensor:
        """The block scales repeated to one per element, [out, in] float32."""
        bo, bi = self.block
        s = self.scale.float().repeat_interleave(bo, 0).repeat_interleave(bi, 1)
        return s[: self.out_features, : self.in_features]

    def narrow_out(self, start: int, length: int) -> Fp8Weight:
        scale = self.scale
        if self.block is None:
            scale = scale[start : start + length]
        else:
            bo = self.block[0]
            _aligned("output rows", start, length, bo, self.out_features)
            scale = scale[start // bo : -(-(start + length) // bo)]
        return Fp8Weight(self.weight[start : start + length], scale, self.block, self.input_scale)

    def narrow_in(self, start: int, length: int) -> Fp8Weight:
        scale = self.scale
        if self.block is not None:
            bi = self.block[1]
            _aligned("input columns", start, length, bi, self.in_features)
            scale = scale[:, start // bi : -(-(start + length) // bi)]
        weight = self.weight[:, start : start + length]
        return Fp8Weight(weight, scale, self.block, self.input_scale)

    @staticmethod
    def cat_out(parts: list[Fp8Weight]) -> Fp8Weight:
        """Parts stacked along the output rows (a fused projection). Static input scales: the
        largest, since the parts quantize the same input (the others' rows are exact either
        way only up to their own scale: the format's documented approximation)."""
        first = parts[0]
        if any(p.block != first.block for p in parts):
            raise ValueError("fused parts have different FP8 blocks")
        if first.block is not None:
            for p in parts[:-1]:
                _aligned("output rows", 0, p.out_features, first.block[0], p.out_features)
        scales = [p.input_scale for p in parts]
        input_scale = None
        if any(s is not None for s in scales):
            if any(s is None for s in scales):
                raise ValueError("fused parts mix static and dynamic activation scales")
            input_scale = torch.stack([s.reshape(()) for s in scales]).max()
        return Fp8Weight(
            torch.cat([p.weight for p in parts]),
            torch.cat([p.scale for p in parts]),
            first.block,
            input_scale,
        )


@dataclass
class Int4Weight:
    qweight: torch.Tensor  # uint8 [out, in], values 0..15
    scales: torch.Tensor  # [out, num_groups], the checkpoint's float dtype
    # uint8 [out, num_groups]: values 0..15 (8 for symmetric formats), 1..16 for GPTQ v1
    # checkpoints, which store each zero point minus one
    zeros: torch.Tensor
    group_size: int  # at least in_features: one group per row (per-channel scales)
    # int32 [in]: the group of each input column (GPTQ with desc_act); None: column i is in
    # group i // group_size
    g_idx: torch.Tensor | None = None

    @property
    def out_features(self) -> int:
        return self.qweight.shape[0]

    @property
    def in_features(self) -> int:
        return self.qweight.shape[1]

    def groups(self) -> torch.Tensor:
        """The group of each input column, int64 [in]."""
        if self.g_idx is not None:
            return self.g_idx.long()
        return torch.arange(self.in_features, device=self.qweight.device) // self.group_size

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        g = self.groups()
        q = self.qweight.float()
        z = self.zeros.float()[:, g]
        s = self.scales.float()[:, g]
        return ((q - z) * s).to(dtype)

    def narrow_out(self, start: int, length: int) -> Int4Weight:
        end = start + length
        return Int4Weight(
            self.qweight[start:end],
            self.scales[start:end],
            self.zeros[start:end],
            self.group_size,
            self.g_idx,
        )

    def narrow_in(self, start: int, length: int) -> Int4Weight:
        """Input columns [start, start + length). Without g_idx the slice must start and end on
        a group boundary (the group's scales go with it); with g_idx, or one group per row,
        every group's scales stay (the columns name theirs, or share the one)."""
        end = start + length
        if self.g_idx is not None or self.group_size >= self.in_features:
            return Int4Weight(
                self.qweight[:, start:end],
                self.scales,
                self.zeros,
                self.group_size,
                None if self.g_idx is None else self.g_idx[start:end],
            )
        g = self.group_size
        _aligned("input columns", start, length, g, self.in_features)
        first, last = start // g, -(-end // g)
        return Int4Weight(
            self.qweight[:, start:end],
            self.scales[:, first:last],
            self.zeros[:, first:last],
            self.group_size,
        )

    @staticmethod
    def cat_out(parts: list[Int4Weight]) -> Int4Weight:
        first = parts[0]
        if any(p.group_size != first.group_size for p in parts):
            raise ValueError("fused parts have different group sizes")
        g_idx = first.g_idx
        if any(
            (p.g_idx is None) != (g_idx is None)
            or (g_idx is not None and not torch.equal(p.g_idx, g_idx))
            for p in parts
        ):
            raise ValueError("fused parts order their input columns differently (g_idx)")
        return Int4Weight(
            torch.cat([p.qweight for p in parts]),
            torch.cat([p.scales for p in parts]),
            torch.cat([p.zeros for p in parts]),
            first.group_size,
            g_idx,
        )


QuantizedWeight = Fp8Weight | Int4Weight


def _aligned(what: str, start: int, length: int, unit: int, size: int) -> None:
    """A slice of blocked / grouped data must start and end on a block boundary (or at the end)."""
    end = start + length
    if start % unit or (end % unit and end != size):
        raise ValueError(
            f"{what} [{start}, {end}) do not fall on the format's blocks of {unit}; "
            f"tensor parallelism (or a fused projection) must split at multiples of {unit}"
        )
