"""A reference move (``mask.reference_refresh_rank``): one stage's frozen reference weights moved towards its live
weights by the best rank-r step of each matrix, in the form that goes on the wire.

The sender (the peer that trains the stage, or the in-process mesh) makes the move from the reference as it holds
it (:func:`make_move`); every holder of that stage's reference, the sender included, adds exactly what was sent
(:func:`apply_move`), so the two ends of a boundary stay bit-identical when they run the same kernels. A move is
``{parameter name: {part: tensor}}``:

- a matrix with more than ``r`` rows and columns: the factors of the SVD's top ``r`` directions of ``live - held``,
  ``a = U S`` and ``b = V`` stored row-wise as ``(r, m)`` and ``(r, n)``: bfloat16 (``bits = 16``), or int8 codes
  with one float32 scale a factor (``bits = 8``: ``a``, ``a_scale``, ``b``, ``b_scale``);
- any other tensor (a vector, a small matrix): its whole change, ``d``, in bfloat16.

:func:`check_move` is what a receiver runs on a move from the wire before it touches its reference.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..compression.quant import dequantize_absmax, quantize_absmax, quantized_nbytes

MOVE_BITS = (16, 8)
# the largest change a move may make to one weight: far beyond any training step, and small enough that a finite
# move of finite weights stays finite (checked on arrival, before anything is applied)
MAX_MOVE_CHANGE = 1e4
Move = dict[str, dict[str, Tensor]]


@torch.no_grad()
def make_move(held: dict[str, Tensor], live: dict[str, Tensor], rank: int, bits: int = 16) -> Move:
    """The move of ``held`` towards ``live`` (same names and shapes): see the module docstring."""
    if bits not in MOVE_BITS:
        raise ValueError(f"reference moves go in 16 (bfloat16) or 8 bits, got {bits}")
    if rank < 1:
        raise ValueError(f"a reference move has rank >= 1, got {rank}")
    out: Move = {}
    for n, h in held.items():
        delta = live[n].detach().float() - h.detach().float()
        if delta.dim() == 2 and rank < min(delta.shape):
            u, sv, vh = torch.linalg.svd(delta, full_matrices=False)
            a, b = (u[:, :rank] * sv[:rank]).T.contiguous(), vh[:rank].contiguous()  # (r, m), (r, n)
            if bits == 8:
                (qa, sa), (qb, sb) = quantize_absmax(a, 8), quantize_absmax(b, 8)
                out[n] = {"a": qa, "a_scale": sa, "b": qb, "b_scale": sb}
            else:
                out[n] = {"a": a.bfloat16(), "b": b.bfloat16()}
        else:
            out[n] = {"d": delta.bfloat16()}
    return out


def move_nbytes(move: Move) -> int:
    """What the move takes on the wire: its tensors' bytes."""
    return sum(t.numel() * t.element_size() for parts in move.values() for t in parts.values())


def move_size(shapes: dict[str, tuple[int, ...]], rank: int, bits: int) -> int:
    """The bytes of a move of tensors of these shapes (:func:`move_nbytes` of any such move): what a receiver
    bounds an incoming one by."""
    total = 0
    for shape in shapes.values():
        if len(shape) == 2 and rank < min(shape):
            total += (quantized_nbytes(rank, shape[0], 8) + quantized_nbytes(rank, shape[1], 8) if bits == 8
                      else rank * (shape[0] + shape[1]) * 2)
        else:
            total += 2 * int(torch.Size(shape).numel())
    return total


def _factors(parts: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
    a, b = parts["a"], parts["b"]
    if a.dtype == torch.int8:
        a = dequantize_absmax(a, parts["a_scale"], 8, a.shape[-1])
        b = dequantize_absmax(b, parts["b_scale"], 8, b.shape[-1])
    return a.float(), b.float()


@torch.no_grad()
def apply_move(held: dict[str, Tensor], move: Move) -> dict[str, Tensor]:
    """``held`` moved by ``move`` (new tensors, ``held``'s dtypes): the factors' product, or the whole change,
    added in float32."""
    out = {}
    for n, h in held.items():
        parts = move[n]
        if "d" in parts:
            delta = parts["d"].float()
        else:
            a, b = _factors(parts)
            delta = a.T @ b
        out[n] = (h.float() + delta.to(h.device)).to(h.dtype)
    return out


def check_move(move: object, held: dict[str, Tensor], rank: int, bits: int) -> Move:
    """``move`` as a receiver may apply it to ``held`` with this run's ``rank`` and ``bits``: every parameter of
    ``held`` and nothing else, each part of its shape and dtype, every value finite. ValueError otherwise."""
    if not isinstance(move, dict) or set(move) != set(held):
        names = set(move) if isinstance(move, dict) else set()
        raise ValueError(f"a reference move must name every parameter of the stage and nothing else (missing "
                         f"{sorted(set(held) - names)[:3]}, unknown {sorted(names - set(held))[:3]})")
    for n, h in held.items():
        parts = move[n]
        shape = tuple(h.shape)
        if len(shape) == 2 and rank < min(shape):
            want = ({"a": ((rank, shape[0]), torch.int8), "a_scale": ((rank,), torch.float32),
                     "b": ((rank, shape[1]), torch.int8), "b_scale": ((rank,), torch.float32)} if bits == 8 else
                    {"a": ((rank, shape[0]), torch.bfloat16), "b": ((rank, shape[1]), torch.bfloat16)})
        else:
            want = {"d": (shape, torch.bfloat16)}
        if not isinstance(parts, dict) or set(parts) != set(want):
            got = sorted(parts) if isinstance(parts, dict) else type(parts).__name__
            raise ValueError(f"reference move of {n!r}: parts {got}, expected {sorted(want)} (rank {rank}, "
                             f"{bits} bits)")
        for part, (pshape, dtype) in want.items():
            t = parts[part]
            if not isinstance(t, Tensor) or tuple(t.shape) != pshape or t.dtype != dtype:
                got = (tuple(t.shape), t.dtype) if isinstance(t, Tensor) else type(t).__name__
                raise ValueError(f"reference move of {n!r}: {part} is {got}, expected {pshape} {dtype}")
            if t.is_floating_point() and not bool(torch.isfinite(t).all()):
                raise ValueError(f"reference move of {n!r}: {part} holds non-finite values")
        if "d" in parts:
            largest = float(parts["d"].float().abs().max()) if parts["d"].numel() else 0.0
        else:  # no entry of a^T b exceeds rank x max|a| x max|b|
            a, b = _factors(parts)
            largest = rank * float(a.abs().max()) * float(b.abs().max())
        if largest > MAX_MOVE_CHANGE:
            raise ValueError(f"reference move of {n!r} changes a weight by up to {largest:.3g}, more than "
                             f"{MAX_MOVE_CHANGE:g}")
    return move  # type: ignore[return-value]


__all__ = ["MAX_MOVE_CHANGE", "MOVE_BITS", "Move", "apply_move", "check_move", "make_move", "move_nbytes", "move_size"]
