"""Benchmark: what reference coding (``mask.reference``) costs a swarm peer in compute, per microbatch.

For SmolLM2-135M cut into 3 stages (batch 4 x 256, bf16 autocast, the run's thread count) it times, per stage:
the training pass (forward + backward with weight gradients), the frozen reference's forward (no graph), and
its forward + input-only backward. Each swarm peer of stage s runs the frozen passes that
:func:`meshnode.stage.peer_plan` lists; the script adds them up from the measured times and prints each
peer's time per microbatch without the reference, with ``forward`` and with ``both``. Writes a JSON record.

    python scripts/bench_refcoding.py --repeats 3 --out docs/results/bench-refcoding.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from meshnode.data import BatchSource
from meshnode.stage import ReferenceModel, causal_lm_loss, peer_plan
from probe_common import load_probe_model  # scripts/ is on the path when a script runs


def timed(fn, repeats: int) -> float:
    fn()  # warm-up
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    _, corpus, cut = load_probe_model(threads=args.threads)
    n = len(cut)
    stages = [cut[s] for s in range(n)]
    ref = ReferenceModel(stages)
    ids = BatchSource(corpus.train, 4, seed=0).batch(0)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16)
    with torch.no_grad(), autocast:  # each stage's input, as the pipeline gives it
        inputs = [ids]
        for s in range(n - 1):
            inputs.append(stages[s](inputs[-1]).float())

    def train_pass(s: int):
        x = inputs[s] if s == 0 else inputs[s].detach().requires_grad_(True)
        with autocast:
            y = stages[s](x)
        if s == n - 1:
            causal_lm_loss(y, ids).backward()
        else:
            y.float().backward(torch.ones_like(y, dtype=torch.float32) * 1e-6)
        for p in stages[s].parameters():
            p.grad = None

    def frozen_forward(s: int):
        with torch.no_grad(), autocast:
            ref.stages[s](inputs[s])

    def frozen_backward(s: int):  # forward + input-only backward of frozen stage s
        x = inputs[s].detach().requires_grad_(True)
        with autocast:
            y = ref.stages[s](x)
        out = causal_lm_loss(y, ids) if s == n - 1 else y.float().sum() * 1e-6
        torch.autograd.grad(out, x)

    rec: dict = {"stages": {}, "peers": {}}
    for s in range(n):
        rec["stages"][s] = {
            "train_s": timed(lambda s=s: train_pass(s), args.repeats),
            "frozen_fwd_s": timed(lambda s=s: frozen_forward(s), args.repeats),
            "frozen_fwd_bwd_s": timed(lambda s=s: frozen_backward(s), args.repeats) if s > 0 else None,
        }
        r = rec["stages"][s]
        print(f"stage {s}: train {r['train_s']:.3f} s, frozen forward {r['frozen_fwd_s']:.3f} s, frozen forward + "
              f"input backward {r['frozen_fwd_bwd_s'] or 0:.3f} s")
    for s in range(n):
        base = rec["stages"][s]["train_s"]
        row = {"none": base}
        for mode in ("forward", "both"):
            prefix, suffixes = peer_plan(s, n, mode)
            row[mode] = base + sum(rec["stages"][k]["frozen_fwd_s"] for k in prefix) + sum(
                rec["stages"][k]["frozen_fwd_bwd_s"] for k in suffixes)
        rec["peers"][s] = row
        print(f"peer of stage {s}: {row['none']:.3f} s per microbatch; with forward {row['forward']:.3f} s "
              f"({row['forward'] / row['none']:.2f}x), with both {row['both']:.3f} s "
              f"({row['both'] / row['none']:.2f}x)")
    slowest = {m: max(rec["peers"][s][m] for s in range(n)) for m in ("none", "forward", "both")}
    rec["slowest_peer_s"] = slowest
    print(f"slowest peer (the pipeline's pace when compute-bound): {slowest['none']:.3f} -> forward "
          f"{slowest['forward']:.3f} ({slowest['forward'] / slowest['none']:.2f}x), both {slowest['both']:.3f} "
          f"({slowest['both'] / slowest['none']:.2f}x)")
    rec["command"] = f"python scripts/bench_refcoding.py --repeats {args.repeats} --threads {args.threads}" + (
        f" --out {args.out}" if args.out else "")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rec, f, indent=1)


if __name__ == "__main__":
    main()
