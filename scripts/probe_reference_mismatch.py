"""Probe: how far two peers' frozen references drift apart when they compute them differently.

Reference coding (``mask.reference``) has the receiver add *its own* reference to what it decodes; the sender coded
against *its* reference. Same weights and autocast (the digest checks both) still leave the numbers: another GPU
type's kernels or another BLAS round differently. The reference check (``mask.reference_check``) measures that
difference from 8 sampled entries per payload and refuses a microbatch above ``mask.reference_tolerance`` (0.1
since this probe; first 0.01). This probe puts numbers on what such a difference is, with what this CPU can
compute two ways:

- ``threads``: float32 with 1 thread against 2 (another split of the same reductions),
- ``bf16``: bfloat16 autocast against float32 (what a peer computing in bf16 would be off by from a float32 one; the
  digest refuses that pairing, so this is a scale for bf16 kernels of two vendors, not a case that occurs),

for SmolLM2-135M's pretrained stages (3, the quality table's cut) on held-out linux-doc tokens, per boundary:
the relative root-mean-square difference of the activation reference over the whole tensor, the check's estimate of
it from 8 entries, and the same for the reference gradient; and what the difference costs: the frozen model's loss
with the boundary replaced by the other computation's, minus its loss with its own.

    python scripts/probe_reference_mismatch.py --tokens 128 --out docs/results/probe-reference-mismatch.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time

import torch

from meshnode.data import heldout_batches
from meshnode.stage import ReferenceModel, causal_lm_loss
from meshnode.stage.reference import reference_difference, reference_sample
from probe_common import load_probe_model  # scripts/ is on the path when a script runs


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| over the whole tensor, in float64."""
    return float((a.double() - b.double()).norm() / b.double().norm())


def references(stages, ids, autocast, threads: int) -> dict:
    """A reference model computed one way (``autocast``, ``threads``) and every boundary's activation from it."""
    torch.set_num_threads(threads)
    ref = ReferenceModel(stages, autocast=autocast, copy_modules=False)
    n = ref.num_stages
    acts = [ref.activation("k", ids, b) for b in range(n - 1)]
    return {"ref": ref, "acts": acts}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=128, help="sequence length of the one held-out sequence")
    ap.add_argument("--samples", type=int, default=8, help="entries the check samples (mask.reference_check)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    t0 = time.time()
    _, corpus, cut = load_probe_model()
    stages = [cut[i] for i in sorted(cut)]
    ids = heldout_batches(corpus.heldout, 1, 1)[0][:, : args.tokens]

    def bf16():
        return torch.autocast("cpu", dtype=torch.bfloat16)

    ways = {"float32_2threads": (contextlib.nullcontext, 2), "float32_1thread": (contextlib.nullcontext, 1),
            "bf16_2threads": (bf16, 2)}
    got = {name: references(stages, ids, ac, th) for name, (ac, th) in ways.items()}
    base = got["float32_2threads"]
    n = len(stages)
    rec: dict = {"tokens": int(ids.numel()), "samples": args.samples, "boundaries": {}}
    for b in range(n - 1):
        torch.set_num_threads(2)
        x = base["acts"][b]
        with torch.no_grad():
            own_loss = float(causal_lm_loss(_run(stages, x, b + 1), ids))
        row: dict = {}
        for name in ("float32_1thread", "bf16_2threads"):
            other = got[name]
            autocast, threads = ways[name]
            torch.set_num_threads(threads)
            g_other = other["ref"].input_grad("k", ids, b, x)
            torch.set_num_threads(2)
            g_base = base["ref"].input_grad("k", ids, b, x)
            a = other["acts"][b]
            with torch.no_grad():
                swapped = float(causal_lm_loss(_run(stages, a, b + 1), ids))
            row[name] = {
                "act_rel": rel(a, x),
                "act_check": reference_difference(reference_sample(x, args.samples),
                                                  reference_sample(a, args.samples)),
                "grad_rel": rel(g_other, g_base),
                "grad_check": reference_difference(reference_sample(g_base, args.samples),
                                                   reference_sample(g_other, args.samples)),
                "dloss_swapped": swapped - own_loss,
            }
            print(f"boundary {b} {name}: activation {row[name]['act_rel']:.3g} (check {row[name]['act_check']:.3g}), "
                  f"gradient {row[name]['grad_rel']:.3g} (check {row[name]['grad_check']:.3g}), loss with the other "
                  f"boundary {row[name]['dloss_swapped']:+.3g}", flush=True)
        rec["boundaries"][b] = row
    rec["command"] = "python scripts/probe_reference_mismatch.py " + " ".join(
        f"--{k} {v}" for k, v in vars(args).items() if v is not None)
    rec["wall_s"] = time.time() - t0
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rec, f, indent=1)


def _run(stages, h, lo: int):
    for s in range(lo, len(stages)):
        h = stages[s](h)
    return h


if __name__ == "__main__":
    main()
