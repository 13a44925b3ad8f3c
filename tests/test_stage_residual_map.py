"""The residual map of reference coding (``mask.reference_map_rank``): the sender predicts the boundary's change
from the pretrained value itself and codes what the prediction misses."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from meshnode.compression import PayloadError, make_codec
from meshnode.config import ConfigError
from meshnode.mesh import CheckpointError, MeshTrainer
from meshnode.stage import MapStore, MicrobatchId, ResidualMap
from meshnode.stage.reference import MAP_META, MAP_TENSORS, apply_map, map_bytes

H = 32


def _planted(gen, true_map, n=4):
    """(h_ref, residual): h_ref with one huge channel and a per-microbatch offset; the residual a linear
    function of the centred h_ref plus noise plus its own offset."""
    x = torch.randn(n, 16, H, generator=gen)
    x[..., 3] *= 100.0  # a "massive activation" channel
    x = x + torch.randn(H, generator=gen)
    xc = x - x.reshape(-1, H).mean(0)
    r = xc @ true_map + 0.01 * torch.randn(n, 16, H, generator=gen) + torch.randn(H, generator=gen)
    return x, r


def _centred_err(pred, r):
    rc = r - r.reshape(-1, H).mean(0)
    return float((pred - rc).norm() / rc.norm())


def test_the_map_recovers_a_planted_low_rank_linear_residual():
    gen = torch.Generator().manual_seed(0)
    true_map = torch.randn(H, 4, generator=gen) @ torch.randn(4, H, generator=gen) / H
    true_map[3] /= 100.0  # the huge channel's row scaled down so that every channel matters alike
    m = ResidualMap(H, 4)
    x, r = _planted(gen, true_map, n=1)
    assert torch.equal(m.predict(x), torch.zeros_like(x))  # nothing before the first fit
    m.observe(x, r)
    assert not m.refit() and m.version == 0  # 16 tokens < 2 H: too few, no map
    for _ in range(10):
        m.observe(*_planted(gen, true_map))
    assert m.refit() and m.version == 1 and m.tokens == 0
    x, r = _planted(gen, true_map)  # fresh microbatch
    assert _centred_err(m.predict(x), r) < 0.05
    low = ResidualMap(H, 1)  # rank 1 of a rank-4 map explains only part of it
    for _ in range(10):
        low.observe(*_planted(gen, true_map))
    low.refit()
    assert 0.2 < _centred_err(low.predict(x), r) < 1.0


def test_a_decayed_fit_follows_the_latest_steps():
    """``ResidualMap.decay``: with the statistics decayed between steps, a fit follows the map of the steps just
    before it (the relation changed half-way, as training moves it); undecayed, it fits their mix."""
    gen = torch.Generator().manual_seed(1)
    old, new = (torch.randn(H, 4, generator=gen) @ torch.randn(4, H, generator=gen) / H for _ in range(2))
    old[3] /= 100.0
    new[3] /= 100.0
    fits = {}
    for factor in (1.0, 0.3):
        m = ResidualMap(H, 8)
        for step in range(6):
            for _ in range(4):
                m.observe(*_planted(gen, old if step < 3 else new))
            if step < 5:
                m.decay(factor)
        assert m.refit()
        fits[factor] = m
    x, r_new = _planted(gen, new)
    err = {f: _centred_err(m.predict(x), r_new) for f, m in fits.items()}
    assert err[0.3] < 0.15 < 0.3 < err[1.0]
    with pytest.raises(ValueError, match="decay"):
        fits[1.0].decay(0.0)


def test_a_map_travels_once_and_the_receiver_predicts_the_same():
    gen = torch.Generator().manual_seed(1)
    true_map = torch.randn(H, H, generator=gen) / H
    codec = make_codec(dataclasses.replace(_mask(), codec="rotq", bits=1))
    m, store = ResidualMap(H, 8), MapStore(H, 8)
    x, r = _planted(gen, true_map)
    plain = codec.encode(r)
    assert m.attach(plain) is plain  # no map yet: the payload is the codec's own
    for _ in range(10):
        m.observe(*_planted(gen, true_map))
    m.refit()
    first, second = m.attach(codec.encode(r)), m.attach(codec.encode(r))
    assert first.nbytes() - plain.nbytes() == map_bytes(H, 8)
    assert second.nbytes() == plain.nbytes() and second.meta[MAP_META] == first.meta[MAP_META] == [m.sender, 1]
    stripped, key = store.take(first)
    assert key == (m.sender, 1) and stripped.meta == plain.meta and set(stripped.tensors) == set(plain.tensors)
    torch.testing.assert_close(store.predict(key, x), m.predict(x), rtol=0, atol=0)
    assert store.take(second)[1] == key
    with pytest.raises(KeyError, match="never received"):
        store.predict((m.sender, 2), x)
    with pytest.raises(KeyError, match="never received"):  # another sender's version 1 is another map
        store.predict((m.sender + 1, 1), x)
    # a swarm host ships per peer: the same version again, for another receiver
    again = m.attach(codec.encode(r), ship=True)
    assert again.nbytes() == first.nbytes()
    other = MapStore(H, 8)
    assert other.take(again)[1] == key and key in other.maps


def _fitted_payload(seed: int, batches: int, shape=(2, 4, H)):
    """(a rank-4 map fitted on ``batches`` planted microbatches, a 1-bit payload naming and carrying it)."""
    gen = torch.Generator().manual_seed(seed)
    m = ResidualMap(H, 4)
    for _ in range(batches):
        m.observe(*_planted(gen, torch.eye(H)))
    assert m.refit()
    return m, m.attach(make_codec(dataclasses.replace(_mask(), codec="rotq", bits=1)).encode(torch.randn(*shape)))


@pytest.mark.parametrize("bad", ["shape", "nan", "version", "unnamed"])
def test_a_malformed_map_is_refused(bad):
    _, p = _fitted_payload(2, 5)
    tensors, meta = dict(p.tensors), dict(p.meta)
    if bad == "shape":
        tensors[MAP_TENSORS[0]] = tensors[MAP_TENSORS[0]][:, :3]
    elif bad == "nan":
        tensors[MAP_TENSORS[1]] = torch.full_like(tensors[MAP_TENSORS[1]], float("nan"))
    elif bad == "version":
        meta[MAP_META] = [meta[MAP_META][0], True]
    else:
        del meta[MAP_META]
    store = MapStore(H, 4)
    with pytest.raises(PayloadError):
        store.take(dataclasses.replace(p, tensors=tensors, meta=meta))
    assert not store.maps


def _mask():
    from meshnode.config import MaskConfig

    return MaskConfig()


MAPPED = ("train.eval_every=0", "model.stages=3", "train.lr=3e-4", "train.warmup_steps=0", "mask.codec=rotq",
          "mask.bits=1", "mask.reference=both")


def test_in_the_mesh_the_map_is_sent_once_per_fit_and_shrinks_the_coded_residual(tiny_cfg, cache_dir):
    """Tiny model, 1-bit rotq against the reference, a rank-8 map refitted every 2 steps: after 8 steps each
    boundary has fitted 4 maps and sent 3 (the 4th goes with the next payload; their bytes on pp_fwd, nothing else
    changes the traffic), and at the trained weights the decoded boundary input is nearer the true one with the
    map than the same code without it."""
    plain = MeshTrainer(tiny_cfg(*MAPPED), cache_dir)
    mapped = MeshTrainer(tiny_cfg(*MAPPED, "mask.reference_map_rank=8", "mask.reference_map_period=2"), cache_dir)
    for _ in range(8):
        plain.train_step()
        mapped.train_step()
    hidden = mapped.workers[0][0].map_out.hidden
    assert [w.map_out.version for w in mapped.workers[0][:2]] == [4, 4]
    sender = mapped.workers[0][0].map_out.sender
    assert sorted(mapped.workers[0][1].map_in.maps) == [(sender, 2), (sender, 3)]
    extra = mapped.counter.snapshot()["pp_fwd"] - plain.counter.snapshot()["pp_fwd"]
    assert extra == 2 * 3 * map_bytes(hidden, 8)
    assert mapped.counter.snapshot()["pp_bwd"] == plain.counter.snapshot()["pp_bwd"]
    assert mapped.losses != plain.losses

    w0, w1 = mapped.workers[0][0], mapped.workers[0][1]
    ids = mapped.sources[0].batch(100)
    mb = MicrobatchId(100, 0)
    payload = w0.forward(mb, ids, labels=ids)
    assert payload.meta[MAP_META] == [sender, 4] and set(MAP_TENSORS) <= set(payload.tensors)  # the new map goes too
    true_out = w0.in_flight[mb].outputs.detach().float()
    with_map = w0.in_flight[mb].sent.float()
    h_ref = mapped.reference.activation(("x",), ids, 0)
    without = w0.codec.decode(w0.codec.encode(true_out - h_ref)).float() + h_ref
    err_map, err_plain = float((with_map - true_out).norm()), float((without - true_out).norm())
    print(f"boundary 0 error with the map {err_map:.4g}, without {err_plain:.4g}")
    assert err_map < 0.95 * err_plain, (err_map, err_plain)
    # the receiver decodes the same input the sender expects
    w1.forward(mb, payload, labels=ids)
    assert sorted(w1.map_in.maps) == [(sender, 3), (sender, 4)]
    torch.testing.assert_close(w1.in_flight[mb].inputs.detach().float(), with_map, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(apply_map(h_ref, w0.map_out.u, w0.map_out.v),
                               w1.map_in.predict((sender, w0.map_out.version), h_ref), rtol=0, atol=0)
    for w in (w0, w1):
        w.discard(mb)


def test_the_first_fit_can_come_before_the_period(tiny_cfg, cache_dir):
    """``mask.reference_map_first``: the first fit after that many steps, then every period; 0 = the period itself."""
    versions = {}
    for first in (0, 1):
        t = MeshTrainer(tiny_cfg(*MAPPED, "mask.reference_map_rank=4", "mask.reference_map_period=3",
                                 f"mask.reference_map_first={first}"), cache_dir)
        versions[first] = []
        for _ in range(5):
            t.train_step()
            versions[first].append(t.workers[0][0].map_out.version)
    assert versions == {0: [0, 0, 1, 1, 1], 1: [1, 1, 1, 2, 2]}
    with pytest.raises(ConfigError, match="reference_map_first"):
        tiny_cfg(*MAPPED, "mask.reference_map_rank=4", "mask.reference_map_first=-1")
    with pytest.raises(ConfigError, match="reference_map_first sets when"):  # nothing is fitted: a mistake
        tiny_cfg(*MAPPED, "mask.reference_map_first=10")


def test_a_worker_decays_its_fit_statistics_each_step_that_does_not_refit(tiny_cfg, cache_dir):
    """``mask.reference_fit_decay``: a step without a fit multiplies the sender's statistics (the map's and the
    gradient code's) by the factor; a fit starts them afresh; 1 (the default) leaves them summed."""
    both = (*MAPPED, "mask.reference=both", "mask.reference_map_rank=4", "mask.reference_map_period=3",
            "mask.reference_grad_code_bits=16")
    tokens = {}
    for decay in (1.0, 0.5):
        t = MeshTrainer(tiny_cfg(*both, f"mask.reference_fit_decay={decay}"), cache_dir)
        seen = []
        for _ in range(3):
            t.train_step()
            seen.append((t.workers[0][0].map_out.tokens, t.workers[0][1].gcode_out.tokens))
        tokens[decay] = seen
    (a1, g1), (a2, g2), (a3, g3) = tokens[1.0]
    assert a1 > 0 and g1 > 0 and a2 == 2 * a1 and g2 == 2 * g1 and a3 == g3 == 0  # refit after the third step
    assert tokens[0.5] == [(a1 / 2, g1 / 2), (a1 * 3 / 4, g1 * 3 / 4), (0, 0)]
    for bad in ("0", "1.5"):
        with pytest.raises(ConfigError, match="reference_fit_decay"):
            tiny_cfg(*both, f"mask.reference_fit_decay={bad}")
    with pytest.raises(ConfigError, match="reference_fit_decay sets how"):  # nothing is fitted: a mistake
        tiny_cfg(*MAPPED, "mask.reference_fit_decay=0.5")


def test_a_worker_refuses_a_map_it_never_got_or_does_not_use(tiny_cfg, cache_dir):
    t = MeshTrainer(tiny_cfg(*MAPPED, "mask.reference_map_rank=4", "mask.reference_map_period=1"), cache_dir)
    t.train_step()
    w0, w1 = t.workers[0][0], t.workers[0][1]
    ids = t.sources[0].batch(50)
    mb = MicrobatchId(50, 0)
    payload = w0.forward(mb, ids, labels=ids)
    w0.discard(mb)
    from meshnode.stage import StageError

    assert set(MAP_TENSORS) <= set(payload.tensors)  # the first payload after the fit carries the map
    codes_only = {k: v for k, v in payload.tensors.items() if k not in MAP_TENSORS}
    unknown = dataclasses.replace(payload, meta={**payload.meta, MAP_META: [w0.map_out.sender, 7]}, tensors=codes_only)
    with pytest.raises(StageError, match="never received"):
        w1.forward(mb, unknown, labels=ids)
    assert not w1.in_flight
    other = MeshTrainer(tiny_cfg(*MAPPED), cache_dir)  # the same codec and reference, no map
    with pytest.raises(StageError, match="does not use"):
        other.workers[0][1].forward(mb, payload, labels=ids)
    assert not other.workers[0][1].in_flight


def test_finite_values_that_overflow_in_decoding_are_refused_with_the_microbatch(tiny_cfg, cache_dir):
    """Every payload tensor is checked finite, but a finite map (1e30 in bf16) or gradient scale (3e38 in float32)
    can overflow once decoded: the stage refuses that microbatch (StageError) before anything reaches its
    graph or its accumulated gradient, and serves the genuine payload afterwards. Before, the inf went on into
    the next stage's activations or this stage's gradient."""
    from meshnode.stage import StageError

    t = MeshTrainer(tiny_cfg(*MAPPED, "mask.reference_map_rank=4", "mask.reference_map_period=1"), cache_dir)
    t.train_step()
    w0, w1, w2 = t.workers[0]
    ids = t.sources[0].batch(50)
    mb = MicrobatchId(50, 0)
    payload = w0.forward(mb, ids, labels=ids)
    assert set(MAP_TENSORS) <= set(payload.tensors)
    huge = {**payload.tensors, **{n: torch.full_like(payload.tensors[n], 1e30) for n in MAP_TENSORS}}
    with pytest.raises(StageError, match="decoded input is not finite"):
        w1.forward(mb, dataclasses.replace(payload, tensors=huge), labels=ids)
    assert not w1.in_flight
    w2.forward(mb, w1.forward(mb, payload, labels=ids), labels=ids)  # the genuine map replaces the bad one
    grad = w2.backward(mb, None)
    bad = dataclasses.replace(grad, tensors={**grad.tensors, "rms": torch.full_like(grad.tensors["rms"], 3e38)})
    with pytest.raises(StageError, match="decoded gradient is not finite"):
        w1.backward(mb, bad)
    assert all(p.grad is None or not p.grad.any() for p in w1.module.parameters())
    w1.backward(mb, grad)
    assert all(bool(torch.isfinite(p.grad).all()) for p in w1.module.parameters() if p.grad is not None)
    assert any(p.grad is not None and p.grad.any() for p in w1.module.parameters())


@pytest.mark.parametrize("extra", [(), ("mask.reference_code_metric=fisher", "mask.reference_fit_bits=8",
                                         "mask.reference_code_grad=project")], ids=["plain", "fisher_f8_proj"])
def test_resume_with_maps_and_codes_is_bit_identical(tiny_cfg, cache_dir, tmp_path, extra):
    """A checkpoint holds reference coding's fits both ways (maps, codes, gradient codes, and the statistics since
    the last fit): the resumed run trains bit for bit as the uninterrupted one. Before, the resumed workers had
    none until the next fit and the losses differed from the step after the checkpoint."""
    cfg = tiny_cfg(*MAPPED, "train.steps=6", "train.bf16=false", "mask.reference_map_rank=4",
                   "mask.reference_map_period=2", "mask.reference_code_bits=64", "mask.reference_grad_code_bits=32",
                   *extra)
    straight = MeshTrainer(cfg, cache_dir)
    straight.train()
    first = MeshTrainer(cfg, cache_dir)
    first.train(until=5, checkpoint_dir=tmp_path / "ckpt")  # between fits (period 2): statistics in flight
    resumed = MeshTrainer(cfg, cache_dir)
    resumed.load_checkpoint(tmp_path / "ckpt")
    assert resumed.workers[0][0].map_out.version == first.workers[0][0].map_out.version >= 2
    resumed.train()
    assert resumed.losses == straight.losses
    other = MeshTrainer(tiny_cfg(*MAPPED, "mask.reference_map_rank=8", "mask.reference_map_period=2",
                                 "mask.reference_code_bits=64", "mask.reference_grad_code_bits=32", *extra), cache_dir)
    other.train_step()
    other.train_step()  # a map fitted, optimizer state: what a failed load must leave as it was
    before = [copy.deepcopy((w.module.state_dict(), w.optimizer_state(), w.fit_state())) for w in other.workers[0]]
    with pytest.raises(CheckpointError, match="other settings.*does not fit.*nothing was loaded"):
        other.load_checkpoint(tmp_path / "ckpt")  # its maps are of rank 8: the checkpoint's of rank 4, found part-way
    assert other.step == 2 and other.workers[0][0].map_out.version == 1
    for w, (weights, optim, fits) in zip(other.workers[0], before):
        _assert_equal_trees((weights, optim, fits), (w.module.state_dict(), w.optimizer_state(), w.fit_state()))


def _assert_equal_trees(a, b):
    if isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys()
        for k in a:
            _assert_equal_trees(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _assert_equal_trees(x, y)
    elif isinstance(a, torch.Tensor):
        assert torch.equal(a, b)
    else:
        assert a == b


def test_a_peers_state_carries_its_own_fits_under_a_new_sender(tiny_cfg, cache_dir, caplog):
    """A swarm peer's state (its checkpoint, or what a joining peer of its stage fetches) holds its own maps and
    codes with the statistics since the last fit; they load under a new sender id (receivers holding the old id's
    maps are sent these afresh). A state of other settings loads its weights and drops the fits, with a warning."""
    from meshnode.model import cut_model, load_model
    from meshnode.node.host import StageHost
    from meshnode.protocol.limits import Limits
    from meshnode.stage import ReferenceModel, StageWorker

    over = ("model.stages=2", "mask.codec=rotq", "mask.bits=1", "mask.reference=both", "mask.reference_code_bits=64",
            "mask.reference_map_period=1000", "mask.reference_grad_code_bits=32")
    model, _ = load_model(tiny_cfg().model, cache_dir)
    hidden = tiny_cfg().model.tiny_hidden

    def host(*extra):
        cfg = tiny_cfg(*over, *extra)
        cut = cut_model(model, 2)
        w = StageWorker(copy.deepcopy(cut[0]), cfg)  # its own weights (the cut shares the model's)
        w.reference = ReferenceModel([cut[0], cut[1]])
        return StageHost(w, cfg, Limits.from_config(cfg, hidden, cfg.model.tiny_vocab), "run")

    a = host("mask.reference_map_rank=4")
    maps = a.worker._residual_map(hidden)
    for _ in range(3):
        maps.observe(torch.randn(2, 64, hidden), torch.randn(2, 64, hidden))
    assert maps.refit()
    maps.observe(torch.randn(2, 64, hidden), torch.randn(2, 64, hidden))  # statistics toward the next fit
    with torch.no_grad():
        next(a.worker.module.parameters()).add_(0.01)  # trained: unlike the pretrained weights
    blob = a._state_blob()
    b = host("mask.reference_map_rank=4")
    b.load_state_blob(blob)
    got = b.worker.map_out
    assert got.version == maps.version == 1 and got.sender != maps.sender and got.tokens == maps.tokens == 128
    assert torch.equal(got.u, maps.u) and torch.equal(got.transform.basis, maps.transform.basis)
    assert torch.equal(got.xtx, maps.xtx) and b.worker.map_in is None  # what it was sent is not carried
    c = host("mask.reference_map_rank=8")
    assert not torch.equal(next(c.worker.module.parameters()), next(a.worker.module.parameters()))
    with caplog.at_level("WARNING", logger="meshnode.node.host"):
        c.load_state_blob(blob)
    assert "do not fit this run" in caplog.text and c.worker.map_out.version == 0
    assert all(torch.equal(x, y) for x, y in zip(c.worker.module.parameters(), a.worker.module.parameters()))


def test_config_refuses_a_map_without_a_reference_or_period(tiny_cfg):
    with pytest.raises(ConfigError, match="needs mask.reference"):
        tiny_cfg("mask.codec=rotq", "mask.reference_map_rank=8")
    with pytest.raises(ConfigError, match="reference_map_period"):
        tiny_cfg("mask.codec=rotq", "mask.reference=both", "mask.reference_map_rank=8", "mask.reference_map_period=0")
    with pytest.raises(ConfigError, match="reference_map_rank"):
        tiny_cfg("mask.codec=rotq", "mask.reference=both", "mask.reference_map_rank=-1")


def test_a_receiver_keeps_two_versions_of_its_last_senders():
    from meshnode.stage.reference import MAX_MAP_SENDERS

    gen = torch.Generator().manual_seed(3)
    codec = make_codec(dataclasses.replace(_mask(), codec="rotq", bits=1))
    store = MapStore(H, 2)
    senders = [ResidualMap(H, 2, sender=s) for s in range(MAX_MAP_SENDERS + 1)]
    for m in senders:
        for _ in range(3):  # three fits each: only the last two are kept
            m.observe(*_planted(gen, torch.eye(H)))
            m.refit()
            store.take(m.attach(codec.encode(torch.randn(1, 4, H))))
    held = set(store.maps)
    assert (0, 2) not in held and (0, 3) not in held  # the least recently used sender went first
    assert {(s, v) for s in range(1, MAX_MAP_SENDERS + 1) for v in (2, 3)} == held


def test_a_map_crosses_the_wire_and_a_wrong_one_is_refused(tiny_cfg):
    from meshnode.protocol.limits import Limits
    from meshnode.protocol.messages import WireError, payload_from_wire, payload_to_wire

    _, p = _fitted_payload(4, 3, (2, 8, H))
    cfg = tiny_cfg("mask.codec=rotq", "mask.reference=both", "mask.reference_map_rank=4")
    limits = Limits.from_config(cfg, H, 100)
    back = payload_from_wire(payload_to_wire(p), limits, "activation")
    assert back.meta == p.meta and all(torch.equal(back.tensors[k], p.tensors[k]) for k in p.tensors)
    wide = dataclasses.replace(p, tensors={**p.tensors, MAP_TENSORS[0]: torch.zeros(H, H + 1, dtype=torch.bfloat16)})
    with pytest.raises(WireError, match="residual map"):
        payload_from_wire(payload_to_wire(wide), limits, "activation")


def test_a_swarm_host_sends_each_map_once_per_peer_and_again_after_a_restart(tiny_cfg, cache_dir):
    """Stage 0's host and two peers of stage 1 ("a", "b"), no network: the first payload to each peer carries the
    map and later ones only name it; a peer that restarted (lost its maps) refuses the next microbatch, which goes
    to the other peer if there is one (as ``call_stage`` retries), and the next request to the restarted peer
    carries the map again. Every map sent counts on pp_fwd."""
    import asyncio

    from meshnode.model import cut_model, load_model
    from meshnode.node.host import StageHost
    from meshnode.protocol.limits import Limits
    from meshnode.stage import ReferenceModel, StageWorker

    cfg = tiny_cfg("model.stages=2", "mask.codec=rotq", "mask.bits=1", "mask.reference=both",
                   "mask.reference_map_rank=4", "mask.reference_map_period=1000", "train.microbatches=1")
    model, _ = load_model(cfg.model, cache_dir)
    hidden = cfg.model.tiny_hidden
    limits = Limits.from_config(cfg, hidden, cfg.model.tiny_vocab)
    pretrained = cut_model(copy.deepcopy(model), 2)  # every peer's reference: the same frozen weights

    def host(stage):
        cut = cut_model(model, 2)
        w = StageWorker(cut[stage], cfg)
        w.reference = ReferenceModel([pretrained[0], pretrained[1]])  # not the cut: the workers train its weights
        return StageHost(w, cfg, limits, "run", call_next=call_next if stage == 0 else None)

    target: list[str] = ["a"]  # the peers call_next tries, in order
    requests: list[dict] = []

    async def call_next(stage, build):
        errors = []
        for peer in target:
            req = build(1, peer)
            requests.append(req)
            try:
                return await peers[peer].forward(req)
            except Exception as exc:
                errors.append(f"{peer}: {exc}")
        raise RuntimeError(f"stage {stage}: no peer could take the microbatch ({'; '.join(errors)})")

    sender = host(0)
    peers = {"a": host(1), "b": host(1)}
    ids = torch.randint(0, cfg.model.tiny_vocab, (cfg.train.batch_size, cfg.data.seq_len))
    maps = sender.worker._residual_map(hidden)
    with torch.no_grad():
        h_ref = sender.worker.reference.activation("fit", ids, 0)
        for _ in range(3):
            maps.observe(h_ref, torch.randn_like(h_ref))
    assert maps.refit()
    one_map = map_bytes(hidden, 4)

    def carried(req):
        return set(MAP_TENSORS) <= set(req["payload"]["data"])

    async def scenario():
        sent = []
        for mb, peer in enumerate(["a", "a", "b"]):
            target[:] = [peer]
            before = sender.worker.counter.snapshot()["pp_fwd"]
            await sender.process(driver="d", step=mb, mb=0, attempt=1, inputs=ids, labels=ids)
            sent.append((carried(requests[-1]), sender.worker.counter.snapshot()["pp_fwd"] - before))
        plain = sent[1][1]
        assert sent == [(True, plain + one_map), (False, plain), (True, plain + one_map)]
        peers["a"] = host(1)  # "a" restarted: its maps are gone
        target[:] = ["a"]
        with pytest.raises(RuntimeError, match="never received"):
            await sender.process(driver="d", step=3, mb=0, attempt=1, inputs=ids, labels=ids)
        assert not carried(requests[-1]) and not peers["a"].worker.in_flight
        await sender.process(driver="d", step=4, mb=0, attempt=1, inputs=ids, labels=ids)
        assert carried(requests[-1]) and (maps.sender, 1) in peers["a"].worker.map_in.maps
        # again, with "b" to fall back on: "a" refuses, "b" (which has the map) serves without it, and the next
        # request to "a" carries the map
        peers["a"] = host(1)
        target[:] = ["a", "b"]
        n = len(requests)
        await sender.process(driver="d", step=5, mb=0, attempt=1, inputs=ids, labels=ids)
        assert [carried(r) for r in requests[n:]] == [False, False]
        target[:] = ["a"]
        await sender.process(driver="d", step=6, mb=0, attempt=1, inputs=ids, labels=ids)
        assert carried(requests[-1]) and (maps.sender, 1) in peers["a"].worker.map_in.maps

    try:
        asyncio.run(scenario())
    finally:
        for h in (sender, *peers.values()):
            h.executor.shutdown(wait=True)


def test_a_swarm_host_ships_its_gradient_code_to_a_caller_that_does_not_hold_it(tiny_cfg, cache_dir):
    """``mask.reference_grad_code_bits``: every forward request says which gradient codes the caller holds
    (``held_codes``); stage 1's host attaches its code to the gradient it replies with only when the caller lacks
    it: the first reply carries it, the next does not, and a caller that restarted gets it again. The code's bytes
    count on stage 1's pp_bwd."""
    import asyncio

    from meshnode.model import cut_model, load_model
    from meshnode.node.host import StageHost
    from meshnode.protocol.limits import Limits
    from meshnode.stage import ReferenceModel, StageWorker
    from meshnode.stage.reference import CODE_TENSORS

    cfg = tiny_cfg("model.stages=2", "mask.codec=rotq", "mask.bits=1", "mask.reference=both",
                   "mask.reference_grad_code_bits=16", "mask.reference_map_period=1000", "train.microbatches=1")
    model, _ = load_model(cfg.model, cache_dir)
    hidden = cfg.model.tiny_hidden
    limits = Limits.from_config(cfg, hidden, cfg.model.tiny_vocab)
    pretrained = cut_model(copy.deepcopy(model), 2)  # every peer's reference: the same frozen weights
    replies: list[dict] = []
    requests: list[dict] = []

    def host(stage):
        cut = cut_model(model, 2)
        w = StageWorker(cut[stage], cfg)
        w.reference = ReferenceModel([pretrained[0], pretrained[1]])  # not the cut: the workers train its weights
        return StageHost(w, cfg, limits, "run", call_next=call_next if stage == 0 else None)

    async def call_next(stage, build):
        requests.append(build(1, "a"))
        replies.append(await callee.forward(requests[-1]))
        return replies[-1]

    caller, callee = host(0), host(1)
    code = callee.worker._grad_code(hidden)
    for _ in range(3):
        code.observe(None, torch.randn(2, 32, hidden))
    assert code.refit()
    ids = torch.randint(0, cfg.model.tiny_vocab, (cfg.train.batch_size, cfg.data.seq_len))

    def carried(reply):
        return set(CODE_TENSORS) <= set(reply["payload"]["data"])

    async def scenario():
        nonlocal caller
        sent = []
        for step in range(2):
            before = callee.worker.counter.snapshot()["pp_bwd"]
            await caller.process(driver="d", step=step, mb=0, attempt=1, inputs=ids, labels=ids)
            sent.append((requests[-1].get("held_codes"), carried(replies[-1]),
                         callee.worker.counter.snapshot()["pp_bwd"] - before))
        plain = sent[1][2]
        assert sent == [(None, True, plain + code.current.nbytes()), ([[code.sender, 1]], False, plain)]
        assert list(caller.worker.gcode_in.maps) == [(code.sender, 1)]
        old = caller
        caller = host(0)  # the caller restarted: it holds no code, says so, and gets it again
        old.executor.shutdown(wait=True)
        await caller.process(driver="d", step=2, mb=0, attempt=1, inputs=ids, labels=ids)
        assert "held_codes" not in requests[-1] and carried(replies[-1])
        assert list(caller.worker.gcode_in.maps) == [(code.sender, 1)]

    try:
        asyncio.run(scenario())
    finally:
        for h in (caller, callee):
            h.executor.shutdown(wait=True)
