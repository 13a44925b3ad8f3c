"""The command line: help, clear one-line errors with non-zero exit, and one real subprocess run."""

from __future__ import annotations

import json
import subprocess
import sys

from typer.testing import CliRunner

from meshnode.cli import app

from .conftest import TINY

runner = CliRunner()


def test_help_and_version():
    r = runner.invoke(app, ["--help"])
    assert r.exit_code == 0 and "train" in r.output
    r = runner.invoke(app, ["--version"])
    assert r.exit_code == 0 and "meshnode" in r.output
    assert runner.invoke(app, ["train", "--help"]).exit_code == 0


def _fails_cleanly(args, needle, cache_dir):
    r = runner.invoke(app, [*args, "--cache-dir", str(cache_dir)] if args[0] == "train" else args)
    assert r.exit_code == 1, r.output
    assert needle in r.output
    assert "Traceback" not in r.output
    return r


def test_bad_config_is_one_clear_line(tmp_path, cache_dir):
    args = ["train", "--config", str(TINY), "--set", "train.lr=fast"]
    _fails_cleanly(args, "train.lr: expected a number", cache_dir)
    _fails_cleanly(["train", "--config", str(tmp_path / "none.toml")], "config file not found", cache_dir)


def test_settings_the_model_or_corpus_cannot_hold_are_one_clear_line(cache_dir):
    """Checked once the model and corpus are loaded, before any step: a residual map wider than the model, and a
    batch larger than the training shard (it used to build the batch row by row, for ever)."""
    coded = ["--set", "mask.codec=\"rotq\"", "--set", "mask.bits=1", "--set", "mask.reference=\"both\""]
    _fails_cleanly(["train", "--config", str(TINY), *coded, "--set", "mask.reference_map_rank=1000"],
                   "mask.reference_map_rank: 1000 is more than the model's", cache_dir)
    _fails_cleanly(["train", "--config", str(TINY), "--set", "train.batch_size=1000000000"],
                   "a batch of 1000000000 sequences, but shard 0 of 1 holds", cache_dir)


def test_missing_corpus_and_unknown_model(tmp_path, cache_dir):
    _fails_cleanly(
        ["train", "--config", str(TINY), "--set", f"data.source=\"dir:{tmp_path / 'nope'}\""], "directory not found",
        cache_dir,
    )
    _fails_cleanly(["train", "--config", str(TINY), "--set", "model.source=\"gpt9\""], "unknown source", cache_dir)


def test_train_subprocess_writes_metrics(tmp_path, cache_dir):
    metrics = tmp_path / "m.jsonl"
    proc = subprocess.run(
        [sys.executable, "-m", "meshnode.cli", "train", "--config", str(TINY), "--steps", "6", "--set",
         "train.eval_every=3", "--metrics-out", str(metrics), "--cache-dir", str(cache_dir),
         "--checkpoint-dir", str(tmp_path / "ck")],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    recs = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in recs if "loss" in r] == list(range(6))
    assert [r["step"] for r in recs if "heldout_loss" in r and not r.get("final")] == [0, 3]
    assert recs[-1]["final"] is True and recs[-1]["steps"] == 6
    assert "held-out loss" in proc.stderr
    r = runner.invoke(app, ["export", "--checkpoint", str(tmp_path / "ck"), "--out", str(tmp_path / "hf")])
    assert r.exit_code == 0 and (tmp_path / "hf" / "config.json").is_file()
    r = runner.invoke(app, ["export", "--checkpoint", str(tmp_path / "nothing"), "--out", str(tmp_path / "x")])
    assert r.exit_code == 1 and "no checkpoint in" in r.output
    weights = tmp_path / "ck" / "replica0-stage1.safetensors"
    weights.write_bytes(weights.read_bytes()[:200])  # a copy cut short: one line, no traceback
    r = runner.invoke(app, ["export", "--checkpoint", str(tmp_path / "ck"), "--out", str(tmp_path / "y")])
    assert r.exit_code == 1 and "replica0-stage1.safetensors is damaged" in r.output, r.output
    assert "Traceback" not in r.output and not (tmp_path / "y").exists()


def test_demo_methods_make_valid_configs_and_unknown_ones_fail(cache_dir):
    import pytest

    from meshnode.config import load_config
    from meshnode.node.claim import fixed_routes
    from meshnode.node.demo import DEMO_METHODS, method_overrides

    rotq_bits = {"rotq4": (4, 0), "rotq4g1": (4, 1), "rotq2": (2, 0)}  # (activation bits, gradient bits; 0 = same)
    assert set(rotq_bits) <= set(DEMO_METHODS)
    for method in DEMO_METHODS:
        if method.endswith("rr"):  # a moving reference: with DP, fixed routes (one reference per replica chain)
            cfg = load_config(TINY, method_overrides(method, tiny=True, dp_peers=1, anchor=True, anchor_key="k"))
            assert not cfg.dp.enabled and cfg.mask.reference_code_bits == 32 and not fixed_routes(cfg)
            assert (cfg.mask.reference_refresh, cfg.mask.reference_refresh_rank) == (10, 1)
            cfg = load_config(TINY, method_overrides(method, tiny=True, dp_peers=2, anchor=True, anchor_key="k"))
            assert cfg.dp.enabled and cfg.dp.replicas == 2 and fixed_routes(cfg)
            continue
        over = method_overrides(method, tiny=True, dp_peers=2, anchor=True, anchor_key="k")
        cfg = load_config(TINY, over)
        assert cfg.dp.enabled and cfg.anchor.enabled == (method == "m95")
        assert cfg.anchor.snapshot == ("dp" if method == "m95" else "full")
        if method == "rotq2ref":
            assert (cfg.mask.codec, cfg.mask.bits, cfg.mask.reference) == ("rotq", 2, "both")
        elif method.startswith("rotq1refmap"):
            assert (cfg.mask.codec, cfg.mask.bits, cfg.mask.reference) == ("rotq", 1, "both")
            assert (cfg.mask.reference_map_rank, cfg.mask.reference_map_period) == (8, 10)
            assert cfg.mask.reference_code_bits == cfg.mask.reference_grad_code_bits == (
                32 if method == "rotq1refmaptc" else 0)
        elif method.startswith("rotq"):
            assert cfg.mask.codec == "rotq" and cfg.mask.rotq_weight == "norm_std"
            assert (cfg.mask.bits, cfg.mask.grad_bits) == rotq_bits[method]
    with pytest.raises(ValueError, match="unknown demo method"):
        method_overrides("m99", tiny=True, dp_peers=1, anchor=False, anchor_key="")
    _fails_cleanly(["demo", "--tiny", "--method", "m99"], "not one of", cache_dir)


def test_rebalance_delay_of_join():
    """Who may move to a stage left without peers: a fast peer whose stage was chosen for it, after 30 s; a fixed
    --stage only with --rebalance-after; never a driver, an anchor, or with --no-rebalance. Bad delays are one
    clear line."""
    import pytest

    from meshnode.cli import rebalance_delay
    from meshnode.config import ConfigError

    assert rebalance_delay(None, False, stage_fixed=False, role="fast") == 30.0
    assert rebalance_delay(None, False, stage_fixed=True, role="fast") is None
    assert rebalance_delay(3.0, False, stage_fixed=True, role="fast") == 3.0
    assert rebalance_delay(None, True, stage_fixed=False, role="fast") is None
    assert rebalance_delay(None, False, stage_fixed=False, role="driver") is None
    assert rebalance_delay(None, False, stage_fixed=False, role="anchor") is None
    for after, never, role, needle in [(3.0, True, "fast", "contradict"), (3.0, False, "anchor", "never moves")]:
        with pytest.raises(ConfigError, match=needle):
            rebalance_delay(after, never, stage_fixed=False, role=role)
    r = runner.invoke(app, ["join", "--config", str(TINY), "--rebalance-after", "-1"])
    assert r.exit_code == 1 and "--rebalance-after: -1.0 is not a number of seconds >= 0" in r.output, r.output
    assert "Traceback" not in r.output


def test_join_refuses_a_bad_slowdown_or_checkpoint_period():
    """``--slowdown`` emulates slower hardware; a factor below 1, NaN or absurdly large is one clear line, before
    any network or model work; so is a checkpoint period that is negative or not a number."""
    for bad in ("0.5", "nan", "1e9"):
        r = runner.invoke(app, ["join", "--config", str(TINY), "--slowdown", bad])
        assert r.exit_code == 1 and "--slowdown" in r.output and "between 1 and 1000" in r.output, r.output
        assert "Traceback" not in r.output
    for bad in ("-1", "nan", "inf"):
        r = runner.invoke(app, ["join", "--config", str(TINY), "--checkpoint-every", bad])
        assert r.exit_code == 1 and "--checkpoint-every" in r.output and "seconds >= 0" in r.output, r.output
        assert "Traceback" not in r.output
