"""Probe: how far fine-tuning moves the boundary tensors from what the *pretrained* model gives on the same tokens.

Every peer already holds the pretrained weights (it loads them from disk to start). So both ends of a stage
boundary could compute the pretrained model's boundary activation ``h_ref`` for the microbatch's tokens (the
tokens travel anyway) and the sender would code only the residual ``h - h_ref``; the same for the gradient
going back, with the pretrained copy of the later stages (``g_ref``: the gradient through the frozen later
stages at the same boundary input). If fine-tuning moves the boundaries little, the residual is small and a
codec spends its bits on it, not on the whole vector.

This probe measures that, before anything is built. It trains SmolLM2-135M densely (3 stages, linux-doc,
batch 4 x 256, AdamW, lr 1e-4 with 10 warmup steps, clip 1.0, bf16 autocast) and at a few steps takes two
held-out batches through the trained model (fp32) and reports, per boundary:

- ``rho_fwd``: ||h - h_ref|| / ||h - mean(h)|| (the norm the centred rotq codec works on), over all tokens;
- ``rho_bwd``: ||g - g_ref|| / ||g||;
- the relative squared reconstruction error of the rotated codec at 1, 2 and 4 bits, coding ``h`` directly
  (as now) and coding the residual (``h_ref + decode(encode(h - h_ref))``), and of ``h_ref`` alone (0 bits);
  the same for the gradient;
- the downstream cost: the trained model's held-out loss when that boundary's activation is replaced by the
  reconstruction, minus its loss with the exact one.

It also prints the compute such a codec would add: the frozen stages each side runs per microbatch.

``--snapshot-ages 10,20`` measures the same against the trained model as it was that many steps before each
measurement instead of the pretrained one (a reference both ends could hold if every peer followed the stages'
DP start weights, which are at most H steps old): recorded under ``snapshot_<age>`` beside each step's result.
``--snapshot-ranks 1,4`` also measures, for every age (``0`` allowed: the model of that step), the pretrained model
plus the best rank-r approximation of each matrix's change since then (vectors copied exactly): a reference that
peers could receive as low-rank deltas (``snapshot_<age>_r<rank>``, with the share of the change it holds,
``energy``, and the bytes of its factors in bfloat16, ``factor_bytes``, what each follower would receive at each
move). The DP start weights at rank 1 are such a reference, one rank-1 round per fragment at a time.

    python scripts/probe_reference_coding.py --steps 60 --out docs/results/probe-reference-coding.json
"""

from __future__ import annotations

import argparse
import copy
import json
import time

import torch

from meshnode.compression import RotQuantCodec
from meshnode.data import BatchSource, heldout_batches
from meshnode.mesh.refresh import low_rank_step
from meshnode.optim.schedule import lr_at
from meshnode.stage import causal_lm_loss
from probe_common import load_probe_model  # scripts/ is on the path when a script runs

BITS = (1, 2, 4)


def run_stages(stages, h, lo: int, hi: int):
    for s in range(lo, hi):
        h = stages[s](h)
    return h


class DenseProbeRun:
    """The probes' dense training: SmolLM2-135M in 3 stages on linux-doc, batch 4 x 256, AdamW lr 1e-4 (10 warmup
    steps, cosine over ``steps``), clip 1.0, bf16 autocast; with a frozen copy of the pretrained stages
    (``frozen``) and ``eval_batches`` held-out batches (``evals``)."""

    def __init__(self, steps: int, eval_batches: int):
        _, corpus, cut = load_probe_model()
        self.st = torch.nn.ModuleList([cut[i] for i in sorted(cut)])
        self.frozen = copy.deepcopy(self.st)
        for p in self.frozen.parameters():
            p.requires_grad_(False)
        self.evals = heldout_batches(corpus.heldout, 4, eval_batches)
        self.src = BatchSource(corpus.train, 4, seed=0)
        self.params = [p for p in self.st.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(self.params, lr=1e-4, weight_decay=0.0)
        self.steps = steps

    def step(self, step: int) -> float:
        """One optimizer step on training batch ``step``; returns its loss."""
        for g in self.opt.param_groups:
            g["lr"] = lr_at(step, 1e-4, 10, self.steps, 1.0)
        ids = self.src.batch(step)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = causal_lm_loss(run_stages(self.st, ids, 0, len(self.st)), ids)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.params, 1.0)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return float(loss.detach())

    def train_logged(self, step: int, rec: dict, t0: float) -> None:
        """:meth:`step`, its loss appended to ``rec["train_loss"]`` and printed every 10 steps."""
        rec["train_loss"].append(self.step(step))
        if step % 10 == 0:
            print(f"step {step} train loss {rec['train_loss'][-1]:.3f} ({time.time() - t0:.0f} s)", flush=True)


def save_record(rec: dict, command: str, out: str | None, t0: float) -> None:
    """The probe's record with its command and wall time, written to ``out`` (when given) as JSON."""
    rec["command"] = command + (f" --out {out}" if out else "")
    rec["wall_s"] = time.time() - t0
    if out:
        with open(out, "w") as f:
            json.dump(rec, f, indent=1)


def rel2(a: torch.Tensor, b: torch.Tensor, ref: torch.Tensor) -> float:
    """||a - b||^2 / ||ref||^2 in float64."""
    return float((a.double() - b.double()).square().sum() / ref.double().square().sum())


def centred(h: torch.Tensor) -> torch.Tensor:
    return h - h.mean(dim=(0, 1), keepdim=True)


def boundary_grad(stages, x: torch.Tensor, ids: torch.Tensor, b: int) -> torch.Tensor:
    """d loss / d (output of stage b), through ``stages`` b + 1 .. end, at input ``x``."""
    x = x.detach().requires_grad_(True)
    loss = causal_lm_loss(run_stages(stages, x, b + 1, len(stages)), ids)
    (g,) = torch.autograd.grad(loss, x)
    return g


def measure(st, frozen, batches, codecs) -> dict:
    out: dict = {}
    n = len(st)
    for b in range(n - 1):
        acc: dict[str, list[float]] = {}

        def add(k, v, acc=acc):
            acc.setdefault(k, []).append(v)

        for ids in batches:
            with torch.no_grad():
                h = run_stages(st, ids, 0, b + 1)
                h_ref = run_stages(frozen, ids, 0, b + 1)
                exact = float(causal_lm_loss(run_stages(st, h, b + 1, n), ids))
                hc = centred(h)
                add("rho_fwd", rel2(h, h_ref, hc) ** 0.5)
                add("fwd_ref_only", rel2(h_ref, h, hc))
                add("dloss_ref_only", float(causal_lm_loss(run_stages(st, h_ref, b + 1, n), ids)) - exact)
                for bits, c in codecs.items():
                    direct = c.decode(c.encode(h))
                    resid = h_ref + c.decode(c.encode(h - h_ref))
                    add(f"fwd_direct_{bits}", rel2(direct, h, hc))
                    add(f"fwd_resid_{bits}", rel2(resid, h, hc))
                    add(f"dloss_direct_{bits}", float(causal_lm_loss(run_stages(st, direct, b + 1, n), ids)) - exact)
                    add(f"dloss_resid_{bits}", float(causal_lm_loss(run_stages(st, resid, b + 1, n), ids)) - exact)
            g = boundary_grad(st, h, ids, b)
            g_ref = boundary_grad(frozen, h, ids, b)
            add("rho_bwd", rel2(g, g_ref, g) ** 0.5)
            add("cos_bwd_ref", float(torch.nn.functional.cosine_similarity(
                g.reshape(-1).double(), g_ref.reshape(-1).double(), dim=0)))
            add("bwd_ref_only", rel2(g_ref, g, g))
            for bits, c in codecs.items():
                add(f"bwd_direct_{bits}", rel2(c.decode_grad(c.encode_grad(g)), g, g))
                add(f"bwd_resid_{bits}", rel2(g_ref + c.decode_grad(c.encode_grad(g - g_ref)), g, g))
        out[b] = {k: sum(v) / len(v) for k, v in acc.items()}
    return out


@torch.no_grad()
def low_rank_references(frozen, snap, ranks: list[int]) -> dict[int, tuple]:
    """Per rank r: ``frozen`` moved towards ``snap`` by :func:`meshnode.mesh.refresh.low_rank_step` (each matrix's
    change truncated to its best rank-r approximation, a vector's whole), the share of the change's squared norm it
    keeps, and the bytes of its factors in bfloat16."""
    held, target = dict(frozen.named_parameters()), dict(snap.named_parameters())
    total = sum(float((target[n].double() - h.double()).square().sum()) for n, h in held.items())
    out = {}
    for r in ranks:
        moved, nbytes = low_rank_step(held, target, r)
        kept = sum(float((moved[n].double() - h.double()).square().sum()) for n, h in held.items())
        ref = copy.deepcopy(frozen)
        for n, p in ref.named_parameters():
            p.copy_(moved[n])
        out[r] = (ref, kept / max(total, 1e-30), nbytes)
    return out


def report(step: int, res: dict) -> None:
    for b, r in res.items():
        print(f"step {step} boundary {b}: rho_fwd {r['rho_fwd']:.4f}  rho_bwd {r['rho_bwd']:.4f}  "
              f"cos(g, g_ref) {r['cos_bwd_ref']:.4f}")
        print("   bits | fwd err direct / residual | dloss direct / residual | bwd err direct / residual")
        print(f"      0 |        -      / {r['fwd_ref_only']:.5f} |     -     / {r['dloss_ref_only']:+.4f} |"
              f"        -      / {r['bwd_ref_only']:.5f}")
        for bits in BITS:
            print(f"      {bits} | {r[f'fwd_direct_{bits}']:.5f} / {r[f'fwd_resid_{bits}']:.5f} | "
                  f"{r[f'dloss_direct_{bits}']:+.4f} / {r[f'dloss_resid_{bits}']:+.4f} | "
                  f"{r[f'bwd_direct_{bits}']:.5f} / {r[f'bwd_resid_{bits}']:.5f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--at", default="0,10,30,60", help="steps at which to measure (comma-separated)")
    ap.add_argument("--eval-batches", type=int, default=2)
    ap.add_argument("--out", default=None)
    ap.add_argument("--snapshot-ages", default="", help="also measure against the model this many steps earlier")
    ap.add_argument("--snapshot-ranks", default="",
                    help="and against the pretrained model plus a rank-r approximation of each snapshot's change")
    args = ap.parse_args()
    at = sorted({int(s) for s in args.at.split(",") if int(s) <= args.steps})
    ages = sorted({int(a) for a in args.snapshot_ages.split(",") if a})
    ranks = sorted({int(r) for r in args.snapshot_ranks.split(",") if r})
    run = DenseProbeRun(args.steps, args.eval_batches)
    codecs = {bits: RotQuantCodec(bits) for bits in BITS}
    rec: dict = {"steps": {}, "train_loss": []}
    snapshots: dict[int, torch.nn.ModuleList] = {}  # step -> a frozen copy of the stages as they were then
    t0 = time.time()
    for step in range(args.steps + 1):
        if any(step + a in at for a in ages):
            snapshots[step] = copy.deepcopy(run.st).requires_grad_(False)
        if step in at:
            run.st.eval()
            res = measure(run.st, run.frozen, run.evals, codecs)
            report(step, res)
            for a in ages:
                if step - a not in snapshots:
                    continue
                snap = snapshots[step - a].eval()
                if a:
                    res[f"snapshot_{a}"] = measure(run.st, snap, run.evals, codecs)
                    print(f"-- against the model of step {step - a} ({a} steps old):")
                    report(step, res[f"snapshot_{a}"])
                for rank, (ref, energy, nbytes) in low_rank_references(run.frozen, snap, ranks).items():
                    key = f"snapshot_{a}_r{rank}"
                    res[key] = {**measure(run.st, ref.eval(), run.evals, codecs), "energy": energy,
                                "factor_bytes": nbytes}
                    print(f"-- against the pretrained model plus rank {rank} of its change to step {step - a} "
                          f"({energy:.3f} of the change's squared norm, {nbytes / 1e6:.2f} MB of factors):")
                    report(step, {b: r for b, r in res[key].items() if isinstance(b, int)})
                del snap
            rec["steps"][step] = res
            run.st.train()
            for old in [k for k in snapshots if k <= step - max(ages, default=0)]:
                del snapshots[old]
        if step == args.steps:
            break
        run.train_logged(step, rec, t0)
    save_record(rec, f"python scripts/probe_reference_coding.py --steps {args.steps} --at {args.at} "
                f"--eval-batches {args.eval_batches}" + (f" --snapshot-ages {args.snapshot_ages}" if ages else "")
                + (f" --snapshot-ranks {args.snapshot_ranks}" if ranks else ""),
                args.out, t0)


if __name__ == "__main__":
    main()
