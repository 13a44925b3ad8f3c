"""The peer's view of the swarm: its DHT, the peer snapshot, announcing its record, and routing calls.

:class:`SwarmClient` owns the hivemind DHT (validators: the run's schemas and the RSA signature
validator with this peer's identity key) and its replicated P2P. It keeps a snapshot of
``{run}_peers`` fresh, re-announces this peer's record before it expires, and routes a request to a
peer of a stage (:func:`order_candidates`), retrying on another peer when a call fails (a failed peer is
avoided for a while).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Callable
from typing import Any

import hivemind
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.p2p import PeerID
from hivemind.utils.timed_storage import get_dht_time

from ..protocol import keys
from ..protocol.limits import Limits
from ..protocol.messages import WireError
from ..protocol.records import PeerRecord, make_schema_validator, parse_peers
from ..protocol.servicer import RPCContext, RPCError, RPCServicer, call_rpc

logger = logging.getLogger(__name__)


def order_candidates(peers: list[PeerRecord], inflight: dict[str, int], rng: random.Random | None = None
                     ) -> list[PeerRecord]:
    """The order in which to try the peers of a stage: fewest calls in flight from here first; among those
    tied, the first is drawn at random with weight proportional to its announced capacity (tokens per second
    of its own compute), a peer that has announced none (a newcomer) weighing as much as the average of the
    others. The rest follow by in-flight count, then capacity.

    Always taking the highest capacity among the tied peers starved a newcomer: with one microbatch in flight
    at a time it was never chosen, so it never measured one. Weighing by the tokens a peer *served* per second
    (its announced ``throughput``) fed back on itself: the replica that happened to get more microbatches
    announced more and was chosen more.
    """
    rng = rng or random
    out = list(peers)
    rng.shuffle(out)
    out.sort(key=lambda p: (inflight.get(p.peer_id, 0), -p.capacity))
    if len(out) < 2:
        return out
    least = inflight.get(out[0].peer_id, 0)
    tied = [p for p in out if inflight.get(p.peer_id, 0) == least]
    if len(tied) > 1:
        known = [p.capacity for p in tied if p.capacity > 0]
        floor = sum(known) / len(known) if known else 1.0
        first = rng.choices(tied, weights=[p.capacity if p.capacity > 0 else floor for p in tied])[0]
        out.remove(first)
        out.insert(0, first)
    return out


FULL_REFRESH_PERIOD = 10.0  # seconds between full (every-holder) reads of the peer records
STREAM_CUT_PAUSE_S = 1.0  # how long a peer whose reply stream was cut is passed over (see call_stage)
PARTNER_MEMORY_S = 30.0  # a same-stage peer seen online this recently still counts as a DP partner
OWNER_REPLY_MAX_BYTES = 64 * 1024  # rpc_owner's frames (a public key)
OWNER_CHECK_TIMEOUT_S = 5.0
OWNER_RECHECK_S = 30.0  # a peer id whose owner could not be checked is asked again after this long
OWNER_BIND_S = 600.0  # a checked owner is trusted this long (a peer may restart with another key)
OWNER_CHECKS_IN_FLIGHT = 8  # rpc_owner calls at once; further conflicts wait for the next refresh
OWNER_TABLE_MAX = 4096  # peer ids remembered as asked (older than OWNER_RECHECK_S are forgotten first)


def merge_peers(held: list[PeerRecord], found: list[PeerRecord], now: float,
                bound: dict[str, str] | None = None) -> list[PeerRecord]:
    """``held`` updated with ``found``: per peer the record announced last; records expired by ``now`` dropped.

    A record's ``updated`` time is its publisher's word, and any key can publish a record that names any peer id.
    So a record signed by another owner than the held record of that peer id does not replace it, however new,
    unless ``bound`` (peer id -> the owner that peer answered with over its own authenticated connection,
    :meth:`SwarmClient.check_owner`) names the newcomer's owner; records ``bound`` contradicts are dropped."""
    bound = bound or {}

    def genuine(r: PeerRecord) -> bool:
        return bound.get(r.peer_id, r.owner) == r.owner

    out = {r.peer_id: r for r in held if r.expiration > now and genuine(r)}
    for r in found:
        if not genuine(r):
            continue
        old = out.get(r.peer_id)
        if old is None or (r.updated >= old.updated and (r.owner == old.owner or r.peer_id in bound)):
            out[r.peer_id] = r
    return sorted(out.values(), key=lambda r: (r.stage, r.peer_id))


def owner_conflicts(records: list[PeerRecord], bound: dict[str, str] | None = None) -> set[str]:
    """Peer ids to ask for their owner: claimed by records of two or more owners and not settled by ``bound``, or
    settled for another owner than a record now names (the peer may have restarted with another key). Only ids
    that some record says are serving (``joining`` / ``online``): a rogue's ``offline`` copies of ids nobody
    serves cost no call."""
    bound = bound or {}
    owners: dict[str, set[str]] = {}
    live: set[str] = set()
    for r in records:
        owners.setdefault(r.peer_id, set()).add(r.owner)
        if r.state in ("joining", "online"):
            live.add(r.peer_id)
    return {pid for pid, o in owners.items() if pid in live
            and (len(o) > 1 and pid not in bound or pid in bound and o != {bound[pid]})}


class OwnerServicer(RPCServicer):
    """``{run}.rpc_owner``: this peer's record-signing public key, over the libp2p connection that authenticates its
    peer id. Every peer serves it for as long as its DHT runs; it settles which of two records that name the same
    peer id is that peer's."""

    def __init__(self, owner: str):
        super().__init__(OWNER_REPLY_MAX_BYTES)
        self.owner = owner

    async def rpc_owner(self, request: dict[str, Any], context: RPCContext) -> dict[str, Any]:
        return {"ok": True, "owner": self.owner}


class SwarmError(RuntimeError):
    """The swarm cannot serve a request (no reachable peer of a stage, bootstrap failed...)."""


class ChainError(SwarmError):
    """A microbatch could not be sent on after every retry."""


def start_dht(
    run_id: str, num_stages: int, *, initial_peers: list[str], host_maddrs: list[str], identity,
    client_mode: bool = False, identity_path: str | None = None, timeout: float = 60.0,
) -> hivemind.DHT:
    """Start (and wait for) a hivemind DHT with this run's validators; raise :class:`SwarmError` on failure."""
    validators = [make_schema_validator(run_id, num_stages), RSASignatureValidator(identity)]
    kwargs: dict[str, Any] = {}
    if identity_path:
        kwargs["identity_path"] = identity_path
    try:
        dht = hivemind.DHT(
            initial_peers=initial_peers or None, host_maddrs=host_maddrs, start=True, record_validators=validators,
            client_mode=client_mode, await_ready=False, **kwargs,
        )
        dht.wait_until_ready(timeout=timeout)
    except Exception as exc:
        msg = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        via = ", ".join(initial_peers) or "no initial peer"
        raise SwarmError(f"could not join the swarm via {via}: {msg}") from None
    return dht


class SwarmClient:
    """DHT + P2P of one peer, its snapshot of the swarm, its announcements and its routed calls."""

    def __init__(self, dht: hivemind.DHT, run_id: str, identity, limits: Limits | None = None):
        self.dht = dht
        self.run_id = run_id
        self.identity = identity
        self.owner = keys.owner_tag(identity)
        self.limits = limits
        self.p2p = None
        self.peer_id = dht.peer_id.to_base58()
        self.peers: list[PeerRecord] = []
        self.snapshot_time = 0.0
        self._inflight: dict[str, int] = {}
        self._avoid: dict[str, float] = {}
        self._refresh_lock = asyncio.Lock()
        # a full refresh asks every holder of the peers key and merges their copies; the others stop at the
        # first holder, usually this node's own storage (see refresh)
        self.full_refresh_period = FULL_REFRESH_PERIOD
        self._last_full = -float("inf")
        self._seen: dict[str, tuple[float, int]] = {}  # serving peer id -> (last seen online, stage)
        # peer id -> (the owner it answered with, when): settles records of two owners that name one peer id
        self._bound: dict[str, tuple[str, float]] = {}
        self._owner_asked: dict[str, float] = {}  # peer id -> when its owner was last asked
        self._owner_tasks: set[asyncio.Task] = set()
        self.owner_servicer = OwnerServicer(keys.owner_of(self.owner) or "")

    async def start(self) -> None:
        self.p2p = await self.dht.replicate_p2p()
        await self.owner_servicer.add_p2p_handlers(self.p2p, self.run_id)

    # ---- the snapshot ----------------------------------------------------------------------

    async def refresh(self, full: bool | None = None, max_age: float | None = None) -> list[PeerRecord]:
        """Re-read the peer records. ``full=True`` merges every holder's copy (``latest=True``: each of up to
        ``num_replicas`` holders sends the whole dictionary); ``full=False`` takes the first holder's copy,
        which is this node's own storage whenever it is a holder (no traffic at all). The default is a full
        read every ``full_refresh_period`` seconds and first-holder reads in between. A first-holder copy
        can lack records (a peer that joined late holds none stored before it came), and so can a full read
        whose holders did not answer in time, so both only update the snapshot: each peer's newest record
        wins and records leave when their DHT expiration passes. Before this, each 1 s refresh was a
        full read: on a time-scaled 0.37 Mbit/s link that control traffic took 20-40 % of every uplink."""
        async with self._refresh_lock:
            now = time.monotonic()
            if full is None:
                full = now - self._last_full >= self.full_refresh_period
            elif full and max_age is not None and now - self._last_full < max_age:
                return self.peers  # a full read finished within max_age (perhaps while this call waited)
            found = await self.dht.get(keys.peers_key(self.run_id), latest=full, return_future=True)
            if full:
                self._last_full = time.monotonic()
            # a full read merges too: on a congested link some holders (or all) do not answer in time, and
            # replacing the snapshot with what came back emptied it ("no peer online") while every peer was
            # alive (docs/throughput.md, 2026-12-03 fourth session); records still leave when they expire
            found = parse_peers(found)
            bound = self.bound_owners()
            for pid in owner_conflicts([*self.peers, *found], bound):
                self._ask_owner(pid)
            self.peers = merge_peers(self.peers, found, get_dht_time(), bound)
            self.snapshot_time = time.monotonic()
            self._remember(self.peers)
            return self.peers

    def bound_owners(self) -> dict[str, str]:
        """Peer id -> the owner that peer answered with, for the answers younger than ``OWNER_BIND_S``; this peer's
        own id always to its own key (it cannot dial itself to settle a rogue's record of its id)."""
        now = time.monotonic()
        for pid in [p for p, (_, t) in self._bound.items() if now - t > OWNER_BIND_S]:
            del self._bound[pid]
        out = {pid: owner for pid, (owner, _) in self._bound.items()}
        own = keys.owner_of(self.owner)
        if own:
            out[self.peer_id] = own
        return out

    def _ask_owner(self, peer_id: str) -> None:
        """Start :meth:`check_owner` for ``peer_id``: at most once per ``OWNER_RECHECK_S`` per id and
        ``OWNER_CHECKS_IN_FLIGHT`` at once, so that records naming many ids cannot make this peer dial them all."""
        now = time.monotonic()
        if (self.p2p is None or len(self._owner_tasks) >= OWNER_CHECKS_IN_FLIGHT
                or now - self._owner_asked.get(peer_id, -float("inf")) < OWNER_RECHECK_S):
            return
        if len(self._owner_asked) >= OWNER_TABLE_MAX:
            for pid in [p for p, t in self._owner_asked.items() if now - t >= OWNER_RECHECK_S]:
                del self._owner_asked[pid]
            if len(self._owner_asked) >= OWNER_TABLE_MAX:
                return  # the table is full of recent asks: this one waits
        self._owner_asked[peer_id] = now
        task = asyncio.create_task(self.check_owner(peer_id))
        self._owner_tasks.add(task)
        task.add_done_callback(self._owner_tasks.discard)

    async def check_owner(self, peer_id: str) -> str | None:
        """Ask ``peer_id`` itself which key signs its records (``rpc_owner``; the libp2p connection authenticates the
        peer id) and trust that owner's records for it from now on. None when it cannot be reached or answers
        nonsense; the snapshot then keeps the record it held first."""
        try:
            reply = await call_rpc(self.p2p, PeerID.from_base58(peer_id), f"{self.run_id}.rpc_owner", {},
                                   max_bytes=OWNER_REPLY_MAX_BYTES, timeout=OWNER_CHECK_TIMEOUT_S,
                                   connect_timeout=OWNER_CHECK_TIMEOUT_S)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            logger.info("records of two owners name peer %s, which did not say which is its own: %s", peer_id[-8:],
                        exc)
            return None
        owner = reply.get("owner")
        if not isinstance(owner, str) or not owner.startswith("ssh-rsa "):
            logger.warning("peer %s answered rpc_owner with no key", peer_id[-8:])
            return None
        self._bound[peer_id] = (owner, time.monotonic())
        impostors = [r for r in self.peers if r.peer_id == peer_id and r.owner != owner]
        self.peers = [r for r in self.peers if r not in impostors]
        logger.warning("records of two owners name peer %s: it answered for %s; the other's records are ignored",
                       peer_id[-8:], owner[8:24] + "...")
        return owner

    async def answers(self, peer_id: str, timeout: float = 10.0) -> bool:
        """Whether ``peer_id`` answers a call now (``rpc_owner``): a record of a peer that died stays in the DHT until
        it expires."""
        try:
            await call_rpc(self.p2p, PeerID.from_base58(peer_id), f"{self.run_id}.rpc_owner", {},
                           max_bytes=OWNER_REPLY_MAX_BYTES, timeout=timeout, connect_timeout=timeout)
            return True
        except asyncio.CancelledError:
            raise
        except Exception:  # noqa: BLE001 (unreachable, or not a peer of this run)
            return False

    async def refresh_full(self, max_age: float = 1.0) -> list[PeerRecord]:
        """A full read of the records, unless one finished less than ``max_age`` seconds ago (several callers
        confirming the same thing at once share one read)."""
        return await self.refresh(full=True, max_age=max_age)

    def _remember(self, peers: list[PeerRecord]) -> None:
        now = time.monotonic()
        for r in peers:
            if r.state == "offline":  # left gracefully: not a partner any more
                self._seen.pop(r.peer_id, None)
            elif r.state == "online" and r.role in ("fast", "driver"):
                self._seen[r.peer_id] = (now, r.stage)

    def recent_partners(self, stage: int, within_s: float = PARTNER_MEMORY_S) -> int:
        """Other serving peers of ``stage`` seen online in the last ``within_s`` seconds. A record can drop out
        of the snapshot for a moment (an announcement late on a congested link lets it expire) while its
        peer is alive; DP asks this, not the snapshot, whether to look for a group at all."""
        now = time.monotonic()
        return sum(1 for pid, (t, s) in self._seen.items()
                   if s == stage and pid != self.peer_id and now - t <= within_s)

    async def get_key(self, key: str, latest: bool = True) -> Any:
        """``key``'s value. ``latest=True`` asks every node on the search path and merges their subkeys (each
        holder sends its whole value: up to ``num_replicas`` copies); ``latest=False`` stops at the first holder."""
        return await self.dht.get(key, latest=latest, return_future=True)

    async def announce(self, record: PeerRecord, ttl: float) -> bool:
        record.peer_id = self.peer_id
        record.updated = time.time()
        return await self.dht.store(
            keys.peers_key(self.run_id), record.to_value(), get_dht_time() + ttl, subkey=self.owner,
            return_future=True,
        )

    async def store_signed(self, key: str, name: str, value: dict[str, Any], ttl: float) -> bool:
        return await self.dht.store(key, value, get_dht_time() + ttl, subkey=self.owner + b"/" + name.encode(),
                                    return_future=True)

    # ---- routing ---------------------------------------------------------------------------

    def candidates(self, stage: int, exclude: set[str] = frozenset(),
                   include_avoided: bool = False, chain: int | None = None) -> list[PeerRecord]:
        """The online peers of ``stage`` in the order to try them; ``chain``: only those of that replica chain (their
        announced shard; fixed routes, :func:`.claim.fixed_routes`)."""
        now = time.monotonic()
        out = [
            p for p in self.peers
            if p.stage == stage and p.role in ("fast", "driver") and p.state == "online"
            and p.peer_id != self.peer_id and p.peer_id not in exclude
            and (include_avoided or self._avoid.get(p.peer_id, 0) < now)
            and (chain is None or p.shard == chain)
        ]
        return order_candidates(out, self._inflight)

    def avoid(self, peer_id: str, seconds: float = 15.0) -> None:
        self._avoid[peer_id] = time.monotonic() + seconds

    async def call_stage(
        self, stage: int, build: Callable[[int], dict[str, Any]], handler: str = "rpc_forward", *,
        stall_timeout: float = 60.0, is_stopping: Callable[[], bool] = lambda: False, chain: int | None = None,
    ) -> dict[str, Any]:
        """Call ``handler`` on a peer of ``stage``, retrying on other peers; ``build(nonce, peer_id)`` makes the
        request for the peer it goes to.

        At most ``limits.max_retries + 1`` attempts: untried peers first, then (when every peer of the stage
        was tried) one tried before whose pause has passed. A peer that could not be reached or timed out is
        avoided for 15 s. One whose stream was cut mid-reply (``WireError``: a reset connection, not a dead
        peer) is asked again at once, the first time in a call and unless another call found it dead (it
        answers a retry of what it computed without computing or counting it again); cut a second time, it is
        avoided for ``STREAM_CUT_PAUSE_S``, so that a dead replica plus cut streams on the live one cost a
        second, not ``stall_timeout`` spent waiting for a peer that was never tried (a 61 s stall in a CI run
        of the churn test). Only when no peer of the stage is in the snapshot does it wait, up to
        ``stall_timeout``; a stage whose peers keep answering "busy" is waited on as long, then given up.
        ``chain``: only peers of that replica chain (fixed routes)."""
        assert self.limits is not None and self.p2p is not None
        tried: set[str] = set()
        recut: set[str] = set()  # peers whose stream was cut once in this call (and were asked again at once)
        again: PeerRecord | None = None
        errors: list[str] = []
        attempts = 0
        deadline = time.monotonic() + stall_timeout
        while attempts < self.limits.max_retries + 1:
            if again is not None:
                peer, again = again, None
            else:
                cands = self.candidates(stage, tried, chain=chain) or self.candidates(stage, chain=chain)
                if not cands:
                    if time.monotonic() > deadline or is_stopping():
                        break
                    await asyncio.sleep(0.5)  # wait for a peer of that stage to (re)appear or its pause to pass
                    await self.refresh(full=not self.candidates(stage, include_avoided=True, chain=chain))
                    continue
                peer = cands[0]
            tried.add(peer.peer_id)
            attempts += 1
            self._inflight[peer.peer_id] = self._inflight.get(peer.peer_id, 0) + 1
            try:
                return await call_rpc(
                    self.p2p, PeerID.from_base58(peer.peer_id), f"{self.run_id}.{handler}",
                    build(random.getrandbits(31), peer.peer_id), max_bytes=self.limits.max_message_bytes,
                    timeout=self.limits.rpc_timeout, connect_timeout=self.limits.connect_timeout,
                )
            except RPCError as exc:
                if str(exc).startswith("BusyError"):
                    if time.monotonic() > deadline or is_stopping():  # a full stage is not waited on forever
                        errors.append(f"{peer.peer_id[-8:]}: busy past the {stall_timeout:.0f} s stall timeout")
                        break
                    attempts -= 1  # not a failure: come back to it shortly
                    tried.discard(peer.peer_id)
                    self.avoid(peer.peer_id, 0.3)
                    continue
                errors.append(f"{peer.peer_id[-8:]}: {exc}")
                logger.warning("stage %d peer %s refused: %s", stage, peer.peer_id[-8:], exc)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # dead peer, reset stream, timeout
                errors.append(f"{peer.peer_id[-8:]}: {type(exc).__name__} {exc}")
                if (isinstance(exc, WireError) and peer.peer_id not in recut
                        and self._avoid.get(peer.peer_id, 0) < time.monotonic()):  # not found dead by another call
                    # the first cut stream of this call: ask the same peer again at once. It holds the request's
                    # result (or is still computing it) and answers the retry from there; another replica would
                    # compute it again and count its gradient twice (3 cuts in run 19's 4 minutes)
                    recut.add(peer.peer_id)
                    again = peer
                    logger.warning("stage %d peer %s: stream cut (%s); asking it again", stage, peer.peer_id[-8:], exc)
                    continue
                logger.warning("stage %d peer %s failed (%s: %s); retrying on another peer", stage,
                               peer.peer_id[-8:], type(exc).__name__, exc)
                self.avoid(peer.peer_id, STREAM_CUT_PAUSE_S if isinstance(exc, WireError) else 15.0)
            finally:
                self._inflight[peer.peer_id] -= 1
        none = "no peer online" if chain is None else f"no peer of chain {chain} online"
        raise ChainError(f"stage {stage}: no peer could take the microbatch ({'; '.join(errors) or none})")

    async def shutdown(self) -> None:
        for task in list(self._owner_tasks):
            task.cancel()
        if self._owner_tasks:
            await asyncio.gather(*self._owner_tasks, return_exceptions=True)
        if self.p2p is not None:
            with contextlib.suppress(Exception):
                await self.p2p.shutdown()
        self.dht.shutdown()


__all__ = ["ChainError", "OwnerServicer", "SwarmClient", "SwarmError", "merge_peers", "owner_conflicts", "start_dht"]
