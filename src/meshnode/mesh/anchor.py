"""The anchor replica of the in-process mesh: unmasked passes on stale weights that become priors.

Every ``anchor.period`` (K) fast steps the anchor copies replica 0's current weights (the snapshot;
with ``anchor.snapshot = "dp"`` the global weights of the last DP sync instead),
draws a batch from the same training distribution (its own order, seed offset), and runs an
unmasked forward/backward with dense boundary transfers. The gradients of the targeted matrices are
the prior; it reaches every fast optimizer K steps later, the delay the swarm would see, so when used
it describes weights K to 2K steps old. The optimizers ignore priors older than
``anchor.max_staleness``.

In ``bias_correction`` mode the anchor also runs the *masked* pass on the same batch and weights, and
publishes both gradients; the fast optimizers keep a low-rank EMA of (clean - masked).

Bytes on the ``anchor`` axis: the anchor pipeline's dense boundary traffic, the weight snapshot it
must fetch (bf16, every cycle) and the published prior (rank-r factors in fp16, or the dense matrix
when the rank is full). With ``anchor.snapshot = "dp"`` the snapshot costs no bf16 copy: the anchor
receives one replica's share of every DP round (counted in ``mesh.dp``).
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass

import torch

from ..data import BatchSource
from ..stage import MicrobatchId, StageWorker, chain_gradients

logger = logging.getLogger(__name__)

ANCHOR_SEED_OFFSET = 1_000_003


@dataclass
class _Prior:
    deliver_at: int
    anchor_step: int
    clean: list[dict[str, torch.Tensor]]  # per stage: name -> (m, n)
    masked: list[dict[str, torch.Tensor]] | None


class MeshAnchor:
    def __init__(self, trainer):
        cfg = trainer.cfg
        self.period = cfg.anchor.period
        self.mode = cfg.spectral.mode
        self.workers = []
        for w in trainer.workers[0]:
            aw = StageWorker(copy.deepcopy(w.module), cfg, replica=-1, counter=trainer.counter)
            aw.masked = False
            aw.reference = w.reference  # its masked twin (``bias_correction``) codes as the fast replicas do
            self.workers.append(aw)
        batch = cfg.anchor.batch_size or cfg.train.batch_size
        self.source = BatchSource(trainer.corpus.train, batch, seed=cfg.train.seed + ANCHOR_SEED_OFFSET)
        self.pending: list[_Prior] = []
        self.cycles = 0
        self.targets = [sorted(w.optimizer.filters) for w in trainer.workers[0]]

    def _grads(self, mb: MicrobatchId, ids: torch.Tensor, masked: bool) -> list[dict[str, torch.Tensor]]:
        for w in self.workers:
            w.masked = masked
        return chain_gradients(self.workers, mb, ids, self.targets)

    def cycle(self, trainer, step: int) -> _Prior:
        """One anchor cycle on the weights replica 0 has after ``step`` fast steps."""
        if trainer.cfg.anchor.snapshot == "dp":  # the global weights of the last DP sync, already paid for
            for s, aw in enumerate(self.workers):
                start = trainer.dp.outer[s].start
                with torch.no_grad():
                    for n, p in aw.module.named_parameters():
                        p.copy_(start[n])
        else:
            for aw, fw in zip(self.workers, trainer.workers[0]):
                aw.module.load_state_dict(fw.module.state_dict())
                trainer.counter.add("anchor", sum(p.numel() * 2 for p in fw.module.parameters()))
        ids = self.source.batch(self.cycles).to(trainer.device)
        mb = MicrobatchId(step, 0)
        clean = self._grads(mb, ids, masked=False)
        masked = self._grads(mb, ids, masked=True) if self.mode == "bias_correction" else None
        for w in self.workers:
            w.masked = False
        rank = trainer.cfg.spectral.rank
        for grads in clean:
            for g in grads.values():
                m, n = g.shape
                trainer.counter.add("anchor", (m + n + 1) * rank * 2 if rank and rank < min(m, n) else m * n * 2)
        self.cycles += 1
        return _Prior(step + self.period, step, clean, masked)

    def after_step(self, trainer, step: int) -> None:
        done = step + 1
        for prior in [p for p in self.pending if p.deliver_at <= done]:
            for workers in trainer.workers:
                for s, w in enumerate(workers):
                    w.optimizer.push_prior(prior.clean[s], prior.anchor_step, None if prior.masked is None else
                                           prior.masked[s])
            self.pending.remove(prior)
        if done % self.period == 0:
            self.pending.append(self.cycle(trainer, done))

    def state_dict(self) -> dict:
        return {"pending": [vars(p) for p in self.pending], "cycles": self.cycles}

    def load_state_dict(self, state: dict) -> None:
        self.pending = [_Prior(**p) for p in state["pending"]]
        self.cycles = int(state["cycles"])


def maybe_anchor(trainer) -> MeshAnchor | None:
    return MeshAnchor(trainer) if trainer.cfg.anchor.enabled else None
