"""Fast peers read the anchor prior of their stage and feed the spectral optimizer.

An anchor publishes, per stage and cycle, a small signed header under ``{run}_prior_{stage}`` naming the
cycle's step, its matrices and a digest over the digests of their fp16 factors (``U (m, r)``, ``s (r,)``,
``Vh (r, n)``). A fast peer polls only the headers (about 1 kB); the factors (for the 135M model at rank 8,
~144 kB per stage) are read once per new cycle, from where the header says:

* ``source`` set (``anchor.priors = "rpc"``, the default): from that anchor peer, ``rpc_prior``. The anchor
  uploads one copy per fast peer that reads it, and the DHT carries one small value per stage and cycle.
* no ``source`` (``"dht"``): from ``{run}_priordata_{stage}``, one signed value per matrix. Every value
  is stored on each of the key's DHT replicas (5 by default), which on a slow link made one cycle 28
  stores and ~1.4 MB from the anchor's uplink (docs/throughput.md, fourth session).

Before the header/factor split every poll (every 2 s) read every factor again, which on a slow link kept
a fast peer's downlink busy with the same prior.

The RSA signature validator of the DHT already guarantees that a value under a subkey holding key K was
written by K; here a prior is accepted only when K is listed in ``anchor.allowed_keys``, the header
and every matrix agree on the step, every shape matches the parameter, every value is finite, the
digests match (this is what binds factors read by RPC to the signed header), and the prior is not older
than ``anchor.max_staleness`` steps of this replica.
Anything else is ignored and logged (once per cause and anchor step); a cycle refused for its content
is not read again.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from hivemind.p2p import PeerID

from ..optim import PriorError
from ..protocol import keys
from ..protocol.limits import FRAME_SLACK
from ..protocol.messages import WireError, tensor_from_bytes
from ..protocol.records import PriorRecordSchema, cycle_digest, factors_digest
from ..protocol.servicer import collect_stream
from .swarm import FULL_REFRESH_PERIOD

logger = logging.getLogger(__name__)

HEADER_NAME = "__header__"


class PriorIncomplete(ValueError):
    """The factors do not (yet) match the header: the cycle may still be being written. Retried later."""


def split_prior_subkey(subkey: Any) -> tuple[str | None, str | None]:
    """``(owner public key, matrix name)`` of a prior subkey ``[owner:KEY]/NAME``."""
    owner = keys.owner_of(subkey)
    if owner is None or b"]/" not in subkey:
        return None, None
    return owner, subkey.split(b"]/", 1)[1].decode(errors="replace")


def validate_prior(
    entries: dict[str, dict], shapes: dict[str, tuple[int, int]]
) -> tuple[int, dict[str, tuple[Any, Any, Any]]]:
    """Check one anchor's entries for one stage; return ``(anchor_step, {name: (U, s, Vh)})`` or raise ValueError."""
    header = entries.get(HEADER_NAME)
    if header is None or header.get("kind") != "header":
        raise ValueError("no header: the cycle is incomplete")
    step = header["anchor_step"]
    names = header.get("names") or []
    if set(names) != set(shapes):
        raise ValueError(f"header names {len(names)} matrices, this stage targets {len(shapes)}")
    out = {}
    for name in names:
        e = entries.get(name)
        if e is None or e.get("kind") != "matrix" or e.get("anchor_step") != step:
            raise PriorIncomplete(f"{name}: missing or from another cycle")
        m, n = shapes[name]
        r = e.get("rank")
        if e.get("shape") != [m, n] or not isinstance(r, int) or not 1 <= r <= min(m, n):
            raise ValueError(f"{name}: shape {e.get('shape')} rank {r} does not fit the parameter ({m}, {n})")
        if factors_digest(e["u"] or b"", e["s"] or b"", e["vh"] or b"") != e.get("digest"):
            raise ValueError(f"{name}: digest mismatch")
        try:
            u = tensor_from_bytes(e["u"], "float16", [m, r]).float()
            s = tensor_from_bytes(e["s"], "float16", [r]).float()
            vh = tensor_from_bytes(e["vh"], "float16", [r, n]).float()
        except WireError as exc:
            raise ValueError(f"{name}: {exc}") from None
        if bool((s < 0).any()):
            raise ValueError(f"{name}: negative singular values")
        out[name] = (u, s, vh)
    if header.get("digest") != cycle_digest({name: entries[name]["digest"] for name in names}):
        raise ValueError("the header's digest does not match its matrices")
    return step, out


def factor_bytes(shapes: dict[str, tuple[int, int]], rank: int) -> dict[str, int]:
    """The most fp16 factor bytes per matrix at ``rank`` (0 = full thin SVD): what a reader accepts."""
    out = {}
    for name, (m, n) in shapes.items():
        r = min(m, n) if rank <= 0 else min(rank, m, n)
        out[name] = 2 * r * (m + n + 1)
    return out


def _frame_factor_bytes(frame: dict) -> int:
    return sum(len(frame[k]) for k in ("u", "s", "vh") if isinstance(frame.get(k), bytes))


class PriorReader:
    """Polls this stage's prior key and pushes accepted priors into the worker's optimizer."""

    def __init__(self, node):
        self.node = node
        self.allowed = set(node.cfg.anchor.allowed_keys)
        self.applied_step = -1
        self.ignored = 0
        self.refused: set[tuple[str, int]] = set()  # (owner, anchor step) refused for its content
        self.incomplete = False  # the last read of the factors missed a matrix: the next one merges every holder
        # the header is polled often: one holder's copy (usually this node's own storage: no traffic) on most
        # polls, every holder's merged copy every ``full_period`` seconds. Merging on every 2 s poll of every
        # fast peer was most of what an anchor added to the swarm's idle traffic (docs/throughput.md)
        self.full_period = FULL_REFRESH_PERIOD
        self._last_full = -float("inf")
        self._logged: set[tuple[str, int, str]] = set()
        opt = node.host.worker.optimizer
        self.shapes = {name: (int(opt.params[name].shape[0]), int(opt.params[name].shape[1])) for name in opt.filters}
        self.max_factor_bytes = factor_bytes(self.shapes, node.cfg.spectral.rank)

    def _log_once(self, owner: str, step: int, why: str) -> None:
        key = (owner[-16:], step, why[:40])
        self.ignored += 1
        if key not in self._logged:
            self._logged.add(key)
            logger.warning("prior from %s (step %s) ignored: %s", owner[-16:], step, why)

    async def loop(self) -> None:
        while True:
            await asyncio.sleep(self.node.opts.prior_period)
            try:
                await self.poll()
            except Exception as exc:
                logger.warning("prior poll failed: %r", exc)

    @staticmethod
    def _by_owner(found: Any) -> dict[str, dict[str, dict]]:
        """``{owner: {name: value}}`` of a dictionary key's schema-valid, owner-signed entries."""
        by_owner: dict[str, dict[str, dict]] = {}
        if found is None or not isinstance(found.value, dict):
            return by_owner
        for subkey, item in found.value.items():
            owner, name = split_prior_subkey(subkey)
            if owner is None or not isinstance(item.value, dict):
                continue
            try:
                PriorRecordSchema.parse_obj(item.value)
            except Exception:
                continue
            by_owner.setdefault(owner, {})[name] = item.value
        return by_owner

    async def _read_from_anchor(self, head: dict) -> dict[str, dict]:
        """``{name: value}`` of one cycle's factors from the anchor the header names (``rpc_prior``)."""
        node = self.node
        source = head["source"]
        if not isinstance(source, str):
            raise ValueError("source is not a peer id")
        limits = node.host.limits
        frames = await collect_stream(
            node.swarm.p2p, PeerID.from_base58(source), f"{node.run_id}.rpc_prior",
            {"run": node.run_id, "stage": node.stage, "anchor_step": head["anchor_step"]},
            max_bytes=max(limits.max_message_bytes, max(self.max_factor_bytes.values(), default=0) + FRAME_SLACK),
            timeout=limits.rpc_timeout, max_total=sum(self.max_factor_bytes.values()), size=_frame_factor_bytes,
        )
        out: dict[str, dict] = {}
        for frame in frames:
            value = {k: v for k, v in frame.items() if k not in ("ok", "last")}
            PriorRecordSchema.parse_obj(value)
            name = value.get("name")
            if value.get("kind") != "matrix" or name not in self.shapes or name in out:
                raise ValueError(f"unexpected or repeated matrix {name!r}")
            if _frame_factor_bytes(value) > self.max_factor_bytes[name]:
                raise ValueError(f"{name}: factors larger than rank {node.cfg.spectral.rank} allows")
            out[name] = value
        return out

    async def poll(self) -> int | None:
        """Read the headers; for a new cycle from an allowed anchor read its factors, check and apply them."""
        node = self.node
        full = time.monotonic() - self._last_full >= self.full_period
        heads = self._by_owner(await node.swarm.get_key(keys.prior_key(node.run_id, node.stage), latest=full))
        if full:
            self._last_full = time.monotonic()
        fresh = {}
        for owner, entries in heads.items():
            head = entries.get(HEADER_NAME) or {}
            hstep = head.get("anchor_step", -1)
            if owner not in self.allowed:
                self._log_once(owner, hstep, "signed by a key not in anchor.allowed_keys")
                continue
            if head.get("kind") != "header" or hstep <= self.applied_step or (owner, hstep) in self.refused:
                continue
            age = node.host.opt_step - hstep
            if age > node.cfg.anchor.max_staleness:
                self._log_once(owner, hstep, f"stale ({age} > {node.cfg.anchor.max_staleness} steps)")
                continue
            fresh[owner] = head
        if not fresh:
            return None
        data = None
        best = None
        for owner, head in fresh.items():
            if head.get("source") is not None:
                try:
                    got = await self._read_from_anchor(head)
                except Exception as exc:  # unreachable, refused, too large, malformed: tried again next poll
                    self._log_once(owner, head["anchor_step"], f"reading the factors from its anchor failed: {exc!r}")
                    continue
            else:
                if data is None:
                    # the factors are large: read one holder's copy, and merge every holder's only after an
                    # incomplete read
                    data = self._by_owner(await node.swarm.get_key(keys.prior_data_key(node.run_id, node.stage),
                                                                   latest=self.incomplete))
                    self.incomplete = False
                got = data.get(owner, {})
            entries = {**got, HEADER_NAME: head}
            try:
                step, factors = validate_prior(entries, self.shapes)
            except PriorIncomplete as exc:
                if head.get("source") is not None:  # the anchor served its whole cycle: missing is wrong
                    self.refused.add((owner, head["anchor_step"]))
                else:
                    self.incomplete = True
                self._log_once(owner, head["anchor_step"], str(exc))
                continue
            except (ValueError, KeyError, TypeError) as exc:
                self.refused.add((owner, head["anchor_step"]))
                self._log_once(owner, head["anchor_step"], str(exc))
                continue
            if best is None or step > best[0]:
                best = (step, factors, owner)
        if best is None:
            return None
        step, factors, owner = best
        try:
            await node.host.run(node.host.worker.optimizer.push_prior_factors, factors, step)
        except PriorError as exc:
            self._log_once(owner, step, str(exc))
            return None
        self.applied_step = step
        node.prior_step = step
        logger.info("stage %d: applied the anchor prior of step %d (%d matrices)", node.stage, step, len(factors))
        return step


__all__ = ["HEADER_NAME", "PriorIncomplete", "PriorReader", "factor_bytes", "split_prior_subkey", "validate_prior"]
