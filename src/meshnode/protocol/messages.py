"""Wire messages of the fast circuit: one length-prefixed msgpack frame per message, raw tensor bytes inside.

A frame is ``len (8 bytes, big endian) | msgpack body``, the framing of hivemind's
``P2P.send_raw_data`` / ``receive_raw_data``; :func:`read_frame` checks the length against the
peer's :class:`~.limits.Limits` *before* it reads the body, and :func:`unpack` bounds every msgpack
container. A boundary payload travels as ``EncodedPayload.header()`` plus ``data`` (one ``bytes``
per tensor), and is rebuilt only after :func:`payload_from_wire` checked everything a tensor could go
wrong with: codec and kind names, dims (<= 3, positive, batch / sequence / hidden within limits),
dtype allowlist, byte length == prod(shape) * itemsize, finite values. Anything else raises
:class:`WireError`, which the servicer turns into an error reply.

Message fields (all msgpack maps; readers ignore keys they do not know):

``forward``  run, driver, step, mb, attempt, boundary, mask_version, payload (stage > 0) and labels
             (token ids, uint16 when the vocabulary fits, else int32; they travel to the last stage);
             optional held_codes (the gradient codes the caller holds) and reference (the digest of the
             frozen model a reference-coded caller codes against; the callee refuses one unlike its own).
``backward`` run, driver, step, mb, attempt, boundary, payload (a gradient).
reply        ok (bool), error (str, when not ok), loss (float), payload (the gradient for the caller).
"""

from __future__ import annotations

import asyncio
import math
from typing import Any

import msgpack
import torch
from torch import Tensor

from ..compression import (
    MAX_REF_CHECK,
    REF_CHECK_TENSOR,
    REF_CODE_TENSORS,
    REF_FIT_STEP_TENSORS,
    REF_MAP_TENSORS,
    EncodedPayload,
)
from .limits import MAX_META_BYTES, Limits

PROTOCOL_VERSION = 1
HEADER_LEN = 8
BYTEORDER = "big"

ALLOWED_CODECS = ("dense", "mask", "topk", "int8", "int4", "rotq")
ALLOWED_KINDS = ("activation", "grad")
DENSE_DTYPES = ("float32", "bfloat16", "float16")
TENSOR_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "int8": torch.int8,
    "uint8": torch.uint8, "int16": torch.int16, "int32": torch.int32, "uint16": torch.uint16,
}
LABEL_DTYPES = ("uint16", "int32")
# a payload's own (at most 5: rotq's codes, scales, the largest scale with one-byte scales, channel means and weights;
# a transform-coded one never carries weights, so at most 4), a residual map's two and its transform code's three,
# and with 8- or 4-bit fits the three matrices' steps per column, and the sampled reference (mask.reference_check)
MAX_TENSORS = 13


class WireError(ValueError):
    """A message that is malformed, too large or inconsistent; the reply says which."""


# ---------------------------------------------------------------------------------------------
# frames


def pack(obj: dict[str, Any]) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def unpack(data: bytes, max_bytes: int) -> dict[str, Any]:
    """Unpack one msgpack map with bounded containers; raise :class:`WireError` on anything odd."""
    if len(data) > max_bytes:
        raise WireError(f"message of {len(data)} bytes exceeds the limit of {max_bytes}")
    try:
        obj = msgpack.unpackb(
            data, raw=False, strict_map_key=True, max_bin_len=max_bytes, max_str_len=1 << 16,
            max_array_len=4096, max_map_len=4096, max_ext_len=0,
        )
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        raise WireError(f"not a msgpack message ({type(exc).__name__})") from None
    if not isinstance(obj, dict):
        raise WireError(f"expected a msgpack map, got {type(obj).__name__}")
    return obj


async def read_frame(reader: asyncio.StreamReader, max_bytes: int) -> bytes:
    """Read one length-prefixed frame; the length is checked before a byte of the body is read."""
    try:
        header = await reader.readexactly(HEADER_LEN)
    except asyncio.IncompleteReadError:
        raise WireError("connection closed before a frame header") from None
    length = int.from_bytes(header, BYTEORDER)
    if length > max_bytes:
        raise WireError(f"frame of {length} bytes exceeds the limit of {max_bytes}")
    try:
        return await reader.readexactly(length)
    except asyncio.IncompleteReadError as exc:
        raise WireError(f"truncated frame: {len(exc.partial)} of {length} bytes") from None


async def write_frame(writer: asyncio.StreamWriter, data: bytes, chunk_size: int = 1 << 16) -> None:
    writer.write(len(data).to_bytes(HEADER_LEN, BYTEORDER))
    view = memoryview(data)
    for off in range(0, len(view), chunk_size):
        writer.write(view[off : off + chunk_size])
    await writer.drain()


# ---------------------------------------------------------------------------------------------
# tensors


def tensor_to_bytes(t: Tensor) -> bytes:
    t = t.detach().to("cpu").contiguous().reshape(-1)
    return t.view(torch.uint8).numpy().tobytes() if t.numel() else b""


def tensor_from_bytes(data: bytes, dtype_name: str, shape: list[int], *, finite: bool = True) -> Tensor:
    """Rebuild a tensor after checking dtype, dims and byte length (and finiteness for float dtypes)."""
    dtype = TENSOR_DTYPES.get(dtype_name) if isinstance(dtype_name, str) else None
    if dtype is None:
        raise WireError(f"tensor dtype {dtype_name!r} is not allowed")
    if not isinstance(shape, list) or not 1 <= len(shape) <= 3:
        raise WireError(f"tensor shape must have 1 to 3 dims, got {shape!r}")
    if any(isinstance(d, bool) or not isinstance(d, int) or d <= 0 for d in shape):
        raise WireError(f"tensor dims must be positive integers, got {shape!r}")
    if not isinstance(data, bytes):
        raise WireError("tensor data must be bytes")
    want = math.prod(shape) * dtype.itemsize
    if len(data) != want:
        raise WireError(f"tensor of {dtype_name} {shape} needs {want} bytes, got {len(data)}")
    t = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype).reshape(shape)
    if finite and t.is_floating_point() and not bool(torch.isfinite(t).all()):
        raise WireError("tensor has non-finite values")
    return t


def _check_meta(meta: Any) -> dict[str, Any]:
    if not isinstance(meta, dict):
        raise WireError("payload meta must be a map")
    if len(pack(meta)) > MAX_META_BYTES:
        raise WireError("payload meta too large")
    for k, v in meta.items():
        ok = isinstance(v, (int, float, str)) or v is None or (
            isinstance(v, list) and len(v) <= 16 and all(isinstance(x, int) and not isinstance(x, bool) for x in v)
        )
        if not ok:
            raise WireError(f"payload meta {k!r} has an unsupported value")
    return meta


def payload_to_wire(payload: EncodedPayload) -> dict[str, Any]:
    body = payload.header()
    body["data"] = {k: tensor_to_bytes(t) for k, t in payload.tensors.items()}
    return body


def payload_from_wire(body: Any, limits: Limits, kind: str) -> EncodedPayload:
    """Validate a wire payload against the limits and rebuild the :class:`EncodedPayload`."""
    if not isinstance(body, dict):
        raise WireError("payload must be a map")
    codec, got_kind, dtype = body.get("codec"), body.get("kind"), body.get("dtype")
    if codec not in ALLOWED_CODECS:
        raise WireError(f"codec {codec!r} is not allowed")
    if got_kind != kind:
        raise WireError(f"expected a {kind} payload, got {got_kind!r}")
    if dtype not in DENSE_DTYPES:
        raise WireError(f"dense dtype {dtype!r} is not allowed")
    shape = body.get("shape")
    if not isinstance(shape, list) or len(shape) != 3 or any(
        isinstance(d, bool) or not isinstance(d, int) or d <= 0 for d in shape
    ):
        raise WireError(f"dense shape must be [B, T, H] with positive ints, got {shape!r}")
    b, t, h = shape
    if b > limits.max_batch or t > limits.max_seq or h != limits.hidden:
        raise WireError(
            f"dense shape {shape} outside the run's limits (B <= {limits.max_batch}, T <= {limits.max_seq}, "
            f"H == {limits.hidden})"
        )
    specs, data = body.get("tensors"), body.get("data")
    if not isinstance(specs, dict) or not isinstance(data, dict) or set(specs) != set(data):
        raise WireError("payload tensors and data do not match")
    if not 1 <= len(specs) <= MAX_TENSORS:
        raise WireError(f"payload has {len(specs)} tensors")
    tensors = {}
    for name, spec in specs.items():
        if not isinstance(spec, list) or len(spec) != 2:
            raise WireError(f"tensor spec of {name!r} must be [dtype, shape]")
        tt = tensor_from_bytes(data[name], spec[0], spec[1])
        per_channel = tt.dim() == 1 and tt.shape[0] == h  # (H,): channel means (mask fill = mean, rotq)
        if name in REF_MAP_TENSORS or name == REF_CODE_TENSORS[0]:  # residual map, transform basis: (H, k), k <= H
            # (ceil(H / 2), k) with 4-bit codes packed two rows to a byte
            if tt.dim() != 2 or tt.shape[0] not in (h, (h + 1) // 2) or tt.shape[1] > h:
                raise WireError(f"tensor {name!r} of shape {list(tt.shape)} is not a residual map ({h}, k <= {h})")
        elif name == REF_CHECK_TENSOR:  # mask.reference_check: sampled entries of the sender's reference
            if tt.dim() != 1 or tt.shape[0] > MAX_REF_CHECK:
                raise WireError(f"tensor {name!r} of shape {list(tt.shape)} is not a reference check "
                                f"(n <= {MAX_REF_CHECK},)")
        elif name == "rms_top":  # rotq's log8 token scales: the payload's largest, one value
            if tt.dim() != 1 or tt.shape[0] != 1:
                raise WireError(f"tensor {name!r} of shape {list(tt.shape)} is not one value")
        elif name in REF_CODE_TENSORS or name in REF_FIT_STEP_TENSORS:  # (m,), m <= H: the transform's scales and
            # bits, an 8-bit matrix's steps
            if tt.dim() != 1 or tt.shape[0] > h:
                raise WireError(f"tensor {name!r} of shape {list(tt.shape)} is not a transform's (m <= {h},)")
        elif not per_channel and (
            tt.shape[0] != b or (tt.dim() > 1 and tt.shape[1] != t) or (tt.dim() > 2 and tt.shape[2] > h)
        ):
            raise WireError(f"tensor {name!r} of shape {list(tt.shape)} does not fit the dense shape {shape}")
        tensors[name] = tt
    return EncodedPayload(
        codec=codec, kind=kind, shape=(b, t, h), dtype=dtype, tensors=tensors, meta=_check_meta(body.get("meta", {}))
    )


def labels_to_wire(ids: Tensor, vocab: int) -> dict[str, Any]:
    dtype = "uint16" if vocab <= 65536 else "int32"
    return {"dtype": dtype, "shape": list(ids.shape), "data": tensor_to_bytes(ids.to(TENSOR_DTYPES[dtype]))}


def labels_from_wire(body: Any, limits: Limits) -> Tensor:  # -> (B, T) int64
    if not isinstance(body, dict) or body.get("dtype") not in LABEL_DTYPES:
        raise WireError("labels must be a map with dtype uint16 or int32")
    shape = body.get("shape")
    if not isinstance(shape, list) or len(shape) != 2:
        raise WireError(f"labels shape must be [B, T], got {shape!r}")
    ids = tensor_from_bytes(body.get("data"), body["dtype"], shape).to(torch.int64)
    if ids.shape[0] > limits.max_batch or ids.shape[1] > limits.max_seq:
        raise WireError(f"labels shape {shape} outside the run's limits")
    if int(ids.min()) < 0 or int(ids.max()) >= limits.vocab:
        raise WireError(f"label ids outside [0, {limits.vocab})")
    return ids


# ---------------------------------------------------------------------------------------------
# requests


def _int(obj: dict, key: str, low: int = 0, high: int = 1 << 62) -> int:
    v = obj.get(key)
    if isinstance(v, bool) or not isinstance(v, int) or not low <= v <= high:
        raise WireError(f"field {key!r} must be an integer in [{low}, {high}], got {v!r}")
    return v


def _str(obj: dict, key: str, max_len: int = 256) -> str:
    v = obj.get(key)
    if not isinstance(v, str) or not 0 < len(v) <= max_len:
        raise WireError(f"field {key!r} must be a non-empty string, got {type(v).__name__}")
    return v


class MicrobatchRequest:
    """A validated forward or backward request (tensors rebuilt, ids checked)."""

    __slots__ = ("kind", "run", "driver", "step", "mb", "attempt", "boundary", "mask_version", "payload", "labels",
                 "held_codes", "reference")

    def __init__(self, **kw: Any) -> None:
        for k in self.__slots__:
            setattr(self, k, kw.get(k))

    @property
    def replay_id(self) -> tuple[str, int, int, int]:
        return (self.driver, self.step, self.mb, self.attempt)


MAX_HELD_CODES = 64  # gradient transform codes a caller may say it holds (16 senders x 2 versions, with room)


def forward_request(
    *, run: str, driver: str, step: int, mb: int, attempt: int, boundary: int, mask_version: int,
    payload: EncodedPayload, labels: Tensor, vocab: int, held_codes: list[tuple[int, int]] | None = None,
    reference: str | None = None,
) -> dict[str, Any]:
    """``held_codes``: the (sender, version) of the gradient transform codes (``mask.reference_grad_code_bits``)
    the caller holds, so that the callee attaches its own with the gradient when the caller lacks it.
    ``reference``: the digest of the frozen pretrained model the caller codes against (``mask.reference``), which
    the callee's must equal (:attr:`meshnode.stage.ReferenceModel.digest`)."""
    obj = {
        "v": PROTOCOL_VERSION, "type": "forward", "run": run, "driver": driver, "step": step, "mb": mb,
        "attempt": attempt, "boundary": boundary, "mask_version": mask_version,
        "payload": payload_to_wire(payload), "labels": labels_to_wire(labels, vocab),
    }
    if held_codes:
        obj["held_codes"] = [[int(a), int(b)] for a, b in held_codes]
    if reference is not None:
        obj["reference"] = reference
    return obj


def _held_codes(obj: dict[str, Any]) -> set[tuple[int, int]]:
    held = obj.get("held_codes", [])
    if not isinstance(held, list) or len(held) > MAX_HELD_CODES or any(
            not isinstance(k, list) or len(k) != 2 or any(isinstance(x, bool) or not isinstance(x, int) for x in k)
            for k in held):
        raise WireError(f"held_codes must be a list of at most {MAX_HELD_CODES} [sender, version] pairs")
    return {(int(a), int(b)) for a, b in held}


def parse_forward(
    obj: dict[str, Any], limits: Limits, *, run: str, stage: int, mask_version: int
) -> MicrobatchRequest:
    """Validate a forward request addressed to ``stage`` of ``run``."""
    if obj.get("type") != "forward":
        raise WireError(f"expected a forward request, got {obj.get('type')!r}")
    req = _parse_common(obj, run, stage)
    if _int(obj, "mask_version") != mask_version:
        raise WireError(f"mask version {obj.get('mask_version')} != this run's {mask_version}")
    req.kind = "forward"
    req.mask_version = mask_version
    req.payload = payload_from_wire(obj.get("payload"), limits, "activation")
    req.labels = labels_from_wire(obj.get("labels"), limits)
    if tuple(req.labels.shape) != tuple(req.payload.shape[:2]):
        raise WireError(f"labels {list(req.labels.shape)} do not match the payload's (B, T) {req.payload.shape[:2]}")
    req.held_codes = _held_codes(obj)
    ref = obj.get("reference")
    if ref is not None and (not isinstance(ref, str) or not 0 < len(ref) <= 64):
        raise WireError("reference must be a digest string of at most 64 characters")
    req.reference = ref
    return req


def backward_request(
    *, run: str, driver: str, step: int, mb: int, attempt: int, boundary: int, payload: EncodedPayload
) -> dict[str, Any]:
    return {
        "v": PROTOCOL_VERSION, "type": "backward", "run": run, "driver": driver, "step": step, "mb": mb,
        "attempt": attempt, "boundary": boundary, "payload": payload_to_wire(payload),
    }


def parse_backward(obj: dict[str, Any], limits: Limits, *, run: str, stage: int) -> MicrobatchRequest:
    """Validate a backward request: the gradient at the output of ``stage`` (boundary == stage)."""
    if obj.get("type") != "backward":
        raise WireError(f"expected a backward request, got {obj.get('type')!r}")
    req = _parse_common(obj, run, stage + 1)
    req.kind = "backward"
    req.payload = payload_from_wire(obj.get("payload"), limits, "grad")
    return req


def _parse_common(obj: dict[str, Any], run: str, receiver_stage: int) -> MicrobatchRequest:
    if obj.get("v") != PROTOCOL_VERSION:
        raise WireError(f"protocol version {obj.get('v')!r} != {PROTOCOL_VERSION}")
    if obj.get("run") != run:
        raise WireError(f"message for run {obj.get('run')!r}, this peer serves {run!r}")
    boundary = _int(obj, "boundary", 0, 1 << 16)
    if boundary != receiver_stage - 1:
        raise WireError(f"boundary {boundary} does not lead into stage {receiver_stage}")
    return MicrobatchRequest(
        run=run, driver=_str(obj, "driver"), step=_int(obj, "step"), mb=_int(obj, "mb", 0, 1 << 20),
        attempt=_int(obj, "attempt", 0, (1 << 31) - 1), boundary=boundary,
    )


def reference_move_request(*, run: str, stage: int, version: int, move: dict[str, dict[str, Tensor]],
                           chain: int | None = None) -> dict[str, Any]:
    """``rpc_reference_move``: version ``version`` of stage ``stage``'s reference move (:mod:`meshnode.stage.moves`),
    ``{name: {part: [dtype, shape, bytes]}}``; ``chain``: the replica chain of the peer that sends it (fixed
    routes; :func:`reference_move_chain`)."""
    out = {"run": run, "stage": int(stage), "version": int(version),
           "move": {n: {k: [str(t.dtype).removeprefix("torch."), list(t.shape), tensor_to_bytes(t)]
                        for k, t in parts.items()} for n, parts in move.items()}}
    if chain is not None:
        out["chain"] = int(chain)
    return out


def reference_move_chain(obj: dict[str, Any]) -> int | None:
    """The replica chain a :func:`reference_move_request` names (None: none named)."""
    return None if obj.get("chain") is None else _int(obj, "chain", 0, 65535)


MAX_MOVE_PARTS = 4  # a low-rank matrix in int8: a, a_scale, b, b_scale


def parse_reference_move(obj: dict[str, Any], *, run: str, num_stages: int
                         ) -> tuple[int, int, dict[str, dict[str, Tensor]]]:
    """(stage, version, move) of a :func:`reference_move_request`, its tensors rebuilt (dtype, dims, byte length and
    finite values checked); whether the move fits the stage's parameters is the receiver's check
    (:func:`meshnode.stage.moves.check_move`)."""
    if obj.get("run") != run:
        raise WireError(f"reference move for run {obj.get('run')!r}, this peer serves {run!r}")
    stage = _int(obj, "stage", 0, num_stages - 1)
    version = _int(obj, "version", 1)
    body = obj.get("move")
    if not isinstance(body, dict) or not body:
        raise WireError("reference move: move must be a non-empty map of parameter names")
    move: dict[str, dict[str, Tensor]] = {}
    for name, parts in body.items():
        if not isinstance(name, str) or not isinstance(parts, dict) or not 0 < len(parts) <= MAX_MOVE_PARTS:
            raise WireError(f"reference move: entry {str(name)[:64]!r} is not a map of at most {MAX_MOVE_PARTS} parts")
        move[name] = {}
        for part, spec in parts.items():
            if not isinstance(part, str) or not isinstance(spec, list) or len(spec) != 3:
                raise WireError(f"reference move of {name[:64]!r}: part {str(part)[:16]!r} is not "
                                "[dtype, shape, bytes]")
            move[name][part] = tensor_from_bytes(spec[2], spec[0], spec[1])
    return stage, version, move


def reply_ok(*, loss: float | None = None, payload: EncodedPayload | None = None, **extra: Any) -> dict[str, Any]:
    wire = None if payload is None else payload_to_wire(payload)
    out = {"v": PROTOCOL_VERSION, "ok": True, "loss": loss, "payload": wire}
    out.update(extra)
    return out


def reply_error(message: str) -> dict[str, Any]:
    return {"v": PROTOCOL_VERSION, "ok": False, "error": str(message)[:500]}


__all__ = [
    "ALLOWED_CODECS", "MicrobatchRequest", "PROTOCOL_VERSION", "TENSOR_DTYPES", "WireError", "backward_request",
    "forward_request", "labels_from_wire", "labels_to_wire", "pack", "parse_backward", "parse_forward",
    "parse_reference_move", "payload_from_wire", "payload_to_wire", "read_frame", "reference_move_chain",
    "reference_move_request", "reply_error", "reply_ok", "tensor_from_bytes",
    "tensor_to_bytes", "unpack", "write_frame",
]
