"""Spectral correction of masked gradients, and the AdamW wrapper that applies it (DESIGN.md section 1).

Fast peers train with masked stage boundaries, so the gradient of each targeted matrix (attention
q, k, v, o and MLP gate, up, down) is a noisy, biased estimate ``G_mask`` of the clean gradient. The
slow anchor circuit computes clean gradients ``G_anchor`` on stale weights; their EMA ``M`` and its
thin SVD ``M = U S V^T`` form the *prior*. The fast peer then filters its masked gradient onto the
prior's dominant singular subspaces with a soft (Tikhonov) filter::

    d_i    = s_i / (s_i + tau)
    G_filt = U diag(d) (U^T G_mask V) diag(d) V^T
    G      = alpha * G_mask + (1 - alpha) * G_filt        -> AdamW

The filter is linear in ``G_mask``, so it commutes with data-parallel averaging as long as every
replica of a stage holds the same prior.

Two ways to receive a prior (both end with the same cached factors ``U, s, Vh``):

* :meth:`SpectralFilter.update_prior` takes the raw anchor gradient, folds it into the EMA ``M`` held
  *on this side* and recomputes the SVD (in-process mesh, and the anchor itself).
* :meth:`SpectralFilter.update_prior_factors` takes factors an anchor already computed from *its* EMA
  (the swarm: an anchor publishes truncated fp16 factors in the DHT). The fast peer keeps no EMA then;
  where a mode needs ``M`` it uses the rank-r reconstruction ``U diag(s) Vh``.

The SVD (float32, ``torch.linalg.svd(full_matrices=False)``) runs only when a prior arrives, never
per step. A prior is *stale* when ``step - prior_step > max_staleness``; a stale or absent prior
leaves the gradient unchanged (``G = G_mask``).

Modes (``SpectralConfig.mode``, plus ``bias_correction`` which the config does not offer yet):

``filter``
    The formula above.
``clean_every``
    On fast steps with ``step % clean_every == 0`` and a fresh prior, the masked gradient is
    *replaced* by the anchor gradient itself, i.e. the EMA ``M`` (or its rank-r reconstruction when
    only factors are held). On every other step (or without a fresh prior) the step is the ``filter``
    step, which reduces to ``G_mask`` for ``alpha = 1`` or without a prior; so ``alpha = 1`` gives the
    pure "masked steps plus a clean step every N" schedule.
``delayed_ef``
    The filtered gradient plus the held residual ``R = M - E``, where ``E`` is an EMA of this peer's
    *masked* gradients kept at the same cadence and with the same ``beta`` as ``M``: the masked
    gradients of every step are averaged since the last prior, and when a prior arrives that window
    mean is folded into ``E`` (``E <- beta*E + (1-beta)*mean``). ``R`` is then an estimate of the
    systematic part of ``E[G_clean] - E[G_mask]`` (the bias the mask introduces), with the per-batch
    noise averaged out on both sides. ``G = alpha*G_mask + (1-alpha)*G_filt + R``. When only factors
    are held, ``R = U diag(s) Vh - U U^T E V V^T`` (both terms restricted to the prior's subspace:
    the part of ``E`` outside it has no anchor counterpart). ``R`` is applied only with a fresh prior
    and once ``E`` has been initialised.
``bias_correction``
    The anchor runs a masked *and* an unmasked pass on the same batch and weights and sends both
    gradients; the filter's EMA then tracks ``C = EMA(G_clean - G_masked)``, truncated to rank r by
    the same SVD (or the anchor publishes the truncated factors of its own ``C``). The fast gradient
    is ``G = G_mask + U diag(s) Vh``. ``alpha`` and ``tau`` are unused in this mode.

EMA initialisation (``ema_init``): ``"first"`` (default) sets ``M = G_anchor`` at the first prior, so
the first prior is already at full scale; ``"zero"`` starts from ``M = 0``, i.e. ``M = (1-beta)*G``
after the first prior, the textbook EMA without bias correction (small at first, which makes the
filter's ``d_i`` small for fixed ``tau``). The same policy applies to ``E`` in ``delayed_ef``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import Tensor

from meshnode.config import AnchorConfig, SpectralConfig, TrainConfig

logger = logging.getLogger(__name__)

MODES = ("filter", "clean_every", "delayed_ef", "bias_correction")
EMA_INITS = ("first", "zero")


class PriorError(ValueError):
    """A prior (gradient or factors) has the wrong shape or non-finite values; it was not applied."""


def truncated_svd(mat: Tensor, rank: int = 0) -> tuple[Tensor, Tensor, Tensor]:
    """Thin SVD of ``mat`` in float32, truncated to ``rank`` (0 = keep all ``min(m, n)`` values).

    ``mat``: (m, n). Returns ``U`` (m, r), ``s`` (r,), ``Vh`` (r, n), with ``s`` descending.
    A rank larger than ``min(m, n)`` is clamped to it (one config rank serves matrices of all shapes).
    """
    u, s, vh = torch.linalg.svd(mat.detach().float(), full_matrices=False)
    r = s.numel() if rank <= 0 else min(rank, s.numel())
    return u[:, :r].contiguous(), s[:r].contiguous(), vh[:r, :].contiguous()


def _ema(old: Tensor | None, new: Tensor, beta: float, ema_init: str) -> Tensor:
    if old is None:
        return new.clone() if ema_init == "first" else (1.0 - beta) * new
    return old.mul_(beta).add_(new, alpha=1.0 - beta)


# ---------------------------------------------------------------------------------------------
# one matrix


class SpectralFilter:
    """Prior state and gradient transform for one targeted matrix of shape ``(m, n)``.

    :param shape: ``(m, n)`` of the matrix.
    :param alpha: weight of the raw masked gradient in the blend (1 = no filtering).
    :param tau: Tikhonov constant of the soft filter ``d = s / (s + tau)``.
    :param beta: EMA coefficient of the anchor gradients (and of the masked gradients in ``delayed_ef``).
    :param rank: truncation rank r of the SVD (0 = full thin SVD; clamped to ``min(m, n)``).
    :param max_staleness: a prior whose snapshot is more than this many fast steps old is ignored
        (``None`` = never stale).
    :param mode: one of :data:`MODES` (see the module docstring).
    :param clean_every: N of the ``clean_every`` mode.
    :param ema_init: ``"first"`` or ``"zero"`` (see the module docstring).
    """

    def __init__(
        self,
        shape: tuple[int, int],
        *,
        alpha: float = 0.3,
        tau: float = 1e-3,
        beta: float = 0.95,
        rank: int = 0,
        max_staleness: int | None = None,
        mode: str = "filter",
        clean_every: int = 10,
        ema_init: str = "first",
    ) -> None:
        if len(shape) != 2:
            raise ValueError(f"SpectralFilter targets 2-D matrices, got shape {tuple(shape)}")
        if mode not in MODES:
            raise ValueError(f"mode {mode!r} is not one of {', '.join(MODES)}")
        if ema_init not in EMA_INITS:
            raise ValueError(f"ema_init {ema_init!r} is not one of {', '.join(EMA_INITS)}")
        if clean_every <= 0:
            raise ValueError(f"clean_every must be > 0, got {clean_every}")
        self.shape = (int(shape[0]), int(shape[1]))
        self.alpha = float(alpha)
        self.tau = float(tau)
        self.beta = float(beta)
        self.rank = int(rank)
        self.max_staleness = max_staleness
        self.mode = mode
        self.clean_every = int(clean_every)
        self.ema_init = ema_init
        # prior state
        self.M: Tensor | None = None  # (m, n) anchor EMA, only when priors arrive as gradients
        self.U: Tensor | None = None  # (m, r) float32
        self.s: Tensor | None = None  # (r,) float32
        self.Vh: Tensor | None = None  # (r, n) float32
        self.prior_step: int | None = None  # fast step of the snapshot behind the current prior
        self.svd_count = 0  # how many SVDs this filter ran (they happen only when a prior arrives)
        # delayed_ef: EMA of this peer's masked gradients, and the window being accumulated
        self.E: Tensor | None = None  # (m, n) float32
        self._mask_sum: Tensor | None = None  # (m, n) float32
        self._mask_count = 0

    # ---- receiving priors -------------------------------------------------------------------

    @property
    def has_prior(self) -> bool:
        return self.U is not None

    def is_fresh(self, step: int | None) -> bool:
        """True when a prior is held and, if ``step`` is given, it is at most ``max_staleness`` old."""
        if self.U is None:
            return False
        if step is None or self.max_staleness is None or self.prior_step is None:
            return True
        return step - self.prior_step <= self.max_staleness

    def _check_matrix(self, g: Tensor, what: str) -> None:
        if tuple(g.shape) != self.shape:
            raise PriorError(f"{what}: shape {tuple(g.shape)} != {self.shape}")
        if not torch.isfinite(g).all():
            raise PriorError(f"{what}: non-finite values")

    def update_prior(self, g_anchor: Tensor, anchor_step: int, g_anchor_masked: Tensor | None = None) -> None:
        """Fold a clean anchor gradient into the EMA ``M`` and recompute the truncated SVD.

        ``g_anchor``: (m, n) clean gradient of the anchor cycle whose weight snapshot was taken at fast
        step ``anchor_step``. In ``bias_correction`` mode ``g_anchor_masked`` (m, n), the anchor's
        masked gradient on the same batch and weights, is required and the EMA tracks their difference.
        """
        self._check_matrix(g_anchor, "anchor gradient")
        target = g_anchor.detach().float()
        if self.mode == "bias_correction":
            if g_anchor_masked is None:
                raise PriorError("bias_correction needs the anchor's masked gradient as well")
            self._check_matrix(g_anchor_masked, "anchor masked gradient")
            target = target - g_anchor_masked.detach().float()
        self.M = _ema(self.M, target, self.beta, self.ema_init)
        self.U, self.s, self.Vh = truncated_svd(self.M, self.rank)
        self.svd_count += 1
        self._on_prior(anchor_step)

    def update_prior_factors(self, U: Tensor, s: Tensor, Vh: Tensor, anchor_step: int) -> None:
        """Set the factors directly (swarm: an anchor published the truncated SVD of its own EMA).

        ``U``: (m, r), ``s``: (r,) non-negative, ``Vh``: (r, n). Any ``M`` held here is dropped: the
        factors now are the prior. Factors of higher rank than this filter's ``rank`` are truncated.
        """
        r = s.shape[0] if s.dim() == 1 else -1
        m, n = self.shape
        if r < 1 or tuple(U.shape) != (m, r) or tuple(Vh.shape) != (r, n) or r > min(m, n):
            shapes = f"U {tuple(U.shape)}, s {tuple(s.shape)}, Vh {tuple(Vh.shape)}"
            raise PriorError(f"factor shapes {shapes} do not fit a {self.shape} matrix")
        for name, t in (("U", U), ("s", s), ("Vh", Vh)):
            if not torch.isfinite(t).all():
                raise PriorError(f"factor {name}: non-finite values")
        if (s < 0).any():
            raise PriorError("factor s: negative singular values")
        keep = r if self.rank <= 0 else min(self.rank, r)
        self.U = U.detach().float()[:, :keep].clone()
        self.s = s.detach().float()[:keep].clone()
        self.Vh = Vh.detach().float()[:keep, :].clone()
        self.M = None
        self._on_prior(anchor_step)

    def _on_prior(self, anchor_step: int) -> None:
        self.prior_step = int(anchor_step)
        if self._mask_sum is not None and self._mask_count > 0:  # delayed_ef: close the masked window
            self.E = _ema(self.E, self._mask_sum / self._mask_count, self.beta, self.ema_init)
            self._mask_sum = None
            self._mask_count = 0

    def factors(self) -> tuple[Tensor, Tensor, Tensor] | None:
        """The cached ``(U, s, Vh)`` (what an anchor publishes), or None before the first prior."""
        if self.U is None or self.s is None or self.Vh is None:
            return None
        return self.U, self.s, self.Vh

    def prior_matrix(self) -> Tensor | None:
        """``M`` (m, n) when held here, else its rank-r reconstruction ``U diag(s) Vh``; None without a prior."""
        if self.M is not None:
            return self.M
        if self.U is None or self.s is None or self.Vh is None:
            return None
        return (self.U * self.s) @ self.Vh

    # ---- transforming gradients ------------------------------------------------------------

    def filter(self, g_mask: Tensor, step: int | None = None) -> Tensor:
        """``alpha*G + (1-alpha) * U diag(d) (U^T G V) diag(d) V^T`` with ``d = s/(s+tau)``.

        ``g_mask``: (m, n). Returned in ``g_mask``'s dtype; ``g_mask`` itself (unchanged, same object)
        without a prior, with a stale one (``step - prior_step > max_staleness``) or for ``alpha = 1``.
        """
        if not self.is_fresh(step) or self.alpha == 1.0:
            return g_mask
        assert self.U is not None and self.s is not None and self.Vh is not None
        g = g_mask.float()
        d = self.s / (self.s + self.tau)  # (r,)
        core = self.U.T @ g @ self.Vh.T  # (r, r)
        core = d[:, None] * core * d[None, :]
        g_filt = self.U @ core @ self.Vh  # (m, n)
        out = self.alpha * g + (1.0 - self.alpha) * g_filt
        return out.to(g_mask.dtype)

    def residual(self) -> Tensor | None:
        """The ``delayed_ef`` residual ``R`` (m, n) float32, or None while ``E`` or the prior is missing."""
        if self.E is None or self.U is None or self.s is None or self.Vh is None:
            return None
        if self.M is not None:
            return self.M - self.E
        proj_e = self.U @ (self.U.T @ self.E @ self.Vh.T) @ self.Vh
        return (self.U * self.s) @ self.Vh - proj_e

    def transform(self, g_mask: Tensor, step: int | None = None) -> Tensor:
        """The gradient handed to AdamW under this filter's ``mode`` at fast step ``step``.

        ``g_mask``: (m, n). See the module docstring for each mode. Without a fresh prior every mode
        returns ``g_mask`` (``delayed_ef`` still records it in its masked window).
        """
        if self.mode == "filter":
            return self.filter(g_mask, step)
        if self.mode == "clean_every":
            if step is not None and step % self.clean_every == 0 and self.is_fresh(step):
                clean = self.prior_matrix()
                assert clean is not None
                return clean.to(g_mask.dtype)
            return self.filter(g_mask, step)
        if self.mode == "delayed_ef":
            g32 = g_mask.detach().float()
            if self._mask_sum is None:
                self._mask_sum = g32.clone()
            else:
                self._mask_sum.add_(g32)
            self._mask_count += 1
            out = self.filter(g_mask, step)
            res = self.residual() if self.is_fresh(step) else None
            if res is None:
                return out
            return (out.float() + res).to(g_mask.dtype)
        # bias_correction
        if not self.is_fresh(step):
            return g_mask
        assert self.U is not None and self.s is not None and self.Vh is not None
        corr = (self.U * self.s) @ self.Vh  # (m, n) rank-r correction, also when M is held here
        return (g_mask.float() + corr).to(g_mask.dtype)

    # ---- checkpointing ---------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Prior and window state (cloned tensors; None where absent)."""

        def c(t: Tensor | None) -> Tensor | None:
            return None if t is None else t.detach().clone()

        return {
            "M": c(self.M), "U": c(self.U), "s": c(self.s), "Vh": c(self.Vh), "prior_step": self.prior_step,
            "E": c(self.E), "mask_sum": c(self._mask_sum), "mask_count": self._mask_count,
            "svd_count": self.svd_count,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        def c(t: Tensor | None) -> Tensor | None:
            return None if t is None else t.detach().clone()

        for key in ("M", "E", "mask_sum"):
            t = state.get(key)
            if t is not None and tuple(t.shape) != self.shape:
                raise ValueError(f"filter state {key}: shape {tuple(t.shape)} != {self.shape}")
        self.M, self.U, self.s, self.Vh = c(state["M"]), c(state["U"]), c(state["s"]), c(state["Vh"])
        self.prior_step = state["prior_step"]
        self.E, self._mask_sum = c(state.get("E")), c(state.get("mask_sum"))
        self._mask_count = int(state.get("mask_count", 0))
        self.svd_count = int(state.get("svd_count", 0))


# ---------------------------------------------------------------------------------------------
# the optimizer


def is_targeted(name: str, param: Tensor, targets: Iterable[str]) -> bool:
    """A 2-D parameter whose name contains one of ``targets`` gets a spectral filter."""
    return param.dim() == 2 and any(t in name for t in targets)


class SpectralAdamW:
    """AdamW whose targeted 2-D gradients go through a :class:`SpectralFilter` first.

    Composed around :class:`torch.optim.AdamW` (exposed as ``.adamw``). Parameters are split into
    two groups, ``"spectral"`` (targeted matrices) and ``"plain"`` (norms, biases, embeddings,
    lm_head...), both with the same hyperparameters; an empty group is left out. ``param_groups`` is
    the inner optimizer's list, so a schedule outside can set ``opt.param_groups[i]["lr"]``.

    :param named_params: ``(name, parameter)`` pairs of one stage; frozen parameters are skipped.
    :param cfg: the run's :class:`SpectralConfig`.
    :param max_staleness: priors older than this many fast steps are ignored (``None`` = never).
    :param mode: overrides ``cfg.mode`` (e.g. ``"bias_correction"``, which the config does not offer).
    :param ema_init: EMA initialisation policy of the filters (``"first"`` or ``"zero"``).
    :param foreach: passed to :class:`torch.optim.AdamW`.
    """

    def __init__(
        self,
        named_params: Iterable[tuple[str, torch.nn.Parameter]],
        cfg: SpectralConfig,
        *,
        max_staleness: int | None = None,
        lr: float = 1e-4,
        betas: tuple[float, float] | list[float] = (0.9, 0.95),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        mode: str | None = None,
        ema_init: str = "first",
        foreach: bool | None = None,
    ) -> None:
        self.cfg = cfg
        self.mode = mode or cfg.mode
        self.max_staleness = max_staleness
        self.params: dict[str, torch.nn.Parameter] = {}
        self.filters: dict[str, SpectralFilter] = {}
        spectral, plain = [], []
        for name, p in named_params:
            if not p.requires_grad:
                continue
            if name in self.params:
                raise ValueError(f"duplicate parameter name {name!r}")
            self.params[name] = p
            if is_targeted(name, p, cfg.targets):
                spectral.append(p)
                self.filters[name] = SpectralFilter(
                    (p.shape[0], p.shape[1]), alpha=cfg.alpha, tau=cfg.tau, beta=cfg.beta, rank=cfg.rank,
                    max_staleness=max_staleness, mode=self.mode, clean_every=cfg.clean_every, ema_init=ema_init,
                )
            else:
                plain.append(p)
        groups = [{"params": ps, "name": n} for n, ps in (("spectral", spectral), ("plain", plain)) if ps]
        if not groups:
            raise ValueError("SpectralAdamW got no trainable parameters")
        self.adamw = torch.optim.AdamW(
            groups, lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, foreach=foreach
        )
        self.fast_step = 0  # the fast step the next step() call is; staleness and clean_every use it
        logger.debug("SpectralAdamW: %d targeted matrices, %d plain tensors, mode %s", len(spectral), len(plain),
                     self.mode)

    @classmethod
    def from_config(
        cls,
        named_params: Iterable[tuple[str, torch.nn.Parameter]],
        spectral: SpectralConfig,
        train: TrainConfig,
        anchor: AnchorConfig,
        **kwargs: Any,
    ) -> SpectralAdamW:
        """Build from the run config: AdamW hyperparameters from ``train``, staleness from ``anchor``."""
        return cls(
            named_params, spectral, max_staleness=anchor.max_staleness, lr=train.lr, betas=tuple(train.betas),
            eps=train.eps, weight_decay=train.weight_decay, **kwargs,
        )

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.adamw.param_groups

    @property
    def state(self) -> Any:
        return self.adamw.state

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.adamw.zero_grad(set_to_none=set_to_none)

    # ---- priors ----------------------------------------------------------------------------

    def _filter_for(self, name: str) -> SpectralFilter:
        try:
            return self.filters[name]
        except KeyError:
            raise PriorError(f"prior for {name!r}, which is not a targeted matrix of this optimizer") from None

    def push_prior(
        self, name_to_grad: Mapping[str, Tensor], anchor_step: int, name_to_masked: Mapping[str, Tensor] | None = None
    ) -> None:
        """Fold anchor gradients (``name -> (m, n)``) from the snapshot at fast step ``anchor_step`` into the filters.

        Matrices absent from the mapping keep their previous prior. ``name_to_masked`` carries the
        anchor's masked gradients for ``bias_correction``. Tensors are moved to their parameter's device.
        """
        for name, g in name_to_grad.items():
            filt, dev = self._filter_for(name), self.params[name].device
            masked = None if name_to_masked is None else name_to_masked.get(name)
            filt.update_prior(g.to(dev), anchor_step, None if masked is None else masked.to(dev))

    def push_prior_factors(
        self, name_to_factors: Mapping[str, tuple[Tensor, Tensor, Tensor]], anchor_step: int
    ) -> None:
        """Set filter factors ``name -> (U (m, r), s (r,), Vh (r, n))`` published by an anchor."""
        for name, (u, s, vh) in name_to_factors.items():
            filt, dev = self._filter_for(name), self.params[name].device
            filt.update_prior_factors(u.to(dev), s.to(dev), vh.to(dev), anchor_step)

    def prior_age(self, step: int | None = None) -> int | None:
        """Fast steps since the oldest held prior's snapshot (None when no filter has a prior)."""
        step = self.fast_step if step is None else step
        steps = [f.prior_step for f in self.filters.values() if f.prior_step is not None]
        return None if not steps else step - min(steps)

    # ---- stepping --------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, fast_step: int | None = None) -> None:
        """Transform the targeted gradients in place (``p.grad`` holds what AdamW used), then take the AdamW step.

        Gradient clipping, if any, belongs before this call (it then clips the masked gradient).

        ``fast_step``: the fast step this is (default: the internal counter). Afterwards the counter is
        ``fast_step + 1``.
        """
        step = self.fast_step if fast_step is None else int(fast_step)
        for name, filt in self.filters.items():
            p = self.params[name]
            if p.grad is None:
                continue
            out = filt.transform(p.grad, step)
            if out is not p.grad:
                p.grad.copy_(out)
        self.adamw.step()
        self.fast_step = step + 1

    # ---- checkpointing ---------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """AdamW state, every filter's prior state and the fast-step counter."""
        return {
            "adamw": self.adamw.state_dict(),
            "filters": {name: f.state_dict() for name, f in self.filters.items()},
            "fast_step": self.fast_step,
            "mode": self.mode,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        missing = set(self.filters) - set(state["filters"])
        extra = set(state["filters"]) - set(self.filters)
        if missing or extra:
            raise ValueError(f"filter state does not match: missing {sorted(missing)}, unexpected {sorted(extra)}")
        if state.get("mode", self.mode) != self.mode:
            logger.warning("loading filter state saved in mode %s into mode %s", state["mode"], self.mode)
        self.adamw.load_state_dict(state["adamw"])
        for name, f in self.filters.items():
            f.load_state_dict(state["filters"][name])
        self.fast_step = int(state["fast_step"])


__all__ = ["EMA_INITS", "MODES", "PriorError", "SpectralAdamW", "SpectralFilter", "is_targeted", "truncated_svd"]
