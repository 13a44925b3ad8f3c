"""The quality table script's bookkeeping: the same tokens for every variant, and the live-gains oracle."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

import quality_table as qt  # noqa: E402
from meshnode.mesh import MeshTrainer  # noqa: E402

CFG = qt.ROOT / "configs" / qt.TASKS["domain"]  # batch 4, one microbatch


@pytest.mark.parametrize("variant,steps,replicas", [
    ("dense", 60, 1), ("dense_dp", 30, 2), ("dense_b8", 30, 1), ("m95_ap_dp", 30, 2), ("rotq4_ns_g1", 60, 1),
])
def test_every_variant_gets_the_same_tokens(variant, steps, replicas):
    assert qt.steps_for(CFG, qt.VARIANTS[variant], 60, []) == (steps, replicas)


@pytest.mark.parametrize("row", ["dense_dp", "m95_ap_dp"])
def test_dp_rows_take_the_default_outer_step_and_diloco_rows_differ_only_there(row):
    from meshnode.config import DPConfig, load_config

    table, diloco = load_config(CFG, qt.VARIANTS[row]), load_config(CFG, qt.VARIANTS[f"{row}_diloco"])
    default = DPConfig()
    assert (table.dp.outer_lr, table.dp.outer_momentum) == (default.outer_lr, default.outer_momentum)
    assert (diloco.dp.outer_lr, diloco.dp.outer_momentum) == (0.7, 0.9)
    diloco.dp.outer_lr, diloco.dp.outer_momentum = table.dp.outer_lr, table.dp.outer_momentum
    assert diloco == table


def test_a_batch_that_is_not_a_multiple_of_the_base_is_refused():
    with pytest.raises(SystemExit, match="multiple"):
        qt.steps_for(CFG, ["train.batch_size=6"], 60, [])
    assert qt.steps_for(CFG, ["train.microbatches=4"], 60, []) == (15, 1)


def test_live_gains_follow_the_receivers_trained_norm(tiny_cfg, cache_dir):
    trainer = MeshTrainer(tiny_cfg("train.steps=2", "train.eval_every=0", "model.stages=3"), cache_dir)
    senders, receivers = trainer.workers[0][:-1], trainer.workers[0][1:]
    loaded = [s.module.next_input_gain.clone() for s in senders]
    trainer.train_step()
    live = [r.module.layers[0].input_layernorm.weight.detach().float() for r in receivers]
    assert all(not torch.equal(a, b) for a, b in zip(loaded, live)), "the norms did not train"
    assert all(torch.equal(s.module.next_input_gain, a) for s, a in zip(senders, loaded)), "the copy moved alone"
    qt.refresh_next_gains(trainer)
    assert all(torch.equal(s.module.next_input_gain, b) for s, b in zip(senders, live))


def test_gain_jitter_moves_each_channel_by_its_size(tiny_cfg, cache_dir):
    trainer = MeshTrainer(tiny_cfg("model.stages=3", "dp.replicas=2"), cache_dir)
    loaded = [[w.module.next_input_gain.clone() for w in row[:-1]] for row in trainer.workers]
    qt.jitter_gains(trainer, 0.02)
    for row, before in zip(trainer.workers, loaded):
        for w, g in zip(row[:-1], before):
            ratio = w.module.next_input_gain / g
            assert torch.allclose((ratio - 1).abs(), torch.full_like(ratio, 0.02), atol=1e-6)
            assert (ratio > 1).any() and (ratio < 1).any()
    first = [w.module.next_input_gain for w in trainer.workers[0][:-1]]
    assert all(torch.equal(a, w.module.next_input_gain) for a, w in zip(first, trainer.workers[1][:-1]))
