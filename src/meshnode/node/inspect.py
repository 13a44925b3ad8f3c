"""Client-side views of a running swarm: the status snapshot and each stage's current weights.

Both start a short-lived client-mode DHT (no serving), read ``{run}_peers`` and, for weights, stream
``rpc_get_weights`` from an online peer of each stage. ``meshnode status``, ``meshnode export
--initial-peers`` and ``meshnode demo`` use them.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import torch
from hivemind.p2p import PeerID

from ..model import average_state_dicts
from ..protocol import keys
from ..protocol.limits import MIB, WEIGHT_CHUNK_BYTES
from ..protocol.records import PeerRecord
from ..protocol.servicer import stream_rpc
from .host import weights_from_chunks
from .status import num_stages_of
from .swarm import SwarmClient, SwarmError, start_dht

logger = logging.getLogger(__name__)


class SwarmReader:
    """A client-mode DHT joined to a swarm, for reading (use as a context manager). One weight fetch per reader
    (:meth:`stage_weights` or :meth:`peer_weights`): each starts the client's p2p and shuts it down."""

    def __init__(self, initial_peers: list[str], run_id: str, timeout: float = 30.0):
        if not initial_peers:
            raise SwarmError("--initial-peers is required (a multiaddr of any peer of the swarm)")
        self.run_id = run_id
        identity = keys.load_or_create_identity(None)
        self.dht = start_dht(run_id, 0, initial_peers=initial_peers, host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                             identity=identity, client_mode=True, timeout=timeout)
        self.client = SwarmClient(self.dht, run_id, identity)

    def __enter__(self) -> SwarmReader:
        return self

    def __exit__(self, *exc) -> None:
        self.dht.shutdown()

    def peers(self) -> list[PeerRecord]:
        return asyncio.run(self.client.refresh(full=True))

    def stage_weights(self, stages: int | None = None, timeout: float = 120.0,
                      average: bool = False) -> tuple[dict[int, dict], dict]:
        """``({stage: state_dict}, {stage: meta})`` from one online peer per stage; raises when a stage has none.
        ``average``: each stage's weights are the exact average of its replicas that keep up with its DP syncs
        (:func:`replicas_to_average`), what one closing uncompressed all-reduce would leave them with; with
        ``dp.keep_residual`` the replicas differ by what their rounds did not send, and their mean scored as
        well as uncompressed DP in the mesh (docs/quality.md, thirty-fifth session)."""
        return asyncio.run(self._stage_weights(stages, timeout, average))

    def peer_weights(self, peer_ids: list[str], timeout: float = 120.0) -> list[dict[str, torch.Tensor]]:
        """Each named peer's current weights of its stage (like :meth:`stage_weights`, once per reader)."""
        async def fetch():
            await self.client.start()
            try:
                return [(await self._fetch(p, timeout))[0] for p in peer_ids]
            finally:
                await self.client.p2p.shutdown()

        return asyncio.run(fetch())

    async def _fetch(self, peer_id: str, timeout: float) -> tuple[dict[str, torch.Tensor], dict]:
        chunks = []
        async for item in stream_rpc(
            self.client.p2p, PeerID.from_base58(peer_id), f"{self.run_id}.rpc_get_weights",
            {"run": self.run_id}, max_bytes=WEIGHT_CHUNK_BYTES + 4 * MIB, timeout=timeout,
        ):
            chunks.append(item)
        return weights_from_chunks(chunks), {"peer": peer_id, "opt_step": chunks[-1].get("opt_step"),
                                             "dp_syncs": chunks[-1].get("dp_syncs")}

    async def _stage_weights(self, stages: int | None, timeout: float, average: bool = False):
        await self.client.start()
        try:
            return reduce_replicas(await self.collect_replicas(stages, timeout, average), average)
        finally:
            await self.client.p2p.shutdown()

    async def collect_replicas(self, stages: int | None, timeout: float, average: bool = False
                               ) -> dict[int, list[tuple[dict[str, torch.Tensor], dict]]]:
        """Each stage's fetched replicas as (weights, meta), the freshest DP sync first, on a started client.

        Without ``average`` one replica a stage (the first of up to 3 candidates that answers); with it the
        replicas :func:`replicas_to_average` picks, those :func:`usable_replica` rejects left out (the first one
        answering is the reference layout). A stage with no online peer or no usable answer is a
        :class:`SwarmError`."""
        peers = await self.client.refresh(full=True)
        n = stages if stages is not None else num_stages_of(peers)
        if n == 0:
            raise SwarmError(f"no peer of run {self.run_id} is online")
        out: dict[int, list[tuple[dict[str, torch.Tensor], dict]]] = {}
        for s in range(n):
            cands = sorted(
                (p for p in peers if p.stage == s and p.role in ("fast", "driver") and p.state == "online"),
                key=lambda p: (-p.dp_syncs, -p.step),  # the freshest DP sync first
            )
            if not cands:
                raise SwarmError(f"stage {s} has no online peer: cannot fetch its weights")
            got: list[tuple[dict, dict]] = []
            last: Exception | None = None
            for p in replicas_to_average(cands) if average else cands[:3]:
                try:
                    got.append(await self._fetch(p.peer_id, timeout))
                except Exception as exc:
                    last = exc
                    logger.warning("weights of stage %d from %s failed: %r", s, p.peer_id[-8:], exc)
                    continue
                if not average:
                    break
            if not got:
                raise SwarmError(f"stage {s}: no peer returned its weights ({last})")
            out[s] = [(w, m) for w, m in got if usable_replica(w, got[0][0], s, m["peer"])] if average else got
            if not out[s]:
                raise SwarmError(f"stage {s}: no replica's weights are usable (see the warnings)")
        return out


def reduce_replicas(replicas: dict[int, list[tuple[dict[str, torch.Tensor], dict]]], average: bool):
    """(weights, meta) by stage from :meth:`SwarmReader.collect_replicas`: each stage's first replica as it is,
    or with ``average`` the exact float32 mean of its replicas (meta: the peers, their steps, how many)."""
    out, meta = {}, {}
    for s, kept in replicas.items():
        if not average:
            out[s], meta[s] = kept[0]
            continue
        out[s] = average_state_dicts([w for w, _ in kept])
        meta[s] = {"peers": [m["peer"] for _, m in kept], "opt_steps": [m["opt_step"] for _, m in kept],
                   "dp_syncs": kept[0][1]["dp_syncs"], "averaged": len(kept)}
    return out, meta


MAX_AVERAGED = 8  # replicas of a stage an averaged fetch takes at most (the freshest first)


def replicas_to_average(cands: list[PeerRecord]) -> list[PeerRecord]:
    """The replicas of a stage whose weights an averaged fetch takes (``cands`` sorted freshest DP sync first):
    those that trained at least one step and applied at least as many DP syncs as the freshest one less, at most
    :data:`MAX_AVERAGED`; the freshest alone if no other qualifies. One sync behind is a round a replica missed
    or ran alone (the tiny demo's drivers ended at 5 and 4); a replica further behind is not keeping up with the
    group (it joined late, or its rounds fail) and is left out rather than pulling the mean back, and so is one
    that never trained (step 0: the pretrained weights)."""
    top = cands[0]
    near = [p for p in cands if p.dp_syncs >= top.dp_syncs - 1 and p.step > 0]
    return near[:MAX_AVERAGED] or [top]


def usable_replica(w: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], stage: int, peer: str) -> bool:
    """Whether a replica's weights can go into a stage's mean: the first replica's names and shapes, and finite
    floats. Otherwise a warning, and it is left out (one bad replica does not spoil the export)."""
    if w.keys() != ref.keys() or any(w[k].shape != ref[k].shape for k in ref):
        why = "another layout than the first replica's"
    elif any(t.is_floating_point() and not bool(torch.isfinite(t).all()) for t in w.values()):
        why = "non-finite values"
    else:
        return True
    logger.warning("stage %d: %s's weights have %s; not averaged", stage, peer[-8:], why)
    return False


def fetch_status(initial_peers: list[str], run_id: str, timeout: float = 30.0) -> list[PeerRecord]:
    with SwarmReader(initial_peers, run_id, timeout) as reader:
        return reader.peers()


@torch.no_grad()
def heldout_loss_of(cfg, stage_weights: dict[int, dict[str, torch.Tensor]] | None, cache_dir=None) -> float:
    """Held-out loss (unmasked) of the model with the given per-stage weights (None: the starting weights)."""
    from ..data import heldout_batches, make_tokenizer, prepare_corpus
    from ..model import cut_model, load_model
    from ..stage import causal_lm_loss

    model, hf_tok = load_model(cfg.model, cache_dir)
    tok = make_tokenizer(cfg.model, hf_tok)
    corpus = prepare_corpus(cfg.data, tok, cache_dir)
    batches = heldout_batches(corpus.heldout, cfg.train.batch_size, cfg.train.eval_batches)
    stages = cut_model(model, cfg.model.stages, cfg.model.boundaries)
    if stage_weights is not None:
        for s, module in stages.items():
            module.load_state_dict(stage_weights[s])
    total = 0.0
    for ids in batches:
        x = ids
        for s in range(cfg.model.stages):
            x = stages[s](x)
        total += float(causal_lm_loss(x, ids))
    return total / len(batches)


def export_from_swarm(cfg, initial_peers: list[str], out, cache_dir=None, average: bool = False) -> dict[str, Any]:
    """Fetch every stage's weights from the swarm (``average``: the mean of its replicas that keep up with its DP
    syncs, :func:`replicas_to_average`) and write a Hugging Face directory."""
    from pathlib import Path

    from ..model import assemble_hf_model, cut_model, load_model

    with SwarmReader(initial_peers, cfg.run_id) as reader:
        weights, meta = reader.stage_weights(cfg.model.stages, average=average)
    model, hf_tok = load_model(cfg.model, cache_dir)
    config = model.config
    stages = cut_model(model, cfg.model.stages, cfg.model.boundaries)
    for s, module in stages.items():
        module.load_state_dict(weights[s])
    config.tie_word_embeddings = False
    hf = assemble_hf_model(config, [stages[s] for s in range(cfg.model.stages)])
    hf.to(torch.float32)
    out = Path(out)
    hf.save_pretrained(str(out), safe_serialization=True)
    if hf_tok is not None:
        hf_tok.save_pretrained(str(out))
    return {"out": str(out), "stages": meta}


__all__ = ["SwarmReader", "export_from_swarm", "fetch_status", "heldout_loss_of", "reduce_replicas",
           "replicas_to_average"]
