"""Boundary codecs against dense references: round trips, gradient positions, rescale, bytes, bad input."""

from __future__ import annotations

import pytest
import torch

from meshnode.compression import (
    HEADER_BYTES,
    BoundaryContext,
    ByteCounter,
    DenseCodec,
    EncodedPayload,
    MaskCodec,
    MaskKey,
    PayloadError,
    QuantCodec,
    TopKCodec,
    keep_indices,
    keep_mask,
    make_codec,
    masked_boundary,
    num_kept,
    payload_bytes,
    simulate_transfer,
)
from meshnode.config import MaskConfig

KEY = MaskKey(run_seed=7, step=3, microbatch=1, boundary=0)


def _x(b=2, t=8, h=64, seed=0, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, t, h, generator=g).to(dtype)


# ---------------------------------------------------------------------------------------------
# mask codec


def test_mask_round_trip_equals_x_at_kept_positions_and_zero_elsewhere():
    x = _x(h=96)
    codec = MaskCodec(0.9, wire_dtype="float32")
    payload = codec.encode(x, BoundaryContext(key=KEY))
    assert set(payload.tensors) == {"values"}  # no indices on the wire
    assert payload.tensors["values"].shape == (2, 8, num_kept(96, 0.9))
    # the receiver knows only the key (its own context), not the sender's indices
    y = codec.decode(payload, BoundaryContext(key=KEY))
    mask = keep_mask(KEY, 2, 8, 96, 0.9)
    assert torch.equal(y[mask], x[mask])
    assert bool((y[~mask] == 0).all())
    # and it can rebuild from the payload alone (the key travels in the header)
    assert torch.equal(codec.decode(payload), y)


def test_mask_wire_dtype_rounding():
    x = _x(h=64)
    codec = MaskCodec(0.5, wire_dtype="bfloat16")
    y = codec.decode(codec.encode(x, BoundaryContext(key=KEY)), BoundaryContext(key=KEY))
    assert y.dtype == torch.float32
    mask = keep_mask(KEY, 2, 8, 64, 0.5)
    assert torch.equal(y[mask], x[mask].to(torch.bfloat16).float())


def test_mask_backward_flows_only_at_kept_positions():
    """sender gather -> receiver scatter -> loss: the sender's gradient is the dense gradient at the mask."""
    x = _x(h=64).requires_grad_()
    w = _x(h=64, seed=1)
    codec = MaskCodec(0.75, wire_dtype="float32")
    y = simulate_transfer(codec, x, KEY)
    loss = (y * w).sum() + (y**2).sum()
    loss.backward()
    mask = keep_mask(KEY, 2, 8, 64, 0.75)
    # the dense gradient of the same loss at y, evaluated at the masked y
    dense_grad = w + 2 * y.detach()
    assert bool((x.grad[~mask] == 0).all())
    assert torch.allclose(x.grad[mask], dense_grad[mask])
    assert bool((x.grad[mask] != 0).all())


def test_mask_backward_payload_uses_forward_positions_without_indices():
    x = _x(h=64)
    codec = MaskCodec(0.75, wire_dtype="float32")
    send, recv = BoundaryContext(key=KEY), BoundaryContext(key=KEY)
    h = codec.decode(codec.encode(x, send), recv)
    grad = torch.randn_like(h)
    gp = codec.encode_grad(grad, recv)
    assert set(gp.tensors) == {"values"} and gp.tensors["values"].shape == (2, 8, 16)
    # a fresh sender context (indices re-derived from the key) gives the same dense gradient
    dx = codec.decode_grad(gp, BoundaryContext(key=KEY))
    assert torch.equal(dx, codec.decode_grad(gp, send))
    idx = keep_indices(KEY, 2, 8, 64, 0.75)
    assert torch.equal(dx.gather(-1, idx), grad.gather(-1, idx))
    assert torch.equal(dx, masked_boundary(grad, idx))


def test_mask_codec_matches_masked_boundary_reference_under_autograd():
    x = _x(h=48).requires_grad_()
    x_ref = x.detach().clone().requires_grad_()
    codec = MaskCodec(0.5, rescale="inv_keep", wire_dtype="float32")
    simulate_transfer(codec, x, KEY).pow(2).sum().backward()
    masked_boundary(x_ref, keep_indices(KEY, 2, 8, 48, 0.5), 2.0).pow(2).sum().backward()
    assert torch.allclose(x.grad, x_ref.grad)


def test_rescale_inv_keep():
    x = _x(h=100)
    plain = MaskCodec(0.9, wire_dtype="float32")
    scaled = MaskCodec(0.9, rescale="inv_keep", wire_dtype="float32")
    y0 = plain.decode(plain.encode(x, BoundaryContext(key=KEY)), BoundaryContext(key=KEY))
    y1 = scaled.decode(scaled.encode(x, BoundaryContext(key=KEY)), BoundaryContext(key=KEY))
    assert torch.allclose(y1, y0 / (1 - 0.9))
    # backward: the gradient is scaled by the same factor (the rescale is part of the boundary op)
    xg = x.clone().requires_grad_()
    simulate_transfer(scaled, xg, KEY).sum().backward()
    assert torch.allclose(xg.grad, keep_mask(KEY, 2, 8, 100, 0.9).float() / (1 - 0.9))


def test_rescale_rms_restores_per_token_rms_and_pays_for_its_scale():
    x = _x(h=128) * torch.linspace(0.1, 10, 8)[None, :, None]  # tokens with very different norms
    codec = MaskCodec(0.95, rescale="rms", wire_dtype="bfloat16")
    send, recv = BoundaryContext(key=KEY), BoundaryContext(key=KEY)
    payload = codec.encode(x, send)
    assert payload.tensors["scale"].shape == (2, 8) and payload.tensors["scale"].dtype == torch.float32
    k = num_kept(128, 0.95)
    assert payload.nbytes() == 2 * 8 * k * 2 + 2 * 8 * 4
    assert codec.forward_nbytes(2, 8, 128) == payload.nbytes()
    y = codec.decode(payload, recv)
    rms = lambda t: t.pow(2).mean(-1).sqrt()  # noqa: E731
    assert torch.allclose(rms(y), rms(x), rtol=1e-5)
    assert not torch.allclose(rms(MaskCodec(0.95).decode(MaskCodec(0.95).encode(x, send), recv)), rms(x), rtol=0.1)
    # backward: per-token scale applied by the receiver, zero outside the mask, no scale bytes
    grad = torch.ones_like(y)
    gp = codec.encode_grad(grad, recv)
    assert set(gp.tensors) == {"values"} and gp.nbytes() == 2 * 8 * k * 2
    dx = codec.decode_grad(gp, send)
    mask = keep_mask(KEY, 2, 8, 128, 0.95)
    expected = mask.float() * payload.tensors["scale"][..., None]
    assert torch.allclose(dx, expected.to(torch.bfloat16).float())


def test_m95_payload_is_about_five_percent_of_dense():
    b, t, h = 4, 16, 576
    x = _x(b, t, h)
    m95 = MaskCodec(0.95)  # bf16 on the wire
    dense = DenseCodec()
    payload = m95.encode(x, BoundaryContext(key=KEY))
    k = num_kept(576, 0.95)
    assert k == 29
    assert payload.nbytes() == b * t * 29 * 2 == 3712
    assert dense.encode(x).nbytes() == b * t * 576 * 2 == 73728
    assert payload.nbytes() / dense.encode(x).nbytes() == pytest.approx(29 / 576)  # 5.03 %
    assert payload_bytes(payload) == 3712 + HEADER_BYTES
    gp = m95.encode_grad(x, BoundaryContext(key=KEY))
    assert gp.nbytes() == 3712 == m95.backward_nbytes(b, t, h)


def test_mask_decode_rejects_bad_payloads():
    codec = MaskCodec(0.9)
    payload = codec.encode(_x(h=64), BoundaryContext(key=KEY))
    with pytest.raises(PayloadError, match="key"):
        codec.decode(payload, BoundaryContext(key=MaskKey(7, 4, 1, 0)))  # a different step's payload
    with pytest.raises(PayloadError, match="ratio"):
        MaskCodec(0.95).decode(payload)
    with pytest.raises(PayloadError, match="codec"):
        DenseCodec().decode(payload)
    bad = EncodedPayload(**{**payload.__dict__, "tensors": {"values": payload.tensors["values"][:, :, :3]}})
    with pytest.raises(PayloadError, match="values"):
        codec.decode(bad)
    nan = payload.tensors["values"].clone()
    nan[0, 0, 0] = float("nan")
    with pytest.raises(PayloadError, match="non-finite"):
        codec.decode(EncodedPayload(**{**payload.__dict__, "tensors": {"values": nan}}))
    with pytest.raises(PayloadError, match="shape"):
        codec.decode(EncodedPayload(**{**payload.__dict__, "shape": (2, 8, 0)}))
    with pytest.raises(PayloadError, match="activation"):
        codec.decode_grad(payload, BoundaryContext(key=KEY))


def test_mask_codec_needs_a_key():
    with pytest.raises(ValueError, match="MaskKey"):
        MaskCodec(0.9).encode(_x(), None)
    with pytest.raises(ValueError, match="key"):
        MaskCodec(0.9).encode(_x(), BoundaryContext())


def test_row_offset_reproduces_a_slice_of_the_microbatch():
    x = _x(b=4, h=64)
    codec = MaskCodec(0.8, wire_dtype="float32")
    whole = codec.decode(codec.encode(x, BoundaryContext(key=KEY)))
    part = codec.decode(codec.encode(x[2:], BoundaryContext(key=KEY, row_offset=2)))
    assert torch.equal(whole[2:], part)


# ---------------------------------------------------------------------------------------------
# baselines: dense, top-k, int8/int4


def test_dense_codec_round_trip_and_grad():
    x = _x(dtype=torch.float32).requires_grad_()
    y = simulate_transfer(DenseCodec("float32"), x)
    assert torch.equal(y, x.detach())
    y.sum().backward()
    assert torch.equal(x.grad, torch.ones_like(x))
    bf = DenseCodec("bfloat16")
    assert torch.equal(bf.decode(bf.encode(x.detach())), x.detach().to(torch.bfloat16).float())


def test_topk_round_trip_and_gradient_at_same_indices():
    x = _x(h=200)
    codec = TopKCodec(0.1, wire_dtype="float32")
    send, recv = BoundaryContext(), BoundaryContext()
    payload = codec.encode(x, send)
    assert payload.tensors["indices"].dtype == torch.int16
    assert payload.nbytes() == codec.forward_nbytes(2, 8, 200) == 2 * 8 * 20 * (4 + 2)
    y = codec.decode(payload, recv)
    kept = y != 0
    assert bool((kept.sum(-1) == 20).all())
    assert torch.equal(y[kept], x[kept])
    # every dropped value is no larger in magnitude than the smallest kept one of its token
    smallest_kept = torch.where(kept, x.abs(), torch.inf).amin(-1, keepdim=True)
    assert bool((torch.where(kept, 0.0, x.abs()) <= smallest_kept).all())
    # error bound: the dropped energy is the smallest 90 % of squared values
    err = (y - x).pow(2).sum(-1)
    assert bool((err <= x.pow(2).sum(-1) * 0.9).all())
    grad = torch.randn_like(x)
    gp = codec.encode_grad(grad, recv)
    assert set(gp.tensors) == {"values"}
    assert torch.equal(codec.decode_grad(gp, send), torch.where(kept, grad, 0.0))


def test_topk_autograd_and_bad_indices():
    x = _x(h=32).requires_grad_()
    codec = TopKCodec(0.25, wire_dtype="float32")
    y = simulate_transfer(codec, x)
    y.sum().backward()
    assert torch.equal(x.grad, (y != 0).float())
    payload = codec.encode(x.detach())
    bad = payload.tensors["indices"].clone()
    bad[0, 0, -1] = 40  # out of range
    with pytest.raises(PayloadError, match="indices"):
        codec.decode(EncodedPayload(**{**payload.__dict__, "tensors": {**payload.tensors, "indices": bad}}))


@pytest.mark.parametrize("bits, levels", [(8, 127), (4, 7)])
def test_quant_codec_error_bound(bits, levels):
    x = _x(h=65) * torch.logspace(-3, 2, 8)[None, :, None]  # odd H (4-bit padding), varied scales
    codec = QuantCodec(bits)
    assert codec.name == f"int{bits}"
    payload = codec.encode(x)
    row = 65 if bits == 8 else 33
    assert payload.nbytes() == 2 * 8 * (row + 4) == codec.forward_nbytes(2, 8, 65)
    y = codec.decode(payload)
    half_step = x.abs().amax(-1, keepdim=True) / (2 * levels)
    assert bool(((y - x).abs() <= half_step * (1 + 1e-5)).all())
    assert bool(((y - x).abs() > half_step * 0.2).any())  # it does quantise
    g = x.flip(-1)
    dg = codec.decode_grad(codec.encode_grad(g))
    assert bool(((dg - g).abs() <= g.abs().amax(-1, keepdim=True) / (2 * levels) * (1 + 1e-5)).all())


def test_quant_zero_rows():
    x = torch.zeros(1, 2, 9)
    for bits in (8, 4):
        codec = QuantCodec(bits)
        assert torch.equal(codec.decode(codec.encode(x)), x)


# ---------------------------------------------------------------------------------------------
# factory and byte counting of a simulated exchange


def test_make_codec():
    assert isinstance(make_codec(MaskConfig(ratio=0.0)), DenseCodec)
    c = make_codec(MaskConfig(ratio=0.95, rescale="rms", wire_dtype="float16"))
    assert isinstance(c, MaskCodec) and c.ratio == 0.95 and c.rescale == "rms" and c.wire_dtype == torch.float16
    assert isinstance(make_codec(MaskConfig(ratio=0.95, codec="dense")), DenseCodec)
    t = make_codec(MaskConfig(codec="topk", topk_ratio=0.2))
    assert isinstance(t, TopKCodec) and t.ratio == 0.2
    assert isinstance(make_codec(MaskConfig(codec="int8")), QuantCodec)
    assert make_codec(MaskConfig(codec="int4")).bits == 4
    warm = MaskConfig(ratio=0.9, warmup_steps=5)
    assert isinstance(make_codec(warm, step=4), DenseCodec)
    assert isinstance(make_codec(warm, step=5), MaskCodec)
    with pytest.raises(ValueError):
        make_codec(MaskConfig(codec="zip"))


def test_simulated_exchange_counts_bytes_per_axis():
    counter = ByteCounter()
    x = _x(b=2, t=8, h=576).requires_grad_()
    simulate_transfer(MaskCodec(0.95), x, KEY, counter=counter).sum().backward()
    snap = counter.snapshot()
    assert snap["pp_fwd"] == 2 * 8 * 29 * 2 + HEADER_BYTES
    assert snap["pp_bwd"] == 2 * 8 * 29 * 2 + HEADER_BYTES
    assert snap["dp"] == 0 and snap["total"] == 2 * (2 * 8 * 29 * 2 + HEADER_BYTES)


def test_payload_header_is_plain_data():
    payload = MaskCodec(0.9).encode(_x(h=64), BoundaryContext(key=KEY))
    header = payload.header()
    assert header["codec"] == "mask" and header["shape"] == [2, 8, 64] and header["dtype"] == "float32"
    assert header["meta"]["key"] == [7, 3, 1, 0, 0]
    assert header["tensors"] == {"values": ["bfloat16", [2, 8, 6]]}
