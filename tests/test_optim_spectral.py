"""Spectral filter and SpectralAdamW: the filter against an explicit SVD formula, AdamW equivalence at
alpha = 1, denoising with a good prior, staleness, the fallback modes and checkpoint round-trips."""

from __future__ import annotations

import copy
import io

import numpy as np
import pytest
import torch

from meshnode.config import SpectralConfig
from meshnode.optim import PriorError, SpectralAdamW, SpectralFilter, is_targeted, truncated_svd


def _rand(*shape: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g)


def _explicit_filter(G: np.ndarray, M: np.ndarray, alpha: float, tau: float, rank: int) -> np.ndarray:
    """U diag(d) U^T G V diag(d) V^T in float64 with an independent numpy SVD."""
    U, s, Vh = np.linalg.svd(M, full_matrices=False)
    r = s.size if rank == 0 else rank
    U, s, V = U[:, :r], s[:r], Vh[:r].T
    D = np.diag(s / (s + tau))
    G_filt = U @ D @ U.T @ G @ V @ D @ V.T
    return alpha * G + (1 - alpha) * G_filt


# ---------------------------------------------------------------------------------------------
# the filter itself


@pytest.mark.parametrize("rank", [0, 3])
@pytest.mark.parametrize("shape", [(12, 8), (7, 16)])
def test_filter_matches_explicit_formula(rank: int, shape: tuple[int, int]) -> None:
    M, G = _rand(*shape, seed=1), _rand(*shape, seed=2)
    s = np.linalg.svd(M.double().numpy(), compute_uv=False)
    tau = float(np.median(s))  # d spans ~0.3..0.8 so the soft weights really matter
    f = SpectralFilter(shape, alpha=0.3, tau=tau, beta=0.9, rank=rank)
    f.update_prior(M, anchor_step=0)
    assert f.U is not None and f.U.shape == (shape[0], rank or min(shape))
    out = f.filter(G, step=0)
    ref = _explicit_filter(G.double().numpy(), M.double().numpy(), 0.3, tau, rank)
    np.testing.assert_allclose(out.double().numpy(), ref, rtol=0, atol=2e-5)
    # and it really filtered something
    assert (out - G).abs().max() > 0.1


def test_rank_larger_than_matrix_is_clamped() -> None:
    f = SpectralFilter((5, 9), rank=64)
    f.update_prior(_rand(5, 9), 0)
    assert f.s is not None and f.s.numel() == 5


def test_ema_update_first_and_zero_init() -> None:
    g1, g2, g3 = _rand(6, 4, seed=1), _rand(6, 4, seed=2), _rand(6, 4, seed=3)
    beta = 0.8
    f = SpectralFilter((6, 4), beta=beta)  # ema_init="first"
    f.update_prior(g1, 0)
    torch.testing.assert_close(f.M, g1)
    f.update_prior(g2, 1)
    f.update_prior(g3, 2)
    torch.testing.assert_close(f.M, beta * (beta * g1 + (1 - beta) * g2) + (1 - beta) * g3)
    # the factors are the SVD of the EMA, not of the last gradient
    U, s, Vh = f.factors()  # type: ignore[misc]
    torch.testing.assert_close((U * s) @ Vh, f.M, atol=1e-5, rtol=1e-5)

    z = SpectralFilter((6, 4), beta=beta, ema_init="zero")
    z.update_prior(g1, 0)
    torch.testing.assert_close(z.M, (1 - beta) * g1)
    z.update_prior(g2, 1)
    torch.testing.assert_close(z.M, beta * (1 - beta) * g1 + (1 - beta) * g2)

    with pytest.raises(ValueError):
        SpectralFilter((6, 4), ema_init="mean")


def test_svd_only_when_a_prior_arrives(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    real_svd = torch.linalg.svd

    def counting_svd(*args, **kwargs):
        calls.append(1)
        return real_svd(*args, **kwargs)

    monkeypatch.setattr(torch.linalg, "svd", counting_svd)
    f = SpectralFilter((8, 8), alpha=0.3, tau=0.1)
    G = _rand(8, 8, seed=5)
    for step in range(5):
        f.filter(G, step)
    assert calls == []
    f.update_prior(_rand(8, 8, seed=1), 0)
    for step in range(10):
        f.filter(G, step)
    assert len(calls) == 1 and f.svd_count == 1
    f.update_prior(_rand(8, 8, seed=2), 10)
    f.filter(G, 11)
    assert len(calls) == 2 and f.svd_count == 2
    # factors pushed from an anchor: no SVD on this side at all
    f.update_prior_factors(*truncated_svd(_rand(8, 8, seed=3), 4), anchor_step=12)
    f.filter(G, 13)
    assert len(calls) == 3  # the truncated_svd call above, made on the "anchor" side
    assert f.svd_count == 2

    # the optimizer steps without any SVD
    calls.clear()
    p = torch.nn.Parameter(_rand(8, 8, seed=4))
    opt = SpectralAdamW([("l.q_proj.weight", p)], SpectralConfig(), lr=1e-2)
    opt.push_prior({"l.q_proj.weight": _rand(8, 8, seed=6)}, anchor_step=0)
    for step in range(5):
        p.grad = _rand(8, 8, seed=10 + step)
        opt.step(step)
    assert len(calls) == 1


def test_good_prior_denoises_masked_gradient() -> None:
    """A prior spanning the true (low-rank) gradient's subspace removes most of isotropic noise."""
    m, n, k = 64, 48, 4
    g = torch.Generator().manual_seed(0)
    Uq, _ = torch.linalg.qr(torch.randn(m, k, generator=g, dtype=torch.float64))
    Vq, _ = torch.linalg.qr(torch.randn(n, k, generator=g, dtype=torch.float64))
    true = (Uq * torch.tensor([10.0, 8.0, 6.0, 4.0], dtype=torch.float64)) @ Vq.T
    noise = torch.randn(m, n, generator=g, dtype=torch.float64)
    noise *= true.norm() / noise.norm()  # as much noise as signal
    noisy = (true + noise).float()
    anchor = (true + 0.01 * torch.randn(m, n, generator=g, dtype=torch.float64)).float()  # a clean-ish prior

    s = torch.linalg.svdvals(anchor.double())
    err_noisy = (noisy.double() - true).norm()
    # full rank: tau at twice the anchor's noise floor s_{k+1}, so noise directions get d <= 1/3 while the
    # signal keeps d >= 0.93; truncated to rank k: only the signal subspace is kept, tau can be tiny
    for rank, tau in [(0, 2 * float(s[k])), (k, 0.01 * float(s[k - 1]))]:
        for alpha, factor in [(0.0, 5.0), (0.3, 2.0)]:
            f = SpectralFilter((m, n), alpha=alpha, tau=tau, rank=rank, max_staleness=30)
            f.update_prior(anchor, anchor_step=100)
            err = (f.filter(noisy, step=120).double() - true).norm()
            assert err * factor < err_noisy, (rank, alpha, float(err), float(err_noisy))
    # the fallback alpha=1 and a wrong prior (a random subspace) do not help
    wrong = SpectralFilter((m, n), alpha=0.0, tau=2 * float(s[k]), rank=k)
    wrong.update_prior(torch.randn(m, n, generator=g).float(), anchor_step=0)
    assert (wrong.filter(noisy, 0).double() - true).norm() > 0.8 * true.norm()


def test_no_prior_or_stale_prior_leaves_gradient_unchanged() -> None:
    G = _rand(6, 5, seed=1)
    f = SpectralFilter((6, 5), alpha=0.3, tau=0.01, max_staleness=30)
    assert f.filter(G, step=0) is G
    assert f.transform(G, step=0) is G
    f.update_prior(_rand(6, 5, seed=2), anchor_step=10)
    assert f.filter(G, step=41) is G  # 31 steps old
    assert f.filter(G, step=40) is not G  # exactly max_staleness: still used
    assert not torch.equal(f.filter(G, step=40), G)
    never = SpectralFilter((6, 5), alpha=0.3, tau=0.01, max_staleness=None)
    never.update_prior(_rand(6, 5, seed=2), anchor_step=0)
    assert not torch.equal(never.filter(G, step=10_000), G)


def test_factor_prior_equals_gradient_prior() -> None:
    """An anchor's published factors give the fast peer the same filter as holding the EMA itself."""
    M, G = _rand(10, 7, seed=1), _rand(10, 7, seed=2)
    a = SpectralFilter((10, 7), alpha=0.3, tau=0.5, rank=3)
    a.update_prior(M, 5)
    b = SpectralFilter((10, 7), alpha=0.3, tau=0.5, rank=3)
    b.update_prior_factors(*a.factors(), anchor_step=5)  # type: ignore[misc]
    torch.testing.assert_close(b.filter(G, 6), a.filter(G, 6))
    assert b.M is None and b.prior_step == 5
    # fp16 transport (what the DHT carries) is close enough
    c = SpectralFilter((10, 7), alpha=0.3, tau=0.5, rank=3)
    c.update_prior_factors(*(t.half() for t in a.factors()), anchor_step=5)  # type: ignore[union-attr]
    torch.testing.assert_close(c.filter(G, 6), a.filter(G, 6), atol=5e-3, rtol=5e-3)


def test_bad_priors_are_rejected() -> None:
    f = SpectralFilter((6, 4), rank=2)
    with pytest.raises(PriorError):
        f.update_prior(_rand(4, 6), 0)
    bad = _rand(6, 4)
    bad[0, 0] = float("nan")
    with pytest.raises(PriorError):
        f.update_prior(bad, 0)
    U, s, Vh = truncated_svd(_rand(6, 4), 2)
    with pytest.raises(PriorError):
        f.update_prior_factors(U.T, s, Vh, 0)
    with pytest.raises(PriorError):
        f.update_prior_factors(U, -s, Vh, 0)
    s_inf = s.clone()
    s_inf[0] = float("inf")
    with pytest.raises(PriorError):
        f.update_prior_factors(U, s_inf, Vh, 0)
    assert not f.has_prior  # nothing was half-applied
    opt = SpectralAdamW([("a.q_proj.weight", torch.nn.Parameter(_rand(6, 4)))], SpectralConfig())
    with pytest.raises(PriorError):
        opt.push_prior({"a.norm.weight": _rand(6, 4)}, 0)


# ---------------------------------------------------------------------------------------------
# fallback modes


def test_clean_every_replaces_with_anchor_ema() -> None:
    M, G = _rand(6, 5, seed=1), _rand(6, 5, seed=2)
    f = SpectralFilter((6, 5), alpha=0.3, tau=0.1, mode="clean_every", clean_every=5, max_staleness=8)
    assert f.transform(G, 5) is G  # no prior yet
    f.update_prior(M, anchor_step=2)
    torch.testing.assert_close(f.transform(G, 5), M)  # a clean step
    torch.testing.assert_close(f.transform(G, 6), f.filter(G, 6))  # other steps: the filter step
    assert f.transform(G, 15) is G  # stale (13 steps > 8): masked gradient, even on a clean step

    # alpha = 1: masked steps plus a clean step every N
    one = SpectralFilter((6, 5), alpha=1.0, tau=0.1, mode="clean_every", clean_every=5)
    one.update_prior(M, 0)
    assert one.transform(G, 6) is G
    torch.testing.assert_close(one.transform(G, 10), M)
    # factors only: the clean gradient is the rank-r reconstruction
    fr = SpectralFilter((6, 5), alpha=1.0, mode="clean_every", clean_every=5)
    U, s, Vh = truncated_svd(M, 2)
    fr.update_prior_factors(U, s, Vh, 0)
    torch.testing.assert_close(fr.transform(G, 5), (U * s) @ Vh)

    # through the optimizer: the .grad AdamW sees on step 5 is M
    p = torch.nn.Parameter(_rand(6, 5, seed=3))
    cfg = SpectralConfig(mode="clean_every", clean_every=5, alpha=0.3, tau=0.1)
    opt = SpectralAdamW([("x.up_proj.weight", p)], cfg, lr=0.0)
    opt.push_prior({"x.up_proj.weight": M}, anchor_step=3)
    p.grad = G.clone()
    opt.step(5)
    torch.testing.assert_close(p.grad, M)
    assert opt.fast_step == 6


def test_delayed_ef_adds_held_residual() -> None:
    beta = 0.5
    g = [_rand(5, 4, seed=i) for i in range(6)]
    A, B = _rand(5, 4, seed=10), _rand(5, 4, seed=11)
    f = SpectralFilter((5, 4), alpha=1.0, beta=beta, mode="delayed_ef")
    assert f.transform(g[0], 0) is g[0]
    assert f.transform(g[1], 1) is g[1]
    f.update_prior(A, anchor_step=1)  # M = A, E = mean(g0, g1)
    E1 = (g[0] + g[1]) / 2
    torch.testing.assert_close(f.transform(g[2], 2), g[2] + A - E1)
    torch.testing.assert_close(f.transform(g[3], 3), g[3] + A - E1)
    f.update_prior(B, anchor_step=3)
    M2 = beta * A + (1 - beta) * B
    E2 = beta * E1 + (1 - beta) * (g[2] + g[3]) / 2
    torch.testing.assert_close(f.transform(g[4], 4), g[4] + M2 - E2)

    # with alpha < 1 the residual is added to the filtered gradient
    h = SpectralFilter((5, 4), alpha=0.3, tau=0.2, beta=beta, mode="delayed_ef")
    h.transform(g[0], 0)
    h.update_prior(A, 0)
    torch.testing.assert_close(h.transform(g[1], 1), h.filter(g[1], 1) + A - g[0])


def test_delayed_ef_with_factor_prior_projects_residual() -> None:
    g0, G, A = _rand(6, 6, seed=1), _rand(6, 6, seed=2), _rand(6, 6, seed=3)
    full = SpectralFilter((6, 6), alpha=1.0, mode="delayed_ef")  # square, full rank: projection is exact
    full.transform(g0, 0)
    full.update_prior_factors(*truncated_svd(A), anchor_step=0)
    torch.testing.assert_close(full.transform(G, 1), G + A - g0, atol=1e-5, rtol=1e-5)

    low = SpectralFilter((6, 6), alpha=1.0, mode="delayed_ef", rank=2)
    low.transform(g0, 0)
    U, s, Vh = truncated_svd(A, 2)
    low.update_prior_factors(U, s, Vh, anchor_step=0)
    expected = G + (U * s) @ Vh - U @ U.T @ g0 @ Vh.T @ Vh
    torch.testing.assert_close(low.transform(G, 1), expected, atol=1e-5, rtol=1e-5)


def test_delayed_ef_removes_a_systematic_mask_bias() -> None:
    """Masked gradients that are a shrunk, noisy copy of the truth: the residual restores the scale."""
    m, n = 16, 12
    true = _rand(m, n, seed=0)
    f = SpectralFilter((m, n), alpha=1.0, beta=0.9, mode="delayed_ef", max_staleness=30)
    plain_err, corr_err = [], []
    gen = torch.Generator().manual_seed(1)
    for step in range(200):
        if step and step % 20 == 0:
            f.update_prior(true + 0.1 * torch.randn(m, n, generator=gen), anchor_step=step - 5)
        masked = 0.5 * true + 0.1 * torch.randn(m, n, generator=gen)
        out = f.transform(masked, step)
        if step >= 100:
            plain_err.append(float((masked - true).norm()))
            corr_err.append(float((out - true).norm()))
    assert np.mean(corr_err) * 3 < np.mean(plain_err)


def test_bias_correction_mode() -> None:
    clean, masked, G = _rand(7, 5, seed=1), _rand(7, 5, seed=2), _rand(7, 5, seed=3)
    f = SpectralFilter((7, 5), beta=0.9, rank=0, mode="bias_correction")
    with pytest.raises(PriorError):
        f.update_prior(clean, 0)  # needs the masked gradient too
    f.update_prior(clean, 0, g_anchor_masked=masked)
    torch.testing.assert_close(f.transform(G, 1), G + (clean - masked), atol=1e-5, rtol=1e-5)

    r1 = SpectralFilter((7, 5), beta=0.9, rank=1, mode="bias_correction")
    r1.update_prior(clean, 0, g_anchor_masked=masked)
    U, s, Vh = np.linalg.svd((clean - masked).double().numpy(), full_matrices=False)
    best_rank1 = s[0] * np.outer(U[:, 0], Vh[0])
    np.testing.assert_allclose((r1.transform(G, 1) - G).double().numpy(), best_rank1, atol=1e-5)

    # through the optimizer, with the anchor's masked gradients passed alongside
    p = torch.nn.Parameter(_rand(7, 5))
    opt = SpectralAdamW([("l.v_proj.weight", p)], SpectralConfig(), mode="bias_correction", lr=0.0)
    opt.push_prior({"l.v_proj.weight": clean}, 0, name_to_masked={"l.v_proj.weight": masked})
    p.grad = G.clone()
    opt.step(1)
    torch.testing.assert_close(p.grad, G + (clean - masked), atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------------------------
# the optimizer


def _named_params(seed: int = 0) -> list[tuple[str, torch.nn.Parameter]]:
    torch.manual_seed(seed)
    return [
        ("embed_tokens.weight", torch.nn.Parameter(torch.randn(20, 8))),
        ("layers.0.input_layernorm.weight", torch.nn.Parameter(torch.ones(8))),
        ("layers.0.self_attn.q_proj.weight", torch.nn.Parameter(torch.randn(8, 8))),
        ("layers.0.self_attn.q_proj.bias", torch.nn.Parameter(torch.randn(8))),
        ("layers.0.mlp.gate_proj.weight", torch.nn.Parameter(torch.randn(16, 8))),
        ("layers.0.mlp.down_proj.weight", torch.nn.Parameter(torch.randn(8, 16))),
        ("lm_head.weight", torch.nn.Parameter(torch.randn(20, 8))),
    ]


def _grads(named, step: int) -> dict[str, torch.Tensor]:
    return {n: _rand(*p.shape, seed=1000 * step + i) for i, (n, p) in enumerate(named)}


def test_from_config() -> None:
    from meshnode.config import AnchorConfig, TrainConfig

    train = TrainConfig(lr=3e-4, betas=[0.8, 0.9], eps=1e-6, weight_decay=0.05)
    opt = SpectralAdamW.from_config(_named_params(), SpectralConfig(rank=2), train, AnchorConfig(max_staleness=25))
    g = opt.param_groups[0]
    assert (g["lr"], g["betas"], g["eps"], g["weight_decay"]) == (3e-4, (0.8, 0.9), 1e-6, 0.05)
    assert all(f.max_staleness == 25 and f.rank == 2 for f in opt.filters.values())


def test_targeting() -> None:
    named = _named_params()
    opt = SpectralAdamW(named, SpectralConfig())
    assert sorted(opt.filters) == [
        "layers.0.mlp.down_proj.weight", "layers.0.mlp.gate_proj.weight", "layers.0.self_attn.q_proj.weight"
    ]
    assert [g["name"] for g in opt.param_groups] == ["spectral", "plain"]
    assert len(opt.param_groups[0]["params"]) == 3 and len(opt.param_groups[1]["params"]) == 4
    assert not is_targeted("layers.0.self_attn.q_proj.bias", torch.zeros(8), ["q_proj"])


def test_alpha_one_reproduces_adamw() -> None:
    cfg = SpectralConfig(alpha=1.0, tau=1e-3)
    named = _named_params()
    ref_params = [torch.nn.Parameter(p.detach().clone()) for _, p in named]
    opt = SpectralAdamW(named, cfg, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, max_staleness=30)
    ref = torch.optim.AdamW(ref_params, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    for step in range(8):
        if step % 3 == 1:
            opt.push_prior({n: _rand(*p.shape, seed=77 + step) for n, p in named if n in opt.filters}, step)
        lr = 1e-2 * (step + 1) / 8  # a schedule applied from outside
        for g in opt.param_groups:
            g["lr"] = lr
        for g in ref.param_groups:
            g["lr"] = lr
        grads = _grads(named, step)
        for (n, p), q in zip(named, ref_params, strict=True):
            p.grad = grads[n].clone()
            q.grad = grads[n].clone()
        opt.step()
        ref.step()
    assert opt.fast_step == 8
    assert all(f.has_prior for f in opt.filters.values())
    for (_, p), q in zip(named, ref_params, strict=True):
        assert (p - q).abs().max().item() <= 1e-7

    # sanity: the same run with alpha < 1 does differ (the equivalence above is not vacuous)
    named2 = _named_params()
    opt2 = SpectralAdamW(named2, SpectralConfig(alpha=0.3, tau=1e-3), lr=1e-2, weight_decay=0.1)
    opt2.push_prior({n: _rand(*p.shape, seed=5) for n, p in named2 if n in opt2.filters}, 0)
    grads = _grads(named2, 0)
    for n, p in named2:
        p.grad = grads[n].clone()
    opt2.step(0)
    name = "layers.0.mlp.gate_proj.weight"
    assert (dict(named2)[name] - dict(named)[name]).abs().max() > 0


def _run(opt: SpectralAdamW, named, steps: range) -> None:
    for step in steps:
        if step % 3 == 0:
            opt.push_prior({n: _rand(*p.shape, seed=500 + step + i) for i, (n, p) in enumerate(named)
                            if n in opt.filters}, anchor_step=max(0, step - 2))
        grads = _grads(named, step)
        for n, p in named:
            p.grad = grads[n].clone()
        opt.step()


@pytest.mark.parametrize("mode", ["filter", "clean_every", "delayed_ef"])
def test_state_dict_round_trip_is_exact(mode: str) -> None:
    cfg = SpectralConfig(alpha=0.3, tau=0.05, beta=0.9, rank=4, mode=mode, clean_every=2)
    named = _named_params()
    opt = SpectralAdamW(named, cfg, lr=1e-2, weight_decay=0.01, max_staleness=30)
    _run(opt, named, range(0, 5))
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)  # must be serialisable, as a checkpoint is
    saved_params = {n: p.detach().clone() for n, p in named}
    _run(opt, named, range(5, 10))
    expected = {n: p.detach().clone() for n, p in named}

    named2 = _named_params(seed=123)  # different initial values, overwritten below
    with torch.no_grad():
        for (n, p) in named2:
            p.copy_(saved_params[n])
    opt2 = SpectralAdamW(named2, cfg, lr=1e-2, weight_decay=0.01, max_staleness=30)
    buf.seek(0)
    opt2.load_state_dict(torch.load(buf, weights_only=True))
    assert opt2.fast_step == 5
    _run(opt2, named2, range(5, 10))
    for n, p in named2:
        assert torch.equal(p.detach(), expected[n]), n


def test_state_dict_rejects_other_filters() -> None:
    named = _named_params()
    opt = SpectralAdamW(named, SpectralConfig())
    state = copy.deepcopy(opt.state_dict())
    del state["filters"]["layers.0.mlp.down_proj.weight"]
    with pytest.raises(ValueError):
        SpectralAdamW(_named_params(), SpectralConfig()).load_state_dict(state)

