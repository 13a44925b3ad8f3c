"""Learning-rate schedule: linear warmup, then cosine decay to ``min_lr_ratio * base_lr``.

Applied outside the optimizer (the trainer sets ``param_groups[i]["lr"]`` before each step), so every
replica of a run computes the same value from the step number alone.
"""

from __future__ import annotations

import math


def lr_at(step: int, base_lr: float, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> float:
    """The learning rate of optimizer step ``step`` (0-based).

    Warmup: ``base_lr * (step + 1) / warmup_steps`` for ``step < warmup_steps`` (the first step already
    moves, the last warmup step reaches ``base_lr``). Then cosine from ``base_lr`` at ``step =
    warmup_steps`` to ``min_lr_ratio * base_lr`` at ``step = total_steps``, and flat after that.
    """
    if step < warmup_steps:
        return base_lr * (step + 1) / warmup_steps
    min_lr = min_lr_ratio * base_lr
    span = total_steps - warmup_steps
    if span <= 0:
        return base_lr if step < total_steps else min_lr
    progress = min(1.0, (step - warmup_steps) / span)
    return min_lr + (base_lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))


__all__ = ["lr_at"]
