"""Swarm DP with ``dp.overlap``: the rounds run in the background, and the outer step keeps local progress."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import torch

from meshnode.node.dp import SwarmDP
from meshnode.optim import OuterNesterov


class _ExactPowerSGD:
    """Stands in for PowerSGD: the 'compressed' average is the exact one."""

    def phase_p(self, pseudo):
        return dict(pseudo)

    def phase_q(self, p):
        return dict(p)

    def finish(self, q):
        return dict(q)


def _dp(params, release: asyncio.Event, calls: list):
    dp = SwarmDP.__new__(SwarmDP)

    async def run(fn, *args):
        return fn(*args)

    dp.host = SimpleNamespace(run=run, opt_step=0)
    dp.params = params
    dp.H = 2
    dp.frags = [list(params)]
    dp.offsets = [0]
    dp.outer = OuterNesterov(params, lr=0.5, momentum=0.0)
    dp.psgd = _ExactPowerSGD()
    dp.overlap = True
    dp.pending, dp.ready = {}, []
    dp.skipped = dp.syncs = 0
    dp.group_sizes = []
    dp._round_lock = asyncio.Lock()

    async def average(tensors, tag):
        calls.append(tag)
        await release.wait()  # the partner is slow: the rounds take a while
        return tensors, 2

    dp._average = average
    return dp


def test_overlapped_sync_does_not_block_and_keeps_local_progress():
    async def scenario():
        w = torch.zeros(4, 3)
        params = {"w": w}
        release, calls = asyncio.Event(), []
        dp = _dp(params, release, calls)
        start = w.clone()
        w.add_(1.0)  # two inner steps of local training
        snap = w.clone()
        await asyncio.wait_for(dp.after_step(2), 1.0)  # due: returns while the rounds are still waiting
        assert 0 in dp.pending and not dp.ready
        w.add_(0.25)  # training goes on during the sync
        await dp.after_step(3)  # not due; nothing finished yet: the weights are untouched
        assert torch.equal(w, snap + 0.25)
        await dp.after_step(4)  # due again while the first sync still runs: skipped
        assert dp.skipped == 1 and len(calls) == 1
        release.set()
        await asyncio.wait_for(dp.pending[0], 1.0)
        assert len(dp.ready) == 1 and dp.syncs == 1 and calls == [("p", 0), ("q", 0)]
        w.add_(0.125)
        progress = w - snap
        await dp.after_step(5)  # the next step boundary applies it
        new_start = start - 0.5 * (start - snap)  # outer SGD, lr 0.5, on the (exactly) averaged pseudo-gradient
        assert torch.allclose(w, new_start + progress)
        assert torch.allclose(dp.outer.start["w"], new_start)
        assert not dp.ready and not dp.pending

    asyncio.run(scenario())


def test_a_failed_background_sync_changes_nothing():
    async def scenario():
        w = torch.ones(2, 2)
        params = {"w": w}
        dp = _dp(params, asyncio.Event(), [])

        async def broken(tensors, tag):
            raise RuntimeError("averager died")

        dp._average = broken
        await dp.after_step(2)
        await asyncio.wait_for(asyncio.gather(*dp.pending.values(), return_exceptions=True), 1.0)
        await dp.after_step(3)
        assert torch.equal(w, torch.ones(2, 2)) and dp.syncs == 0 and not dp.pending

    asyncio.run(scenario())
