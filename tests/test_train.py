"""Dense reference training of the tiny model: loss falls, checkpoints resume bit-identically, export loads."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from meshnode.mesh import CheckpointError, MeshTrainer, export_checkpoint


def test_tiny_training_lowers_heldout_loss(tiny_cfg, cache_dir):
    cfg = tiny_cfg("train.steps=40", "train.eval_every=0")
    trainer = MeshTrainer(cfg, cache_dir)
    before = trainer.heldout_loss()
    records = []
    result = trainer.train(metrics=records.append)
    assert result.heldout_loss < before - 0.5, (before, result.heldout_loss)
    steps = [r for r in records if "loss" in r]
    assert [r["step"] for r in steps] == list(range(40))
    assert set(steps[0]) >= {"step", "tokens", "loss", "lr", "wall_s", "bytes"}
    final = records[-1]
    assert final["final"] and final["steps"] == 40 and final["tokens_per_s"] > 0
    # dense bf16 boundary: 2 bytes per hidden channel per token, each way, plus headers
    assert final["bytes_per_token"]["pp_fwd"] >= 64 * 2


def test_resume_is_bit_identical(tiny_cfg, cache_dir, tmp_path):
    cfg = tiny_cfg("train.steps=12", "train.eval_every=0", "train.bf16=false")
    straight = MeshTrainer(cfg, cache_dir)
    straight.train()
    first = MeshTrainer(cfg, cache_dir)
    first.train(until=5, checkpoint_dir=tmp_path / "ckpt")
    resumed = MeshTrainer(cfg, cache_dir)
    resumed.load_checkpoint(tmp_path / "ckpt")
    assert resumed.step == 5
    resumed.train()
    assert resumed.losses == straight.losses  # bit for bit
    for a, b in zip(straight.stage_modules(), resumed.stage_modules()):
        for (na, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
            assert torch.equal(pa, pb), na


def test_checkpoint_of_other_shape_is_refused(tiny_cfg, cache_dir, tmp_path):
    trainer = MeshTrainer(tiny_cfg("train.steps=1", "train.eval_every=0"), cache_dir)
    trainer.train(checkpoint_dir=tmp_path / "c")
    other = MeshTrainer(tiny_cfg("model.stages=3"), cache_dir)
    with pytest.raises(CheckpointError, match="stages"):
        other.load_checkpoint(tmp_path / "c")


def _weights(trainer):
    return [p.detach().clone() for m in trainer.stage_modules() for p in m.parameters()]


@pytest.mark.parametrize("damaged", ["trainer.json", "state.pt", "replica0-stage1.safetensors"])
def test_a_damaged_checkpoint_is_refused_and_changes_nothing(tiny_cfg, cache_dir, tmp_path, damaged):
    """A truncated file (a disk that filled up, a copy cut short) is a CheckpointError naming it, raised before any
    weight, optimizer state or counter of the resuming trainer changes; a checkpoint of another model's width too."""
    cfg = tiny_cfg("train.steps=2", "train.eval_every=0", "train.bf16=false")
    MeshTrainer(cfg, cache_dir).train(checkpoint_dir=tmp_path / "c")
    f = tmp_path / "c" / damaged
    f.write_bytes(f.read_bytes()[:300])
    fresh = MeshTrainer(cfg, cache_dir)
    before = _weights(fresh)
    with pytest.raises(CheckpointError, match=f"{damaged} is damaged") as info:
        fresh.load_checkpoint(tmp_path / "c")
    assert "\n" not in str(info.value)  # one line (torch.load's own message runs to twenty)
    assert fresh.step == 0 and fresh.losses == [] and fresh.tokens == 0
    assert all(torch.equal(a, b) for a, b in zip(before, _weights(fresh)))
    assert all(not w.optimizer.state for chain in fresh.workers for w in chain)


def test_a_checkpoint_of_another_width_is_refused(tiny_cfg, cache_dir, tmp_path):
    MeshTrainer(tiny_cfg("train.steps=1", "train.eval_every=0"), cache_dir).train(checkpoint_dir=tmp_path / "c")
    other = MeshTrainer(tiny_cfg("model.tiny_hidden=32", "model.tiny_heads=2", "model.tiny_kv_heads=1"), cache_dir)
    with pytest.raises(CheckpointError, match="holds other weights than this run's stage 0"):
        other.load_checkpoint(tmp_path / "c")


def test_a_save_cut_off_between_its_renames_resumes_from_the_one_before(tiny_cfg, cache_dir, tmp_path, caplog):
    """save_checkpoint moves the old checkpoint to DIR.old before moving the new one in; if it stops between the two,
    only DIR.old is left, and a resume takes it (with a warning) instead of starting over."""
    cfg = tiny_cfg("train.steps=3", "train.eval_every=0", "train.bf16=false")
    first = MeshTrainer(cfg, cache_dir)
    first.train(until=2, checkpoint_dir=tmp_path / "c")
    shutil.move(tmp_path / "c", tmp_path / "c.old")
    resumed = MeshTrainer(cfg, cache_dir)
    with caplog.at_level("WARNING"):
        resumed.load_checkpoint(tmp_path / "c")
    assert "a save was interrupted" in caplog.text
    assert resumed.step == 2 and resumed.losses == first.losses
    assert all(torch.equal(a, b) for a, b in zip(_weights(first), _weights(resumed)))
    resumed.train(checkpoint_dir=tmp_path / "c")  # the next save completes and clears the old one
    assert (tmp_path / "c" / "trainer.json").is_file() and not (tmp_path / "c.old").exists()
    with pytest.raises(CheckpointError, match="no checkpoint in"):
        MeshTrainer(cfg, cache_dir).load_checkpoint(tmp_path / "none")


def test_export_loads_in_transformers(tiny_cfg, cache_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    trainer = MeshTrainer(tiny_cfg("train.steps=3", "train.eval_every=0"), cache_dir)
    trainer.train(checkpoint_dir=tmp_path / "ckpt")
    out = export_checkpoint(tmp_path / "ckpt", tmp_path / "hf")
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is False
    model = AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    ids = trainer.eval_set[0][:2]
    with torch.no_grad():
        staged = ids
        for w in trainer.workers[0]:
            staged = w.eval_forward(staged)
        assert (model(ids).logits - staged).abs().max() < 1e-4
        gen = model.generate(ids[:1, :8], max_new_tokens=4, do_sample=False)
    assert gen.shape == (1, 12)


def test_export_average_writes_the_dp_replicas_exact_mean(tiny_cfg, cache_dir, tmp_path):
    """A checkpoint of an X = 2 run whose replicas differ (dp.keep_residual at rank 1): ``average`` writes their
    exact mean, which scores what the final record's heldout_loss_mean says; without it replica 0."""
    from transformers import AutoModelForCausalLM

    records = []
    trainer = MeshTrainer(tiny_cfg("train.steps=4", "train.eval_every=0", "dp.enabled=true", "dp.replicas=2",
                                   "dp.inner_steps=2", "dp.rank=1", "dp.keep_residual=true", "dp.fragments=1",
                                   "train.bf16=false"), cache_dir)
    trainer.train(metrics=records.append, checkpoint_dir=tmp_path / "ckpt")
    final = records[-1]
    assert abs(final["heldout_loss_mean"] - final["heldout_loss"]) > 1e-4  # the replicas differ
    ids = trainer.eval_set[0][:2]
    logits = {}
    for average in (False, True):
        out = export_checkpoint(tmp_path / "ckpt", tmp_path / f"hf{average}", average=average)
        with torch.no_grad():
            logits[average] = AutoModelForCausalLM.from_pretrained(out, local_files_only=True)(ids).logits
    with torch.no_grad():
        staged = ids
        for w in trainer.workers[0]:
            staged = w.eval_forward(staged)
    assert (logits[False] - staged).abs().max() < 1e-4
    assert (logits[True] - staged).abs().max() > 1e-3
    with torch.no_grad():  # replica 0 set to the mean, parameter by parameter: the averaged export's function
        for s in range(len(trainer.workers[0])):
            params = [dict(trainer.workers[r][s].module.named_parameters()) for r in range(2)]
            for n, p in params[0].items():
                p.copy_((p + params[1][n]) / 2)
        staged = ids
        for w in trainer.workers[0]:
            staged = w.eval_forward(staged)
    assert (logits[True] - staged).abs().max() < 1e-4
