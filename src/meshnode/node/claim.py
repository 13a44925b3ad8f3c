"""Stage claiming: pure functions over a snapshot of ``{run}_peers`` (Petals-style, no network).

A joining fast peer takes the stage with the least serving capacity: the fewest fast peers
(joining or online), ties broken by the lower summed throughput, then the lower stage index. A
running peer moves (rebalancing) when a stage is *starved* (no fast peer), or served by at least two
fewer fast peers than its own: only peers of the most crowded stage (the lowest index among equals)
move, to the least served stage (the lowest index among equals; stage 0, whose peers are drivers, only
when it has none), and of them only the movable one
(announced so: a peer pinned to its stage, or an older one, is not) with the smallest peer id, so one
peer moves at a time and a move never makes the counts worse than one apart.
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


def stage_loads(peers: Sequence[PeerRecord], num_stages: int) -> list[tuple[int, float]]:
    """Per stage: (number of fast peers, summed throughput)."""
    return [(len(ps), sum(p.throughput for p in ps)) for ps in _serving(peers, num_stages)]


def choose_stage(peers: Sequence[PeerRecord], num_stages: int, exclude: str | None = None) -> int:
    """The stage a joining peer should serve (``exclude``: its own peer id, when re-choosing)."""
    if num_stages <= 0:
        raise ValueError(f"num_stages must be > 0, got {num_stages}")
    loads = stage_loads([p for p in peers if p.peer_id != exclude], num_stages)
    return min(range(num_stages), key=lambda s: (loads[s][0], loads[s][1], s))


def starved_stages(peers: Sequence[PeerRecord], num_stages: int) -> list[int]:
    return [s for s, (n, _) in enumerate(stage_loads(peers, num_stages)) if n == 0]


def should_rebalance(peers: Sequence[PeerRecord], num_stages: int, me: str) -> int | None:
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
    least = min(targets, key=lambda s: (counts[s], s))
    # the sending stage: the most crowded of those with a peer that can move (pinned drivers in a crowded stage 0
    # must not hold up a move from another crowded stage)
    movable = [[p.peer_id for p in ps if p.movable or p.peer_id == me] for ps in serving]
    senders = [s for s in range(num_stages) if movable[s]]
    most = min(senders, key=lambda s: (-counts[s], s))
    if stage != most or counts[stage] < 2 or counts[stage] - counts[least] < (1 if counts[least] == 0 else 2):
        return None
    return least if min(movable[stage]) == me else None


def choose_shard(peers: Sequence[PeerRecord], me: str, shards: int, current: int | None = None) -> int:
    """The data shard (of ``shards`` = dp.replicas) driver ``me`` should read, from the shards the other drivers
    announce: its ``current`` one unless a driver with a smaller peer id holds it too; otherwise a shard no other
    driver holds: at the start, of the free shards the one of its rank among the drivers that hold none yet (two
    drivers starting together take 0 and 1 if they see each other; if not, both take 0, and once their records
    meet the larger peer id moves), later the lowest. With every shard held (more drivers than shards), drivers
    share them by their rank among the drivers."""
    if shards <= 0:
        raise ValueError(f"shards must be > 0, got {shards}")
    drivers = [p for p in peers if p.role == "driver" and p.state in ("joining", "online") and p.peer_id != me]
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


__all__ = ["choose_shard", "choose_stage", "should_rebalance", "stage_loads", "starved_stages"]
