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


def _step(opt, noise: MicrobatchNoise, variance: dict, scale: float = 1.0) -> int:
    """What a worker does after clipping: the tracker, AdamW's step, the tracker."""
    noise.before_step(opt, variance, scale)
    opt.step()
    return noise.after_step(opt)


def test_after_step_sets_v_to_the_formula():
    """v = max(A - (1 - 1/X) B, A / 2X) with A the plain EMA of g^2 (not stored: derived from v and B), also
    across a change of X (the swarm's group size), which must not disturb A."""
    torch.manual_seed(1)
    p = torch.nn.Parameter(torch.randn(4, 3))
    opt = torch.optim.AdamW([p], lr=1e-2, betas=(0.9, 0.95))
    noise = MicrobatchNoise({"w": p}, replicas=2)
    v_plain = torch.zeros(4, 3)
    b = torch.zeros(4, 3)
    for step in range(6):
        x = 2 if step < 3 else 4
        noise.replicas = x
        g = torch.randn(4, 3) * 0.1
        var = torch.rand(4, 3) * 1e-2 if step != 2 else torch.ones(4, 3)  # step 2: a huge estimate: the floor acts
        p.grad = g.clone()
        assert _step(opt, noise, {"w": var.clone()}, scale=0.8) == 1
        v_plain = 0.95 * v_plain + 0.05 * g.square()
        b = 0.95 * b + 0.05 * 0.64 * var
        want = torch.maximum(v_plain - (1 - 1 / x) * b, v_plain / (2 * x))
        assert torch.allclose(opt.state[p]["exp_avg_sq"], want, rtol=1e-5, atol=1e-12), step
        if step == 2:
            assert torch.equal(want, v_plain / 4)
    p.grad = torch.randn(4, 3)
    assert _step(opt, noise, {}) == 0  # no estimate (one microbatch): AdamW's own v, the EMA dropped
    assert noise.ema_var == {}
    v_carried = opt.state[p]["exp_avg_sq"].clone()
    g = torch.randn(4, 3) * 0.1
    p.grad = g.clone()
    var = torch.rand(4, 3) * 1e-2
    assert _step(opt, noise, {"w": var.clone()}) == 1  # estimates back: A restarts from AdamW's v, B from zero
    a = 0.95 * v_carried + 0.05 * g.square()
    assert torch.allclose(opt.state[p]["exp_avg_sq"], torch.maximum(a - 0.75 * 0.05 * var, a / 8), rtol=1e-5)


def test_two_microbatches_take_two_buffers_and_agree_with_the_general_path():
    """At M = 2 the tracker keeps B and one scratch buffer per tensor (8 bytes per parameter), the general path
    one more; both give the same variance and the same corrected v."""
    torch.manual_seed(3)
    shape = (6, 5)
    ps = {k: torch.nn.Parameter(torch.zeros(shape)) for k in ("pair", "general")}
    opts = {k: torch.optim.AdamW([p], lr=1e-3, betas=(0.9, 0.95)) for k, p in ps.items()}
    trackers = {"pair": MicrobatchNoise({"w": ps["pair"]}, 2, microbatches=2),
                "general": MicrobatchNoise({"w": ps["general"]}, 2)}
    for step in range(5):
        mbs = [torch.randn(shape) * 0.1 + 0.05 for _ in range(2)]
        variances = {}
        for k, noise in trackers.items():
            noise.reset()
            _accumulate(ps[k], noise, mbs)
            variances[k] = noise.variance()["w"].clone()
            _step(opts[k], noise, noise.variance(), scale=0.9)
        assert torch.allclose(variances["pair"], variances["general"], rtol=1e-4, atol=1e-9), step
        assert torch.allclose(opts["pair"].state[ps["pair"]]["exp_avg_sq"],
                              opts["general"].state[ps["general"]]["exp_avg_sq"], rtol=1e-4, atol=1e-12), step

    assert len(trackers["pair"].buffers()) == 2 and len(trackers["general"].buffers()) == 3
    # a third microbatch where two were declared: no estimate for that step, and no crash
    noise = trackers["pair"]
    noise.reset()
    _accumulate(ps["pair"], noise, [torch.randn(shape) for _ in range(3)])
    assert noise.variance() == {}
    noise.reset()
    _accumulate(ps["pair"], noise, [torch.randn(shape) for _ in range(2)])
    assert set(noise.variance()) == {"w"}


def test_a_state_round_trip_continues_bit_for_bit():
    torch.manual_seed(4)
    runs = []
    for split in (False, True):
        torch.manual_seed(4)
        p = torch.nn.Parameter(torch.zeros(5, 4))
        opt = torch.optim.AdamW([p], lr=1e-3, betas=(0.9, 0.95))
        noise = MicrobatchNoise({"w": p}, 4, microbatches=2)
        for step in range(4):
            if split and step == 2:  # a restart: a new tracker and optimizer from the saved states
                saved_opt, saved = opt.state_dict(), noise.state_dict()
                opt = torch.optim.AdamW([p], lr=1e-3, betas=(0.9, 0.95))
                opt.load_state_dict(saved_opt)
                noise = MicrobatchNoise({"w": p}, 2, microbatches=2)
                noise.load_state_dict(saved)
                noise.replicas = 4
            noise.reset()
            _accumulate(p, noise, [torch.randn(5, 4) * 0.1 for _ in range(2)])
            _step(opt, noise, noise.variance())
        runs.append((p.detach().clone(), opt.state[p]["exp_avg_sq"].clone()))
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])


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
    noise = MicrobatchNoise({"w": corr}, replicas=x, microbatches=m)
    for _ in range(steps):
        mbs = [mu + s2 ** 0.5 * torch.randn(n) for _ in range(m)]
        noise.reset()
        _accumulate(corr, noise, mbs)
        plain.grad = corr.grad.clone()
        opt_plain.step()
        _step(opt_corr, noise, noise.variance())
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


def test_a_bf16_second_moment_is_corrected_like_an_fp32_one():
    """Parameters (and so AdamW's state) in bf16: the tracker's buffers stay fp32 and the corrected v is written
    back in bf16, within bf16's rounding of the fp32 run's."""
    vs = []
    for dtype in (torch.float32, torch.bfloat16):
        torch.manual_seed(5)
        p = torch.nn.Parameter(torch.zeros(30, 20, dtype=dtype))
        opt = torch.optim.AdamW([p], lr=1e-3, betas=(0.9, 0.95))
        noise = MicrobatchNoise({"w": p}, 2, microbatches=2)
        for _ in range(4):
            noise.reset()
            _accumulate(p, noise, [(torch.randn(30, 20) * 0.1 + 0.05).to(dtype) for _ in range(2)])
            assert _step(opt, noise, noise.variance()) == 1
        assert opt.state[p]["exp_avg_sq"].dtype == dtype and noise.ema_var["w"].dtype == torch.float32
        vs.append(opt.state[p]["exp_avg_sq"].float())
    assert torch.allclose(vs[1], vs[0], rtol=0.08, atol=1e-9)


def test_a_long_bf16_run_keeps_the_group_batch_target():
    """With bf16 state AdamW's own update of v rounds away (1 - beta2) g^2 once v is large enough, so A is kept
    in fp32 there (rebuilt from v it came out 4.5x too large at beta2 = 0.999): pure noise of per-microbatch
    variance 1 at X = 2 lands on the group batch's 0.25, as in fp32."""
    torch.manual_seed(6)
    n, beta2 = 2000, 0.999
    means = {}
    for dtype in (torch.float32, torch.bfloat16):
        p = torch.nn.Parameter(torch.zeros(n, dtype=dtype))
        opt = torch.optim.AdamW([p], lr=0.0, betas=(0.9, beta2))
        noise = MicrobatchNoise({"w": p}, 2, microbatches=2)
        gen = torch.Generator().manual_seed(7)
        for _ in range(3000):
            noise.reset()
            _accumulate(p, noise, [torch.randn(n, generator=gen).to(dtype) for _ in range(2)])
            _step(opt, noise, noise.variance())
        means[dtype] = float(opt.state[p]["exp_avg_sq"].float().mean())
    # the EMA started from zero 3000 steps ago: 1 - 0.999^3000 = 95 % of the way
    assert means[torch.float32] == pytest.approx(0.25 * (1 - beta2 ** 3000), rel=0.05)
    assert means[torch.bfloat16] == pytest.approx(means[torch.float32], rel=0.03)


def test_a_failed_step_lets_the_pending_estimates_lapse():
    """An optimizer step that raises after before_step: B already holds the step's estimate and v is whatever
    the failed step left, so A cannot be rebuilt; the tensors' EMAs lapse and restart from AdamW's v."""
    torch.manual_seed(8)
    p = torch.nn.Parameter(torch.zeros(6, 4))
    opt = torch.optim.AdamW([p], lr=1e-3, betas=(0.9, 0.95))
    noise = MicrobatchNoise({"w": p}, 2, microbatches=2)
    for fail in (False, True, False):
        noise.reset()
        _accumulate(p, noise, [torch.randn(6, 4) * 0.1 for _ in range(2)])
        if fail:
            noise.before_step(opt, noise.variance())
            noise.reset()  # what the worker does when optimizer.step raises
            assert noise.ema_var == {}
            continue
        var = noise.variance()["w"].clone()
        v_before = opt.state[p]["exp_avg_sq"].clone() if opt.state.get(p) else torch.zeros(6, 4)
        g = p.grad.clone()
        assert _step(opt, noise, noise.variance()) == 1
    a = 0.95 * v_before + 0.05 * g.square()  # restarted: A from AdamW's v, B from this step's estimate
    want = torch.maximum(a - 0.5 * 0.05 * var, a / 4)
    assert torch.allclose(opt.state[p]["exp_avg_sq"], want, rtol=1e-5, atol=1e-12)

