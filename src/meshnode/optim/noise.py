"""The second moment a data-parallel replica would see on the whole group's batch (``dp.v_correction``).

X replicas that each step AdamW on their own batch of B sequences build their second moments from
gradients of B sequences: ``E[g^2] = mu^2 + s^2``, with ``s^2`` the variance of a B-sequence gradient.
One AdamW on the X * B sequences the group sees together would build it from ``mu^2 + s^2 / X``. Where
the gradient is noise-dominated the replicas' ``v`` is up to X times larger, so their steps there are
up to sqrt(X) times shorter, and averaging their updates does not give them back (docs/quality.md,
fifteenth session: with the moments and the weights averaged after every step, the only thing that
still differs from one batch-8 AdamW is this ``v``, and the gap was still +1.2 %).

A replica that accumulates M >= 2 microbatches per step can estimate ``s^2`` per coordinate from the
spread of its microbatch gradients. After each AdamW step it keeps ``A``, the EMA of ``g^2`` (AdamW's own
``v``), and ``B``, the EMA of the estimate, both with AdamW's beta2 from zero, and sets AdamW's ``v`` to
``max(A - (1 - 1/X) B, A / (2X))``: the group batch's second moment, floored at half the pure-noise limit
(a ``v`` near 0 under a nonzero momentum would step ``lr * m / eps``; a floor at the limit itself bound
often enough, the estimate being noisy, to bias pure-noise ``v`` 10 % high at X = 2). One step's estimate
has M - 1 degrees of freedom; the EMA averages it over ~1 / (1 - beta2) steps. The step that adds a
``g^2`` uses it before its own correction (the correction follows the step): one step's share, 1 - beta2,
of ``v``. Pure tensor code.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor


class MicrobatchNoise:
    """Per-coordinate variance of a step's accumulated gradient, from its microbatches' gradients.

    Call :meth:`after_microbatch` after each microbatch's backward (``p.grad`` then holds the sum of the
    microbatch gradients so far, each already divided by M), :meth:`variance` before clipping, and
    :meth:`after_step` after the optimizer step (before the gradients are zeroed), then :meth:`reset`.
    Costs four parameter-sized fp32 buffers per tensor, allocated once: every pass over them is in place
    (``scripts/bench_noise.py`` measures what a step costs).

    :param replicas: X, the DP group size the second moment is corrected to (the swarm sets it to the size
        of the group its last DP sync averaged with)."""

    def __init__(self, params: dict[str, torch.nn.Parameter], replicas: int):
        if replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {replicas}")
        self.params = params
        self._names = {id(q): n for n, q in params.items()}  # the optimizer's groups hold the tensors, not names
        self.replicas = replicas
        self._prev: dict[str, Tensor] = {}  # the step's gradient so far (fp32); after_step's scratch
        self._sq: dict[str, Tensor] = {}  # sum of the microbatch shares squared; variance() turns it into s2_hat
        self._touched: set[str] = set()  # tensors with a gradient since the last reset
        self._variance: dict[str, Tensor] | None = None  # set by variance() until the next reset
        self.count = 0
        self.ema_g2: dict[str, Tensor] = {}  # A
        self.ema_var: dict[str, Tensor] = {}  # B

    @torch.no_grad()
    def after_microbatch(self) -> None:
        if self._variance is not None:
            raise RuntimeError("after_microbatch after variance(): call reset() first")
        first, rest = [], []
        for n, p in self.params.items():
            if p.grad is None:
                continue
            if n not in self._prev:
                self._prev[n] = torch.zeros_like(p, dtype=torch.float32)
                self._sq[n] = torch.zeros_like(self._prev[n])
            (rest if n in self._touched else first).append(n)
        # a tensor's first gradient since the reset is its whole share so far (the microbatches before gave it
        # none): the buffers are overwritten, so reset() need not zero them
        for n in first:
            g = self.params[n].grad.detach()
            self._prev[n].copy_(g)
            torch.mul(self._prev[n], self._prev[n], out=self._sq[n])
        if rest:
            grads = [self.params[n].grad.detach() for n in rest]
            prevs, sqs = [self._prev[n] for n in rest], [self._sq[n] for n in rest]
            torch._foreach_sub_(prevs, grads)  # minus this microbatch's share, -g_j / M
            torch._foreach_addcmul_(sqs, prevs, prevs)
            torch._foreach_copy_(prevs, grads)
        self._touched.update(first)
        self.count += 1

    @torch.no_grad()
    def variance(self) -> dict[str, Tensor]:
        """``name -> s2_hat``: the unbiased variance estimate of the step's gradient (the mean of the M
        microbatch gradients), from the last :meth:`reset` on; empty with fewer than two microbatches. The
        tensors are the tracker's buffers, valid until :meth:`after_step` or :meth:`reset` (computed once:
        a second call returns the same dict)."""
        m = self.count
        if m < 2:
            return {}
        if self._variance is None:
            # microbatch j's own gradient is g_j = M * delta_j, the step's gradient g = sum_j delta_j; the variance
            # of g (a mean of M) is sum_j (g_j - g)^2 / (M (M - 1)) = (M * sum_j delta_j^2 - g^2) / (M - 1)
            names = sorted(self._touched)
            sqs, prevs = [self._sq[n] for n in names], [self._prev[n] for n in names]
            torch._foreach_mul_(sqs, m / (m - 1))
            torch._foreach_addcmul_(sqs, prevs, prevs, value=-1.0 / (m - 1))
            torch._foreach_clamp_min_(sqs, 0.0)
            self._variance = dict(zip(names, sqs))
        return self._variance

    def reset(self) -> None:
        """Forget the microbatches of the step (the EMAs stay; the buffers are kept for the next step)."""
        self._touched.clear()
        self._variance = None
        self.count = 0

    @torch.no_grad()
    def after_step(self, optimizer: torch.optim.Optimizer, variance: dict[str, Tensor], scale: float = 1.0) -> int:
        """Fold this step into the EMAs and set AdamW's ``exp_avg_sq`` of each tensor with an estimate.

        ``variance``: from :meth:`variance`, taken before clipping; ``scale``: the clip factor the gradient
        was multiplied by (the variance scales by its square). ``p.grad`` must still hold the gradient the
        step used. Tensors without an estimate this step (none with M < 2) keep AdamW's ``v``, and their EMAs
        lapse (they restart from AdamW's ``v`` when estimates come back). Returns how many were corrected.
        The tracker's own buffers serve as scratch: :meth:`variance`'s tensors are spent afterwards."""
        x = self.replicas  # read once: the swarm's DP sets it from the event loop
        excess = 1.0 - 1.0 / x
        floor = 1.0 / (2 * x)
        done = 0
        for group in optimizer.param_groups:
            beta2 = group["betas"][1]
            for p in group["params"]:
                n = self._names.get(id(p))
                st = optimizer.state.get(p)
                var = variance.get(n) if n is not None else None
                if var is None or p.grad is None or not st or "exp_avg_sq" not in st:
                    if n is not None:
                        self.ema_g2.pop(n, None)
                        self.ema_var.pop(n, None)
                    continue
                v = st["exp_avg_sq"]
                a = self.ema_g2.get(n)
                if a is None:  # AdamW's v already holds this step's g^2; the variance EMA starts with it
                    a = self.ema_g2[n] = v.detach().float().clone()
                    b = self.ema_var[n] = (1 - beta2) * scale * scale * var
                else:
                    a.mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
                    b = self.ema_var[n]
                    b.mul_(beta2).add_(var, alpha=(1 - beta2) * scale * scale)
                # v = max(A - (1 - 1/X) B, A / 2X), with the step's gradient copy as scratch for the floor
                lo = self._prev[n] if n in self._touched else torch.empty_like(a)
                torch.mul(a, floor, out=lo)
                if v.dtype == torch.float32:
                    torch.add(a, b, alpha=-excess, out=v)
                    torch.maximum(v, lo, out=v)
                else:
                    v.copy_(torch.maximum(a - excess * b, lo))
                done += 1
        return done

    def state_dict(self) -> dict[str, Any]:
        return {"ema_g2": dict(self.ema_g2), "ema_var": dict(self.ema_var)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.ema_g2 = {n: t.clone() for n, t in state["ema_g2"].items()}
        self.ema_var = {n: t.clone() for n, t in state["ema_var"].items()}


__all__ = ["MicrobatchNoise"]
