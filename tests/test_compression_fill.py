"""Mean fill of dropped channels: forward values and the exact gradient through the filled mean."""

from __future__ import annotations

import pytest
import torch

from meshnode.compression import BoundaryContext, MaskCodec, MaskKey, keep_mask, simulate_transfer
from meshnode.config import ConfigError, config_from_dict

KEY = MaskKey(run_seed=3, step=2, microbatch=1, boundary=0)


def test_mean_fill_forward():
    x = torch.randn(2, 5, 40) + torch.linspace(-3, 3, 40)  # channel means far from zero
    codec = MaskCodec(0.9, wire_dtype="float32", fill="mean")
    payload = codec.encode(x, BoundaryContext(key=KEY))
    y = codec.decode(payload, BoundaryContext(key=KEY))
    keep = keep_mask(KEY, 2, 5, 40, 0.9)
    mean = x.mean(dim=(0, 1))
    assert torch.equal(y[keep], x[keep])
    assert torch.allclose(y[~keep], mean.expand_as(x)[~keep])
    zero = MaskCodec(0.9, wire_dtype="float32")
    y0 = zero.decode(zero.encode(x, BoundaryContext(key=KEY)), BoundaryContext(key=KEY))
    assert (y - x).norm() < 0.6 * (y0 - x).norm()  # mean fill is much closer to the dense input
    assert payload.nbytes() == 2 * 5 * 4 * 4 + 40 * 4


def test_mean_fill_gradient_is_exact():
    x = (torch.randn(3, 4, 32) + 2.0).requires_grad_(True)
    w = torch.randn(3, 4, 32)
    codec = MaskCodec(0.75, wire_dtype="float32", fill="mean")
    y = simulate_transfer(codec, x, KEY)
    (y * w).sum().backward()
    # reference: the same function written with autograd end to end
    xr = x.detach().clone().requires_grad_(True)
    keep = keep_mask(KEY, 3, 4, 32, 0.75).float()
    m = xr.mean(dim=(0, 1))
    yr = m + keep * (xr - m)
    (yr * w).sum().backward()
    assert torch.allclose(y, yr, atol=1e-6)
    assert torch.allclose(x.grad, xr.grad, atol=1e-6)
    assert (x.grad[keep == 0] != 0).all()  # the mean carries gradient to dropped positions too


def test_fill_mismatch_and_config():
    x = torch.randn(1, 2, 16)
    sent = MaskCodec(0.5, wire_dtype="float32", fill="mean").encode(x, BoundaryContext(key=KEY))
    with pytest.raises(ValueError, match="fill"):
        MaskCodec(0.5, wire_dtype="float32").decode(sent, BoundaryContext(key=KEY))
    with pytest.raises(ValueError):
        MaskCodec(0.5, rescale="rms", fill="mean")
    with pytest.raises(ConfigError, match="mask.fill"):
        config_from_dict({}, ["mask.fill=mean", "mask.rescale=rms"])
