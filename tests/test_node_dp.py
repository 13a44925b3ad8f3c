"""Swarm DP: ``dp.overlap`` (rounds in the background, the outer step keeps local progress) and the DP log the
anchor follows with ``anchor.snapshot = "dp"``."""

from __future__ import annotations

import asyncio
from collections import deque
from types import SimpleNamespace

import pytest
import torch

from meshnode.compression import DenseCodec, PowerSGDState
from meshnode.node.dp import DPFollower, SwarmDP
from meshnode.node.host import tensor_chunks, weights_from_chunks
from meshnode.optim import OuterNesterov


class _ExactPowerSGD:
    """Stands in for PowerSGD: the 'compressed' average is the exact one."""

    def phase_p(self, pseudo):
        return dict(pseudo)

    def phase_q(self, p):
        return dict(p)

    def finish(self, q):
        return dict(q)

    def abandon(self):
        pass

    def state_dict(self):
        return {}


def _dp(params, release: asyncio.Event, calls: list):
    dp = SwarmDP.__new__(SwarmDP)

    async def run(fn, *args):
        return fn(*args)

    dp.host = SimpleNamespace(run=run, opt_step=0, worker=SimpleNamespace(noise=None))
    dp.params = params
    dp.H = 2
    dp.frags = [list(params)]
    dp.offsets = [0]
    dp.outer = OuterNesterov(params, lr=0.5, momentum=0.0)
    dp.psgd = _ExactPowerSGD()
    dp.overlap = True
    dp.keep_residual = False
    dp.clock, dp._periods = None, []
    dp.pending, dp.ready = {}, []
    dp.skipped = dp.syncs = dp.abandoned = dp.realigned = 0
    dp.fetch_outer = None
    dp.group_sizes = []
    dp.partners = lambda: 1
    dp.recheck = None
    dp.keep_log, dp.log, dp.log_seq = False, [], 0
    dp._round_lock = asyncio.Lock()

    async def average(tensors, tag, paired=False, fingerprint=None):
        calls.append(tag)
        await release.wait()  # the partner is slow: the rounds take a while
        return tensors, frozenset({"me", "partner"})

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


def test_a_finished_overlapped_sync_is_applied_at_once_when_the_replica_is_idle(tiny_cfg, cache_dir):
    """After a run's last step no step boundary comes: a background sync that finishes while the replica is idle
    is applied then (gate closed meanwhile), not left waiting, so the final weights hold the last average. A
    replica with a microbatch in flight keeps it for the next boundary."""
    cfg, host, mod, _, _ = _last_stage_host(tiny_cfg, cache_dir)
    params = {n: p for n, p in mod.named_parameters() if n.endswith("o_proj.weight")}

    async def scenario():
        release, calls = asyncio.Event(), []
        dp = _dp(params, release, calls)
        dp.host, host.dp = host, dp
        name = next(iter(params))
        w = params[name]
        start = w.detach().clone()
        with torch.no_grad():
            w.add_(1.0)  # local training since the start
        snap = w.detach().clone()
        await dp.after_step(2)  # due: the rounds run in the background
        assert 0 in dp.pending and host.busy()  # a background sync pending: the demo's final read waits
        release.set()
        await asyncio.wait_for(dp.pending[0], 10.0)  # the task: the rounds, then the apply while idle
        assert not dp.ready and dp.syncs == 1 and not host.busy()
        new_start = start - 0.5 * (start - snap)  # outer SGD, lr 0.5, on the (exactly) averaged pseudo-gradient
        assert torch.allclose(w.detach(), new_start) and torch.allclose(dp.outer.start[name], new_start)
        # busy (a microbatch in flight): the finished sync waits for the next step boundary
        release.clear()
        await dp.after_step(4)
        host._active = 1
        release.set()
        await asyncio.wait_for(dp.pending[0], 10.0)
        assert len(dp.ready) == 1
        host._active = 0
        await dp.after_step(5)
        assert not dp.ready and dp.syncs == 2

    asyncio.run(scenario())


def test_overlapped_schedule_on_the_shared_driver_clock():
    """dp.clock = driver: syncs start when the shared clock crosses a period, whatever this replica's own steps."""
    async def scenario():
        params = {"w": torch.zeros(2, 2)}
        release, calls = asyncio.Event(), []
        dp = _dp(params, release, calls)
        clock = [1]
        dp.clock = lambda: clock[0]
        await dp.after_step(1)
        await dp.after_step(2)  # own step 2 would be due (H = 2); the clock still says 1
        assert not calls and not dp.pending
        clock[0] = 5  # the leading driver is ahead: this replica syncs with it now
        await dp.after_step(3)
        assert 0 in dp.pending
        release.set()
        await asyncio.wait_for(dp.pending[0], 1.0)
        assert calls == [("p", 0), ("q", 0)]
        await dp.after_step(4)  # applied at the next boundary; the clock has not moved: nothing new
        assert dp.syncs == 1 and not dp.pending and len(calls) == 2

    asyncio.run(scenario())


def test_a_sync_averages_q_only_with_the_group_that_averaged_p():
    """Q is projected on the averaged P: a P round without partners makes the sync local (no Q round, so this peer
    cannot meet a late partner's P round with its Q), and a Q round that met other peers than P is not used."""

    def run_sync(groups, partners=1):
        async def scenario():
            params = {"w": torch.zeros(2, 2)}
            dp = _dp(params, asyncio.Event(), [])
            dp.partners = lambda: partners
            calls, values = [], iter(groups)

            async def average(tensors, tag, paired=False, fingerprint=None):
                calls.append(tag[0] + ("!" if paired else ""))  # "!": a round that skips the swarm-snapshot check
                members, factor = next(values)
                return {n: t * factor for n, t in tensors.items()}, members

            dp._average = average
            done = await dp._rounds(0, {"w": torch.ones(2, 2)})
            return calls, (None if done is None else (done[0]["w"], done[1])), dp.abandoned

        return asyncio.run(scenario())

    pair, other = frozenset({"me", "b"}), frozenset({"me", "c"})
    calls, (out, g), _ = run_sync([(pair, 2.0), (pair, 3.0)])  # both rounds in one group: both averages used
    assert calls == ["p", "q!"] and g == 2 and torch.equal(out, torch.full((2, 2), 6.0))
    calls, (out, g), _ = run_sync([(frozenset(), 1.0)], partners=0)  # truly alone: no Q round, the own update
    assert calls == ["p"] and g == 1 and torch.equal(out, torch.ones(2, 2))
    # partners exist but none came: abandoned, no Q round, nothing to apply
    assert run_sync([(frozenset(), 1.0)]) == (["p"], None, 1)
    # Q met someone else: abandoned too (P's average with an own Q would be this peer's alone)
    assert run_sync([(pair, 2.0), (other, 3.0)]) == (["p", "q!"], None, 1)


def test_an_unpaired_sync_changes_nothing_and_the_progress_carries_over():
    """A sync that finds no group while the stage has partners is abandoned: the weights, the start and the
    PowerSGD error feedback stay as they were (applying the own update would move this replica's start away from
    its partners' for good), and the next paired sync averages the whole progress since the common start."""
    async def scenario():
        w = torch.zeros(8, 6)
        params = {"w": w}
        dp = _dp(params, asyncio.Event(), [])
        dp.overlap = False
        dp.psgd = PowerSGDState(2)
        partner_comes = [False]

        async def average(tensors, tag, paired=False, fingerprint=None):  # the partner's values: ours (own update)
            return tensors, (frozenset({"me", "b"}) if partner_comes[0] else frozenset())

        dp._average = average
        progress = torch.randn(8, 6)
        w.add_(progress)
        await dp.sync(0)
        assert dp.abandoned == 1 and dp.syncs == 0 and torch.equal(w, progress)
        assert torch.equal(dp.outer.start["w"], torch.zeros(8, 6)) and dp.psgd.errors == {}
        more = torch.randn(8, 6)
        w.add_(more)
        partner_comes[0] = True
        await dp.sync(0)
        assert dp.syncs == 1 and dp.group_sizes == [2]
        # start 0, outer lr 0.5: w = -0.5 * (the rank-2 part of the pseudo-gradient, -(progress + more)); the rest
        # is in the error feedback: the whole progress since the common start went into this sync
        assert torch.linalg.matrix_rank(w) <= 2
        assert torch.allclose(2 * w - dp.psgd.errors["w"], progress + more, atol=1e-5)

    asyncio.run(scenario())


def test_an_overlapped_sync_with_keep_residual_keeps_the_unsent_progress_too():
    """dp.keep_residual in the swarm: the outer step lands at the next step boundary with the progress made during
    the rounds kept, and the part of the synced progress that rank 2 did not send is kept in the weights instead of
    in error feedback (a partner that sent the same values: the group mean is this replica's own)."""
    async def scenario():
        w = torch.zeros(8, 6)
        params = {"w": w}
        release = asyncio.Event()
        dp = _dp(params, release, [])
        dp.outer = OuterNesterov(params, lr=1.0, momentum=0.0)
        dp.psgd = PowerSGDState(2)
        dp.keep_residual = True
        synced = torch.randn(8, 6, generator=torch.Generator().manual_seed(3))
        w.add_(synced)
        await dp.after_step(2)
        during = torch.randn(8, 6, generator=torch.Generator().manual_seed(4))
        w.add_(during)
        release.set()
        await asyncio.wait_for(dp.pending[0], 1.0)
        sent = dp.ready[0][1]["w"]  # the averaged update: -(the rank-2 part of the synced progress)
        assert torch.linalg.matrix_rank(sent) <= 2 and not torch.allclose(-sent, synced, atol=1e-3)
        await dp.after_step(3)
        # nothing of either lost: the start moved by the sent part; the weights hold all of both
        assert torch.allclose(dp.outer.start["w"], -sent)
        assert torch.allclose(w, synced + during, atol=1e-5)
        assert not dp.psgd.errors["w"].any()

    asyncio.run(scenario())


def test_a_failed_background_sync_changes_nothing():
    async def scenario():
        w = torch.ones(2, 2)
        params = {"w": w}
        dp = _dp(params, asyncio.Event(), [])

        async def broken(tensors, tag, paired=False, fingerprint=None):
            raise RuntimeError("averager died")

        dp._average = broken
        await dp.after_step(2)
        await asyncio.wait_for(asyncio.gather(*dp.pending.values(), return_exceptions=True), 1.0)
        await dp.after_step(3)
        assert torch.equal(w, torch.ones(2, 2)) and dp.syncs == 0 and not dp.pending

    asyncio.run(scenario())


def _logging_dp(params, maxlen: int):
    """A SwarmDP of one peer (group of one) with real PowerSGD (8-bit factors) that keeps the DP log."""
    dp = SwarmDP.__new__(SwarmDP)

    async def run(fn, *args):
        return fn(*args)

    async def alone(tensors, tag, paired=False, fingerprint=None):
        return tensors, frozenset()

    dp.host = SimpleNamespace(run=run, opt_step=0, worker=SimpleNamespace(noise=None))
    dp.params = params
    dp.frags = [["w"], ["b"]]
    dp.outer = OuterNesterov(params, lr=0.7, momentum=0.9)
    dp.psgd = PowerSGDState(2, quantize=True)
    dp.keep_residual = False
    dp.syncs, dp.group_sizes, dp.partners, dp.recheck = 0, [], lambda: 0, None
    dp.keep_log, dp.log, dp.log_seq = True, deque(maxlen=maxlen), 0
    dp.log_epoch, dp.log_base = "e1", "pretrained"
    dp._average = alone
    return dp


def _wire(entries):
    """The entries as the anchor receives them: fp16 pieces through rpc_dp_log's chunk format."""
    return [(e.seq, weights_from_chunks(list(tensor_chunks(e.tensors())))) for e in entries]


def test_the_anchor_follows_the_dp_log_to_the_peers_global_weights():
    async def scenario():
        gen = torch.Generator().manual_seed(0)
        params = {"w": torch.randn(12, 10, generator=gen), "b": torch.randn(10, generator=gen)}
        mine = {n: t.clone() for n, t in params.items()}  # the anchor's copy of the pretrained weights
        dp = _logging_dp(params, maxlen=4)
        fol = DPFollower(mine, lr=0.7, momentum=0.9, rank=2)

        async def inner_steps_then_sync(f):
            for t in params.values():
                t.add_(0.05 * torch.randn(t.shape, generator=gen))
            await dp.sync(f)

        for i in range(3):
            await inner_steps_then_sync(i % 2)
        assert fol.since("peerA") == (0, None)  # nothing followed yet: from the pretrained weights
        assert not torch.allclose(mine["w"], dp.outer.start["w"], atol=1e-2)  # control
        entries = dp.log_since(0, None)
        assert [e.seq for e in entries] == [1, 2, 3]
        assert fol.replay("peerA", dp.log_epoch, _wire(entries)) == 3
        for n in params:  # bf16 factors on the wire: close, not bit-equal
            torch.testing.assert_close(mine[n], dp.outer.start[n], atol=2e-3, rtol=2e-3)
            torch.testing.assert_close(fol.outer.velocity[n], dp.outer.velocity[n], atol=2e-3, rtol=1e-2)

        # bad entries change nothing: out of order, unknown tensors, wrong shapes or rank, NaN, integers
        before = {n: t.clone() for n, t in mine.items()}
        await inner_steps_then_sync(1)
        good = _wire(dp.log_since(3, "e1"))
        seq, tensors = good[0]
        bad = [[(seq + 1, tensors)], [(seq, {**tensors, "p/x": torch.zeros(3)})],
               [(seq, {**tensors, "p/b": torch.zeros(11)})], [(seq, {**tensors, "p/w": torch.zeros(12, 40)})],
               [(seq, {**tensors, "p/b": tensors["p/b"] * float("nan")})],
               [(seq, {**tensors, "p/b": torch.zeros(10, dtype=torch.int64)})]]
        for entries in bad:
            with pytest.raises(ValueError):
                fol.replay("peerA", "e1", entries)
            assert all(torch.equal(mine[n], before[n]) for n in mine) and fol.seq == 3
        with pytest.raises(ValueError):  # another peer's log does not continue this one
            fol.replay("peerB", "e9", good)
        assert fol.since("peerB") is None
        fol.replay("peerA", "e1", good)

        # the peer syncs more often than its log holds: a gap, then the outer state once, then the log again
        for i in range(5):
            await inner_steps_then_sync(i % 2)
        assert dp.log_since(*fol.since("peerA")) is None
        state = weights_from_chunks(list(tensor_chunks({
            **{f"start/{n}": t for n, t in dp.outer.start.items()},
            **{f"velocity/{n}": t for n, t in dp.outer.velocity.items()}}, half=True)))
        fol.load("peerA", dp.log_epoch, dp.log_seq, state)
        await inner_steps_then_sync(0)
        assert fol.replay("peerA", dp.log_epoch, _wire(dp.log_since(*fol.since("peerA")))) == 1
        assert fol.seq == dp.log_seq == 10 and fol.loads == 1
        for n in params:  # bf16 start weights, then one fp16 step
            torch.testing.assert_close(mine[n], dp.outer.start[n], atol=2e-2, rtol=1e-2)

    asyncio.run(scenario())


def test_the_dp_log_answers_only_what_can_be_replayed():
    dp = _logging_dp({"w": torch.zeros(4, 3), "b": torch.zeros(3)}, maxlen=2)
    assert dp.log_since(0, None) == []  # no sync yet: the pretrained weights are current
    for seq in range(1, 4):
        dp._record(0, ({"w": torch.ones(4, 2) * seq, "b": torch.ones(3)}, {"w": torch.ones(3, 2)}))
    assert [e.seq for e in dp.log] == [2, 3]
    assert dp.log_since(0, None) is None  # entry 1 was dropped
    assert [e.seq for e in dp.log_since(1, "e1")] == [2, 3]
    assert dp.log_since(3, "e1") == [] and dp.log_since(4, "e1") is None and dp.log_since(0, "e1") is None
    assert dp.log_since(2, "other") is None
    dp.load_state_dict({"outer": dp.outer.state_dict(), "psgd": dp.psgd.state_dict(), "syncs": 3})
    assert dp.log_epoch != "e1" and not dp.log and dp.log_since(3, "e1") is None
    assert dp.log_since(0, None) is None  # a peer that loaded its state cannot be followed from pretrained


def test_the_overlapped_schedule_logs_each_outer_step_when_it_is_applied():
    async def scenario():
        params = {"w": torch.zeros(4, 3)}
        release = asyncio.Event()
        dp = _dp(params, release, [])
        dp.keep_log, dp.log, dp.log_seq, dp.log_base = True, deque(maxlen=4), 0, "pretrained"
        dp.outer = OuterNesterov(params, lr=0.5, momentum=0.0)
        dp.psgd = PowerSGDState(1)  # real factors: the log holds what the follower can decode
        fol = DPFollower({"w": torch.zeros(4, 3)}, lr=0.5, momentum=0.0, rank=1)
        params["w"].add_(torch.arange(12.0).reshape(4, 3))
        await dp.after_step(2)  # starts the background rounds
        release.set()
        await asyncio.wait_for(dp.pending[0], 1.0)
        assert dp.log_seq == 0 and not dp.log  # averaged, not applied yet: nothing to follow
        await dp.after_step(3)  # applied at this step boundary, and logged
        assert dp.log_seq == 1 and [e.seq for e in dp.log] == [1]
        fol.replay("me", "e1", _wire(dp.log_since(0, None)))
        assert not torch.equal(dp.outer.start["w"], torch.zeros(4, 3))
        torch.testing.assert_close(fol.params["w"], dp.outer.start["w"], atol=2e-2, rtol=1e-2)

    asyncio.run(scenario())


def test_the_anchor_keeps_to_the_followed_log_for_a_grace_period():
    """An anchor asks only the peer whose DP log it follows while that peer answered less than the grace period
    ago (another replica would cost its whole outer state); before anything is followed, or after the grace,
    every candidate, the followed one first."""
    from meshnode.node.anchor import SOURCE_GRACE_S, follow_order

    peers = ["a", "b", "c", "d"]
    assert follow_order(peers, None, -float("inf"), 0.0) == ["a", "b", "c"]  # nothing followed: anyone
    assert follow_order(peers, "c", 100.0, 101.0) == ["c"]
    assert follow_order(["a", "b"], "c", 100.0, 101.0) == []  # the source is missing: wait for it
    late = 100.0 + SOURCE_GRACE_S
    assert follow_order(["a", "b"], "c", 100.0, late) == ["a", "b"]
    assert follow_order(peers, "c", 100.0, late) == ["c", "a", "b"]


def _last_stage_host(tiny_cfg, cache_dir, *overrides):
    """(cfg, host, module, an encoded input, labels) for the last stage of a tiny 2-stage model, no network."""
    from meshnode.model import cut_model, load_model
    from meshnode.node.host import StageHost
    from meshnode.protocol.limits import Limits
    from meshnode.stage import StageWorker

    cfg = tiny_cfg("model.stages=2", "mask.ratio=0", *overrides)
    model, _ = load_model(cfg.model, cache_dir)
    mod = cut_model(model, 2)[1]
    host = StageHost(StageWorker(mod, cfg), cfg, Limits.from_config(cfg, cfg.model.tiny_hidden, cfg.model.tiny_vocab),
                     "run")
    B, T = cfg.train.batch_size, cfg.data.seq_len
    x = DenseCodec("bfloat16").encode(torch.randn(B, T, cfg.model.tiny_hidden))
    return cfg, host, mod, x, torch.randint(0, 200, (B, T))


def test_a_retried_microbatch_the_host_completed_is_answered_once(tiny_cfg, cache_dir):
    """A retry (new attempt) of a microbatch this host already completed, whose reply was lost on the way back,
    gets the first result again: its gradient is accumulated and counted toward the step once (a CI run of
    the mesh-equivalence test diverged at the step where a cut reply was retried)."""
    import asyncio

    cfg, host, mod, x, y = _last_stage_host(tiny_cfg, cache_dir, "train.microbatches=2")
    B, T = cfg.train.batch_size, cfg.data.seq_len

    async def go():
        first = await host.process(driver="d", step=0, mb=0, attempt=1, inputs=x, labels=y)
        grads = {n: p.grad.clone() for n, p in mod.named_parameters() if p.grad is not None}
        again = await host.process(driver="d", step=0, mb=0, attempt=2, inputs=x, labels=y)
        assert again[1] == first[1] and again[0] is first[0]
        assert all(torch.equal(p.grad, grads[n]) for n, p in mod.named_parameters() if n in grads)  # not twice
        assert host.tokens == B * T and not host.gate_closed()  # one of two microbatches counted
        other = await host.process(driver="e", step=0, mb=0, attempt=1, inputs=x, labels=y)  # another driver's
        assert other[1] == pytest.approx(first[1]) and host.tokens == 2 * B * T
        # capacity: tokens per second of this host's own compute (the answered retry cost none)
        assert host.compute_s > 0 and host.capacity() == pytest.approx(host.tokens / host.compute_s)

    asyncio.run(go())


def test_a_replica_takes_one_step_per_train_microbatches_however_many_arrive(tiny_cfg, cache_dir):
    """Three drivers' microbatches reaching one replica at once, one of them failing: each step takes exactly
    ``train.microbatches`` = 2 completed ones (the others wait at the gate; a failed one frees its place), so
    the replica takes as many steps as the drivers. Before, all were admitted and folded into one step with
    their gradients summed, and the replica fell behind."""
    import asyncio

    cfg, host, mod, x, y = _last_stage_host(tiny_cfg, cache_dir, "train.microbatches=2")
    B, T = cfg.train.batch_size, cfg.data.seq_len
    bad = DenseCodec("bfloat16").encode(torch.randn(B, T, cfg.model.tiny_hidden + 1))  # the worker refuses it
    seen_tokens: list[int] = []
    step_fn = host.worker.step

    def counting_step(step, lr):
        seen_tokens.append(host.worker.step_stats.tokens)
        return step_fn(step, lr)

    host.worker.step = counting_step

    async def go():
        # in the order a0 b0 c0 a1 b1 c1: the first step takes two drivers' microbatch 0, in flight together
        calls = [host.process(driver=d, step=0, mb=m, attempt=1, inputs=x, labels=y) for m in (0, 1) for d in "abc"]
        calls.insert(3, host.process(driver="z", step=0, mb=0, attempt=1, inputs=bad, labels=y))
        results = await asyncio.gather(*calls, return_exceptions=True)
        assert [isinstance(r, Exception) for r in results] == [False] * 3 + [True] + [False] * 3
        assert await host.wait_idle(30.0)

    asyncio.run(go())
    assert host.opt_step == 3 and seen_tokens == [2 * B * T] * 3  # two microbatches per step, three steps
    assert host.tokens == 6 * B * T and not host.worker.in_flight and not host._running


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_host_counts_the_steps_it_skipped_for_a_non_finite_gradient(tiny_cfg, cache_dir, bad):
    """A microbatch whose backward leaves a NaN or inf in one weight's gradient: the replica's step is taken
    as skipped (weights kept, StageWorker.step) and counted in ``skipped_steps`` (the peer record and
    ``meshnode status`` show it); the next step trains and is not counted."""
    import asyncio

    cfg, host, mod, x, y = _last_stage_host(tiny_cfg, cache_dir, "train.microbatches=1")
    weights = {n: t.clone() for n, t in mod.state_dict().items()}
    param = next(p for p in mod.parameters() if p.requires_grad)
    hook = param.register_hook(lambda g: torch.full_like(g, bad))

    async def go():
        await host.process(driver="d", step=0, mb=0, attempt=1, inputs=x, labels=y)
        assert await host.wait_idle(30.0)
        assert host.opt_step == 1 and host.skipped_steps == 1
        assert all(torch.equal(weights[n], t) for n, t in mod.state_dict().items())
        hook.remove()
        await host.process(driver="d", step=1, mb=0, attempt=1, inputs=x, labels=y)
        assert await host.wait_idle(30.0)
        assert host.opt_step == 2 and host.skipped_steps == 1

    asyncio.run(go())
    assert not all(torch.equal(weights[n], t) for n, t in mod.state_dict().items())


def _held_host(tiny_cfg, cache_dir):
    """A one-microbatch last-stage host whose first backward stays in flight until ``release`` is set:
    ``(host, labels, in_backward, release, request(driver, attempt))``."""
    import threading

    from meshnode.protocol.messages import forward_request

    cfg, host, mod, x, y = _last_stage_host(tiny_cfg, cache_dir, "train.microbatches=1")
    in_backward, release = threading.Event(), threading.Event()
    backward_fn = host.worker.backward

    def held_backward(mbid, grad):
        in_backward.set()
        assert release.wait(30.0)
        return backward_fn(mbid, grad)

    host.worker.backward = held_backward

    def request(driver, attempt):
        return forward_request(run="run", driver=driver, step=0, mb=0, attempt=attempt, boundary=0,
                               mask_version=cfg.mask.version, payload=x, labels=y, vocab=host.limits.vocab)

    return host, y, in_backward, release, request


def test_a_forward_waits_at_a_full_replica_then_is_told_busy_but_a_retry_is_answered(tiny_cfg, cache_dir):
    """Over the wire (``forward``): with the step's one place taken, another driver's microbatch waits
    ``busy_timeout`` and is told "busy" (it goes to another replica); a retry of the microbatch in flight is
    not refused and takes no place: it gets the first attempt's result, counted once."""
    import asyncio

    from meshnode.node.host import BusyError

    host, y, in_backward, release, request = _held_host(tiny_cfg, cache_dir)
    host.busy_timeout = 0.05

    async def go():
        loop = asyncio.get_running_loop()
        first = asyncio.create_task(host.forward(request("d", 1)))
        assert await loop.run_in_executor(None, in_backward.wait, 30.0)
        retry = asyncio.create_task(host.forward(request("d", 2)))  # runs as soon as this task waits
        with pytest.raises(BusyError, match="busy"):
            await host.forward(request("e", 1))
        assert host.refused == 1
        assert not retry.done() and host._active == 1  # the retry waits, without a place of its own
        release.set()
        a, b = await asyncio.gather(first, retry)
        assert a["loss"] == b["loss"] and a["payload"] == b["payload"]
        assert await host.wait_idle(30.0)

    asyncio.run(go())
    assert host.opt_step == 1 and host.tokens == y.numel()


def test_a_closed_replica_finishes_what_is_in_flight_and_turns_the_rest_away(tiny_cfg, cache_dir):
    """Leaving (shutdown, or a move to another stage): ``close`` turns away the forwards waiting at the gate and
    any later one ("busy": the caller goes to another replica), while the microbatch in flight finishes and a
    retry of it is still answered. Before, ``wait_idle`` saw only what was in flight: a forward queued at the
    gate was admitted after it returned, while the peer was being torn down."""
    import asyncio

    from meshnode.node.host import BusyError

    host, y, in_backward, release, request = _held_host(tiny_cfg, cache_dir)
    host.busy_timeout = 30.0  # a queued forward would wait this long: close must release it at once

    async def go():
        loop = asyncio.get_running_loop()
        first = asyncio.create_task(host.forward(request("d", 1)))
        assert await loop.run_in_executor(None, in_backward.wait, 30.0)
        queued = asyncio.create_task(host.forward(request("e", 1)))  # the step's one place is taken: it waits
        for _ in range(20):
            await asyncio.sleep(0)
        assert not queued.done()
        assert host.busy()  # a microbatch in flight: what the demo's final read waits out
        await host.close()
        with pytest.raises(BusyError, match="leaving"):
            await asyncio.wait_for(queued, 10.0)
        with pytest.raises(BusyError, match="leaving"):
            await host.forward(request("f", 1))
        idle = asyncio.create_task(host.wait_idle(30.0))
        release.set()
        a = await first
        assert await idle
        again = await host.forward(request("d", 2))  # the reply was lost: the retry is answered, not refused
        assert again["loss"] == a["loss"]
        assert host.refused == 2
        assert await host.wait_idle(30.0) and not host.busy()

    asyncio.run(go())
    assert host.opt_step == 1 and host.tokens == y.numel()


def test_a_cancelled_call_frees_its_place_and_its_graph(tiny_cfg, cache_dir):
    """A call cancelled (the driver stopping) while it waits to leave the step, or while its forward runs on the
    host's thread, gives back its place in the step and leaves no graph in flight: the replica still steps and
    the same microbatch can run again. Before, the place leaked (the replica never stepped again) and the
    graph stayed in flight."""
    import asyncio
    import threading

    from meshnode.stage import MicrobatchId

    cfg, host, mod, x, y = _last_stage_host(tiny_cfg, cache_dir, "train.microbatches=1")
    in_fn, release = threading.Event(), threading.Event()
    leave_fn = host._leave

    def held(fn):
        def wrapped(*args):
            in_fn.set()
            assert release.wait(30.0)
            return fn(*args)
        return wrapped

    async def go():
        loop = asyncio.get_running_loop()
        # 1. cancelled while waiting for the condition's lock to leave the step
        backward_fn = host.worker.backward
        host.worker.backward = held(backward_fn)
        task = asyncio.create_task(host.process(driver="d", step=0, mb=0, attempt=1, inputs=x, labels=y))
        assert await loop.run_in_executor(None, in_fn.wait, 30.0)
        await host._cond.acquire()  # someone else holds the gate's lock (a weights snapshot, a woken waiter)
        leaving = asyncio.Event()

        async def noted_leave(completed):
            leaving.set()
            await leave_fn(completed)  # waits for the lock the test holds

        host._leave = noted_leave
        release.set()
        await asyncio.wait_for(leaving.wait(), 30.0)  # the microbatch completed and waits to leave
        assert host.tokens > 0
        task.cancel()
        host._cond.release()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert await host.wait_idle(30.0) and host._active == 0 and host.opt_step == 1
        host.worker.backward, host._leave = backward_fn, leave_fn
        # 2. cancelled while its forward runs on the host's thread
        in_fn.clear()
        release.clear()
        host.worker.forward = held(host.worker.forward)
        task = asyncio.create_task(host.process(driver="d", step=1, mb=0, attempt=1, inputs=x, labels=y))
        assert await loop.run_in_executor(None, in_fn.wait, 30.0)
        task.cancel()
        release.set()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert await host.wait_idle(30.0) and host._active == 0
        assert MicrobatchId(1, 0, "d") not in host.worker.in_flight and not host.worker.in_flight  # discarded
        await host.process(driver="d", step=1, mb=0, attempt=2, inputs=x, labels=y)  # runs again: not "in flight"
        assert await host.wait_idle(30.0) and host.opt_step == 2

    asyncio.run(go())


def test_a_joiner_takes_the_second_moment_correction_with_the_state(tiny_cfg, cache_dir):
    """dp.v_correction in the swarm: a peer that loads a replica's state blob (a joiner, or a restart) gets the
    correction's EMAs with AdamW's moments, so its next step is the replica's own, bit for bit (weights, v, EMAs);
    loaded without them, the EMAs would restart from AdamW's v and the next v would differ."""
    import io

    from meshnode.optim import MicrobatchNoise

    vc = ("train.microbatches=2", "dp.enabled=true", "dp.replicas=2", "dp.v_correction=true")
    cfg, a, mod_a, x, y = _last_stage_host(tiny_cfg, cache_dir, *vc)
    B, T = cfg.train.batch_size, cfg.data.seq_len
    x2 = DenseCodec("bfloat16").encode(torch.randn(B, T, cfg.model.tiny_hidden))
    y2 = torch.randint(0, 200, (B, T))
    assert isinstance(a.worker.noise, MicrobatchNoise)

    async def one_step(host, step):
        for m, (inp, lab) in enumerate([(x, y), (x2, y2)]):
            await host.process(driver="d", step=step, mb=m, attempt=1, inputs=inp, labels=lab)
        assert await host.wait_idle(30.0)

    def strip_noise(blob: bytes) -> bytes:
        state = torch.load(io.BytesIO(blob), weights_only=True)
        assert set(state["optimizer"]["noise"]["ema_var"]) == set(a.worker.noise.ema_var)
        state["optimizer"].pop("noise")
        buf = io.BytesIO()
        torch.save(state, buf)
        return buf.getvalue()

    joiners = []

    async def go():  # one event loop: a host's condition belongs to the loop that first used it
        await one_step(a, 0)
        assert a.opt_step == 1 and a.worker.noise.ema_var  # the correction ran
        blob = a._state_blob()
        for b in (blob, strip_noise(blob)):
            _, host, mod, _, _ = _last_stage_host(tiny_cfg, cache_dir, *vc)
            host.load_state_blob(b)
            joiners.append((host, mod))
        for host in (a, *(h for h, _ in joiners)):
            await one_step(host, 1)

    asyncio.run(go())
    (full, mod_full), (bare, _) = joiners
    assert full.opt_step == a.opt_step == 2

    def v_of(host):
        return [host.worker.optimizer.state[p]["exp_avg_sq"] for p in host.worker.module.parameters()]

    assert all(torch.equal(p, q) for p, q in zip(mod_a.parameters(), mod_full.parameters()))
    assert all(torch.equal(u, w) for u, w in zip(v_of(a), v_of(full)))
    for n, t in a.worker.noise.ema_var.items():
        assert torch.equal(t, full.worker.noise.ema_var[n])
    assert not all(torch.equal(u, w) for u, w in zip(v_of(a), v_of(bare)))  # EMAs restarted: another v


def test_the_correction_follows_the_group_the_last_sync_met():
    """dp.v_correction in the swarm: X is the size of the group the last DP sync averaged with (the mesh's is
    always dp.replicas): a pair corrects to 2, a sync alone (nobody to average with) to 1, no correction."""
    from meshnode.optim import MicrobatchNoise

    async def scenario():
        params = {"w": torch.zeros(2, 2)}
        dp = _dp(params, asyncio.Event(), [])
        noise = MicrobatchNoise({"w": torch.nn.Parameter(torch.zeros(2, 2))}, replicas=3)
        dp.host.worker.noise = noise
        groups = iter([frozenset({"me", "b"}), frozenset(), frozenset(), frozenset({"me", "b"})])

        async def average(tensors, tag, paired=False, fingerprint=None):
            return tensors, (next(groups) if tag[0] == "p" else frozenset({"me", "b"}))

        dp._average = average
        dp.overlap = False
        await dp.sync(0)
        assert noise.replicas == 2
        await dp.sync(0)  # a partner is known but did not come: abandoned, nothing changes
        assert noise.replicas == 2 and dp.abandoned == 1
        dp.partners = lambda: 0
        await dp.sync(0)  # truly alone: a local sync, not averaged with anyone
        assert noise.replicas == 1 and dp.group_sizes == [2, 1]
        dp.partners = lambda: 1
        await dp.sync(0)
        assert noise.replicas == 2
    asyncio.run(scenario())


def test_a_peer_that_sees_no_partner_rereads_the_records_before_syncing_alone():
    """A sync made alone moves this peer's start where no partner's is; a first-holder copy of the records can
    lack a partner that is there. So before a sync alone the peer re-reads the records: a partner found then
    gets the sync paired; none found, the sync is made alone; with a partner already seen, no re-read."""
    from meshnode.node.dp import SwarmDP

    async def scenario():
        params = {"w": torch.ones(3, 2)}
        dp = _dp(params, asyncio.Event(), [])
        dp.overlap = False
        seen = {"partners": 0, "rechecks": 0, "found": True}

        async def recheck():
            seen["rechecks"] += 1
            if seen["found"]:
                seen["partners"] = 1

        async def average(tensors, tag, paired=False, fingerprint=None):  # SwarmDP's own gate, then a pair
            if not paired and dp.partners() < 1:
                return tensors, frozenset()
            return tensors, frozenset({"me", "partner"})

        dp.partners = lambda: seen["partners"]
        dp.recheck = recheck
        dp._average = average
        dp._fingerprint = lambda f: None
        dp._start_leader = SwarmDP._start_leader.__get__(dp)
        dp._gathered = {}
        await dp.sync(0)
        assert seen["rechecks"] == 1 and dp.group_sizes == [2]  # found on the re-read: paired
        await dp.sync(0)
        assert seen["rechecks"] == 1 and dp.group_sizes == [2, 2]  # seen already: no re-read
        seen["partners"], seen["found"] = 0, False

        async def failing():
            seen["rechecks"] += 1
            raise RuntimeError("DHT unreachable")

        dp.recheck = failing
        await dp.sync(0)  # the re-read fails: logged, and the sync goes on alone
        dp.recheck = recheck
        await dp.sync(0)
        assert seen["rechecks"] == 3 and dp.group_sizes == [2, 2, 1, 1]
    asyncio.run(scenario())


def test_replicas_whose_starts_drifted_apart_take_the_leaders():
    """A replica that synced alone before it saw its partner has moved its start weights; averaging
    pseudo-gradients from two starts would keep that difference for good. The P round gathers a fingerprint of
    the start: on a mismatch the sync is abandoned, and the members that do not hold the start most members hold
    (ties: the smallest peer id's) take its holder's outer state, start and velocity exactly (its own weights
    stay), if it has the fingerprint gathered. The next sync then closes the gap."""
    async def scenario():
        w = torch.full((4, 3), 2.0)
        params = {"w": w}
        dp = _dp(params, asyncio.Event(), [])
        dp.outer = OuterNesterov(params, lr=0.5, momentum=0.9)
        dp.overlap = False
        dp.averager = SimpleNamespace(peer_id="me")
        dp.log, dp.log_seq, dp.log_base, dp.log_epoch = deque([1]), 1, "pretrained", "e0"
        dp.outer.start["w"] = torch.full((4, 3), 1.0)  # this replica's start moved (a solo sync) ...
        dp.outer.velocity["w"] = torch.full((4, 3), 0.3)  # ... which made a velocity its partner does not have
        leader_start = torch.zeros(4, 3)
        served = {"start/w": leader_start}  # the leader made no outer step yet: no velocity
        fetched = []

        async def fetch_outer(peer, names):
            assert names == ["w"]  # the fragment's tensors only
            fetched.append(peer)
            return {k: t.clone() for k, t in served.items()}

        dp.fetch_outer = fetch_outer

        async def average(tensors, tag, paired=False, fingerprint=None):
            if tag[0] == "p":
                dp._gathered = {"me": fingerprint, "a-leader": [0.0, 0.0]}  # the leader's start: zeros
            return tensors, frozenset({"me", "a-leader"})

        dp._average = average
        assert dp._fingerprint(0) == [12.0, 12.0]  # 12 entries of 1.0: sum and absolute sum
        served["start/w"] = torch.full((4, 3), 0.5)  # first a start that is not the one the leader gathered
        await dp.sync(0)
        assert fetched == ["a-leader"] and dp.realigned == 0 and dp.abandoned == 1
        assert torch.equal(dp.outer.start["w"], torch.full((4, 3), 1.0))  # not taken
        served["start/w"] = leader_start
        await dp.sync(0)
        assert fetched == ["a-leader"] * 2 and dp.realigned == 1 and dp.abandoned == 2 and dp.syncs == 0
        assert torch.equal(dp.outer.start["w"], leader_start) and "w" not in dp.outer.velocity  # exactly the leader's
        assert torch.equal(w, torch.full((4, 3), 2.0))  # own weights kept
        assert dp.log_base == "loaded" and not dp.log and dp.log_epoch != "e0"  # followers reload
        await dp.sync(0)  # the fingerprints agree now: averaged and applied from the common start
        assert len(fetched) == 2 and dp.syncs == 1
        # the leader's own first outer step from the same start, pseudo-gradient start - w = -2: velocity -2,
        # Nesterov update -2 * (1 + 0.9), lr 0.5
        assert torch.allclose(w, leader_start + 0.5 * 1.9 * 2.0)

    asyncio.run(scenario())

    # who takes whose: the start most members hold, then the smallest peer id; a member already holding it takes
    # nothing; a fingerprint within the tolerance is the same start
    dp = _dp({"w": torch.zeros(4, 3)}, asyncio.Event(), [])
    dp.outer.start["w"] = torch.arange(12.0).reshape(4, 3) / 10
    mine = dp._fingerprint(0)
    other = [mine[0] + 1e-3, mine[1]]
    dp.averager = SimpleNamespace(peer_id="b")
    pair = frozenset({"0-first", "b"})
    dp._gathered = {}
    assert dp._start_leader(mine, pair) is None  # nothing gathered: no check
    dp._gathered = {"0-first": [mine[0] * (1 + 1e-7), mine[1]], "b": mine}
    assert dp._start_leader(mine, pair) is None
    dp._gathered = {"0-first": other, "b": mine}
    assert dp._start_leader(mine, pair) == ("0-first", False)  # a tie: the smallest peer id's start
    dp.averager = SimpleNamespace(peer_id="0-first")
    assert dp._start_leader(other, pair) == ("0-first", True)
    trio = frozenset({"0-first", "b", "c"})
    dp.averager = SimpleNamespace(peer_id="c")
    dp._gathered = {"0-first": other, "b": mine, "c": mine}
    assert dp._start_leader(mine, trio) == ("b", True)  # two hold mine: 0-first takes b's, c takes nothing
    dp.averager = SimpleNamespace(peer_id="0-first")
    assert dp._start_leader(other, trio) == ("b", False)


def test_a_partner_serves_one_fragments_outer_state_while_it_steps(tiny_cfg, cache_dir):
    """What a replica whose start drifted fetches: only the fragment's start and velocity, served at once even
    while the partner steps (in the blocking schedule it may be waiting in its next fragment's DP round, which
    would hold the caller until that round timed out). The whole outer state (the anchor's) still waits for the
    step to end. Bad requests are refused."""
    from meshnode.protocol.messages import WireError

    cfg, host, mod, _, _ = _last_stage_host(tiny_cfg, cache_dir)
    params = dict(mod.named_parameters())
    outer = OuterNesterov(params, lr=1.0, momentum=0.9)
    names = sorted(params)[:2]
    outer.velocity[names[0]] = torch.full_like(params[names[0]], 0.25)
    host.dp = SimpleNamespace(outer=outer, log_seq=0, log_epoch="e", syncs=0)

    async def collect(request):
        return [c async for c in host.weights_stream(request)]

    async def scenario():
        async with host._cond:
            host._stepping = True
        got = weights_from_chunks(await asyncio.wait_for(collect({"run": "run", "what": "outer", "names": names}),
                                                         timeout=30))
        assert set(got) == {f"start/{names[0]}", f"start/{names[1]}", f"velocity/{names[0]}"}
        assert torch.equal(got[f"start/{names[1]}"], params[names[1]].detach().float())
        assert torch.equal(got[f"velocity/{names[0]}"], outer.velocity[names[0]])
        whole = asyncio.create_task(collect({"run": "run", "what": "outer"}))
        for _ in range(20):
            await asyncio.sleep(0)
        assert not whole.done()  # the full state waits for the step
        async with host._cond:
            host._stepping = False
            host._cond.notify_all()
        full = weights_from_chunks(await asyncio.wait_for(whole, timeout=30))
        assert len(full) == len(params) + 1
        for bad in (["no.such.weight"], [], names[0], [names[0], 3], [names[0]] * (len(params) + 1)):
            with pytest.raises(WireError, match="names"):
                await collect({"run": "run", "what": "outer", "names": bad})
        with pytest.raises(WireError, match="names only"):
            await collect({"run": "run", "names": names})

    asyncio.run(scenario())


def test_weights_from_an_anchor_are_checked_whole_and_restart_dp(tiny_cfg, cache_dir):
    """What a peer that moves into an empty stage takes from the anchor: every tensor of the stage, of its shape
    and finite, or nothing changes. Taken, they are DP's start weights (no velocity, no error feedback) and the
    optimizer step goes on from the anchor's."""
    cfg, host, mod, _, _ = _last_stage_host(tiny_cfg, cache_dir)
    before = {k: v.clone() for k, v in mod.state_dict().items()}
    good = {k: v.float() + 0.5 for k, v in before.items()}
    name = next(k for k, v in before.items() if v.is_floating_point())
    restarted = []
    host.dp = SimpleNamespace(restart_from_weights=lambda: restarted.append(True))
    bads = [
        ({k: v for k, v in good.items() if k != name}, "missing"),
        ({**good, "extra.weight": torch.zeros(2)}, "unknown"),
        ({**good, name: good[name].reshape(-1)[:-1]}, "wrong shape"),
        ({**good, name: torch.full_like(good[name], float("nan"))}, "non-finite"),
        ({**good, name: good[name].long()}, "dtype"),
    ]
    for bad, needle in bads:
        with pytest.raises(ValueError, match=needle):
            host.load_weights(bad, 7)
        assert all(torch.equal(v, before[k]) for k, v in mod.state_dict().items()) and host.opt_step == 0
    assert not restarted
    host.load_weights(good, 7)
    assert all(torch.equal(v.float(), good[k]) for k, v in mod.state_dict().items())
    assert host.opt_step == 7 and restarted == [True]

    dp = _dp(dict(mod.named_parameters()), asyncio.Event(), [])
    dp.host.cfg = cfg
    dp.outer.velocity["x"] = torch.zeros(1)
    dp.log, dp.log_base, dp.log_epoch = deque([1]), "pretrained", "e0"
    dp.restart_from_weights()
    assert not dp.outer.velocity and dp.log_base == "loaded" and dp.log_epoch != "e0"
    assert all(torch.equal(dp.outer.start[n], p.detach().float()) for n, p in mod.named_parameters())


def test_a_failed_step_does_not_stop_the_correction_for_good(tiny_cfg, cache_dir, caplog):
    """dp.v_correction: an optimizer step that raises (a CUDA out-of-memory, say) after the step's variance was
    taken must not leave the tracker expecting a reset that never comes: the next microbatches are served and
    the next step is taken (their gradients add to the failed step's, as without the correction)."""
    vc = ("train.microbatches=2", "dp.enabled=true", "dp.replicas=2", "dp.v_correction=true")
    cfg, host, _, x, y = _last_stage_host(tiny_cfg, cache_dir, *vc)
    real_step = host.worker.optimizer.step
    calls = []

    def failing_once(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("out of memory (simulated)")
        return real_step(*args, **kwargs)

    host.worker.optimizer.step = failing_once

    async def go():
        for step in (0, 1):
            for m in (0, 1):
                await host.process(driver="d", step=step, mb=m, attempt=1, inputs=x, labels=y)
            assert await host.wait_idle(30.0)

    asyncio.run(go())
    assert len(calls) == 2 and host.opt_step == 1  # the first step failed, the second was taken
    assert host.worker.noise.ema_var  # and corrected v
    assert "optimizer step 0 failed" in caplog.text


def test_a_joining_peer_bounds_the_state_it_reads(tiny_cfg, cache_dir, monkeypatch):
    """A peer's state blob (weights, optimizer, DP state, fits) fits within ``state_bytes_bound`` of its stage; a
    stream larger than the bound, or with a frame that carries no bytes, is refused as it arrives (what
    ``_fetch_state`` reads through ``collect_stream``)."""
    import asyncio

    from meshnode.node.host import state_bytes_bound, state_chunk_bytes
    from meshnode.protocol import servicer

    cfg, host, mod, x, y = _last_stage_host(tiny_cfg, cache_dir, "train.microbatches=1")

    async def go():
        await host.process(driver="d", step=0, mb=0, attempt=1, inputs=x, labels=y)
        assert await host.wait_idle(30.0)  # one step taken: AdamW's moments exist
        return await host.state_blob()

    blob = asyncio.run(go())
    bound = state_bytes_bound(mod)
    assert len(blob) < bound

    read: list[int] = []
    chunks: list = []

    async def frames(p2p, peer, handler, request, **kw):
        for i, c in enumerate(chunks):
            read.append(i)
            yield {"ok": True, "data": c, "last": i == len(chunks) - 1}

    monkeypatch.setattr(servicer, "stream_rpc", frames)

    def fetch():
        got = asyncio.run(servicer.collect_stream(None, None, "run.rpc_get_state", {}, max_bytes=0, timeout=1.0,
                                                  max_total=bound, size=state_chunk_bytes))
        return b"".join(f["data"] for f in got)

    chunks[:] = [blob[i:i + 4096] for i in range(0, len(blob), 4096)]
    assert fetch() == blob
    read.clear()
    chunks[:] = [b"\0" * (1 << 20)] * (bound // (1 << 20) + 8)
    with pytest.raises(ValueError, match="larger than"):
        fetch()
    assert len(read) == bound // (1 << 20) + 1  # refused at the first chunk past the bound, the rest never read
    chunks[:] = ["text"]
    with pytest.raises(ValueError, match="without data"):
        fetch()


def _microbatches(cfg, n):
    """``n`` distinct (encoded input, labels) microbatches for the last stage of ``_last_stage_host``."""
    gen = torch.Generator().manual_seed(7)
    B, T, H = cfg.train.batch_size, cfg.data.seq_len, cfg.model.tiny_hidden
    return [(DenseCodec("bfloat16").encode(torch.randn(B, T, H, generator=gen)),
             torch.randint(0, 200, (B, T), generator=gen)) for _ in range(n)]


async def _feed(host, mbs, which):
    for m in which:
        await host.process(driver="d", step=0, mb=m, attempt=1, inputs=mbs[m][0], labels=mbs[m][1])
    assert await host.wait_idle(30.0)


@pytest.mark.parametrize("extra", [(), ("dp.enabled=true", "dp.v_correction=true")], ids=["plain", "v_correction"])
def test_a_graceful_stop_keeps_the_step_taken_so_far(tiny_cfg, cache_dir, extra):
    """A replica stopped with two of its step's three microbatches taken checkpoints them (their gradient, the
    step's sums and dp.v_correction's microbatch buffers); restarted from it, the third microbatch completes the
    step, and the weights and the step's loss are bit for bit those of the uninterrupted replica. Before, the
    stop's checkpoint held only the weights: the two microbatches the drivers had counted were lost. A joining
    peer's load of the same state takes no partial step (it was the stopped replica's)."""
    overrides = ("train.microbatches=3", *extra)
    cfg, whole, _, _, _ = _last_stage_host(tiny_cfg, cache_dir, *overrides)
    mbs = _microbatches(cfg, 3)
    start = {n: t.clone() for n, t in whole.worker.module.state_dict().items()}
    asyncio.run(_feed(whole, mbs, [0, 1, 2]))
    assert whole.opt_step == 1

    _, stopped, _, _, _ = _last_stage_host(tiny_cfg, cache_dir, *overrides)
    assert all(torch.equal(t, start[n]) for n, t in stopped.worker.module.state_dict().items())

    async def stop():
        await _feed(stopped, mbs, [0, 1])
        with pytest.raises(RuntimeError, match="after close"):
            await stopped.state_blob(partial=True)
        await stopped.close()
        return await stopped.state_blob(partial=True), await stopped.state_blob()

    blob, plain_blob = asyncio.run(stop())
    assert stopped.opt_step == 0 and stopped.pending_microbatches == 2

    _, restarted, _, _, _ = _last_stage_host(tiny_cfg, cache_dir, *overrides)
    assert restarted.load_state_blob(blob, partial=True) == 2 and restarted.pending_microbatches == 2
    asyncio.run(_feed(restarted, mbs, [2]))
    assert restarted.opt_step == 1 and restarted.last_loss == whole.last_loss
    after = whole.worker.module.state_dict()
    assert all(torch.equal(t, after[n]) for n, t in restarted.worker.module.state_dict().items())
    assert not any(torch.equal(t, start[n]) for n, t in after.items() if t.is_floating_point())  # it trained
    if whole.worker.noise is not None:  # the variance estimate of the step: all three microbatches' in both
        ema, ema2 = whole.worker.noise.ema_var, restarted.worker.noise.ema_var
        assert ema and set(ema) == set(ema2) and all(torch.equal(ema[n], ema2[n]) for n in ema)

    # without the partial step: the plain state, or the same blob read as a joining peer reads a peer's state
    for b in (plain_blob, blob):
        _, joined, mod, _, _ = _last_stage_host(tiny_cfg, cache_dir, *overrides)
        assert joined.load_state_blob(b) == 0 and joined.pending_microbatches == 0
        assert all(p.grad is None for p in mod.parameters())
        asyncio.run(_feed(joined, mbs, [2]))
        assert joined.opt_step == 0 and joined.pending_microbatches == 1  # the step waits for two more


def test_a_periodic_checkpoint_keeps_the_step_taken_so_far_when_the_replica_is_quiet(tiny_cfg, cache_dir):
    """A periodic checkpoint (the gate open, the replica serving on) holds the two microbatches of its step taken
    so far when nothing is in flight: restarted from it, the third completes the step bit for bit as without the
    crash. With a microbatch in flight for the whole wait it holds none (its gradient would be half-taken), and
    the replica's counters are untouched. Before, periodic checkpoints never held them: a crash lost up to M - 1
    microbatches the drivers had counted."""
    overrides = ("train.microbatches=3",)
    cfg, whole, _, _, _ = _last_stage_host(tiny_cfg, cache_dir, *overrides)
    mbs = _microbatches(cfg, 3)
    asyncio.run(_feed(whole, mbs, [0, 1, 2]))
    _, live, _, _, _ = _last_stage_host(tiny_cfg, cache_dir, *overrides)

    async def periodic():
        await _feed(live, mbs, [0, 1])
        quiet = await live.checkpoint_blob(5.0)
        async with live._cond:  # a microbatch in flight (as _enter counts one) for the whole wait
            live._active += 1
        busy = await live.checkpoint_blob(0.2)
        async with live._cond:
            live._active -= 1
            live._cond.notify_all()
        assert live.pending_microbatches == 2 and not live.gate_closed()
        await _feed(live, mbs, [2])  # the live replica goes on as if nothing had been taken
        return quiet, busy

    (blob, taken), (busy_blob, busy_taken) = asyncio.run(periodic())
    assert taken == 2 and busy_taken == 0
    assert live.opt_step == 1 and live.last_loss == whole.last_loss
    _, restarted, _, _, _ = _last_stage_host(tiny_cfg, cache_dir, *overrides)
    assert restarted.load_state_blob(blob, partial=True) == 2
    asyncio.run(_feed(restarted, mbs, [2]))
    assert restarted.opt_step == 1 and restarted.last_loss == whole.last_loss
    after = whole.worker.module.state_dict()
    assert all(torch.equal(t, after[n]) for n, t in restarted.worker.module.state_dict().items())
    _, other, _, _, _ = _last_stage_host(tiny_cfg, cache_dir, *overrides)
    assert other.load_state_blob(busy_blob, partial=True) == 0 and other.pending_microbatches == 0


def test_a_failed_background_round_lets_a_waiting_periodic_checkpoint_go_on(tiny_cfg, cache_dir):
    """A periodic checkpoint waits for the replica to be quiet with no DP round pending. When the pending round
    fails (the fast circuit goes on without it), the waiting checkpoint takes the step so far at once; before, no
    one woke it and it waited out its whole time, then saved without the partial step."""
    cfg, host, mod, _, _ = _last_stage_host(tiny_cfg, cache_dir, "train.microbatches=3")
    params = {n: p for n, p in mod.named_parameters() if n.endswith("o_proj.weight")}

    async def scenario():
        release, calls = asyncio.Event(), []
        dp = _dp(params, release, calls)

        async def failing(tensors, tag, paired=False, fingerprint=None):
            calls.append(tag)
            await release.wait()
            raise RuntimeError("the group fell apart")

        dp._average = failing
        dp.host, host.dp = host, dp
        await _feed(host, _microbatches(cfg, 2), [0, 1])
        await dp.after_step(2)  # due: the round runs in the background
        assert 0 in dp.pending
        saving = asyncio.create_task(host.checkpoint_blob(60.0))
        for _ in range(1000):  # until the checkpoint waits on the replica's condition
            if host._cond._waiters:
                break
            await asyncio.sleep(0)
        assert host._cond._waiters and not saving.done()
        release.set()
        blob, taken = await asyncio.wait_for(saving, 20.0)
        assert not dp.pending and not dp.ready and dp.syncs == 0 and calls
        return taken

    assert asyncio.run(scenario()) == 2


def test_a_checkpoints_partial_step_that_does_not_fit_is_dropped_whole(tiny_cfg, cache_dir, caplog):
    """A partial step with a non-finite or misshapen gradient, an unknown parameter, a count a step cannot hold,
    or one taken with dp.v_correction where this run has none: the weights load, no gradient and no count are
    taken from it (a warning says so); the worker refuses it with nothing changed."""
    import io

    from meshnode.stage import StageError

    cfg, host, _, _, _ = _last_stage_host(tiny_cfg, cache_dir, "train.microbatches=3", "dp.enabled=true",
                                          "dp.v_correction=true")
    mbs = _microbatches(cfg, 2)

    async def stop():
        await _feed(host, mbs, [0, 1])
        await host.close()
        return await host.state_blob(partial=True)

    blob = asyncio.run(stop())
    good = torch.load(io.BytesIO(blob), weights_only=True)
    name = next(iter(good["partial"]["grads"]))

    def spoiled(fn):
        state = torch.load(io.BytesIO(blob), weights_only=True)  # a copy of its own
        fn(state["partial"])
        buf = io.BytesIO()
        torch.save(state, buf)
        return buf.getvalue()

    bad = {
        "nan": lambda p: p["grads"][name].view(-1)[0].fill_(float("nan")),
        "shape": lambda p: p["grads"].__setitem__(name, p["grads"][name][:1]),
        "unknown": lambda p: p["grads"].__setitem__("nope.weight", p["grads"][name]),
        "count": lambda p: p.__setitem__("done", 3),
        "noise": lambda p: p["noise"]["prev"][name].view(-1)[0].fill_(float("inf")),
    }
    for what, fn in bad.items():
        _, fresh, mod, _, _ = _last_stage_host(tiny_cfg, cache_dir, "train.microbatches=3", "dp.enabled=true",
                                               "dp.v_correction=true")
        caplog.clear()
        assert fresh.load_state_blob(spoiled(fn), partial=True) == 0, what
        assert fresh.pending_microbatches == 0 and all(p.grad is None for p in mod.parameters()), what
        assert "partial step does not fit" in caplog.text, what
        assert all(torch.equal(t, good["weights"][n]) for n, t in mod.state_dict().items()), what
    _, other, mod, _, _ = _last_stage_host(tiny_cfg, cache_dir, "train.microbatches=3")  # no v_correction
    assert other.load_state_blob(spoiled(lambda p: None), partial=True) == 0
    with pytest.raises(ValueError, match="v_correction"):
        other.worker.load_partial_step(good["partial"])
    assert all(p.grad is None for p in mod.parameters())
    host.worker.in_flight[object()] = None
    with pytest.raises(StageError, match="in flight"):
        host.worker.partial_step()


def test_a_state_that_does_not_load_leaves_the_replica_as_it_was(tiny_cfg, cache_dir):
    """A peer's state blob or a damaged checkpoint: truncated, a counter that is no count, a non-finite optimizer
    moment, misshapen weights, or a state whose optimizer part fails to load after its weights did. Each is a
    ValueError, and the replica keeps its own weights, optimizer state, counters and the step it had taken so far
    (the last case is undone from a copy: before, the weights stayed half-loaded)."""
    import io

    cfg, donor, _, _, _ = _last_stage_host(tiny_cfg, cache_dir, "train.microbatches=2")
    mbs = _microbatches(cfg, 2)

    async def step_once(host):
        await _feed(host, mbs, [0, 1])

    asyncio.run(step_once(donor))
    assert donor.opt_step == 1
    blob = donor._state_blob()

    def spoiled(fn):
        state = torch.load(io.BytesIO(blob), weights_only=True)
        fn(state)
        buf = io.BytesIO()
        torch.save(state, buf)
        return buf.getvalue()

    def moment(state):
        return next(iter(state["optimizer"]["adamw"]["state"].values()))["exp_avg"]

    assert torch.is_tensor(moment(torch.load(io.BytesIO(blob), weights_only=True)))
    weight = next(iter(torch.load(io.BytesIO(blob), weights_only=True)["weights"]))
    bad = {
        "truncated": (blob[: len(blob) // 2], "not a stage state"),
        "step": (spoiled(lambda s: s.__setitem__("opt_step", -3)), "opt_step is -3, not a count"),
        "nan moment": (spoiled(lambda s: moment(s).view(-1)[0].fill_(float("nan"))),
                       "optimizer state holds non-finite"),
        "shape": (spoiled(lambda s: s["weights"].__setitem__(weight, s["weights"][weight][:1])), "wrong shape"),
        # the weights and AdamW's moments load before the missing step counter is found: undone
        "half-way": (spoiled(lambda s: s["optimizer"].pop("fast_step")), "this replica's own state is kept"),
    }
    _, host, mod, _, _ = _last_stage_host(tiny_cfg, cache_dir, "train.microbatches=2")
    asyncio.run(_feed(host, mbs[:1], [0]))  # one of its step's two microbatches taken
    weights = {k: v.clone() for k, v in mod.state_dict().items()}
    grads = {n: p.grad.clone() for n, p in mod.named_parameters()}
    assert any(not torch.equal(weights[k], v) for k, v in donor.worker.module.state_dict().items())
    for what, (b, needle) in bad.items():
        with pytest.raises(ValueError, match=needle):
            host.load_state_blob(b)
        assert all(torch.equal(v, weights[k]) for k, v in mod.state_dict().items()), what
        assert all(torch.equal(p.grad, grads[n]) for n, p in mod.named_parameters()), what
        assert host.opt_step == 0 and host.pending_microbatches == 1 and not host.worker.optimizer.adamw.state, what
    assert host.load_state_blob(blob) == 0 and host.opt_step == 1  # the donor's own state still loads
    assert all(torch.equal(v, donor.worker.module.state_dict()[k]) for k, v in mod.state_dict().items())
