"""Stage claiming: pure functions over a snapshot of ``{run}_peers`` (Petals-style, no network).

A stage's *rate* is the tokens per second its fast peers (joining or online) can serve between them: the sum of
their announced capacities (tokens per second of their own forward + backward work). A peer that announced none
yet counts as the median speed of those that did. Speeds carry across stages by the stages' costs (FLOPs per
token, :func:`meshnode.model.stage_costs`; equal when not given): a peer serving stage a at c tokens/s would
serve stage b at ``c x cost_a / cost_b``.

A joining fast peer takes a stage with no fast peer (the lowest index), else the one with the lowest rate; with
no capacity announced anywhere, the fewest fast peers, ties broken by the lower summed throughput, then the
lower stage index.

A running peer moves (rebalancing) when

- a stage is *starved* (no fast peer), or, with no capacity announced anywhere, served by at least two fewer
  fast peers than its own: only peers of the most crowded stage (the lowest index among equals) move, to the
  least served stage (the lowest index among equals; stage 0, whose peers are drivers, only when it has
  none), and of them only the movable one (announced so: a peer pinned to its stage, or an older one, is not)
  with the smallest peer id, so one peer moves at a time and a move never makes the counts worse than one
  apart;
- otherwise by speed: of all moves of one movable peer out of a stage of two or more into another stage
  (not stage 0), the one that raises the slowest stage's rate the most, if by at least :data:`GAIN`: between
  that pair of stages, the smallest id of the movable peers whose move gains that much (a stable choice: which
  of two similar peers' moves gains most flips with their measurements). Stage 0's rate is set by the drivers
  that join, so it counts only when the mover leaves it. The margin keeps measurement noise and a move's own
  cost from making peers move back and forth: a move that pays by ``GAIN`` leaves the reverse move a loss. No
  move by speed is named while a fast peer is in transit (an ``offline`` record not yet expired, or a
  ``joining`` one): a mover counts in no stage until it serves, and a second mover would overshoot.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..protocol.records import PeerRecord


def _serving(peers: Sequence[PeerRecord], num_stages: int) -> list[list[PeerRecord]]:
    out: list[list[PeerRecord]] = [[] for _ in range(num_stages)]
    for p in peers:
        if p.role in ("fast", "driver") and p.state in ("joining", "online") and 0 <= p.stage < num_stages:
            out[p.stage].append(p)
    return out


GAIN = 1.5  # a move by speed must raise the slowest stage's rate by at least this factor


def stage_loads(peers: Sequence[PeerRecord], num_stages: int) -> list[tuple[int, float]]:
    """Per stage: (number of fast peers, summed throughput)."""
    return [(len(ps), sum(p.throughput for p in ps)) for ps in _serving(peers, num_stages)]


def _costs(costs: Sequence[float] | None, num_stages: int) -> list[float]:
    if costs is None:
        return [1.0] * num_stages
    out = [float(c) for c in costs]
    if len(out) != num_stages or not all(c > 0 and c < float("inf") for c in out):
        raise ValueError(f"stage costs must be {num_stages} positive finite numbers, got {costs!r}")
    return out


MIN_CAPACITY = 1e-3  # tokens/s; a capacity announced below this counts as unknown


def _speeds(serving: list[list[PeerRecord]], costs: list[float]) -> list[list[float]] | None:
    """Per stage, per fast peer: its capacity there (tokens/s), an unknown one the median of the known ones carried
    over by cost (the median: one record announcing an absurd capacity must not lend it to every newcomer); None
    when no peer announced a capacity."""
    work = sorted(p.capacity * costs[s] for s, ps in enumerate(serving) for p in ps if p.capacity >= MIN_CAPACITY)
    if not work:
        return None
    mid = len(work) // 2
    typical = work[mid] if len(work) % 2 else (work[mid - 1] + work[mid]) / 2
    return [[p.capacity if p.capacity >= MIN_CAPACITY else typical / costs[s] for p in ps]
            for s, ps in enumerate(serving)]


def in_transit(peers: Sequence[PeerRecord]) -> bool:
    """A fast peer is between stages or setting one up (``offline`` record not yet expired, or ``joining``): its
    speed is counted nowhere, or only as an estimate, until it serves."""
    return any(p.role in ("fast", "driver") and p.state in ("offline", "joining") for p in peers)


def stage_rates(peers: Sequence[PeerRecord], num_stages: int,
                costs: Sequence[float] | None = None) -> list[float] | None:
    """Per stage: the tokens per second its fast peers can serve between them (None: no capacity announced)."""
    speeds = _speeds(_serving(peers, num_stages), _costs(costs, num_stages))
    return None if speeds is None else [sum(v) for v in speeds]


def choose_stage(peers: Sequence[PeerRecord], num_stages: int, exclude: str | None = None,
                 costs: Sequence[float] | None = None) -> int:
    """The stage a joining peer should serve (``exclude``: its own peer id, when re-choosing). A peer joins before it
    has loaded the model, so the daemon passes no ``costs`` then: the rates are the peers' measured ones, and only
    the estimate for peers that announced no capacity yet is not carried by cost."""
    if num_stages <= 0:
        raise ValueError(f"num_stages must be > 0, got {num_stages}")
    peers = [p for p in peers if p.peer_id != exclude]
    loads = stage_loads(peers, num_stages)
    rates = stage_rates(peers, num_stages, costs)
    if rates is None:
        return min(range(num_stages), key=lambda s: (loads[s][0], loads[s][1], s))
    # stage 0 (drivers, each reading a data shard) only when it has no peer, as for a move
    return min((s for s in range(num_stages) if s > 0 or loads[s][0] == 0 or num_stages == 1),
               key=lambda s: (loads[s][0] > 0, rates[s], s))


def starved_stages(peers: Sequence[PeerRecord], num_stages: int) -> list[int]:
    return [s for s, (n, _) in enumerate(stage_loads(peers, num_stages)) if n == 0]


def should_rebalance(peers: Sequence[PeerRecord], num_stages: int, me: str,
                     costs: Sequence[float] | None = None) -> int | None:
    """The stage peer ``me`` should move to, or None (it stays)."""
    serving = _serving(peers, num_stages)
    mine = [s for s, ps in enumerate(serving) if any(p.peer_id == me for p in ps)]
    if not mine:
        return None
    stage = mine[0]
    counts = [len(ps) for ps in serving]
    # stage 0's peers are drivers, each reading a data shard: another one is added only where there is none
    targets = [s for s in range(num_stages) if s > 0 or counts[s] == 0]
    if not targets:
        return None
    movable = [[p.peer_id for p in ps if p.movable or p.peer_id == me] for ps in serving]
    cost = _costs(costs, num_stages)
    speeds = _speeds(serving, cost)
    if speeds is not None and all(counts[s] > 0 for s in targets):
        if in_transit(peers):  # a peer moving now counts nowhere: a second mover would overshoot
            return None
        move = best_move(serving, speeds, cost, movable)
        return move[1] if move is not None and move[0] == me else None
    least = min(targets, key=lambda s: (counts[s], s))
    # the sending stage: the most crowded of those with a peer that can move (pinned drivers in a crowded stage 0
    # must not hold up a move from another crowded stage)
    senders = [s for s in range(num_stages) if movable[s]]
    most = min(senders, key=lambda s: (-counts[s], s))
    if stage != most or counts[stage] < 2 or counts[stage] - counts[least] < (1 if counts[least] == 0 else 2):
        return None
    return least if min(movable[stage]) == me else None


def best_move(serving: list[list[PeerRecord]], speeds: list[list[float]], costs: list[float],
              movable: list[list[str]]) -> tuple[str, int, float] | None:
    """(peer id, target stage, gain) of the move by speed that raises the slowest stage's rate the most, if by
    at least :data:`GAIN`; None when no move does. Of the peers whose move from the best stage to the best target
    gains that much, the smallest peer id goes (not the one whose move gains most: which of two similar peers that
    is flips with the noise of their measurements, and two peers that each read themselves as the mover would both
    go)."""
    num_stages = len(serving)
    rates = [sum(v) for v in speeds]
    best: tuple[float, int, int] | None = None  # (gain, source, target)
    movers: dict[tuple[int, int], list[str]] = {}
    for a, ps in enumerate(serving):
        if len(ps) < 2:
            continue
        counted = [s for s in range(num_stages) if s > 0 or a == 0]  # stage 0 counts when the mover leaves it
        before = min(rates[s] for s in counted)
        if before <= 0:
            continue
        for p, c in zip(ps, speeds[a]):
            if p.peer_id not in movable[a]:
                continue
            for b in range(1, num_stages):
                if b == a:
                    continue
                after = list(rates)
                after[a] -= c
                after[b] += c * costs[a] / costs[b]
                gain = min(after[s] for s in counted) / before
                if gain < GAIN:
                    continue
                movers.setdefault((a, b), []).append(p.peer_id)
                if best is None or (-gain, a, b) < (-best[0], best[1], best[2]):
                    best = (gain, a, b)
    if best is None:
        return None
    return min(movers[best[1], best[2]]), best[2], best[0]


def fixed_routes(cfg) -> bool:
    """Whether the swarm's microbatches keep to fixed routes, one per replica chain: with DP and a moving reference
    (``mask.reference_refresh``), each chain's peers move their stages' references towards their own weights (as
    the in-process mesh does), so both ends of a boundary hold the same reference only within a chain. Every peer
    then takes a chain (:func:`choose_shard` among its stage's peers, announced as its record's ``shard``; a
    driver's chain is its data shard), calls only the next stage's peer of its chain and sends its reference moves
    to its chain's followers only."""
    return bool(cfg.dp.enabled and cfg.mask.reference_refresh)


def choose_shard(peers: Sequence[PeerRecord], me: str, shards: int, current: int | None = None,
                 stage: int = 0) -> int:
    """The data shard (of ``shards`` = dp.replicas) driver ``me`` should read, from the shards the other drivers
    announce: its ``current`` one unless a driver with a smaller peer id holds it too; otherwise a shard no other
    driver holds: at the start, of the free shards the one of its rank among the drivers that hold none yet (two
    drivers starting together take 0 and 1 if they see each other; if not, both take 0, and once their records
    meet the larger peer id moves), later the lowest. With every shard held (more drivers than shards), drivers
    share them by their rank among the drivers.

    With fixed routes (:func:`fixed_routes`) every peer of ``stage`` takes a shard the same way among that stage's
    peers: its replica chain, the route its microbatches take and the reference moves it follows."""
    if shards <= 0:
        raise ValueError(f"shards must be > 0, got {shards}")
    drivers = [p for p in peers if p.stage == stage and p.role in ("driver", "fast")
               and p.state in ("joining", "online") and p.peer_id != me]
    held = {p.shard for p in drivers if p.shard is not None}
    if current is not None and 0 <= current < shards and not any(
            p.shard == current and p.peer_id < me for p in drivers):
        return current
    free = [s for s in range(shards) if s not in held]
    if current is None:  # starting: the drivers that hold no shard yet share the free ones by peer id
        k = sorted({me, *(p.peer_id for p in drivers if p.shard is None)}).index(me)
        if k < len(free):
            return free[k]
    if free:
        return free[0]
    return sorted({me, *(p.peer_id for p in drivers)}).index(me) % shards


__all__ = ["GAIN", "MIN_CAPACITY", "best_move", "choose_shard", "choose_stage", "fixed_routes", "in_transit",
           "should_rebalance", "stage_loads", "stage_rates", "starved_stages"]
