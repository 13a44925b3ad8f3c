"""Probe: how much of a stage-boundary activation can the receiver rebuild at M95/M90 bytes?

Cuts SmolLM2-135M into 3 stages (linux-doc), estimates each boundary's channel mean and covariance
from 4 training batches, and on 2 held-out batches of 4 x 256 tokens compares, for the untrained
model, the loss of the forward pass through both boundaries when the receiver rebuilds the
boundary tensor by: ``zero`` (the paper: dropped channels = 0), ``mean`` (dropped channels = the
microbatch channel mean, ``mask.fill = mean``), ``gauss`` (the conditional expectation of the dropped
channels given the kept ones under a Gaussian fit), and ``pca`` (a K-dim projection on the top
principal components instead of K random channels: the same bytes). Prints relative reconstruction
error and the loss; the unmasked loss is the reference.

    python scripts/probe_boundary_reconstruction.py
"""

from __future__ import annotations

import torch

from meshnode.compression import MaskKey, keep_indices
from meshnode.data import BatchSource, heldout_batches
from meshnode.stage import causal_lm_loss
from probe_common import load_probe_model  # scripts/ is on the path when a script runs


def rebuild(x, idx, mode, mu, cov, lam=1e-3):  # x: (B, T, H), idx: (B, T, K) -> (B, T, H)
    kept = x.gather(-1, idx)
    if mode == "zero":
        return torch.zeros_like(x).scatter_(-1, idx, kept)
    if mode == "mean":
        return x.mean((0, 1)).expand_as(x).clone().scatter_(-1, idx, kept)
    b, t, k = idx.shape
    flat = idx.reshape(-1, k)  # (N, K)
    s_kk = cov[flat[:, :, None], flat[:, None, :]]  # (N, K, K)
    s_ak = cov[:, flat].permute(1, 0, 2)  # (N, H, K)
    ridge = lam * torch.diagonal(s_kk, dim1=-2, dim2=-1).mean(-1)[:, None, None] * torch.eye(k)
    sol = torch.linalg.solve(s_kk + ridge, (kept.reshape(-1, k) - mu[flat]).unsqueeze(-1))
    return (mu + (s_ak @ sol).squeeze(-1)).reshape(b, t, -1).scatter_(-1, idx, kept)


@torch.no_grad()
def main() -> None:
    model, corpus, st = load_probe_model()
    hidden = model.config.hidden_size
    src = BatchSource(corpus.train, 4, seed=0)
    acts: dict[int, list[torch.Tensor]] = {0: [], 1: []}
    for p in range(4):
        h0 = st[0](src.batch(p))
        h1 = st[1](h0)
        acts[0].append(h0.reshape(-1, hidden))
        acts[1].append(h1.reshape(-1, hidden))
    mus, covs, bases = {}, {}, {}
    for b, xs in acts.items():
        x = torch.cat(xs).double()
        mus[b] = x.mean(0)
        xc = x - mus[b]
        covs[b] = (xc.T @ xc) / len(x)
        ev, vecs = torch.linalg.eigh(covs[b])
        bases[b] = vecs.flip(1).float()
        ev = ev.flip(0)
        share = [round((ev[:k].sum() / ev.sum()).item(), 3) for k in (8, 32, 64)]
        print(f"boundary {b}: variance in the top 8/32/64 principal directions {share}")
    evals = heldout_batches(corpus.heldout, 4, 2)

    def loss_with(fn) -> tuple[float, float]:
        total, errs = 0.0, []
        for i, ids in enumerate(evals):
            h = st[0](ids)
            hr = fn(h, 0, i)
            errs.append(((hr - h).norm() / h.norm()).item())
            h1 = st[1](hr)
            h1r = fn(h1, 1, i)
            errs.append(((h1r - h1).norm() / h1.norm()).item())
            total += causal_lm_loss(st[2](h1r), ids).item()
        return total / len(evals), sum(errs) / len(errs)

    print(f"unmasked loss {loss_with(lambda h, b, i: h)[0]:.3f}")
    for ratio in (0.95, 0.9):
        for mode in ("zero", "mean", "gauss"):
            def fn(h, b, i, mode=mode, ratio=ratio):
                idx = keep_indices(MaskKey(0, i, 0, b), *h.shape, ratio)
                return rebuild(h, idx, mode, mus[b].float(), covs[b].float())

            loss, err = loss_with(fn)
            print(f"p={ratio} fill={mode}: loss {loss:.3f}, relative reconstruction error {err:.3f}")
    for k in (29, 58, 115):
        def pca(h, b, i, k=k):
            mu, basis = mus[b].float(), bases[b][:, :k]
            return mu + ((h - mu) @ basis) @ basis.T

        loss, err = loss_with(pca)
        print(f"top-{k} PCA projection: loss {loss:.3f}, relative reconstruction error {err:.3f}")


if __name__ == "__main__":
    main()
