"""The mask PRF: which K of a token's H hidden channels cross a stage boundary.

Sender and receiver of a boundary evaluate the mask independently, so the payload carries only the
kept values, shape (B, T, K), and no indices (DESIGN.md section 1). That only works if both sides
compute exactly the same channels, on any device and platform, which rules out ``torch.Generator``
and any float arithmetic. The mask is therefore defined by integer hashing (see :mod:`.prf`):

* the scalar key (run seed, optimizer step, microbatch id, boundary id, mask version) is folded into
  one 64-bit seed with Python ints;
* for each row ``r`` (absolute row of the microbatch, ``row_offset + b``), position ``t``
  (``pos_offset + t``) and channel ``c`` the hash is
  ``h = stream(stream(stream(seed, r), t), c)`` with ``stream(s, i) = splitmix64(s + (i+1)*GOLDEN)``;
* a token keeps the K channels with the smallest hash, ordered as signed int64 (any fixed total order
  would do), ties broken by the lower channel index (a stable sort), returned in ascending channel
  order.

K = ``round((1 - ratio) * H)`` with Python's ``round`` (half to even), at least 1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .prf import fold_seed, stream, to_int64

_MASK_DOMAIN = 0x4D41534B  # "MASK": separates mask seeds from other uses of fold_seed
_CHUNK_ELEMENTS = 1 << 24  # hash at most this many (row, position, channel) words at once


@dataclass(frozen=True)
class MaskKey:
    """Everything the mask of one microbatch crossing one boundary depends on (besides the shape)."""

    run_seed: int
    step: int
    microbatch: int
    boundary: int
    version: int = 0

    def as_tuple(self) -> tuple[int, int, int, int, int]:
        return (self.run_seed, self.step, self.microbatch, self.boundary, self.version)

    def seed(self) -> int:
        """The folded uint64 seed of this key."""
        return fold_seed(*self.as_tuple(), domain=_MASK_DOMAIN)


def num_kept(hidden: int, ratio: float) -> int:
    """K, the channels a token keeps: ``round((1 - ratio) * hidden)``, at least 1."""
    if hidden <= 0:
        raise ValueError(f"hidden must be > 0, got {hidden}")
    if not 0.0 <= ratio < 1.0:
        raise ValueError(f"mask ratio must be in [0, 1), got {ratio}")
    return max(1, min(hidden, round((1.0 - ratio) * hidden)))


def channel_hash(
    key: MaskKey,
    batch: int,
    seq: int,
    hidden: int,
    device: torch.device | str | None = None,
    *,
    row_offset: int = 0,
    pos_offset: int = 0,
) -> Tensor:  # (B, T, H) int64
    """The raw per-(row, position, channel) hash words the mask is chosen from."""
    seed = torch.tensor(to_int64(key.seed()), dtype=torch.int64, device=device)
    rows = torch.arange(row_offset, row_offset + batch, dtype=torch.int64, device=device)
    pos = torch.arange(pos_offset, pos_offset + seq, dtype=torch.int64, device=device)
    chans = torch.arange(hidden, dtype=torch.int64, device=device)
    row_seed = stream(seed, rows)  # (B,)
    tok_seed = stream(row_seed[:, None], pos[None, :])  # (B, T)
    return stream(tok_seed[:, :, None], chans)  # (B, T, H)


def keep_indices(
    key: MaskKey,
    batch: int,
    seq: int,
    hidden: int,
    ratio: float,
    device: torch.device | str | None = None,
    *,
    row_offset: int = 0,
    pos_offset: int = 0,
    chunk_elements: int = _CHUNK_ELEMENTS,
) -> Tensor:  # (B, T, K) int64, ascending per token
    """Kept channel indices of every token: the K channels with the smallest hash, sorted ascending.

    ``row_offset``/``pos_offset`` give the absolute row and position of element [0, 0], so a slice of a
    microbatch can compute its own part of the mask. Work is split over rows so that at most about
    ``chunk_elements`` hash words exist at once; the result does not depend on the split.
    """
    k = num_kept(hidden, ratio)
    rows_per_chunk = max(1, chunk_elements // max(1, seq * hidden))
    parts = []
    for start in range(0, batch, rows_per_chunk):
        n = min(rows_per_chunk, batch - start)
        h = channel_hash(key, n, seq, hidden, device, row_offset=row_offset + start, pos_offset=pos_offset)
        order = torch.sort(h, dim=-1, stable=True).indices[..., :k]
        parts.append(torch.sort(order, dim=-1).values)
    if not parts:
        return torch.empty(0, seq, k, dtype=torch.int64, device=device)
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)


def keep_mask(
    key: MaskKey,
    batch: int,
    seq: int,
    hidden: int,
    ratio: float,
    device: torch.device | str | None = None,
    *,
    row_offset: int = 0,
    pos_offset: int = 0,
) -> Tensor:  # (B, T, H) bool
    """The same mask as :func:`keep_indices`, as a dense boolean tensor (True = kept)."""
    idx = keep_indices(key, batch, seq, hidden, ratio, device, row_offset=row_offset, pos_offset=pos_offset)
    mask = torch.zeros(batch, seq, hidden, dtype=torch.bool, device=idx.device)
    return mask.scatter_(-1, idx, True)


__all__ = ["MaskKey", "channel_hash", "keep_indices", "keep_mask", "num_kept"]
