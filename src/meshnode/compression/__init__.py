"""Pure tensor code for what crosses the wire: mask PRF, boundary codecs, PowerSGD, quantisation, bytes.

No networking here (DESIGN.md section 2): ``stage/`` uses the codecs at its boundaries, ``node/`` and
``mesh/`` move the payloads, and everyone counts bytes with :class:`ByteCounter`.
"""

from .accounting import AXES, HEADER_BYTES, ByteCounter, payload_bytes, tensor_bytes
from .codec import (
    MAX_REF_CHECK,
    REF_CHECK_TENSOR,
    REF_CODE_TENSORS,
    REF_FIT_STEP_TENSORS,
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
from .transform import Transform, fit_transform, normalised_second_moment, tc_decode, tc_encode, tc_grad

__all__ = [
    "AXES", "HEADER_BYTES", "MAX_REF_CHECK", "REF_CHECK_TENSOR", "REF_CODE_TENSORS", "REF_FIT_STEP_TENSORS",
    "REF_MAP_META", "REF_MAP_TENSORS",
    "RESCALE_MODES", "WIRE_DTYPES",
    "BoundaryCodec", "BoundaryContext", "ByteCounter",
    "DenseCodec", "EncodedPayload", "MaskCodec", "MaskKey", "PayloadError", "PowerSGDState", "QuantCodec", "ROTQ_BITS",
    "RotQuantCodec", "rotation", "rotq_decode", "rotq_encode", "rotq_nbytes",
    "TopKCodec", "Transform", "channel_hash", "compressed_rank", "dequantize_absmax", "fake_quantize", "gather_kept",
    "keep_indices", "keep_mask", "make_codec", "masked_boundary", "num_kept", "orthonormalize", "orthonormalize_all",
    "pack_int4",
    "payload_bytes", "powersgd_allreduce", "powersgd_decode", "quantize_absmax", "quantized_nbytes", "rms_scale",
    "scatter_kept",
    "simulate_transfer", "fit_transform", "normalised_second_moment", "tc_decode", "tc_encode", "tc_grad",
    "tensor_bytes",
    "unpack_int4",
]
