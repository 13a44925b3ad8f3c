"""Where a mesh step's time goes: forward, backward, optimizer step and the ``dp.v_correction`` passes, per step.

Runs the quality table's DP row (X = 2, two microbatches of 2; ``scripts/quality_table.py``'s ``DP`` and ``MB2``)
on SmolLM2-135M for a warm-up step and ``--steps`` timed ones, once per ``--runs`` entry: ``mb2`` (the control),
``vc`` (with ``dp.v_correction``), ``mb2+ballastN`` (the control while the process holds N untouched-after-fill
fp32 tensors of 134.5M entries, the size of the correction's buffers: 8 for both replicas). Seconds are summed
over the 6 stage workers and divided by the steps.

    python scripts/probe_step_time.py --runs mb2,vc,mb2+ballast8 --out /tmp/step_time.json
"""

from __future__ import annotations

import argparse
import collections
import json
import platform
import sys
import time
from pathlib import Path

import torch

from meshnode.config import load_config
from meshnode.mesh import MeshTrainer
from meshnode.optim import MicrobatchNoise
from meshnode.stage import StageWorker

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
from quality_table import DP, MB2  # noqa: E402

TIMED = {MicrobatchNoise: ("after_microbatch", "variance", "before_step", "after_step", "reset"),
         StageWorker: ("forward", "backward", "step")}


def timed(acc: dict[str, float]) -> None:
    for cls, names in TIMED.items():
        for name in names:
            fn = getattr(cls, name)

            def wrapper(*args, _fn=fn, _key=f"{cls.__name__}.{name}", **kwargs):
                t0 = time.perf_counter()
                try:
                    return _fn(*args, **kwargs)
                finally:
                    acc[_key] += time.perf_counter() - t0

            setattr(cls, name, wrapper)


def one(run: str, steps: int, cache: Path, acc: dict[str, float]) -> dict:
    name, _, ballast = run.partition("+ballast")
    over = [*DP, *MB2, "train.steps=30"] + (["dp.v_correction=true"] if name == "vc" else [])
    trainer = MeshTrainer(load_config(ROOT / "configs" / "smollm2-linuxdoc.toml", over), cache)
    held = [torch.ones(134_500_000) for _ in range(int(ballast or 0))]
    trainer.train_step()  # warm-up: first allocations, AdamW state
    acc.clear()
    t0 = time.perf_counter()
    for _ in range(steps):
        trainer.train_step()
    total = (time.perf_counter() - t0) / steps
    del held, trainer
    return {"run": run, "s_per_step": round(total, 3), **{k: round(v / steps, 3) for k, v in acc.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", default="mb2,vc,mb2+ballast8")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--cache-dir", default=str(Path.home() / ".cache" / "meshnode"))
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    acc: dict[str, float] = collections.defaultdict(float)
    timed(acc)
    rows = []
    for run in args.runs.split(","):
        rows.append(one(run, args.steps, Path(args.cache_dir), acc))
        print(json.dumps(rows[-1]), flush=True)
    if args.out:
        rec = {"command": "python scripts/probe_step_time.py " + " ".join(sys.argv[1:]),
               "platform": platform.platform(), "threads": torch.get_num_threads(), "torch": torch.__version__,
               "rows": rows}
        Path(args.out).write_text(json.dumps(rec, indent=1))


if __name__ == "__main__":
    main()
