"""What the probes share: SmolLM2-135M and the linux-doc corpus from the local cache, cut into stages."""

from __future__ import annotations

from pathlib import Path

import torch

from meshnode.config import load_config
from meshnode.data import make_tokenizer, prepare_corpus
from meshnode.model import cut_model, load_model

ROOT = Path(__file__).resolve().parents[1]


def load_probe_model(stages: int = 3, config: str = "smollm2-linuxdoc.toml", threads: int = 2):
    """``(model, corpus, stage modules)`` from ``configs/<config>`` and ``~/.cache/meshnode``, on ``threads``
    CPU threads (nothing is downloaded: the cache is what ``meshnode`` built)."""
    torch.set_num_threads(threads)
    cfg = load_config(ROOT / "configs" / config)
    cache = Path.home() / ".cache" / "meshnode"
    model, hf_tok = load_model(cfg.model, cache)
    corpus = prepare_corpus(cfg.data, make_tokenizer(cfg.model, hf_tok), cache)
    return model, corpus, cut_model(model, stages)
