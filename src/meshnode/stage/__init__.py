"""meshnode.stage: the transport-agnostic stage worker used by the in-process mesh and by the daemon."""

from .reference import REFERENCE_MODES, MapStore, ReferenceModel, ResidualMap, peer_passes, peer_plan
from .worker import MicrobatchId, StageError, StageWorker, causal_lm_loss, chain_gradients

__all__ = [
    "REFERENCE_MODES", "MapStore", "MicrobatchId", "ReferenceModel", "ResidualMap", "StageError", "StageWorker",
    "causal_lm_loss", "chain_gradients", "peer_passes", "peer_plan",
]
