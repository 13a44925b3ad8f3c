"""Benchmark of the foundation (issue 3): staged-vs-full logits on SmolLM2, then dense domain adaptation.

1. Loads SmolLM2-135M (the bundled GGUF, cached as safetensors), cuts it into 3 stages and compares the
   staged logits with the uncut model's on real held-out linux-doc text, in fp32: max abs diff.
2. Trains the stage-cut model densely on linux-doc (``configs/smollm2-linuxdoc.toml``) for ``--steps``
   steps at batch 4 x 256, and records tokens/s, peak RSS, and held-out loss on linux-doc and on sotu
   before and after.

    python scripts/bench_reference.py --steps 100 --out docs/results/reference.json
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import platform
import resource
import time
from pathlib import Path

import torch

from meshnode.config import load_config
from meshnode.data import heldout_batches, make_tokenizer, prepare_corpus
from meshnode.mesh import MeshTrainer
from meshnode.model import cut_model, load_model

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(ROOT / "configs" / "smollm2-linuxdoc.toml"))
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--eval-batches", type=int, default=8)
    ap.add_argument("--cache-dir", default=str(Path.home() / ".cache" / "meshnode"))
    ap.add_argument("--set", action="append", default=[], help="config override key=value")
    ap.add_argument("--out", default=str(ROOT / "docs" / "results" / "reference.json"))
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    cache = Path(args.cache_dir)
    cfg = load_config(args.config, [f"train.steps={args.steps}", f"train.eval_batches={args.eval_batches}", *args.set])
    torch.set_num_threads(cfg.train.threads or torch.get_num_threads())

    # 1. staged vs full logits, fp32, on real held-out text
    t0 = time.perf_counter()
    model, hf_tok = load_model(cfg.model, cache)
    load_s = time.perf_counter() - t0
    tok = make_tokenizer(cfg.model, hf_tok)
    corpus = prepare_corpus(cfg.data, tok, cache)
    ids = heldout_batches(corpus.heldout, 2, 1)[0]  # (2, 256)
    with torch.no_grad():
        full = model(ids).logits
        stages = cut_model(copy.deepcopy(model), cfg.model.stages, cfg.model.boundaries)
        h = ids
        for s in range(cfg.model.stages):
            h = stages[s](h)
    max_diff = (h - full).abs().max().item()
    logging.info("staged vs full logits: max abs diff %.3g (load %.2f s)", max_diff, load_s)
    del model, stages

    # 2. dense adaptation
    sotu_cfg = load_config(ROOT / "configs" / "smollm2-sotu.toml", [f"train.eval_batches={args.eval_batches}"])
    trainer = MeshTrainer(cfg, cache)
    sotu = prepare_corpus(sotu_cfg.data, trainer.tokenizer, cache)
    sotu_eval = heldout_batches(sotu.heldout, cfg.train.batch_size, args.eval_batches)
    before = {"linuxdoc": trainer.heldout_loss(), "sotu": trainer.heldout_loss(batches=sotu_eval)}
    logging.info("held-out before: %s", before)
    records = []
    t1 = time.perf_counter()
    result = trainer.train(metrics=records.append)
    train_s = time.perf_counter() - t1
    after = {"linuxdoc": result.heldout_loss, "sotu": trainer.heldout_loss(batches=sotu_eval)}
    final = records[-1]
    out = {
        "command": "python scripts/bench_reference.py " + " ".join(
            [f"--steps {args.steps}"] + [f"--set {s}" for s in args.set]
        ),
        "model": cfg.model.source, "stages": cfg.model.stages, "model_load_s": round(load_s, 2),
        "staged_vs_full_max_abs_diff_fp32": max_diff,
        "steps": args.steps, "batch": [cfg.train.batch_size, cfg.data.seq_len], "bf16": cfg.train.bf16,
        "bf16_autocast": trainer.workers[0][0].bf16,
        "lr": cfg.train.lr, "tokens_per_s": final["tokens_per_s"], "train_wall_s": round(train_s, 1),
        "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "heldout_before": before, "heldout_after": after,
        "heldout_delta": {k: after[k] - before[k] for k in before},
        "loss_curve": [r["loss"] for r in records if "loss" in r],
        "eval_curve": [[r["step"], r["heldout_loss"]] for r in records if "heldout_loss" in r and not r.get("final")],
        "threads": torch.get_num_threads(), "machine": platform.machine(), "torch": torch.__version__,
        "corpus": {"linuxdoc": corpus.meta["splits"], "sotu": sotu.meta["splits"]},
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    logging.info("wrote %s", args.out)
    print(json.dumps({k: v for k, v in out.items() if k not in ("loss_curve", "corpus")}, indent=1))


if __name__ == "__main__":
    main()
