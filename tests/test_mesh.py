"""The in-process mesh: equals plain dense training when masking is off; deterministic when on;
DP and anchor wiring behave as DESIGN.md section 1 says."""

from __future__ import annotations

import copy

import pytest
import torch

from meshnode.mesh import MeshTrainer
from meshnode.model import load_model
from meshnode.stage import causal_lm_loss

EXACT = ("train.eval_every=0", "train.grad_clip=0.0", "mask.wire_dtype=float32", "train.bf16=false")


def _reference_losses(cfg, trainer: MeshTrainer, steps: int) -> list[list[float]]:
    """Each replica's batches trained on the *uncut* HF model with torch.optim.AdamW: the dense reference."""
    model, _ = load_model(cfg.model)
    out = []
    for r in range(trainer.replicas):
        m = copy.deepcopy(model)
        m.lm_head.weight = torch.nn.Parameter(m.model.embed_tokens.weight.detach().clone())  # untied, like the cut
        m.config.tie_word_embeddings = False
        t = cfg.train
        opt = torch.optim.AdamW(m.parameters(), lr=t.lr, betas=tuple(t.betas), eps=t.eps, weight_decay=t.weight_decay)
        from meshnode.optim import lr_at

        losses = []
        for step in range(steps):
            for g in opt.param_groups:
                g["lr"] = lr_at(step, t.lr, t.warmup_steps, t.steps, t.min_lr_ratio)
            ids = trainer.sources[r].batch(step)
            loss = causal_lm_loss(m(ids).logits, ids)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        out.append(losses)
    return out


@pytest.mark.parametrize("replicas,stages", [(1, 3), (2, 2)])
def test_unmasked_mesh_equals_dense_training(tiny_cfg, cache_dir, replicas, stages):
    cfg = tiny_cfg(*EXACT, "train.steps=6", f"dp.replicas={replicas}", f"model.stages={stages}")
    mesh = MeshTrainer(cfg, cache_dir)
    ref = _reference_losses(cfg, mesh, 6)  # before training: the reference starts from the same weights
    for _ in range(6):
        mesh.train_step()
    mean_ref = [sum(col) / replicas for col in zip(*ref)]  # the mesh records the mean over replicas per step
    assert len(mesh.losses) == 6
    for a, b in zip(mesh.losses, mean_ref):
        assert abs(a - b) <= 2e-5, (mesh.losses, mean_ref)
    if replicas == 2:  # without DP the replicas train apart on their own shards
        w0 = mesh.workers[0][0].module.embed_tokens.weight
        w1 = mesh.workers[1][0].module.embed_tokens.weight
        assert not torch.equal(w0, w1)


def test_exact_dp_every_step_is_parameter_averaging(tiny_cfg, cache_dir):
    """H = 1, outer lr 1, no momentum, PowerSGD rank above every matrix's rank: DiLoCo == averaging params."""
    cfg = tiny_cfg(
        *EXACT, "train.steps=3", "dp.enabled=true", "dp.replicas=2", "dp.inner_steps=1", "dp.outer_lr=1.0",
        "dp.outer_momentum=0.0", "dp.rank=512", "dp.fragments=1",
    )
    mesh = MeshTrainer(cfg, cache_dir)
    solo = copy.deepcopy([[w.module for w in ws] for ws in mesh.workers])
    mesh.train_step()
    # replicas agree after the sync
    for a, b in zip(mesh.workers[0], mesh.workers[1]):
        for (n, pa), (_, pb) in zip(a.module.named_parameters(), b.module.named_parameters()):
            assert torch.equal(pa, pb), n
    # and equal the average of two independent steps from the same start
    solo_cfg = tiny_cfg(*EXACT, "train.steps=3", "dp.replicas=2")
    ind = MeshTrainer(solo_cfg, cache_dir)
    for r in range(2):
        for w, m in zip(ind.workers[r], solo[r]):
            w.module.load_state_dict(m.state_dict())
    ind.train_step()
    for s in range(len(mesh.workers[0])):
        pa = dict(mesh.workers[0][s].module.named_parameters())
        p0 = dict(ind.workers[0][s].module.named_parameters())
        p1 = dict(ind.workers[1][s].module.named_parameters())
        for n in pa:
            assert torch.allclose(pa[n], (p0[n] + p1[n]) / 2, atol=1e-5), n
    assert mesh.counter.snapshot()["dp"] > 0


def test_dp_keep_residual_keeps_each_replicas_unsent_progress(tiny_cfg, cache_dir):
    """dp.keep_residual at rank 2: after a sync the replicas differ (each kept what PowerSGD did not send), their
    mean is the exact average of two independent steps, and error feedback is empty; without it they are one
    model, the average's rank-2 part away from it."""
    base = (*EXACT, "train.steps=3", "dp.enabled=true", "dp.replicas=2", "dp.inner_steps=1", "dp.outer_lr=1.0",
            "dp.outer_momentum=0.0", "dp.rank=2", "dp.fragments=1")
    kept = MeshTrainer(tiny_cfg(*base, "dp.keep_residual=true"), cache_dir)
    plain = MeshTrainer(tiny_cfg(*base), cache_dir)
    ind = MeshTrainer(tiny_cfg(*EXACT, "train.steps=3", "dp.replicas=2"), cache_dir)
    for r in range(2):
        for w, k in zip(ind.workers[r], kept.workers[r]):
            w.module.load_state_dict(k.module.state_dict())
    for m in (kept, plain, ind):
        m.train_step()
    far_kept = far_plain = 0.0
    for s in range(len(kept.workers[0])):
        k0, k1, p0, i0, i1 = ({n: t.detach() for n, t in m.workers[r][s].module.named_parameters()}
                              for m, r in ((kept, 0), (kept, 1), (plain, 0), (ind, 0), (ind, 1)))
        for n in k0:
            mean = (i0[n] + i1[n]) / 2
            assert torch.allclose((k0[n] + k1[n]) / 2, mean, atol=1e-5), n
            far_kept = max(far_kept, float((k0[n] - k1[n]).abs().max()))
            far_plain = max(far_plain, float((p0[n] - mean).abs().max()))
        assert all(not e.any() for st in kept.dp.psgd[s] for e in st.errors.values())
    assert far_kept > 1e-4 and far_plain > 1e-4  # rank 2 leaves a residual in both


def test_heldout_loss_of_mean_scores_the_replicas_exact_average_and_leaves_replica_0_as_it_was(tiny_cfg, cache_dir):
    """With dp.keep_residual the replicas differ after a rank-2 sync; the loss of their mean is that of uncompressed
    DP's model (both replicas at the exact average of the same two steps), not replica 0's, and replica 0's weights
    are bit for bit what they were before."""
    base = (*EXACT, "train.steps=3", "dp.enabled=true", "dp.replicas=2", "dp.inner_steps=1", "dp.outer_lr=1.0",
            "dp.outer_momentum=0.0", "dp.fragments=1")
    kept = MeshTrainer(tiny_cfg(*base, "dp.rank=2", "dp.keep_residual=true"), cache_dir)
    exact = MeshTrainer(tiny_cfg(*base, "dp.rank=100000", "dp.quantize=false"), cache_dir)
    for m in (kept, exact):
        m.train_step()
    before = [{n: t.detach().clone() for n, t in w.module.named_parameters()} for w in kept.workers[0]]
    of_mean, own = kept.heldout_loss_of_mean(), kept.heldout_loss(0)
    assert abs(of_mean - exact.heldout_loss(0)) < 1e-4
    assert abs(of_mean - own) > 1e-4  # replica 0 alone is another model
    for w, saved in zip(kept.workers[0], before):
        for n, t in w.module.named_parameters():
            assert torch.equal(t, saved[n]), n
    assert kept.heldout_loss(0) == own


def test_dp_average_moments_averages_the_adamw_state(tiny_cfg, cache_dir):
    """dp.average_moments: after a sync every replica holds the mean of the moments the replicas had, and the dp
    axis counts them; without it the replicas keep their own moments."""
    base = (*EXACT, "train.steps=3", "dp.enabled=true", "dp.replicas=2", "dp.inner_steps=1", "dp.rank=4",
            "dp.fragments=1")
    own = MeshTrainer(tiny_cfg(*base), cache_dir)
    avg = MeshTrainer(tiny_cfg(*base, "dp.average_moments=true"), cache_dir)
    own.train_step()
    avg.train_step()  # the first step: both start from the same weights and batches
    numel = 0
    for s in range(len(own.workers[0])):
        opts_own = [own.workers[r][s].optimizer for r in range(2)]
        opts_avg = [avg.workers[r][s].optimizer for r in range(2)]
        for n in opts_own[0].params:
            st_own = [o.state[o.params[n]] for o in opts_own]
            st_avg = [o.state[o.params[n]] for o in opts_avg]
            numel += st_own[0]["exp_avg"].numel()
            for k in ("exp_avg", "exp_avg_sq"):
                assert not torch.equal(st_own[0][k], st_own[1][k]), (n, k)  # the replicas' own moments differ
                assert torch.equal(st_avg[0][k], st_avg[1][k]), (n, k)
                assert torch.allclose(st_avg[0][k], (st_own[0][k] + st_own[1][k]) / 2, rtol=1e-5, atol=1e-12)
    extra = avg.counter.snapshot()["dp"] - own.counter.snapshot()["dp"]
    assert extra == 2 * 2 * numel * 2  # two replicas, two moments, bf16, ring factor 2 (X - 1) / X = 1


def test_masked_mesh_is_deterministic_and_compresses(tiny_cfg, cache_dir):
    args = ("train.eval_every=0", "train.steps=5", "mask.ratio=0.9", "model.stages=3")
    a = MeshTrainer(tiny_cfg(*args), cache_dir)
    a.train()
    b = MeshTrainer(tiny_cfg(*args), cache_dir)
    b.train()
    assert a.losses == b.losses
    c = MeshTrainer(tiny_cfg(*args, "train.seed=1"), cache_dir)  # another seed: other masks, other batches
    c.train()
    assert c.losses != a.losses
    dense = MeshTrainer(tiny_cfg("train.eval_every=0", "train.steps=5", "model.stages=3"), cache_dir)
    dense.train()
    ratio = a.counter.snapshot()["pp_fwd"] / dense.counter.snapshot()["pp_fwd"]
    assert 0.09 < ratio < 0.2  # 6 of 64 channels (+ 64-byte headers) vs all 64


def test_mask_warmup_runs_dense_first(tiny_cfg, cache_dir):
    cfg = tiny_cfg("train.eval_every=0", "train.steps=4", "mask.ratio=0.9", "mask.warmup_steps=2")
    t = MeshTrainer(cfg, cache_dir)
    t.train_step()
    first = t.counter.snapshot()["pp_fwd"]
    t.train_step()
    t.train_step()
    third = t.counter.snapshot()["pp_fwd"] - 2 * first
    assert third < first / 4


def test_anchor_prior_arrives_after_its_delay(tiny_cfg, cache_dir):
    cfg = tiny_cfg("train.eval_every=0", "train.steps=9", "mask.ratio=0.9", "anchor.enabled=true", "anchor.period=3",
                   "spectral.rank=4")
    t = MeshTrainer(cfg, cache_dir)
    opt = t.workers[0][0].optimizer
    for _ in range(5):
        t.train_step()
    assert all(f.prior_step is None for f in opt.filters.values())  # cycle at step 3, not delivered before 6
    assert t.counter.snapshot()["anchor"] > 0
    t.train_step()  # step index 5 -> 6 steps done: the prior of the snapshot at 3 arrives
    steps = {f.prior_step for f in opt.filters.values()}
    assert steps == {3}
    assert opt.prior_age(6) == 3
    t.train_step()
    t.train_step()
    t.train_step()
    assert {f.prior_step for f in opt.filters.values()} == {6}


def test_anchor_resume_is_bit_identical(tiny_cfg, cache_dir, tmp_path):
    args = ("train.eval_every=0", "train.steps=8", "mask.ratio=0.9", "anchor.enabled=true", "anchor.period=2",
            "spectral.rank=4", "dp.enabled=true", "dp.replicas=2", "dp.inner_steps=3", "dp.rank=2")
    a = MeshTrainer(tiny_cfg(*args), cache_dir)
    a.train()
    b = MeshTrainer(tiny_cfg(*args), cache_dir)
    b.train(until=3, checkpoint_dir=tmp_path / "ck")
    c = MeshTrainer(tiny_cfg(*args), cache_dir)
    c.load_checkpoint(tmp_path / "ck")
    c.train()
    assert c.losses == a.losses


def test_dp_v_correction_lowers_v_and_resumes_bit_identical(tiny_cfg, cache_dir, tmp_path):
    args = ("train.eval_every=0", "train.steps=6", "dp.enabled=true", "dp.replicas=2", "dp.inner_steps=2",
            "dp.rank=2", "train.microbatches=2", "train.batch_size=2")
    plain = MeshTrainer(tiny_cfg(*args), cache_dir)
    corr = MeshTrainer(tiny_cfg(*args, "dp.v_correction=true"), cache_dir)
    plain.train_step()
    corr.train_step()  # the same first step; only the second moments it leaves behind differ
    assert plain.losses == corr.losses
    lower = 0
    for wp, wc in zip(plain.workers[0], corr.workers[0]):
        for n, p in wp.optimizer.params.items():
            vp = wp.optimizer.state[p]["exp_avg_sq"]
            vc = wc.optimizer.state[wc.optimizer.params[n]]["exp_avg_sq"]
            assert (vc <= vp).all() and (vc >= vp / 4 - 1e-12).all(), n  # between the floor and AdamW's own
            lower += int((vc < vp).sum())
    assert lower > 0
    a = MeshTrainer(tiny_cfg(*args, "dp.v_correction=true"), cache_dir)
    a.train()
    b = MeshTrainer(tiny_cfg(*args, "dp.v_correction=true"), cache_dir)
    b.train(until=3, checkpoint_dir=tmp_path / "ck")
    c = MeshTrainer(tiny_cfg(*args, "dp.v_correction=true"), cache_dir)
    c.load_checkpoint(tmp_path / "ck")
    c.train()
    assert c.losses == a.losses  # the correction's EMAs travel with the checkpoint
    plain.train()
    assert plain.losses != a.losses


def test_filter_changes_the_trajectory_only_once_a_prior_arrives(tiny_cfg, cache_dir):
    """alpha = 1 is plain masked training; alpha = 0 follows it bit for bit until the first prior is
    delivered (after 2K steps) and then moves the targeted matrices elsewhere: the prior reaches the update."""
    args = (*EXACT, "train.steps=8", "mask.ratio=0.9", "anchor.enabled=true", "anchor.period=3", "spectral.rank=4")

    def weights_after(steps: int, alpha: str) -> dict[str, torch.Tensor]:
        t = MeshTrainer(tiny_cfg(*args, f"spectral.alpha={alpha}"), cache_dir)
        for _ in range(steps):
            t.train_step()
        w = t.workers[0][1]
        return {n: p.detach().clone() for n, p in w.module.named_parameters()}, sorted(w.optimizer.filters)

    before1, targets = weights_after(6, "1.0")
    before0, _ = weights_after(6, "0.0")
    assert all(torch.equal(before1[n], before0[n]) for n in before1)  # no prior used yet: identical
    after1, _ = weights_after(8, "1.0")
    after0, _ = weights_after(8, "0.0")
    moved = [n for n in targets if not torch.equal(after1[n], after0[n])]
    assert moved == targets


def test_train_device_is_validated(tiny_cfg):
    from meshnode.config import ConfigError

    assert tiny_cfg().train.device == "cpu"
    assert tiny_cfg("train.device=cuda:1").train.device == "cuda:1"
    for bad in ("tpu", "cuda:x", "CUDA", ""):
        with pytest.raises(ConfigError, match="train.device"):
            tiny_cfg(f"train.device={bad}")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_cuda_without_a_device_is_a_clear_error(tiny_cfg, cache_dir):
    with pytest.raises(ValueError, match="sees no CUDA device"):
        MeshTrainer(tiny_cfg("train.device=cuda"), cache_dir)


# one of each path that puts tensors on a device: codecs, PowerSGD + the outer step, the anchor and its SVD
CUDA_VARIANTS = {
    "dense": (),
    "rotq4_g1": ("mask.codec=rotq", "mask.bits=4", "mask.grad_bits=1", "mask.rotq_weight=norm_std"),
    "dp": ("dp.enabled=true", "dp.replicas=2", "dp.inner_steps=2", "dp.rank=4", "dp.quantize=true"),
    "m95_ap": ("mask.ratio=0.95", "anchor.enabled=true", "anchor.period=2", "spectral.rank=8"),
    "m95_bc": ("mask.ratio=0.95", "anchor.enabled=true", "anchor.period=2", "spectral.mode=bias_correction"),
}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("variant", sorted(CUDA_VARIANTS))
def test_mesh_on_cuda_agrees_with_cpu(tiny_cfg, cache_dir, variant):
    """``train.device = cuda`` trains the same run as the CPU (fp32, no TF32: up to rounding)."""
    out = {}
    for device in ("cpu", "cuda"):
        mesh = MeshTrainer(tiny_cfg(*EXACT, "train.steps=6", *CUDA_VARIANTS[variant], f"train.device={device}"),
                           cache_dir)
        assert next(mesh.workers[0][0].module.parameters()).device.type == device
        for _ in range(6):
            mesh.train_step()
        out[device] = [*mesh.losses, mesh.heldout_loss()]
    assert out["cuda"] == pytest.approx(out["cpu"], rel=2e-3), out


def _leaves(state, path=()) -> dict:
    """A nested state dict's leaves by path, tensors as (dtype, shape, values) so that == compares them."""
    if isinstance(state, dict):
        return {k: v for key, sub in state.items() for k, v in _leaves(sub, (*path, key)).items()}
    if isinstance(state, (list, tuple)):
        return {k: v for i, sub in enumerate(state) for k, v in _leaves(sub, (*path, i)).items()}
    if torch.is_tensor(state):
        return {path: (state.dtype, tuple(state.shape), state.flatten().tolist())}
    return {path: state}


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_gradient_skips_the_step_and_keeps_the_weights(tiny_cfg, cache_dir, bad):
    """A gradient that holds a NaN or inf (an overflow from a bad payload upstream) must not reach the weights:
    the stage skips that step, keeps its weights and optimizer state, and trains on from the next one."""
    t = MeshTrainer(tiny_cfg("train.eval_every=0", "train.steps=4"), cache_dir)
    t.train_step()
    w = t.workers[0][1]
    weights = copy.deepcopy(w.module.state_dict())
    opt_state = copy.deepcopy(w.optimizer_state())
    gen = torch.Generator().manual_seed(0)
    params = list(w.module.parameters())
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)
    params[len(params) // 2].grad.view(-1)[3] = bad
    stats = w.step(1, 1e-3)
    assert stats["skipped"] and not torch.isfinite(torch.tensor(stats["grad_norm"]))
    assert all(torch.equal(weights[n], v) for n, v in w.module.state_dict().items())
    assert _leaves(w.optimizer_state()) == _leaves(opt_state)
    assert all(p.grad is None or not p.grad.any() for p in params)  # nothing carried into the next step
    hook = params[0].register_hook(lambda g: torch.full_like(g, bad))  # the same through a whole step
    rec = t.train_step()
    hook.remove()
    assert rec["skipped_stages"] == 1 and all(torch.equal(weights[n], v) for n, v in w.module.state_dict().items())
    rec = t.train_step()
    assert torch.isfinite(torch.tensor(rec["loss"])) and "skipped_stages" not in rec
    assert not all(torch.equal(weights[n], v) for n, v in w.module.state_dict().items())  # it trains on


# reference coding with maps and transform codes both ways, fitted every 2 steps, the fits in 4 bits, one-byte token
# scales: what the swarm runs, every kind of payload tensor
WIRE_CODED = ("model.stages=3", "mask.codec=rotq", "mask.bits=1", "mask.reference=both", "mask.reference_map_rank=8",
              "mask.reference_map_period=2", "mask.reference_code_bits=32", "mask.reference_grad_code_bits=16",
              "mask.reference_fit_bits=4", "mask.token_scale=log8")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device"))])
def test_a_stage_runs_what_the_wire_delivers_on_its_own_device(tiny_cfg, cache_dir, device):
    """A swarm stage gets its inputs, labels and gradients from the wire, on the CPU: on ``train.device`` the stages
    run them as they run the mesh's own payloads (same losses, same gradient sent back)."""
    from meshnode.protocol.limits import Limits
    from meshnode.protocol.messages import payload_from_wire, payload_to_wire
    from meshnode.stage import MicrobatchId

    cfg = tiny_cfg(*EXACT, *WIRE_CODED, f"train.device={device}")
    mesh = MeshTrainer(cfg, cache_dir)
    for _ in range(3):  # the first fits come after step 2: the payloads carry maps and codes
        mesh.train_step()
    workers = mesh.workers[0]
    assert workers[0].map_out.version >= 1 and workers[1].gcode_out.version >= 1
    assert workers[0].codec.token_scale == "log8"
    assert workers[1].device.type == device
    limits = Limits.from_config(cfg, cfg.model.tiny_hidden, cfg.model.tiny_vocab)
    ids = mesh.sources[0].batch(100)

    def wire(payload, kind):
        if payload is None:
            return None
        back = payload_from_wire(payload_to_wire(payload), limits, kind)
        assert all(t.device.type == "cpu" for t in back.tensors.values())
        return back

    def run(through_wire: bool):
        move = (lambda p, kind: wire(p, kind)) if through_wire else (lambda p, kind: p)
        mb = MicrobatchId(100, 0)
        for w in workers:  # every payload carries its fit again: 4-bit matrices and their steps cross the wire too
            for fits in (w.map_out, w.gcode_out):
                if fits is not None:
                    fits.shipped = False
        labels = ids.cpu() if through_wire else ids.to(workers[0].device)
        x, forwards = labels, []
        for w in workers:
            x = w.forward(mb, x if w.is_first else move(x, "activation"), labels=labels)
            if not w.is_last:
                forwards.append(x.tensors)
        loss, g, sent = x, None, []
        for w in reversed(workers):
            g = w.backward(mb, None if w.is_last else move(g, "grad"))
            sent.append(g)
        grads = [p.grad.detach().clone() for w in workers for p in w.module.parameters()]
        for w in workers:
            w.module.zero_grad(set_to_none=True)
        return loss, [s.tensors for s in sent if s is not None], grads, forwards

    direct, through = run(False), run(True)
    # the activation sent on carries the most tensors a payload may: codes, scales, the largest scale, channel means,
    # the map's two matrices, the code's basis, scales and bits, the three matrices' steps and the sampled reference
    from meshnode.protocol.messages import MAX_TENSORS

    assert max(len(t) for t in through[3]) == 13 == MAX_TENSORS
    assert through[0] == pytest.approx(direct[0], rel=1e-5)
    for a, b in zip(through[1], direct[1]):
        assert set(a) == set(b)
        if device == "cpu":  # bit for bit (a GPU may round a code the other way: its decode ran elsewhere)
            assert all(torch.equal(a[k], b[k]) for k in a)
    for a, b in zip(through[2], direct[2]):
        assert a.device.type == device
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
