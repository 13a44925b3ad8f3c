"""Byte accounting by axis, quantisation helpers, and the no-networking rule of compression/."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from meshnode.compression import (
    AXES,
    HEADER_BYTES,
    ByteCounter,
    dequantize_absmax,
    fake_quantize,
    pack_int4,
    payload_bytes,
    quantize_absmax,
    quantized_nbytes,
    unpack_int4,
)


def test_byte_counter_arithmetic():
    c = ByteCounter()
    assert AXES == ("pp_fwd", "pp_bwd", "dp", "anchor", "ref")
    assert c.snapshot() == {"pp_fwd": 0, "pp_bwd": 0, "dp": 0, "anchor": 0, "ref": 0, "total": 0}
    c.add("pp_fwd", 100)
    c.add("pp_fwd", 50)
    c.add("pp_bwd", 30)
    c.add("dp", 20)
    assert c.snapshot() == {"pp_fwd": 150, "pp_bwd": 30, "dp": 20, "anchor": 0, "ref": 0, "total": 200}
    assert c.per_token(50) == {"pp_fwd": 3.0, "pp_bwd": 0.6, "dp": 0.4, "anchor": 0.0, "ref": 0.0, "total": 4.0}
    other = ByteCounter()
    other.add("anchor", 7)
    other.add("pp_fwd", 1)
    assert c.merge(other) is c
    assert c.snapshot() == {"pp_fwd": 151, "pp_bwd": 30, "dp": 20, "anchor": 7, "ref": 0, "total": 208}
    assert other.snapshot()["total"] == 8  # merge leaves the other counter alone
    restored = ByteCounter.from_snapshot(c.snapshot())
    assert restored.snapshot() == c.snapshot()
    c.reset()
    assert c.snapshot()["total"] == 0


def test_byte_counter_rejects_bad_input():
    c = ByteCounter()
    with pytest.raises(ValueError, match="axis"):
        c.add("pp", 1)
    with pytest.raises(ValueError):
        c.add("dp", -1)
    with pytest.raises(ValueError):
        c.per_token(0)


def test_payload_bytes():
    t = torch.zeros(3, 5, dtype=torch.bfloat16)
    assert payload_bytes(t) == 30 + HEADER_BYTES
    assert payload_bytes({"a": t, "b": torch.zeros(4, dtype=torch.int8)}) == 34 + HEADER_BYTES
    with pytest.raises(TypeError):
        payload_bytes([t])


def test_int4_pack_round_trip():
    q = torch.tensor([[-7, 7, 0, 3, -1], [1, 2, 3, 4, 5]], dtype=torch.int8)
    packed = pack_int4(q)
    assert packed.dtype == torch.uint8 and packed.shape == (2, 3)
    assert torch.equal(unpack_int4(packed, 5), q)


@pytest.mark.parametrize("bits", [8, 4])
def test_quantize_absmax_bound_and_size(bits):
    x = torch.randn(6, 33, generator=torch.Generator().manual_seed(0)) * torch.logspace(-4, 3, 6)[:, None]
    codes, scale = quantize_absmax(x, bits)
    assert scale.shape == (6,) and scale.dtype == torch.float32
    assert codes.numel() * codes.element_size() + scale.numel() * 4 == quantized_nbytes(6, 33, bits)
    y = dequantize_absmax(codes, scale, bits, 33)
    levels = 127 if bits == 8 else 7
    assert bool(((y - x).abs() <= x.abs().amax(-1, keepdim=True) / (2 * levels) * (1 + 1e-5)).all())
    assert torch.equal(y.abs().amax(-1), x.abs().amax(-1))  # absmax is exactly representable


def test_fake_quantize_per_column():
    p = torch.randn(40, 3) * torch.tensor([1e-3, 1.0, 1e3])
    q = fake_quantize(p, 8, dim=0)
    # per-column scales: each column's error is relative to its own absmax, not the largest column's
    rel = (q - p).abs().amax(0) / p.abs().amax(0)
    assert bool((rel <= 1 / 254 * (1 + 1e-5)).all())


def test_compression_imports_no_networking():
    # torch itself imports asyncio and socket, so those are not checked; the swarm stack must stay out
    code = (
        "import sys, meshnode.compression\n"
        "roots = ('hivemind', 'grpc', 'msgpack', 'multiaddr', 'uvloop', 'requests')\n"
        "layers = ('meshnode.node', 'meshnode.protocol', 'meshnode.mesh', 'meshnode.stage', 'meshnode.cli')\n"
        "bad = [m for m in sys.modules if m.split('.')[0] in roots or m.startswith(layers)]\n"
        "assert not bad, bad\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
