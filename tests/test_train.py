"""Dense reference training of the tiny model: loss falls, checkpoints resume bit-identically, export loads."""

from __future__ import annotations

import json

import pytest
import torch

from meshnode.mesh import MeshTrainer, export_checkpoint


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
    with pytest.raises(ValueError, match="stages"):
        other.load_checkpoint(tmp_path / "c")


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
