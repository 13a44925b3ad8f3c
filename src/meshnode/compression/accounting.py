"""Byte accounting by axis: what each kind of traffic costs, per trained token.

The method's headline number is bytes on the wire per trained token, split by axis (DESIGN.md
section 4): ``pp_fwd`` (activations across stage boundaries), ``pp_bwd`` (their gradients), ``dp``
(pseudo-gradient synchronisation inside a stage) and ``anchor`` (anchor priors). Every component
that sends a tensor adds its bytes to a :class:`ByteCounter`; the in-process mesh and the swarm use
the same counting, so their numbers can be compared.

A message's cost is its tensor bytes plus :data:`HEADER_BYTES` of metadata.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

from torch import Tensor

AXES: tuple[str, ...] = ("pp_fwd", "pp_bwd", "dp", "anchor", "ref")  # ref: mask.reference_refresh (mesh)

HEADER_BYTES = 64
"""Approximate per-message metadata: the msgpack header beside the raw tensor bytes, i.e. run id
(short string), optimizer step, microbatch id, boundary id, codec name, dtype and shape (B, T, H) of
the dense tensor, and the names/dtypes/shapes of the payload tensors. About 64 bytes for a
boundary payload; transport framing (libp2p, TCP/IP) is not counted."""


class ByteCounter:
    """Bytes sent, per axis. Thread-safe; unknown axes raise ``ValueError``."""

    def __init__(self) -> None:
        self._bytes = dict.fromkeys(AXES, 0)
        self._lock = threading.Lock()

    @classmethod
    def from_snapshot(cls, snapshot: Mapping[str, int]) -> ByteCounter:
        """A counter holding the counts of a :meth:`snapshot` (e.g. from a checkpoint); ``total`` is ignored."""
        counter = cls()
        for axis, n in snapshot.items():
            if axis != "total":
                counter.add(axis, int(n))
        return counter

    def add(self, axis: str, nbytes: int) -> None:
        """Count ``nbytes`` (>= 0) on ``axis``."""
        if axis not in self._bytes:
            raise ValueError(f"unknown traffic axis {axis!r} (known: {', '.join(AXES)})")
        if nbytes < 0:
            raise ValueError(f"byte count must be >= 0, got {nbytes}")
        with self._lock:
            self._bytes[axis] += int(nbytes)

    def snapshot(self) -> dict[str, int]:
        """Bytes per axis, plus ``total``."""
        with self._lock:
            out = dict(self._bytes)
        out["total"] = sum(out[a] for a in AXES)
        return out

    def per_token(self, tokens: int) -> dict[str, float]:
        """Bytes per trained token per axis (and ``total``); ``tokens`` must be > 0."""
        if tokens <= 0:
            raise ValueError(f"tokens must be > 0, got {tokens}")
        return {k: v / tokens for k, v in self.snapshot().items()}

    def merge(self, other: ByteCounter) -> ByteCounter:
        """Add ``other``'s counts into this counter; returns ``self``."""
        snap = other.snapshot()
        with self._lock:
            for a in AXES:
                self._bytes[a] += snap[a]
        return self

    def reset(self) -> None:
        with self._lock:
            for a in AXES:
                self._bytes[a] = 0

    def __repr__(self) -> str:
        return f"ByteCounter({self.snapshot()})"


def tensor_bytes(t: Tensor) -> int:
    """Raw bytes of a tensor's elements."""
    return t.numel() * t.element_size()


def payload_bytes(payload: Any) -> int:
    """Wire bytes of one message: its tensor bytes plus :data:`HEADER_BYTES`.

    ``payload`` is anything with an ``nbytes()`` method (e.g. ``EncodedPayload``), a mapping of
    name -> tensor, or a single tensor.
    """
    if hasattr(payload, "nbytes") and callable(payload.nbytes):
        body = int(payload.nbytes())
    elif isinstance(payload, Tensor):
        body = tensor_bytes(payload)
    elif isinstance(payload, Mapping):
        body = sum(tensor_bytes(t) for t in payload.values())
    else:
        raise TypeError(f"cannot size a payload of type {type(payload).__name__}")
    return body + HEADER_BYTES


__all__ = ["AXES", "HEADER_BYTES", "ByteCounter", "payload_bytes", "tensor_bytes"]
