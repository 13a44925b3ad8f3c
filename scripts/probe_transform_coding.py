"""Probe: can a fitted transform code (a KLT with bits allocated by variance) carry the reference residual in
fewer than one bit per coordinate?

Reference coding (``mask.reference``) sends ``r = h - h_ref``, and the residual map (``mask.reference_map_rank``)
removes the part of r that is a linear function of ``h_ref``. Both still code what is left with the rotated
1-bit codec: a random rotation makes every coordinate equally important, so the cheapest code is one bit for
each of the H coordinates, and the last session's probe found that dropping a random half of them costs more
than it saves. That holds only if r has no preferred directions. If r's energy sits in a few tens of
directions (fine-tuning's weight changes are close to low rank, so the changes they make at a boundary may
be too), a Karhunen-Loeve transform fitted by the sender, with the bits given to the directions that carry the
variance (greedy reverse water-filling over integer bits 0..4 per coordinate), spends a budget of R bits per
token far better than a rotation can, and below one bit per coordinate is possible.

This probe trains SmolLM2-135M densely (``DenseProbeRun``: 3 stages, linux-doc, batch 4 x 256, AdamW lr 1e-4)
and at ``--at`` steps, per boundary:

- fits on ``--fit-batches`` training batches just seen (what a sender has): the residual's directions (the
  eigenvectors of the second moment of each token's *normalised* residual, so the attention sink's huge
  vector does not own the basis), optionally after the rank-64 residual map, and optionally in the metric of
  the boundary's empirical Fisher (``fisher``: distortion weighted by what the loss reads, ``M = sum g g^T``
  over tokens, regularised by 1 % of its mean eigenvalue);
- tests on held-out batches: the fraction of the normalised residual's energy in the top k directions, and
  the held-out loss cost (``dloss``) of replacing the boundary by ``h_ref [+ pred] + decode(code(r [- pred]))``
  for the rotated 1-bit code (576 bits per token) and the transform code at R = 576, 288, 144 bits per token
  (each plus one float per token for its gain, as rotq);
- ``--grad``: the same transform code for the gradient going back (``g - g_ref``, uncentred): its relative
  squared error of g, against the rotated 1-bit code.

    python scripts/probe_transform_coding.py --steps 60 --at 30,60 --grad \
        --out docs/results/probe-transform-coding.json
"""

from __future__ import annotations

import time

import torch

from meshnode.compression import RotQuantCodec
from meshnode.compression.rotquant import GAUSS_STEP
from meshnode.stage import causal_lm_loss
from probe_reference_coding import DenseProbeRun, boundary_grad, run_stages, save_record
from probe_residual_predictor import centre, fit_map, fit_pairs, fit_probe_args, low_rank, subsample_code

BUDGETS = (576, 288, 144)  # bits per token
TOPK = (16, 64, 144, 288)
STEP = {**GAUSS_STEP, 3: 0.5860}  # Max 1960: MSE-optimal uniform step for a unit Gaussian, 2**b levels
GAUSS_MSE = (1.0, 0.3634, 0.1188, 0.03744, 0.01154)  # its mean squared error at 0..4 bits


def flat(xs: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([x.reshape(-1, x.shape[-1]) for x in xs]).double()


def sqrt_metric(gs: list[torch.Tensor] | None, h: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(L, L^-1) with L = M^(1/2), M the empirical Fisher of the boundary gradients ``gs`` plus 1 % of its mean
    eigenvalue; the identity when ``gs`` is None."""
    if gs is None:
        eye = torch.eye(h, dtype=torch.float64)
        return eye, eye
    g = flat(gs)
    m = g.T @ g / g.shape[0]
    lam, vec = torch.linalg.eigh(m)
    lam = lam.clamp_min(0) + 1e-2 * float(lam.clamp_min(0).mean())
    return (vec * lam.sqrt()) @ vec.T, (vec / lam.sqrt()) @ vec.T


class TransformCode:
    """A KLT of per-token normalised vectors with integer bits per direction (greedy water-filling)."""

    def __init__(self, zs: torch.Tensor, budget: int):  # zs: (N, H) float64, the fit tokens (already in metric)
        u = zs / zs.norm(dim=1, keepdim=True).clamp_min(1e-30) * zs.shape[1] ** 0.5  # unit rms per token
        lam, vec = torch.linalg.eigh(u.T @ u / u.shape[0])
        order = torch.argsort(lam, descending=True)
        self.var, self.basis = lam[order].clamp_min(1e-30), vec[:, order]  # var sums to H
        self.energy = (self.var.cumsum(0) / self.var.sum())
        bits = [0] * len(self.var)
        var = self.var.tolist()
        gain = [v * (GAUSS_MSE[0] - GAUSS_MSE[1]) for v in var]
        for _ in range(budget):  # give each bit where it removes the most expected squared error
            i = max(range(len(gain)), key=gain.__getitem__)
            bits[i] += 1
            gain[i] = var[i] * (GAUSS_MSE[bits[i]] - GAUSS_MSE[bits[i] + 1]) if bits[i] < 4 else -1.0
        self.bits = torch.tensor(bits)

    def roundtrip(self, z: torch.Tensor) -> torch.Tensor:  # (N, H) float64 -> its decoded version
        rms = z.norm(dim=1, keepdim=True).clamp_min(1e-30) / z.shape[1] ** 0.5
        c = (z / rms) @ self.basis
        out = torch.zeros_like(c)
        for b in range(1, 5):
            sel = self.bits == b
            if bool(sel.any()):
                step = STEP[b] * self.var[sel].sqrt()
                half = 1 << (b - 1)
                q = torch.floor(c[:, sel] / step).clamp(-half, half - 1)
                out[:, sel] = (q + 0.5) * step
        return (out @ self.basis.T) * rms


def code_resid(tc: TransformCode, lmat, linv, r: torch.Tensor) -> torch.Tensor:
    """Centre r per microbatch (the mean travels, as in rotq), code it in the metric, decode."""
    mean = r.mean(dim=(0, 1), keepdim=True)
    z = flat([r - mean]) @ lmat
    return (tc.roundtrip(z) @ linv).reshape(r.shape).to(r.dtype) + mean


def fwd_side(st, frozen, fit_batches, evals, b: int, ridge: float) -> dict:
    n = len(st)
    fx, fr = fit_pairs(st, frozen, fit_batches, b)
    with torch.no_grad():
        map64 = low_rank(fit_map(fx, fr, ridge), fx, 64)
    fg = [boundary_grad(st, run_stages(st, ids, 0, b + 1).detach(), ids, b) for ids in fit_batches]
    metrics = {"plain": sqrt_metric(None, fx[0].shape[-1]), "fisher": sqrt_metric(fg, fx[0].shape[-1])}
    preds = {"none": lambda x: torch.zeros_like(x), "map64": lambda x: (centre(x).double() @ map64).to(x.dtype)}
    res: dict = {}
    codes = {}
    for pname, pf in preds.items():
        targets = [centre(r - pf(x)) for x, r in zip(fx, fr)]
        for mname, (lmat, _) in metrics.items():
            zs = flat(targets) @ lmat
            for budget in BUDGETS:
                codes[pname, mname, budget] = TransformCode(zs, budget)
            res[f"fit_bits_{pname}_{mname}"] = {bud: torch.bincount(codes[pname, mname, bud].bits, minlength=5)
                                                .tolist() for bud in BUDGETS}
    acc: dict[str, list[float]] = {}
    with torch.no_grad():
        for ids in evals:
            h_ref = run_stages(frozen, ids, 0, b + 1)
            h = run_stages(st, ids, 0, b + 1)
            r = h - h_ref
            exact = float(causal_lm_loss(run_stages(st, h, b + 1, n), ids))

            def dloss(hh, ids=ids, exact=exact):
                return float(causal_lm_loss(run_stages(st, hh, b + 1, n), ids)) - exact

            for pname, pf in preds.items():
                pred = pf(h_ref)
                t = r - pred
                acc.setdefault(f"dloss_{pname}_rotq1", []).append(dloss(h_ref + pred + subsample_code(t, 1.0)))
                for mname, (lmat, linv) in metrics.items():
                    tc = codes[pname, mname, BUDGETS[0]]
                    u = flat([centre(t)]) @ lmat
                    u = u / u.norm(dim=1, keepdim=True).clamp_min(1e-30)
                    e = (u @ tc.basis).square().sum(0)
                    cum = e.cumsum(0) / e.sum()
                    for k in TOPK:
                        acc.setdefault(f"energy_top{k}_{pname}_{mname}", []).append(float(cum[k - 1]))
                    for budget in BUDGETS:
                        hh = h_ref + pred + code_resid(codes[pname, mname, budget], lmat, linv, t)
                        acc.setdefault(f"dloss_{pname}_{mname}_{budget}", []).append(dloss(hh))
                        acc.setdefault(f"err_{pname}_{mname}_{budget}", []).append(
                            float((hh - h).double().square().sum() / centre(r).double().square().sum()))
                acc.setdefault(f"err_{pname}_rotq1", []).append(float(
                    (h_ref + pred + subsample_code(t, 1.0) - h).double().square().sum()
                    / centre(r).double().square().sum()))
    res.update({k: sum(v) / len(v) for k, v in acc.items()})
    return res


def grad_side(st, frozen, fit_batches, evals, b: int) -> dict:
    """The transform code for ``g - g_ref`` (uncentred, plain metric), against rotq 1 bit: relative squared
    error of g on held-out batches."""
    rot = RotQuantCodec(1)

    def pair(ids):
        with torch.no_grad():
            h = run_stages(st, ids, 0, b + 1)
        g = boundary_grad(st, h, ids, b)
        return g, boundary_grad(frozen, h, ids, b)

    fit = [pair(ids) for ids in fit_batches]
    zs = flat([g - gr for g, gr in fit])
    codes = {budget: TransformCode(zs, budget) for budget in BUDGETS}
    res: dict = {"bwd_fit_bits": {bud: torch.bincount(c.bits, minlength=5).tolist() for bud, c in codes.items()}}
    acc: dict[str, list[float]] = {}
    for ids in evals:
        g, g_ref = pair(ids)
        r = g - g_ref
        gsq = float(g.double().square().sum())
        acc.setdefault("bwd_err_rotq1", []).append(
            float((g_ref + rot.decode_grad(rot.encode_grad(r)).to(r.dtype) - g).double().square().sum()) / gsq)
        u = flat([r])
        u = u / u.norm(dim=1, keepdim=True).clamp_min(1e-30)
        cum = (u @ codes[BUDGETS[0]].basis).square().sum(0).cumsum(0)
        for k in TOPK:
            acc.setdefault(f"bwd_energy_top{k}", []).append(float(cum[k - 1] / cum[-1]))
        for budget, c in codes.items():
            dec = c.roundtrip(flat([r])).reshape(r.shape).to(r.dtype)
            acc.setdefault(f"bwd_err_{budget}", []).append(float((g_ref + dec - g).double().square().sum()) / gsq)
    res.update({k: sum(v) / len(v) for k, v in acc.items()})
    return res


def main() -> None:
    args = fit_probe_args(__doc__, "also the gradient going back")
    at = sorted({int(s) for s in args.at.split(",") if int(s) <= args.steps})
    run = DenseProbeRun(args.steps, args.eval_batches)
    rec: dict = {"steps": {}, "train_loss": []}
    t0 = time.time()
    for step in range(args.steps + 1):
        if step in at:
            run.st.eval()
            fit = [run.src.batch(max(0, step - 1 - i)) for i in range(args.fit_batches)]
            out = {}
            for b in range(len(run.st) - 1):
                out[b] = fwd_side(run.st, run.frozen, fit, run.evals, b, args.ridge)
                if args.grad:
                    out[b].update(grad_side(run.st, run.frozen, fit, run.evals, b))
                print(f"step {step} boundary {b}: " + ", ".join(
                    f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}" for k, v in out[b].items()), flush=True)
            rec["steps"][step] = out
            run.st.train()
        if step == args.steps:
            break
        run.train_logged(step, rec, t0)
    save_record(rec, f"python scripts/probe_transform_coding.py --steps {args.steps} --at {args.at} "
                f"--fit-batches {args.fit_batches} --eval-batches {args.eval_batches} --ridge {args.ridge}"
                + (" --grad" if args.grad else ""), args.out, t0)


if __name__ == "__main__":
    main()
