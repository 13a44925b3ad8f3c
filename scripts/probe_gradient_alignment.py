"""Probe: do masked gradients point where the clean (unmasked) gradient points, and does the prior help?

SmolLM2-135M cut into 3 stages (linux-doc). For a few batches, computes the gradient of the targeted
matrices (attention q/k/v/o, MLP gate/up/down) with dense boundaries (G_clean) and with M95 boundaries
(G_mask, zero fill and mean fill, same batch and weights), and reports per stage the mean cosine
cos(G_mask, G_clean), the norm ratio, and the cosine after the paper's spectral filter
(alpha 0.3, tau 1e-3) whose prior is the clean gradient of *another* batch (what an anchor provides),
plus the filter with alpha = 0, and the share of the norm the alpha = 0 filter keeps of G_clean, of
G_mask and of the mask's error G_mask - G_clean. Aggregates over matrices and batches.

    python scripts/probe_gradient_alignment.py [--batches 3] [--ratio 0.95]
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
from pathlib import Path

import torch

from meshnode.config import load_config
from meshnode.data import BatchSource, make_tokenizer, prepare_corpus
from meshnode.model import cut_model, load_model
from meshnode.optim import SpectralFilter
from meshnode.stage import MicrobatchId, StageWorker, chain_gradients

ROOT = Path(__file__).resolve().parents[1]


def grads(workers, ids, step) -> list[dict[str, torch.Tensor]]:
    return chain_gradients(workers, MicrobatchId(step, 0), ids, [list(w.optimizer.filters) for w in workers])


def cos(a, b) -> float:
    return float((a * b).sum() / (a.norm() * b.norm() + 1e-30))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, default=3)
    ap.add_argument("--ratio", type=float, default=0.95)
    ap.add_argument("--out", default=str(ROOT / "docs" / "results" / "gradient_alignment.json"))
    args = ap.parse_args()
    torch.set_num_threads(2)
    cache = Path.home() / ".cache" / "meshnode"
    cfg = load_config(ROOT / "configs" / "smollm2-linuxdoc.toml", ["train.bf16=false"])
    model, hf_tok = load_model(cfg.model, cache)
    corpus = prepare_corpus(cfg.data, make_tokenizer(cfg.model, hf_tok), cache)
    stages = cut_model(model, cfg.model.stages)
    variants = {
        "clean": dataclasses.replace(cfg, mask=dataclasses.replace(cfg.mask, ratio=0.0)),
        "zero": dataclasses.replace(cfg, mask=dataclasses.replace(cfg.mask, ratio=args.ratio)),
        "mean": dataclasses.replace(cfg, mask=dataclasses.replace(cfg.mask, ratio=args.ratio, fill="mean")),
    }
    workers = {k: [StageWorker(copy.deepcopy(stages[s]) if k != "clean" else stages[s], c) for s in range(3)]
               for k, c in variants.items()}
    src = BatchSource(corpus.train, 4, seed=7)
    batches = [src.batch(i) for i in range(args.batches + 1)]
    g = {k: [grads(ws, ids, i) for i, ids in enumerate(batches)] for k, ws in workers.items()}
    rows = {}
    for s in range(3):
        acc: dict[str, list[float]] = {}
        for i in range(args.batches):
            prior = g["clean"][i + 1][s]  # another batch's clean gradient: what the anchor publishes
            for name, clean in g["clean"][i][s].items():
                acc.setdefault("cos(clean batch i, clean batch j)", []).append(cos(clean, prior[name]))
                for fill in ("zero", "mean"):
                    gm = g[fill][i][s][name]
                    acc.setdefault(f"{fill}: cos(G_mask, G_clean)", []).append(cos(gm, clean))
                    acc.setdefault(f"{fill}: |G_mask| / |G_clean|", []).append(float(gm.norm() / clean.norm()))
                    for alpha in (0.3, 0.0):
                        f = SpectralFilter(tuple(clean.shape), alpha=alpha, tau=1e-3, beta=0.95, rank=32)
                        f.update_prior(prior[name], 0)
                        acc.setdefault(f"{fill}: cos(filter a={alpha}(G_mask), G_clean)", []).append(
                            cos(f.filter(gm, 0), clean))
                        if alpha == 0.0:
                            # how much of each part the pure filter keeps: the signal (G_clean), the masked
                            # gradient, and the mask's error (G_mask - G_clean); a filter that helps keeps
                            # much more of the first than of the last
                            err = gm - clean
                            for what, t in (("G_clean", clean), ("G_mask", gm), ("G_mask - G_clean", err)):
                                acc.setdefault(f"{fill}: |filter a=0({what})| / |{what}|", []).append(
                                    float(f.filter(t, 0).norm() / (t.norm() + 1e-30)))
        rows[f"stage {s}"] = {k: round(sum(v) / len(v), 4) for k, v in acc.items()}
    print(json.dumps(rows, indent=1))
    Path(args.out).write_text(json.dumps({"command": "python scripts/probe_gradient_alignment.py "
                                          f"--batches {args.batches} --ratio {args.ratio}", "stages": rows}, indent=1))


if __name__ == "__main__":
    main()
