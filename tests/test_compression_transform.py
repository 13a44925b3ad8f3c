"""The fitted transform code (``mask.reference_code_bits``): a KLT with bits by variance, fewer than one bit per
coordinate where the coded vectors have preferred directions."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from meshnode.compression import (
    BoundaryContext,
    PayloadError,
    RotQuantCodec,
    fit_transform,
    normalised_second_moment,
    tc_decode,
    tc_encode,
    tc_grad,
)
from meshnode.compression.transform import TC_MSE, allocate_bits
from meshnode.config import ConfigError
from meshnode.mesh import MeshTrainer
from meshnode.protocol.limits import Limits
from meshnode.protocol.messages import payload_from_wire, payload_to_wire
from meshnode.stage import MapStore, MicrobatchId, ResidualMap
from meshnode.stage.reference import CHECK_TENSOR, CODE_TENSORS, MAP_META, MAP_TENSORS, MATRIX_TENSORS, STEP_TENSORS

H = 32


def _anisotropic(gen, n, h=H, decay=3.0):
    """n vectors whose variance falls over ``decay`` decades across a random basis, with per-token scales."""
    q, _ = torch.linalg.qr(torch.randn(h, h, generator=gen, dtype=torch.float64))
    spec = torch.logspace(0, -decay, h, dtype=torch.float64)
    x = (torch.randn(n, h, generator=gen, dtype=torch.float64) * spec.sqrt()) @ q.T
    return (x * (0.1 + 5 * torch.rand(n, 1, generator=gen, dtype=torch.float64))).float()


def _greedy(var, budget):  # the explicit loop the vectorised allocation must equal
    bits = [0] * len(var)
    for _ in range(budget):
        gains = [v * (TC_MSE[b] - TC_MSE[b + 1]) if b < 4 else -1.0 for v, b in zip(var.tolist(), bits)]
        i = max(range(len(gains)), key=gains.__getitem__)
        bits[i] += 1
    return bits


@pytest.mark.parametrize("budget", [0, 1, 7, 40, 61, 4 * 20])
def test_bit_allocation_is_the_greedy_water_filling(budget):
    var = torch.rand(20, generator=torch.Generator().manual_seed(budget)).square() * 10
    bits = allocate_bits(var, budget)
    assert int(bits.sum()) == budget and int(bits.max()) <= 4
    assert bits.tolist() == _greedy(var, budget)
    order = torch.argsort(var, descending=True)
    assert bool((bits[order][1:] <= bits[order][:-1]).all())  # more variance, never fewer bits
    with pytest.raises(ValueError, match="budget"):
        allocate_bits(var, 4 * 20 + 1)


def test_the_code_roundtrips_at_the_gaussian_error_and_beats_the_rotation_below_one_bit():
    gen = torch.Generator().manual_seed(0)
    both = _anisotropic(gen, 5000)  # one basis: the fit on 4000 tokens, the test on 1000 others
    fit, test = both[:4000], both[4000:].reshape(10, 100, H)
    tf = fit_transform(normalised_second_moment(fit.reshape(-1, H)), H // 2)  # half a bit per coordinate
    assert tf.code_bits == H // 2 and tf.basis.shape[1] == int((tf.bits > 0).sum()) < H
    codes, rms = tc_encode(test, tf)
    assert codes.shape == (10, 100, tf.code_bytes) and codes.dtype == torch.uint8 and rms.shape == (10, 100)
    err = float((tc_decode(codes, rms, tf) - test).square().sum() / test.square().sum())
    rot = RotQuantCodec(1, center=False)
    rot_err = float((rot.decode(rot.encode(test)) - test).square().sum() / test.square().sum())
    print(f"relative squared error: transform at 0.5 bit {err:.4f}, rotq at 1 bit {rot_err:.4f}")
    assert err < 0.75 * rot_err  # with half the bits
    # at 4 bits in every direction the error is the Gaussian quantiser's (0.0115), whatever the spectrum
    full = fit_transform(normalised_second_moment(fit.reshape(-1, H)), 4 * H)
    err4 = float((tc_decode(*tc_encode(test, full), full) - test).square().sum() / test.square().sum())
    assert 0.005 < err4 < 0.02
    # a token's scale travels in its rms: scaling it scales its decoding
    c2, r2 = tc_encode(3.0 * test, tf)
    assert torch.equal(c2, codes)
    torch.testing.assert_close(tc_decode(c2, r2, tf), 3.0 * tc_decode(codes, rms, tf), rtol=1e-5, atol=1e-6)


def test_a_malformed_transform_is_refused():
    tf = fit_transform(normalised_second_moment(_anisotropic(torch.Generator().manual_seed(1), 500)), 24)
    tf.check(H)
    bad = {
        "hidden": (tf, H + 1),
        "bits 0": (dataclasses.replace(tf, bits=torch.zeros_like(tf.bits)), H),
        "bits 5": (dataclasses.replace(tf, bits=torch.full_like(tf.bits, 5)), H),
        "scale": (dataclasses.replace(tf, scale=-tf.scale), H),
        "nan": (dataclasses.replace(tf, basis=torch.full_like(tf.basis, float("nan"))), H),
        "dtype": (dataclasses.replace(tf, basis=tf.basis.half()), H),
        "length": (dataclasses.replace(tf, scale=tf.scale[:-1]), H),
        "huge scale": (dataclasses.replace(tf, scale=tf.scale * 1e6), H),
        "not unit": (dataclasses.replace(tf, basis=(tf.basis.float() * 1e6).to(tf.basis.dtype)), H),
    }
    for what, (t, h) in bad.items():
        with pytest.raises(ValueError):
            t.check(h)
            pytest.fail(what)


def test_the_codec_needs_the_transform_its_payload_was_coded_in():
    gen = torch.Generator().manual_seed(2)
    x = _anisotropic(gen, 256).reshape(4, 64, H)
    tf = fit_transform(normalised_second_moment(x.reshape(-1, H)), 40)
    codec = RotQuantCodec(1)
    p = codec.encode(x, BoundaryContext(transform=tf))
    assert p.meta["code_bits"] == 40 and p.tensors["codes"].shape == (4, 64, 5)
    y = codec.decode(p, BoundaryContext(transform=tf))
    assert float((y - x).square().sum() / (x - x.mean((0, 1))).square().sum()) < 0.5
    with pytest.raises(PayloadError, match="has none"):
        codec.decode(p)
    other = fit_transform(normalised_second_moment(x.reshape(-1, H)), 48)
    with pytest.raises(PayloadError, match="40-bit"):
        codec.decode(p, BoundaryContext(transform=other))
    for bad in (float("inf"), float("nan"), -1.0):
        rms = p.tensors["rms"].clone()
        rms[0, 0] = bad
        with pytest.raises(PayloadError, match="rms"):
            codec.decode(dataclasses.replace(p, tensors={**p.tensors, "rms": rms}), BoundaryContext(transform=tf))
    short = dataclasses.replace(p, tensors={**p.tensors, "codes": p.tensors["codes"][..., :4]})
    with pytest.raises(PayloadError):
        codec.decode(short, BoundaryContext(transform=tf))
    with pytest.raises(PayloadError):  # quantised with other settings
        RotQuantCodec(2).decode(p, BoundaryContext(transform=tf))


def test_the_sender_fits_the_code_of_what_its_new_map_leaves():
    """The transform is fitted from weighted statistics; the second moment it diagonalises equals the one computed
    directly from the residuals minus the new map's prediction (each token weighted by 1 / its residual's mean
    square), so its top direction is that matrix's."""
    gen = torch.Generator().manual_seed(4)
    m = ResidualMap(H, 4, code_bits=48)
    xs, rs = [], []
    mix, noise = torch.randn(H, H, generator=gen) / H ** 0.5, _anisotropic(gen, 6 * 64).reshape(6, 64, H)
    for i in range(6):
        x = torch.randn(4, 16, H, generator=gen)
        r = 0.3 * x @ mix + noise[i].reshape(4, 16, H)
        m.observe(x, r)
        xs.append(x)
        rs.append(r)
    assert m.refit() and m.version == 1
    tf = m.transform
    assert tf is not None and tf.code_bits == 48
    a = m.u.double() @ m.v.double().T
    direct = torch.zeros(H, H, dtype=torch.float64)
    for x, r in zip(xs, rs):
        xc = (x - x.mean((0, 1))).reshape(-1, H).double()
        rc = (r - r.mean((0, 1))).reshape(-1, H).double()
        w = 1.0 / rc.square().mean(-1, keepdim=True)
        e = rc - xc @ a
        direct += (e * w).T @ e
    top = torch.linalg.eigh(direct).eigenvectors[:, -1]
    assert abs(float(top @ tf.basis[:, 0].double())) > 0.99
    # rank 0: a code and no map
    only = ResidualMap(H, 0, code_bits=16)
    for x, r in zip(xs, rs):
        only.observe(x, r)
    assert only.refit() and only.u is None and only.transform.code_bits == 16
    with pytest.raises(ValueError, match="rank"):
        ResidualMap(H, 0)
    with pytest.raises(ValueError, match="reference_code_bits"):
        ResidualMap(H, 4, code_bits=4 * H + 1)


def test_a_receiver_stores_the_code_with_the_map_and_refuses_a_bad_one():
    gen = torch.Generator().manual_seed(5)
    m = ResidualMap(H, 4, code_bits=24)
    noise = _anisotropic(gen, 4 * 64).reshape(4, 4, 16, H)
    for i in range(4):
        m.observe(torch.randn(4, 16, H, generator=gen), noise[i])
    assert m.refit()
    codec = RotQuantCodec(1)
    x = torch.randn(2, 8, H, generator=gen)
    sent = m.attach(codec.encode(x, BoundaryContext(transform=m.transform)))
    assert set(MAP_TENSORS + CODE_TENSORS) <= set(sent.tensors)
    assert sent.nbytes() - codec.encode(x, BoundaryContext(transform=m.transform)).nbytes() == m.current.nbytes()
    store = MapStore(H, 4, code_bits=24)
    plain, key = store.take(sent)
    assert key == (m.sender, 1) and not set(MAP_TENSORS + CODE_TENSORS) & set(plain.tensors)
    fit = store.get(key)
    assert torch.equal(fit.transform.basis, m.transform.basis) and torch.equal(fit.transform.bits, m.transform.bits)
    torch.testing.assert_close(codec.decode(plain, BoundaryContext(transform=fit.transform)),
                               codec.decode(plain, BoundaryContext(transform=m.transform)), rtol=0, atol=0)
    for name, t in [(CODE_TENSORS[2], torch.full_like(sent.tensors[CODE_TENSORS[2]], 9)),
                    (CODE_TENSORS[1], -sent.tensors[CODE_TENSORS[1]])]:
        with pytest.raises(PayloadError, match="transform"):
            MapStore(H, 4, code_bits=24).take(dataclasses.replace(sent, tensors={**sent.tensors, name: t}))
    missing = {k: v for k, v in sent.tensors.items() if k != CODE_TENSORS[0]}
    with pytest.raises(PayloadError, match="must carry"):
        MapStore(H, 4, code_bits=24).take(dataclasses.replace(sent, tensors=missing))
    with pytest.raises(PayloadError, match="bits per token"):
        MapStore(H, 4, code_bits=32).take(sent)


def _fitted_map(gen, fit_bits, seen=None):
    m = ResidualMap(H, 4, code_bits=24, sender=7, fit_bits=fit_bits)
    mix = torch.randn(H, H, generator=gen) / H ** 0.5
    noise = _anisotropic(gen, 6 * 64).reshape(6, 4, 16, H)
    for i in range(6):
        x = torch.randn(4, 16, H, generator=gen)
        m.observe(x, 0.3 * x @ mix + noise[i])
        if seen is not None:
            seen.append((x, 0.3 * x @ mix + noise[i]))
    assert m.refit()
    return m


@pytest.mark.parametrize("bits", [8, 4])
def test_a_quantized_fit_is_fewer_bytes_codes_nearly_as_well_and_both_ends_decode_the_same(tiny_cfg, bits):
    """``mask.reference_fit_bits = 8`` (4): U, V and the basis travel as int8 (4-bit codes packed two rows to a
    byte) with a float32 step per column. The fit is about half (a quarter of) the bytes of the bfloat16 one from
    the same statistics, the receiver decodes exactly the values the sender uses, and the code is about as good
    (its error within 2 % (8 bits) or 15 % (4 bits) of the bfloat16 fit's)."""
    seen = []
    m16 = _fitted_map(torch.Generator().manual_seed(6), 16, seen)
    mq = _fitted_map(torch.Generator().manual_seed(6), bits)
    f16, fq = m16.current, mq.current
    assert fq.transform.code_bits == f16.transform.code_bits == 24
    m = fq.transform.basis.shape[1]
    # U, V (H x 4 each) and basis (H x m) in a byte (half a byte) per value, a float32 step per column, the scales
    # and bits as before
    rows = H if bits == 8 else H // 2
    assert fq.nbytes() == (2 * 4 + m) * (rows + 4) + 5 * m
    assert fq.nbytes() < (0.6 if bits == 8 else 0.35) * f16.nbytes()
    matrices = {n: t for n, t in fq.tensors().items() if n in MAP_TENSORS + CODE_TENSORS[:1]}
    assert {t.dtype for t in matrices.values()} == {torch.int8 if bits == 8 else torch.uint8}
    assert {t.shape[0] for t in matrices.values()} == {rows}
    tol = (0.01 if bits == 8 else 0.1) * float(f16.u.float().abs().max())
    torch.testing.assert_close(fq.u, f16.u.float(), rtol=0, atol=tol)
    codec = RotQuantCodec(1)
    x = torch.randn(2, 8, H, generator=torch.Generator().manual_seed(7))
    sent = mq.attach(codec.encode(x, BoundaryContext(transform=mq.transform)))
    # all of it crosses the wire (11 tensors: the codec's 3, the fit's 5 and the three matrices' steps)
    cfg = tiny_cfg("mask.codec=rotq", "mask.bits=1", "mask.reference=both", "mask.reference_map_rank=4",
                   "mask.reference_code_bits=24", f"mask.reference_fit_bits={bits}")
    back = payload_from_wire(payload_to_wire(sent), Limits.from_config(cfg, H, 100), "activation")
    assert len(back.tensors) == 11 and all(torch.equal(back.tensors[k], t) for k, t in sent.tensors.items())
    store = MapStore(H, 4, code_bits=24, fit_bits=bits)
    plain, key = store.take(back)
    assert not set(plain.tensors) & set(fq.tensors())
    got = store.get(key)
    for a, b in ((got.u, fq.u), (got.v, fq.v), (got.transform.basis, fq.transform.basis)):
        assert a.dtype == torch.float32 and torch.equal(a, b)
    assert torch.equal(codec.decode(plain, BoundaryContext(transform=got.transform)),
                       codec.decode(plain, BoundaryContext(transform=fq.transform)))
    with pytest.raises(PayloadError, match="must be"):  # a store of the other width refuses it
        MapStore(H, 4, code_bits=24, fit_bits=12 - bits).take(back)

    def err(fit):  # of the code of what each fit's map leaves of the residuals it was fitted on
        num = den = 0.0
        for x, r in seen:
            e = (r - r.mean((0, 1))) - fit.predict(x)
            codes, rms = tc_encode(e, fit.transform)
            num += float((tc_decode(codes, rms, fit.transform) - e).square().sum())
            den += float(e.square().sum())
        return num / den

    e16, eq = err(f16), err(fq)
    print(f"relative squared error of a 24-bit code: bfloat16 fit {e16:.4f}, {bits}-bit fit {eq:.4f}")
    assert e16 < 0.5 and eq < (1.02 if bits == 8 else 1.15) * e16


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("bad", ["negative step", "nan step", "step shape", "no step", "bf16 matrix",
                                 "to a bf16 store", "unpacked rows"])
def test_a_malformed_quantized_fit_is_refused(bad, bits):
    m8 = _fitted_map(torch.Generator().manual_seed(6), bits)
    sent = m8.attach(RotQuantCodec(1).encode(torch.randn(2, 8, H), BoundaryContext(transform=m8.transform)))
    t = dict(sent.tensors)
    step = STEP_TENSORS[0]
    if bad == "negative step":
        t[step] = -t[step]
    elif bad == "nan step":
        t[step] = t[step].clone()
        t[step][0] = float("nan")
    elif bad == "step shape":
        t[step] = t[step][:-1]
    elif bad == "no step":
        del t[STEP_TENSORS[2]]
    elif bad == "bf16 matrix":
        t[CODE_TENSORS[0]] = t[CODE_TENSORS[0]].to(torch.bfloat16)
    elif bad == "unpacked rows":  # H rows of the store's dtype where a 4-bit fit has H / 2 (and the reverse)
        rows = H if bits == 4 else H // 2
        t[MAP_TENSORS[0]] = torch.zeros(rows, 4, dtype=t[MAP_TENSORS[0]].dtype)
    store = MapStore(H, 4, code_bits=24, fit_bits=16 if bad == "to a bf16 store" else bits)
    with pytest.raises(PayloadError):
        store.take(dataclasses.replace(sent, tensors=t))
    assert not store.maps
    with pytest.raises(ValueError, match="reference_fit_bits"):
        MapStore(H, 4, code_bits=24, fit_bits=2)


def test_a_fisher_weighted_code_spends_its_bits_where_the_loss_reads():
    """``metric``: the code minimises the error weighted by M. With M = I it is the plain code; with an anisotropic
    M its M-weighted error is well below the plain code's at the same bits (and its plain error above), and the
    receiver, which gets only the unit basis and the scales, decodes what the sender's encoder coded."""
    gen = torch.Generator().manual_seed(9)
    x = _anisotropic(gen, 4096, decay=2.0)
    s = normalised_second_moment(x)
    plain = fit_transform(s, 40)
    same = fit_transform(s, 40, metric=torch.eye(H))
    assert torch.equal(same.bits, plain.bits)
    torch.testing.assert_close(same.scale, plain.scale, rtol=1e-4, atol=0)
    torch.testing.assert_close(same.basis.float().abs(), plain.basis.float().abs(), rtol=0, atol=1e-2)
    # the loss reads a few directions unrelated to x's own: M = sum g g^T of gradients living there
    q, _ = torch.linalg.qr(torch.randn(H, H, generator=gen, dtype=torch.float64))
    g = torch.randn(2048, 4, generator=gen, dtype=torch.float64) @ q[:, :4].T * 10 + 0.1 * torch.randn(
        2048, H, generator=gen, dtype=torch.float64)
    metric = g.T @ g
    fisher = fit_transform(s, 40, metric=metric)
    assert fisher.encoder is not None and fisher.code_bits == 40
    fisher.check(H, weighted=True)

    def errors(tf):
        codes, rms = tc_encode(x, tf)
        e = (tc_decode(codes, rms, tf) - x).double()
        return float(((e @ metric) * e).sum() / ((x.double() @ metric) * x.double()).sum()), float(
            e.square().sum() / x.square().sum())

    (wp, ep), (wf, ef) = errors(plain), errors(fisher)
    print(f"Fisher-weighted error: plain code {wp:.3f}, fisher code {wf:.3f}; plain error {ep:.3f} vs {ef:.3f}")
    assert wf < 0.7 * wp and ef > ep
    # the receiver's copy: no encoder, the same decode
    wire = dataclasses.replace(fisher, encoder=None)
    codes, rms = tc_encode(x[:64], fisher)
    assert torch.equal(tc_decode(codes, rms, wire), tc_decode(codes, rms, fisher))


@pytest.mark.parametrize("metric", ["plain", "fisher"])
def test_the_encoder_is_fitted_to_the_basis_as_rounded(metric):
    """``round_basis``: the sender's encoder is fitted to the directions the receiver decodes along. Without rounding
    it is the exact fit's encoder and scales; with a coarse rounding (4 bits a value) its (weighted) error is
    measurably below that of the exact fit's encoder used against the rounded basis, and the receiver, which gets
    the rounded basis and the scales, decodes what the sender coded."""
    gen = torch.Generator().manual_seed(11)
    x = _anisotropic(gen, 4096, decay=2.0)
    s = normalised_second_moment(x)
    q, _ = torch.linalg.qr(torch.randn(H, H, generator=gen, dtype=torch.float64))
    g = torch.randn(2048, 4, generator=gen, dtype=torch.float64) @ q[:, :4].T * 10 + 0.1 * torch.randn(
        2048, H, generator=gen, dtype=torch.float64)
    m = g.T @ g if metric == "fisher" else None
    weight = torch.eye(H, dtype=torch.float64) if m is None else m
    exact = fit_transform(s, 40, torch.float32, metric=m)
    same = fit_transform(s, 40, metric=m, round_basis=lambda b: b)
    torch.testing.assert_close(same.basis, exact.basis)
    torch.testing.assert_close(same.encoder, exact.coder.float(), rtol=0, atol=1e-4)
    torch.testing.assert_close(same.scale, exact.scale, rtol=1e-4, atol=0)

    def four_bits(b):  # absmax per column in 4 bits, then back to unit columns (what a 4-bit fit sends)
        step = b.abs().amax(0) / 7
        r = (b / step).round().clamp(-8, 7) * step
        return r / r.norm(dim=0)

    fitted = fit_transform(s, 40, metric=m, round_basis=four_bits)
    stale = dataclasses.replace(exact, basis=four_bits(exact.basis))  # the exact encoder, the rounded basis
    assert torch.equal(fitted.basis, stale.basis) and torch.equal(fitted.bits, stale.bits)

    def error(tf):
        codes, rms = tc_encode(x, tf)
        e = (tc_decode(codes, rms, tf) - x).double()
        return float(((e @ weight) * e).sum() / ((x.double() @ weight) * x.double()).sum())

    ef, es = error(fitted), error(stale)
    print(f"{metric}: error with the encoder fitted to the 4-bit basis {ef:.4f}, with the exact fit's {es:.4f}")
    assert ef < (0.97 if m is None else 0.8) * es  # measured 0.950 and 0.63 of it
    codes, rms = tc_encode(x[:64], fitted)
    assert torch.equal(tc_decode(codes, rms, dataclasses.replace(fitted, encoder=None)), tc_decode(codes, rms, fitted))


def _too_wide(hidden):
    """A fit_transform whose codes' scales pass a receiver's bound (1.5 sqrt(H))."""
    def fit(*args, **kwargs):
        tf = fit_transform(*args, **kwargs)
        return dataclasses.replace(tf, scale=tf.scale * 0 + 1.5 * hidden ** 0.5)
    return fit


def test_a_sender_keeps_its_fit_rather_than_ship_a_code_a_receiver_refuses(monkeypatch):
    """The scales of a code whose encoder is fitted to a rounded basis are its coefficients' spreads, which can pass
    the receiver's bound; the sender checks its code as a receiver would and keeps the fit it has instead."""
    import meshnode.stage.reference as reference

    gen = torch.Generator().manual_seed(12)
    m = ResidualMap(H, 4, code_bits=24, sender=3, fit_bits=8)
    mix = torch.randn(H, H, generator=gen) / H ** 0.5

    def observe():
        for _ in range(4):
            x = torch.randn(4, 16, H, generator=gen)
            m.observe(x, 0.3 * x @ mix + _anisotropic(gen, 64).reshape(4, 16, H))

    observe()
    assert m.refit() and m.version == 1
    good = m.current

    monkeypatch.setattr(reference, "fit_transform", _too_wide(H))
    observe()
    assert not m.refit() and m.version == 1 and m.current is good
    assert m.refit_error.startswith("transform code: transform scales must be in")
    assert not m.refit() and m.refit_error.startswith("0 tokens since the last fit")


def test_a_worker_says_why_it_kept_its_fit(tiny_cfg, cache_dir, monkeypatch, caplog):
    import meshnode.stage.reference as reference

    monkeypatch.setattr(reference, "fit_transform", _too_wide(64))
    trainer = MeshTrainer(tiny_cfg(*CODED, "mask.reference_code_bits=32"), cache_dir)
    with caplog.at_level("WARNING", logger="meshnode.stage.worker"):
        for _ in range(2):  # the first fit comes after the second step
            trainer.train_step()
    kept = [r.getMessage() for r in caplog.records if "not refitted" in r.getMessage()]
    assert kept and all("transform scales must be in" in k and "keeping version 0" in k for k in kept)
    assert trainer.workers[0][0].map_out.version == 0


@pytest.mark.parametrize("metric", ["plain", "fisher"])
def test_directions_rounded_alike_are_coded_by_their_common_part(metric):
    """4-bit absmax rounding can make two columns the same (each dominated by one huge channel rounds to its unit
    vector). The encoder fitted to such a basis is finite (the Gram matrix is singular), codes the two by their
    common part (equal encoders), passes the receiver's check, and codes no worse than the exact fit's encoder on
    the same rounded basis."""
    gen = torch.Generator().manual_seed(13)
    x = _anisotropic(gen, 4096, decay=2.0)
    s = normalised_second_moment(x)
    g = torch.randn(2048, H, generator=gen, dtype=torch.float64) * torch.linspace(0.1, 3, H, dtype=torch.float64)
    m = g.T @ g if metric == "fisher" else None

    def alike(b):
        b = b.clone()
        b[:, 1] = b[:, 0]
        return b

    tf = fit_transform(s, 40, metric=m, round_basis=alike)
    assert bool(torch.isfinite(tf.encoder).all()) and bool(torch.isfinite(tf.scale).all())
    torch.testing.assert_close(tf.encoder[:, 0], tf.encoder[:, 1], rtol=1e-4, atol=1e-6)
    tf.check(H, weighted=m is not None)
    exact = fit_transform(s, 40, torch.float32, metric=m)
    stale = dataclasses.replace(exact, basis=alike(exact.basis))
    weight = torch.eye(H, dtype=torch.float64) if m is None else m

    def error(code):
        codes, rms = tc_encode(x, code)
        e = (tc_decode(codes, rms, code) - x).double()
        return float(((e @ weight) * e).sum() / ((x.double() @ weight) * x.double()).sum())

    assert error(tf) <= error(stale)


def test_the_bases_can_travel_in_fewer_bits_than_the_map(tmp_path):
    """``mask.reference_basis_bits``: U and V in 8 bits, the code's basis in 4. Bytes as the two settings add up, the
    fit crosses the wire and decodes the same at the receiver, a store of either setting alone refuses it, and a
    sender's state refuses a sender of other settings (one of the map's bits alone still loads an older state,
    which has no ``basis_bits``)."""
    gen = torch.Generator().manual_seed(6)
    m = ResidualMap(H, 4, code_bits=24, sender=7, fit_bits=8, basis_bits=4)
    mix = torch.randn(H, H, generator=gen) / H ** 0.5
    for _ in range(6):
        x = torch.randn(4, 16, H, generator=gen)
        m.observe(x, 0.3 * x @ mix + _anisotropic(gen, 64).reshape(4, 16, H))
    assert m.refit()
    fit = m.current
    k = fit.transform.basis.shape[1]
    dtypes = {n: (t.dtype, t.shape[0]) for n, t in fit.tensors().items() if n in MATRIX_TENSORS}
    assert dtypes == {MAP_TENSORS[0]: (torch.int8, H), MAP_TENSORS[1]: (torch.int8, H),
                      CODE_TENSORS[0]: (torch.uint8, H // 2)}
    assert fit.nbytes() == 2 * 4 * (H + 4) + k * (H // 2 + 4) + 5 * k
    sent = m.attach(RotQuantCodec(1).encode(torch.randn(2, 8, H), BoundaryContext(transform=fit.transform)))
    store = MapStore(H, 4, code_bits=24, fit_bits=8, basis_bits=4)
    _, key = store.take(sent)
    got = store.get(key)
    for a, b in ((got.u, fit.u), (got.v, fit.v), (got.transform.basis, fit.transform.basis)):
        assert torch.equal(a, b)
    for bits in ((8, None), (4, None), (4, 8)):
        with pytest.raises(PayloadError, match="must be"):
            MapStore(H, 4, code_bits=24, fit_bits=bits[0], basis_bits=bits[1]).take(sent)
    with pytest.raises(ValueError, match="reference_basis_bits"):
        MapStore(H, 4, code_bits=24, fit_bits=8, basis_bits=2)
    state = m.state_dict()
    with pytest.raises(ValueError, match="does not fit"):
        ResidualMap(H, 4, code_bits=24, fit_bits=8).load_state_dict(state)
    twin = ResidualMap(H, 4, code_bits=24, fit_bits=8, basis_bits=4)
    twin.load_state_dict(state)
    assert torch.equal(twin.current.transform.basis, fit.transform.basis)
    older = ResidualMap(H, 4, code_bits=24, fit_bits=8, basis_bits=8).state_dict()
    assert "basis_bits" not in older["settings"]
    ResidualMap(H, 4, code_bits=24, fit_bits=8).load_state_dict(older)


def test_the_sender_weights_its_code_by_the_gradients_it_received():
    gen = torch.Generator().manual_seed(10)
    m = ResidualMap(H, 4, code_bits=24, fisher=True)
    noise = _anisotropic(gen, 4 * 64).reshape(4, 4, 16, H)
    for i in range(4):
        m.observe(torch.randn(4, 16, H, generator=gen), noise[i])
    # no gradient yet: the plain code, whose encoder (fitted to the basis as rounded to bfloat16) is that basis to
    # within the rounding
    assert m.refit() and (m.transform.encoder - m.transform.basis.float()).abs().max() < 0.01
    for i in range(4):
        m.observe(torch.randn(4, 16, H, generator=gen), noise[i])
        m.observe_grad(torch.randn(4, 16, H, generator=gen) * torch.linspace(0.01, 3, H))
    m.observe_grad(torch.full((1, 2, H), float("nan")))  # skipped
    assert m.grad_tokens == 4 * 64
    assert m.refit() and m.grad_tokens == 0 and (m.transform.encoder - m.transform.basis.float()).abs().max() > 0.1
    sent = m.attach(RotQuantCodec(1).encode(torch.randn(2, 8, H), BoundaryContext(transform=m.transform)))
    store = MapStore(H, 4, code_bits=24, fisher=True)
    _, key = store.take(sent)
    assert store.get(key).transform.encoder is None and torch.equal(store.get(key).transform.basis,
                                                                      m.transform.basis)
    plain = ResidualMap(H, 4, code_bits=24)
    plain.observe_grad(torch.randn(1, 2, H))  # a plain code keeps no metric
    assert plain.ggt is None


CODED = ("train.eval_every=0", "model.stages=3", "train.lr=3e-4", "train.warmup_steps=0", "mask.codec=rotq",
         "mask.bits=1", "mask.reference=both", "mask.reference_map_rank=8", "mask.reference_map_period=2")


@pytest.mark.parametrize("fit_bits, basis_bits, metric", [(16, 0, "plain"), (8, 0, "plain"), (16, 0, "fisher"),
                                                          (4, 0, "fisher"), (8, 4, "fisher"), (16, 8, "plain")])
def test_in_the_mesh_the_code_halves_the_forward_bytes_and_both_ends_agree(tiny_cfg, cache_dir, fit_bits, basis_bits,
                                                                           metric):
    """Tiny model (H = 64), 1-bit rotq against the reference with a rank-8 map: with a 32-bit transform code (half
    a bit per coordinate) the forward payloads after the first fit are about half as large, the gradients' are
    unchanged, and the receiver decodes the input the sender expects (with the fits in bfloat16, 8 or 4 bits, the
    codes' bases as the map or apart (``mask.reference_basis_bits``), the code plain or Fisher-weighted)."""
    bits = (f"mask.reference_fit_bits={fit_bits}", f"mask.reference_basis_bits={basis_bits}")
    rotq = MeshTrainer(tiny_cfg(*CODED, bits[0]), cache_dir)
    coded = MeshTrainer(tiny_cfg(*CODED, "mask.reference_code_bits=32", *bits, f"mask.reference_code_metric={metric}"),
                        cache_dir)
    for _ in range(6):
        rotq.train_step()
        coded.train_step()
    a, b = rotq.counter.snapshot(), coded.counter.snapshot()
    assert b["pp_bwd"] == a["pp_bwd"]
    w0, w1 = coded.workers[0][0], coded.workers[0][1]
    assert w0.map_out.transform is not None and w0.map_out.transform.code_bits == 32
    tf = w0.map_out.transform
    # the encoder is fitted to the basis as rounded: a plain code's is that basis to within the rounding
    assert (float((tf.encoder - tf.basis.float()).abs().max()) > 0.05) == (metric == "fisher")
    mats = {n: t.dtype for n, t in w0.map_out.current.tensors().items() if n in MAP_TENSORS + CODE_TENSORS[:1]}
    dtype = {16: torch.bfloat16, 8: torch.int8, 4: torch.uint8}
    assert mats == {MAP_TENSORS[0]: dtype[fit_bits], MAP_TENSORS[1]: dtype[fit_bits],
                    CODE_TENSORS[0]: dtype[basis_bits or fit_bits]}
    ids = coded.sources[0].batch(100)
    mb = MicrobatchId(100, 0)
    payload = w0.forward(mb, ids, labels=ids)
    assert payload.meta["code_bits"] == 32 and payload.meta[MAP_META][1] == w0.map_out.version
    plain = rotq.workers[0][0].codec.encode(w0.in_flight[mb].outputs.detach())
    assert 2 * payload.tensors["codes"].shape[-1] == plain.tensors["codes"].shape[-1] == 8
    assert payload.tensors["rms"].dtype == torch.bfloat16  # the token's scale in 2 bytes, not 4
    w1.forward(mb, payload, labels=ids)
    torch.testing.assert_close(w1.in_flight[mb].inputs.detach().float(), w0.in_flight[mb].sent.float(),
                               rtol=1e-5, atol=1e-5)
    for w in (w0, w1):
        w.discard(mb)
    assert all(torch.isfinite(torch.tensor(coded.losses)))


def test_config_refuses_a_code_without_rotq_and_a_reference(tiny_cfg):
    with pytest.raises(ConfigError, match="reference_code_bits"):
        tiny_cfg("mask.codec=rotq", "mask.reference_code_bits=32")
    with pytest.raises(ConfigError, match="reference_code_bits"):
        tiny_cfg("mask.ratio=0.9", "mask.reference=both", "mask.reference_code_bits=32")
    with pytest.raises(ConfigError, match="reference_code_bits"):
        tiny_cfg("mask.codec=rotq", "mask.reference=both", "mask.reference_code_bits=-1")
    with pytest.raises(ConfigError, match="reference_fit_bits"):
        tiny_cfg("mask.codec=rotq", "mask.reference=both", "mask.reference_code_bits=32", "mask.reference_fit_bits=2")
    with pytest.raises(ConfigError, match="reference_fit_bits"):
        tiny_cfg("mask.codec=rotq", "mask.reference=both", "mask.reference_fit_bits=8")
    with pytest.raises(ConfigError, match="reference_code_metric"):
        tiny_cfg("mask.codec=rotq", "mask.reference=both", "mask.reference_map_rank=8",
                 "mask.reference_code_metric=fisher")


def test_in_the_mesh_the_gradient_code_halves_the_backward_bytes(tiny_cfg, cache_dir):
    """``mask.reference_grad_code_bits``: the later stage of each boundary fits a transform code of the gradient's
    residual and ships it with its gradients; from the first fit on their codes are half as large, the earlier
    stage decodes them with that code (never the forward's, which the same exchange carried), and training differs
    from the 1-bit gradient's."""
    fwd = MeshTrainer(tiny_cfg(*CODED, "mask.reference_code_bits=32"), cache_dir)
    both = MeshTrainer(tiny_cfg(*CODED, "mask.reference_code_bits=32", "mask.reference_grad_code_bits=32"), cache_dir)
    for _ in range(6):
        fwd.train_step()
        both.train_step()
    # (the same forward bytes but for the headers: the senders' random ids take more or fewer bytes)
    assert both.counter.snapshot()["pp_fwd"] == pytest.approx(fwd.counter.snapshot()["pp_fwd"], rel=0.01)
    assert both.counter.snapshot()["pp_bwd"] < 0.85 * fwd.counter.snapshot()["pp_bwd"]
    assert both.losses != fwd.losses and all(torch.isfinite(torch.tensor(both.losses)))
    w0, w1, w2 = both.workers[0]
    assert w1.gcode_out.transform.code_bits == 32 and w0.gcode_out is None and w2.gcode_out.version == 3
    # one microbatch through the chain, the codec calls recorded: what w2 codes and what w1 decodes from it
    sent, got = [], []
    enc, dec = w2.codec.encode_grad, w1.codec.decode_grad
    w2.codec.encode_grad = lambda g, ctx=None: sent.append(g.clone()) or enc(g, ctx)
    w1.codec.decode_grad = lambda p, ctx=None: got.append(dec(p, ctx)) or got[-1]
    ids = both.sources[0].batch(100)
    mb = MicrobatchId(100, 0)
    w2.forward(mb, w1.forward(mb, w0.forward(mb, ids, labels=ids), labels=ids), labels=ids)
    g2 = w2.backward(mb)
    assert g2.meta["code_bits"] == 32 and g2.tensors["codes"].shape[-1] == 4  # half of 1-bit rotq's 8 bytes
    w0.backward(mb, w1.backward(mb, g2))
    err = float((got[0] - sent[0]).square().sum() / sent[0].square().sum())
    wrong = dec(dataclasses.replace(g2, meta={k: v for k, v in g2.meta.items() if k != MAP_META},
                                    tensors={k: v for k, v in g2.tensors.items()
                                             if k not in (*CODE_TENSORS, CHECK_TENSOR)}),
                BoundaryContext(transform=w1.map_in.get(tuple(w0.forward(MicrobatchId(101, 0), ids, labels=ids)
                                                               .meta[MAP_META])).transform))
    err_wrong = float((wrong - sent[0]).square().sum() / sent[0].square().sum())
    print(f"gradient residual decoded at half a bit: relative squared error {err:.3f} ({err_wrong:.3f} with the "
          "forward's code)")
    assert err < 0.6 < err_wrong


@pytest.mark.parametrize("metric", ["plain", "fisher"])
def test_tc_grad_is_the_backward_of_the_code_s_linear_part(metric):
    """``tc_grad`` is the vector-Jacobian product of ``e -> e E D^T`` (what the code does to a vector, quantisation
    aside), so it is zero along every direction the code does not send; for the plain code it is the orthogonal
    projection onto the sent directions."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(4096, H, generator=gen) * torch.linspace(0.2, 2.0, H)
    s = normalised_second_moment(x)
    a = torch.randn(H, H, generator=gen)
    tf = fit_transform(s, 40, metric=(a @ a.T).double() if metric == "fisher" else None)
    enc = (tf.basis if tf.encoder is None else tf.encoder).float()
    e = torch.randn(3, 5, H, generator=gen, requires_grad=True)
    g = torch.randn(3, 5, H, generator=gen)
    ((e @ enc @ tf.basis.float().T) * g).sum().backward()
    torch.testing.assert_close(tc_grad(g, tf), e.grad, rtol=1e-5, atol=1e-5)
    m = tf.basis.shape[1]
    assert m < H
    null = torch.linalg.svd(enc.T.double(), full_matrices=True).Vh[m:].float()  # directions the encoder ignores
    off = tc_grad(g, tf) @ null.T
    assert float(off.abs().max()) < 1e-4  # nothing along what the code drops
    assert float((g @ null.T).abs().max()) > 0.1
    if metric == "plain":
        p = tc_grad(g, tf)
        torch.testing.assert_close(tc_grad(p, tf), p, rtol=1e-2, atol=1e-2)  # bfloat16 basis: nearly a projection


@pytest.mark.parametrize("metric", ["plain", "fisher"])
def test_in_the_mesh_the_projected_gradient_moves_the_sender_only_along_what_it_sent(tiny_cfg, cache_dir, metric):
    """``mask.reference_code_grad = project``: the activation's sender applies the returning gradient through its
    code's linear part, so the gradient at its output lies in the span of the code's encoder (straight through, it
    does not); training is the same until the first code is used, then differs."""
    args = (*CODED, "mask.reference_code_bits=32", f"mask.reference_code_metric={metric}")
    straight = MeshTrainer(tiny_cfg(*args), cache_dir)
    proj = MeshTrainer(tiny_cfg(*args, "mask.reference_code_grad=project"), cache_dir)
    for _ in range(2):  # the first fit comes after step 1 (period 2): no code yet
        straight.train_step()
        proj.train_step()
    assert proj.losses == straight.losses
    for _ in range(4):
        straight.train_step()
        proj.train_step()
    assert proj.losses != straight.losses and all(torch.isfinite(torch.tensor(proj.losses)))

    def out_grad(trainer):
        w0, w1, w2 = trainer.workers[0]
        ids = trainer.sources[0].batch(100)
        mb = MicrobatchId(100, 0)
        w2.forward(mb, w1.forward(mb, w0.forward(mb, ids, labels=ids), labels=ids), labels=ids)
        got = []
        w0.in_flight[mb].outputs.register_hook(lambda grad: got.append(grad.detach().float()))
        tf = w0.in_flight[mb].ctx_out.transform
        w0.backward(mb, w1.backward(mb, w2.backward(mb)))
        for w in trainer.workers[0]:
            w.zero_grad()
        enc = (tf.basis if tf.encoder is None else tf.encoder).double()
        g = got[0].reshape(-1, enc.shape[0]).double()
        q, _ = torch.linalg.qr(enc)
        return float((g - (g @ q) @ q.T).norm() / g.norm())  # the part outside the encoder's span

    assert out_grad(proj) < 1e-4
    assert out_grad(straight) > 0.1


def test_config_refuses_a_projected_gradient_without_a_code(tiny_cfg):
    with pytest.raises(ConfigError, match="reference_code_grad"):
        tiny_cfg("mask.codec=rotq", "mask.reference=both", "mask.reference_map_rank=8",
                 "mask.reference_code_grad=project")
    with pytest.raises(ConfigError, match="reference_code_grad"):
        tiny_cfg("mask.codec=rotq", "mask.reference=both", "mask.reference_code_bits=32",
                 "mask.reference_code_grad=sideways")


def test_a_four_bit_fit_of_an_odd_width_drops_its_pad_and_decodes_the_same_at_both_ends():
    """H = 33: a 4-bit fit's matrices travel as (17, k) bytes, the last row's high nibble a pad that neither the
    basis' unit norm nor the decoded values see."""
    h, gen = 33, torch.Generator().manual_seed(11)
    m = ResidualMap(h, 3, code_bits=20, sender=5, fit_bits=4)
    for _ in range(4):
        x = torch.randn(2, 16, h, generator=gen)
        m.observe(x, 0.5 * x.flip(-1) + 0.1 * _anisotropic(gen, 32, h).reshape(2, 16, h))
    assert m.refit()
    fit = m.current
    assert {tuple(fit.wire[n].shape[:1]) for n in MATRIX_TENSORS} == {(17,)}
    torch.testing.assert_close(fit.transform.basis.norm(dim=0), torch.ones(fit.transform.basis.shape[1]))
    sent = m.attach(RotQuantCodec(1).encode(torch.randn(1, 4, h, generator=gen),
                                            BoundaryContext(transform=m.transform)))
    store = MapStore(h, 3, code_bits=20, fit_bits=4)
    _, key = store.take(sent)
    got = store.get(key)
    for a, b in ((got.u, fit.u), (got.v, fit.v), (got.transform.basis, fit.transform.basis)):
        assert a.shape[0] == h and torch.equal(a, b)
