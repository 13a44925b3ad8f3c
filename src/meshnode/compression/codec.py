"""Boundary codecs: how the activation (and its gradient) crossing a stage boundary goes on the wire.

Only the tensor that crosses a stage boundary is compressed (DESIGN.md section 1). One exchange is
one microbatch crossing one boundary; it has four steps, one codec method each::

    sender                                   receiver
    payload = codec.encode(x, ctx_s)   --->  h = codec.decode(payload, ctx_r)      (pp_fwd)
    dx = codec.decode_grad(gp, ctx_s)  <---  gp = codec.encode_grad(h.grad, ctx_r) (pp_bwd)
    x.backward(dx)

``ctx_s`` and ``ctx_r`` are two :class:`BoundaryContext` objects, one per side, for the lifetime of the
exchange. They carry the :class:`~.mask.MaskKey` (the mask codec needs it) and record what the backward
needs: the kept indices and the per-token scale. Nothing is shared between the two sides but the
payloads.

Codecs:

* :class:`DenseCodec`: the tensor cast to the wire dtype (the dense baseline).
* :class:`MaskCodec`: the paper's PRF mask. The payload is the K kept values per token, (B, T, K), and
  no indices: the receiver re-derives them from the key. The gradient goes back at exactly the same
  K positions, so the composite ``decode(encode(x))`` acts as the multiply-by-mask inside autograd.
  Rescale modes: ``none`` (the paper's default), ``inv_keep`` (times 1/(1-p)) and ``rms`` (each token
  scaled so its RMS over H equals that of the dense x; the factor, one float32 per token, travels in
  the payload because only the sender can compute it). The rescale is treated as a constant in the
  backward (no gradient through the RMS statistics): the gradient reaching the sender is
  ``scale * grad`` at the kept positions and exactly zero elsewhere, so it needs no extra bytes.
  The receiver applies the scale both ways: to the values in ``decode`` and to the gradient in
  ``encode_grad``.
* :class:`TopKCodec`: per-token top-k by magnitude (values plus int16/int32 indices); the gradient
  goes back at the same indices, which both sides remember, so it carries no indices.
* :class:`QuantCodec`: per-token absmax int8 or int4 (packed) quantisation, both directions.
* :class:`RotQuantCodec`: every channel at 1, 2 or 4 bits after a fixed orthogonal rotation
  (:mod:`.rotquant`), both directions: the codec that keeps dense quality at a fraction of the bytes.

:func:`simulate_transfer` runs an exchange in one process as a differentiable op (the in-process
mesh, and the tests). :func:`make_codec` builds a codec from :class:`meshnode.config.MaskConfig`.

Decoding validates the payload (codec, names, shapes, dtypes, finite values, index range) and raises
:class:`PayloadError`, so bad input from a peer is a clear error, never a crash or a corrupt tensor.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from ..config import MAX_REFERENCE_CHECK, MaskConfig
from .accounting import ByteCounter, payload_bytes, tensor_bytes
from .mask import MaskKey, keep_indices, num_kept
from .quant import dequantize_absmax, quantize_absmax, quantized_nbytes
from .rotquant import ROTQ_BITS, packed_width, rotq_decode, rotq_encode, rotq_nbytes
from .transform import Transform, tc_decode, tc_encode

WIRE_DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
}
_DENSE_DTYPES: dict[str, torch.dtype] = {**WIRE_DTYPES, "float64": torch.float64}
RESCALE_MODES = ("none", "inv_keep", "rms")
ROTQ_WEIGHTS = ("none", "norm", "norm_std")
ROTQ_GRAD_WEIGHTS = ("none", "std")
ROTQ_WEIGHT_RANGE = 64.0  # channel weights are normalised to rms 1 and clipped to [1/64, 64]
FILL_MODES = ("zero", "mean")
ACTIVATION, GRAD = "activation", "grad"
TRANSFORM_META = "code_bits"  # rotq payload meta: bits per token of the fitted transform code it is in
# rotq's per-token scale (``mask.token_scale``): "float" = float32 (a transform code's: bfloat16); "log8" = one byte a
# token, 2^(-c / 16) times the payload's largest scale (one float32, tensor "rms_top"): 16 steps an octave (at most
# 2.2 % off), 254 steps (down to 1.7e-5 of the largest; smaller ones are coded as that), c = 255 for exactly zero.
# The sender codes each token with the scale as the receiver will decode it, so the rounding costs no scale error.
TOKEN_SCALES = ("float", "log8")
LOG8_STEPS = 16  # codes per octave
LOG8_ZERO = 255


def log8_scales(rms: Tensor) -> tuple[Tensor, Tensor]:
    """Token scales ``rms`` (...) >= 0 as ``(codes, top)``: codes (...) uint8, top (1,) float32 (the largest)."""
    r = rms.detach().to(torch.float32)
    top = r.max().reshape(1) if r.numel() else torch.zeros(1, device=r.device)
    safe = torch.where(r > 0, r, torch.ones_like(r))
    c = torch.round(-LOG8_STEPS * torch.log2(safe / top.clamp_min(torch.finfo(torch.float32).tiny)))
    c = torch.where(r > 0, c.clamp(0, LOG8_ZERO - 1), torch.full_like(c, LOG8_ZERO))
    return c.to(torch.uint8), top


def log8_decode(codes: Tensor, top: Tensor) -> Tensor:
    """Inverse of :func:`log8_scales` (up to its rounding): float32, ``codes``' shape."""
    c = codes.to(torch.float32)
    r = top.to(torch.float32) * torch.exp2(-c / LOG8_STEPS)
    return torch.where(codes == LOG8_ZERO, torch.zeros_like(r), r)


class PayloadError(ValueError):
    """A payload does not match what this codec and exchange expect (shape, dtype, key, values)."""


def _exact_int(v: Any) -> int:
    """``v`` if it is an int (not a bool, not a float that would be truncated), else TypeError."""
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"{v!r} is not an integer")
    return v


def _dtype_name(dtype: torch.dtype) -> str:
    for name, dt in _DENSE_DTYPES.items():
        if dt == dtype:
            return name
    raise TypeError(f"unsupported dense dtype {dtype}")


def _dense_shape(x: Tensor) -> tuple[int, int, int]:
    if x.dim() != 3:
        raise ValueError(f"boundary tensors are (B, T, H), got shape {tuple(x.shape)}")
    if not x.is_floating_point():
        raise TypeError(f"boundary tensors are floating point, got {x.dtype}")
    b, t, h = x.shape
    return int(b), int(t), int(h)


# ---------------------------------------------------------------------------------------------
# payload and per-exchange context


# reference coding's residual map (meshnode.stage.reference): the payload meta that names the map a residual was
# coded against ([sender, version]), and the tensors that carry the map itself ((H, k) each, once per receiver)
REF_MAP_META = "ref_map"
REF_MAP_TENSORS = ("ref_map_u", "ref_map_v")
# and the transform code fitted with it (``mask.reference_code_bits``): basis (H, m), scale (m,), bits (m,)
REF_CODE_TENSORS = ("ref_code_basis", "ref_code_scale", "ref_code_bits")
# with ``mask.reference_fit_bits = 8`` the (H, k) matrices travel as int8 with one float32 step per column (k,); with 4
# as 4-bit codes packed two rows to a byte, uint8 (ceil(H / 2), k) (a code's basis: ``mask.reference_basis_bits``)
REF_FIT_STEP_TENSORS = tuple(f"{name}_step" for name in (*REF_MAP_TENSORS, REF_CODE_TENSORS[0]))
# ``mask.reference_check``: entries of the reference the sender coded against, (n <= 64,) float32, which the receiver
# compares with its own: the activation's and, with ``both``, the reference gradient's
REF_CHECK_TENSOR = "ref_check"
MAX_REF_CHECK = 2 * MAX_REFERENCE_CHECK


@dataclass
class EncodedPayload:
    """One message's content: named tensors plus the metadata the receiver needs to rebuild (B, T, H).

    ``meta`` holds small JSON-able values (ints, floats, strings, lists) that travel in the message
    header, e.g. the mask key. :meth:`nbytes` counts tensor bytes only; :func:`~.accounting.payload_bytes`
    adds the header estimate.
    """

    codec: str
    kind: str  # "activation" | "grad"
    shape: tuple[int, int, int]  # (B, T, H) of the dense tensor
    dtype: str  # dense dtype name, what decode returns
    tensors: dict[str, Tensor]
    meta: dict[str, Any] = field(default_factory=dict)

    def nbytes(self) -> int:
        return sum(tensor_bytes(t) for t in self.tensors.values())

    def header(self) -> dict[str, Any]:
        """The msgpack-able metadata of this payload (everything but the tensor bytes)."""
        return {
            "codec": self.codec,
            "kind": self.kind,
            "shape": list(self.shape),
            "dtype": self.dtype,
            "meta": dict(self.meta),
            "tensors": {k: [str(t.dtype).removeprefix("torch."), list(t.shape)] for k, t in self.tensors.items()},
        }


@dataclass(kw_only=True)
class BoundaryContext:
    """One side's state for one exchange (one microbatch crossing one boundary).

    ``key`` and ``row_offset`` are inputs (the mask codec needs the key); ``indices`` and ``scale`` are
    recorded by ``encode``/``decode`` for the backward of the same exchange.
    """

    key: MaskKey | None = None
    row_offset: int = 0
    gain: Tensor | None = None  # sender side: the receiving layer's input norm gains (H,), for rotq weighting
    # rotq activations: the fitted transform code to code (sender) or decode (receiver) with instead of the rotation
    # (``mask.reference_code_bits``; the residual map's, :mod:`.transform`); None: the rotation
    transform: Transform | None = None
    indices: Tensor | None = None  # (B, T, K) int64
    scale: Tensor | None = None  # (B, T) float32


# ---------------------------------------------------------------------------------------------
# differentiable building blocks


def gather_kept(x: Tensor, idx: Tensor) -> Tensor:  # x: (B, T, H), idx: (B, T, K) -> (B, T, K)
    """The kept values; differentiable, its backward scatters the gradient into zeros at ``idx``."""
    return x.gather(-1, idx)


def scatter_kept(values: Tensor, idx: Tensor, hidden: int) -> Tensor:  # (B, T, K) -> (B, T, H)
    """Scatter kept values into zeros; differentiable, its backward gathers the gradient at ``idx``."""
    zeros = torch.zeros(*values.shape[:-1], hidden, dtype=values.dtype, device=values.device)
    return zeros.scatter(-1, idx, values)


def masked_boundary(x: Tensor, idx: Tensor, scale: Tensor | float | None = None) -> Tensor:  # (B, T, H)
    """In-process reference of a masked boundary: ``scale * scatter(gather(x, idx))``.

    ``scale`` (a float, or (B, T) per token) is a constant for autograd, so the gradient at ``x`` is
    ``scale * grad`` at the kept positions and zero elsewhere. No wire dtype rounding.
    """
    y = scatter_kept(gather_kept(x, idx), idx, x.shape[-1])
    if scale is None:
        return y
    if isinstance(scale, Tensor):
        return y * scale.detach().to(y.dtype)[..., None]
    return y * scale


def rms_scale(x: Tensor, kept: Tensor) -> Tensor:  # x: (B, T, H), kept: (B, T, K) -> (B, T) float32
    """Per-token factor that restores the dense RMS: ``sqrt(sum x^2 / sum kept^2)`` (1 where kept is 0)."""
    dense = x.detach().to(torch.float32).square().sum(-1)
    part = kept.detach().to(torch.float32).square().sum(-1)
    ok = part > 0
    return torch.where(ok, torch.sqrt(dense / torch.where(ok, part, torch.ones_like(part))), torch.ones_like(part))


# ---------------------------------------------------------------------------------------------
# codecs


class BoundaryCodec(ABC):
    """The interface a stage worker uses for every boundary, whatever the compression."""

    name: str = "?"

    def __init__(self, wire_dtype: str = "bfloat16") -> None:
        if wire_dtype not in WIRE_DTYPES:
            raise ValueError(f"wire dtype must be one of {', '.join(WIRE_DTYPES)}, got {wire_dtype!r}")
        self.wire_dtype_name = wire_dtype
        self.wire_dtype = WIRE_DTYPES[wire_dtype]

    @abstractmethod
    def encode(self, x: Tensor, ctx: BoundaryContext | None = None) -> EncodedPayload:
        """Sender, forward: the payload for activation ``x`` (B, T, H)."""

    @abstractmethod
    def decode(self, payload: EncodedPayload, ctx: BoundaryContext | None = None) -> Tensor:
        """Receiver, forward: the dense (B, T, H) input of the next stage (no autograd history)."""

    @abstractmethod
    def encode_grad(self, grad: Tensor, ctx: BoundaryContext | None = None) -> EncodedPayload:
        """Receiver, backward: the payload for the gradient (B, T, H) at the decoded input."""

    @abstractmethod
    def decode_grad(self, payload: EncodedPayload, ctx: BoundaryContext | None = None) -> Tensor:
        """Sender, backward: the dense (B, T, H) gradient to backpropagate from ``x``."""

    @abstractmethod
    def forward_nbytes(self, batch: int, seq: int, hidden: int) -> int:
        """Tensor bytes of an activation payload (no header), without building one (cost models)."""

    @abstractmethod
    def backward_nbytes(self, batch: int, seq: int, hidden: int) -> int:
        """Tensor bytes of a gradient payload (no header)."""

    def describe(self) -> str:
        return f"{self.name}({self.wire_dtype_name})"

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.describe()}>"

    # -- helpers shared by the implementations

    def _payload(
        self, kind: str, x: Tensor, tensors: dict[str, Tensor], meta: dict[str, Any] | None = None
    ) -> EncodedPayload:
        return EncodedPayload(
            codec=self.name,
            kind=kind,
            shape=_dense_shape(x),
            dtype=_dtype_name(x.dtype),
            tensors={k: v.detach().contiguous() for k, v in tensors.items()},
            meta=meta or {},
        )

    def _header(self, payload: EncodedPayload, kind: str) -> tuple[int, int, int]:
        """Validate codec, kind, dense dtype and shape; return (B, T, H)."""
        if payload.codec != self.name:
            raise PayloadError(f"payload codec {payload.codec!r} but this boundary uses {self.name!r}")
        if payload.kind != kind:
            raise PayloadError(f"expected a {kind} payload, got {payload.kind!r}")
        if payload.dtype not in _DENSE_DTYPES:
            raise PayloadError(f"unsupported dense dtype {payload.dtype!r}")
        shape = tuple(payload.shape)
        if len(shape) != 3 or any(isinstance(d, bool) or not isinstance(d, int) or d <= 0 for d in shape):
            raise PayloadError(f"dense shape must be (B, T, H) with positive sizes, got {payload.shape!r}")
        return shape  # type: ignore[return-value]

    @staticmethod
    def _tensors(payload: EncodedPayload, specs: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> None:
        """Validate tensor names, shapes, dtypes and finiteness."""
        if set(payload.tensors) != set(specs):
            raise PayloadError(f"payload tensors {sorted(payload.tensors)}, expected {sorted(specs)}")
        for name, (want_shape, want_dtype) in specs.items():
            t = payload.tensors[name]
            if tuple(t.shape) != want_shape or t.dtype != want_dtype:
                raise PayloadError(
                    f"payload tensor {name!r}: got {t.dtype} {tuple(t.shape)}, expected {want_dtype} {want_shape}"
                )
            if t.is_floating_point() and not bool(torch.isfinite(t).all()):
                raise PayloadError(f"payload tensor {name!r} has non-finite values")


class DenseCodec(BoundaryCodec):
    """No compression: the tensor in the wire dtype, both directions."""

    name = "dense"

    def encode(self, x: Tensor, ctx: BoundaryContext | None = None) -> EncodedPayload:
        return self._payload(ACTIVATION, x, {"values": x.to(self.wire_dtype)})

    def decode(self, payload: EncodedPayload, ctx: BoundaryContext | None = None) -> Tensor:
        return self._decode(payload, ACTIVATION)

    def encode_grad(self, grad: Tensor, ctx: BoundaryContext | None = None) -> EncodedPayload:
        return self._payload(GRAD, grad, {"values": grad.to(self.wire_dtype)})

    def decode_grad(self, payload: EncodedPayload, ctx: BoundaryContext | None = None) -> Tensor:
        return self._decode(payload, GRAD)

    def _decode(self, payload: EncodedPayload, kind: str) -> Tensor:
        self._tensors(payload, {"values": (self._header(payload, kind), self.wire_dtype)})
        return payload.tensors["values"].to(dtype=_DENSE_DTYPES[payload.dtype], copy=True)

    def forward_nbytes(self, batch: int, seq: int, hidden: int) -> int:
        return batch * seq * hidden * self.wire_dtype.itemsize

    backward_nbytes = forward_nbytes


class MaskCodec(BoundaryCodec):
    """The PRF mask: K = round((1-p) H) values per token, indices re-derived from the key on both sides.

    ``fill`` says what the receiver puts at the dropped positions:

    - ``zero`` (the paper): zeros. The next stage sees a vector whose dropped channels, including the
      residual stream's large, nearly constant "massive activation" channels, are 0.
    - ``mean``: the per-channel mean of this microbatch, ``mean_c = mean_{b,t} x[b, t, c]`` (H values,
      sent beside the kept values: H x 2 bytes per message). The receiver's input is then
      ``y = m + mask * (x - m)``: the error per dropped entry is its deviation from the channel mean
      instead of its whole value. The function stays differentiable end to end: the backward payload
      is the gradient at the same K positions plus ``sum over dropped (b, t) of g[b, t, c]`` (H values,
      fp32), which the sender spreads as ``1/(B T)`` over every token (the gradient through the mean).
    """

    name = "mask"

    def __init__(self, ratio: float, rescale: str = "none", wire_dtype: str = "bfloat16", fill: str = "zero") -> None:
        super().__init__(wire_dtype)
        num_kept(1, ratio)  # validates the range
        if rescale not in RESCALE_MODES:
            raise ValueError(f"rescale must be one of {', '.join(RESCALE_MODES)}, got {rescale!r}")
        if fill not in FILL_MODES:
            raise ValueError(f"fill must be one of {', '.join(FILL_MODES)}, got {fill!r}")
        if fill == "mean" and rescale != "none":
            raise ValueError("fill = mean works with rescale = none only")
        self.ratio = float(ratio)
        self.rescale = rescale
        self.fill = fill

    def describe(self) -> str:
        return f"mask(p={self.ratio}, rescale={self.rescale}, fill={self.fill}, {self.wire_dtype_name})"

    def keep_factor(self) -> float:
        """The ``inv_keep`` factor 1/(1-p)."""
        return 1.0 / (1.0 - self.ratio)

    def _indices(self, ctx: BoundaryContext, batch: int, seq: int, hidden: int, device: torch.device) -> Tensor:
        k = num_kept(hidden, self.ratio)
        if ctx.indices is not None and tuple(ctx.indices.shape) == (batch, seq, k):
            return ctx.indices.to(device)
        if ctx.key is None:
            raise ValueError("the mask codec needs ctx.key (the MaskKey of this exchange)")
        ctx.indices = keep_indices(ctx.key, batch, seq, hidden, self.ratio, device, row_offset=ctx.row_offset)
        return ctx.indices

    def _meta(self, ctx: BoundaryContext) -> dict[str, Any]:
        assert ctx.key is not None
        return {
            "key": list(ctx.key.as_tuple()),
            "row_offset": ctx.row_offset,
            "ratio": self.ratio,
            "rescale": self.rescale,
            "fill": self.fill,
        }

    def _adopt_key(self, payload: EncodedPayload, ctx: BoundaryContext | None) -> BoundaryContext:
        """The receiver's context: its own key if it has one (checked against the payload's), else the payload's."""
        meta = payload.meta
        if (
            meta.get("ratio", self.ratio) != self.ratio
            or meta.get("rescale", self.rescale) != self.rescale
            or meta.get("fill", "zero") != self.fill
        ):
            raise PayloadError(
                f"payload masked with ratio={meta.get('ratio')} rescale={meta.get('rescale')} "
                f"fill={meta.get('fill', 'zero')}, this boundary uses ratio={self.ratio} rescale={self.rescale} "
                f"fill={self.fill}"
            )
        sent = meta.get("key")
        try:
            sent_key = MaskKey(*(_exact_int(v) for v in sent)) if sent is not None else None
        except (TypeError, ValueError):
            raise PayloadError(f"malformed mask key in payload: {sent!r}") from None
        try:
            row_offset = _exact_int(meta.get("row_offset", 0))
        except TypeError:
            raise PayloadError(f"payload row offset {meta['row_offset']!r} is not an integer") from None
        if ctx is None:
            ctx = BoundaryContext(row_offset=row_offset)
        if ctx.key is None:
            if sent_key is None:
                raise PayloadError("mask payload without a key, and no key in the context")
            ctx.key = sent_key
        elif sent_key is not None and sent_key != ctx.key:
            raise PayloadError(f"payload mask key {sent_key} does not match this exchange's key {ctx.key}")
        if "row_offset" in meta and row_offset != ctx.row_offset:
            raise PayloadError(f"payload row offset {meta['row_offset']} != {ctx.row_offset}")
        return ctx

    def _specs(self, payload: EncodedPayload, kind: str) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        b, t, h = self._header(payload, kind)
        specs = {"values": ((b, t, num_kept(h, self.ratio)), self.wire_dtype)}
        if self.rescale == "rms" and kind == ACTIVATION:
            specs["scale"] = ((b, t), torch.float32)
        if self.fill == "mean":
            specs["mean"] = ((h,), self.wire_dtype) if kind == ACTIVATION else ((h,), torch.float32)
        return specs

    def encode(self, x: Tensor, ctx: BoundaryContext | None = None) -> EncodedPayload:
        if ctx is None:
            raise ValueError("the mask codec needs a BoundaryContext with the exchange's MaskKey")
        b, t, h = _dense_shape(x)
        idx = self._indices(ctx, b, t, h, x.device)
        values = gather_kept(x.detach(), idx).to(self.wire_dtype)
        tensors = {"values": values}
        if self.rescale == "rms":
            tensors["scale"] = rms_scale(x, values)  # measured on the wire-rounded values
        if self.fill == "mean":
            tensors["mean"] = x.detach().float().mean(dim=(0, 1)).to(self.wire_dtype)  # (H,)
        return self._payload(ACTIVATION, x, tensors, self._meta(ctx))

    def decode(self, payload: EncodedPayload, ctx: BoundaryContext | None = None) -> Tensor:
        self._header(payload, ACTIVATION)
        ctx = self._adopt_key(payload, ctx)
        self._tensors(payload, self._specs(payload, ACTIVATION))
        b, t, h = payload.shape
        dtype = _DENSE_DTYPES[payload.dtype]
        values = payload.tensors["values"]
        idx = self._indices(ctx, b, t, h, values.device)
        if self.fill == "mean":
            y = payload.tensors["mean"].to(dtype).expand(b, t, h).clone()
            return y.scatter_(-1, idx, values.to(dtype))
        y = scatter_kept(values.to(dtype), idx, h)
        if self.rescale == "inv_keep":
            y = y * self.keep_factor()
        elif self.rescale == "rms":
            ctx.scale = payload.tensors["scale"]
            y = y * ctx.scale.to(dtype)[..., None]
        return y

    def encode_grad(self, grad: Tensor, ctx: BoundaryContext | None = None) -> EncodedPayload:
        if ctx is None:
            raise ValueError("encode_grad needs the receiver's BoundaryContext of this exchange")
        b, t, h = _dense_shape(grad)
        idx = self._indices(ctx, b, t, h, grad.device)
        g = gather_kept(grad.detach(), idx)
        if self.rescale == "inv_keep":
            g = g * self.keep_factor()
        elif self.rescale == "rms":
            if ctx.scale is None:
                raise ValueError("rms rescale: encode_grad needs the scale recorded by decode in this context")
            g = g * ctx.scale.to(device=g.device, dtype=g.dtype)[..., None]
        tensors = {"values": g.to(self.wire_dtype)}
        if self.fill == "mean":  # the gradient of the filled mean: sum over the dropped positions
            kept = torch.zeros(b, t, h, device=grad.device).scatter_(-1, idx, 1.0)  # (B, T, H)
            tensors["mean"] = (grad.detach().float() * (1.0 - kept)).sum(dim=(0, 1))  # (H,) float32
        return self._payload(GRAD, grad, tensors, self._meta(ctx))

    def decode_grad(self, payload: EncodedPayload, ctx: BoundaryContext | None = None) -> Tensor:
        self._header(payload, GRAD)
        ctx = self._adopt_key(payload, ctx)
        self._tensors(payload, self._specs(payload, GRAD))
        b, t, h = payload.shape
        values = payload.tensors["values"]
        idx = self._indices(ctx, b, t, h, values.device)
        dtype = _DENSE_DTYPES[payload.dtype]
        g = scatter_kept(values.to(dtype), idx, h)
        if self.fill == "mean":
            g = g + (payload.tensors["mean"] / (b * t)).to(dtype)
        return g

    def forward_nbytes(self, batch: int, seq: int, hidden: int) -> int:
        n = batch * seq * num_kept(hidden, self.ratio) * self.wire_dtype.itemsize
        return n + (batch * seq * 4 if self.rescale == "rms" else 0)

    def backward_nbytes(self, batch: int, seq: int, hidden: int) -> int:
        return batch * seq * num_kept(hidden, self.ratio) * self.wire_dtype.itemsize


class TopKCodec(BoundaryCodec):
    """Per-token top-k by magnitude: values plus indices forward; the gradient at the same indices back."""

    name = "topk"

    def __init__(self, ratio: float, wire_dtype: str = "bfloat16") -> None:
        super().__init__(wire_dtype)
        if not 0.0 < ratio <= 1.0:
            raise ValueError(f"top-k ratio (fraction kept) must be in (0, 1], got {ratio}")
        self.ratio = float(ratio)

    def describe(self) -> str:
        return f"topk(keep={self.ratio}, {self.wire_dtype_name})"

    def k(self, hidden: int) -> int:
        return max(1, min(hidden, round(self.ratio * hidden)))

    @staticmethod
    def index_dtype(hidden: int) -> torch.dtype:
        return torch.int16 if hidden <= 1 << 15 else torch.int32

    def encode(self, x: Tensor, ctx: BoundaryContext | None = None) -> EncodedPayload:
        b, t, h = _dense_shape(x)
        xd = x.detach()
        idx = torch.topk(xd.abs(), self.k(h), dim=-1, sorted=False).indices.sort(dim=-1).values
        if ctx is not None:
            ctx.indices = idx
        tensors = {"values": gather_kept(xd, idx).to(self.wire_dtype), "indices": idx.to(self.index_dtype(h))}
        return self._payload(ACTIVATION, x, tensors)

    def decode(self, payload: EncodedPayload, ctx: BoundaryContext | None = None) -> Tensor:
        b, t, h = self._header(payload, ACTIVATION)
        k = self.k(h)
        self._tensors(payload, {"values": ((b, t, k), self.wire_dtype), "indices": ((b, t, k), self.index_dtype(h))})
        idx = payload.tensors["indices"].long()
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= h or bool((idx.diff(dim=-1) <= 0).any())):
            raise PayloadError("top-k indices out of range, unsorted or repeated")
        if ctx is not None:
            ctx.indices = idx
        return scatter_kept(payload.tensors["values"].to(_DENSE_DTYPES[payload.dtype]), idx, h)

    def encode_grad(self, grad: Tensor, ctx: BoundaryContext | None = None) -> EncodedPayload:
        if ctx is None or ctx.indices is None:
            raise ValueError("top-k encode_grad needs the indices recorded by decode in this context")
        g = gather_kept(grad.detach(), ctx.indices.to(grad.device)).to(self.wire_dtype)
        return self._payload(GRAD, grad, {"values": g})

    def decode_grad(self, payload: EncodedPayload, ctx: BoundaryContext | None = None) -> Tensor:
        if ctx is None or ctx.indices is None:
            raise ValueError("top-k decode_grad needs the indices recorded by encode in this context")
        b, t, h = self._header(payload, GRAD)
        if (b, t) != tuple(ctx.indices.shape[:2]):
            raise PayloadError(f"gradient shape {payload.shape} does not match the forward's")
        self._tensors(payload, {"values": (tuple(ctx.indices.shape), self.wire_dtype)})
        return scatter_kept(payload.tensors["values"].to(_DENSE_DTYPES[payload.dtype]), ctx.indices, h)

    def forward_nbytes(self, batch: int, seq: int, hidden: int) -> int:
        k = self.k(hidden)
        return batch * seq * k * (self.wire_dtype.itemsize + self.index_dtype(hidden).itemsize)

    def backward_nbytes(self, batch: int, seq: int, hidden: int) -> int:
        return batch * seq * self.k(hidden) * self.wire_dtype.itemsize


class _SameBothWays(BoundaryCodec):
    """A codec that treats activations and gradients alike, with no per-exchange state: one ``_encode`` and
    one ``_decode`` given the payload kind."""

    @abstractmethod
    def _encode(self, kind: str, x: Tensor) -> EncodedPayload: ...

    @abstractmethod
    def _decode(self, payload: EncodedPayload, kind: str) -> Tensor: ...

    def encode(self, x: Tensor, ctx: BoundaryContext | None = None) -> EncodedPayload:
        return self._encode(ACTIVATION, x)

    def decode(self, payload: EncodedPayload, ctx: BoundaryContext | None = None) -> Tensor:
        return self._decode(payload, ACTIVATION)

    def encode_grad(self, grad: Tensor, ctx: BoundaryContext | None = None) -> EncodedPayload:
        return self._encode(GRAD, grad)

    def decode_grad(self, payload: EncodedPayload, ctx: BoundaryContext | None = None) -> Tensor:
        return self._decode(payload, GRAD)


class QuantCodec(_SameBothWays):
    """Per-token absmax quantisation (int8, or int4 packed two per byte), both directions."""

    def __init__(self, bits: int = 8) -> None:
        super().__init__("float32")  # the wire carries codes + float32 scales; no float values
        if bits not in (8, 4):
            raise ValueError(f"quantisation bits must be 8 or 4, got {bits}")
        self.bits = bits
        self.name = f"int{bits}"

    def describe(self) -> str:
        return self.name

    def _encode(self, kind: str, x: Tensor) -> EncodedPayload:
        _dense_shape(x)
        codes, scale = quantize_absmax(x, self.bits)
        return self._payload(kind, x, {"codes": codes, "scale": scale})

    def _decode(self, payload: EncodedPayload, kind: str) -> Tensor:
        b, t, h = self._header(payload, kind)
        codes = ((b, t, h), torch.int8) if self.bits == 8 else ((b, t, (h + 1) // 2), torch.uint8)
        self._tensors(payload, {"codes": codes, "scale": ((b, t), torch.float32)})
        p = payload.tensors
        return dequantize_absmax(p["codes"], p["scale"], self.bits, h, _DENSE_DTYPES[payload.dtype])

    def forward_nbytes(self, batch: int, seq: int, hidden: int) -> int:
        return quantized_nbytes(batch * seq, hidden, self.bits)

    backward_nbytes = forward_nbytes


def _check_scale(rms: Tensor) -> None:
    """A payload's per-token scales must be finite and non-negative."""
    if not (bool((rms >= 0).all()) and bool(torch.isfinite(rms).all())):
        raise PayloadError("payload tensor 'rms' has negative or non-finite values")


class RotQuantCodec(_SameBothWays):
    """Rotated low-bit quantisation (:mod:`.rotquant`): all H channels at ``bits`` bits, both directions.

    With ``center`` (the default) the activation is centred first: the sender subtracts the microbatch's
    per-channel mean (H values in the wire dtype, sent beside the codes) and quantises the rest. The
    residual stream's large, nearly constant channels then cost nothing, and the quantiser's step
    follows what varies. The gradient is quantised as is (the centring is exact, so it passes the
    gradient through unchanged).

    ``weight`` shapes the activation's error over the channels: the sender multiplies channel c by
    ``w_c`` before the rotation and the receiver divides by it after, so the (rotation-flattened)
    quantisation error lands on channel c scaled by ``1 / w_c``. The receiving layer reads the boundary
    through an RMSNorm with gains ``g``, so an error in channel c costs in proportion to ``g_c``:
    ``"norm"`` uses ``w = |g|``; ``"norm_std"`` uses ``w = sqrt(|g| / std_c)`` (std over the microbatch's
    tokens), which minimises the gain-weighted error for a given total (Cauchy-Schwarz). The gains are
    the sender's copy of the receiving layer's (``BoundaryContext.gain``: the pretrained values, which
    every peer loads; without them ``g = 1``). ``w`` is normalised to rms 1, clipped to [1/64, 64] and
    sent in the wire dtype (H values), so the receiver needs nothing but the payload.

    ``grad_weight = "std"`` weights the gradient going back by ``w = 1 / rms_c`` (the channel's rms over the
    microbatch's tokens, normalised and clipped the same way, sent the same way): every channel's error is
    then the same fraction of that channel's own gradient. Unweighted, the rotation spreads the error
    evenly in absolute terms, so channels with a small gradient get a large relative error, and AdamW, which
    normalises each coordinate by its own scale, takes that noise at full size in the matrices writing those
    channels. With the default ``"none"`` the gradient is not weighted (and the payload is as before).
    """

    name = "rotq"

    def __init__(self, bits: int = 2, center: bool = True, wire_dtype: str = "bfloat16", seed: int = 0,
                 weight: str = "none", grad_bits: int = 0, grad_weight: str = "none",
                 token_scale: str = "float") -> None:
        super().__init__(wire_dtype)  # the dtype of the channel means; codes are uint8, the rms float32
        for b in (bits, grad_bits or bits):
            if b not in ROTQ_BITS:
                raise ValueError(f"rotq bits must be one of {', '.join(map(str, ROTQ_BITS))}, got {b}")
        self.grad_bits = int(grad_bits or bits)  # the gradient's bits (default: the activation's)
        if weight not in ROTQ_WEIGHTS:
            raise ValueError(f"rotq weight must be one of {', '.join(ROTQ_WEIGHTS)}, got {weight!r}")
        if grad_weight not in ROTQ_GRAD_WEIGHTS:
            raise ValueError(f"rotq grad_weight must be one of {', '.join(ROTQ_GRAD_WEIGHTS)}, got {grad_weight!r}")
        self.grad_weight = grad_weight
        if token_scale not in TOKEN_SCALES:
            raise ValueError(f"rotq token_scale must be one of {', '.join(TOKEN_SCALES)}, got {token_scale!r}")
        self.token_scale = token_scale
        self.bits = int(bits)
        self.center = bool(center)
        self.seed = int(seed)
        self.weight = weight

    def describe(self) -> str:
        extra = (", centred" if self.center else "") + (
            f", weighted by {self.weight}" if self.weight != "none" else "")
        if self.grad_bits != self.bits:
            extra += f", gradient {self.grad_bits} bit"
        if self.grad_weight != "none":
            extra += f", gradient weighted by {self.grad_weight}"
        if self.token_scale != "float":
            extra += f", {self.token_scale} token scales"
        return f"rotq({self.bits} bit{extra})"

    def _meta(self) -> dict[str, Any]:
        meta = {"bits": self.bits, "seed": self.seed, "center": self.center, "weight": self.weight,
                "grad_bits": self.grad_bits}
        if self.grad_weight != "none":  # absent when unweighted: payloads stay those of peers without the key
            meta["grad_weight"] = self.grad_weight
        if self.token_scale != "float":  # the same
            meta["token_scale"] = self.token_scale
        return meta

    def _scales(self, z: Tensor, tensors: dict[str, Tensor]) -> Tensor | None:
        """With ``log8`` token scales: put the scales of ``z``'s tokens (..., H) in ``tensors`` as they travel and
        return them as the receiver decodes them (the encoder codes with these); None with float scales."""
        if self.token_scale == "float":
            return None
        codes, top = log8_scales(z.detach().float().square().mean(-1).sqrt())
        tensors.update(rms=codes, rms_top=top)
        return log8_decode(codes, top)

    def _scale_specs(self, b: int, t: int, dtype: torch.dtype) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        if self.token_scale == "float":
            return {"rms": ((b, t), dtype)}
        return {"rms": ((b, t), torch.uint8), "rms_top": ((1,), torch.float32)}

    def _decoded_scales(self, p: dict[str, Tensor]) -> Tensor:
        """The token scales of a validated payload: float32 (B, T)."""
        if self.token_scale == "float":
            _check_scale(p["rms"])
            return p["rms"].float()
        if float(p["rms_top"]) < 0:
            raise PayloadError("payload tensor 'rms_top' is negative")
        return log8_decode(p["rms"], p["rms_top"])


    def _bits(self, kind: str) -> int:
        return self.grad_bits if kind == GRAD else self.bits

    def _weighted(self, kind: str) -> bool:  # whether this kind of payload carries channel weights
        return (self.weight if kind == ACTIVATION else self.grad_weight) != "none"

    def encode(self, x: Tensor, ctx: BoundaryContext | None = None) -> EncodedPayload:
        if ctx is not None and ctx.transform is not None:
            return self._encode_transform(x, ctx.transform)
        return self._encode(ACTIVATION, x, ctx.gain if ctx is not None else None)

    def decode(self, payload: EncodedPayload, ctx: BoundaryContext | None = None) -> Tensor:
        if TRANSFORM_META in payload.meta:
            return self._decode_transform(payload, ACTIVATION, ctx.transform if ctx is not None else None)
        return self._decode(payload, ACTIVATION)

    def encode_grad(self, grad: Tensor, ctx: BoundaryContext | None = None) -> EncodedPayload:
        if ctx is not None and ctx.transform is not None:
            return self._encode_transform(grad, ctx.transform, GRAD)
        return self._encode(GRAD, grad)

    def decode_grad(self, payload: EncodedPayload, ctx: BoundaryContext | None = None) -> Tensor:
        if TRANSFORM_META in payload.meta:
            return self._decode_transform(payload, GRAD, ctx.transform if ctx is not None else None)
        return self._decode(payload, GRAD)

    def _encode_transform(self, x: Tensor, tf: Transform, kind: str = ACTIVATION) -> EncodedPayload:
        """``x`` in the fitted transform code ``tf`` (an activation centred as usual, a gradient as is; no channel
        weights: the transform is fitted to what it codes). The payload's meta names the code's bits per token."""
        _dense_shape(x)
        z = x.detach().float()
        tensors: dict[str, Tensor] = {}
        if self.center and kind == ACTIVATION:
            tensors["mean"] = z.mean(dim=(0, 1)).to(self.wire_dtype)
            z = z - tensors["mean"].float()
        scales = self._scales(z, tensors)
        codes, rms = tc_encode(z, tf, scales)
        tensors["codes"] = codes
        if scales is None:
            tensors["rms"] = rms.to(torch.bfloat16)  # 2 bytes a token: a tenth of a half-bit code
        return self._payload(kind, x, tensors, {**self._meta(), TRANSFORM_META: tf.code_bits})

    def _decode_transform(self, payload: EncodedPayload, kind: str, tf: Transform | None) -> Tensor:
        b, t, h = self._header(payload, kind)
        meta = dict(payload.meta)
        code_bits = meta.pop(TRANSFORM_META)
        if meta != self._meta():
            raise PayloadError(f"payload quantised with {meta}, this boundary uses {self._meta()}")
        if tf is None:
            raise PayloadError("payload is in a fitted transform code, and this boundary has none for it")
        if code_bits != tf.code_bits or tf.basis.shape[0] != h:
            raise PayloadError(f"payload is a {code_bits}-bit transform code of {h} channels; the transform it names "
                               f"has {tf.code_bits} bits and {tf.basis.shape[0]} channels")
        specs = {"codes": ((b, t, tf.code_bytes), torch.uint8), **self._scale_specs(b, t, torch.bfloat16)}
        centred = self.center and kind == ACTIVATION
        if centred:
            specs["mean"] = ((h,), self.wire_dtype)
        self._tensors(payload, specs)
        p = payload.tensors
        y = tc_decode(p["codes"], self._decoded_scales(p), tf)
        if centred:
            y = y + p["mean"].float()
        return y.to(_DENSE_DTYPES[payload.dtype])

    def channel_weights(self, z: Tensor, gain: Tensor | None, kind: str = ACTIVATION) -> Tensor:
        """The per-channel weights of :attr:`weight` for the (centred) activation ``z`` (B, T, H), or of
        :attr:`grad_weight` for a gradient, as they travel: (H,) in the wire dtype."""
        h = z.shape[-1]
        if kind != ACTIVATION:
            rms = z.square().mean(dim=(0, 1)).sqrt()
            return self._normalised(1.0 / rms.clamp_min(1e-6 * float(rms.max()) + 1e-30))
        if gain is None:
            g = torch.ones(h, device=z.device)
        else:
            if tuple(gain.shape) != (h,):
                raise ValueError(f"rotq gain must have shape ({h},), got {tuple(gain.shape)}")
            g = gain.detach().to(device=z.device, dtype=torch.float32).abs()
        w = g
        if self.weight == "norm_std":
            std = z.square().mean(dim=(0, 1)).sqrt()
            w = (g / std.clamp_min(1e-6 * float(std.max()) + 1e-30)).sqrt()
        return self._normalised(w)

    def _normalised(self, w: Tensor) -> Tensor:  # rms 1, clipped to the range a receiver accepts, wire dtype
        w = torch.nan_to_num(w, nan=1.0, posinf=1.0)
        top = float(w.max())
        if 0.0 < top < float("inf"):
            w = w / top  # first to at most 1: a huge weight (a channel of ~zero rms) must not overflow the square
        rms = w.square().mean().sqrt()
        w = w / rms if float(rms) > 0 else torch.ones_like(w)
        return w.clamp(1.0 / ROTQ_WEIGHT_RANGE, ROTQ_WEIGHT_RANGE).to(self.wire_dtype)

    def _encode(self, kind: str, x: Tensor, gain: Tensor | None = None) -> EncodedPayload:
        _dense_shape(x)
        tensors: dict[str, Tensor] = {}
        z = x.detach().float()
        if self.center and kind == ACTIVATION:
            mean = z.mean(dim=(0, 1)).to(self.wire_dtype)  # (H,), rounded as it travels
            tensors["mean"] = mean
            z = z - mean.float()
        if self._weighted(kind):
            w = self.channel_weights(z, gain, kind)
            tensors["weight"] = w
            z = z * w.float()
        scales = self._scales(z, tensors)  # the rotation keeps each token's rms
        codes, rms = rotq_encode(z, self._bits(kind), self.seed, scales)
        tensors["codes"] = codes
        if scales is None:
            tensors["rms"] = rms
        return self._payload(kind, x, tensors, self._meta())

    def _decode(self, payload: EncodedPayload, kind: str) -> Tensor:
        b, t, h = self._header(payload, kind)
        if payload.meta != self._meta():
            raise PayloadError(f"payload quantised with {payload.meta}, this boundary uses {self._meta()}")
        bits = self._bits(kind)
        specs = {"codes": ((b, t, packed_width(h, bits)), torch.uint8), **self._scale_specs(b, t, torch.float32)}
        centred = self.center and kind == ACTIVATION
        weighted = self._weighted(kind)
        if centred:
            specs["mean"] = ((h,), self.wire_dtype)
        if weighted:
            specs["weight"] = ((h,), self.wire_dtype)
        self._tensors(payload, specs)
        p = payload.tensors
        rms = self._decoded_scales(p)
        if weighted:
            w = p["weight"].float()
            if bool(((w < 1.0 / ROTQ_WEIGHT_RANGE * 0.99) | (w > ROTQ_WEIGHT_RANGE * 1.01)).any()):
                raise PayloadError(f"payload tensor 'weight' outside [1/{ROTQ_WEIGHT_RANGE:g}, {ROTQ_WEIGHT_RANGE:g}]")
        y = rotq_decode(p["codes"], rms, bits, h, self.seed)
        if weighted:
            y = y / w
        if centred:
            y = y + p["mean"].float()
        return y.to(_DENSE_DTYPES[payload.dtype])

    def forward_nbytes(self, batch: int, seq: int, hidden: int) -> int:
        per_channel = int(self.center) + int(self.weight != "none")  # means, weights: H values each
        return self._coded_nbytes(batch * seq, hidden, self.bits) + per_channel * hidden * self.wire_dtype.itemsize

    def backward_nbytes(self, batch: int, seq: int, hidden: int) -> int:
        per_channel = int(self.grad_weight != "none")  # the gradient's weights: H values
        n = self._coded_nbytes(batch * seq, hidden, self.grad_bits)
        return n + per_channel * hidden * self.wire_dtype.itemsize

    def _coded_nbytes(self, tokens: int, hidden: int, bits: int) -> int:
        """Codes and token scales: a float32 scale a token, or (log8) a byte a token and the payload's largest."""
        if self.token_scale == "float":
            return rotq_nbytes(tokens, hidden, bits)
        return rotq_nbytes(tokens, hidden, bits, scale_bytes=1) + 4


# ---------------------------------------------------------------------------------------------
# factory and in-process exchange


def make_codec(mask_cfg: MaskConfig, *, step: int | None = None) -> BoundaryCodec:
    """The boundary codec of a run config's ``[mask]`` section.

    ``codec = "mask"`` with ``ratio = 0`` is dense. With ``step`` given, steps before
    ``mask_cfg.warmup_steps`` get the dense codec (masking starts after the warmup).
    """
    if step is not None and step < mask_cfg.warmup_steps:
        return DenseCodec(mask_cfg.wire_dtype)
    kind = mask_cfg.codec
    if kind == "dense" or (kind == "mask" and mask_cfg.ratio == 0.0):
        return DenseCodec(mask_cfg.wire_dtype)
    if kind == "mask":
        return MaskCodec(mask_cfg.ratio, mask_cfg.rescale, mask_cfg.wire_dtype, mask_cfg.fill)
    if kind == "topk":
        return TopKCodec(mask_cfg.topk_ratio, mask_cfg.wire_dtype)
    if kind in ("int8", "int4"):
        return QuantCodec(int(kind[3:]))
    if kind == "rotq":
        return RotQuantCodec(mask_cfg.bits, mask_cfg.rotq_center, mask_cfg.wire_dtype, weight=mask_cfg.rotq_weight,
                             grad_bits=mask_cfg.grad_bits, grad_weight=mask_cfg.grad_weight,
                             token_scale=mask_cfg.token_scale)
    raise ValueError(f"unknown boundary codec {kind!r} (mask | topk | int8 | int4 | rotq | dense)")


class _Exchange(torch.autograd.Function):
    """encode -> decode forward, encode_grad -> decode_grad backward, as one autograd op."""

    @staticmethod
    def forward(fctx, x, codec, send_ctx, recv_ctx, counter):  # type: ignore[override]
        payload = codec.encode(x.detach(), send_ctx)
        if counter is not None:
            counter.add("pp_fwd", payload_bytes(payload))
        fctx.parts = (codec, send_ctx, recv_ctx, counter)
        return codec.decode(payload, recv_ctx)

    @staticmethod
    def backward(fctx, grad):  # type: ignore[override]
        codec, send_ctx, recv_ctx, counter = fctx.parts
        gp = codec.encode_grad(grad.contiguous(), recv_ctx)
        if counter is not None:
            counter.add("pp_bwd", payload_bytes(gp))
        return codec.decode_grad(gp, send_ctx), None, None, None, None


def simulate_transfer(
    codec: BoundaryCodec,
    x: Tensor,  # (B, T, H)
    key: MaskKey | None = None,
    *,
    row_offset: int = 0,
    counter: ByteCounter | None = None,
    gain: Tensor | None = None,
) -> Tensor:  # (B, T, H)
    """One exchange in one process, differentiable: the forward and backward go through the wire codec.

    Uses two separate contexts, as two peers would, and counts the payload bytes (with header) on
    ``pp_fwd`` and ``pp_bwd`` if a counter is given. ``gain``: the receiving layer's input norm gains, as
    the sender knows them (``rotq`` weighting).
    """
    send_ctx = BoundaryContext(key=key, row_offset=row_offset, gain=gain)
    recv_ctx = BoundaryContext(key=key, row_offset=row_offset)
    return _Exchange.apply(x, codec, send_ctx, recv_ctx, counter)


__all__ = [
    "RESCALE_MODES", "ROTQ_GRAD_WEIGHTS", "ROTQ_WEIGHTS", "WIRE_DTYPES", "BoundaryCodec", "BoundaryContext",
    "DenseCodec", "EncodedPayload", "MaskCodec", "TOKEN_SCALES", "log8_decode", "log8_scales",
    "PayloadError", "QuantCodec", "TopKCodec", "gather_kept", "make_codec", "masked_boundary", "rms_scale",
    "scatter_kept", "simulate_transfer",
]
