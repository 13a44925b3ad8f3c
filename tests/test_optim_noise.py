"""dp.v_correction: the microbatch variance estimate and the second-moment correction."""

from __future__ import annotations

import pytest
import torch

from meshnode.config import ConfigError, load_config
from meshnode.optim import MicrobatchNoise

from .conftest import TINY


def _accumulate(p: torch.nn.Parameter, noise: MicrobatchNoise, mbs: list[torch.Tensor]) -> None:
    """What a worker does: each microbatch's gradient, divided by M, added into p.grad, then the tracker."""
    p.grad = None
    for g in mbs:
        p.grad = g / len(mbs) if p.grad is None else p.grad + g / len(mbs)
        noise.after_microbatch()


def test_variance_is_the_unbiased_variance_of_the_mean():
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.zeros(7, 5))
    noise = MicrobatchNoise({"w": p}, replicas=2)
    for m in (2, 3, 5):
        mbs = [torch.randn(7, 5) * 3 + 1 for _ in range(m)]
        noise.reset()
        _accumulate(p, noise, mbs)
        explicit = torch.stack(mbs).var(0, unbiased=True) / m
        assert torch.allclose(noise.variance()["w"], explicit, rtol=1e-4, atol=1e-5), m
    noise.reset()
    _accumulate(p, noise, [torch.randn(7, 5)])
    assert noise.variance() == {}  # one microbatch: no estimate


def test_after_step_sets_v_to_the_formula():
    torch.manual_seed(1)
    p = torch.nn.Parameter(torch.randn(4, 3))
    opt = torch.optim.AdamW([p], lr=1e-2, betas=(0.9, 0.95))
    noise = MicrobatchNoise({"w": p}, replicas=2)
    v_plain = torch.zeros(4, 3)
    b = torch.zeros(4, 3)
    for step in range(4):
        g = torch.randn(4, 3) * 0.1
        var = torch.rand(4, 3) * 1e-2 if step != 2 else torch.ones(4, 3)  # step 2: a huge estimate: the floor acts
        p.grad = g.clone()
        opt.step()
        assert noise.after_step(opt, {"w": var}, scale=0.8) == 1
        v_plain = 0.95 * v_plain + 0.05 * g.square()
        b = 0.95 * b + 0.05 * 0.64 * var
        want = torch.maximum(v_plain - 0.5 * b, v_plain / 4)
        assert torch.allclose(opt.state[p]["exp_avg_sq"], want, rtol=1e-5, atol=1e-12), step
        if step == 2:
            assert torch.equal(want, v_plain / 4)
    p.grad = torch.randn(4, 3)
    opt.step()
    assert noise.after_step(opt, {}, 1.0) == 0  # no estimate (one microbatch): AdamW's own v, EMAs dropped
    assert noise.ema_g2 == {} and noise.ema_var == {}


@pytest.mark.parametrize("x", [2, 4])
def test_corrected_v_matches_the_group_batch(x):
    """Noise-dominated gradients: M = 2 microbatches of per-microbatch variance s2 around mu. One replica's
    v tends to mu^2 + s2 / M; the group's batch (X times larger) to mu^2 + s2 / (M X); corrected, the replica's
    v lands there (measured over many steps). At X = 4 the one-degree-of-freedom estimate is noisy enough that the
    floor (A / 2X) binds now and then and lifts the mean a little."""
    torch.manual_seed(2)
    n, m, mu, s2, steps, beta2 = 4000, 2, 0.1, 1.0, 400, 0.95
    plain = torch.nn.Parameter(torch.zeros(n))
    corr = torch.nn.Parameter(torch.zeros(n))
    opt_plain = torch.optim.AdamW([plain], lr=0.0, betas=(0.9, beta2))
    opt_corr = torch.optim.AdamW([corr], lr=0.0, betas=(0.9, beta2))
    noise = MicrobatchNoise({"w": corr}, replicas=x)
    for _ in range(steps):
        mbs = [mu + s2 ** 0.5 * torch.randn(n) for _ in range(m)]
        noise.reset()
        _accumulate(corr, noise, mbs)
        plain.grad = corr.grad.clone()
        opt_plain.step()
        opt_corr.step()
        noise.after_step(opt_corr, noise.variance())
    mean_plain = float(opt_plain.state[plain]["exp_avg_sq"].mean())
    mean_corr = float(opt_corr.state[corr]["exp_avg_sq"].mean())
    assert mean_plain == pytest.approx(mu ** 2 + s2 / m, rel=0.05)
    target = mu ** 2 + s2 / (m * x)
    if x == 2:
        assert mean_corr == pytest.approx(target, rel=0.03)
    else:
        assert target < mean_corr < 1.25 * target


def test_config_needs_dp_and_microbatches():
    with pytest.raises(ConfigError, match="v_correction"):
        load_config(TINY, ["dp.v_correction=true", "dp.enabled=true", "train.microbatches=1"])
    with pytest.raises(ConfigError, match="v_correction"):
        load_config(TINY, ["dp.v_correction=true", "train.microbatches=2"])
    assert load_config(TINY, ["dp.v_correction=true", "dp.enabled=true", "train.microbatches=2"]).dp.v_correction
