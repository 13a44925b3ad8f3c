"""Size, shape and rate limits of the swarm's wire messages, derived from the run config.

Every message is size-checked against :attr:`Limits.max_message_bytes` *before* it is unpacked, and
every payload's dims against the batch / sequence / hidden sizes the run allows, so a peer never
allocates memory an attacker chose. The values follow from the run config (every peer of a run
agrees on them); the few timeouts here are local choices that need no agreement.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..config import RunConfig

MIB = 1 << 20
FRAME_SLACK = 64 * 1024  # msgpack header beside the raw tensor bytes
WEIGHT_CHUNK_BYTES = 2 * MIB  # one frame of a weight / state stream
MAX_META_BYTES = 4096


@dataclass(frozen=True, kw_only=True, slots=True)
class Limits:
    """What one peer accepts from another.

    ``max_batch`` / ``max_seq`` bound the (B, T) of a boundary payload, ``hidden`` is the model's
    exact hidden size and ``vocab`` bounds the label ids. ``replay_window`` is how many driver steps
    behind the newest seen one a microbatch may still arrive before it is refused as stale.
    """

    max_message_bytes: int
    max_batch: int
    max_seq: int
    hidden: int
    vocab: int
    replay_window: int = 2
    rpc_timeout: float = 120.0  # one nested forward/backward chain, downstream included
    connect_timeout: float = 10.0
    max_retries: int = 3

    @classmethod
    def from_config(cls, cfg: RunConfig, hidden: int, vocab: int, ref_move_bytes: int = 0) -> Limits:
        """``ref_move_bytes``: the largest reference move of a stage (``mask.reference_refresh_rank``,
        :func:`meshnode.stage.moves.move_size`), which one ``rpc_reference_move`` message carries."""
        batch = max(cfg.train.batch_size, cfg.anchor.batch_size or 0)
        seq = cfg.data.seq_len
        dense = batch * seq * hidden * 4  # float32, the widest wire dtype
        labels = batch * seq * 4
        ref_map = 2 * hidden * min(cfg.mask.reference_map_rank, hidden) * 2  # a residual map's U and V, bfloat16
        if cfg.mask.reference_code_bits or cfg.mask.reference_grad_code_bits:
            # and a transform code (the activation's with the map, or the gradient's): basis (H, m <= H) bfloat16,
            # scales, bits
            ref_map += hidden * hidden * 2 + hidden * 5
        body = max(2 * dense + labels + ref_map, WEIGHT_CHUNK_BYTES, ref_move_bytes) + FRAME_SLACK
        return cls(max_message_bytes=int(body), max_batch=batch, max_seq=seq, hidden=hidden, vocab=vocab)


__all__ = ["FRAME_SLACK", "Limits", "MAX_META_BYTES", "MIB", "WEIGHT_CHUNK_BYTES"]
