"""Probe: what each boundary codec does to the pretrained model, before any training.

SmolLM2-135M cut into 3 stages (linux-doc). For every codec, on 2 held-out batches of 4 x 256 tokens:
the loss of the forward pass through both boundaries, the relative error of each boundary tensor, and
on 2 training batches the cosine between the full model's gradient (all stages, codec in the forward
and the backward) and the exact gradient. Bytes per token are one boundary crossing, forward + backward.

    python scripts/probe_boundary_codecs.py [--out docs/results/boundary_codecs.json]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from meshnode.compression import MaskKey, make_codec, simulate_transfer
from meshnode.config import MaskConfig
from meshnode.data import BatchSource, heldout_batches
from meshnode.stage import causal_lm_loss
from probe_common import load_probe_model  # scripts/ is on the path when a script runs

CODECS = {
    "dense": MaskConfig(),
    "int8": MaskConfig(codec="int8"),
    "int4": MaskConfig(codec="int4"),
    "rotq4": MaskConfig(codec="rotq", bits=4),
    "rotq2": MaskConfig(codec="rotq", bits=2),
    "rotq1": MaskConfig(codec="rotq", bits=1),
    "rotq4_norm": MaskConfig(codec="rotq", bits=4, rotq_weight="norm"),
    "rotq2_norm": MaskConfig(codec="rotq", bits=2, rotq_weight="norm"),
    "rotq1_norm": MaskConfig(codec="rotq", bits=1, rotq_weight="norm"),
    "rotq4_ns": MaskConfig(codec="rotq", bits=4, rotq_weight="norm_std"),
    "rotq2_ns": MaskConfig(codec="rotq", bits=2, rotq_weight="norm_std"),
    "rotq1_ns": MaskConfig(codec="rotq", bits=1, rotq_weight="norm_std"),
    "rotq4_nocenter": MaskConfig(codec="rotq", bits=4, rotq_center=False),
    "rotq2_nocenter": MaskConfig(codec="rotq", bits=2, rotq_center=False),
    "rotq1_nocenter": MaskConfig(codec="rotq", bits=1, rotq_center=False),
    "topk": MaskConfig(codec="topk", topk_ratio=0.1),
    "m90": MaskConfig(ratio=0.9),
    "m95": MaskConfig(ratio=0.95),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    model, corpus, stages = load_probe_model()
    params = [p for st in stages.values() for p in st.parameters()]
    hidden = model.config.hidden_size
    evals = heldout_batches(corpus.heldout, 4, 2)
    src = BatchSource(corpus.train, 4, seed=0)
    trains = [src.batch(p) for p in range(2)]

    def run(ids, codec, step, with_grad):
        h = stages[0](ids)
        errs = []
        for b in (0, 1):
            gain = stages[b].next_input_gain  # the receiving layer's input norm gains (rotq weighting)
            hr = simulate_transfer(codec, h, MaskKey(0, step, 0, b), gain=gain) if codec is not None else h
            errs.append(((hr.detach() - h.detach()).norm() / h.detach().norm()).item())
            h = stages[b + 1](hr)
        loss = causal_lm_loss(h, ids)
        if not with_grad:
            return loss.item(), errs, None
        grads = torch.autograd.grad(loss, params)
        return loss.item(), errs, torch.cat([g.flatten() for g in grads]).double()  # float64: 134M-term dot

    with torch.no_grad():
        ref_eval = sum(run(ids, None, i, False)[0] for i, ids in enumerate(evals)) / len(evals)
    ref_grads = [run(ids, None, 100 + i, True)[2] for i, ids in enumerate(trains)]
    print(f"unmasked held-out loss {ref_eval:.3f}")
    rows = {}
    for name, mcfg in CODECS.items():
        codec = make_codec(mcfg)
        with torch.no_grad():
            res = [run(ids, codec, i, False) for i, ids in enumerate(evals)]
        loss = sum(r[0] for r in res) / len(res)
        err = sum(sum(r[1]) for r in res) / (2 * len(res))
        cos = []
        for i, ids in enumerate(trains):
            g = run(ids, codec, 100 + i, True)[2]
            cos.append(torch.nn.functional.cosine_similarity(g, ref_grads[i], dim=0).item())
        nbytes = (codec.forward_nbytes(4, 256, hidden) + codec.backward_nbytes(4, 256, hidden)) / (2 * 4 * 256)
        rows[name] = {"loss": loss, "rel_err": err, "grad_cos": sum(cos) / len(cos), "bytes_per_token": nbytes,
                      "compression": 2 * hidden / nbytes}
        print(f"{name:14s} {codec.describe():40s} loss {loss:7.3f}  rel.err {err:.3f}  grad cos "
              f"{rows[name]['grad_cos']:.3f}  {nbytes:6.1f} B/token/direction ({2 * hidden / nbytes:5.1f}x vs bf16)")
    if args.out:
        args.out.write_text(json.dumps({"unmasked_loss": ref_eval, "codecs": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
