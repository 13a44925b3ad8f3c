"""PowerSGD with error feedback: exact where the rank suffices, convergent where it does not, replicas agree."""

from __future__ import annotations

import pytest
import torch

from meshnode.compression import (
    ByteCounter,
    PowerSGDState,
    compressed_rank,
    orthonormalize,
    orthonormalize_all,
    powersgd_allreduce,
    powersgd_decode,
)


def _randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def test_compressed_rank_rule():
    assert compressed_rank((64,), 4) == 0  # 1-D: uncompressed
    assert compressed_rank((64, 48), 4) == 4
    assert compressed_rank((8, 8), 4) == 0  # 4 * 16 >= 64: does not pay
    assert compressed_rank((8, 8), 3) == 3  # 3 * 16 < 64
    assert compressed_rank((64, 48), 100) == 0  # capped at 48: 48 * 112 >= 64 * 48
    assert compressed_rank((16, 4, 8), 2) == 2  # viewed as (16, 32)


def test_orthonormalize():
    p = _randn(50, 6)
    q = orthonormalize(p)
    assert torch.allclose(q.T @ q, torch.eye(6), atol=1e-5)
    # same span: projecting p onto q's columns recovers p
    assert torch.allclose(q @ (q.T @ p), p, atol=1e-4)
    # a dependent column becomes zero instead of amplified noise
    p[:, 3] = p[:, 0] * 2 - p[:, 1]
    q = orthonormalize(p)
    assert float(q[:, 3].norm()) == 0.0
    assert torch.allclose(q[:, [0, 1, 2, 4, 5]].T @ q[:, [0, 1, 2, 4, 5]], torch.eye(5), atol=1e-5)


def test_orthonormalize_all_batches_by_shape():
    """The batched form equals each matrix's own, whatever the order the factors come in."""
    shapes = {"a": (50, 6), "b": (30, 6), "c": (50, 6), "d": (50, 4), "e": (50, 6)}
    ps = {n: _randn(*s, seed=i) for i, (n, s) in enumerate(shapes.items())}
    ps["c"][:, 2] = ps["c"][:, 0] - ps["c"][:, 1]  # a dependent column inside a batch: zero there, only there
    out = orthonormalize_all(ps)
    assert list(out) == list(ps)
    for n, p in ps.items():
        torch.testing.assert_close(out[n], orthonormalize(p), rtol=0, atol=1e-6)
    assert float(out["c"][:, 2].norm()) == 0.0 and float(out["a"][:, 2].norm()) > 0.99
    shuffled = orthonormalize_all({n: ps[n] for n in reversed(list(ps))})
    assert all(torch.equal(shuffled[n], out[n]) for n in ps)  # bit for bit: every peer batches alike


def test_exact_after_one_round_when_rank_suffices():
    # each replica's update lies in a shared rank-3 column space; rank 3 recovers the mean exactly
    basis = _randn(40, 3, seed=1)
    replicas = [{"w": basis @ _randn(3, 30, seed=10 + i), "b": _randn(30, seed=20 + i)} for i in range(3)]
    states = [PowerSGDState(rank=3) for _ in range(3)]
    outs, sent = powersgd_allreduce(states, replicas)
    assert sent == [s.last_bytes for s in states]
    mean_w = torch.stack([r["w"] for r in replicas]).mean(0)
    mean_b = torch.stack([r["b"] for r in replicas]).mean(0)
    for out in outs:
        assert torch.allclose(out["w"], mean_w, atol=1e-4)
        assert torch.allclose(out["b"], mean_b)  # 1-D: passed through, averaged
    for s in states:
        assert float(s.errors["w"].norm()) < 1e-3 * float(mean_w.norm())
        assert "b" not in s.errors


def test_full_rank_passes_through_exactly():
    replicas = [{"w": _randn(12, 10, seed=i)} for i in range(2)]
    states = [PowerSGDState(rank=10) for _ in range(2)]
    outs, _ = powersgd_allreduce(states, replicas)
    assert torch.equal(outs[0]["w"], (replicas[0]["w"] + replicas[1]["w"]) / 2)
    assert states[0].last_bytes == 12 * 10 * 4


def test_low_rank_is_not_exact_in_one_round():
    # the other side of the tests above: a full-rank matrix at rank 4 is only approximated
    g = {"w": _randn(64, 48, seed=3)}
    out = powersgd_allreduce([PowerSGDState(rank=4)], [g])[0][0]
    rel = float((out["w"] - g["w"]).norm() / g["w"].norm())
    assert 0.3 < rel < 1.0


def _run_rounds(quantize: bool, rounds: int, replicas: int = 3) -> tuple[list[float], list[float]]:
    """Accumulated applied update against the accumulated true (mean) update, per round.

    The true update has a decaying spectrum (as pseudo-gradients do), drifts slowly, and each replica
    sees it plus its own full-rank noise. Returns (relative error, absolute error) after each round.
    """
    u = torch.linalg.qr(_randn(64, 48, seed=1)).Q
    v = torch.linalg.qr(_randn(48, 48, seed=2)).Q
    true = (u * 0.7 ** torch.arange(48.0)) @ v.T
    true = true * (10 / true.norm())
    drift = _randn(64, 48, seed=6) / 48
    states = [PowerSGDState(rank=4, quantize=quantize) for _ in range(replicas)]
    applied = torch.zeros_like(true)
    target = torch.zeros_like(true)
    rels, abss = [], []
    for t in range(rounds):
        base = true + 0.01 * t * drift
        grads = [
            {"w": base + 0.05 * _randn(64, 48, seed=1000 * t + i), "b": _randn(48, seed=7 + i)}
            for i in range(replicas)
        ]
        outs, _ = powersgd_allreduce(states, grads)
        for o in outs[1:]:
            assert torch.equal(o["w"], outs[0]["w"]) and torch.equal(o["b"], outs[0]["b"])
        applied += outs[0]["w"]
        target += torch.stack([g["w"] for g in grads]).mean(0)
        abss.append(float((applied - target).norm()))
        rels.append(abss[-1] / float(target.norm()))
    return rels, abss


@pytest.mark.parametrize("quantize", [False, True])
def test_error_feedback_converges(quantize):
    rels, abss = _run_rounds(quantize, rounds=40)
    assert rels[0] > 0.3  # one round of rank 4 on a full-rank 64 x 48 matrix is far off
    assert rels[-1] < 0.05
    assert rels[-1] < rels[9] / 2 < rels[0] / 4  # and it keeps decreasing
    assert abss[-1] < 1.5 * abss[19]  # because the residual (the error buffer) stays bounded


def test_without_error_feedback_it_does_not_converge():
    # control: drop the error buffers every round; the accumulated update stays far off
    true = _randn(64, 48, seed=5)
    state = PowerSGDState(rank=4)
    applied = torch.zeros_like(true)
    for _ in range(30):
        applied += powersgd_allreduce([state], [{"w": true}])[0][0]["w"]
        state.errors.clear()
    assert float((applied - 30 * true).norm() / (30 * true).norm()) > 0.2


def test_bytes_and_counters():
    tensors = {"w": _randn(64, 48), "b": _randn(48), "e": _randn(4, 3)}
    plain, quant = PowerSGDState(rank=4), PowerSGDState(rank=4, quantize=True)
    counters = [ByteCounter()]
    _, sent = powersgd_allreduce([plain], [tensors], counters)
    powersgd_allreduce([quant], [tensors])
    assert sent == [plain.last_bytes]
    dense_part = (48 + 12) * 4
    assert plain.last_bytes == (64 * 4 + 48 * 4) * 4 + dense_part == plain.round_bytes(tensors)
    assert quant.last_bytes == (64 * 4 + 4 * 4) + (48 * 4 + 4 * 4) + dense_part == quant.round_bytes(tensors)
    assert counters[0].snapshot()["dp"] == plain.last_bytes
    assert plain.last_bytes < 0.2 * (64 * 48 + 48 + 12) * 4


def test_replicas_start_from_the_same_q_and_phases_are_ordered():
    a, b = PowerSGDState(rank=2, seed=9), PowerSGDState(rank=2, seed=9)
    g = {"layer.w": _randn(20, 16)}
    assert torch.equal(a.phase_p(g)["layer.w"], b.phase_p(g)["layer.w"])
    c = PowerSGDState(rank=2, seed=10)
    assert not torch.equal(a.phase_p(g)["layer.w"], c.phase_p(g)["layer.w"])
    with pytest.raises(RuntimeError):
        PowerSGDState(rank=2).phase_q({})
    with pytest.raises(RuntimeError):
        PowerSGDState(rank=2).finish({})


def test_state_dict_round_trip_lets_a_replica_join():
    g1 = [{"w": _randn(32, 24, seed=i)} for i in range(2)]
    g2 = [{"w": _randn(32, 24, seed=10 + i)} for i in range(2)]
    states = [PowerSGDState(rank=2), PowerSGDState(rank=2)]
    powersgd_allreduce(states, g1)
    copies = [PowerSGDState(rank=2), PowerSGDState(rank=2)]
    for c, s in zip(copies, states, strict=True):
        c.load_state_dict(s.state_dict())
    out, _ = powersgd_allreduce(states, g2)
    assert torch.equal(out[0]["w"], powersgd_allreduce(copies, g2)[0][0]["w"])
    # control: without the loaded state (errors, warm-start Q) the round comes out differently
    cold, _ = powersgd_allreduce([PowerSGDState(rank=2), PowerSGDState(rank=2)], g2)
    assert not torch.allclose(cold[0]["w"], out[0]["w"], atol=1e-3)


def test_dtype_and_shape_preserved():
    g = {"w": _randn(16, 4, 8).to(torch.bfloat16)}
    out = powersgd_allreduce([PowerSGDState(rank=2)], [g])[0][0]
    assert out["w"].shape == (16, 4, 8) and out["w"].dtype == torch.bfloat16


@pytest.mark.parametrize("quantize", [False, True])
def test_decode_from_the_averaged_phases_equals_finish(quantize):
    """Someone who only sees the round's averages (the anchor following DP) gets what the replicas got."""
    shapes = {"w": (24, 16), "conv": (8, 2, 6), "bias": (16,)}
    states = [PowerSGDState(rank=3, quantize=quantize) for _ in range(2)]
    for rnd in range(3):  # warm-started rounds too
        g = [{n: _randn(*s, seed=100 * rnd + 10 * r + i) for i, (n, s) in enumerate(shapes.items())} for r in range(2)]
        ps = [s.phase_p(t) for s, t in zip(states, g, strict=True)]
        p_avg = {n: (ps[0][n] + ps[1][n]) / 2 for n in ps[0]}
        qs = [s.phase_q(p_avg) for s in states]
        q_avg = {n: (qs[0][n] + qs[1][n]) / 2 for n in qs[0]}
        outs = [s.finish(q_avg) for s in states]
        p_hat = {**p_avg, **orthonormalize_all({n: t for n, t in p_avg.items() if n in q_avg})}
        decoded = powersgd_decode(p_hat, q_avg, shapes, rank=3)
        assert set(decoded) == set(shapes) and "bias" not in q_avg
        for n in shapes:
            assert decoded[n].shape == outs[0][n].shape
            torch.testing.assert_close(decoded[n], outs[0][n], rtol=0, atol=1e-6)
    # factors of another rank, a missing or unknown factor, a dense tensor cut short: refused
    bad = [({**p_hat, "w": torch.zeros(24, 5)}, q_avg), (p_hat, {**q_avg, "w": torch.zeros(16, 5)}),
           ({k: v for k, v in p_hat.items() if k != "w"}, q_avg), ({**p_hat, "x": torch.zeros(3)}, q_avg),
           ({**p_hat, "bias": torch.zeros(15)}, q_avg), (p_hat, {**q_avg, "bias": torch.zeros(16, 3)})]
    for p, q in bad:
        with pytest.raises(ValueError):
            powersgd_decode(p, q, shapes, rank=3)


@pytest.mark.parametrize("quantize", [False, True])
def test_keep_residual_puts_each_replicas_unsent_progress_in_its_weights(quantize):
    # two replicas moved from a shared start s by full-rank steps; a rank-2 round sends only part of them
    s = {"w": _randn(64, 48, seed=20), "b": _randn(48, seed=21)}
    moved = [{n: t - 0.1 * _randn(*t.shape, seed=30 + i + (5 if n == "b" else 0)) for n, t in s.items()}
             for i in range(2)]
    states = [PowerSGDState(rank=2, quantize=quantize) for _ in range(2)]
    outs, _ = powersgd_allreduce(states, [{n: s[n] - x[n] for n in s} for x in moved])
    errors = [st.errors["w"].clone() for st in states]
    assert errors[0].norm() > 0.5 * (s["w"] - moved[0]["w"]).norm()  # most of a full-rank step is not sent
    params = [{n: s[n] - outs[0][n] for n in s} for _ in range(2)]  # plain averaging: every replica at the new start
    for st, p in zip(states, params):
        st.keep_residual(p, ["w", "b"])
    for p, e, st in zip(params, errors, states):
        assert torch.allclose(p["w"], s["w"] - outs[0]["w"] - e, atol=1e-6)
        assert not st.errors["w"].any()  # the next pseudo-gradient (start - weights) holds it now
    assert not torch.equal(params[0]["w"], params[1]["w"])  # each keeps its own residual
    for n in s:  # and their mean is the exact average of the weights the replicas reached
        assert torch.allclose((params[0][n] + params[1][n]) / 2, (moved[0][n] + moved[1][n]) / 2, atol=1e-5), n
    # the next round sends the residual: start - weights = error, and error feedback does not count it twice
    nxt = {n: s[n] - outs[0][n] - params[0][n] for n in s}
    assert torch.allclose(nxt["w"], errors[0], atol=1e-6) and not nxt["b"].any()
