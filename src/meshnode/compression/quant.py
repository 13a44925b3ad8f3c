"""Per-row absmax quantisation to int8 or int4, shared by the boundary codecs and PowerSGD.

Each row (the last dimension) gets one float32 scale ``absmax / L`` with L = 127 (8 bits) or 7 (4 bits),
and its values are rounded to integers in [-L, L]. The error per element is at most half a step,
``absmax / (2 L)``. 4-bit codes are stored two per byte (low nibble first, offset by 8 so each nibble
is in [1, 15]); an odd row is padded with one zero nibble. Scales stay float32: activations and
gradients span many orders of magnitude (fp16 would underflow on small gradients), and 4 bytes per
row is small next to the row itself.
"""

from __future__ import annotations

import torch
from torch import Tensor

_LEVELS = {8: 127, 4: 7}


def levels(bits: int) -> int:
    """The largest code magnitude L for ``bits`` (8 -> 127, 4 -> 7)."""
    if bits not in _LEVELS:
        raise ValueError(f"quantisation bits must be 8 or 4, got {bits}")
    return _LEVELS[bits]


def pack_int4(q: Tensor) -> Tensor:  # (..., N) int8 in [-8, 7] -> (..., ceil(N/2)) uint8
    """Pack signed 4-bit codes two per byte, low nibble first."""
    u = (q.to(torch.int16) + 8).to(torch.uint8)
    if u.shape[-1] % 2:
        u = torch.nn.functional.pad(u, (0, 1), value=8)  # pad with code 0
    return u[..., 0::2] | (u[..., 1::2] << 4)


def unpack_int4(packed: Tensor, size: int) -> Tensor:  # (..., ceil(N/2)) uint8 -> (..., N) int8
    """Inverse of :func:`pack_int4`; ``size`` is the unpadded length N."""
    lo = (packed & 0x0F).to(torch.int8) - 8
    hi = (packed >> 4).to(torch.int8) - 8
    out = torch.stack((lo, hi), dim=-1).flatten(-2)
    return out[..., :size]


def quantize_absmax(x: Tensor, bits: int) -> tuple[Tensor, Tensor]:
    """Quantise ``x`` per row.

    x: (..., N) float. Returns ``(codes, scale)``: codes (..., N) int8 for 8 bits or (..., ceil(N/2))
    uint8 (packed) for 4 bits; scale (...) float32 with ``x ~= codes * scale``.
    """
    lv = levels(bits)
    xf = x.detach().to(torch.float32)
    amax = xf.abs().amax(dim=-1)
    scale = amax / lv
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(xf / safe[..., None]).clamp_(-lv, lv).to(torch.int8)
    if bits == 4:
        q = pack_int4(q)
    return q, scale


def dequantize_absmax(
    codes: Tensor, scale: Tensor, bits: int, size: int, dtype: torch.dtype = torch.float32
) -> Tensor:  # (..., N)
    """Inverse of :func:`quantize_absmax`; ``size`` is N (needed to drop a 4-bit pad nibble)."""
    levels(bits)
    q = unpack_int4(codes, size) if bits == 4 else codes
    return (q.to(torch.float32) * scale.to(torch.float32)[..., None]).to(dtype)


def quantized_nbytes(rows: int, size: int, bits: int) -> int:
    """Wire bytes of ``rows`` rows of length ``size``: codes plus one float32 scale per row."""
    levels(bits)
    per_row = size if bits == 8 else (size + 1) // 2
    return rows * (per_row + 4)


def fake_quantize(x: Tensor, bits: int, dim: int = -1) -> Tensor:
    """``x`` after a quantise/dequantise round trip, absmax taken along ``dim``.

    For a matrix (m, r), ``dim=0`` gives one scale per column.

    Used where the values stay float but must carry exactly the wire's rounding (PowerSGD factors).
    """
    moved = x.movedim(dim, -1)
    codes, scale = quantize_absmax(moved, bits)
    return dequantize_absmax(codes, scale, bits, moved.shape[-1], x.dtype).movedim(-1, dim)


__all__ = [
    "dequantize_absmax", "fake_quantize", "levels", "pack_int4", "quantize_absmax", "quantized_nbytes", "unpack_int4",
]
