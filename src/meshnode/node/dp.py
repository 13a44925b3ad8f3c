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
or one that finds no partner within the matchmaking window (``dp.matchmaking_time``), uses its own
factors: a group of one, exactly what the mesh does with one replica.

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
  With ``dp.clock = "driver"`` the inner steps are counted on the newest driver step the peer knows
  instead (the microbatches it serves carry it; drivers read each other's records), a clock the
  replicas share, so that they reach each sync together (:func:`~meshnode.optim.fragments_due_by_clock`).

Bytes on the ``dp`` axis: what the butterfly all-reduce sends per round, ``2 (g-1)/g`` times the
buffer for a group of g peers.

The DP log (``anchor.snapshot = "dp"``): each outer step this peer applies is kept as what the sync's
two averages leave behind (the orthonormalised averaged P and the averaged Q of each compressed tensor,
the average of the others; bf16, which has fp32's range, so small factors do not underflow as in
fp16), numbered 1, 2, ... in the order applied, the last :func:`log_length` of them, under a random
``epoch`` that names this log. The anchor (:class:`DPFollower`) replays them on its own copy of the
start weights instead of fetching every stage's weights each cycle: both began from the same
pretrained weights, and the outer step is a function of the averaged update alone, so the anchor holds
this peer's global weights (to bf16 rounding of each update) for about one replica's share of each
sync. A follower that cannot continue the log (it is new to this peer, the peer restarted or loaded its
state, or the entries it needs were dropped) first loads the peer's outer state (start weights and
momentum, bf16) once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..compression import PowerSGDState, compressed_rank, orthonormalize_all, powersgd_decode
from ..optim import OuterNesterov, fragments, fragments_due, fragments_due_by_clock, sync_schedule
from ..protocol import keys

logger = logging.getLogger(__name__)

DP_LOG_ENTRIES = 16  # the least number of outer steps a fast peer keeps for the anchor (anchor.snapshot = "dp")
LOG_DTYPE = torch.bfloat16


def log_length(cfg) -> int:
    """Entries a fast peer keeps: three anchor cycles' worth of syncs (``period * fragments / H`` per cycle), at
    least ``DP_LOG_ENTRIES``, so a late cycle still finds every entry it needs."""
    per_cycle = -(-cfg.anchor.period * max(1, cfg.dp.fragments) // max(1, cfg.dp.inner_steps))
    return max(DP_LOG_ENTRIES, 3 * per_cycle + 2)


@dataclass(frozen=True, slots=True)
class DPLogEntry:
    """One applied outer step, enough to redo it (:func:`powersgd_decode`)."""

    seq: int
    fragment: int
    p: dict[str, torch.Tensor]  # bf16; orthonormalised averaged P (compressed tensors), the average (others)
    q: dict[str, torch.Tensor]  # bf16; the averaged Q of the compressed tensors

    def tensors(self) -> dict[str, torch.Tensor]:
        return {**{f"p/{n}": t for n, t in self.p.items()}, **{f"q/{n}": t for n, t in self.q.items()}}


@torch.no_grad()
def fingerprint(start: dict[str, torch.Tensor], names: list[str]) -> list[float]:
    """Per tensor of ``names``: the sum of 64 evenly spaced entries of ``start``, and of their absolute values. Equal
    starts give equal sums on any hardware to ~1e-7; one outer step apart (a sync one replica made alone: a
    low-rank update of ~1e-4 per entry per inner step) they differ by ~1e-3. One host sync."""
    sums = []
    for n in names:
        flat = start[n].reshape(-1)
        sample = flat[:: max(1, flat.numel() // 64)][:64].double()
        sums += [sample.sum(), sample.abs().sum()]
    return [float(x) for x in torch.stack(sums).cpu().tolist()] if sums else []


def same_fingerprint(fp: list, ref: list[float]) -> bool:
    """``fp`` matches ``ref`` within 1e-5 of each tensor's sampled absolute sum (entries that are not floats:
    no match)."""
    if len(fp) != len(ref):
        return False
    for i in range(0, len(ref), 2):
        tol = 1e-5 * max(ref[i + 1], 1e-12)
        if not all(isinstance(fp[j], float) and abs(fp[j] - ref[j]) <= tol for j in (i, i + 1)):
            return False
    return True


RECHECK_TIMEOUT_S = 5.0  # the full read of the records before a sync made alone waits this long at most


class SwarmDP:
    def __init__(self, host, dht, run_id: str, counter, partners: Callable[[], int] = lambda: 1,
                 matchmaking_time: float | None = None, round_timeout: float | None = None,
                 clock: Callable[[], int] | None = None,
                 fetch_outer: Callable[[str, list[str]], Awaitable[dict[str, torch.Tensor]]] | None = None,
                 recheck: Callable[[], Awaitable[Any]] | None = None):
        from hivemind.averaging import DecentralizedAverager

        cfg = host.cfg.dp
        self.host = host
        self.counter = counter
        self.partners = partners
        self.recheck = recheck  # re-reads the swarm's records before a sync made alone (see _rounds)
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
        self.matchmaking_time = cfg.matchmaking_time if matchmaking_time is None else matchmaking_time
        self.overlap = cfg.overlap
        self.keep_residual = cfg.keep_residual  # after a sync, stand at start - own residual (PowerSGDState)
        # dp.clock = "driver" (overlap only): syncs counted on the newest driver step this peer knows
        self.clock = clock if cfg.clock == "driver" and cfg.overlap else None
        self._periods: list[int] = []  # the clock period each fragment last synced in
        self.pending: dict[int, asyncio.Task] = {}  # fragment -> background rounds (overlap)
        self.ready: list[tuple[int, dict, dict, tuple]] = []  # (fragment, averaged update, weight snapshot, phases)
        self.skipped = 0
        self.abandoned = 0  # syncs that found no group although partners exist (nothing applied)
        self.fetch_outer = fetch_outer  # (peer id, names) -> its outer state of those (start/<n>, velocity/<n>), f32
        self.realigned = 0  # fragments whose start this peer took from a partner (the starts had drifted apart)
        self._gathered: dict[str, Any] = {}  # peer id -> what it gathered in the last round (real averager only)
        self._round_lock = asyncio.Lock()
        self.syncs = 0
        self.rounds = 0
        self.group_sizes: list[int] = []
        anchor = host.cfg.anchor
        self.keep_log = anchor.enabled and anchor.snapshot == "dp"
        self.log: deque[DPLogEntry] = deque(maxlen=log_length(host.cfg))
        self.log_seq = 0  # outer steps applied (the last entry's number)
        self.log_epoch = secrets.token_hex(8)
        self.log_base = "pretrained"  # "loaded" once the state came from a checkpoint or a peer
        self.averager = DecentralizedAverager(
            [self.buffer], dht, start=True, prefix=keys.dp_prefix(run_id, host.stage), min_group_size=2,
            target_group_size=max(2, cfg.replicas), min_matchmaking_time=self.matchmaking_time, request_timeout=2.0,
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
        if self.clock is not None:
            due = fragments_due_by_clock(int(self.clock()), self.H, self.offsets, self._periods)
        else:
            due = fragments_due(opt_step, self.H, self.offsets)
        for f in due:
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
        done = await self._rounds(f, pseudo)
        if done is None:
            return
        out, g, phases = done
        await host.run(self._apply, out)
        self._record(f, phases)
        self._count(f, g)

    async def _rounds(self, f: int, pseudo: dict) -> tuple[dict, int, tuple[dict, dict]] | None:
        """PowerSGD phase P, all-reduce, phase Q, all-reduce, finish: the averaged update, the group size and the
        two averaged phases (what :func:`powersgd_decode` needs to redo the update); None when the sync is
        abandoned.

        Abandoned: the rounds did not average with a group although this peer has partners (none joined the P
        round in time, or the Q round did not meet the P round's group). The outer step moves the start weights,
        and the replicas of a stage stay one model only while they move them together: applying this peer's own
        update would put its start where no partner's is, and every later average (of pseudo-gradients from
        those different starts) would keep the difference for good. So nothing changes: no outer step, the
        error feedback as before the round, and the progress carries over to the next sync (whose
        pseudo-gradient, from the same start, holds it). A peer with no partner at all syncs alone, as the
        mesh does with one replica (and the anchor can follow it through the DP log)."""
        host = self.host
        if self.partners() < 1 and self.recheck is not None:
            # syncing alone moves this peer's start where no partner's is (healed only when a later P round pairs
            # and compares fingerprints): first make sure with a fresh read of every holder's records. A
            # first-holder copy can lack a partner that is there; in a tiny overlapped demo one driver saw none
            # for its whole run (5 s, under one full-read period) and synced alone 6 times while its partner
            # waited for it in every round
            try:
                await asyncio.wait_for(self.recheck(), RECHECK_TIMEOUT_S)
            except Exception as exc:
                logger.info("DP fragment %d: re-reading the records before a sync alone failed: %r", f, exc)
        p = await host.run(self.psgd.phase_p, pseudo)
        mine = await host.run(self._fingerprint, f)
        self._gathered = {}
        p_avg, p_group = await self._average(p, ("p", f), fingerprint=mine)
        found = self._start_leader(mine, p_group)
        if found is not None:  # the group's starts differ: this sync's average means nothing
            leader, agree = found
            if agree:
                why = f"the group's start weights differ; this peer's is the one taken (that of {leader[-8:]})"
            elif await self._realign(f, leader, self._gathered[leader]):
                why = f"the group's start weights differ; took {leader[-8:]}'s"
            else:
                why = f"the group's start weights differ; {leader[-8:]}'s could not be taken"
            return self._abandon(f, why)
        if len(p_group) < 2:
            # Q is this peer's pseudo-gradient projected on its P: averaging it with anyone is only meaningful
            # when the P it was projected on is the same (the group's average). A P round without partners
            # makes the whole sync local, and keeps this peer out of matchmaking, where its Q round would
            # meet a late partner's P round (hivemind tells the two phases apart only by the tag we gather).
            if self.partners() >= 1:
                return self._abandon(f, "no partner joined the P round")
            q = await host.run(self.psgd.phase_q, p_avg)
            q_avg, q_group = q, p_group
        else:
            q = await host.run(self.psgd.phase_q, p_avg)
            # the P group's members are there: no look at the swarm snapshot, whose records may lag
            q_avg, q_group = await self._average(q, ("q", f), paired=True)
            if q_group != p_group:  # no Q average, or one of other peers (possible with 3+ replicas)
                return self._abandon(f, "the Q round " + ("found no partner" if not q_group else
                                                          "met other peers than the P round"))
        out = await host.run(self.psgd.finish, q_avg)
        return out, max(1, min(len(p_group), len(q_group))), (p_avg, q_avg)

    @property
    def me(self) -> str:
        return str(self.averager.peer_id)

    def _fingerprint(self, f: int) -> list[float]:
        return fingerprint(self.outer.start, self.frags[f])

    def _start_leader(self, mine: list[float], group: frozenset[str]) -> tuple[str, bool] | None:
        """None when every member of the P round gathered this peer's fingerprint (a member that sent none, an
        older peer, is not compared). Otherwise ``(leader, agree)``: the start the group takes is the one most
        members hold (a tie goes to the one held by the smallest peer id), the leader the smallest peer id
        holding it; ``agree`` when this peer holds it too (it takes nothing)."""
        if len(group) < 2 or not self._gathered:
            return None
        fps = {p: fp for p, fp in self._gathered.items() if isinstance(fp, list) and len(fp) == len(mine)}
        fps[self.me] = mine
        if all(same_fingerprint(fp, mine) for fp in fps.values()):
            return None
        clusters: list[list[str]] = []
        for peer in sorted(fps):
            for c in clusters:
                if same_fingerprint(fps[peer], fps[c[0]]):
                    c.append(peer)
                    break
            else:
                clusters.append([peer])
        best = max(clusters, key=len)  # the first of the largest: the one with the smallest peer id
        return best[0], self.me in best

    async def _realign(self, f: int, leader: str, expected: list[float]) -> bool:
        """Take fragment ``f``'s start weights and outer velocity from ``leader`` (this peer's current weights stay:
        the next pseudo-gradient, from the common start, holds the difference, and the next average closes it).
        The start taken must have the fingerprint the leader gathered."""
        if self.fetch_outer is None:
            logger.warning("DP fragment %d: start weights differ from %s's and this peer cannot fetch them", f,
                           leader[-8:])
            return False
        names = self.frags[f]
        try:
            state = await self.fetch_outer(leader, names)
        except Exception as exc:
            logger.warning("DP fragment %d: could not take %s's start weights: %r", f, leader[-8:], exc)
            return False
        got = {n: (state.get(f"start/{n}"), state.get(f"velocity/{n}")) for n in names}

        def fits(t: torch.Tensor | None, n: str) -> bool:
            return t is not None and t.shape == self.params[n].shape and bool(torch.isfinite(t).all())

        bad = [n for n, (st, vel) in got.items() if not fits(st, n) or (vel is not None and not fits(vel, n))]
        if bad:
            logger.warning("DP fragment %d: %s's outer state lacks or mangles %d tensors (%s); not taken", f,
                           leader[-8:], len(bad), bad[0])
            return False
        if not same_fingerprint(fingerprint({n: st for n, (st, _) in got.items()}, names), expected):
            logger.warning("DP fragment %d: the start fetched from %s is not the one it gathered; not taken", f,
                           leader[-8:])
            return False
        await self.host.run(self._take_start, got)
        self.realigned += 1
        self._restart_log()
        logger.warning("DP fragment %d: start weights differed from the group's; took %s's", f, leader[-8:])
        return True

    @torch.no_grad()
    def _take_start(self, got: dict[str, tuple[torch.Tensor, torch.Tensor | None]]) -> None:
        """The leader's start and velocity, exactly: a tensor without velocity there (no outer step yet) has
        none here either, so both peers' next outer steps are the same."""
        for n, (st, vel) in got.items():
            self.outer.start[n].copy_(st)
            if vel is None:
                self.outer.velocity.pop(n, None)
            else:
                self.outer.velocity[n] = vel.to(self.outer.start[n].device, torch.float32, copy=True)

    def _abandon(self, f: int, why: str) -> None:
        self.psgd.abandon()
        self.abandoned += 1
        logger.info("DP sync of fragment %d at step %d abandoned: %s; start kept, the progress carries over",
                    f, self.host.opt_step, why)
        return None

    def _record(self, f: int, phases: tuple[dict, dict]) -> None:
        """Number the outer step just applied and, when the anchor follows DP, keep its phases."""
        self.log_seq += 1
        if self.keep_log:
            p_avg, q_avg = phases
            p_hat = orthonormalize_all({n: t for n, t in p_avg.items() if n in q_avg})
            p = {n: p_hat.get(n, t).detach().to(LOG_DTYPE, copy=True) for n, t in p_avg.items()}
            q = {n: t.detach().to(LOG_DTYPE, copy=True) for n, t in q_avg.items()}
            self.log.append(DPLogEntry(self.log_seq, f, p, q))

    def log_since(self, since: int, epoch: str | None) -> list[DPLogEntry] | None:
        """The outer steps after ``since`` of the log ``epoch``, or None when they cannot be replayed (a gap).

        ``epoch = None`` asks from the pretrained weights: only a peer that started from them and still holds
        its first entry can answer."""
        if epoch is None:
            ok = since == 0 and self.log_base == "pretrained" and (self.log_seq == 0 or (
                bool(self.log) and self.log[0].seq == 1))
        else:
            ok = epoch == self.log_epoch and 0 <= since <= self.log_seq and (
                since == self.log_seq or (bool(self.log) and self.log[0].seq <= since + 1))
        return [e for e in self.log if e.seq > since] if ok and self.keep_log else None

    def _count(self, f: int, group: int) -> None:
        self.syncs += 1
        self.group_sizes.append(group)
        logger.info("DP sync %d (fragment %d) at step %d: group of %d", self.syncs, f, self.host.opt_step, group)
        # dp.v_correction corrects each replica's second moment to the batch of the group its updates are averaged
        # with: the mesh's is always dp.replicas; here it is the group the last sync met (until the first sync, the
        # dp.replicas the peer expects). A peer that synced alone is not averaged with anyone: no correction.
        noise = self.host.worker.noise
        if noise is not None and noise.replicas != group:
            logger.info("dp.v_correction: second moment now corrected to a group of %d (was %d)", group,
                        noise.replicas)
            noise.replicas = group

    async def _background(self, f: int, due_step: int, names: list[str], pseudo: dict, snapshot: dict) -> None:
        try:
            async with self._round_lock:  # one averager buffer: rounds of different fragments take turns
                done = await self._rounds(f, pseudo)
            if done is not None:
                out, g, phases = done
                self.ready.append((f, out, snapshot, phases))
                self._count(f, g)
        except Exception as exc:  # the fast circuit goes on; this fragment simply skipped a sync
            logger.warning("DP background sync of fragment %d failed: %r", f, exc)
        finally:
            self.pending.pop(f, None)
        # applied at the next step boundary, or now if the replica is idle: after a run's last step no boundary
        # comes, and the last sync's average would never reach the weights
        run_if_idle = getattr(self.host, "run_if_idle", None)
        if self.ready and run_if_idle is not None:
            try:
                await run_if_idle(self.apply_ready)
            except Exception as exc:
                logger.warning("DP: applying a finished sync while idle failed: %r", exc)
        # whoever waits for no round pending (a periodic checkpoint) looks again, also when the round failed
        wake = getattr(self.host, "wake", None)
        if wake is not None:
            await wake()

    async def apply_ready(self) -> None:
        """Apply finished background syncs (call with the gate closed: no live autograd graph)."""
        while self.ready:
            f, out, snapshot, phases = self.ready.pop(0)
            await self.host.run(self._apply_keep_progress, out, snapshot)
            self._record(f, phases)

    def _snapshot(self, names: list[str]) -> dict[str, torch.Tensor]:
        return {n: self.params[n].detach().to(torch.float32, copy=True) for n in names}

    @torch.no_grad()
    def _apply_keep_progress(self, avg: dict, snapshot: dict) -> None:
        progress = {n: self.params[n].detach().float() - snapshot[n] for n in avg}
        self._apply(avg)
        for n, d in progress.items():
            self.params[n].add_(d.to(self.params[n].dtype))

    @torch.no_grad()
    def _apply(self, avg) -> None:
        self.outer.apply(avg, self.params)
        if self.keep_residual:
            self.psgd.keep_residual(self.params, avg)

    async def _average(self, tensors: dict[str, torch.Tensor], tag: tuple, paired: bool = False,
                       fingerprint: list[float] | None = None) -> tuple[dict[str, torch.Tensor], frozenset[str]]:
        """All-reduce (mean) ``tensors`` with the stage's group: the averaged values and the group's peer ids;
        own values and an empty group when alone or on failure. Unless ``paired`` (partners known to be there),
        a peer that sees no other replica of its stage does not look for a group. ``fingerprint`` (of the start
        weights) is gathered with the tag; what each member gathered is kept in ``_gathered``."""
        if not paired and self.partners() < 1:
            return tensors, frozenset()
        order = sorted(tensors)
        flat = torch.cat([tensors[n].reshape(-1).float() for n in order])
        with self.averager.get_tensors() as buf:
            buf[0].zero_()
            buf[0][: flat.numel()].copy_(flat)
        try:
            gather = [*tag, fingerprint] if fingerprint is not None else list(tag)
            group = await asyncio.to_thread(self.averager.step, gather=gather, timeout=self.round_timeout)
        except Exception as exc:
            logger.info("DP round %s failed: %r; keeping own values", tag, exc)
            group = None
        self.rounds += 1
        if not group:
            return tensors, frozenset()
        if any(not isinstance(v, (list, tuple)) or list(v)[: len(tag)] != list(tag) for v in group.values()):
            logger.warning("DP round %s: partners were in another phase; keeping own values", tag)
            return tensors, frozenset()
        self._gathered = {str(peer): list(v)[len(tag)] if len(v) > len(tag) else None for peer, v in group.items()}
        with self.averager.get_tensors() as buf:
            out_flat = buf[0][: flat.numel()].clone()
        g = len(group)
        self.counter.add("dp", int(2 * (g - 1) / g * self.buffer.numel() * 4))
        out, off = {}, 0
        for n in order:
            k = tensors[n].numel()
            out[n] = out_flat[off : off + k].reshape(tensors[n].shape)
            off += k
        return out, frozenset(str(peer) for peer in group)

    def state_dict(self) -> dict:
        return {"outer": self.outer.state_dict(), "psgd": self.psgd.state_dict(), "syncs": self.syncs}

    def load_state_dict(self, state: dict) -> None:
        self.outer.load_state_dict(state["outer"])
        self.psgd.load_state_dict(state["psgd"])
        self.syncs = int(state["syncs"])
        self._restart_log()

    def restart_from_weights(self) -> None:
        """The live weights were replaced without a DP state (an anchor's copy): they are the start weights now,
        with no outer velocity and no PowerSGD error feedback."""
        cfg = self.host.cfg.dp
        self.outer = OuterNesterov(self.params, lr=cfg.outer_lr, momentum=cfg.outer_momentum)
        self.psgd = PowerSGDState(cfg.rank, quantize=cfg.quantize)
        self._restart_log()

    def _restart_log(self) -> None:
        """The start weights came from elsewhere (a checkpoint, a peer's state, a partner's outer state): the log's
        entries no longer lead to them, so a new log that followers cannot reach from the pretrained weights (they
        reload the outer state)."""
        self.log.clear()
        self.log_base = "loaded"
        self.log_epoch = secrets.token_hex(8)

    def shutdown(self) -> None:
        for task in self.pending.values():
            task.cancel()
        with contextlib.suppress(Exception):
            self.averager.shutdown()


class DPFollower:
    """One stage's global (outer) weights, kept by replaying a fast peer's DP log (``anchor.snapshot = "dp"``).

    ``params`` are the follower's own live parameters (the anchor's stage module, loaded with the pretrained
    weights); they always hold the start weights. Entries must come in order and belong to the log
    (``epoch``) being followed; anything else (a gap, an unknown tensor, a wrong shape, a non-finite value)
    raises ValueError before any weight changes.
    """

    def __init__(self, params: dict[str, torch.Tensor], *, lr: float, momentum: float, rank: int):
        self.params = params
        self.rank = rank
        self.outer = OuterNesterov(params, lr=lr, momentum=momentum)
        self.source: str | None = None
        self.epoch: str | None = None  # None: the pretrained weights, no log followed yet
        self.seq = 0
        self.replayed = 0  # outer steps replayed in total
        self.loads = 0  # outer states loaded in full

    @property
    def _fresh(self) -> bool:  # still at the pretrained weights: no log followed, no state loaded
        return self.epoch is None and self.loads == 0

    def since(self, source: str) -> tuple[int, str | None] | None:
        """What to ask ``source`` for: the next entries of the followed log, ``(0, None)`` (from the pretrained
        weights) when nothing was followed yet, or None when ``source``'s outer state must be loaded first (a
        different peer's log cannot continue ours)."""
        if self._fresh:
            return 0, None
        return (self.seq, self.epoch) if source == self.source else None

    def _decode(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        p = {k[2:]: v for k, v in tensors.items() if k.startswith("p/")}
        q = {k[2:]: v for k, v in tensors.items() if k.startswith("q/")}
        if len(p) + len(q) != len(tensors) or not p:
            raise ValueError("DP log entry: unexpected tensor names")
        unknown = [n for n in p if n not in self.params]
        if unknown:
            raise ValueError(f"DP log entry names tensors this stage does not have: {unknown[:3]}")
        if any(not t.is_floating_point() or not bool(torch.isfinite(t).all()) for t in tensors.values()):
            raise ValueError("DP log entry holds non-float or non-finite values")
        # every factor's shape is checked against this stage's parameter and dp.rank before any arithmetic
        avg = powersgd_decode(p, q, {n: tuple(self.params[n].shape) for n in p}, self.rank)
        if any(not bool(torch.isfinite(t).all()) for t in avg.values()):
            raise ValueError("DP log entry decodes to non-finite values")
        return avg

    @torch.no_grad()
    def replay(self, source: str, epoch: str, entries: list[tuple[int, dict[str, torch.Tensor]]]) -> int:
        """Apply ``(seq, tensors)`` entries of ``source``'s log ``epoch``; every entry is checked first."""
        expect = self.seq if self._fresh or (source == self.source and epoch == self.epoch) else None
        avgs = []
        for seq, tensors in entries:
            if expect is None or seq != expect + 1:
                raise ValueError(f"DP log: entry {seq} does not follow {expect} of the followed log")
            avgs.append(self._decode(tensors))
            expect = seq
        for avg in avgs:
            self.outer.apply(avg, self.params)
        self.source, self.epoch = source, epoch
        if entries:
            self.seq = entries[-1][0]
        self.replayed += len(entries)
        return len(entries)

    @torch.no_grad()
    def load(self, source: str, epoch: str, seq: int, tensors: dict[str, torch.Tensor]) -> None:
        """Take ``source``'s outer state (``start/<name>`` and ``velocity/<name>``) as the point to follow from."""
        start = {k[6:]: v for k, v in tensors.items() if k.startswith("start/")}
        velocity = {k[9:]: v for k, v in tensors.items() if k.startswith("velocity/")}
        if set(start) != set(self.params) or not set(velocity) <= set(start):
            raise ValueError("outer state: start weights missing or unknown tensors")
        for n, t in [*start.items(), *velocity.items()]:
            if tuple(t.shape) != tuple(self.params[n].shape) or not bool(torch.isfinite(t).all()):
                raise ValueError(f"outer state {n!r}: wrong shape or non-finite values")
        self.outer.start = {n: t.to(torch.float32, copy=True) for n, t in start.items()}
        self.outer.velocity = {n: t.to(torch.float32, copy=True) for n, t in velocity.items()}
        for n, p in self.params.items():
            p.copy_(self.outer.start[n].to(p.dtype))
        self.source, self.epoch, self.seq = source, epoch, int(seq)
        self.loads += 1


__all__ = ["DP_LOG_ENTRIES", "DPFollower", "DPLogEntry", "SwarmDP", "log_length"]
