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
    ("dense_b32", 7, 1), ("dense_dp_vc_r2_h20_b32", 7, 2),
    ("rotq1_refmap64_tc288_g72_p10_fisher_f8_log8_dp_r2_h20_b32", 7, 2), ("dense_dp_vc_r1_h20_kr_b32", 7, 2),
    ("rotq1_refmap64_tc288_g72_p10_fisher_f8_log8_dp_r1_h20_kr_b32", 7, 2), ("dense_b16", 15, 1),
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


def test_a_row_at_another_batch_is_compared_with_dense_at_that_batch(tmp_path):
    import json

    def row(loss):
        return {"heldout_loss": {"linuxdoc": loss, "sotu": 3.0}, "wall_s": 1.0,
                "bytes_per_token": {"pp_fwd": 1, "pp_bwd": 1, "dp": 0, "anchor": 0, "total": 2}}

    runs = {"dense": row(2.0), "dense_b32": row(1.6), "x_b32": row(1.64), "x": row(2.1), "x_b8": row(2.2)}
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"steps": 60, "batch": [4, 256], "eval_batches": 8, "tasks": {"domain": runs}}))
    qt.render(path)
    cells = {line.split("|")[1].strip(): line.split("|")[4].strip()
             for line in path.with_suffix(".md").read_text().splitlines() if line.startswith("| ")}
    assert cells["dense_b32"] == "-20.0%"  # against the table's dense
    assert cells["x_b32"] == "+2.5%"  # against dense_b32
    assert cells["x"] == "+5.0%" and cells["x_b8"] == "+10.0%"  # no dense_b8 in the file: the table's dense


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


def test_the_steady_step_cost_is_a_step_without_a_fit(tiny_cfg, cache_dir):
    """The per-step bytes add up to the run's counter, and the steady cost is that of the steps that ship codes only:
    below the run's mean (which carries the fits and the uncoded warm-up), and exactly the cheapest step's."""
    cfg = tiny_cfg("train.steps=8", "train.eval_every=0", "model.stages=3", "mask.warmup_steps=2",
                   "mask.codec=rotq", "mask.bits=1", "mask.reference=both", "mask.reference_map_rank=8",
                   "mask.reference_map_period=4", "mask.reference_code_bits=32", "mask.reference_grad_code_bits=16")
    trainer = MeshTrainer(cfg, cache_dir)
    records: list[dict] = []
    trainer.train(metrics=records.append)
    per_step = qt.step_bytes(records)
    assert len(per_step) == 8
    final = trainer.counter.snapshot()
    assert {a: sum(s[a] for s in per_step) for a in qt.AXES} == {a: final[a] for a in qt.AXES}
    totals = [sum(s.values()) for s in per_step]
    assert len(set(totals[4:])) == 2, f"expected fit and no-fit steps in the second half: {totals}"
    per_step_tokens = trainer.tokens / 8
    steady = qt.steady_bytes_per_token(per_step, per_step_tokens)
    assert steady["total"] == min(totals[4:]) / per_step_tokens
    assert steady["total"] < final["total"] / trainer.tokens
    assert steady["pp_fwd"] > 0 and steady["pp_bwd"] > 0 and steady["dp"] == 0
    assert qt.steady_bytes_per_token([], per_step_tokens) == {}


def test_a_dp_rows_replica_mean_is_rendered_against_its_dense(tmp_path):
    import json

    def row(loss, mean=None):
        r = {"heldout_loss": {"linuxdoc": loss, "sotu": 3.0}, "wall_s": 1.0,
             "bytes_per_token": {"pp_fwd": 1, "pp_bwd": 1, "dp": 0, "anchor": 0, "total": 2}}
        if mean is not None:
            r["heldout_loss_mean"] = {"linuxdoc": mean, "sotu": 2.9}
        return r

    runs = {"dense_b32": row(2.0), "dp_b32": row(2.1, mean=2.05), "other_b32": row(2.2)}
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"steps": 60, "batch": [4, 256], "eval_batches": 8, "tasks": {"domain": runs}}))
    qt.render(path)
    means = [line for line in path.with_suffix(".md").read_text().splitlines() if line.startswith("- ")]
    assert means == ["- dp_b32: linux-doc 2.050 (+2.5%), sotu 2.900"]
    # a merged file's note (what it holds beside its command's rows) is rendered under the header
    path.write_text(json.dumps({"steps": 60, "batch": [4, 256], "eval_batches": 8, "note": "rows merged from X",
                                "tasks": {"domain": runs}}))
    qt.render(path)
    assert "rows merged from X" in path.with_suffix(".md").read_text().splitlines()
