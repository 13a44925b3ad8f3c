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

from ..protocol import keys
from ..protocol.limits import MIB, WEIGHT_CHUNK_BYTES
from ..protocol.records import PeerRecord
from ..protocol.servicer import stream_rpc
from .host import weights_from_chunks
from .status import num_stages_of
from .swarm import SwarmClient, SwarmError, start_dht

logger = logging.getLogger(__name__)


class SwarmReader:
    """A client-mode DHT joined to a swarm, for reading (use as a context manager)."""

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

    def stage_weights(self, stages: int | None = None, timeout: float = 120.0) -> tuple[dict[int, dict], dict]:
        """``({stage: state_dict}, {stage: meta})`` from one online peer per stage; raises when a stage has none."""
        return asyncio.run(self._stage_weights(stages, timeout))

    async def _stage_weights(self, stages: int | None, timeout: float):
        await self.client.start()
        try:
            peers = await self.client.refresh(full=True)
            n = stages if stages is not None else num_stages_of(peers)
            if n == 0:
                raise SwarmError(f"no peer of run {self.run_id} is online")
            out, meta = {}, {}
            for s in range(n):
                cands = sorted(
                    (p for p in peers if p.stage == s and p.role in ("fast", "driver") and p.state == "online"),
                    key=lambda p: (-p.dp_syncs, -p.step),  # the freshest DP sync first
                )
                if not cands:
                    raise SwarmError(f"stage {s} has no online peer: cannot fetch its weights")
                last: Exception | None = None
                for p in cands[:3]:
                    try:
                        chunks = []
                        async for item in stream_rpc(
                            self.client.p2p, PeerID.from_base58(p.peer_id), f"{self.run_id}.rpc_get_weights",
                            {"run": self.run_id}, max_bytes=WEIGHT_CHUNK_BYTES + 4 * MIB, timeout=timeout,
                        ):
                            chunks.append(item)
                        out[s] = weights_from_chunks(chunks)
                        meta[s] = {"peer": p.peer_id, "opt_step": chunks[-1].get("opt_step"),
                                   "dp_syncs": chunks[-1].get("dp_syncs")}
                        break
                    except Exception as exc:
                        last = exc
                        logger.warning("weights of stage %d from %s failed: %r", s, p.peer_id[-8:], exc)
                if s not in out:
                    raise SwarmError(f"stage {s}: no peer returned its weights ({last})")
            return out, meta
        finally:
            await self.client.p2p.shutdown()


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


def export_from_swarm(cfg, initial_peers: list[str], out, cache_dir=None) -> dict[str, Any]:
    """Fetch every stage's weights from the swarm and write a Hugging Face directory."""
    from pathlib import Path

    from ..model import assemble_hf_model, cut_model, load_model

    with SwarmReader(initial_peers, cfg.run_id) as reader:
        weights, meta = reader.stage_weights(cfg.model.stages)
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


__all__ = ["SwarmReader", "export_from_swarm", "fetch_status", "heldout_loss_of"]
