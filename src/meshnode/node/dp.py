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
exactly what the mesh does with one replica.

Two schedules:

- ``dp.overlap = false``: the sync runs in the optimizer step's hook, with the stage's gate closed (no
  microbatch in flight), so the in-place weight update never meets a live autograd graph. The stage
  waits for its partners and both rounds: on slow links this stall dominated the step time
  (``docs/throughput.md``: 12-24 s per sync against about 1 s per step).
- ``dp.overlap = true``: the hook only takes the pseudo-gradient and a copy of the fragment's weights
  (gate closed, so both are consistent) and hands the rounds to a background task; training goes on.
  At the first step boundary after the rounds finish (gate closed again) the outer step is applied with
  the local progress made meanwhile kept on top: ``w <- outer(start, avg) + (w_now - w_snapshot)``.
  This is DiLoCo with a delayed outer step (one to a few inner steps late), as streaming DiLoCo
  overlaps its communication. A fragment whose previous sync is still running skips its turn. Rounds
  are tagged with (phase, fragment) only: replicas of a stage past stage 0 count their own optimizer
  steps (one that serves more microbatches steps more often), so neither step numbers nor sync counts
  line up between partners; whoever is in the same phase of the same fragment averages together.

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
                 matchmaking_time: float = 2.0, round_timeout: float | None = None):
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
        self.round_timeout = cfg.round_timeout if round_timeout is None else round_timeout
        self.overlap = cfg.overlap
        self.pending: dict[int, asyncio.Task] = {}  # fragment -> background rounds (overlap)
        self.ready: list[tuple[list[str], dict, dict]] = []  # (names, averaged update, weight snapshot)
        self.skipped = 0
        self._round_lock = asyncio.Lock()
        self.syncs = 0
        self.rounds = 0
        self.group_sizes: list[int] = []
        self.averager = DecentralizedAverager(
            [self.buffer], dht, start=True, prefix=keys.dp_prefix(run_id, host.stage), min_group_size=2,
            target_group_size=max(2, cfg.replicas), min_matchmaking_time=matchmaking_time, request_timeout=2.0,
            allreduce_timeout=self.round_timeout, allow_state_sharing=False,
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
        """The optimizer step's hook (gate closed): sync now, or with overlap start and finish background syncs."""
        if not self.overlap:
            for f in fragments_due(opt_step, self.H, self.offsets):
                await self.sync(f)
            return
        await self.apply_ready()
        for f in fragments_due(opt_step, self.H, self.offsets):
            if f in self.pending:
                self.skipped += 1
                logger.info("DP fragment %d: previous sync still running at step %d; skipping this turn", f, opt_step)
                continue
            names = self.frags[f]
            pseudo = await self.host.run(self.outer.pseudo_gradient, self.params, names)
            snapshot = await self.host.run(self._snapshot, names)
            self.pending[f] = asyncio.create_task(self._background(f, opt_step, names, pseudo, snapshot))

    async def sync(self, f: int) -> None:
        names = self.frags[f]
        host = self.host
        pseudo = await host.run(self.outer.pseudo_gradient, self.params, names)
        out, g = await self._rounds(f, self.syncs, pseudo)
        await host.run(self._apply, out)
        self._count(f, g)

    async def _rounds(self, f: int, tag: int | None, pseudo: dict) -> tuple[dict, int]:
        """PowerSGD phase P, all-reduce, phase Q, all-reduce, finish: the averaged update and the group size."""
        host = self.host
        p = await host.run(self.psgd.phase_p, pseudo)
        p_avg, g1 = await self._average(p, ("p", f) if tag is None else ("p", f, tag))
        q = await host.run(self.psgd.phase_q, p_avg)
        q_avg, g2 = await self._average(q, ("q", f) if tag is None else ("q", f, tag))
        out = await host.run(self.psgd.finish, q_avg)
        return out, min(g1, g2)

    def _count(self, f: int, group: int) -> None:
        self.syncs += 1
        self.group_sizes.append(group)
        logger.info("DP sync %d (fragment %d) at step %d: group of %d", self.syncs, f, self.host.opt_step, group)

    async def _background(self, f: int, due_step: int, names: list[str], pseudo: dict, snapshot: dict) -> None:
        try:
            async with self._round_lock:  # one averager buffer: rounds of different fragments take turns
                out, g = await self._rounds(f, None, pseudo)
            self.ready.append((names, out, snapshot))
            self._count(f, g)
        except Exception as exc:  # the fast circuit goes on; this fragment simply skipped a sync
            logger.warning("DP background sync of fragment %d failed: %r", f, exc)
        finally:
            self.pending.pop(f, None)

    async def apply_ready(self) -> None:
        """Apply finished background syncs (call with the gate closed: no live autograd graph)."""
        while self.ready:
            names, out, snapshot = self.ready.pop(0)
            await self.host.run(self._apply_keep_progress, out, snapshot)

    def _snapshot(self, names: list[str]) -> dict[str, torch.Tensor]:
        return {n: self.params[n].detach().to(torch.float32, copy=True) for n in names}

    @torch.no_grad()
    def _apply_keep_progress(self, avg: dict, snapshot: dict) -> None:
        progress = {n: self.params[n].detach().float() - snapshot[n] for n in avg}
        self.outer.apply(avg, self.params)
        for n, d in progress.items():
            self.params[n].add_(d.to(self.params[n].dtype))

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
        for task in self.pending.values():
            task.cancel()
        with contextlib.suppress(Exception):
            self.averager.shutdown()


__all__ = ["SwarmDP"]
