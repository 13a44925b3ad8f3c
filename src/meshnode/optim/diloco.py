"""DiLoCo outer optimizer and the streaming-fragment schedule (DESIGN.md section 1, DP circuit).

Each replica of a stage takes H inner optimizer steps from the shared *start* (global) weights, then
the replicas average their pseudo-gradients ``start - current`` (compressed by PowerSGD elsewhere) and
every replica applies the same outer Nesterov-SGD step to the start weights, which become the new live
weights. DiLoCo's defaults are outer lr 0.7 and momentum 0.9.

Streaming DiLoCo splits the parameters into F *fragments* that sync at staggered inner steps, so
only 1/F of the parameters is on the wire at any moment and the traffic overlaps compute.
:func:`fragments` cuts the (ordered) parameter names into F contiguous, similarly sized pieces;
:func:`sync_schedule` gives fragment f the offset ``(f * H) // F``; fragment f syncs after the inner
steps ``step >= 1`` with ``(step - offset_f) % H == 0`` (:func:`fragments_due`). So fragment 0 syncs at
H, 2H, ...; fragment f first syncs early, at its offset (or at H when the offset is 0), then every H
steps. With F = 1 this is plain DiLoCo.

:class:`OuterNesterov` can hold all of a stage's parameters or one fragment of them (``names``); an
outer step touches only the names present in the averaged pseudo-gradient it is given.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

logger = logging.getLogger(__name__)


def _as_dict(params: Mapping[str, Tensor] | Iterable[tuple[str, Tensor]]) -> dict[str, Tensor]:
    return dict(params.items()) if isinstance(params, Mapping) else dict(params)


class OuterNesterov:
    """Outer Nesterov SGD on the start weights of a set of parameters.

    ``v <- mu*v + g``; ``update = g + mu*v``; ``start <- start - lr*update``; live params <- start
    (the same Nesterov form as :class:`torch.optim.SGD` with ``nesterov=True``).

    :param params: ``name -> tensor`` (or ``(name, tensor)`` pairs) of the live parameters; their
        current values become the start weights.
    :param lr: outer learning rate (DiLoCo: 0.7).
    :param momentum: outer momentum mu (DiLoCo: 0.9).
    :param names: the subset (e.g. a fragment) this optimizer owns; default all of ``params``.
    :param device: where the start weights and momentum live (e.g. ``"cpu"`` to offload); default
        each parameter's device. They are kept in float32 whatever the parameter dtype.
    """

    def __init__(
        self,
        params: Mapping[str, Tensor] | Iterable[tuple[str, Tensor]],
        *,
        lr: float = 0.7,
        momentum: float = 0.9,
        names: Sequence[str] | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        live = _as_dict(params)
        self.names = list(live) if names is None else list(names)
        unknown = [n for n in self.names if n not in live]
        if unknown:
            raise KeyError(f"OuterNesterov: unknown parameter names {unknown}")
        self.lr = float(lr)
        self.momentum = float(momentum)
        self.device = None if device is None else torch.device(device)
        self.start: dict[str, Tensor] = {}
        self.velocity: dict[str, Tensor] = {}
        self.outer_steps = 0
        self.reset_start(live)

    def reset_start(self, params: Mapping[str, Tensor] | Iterable[tuple[str, Tensor]]) -> None:
        """Take the current live values as start weights (e.g. after loading weights from a peer)."""
        live = _as_dict(params)
        with torch.no_grad():
            for n in self.names:
                t = live[n].detach()
                self.start[n] = t.to(device=self.device or t.device, dtype=torch.float32, copy=True)

    @torch.no_grad()
    def pseudo_gradient(
        self, params: Mapping[str, Tensor] | Iterable[tuple[str, Tensor]], names: Iterable[str] | None = None
    ) -> dict[str, Tensor]:
        """``start - current`` (float32, on the start weights' device) for ``names`` (default: all owned)."""
        live = _as_dict(params)
        out = {}
        for n in self.names if names is None else names:
            start = self.start[n]
            out[n] = start - live[n].detach().to(device=start.device, dtype=torch.float32)
        return out

    @torch.no_grad()
    def apply(
        self, avg_pseudo_grad: Mapping[str, Tensor], params: Mapping[str, Tensor] | Iterable[tuple[str, Tensor]]
    ) -> None:
        """One outer step on the names in ``avg_pseudo_grad``, then copy the new start weights into ``params``.

        ``avg_pseudo_grad``: ``name -> tensor`` shaped like the parameter (the replicas' average).
        """
        live = _as_dict(params)
        for n, g in avg_pseudo_grad.items():
            if n not in self.start:
                raise KeyError(f"OuterNesterov: {n!r} is not owned by this optimizer")
            start = self.start[n]
            if tuple(g.shape) != tuple(start.shape):
                raise ValueError(f"pseudo-gradient {n!r}: shape {tuple(g.shape)} != {tuple(start.shape)}")
            g = g.to(device=start.device, dtype=torch.float32)
            if self.momentum > 0:
                v = self.velocity.get(n)
                v = g.clone() if v is None else v.mul_(self.momentum).add_(g)
                self.velocity[n] = v
                update = g + self.momentum * v
            else:
                update = g
            start.sub_(update, alpha=self.lr)
            live[n].copy_(start.to(device=live[n].device, dtype=live[n].dtype))
        self.outer_steps += 1

    def state_dict(self) -> dict[str, Any]:
        return {
            "names": list(self.names),
            "start": {n: t.clone() for n, t in self.start.items()},
            "velocity": {n: t.clone() for n, t in self.velocity.items()},
            "lr": self.lr,
            "momentum": self.momentum,
            "outer_steps": self.outer_steps,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if list(state["names"]) != self.names:
            raise ValueError("OuterNesterov state holds other parameter names")
        for n in self.names:
            if tuple(state["start"][n].shape) != tuple(self.start[n].shape):
                raise ValueError(f"OuterNesterov state {n!r}: shape mismatch")
        dev = {n: self.start[n].device for n in self.names}
        self.start = {n: t.to(dev[n], torch.float32, copy=True) for n, t in state["start"].items()}
        self.velocity = {n: t.to(dev[n], torch.float32, copy=True) for n, t in state["velocity"].items()}
        self.lr = float(state["lr"])
        self.momentum = float(state["momentum"])
        self.outer_steps = int(state["outer_steps"])


# ---------------------------------------------------------------------------------------------
# streaming fragments


def fragments(names: Sequence[str], F: int, sizes: Sequence[int] | None = None) -> list[list[str]]:
    """Split ``names`` (in order) into ``F`` contiguous, non-empty fragments of similar total size.

    ``sizes``: the element count of each name (default 1 each, i.e. balance by count). Deterministic:
    cut f (1..F-1) goes at the index whose prefix size is closest to ``f/F`` of the total (ties to
    the earlier index), keeping every fragment non-empty.
    """
    n = len(names)
    if F < 1:
        raise ValueError(f"fragments: F must be >= 1, got {F}")
    if n < F:
        raise ValueError(f"fragments: cannot cut {n} parameters into {F} non-empty fragments")
    w = [1] * n if sizes is None else [int(x) for x in sizes]
    if len(w) != n:
        raise ValueError("fragments: sizes and names differ in length")
    prefix = [0]
    for x in w:
        prefix.append(prefix[-1] + x)
    total = prefix[-1]
    cuts = [0]
    for f in range(1, F):
        target = total * f / F
        lo, hi = cuts[-1] + 1, n - (F - f)  # keep this and the remaining fragments non-empty
        best = min(range(lo, hi + 1), key=lambda i: (abs(prefix[i] - target), i))
        cuts.append(best)
    cuts.append(n)
    return [list(names[a:b]) for a, b in zip(cuts[:-1], cuts[1:], strict=True)]


def sync_schedule(H: int, F: int) -> list[int]:
    """Offsets of the F fragments within a period of H inner steps: ``offset_f = (f * H) // F``."""
    if H < 1 or F < 1:
        raise ValueError(f"sync_schedule: H and F must be >= 1, got H={H}, F={F}")
    return [(f * H) // F for f in range(F)]


def fragments_due(step: int, H: int, offsets: Sequence[int]) -> list[int]:
    """Fragments that sync after inner step ``step`` (1-based count of inner steps taken)."""
    if step < 1:
        return []
    return [f for f, off in enumerate(offsets) if (step - off) % H == 0]


def fragments_due_by_clock(clock: int, H: int, offsets: Sequence[int], last: list[int]) -> list[int]:
    """Fragments due at ``clock``, a step count shared by peers that may jump by several steps at once.

    Fragment f belongs to period ``(clock - offset_f) // H``; it is due when its period has passed the one it
    last synced in, ``last[f]`` (updated in place). A jump over several periods is one sync. ``last`` empty:
    the first call only records the periods (a peer joining mid-run waits for the next boundary); at the
    start of a run (clock 1) this gives the same steps as :func:`fragments_due`.
    """
    periods = [(clock - off) // H for off in offsets]
    if not last:
        base = clock - 1 if clock <= 1 else clock  # at the run's first step that step itself may be due
        last[:] = [(base - off) // H for off in offsets]
    due = []
    for f, period in enumerate(periods):
        if period > last[f]:
            last[f] = period
            due.append(f)
    return due


__all__ = ["OuterNesterov", "fragments", "fragments_due", "fragments_due_by_clock", "sync_schedule"]
