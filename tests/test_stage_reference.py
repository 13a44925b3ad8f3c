"""Reference coding (``mask.reference``): boundaries coded as their change from the frozen pretrained model."""

from __future__ import annotations

import pytest
import torch

from meshnode.compression import EncodedPayload, make_codec
from meshnode.config import ConfigError
from meshnode.mesh import MeshTrainer
from meshnode.model import cut_model, load_model
from meshnode.stage import (
    MicrobatchId,
    ReferenceModel,
    StageError,
    StageWorker,
    causal_lm_loss,
    peer_passes,
    peer_plan,
)

EXACT = ("train.eval_every=0", "train.grad_clip=0.0", "mask.wire_dtype=float32", "train.bf16=false",
         "model.stages=3")


def _stages(cfg):
    model, _ = load_model(cfg.model)
    cut = cut_model(model, cfg.model.stages)
    return [cut[s] for s in range(cfg.model.stages)]


def test_activation_is_the_frozen_prefix_and_is_computed_once_per_key(tiny_cfg):
    cfg = tiny_cfg("model.stages=3")
    stages = _stages(cfg)
    ref = ReferenceModel(stages)
    ids = torch.randint(0, 200, (2, 16))
    with torch.no_grad():
        want1 = stages[1](stages[0](ids))
    got = ref.activation("a", ids, 1)
    torch.testing.assert_close(got, want1.float(), rtol=0, atol=0)
    assert ref.stage_forwards == 2
    torch.testing.assert_close(ref.activation("a", ids, 0), stages[0](ids).detach(), rtol=0, atol=0)
    assert ref.stage_forwards == 2  # both ends of a boundary in one process: computed once
    other = torch.randint(0, 200, (2, 16))
    ref.activation("a", other, 0)  # the same key with other ids is not served from the cache
    assert ref.stage_forwards == 3
    with pytest.raises(ValueError, match="boundary"):
        ref.activation("a", ids, 2)  # the last stage's output is not a boundary


def test_the_reference_is_frozen_and_does_not_follow_training(tiny_cfg):
    cfg = tiny_cfg("model.stages=2")
    stages = _stages(cfg)
    ref = ReferenceModel(stages)
    ids = torch.randint(0, 200, (1, 8))
    before = ref.activation("k", ids, 0).clone()
    with torch.no_grad():
        for p in stages[0].parameters():
            p.add_(0.1)
    assert all(not p.requires_grad for m in ref.stages for p in m.parameters())
    torch.testing.assert_close(ref.activation("k2", ids, 0), before, rtol=0, atol=0)


def test_the_digest_names_the_frozen_weights(tiny_cfg):
    """Two copies of the same pretrained stages share a digest; one weight moved by one step of its float, stored
    in another dtype, or computed under bf16 autocast, gives another (such a peer decodes a residual wrong)."""
    cfg = tiny_cfg("model.stages=2")
    stages = _stages(cfg)
    ref = ReferenceModel(stages)
    assert len(ref.digest) == 16 and ReferenceModel(stages).digest == ref.digest
    moved = ReferenceModel(stages)
    with torch.no_grad():
        w = next(moved.stages[1].parameters())
        w.view(-1)[5] = torch.nextafter(w.view(-1)[5], torch.tensor(float("inf")))
    assert moved.digest != ref.digest
    bf16 = ReferenceModel(stages, autocast=lambda: torch.autocast("cpu", dtype=torch.bfloat16))
    assert bf16.precision != ref.precision == "float32" and bf16.digest != ref.digest  # computed otherwise
    assert ReferenceModel([m.to(torch.bfloat16) for m in stages]).digest != ref.digest


def test_a_stage_refuses_a_caller_that_codes_against_other_weights(tiny_cfg):
    """In the swarm each forward carries the digest of the caller's reference; the next stage refuses one unlike
    its own (or none, from a caller that does not code against a reference) before it decodes anything, and
    serves the same request from a caller with its own reference."""
    import asyncio
    import math

    from meshnode.node.host import StageHost
    from meshnode.protocol.limits import Limits
    from meshnode.protocol.messages import WireError

    cfg = tiny_cfg("model.stages=2", "mask.codec=rotq", "mask.bits=2", "mask.reference=both", "train.microbatches=1")
    stages = _stages(cfg)
    limits = Limits.from_config(cfg, cfg.model.tiny_hidden, cfg.model.tiny_vocab)
    moved = ReferenceModel(stages)
    with torch.no_grad():
        next(moved.stages[0].parameters()).view(-1)[0] += 1e-3
    callee: dict = {}
    drop_digest = [False]

    async def call_next(stage, build):
        req = build(1, "p")
        if drop_digest[0]:
            req.pop("reference")
        return await callee["host"].forward(req)

    def host(stage, ref, call=None):
        w = StageWorker(stages[stage], cfg)
        w.reference = ref
        return StageHost(w, cfg, limits, "run", call_next=call)

    sender = host(0, ReferenceModel(stages), call_next)
    ids = torch.randint(0, 200, (cfg.train.batch_size, cfg.data.seq_len))

    async def go():
        callee["host"] = host(1, moved)
        with pytest.raises(WireError, match=f"reference model {sender.reference_digest} is not this peer's "
                                            f"{moved.digest}"):
            await sender.process(driver="d", step=0, mb=0, attempt=1, inputs=ids, labels=ids)
        assert callee["host"].tokens == 0 and not callee["host"].worker.in_flight
        callee["host"] = host(1, ReferenceModel(stages))
        drop_digest[0] = True
        with pytest.raises(WireError, match="codes against no reference"):
            await sender.process(driver="d", step=0, mb=0, attempt=2, inputs=ids, labels=ids)
        drop_digest[0] = False
        _, loss = await sender.process(driver="d", step=0, mb=0, attempt=3, inputs=ids, labels=ids)
        assert math.isfinite(loss) and callee["host"].tokens == ids.numel()

    asyncio.run(go())


def test_input_grad_is_the_frozen_suffix_gradient(tiny_cfg):
    cfg = tiny_cfg("model.stages=3")
    stages = _stages(cfg)
    ref = ReferenceModel(stages)
    ids = torch.randint(0, 200, (2, 16))
    x = torch.randn(2, 16, cfg.model.tiny_hidden)
    leaf = x.clone().requires_grad_(True)
    (causal_lm_loss(stages[2](stages[1](leaf)), ids) * 0.5).backward()
    got = ref.input_grad("k", ids, 0, x, scale=0.5)
    torch.testing.assert_close(got, leaf.grad, rtol=1e-5, atol=1e-7)
    assert (ref.stage_forwards, ref.stage_backwards) == (2, 2)
    ref.input_grad("k", ids, 0, x, scale=0.5)
    assert ref.stage_forwards == 2  # cached for the same ids and input
    ref.input_grad("k", ids, 0, x + 1e-3, scale=0.5)
    assert ref.stage_forwards == 4  # another input: computed again


def test_peer_passes_count_what_a_swarm_peer_runs():
    assert peer_passes(0, 3, "none") == (0, 0)
    assert peer_passes(0, 3, "forward") == (1, 0)  # stage 0 -> boundary 0
    assert peer_passes(1, 3, "forward") == (2, 0)  # 0..1, reused for boundary 0
    assert peer_passes(2, 3, "forward") == (2, 0)  # 0..1 for its input
    assert peer_passes(0, 3, "both") == (1 + 2, 2)  # + stages 1, 2 for boundary 0's gradient
    assert peer_passes(1, 3, "both") == (2 + 1 + 2, 1 + 2)  # + stage 2 (boundary 1), stages 1, 2 (boundary 0)
    assert peer_passes(2, 3, "both") == (2 + 1, 1)
    assert peer_plan(1, 3, "both") == ([0, 1], [2, 1, 2])  # the stages behind those counts
    with pytest.raises(ValueError):
        peer_passes(0, 3, "sideways")


def test_config_rejects_an_unknown_reference_mode(tiny_cfg):
    with pytest.raises(ConfigError, match="mask.reference"):
        tiny_cfg("mask.reference=pretrained")
    with pytest.raises(ConfigError, match="compressing codec"):
        tiny_cfg("mask.reference=both")  # dense boundaries: nothing to code against the reference
    assert tiny_cfg("mask.reference=both", "mask.codec=rotq").mask.reference == "both"


def _first_step(cfg, cache_dir):
    t = MeshTrainer(cfg, cache_dir)
    t.train_step()
    return t


@pytest.mark.parametrize("mode", ["forward", "both"])
def test_reference_coding_at_the_pretrained_weights_is_exact(tiny_cfg, cache_dir, mode):
    """At step 0 the model is the reference: the masked residual is zero, the pass is the dense one. With "both"
    the gradients are exact too, so every stage's first update is dense's; with "forward" only the last stage's."""
    dense = _first_step(tiny_cfg(*EXACT), cache_dir)
    m95 = _first_step(tiny_cfg(*EXACT, "mask.ratio=0.95"), cache_dir)
    ref = _first_step(tiny_cfg(*EXACT, "mask.ratio=0.95", f"mask.reference={mode}"), cache_dir)
    assert abs(ref.losses[0] - dense.losses[0]) < 1e-5
    assert abs(m95.losses[0] - dense.losses[0]) > 1e-2  # without the reference the mask changes the pass
    # the same bytes, and each activation's sampled reference (mask.reference_check, float32; the gradient's too)
    checks = (3 - 1) * ref.cfg.train.microbatches * 4 * ref.cfg.mask.reference_check * (2 if mode == "both" else 1)
    assert checks > 0
    assert ref.counter.snapshot()["pp_fwd"] == m95.counter.snapshot()["pp_fwd"] + checks
    for s in range(3):
        a = torch.cat([p.detach().reshape(-1) for p in dense.workers[0][s].module.parameters()])
        b = torch.cat([p.detach().reshape(-1) for p in ref.workers[0][s].module.parameters()])
        if mode == "both" or s == 2:
            torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-6)
        else:  # stage 0 and 1 got a masked gradient
            assert (b - a).abs().max() > 1e-4


def test_a_quantised_zero_residual_decodes_to_the_reference(tiny_cfg, cache_dir):
    """rotq at 1 bit of an all-zero residual (step 0): the pass is dense's, with no NaN from a zero scale."""
    dense = _first_step(tiny_cfg(*EXACT), cache_dir)
    ref = _first_step(tiny_cfg(*EXACT, "mask.codec=rotq", "mask.bits=1", "mask.reference=both"), cache_dir)
    assert abs(ref.losses[0] - dense.losses[0]) < 1e-5
    params = torch.cat([p.detach().reshape(-1) for w in ref.workers[0] for p in w.module.parameters()])
    assert torch.isfinite(params).all()


def test_reference_coding_keeps_training_closer_to_dense(tiny_cfg, cache_dir):
    """Twelve steps at a small learning rate (the weights stay near the reference, as in fine-tuning): M95 coded
    against the reference ends nearer dense's held-out loss than plain M95, in both modes (tiny model, measured
    0.146 and 0.113 from dense against 0.229)."""
    args = ("train.eval_every=0", "train.steps=12", "train.lr=3e-4", "train.warmup_steps=0", "model.stages=3")
    runs = {}
    for name, extra in {"dense": (), "m95": ("mask.ratio=0.95",),
                        "both": ("mask.ratio=0.95", "mask.reference=both"),
                        "forward": ("mask.ratio=0.95", "mask.reference=forward")}.items():
        t = MeshTrainer(tiny_cfg(*args, *extra), cache_dir)
        for _ in range(12):
            t.train_step()
        runs[name] = (t.heldout_loss(), t.losses)
    gap = {k: abs(runs[k][0] - runs["dense"][0]) for k in ("m95", "both", "forward")}
    assert gap["both"] < 0.8 * gap["m95"] and gap["forward"] < 0.8 * gap["m95"], runs
    assert runs["both"][1] != runs["dense"][1]  # after step 0 the mask drops part of the change


def test_a_worker_without_its_reference_or_ids_refuses(tiny_cfg):
    cfg = tiny_cfg("model.stages=2", "mask.ratio=0.9", "mask.reference=forward")
    stages = _stages(cfg)
    w0, w1 = StageWorker(stages[0], cfg), StageWorker(stages[1], cfg)
    ids = torch.randint(0, 200, (2, 8))
    with pytest.raises(StageError, match="reference model"):
        w0.forward(MicrobatchId(0, 0), ids)
    w0.reference = w1.reference = ReferenceModel(stages)
    payload = w0.forward(MicrobatchId(0, 0), ids)
    assert isinstance(payload, EncodedPayload)
    with pytest.raises(StageError, match="token ids"):
        w1.forward(MicrobatchId(0, 0), payload, labels=ids[:, :4])
    assert not w1.in_flight  # nothing kept from the refused request
    w1.forward(MicrobatchId(0, 0), payload, labels=ids)
    assert make_codec(cfg.mask).describe() == w1.codec.describe()


# ---------------------------------------------------------------------------------------------
# the reference check (mask.reference_check): both ends compute the pretrained model alike


def test_a_reference_check_is_sampled_alike_and_a_malformed_one_refused():
    from meshnode.compression import PayloadError
    from meshnode.stage.reference import CHECK_TENSOR, reference_difference, reference_sample, take_check, with_check

    ref = torch.arange(2 * 3 * 5, dtype=torch.float32).reshape(2, 3, 5)
    s = reference_sample(ref, 4)
    assert s.dtype == torch.float32 and s.tolist() == [0.0, 9.0, 19.0, 29.0]  # the first, the last, evenly between
    assert reference_sample(ref.double(), 1).tolist() == [0.0]
    assert reference_difference(s, s) == 0.0 and reference_difference(0 * s, 0 * s) == 0.0
    assert reference_difference(s * 1.01, s) == pytest.approx(0.01 / 1.01, rel=1e-5)
    payload = EncodedPayload("rotq", "activation", (2, 3, 5), "float32", {"codes": torch.zeros(2, 3, 1)})
    checked = with_check(payload, s)
    assert with_check(payload, None) is payload
    rest, got = take_check(checked, 4)
    assert set(rest.tensors) == {"codes"} and torch.equal(got, s)
    assert take_check(payload, 0) == (payload, None)
    bad = {"none": payload, "short": with_check(payload, s[:3]),
           "nan": EncodedPayload("rotq", "activation", (2, 3, 5), "float32",
                                 {**payload.tensors, CHECK_TENSOR: torch.full((4,), float("nan"))}),
           "half": EncodedPayload("rotq", "activation", (2, 3, 5), "float32",
                                  {**payload.tensors, CHECK_TENSOR: s.half()})}
    for name, p in bad.items():
        with pytest.raises(PayloadError, match="reference check"):
            take_check(p, 4)
        assert name
    with pytest.raises(PayloadError, match="does not use"):
        take_check(checked, 0)


@pytest.mark.parametrize("mode", ["forward", "both"])
def test_the_check_travels_with_every_coded_activation_and_changes_no_number(tiny_cfg, cache_dir, mode):
    """Two mesh runs, with and without checks: the same losses, bit for bit (both ends of a mesh share one
    reference, so every difference is 0), 4 bytes a sampled entry more on each activation (twice as many with
    "both": the reference gradient's too), none on the gradients, and no frozen pass more (the reference gradient
    taken early for the check is the one backward() adds)."""
    base = (*EXACT, "mask.codec=rotq", "mask.bits=1", f"mask.reference={mode}", "train.steps=2")
    on, off = (MeshTrainer(tiny_cfg(*base, f"mask.reference_check={n}"), cache_dir) for n in (8, 0))
    for t in (on, off):
        t.train_step()
        t.train_step()
    assert on.losses == off.losses
    payloads = 2 * (3 - 1) * on.cfg.train.microbatches  # two steps, two boundaries
    ways = 2 if mode == "both" else 1
    got = {axis: on.counter.snapshot()[axis] - off.counter.snapshot()[axis] for axis in ("pp_fwd", "pp_bwd")}
    assert got == {"pp_fwd": payloads * ways * 8 * 4, "pp_bwd": 0}
    assert [w.ref_checked for w in on.workers[0]] == [0, 2 * ways, 2 * ways]  # compared at both receivers
    assert all(w.ref_mismatch == 0.0 and w.ref_refused == 0 for w in on.workers[0])
    ref_on, ref_off = on.workers[0][0].reference, off.workers[0][0].reference
    assert (ref_on.stage_forwards, ref_on.stage_backwards) == (ref_off.stage_forwards, ref_off.stage_backwards)
    with pytest.raises(ConfigError, match="reference_check"):
        tiny_cfg(*base, "mask.reference_check=33")
    with pytest.raises(ConfigError, match="reference_tolerance"):
        tiny_cfg(*base, "mask.reference_tolerance=0")


def _skewed(ref: ReferenceModel, stage: int, factor: float) -> ReferenceModel:
    """``ref`` whose frozen ``stage`` gives its output times ``factor``: the same weights (the same digest), other
    numbers, as another device's kernels would give."""
    ref.stages[stage].register_forward_hook(lambda module, args, out: out * factor)
    return ref


def test_peers_that_compute_the_reference_differently_are_told_apart(tiny_cfg, cache_dir):
    """Swarm hosts of a 2-stage run through the wire's parsing, no network. Each peer holds its own copy of the
    frozen model; one whose numbers differ by 0.1 % (as another device's kernels might) is served and the
    difference measured; one 30 % off is refused with the tolerance named (the default 0.1), and keeps nothing of
    the microbatch; a caller whose reference gradient differs as much is refused by its callee before either
    runs anything of the microbatch."""
    import asyncio
    import copy

    from meshnode.node.host import StageHost
    from meshnode.protocol.limits import Limits

    cfg = tiny_cfg("model.stages=2", "mask.codec=rotq", "mask.bits=1", "mask.reference=both", "train.microbatches=1",
                   "train.bf16=false")
    model, _ = load_model(cfg.model, cache_dir)
    limits = Limits.from_config(cfg, cfg.model.tiny_hidden, cfg.model.tiny_vocab)
    pretrained = cut_model(copy.deepcopy(model), 2)
    peers: dict[str, StageHost] = {}
    target = ["same"]

    async def call_next(stage, build):
        return await peers[target[0]].forward(build(1, target[0]))

    def host(stage, skew=None):
        w = StageWorker(cut_model(copy.deepcopy(model), 2)[stage], cfg)
        w.reference = ReferenceModel([pretrained[0], pretrained[1]])
        if skew is not None:
            _skewed(w.reference, *skew)
        return StageHost(w, cfg, limits, "run", call_next=call_next if stage == 0 else None)

    sender, skewed_sender = host(0), host(0, skew=(1, 3.0))
    peers.update(same=host(1), near=host(1, skew=(0, 1.001)), far=host(1, skew=(0, 1.3)))
    assert len({h.reference_digest for h in (sender, skewed_sender, *peers.values())}) == 1  # digests cannot tell
    ids = torch.randint(0, cfg.model.tiny_vocab, (cfg.train.batch_size, cfg.data.seq_len))

    def grads(h):
        return [p.grad for p in h.worker.module.parameters() if p.grad is not None and p.grad.any()]

    async def scenario():
        await sender.process(driver="d", step=0, mb=0, attempt=1, inputs=ids, labels=ids)
        same = peers["same"].worker  # both ways compared (activation, gradient), bit-identical
        assert same.ref_checked == 2 and same.ref_mismatch == 0.0 and sender.worker.ref_checked == 0
        target[0] = "near"
        await sender.process(driver="d", step=1, mb=0, attempt=1, inputs=ids, labels=ids)
        assert 5e-4 < peers["near"].worker.ref_mismatch < 2e-3  # measured, under the tolerance: served
        assert peers["near"].tokens == ids.numel() and peers["near"].worker.ref_refused == 0
        target[0] = "far"
        with pytest.raises(Exception, match="mask.reference_tolerance") as refused:
            await sender.process(driver="d", step=2, mb=0, attempt=1, inputs=ids, labels=ids)
        assert "activation reference" in str(refused.value)
        far = peers["far"].worker
        assert far.ref_refused == 1 and 0.2 < far.ref_mismatch < 0.26  # 0.3 / 1.3
        assert not far.in_flight and not grads(peers["far"]) and peers["far"].tokens == 0
        # the gradient's way: the caller takes g_ref with its own frozen stage 1 and sends its sample with the
        # activation, so the callee refuses before it runs anything (it would otherwise train on a microbatch whose
        # gradient the caller then could not use)
        target[0] = "same"
        same = peers["same"]
        tokens, checked = same.tokens, same.worker.ref_checked
        assert same.worker.ref_refused == 0
        with pytest.raises(Exception, match="gradient reference") as refused:
            await skewed_sender.process(driver="e", step=0, mb=0, attempt=1, inputs=ids, labels=ids)
        assert "mask.reference_tolerance" in str(refused.value)
        assert same.worker.ref_refused == 1 and same.worker.ref_mismatch > 0.1
        assert same.tokens == tokens and same.worker.ref_checked == checked + 2 and not same.worker.in_flight
        assert not skewed_sender.worker.in_flight and not grads(skewed_sender) and skewed_sender.tokens == 0

    try:
        asyncio.run(scenario())
    finally:
        for h in (sender, skewed_sender, *peers.values()):
            h.executor.shutdown(wait=True)
