"""The reference follows training (``mask.reference_refresh``, in-process mesh only).

Reference coding (:mod:`meshnode.stage.reference`) codes each boundary against what a frozen model computes for
the same tokens. With the pretrained model as that reference, what the codes carry grows as training moves away
from it; ``scripts/probe_reference_coding.py --snapshot-ages`` measured a 10-step-old model leaving 3-9x less to
code forward and 2-4x less back (``docs/quality.md``). After every ``mask.reference_refresh`` (K) steps,
:class:`MeshReference` gives the shared :class:`~meshnode.stage.ReferenceModel` new weights and every worker drops
its residual maps (:meth:`~meshnode.stage.StageWorker.reference_moved`):

- with DP, each stage's start weights (``dp.outer[s].start``: the result of the last rounds, which every replica
  shares). A swarm peer would follow the rounds of every stage its reference computes, as an anchor with
  ``anchor.snapshot = "dp"`` does; :meth:`MeshDP.sync <meshnode.mesh.dp.MeshDP.sync>` counts one replica's share
  of each round on the ``ref`` axis for every such peer (:func:`followers`).
- without DP (one replica), that replica's live weights: an upper bound on what a reference K steps old gives,
  counted here as a bfloat16 copy of each stage to every peer whose reference computes it. With
  ``mask.reference_refresh_rank = r`` it takes, instead, the best rank-r approximation of each matrix's distance
  from the live weights (vectors whole, :func:`low_rank_step`): what a swarm could afford to send its followers,
  counted as those factors in bfloat16.
- with ``mask.reference_refresh_rank`` and DP, each replica chain has its own reference, moved by those rank-r
  steps towards that chain's live weights (both ends of a boundary are in one chain, so they agree on it; the DP
  rounds are then not followed and not counted on ``ref``).

Both ends of a boundary move at the same step (one process). The swarm does the rank-r form with one peer per
stage (:mod:`meshnode.node.refmoves`: the same :mod:`meshnode.stage.moves`, sent to each stage's followers and
applied at the first microbatch of the next step; ``tests/test_swarm.py`` checks its losses and ``ref`` bytes are
the mesh's); whole copies, DP's start weights and one reference per replica chain stay in the mesh.
"""

from __future__ import annotations

import logging

import torch

from ..stage.moves import apply_move, make_move, move_nbytes
from ..stage.reference import follower_stages

logger = logging.getLogger(__name__)


def followers(stage: int, num_stages: int, mode: str) -> int:
    """How many peers of one replica chain compute the frozen ``stage`` for reference coding in ``mode``, other than
    the peer of ``stage`` itself (which trains it): each needs its weights when the reference moves."""
    return len(follower_stages(stage, num_stages, mode))


def low_rank_step(held: dict[str, torch.Tensor], live: dict[str, torch.Tensor], rank: int, bits: int = 16
                  ) -> tuple[dict[str, torch.Tensor], int]:
    """``held`` moved towards ``live``: each matrix by the best rank-``rank`` approximation (SVD, float32) of
    ``live - held``, a vector (or a matrix of rank at most ``rank``) all the way; and the bytes of what that takes.
    What is added is what would be sent (:mod:`meshnode.stage.moves`), rounded as sent: the factors ``U S`` and
    ``V`` in bfloat16 (``bits = 16``) or in int8 with one float32 scale a factor (``bits = 8``), a tensor sent whole
    as its change in bfloat16. The next step is taken from the reference so held, so no rounding accumulates."""
    move = make_move(held, live, rank, bits)
    return apply_move(held, move), move_nbytes(move)


class MeshReference:
    """Moves the mesh's reference every ``mask.reference_refresh`` steps (see the module docstring)."""

    def __init__(self, trainer):
        self.period = trainer.cfg.mask.reference_refresh
        self.rank = trainer.cfg.mask.reference_refresh_rank
        self.bits = trainer.cfg.mask.reference_refresh_bits
        self.references = trainer.references  # one per replica chain with a rank, else one shared
        self.refreshes = 0

    def after_step(self, trainer, step: int) -> None:
        done = step + 1
        if done % self.period:
            return
        mode = trainer.cfg.mask.reference
        if trainer.dp is not None and not self.rank:  # after this step's rounds (the DP hook runs first)
            moved = [[trainer.dp.outer[s].start for s in range(trainer.num_stages)]]
        else:  # each chain's reference towards that chain's live weights (a whole copy, or a rank-r step)
            moved = []
            for reference, chain in zip(self.references, trainer.workers):
                weights = [{n: p.detach() for n, p in w.module.named_parameters()} for w in chain]
                for s, w in enumerate(chain):
                    if self.rank:  # what a swarm peer of the stage sends its followers (stage.moves)
                        weights[s] = make_move(dict(reference.stages[s].named_parameters()), weights[s], self.rank,
                                               self.bits)
                        size = move_nbytes(weights[s])
                    else:
                        size = sum(p.numel() * 2 for p in w.module.parameters())
                    trainer.counter.add("ref", size * followers(s, trainer.num_stages, mode))
                moved.append(weights)
        for reference, weights in zip(self.references, moved):
            if self.rank:  # every stage's move made from the reference as held before any is applied
                for s, move in enumerate(weights):
                    reference.apply_move(s, move)
            else:
                reference.load_weights(weights)
        for chain in trainer.workers:
            for w in chain:
                w.reference_moved()
        if trainer.anchor is not None:
            for w in trainer.anchor.workers:
                w.reference_moved()
        self.refreshes += 1
        what = ("the DP start weights" if trainer.dp is not None and not self.rank else "the live weights"
                if not self.rank else f"a rank-{self.rank} step towards its chain's live weights")
        logger.info("step %d: the reference took %s (refresh %d)", done, what, self.refreshes)

    def state_dict(self) -> dict:
        """The refreshes so far and each reference's weights (what a resumed run codes against)."""
        return {"refreshes": self.refreshes,
                "weights": [[dict(m.named_parameters()) for m in r.stages] for r in self.references]}

    def load_state_dict(self, state: dict) -> None:
        weights = state["weights"]
        if weights and isinstance(weights[0], dict):  # saved before the references were per chain: one reference
            weights = [weights]
        if len(weights) != len(self.references):
            raise ValueError(f"the state holds {len(weights)} references, this run {len(self.references)}")
        for reference, held in zip(self.references, weights):
            reference.load_weights(held)
        self.refreshes = int(state["refreshes"])


def maybe_reference(trainer) -> MeshReference | None:
    return MeshReference(trainer) if trainer.cfg.mask.reference_refresh else None


__all__ = ["MeshReference", "followers", "low_rank_step", "maybe_reference"]
