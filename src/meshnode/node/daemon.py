"""``meshnode join``: the peer daemon.

Life of a peer (docs/swarm.md):

1. start the DHT (the run's schema validators + RSA signatures with this peer's identity key) and
   replicate its P2P; read ``{run}_peers``;
2. choose a stage (:func:`.claim.choose_stage`, or the stage of its own checkpoint, or ``--stage``),
   announce ``joining``, load only that stage's layers;
3. load the stage's current weights and optimizer state from an online peer of the stage (mid-run
   join), else its own checkpoint (restart), else start from the pretrained weights;
4. serve ``{run}.rpc_*``, announce ``online`` (re-announced before expiry, with throughput, steps,
   loss, bytes per axis); a stage-0 peer is a *driver*: it reads its data shard and pushes
   microbatches down the pipeline, one optimizer step at a time;
5. fast peers poll ``{run}_prior_{stage}`` for anchor priors (:mod:`.priors`) and run DP rounds
   with the other peers of their stage (:mod:`.dp`);
6. on SIGINT / SIGTERM: announce ``offline``, stop taking new steps, let in-flight chains finish
   (bounded), save a checkpoint, stop the DHT and its daemon (with ``--checkpoint-every`` a checkpoint is
   also saved periodically while the stage trains, for a restart after a crash);
7. rebalancing (``--rebalance-after``, on by default for a peer whose stage was chosen for it): when a
   stage has had no fast peer, or (by the capacities peers announce) a move of this peer would raise the
   slowest stage's rate by :data:`.claim.GAIN`, for that long and this peer is the one
   :func:`.claim.should_rebalance` names, it leaves its stage as in 6 (no checkpoint) and joins the thin
   one as in 2-4 (an empty stage from an allowed anchor's copy when there is one), in the same process:
   a stage whose last peer died no longer stalls the pipeline until somebody new joins.

The anchor role is :mod:`.anchor`.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import logging
import math
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..compression import ByteCounter
from ..config import RunConfig, check_model_width
from ..protocol import keys
from ..protocol.limits import Limits
from ..protocol.messages import pack
from ..protocol.records import PeerRecord
from ..protocol.servicer import RPCServicer, StageServicer, collect_stream
from ..stage.moves import move_size
from ..stage.reference import follower_stages
from .claim import choose_shard, choose_stage, fixed_routes, in_transit, should_rebalance, stage_loads, stage_rates
from .host import StageHost, pieces_bytes, state_bytes_bound, state_chunk_bytes, weights_from_chunks
from .status import driver_step, swarm_health
from .swarm import ChainError, SwarmClient, SwarmError, start_dht

logger = logging.getLogger(__name__)

CHECKPOINT_NAME = "stage{stage}.pt"
# a periodic checkpoint waits up to this long for a moment with nothing in flight, to hold the step taken so far
PERIODIC_IDLE_WAIT = 10.0


@dataclass(kw_only=True)
class JoinOptions:
    """Flags of ``meshnode join`` (the run config is separate)."""

    initial_peers: list[str] = field(default_factory=list)
    host_maddrs: list[str] = field(default_factory=lambda: ["/ip4/127.0.0.1/tcp/0"])
    stage: int | None = None  # None = auto
    role: str = "fast"  # fast | driver | anchor
    device: str = "cpu"
    identity: Path | None = None
    checkpoint_dir: Path | None = None
    # with checkpoint_dir: also save the stage's state every this many seconds (when it has stepped since), so that
    # a peer that crashes and restarts loses at most that much of its stage's training; None: only at a stop
    checkpoint_every: float | None = None
    cache_dir: Path | None = None
    metrics_out: Path | None = None
    trace_out: Path | None = None  # per-microbatch timing records (JSON lines), for the throughput benchmark
    ready_file: Path | None = None
    announce_period: float = 3.0
    refresh_period: float = 1.0
    prior_period: float = 2.0
    threads: int = 1
    slowdown: float = 1.0  # emulate hardware this many times slower (tests and benchmarks of mixed swarms)
    shutdown_grace: float = 30.0
    # move to a stage that has had no fast peer for this many seconds (when claim.should_rebalance names this
    # peer); None: never (the CLI's default: 30 s for a peer whose stage was chosen for it, never for --stage N)
    rebalance_after: float | None = None


class SwarmNode:
    """One peer of the swarm: a stage replica (fast / driver) or the anchor pipeline."""

    def __init__(self, cfg: RunConfig, opts: JoinOptions):
        self.cfg = cfg
        self.opts = opts
        self.run_id = cfg.run_id
        self.num_stages = cfg.model.stages
        self.identity = keys.load_or_create_identity(opts.identity)
        self.stopping = asyncio.Event()
        self.state = "joining"  # what the record says (the announce loop repeats it)
        self.leaving = asyncio.Event()  # leave the current stage: stopping, or moving to another (rebalance)
        self.move_to: int | None = None
        self._starved: tuple[int, float] | None = None  # (the stage should_rebalance names, since when)
        self.moves = 0
        self._ckpt_lock = threading.Lock()  # checkpoint writes (threads): the newest step's state wins
        self._ckpt_step: dict[int, tuple[int, int]] = {}  # stage -> (optimizer step, save number) written last
        self._ckpt_seq = 0
        self.stage_costs: list[float] | None = None  # FLOPs per token of each stage (from the model, once loaded)
        self._served_driver_step = 0  # the newest driver step the stages this peer left had served
        self.counter = ByteCounter()
        self.swarm: SwarmClient | None = None
        self.host: StageHost | None = None
        self.servicer: RPCServicer | None = None
        self.record: PeerRecord | None = None
        self.tasks: list[asyncio.Task] = []  # the peer's (metrics)
        self.stage_tasks: list[asyncio.Task] = []  # the current stage's (announce, refresh, priors)
        self.stage = -1
        self.role = opts.role
        self.driver_step = 0
        self.driver_tokens = 0
        self.shard: int | None = None  # a driver's data shard (of dp.replicas), announced in its record
        # fixed routes (DP with a moving reference): every peer's replica chain, announced as its shard
        self.routes = fixed_routes(cfg)
        self.replicas = cfg.dp.replicas if cfg.dp.enabled or cfg.dp.replicas > 1 else 1
        self._chain_warned: int | None = None
        self._ckpt_chain: int | None = None  # the chain the checkpoint this peer starts from was written in
        self.last_loss: float | None = None
        self.prior_step: int | None = None
        self.metrics = None
        self.trace_file = None

    # ---- entry -----------------------------------------------------------------------------

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self._on_signal, sig)
        if self.opts.threads:
            torch.set_num_threads(self.opts.threads)
        identity_path = None
        if self.opts.identity is not None:
            identity_path = str(self.opts.identity) + ".p2p"
            if not Path(identity_path).exists():
                from hivemind.p2p import P2P

                P2P.generate_identity(identity_path)
        dht = await asyncio.to_thread(
            start_dht, self.run_id, self.num_stages, initial_peers=self.opts.initial_peers,
            host_maddrs=self.opts.host_maddrs, identity=self.identity, identity_path=identity_path,
        )
        self.swarm = SwarmClient(dht, self.run_id, self.identity)
        if self.opts.metrics_out is not None:
            self.metrics = open(self.opts.metrics_out, "a")  # noqa: SIM115 (closed in _cleanup)
            self.tasks.append(asyncio.create_task(self._metrics_loop()))
        try:
            await self.swarm.start()
            await self.swarm.refresh()
            if self.role == "anchor":
                from .anchor import AnchorRunner

                await AnchorRunner(self).run()
            else:
                await self._run_stage()
        finally:
            await self._cleanup()

    def _on_signal(self, sig: int) -> None:
        logger.info("received %s: shutting down", signal.Signals(sig).name)
        self.stopping.set()
        self.leaving.set()

    async def _cleanup(self) -> None:
        await _cancel(self.tasks)
        await self._leave_stage()
        if self.swarm is not None:
            await self.swarm.shutdown()
        for f in (self.metrics, self.trace_file):
            if f is not None:
                f.close()

    # ---- a stage replica -------------------------------------------------------------------

    def _checkpoint_of(self, stage: int) -> Path | None:
        if self.opts.checkpoint_dir is None:
            return None
        path = Path(self.opts.checkpoint_dir) / CHECKPOINT_NAME.format(stage=stage)
        return path if path.is_file() else None

    def _pick_stage(self, move_to: int | None = None) -> tuple[int, Path | None]:
        if move_to is not None:
            return move_to, self._checkpoint_of(move_to)
        if self.role == "driver":
            return 0, self._checkpoint_of(0)
        if self.opts.stage is not None:
            if not 0 <= self.opts.stage < self.num_stages:
                raise SwarmError(f"--stage {self.opts.stage}: the run has stages 0..{self.num_stages - 1}")
            return self.opts.stage, self._checkpoint_of(self.opts.stage)
        found = list(Path(self.opts.checkpoint_dir).glob("stage*.pt")) if self.opts.checkpoint_dir else []
        if found:  # the newest: a peer that moved between stages saved the one it served last
            ckpt = max(found, key=lambda f: f.stat().st_mtime)
            return int(ckpt.stem.removeprefix("stage")), ckpt
        stage = choose_stage(self.swarm.peers, self.num_stages, exclude=self.swarm.peer_id, costs=self.stage_costs)
        return stage, None

    def _build_host(self, stage: int) -> StageHost:
        from ..model import cut_model, load_model, stage_costs
        from ..stage import ReferenceModel, StageWorker

        model, _ = load_model(self.cfg.model, self.opts.cache_dir)
        hidden, vocab = int(model.config.hidden_size), int(model.config.vocab_size)
        check_model_width(self.cfg, hidden)
        self.stage_costs = stage_costs(model.config, self.num_stages, self.cfg.model.boundaries, self.cfg.data.seq_len)
        coded = self.cfg.mask.reference != "none"  # reference coding: every stage's pretrained weights, frozen
        cut = cut_model(model, self.num_stages, self.cfg.model.boundaries, keep=None if coded else [stage])
        del model
        module = cut[stage]
        reference = None
        if coded:
            frozen = [copy.deepcopy(m) if s == stage else m for s, m in sorted(cut.items())]
            # a small cache: a peer reuses a result only within one call (its incoming boundary's prefix for the
            # outgoing one); the mesh's larger default serves both ends of a boundary in one process
            reference = ReferenceModel([m.to(self.opts.device) for m in frozen], copy_modules=False, max_keys=4)
        module.to(self.opts.device)
        worker = StageWorker(module, self.cfg, replica=0, counter=self.counter)
        if reference is not None:
            reference.autocast = worker.autocast
            worker.reference = reference
            logger.info("reference model %s (its digest: the next stage accepts only the same)", reference.digest)
        move_bytes = 0
        if reference is not None and self.cfg.mask.reference_refresh_rank:  # the largest stage's reference move
            m = self.cfg.mask
            move_bytes = max(move_size({n: tuple(p.shape) for n, p in st.named_parameters()},
                                       m.reference_refresh_rank, m.reference_refresh_bits) for st in reference.stages)
            move_bytes += 256 * max(len(list(st.parameters())) for st in reference.stages)  # names, dtypes, shapes
        limits = Limits.from_config(self.cfg, hidden, vocab, ref_move_bytes=move_bytes)
        host = StageHost(worker, self.cfg, limits, self.run_id, call_next=self._call_next, threads=self.opts.threads,
                         slowdown=self.opts.slowdown)
        if reference is not None and self.cfg.mask.reference_refresh:
            from .refmoves import SwarmReference

            host.ref_moves = SwarmReference(host, push=self._push_move, fetch=self._fetch_move, horizon=lambda: max(
                driver_step(self.swarm.peers), self.driver_step if self.role == "driver" else 0), chain=self._chain)
            host.after_step_hooks.append(host.ref_moves.after_step)
        return host

    async def _fetch_move(self, stage: int, version: int, first: str | None = None
                          ) -> tuple[str, dict[str, Any]] | None:
        """A reference move this peer was not pushed (:mod:`.refmoves`): from ``first`` (the driver of the
        microbatch that needs it), then a peer that follows ``stage``, then the stage's peer: (the peer that
        answered, the move as pushed), or None if none holds it, also after a full read of the records (a peer
        that came online since the last read, such as a driver that joined with the moves, is asked too)."""
        from hivemind.p2p import PeerID

        from ..protocol.servicer import call_rpc

        limits = self.host.limits
        asked = {self.swarm.peer_id}

        async def ask(peer_id: str) -> tuple[str, dict[str, Any]] | None:
            asked.add(peer_id)
            try:
                reply = await call_rpc(self.swarm.p2p, PeerID.from_base58(peer_id),
                                       f"{self.run_id}.rpc_reference_move",
                                       {"run": self.run_id, "fetch": [stage, version]},
                                       max_bytes=limits.max_message_bytes, timeout=limits.rpc_timeout,
                                       connect_timeout=limits.connect_timeout)
                return peer_id, reply
            except Exception as exc:  # noqa: BLE001 (not held there, or unreachable: the next peer)
                logger.debug("reference move %d of stage %d not fetched from %s: %r", version, stage, peer_id[-8:],
                             exc)
                return None

        # the microbatch's driver names itself in an unauthenticated request: asked first only if its signed record
        # says it is an online driver (of this peer's chain)
        drivers = {p.peer_id for p in self.swarm.candidates(0, include_avoided=True, chain=self._chain())}
        if first in drivers and first not in asked and (got := await ask(first)) is not None:
            return got
        # the followers before the stage's peer: it makes a move it does not hold (a restart), which must not
        # replace one its previous process sent
        order = [*follower_stages(stage, self.num_stages, self.cfg.mask.reference), stage]
        for fresh in (False, True):
            if fresh:
                with contextlib.suppress(Exception):
                    await self.swarm.refresh_full()
            for s in order:
                for p in self.swarm.candidates(s, include_avoided=True, chain=self._chain()):
                    if p.peer_id not in asked and (got := await ask(p.peer_id)) is not None:
                        return got
        return None

    async def _push_move(self, stages: list[int], request: dict[str, Any]) -> int:
        """Send a reference move to every online peer of ``stages`` (:mod:`.refmoves`), each tried up to
        ``limits.max_retries`` times; returns how many took it."""
        from hivemind.p2p import PeerID

        from ..protocol.servicer import RPCError, call_rpc

        limits = self.host.limits
        payload = pack(request)  # packed once for every follower

        async def send(peer_id: str) -> bool:
            for attempt in range(limits.max_retries):
                try:
                    await call_rpc(self.swarm.p2p, PeerID.from_base58(peer_id), f"{self.run_id}.rpc_reference_move",
                                   payload, max_bytes=limits.max_message_bytes, timeout=limits.rpc_timeout,
                                   connect_timeout=limits.connect_timeout)
                    return True
                except RPCError as exc:  # refused: sending it again changes nothing
                    logger.warning("reference move refused by %s: %s", peer_id[-8:], exc)
                    return False
                except Exception as exc:  # noqa: BLE001 (a lost connection: try again)
                    logger.info("reference move to %s failed (attempt %d): %r", peer_id[-8:], attempt + 1, exc)
            return False

        chain = self._chain()
        twins = self.swarm.candidates(self.stage, include_avoided=True, chain=chain)
        if twins:  # each would move its own chain's reference: followers keep the first move of each version
            logger.warning("stage %d has %d other peer(s) online%s (%s; or the record of a peer that left, until it "
                           "expires): a moving reference (mask.reference_refresh) follows one peer per stage of a "
                           "chain; two peers' moves conflict, and the forward requests of one of them will be refused",
                           self.stage, len(twins), "" if chain is None else f" in replica chain {chain}",
                           ", ".join(p.peer_id[-8:] for p in twins))
        peers = [p.peer_id for s in stages for p in self.swarm.candidates(s, include_avoided=True, chain=chain)]
        return sum(await asyncio.gather(*(send(p) for p in peers)))

    async def _call_next(self, stage: int, build) -> dict[str, Any]:
        return await self.swarm.call_stage(stage, build, stall_timeout=60.0, is_stopping=self.leaving.is_set,
                                           chain=self._chain())

    def _chain(self) -> int | None:
        """The replica chain whose peers this one calls and sends moves to (fixed routes), else None: any peer."""
        return self.shard if self.routes else None

    async def _take_chain(self, ckpt: Path | None) -> None:
        """Fixed routes: take a replica chain of this stage before serving, the one a checkpoint names first (a
        restart goes back to its chain, whose peers hold its reference moves)."""
        current = None
        meta = ckpt.with_suffix(".json") if ckpt is not None else None
        if meta is not None and meta.is_file():
            with contextlib.suppress(OSError, ValueError, TypeError, AttributeError):
                chain = json.loads(meta.read_text()).get("chain")
                current = chain if isinstance(chain, int) and not isinstance(chain, bool) else None
        with contextlib.suppress(Exception):  # every holder's copy: the chains this stage's other peers took
            await self.swarm.refresh(full=True)
        self._ckpt_chain = current
        self.shard = await self._chain_now(self.swarm.peers, current)
        logger.info("stage %d: replica chain %d of %d (fixed routes: DP with a moving reference)", self.stage,
                    self.shard, self.replicas)
        with contextlib.suppress(Exception):  # the others taking a chain now see this one's
            await self.announce()

    async def _chain_now(self, peers: list[PeerRecord], current: int | None) -> int:
        """Fixed routes: the chain to hold, from :func:`.claim.choose_shard` among this stage's peers that answer
        (the record of a peer that died holds its chain until it expires: asked only when it would decide) and
        :meth:`_recheck_chain`."""
        me = self.swarm.peer_id
        chosen = choose_shard(peers, me, self.replicas, current, stage=self.stage)
        rivals = [p for p in peers if p.stage == self.stage and p.peer_id != me and p.shard is not None
                  and p.role in ("driver", "fast") and p.state in ("joining", "online")]
        if rivals and (current is None or chosen != current):
            alive = await asyncio.gather(*(self.swarm.answers(p.peer_id) for p in rivals))
            dead = {p.peer_id for p, ok in zip(rivals, alive) if not ok}
            for p in rivals:
                if p.peer_id in dead:
                    logger.info("stage %d: peer %s's record holds replica chain %d, but it does not answer: not "
                                "counted", self.stage, p.peer_id[-8:], p.shard)
            if dead:
                chosen = choose_shard([p for p in peers if p.peer_id not in dead], me, self.replicas, current,
                                      stage=self.stage)
        return chosen if current is None else self._recheck_chain(chosen)

    def _recheck_chain(self, chosen: int) -> int:
        """Fixed routes: the chain ``choose_shard`` names now, or this peer's own once its reference has moved (its
        moves are its chain's: changing chains then would code against another chain's reference), with an error
        logged once per conflict."""
        host = self.host
        moved = host is not None and host.ref_moves is not None and host.ref_moves.has_moved()
        if chosen == self.shard or self.shard is None or not moved:
            return chosen
        if self._chain_warned != chosen:
            self._chain_warned = chosen
            logger.error("stage %d: another peer with a smaller id holds replica chain %d too; this peer keeps it "
                         "(its reference has moved with this chain), and the two peers' moves conflict: stop one",
                         self.stage, self.shard)
        return self.shard

    def _make_record(self, state: str) -> PeerRecord:
        host = self.host
        layers = list(host.worker.module.layer_range) if host is not None else []
        return PeerRecord(
            peer_id=self.swarm.peer_id, role=self.role, stage=self.stage, num_stages=self.num_stages, state=state,
            layers=layers, throughput=float(host.throughput()) if host else 0.0,
            capacity=min(float(host.capacity()), 1e12) if host else 0.0, step=host.opt_step if host else 0,
            driver_step=self.driver_step if self.role == "driver" else (host.driver_step if host else None),
            tokens=self.driver_tokens if self.role == "driver" else (host.tokens if host else 0),
            loss=_finite(self.last_loss if self.role == "driver" else (host.last_loss if host else None)),
            bytes={k: v for k, v in self.counter.snapshot().items() if k != "total"},
            prior_step=self.prior_step, dp_syncs=host.dp_syncs() if host else 0,
            skipped_steps=host.skipped_steps if host else 0, reference=_record_reference(host),
            ref_mismatch=min(float(host.worker.ref_mismatch), 1e12) if host else 0.0,
            ref_refused=host.worker.ref_refused if host else 0,
            shard=self.shard,
            movable=self.opts.rebalance_after is not None, busy=host.busy() if host else False,
        )

    async def announce(self, state: str | None = None) -> None:
        """Store this peer's record in ``state`` (default: the current one, :attr:`state`)."""
        if state is not None:
            self.state = state
        ttl = self.opts.announce_period * 4
        ok = await self.swarm.announce(self._make_record(self.state), ttl)
        if not ok:
            logger.debug("announce (%s) was not stored", self.state)

    async def _announce_loop(self) -> None:
        """Re-announce the current state before the record expires: ``joining`` while the stage is set up (which
        can outlast a record's lifetime: the stage would look empty to rebalancing peers), ``online`` while it
        serves, ``offline`` from the start of a graceful stop (routers and DP partners leave it alone)."""
        while True:
            await asyncio.sleep(self.opts.announce_period)
            try:
                await self.announce()
            except Exception as exc:
                logger.warning("announce failed: %r", exc)

    def _write_metrics(self, rec: dict[str, Any]) -> None:
        if self.metrics is not None and not self.metrics.closed:
            self.metrics.write(json.dumps(rec) + "\n")
            self.metrics.flush()

    def _write_trace(self, rec: dict[str, Any]) -> None:
        if self.trace_file is not None and not self.trace_file.closed:
            self.trace_file.write(json.dumps(rec) + "\n")

    async def _metrics_loop(self) -> None:
        """With ``--metrics-out``, a fast or anchor peer writes a ``tick`` line each announce period: wall-clock
        time, compute seconds, tokens and bytes sent per axis (benchmarks take differences over a window).
        A driver writes one record per step instead (with the same fields)."""
        while True:
            await asyncio.sleep(self.opts.announce_period)
            if self.role == "driver":
                continue
            host = self.host
            self._write_metrics({
                "kind": "tick", "t": time.time(), "role": self.role, "stage": self.stage,
                "compute_s": round(host.compute_s, 4) if host else None, "tokens": host.tokens if host else 0,
                "driver_step": self.driver_step, "bytes": self.counter.snapshot(),
            })

    async def _refresh_loop(self) -> None:
        last_health: list[str] = []
        while True:
            await asyncio.sleep(self.opts.refresh_period)
            try:
                peers = await self.swarm.refresh()
            except Exception as exc:
                logger.warning("DHT refresh failed: %r", exc)
                continue
            if self.routes and self.role != "driver" and self.shard is not None:  # a driver re-checks every step
                chain = await self._chain_now(peers, self.shard)
                if chain != self.shard:
                    logger.warning("stage %d: replica chain %d is another peer's; taking chain %d", self.stage,
                                   self.shard, chain)
                    self.shard = chain
                    with contextlib.suppress(Exception):
                        await self.announce()
            health = swarm_health(peers, self.num_stages)
            if health != last_health:
                for line in health:
                    (logger.info if line.startswith("ok") else logger.warning)("swarm: %s", line)
                last_health = health
            if self.opts.rebalance_after is not None:
                try:
                    await self._check_rebalance(peers)
                except Exception as exc:  # a DHT error must not end the refresh loop
                    logger.warning("rebalance check failed: %r", exc)

    async def _check_rebalance(self, peers) -> None:
        """Move once :func:`.claim.should_rebalance` has named the same stage for ``rebalance_after`` seconds (a stage
        with no fast peer, or one that this peer's move would speed up enough); a full read of the records first
        confirms it (a first-holder read can lack a peer that is there)."""
        target = should_rebalance(peers, self.num_stages, self.swarm.peer_id, self.stage_costs)
        now = time.monotonic()
        if target is None:
            if self._starved is not None:
                logger.info("rebalance: not moving to stage %d for now (it is served again, the move no longer gains "
                            "enough, or a peer is between stages%s); staying in stage %d", self._starved[0],
                            ": some record is joining or offline" if in_transit(peers) else "", self.stage)
            self._starved = None
            return
        if self._starved is None or self._starved[0] != target:
            logger.warning("rebalance: %s; this peer moves there from stage %d unless that changes within %.0f s",
                           self._imbalance(peers, target), self.stage, self.opts.rebalance_after)
            self._starved = (target, now)
            return
        if now - self._starved[1] < self.opts.rebalance_after or self.leaving.is_set():
            return
        peers = await self.swarm.refresh(full=True)
        if should_rebalance(peers, self.num_stages, self.swarm.peer_id, self.stage_costs) != target:
            logger.info("rebalance: a full read of the records does not confirm the move to stage %d; staying in "
                        "stage %d", target, self.stage)
            self._starved = None
            return
        logger.warning("rebalance: %s for %.0f s; moving there from stage %d", self._imbalance(peers, target),
                       now - self._starved[1], self.stage)
        self.move_to = target
        self.leaving.set()

    def _imbalance(self, peers, target: int) -> str:
        loads = stage_loads(peers, self.num_stages)
        if loads[target][0] == 0:
            return f"stage {target} has no fast peer"
        rates = stage_rates(peers, self.num_stages, self.stage_costs)
        if rates is None:
            return f"stage {target} has {loads[target][0]} fast peers against {loads[self.stage][0]} here"
        return (f"stage {target} serves {rates[target]:.0f} tokens/s with {loads[target][0]} fast peers against "
                f"{rates[self.stage]:.0f} with {loads[self.stage][0]} here")

    async def _load_initial_state(self, ckpt: Path | None) -> None:
        host = self.host
        loaded_step = -1
        partial = 0
        if ckpt is not None and ckpt.is_file():
            blob = ckpt.read_bytes()
            # fixed routes: a checkpoint of another chain (another peer took this one's while it was down) gives its
            # weights, not its chain's reference moves and fits
            mine = not self.routes or self._ckpt_chain == self.shard
            if not mine:
                logger.warning("stage %d: checkpoint %s was written in replica chain %s, this peer is in chain %d "
                               "now: its reference moves are not loaded (this chain's are fetched)", self.stage,
                               ckpt, self._ckpt_chain, self.shard)
            try:
                partial = await host.run(host.load_state_blob, blob, True, mine)
                loaded_step = host.opt_step
            except ValueError as exc:  # damaged (a disk that filled up, a copy cut short): kept aside, not loaded
                aside = ckpt.with_name(ckpt.name + ".damaged")
                try:
                    ckpt.replace(aside)
                    where = f"moved to {aside}"
                except OSError as move_exc:
                    where = f"left in place ({move_exc.strerror})"
                logger.error("checkpoint %s does not load (%s): %s; this stage starts from its peers, an anchor's "
                             "copy or the pretrained weights", ckpt, exc, where)
        if loaded_step >= 0:
            meta = ckpt.with_suffix(".json")
            try:  # a mover's counters and driver steps are this process's
                m = json.loads(meta.read_text()) if meta.is_file() and not self.moves else None
                if m is not None and int(m.get("opt_step", -1)) != loaded_step:  # a crash between a save's renames
                    logger.warning("checkpoint %s: its counters are of step %s, its state of step %d; counters "
                                   "not restored", meta, m.get("opt_step"), loaded_step)
                elif m is not None:
                    counters = ByteCounter.from_snapshot(m.get("bytes", {}))
                    driver_step, driver_tokens = int(m.get("driver_step", 0)), int(m.get("driver_tokens", 0))
                    self.counter.merge(counters)
                    self.driver_step, self.driver_tokens = driver_step, driver_tokens
            except (OSError, ValueError, TypeError, AttributeError, KeyError) as exc:
                logger.warning("checkpoint %s is damaged (%s): counters not restored", meta, exc)
            logger.info("resumed stage %d from %s at step %d%s", self.stage, ckpt, loaded_step,
                        f", with {partial} of the step's {self.cfg.train.microbatches} microbatches taken" if partial
                        else "")
        others = [p for p in self.swarm.candidates(self.stage) if p.step > max(loaded_step, 0)]
        if loaded_step < 0 and not others and not await self._load_from_anchor():
            # a stage left without peers (this peer moved into it, or joined it) and no anchor copy: whatever it
            # had trained is gone, and training goes on from the pretrained weights rather than not at all
            (logger.warning if self.moves else logger.info)(
                "stage %d: no peer of it, no checkpoint and no anchor copy to load from; starting from the "
                "pretrained weights", self.stage)
        forked = False
        if self.routes:  # a peer of its own chain first: its reference moves and fits are this chain's
            others.sort(key=lambda p: p.shard != self.shard)
        for peer in others[:3]:
            try:
                blob = await self._fetch_state(peer.peer_id)
                own = not self.routes or peer.shard == self.shard
                # another chain's state: its reference moves are that chain's. A driver's chain goes on from them (a
                # fork) if none of its peers has moved yet; any other peer fetches its chain's moves (from its
                # driver, which forked if the chain is new)
                fork = (not own and self.role == "driver" and not host.ref_moves.has_moved()
                        and await self._fetch_move(self.stage, 1) is None)
                forked = forked or fork
                await host.run(host.load_state_blob, blob, False, own or fork)
                logger.info("loaded stage %d state (step %d) from peer %s%s", self.stage, host.opt_step,
                            peer.peer_id[-8:], "" if own else f" of replica chain {peer.shard} " + (
                                "with its reference moves (no peer of this chain has moved its reference yet: the "
                                "chain goes on from that one's)" if fork else "without its reference moves (this "
                                "chain's are fetched from its peers)"))
                break
            except Exception as exc:
                logger.warning("could not load state from %s: %r", peer.peer_id[-8:], exc)
        if self.role == "driver" and self.routes and not forked:
            # fixed routes: this chain's own step (its peers' records), not another chain's: its reference has no
            # move of a later step, and no peer of it would make one
            steps = [p.driver_step or 0 for p in self.swarm.peers if p.shard == self.shard and p.state == "online"
                     and p.role in ("driver", "fast") and p.peer_id != self.swarm.peer_id]
            self.driver_step = max([self.driver_step, self._served_driver_step, *steps])
        elif self.role == "driver":
            # the drivers' records, and the newest driver step the stage this peer left had served: a fast peer that
            # moved into a starved stage 0 (no driver record left) goes on from there, not from step 0
            steps = [p.driver_step or 0 for p in self.swarm.peers if p.role == "driver" and p.state == "online"]
            self.driver_step = max([self.driver_step, host.opt_step, self._served_driver_step, *steps])

    async def _stream(self, peer_id: str, method: str, request: dict[str, Any], max_total: int) -> list[dict]:
        """Every frame of ``peer_id``'s streamed reply to ``{run}.{method}`` (tensor frames, at most ``max_total``
        bytes of tensor data in all)."""
        from hivemind.p2p import PeerID

        limits = self.host.limits
        return await collect_stream(
            self.swarm.p2p, PeerID.from_base58(peer_id), f"{self.run_id}.{method}", {"run": self.run_id, **request},
            max_bytes=limits.max_message_bytes, timeout=limits.rpc_timeout, max_total=max_total, size=pieces_bytes,
        )

    async def _load_from_anchor(self) -> bool:
        """Take the stage's weights from an allowed anchor's last cycle (``rpc_stage_weights``): stale by up to
        ``anchor.period`` steps and with a fresh optimizer state, but far closer to the swarm's model than the
        pretrained weights. Only anchors whose record is signed by a key in ``anchor.allowed_keys`` and that have
        run a cycle are asked; whatever they send is checked before any weight changes."""
        allowed = set(self.cfg.anchor.allowed_keys)
        anchors = [p for p in self.swarm.peers
                   if p.role == "anchor" and p.state == "online" and p.step > 0 and p.owner in allowed]
        host = self.host
        most = sum(t.numel() * 4 for t in host.worker.module.state_dict().values())
        for anchor in sorted(anchors, key=lambda p: -p.step)[:2]:
            try:
                chunks = await self._stream(anchor.peer_id, "rpc_stage_weights", {"stage": self.stage}, most)
                opt_step = chunks[-1].get("opt_step") if chunks else None
                if not isinstance(opt_step, int) or isinstance(opt_step, bool) or opt_step < 0:
                    raise ValueError(f"bad opt_step {opt_step!r}")
                await host.run(host.load_weights, weights_from_chunks(chunks), opt_step)
            except Exception as exc:
                logger.warning("could not take stage %d's weights from anchor %s: %r", self.stage,
                               anchor.peer_id[-8:], exc)
                continue
            logger.warning("stage %d: no peer of it to load from; took the anchor %s's copy of its weights (the "
                           "stage's step %d, fresh optimizer state)", self.stage, anchor.peer_id[-8:], opt_step)
            return True
        return False

    def _dp_clock(self) -> int:
        """The newest driver step this peer knows: its own (a driver), the microbatches it served, the records."""
        host = self.host
        return max(self.driver_step if self.role == "driver" else 0, host.driver_step if host else 0,
                   driver_step(self.swarm.peers) if self.swarm else 0)

    async def _fetch_outer(self, peer_id: str, names: list[str]) -> dict[str, torch.Tensor]:
        """A stage partner's DP outer state of the tensors ``names`` (``start/<name>``, ``velocity/<name>``,
        float32): what this peer takes for a fragment whose start weights have drifted apart
        (:meth:`.dp.SwarmDP._realign`)."""
        params = dict(self.host.worker.module.named_parameters())
        most = 2 * sum(params[n].numel() * 4 for n in names)  # start + velocity, float32
        chunks = await self._stream(peer_id, "rpc_get_weights", {"what": "outer", "names": list(names)}, most)
        state = weights_from_chunks(chunks)
        self.counter.add("dp", sum(t.numel() * t.element_size() for t in state.values()))
        return state

    async def _fetch_state(self, peer_id: str) -> bytes:
        from hivemind.p2p import PeerID

        limits = self.host.limits
        frames = await collect_stream(
            self.swarm.p2p, PeerID.from_base58(peer_id), f"{self.run_id}.rpc_get_state", {"run": self.run_id},
            max_bytes=limits.max_message_bytes, timeout=limits.rpc_timeout,
            max_total=state_bytes_bound(self.host.worker.module), size=state_chunk_bytes,
        )
        return b"".join(f["data"] for f in frames)

    async def _run_stage(self) -> None:
        stage, ckpt = self._pick_stage()
        while True:
            await self._serve_stage(stage, ckpt)
            if self.stopping.is_set() or self.move_to is None:
                return
            await self._leave_stage()
            stage, ckpt = self._pick_stage(self.move_to)
            self.move_to, self._starved = None, None
            self.moves += 1
            self.leaving.clear()
            if self.stopping.is_set():  # a signal during the move
                return

    async def _leave_stage(self) -> None:
        """Stop serving the current stage (after its graceful stop): its tasks, DP averager and RPC handlers."""
        await _cancel(self.stage_tasks)
        host, self.host = self.host, None
        if host is not None:
            self._served_driver_step = max(self._served_driver_step, host.driver_step)
        if host is not None and host.dp is not None:
            await asyncio.to_thread(host.dp.shutdown)  # hivemind joins its averager process: not on the loop
        if host is not None and host.ref_moves is not None:
            await host.ref_moves.close()  # moves still being sent
        if self.servicer is not None and self.swarm is not None and self.swarm.p2p is not None:
            with contextlib.suppress(Exception):
                await self.servicer.remove_p2p_handlers(self.swarm.p2p, self.run_id)
        self.servicer = None
        self.shard = None
        if host is not None:
            host.executor.shutdown(wait=False)

    async def _serve_stage(self, stage: int, ckpt: Path | None) -> None:
        self.stage = stage
        if stage == 0:
            self.role = "driver"
        elif self.role == "driver":
            self.role = "fast"
        logger.info("peer %s joins run %s as %s of stage %d", self.swarm.peer_id, self.run_id, self.role, stage)
        await self.announce("joining")
        self.stage_tasks.append(asyncio.create_task(self._announce_loop()))
        self.host = await asyncio.to_thread(self._build_host, stage)
        self.swarm.limits = self.host.limits
        if self.opts.trace_out is not None:
            if self.trace_file is None:
                self.trace_file = open(self.opts.trace_out, "a", buffering=1)  # noqa: SIM115 (closed in _cleanup)
            self.host.trace = self._write_trace
        if self.cfg.dp.enabled:
            from .dp import SwarmDP

            self.host.dp = SwarmDP(self.host, self.swarm.dht, self.run_id, self.counter,
                                   partners=lambda: self.swarm.recent_partners(self.stage), clock=self._dp_clock,
                                   fetch_outer=self._fetch_outer, recheck=self.swarm.refresh_full)
            self.host.after_step_hooks.append(self.host.dp.after_step)
        if self.routes:
            await self._take_chain(ckpt)
        await self._load_initial_state(ckpt)
        self.servicer = StageServicer(self.host, self.host.limits.max_message_bytes)
        await self.servicer.add_p2p_handlers(self.swarm.p2p, self.run_id)
        await self.announce("online")
        self.stage_tasks.append(asyncio.create_task(self._refresh_loop()))
        if self.opts.checkpoint_dir is not None and self.opts.checkpoint_every:
            self.stage_tasks.append(asyncio.create_task(self._checkpoint_loop()))
        if self.cfg.anchor.enabled:
            from .priors import PriorReader

            reader = PriorReader(self)
            self.stage_tasks.append(asyncio.create_task(reader.loop()))
        self._write_ready()
        driver = asyncio.create_task(self._drive()) if self.role == "driver" else None
        await self.leaving.wait()
        await self._graceful_stop(driver)

    def _write_ready(self) -> None:
        if self.opts.ready_file is not None:
            tmp = Path(str(self.opts.ready_file) + ".tmp")
            tmp.write_text(json.dumps({"peer_id": self.swarm.peer_id, "stage": self.stage, "role": self.role,
                                       "maddrs": [str(m) for m in self.swarm.dht.get_visible_maddrs()]}))
            tmp.rename(self.opts.ready_file)

    async def _graceful_stop(self, driver: asyncio.Task | None) -> None:
        """Leave the stage: ``offline`` (the announce loop repeats it), the driver's step finished, the gate closed and
        what is in flight finished (bounded), then, unless only moving to another stage, a checkpoint (a signal
        that came during a move's drain gets one too)."""
        try:
            await self.announce("offline")
        except Exception as exc:
            logger.warning("could not announce offline: %r", exc)
        if driver is not None:
            try:
                await asyncio.wait_for(driver, self.opts.shutdown_grace)
            except (asyncio.TimeoutError, asyncio.CancelledError):
                driver.cancel()
            except Exception as exc:
                logger.warning("driver stopped with %r", exc)
        await self.host.close()
        idle = await self.host.wait_idle(self.opts.shutdown_grace)
        if not idle:
            logger.warning("in-flight microbatches did not finish within %.0fs", self.opts.shutdown_grace)
        if self.stopping.is_set() and self.opts.checkpoint_dir is not None:
            # with the step taken so far (once idle): a restart finishes it, the microbatches are not lost
            await self.save_checkpoint(Path(self.opts.checkpoint_dir), partial=idle)
        elif self.host.pending_microbatches:
            logger.warning("leaving stage %d with %d microbatches of its step taken and not applied: their gradient "
                           "is lost", self.stage, self.host.pending_microbatches)

    async def save_checkpoint(self, directory: Path, partial: bool = False, idle_wait: float | None = None
                              ) -> Path | None:
        """Write the stage's state (between steps) to ``directory/stage{N}.pt`` and its counters to ``.json``, each
        through a temporary file and a rename, so a crash mid-write leaves the previous checkpoint whole. Returns
        None when a checkpoint of a later step was written meanwhile (a periodic save that finished after the stop's
        save must not replace it, or a periodic one found a DP round pending). ``partial``: with the step taken so far
        (a stop's save, the gate closed); ``idle_wait`` (a periodic save): with it if the replica is quiet within
        that many seconds."""
        host, stage = self.host, self.stage
        if idle_wait is not None:
            got = await host.checkpoint_blob(idle_wait)
            if got is None:  # a DP round pending: the next period tries again
                return None
            blob, taken = got
        else:
            blob = await host.state_blob(partial)
            taken = host.pending_microbatches if partial else 0
        self._ckpt_seq += 1
        seq = self._ckpt_seq
        meta = {
            "run_id": self.run_id, "stage": stage, "opt_step": host.opt_step, "driver_step": self.driver_step,
            "driver_tokens": self.driver_tokens, "bytes": self.counter.snapshot(), "partial_microbatches": taken,
            "chain": self._chain(),
        }
        path = Path(directory) / CHECKPOINT_NAME.format(stage=stage)
        if not await asyncio.to_thread(self._write_checkpoint, path, blob, meta, seq):
            return None
        logger.info("checkpoint of stage %d at step %d: %s", stage, meta["opt_step"], path)
        return path

    def _write_checkpoint(self, path: Path, blob: bytes, meta: dict[str, Any], seq: int) -> bool:
        with self._ckpt_lock:
            # the later state wins: by step, and at the same step by when it was taken (its counters are newer)
            if (meta["opt_step"], seq) < self._ckpt_step.get(meta["stage"], (-1, -1)):
                return False
            path.parent.mkdir(parents=True, exist_ok=True)
            for target, data in ((path, blob), (path.with_suffix(".json"), json.dumps(meta).encode())):
                tmp = target.with_name(target.name + ".tmp")
                with open(tmp, "wb") as f:
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
                tmp.replace(target)
            with contextlib.suppress(OSError):  # the renames themselves, on filesystems that allow it
                fd = os.open(path.parent, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
            self._ckpt_step[meta["stage"]] = (meta["opt_step"], seq)
            return True

    async def _checkpoint_loop(self) -> None:
        """With ``--checkpoint-dir`` and ``--checkpoint-every``: save the stage every period in which it stepped. Not
        while an overlapped DP round of it is running or waiting to be applied (its error feedback is committed
        before its update reaches the weights: a state taken in between would lose that update on a resume); the
        next period tries again."""
        saved = self.host.opt_step
        while True:
            await asyncio.sleep(self.opts.checkpoint_every)
            host = self.host
            if self.leaving.is_set() or host is None or host.opt_step <= saved:
                continue
            if host.dp is not None and (host.dp.pending or host.dp.ready):
                continue
            try:
                step = host.opt_step
                idle_wait = min(PERIODIC_IDLE_WAIT, self.opts.checkpoint_every)
                if await self.save_checkpoint(Path(self.opts.checkpoint_dir), idle_wait=idle_wait) is not None:
                    saved = step
            except Exception as exc:  # a full disk must not end the peer: the next period tries again
                logger.warning("periodic checkpoint of stage %d failed: %r", self.stage, exc)

    # ---- the driver ------------------------------------------------------------------------

    async def _drive(self) -> None:
        from ..data import BatchSource, make_tokenizer, prepare_corpus

        cfg = self.cfg
        tok = make_tokenizer(cfg.model, None if cfg.model.tokenizer == "bytes" else _hf_tokenizer(cfg, self.opts))
        corpus = await asyncio.to_thread(prepare_corpus, cfg.data, tok, self.opts.cache_dir)
        replicas = self.replicas
        M = cfg.train.microbatches
        start = time.monotonic()
        source = None
        # every holder's copy of the records: the other drivers (their shards) and this stage's DP partners, which
        # the cheap first-holder reads of the refresh loop may not show for a while after a join
        with contextlib.suppress(Exception):
            await self.swarm.refresh(full=True)
        while self.driver_step < cfg.train.steps and not self.leaving.is_set():
            step = self.driver_step
            # each driver reads its own shard: the one no other driver announces (re-checked every step, so two
            # drivers that started together and both took shard 0 part once they see each other's records)
            if self.routes:
                shard = await self._chain_now(self.swarm.peers, self.shard)
            else:
                shard = choose_shard(self.swarm.peers, self.swarm.peer_id, replicas, self.shard)
            if source is None or shard != self.shard:
                if source is not None:
                    logger.info("driver: shard %d is another driver's; moving to shard %d at step %d", self.shard,
                                shard, step)
                else:
                    logger.info("driver: shard %d of %d, from step %d to %d", shard, replicas, step, cfg.train.steps)
                self.shard = shard
                source = BatchSource(corpus.train, cfg.train.batch_size, shard=shard, num_shards=replicas,
                                     seed=cfg.train.seed)
                with contextlib.suppress(Exception):  # tell the other drivers now, not at the next announcement
                    await self.announce()
            pending = list(range(M))
            losses: dict[int, float] = {}
            stalled_since = None
            while pending and not self.leaving.is_set():
                results = await asyncio.gather(
                    *(self._microbatch(step, m, source.batch(step * M + m)) for m in pending), return_exceptions=True
                )
                for m, r in zip(list(pending), results):
                    if isinstance(r, BaseException):
                        logger.warning("driver step %d microbatch %d failed: %s", step, m, r)
                    else:
                        losses[m] = r
                        pending.remove(m)
                if pending:
                    stalled_since = stalled_since or time.monotonic()
                    await asyncio.sleep(1.0)  # the pipeline is broken: wait for peers, then retry these microbatches
            if pending:
                break
            loss = sum(losses.values()) / len(losses)
            self.last_loss = loss
            self.driver_step = step + 1
            self.driver_tokens += M * cfg.train.batch_size * cfg.data.seq_len
            rec = {"step": step, "loss": loss, "tokens": self.driver_tokens,
                   "wall_s": round(time.monotonic() - start, 3), "t": time.time(),
                   "compute_s": round(self.host.compute_s, 4), "bytes": self.counter.snapshot()}
            if stalled_since is not None:
                rec["stall_s"] = round(time.monotonic() - stalled_since, 3)
            self._write_metrics(rec)
            if (step + 1) % 10 == 0 or step + 1 == cfg.train.steps:
                logger.info("driver step %d/%d loss %.4f", step + 1, cfg.train.steps, loss)
        if self.driver_step >= cfg.train.steps:
            logger.info("driver: reached train.steps = %d", cfg.train.steps)
            await self.announce()

    async def _microbatch(self, step: int, m: int, ids: torch.Tensor) -> float:
        import random

        host = self.host
        ids = ids.to(self.opts.device)
        try:
            _, loss = await host.process(driver=self.swarm.peer_id, step=step, mb=m, attempt=random.getrandbits(31),
                                         inputs=ids, labels=ids)
        except ChainError:
            raise
        return loss


async def _cancel(tasks: list[asyncio.Task]) -> None:
    for t in tasks:
        t.cancel()
    for t in tasks:
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await t
    tasks.clear()


def _record_reference(host: StageHost | None) -> str | None:
    """The reference a peer's record names: its digest, or with a moving reference the digest of the weights the
    moves started from (peers apply each move at their own first microbatch of its step, so the moved digests of
    two peers differ for a moment at every move; the forward requests compare those)."""
    if host is None or host.worker.reference is None:
        return None
    return host.worker.reference.origin_digest if host.ref_moves is not None else host.reference_digest


def _finite(x: float | None) -> float | None:
    return x if x is not None and math.isfinite(x) else None


def _hf_tokenizer(cfg: RunConfig, opts: JoinOptions):
    from ..model import load_model

    _, tok = load_model(cfg.model, opts.cache_dir)
    return tok


async def join(cfg: RunConfig, opts: JoinOptions) -> None:
    """Run one peer until SIGINT / SIGTERM (or, for a driver-only run, forever after training)."""
    await SwarmNode(cfg, opts).run()


def run_join(cfg: RunConfig, opts: JoinOptions) -> None:
    """Entry point of ``meshnode join``: the asyncio work on uvloop."""
    try:
        import uvloop

        uvloop.run(join(cfg, opts))
    except ImportError:  # pragma: no cover (windows)
        asyncio.run(join(cfg, opts))


__all__ = ["JoinOptions", "SwarmNode", "join", "run_join"]
