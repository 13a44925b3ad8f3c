"""meshnode.mesh: the in-process X x Y mesh (plus anchor) built from stage workers; the swarm's reference."""

from .export import export_checkpoint
from .trainer import CheckpointError, MeshTrainer, TrainResult

__all__ = ["CheckpointError", "MeshTrainer", "TrainResult", "export_checkpoint"]
