"""The second moment a data-parallel replica would see on the whole group's batch (``dp.v_correction``).

X replicas that each step AdamW on their own batch of B sequences build their second moments from
gradients of B sequences: ``E[g^2] = mu^2 + s^2``, with ``s^2`` the variance of a B-sequence gradient.
One AdamW on the X * B sequences the group sees together would build it from ``mu^2 + s^2 / X``. Where
the gradient is noise-dominated the replicas' ``v`` is up to X times larger, so their steps there are
up to sqrt(X) times shorter, and averaging their updates does not give them back (docs/quality.md,
fifteenth session: with the moments and the weights averaged after every step, the only thing that
still differs from one batch-8 AdamW is this ``v``, and the gap was still +1.2 %).

A replica that accumulates M >= 2 microbatches per step can estimate ``s^2`` per coordinate from the
spread of its microbatch gradients. It keeps ``A``, the EMA of ``g^2`` (AdamW's own, uncorrected ``v``),
and ``B``, the EMA of the estimate, both with AdamW's beta2 from zero, and after each AdamW step sets
AdamW's ``v`` to ``max(A - (1 - 1/X) B, A / (2X))``: the group batch's second moment, floored at half the
pure-noise limit (a ``v`` near 0 under a nonzero momentum would step ``lr * m / eps``; a floor at the limit
itself bound often enough, the estimate being noisy, to bias pure-noise ``v`` 10 % high at X = 2). One
step's estimate has M - 1 degrees of freedom; the EMA averages it over ~1 / (1 - beta2) steps. The step
that adds a ``g^2`` uses it before its own correction (the correction follows the step): one step's share,
1 - beta2, of ``v``. Pure tensor code.

Memory: ``A`` is not stored. The corrected ``v`` (in AdamW's state) and ``B`` determine it: ``A`` is at most
both ``v + (1 - 1/X) B`` and ``2X v``, and equal to the one the max picked, so ``A = min(v + (1 - 1/X) B,
2X v)``. Before each step the tracker saves ``A - v`` (AdamW's step overwrites ``v``), and after it ``A``
is AdamW's new ``v`` plus beta2 times that. So the correction holds ``B`` and one scratch buffer per tensor
at M = 2 (the two microbatches' difference needs only the first one's gradient), one more at M > 2:
8 bytes per parameter instead of the 16 it took with ``A`` and a sum of squares stored. Where AdamW's ``v``
is not fp32 (``model.dtype`` bf16 / fp16), ``A`` is stored in fp32 as before: rebuilt from a rounded ``v``
it would lose the ``(1 - beta2) g^2`` that the rounding of AdamW's own update drops (4.5x too large a ``v``
at beta2 = 0.999 in bf16).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import Tensor

logger = logging.getLogger(__name__)


class MicrobatchNoise:
    """Per-coordinate variance of a step's accumulated gradient, from its microbatches' gradients.

    Call :meth:`after_microbatch` after each microbatch's backward (``p.grad`` then holds the sum of the
    microbatch gradients so far, each already divided by M), :meth:`variance` before clipping,
    :meth:`before_step` after clipping, :meth:`after_step` after the optimizer step, then :meth:`reset`
    (also after a step that raised). Every pass over the buffers is in place, and they are allocated once
    (``scripts/bench_noise.py`` measures what a step costs).

    :param replicas: X, the DP group size the second moment is corrected to (the swarm sets it to the size
        of the group its last DP sync averaged with).
    :param microbatches: M, when every step has that many: at M = 2 the tracker keeps one scratch buffer per
        tensor instead of two (a step with more microbatches than that gets no estimate)."""

    def __init__(self, params: dict[str, torch.nn.Parameter], replicas: int, microbatches: int | None = None):
        if replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {replicas}")
        self.params = params
        self._names = {id(q): n for n, q in params.items()}  # the optimizer's groups hold the tensors, not names
        self.replicas = replicas
        self._pair = microbatches == 2
        # the step's gradient so far (fp32); at M = 2 the first microbatch's, which variance() turns into s2_hat
        self._prev: dict[str, Tensor] = {}
        self._sq: dict[str, Tensor] = {}  # M != 2: sum of the microbatch shares squared, turned into s2_hat
        self._touched: set[str] = set()  # tensors with a gradient since the last reset
        self._variance: dict[str, Tensor] | None = None  # set by variance() until the next reset
        self.count = 0
        self.ema_var: dict[str, Tensor] = {}  # B
        self.ema_g2: dict[str, Tensor] = {}  # A, stored (fp32) only for tensors whose AdamW state is not fp32
        self._applied = replicas  # the X of the last correction, which A's reconstruction must use
        # between before_step and after_step: name -> (buffer holding A - v, or None where A starts from v)
        self._pending: dict[str, tuple[Tensor, bool]] | None = None

    def buffers(self) -> list[Tensor]:
        """Every parameter-sized buffer the tracker holds now (what it costs in memory)."""
        held = {t.data_ptr(): t for d in (self._prev, self._sq, self.ema_var, self.ema_g2) for t in d.values()}
        return list(held.values())

    def _scratch(self) -> dict[str, Tensor]:
        """The dict whose buffers variance() fills (and before_step trades for B's)."""
        return self._prev if self._pair else self._sq

    @torch.no_grad()
    def after_microbatch(self) -> None:
        if self._variance is not None or self._pending is not None:
            raise RuntimeError("after_microbatch after variance() or before_step(): call reset() first")
        first, rest = [], []
        for n, p in self.params.items():
            if p.grad is None:
                continue
            if n not in self._prev:
                self._prev[n] = torch.zeros_like(p, dtype=torch.float32)
                if not self._pair:
                    self._sq[n] = torch.zeros_like(self._prev[n])
            (rest if n in self._touched else first).append(n)
        # a tensor's first gradient since the reset is its whole share so far (the microbatches before gave it
        # none): the buffers are overwritten, so reset() need not zero them
        for n in first:
            g = self.params[n].grad.detach()
            self._prev[n].copy_(g)
            if not self._pair:
                torch.mul(self._prev[n], self._prev[n], out=self._sq[n])
        if rest and not self._pair:  # at M = 2 the first microbatch's gradient is all variance() needs
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
        tensors are the tracker's buffers, valid until :meth:`before_step` or :meth:`reset` (computed once:
        a second call returns the same dict). Call it before clipping: at M = 2 it reads ``p.grad``."""
        m = self.count
        if self._pair and m > 2:
            logger.warning("v_correction: a step of %d microbatches where 2 were declared gets no estimate", m)
        if m < 2 or (self._pair and m != 2):
            return {}
        if self._variance is None:
            names = sorted(self._touched)
            if self._pair:
                # g = d1 + d2 (each share g_j / 2): the variance of the mean of two is (g_1 - g_2)^2 / 4 =
                # (d1 - d2)^2 = (2 d1 - g)^2; a tensor first touched by the second microbatch holds g (d1 = 0)
                prevs = [self._prev[n] for n in names]
                torch._foreach_mul_(prevs, 2.0)
                torch._foreach_sub_(prevs, [self.params[n].grad.detach() for n in names])
                torch._foreach_mul_(prevs, prevs)
                self._variance = dict(zip(names, prevs))
            else:
                # microbatch j's own gradient is g_j = M * delta_j, the step's gradient g = sum_j delta_j; the variance
                # of g (a mean of M) is sum_j (g_j - g)^2 / (M (M - 1)) = (M * sum_j delta_j^2 - g^2) / (M - 1)
                sqs, prevs = [self._sq[n] for n in names], [self._prev[n] for n in names]
                torch._foreach_mul_(sqs, m / (m - 1))
                torch._foreach_addcmul_(sqs, prevs, prevs, value=-1.0 / (m - 1))
                torch._foreach_clamp_min_(sqs, 0.0)
                self._variance = dict(zip(names, sqs))
        return self._variance

    def reset(self) -> None:
        """Forget the microbatches of the step (the EMAs stay; the buffers are kept for the next step). After a
        step that raised between :meth:`before_step` and the end of :meth:`after_step`, the EMAs of the tensors
        not yet corrected lapse (``B`` already holds the failed step's estimate, and ``v`` is whatever the failed
        step left, so ``A`` could not be rebuilt from them): they restart from AdamW's ``v``."""
        if self._pending:
            for n in self._pending:
                self.ema_var.pop(n, None)
                self.ema_g2.pop(n, None)
        self._touched.clear()
        self._variance = None
        self._pending = None
        self.count = 0

    def partial_state(self) -> dict[str, Any]:
        """The microbatch buffers of the step so far (between :meth:`after_microbatch` calls, before
        :meth:`variance`): with :meth:`load_partial_state` a restarted replica finishes the step's estimate."""
        if self._variance is not None or self._pending is not None:
            raise RuntimeError("partial_state after variance() or before_step(): the step is being taken")
        names = sorted(self._touched)
        return {"count": self.count, "prev": {n: self._prev[n].clone() for n in names},
                "sq": {} if self._pair else {n: self._sq[n].clone() for n in names}}

    def check_partial_state(self, state: Any) -> None:
        """ValueError unless ``state`` is a :meth:`partial_state` of these parameters and this M."""
        try:
            count, prev, sq = int(state["count"]), state["prev"], state["sq"]
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"v_correction's partial state: {exc!r}") from None
        if count < 0 or not isinstance(prev, dict) or not isinstance(sq, dict):
            raise ValueError("v_correction's partial state: malformed")
        if set(sq) != (set() if self._pair else set(prev)):
            raise ValueError("v_correction's partial state was taken with another number of microbatches")
        for n, t in [*prev.items(), *sq.items()]:
            if (n not in self.params or not isinstance(t, Tensor) or tuple(t.shape) != tuple(self.params[n].shape)
                    or not bool(torch.isfinite(t).all())):
                raise ValueError(f"v_correction's partial state for {n!r}: unknown, wrong shape or not finite")

    @torch.no_grad()
    def load_partial_state(self, state: dict[str, Any]) -> None:
        """Restore :meth:`partial_state` (checked by :meth:`check_partial_state`) in place of the step so far."""
        self.check_partial_state(state)
        self.reset()
        for n, t in state["prev"].items():
            self._prev[n] = t.to(device=self.params[n].device, dtype=torch.float32).clone()
        for n, t in state["sq"].items():
            self._sq[n] = t.to(device=self.params[n].device, dtype=torch.float32).clone()
        self._touched = set(state["prev"])
        self.count = int(state["count"])

    def _tensors(self, optimizer: torch.optim.Optimizer):
        """(name, parameter, beta2, AdamW's v or None) of every tracked tensor the optimizer holds."""
        for group in optimizer.param_groups:
            beta2 = group["betas"][1]
            for p in group["params"]:
                n = self._names.get(id(p))
                if n is not None:
                    st = optimizer.state.get(p)
                    yield n, p, beta2, (st.get("exp_avg_sq") if st else None)

    @torch.no_grad()
    def before_step(self, optimizer: torch.optim.Optimizer, variance: dict[str, Tensor], scale: float = 1.0) -> None:
        """Fold this step's estimate into ``B`` and save ``A - v`` before AdamW overwrites ``v``.

        ``variance``: from :meth:`variance` (its tensors are spent here); ``scale``: the clip factor the gradient
        was multiplied by (the variance scales by its square). Tensors without an estimate this step (none with
        M < 2) keep AdamW's ``v``, and their EMA lapses (it restarts from AdamW's ``v`` when estimates come
        back); so does a tensor whose optimizer state was dropped."""
        x = self._applied  # A - v as the last correction left it: with the X it used
        excess, cap = 1.0 - 1.0 / x, 2.0 * x - 1.0
        scratch = self._scratch()
        pending: dict[str, tuple[Tensor, bool]] = {}
        for n, p, beta2, v in self._tensors(optimizer):
            var = variance.get(n)
            b = self.ema_var.get(n)
            if var is None or p.grad is None:
                self.ema_var.pop(n, None)
                self.ema_g2.pop(n, None)
                continue
            if b is None or v is None:  # B starts from zero; A from AdamW's v after the step
                self.ema_g2.pop(n, None)
                b = torch.empty_like(var)
                var.mul_((1 - beta2) * scale * scale)
                pending[n] = (b, False)
            else:
                # B_t = beta2 B + (1 - beta2) s2 into the estimate's buffer; A - v = min(excess B, (2X - 1) v) into
                # B's. v not fp32: A is stored (rebuilt from v and B once, when there is none: after a load)
                var.mul_((1 - beta2) * scale * scale).add_(b, alpha=beta2)
                if v.dtype == b.dtype:
                    b.mul_(excess / cap)
                    torch.minimum(b, v, out=b)
                    b.mul_(cap)
                elif n not in self.ema_g2:
                    vf = v.float()
                    self.ema_g2[n] = torch.minimum(vf + excess * b, 2.0 * x * vf)
                pending[n] = (b, True)
            self.ema_var[n], scratch[n] = var, b  # the two buffers trade places
        self._variance = None
        self._pending = pending

    @torch.no_grad()
    def after_step(self, optimizer: torch.optim.Optimizer) -> int:
        """Set AdamW's ``exp_avg_sq`` of each tensor :meth:`before_step` took an estimate for to the corrected
        ``v``, with the current X. Returns how many were corrected."""
        pending = self._pending
        if not pending:
            self._pending = None
            return 0
        x = self.replicas  # read once: the swarm's DP sets it from the event loop
        excess, floor = 1.0 - 1.0 / x, 1.0 / (2 * x)
        done = 0
        for n, p, beta2, v in self._tensors(optimizer):
            if n not in pending:
                continue
            if v is None:
                self.ema_var.pop(n, None)
                self.ema_g2.pop(n, None)
                continue
            a, carried = pending[n]
            b = self.ema_var[n]
            if v.dtype != a.dtype:  # A stored: its own EMA of g^2, as AdamW's v would be without the rounding
                stored = self.ema_g2.get(n) if carried else None
                if stored is None:
                    self.ema_g2[n] = stored = v.float()
                else:
                    stored.mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
                v.copy_(torch.maximum(stored - excess * b, stored * floor))
            else:
                if carried:  # A = v (AdamW's, after its step) + beta2 (A - v) of before it
                    a.mul_(beta2).add_(v)
                else:
                    a.copy_(v)
                # v = max(A - (1 - 1/X) B, A / 2X); A's buffer is scratch afterwards
                torch.add(a, b, alpha=-excess, out=v)
                torch.maximum(v, a.mul_(floor), out=v)
            done += 1
        self._applied = x
        self._pending = None
        return done

    def state_dict(self) -> dict[str, Any]:
        """``B``, the X of the last correction and, for tensors whose AdamW state is not fp32, ``A``. The
        tensors are the tracker's own (save or copy them before the next step)."""
        return {"ema_var": dict(self.ema_var), "replicas": self._applied, "ema_g2": dict(self.ema_g2)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The inverse of :meth:`state_dict`; a state from before ``A`` was derived holds every tensor's ``A``
        in ``ema_g2`` (only those of non-fp32 tensors are used) and no X (the current one is taken)."""
        self.ema_var = {n: t.clone() for n, t in state["ema_var"].items()}
        self.ema_g2 = {n: t.float().clone() for n, t in state.get("ema_g2", {}).items()}
        self._applied = int(state.get("replicas", self.replicas))
        self._pending = None


__all__ = ["MicrobatchNoise"]
