"""Probe: how unevenly the boundary gradient's channels are scaled, and what ``mask.grad_weight = std`` does.

Cuts SmolLM2-135M into 3 stages (linux-doc), runs 2 training batches of 4 x 256 tokens forward and backward
unmasked, and takes the gradient arriving at each boundary (what a stage sends back). Prints the spread of
its per-channel rms over the microbatch's tokens, and for the 1-bit and 4-bit rotated codec, unweighted and
weighted by ``1 / rms_c``: the total relative squared error, the per-channel relative squared error
(median, 90th percentile, max), and the cosine between the true parameter gradient of the sending stage's
residual-writing matrices (every layer's ``o_proj`` and ``down_proj``) and the one the decoded boundary
gradient gives (the gradient reaches those rows directly). Writes a JSON record with ``--out``.

    python scripts/probe_gradient_channels.py --out docs/results/probe-gradient-channels.json
"""

from __future__ import annotations

import argparse
import json

import torch

from meshnode.compression import RotQuantCodec
from meshnode.data import BatchSource
from meshnode.stage import causal_lm_loss
from probe_common import load_probe_model  # scripts/ is on the path when a script runs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, default=2)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    model, corpus, st = load_probe_model()
    src = BatchSource(corpus.train, 4, seed=0)
    codecs = {f"{bits} bit {w}": RotQuantCodec(4, grad_bits=bits, grad_weight=w)
              for bits in (1, 4) for w in ("none", "std")}
    rec: dict = {"boundaries": {}}
    for b in range(2):  # boundary b: stage b sends its output, stage b + 1 sends the gradient back
        rows: dict[str, dict[str, list[float]]] = {k: {"total": [], "median": [], "p90": [], "max": [], "cos": []}
                                                  for k in codecs}
        spread: list[list[float]] = []
        for i in range(args.batches):
            ids = src.batch(i)
            with torch.no_grad():
                h = ids
                for s in range(b):
                    h = st[s](h)
            sender = st[b]
            boundary_in = h
            out = sender(boundary_in)
            x = out.detach().requires_grad_(True)
            y = x
            for s in range(b + 1, 3):
                y = st[s](y)
            causal_lm_loss(y, ids).backward()
            g = x.grad.detach()
            rms = g.square().mean(dim=(0, 1)).sqrt()
            q = torch.quantile(rms, torch.tensor([0.01, 0.5, 0.99]))
            spread.append([float(rms.max() / rms.min()), float(q[2] / q[0]), float(rms.max() / q[1])])
            mats = [p for n, p in sender.named_parameters() if n.endswith(("o_proj.weight", "down_proj.weight"))]

            def param_grad(grad_out, out=out, mats=mats):
                gs = torch.autograd.grad(out, mats, grad_out, retain_graph=True)
                return torch.cat([t.reshape(-1) for t in gs])

            true = param_grad(g).double()  # a cosine over ~12M entries: fp32 sums drift past 1
            for name, codec in codecs.items():
                d = codec.decode_grad(codec.encode_grad(g))
                per = (d - g).square().sum(dim=(0, 1)) / g.square().sum(dim=(0, 1)).clamp_min(1e-30)
                r = rows[name]
                r["total"].append(float((d - g).square().sum() / g.square().sum()))
                r["median"].append(float(per.median()))
                r["p90"].append(float(torch.quantile(per, 0.9)))
                r["max"].append(float(per.max()))
                r["cos"].append(float(torch.nn.functional.cosine_similarity(param_grad(d).double(), true, dim=0)))
            model.zero_grad(set_to_none=True)
        mean = {k: {m: sum(v) / len(v) for m, v in r.items()} for k, r in rows.items()}
        s = [sum(c) / len(c) for c in zip(*spread)]
        print(f"boundary {b}: channel rms max/min {s[0]:.0f}, p99/p1 {s[1]:.1f}, max/median {s[2]:.1f}")
        for k, r in mean.items():
            print(f"  {k:>10}: total {r['total']:.4f}  per channel median {r['median']:.4f} p90 {r['p90']:.4f} "
                  f"max {r['max']:.2f}  cos(o/down grads) {r['cos']:.4f}")
        rec["boundaries"][b] = {"rms_max_over_min": s[0], "rms_p99_over_p1": s[1], "rms_max_over_median": s[2],
                                "codecs": mean}
    if args.out:
        rec["command"] = f"python scripts/probe_gradient_channels.py --batches {args.batches} --out {args.out}"
        with open(args.out, "w") as f:
            json.dump(rec, f, indent=1)


if __name__ == "__main__":
    main()
