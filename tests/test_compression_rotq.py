"""Rotated low-bit quantisation: the rotation, bit packing, error against the Gaussian quantiser's, outliers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from meshnode.compression import (
    HEADER_BYTES,
    BoundaryContext,
    ByteCounter,
    EncodedPayload,
    PayloadError,
    QuantCodec,
    RotQuantCodec,
    fit_transform,
    make_codec,
    normalised_second_moment,
    rotation,
    rotq_decode,
    rotq_encode,
    simulate_transfer,
)
from meshnode.compression.codec import LOG8_ZERO, log8_decode, log8_scales
from meshnode.compression.rotquant import pack_codes, packed_width, unpack_codes
from meshnode.config import ConfigError, MaskConfig, load_config
from meshnode.protocol.limits import Limits
from meshnode.protocol.messages import WireError, payload_from_wire, payload_to_wire

# relative mean squared error of the MSE-optimal uniform quantiser on a unit Gaussian (Max 1960)
GAUSS_MSE = {1: 0.3634, 2: 0.1188, 4: 0.01154}


def _gauss(b=4, t=64, h=576, seed=0):
    return torch.randn(b, t, h, generator=torch.Generator().manual_seed(seed))


def _rel_mse(y, x):
    return float((y - x).pow(2).sum() / x.pow(2).sum())


@pytest.mark.parametrize("hidden", [576, 256, 96, 7, 1])
def test_rotation_is_orthogonal_and_mixes_every_channel(hidden):
    r = rotation(hidden)
    assert r.shape == (hidden, hidden)
    assert torch.allclose(r @ r.T, torch.eye(hidden), atol=1e-5)
    if hidden > 1:  # a one-hot input (a single huge channel) is spread over every coordinate
        assert bool((r[:, 0].abs() > 0).all())
        assert float(r.abs().max()) <= 1.5 / hidden**0.5
    assert torch.equal(rotation(hidden), r)  # deterministic
    assert not torch.equal(rotation(hidden, seed=1), r) or hidden == 1


@pytest.mark.parametrize("bits", [1, 2, 4])
@pytest.mark.parametrize("hidden", [576, 13])
def test_pack_round_trip(bits, hidden):
    q = torch.randint(0, 1 << bits, (3, 5, hidden), generator=torch.Generator().manual_seed(bits), dtype=torch.uint8)
    packed = pack_codes(q, bits)
    assert packed.dtype == torch.uint8 and packed.shape == (3, 5, packed_width(hidden, bits))
    assert packed.shape[-1] == -(-hidden * bits // 8)
    assert torch.equal(unpack_codes(packed, bits, hidden), q)


@pytest.mark.parametrize("bits", [1, 2, 4])
def test_error_matches_the_gaussian_quantiser(bits):
    x = _gauss()
    codes, rms = rotq_encode(x, bits)
    y = rotq_decode(codes, rms, bits, 576)
    assert GAUSS_MSE[bits] * 0.85 < _rel_mse(y, x) < GAUSS_MSE[bits] * 1.15


def test_outlier_channels_cost_rotq_little_and_absmax_a_lot():
    x = _gauss()
    x[..., 5] *= 80.0  # a "massive activation" channel
    x[..., 300] += 40.0
    rot = RotQuantCodec(4, center=False, wire_dtype="float32")
    absmax = QuantCodec(4)
    e_rot = _rel_mse(rot.decode(rot.encode(x)), x)
    e_abs = _rel_mse(absmax.decode(absmax.encode(x)), x)
    assert e_rot < 0.02 and e_abs > 5 * e_rot
    # error on the ordinary channels, which the outlier's scale swamps in absmax
    rest = torch.ones(576, dtype=torch.bool)
    rest[[5, 300]] = False
    e_rot_rest = _rel_mse(rot.decode(rot.encode(x))[..., rest], x[..., rest])
    e_abs_rest = _rel_mse(absmax.decode(absmax.encode(x))[..., rest], x[..., rest])
    assert e_abs_rest > 5 * e_rot_rest


def test_centring_removes_constant_channels_from_the_error():
    x = _gauss()
    x[..., :8] += 50.0  # nearly constant large channels
    plain = RotQuantCodec(2, center=False, wire_dtype="float32")
    centred = RotQuantCodec(2, center=True, wire_dtype="float32")
    e_plain = _rel_mse(plain.decode(plain.encode(x)), x)
    e_centred = _rel_mse(centred.decode(centred.encode(x)), x)
    assert e_centred < 0.5 * e_plain
    # centring is exact for a constant input: only the mean's wire rounding remains
    const = torch.full((2, 4, 576), 3.25)
    assert torch.equal(centred.decode(centred.encode(const)), const)


def test_exchange_bytes_gradient_and_dtype():
    codec = make_codec(MaskConfig(codec="rotq", bits=2))
    assert isinstance(codec, RotQuantCodec) and codec.bits == 2 and codec.center
    counter = ByteCounter()
    x = _gauss(b=2, t=32).requires_grad_()
    y = simulate_transfer(codec, x, counter=counter)
    assert y.dtype == x.dtype
    g = _gauss(b=2, t=32, seed=1)
    y.backward(g)
    assert GAUSS_MSE[2] * 0.85 < _rel_mse(x.grad, g) < GAUSS_MSE[2] * 1.15  # the gradient is quantised too
    snap = counter.snapshot()
    fwd, bwd = 2 * 32 * (144 + 4) + 576 * 2, 2 * 32 * (144 + 4)  # codes + rms per token, + channel means forward
    assert snap["pp_fwd"] == fwd + HEADER_BYTES and codec.forward_nbytes(2, 32, 576) == fwd
    assert snap["pp_bwd"] == bwd + HEADER_BYTES and codec.backward_nbytes(2, 32, 576) == bwd


def _replace(payload, **tensors):
    return EncodedPayload(**{**payload.__dict__, "tensors": {**payload.tensors, **tensors}})


def test_bad_payloads_are_refused():
    codec = RotQuantCodec(2)
    p = codec.encode(_gauss(b=1, t=4, h=64))
    with pytest.raises(PayloadError, match="bits"):
        RotQuantCodec(4).decode(p)
    with pytest.raises(PayloadError, match="non-finite"):
        codec.decode(_replace(p, rms=torch.full((1, 4), float("nan"))))
    with pytest.raises(PayloadError, match="negative"):
        codec.decode(_replace(p, rms=-p.tensors["rms"]))
    with pytest.raises(PayloadError, match="codes"):
        codec.decode(_replace(p, codes=p.tensors["codes"][..., :-1]))
    with pytest.raises(PayloadError, match="tensors"):
        no_mean = {"codes": p.tensors["codes"], "rms": p.tensors["rms"]}
        codec.decode(EncodedPayload(**{**p.__dict__, "tensors": no_mean}))
    with pytest.raises(PayloadError, match="activation"):
        codec.decode_grad(p)
    with pytest.raises(ValueError, match="bits"):
        RotQuantCodec(3)


def test_config_keys():
    tiny = Path(__file__).resolve().parents[1] / "configs" / "tiny.toml"
    cfg = load_config(tiny, ["mask.codec=rotq", "mask.bits=4", "mask.rotq_center=false"])
    codec = make_codec(cfg.mask)
    assert codec.bits == 4 and not codec.center
    with pytest.raises(ConfigError, match="mask.bits"):
        load_config(tiny, ["mask.codec=rotq", "mask.bits=3"])


def _gain_weighted_mse(y, x, gain):
    centred = x - x.mean(dim=(0, 1))
    return float(((y - x) * gain).pow(2).sum() / (centred * gain).pow(2).sum())


def test_channel_weights_move_the_error_to_channels_the_next_norm_ignores():
    # channels of very different spread, and a next-layer norm that reads some channels 20x less than the others;
    # as in SmolLM2's residual stream, the widest channels are among those the norm damps
    gen = torch.Generator().manual_seed(3)
    spread = torch.logspace(-1, 1, 576)[torch.randperm(576, generator=gen)]
    x = _gauss(b=2, t=64) * spread + 2.0
    gain = torch.where((spread > 3.0) | (torch.rand(576, generator=gen) < 0.2), 0.05, 1.0)
    errs = {}
    for mode in ("none", "norm", "norm_std"):
        codec = RotQuantCodec(2, weight=mode)
        ctx = BoundaryContext(gain=gain)
        payload = codec.encode(x, ctx)
        errs[mode] = _gain_weighted_mse(codec.decode(payload), x, gain)
        assert codec.forward_nbytes(2, 64, 576) == sum(t.numel() * t.element_size() for t in payload.tensors.values())
    assert errs["norm"] < 0.5 * errs["none"]
    assert errs["norm_std"] < 0.9 * errs["norm"]
    # without the gains the weights still follow the channels' spread (norm_std) or are flat (norm)
    flat = RotQuantCodec(2, weight="norm").encode(x)
    assert torch.allclose(flat.tensors["weight"].float(), torch.ones(576), atol=1e-2)


def test_weighted_payloads_are_checked():
    codec = RotQuantCodec(2, weight="norm_std")
    p = codec.encode(_gauss(b=1, t=4, h=64), BoundaryContext(gain=torch.rand(64) + 0.1))
    assert set(p.tensors) == {"codes", "rms", "mean", "weight"}
    assert codec.decode_grad(codec.encode_grad(_gauss(b=1, t=4, h=64))).shape == (1, 4, 64)  # gradients unweighted
    with pytest.raises(PayloadError, match="weight"):
        codec.decode(_replace(p, weight=torch.zeros(64, dtype=torch.bfloat16)))
    with pytest.raises(PayloadError, match="weight"):
        codec.decode(_replace(p, weight=torch.full((64,), 1e4, dtype=torch.bfloat16)))
    with pytest.raises(PayloadError, match="non-finite"):
        codec.decode(_replace(p, weight=torch.full((64,), float("inf"), dtype=torch.bfloat16)))
    with pytest.raises(PayloadError, match="tensors"):
        unweighted = {k: v for k, v in p.tensors.items() if k != "weight"}
        codec.decode(EncodedPayload(**{**p.__dict__, "tensors": unweighted}))
    with pytest.raises(PayloadError, match="weight"):
        RotQuantCodec(2).decode(p)  # a boundary that does not weight refuses a weighted payload
    with pytest.raises(ValueError, match="gain"):
        codec.encode(_gauss(b=1, t=4, h=64), BoundaryContext(gain=torch.ones(63)))
    with pytest.raises(ValueError, match="weight"):
        RotQuantCodec(2, weight="sqrt")


def test_gradient_weights_give_every_channel_the_same_relative_error():
    """mask.grad_weight = std: a gradient whose channels differ 100x in scale; unweighted, the rotation spreads
    the error evenly, so the small channels get a relative error of order 1; weighted by 1 / rms_c, every
    channel's relative error is close to the quantiser's own. The payload carries H weights more, counted."""
    gen = torch.Generator().manual_seed(4)
    scale = torch.logspace(-2, 0, 576)[torch.randperm(576, generator=gen)]
    g = _gauss(b=2, t=64) * scale

    def relative_error_by_channel(codec):
        payload = codec.encode_grad(g)
        assert codec.backward_nbytes(2, 64, 576) == sum(t.numel() * t.element_size()
                                                        for t in payload.tensors.values())
        err = (codec.decode_grad(payload) - g).pow(2).sum(dim=(0, 1)) / g.pow(2).sum(dim=(0, 1))
        return err, payload

    for bits in (1, 4):
        plain, p0 = relative_error_by_channel(RotQuantCodec(4, grad_bits=bits))
        weighted, p1 = relative_error_by_channel(RotQuantCodec(4, grad_bits=bits, grad_weight="std"))
        assert "weight" not in p0.tensors and "grad_weight" not in p0.meta  # unweighted: the payload as before
        assert set(p1.tensors) == {"codes", "rms", "weight"} and p1.meta["grad_weight"] == "std"
        assert float(weighted.max()) < 3 * GAUSS_MSE[bits] < float(plain.max()), bits
        assert float(weighted.max()) < 0.1 * float(plain.max()), bits
    codec = RotQuantCodec(4, grad_bits=1, grad_weight="std")
    with pytest.raises(PayloadError, match="weight"):
        codec.decode_grad(_replace(p1, weight=torch.zeros(576, dtype=torch.bfloat16)))
    with pytest.raises(PayloadError, match="grad_weight|weight"):
        RotQuantCodec(4, grad_bits=1).decode_grad(codec.encode_grad(g))  # a boundary that does not weight refuses
    with pytest.raises(ValueError, match="grad_weight"):
        RotQuantCodec(4, grad_weight="norm")
    cfg = load_config(Path(__file__).resolve().parents[1] / "configs" / "tiny.toml", [
        "mask.codec=rotq", "mask.grad_bits=1", "mask.grad_weight=std"])
    assert make_codec(cfg.mask).grad_weight == "std"
    with pytest.raises(ConfigError, match="grad_weight"):
        load_config(Path(__file__).resolve().parents[1] / "configs" / "tiny.toml", ["mask.grad_weight=gains"])


def test_stages_carry_the_next_layers_input_norm_gains():
    from meshnode.model import build_tiny, cut_model

    cfg = load_config(Path(__file__).resolve().parents[1] / "configs" / "tiny.toml", ["model.stages=3"])
    model = build_tiny(cfg.model)
    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            layer.input_layernorm.weight.fill_(0.5 + i)
    stages = cut_model(model, 3)
    for s in (0, 1):
        nxt = stages[s + 1].layer_range[0]
        assert torch.equal(stages[s].next_input_gain, torch.full_like(stages[s].next_input_gain, 0.5 + nxt))
        assert "next_input_gain" not in stages[s].state_dict()
    assert stages[2].next_input_gain is None
    cfg2 = load_config(Path(__file__).resolve().parents[1] / "configs" / "tiny.toml", ["mask.codec=rotq",
                                                                                         "mask.rotq_weight=norm_std"])
    assert make_codec(cfg2.mask).weight == "norm_std"
    with pytest.raises(ConfigError, match="rotq_weight"):
        load_config(Path(__file__).resolve().parents[1] / "configs" / "tiny.toml", ["mask.rotq_weight=gains"])


def test_the_gradient_may_go_back_at_other_bits():
    codec = make_codec(MaskConfig(codec="rotq", bits=2, grad_bits=4))
    assert (codec.bits, codec.grad_bits) == (2, 4) and "gradient 4 bit" in codec.describe()
    x, g = _gauss(b=2, t=32), _gauss(b=2, t=32, seed=1)
    assert GAUSS_MSE[2] * 0.7 < _rel_mse(codec.decode(codec.encode(x)), x) < GAUSS_MSE[2] * 1.15
    assert _rel_mse(codec.decode_grad(codec.encode_grad(g)), g) < GAUSS_MSE[4] * 1.15
    assert codec.backward_nbytes(2, 32, 576) == 2 * 32 * (288 + 4) and codec.forward_nbytes(2, 32, 576) == (
        2 * 32 * (144 + 4) + 576 * 2)
    with pytest.raises(PayloadError, match="grad_bits"):
        RotQuantCodec(2).decode_grad(codec.encode_grad(g))
    with pytest.raises(ValueError, match="bits"):
        RotQuantCodec(2, grad_bits=3)


def test_log8_token_scales_round_trip_within_their_step():
    """``log8_scales``: 1/16 octave below the payload's largest (at most 2.2 % off), zero kept zero, a scale below the
    range (1.7e-5 of the largest) coded as the range's end, never as zero or larger than the largest."""
    r = torch.logspace(-4, 1, 400).reshape(20, 20)
    r[0, 0], r[0, 1] = 0.0, 1e-12
    codes, top = log8_scales(r)
    assert codes.dtype == torch.uint8 and top.shape == (1,) and float(top) == float(r.max())
    d = log8_decode(codes, top)
    inside = r > float(top) * 2 ** (-254 / 16)
    rel = (d[inside] / r[inside]).log2().abs()
    assert float(rel.max()) <= 1 / 32 + 1e-6 and float(rel.max()) > 1 / 64  # the step is what it says, and used
    assert d[0, 0] == 0 and codes[0, 0] == LOG8_ZERO
    assert codes[0, 1] == LOG8_ZERO - 1 and float(d[0, 1]) == pytest.approx(float(top) * 2 ** (-254 / 16))
    assert float(d.max()) == float(top)
    zero = log8_scales(torch.zeros(3, 5))
    assert bool((zero[0] == LOG8_ZERO).all()) and float(log8_decode(*zero).abs().max()) == 0


@pytest.mark.parametrize("transform", [False, True])
def test_log8_token_scales_save_bytes_and_code_as_well(transform):
    """``mask.token_scale = log8``: one byte a token for its scale (and a float32 a payload) instead of 4 (rotq) or
    2 (a transform code), both ways; the receiver decodes what the sender coded, and the error is that of float
    scales within 1 % (the sender codes with the rounded scale, so the rounding costs no scale error)."""
    x = _gauss(b=2, t=64, h=96) * torch.rand(2, 64, 1, generator=torch.Generator().manual_seed(3)) * 5
    tf = fit_transform(normalised_second_moment(x.reshape(-1, 96) - x.reshape(-1, 96).mean(0)), 48) if transform \
        else None
    out = {}
    for scale in ("float", "log8"):
        codec = make_codec(MaskConfig(codec="rotq", bits=1, token_scale=scale))
        ctx = BoundaryContext(transform=tf)
        p, g = codec.encode(x, ctx), codec.encode_grad(x, ctx)
        y, gy = codec.decode(p, ctx), codec.decode_grad(g, ctx)
        if not transform:  # the byte count the cost models use is what travels
            assert p.nbytes() == codec.forward_nbytes(2, 64, 96) and g.nbytes() == codec.backward_nbytes(2, 64, 96)
        centred = x - x.mean(dim=(0, 1))
        out[scale] = (p.nbytes(), g.nbytes(), float((y - x).square().sum() / centred.square().sum()),
                      _rel_mse(gy, x))
        if scale == "log8":
            assert p.tensors["rms"].dtype == torch.uint8 and p.meta["token_scale"] == "log8"
            with pytest.raises(PayloadError, match="tensors|token_scale|quantised"):  # a float peer refuses it
                RotQuantCodec(1).decode(p, ctx)
    per_token = 2 if transform else 4
    for i in (0, 1):
        assert out["float"][i] - out["log8"][i] == 2 * 64 * (per_token - 1) - 4
    for i in (2, 3):
        assert out["log8"][i] < 1.01 * out["float"][i], out


def test_malformed_log8_scales_are_refused():
    codec = RotQuantCodec(2, token_scale="log8")
    p = codec.encode(_gauss(b=1, t=4, h=64))
    for bad, match in ((dict(rms_top=torch.tensor([float("nan")])), "non-finite"),
                       (dict(rms_top=torch.tensor([-1.0])), "negative"),
                       (dict(rms_top=torch.ones(2)), "rms_top"),
                       (dict(rms=p.tensors["rms"].float()), "rms")):
        with pytest.raises(PayloadError, match=match):
            codec.decode(_replace(p, **bad))
    with pytest.raises(ValueError, match="token_scale"):
        RotQuantCodec(2, token_scale="log4")
    tiny = Path(__file__).resolve().parents[1] / "configs" / "tiny.toml"
    limits = Limits.from_config(load_config(tiny, ["mask.codec=rotq", "mask.token_scale=log8"]), 64, 100)
    back = payload_from_wire(payload_to_wire(p), limits, "activation")  # crosses the wire whole
    assert set(back.tensors) == set(p.tensors) and all(torch.equal(back.tensors[k], t) for k, t in p.tensors.items())
    assert torch.equal(codec.decode(back), codec.decode(p))
    with pytest.raises(WireError, match="rms_top"):
        payload_from_wire(payload_to_wire(_replace(p, rms_top=torch.ones(2))), limits, "activation")
    with pytest.raises(ConfigError, match="token_scale"):
        load_config(tiny, ["mask.ratio=0.9", "mask.token_scale=log8"])
    with pytest.raises(ConfigError, match="token_scale"):
        load_config(tiny, ["mask.codec=rotq", "mask.token_scale=log16"])
