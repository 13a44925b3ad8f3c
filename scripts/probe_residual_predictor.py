"""Probe: how much of the reference residual ``h - h_ref`` a sender could predict from ``h_ref``, and what
fewer than one bit per coordinate would cost.

Reference coding (``mask.reference``, ``docs/quality.md``) sends ``r = h - h_ref``: what fine-tuning changed
at a boundary. At 1 bit per coordinate it costs +1.4-1.6 % over dense (15x fewer bytes); to reach 20-40x a
codec must spend less than one bit per coordinate, which only pays if ``r`` has structure a few bytes can
carry. This probe asks two questions of a densely trained model (SmolLM2-135M, 3 stages, linux-doc, batch
4 x 256, AdamW lr 1e-4, the same loop as ``probe_reference_coding.py``):

1. **Is r a function of h_ref a sender could ship?** A ridge regression ``r ~ h_ref A`` (both centred per
   microbatch, as the rotq codec centres) fitted on ``--fit-batches`` *training* batches (what a sender has
   seen), tested on held-out batches; also its best rank-k versions (reduced-rank regression; a rank-k map
   costs ``2 k H`` numbers to send). ``A`` fitted ``--stale`` steps before is tested too (a shipped map ages).
   Reported: the fraction of r's energy (centred) the map explains on held-out tokens.
2. **What do sub-bit codes cost downstream?** The held-out loss increase when a boundary's activation is
   replaced by ``h_ref + [pred +] decode(code(r [- pred]))`` with the rotated 1-bit code, and with a rotated
   *subsampled* 1-bit code (keep a fraction f of the rotated coordinates, chosen by a fixed seed; the rest
   decode to 0): about ``f`` bits per coordinate.

    python scripts/probe_residual_predictor.py --steps 60 --at 30,60 --out docs/results/probe-residual-predictor.json
"""

from __future__ import annotations

import argparse
import time

import torch

from meshnode.compression import RotQuantCodec
from meshnode.compression.rotquant import rotation, rotq_decode, rotq_encode
from meshnode.stage import causal_lm_loss
from probe_reference_coding import DenseProbeRun, boundary_grad, run_stages, save_record

RANKS = (4, 16, 64)
KEEP = (1.0, 0.5, 0.25)


def centre(x: torch.Tensor) -> torch.Tensor:  # per microbatch, per channel (the rotq codec's centring)
    return x - x.mean(dim=(0, 1), keepdim=True)


def fit_map(xs: list[torch.Tensor], ys: list[torch.Tensor], ridge: float, center: bool = True) -> torch.Tensor:
    """Ridge regression y ~ x A over all tokens (float64). The inputs are standardised per channel for the
    penalty (the residual stream's few huge channels would otherwise set it for all), ``ridge`` times the
    number of tokens; the returned map acts on the unstandardised x."""
    c = centre if center else (lambda t: t)
    x = torch.cat([c(a).reshape(-1, a.shape[-1]) for a in xs]).double()
    y = torch.cat([c(a).reshape(-1, a.shape[-1]) for a in ys]).double()
    sd = x.square().mean(dim=0).sqrt().clamp_min(1e-30)
    xs_ = x / sd
    xtx = xs_.T @ xs_
    a = torch.linalg.solve(xtx + ridge * x.shape[0] * torch.eye(xtx.shape[0], dtype=xtx.dtype), xs_.T @ y)
    return a / sd[:, None]


def low_rank(a: torch.Tensor, xs: list[torch.Tensor], k: int, center: bool = True) -> torch.Tensor:
    """Reduced-rank regression: project the full map's fitted values onto their top-k right singular vectors."""
    x = torch.cat([(centre(t) if center else t).reshape(-1, t.shape[-1]) for t in xs]).double()
    _, _, vh = torch.linalg.svd(x @ a, full_matrices=False)
    v = vh[:k].T
    return a @ v @ v.T


def explained(a: torch.Tensor, hrefs: list[torch.Tensor], rs: list[torch.Tensor], first: int = 0) -> float:
    """The fraction of the centred residual's energy the map explains, over positions ``first`` on."""
    num = den = 0.0
    for x, r in zip(hrefs, rs):
        rc = centre(r).double()[:, first:]
        num += float((rc - centre(x).double()[:, first:] @ a).square().sum())
        den += float(rc.square().sum())
    return 1.0 - num / den


def subsample_code(x: torch.Tensor, keep: float, seed: int = 0) -> torch.Tensor:
    """Rotated 1-bit code of ``x`` (centred first, as the codec does), keeping a fraction ``keep`` of the
    rotated coordinates (fixed, seeded); the others decode to 0. About ``keep`` bits per coordinate."""
    mean = x.mean(dim=(0, 1), keepdim=True)
    xc = (x - mean).float()
    hdim = x.shape[-1]
    if keep >= 1.0:
        codes, rms = rotq_encode(xc, 1, seed)
        return rotq_decode(codes, rms, 1, hdim, seed).to(x.dtype) + mean
    rot = rotation(hdim, seed).to(xc.dtype)
    y = xc @ rot.T
    n = max(1, int(round(keep * hdim)))
    idx = torch.randperm(hdim, generator=torch.Generator().manual_seed(seed + 1))[:n]
    ys = y[..., idx]
    scale = ys.abs().mean(dim=-1, keepdim=True)  # the MSE-optimal 1-bit level of each token's kept part
    yhat = torch.zeros_like(y)
    yhat[..., idx] = torch.sign(ys) * scale
    return (yhat @ rot).to(x.dtype) + mean


def grad_side(st, frozen, fit_batches, evals, b: int, ridge: float) -> dict:
    """The same question for the gradient going back over boundary ``b``: a map ``g - g_ref ~ g_ref A``
    (uncentred: the rotq gradient code is not centred) fitted on the fit batches; on the held-out batches, the
    fraction of the residual's energy it explains and the 1-bit code's relative squared error of ``g`` with
    and without it (``g_ref + pred + decode(code(g - g_ref - pred))`` against ``g``)."""
    codec = RotQuantCodec(1)

    def pair(ids):
        with torch.no_grad():
            h = run_stages(st, ids, 0, b + 1)
        g = boundary_grad(st, h, ids, b)
        g_ref = boundary_grad(frozen, h, ids, b)
        return g_ref, g - g_ref, g

    fit = [pair(ids) for ids in fit_batches]
    a = fit_map([p[0] for p in fit], [p[1] for p in fit], ridge, center=False)
    maps = {"none": None, "full": a, "rank64": low_rank(a, [p[0] for p in fit], 64, center=False)}
    ev = [pair(ids) for ids in evals]
    res = {"rho_bwd": (sum(float(r.square().sum()) for _, r, _ in ev) / sum(float(g.square().sum()) for *_, g in ev))
           ** 0.5}
    for name, m in maps.items():
        num = den = err = gsq = 0.0
        for g_ref, r, g in ev:
            pred = torch.zeros_like(r) if m is None else (g_ref.double() @ m).to(r.dtype)
            num += float((r - pred).square().sum())
            den += float(r.square().sum())
            coded = g_ref + pred + codec.decode_grad(codec.encode_grad(r - pred)).to(r.dtype)
            err += float((coded - g).square().sum())
            gsq += float(g.square().sum())
        if m is not None:
            res[f"bwd_explained_{name}"] = 1.0 - num / den
        res[f"bwd_err1_{name}"] = err / gsq
    return res


@torch.no_grad()
def fit_pairs(st, frozen, fit_batches, b: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(h_ref, r = h - h_ref) at boundary ``b`` for each of the fit batches."""
    fx, fr = [], []
    for ids in fit_batches:
        h_ref = run_stages(frozen, ids, 0, b + 1)
        fx.append(h_ref)
        fr.append(run_stages(st, ids, 0, b + 1) - h_ref)
    return fx, fr


def measure(st, frozen, fit_batches, evals, stale_maps, ridge, grad=False) -> tuple[dict, dict]:
    out, maps = {}, {}
    n = len(st)
    for b in range(n - 1):
        with torch.no_grad():
            fx, fr = fit_pairs(st, frozen, fit_batches, b)
            a_full = fit_map(fx, fr, ridge)
            maps[b] = a_full
            a_k = {k: low_rank(a_full, fx, k) for k in RANKS}
            ex, er, hs = [], [], []
            for ids in evals:
                h_ref = run_stages(frozen, ids, 0, b + 1)
                h = run_stages(st, ids, 0, b + 1)
                ex.append(h_ref)
                er.append(h - h_ref)
                hs.append(h)
            res = {"explained_fit_full": explained(a_full, fx, fr), "explained_full": explained(a_full, ex, er),
                   "explained_full_from_pos1": explained(a_full, ex, er, first=1)}
            for k, a in a_k.items():
                res[f"explained_rank{k}"] = explained(a, ex, er)
            if b in stale_maps:
                res["explained_stale_full"] = explained(stale_maps[b], ex, er)
            rho = sum(float(centre(r).square().sum()) for r in er) / sum(float(centre(h).square().sum()) for h in hs)
            res["rho_fwd"] = rho ** 0.5
            acc: dict[str, list[float]] = {}
            for ids, h_ref, r, h in zip(evals, ex, er, hs):
                exact = float(causal_lm_loss(run_stages(st, h, b + 1, n), ids))

                def dloss(hh, ids=ids, exact=exact, b=b):
                    return float(causal_lm_loss(run_stages(st, hh, b + 1, n), ids)) - exact

                acc.setdefault("dloss_ref_only", []).append(dloss(h_ref))
                preds = {"none": torch.zeros_like(r), "full": (centre(h_ref).double() @ a_full).to(r.dtype)}
                for k in (16, 64):
                    preds[f"rank{k}"] = (centre(h_ref).double() @ a_k[k]).to(r.dtype)
                for pname, pred in preds.items():
                    if pname != "none":
                        acc.setdefault(f"dloss_pred_{pname}_0bit", []).append(dloss(h_ref + pred))
                    for keep in KEEP:
                        hh = h_ref + pred + subsample_code(r - pred, keep)
                        acc.setdefault(f"dloss_pred_{pname}_keep{keep}", []).append(dloss(hh))
                    # the same 1-bit code with each sequence's first position sent exactly (the attention sink,
                    # where the residual's energy concentrates at the later boundary)
                    hh = h_ref + pred + subsample_code(r - pred, 1.0)
                    hh[:, :1] = h[:, :1]
                    acc.setdefault(f"dloss_pred_{pname}_keep1.0_pos0exact", []).append(dloss(hh))
            res.update({k: sum(v) / len(v) for k, v in acc.items()})
        if grad:
            res.update(grad_side(st, frozen, fit_batches, evals, b, ridge))
        out[b] = res
    return out, maps


def fit_probe_args(doc: str, grad_help: str, stale: bool = False) -> argparse.Namespace:
    """The command line shared by the probes that fit on recent training batches and test on held-out ones."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--at", default="30,60", help="steps at which to measure (comma-separated)")
    if stale:
        ap.add_argument("--stale", type=int, default=10, help="also test the map fitted this many steps earlier")
    ap.add_argument("--fit-batches", type=int, default=8)
    ap.add_argument("--eval-batches", type=int, default=2)
    ap.add_argument("--ridge", type=float, default=1e-2)
    ap.add_argument("--grad", action="store_true", help=grad_help)
    ap.add_argument("--out", default=None)
    return ap.parse_args()


def main() -> None:
    args = fit_probe_args(__doc__, "also the gradient going back (a map from g_ref)", stale=True)
    at = sorted({int(s) for s in args.at.split(",") if int(s) <= args.steps})
    fit_at = sorted(set(at) | {s - args.stale for s in at if s - args.stale >= 0})
    run = DenseProbeRun(args.steps, args.eval_batches)
    st, frozen, evals, src = run.st, run.frozen, run.evals, run.src
    rec: dict = {"steps": {}, "train_loss": []}
    old_maps: dict[int, dict] = {}
    t0 = time.time()
    for step in range(args.steps + 1):
        if step in fit_at:
            st.eval()
            # the sender fits on training microbatches it has just seen (those of the last steps)
            fit = [src.batch(max(0, step - 1 - i)) for i in range(args.fit_batches)]
            stale = old_maps.get(step - args.stale, {})
            res, maps = measure(st, frozen, fit, evals, stale, args.ridge, grad=args.grad and step in at)
            old_maps[step] = maps
            if step in at:
                rec["steps"][step] = res
                for b, r in res.items():
                    print(f"step {step} boundary {b}: " + ", ".join(f"{k} {v:.4f}" for k, v in r.items()), flush=True)
            st.train()
        if step == args.steps:
            break
        run.train_logged(step, rec, t0)
    save_record(rec, f"python scripts/probe_residual_predictor.py --steps {args.steps} --at {args.at} "
                f"--stale {args.stale} --fit-batches {args.fit_batches} --eval-batches {args.eval_batches} "
                f"--ridge {args.ridge}" + (" --grad" if args.grad else ""), args.out, t0)


if __name__ == "__main__":
    main()
