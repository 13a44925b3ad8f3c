"""``mask.reference_refresh``: the mesh's reference follows training (the DP start weights, or without DP the live
weights of its one replica) instead of staying the pretrained model."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from meshnode.compression.quant import quantized_nbytes
from meshnode.config import ConfigError
from meshnode.mesh import MeshTrainer
from meshnode.mesh.refresh import followers, low_rank_step
from meshnode.stage import MapStore, ResidualMap
from meshnode.stage.reference import CODE_TENSORS, MAP_TENSORS, PayloadError

BASE = ("train.eval_every=0", "model.stages=3", "train.lr=3e-3", "train.warmup_steps=0", "mask.codec=rotq",
        "mask.bits=1", "mask.reference=both", "train.bf16=false")


def _params(module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in module.named_parameters()}


def test_the_peers_that_need_a_stage_when_the_reference_moves():
    """A peer's reference computes the stages before each boundary it touches (and with ``both`` those after):
    3 stages forward: stage 0 is computed by stages 1 and 2, stage 1 by stage 2, stage 2 by none; with ``both`` the
    later stages are computed by the earlier ones too."""
    assert [followers(s, 3, "forward") for s in range(3)] == [2, 1, 0]
    assert [followers(s, 3, "both") for s in range(3)] == [2, 2, 2]
    assert [followers(s, 2, "both") for s in range(2)] == [1, 1]


def test_without_dp_the_reference_takes_the_live_weights_every_k_steps(tiny_cfg, cache_dir):
    """Refresh every 2 steps, one replica: after steps 2 and 4 the reference holds the weights then trained (not the
    pretrained ones), in between it keeps the last; each refresh counts a bfloat16 copy of each stage for every peer
    whose reference computes it; and with a moved reference the residual a boundary codes is smaller than against
    the pretrained model."""
    fixed = MeshTrainer(tiny_cfg(*BASE), cache_dir)
    t = MeshTrainer(tiny_cfg(*BASE, "mask.reference_refresh=2"), cache_dir)
    pretrained = [_params(m) for m in t.reference.stages]
    sizes = [sum(p.numel() * 2 for p in w.module.parameters()) for w in t.workers[0]]
    per_refresh = sum(size * followers(s, 3, "both") for s, size in enumerate(sizes))
    want = pretrained
    for step in range(5):
        t.train_step()
        fixed.train_step()
        if (step + 1) % 2 == 0:  # moved after steps 2 and 4, to the weights then trained
            want = [_params(w.module) for w in t.workers[0]]
        held = [_params(m) for m in t.reference.stages]
        for h, w in zip(held, want):
            for n in h:
                torch.testing.assert_close(h[n], w[n], rtol=0, atol=0)
        assert t.counter.snapshot()["ref"] == per_refresh * ((step + 1) // 2)
    assert t.refresh.refreshes == 2
    assert fixed.counter.snapshot()["ref"] == 0
    # the live model moved from the pretrained one; the reference after step 4 is one step behind it
    ids = t.sources[0].batch(100)
    for trainer in (t, fixed):
        trainer.reference._acts.clear()
    with torch.no_grad():
        out = t.workers[0][0].eval_forward(ids).float()
    moved = (out - t.reference.activation("k", ids, 0)).norm()
    pre = (out - fixed.reference.activation("k", ids, 0)).norm()
    print(f"boundary 0 residual against the moved reference {float(moved):.4g}, the pretrained {float(pre):.4g}")
    assert moved < 0.5 * pre


def test_a_low_rank_refresh_moves_each_matrix_by_its_best_rank_r_step(tiny_cfg, cache_dir):
    """``mask.reference_refresh_rank = 1`` (no DP): each refresh moves every matrix of the reference by the best
    rank-1 approximation of its distance from the live weights (two refreshes: rank 2 from the pretrained model),
    every vector all the way; the ``ref`` axis counts the factors (rows + columns a matrix, bf16) and the vectors
    for every follower; and the reference ends closer to the live weights than the pretrained model is, farther
    than the whole copy."""
    t = MeshTrainer(tiny_cfg(*BASE, "mask.reference_refresh=2", "mask.reference_refresh_rank=1"), cache_dir)
    pretrained = [_params(m) for m in t.reference.stages]

    def factor_bytes(stage: dict[str, torch.Tensor]) -> int:
        return sum((t_.shape[0] + t_.shape[1]) * 2 if t_.dim() == 2 and min(t_.shape) > 1 else t_.numel() * 2
                   for t_ in stage.values())

    per_refresh = sum(factor_bytes(p_) * followers(s, 3, "both") for s, p_ in enumerate(pretrained))
    before = pretrained
    matrices = 0
    for move in (1, 2):
        t.train_step()
        t.train_step()
        live = [_params(w.module) for w in t.workers[0]]
        held = [_params(m) for m in t.reference.stages]
        for s in range(3):
            for n, h in held[s].items():
                if h.dim() == 2:
                    _assert_best_rank1_step(h, before[s][n], live[s][n], 2 ** -8)
                    # from the pretrained model: at most one rank a refresh
                    assert torch.linalg.matrix_rank((h - pretrained[s][n]).double(), rtol=1e-6) <= move
                    matrices += 1
                else:  # its change, in bfloat16
                    torch.testing.assert_close(h, live[s][n], rtol=2 ** -8, atol=1e-6)
        assert t.counter.snapshot()["ref"] == per_refresh * move
        before = held
    assert matrices > 0 and t.refresh.refreshes == 2

    def distance(ws) -> float:
        return sum(float((live[s][n] - w[n]).float().square().sum()) for s, w in enumerate(ws) for n in w) ** 0.5

    assert 0 < distance(held) < distance(pretrained)
    with pytest.raises(ConfigError, match="reference_refresh_rank"):
        tiny_cfg(*BASE, "mask.reference_refresh_rank=1")


def _assert_best_rank1_step(held: torch.Tensor, before: torch.Tensor, live: torch.Tensor, rel: float) -> None:
    """``held - before`` is the best rank-1 approximation of ``live - before`` up to the wire's rounding (``rel`` of
    the step's largest value), and exactly of rank 1."""
    u, sv, vh = torch.linalg.svd((live - before).float(), full_matrices=False)
    best = sv[0] * torch.outer(u[:, 0], vh[0])
    step = held.float() - before.float()
    assert float((step - best).abs().max()) <= 2 * rel * float(best.abs().max()) + 1e-7
    assert torch.linalg.matrix_rank(step.double(), rtol=1e-6) <= 1


def test_with_dp_each_chain_moves_its_own_reference_towards_its_own_weights(tiny_cfg, cache_dir):
    """Two replicas under DP (a round every 3 steps), a rank-1 refresh every 2: each chain codes against its own
    reference, which each refresh moves by the best rank-1 step towards that chain's live weights (the chains
    trained on different batches, so their references differ); the ``ref`` axis counts those factors for every
    follower in each chain and nothing for the DP rounds; and the references' state loads into a fresh run."""
    dp = ("dp.enabled=true", "dp.replicas=2", "dp.inner_steps=3", "dp.fragments=1")
    t = MeshTrainer(tiny_cfg(*BASE, *dp, "mask.reference_refresh=2", "mask.reference_refresh_rank=1"), cache_dir)
    plain = MeshTrainer(tiny_cfg(*BASE, *dp), cache_dir)
    assert len(t.references) == 2 and t.references[0] is not t.references[1]
    assert all(w.reference is t.references[r] for r, chain in enumerate(t.workers) for w in chain)
    pretrained = [_params(m) for m in t.reference.stages]
    per_refresh = sum(sum((p_.shape[0] + p_.shape[1]) * 2 if p_.dim() == 2 and min(p_.shape) > 1 else p_.numel() * 2
                          for p_ in stage.values()) * followers(s, 3, "both") for s, stage in enumerate(pretrained))
    before = [pretrained, pretrained]
    for move in (1, 2):  # after steps 2 and 4 (a DP round after step 3 in between)
        t.train_step()
        t.train_step()
        plain.train_step()
        plain.train_step()
        held = [[_params(m) for m in ref.stages] for ref in t.references]
        for r in range(2):
            live = [_params(w.module) for w in t.workers[r]]
            for s in range(3):
                for n, h in held[r][s].items():
                    if h.dim() == 2:
                        _assert_best_rank1_step(h, before[r][s][n], live[s][n], 2 ** -8)
                    else:
                        torch.testing.assert_close(h, live[s][n], rtol=2 ** -8, atol=1e-6)
        differ = sum(float((held[0][s][n] - held[1][s][n]).abs().max()) for s in range(3) for n in held[0][s])
        assert differ > 0
        snap = t.counter.snapshot()
        assert snap["ref"] == 2 * per_refresh * move
        before = held
    assert snap["dp"] == plain.counter.snapshot()["dp"] > 0
    state = t.refresh.state_dict()
    fresh = MeshTrainer(tiny_cfg(*BASE, *dp, "mask.reference_refresh=2", "mask.reference_refresh_rank=1"), cache_dir)
    fresh.refresh.load_state_dict(state)
    assert fresh.refresh.refreshes == 2
    for r in range(2):
        for s, m in enumerate(fresh.references[r].stages):
            for n, p in m.named_parameters():
                assert torch.equal(p, held[r][s][n])
    one = MeshTrainer(tiny_cfg(*BASE, "mask.reference_refresh=2", "mask.reference_refresh_rank=1"), cache_dir)
    with pytest.raises(ValueError, match="2 references"):
        one.refresh.load_state_dict(state)
    one.refresh.load_state_dict({"refreshes": 1, "weights": state["weights"][1]})  # the one-reference form
    for s, m in enumerate(one.reference.stages):
        for n, p in m.named_parameters():
            assert torch.equal(p, held[1][s][n])


def test_with_dp_the_reference_takes_the_start_weights_and_counts_the_rounds(tiny_cfg, cache_dir):
    """Two replicas under DP (a round every 2 steps), refresh every 2: the reference holds each stage's start
    weights (what the rounds left every replica with), and the ``ref`` axis counts, per round, one replica's share
    for every peer whose reference computes the stage (here ``both`` on 3 stages: 2 per stage, 2 replicas)."""
    dp = ("dp.enabled=true", "dp.replicas=2", "dp.inner_steps=2", "dp.fragments=1")
    t = MeshTrainer(tiny_cfg(*BASE, *dp, "mask.reference_refresh=2"), cache_dir)
    plain = MeshTrainer(tiny_cfg(*BASE, *dp), cache_dir)
    for _ in range(4):
        t.train_step()
        plain.train_step()
    for s, m in enumerate(t.reference.stages):
        start = t.dp.outer[s].start
        for n, p in m.named_parameters():
            torch.testing.assert_close(p, start[n].to(p.dtype), rtol=0, atol=0)
    snap = t.counter.snapshot()
    assert snap["dp"] == plain.counter.snapshot()["dp"] > 0
    # 2 replicas send alike-sized factors: the rounds' share for 2 followers of each stage x 2 replicas = 2 x dp
    assert snap["ref"] == 2 * snap["dp"]
    with pytest.raises(ConfigError, match="reference_refresh"):
        tiny_cfg(*BASE, "dp.replicas=2", "mask.reference_refresh=2")
    with pytest.raises(ConfigError, match="reference_refresh"):
        tiny_cfg("mask.reference_refresh=2")


def test_a_refresh_drops_the_maps_both_ends_and_keeps_the_codes(tiny_cfg, cache_dir):
    """Maps and codes fitted every 3 steps (the first after 2) and a refresh every 3: right after a refresh neither
    end holds a map (both predict zero), the transform codes stay, the statistics start afresh, and training goes on
    decoding what was sent (the next fit, 2 steps later, ships)."""
    cfg = tiny_cfg(*BASE, "mask.reference_refresh=3", "mask.reference_map_rank=4", "mask.reference_map_period=3",
                   "mask.reference_map_first=2", "mask.reference_code_bits=64", "mask.reference_grad_code_bits=32")
    t = MeshTrainer(cfg, cache_dir)
    t.train_step()
    t.train_step()  # fit 1 after step 2 (step 1 trained from the pretrained weights: no residual)
    w0, w1 = t.workers[0][0], t.workers[0][1]
    assert w0.map_out.version == 1 and w0.map_out.u is not None
    t.train_step()  # shipped with step 3's payloads; refresh after step 3
    assert t.refresh.refreshes == 1
    assert w0.map_out.version == 1 and w0.map_out.u is None and w0.map_out.transform is not None
    assert w0.map_out.tokens == 0 and w1.gcode_out.tokens == 0 and w1.gcode_out.transform is not None
    assert w1.map_in.maps and all(f.u is None and f.transform is not None for f in w1.map_in.maps.values())
    h = torch.randn(2, 3, w0.map_out.hidden)
    assert torch.equal(w0.map_out.predict(h), torch.zeros_like(h))
    t.train_step()
    t.train_step()  # fit 2 after step 5, from steps 4 and 5 alone
    assert w0.map_out.version == 2 and w0.map_out.u is not None
    t.train_step()  # fit 2 went with step 6's payloads; the refresh after step 6 dropped its map both ends
    assert (w0.map_out.sender, 2) in w1.map_in.maps and w1.map_in.maps[(w0.map_out.sender, 2)].u is None
    assert all(map(math.isfinite, t.losses)) and t.refresh.refreshes == 2


def test_a_fit_not_yet_shipped_is_withdrawn_when_the_reference_moves():
    """A fit made at the step the reference moves never reached the receiver and was solved against the old
    reference: the sender goes back to the version before it (without its map); a map-only fit leaves nothing."""
    gen = torch.Generator().manual_seed(0)
    m = ResidualMap(16, 2, code_bits=16, sender=7)
    store = MapStore(16, 2, code_bits=16)
    from meshnode.compression import EncodedPayload

    def fit():
        for _ in range(4):
            m.observe(torch.randn(4, 8, 16, generator=gen), torch.randn(4, 8, 16, generator=gen))
        assert m.refit(), m.refit_error

    fit()
    store.take(m.attach(EncodedPayload("rotq", "activation", (1, 1, 16), "float32", {})))
    fit()
    assert m.version == 2 and not m.shipped
    m.forget_map()
    store.forget_maps()
    assert m.version == 1 and m.shipped and m.u is None and m.transform is not None
    assert set(store.maps) == {(7, 1)} and store.maps[(7, 1)].u is None
    only_map = ResidualMap(16, 2, sender=8)
    for _ in range(4):
        only_map.observe(torch.randn(4, 8, 16, generator=gen), torch.randn(4, 8, 16, generator=gen))
    assert only_map.refit()
    only_map.shipped = True
    only_map.forget_map()
    assert only_map.current is None
    assert only_map.attach(EncodedPayload("rotq", "activation", (1, 1, 16), "float32", {})).meta == {}


def test_a_fit_whose_map_a_move_withdrew_reaches_a_new_receiver_as_its_code():
    """A sender restored from a state taken after a move and before its next fit (a swarm peer's restart, or a
    chain that took another chain's state) holds a fit without a map, under a new sender id: a receiver that never
    held it takes the code alone and decodes what the sender coded with it; a payload that carries half a map is
    still refused."""
    gen = torch.Generator().manual_seed(1)
    m = ResidualMap(16, 2, code_bits=16, sender=7, fit_bits=8)
    for _ in range(4):
        m.observe(torch.randn(4, 8, 16, generator=gen), torch.randn(4, 8, 16, generator=gen))
    assert m.refit(), m.refit_error
    from meshnode.compression import BoundaryContext, EncodedPayload, RotQuantCodec

    m.attach(EncodedPayload("rotq", "activation", (1, 1, 16), "float32", {}))  # shipped to its first receiver
    m.forget_map()
    restored = ResidualMap(16, 2, code_bits=16, fit_bits=8)
    restored.load_state_dict(m.state_dict())
    restored.sender = 9  # what load_fit_state(fresh_sender=True) does
    codec = RotQuantCodec(1)
    x = torch.randn(2, 8, 16, generator=gen)
    sent = restored.attach(codec.encode(x, BoundaryContext(transform=restored.transform)), ship=True)
    assert not set(MAP_TENSORS) & set(sent.tensors) and CODE_TENSORS[0] in sent.tensors
    store = MapStore(16, 2, code_bits=16, fit_bits=8)
    plain, key = store.take(sent)
    assert key == (9, 1) and store.maps[key].u is None
    torch.testing.assert_close(codec.decode(plain, BoundaryContext(transform=store.maps[key].transform)),
                               codec.decode(plain, BoundaryContext(transform=restored.transform)), rtol=0, atol=0)
    for _ in range(4):
        m.observe(torch.randn(4, 8, 16, generator=gen), torch.randn(4, 8, 16, generator=gen))
    assert m.refit(), m.refit_error
    whole = m.attach(codec.encode(x, BoundaryContext(transform=m.transform)), ship=True)
    half = {k: t for k, t in whole.tensors.items() if k != MAP_TENSORS[1]}
    with pytest.raises(PayloadError, match="must carry"):
        MapStore(16, 2, code_bits=16, fit_bits=8).take(dataclasses.replace(whole, tensors=half))


def test_a_bad_reference_weight_is_refused_and_changes_nothing(tiny_cfg, cache_dir):
    t = MeshTrainer(tiny_cfg(*BASE, "mask.reference_refresh=2"), cache_dir)
    held = [_params(m) for m in t.reference.stages]
    bad = [_params(m) for m in t.reference.stages]
    name = next(iter(bad[1]))
    for broken, match in ((dict(bad[1], **{name: bad[1][name][:1]}), "do not match"),
                          (dict(bad[1], **{name: bad[1][name] * float("nan")}), "not finite")):
        with pytest.raises(ValueError, match=match):
            t.reference.load_weights([bad[0], broken, bad[2]])
    with pytest.raises(ValueError, match="2 stages"):
        t.reference.load_weights(bad[:2])
    for h, m in zip(held, t.reference.stages):
        for n, p in m.named_parameters():
            assert torch.equal(p, h[n])


def test_resume_with_a_moved_reference_is_bit_identical(tiny_cfg, cache_dir, tmp_path):
    """The checkpoint holds the reference's weights: a run resumed between two refreshes codes against the same
    reference and trains bit for bit as the uninterrupted one."""
    cfg = tiny_cfg(*BASE, "train.steps=7", "mask.reference_refresh=3", "mask.reference_map_rank=4",
                   "mask.reference_map_period=3", "mask.reference_map_first=2", "mask.reference_code_bits=64")
    straight = MeshTrainer(cfg, cache_dir)
    straight.train()
    first = MeshTrainer(cfg, cache_dir)
    first.train(until=5, checkpoint_dir=tmp_path / "ckpt")  # after a refresh, before the next fit
    resumed = MeshTrainer(cfg, cache_dir)
    resumed.load_checkpoint(tmp_path / "ckpt")
    assert resumed.refresh.refreshes == 1
    resumed.train()
    assert resumed.losses == straight.losses
    assert resumed.counter.snapshot()["ref"] == straight.counter.snapshot()["ref"] > 0


def test_an_8_bit_refresh_sends_int8_factors_and_half_the_bytes(tiny_cfg, cache_dir):
    """``mask.reference_refresh_bits = 8``: each matrix moves by its best rank-1 step as int8 factors with a float32
    scale a column (within the int8 rounding of the bfloat16 run's step), the ``ref`` axis counts those codes and
    scales (vectors whole in bfloat16) and is about half the bfloat16 run's; bad bits are refused."""
    cfg = (*BASE, "mask.reference_refresh=2", "mask.reference_refresh_rank=1")
    wide = MeshTrainer(tiny_cfg(*cfg), cache_dir)
    narrow = MeshTrainer(tiny_cfg(*cfg, "mask.reference_refresh_bits=8"), cache_dir)
    pretrained = [_params(m) for m in narrow.reference.stages]
    for t in (wide, narrow):
        t.train_step()
        t.train_step()
    live = [_params(w.module) for w in narrow.workers[0]]
    held = [_params(m) for m in narrow.reference.stages]
    factors = vectors = 0
    for s in range(3):
        for n, h in held[s].items():
            if h.dim() == 2 and min(h.shape) > 1:
                _assert_best_rank1_step(h, pretrained[s][n], live[s][n], 1 / 127)
                factors += (quantized_nbytes(1, h.shape[0], 8) + quantized_nbytes(1, h.shape[1], 8)) * followers(s, 3,
                                                                                                                "both")
            else:
                vectors += h.numel() * 2 * followers(s, 3, "both")
    got, bf16 = narrow.counter.snapshot()["ref"], wide.counter.snapshot()["ref"]
    print(f"ref bytes a refresh: int8 {got}, bfloat16 {bf16}")
    assert got == factors + vectors
    assert got < 0.6 * bf16
    with pytest.raises(ConfigError, match="reference_refresh_bits"):
        tiny_cfg(*cfg, "mask.reference_refresh_bits=4")
    with pytest.raises(ConfigError, match="reference_refresh_bits"):
        tiny_cfg(*BASE, "mask.reference_refresh=2", "mask.reference_refresh_bits=8")
    with pytest.raises(ValueError, match="16 .bfloat16. or 8"):
        low_rank_step(held[0], live[0], 1, bits=4)
