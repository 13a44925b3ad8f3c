"""Compressed data-parallel synchronisation of the in-process mesh (streaming DiLoCo + PowerSGD).

Each stage's X replicas share one DiLoCo outer optimizer (in the swarm each peer holds an identical
copy, since every peer applies the same all-reduced result). The stage's parameters are split into
``dp.fragments`` fragments that sync at staggered inner steps: fragment f syncs after inner step t
when ``(t - offset_f) % H == 0``. A sync all-reduces the replicas' pseudo-gradients (start minus
current weights) with PowerSGD (rank ``dp.rank``, error feedback, optional 8-bit factors), takes a
Nesterov outer step on the start weights and copies them into every replica. The bytes one replica
would send are counted on the ``dp`` axis. ``dp.average_moments`` (an experiment) also averages the replicas'
AdamW moments of the synced parameters (:func:`average_moments`). ``dp.keep_residual`` leaves in each replica's
weights the part of its own progress the round did not send (:meth:`PowerSGDState.keep_residual`), so the
replicas differ after a sync by their residuals and their mean is the exact average.
"""

from __future__ import annotations

import logging

import torch

from ..compression import PowerSGDState, powersgd_allreduce
from ..optim import OuterNesterov, fragments, fragments_due, sync_schedule
from .refresh import followers

logger = logging.getLogger(__name__)


class MeshDP:
    def __init__(self, trainer):
        cfg = trainer.cfg.dp
        self.H = cfg.inner_steps
        self.replicas = trainer.replicas
        self.num_stages = trainer.num_stages
        self.frags: list[list[list[str]]] = []
        self.outer: list[OuterNesterov] = []
        self.psgd: list[list[PowerSGDState]] = []
        for s in range(self.num_stages):
            params = dict(trainer.workers[0][s].module.named_parameters())
            names = list(params)
            self.frags.append(fragments(names, min(cfg.fragments, len(names)), [params[n].numel() for n in names]))
            self.outer.append(OuterNesterov(params, lr=cfg.outer_lr, momentum=cfg.outer_momentum))
            self.psgd.append([PowerSGDState(cfg.rank, quantize=cfg.quantize) for _ in range(self.replicas)])
        self.offsets = sync_schedule(self.H, cfg.fragments)
        self.syncs = 0

    def after_step(self, trainer, step: int) -> None:
        due = fragments_due(step + 1, self.H, self.offsets)
        for f in due:
            for s in range(self.num_stages):
                if f >= len(self.frags[s]):
                    continue
                self.sync(trainer, s, self.frags[s][f])
            self.syncs += 1

    @torch.no_grad()
    def sync(self, trainer, stage: int, names: list[str]) -> None:
        live = [dict(trainer.workers[r][stage].module.named_parameters()) for r in range(self.replicas)]
        pseudo = [self.outer[stage].pseudo_gradient(live[r], names) for r in range(self.replicas)]
        results, sent = powersgd_allreduce(self.psgd[stage], pseudo)
        trainer.counter.add("dp", int(sum(sent)))
        if trainer.cfg.anchor.enabled and trainer.cfg.anchor.snapshot == "dp":
            trainer.counter.add("anchor", int(max(sent)))  # the anchor receives one replica's share of the round
        if trainer.cfg.mask.reference_refresh and not trainer.cfg.mask.reference_refresh_rank:
            # every peer whose reference computes this stage receives it too (a rank-r refresh sends its own moves)
            follow = followers(stage, self.num_stages, trainer.cfg.mask.reference)
            trainer.counter.add("ref", int(max(sent)) * follow * self.replicas)
        self.outer[stage].apply(results[0], live[0])
        for r in range(1, self.replicas):
            for n in names:
                live[r][n].copy_(live[0][n])
        if trainer.cfg.dp.keep_residual:
            for r in range(self.replicas):
                self.psgd[stage][r].keep_residual(live[r], names)
        if trainer.cfg.dp.average_moments:
            trainer.counter.add("dp", self.replicas * average_moments(
                [trainer.workers[r][stage].optimizer for r in range(self.replicas)], names))

    def state_dict(self) -> dict:
        return {
            "outer": [o.state_dict() for o in self.outer],
            "psgd": [[p.state_dict() for p in row] for row in self.psgd],
            "syncs": self.syncs,
        }

    def load_state_dict(self, state: dict) -> None:
        for o, st in zip(self.outer, state["outer"]):
            o.load_state_dict(st)
        for row, strow in zip(self.psgd, state["psgd"]):
            for p, st in zip(row, strow):
                p.load_state_dict(st)
        self.syncs = int(state["syncs"])


@torch.no_grad()
def average_moments(optimizers, names: list[str]) -> int:
    """Set both AdamW moments of the parameters ``names`` to their mean over the replicas' optimizers.

    Returns the bytes one replica would send for it: a bf16 ring all-reduce moves 2 (X - 1) / X of each tensor.
    Parameters without state yet (before their first step) are skipped."""
    x = len(optimizers)
    sent = 0
    for n in names:
        states = [opt.state.get(opt.params[n]) for opt in optimizers]
        if any(not st for st in states):
            continue
        for k in ("exp_avg", "exp_avg_sq"):
            mean = torch.stack([st[k] for st in states]).mean(0)
            for st in states:
                st[k].copy_(mean)
            sent += 2 * mean.numel() * 2 * (x - 1) // x
    return sent


def maybe_dp(trainer) -> MeshDP | None:
    return MeshDP(trainer) if trainer.cfg.dp.enabled else None
