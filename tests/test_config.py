"""The run config: strict keys and types, overrides, the shipped configs."""

from __future__ import annotations

from pathlib import Path

import pytest

from meshnode.config import ConfigError, check_model_width, config_from_dict, load_config

CONFIGS = sorted((Path(__file__).resolve().parents[1] / "configs").glob("*.toml"))


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_shipped_configs_load(path):
    cfg = load_config(path)
    assert cfg.name and cfg.run_id.startswith(cfg.name)


def test_overrides_and_run_id():
    a = config_from_dict({}, ["train.lr=3e-4", "mask.rescale=rms", "model.boundaries=[4, 9]", "model.stages=3"])
    assert a.train.lr == 3e-4 and a.mask.rescale == "rms" and a.model.boundaries == [4, 9]
    assert config_from_dict({}).run_id != a.run_id


@pytest.mark.parametrize(
    "data,overrides,message",
    [
        ({"train": {"lr": "fast"}}, [], "train.lr: expected a number"),
        ({"trian": {}}, [], "trian: unknown key"),
        ({"train": {"lrr": 1.0}}, [], "train.lrr: unknown key"),
        ({}, ["mask.ratio=1.2"], "mask.ratio: 1.2 is outside"),
        ({}, ["mask.rescale=loud"], "mask.rescale: 'loud' is not one of"),
        ({}, ["train.batch_size=0"], "train.batch_size: must be > 0"),
        ({}, ["model.boundaries=[3]"], "model.boundaries: 1 boundaries given for 3 stages"),
        ({}, ["model.stages=3", "model.boundaries=[5, 2]"], "strictly increasing"),
        ({}, ["train.lr"], "expected key=value"),
        ({"model": 3}, [], "model: expected a table"),
        ({}, ["anchor.enabled=1"], "anchor.enabled: expected true or false"),
        ({}, ["anchor.priors=\"ipfs\""], "anchor.priors: 'ipfs' is not one of"),
        ({}, ["dp.matchmaking_time=20.0"], "dp.matchmaking_time: 20.0 s must be below dp.round_timeout"),
        ({}, ["dp.matchmaking_time=0"], "dp.matchmaking_time: must be > 0"),
        ({}, ["dp.clock=\"wall\""], "dp.clock: 'wall' is not one of"),
        ({}, ["train.bf16=\"maybe\""], "train.bf16: 'maybe' is not one of"),
        ({}, ["train.bf16=1"], "train.bf16: expected true, false or a string"),
        ({}, ["train.lr=nan"], "train.lr: expected a finite number, got nan"),
        ({"spectral": {"tau": float("inf")}}, [], "spectral.tau: expected a finite number, got inf"),
        ({}, ["dp.round_timeout=-inf"], "dp.round_timeout: expected a finite number"),
    ],
)
def test_bad_config_names_key(data, overrides, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace(".", r"\.")):
        config_from_dict(data, overrides)


def test_bad_files(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[train\nlr = 1")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(bad)


def test_bf16_takes_true_false_or_auto():
    assert [config_from_dict({}, [f"train.bf16={v}"]).train.bf16 for v in ("true", "false", "auto")] == [
        True, False, "auto"]


def test_widths_are_checked_against_the_model():
    """A residual map's rank and the transform codes' budgets are bounded by the model's width, which only the loaded
    model knows: at the bound they pass, one over it is a ConfigError naming the key."""
    coded = ["mask.codec=\"rotq\"", "mask.bits=1", "mask.reference=\"both\""]
    check_model_width(config_from_dict({}, [*coded, "mask.reference_map_rank=64", "mask.reference_code_bits=256",
                                            "mask.reference_grad_code_bits=256"]), 64)
    for key, value, needle in [("mask.reference_map_rank", 65, "65 is more than the model's 64 channels"),
                               ("mask.reference_code_bits", 257, "257 bits is more than 4 per channel"),
                               ("mask.reference_grad_code_bits", 257, "257 bits is more than 4 per channel")]:
        cfg = config_from_dict({}, [*coded, "mask.reference_map_rank=4", f"{key}={value}"])
        with pytest.raises(ConfigError, match=f"{key}: {needle}"):
            check_model_width(cfg, 64)
