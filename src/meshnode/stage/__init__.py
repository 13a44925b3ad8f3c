"""meshnode.stage: the transport-agnostic stage worker used by the in-process mesh and by the daemon."""

from .worker import MicrobatchId, StageError, StageWorker, causal_lm_loss, chain_gradients

__all__ = ["MicrobatchId", "StageError", "StageWorker", "causal_lm_loss", "chain_gradients"]
