"""Reference coding of stage boundaries (``mask.reference``): code what fine-tuning changed, not the whole tensor.

Every peer starts from the same pretrained weights, which it loads from disk; the microbatch's token ids travel
with it to every stage. So both ends of a boundary can compute, for the same tokens, what the *pretrained*
model would send across it, and the sender codes only the difference:

- forward (``reference = "forward"`` or ``"both"``): the sender of boundary b encodes ``h - h_ref``, where
  ``h_ref`` is the output of the frozen pretrained stages 0..b on the ids; the receiver decodes and adds its
  own ``h_ref``. A channel the mask drops, or a coordinate the quantiser rounds, then costs its *change* from
  the pretrained value, not its value: zero-filling 95 % of the channels puts the pretrained value there.
- backward (``"both"``): the gradient's sender (stage b + 1) encodes ``g - g_ref``, where ``g_ref`` is the
  gradient of the frozen stages b + 1..end's loss at the decoded boundary input ``x_hat`` (the one both ends
  know: the receiver of the gradient decodes its own payload to get it); the receiver adds its own ``g_ref``.

``scripts/probe_reference_coding.py`` measured the residuals on SmolLM2-135M (``docs/quality.md``): after 10 to
150 dense steps they are a small fraction of the tensors, so a codec spends its bits on far less.

The price is compute and memory, not bytes: a peer holds the whole pretrained model frozen, and per microbatch
runs the frozen stages before its boundaries forward (no graph) and, for the gradient, the frozen stages after
its boundaries forward and backward (input gradient only). :class:`ReferenceModel` counts the frozen stage passes
it ran (``stage_forwards``, ``stage_backwards``). In one process (the mesh) a result is computed once and shared
by both ends (they would compute the same numbers); the counters say what was computed, and
:func:`peer_passes` what each peer of a swarm computes.

Both ends must compute the same reference to float rounding: same weights (the pretrained ones, never trained),
same autocast. A mismatch adds to the error; it is not detected.
"""

from __future__ import annotations

import contextlib
import copy
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence

import torch
from torch import Tensor

REFERENCE_MODES = ("none", "forward", "both")


class ReferenceModel:
    """The frozen pretrained stages, and the boundary tensors they give for a microbatch's token ids.

    ``stages``: every stage's module as loaded (copied here, frozen). ``autocast``: a context factory, the one
    the training workers use (the reference is computed the same way on both ends). Results are kept per key
    (a microbatch of a replica chain) for the last ``max_keys`` keys, checked against the ids they were made
    from, so the two ends of a boundary in one process share one computation.
    """

    def __init__(self, stages: Sequence[torch.nn.Module], *, autocast: Callable[[], contextlib.AbstractContextManager]
                 | None = None, max_keys: int = 32, copy_modules: bool = True):
        self.stages = [copy.deepcopy(m) if copy_modules else m for m in stages]
        for m in self.stages:
            m.eval()
            for p in m.parameters():
                p.requires_grad_(False)
        self.autocast = autocast or contextlib.nullcontext
        self.max_keys = max_keys
        self._acts: OrderedDict[Hashable, tuple[Tensor, list[Tensor]]] = OrderedDict()
        self._grads: OrderedDict[tuple[Hashable, int], tuple[Tensor, Tensor, Tensor]] = OrderedDict()
        self.stage_forwards = 0  # frozen stage passes computed (not served from the cache)
        self.stage_backwards = 0

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    def _dtype(self, s: int) -> torch.dtype:
        return next(self.stages[s].parameters()).dtype

    @staticmethod
    def _touch(cache: OrderedDict, key, value, limit: int) -> None:
        cache[key] = value
        cache.move_to_end(key)
        while len(cache) > limit:
            cache.popitem(last=False)

    @torch.no_grad()
    def activation(self, key: Hashable, ids: Tensor, boundary: int) -> Tensor:
        """The pretrained model's output of stage ``boundary`` for ``ids`` ``(B, T)``: float32 ``(B, T, H)``."""
        if not 0 <= boundary < self.num_stages - 1:
            raise ValueError(f"boundary {boundary} is not between two of {self.num_stages} stages")
        held = self._acts.get(key)
        acts = held[1] if held is not None and torch.equal(held[0], ids) else []
        with self.autocast():
            while len(acts) <= boundary:
                s = len(acts)
                x = ids if s == 0 else acts[-1].to(self._dtype(s))
                acts.append(self.stages[s](x).float())
                self.stage_forwards += 1
        self._touch(self._acts, key, (ids, acts), self.max_keys)
        return acts[boundary]

    def input_grad(self, key: Hashable, ids: Tensor, boundary: int, x: Tensor, scale: float = 1.0) -> Tensor:
        """The gradient of ``scale`` x the frozen stages ``boundary + 1 ..``'s mean next-token loss on ``ids``
        with respect to their input ``x`` (the decoded boundary ``boundary``): float32, ``x``'s shape."""
        if not 0 <= boundary < self.num_stages - 1:
            raise ValueError(f"boundary {boundary} is not between two of {self.num_stages} stages")
        from .worker import causal_lm_loss

        held = self._grads.get((key, boundary))
        if held is not None and torch.equal(held[0], ids) and torch.equal(held[1], x):
            return held[2]
        leaf = x.detach().to(self._dtype(boundary + 1)).requires_grad_(True)
        with torch.enable_grad(), self.autocast():
            y = leaf
            for s in range(boundary + 1, self.num_stages):
                y = self.stages[s](y)
                self.stage_forwards += 1
            loss = causal_lm_loss(y, ids) * scale
        (g,) = torch.autograd.grad(loss, leaf)
        self.stage_backwards += self.num_stages - boundary - 1
        g = g.float()
        self._touch(self._grads, (key, boundary), (ids, x.detach().clone(), g), self.max_keys)
        return g


def peer_plan(stage: int, num_stages: int, mode: str) -> tuple[list[int], list[int]]:
    """The frozen stages a swarm peer of ``stage`` runs per microbatch for ``mode``: (forward only, forward and
    input backward).

    Forward only: the prefix 0..b of each boundary b it receives (b = stage - 1) or sends (b = stage), computed
    once (0..stage, or 0..stage - 1 on the last stage). With ``"both"``, for each boundary it receives a gradient
    on (b = stage) or sends one on (b = stage - 1), the frozen stages after it, forward and backward.
    """
    if mode not in REFERENCE_MODES:
        raise ValueError(f"reference mode must be one of {', '.join(REFERENCE_MODES)}, got {mode!r}")
    if mode == "none" or num_stages < 2:
        return [], []
    last = stage == num_stages - 1
    prefix = list(range(stage if last else stage + 1))
    suffixes: list[int] = []
    if mode == "both":
        for b in ([stage] if not last else []) + ([stage - 1] if stage > 0 else []):
            suffixes += list(range(b + 1, num_stages))
    return prefix, suffixes


def peer_passes(stage: int, num_stages: int, mode: str) -> tuple[int, int]:
    """How many frozen stage passes :func:`peer_plan` makes: (forwards, backwards)."""
    prefix, suffixes = peer_plan(stage, num_stages, mode)
    return len(prefix) + len(suffixes), len(suffixes)


__all__ = ["REFERENCE_MODES", "ReferenceModel", "peer_passes", "peer_plan"]
