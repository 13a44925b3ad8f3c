"""The anchor role: an unmasked pipeline on stale weights that publishes spectral priors.

One anchor peer holds every stage (DESIGN.md: one anchor replica is enough). Every ``anchor.period``
driver steps (read from the peers' records) it runs a cycle:

1. take each stage's weights: with ``anchor.snapshot = "full"`` fetch its current weights from an online
   fast peer (``rpc_get_weights``, bf16); with ``"dp"`` replay that peer's DP log since the last cycle
   (``rpc_dp_log``: each outer step's averaged PowerSGD phases, fp16) on the anchor's own copy of the
   global weights (:class:`~.dp.DPFollower`), loading the peer's outer state in full only when the log
   cannot be continued (first contact with a peer whose log does not start at the pretrained weights,
   another peer, entries dropped). The bytes count on the ``anchor`` axis either way;
2. draw a batch from the training distribution (its own order: ``seed + ANCHOR_SEED_OFFSET``) and run
   an unmasked forward/backward with dense boundaries (counted on ``anchor`` like the mesh does);
3. fold each targeted matrix's clean gradient into its EMA and take the SVD truncated to
   ``spectral.rank`` (:class:`SpectralFilter.update_prior`, the same code the mesh uses);
4. publish a small signed header to ``{run}_prior_{stage}`` naming the step (the stage's optimizer step at
   the snapshot), the matrices and a digest over their fp16 factors' digests. With ``anchor.priors = "rpc"``
   (default) the anchor keeps the factors and serves them itself (:class:`PriorServicer`, ``rpc_prior``;
   the header names this peer as ``source``); with ``"dht"`` it first stores them under
   ``{run}_priordata_{stage}``, one signed value per matrix. Fast peers poll only the headers and read the
   factors once per new cycle (node/priors.py).

Anchors never take optimizer steps. The ``bias_correction`` mode is not published by the swarm
anchor (filter modes only).

The anchor also serves its copy of a stage's weights as of its last cycle (``rpc_stage_weights``, float32,
with the stage's optimizer step then): a fast peer that moves into a stage left without peers starts from it
instead of the pretrained weights (node/daemon.py), if the anchor's key is in ``anchor.allowed_keys``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable

import torch
from hivemind.p2p import PeerID

from ..config import check_model_width
from ..protocol import keys
from ..protocol.limits import Limits
from ..protocol.messages import tensor_to_bytes
from ..protocol.records import PeerRecord, cycle_digest, factors_digest, prior_value
from ..protocol.servicer import RPCContext, RPCServicer, collect_stream
from .dp import DPFollower, log_length
from .host import pieces_bytes, tensor_chunks, weights_from_chunks
from .priors import HEADER_NAME
from .status import driver_step

logger = logging.getLogger(__name__)

ANCHOR_SEED_OFFSET = 1_000_003  # the mesh anchor's offset (meshnode.mesh.anchor)
SOURCE_GRACE_S = 60.0  # how long a followed DP log's peer may be unreachable before another one is loaded


def follow_order(candidates: list[str], source: str | None, last_ok: float, now: float,
                 grace_s: float = SOURCE_GRACE_S) -> list[str]:
    """The peers an anchor asks, in order, for one stage's DP log (``anchor.snapshot = "dp"``).

    The followed peer (``source``) continues its log: a few entries. Any other replica's log starts with its
    whole outer state (start weights and velocity: nine log entries' worth in the benchmark swarm, 1.2 MB
    there), which on a slow link is a long transfer that a connection hiccup cuts off. So while the source was
    last reached less than ``grace_s`` ago, only the source is asked (or nobody, while it is missing from the
    snapshot: the cycle is tried again); after that, or before anything is followed, every candidate, the
    source first. At most three."""
    if source is None or now - last_ok >= grace_s:
        return sorted(candidates, key=lambda c: c != source)[:3]
    return [source] if source in candidates else []


class PriorServicer(RPCServicer):
    """``rpc_prior`` (``anchor.priors = "rpc"``): the factors of the anchor's latest cycle of one stage.

    Request ``{"run", "stage", "anchor_step"}``; reply one frame per matrix (the same fields a ``"dht"``
    value has, ``last`` on the final one). Only the cycle the DHT header currently names is held, so a
    reader that asks for another step is refused and reads the new header first. The reader checks every
    frame against that signed header (digests), so the stream itself needs no signature. Each reply is
    counted on the ``anchor`` axis: it is what this anchor uploads.
    """

    def __init__(self, run_id: str, num_stages: int, max_message_bytes: int, counter):
        super().__init__(max_message_bytes)
        # stage -> (its weights as of the anchor's last cycle, that cycle's optimizer step of the stage), or None
        self.weights_of: Callable[[int], Awaitable[tuple[dict[str, torch.Tensor], int] | None]] | None = None
        self.run_id = run_id
        self.num_stages = num_stages
        self.counter = counter
        self.held: dict[int, tuple[int, list[dict]]] = {}  # stage -> (anchor step, matrix values by name)

    def hold(self, stage: int, anchor_step: int, values: dict[str, dict]) -> None:
        self.held[stage] = (anchor_step, [values[n] for n in sorted(values)])

    async def rpc_prior(self, request: dict, context: RPCContext):
        if request.get("run") != self.run_id:
            raise ValueError("wrong run")
        stage, step = request.get("stage"), request.get("anchor_step")
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in (stage, step)):
            raise TypeError("stage and anchor_step must be integers")
        if not 0 <= stage < self.num_stages:
            raise ValueError(f"no stage {stage}")
        held_step, values = self.held.get(stage, (None, []))
        if held_step != step:
            raise ValueError(f"stage {stage}: the prior of step {step} is not held (latest: {held_step})")
        for i, value in enumerate(values):
            self.counter.add("anchor", len(value["u"]) + len(value["s"]) + len(value["vh"]))
            yield {**value, "last": i == len(values) - 1}


    async def rpc_stage_weights(self, request: dict, context: RPCContext):
        """``{"run", "stage"}`` -> the anchor's copy of that stage's weights (float32 frames, each with the stage's
        ``opt_step`` at the cycle that took them); refused before the anchor's first cycle."""
        if request.get("run") != self.run_id:
            raise ValueError("wrong run")
        stage = request.get("stage")
        if not isinstance(stage, int) or isinstance(stage, bool) or not 0 <= stage < self.num_stages:
            raise ValueError(f"no stage {stage!r}")
        held = await self.weights_of(stage) if self.weights_of is not None else None
        if held is None:
            raise ValueError(f"stage {stage}: no anchor cycle has taken its weights yet")
        weights, opt_step = held
        for chunk in tensor_chunks(weights):
            self.counter.add("anchor", pieces_bytes(chunk))
            yield {**chunk, "opt_step": opt_step}


class AnchorRunner:
    def __init__(self, node):
        self.node = node
        self.cfg = node.cfg
        self.cycles = 0
        self.prior_step: int | None = None
        self.next_at = self.cfg.anchor.period
        self.servicer: PriorServicer | None = None
        # per stage: held while a cycle replaces that stage's weights (rpc_stage_weights copies them under it)
        self._weights_locks = [asyncio.Lock() for _ in range(self.cfg.model.stages)]
        self.weights_step: dict[int, int] = {}  # stage -> its optimizer step when the last cycle took its weights

    def _build(self):
        from ..data import BatchSource, make_tokenizer, prepare_corpus
        from ..model import cut_model, load_model
        from ..optim import SpectralFilter
        from ..stage import StageWorker

        cfg = self.cfg
        model, hf_tok = load_model(cfg.model, self.node.opts.cache_dir)
        check_model_width(cfg, int(model.config.hidden_size))
        self.limits = Limits.from_config(cfg, int(model.config.hidden_size), int(model.config.vocab_size))
        stages = cut_model(model, cfg.model.stages, cfg.model.boundaries)
        self.workers = []
        for s in range(cfg.model.stages):
            w = StageWorker(stages[s].to(self.node.opts.device), cfg, replica=-1, counter=self.node.counter)
            w.masked = False
            self.workers.append(w)
        sp = cfg.spectral
        self.filters = []
        for w in self.workers:
            params = dict(w.module.named_parameters())
            self.filters.append({
                name: SpectralFilter((params[name].shape[0], params[name].shape[1]), alpha=sp.alpha, tau=sp.tau,
                                     beta=sp.beta, rank=sp.rank, mode="filter", ema_init=sp.ema_init)
                for name in sorted(w.optimizer.filters)
            })
        self.followers: list[DPFollower] = []
        self._source_ok: dict[int, float] = {}  # stage -> when its followed peer last gave its log
        if cfg.anchor.snapshot == "dp":
            self.followers = [DPFollower(dict(w.module.named_parameters()), lr=cfg.dp.outer_lr,
                                         momentum=cfg.dp.outer_momentum, rank=cfg.dp.rank) for w in self.workers]
        tok = make_tokenizer(cfg.model, hf_tok)
        corpus = prepare_corpus(cfg.data, tok, self.node.opts.cache_dir)
        batch = cfg.anchor.batch_size or cfg.train.batch_size
        self.source = BatchSource(corpus.train, batch, seed=cfg.train.seed + ANCHOR_SEED_OFFSET)

    def _record(self, state: str) -> PeerRecord:
        return PeerRecord(
            peer_id=self.node.swarm.peer_id, role="anchor", stage=-1, num_stages=self.cfg.model.stages, state=state,
            layers=[], step=self.cycles, prior_step=self.prior_step,
            bytes={k: v for k, v in self.node.counter.snapshot().items() if k != "total"},
        )

    async def _announce(self, state: str) -> None:
        await self.node.swarm.announce(self._record(state), self.node.opts.announce_period * 4)

    async def run(self) -> None:
        node = self.node
        await self._announce("joining")
        await asyncio.to_thread(self._build)
        node.swarm.limits = self.limits
        # rpc_prior (anchor.priors = "rpc"; with "dht" it holds nothing and refuses) and rpc_stage_weights
        self.servicer = PriorServicer(node.run_id, self.cfg.model.stages, self.limits.max_message_bytes, node.counter)
        self.servicer.weights_of = self.stage_weights
        await self.servicer.add_p2p_handlers(node.swarm.p2p, node.run_id)
        node.servicer = self.servicer  # the daemon removes its handlers at shutdown
        await self._announce("online")
        node._write_ready()

        async def announce_loop():
            while True:
                await asyncio.sleep(node.opts.announce_period)
                try:
                    await self._announce("online")
                except Exception as exc:
                    logger.warning("announce failed: %r", exc)

        node.tasks.append(asyncio.create_task(announce_loop()))
        last_error = None
        while not node.stopping.is_set():
            try:
                peers = await node.swarm.refresh()
                if driver_step(peers) >= self.next_at:
                    await self.cycle()
                    self.next_at = driver_step(node.swarm.peers) + self.cfg.anchor.period
                    await self._announce("online")
                    last_error = None
            except Exception as exc:  # retried each second; the same failure is logged once
                (logger.debug if repr(exc) == last_error else logger.warning)("anchor cycle failed: %r", exc)
                last_error = repr(exc)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(node.stopping.wait(), 1.0)
        await self._announce("offline")

    async def _stream(self, peer_id: str, method: str, request: dict, max_total: int | None = None) -> list[dict]:
        """Every frame of a streamed reply; more than ``max_total`` bytes of tensor data in all is refused."""
        return await collect_stream(
            self.node.swarm.p2p, PeerID.from_base58(peer_id), f"{self.node.run_id}.{method}",
            {"run": self.node.run_id, **request}, max_bytes=self.limits.max_message_bytes,
            timeout=self.limits.rpc_timeout, max_total=max_total, size=pieces_bytes,
        )

    def _stage_bytes(self, stage: int) -> int:
        """Bytes of one stage's parameters in float32: the most any entry or state of it can honestly take."""
        return sum(p.numel() * 4 for p in self.workers[stage].module.parameters())

    def _count(self, tensors: dict[str, torch.Tensor]) -> None:
        self.node.counter.add("anchor", sum(t.numel() * t.element_size() for t in tensors.values()))

    async def _fetch(self, stage: int) -> tuple[dict, int]:
        """``anchor.snapshot = "full"``: the stage's current weights (bf16) from one of its fast peers."""
        swarm = self.node.swarm
        last = None
        for peer in swarm.candidates(stage)[:3]:
            try:
                chunks = await self._stream(peer.peer_id, "rpc_get_weights", {"dtype": "bfloat16"},
                                            max_total=self._stage_bytes(stage))  # bf16 weights: half of this
                weights = weights_from_chunks(chunks)
                self._count(weights)
                return weights, int(chunks[-1].get("opt_step", 0))
            except Exception as exc:
                last = exc
                swarm.avoid(peer.peer_id)
        raise RuntimeError(f"stage {stage}: no peer gave its weights ({last})")

    async def _dp_log(self, stage: int, peer_id: str, since: int, epoch: str | None) -> tuple[list, dict]:
        # at most a whole log of entries, each smaller than the stage's weights in bf16
        cap = log_length(self.cfg) * self._stage_bytes(stage) // 2
        chunks = await self._stream(peer_id, "rpc_dp_log", {"since": since, "epoch": epoch}, max_total=cap)
        by_seq: dict[int, list[dict]] = {}
        for c in chunks:
            if c.get("pieces"):
                seq = c.get("seq")
                if not isinstance(seq, int) or isinstance(seq, bool):
                    raise ValueError("DP log chunk without an entry number")
                by_seq.setdefault(seq, []).append(c)
        entries = [(seq, weights_from_chunks(cs)) for seq, cs in sorted(by_seq.items())]
        for _, tensors in entries:
            self._count(tensors)
        return entries, _checked_meta(chunks[-1])

    async def _follow(self, stage: int) -> int:
        """``anchor.snapshot = "dp"``: bring the stage's global weights up to date from a fast peer's DP log."""
        swarm = self.node.swarm
        fol = self.followers[stage]
        by_id = {p.peer_id: p for p in swarm.candidates(stage)}
        order = follow_order(list(by_id), fol.source, self._source_ok.get(stage, -float("inf")), time.monotonic())
        if not order:
            raise RuntimeError(f"stage {stage}: the followed peer {fol.source[-8:]} is not reachable; waiting for it "
                               f"up to {SOURCE_GRACE_S:.0f} s before loading another peer's outer state")
        last = None
        for peer in (by_id[i] for i in order):
            try:
                ask = fol.since(peer.peer_id)
                meta: dict = {}
                if ask is not None:
                    entries, meta = await self._dp_log(stage, peer.peer_id, *ask)
                if ask is None or meta.get("gap"):
                    outer = {"what": "outer", "dtype": "bfloat16"}  # start + velocity in bf16: the f32 size
                    chunks = await self._stream(peer.peer_id, "rpc_get_weights", outer,
                                                max_total=self._stage_bytes(stage))
                    head = _checked_meta(chunks[-1])
                    state = weights_from_chunks(chunks)
                    self._count(state)
                    await asyncio.to_thread(fol.load, peer.peer_id, head["dp_epoch"], head["dp_seq"], state)
                    logger.info("anchor: stage %d follows DP of %s from its outer state (entry %d)", stage,
                                peer.peer_id[-8:], fol.seq)
                    entries, meta = await self._dp_log(stage, peer.peer_id, fol.seq, fol.epoch)
                    if meta.get("gap"):
                        raise RuntimeError("DP log gap right after loading the outer state")
                n = await asyncio.to_thread(fol.replay, peer.peer_id, meta["dp_epoch"], entries)
                self._source_ok[stage] = time.monotonic()
                logger.info("anchor: stage %d replayed %d DP outer steps of %s (now at entry %d)", stage, n,
                            peer.peer_id[-8:], fol.seq)
                return meta["opt_step"]
            except Exception as exc:
                last = exc
                logger.warning("anchor: following DP of stage %d via %s failed: %r", stage, peer.peer_id[-8:], exc)
                if peer.peer_id != fol.source:  # the followed peer is asked again next time (follow_order)
                    swarm.avoid(peer.peer_id)
        raise RuntimeError(f"stage {stage}: no peer gave its DP log ({last})")

    def _pass(self, ids: torch.Tensor, step: int) -> list[dict[str, torch.Tensor]]:
        from ..stage import MicrobatchId, chain_gradients

        return chain_gradients(self.workers, MicrobatchId(step, 0), ids, [list(f) for f in self.filters])

    def _fold(self, grads: list[dict[str, torch.Tensor]], steps: list[int]) -> list[dict[str, tuple]]:
        out = []
        for s, g in enumerate(grads):
            fs = {}
            for name, mat in g.items():
                f = self.filters[s][name]
                f.update_prior(mat, steps[s])
                fs[name] = f.factors()
            out.append(fs)
        return out

    async def stage_weights(self, stage: int) -> tuple[dict[str, torch.Tensor], int] | None:
        """A copy of ``stage``'s weights as the last cycle left them, and the stage's optimizer step then (None
        before the first cycle): what a peer that moves into an empty stage starts from."""
        if stage not in self.weights_step:
            return None
        async with self._weights_locks[stage]:
            module = self.workers[stage].module
            copy = await asyncio.to_thread(lambda: {k: v.detach().float().clone() for k, v in
                                                    module.state_dict().items()})
            return copy, self.weights_step[stage]

    async def cycle(self) -> None:
        node = self.node
        steps = []
        for s, w in enumerate(self.workers):
            if self.followers:
                async with self._weights_locks[s]:  # the follower changes the weights as it goes
                    steps.append(await self._follow(s))
            else:
                weights, opt_step = await self._fetch(s)  # over the network: outside the lock
                async with self._weights_locks[s]:
                    await asyncio.to_thread(w.module.load_state_dict, weights)
                steps.append(opt_step)
            self.weights_step[s] = steps[-1]
        ids = self.source.batch(self.cycles).to(node.opts.device)
        grads = await asyncio.to_thread(self._pass, ids, max(steps))
        factors = await asyncio.to_thread(self._fold, grads, steps)
        ttl = max(300.0, node.opts.announce_period * 20)
        for s, fs in enumerate(factors):
            data_key = keys.prior_data_key(node.run_id, s)
            values, digests = {}, {}
            for name, (u, sv, vh) in fs.items():
                ub, sb, vb = (tensor_to_bytes(t.to(torch.float16)) for t in (u, sv, vh))
                digests[name] = factors_digest(ub, sb, vb)
                values[name] = prior_value(kind="matrix", anchor_step=steps[s], name=name, rank=int(sv.numel()),
                                           shape=[int(u.shape[0]), int(vh.shape[1])], u=ub, s=sb, vh=vb,
                                           digest=digests[name])
            source = None
            if self.servicer is not None:  # served on request (counted per reply), only the header goes to the DHT
                self.servicer.hold(s, steps[s], values)
                source = node.swarm.peer_id
            else:
                for name, value in values.items():
                    if not await node.swarm.store_signed(data_key, name, value, ttl):
                        logger.warning("prior %s of stage %d was not stored", name, s)
                    node.counter.add("anchor", len(value["u"]) + len(value["s"]) + len(value["vh"]))
            header = prior_value(kind="header", anchor_step=steps[s], names=sorted(fs), digest=cycle_digest(digests),
                                 final=True, source=source)
            await node.swarm.store_signed(keys.prior_key(node.run_id, s), HEADER_NAME, header, ttl)
        self.cycles += 1
        self.prior_step = min(steps)
        logger.info("anchor cycle %d: published priors of steps %s", self.cycles, steps)


def _checked_meta(frame: dict) -> dict:
    """The fields of a DP log or outer-state reply the anchor acts on, type-checked before anything is applied."""
    ints = {k: frame.get(k) for k in ("opt_step", "dp_seq")}
    if any(not isinstance(v, int) or isinstance(v, bool) or v < 0 for v in ints.values()):
        raise ValueError(f"DP reply: opt_step and dp_seq must be integers >= 0, got {ints}")
    epoch = frame.get("dp_epoch")
    if not isinstance(epoch, str) or not 0 < len(epoch) <= 64:
        raise ValueError("DP reply without a valid epoch")
    return {**ints, "dp_epoch": epoch, "gap": bool(frame.get("gap", False))}


__all__ = ["ANCHOR_SEED_OFFSET", "AnchorRunner", "PriorServicer"]
