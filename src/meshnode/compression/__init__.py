"""Pure tensor code for what crosses the wire: mask PRF, boundary codecs, PowerSGD, quantisation, bytes.

No networking here (DESIGN.md section 2): ``stage/`` uses the codecs at its boundaries, ``node/`` and
``mesh/`` move the payloads, and everyone counts bytes with :class:`ByteCounter`.
"""

from .accounting import AXES, HEADER_BYTES, ByteCounter, payload_bytes, tensor_bytes
from .codec import (
    REF_MAP_META,
    REF_MAP_TENSORS,
    RESCALE_MODES,
    WIRE_DTYPES,
    BoundaryCodec,
    BoundaryContext,
    DenseCodec,
    EncodedPayload,
    MaskCodec,
    PayloadError,
    QuantCodec,
    RotQuantCodec,
    TopKCodec,
    gather_kept,
    make_codec,
    masked_boundary,
    rms_scale,
    scatter_kept,
    simulate_transfer,
)
from .mask import MaskKey, channel_hash, keep_indices, keep_mask, num_kept
from .powersgd import (
    PowerSGDState,
    compressed_rank,
    orthonormalize,
    orthonormalize_all,
    powersgd_allreduce,
    powersgd_decode,
)
from .quant import dequantize_absmax, fake_quantize, pack_int4, quantize_absmax, quantized_nbytes, unpack_int4
from .rotquant import ROTQ_BITS, rotation, rotq_decode, rotq_encode, rotq_nbytes

__all__ = [
    "AXES", "HEADER_BYTES", "REF_MAP_META", "REF_MAP_TENSORS", "RESCALE_MODES", "WIRE_DTYPES", "BoundaryCodec",
    "BoundaryContext", "ByteCounter",
    "DenseCodec", "EncodedPayload", "MaskCodec", "MaskKey", "PayloadError", "PowerSGDState", "QuantCodec", "ROTQ_BITS",
    "RotQuantCodec", "rotation", "rotq_decode", "rotq_encode", "rotq_nbytes",
    "TopKCodec", "channel_hash", "compressed_rank", "dequantize_absmax", "fake_quantize", "gather_kept",
    "keep_indices", "keep_mask", "make_codec", "masked_boundary", "num_kept", "orthonormalize", "orthonormalize_all",
    "pack_int4",
    "payload_bytes", "powersgd_allreduce", "powersgd_decode", "quantize_absmax", "quantized_nbytes", "rms_scale",
    "scatter_kept",
    "simulate_transfer", "tensor_bytes", "unpack_int4",
]
