"""Shared fixtures: a per-session cache directory and the tiny run config."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from meshnode.config import load_config

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny.toml"


@pytest.fixture(autouse=True, scope="session")
def _threads():
    torch.set_num_threads(2)


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("meshnode-cache")


@pytest.fixture
def tiny_cfg():
    def make(*overrides: str):
        return load_config(TINY, list(overrides))

    return make
