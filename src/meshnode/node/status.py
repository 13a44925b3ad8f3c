"""Swarm status from the DHT alone: per-stage summary, health lines and bytes per token by axis.

:func:`summarize` and :func:`swarm_health` are pure functions of a peer snapshot; ``meshnode status``
renders them (rich table or ``--json``) and the daemon logs the same health lines.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from ..compression import AXES
from ..protocol.records import PeerRecord


@dataclass
class StageSummary:
    stage: int
    layers: list[int] = field(default_factory=list)
    fast_peers: list[str] = field(default_factory=list)
    anchor_peers: list[str] = field(default_factory=list)
    tokens_per_s: float = 0.0  # served (the stage's share of the load)
    capacity: float = 0.0  # what its peers could serve: the sum of their announced capacities (tokens/s)
    step: int = 0
    loss: float | None = None
    prior_step: int | None = None
    prior_age: int | None = None
    skipped_steps: int = 0  # optimizer steps its peers skipped for a non-finite gradient (weights kept)
    # mask.reference_check: the largest relative difference its peers measured between a caller's sampled reference
    # and their own, and the microbatches they refused for one above mask.reference_tolerance
    ref_mismatch: float = 0.0
    ref_refused: int = 0


def _live(peers: Sequence[PeerRecord]) -> list[PeerRecord]:
    return [p for p in peers if p.state in ("joining", "online")]


def num_stages_of(peers: Sequence[PeerRecord]) -> int:
    stages = [p.stage + 1 for p in peers if p.stage >= 0]
    return max([p.num_stages for p in peers] + stages + [0])


def driver_step(peers: Sequence[PeerRecord]) -> int:
    steps = [p.driver_step or 0 for p in _live(peers) if p.role == "driver"]
    steps += [p.driver_step or 0 for p in peers if p.role == "driver"]
    return max(steps, default=0)


def slowest_driver_step(peers: Sequence[PeerRecord], drivers: int) -> int:
    """The step of the least advanced of ``drivers`` expected drivers (0 until that many are live): with DP
    replicas the drivers progress at their own pace, and a run is done only when every one of them is."""
    steps = sorted(p.driver_step or 0 for p in _live(peers) if p.role == "driver")
    return steps[0] if steps and len(steps) >= max(1, drivers) else 0


def summarize(peers: Sequence[PeerRecord], num_stages: int | None = None) -> list[StageSummary]:
    n = num_stages if num_stages is not None else num_stages_of(peers)
    out = [StageSummary(stage=s) for s in range(n)]
    now_step = driver_step(peers)
    for p in _live(peers):
        if p.role == "anchor":
            for s in range(n):
                out[s].anchor_peers.append(p.peer_id)
                if p.prior_step is not None:
                    cur = out[s].prior_step
                    out[s].prior_step = p.prior_step if cur is None else max(cur, p.prior_step)
            continue
        if not 0 <= p.stage < n:
            continue
        st = out[p.stage]
        st.fast_peers.append(p.peer_id)
        st.layers = st.layers or list(p.layers)
        st.tokens_per_s += p.throughput
        st.capacity += p.capacity
        st.step = max(st.step, p.step)
        st.skipped_steps += p.skipped_steps
        st.ref_mismatch = max(st.ref_mismatch, p.ref_mismatch)
        st.ref_refused += p.ref_refused
        if p.loss is not None and (p.stage == n - 1 or st.loss is None):
            st.loss = p.loss
        if p.prior_step is not None:
            st.prior_step = p.prior_step if st.prior_step is None else max(st.prior_step, p.prior_step)
    for st in out:
        if st.prior_step is not None:
            st.prior_age = max(0, now_step - st.prior_step)
    return out


def swarm_health(peers: Sequence[PeerRecord], num_stages: int | None = None, *, anchor_expected: bool = False,
                 max_staleness: int | None = None) -> list[str]:
    """Human-readable health lines; the first word is ``ok``, ``warning`` or ``error``."""
    live = _live(peers)
    if not live:
        return ["error: no peer online"]
    stages = summarize(peers, num_stages)
    lines = []
    for st in stages:
        if not st.fast_peers:
            lines.append(f"error: stage {st.stage} has no peer: pipeline stalled")
    if not any(p.role == "driver" for p in live):
        lines.append("error: no driver (stage 0 peer): nothing trains")
    anchors = [p for p in live if p.role == "anchor"]
    if anchor_expected and not anchors:
        lines.append("warning: no anchor peer: fast peers train without a prior")
    refs: dict[str, list[str]] = {}
    for p in live:
        if p.reference is not None:
            refs.setdefault(p.reference, []).append(p.peer_id[-8:])
    if len(refs) > 1:
        held = "; ".join(f"{d}: {', '.join(ids)}" for d, ids in sorted(refs.items()))
        lines.append(f"error: peers code against different reference models ({held}): a boundary between two of "
                     "them is refused")
    for st in stages:
        if st.skipped_steps:
            lines.append(f"warning: stage {st.stage} skipped {st.skipped_steps} optimizer steps for a non-finite "
                         "gradient (weights kept; a bad payload or an overflow upstream)")
    for st in stages:
        if st.ref_refused:
            lines.append(f"warning: stage {st.stage} refused {st.ref_refused} microbatches whose sender computes the "
                         f"reference model differently (relative difference up to {st.ref_mismatch:.3g}, above "
                         "mask.reference_tolerance): peers on other devices' kernels; mask.reference_tolerance or "
                         "train.bf16 = false may bring them together")
    if max_staleness is not None:
        for st in stages:
            if st.prior_age is not None and st.prior_age > max_staleness:
                lines.append(f"warning: stage {st.stage} prior is {st.prior_age} steps old (stale)")
    if not lines:
        fast = sum(len(st.fast_peers) for st in stages)
        lines.append(f"ok: {len(stages)} stages served by {fast} fast peers, {len(anchors)} anchor peers")
    return lines


def bytes_per_token(peers: Sequence[PeerRecord]) -> dict[str, float]:
    """Bytes sent per trained token, per axis, over every peer ever seen (tokens = the drivers' tokens)."""
    tokens = sum(p.tokens for p in peers if p.role == "driver")
    totals = dict.fromkeys(AXES, 0)
    for p in peers:
        for axis in AXES:
            totals[axis] += int(p.bytes.get(axis, 0))
    out = {a: (totals[a] / tokens if tokens else 0.0) for a in AXES}
    out["total"] = sum(out[a] for a in AXES)
    return out


def status_json(peers: Sequence[PeerRecord], run: str, num_stages: int | None = None) -> dict[str, Any]:
    return {
        "run": run,
        "driver_step": driver_step(peers),
        "stages": [asdict(s) for s in summarize(peers, num_stages)],
        "peers": [{k: v for k, v in asdict(p).items()} for p in peers],
        "health": swarm_health(peers, num_stages),
        "bytes_per_token": bytes_per_token(peers),
        "tokens": sum(p.tokens for p in peers if p.role == "driver"),
    }


def render_table(status: dict[str, Any]):
    """A rich renderable of :func:`status_json`'s output."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    table = Table(title=f"swarm {status['run']} (driver step {status['driver_step']})")
    for col in ("stage", "layers", "fast peers", "anchors", "tokens/s", "capacity", "step", "skipped", "loss",
                "prior age"):
        table.add_column(col, justify="right" if col not in ("fast peers", "layers") else "left")
    for st in status["stages"]:
        layers = "-".join(str(x) for x in st["layers"][:2]) if st["layers"] else "?"
        table.add_row(
            str(st["stage"]), layers, ", ".join(p[-8:] for p in st["fast_peers"]) or "[red]none",
            str(len(st["anchor_peers"])), f"{st['tokens_per_s']:.0f}",
            f"{st.get('capacity', 0.0):.0f}", str(st["step"]), str(st.get("skipped_steps", 0)),
            "-" if st["loss"] is None else f"{st['loss']:.4f}",
            "-" if st["prior_age"] is None else str(st["prior_age"]),
        )
    bpt = status["bytes_per_token"]
    axes = "  ".join(f"{k} {v:.1f}" for k, v in bpt.items())
    health = [Text(h, style="green" if h.startswith("ok") else "yellow" if h.startswith("warning") else "red")
              for h in status["health"]]
    return Group(table, Text(f"bytes/token: {axes}"), *health)


__all__ = ["StageSummary", "bytes_per_token", "driver_step", "num_stages_of", "render_table", "status_json",
           "summarize", "swarm_health"]
