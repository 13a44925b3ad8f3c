"""Optimizers of a stage replica: spectral correction of masked gradients (AdamW wrapper), the anchor
EMA/SVD prior, the DiLoCo outer step with streaming fragments, and the learning-rate schedule.

Pure tensor code: nothing here imports networking (DESIGN.md section 2).
"""

from meshnode.optim.diloco import OuterNesterov, fragments, fragments_due, fragments_due_by_clock, sync_schedule
from meshnode.optim.noise import MicrobatchNoise
from meshnode.optim.schedule import lr_at
from meshnode.optim.spectral import (
    EMA_INITS,
    MODES,
    PriorError,
    SpectralAdamW,
    SpectralFilter,
    is_targeted,
    truncated_svd,
)

__all__ = [
    "EMA_INITS", "MODES", "MicrobatchNoise", "OuterNesterov", "PriorError", "SpectralAdamW", "SpectralFilter",
    "fragments", "fragments_due", "fragments_due_by_clock", "is_targeted", "lr_at",
    "sync_schedule", "truncated_svd",
]
