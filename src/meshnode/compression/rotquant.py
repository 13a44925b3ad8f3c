"""Rotated low-bit quantisation of boundary tensors (``mask.codec = "rotq"``).

Random channel masking throws away 95 % of each token's vector, and the pretrained network downstream
cannot work with what is left (``docs/quality.md``: loss 14 instead of 2.9 through M95 boundaries).
This codec spends the same order of bytes differently: it keeps *every* channel, at 1, 2 or 4 bits.

1. **Rotate.** ``y = R x`` with a fixed orthogonal ``R = (C_m kron W_n) diag(s)``: random signs ``s``
   from the PRF (a fixed key, so every peer builds the same ``R`` with no communication), a
   normalised Walsh-Hadamard matrix ``W_n`` over the largest power of two ``n`` dividing H, and an
   orthonormal DCT-II matrix ``C_m`` over the remaining factor ``m = H / n`` (576 = 9 x 64). The
   residual stream's few huge "massive activation" channels are spread over all H coordinates, so the
   rotated vector is close to Gaussian with one scale per token.
2. **Quantise** each token with a uniform midrise quantiser of ``2**bits`` levels, step ``D_b * rms(y)``,
   where ``D_b`` is the step that minimises the mean squared error of a unit Gaussian
   (Max, 1960: 1.596, 0.9957, 0.3352 for 1, 2, 4 bits). The payload is the packed codes plus the
   token's rms as one float32.
3. The receiver dequantises and rotates back: ``x_hat = R^T y_hat``.

The gradient goes back the same way (its own rms per token). The expected relative squared error per
token is that of the Gaussian quantiser: 0.363 (1 bit), 0.119 (2 bits), 0.0115 (4 bits), whatever the
activation's outliers. Bytes per token: ``H * bits / 8 + 4`` (H = 576: 76, 148, 292, against 1152 in bf16).

The codec is deterministic (round to nearest); the rotation is float arithmetic, so sender and
receiver agree to float rounding, not bit for bit, which the codec does not need: each side only
applies R or R^T to its own tensors.
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch
from torch import Tensor

from .prf import fold_seed, uniform

ROTQ_BITS = (1, 2, 4)
# MSE-optimal uniform quantiser step for a unit Gaussian with 2**b levels (Max 1960, Table I).
GAUSS_STEP = {1: 1.5956, 2: 0.9957, 4: 0.3352}
_ROTATION_DOMAIN = 0x524F5451  # "ROTQ": the PRF domain of the sign flips


def _check_bits(bits: int) -> int:
    if bits not in ROTQ_BITS:
        raise ValueError(f"rotq bits must be one of {', '.join(map(str, ROTQ_BITS))}, got {bits}")
    return bits


def _hadamard(n: int) -> Tensor:  # (n, n) float64, orthonormal; n a power of two
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    return h / math.sqrt(n)


def _dct(m: int) -> Tensor:  # (m, m) float64, orthonormal DCT-II
    k = torch.arange(m, dtype=torch.float64)[:, None]
    i = torch.arange(m, dtype=torch.float64)[None, :]
    c = torch.cos(math.pi * (i + 0.5) * k / m) * math.sqrt(2.0 / m)
    c[0] /= math.sqrt(2.0)
    return c


@lru_cache(maxsize=16)
def _rotation_cpu(hidden: int, seed: int) -> Tensor:
    n = hidden & -hidden  # largest power of two dividing hidden
    m = hidden // n
    signs = torch.where(uniform(fold_seed(seed, hidden, domain=_ROTATION_DOMAIN), (hidden,)) < 0, -1.0, 1.0)
    rot = torch.kron(_dct(m), _hadamard(n)) * signs.to(torch.float64)[None, :]
    return rot.to(torch.float32)


def rotation(hidden: int, seed: int = 0, device: torch.device | str | None = None) -> Tensor:  # (H, H)
    """The orthogonal matrix R of this codec for ``hidden`` channels (float32; cached per size)."""
    if hidden <= 0:
        raise ValueError(f"hidden size must be positive, got {hidden}")
    rot = _rotation_cpu(int(hidden), int(seed))
    return rot if device is None else rot.to(device)


def codes_per_byte(bits: int) -> int:
    return 8 // _check_bits(bits)


def packed_width(hidden: int, bits: int) -> int:
    """Bytes per token of packed codes."""
    per = codes_per_byte(bits)
    return (hidden + per - 1) // per


def pack_codes(q: Tensor, bits: int) -> Tensor:  # (..., H) uint8 in [0, 2**bits) -> (..., ceil(H / per)) uint8
    per = codes_per_byte(bits)
    pad = (-q.shape[-1]) % per
    if pad:
        q = torch.nn.functional.pad(q, (0, pad))
    q = q.reshape(*q.shape[:-1], -1, per).to(torch.int32)
    shifts = torch.arange(per, dtype=torch.int32, device=q.device) * bits
    return (q << shifts).sum(-1).to(torch.uint8)


def unpack_codes(packed: Tensor, bits: int, hidden: int) -> Tensor:  # inverse of pack_codes
    per = codes_per_byte(bits)
    shifts = torch.arange(per, dtype=torch.int32, device=packed.device) * bits
    q = (packed.to(torch.int32)[..., None] >> shifts) & ((1 << bits) - 1)
    return q.flatten(-2)[..., :hidden].to(torch.uint8)


def rotq_encode(x: Tensor, bits: int, seed: int = 0, rms: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Quantise ``x`` (..., H): returns ``(codes, rms)``, codes (..., packed_width) uint8, rms (...) float32.
    ``rms`` (...): the token scales to quantise with (as the receiver will decode them), instead of the exact ones."""
    _check_bits(bits)
    h = x.shape[-1]
    y = x.detach().to(torch.float32) @ rotation(h, seed, x.device).T
    rms = y.square().mean(-1).sqrt() if rms is None else rms.to(torch.float32)
    step = GAUSS_STEP[bits] * torch.where(rms > 0, rms, torch.ones_like(rms))
    half = 1 << (bits - 1)
    q = torch.floor(y / step[..., None]).clamp_(-half, half - 1) + half  # [0, 2**bits)
    return pack_codes(q.to(torch.uint8), bits), rms


def rotq_decode(codes: Tensor, rms: Tensor, bits: int, hidden: int, seed: int = 0,
                dtype: torch.dtype = torch.float32) -> Tensor:  # (..., H)
    """Inverse of :func:`rotq_encode` (up to the quantisation error)."""
    _check_bits(bits)
    q = unpack_codes(codes, bits, hidden).to(torch.float32)
    half = 1 << (bits - 1)
    y = (q - half + 0.5) * (GAUSS_STEP[bits] * rms.to(torch.float32))[..., None]
    return (y @ rotation(hidden, seed, codes.device)).to(dtype)


def rotq_nbytes(rows: int, hidden: int, bits: int, scale_bytes: int = 4) -> int:
    """Wire bytes of ``rows`` tokens: packed codes plus one rms each (float32, or ``scale_bytes``)."""
    return rows * (packed_width(hidden, bits) + scale_bytes)


__all__ = [
    "GAUSS_STEP", "ROTQ_BITS", "pack_codes", "packed_width", "rotation", "rotq_decode", "rotq_encode", "rotq_nbytes",
    "unpack_codes",
]
