"""The moving reference in the swarm (``mask.reference_refresh`` with ``mask.reference_refresh_rank``).

Reference coding (:mod:`meshnode.stage.reference`) codes each boundary against what a frozen copy of the model
computes for the same tokens; every peer holds a copy of every stage it computes (:func:`~meshnode.stage.reference.
peer_plan`). As in the in-process mesh (:mod:`meshnode.mesh.refresh`), after every ``mask.reference_refresh`` (K)
optimizer steps the peer of a stage makes the best rank-r move of its stage's reference towards its live weights
(:mod:`meshnode.stage.moves`) and sends it to every online peer whose plan computes that stage (its followers),
with ``rpc_reference_move``; its bytes count on the ``ref`` axis, once per follower it reached.

When they are applied: every microbatch of driver step n is coded against version ``n // K`` of every stage's
reference. A peer brings its reference there when the first microbatch of such a step reaches it (the gate has let
no microbatch of the step in before, and every microbatch of the step before has completed: no result of the old
reference is still in use), waiting for a move that has not arrived yet up to :data:`MOVE_WAIT_S`; then every
worker drops its residual maps (:meth:`~meshnode.stage.StageWorker.reference_moved`), as the mesh does. A move that
arrives early is held until then; one not pushed within :data:`FETCH_AFTER_S` (a lost push) is asked for from
the peers of its stage, then from any peer that follows it (``rpc_reference_move`` with ``fetch``). The forward
request names the sender's reference by its digest, which chains
the moves applied (:meth:`~meshnode.stage.ReferenceModel.apply_move`); the receiver compares it once its own
reference is at the microbatch's version, so both ends of a boundary code against the same weights or the
microbatch is refused.

A peer's state (its checkpoint, what a joining partner copies) holds every move it applied and holds
(:meth:`SwarmReference.state_dict`): a restarted peer replays them and codes against the same reference again.

With DP the swarm keeps fixed routes (:func:`~meshnode.node.claim.fixed_routes`): every peer takes a replica chain,
calls only the next stage's peer of its chain and sends its moves to its chain's followers only, so each chain moves
its own reference towards its own weights, as each replica chain of the in-process mesh does. A peer that joins with
no state of its chain (a new peer, or one that loaded another chain's weights) starts from the pretrained reference
and catches up: the moves it lacks are fetched in order from its chain's peers when a microbatch needs them. A second
peer of a stage in one chain would move its own reference too: its moves are refused (the first sender of a version
wins) and a warning names it.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Awaitable, Callable
from typing import Any

from ..protocol.messages import WireError, parse_reference_move, reference_move_chain, reference_move_request
from ..stage import StageError
from ..stage.moves import Move, check_move, make_move, move_nbytes
from ..stage.reference import follower_stages, peer_plan

logger = logging.getLogger(__name__)

MOVE_WAIT_S = 120.0  # how long a microbatch waits for a reference move that has not arrived
FETCH_AFTER_S = 5.0  # a move not pushed within this long is asked for (a lost push), then again as often
MAX_EARLY_VERSIONS = 2  # moves a peer holds ahead of the version it codes against, per stage

# push(stages, request) -> the number of followers that took it
Push = Callable[[list[int], dict[str, Any]], Awaitable[int]]
# fetch(stage, version, first) -> (the peer that answered, its reference_move_request), or None if no peer holds it;
# ``first``: a peer to ask before the others (the driver of the microbatch that needs it), or None
Fetch = Callable[[int, int, str | None], Awaitable[tuple[str, dict[str, Any]] | None]]


def _needed(stage: int, num_stages: int, mode: str) -> list[int]:
    """The stages whose reference a peer of ``stage`` computes (its own included)."""
    prefix, suffixes = peer_plan(stage, num_stages, mode)
    return sorted({stage, *prefix, *suffixes})


class SwarmReference:
    """One peer's side of the moving reference: makes and sends its stage's moves, takes the others' and applies
    every move when a microbatch of the step it belongs to arrives (see the module docstring)."""

    def __init__(self, host, push: Push | None, fetch: Fetch | None = None,
                 horizon: Callable[[], int] | None = None, chain: Callable[[], int | None] | None = None):
        cfg = host.cfg
        self.host = host
        self.period = cfg.mask.reference_refresh
        self.rank = cfg.mask.reference_refresh_rank
        self.bits = cfg.mask.reference_refresh_bits
        self.stage, self.num_stages = host.stage, host.num_stages
        self.reference = host.worker.reference
        if self.reference is None or not self.period or not self.rank:
            raise ValueError("a moving reference needs mask.reference, mask.reference_refresh and "
                             "mask.reference_refresh_rank")
        self.needed = _needed(self.stage, self.num_stages, cfg.mask.reference)  # the stages its reference computes
        self.followers = follower_stages(self.stage, self.num_stages, cfg.mask.reference)
        self.push = push
        self.fetch = fetch
        # the newest driver step the swarm's signed records show: a catch-up fetches no move beyond its version (+
        # MAX_EARLY_VERSIONS), whatever step an unauthenticated forward request names
        self.horizon = horizon
        self.chain = chain or (lambda: None)  # this peer's replica chain (fixed routes), named in what it sends
        self.fetched = 0  # moves this peer asked for after their push did not come
        self.pending: dict[int, dict[int, Move]] = {s: {} for s in self.needed}  # stage -> version -> move
        self.senders: dict[tuple[int, int], str] = {}  # (stage, version) -> the peer it came from
        self.moves_sent = 0
        self.history: list[tuple[int, int, Move]] = []  # every move applied, in order: a restart replays them
        self._arrived = asyncio.Condition()
        self._apply_lock = asyncio.Lock()
        self._fetch_lock = asyncio.Lock()  # one microbatch asks the swarm for missing moves (or makes a late one)
        self._make_lock = asyncio.Lock()  # a late move of this stage is made once, however many ask for it
        # pending and history change together under this lock, on the loop or the host's thread: a state taken on
        # the thread (state_dict) sees every move in one of them exactly once
        self._book = threading.Lock()
        self._tasks: set[asyncio.Task] = set()
        # boundary -> the stages both of its ends compute (the digest a forward request names covers those only)
        self.shared = {b: sorted(set(_needed(b, self.num_stages, cfg.mask.reference))
                                 & set(_needed(b + 1, self.num_stages, cfg.mask.reference)))
                       for b in range(self.num_stages - 1)}

    def has_moved(self) -> bool:
        """Whether this peer's reference has taken or holds any move (it is then its chain's)."""
        with self._book:
            return bool(self.history) or any(self.pending.values())

    def version_of(self, step: int) -> int:
        return step // self.period

    def boundary_digest(self, boundary: int) -> str:
        """The digest the two ends of ``boundary`` compare: the weights the moves started from and the moves of the
        stages both compute (:meth:`~meshnode.stage.ReferenceModel.digest_for`)."""
        return self.reference.digest_for(self.shared[boundary])

    # ---- this stage's moves ----------------------------------------------------------------

    async def after_step(self, opt_step: int) -> None:
        """The host's after-step hook: after every K-th step, this stage's move, held for the next step and sent
        to its followers (in the background: the gate opens meanwhile, and a follower waits for it)."""
        nxt = self.host.last_step_served + 1  # the driver step of the next microbatch (= opt_step in one chain)
        if nxt % self.period or nxt <= 0:
            return
        version = self.version_of(nxt)
        if version in self.pending[self.stage]:
            return  # made already, late, when a peer asked for it (held_move)
        if version != self.reference.versions[self.stage] + 1:
            logger.warning("stage %d: step %d would make reference move %d, but the reference holds version %d of "
                           "this stage; no move", self.stage, nxt, version, self.reference.versions[self.stage])
            return
        await self._make_and_send(version)

    async def _make_and_send(self, version: int) -> None:
        """This stage's move ``version``, held for its step and sent to the followers in the background."""
        move = await self.host.run(self._make)
        async with self._arrived:
            self._hold(self.stage, version, move)
            self._arrived.notify_all()
        if self.push is not None and self.followers:
            request = reference_move_request(run=self.host.run_id, stage=self.stage, version=version, move=move,
                                             chain=self.chain())
            task = asyncio.create_task(self._send(version, request, move_nbytes(move)))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def _make(self) -> Move:
        held = dict(self.reference.stages[self.stage].named_parameters())
        live = {n: p.detach() for n, p in self.host.worker.module.named_parameters()}
        move = make_move(held, live, self.rank, self.bits)
        return {n: {k: t.cpu() for k, t in parts.items()} for n, parts in move.items()}  # as sent and kept

    async def _send(self, version: int, request: dict[str, Any], nbytes: int) -> None:
        try:
            reached = await self.push(self.followers, request)
        except Exception as exc:  # noqa: BLE001 (the followers wait and refuse; this peer goes on)
            logger.warning("stage %d: reference move %d was not sent: %r", self.stage, version, exc)
            return
        self.host.worker.count("ref", nbytes * reached)
        self.moves_sent += 1
        logger.info("stage %d: reference move %d (%d bytes) sent to %d followers", self.stage, version, nbytes,
                    reached)

    # ---- the others' moves -----------------------------------------------------------------

    async def receive(self, request: dict[str, Any], sender: str, own: bool = False,
                      fetched: tuple[int, int] | None = None) -> dict[str, Any]:
        """``rpc_reference_move``: a move of another stage, checked and held until its step (WireError if it is
        malformed, of a stage or version this peer does not expect, or from a second peer of that stage). ``own``:
        a move of this peer's own stage that it fetched (made by the stage's peer before this one restarted).
        ``fetched``: the (stage, version) this peer asked for, in order (:meth:`_fetch_missing`): the move must be
        that one, may be however far ahead of its reference (a peer that joined late catches up), and need not come
        from the stage's sender (a follower may answer)."""
        stage, version, move = parse_reference_move(request, run=self.host.run_id, num_stages=self.num_stages)
        if fetched is not None and (stage, version) != fetched:
            raise WireError(f"asked for reference move {fetched[1]} of stage {fetched[0]}, sent move {version} of "
                            f"stage {stage}")
        chain, mine = reference_move_chain(request), self.chain()
        if chain != mine:  # fixed routes: a sender with an old view of the chains (or a peer of no chain, or none)
            raise WireError(f"a reference move of replica chain {chain}: this peer is in chain {mine}")
        if (stage == self.stage and not own) or stage not in self.needed:
            raise WireError(f"a reference move of stage {stage}: this peer (stage {self.stage}) does not follow it")
        held = dict(self.reference.stages[stage].named_parameters())
        try:
            check_move(move, held, self.rank, self.bits)
        except ValueError as exc:
            raise WireError(str(exc)) from None
        async with self._arrived:
            if version in self.pending[stage] or version <= self.reference.versions[stage]:
                first = self.senders.get((stage, version))
                if first is not None and first != sender and not fetched:  # two peers of a stage (and chain)
                    raise WireError(f"reference move {version} of stage {stage} came from peer {first[-8:]} already: "
                                    "a moving reference follows one peer per stage (one replica chain) in this "
                                    "version of meshnode")
                return {"ok": True, "held": True}  # a resend: taken already
            if version > self.reference.versions[stage] + MAX_EARLY_VERSIONS and not fetched:
                raise WireError(f"reference move {version} of stage {stage} is more than {MAX_EARLY_VERSIONS} ahead "
                                f"of version {self.reference.versions[stage]} held here")
            self._hold(stage, version, move)
            if not fetched:  # a peer that replaced the stage's last one may send the next
                self.senders[(stage, version)] = sender
            self._arrived.notify_all()
        return {"ok": True}

    # ---- applying them ---------------------------------------------------------------------

    def _missing(self, target: int) -> list[int]:
        return [s for s in self.needed
                if not all(v in self.pending[s] for v in range(self.reference.versions[s] + 1, target + 1))]

    async def at_step(self, step: int, driver: str | None = None) -> None:
        """Bring this peer's reference to the version of driver step ``step`` before a microbatch of it is
        computed: StageError if it is already past it, or a move has not arrived within :data:`MOVE_WAIT_S`
        (each microbatch waits on its own, not behind another's wait). ``driver``: the microbatch's driver, asked
        first for a missing move (it coded the microbatch against them)."""
        target = self.version_of(step)
        ahead = [s for s in self.needed if self.reference.versions[s] > target]
        if ahead:
            raise StageError(f"stage {self.stage}: a microbatch of step {step} is coded against reference version "
                             f"{target}, and this peer's reference of stage {ahead[0]} has moved to "
                             f"{self.reference.versions[ahead[0]]}; refused")
        if all(self.reference.versions[s] >= target for s in self.needed):
            return
        deadline = asyncio.get_running_loop().time() + MOVE_WAIT_S
        while True:
            left = deadline - asyncio.get_running_loop().time()
            async with self._arrived:
                try:
                    await asyncio.wait_for(self._arrived.wait_for(lambda: not self._missing(target)),
                                           max(0.0, min(left, FETCH_AFTER_S if self.fetch else left)))
                    break
                except asyncio.TimeoutError:
                    missing = self._missing(target)
            if left <= FETCH_AFTER_S or self.fetch is None:
                raise StageError(f"stage {self.stage}: reference move {target} of stage(s) {missing} did not arrive "
                                 f"within {MOVE_WAIT_S:.0f} s (its peer left, or this peer joined after it was "
                                 "sent)")
            async with self._fetch_lock:  # the microbatches waiting beside it find what it fetched
                if self._missing(target):
                    await self._fetch_missing(target, driver, deadline)
        async with self._apply_lock:  # one microbatch applies; the others find the reference there
            moves = [(s, v, self.pending[s][v]) for s in self.needed
                     for v in range(self.reference.versions[s] + 1, target + 1) if v in self.pending[s]]
            if moves:
                # shielded: the thread applies them whatever happens to this call, and the bookkeeping is its own
                await asyncio.shield(self.host.run(self._apply, moves))
                logger.info("stage %d: reference at version %d for step %d (%d moves applied)", self.stage, target,
                            step, len(moves))
        async with self._arrived:
            self.senders = {k: p for k, p in self.senders.items() if k[1] >= self.reference.versions[k[0]]}
        if any(self.reference.versions[s] < target for s in self.needed):
            raise StageError(f"stage {self.stage}: the reference did not reach version {target} (a move failed to "
                             "apply; see the log)")

    async def _fetch_missing(self, target: int, first: str | None = None, deadline: float | None = None) -> None:
        """Ask the swarm for each move up to ``target`` not held (a push that was lost, or never reached this peer)
        and take it as if pushed; not beyond :attr:`horizon`'s version + :data:`MAX_EARLY_VERSIONS`, nor past
        ``deadline`` (the loop's clock)."""
        loop = asyncio.get_running_loop()
        if self.horizon is not None:
            target = min(target, self.version_of(max(self.horizon(), 0)) + MAX_EARLY_VERSIONS)
        for s in self._missing(target):
            for v in range(self.reference.versions[s] + 1, target + 1):
                if v in self.pending[s]:
                    continue
                if deadline is not None and loop.time() > deadline:
                    return
                try:
                    got = await self.fetch(s, v, first)
                    if (got is None and s == self.stage and not self.pending[s] and v == target
                            and v == self.reference.versions[s] + 1):
                        await self._make_late(v)  # its own next move, which no peer holds: this peer restarted
                        continue
                    if got is None:
                        break
                    await self.receive(got[1], got[0], own=s == self.stage, fetched=(s, v))
                    self.fetched += 1
                    logger.warning("stage %d: reference move %d of stage %d was not pushed here; fetched it from %s",
                                   self.stage, v, s, got[0][-8:])
                except Exception as exc:  # noqa: BLE001 (a bad answer: the wait goes on until its deadline)
                    logger.warning("stage %d: fetching reference move %d of stage %d failed: %r", self.stage, v, s,
                                   exc)
                    break

    async def _make_late(self, version: int) -> None:
        """This stage's move ``version``, made now from the live weights: its previous peer died before it reached
        anyone (and this peer restarted from a checkpoint older than it), so every peer takes this one instead."""
        async with self._make_lock:  # two askers at once: one move
            if version in self.pending[self.stage] or version <= self.reference.versions[self.stage]:
                return
            logger.warning("stage %d: reference move %d of this stage is held by no peer (its maker stopped before "
                           "sending it); making it now from this peer's weights", self.stage, version)
            await self._make_and_send(version)

    async def held_move(self, stage: int, version: int) -> dict[str, Any]:
        """``rpc_reference_move`` with ``fetch``: the move (stage, version) as pushed, if this peer holds it (applied
        or pending); WireError if not. The next move of this peer's own stage that it does not hold is made now
        (this peer restarted from a checkpoint older than it, and the asker has already asked the followers, which
        would hold it had the previous process sent it)."""
        if (stage == self.stage and not self.pending[stage] and version == self.reference.versions[stage] + 1):
            await self._make_late(version)
        with self._book:
            move = self.pending.get(stage, {}).get(version)
            if move is None:
                move = next((m for s, v, m in self.history if (s, v) == (stage, version)), None)
        if move is None:
            raise WireError(f"reference move {version} of stage {stage} is not held by this peer")
        self.host.worker.count("ref", move_nbytes(move))  # what the asker is sent
        return reference_move_request(run=self.host.run_id, stage=stage, version=version, move=move,
                                      chain=self.chain())

    def _hold(self, stage: int, version: int, move: Move) -> None:
        with self._book:
            self.pending[stage] = {**self.pending[stage], version: move}

    def _apply(self, moves: list[tuple[int, int, Move]], restored: bool = False) -> None:
        """Apply ``moves`` in order (each only if it is the next version of its stage), moving each from pending to
        history as it goes; on the host's thread."""
        applied = 0
        for s, v, move in moves:
            if v != self.reference.versions[s] + 1:
                continue
            try:
                self.reference.apply_move(s, move)
            except ValueError as exc:  # checked on arrival; a non-finite result is dropped, and the step waits
                logger.error("stage %d: reference move %d of stage %d not applied: %s", self.stage, v, s, exc)
                with self._book:
                    self.pending[s] = {k: m for k, m in self.pending[s].items() if k != v}
                break
            with self._book:
                self.history.append((s, v, move))
                self.pending[s] = {k: m for k, m in self.pending[s].items() if k != v}
            applied += 1
        if applied and not restored:  # a restored state's fits are those made after these moves
            self.host.worker.reference_moved()

    # ---- state -----------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Every move applied and every one held for a later step (what a restart needs to code against the same
        reference as the peers that went on: the moves are not sent again). Taken on the host's thread."""
        with self._book:
            return {"applied": [[s, v, m] for s, v, m in self.history],
                    "pending": [[s, v, m] for s in sorted(self.pending) for v, m in sorted(self.pending[s].items())]}

    def load_state_dict(self, state: Any, fits_restored: bool = True) -> None:
        """Replay a :meth:`state_dict` onto a reference that has taken a prefix of its moves (a new peer's: none);
        ValueError, with nothing changed, if a move does not fit (checked first) or the reference moved otherwise.
        On the host's thread, before the peer serves."""
        if not isinstance(state, dict) or not isinstance(state.get("applied"), list) or not isinstance(
                state.get("pending"), list):
            raise ValueError("not a reference moves state")
        entries = []
        for entry in (*state["applied"], *state["pending"]):
            if not isinstance(entry, (list, tuple)) or len(entry) != 3 or not all(
                    isinstance(x, int) and not isinstance(x, bool) for x in entry[:2]):
                raise ValueError("a reference moves state entry is not [stage, version, move]")
            entries.append(tuple(entry))
        applied, pending = entries[:len(state["applied"])], entries[len(state["applied"]):]
        done = [(s, v) for s, v, _ in self.history]
        if [(s, v) for s, v, _ in applied[:len(done)]] != done:
            raise ValueError("the state's reference moves do not continue those this peer applied")
        versions = list(self.reference.versions)
        for s, v, move in applied[len(done):]:
            if s not in self.needed or v != versions[s] + 1:
                raise ValueError(f"reference move {v} of stage {s} does not follow version {versions[s]}")
            check_move(move, dict(self.reference.stages[s].named_parameters()), self.rank, self.bits)
            versions[s] = v
        for s, v, move in pending:
            if s not in self.needed or v <= versions[s]:
                raise ValueError(f"held reference move {v} of stage {s} is not after version {versions[s]}")
            check_move(move, dict(self.reference.stages[s].named_parameters()), self.rank, self.bits)
        with self._book:
            self.pending = {s: {} for s in self.needed}
        self._apply(list(applied[len(done):]), restored=fits_restored)
        for s, v, move in pending:
            self._hold(s, v, move)

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


__all__ = ["FETCH_AFTER_S", "MOVE_WAIT_S", "SwarmReference"]
