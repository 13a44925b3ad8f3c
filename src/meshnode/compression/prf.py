"""Counter-based pseudo-random functions built from splitmix64, in int64 tensor arithmetic.

Two peers must draw the same "random" numbers without talking to each other: the sender and the
receiver of a masked boundary evaluate the same mask, and all DP replicas start PowerSGD from the same
Q. ``torch.Generator`` streams are not promised to match across devices (CPU vs CUDA) or torch
versions, so everything here is pure integer arithmetic that any platform computes bit for bit:

* splitmix64's finaliser (``mix64``) on int64 tensors. torch has no uint64 arithmetic on every op,
  so the 64-bit words live in int64: multiplication and addition wrap in two's complement exactly
  like uint64 would, XOR is sign-agnostic, and a logical right shift is ``(x >> s) & (2**(64-s)-1)``
  (torch's ``>>`` on int64 is arithmetic, i.e. sign-extending).
* The same functions on Python ints (``mix64_int``), used to fold the small scalar keys into a seed
  and as the reference the tests check the tensor version against.

The values are a hash, not a stream: element ``i`` of a draw depends only on (seed, i), so any slice
can be recomputed alone.
"""

from __future__ import annotations

import torch
from torch import Tensor

MASK64 = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15  # splitmix64 increment (2**64 / golden ratio)
_MUL1 = 0xBF58476D1CE4E5B9
_MUL2 = 0x94D049BB133111EB


def to_int64(u: int) -> int:
    """The int64 (two's complement) whose bit pattern is the uint64 ``u mod 2**64``."""
    u &= MASK64
    return u - (1 << 64) if u >= (1 << 63) else u


def to_uint64(s: int) -> int:
    """Inverse of :func:`to_int64`: the unsigned value of an int64 bit pattern."""
    return s & MASK64


_GOLDEN_S = to_int64(GOLDEN)
_MUL1_S = to_int64(_MUL1)
_MUL2_S = to_int64(_MUL2)


# ---------------------------------------------------------------------------------------------
# Python-int reference


def mix64_int(z: int) -> int:
    """splitmix64 finaliser on a Python int (uint64 semantics); returns a value in [0, 2**64)."""
    z &= MASK64
    z = ((z ^ (z >> 30)) * _MUL1) & MASK64
    z = ((z ^ (z >> 27)) * _MUL2) & MASK64
    return z ^ (z >> 31)


def fold_seed(*fields: int, domain: int = 0) -> int:
    """Fold a few integer fields into one uint64 seed; order matters, every field changes the result."""
    h = mix64_int(domain + GOLDEN)
    for f in fields:
        h = mix64_int(h ^ mix64_int((f + GOLDEN) & MASK64))
    return h


def stream_int(seed: int, i: int) -> int:
    """Element ``i`` of the splitmix64 stream of ``seed`` (uint64), the reference for :func:`stream`."""
    return mix64_int(seed + (i + 1) * GOLDEN)


# ---------------------------------------------------------------------------------------------
# int64 tensors


def _srl(z: Tensor, s: int) -> Tensor:
    """Logical right shift of int64 words by ``s`` bits (0 < s < 64)."""
    return (z >> s) & ((1 << (64 - s)) - 1)


def mix64(z: Tensor) -> Tensor:
    """splitmix64 finaliser on int64 tensors, bit-identical to :func:`mix64_int` (as int64 patterns)."""
    if z.dtype != torch.int64:
        raise TypeError(f"mix64 needs int64, got {z.dtype}")
    z = (z ^ _srl(z, 30)) * _MUL1_S
    z = (z ^ _srl(z, 27)) * _MUL2_S
    return z ^ _srl(z, 31)


def stream(seeds: Tensor, counters: Tensor) -> Tensor:
    """``mix64(seed + (counter + 1) * GOLDEN)`` elementwise (broadcasting): the splitmix64 stream.

    seeds: int64 tensor of uint64 bit patterns; counters: int64 tensor of non-negative indices.
    """
    return mix64(seeds + (counters + 1) * _GOLDEN_S)


def uniform(seed: int, shape: tuple[int, ...], device: torch.device | str | None = None) -> Tensor:
    """Deterministic float32 values in [-1, 1) from element index ``i`` of ``seed``'s stream.

    The top 24 bits of each hash give an exact float32 (no rounding), so the floats agree on every
    device too.
    """
    n = 1
    for d in shape:
        n *= d
    counters = torch.arange(n, dtype=torch.int64, device=device)
    h = stream(torch.tensor(to_int64(seed), dtype=torch.int64, device=device), counters)
    top24 = _srl(h, 40)  # in [0, 2**24)
    return (top24.to(torch.float32) * (2.0 / (1 << 24)) - 1.0).reshape(shape)


__all__ = [
    "GOLDEN", "MASK64", "fold_seed", "mix64", "mix64_int", "stream", "stream_int", "to_int64", "to_uint64",
    "uniform",
]
