"""meshnode.mesh: the in-process X x Y mesh (plus anchor) built from stage workers; the swarm's reference."""

from .export import export_checkpoint
from .trainer import MeshTrainer, TrainResult

__all__ = ["MeshTrainer", "TrainResult", "export_checkpoint"]
