"""Compressed DP inside a stage: streaming DiLoCo with PowerSGD, all-reduced by hivemind's averager.

Every peer of stage s runs one :class:`hivemind.averaging.DecentralizedAverager` under the prefix
``{run}_dp_{s}`` (hivemind forbids dots in a group prefix). After inner step t (1-based, the
replica's own optimizer steps) the fragments due by :func:`~meshnode.optim.fragments_due` sync:

1. pseudo-gradient = start weights - current weights of the fragment (:class:`OuterNesterov`);
2. ``PowerSGDState.phase_p`` -> all-reduce P -> ``phase_q`` -> all-reduce Q -> ``finish``: two
   averaging rounds per sync, the same PowerSGD code the in-process mesh uses (error feedback, warm
   start, optional 8-bit factors);
3. an outer Nesterov step on the start weights, copied into the live weights.

The averager averages one flat float32 buffer sized for the largest phase of any fragment; each
round packs the phase's factors into it (zero padded) and gathers ``(phase, fragment, round)`` so
mismatched partners are detected (the peer then keeps its own values). A peer alone in its stage,
or one that finds no partner within the matchmaking window, uses its own factors: a group of one,
exactly what the mesh does with one replica. The sync runs while the stage's gate is closed (no
microbatch in flight), so the in-place weight update never meets a live autograd graph.

Bytes on the ``dp`` axis: what the butterfly all-reduce sends per round, ``2 (g-1)/g`` times the
buffer for a group of g peers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

import torch

from ..compression import PowerSGDState, compressed_rank
from ..optim import OuterNesterov, fragments, fragments_due, sync_schedule
from ..protocol import keys

logger = logging.getLogger(__name__)


class SwarmDP:
    def __init__(self, host, dht, run_id: str, counter, partners: Callable[[], int] = lambda: 1,
                 matchmaking_time: float = 2.0, round_timeout: float = 15.0):
        from hivemind.averaging import DecentralizedAverager

        cfg = host.cfg.dp
        self.host = host
        self.counter = counter
        self.partners = partners
        self.H = cfg.inner_steps
        self.params = dict(host.worker.module.named_parameters())
        names = list(self.params)
        self.frags = fragments(names, min(cfg.fragments, len(names)), [self.params[n].numel() for n in names])
        self.offsets = sync_schedule(self.H, len(self.frags))
        self.outer = OuterNesterov(self.params, lr=cfg.outer_lr, momentum=cfg.outer_momentum)
        self.psgd = PowerSGDState(cfg.rank, quantize=cfg.quantize)
        size = max(max(self._phase_sizes(f)) for f in self.frags)
        self.buffer = torch.zeros(size, dtype=torch.float32)
        self.round_timeout = round_timeout
        self.syncs = 0
        self.rounds = 0
        self.group_sizes: list[int] = []
        self.averager = DecentralizedAverager(
            [self.buffer], dht, start=True, prefix=keys.dp_prefix(run_id, host.stage), min_group_size=2,
            target_group_size=max(2, cfg.replicas), min_matchmaking_time=matchmaking_time, request_timeout=2.0,
            allreduce_timeout=round_timeout, allow_state_sharing=False,
        )

    def _phase_sizes(self, names: list[str]) -> tuple[int, int]:
        p = q = 0
        for n in names:
            t = self.params[n]
            r = compressed_rank(t.shape, self.psgd.rank)
            if r == 0:
                p += t.numel()
            else:
                p += t.shape[0] * r
                q += (t.numel() // t.shape[0]) * r
        return p, max(q, 1)

    async def after_step(self, opt_step: int) -> None:
        for f in fragments_due(opt_step, self.H, self.offsets):
            await self.sync(f)

    async def sync(self, f: int) -> None:
        names = self.frags[f]
        host = self.host
        pseudo = await host.run(self.outer.pseudo_gradient, self.params, names)
        p = await host.run(self.psgd.phase_p, pseudo)
        p_avg, g1 = await self._average(p, ("p", f, self.syncs))
        q = await host.run(self.psgd.phase_q, p_avg)
        q_avg, g2 = await self._average(q, ("q", f, self.syncs))
        out = await host.run(self.psgd.finish, q_avg)
        await host.run(self._apply, out)
        self.syncs += 1
        self.group_sizes.append(min(g1, g2))
        logger.info("DP sync %d (fragment %d) at step %d: group of %d", self.syncs, f, host.opt_step, min(g1, g2))

    @torch.no_grad()
    def _apply(self, avg) -> None:
        self.outer.apply(avg, self.params)

    async def _average(self, tensors: dict[str, torch.Tensor], tag: tuple) -> tuple[dict[str, torch.Tensor], int]:
        """All-reduce (mean) ``tensors`` with the stage's group; own values when alone or on failure."""
        if self.partners() < 1:
            return tensors, 1
        order = sorted(tensors)
        flat = torch.cat([tensors[n].reshape(-1).float() for n in order])
        with self.averager.get_tensors() as buf:
            buf[0].zero_()
            buf[0][: flat.numel()].copy_(flat)
        try:
            group = await asyncio.to_thread(self.averager.step, gather=list(tag), timeout=self.round_timeout)
        except Exception as exc:
            logger.info("DP round %s failed: %r; keeping own values", tag, exc)
            group = None
        self.rounds += 1
        if not group:
            return tensors, 1
        if any(list(v) != list(tag) for v in group.values()):
            logger.warning("DP round %s: partners were in another phase; keeping own values", tag)
            return tensors, 1
        with self.averager.get_tensors() as buf:
            out_flat = buf[0][: flat.numel()].clone()
        g = len(group)
        self.counter.add("dp", int(2 * (g - 1) / g * self.buffer.numel() * 4))
        out, off = {}, 0
        for n in order:
            k = tensors[n].numel()
            out[n] = out_flat[off : off + k].reshape(tensors[n].shape)
            off += k
        return out, g

    def state_dict(self) -> dict:
        return {"outer": self.outer.state_dict(), "psgd": self.psgd.state_dict(), "syncs": self.syncs}

    def load_state_dict(self, state: dict) -> None:
        self.outer.load_state_dict(state["outer"])
        self.psgd.load_state_dict(state["psgd"])
        self.syncs = int(state["syncs"])

    def shutdown(self) -> None:
        with contextlib.suppress(Exception):
            self.averager.shutdown()


__all__ = ["SwarmDP"]
