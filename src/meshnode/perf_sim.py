r"""Event-level cost model of the swarm: the nested chain, the step gate and fair-shared links, simulated.

:func:`meshnode.perf.predict_tokens_per_s` is closed-form: a steady-state pipeline with a fill-and-drain
term per step. On emulated links it over-predicted by 19-37 % (``docs/throughput.md``), because the
swarm does not pipeline the way that formula assumes: a driver sends its ``m`` microbatches of a step
at once, and TCP shares every access link fairly between the flows on it, so they cross each hop
together and then queue for compute. This module replays that schedule instead of summarising it.

What is simulated (pure Python, no torch, deterministic):

* **Peers.** ``R_s`` replicas of stage ``s``; the ``R_0`` replicas of stage 0 are the drivers. Every peer
  has a full-duplex access link (``bandwidth_bps`` each way) and one compute thread (a FIFO executor,
  as :class:`meshnode.node.host.StageHost`).
* **Links.** Every transfer is a flow from one peer's uplink to another's downlink. Messages between one
  pair of peers share one connection and go in order (libp2p multiplexes all streams of a peer pair
  over one TCP connection; a message is written whole); the active messages of different connections
  get max-min fair rates (progressive filling) over the uplink and downlink capacities, re-rated
  whenever one starts or ends. A message is delivered ``latency_s + message_overhead_s`` after its last
  byte leaves (the overhead: what a message costs besides its bytes, e.g. serialisation and RPC layers;
  measure it on an unshaped run).
* **Token buckets** (``burst_bytes`` > 0). Each access link, each way, is a token bucket as ``tbf`` shapes
  it: tokens accrue at the link rate up to ``burst_bytes``, bytes sent use them up, and a message that
  starts on links holding ``k`` tokens (the fewer of its uplink's and downlink's) has its first ``k``
  bytes through at once. Traffic keeps a loaded link's bucket empty; after an idle gap a short message
  costs little more than its latency. On the time-scaled links (0.37 Mbit/s, a 6 kB bucket: 0.13 s of
  line rate) a whole M95 microbatch fits in it; at 200 Mbit/s (50 kB: 2 ms) it is negligible.
* **The nested chain** (``docs/swarm.md``). A driver computes the forward of each of its ``m``
  microbatches and sends each to a stage-1 peer, chosen as the one with the fewest of this sender's
  microbatches in flight (ties round robin: the swarm's routing breaks them at random). Stage ``s``
  forwards, sends on, and when the gradient comes back runs its backward and replies upstream. The
  last stage runs forward and backward back to back.
* **The step gate.** A replica steps its optimizer after ``m`` completed backward passes, once nothing is
  in flight on it; forwards that arrive meanwhile wait. A driver starts its next step when all ``m``
  of its microbatches are back and it has stepped.
* **DP** (``dp_inner_steps`` > 0). After every ``dp_inner_steps``-th optimizer step a replica syncs: the
  replicas of its stage meet (the sync starts when the last of them arrives, plus ``dp_matchmaking_s``),
  then each sends ``2 (R-1)/R`` of ``dp_bytes[s]`` to the others and receives as much. A replica whose
  partners do not come within ``dp_timeout_s`` syncs alone (no bytes). With
  ``dp_blocking`` the replica's gate stays closed until its sync is done (``node/dp.py`` before
  ``dp.overlap``); without it the sync's flows only compete for bandwidth.
* **Anchor** (``node/anchor.py``'s cycle). An anchor peer (its own link) pulls ``snapshot_bytes[s]``
  from replica 0 of each stage, one stage after the other, runs its pass (``anchor_compute_s``) and
  publishes ``prior_bytes[s]`` per stage: with ``prior_holders = 0`` straight to every replica of stage
  ``s``; with ``prior_holders = k`` as the DHT does it, a store to the ``k`` peers that hold the key (all
  of them when the swarm has at most ``k`` peers; a reader that holds the key reads it locally, others
  read one holder's copy). The next cycle starts ``anchor_period`` steps of driver 0 after the last one
  was published.

Tokens/s is measured as in the benchmark: the drivers' tokens of the steps that *end* inside a window
after ``warmup_steps``, over that window.

* **Shared cores** (``cores``, optional). Peers on one machine share ``cores`` CPUs: the compute tasks
  running at one time each progress at ``min(1, cores / n)`` (processor sharing); the anchor's own
  forward + backward per cycle (``anchor_compute_s``) takes its share. Default: a core per peer.

* **Background traffic** (:func:`simulate_with_background`): the swarm's own control traffic (DHT
  announcements and reads, libp2p upkeep), measured on an idle swarm. It arrives in small bursts at
  times unrelated to the pipeline, so a burst delays pipeline bytes only when it meets them on the link:
  the expected cost is the link's busy fraction times the background rate. The function solves that
  fixed point (capacity = link - utilisation x background, utilisation from the run at that capacity)
  instead of taking the whole background off the link, which over-charges a link that is mostly idle.

Not simulated: the CPU that moving a message takes from compute (``message_overhead_s`` is a delay
only), TCP slow start and loss recovery, RPC framing beyond the byte counts given, stragglers. These are
what the measured error still contains.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace


@dataclass(frozen=True, slots=True)
class SimStage:
    """Per microbatch: compute seconds forward and backward, bytes sent forward (to ``s+1``) and back (to ``s-1``)."""

    fwd_s: float
    bwd_s: float
    fwd_bytes: float  # activation payload to the next stage (ignored on the last)
    bwd_bytes: float  # gradient payload to the previous stage (ignored on stage 0)
    step_s: float = 0.0  # the optimizer step


@dataclass(frozen=True, slots=True)
class SimSpec:
    stages: Sequence[SimStage]
    replicas: Sequence[int]  # per stage; stage 0's replicas are the drivers
    microbatches: int  # m per optimizer step (a driver sends all of them at once)
    tokens_per_microbatch: int
    bandwidth_bps: float  # each way, per peer (goodput)
    latency_s: float  # one way
    dp_inner_steps: int = 0  # 0 = no DP
    dp_bytes: Sequence[float] = ()  # per replica and sync (the whole buffer, all rounds)
    dp_blocking: bool = True
    dp_matchmaking_s: float = 0.0
    dp_timeout_s: float = 15.0  # a replica waits this long for its partners, then syncs alone (node/dp.py)
    anchor_period: int = 0  # 0 = no anchor
    snapshot_bytes: Sequence[float] = ()  # per stage and anchor cycle, from replica 0 of the stage
    prior_bytes: Sequence[float] = ()  # per stage and cycle, to every replica of the stage
    prior_holders: int = 0  # 0: priors sent to the stage's replicas; k: stored on k DHT holders (see above)
    message_overhead_s: float = 0.0  # per message, added to its delivery (serialisation, RPC layers)
    burst_bytes: float = 0.0  # token bucket depth of every access link, each way (tbf's burst); 0 = a plain rate
    cores: int | None = None  # CPU cores shared by every peer's compute (None: a core per peer)
    anchor_compute_s: float = 0.0  # the anchor's forward + backward per cycle (on the shared cores)
    steps: int = 24  # driver steps simulated
    warmup_steps: int = 4

    def __post_init__(self) -> None:
        if len(self.stages) != len(self.replicas) or not self.stages:
            raise ValueError("stages and replicas must have one entry per stage")
        if any(r < 1 for r in self.replicas) or self.microbatches < 1:
            raise ValueError("every stage needs a replica and a step at least one microbatch")
        if self.bandwidth_bps <= 0 or self.latency_s < 0:
            raise ValueError("bandwidth must be > 0 and latency >= 0")
        if self.burst_bytes < 0:
            raise ValueError("burst_bytes must be >= 0")
        if self.cores is not None and self.cores < 1:
            raise ValueError("cores must be >= 1 (or None for a core per peer)")
        if self.steps <= self.warmup_steps + 1:
            raise ValueError("simulate more steps than the warm-up + 1")


@dataclass(slots=True)
class SimResult:
    tokens_per_s: float
    step_s: float  # mean driver step time in the window
    link_utilisation: dict[str, float]  # per peer: bytes sent / (window x capacity)
    busy_fraction: dict[str, float]  # per peer: compute seconds / window
    sim_time_s: float
    anchor_published: list[float] = field(default_factory=list)  # when each anchor cycle's priors went out
    # per boundary call in the window, as the benchmark's traces measure them (``message_timing``): medians of
    # the forward transit (send to arrival), the serving side's time (arrival to the gradient's send), the
    # gradient's transit and the round trip, in seconds
    message_s: dict[str, float] = field(default_factory=dict)


# ---------------------------------------------------------------------------------------------
# the engine: an event queue, fair-shared flows, FIFO compute


@dataclass(eq=False)
class _Flow:
    src: int
    dst: int
    left: float  # bytes
    done: Callable[[], None]
    rate: float = 0.0


@dataclass(eq=False)
class _Peer:
    name: str
    stage: int
    index: int
    queue: list = field(default_factory=list)  # pending (seconds, callback)
    busy: bool = False
    compute_s: float = 0.0
    sent: float = 0.0
    # the step gate
    active: int = 0
    done: int = 0
    step_due: bool = False
    stepping: bool = False
    waiting: list = field(default_factory=list)  # callbacks of forwards held at the gate
    opt_step: int = 0
    inflight_to: dict = field(default_factory=dict)  # next-stage peer id -> microbatches in flight
    pending: dict = field(default_factory=dict)  # next-stage peer id -> backward callbacks, oldest first
    rr: int = 0


class _Sim:
    def __init__(self, spec: SimSpec):
        self.spec = spec
        self.now = 0.0
        self.events: list = []
        self.seq = 0
        self.flows: list[_Flow] = []
        self.running: dict[int, list] = {}  # shared cores: peer -> [work seconds left, callback]
        self.cpu_rate = 1.0
        self.cpu_version = 0
        self.conns: dict[tuple[int, int], list[_Flow]] = {}  # per connection: messages, the active one first
        self.flow_version = 0
        self.cap = spec.bandwidth_bps / 8.0  # bytes/s
        self.peers: list[_Peer] = []
        self.by_stage: list[list[int]] = []
        for s, r in enumerate(spec.replicas):
            ids = []
            for i in range(r):
                ids.append(len(self.peers))
                self.peers.append(_Peer(f"s{s}r{i}", s, i))
            self.by_stage.append(ids)
        self.anchor = None
        if spec.anchor_period > 0:
            self.anchor = len(self.peers)
            self.peers.append(_Peer("anchor", -1, 0))
        self.driver_steps: dict[int, list[float]] = {d: [] for d in self.by_stage[0]}
        self.dp_groups: dict[tuple[int, int], dict] = {}
        self.anchor_busy = False
        self.anchor_next = spec.anchor_period  # driver 0's step that starts the next cycle
        self.anchor_published: list[float] = []
        self.mb_log: list[dict[str, float]] = []  # per boundary call: t_call, t_in, t_out, t_back
        # token buckets, per link and direction (("u", peer) / ("d", peer)), full at the start
        self.tokens: dict[tuple[str, int], float] = {}
        if spec.burst_bytes > 0:
            self.tokens = {(d, p): float(spec.burst_bytes) for p in range(len(self.peers)) for d in ("u", "d")}

    # -- events
    def at(self, t: float, fn: Callable[[], None]) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, fn))

    def run(self, until: Callable[[], bool], horizon: float = 1e9) -> None:
        while self.events and not until():
            t, _, fn = heapq.heappop(self.events)
            if t > horizon:
                break
            self._advance(t)
            fn()

    # -- links
    def _advance(self, t: float) -> None:
        dt = t - self.now
        if dt > 0:
            used: dict[tuple[str, int], float] = {}
            for f in self.flows:
                moved = f.rate * dt
                f.left -= moved
                self.peers[f.src].sent += moved
                used[("u", f.src)] = used.get(("u", f.src), 0.0) + f.rate
                used[("d", f.dst)] = used.get(("d", f.dst), 0.0) + f.rate
            burst = self.spec.burst_bytes
            for r, tok in self.tokens.items():  # a bucket fills with what its link's rate leaves unused
                if tok < burst:
                    self.tokens[r] = min(burst, tok + max(0.0, self.cap - used.get(r, 0.0)) * dt)
            for task in self.running.values():
                task[0] -= self.cpu_rate * dt
        self.now = t

    def send(self, src: int, dst: int, nbytes: float, delivered: Callable[[], None]) -> None:
        """Queue ``nbytes`` on the connection src -> dst; ``delivered`` runs when the last byte has arrived.

        Messages between one pair of peers share one connection (libp2p multiplexes its streams over one
        TCP connection) and go first in, first out; different connections share the links fairly.
        """
        lat = self.spec.latency_s + self.spec.message_overhead_s
        if nbytes <= 0:
            self.at(self.now + lat, delivered)
            return
        key = (src, dst)
        queue = self.conns.setdefault(key, [])

        def finished():
            queue.pop(0)
            self.at(self.now + lat, delivered)
            if queue:
                self._start_flow(queue[0])  # the next message on this connection (re-rated by the caller)

        queue.append(_Flow(src, dst, float(nbytes), finished))
        if len(queue) == 1:
            self._start_flow(queue[0])
            self._rerate()

    def _start_flow(self, f: _Flow) -> None:
        """A message starts moving: what both its links' buckets hold goes at once, the rest at the fair rate."""
        if self.tokens:
            up, down = ("u", f.src), ("d", f.dst)
            now = min(self.tokens[up], self.tokens[down], f.left)
            if now > 0:
                f.left -= now
                self.peers[f.src].sent += now
                self.tokens[up] -= now
                self.tokens[down] -= now
        self.flows.append(f)

    def _rerate(self) -> None:
        """Max-min fair rates by progressive filling over uplinks and downlinks."""
        done = [f for f in self.flows if f.left <= 1e-9]
        self.flows = [f for f in self.flows if f.left > 1e-9]
        for f in done:
            f.done()  # may start the next message of its connection
        flows = self.flows
        left = {("u", f.src): self.cap for f in flows} | {("d", f.dst): self.cap for f in flows}
        unfixed = set(flows)
        for f in flows:
            f.rate = 0.0
        while unfixed:
            counts: dict = {}
            for f in unfixed:
                for r in (("u", f.src), ("d", f.dst)):
                    counts[r] = counts.get(r, 0) + 1
            res, share = min(((r, left[r] / n) for r, n in counts.items()), key=lambda x: x[1])
            for f in [f for f in unfixed if ("u", f.src) == res or ("d", f.dst) == res]:
                f.rate = share
                unfixed.discard(f)
                left[("u", f.src)] -= share
                left[("d", f.dst)] -= share
        self.flow_version += 1
        version = self.flow_version
        if flows:
            t_next = min(f.left / f.rate for f in flows if f.rate > 0)
            self.at(self.now + t_next, lambda: self._flows_tick(version))

    def _flows_tick(self, version: int) -> None:
        if version == self.flow_version:
            for f in self.flows:
                if f.left <= f.rate * 1e-9 + 1e-6:
                    f.left = 0.0
            self._rerate()

    # -- compute (one FIFO thread per peer)
    def compute(self, p: int, seconds: float, then: Callable[[], None]) -> None:
        peer = self.peers[p]
        peer.queue.append((seconds, then))
        if not peer.busy:
            self._next_compute(p)

    def _next_compute(self, p: int) -> None:
        peer = self.peers[p]
        if not peer.queue:
            peer.busy = False
            return
        seconds, then = peer.queue.pop(0)
        peer.busy = True
        peer.compute_s += seconds

        def finish():
            then()
            self._next_compute(p)

        if self.spec.cores is None:
            self.at(self.now + seconds, finish)
        else:  # processor sharing: n running tasks each get min(1, cores / n) of a core
            self.running[p] = [seconds, finish]
            self._recpu()

    def _recpu(self) -> None:
        done = [p for p, task in self.running.items() if task[0] <= 1e-12]
        callbacks = [self.running.pop(p)[1] for p in done]
        for cb in callbacks:
            cb()  # may start the peer's next task (and re-rate, which the lines below redo harmlessly)
        n = len(self.running)
        self.cpu_rate = min(1.0, self.spec.cores / n) if n else 1.0
        self.cpu_version += 1
        version = self.cpu_version
        if n:
            t_next = min(task[0] for task in self.running.values()) / self.cpu_rate
            self.at(self.now + t_next, lambda: self._cpu_tick(version))

    def _cpu_tick(self, version: int) -> None:
        if version == self.cpu_version:
            for task in self.running.values():
                if task[0] <= self.cpu_rate * 1e-9 + 1e-12:
                    task[0] = 0.0
            self._recpu()

    # -- the chain
    def start_step(self, d: int) -> None:
        peer = self.peers[d]
        peer.done = 0
        peer.active = self.spec.microbatches
        st = self.spec.stages[0]
        for _ in range(self.spec.microbatches):
            if len(self.spec.stages) == 1:  # the driver is also the last stage
                self.compute(d, st.fwd_s + st.bwd_s, lambda d=d: self.backward_done(d, None))
            else:
                self.compute(d, st.fwd_s, lambda d=d: self.forward_done(d, None))

    def arrive(self, p: int, sender: int, rec: dict | None = None) -> None:
        """A forward reaches peer ``p`` (stage >= 1) from ``sender``."""
        peer = self.peers[p]
        if rec is not None:
            rec.setdefault("t_in", self.now)
        if peer.step_due or peer.stepping:
            peer.waiting.append(lambda: self.arrive(p, sender, rec))
            return
        peer.active += 1
        st = self.spec.stages[peer.stage]
        if peer.stage == len(self.spec.stages) - 1:
            self.compute(p, st.fwd_s + st.bwd_s, lambda: self.backward_done(p, sender, rec))
        else:
            self.compute(p, st.fwd_s, lambda: self.forward_done(p, sender, rec))

    def forward_done(self, p: int, sender: int | None, up_rec: dict | None = None) -> None:
        peer = self.peers[p]
        nxt = self.by_stage[peer.stage + 1]
        rr = peer.rr = peer.rr + 1  # ties: round robin (the swarm breaks them at random)
        target = min(nxt, key=lambda q: (peer.inflight_to.get(q, 0), (q + rr) % len(nxt)))
        peer.inflight_to[target] = peer.inflight_to.get(target, 0) + 1
        rec = {"stage": peer.stage, "t_call": self.now}
        self.mb_log.append(rec)
        self.send(p, target, self.spec.stages[peer.stage].fwd_bytes, lambda: self.arrive(target, p, rec))

        def grad_back(p=p, target=target, sender=sender):
            rec["t_back"] = self.now
            peer.inflight_to[target] -= 1
            self.compute(p, self.spec.stages[peer.stage].bwd_s, lambda: self.backward_done(p, sender, up_rec))

        peer.pending.setdefault(target, []).append(grad_back)

    def backward_done(self, p: int, sender: int | None, rec: dict | None = None) -> None:
        peer = self.peers[p]
        if sender is not None:
            up = self.peers[sender]
            if rec is not None:
                rec["t_out"] = self.now
            self.send(p, sender, self.spec.stages[peer.stage].bwd_bytes, lambda: up.pending[p].pop(0)())
        peer.active -= 1
        peer.done += 1
        if peer.stage == 0:
            if peer.done == self.spec.microbatches:
                self.compute(p, self.spec.stages[0].step_s, lambda: self.stepped(p))
            return
        if peer.done >= self.spec.microbatches:
            peer.step_due = True
        self.maybe_step(p)

    def maybe_step(self, p: int) -> None:
        peer = self.peers[p]
        if peer.step_due and peer.active == 0 and not peer.stepping:
            peer.stepping = True
            self.compute(p, self.spec.stages[peer.stage].step_s, lambda: self.stepped(p))

    def stepped(self, p: int) -> None:
        peer = self.peers[p]
        peer.opt_step += 1
        h = self.spec.dp_inner_steps
        if h > 0 and self.spec.replicas[peer.stage] > 1 and peer.opt_step % h == 0:
            self.dp_sync(p, peer.opt_step)
            if self.spec.dp_blocking:
                return  # the gate opens when the sync is done
        self.open_gate(p)

    def open_gate(self, p: int) -> None:
        peer = self.peers[p]
        if peer.stage == 0:
            self.driver_steps[p].append(self.now)
            if (p == self.by_stage[0][0] and self.anchor is not None and not self.anchor_busy
                    and peer.opt_step >= self.anchor_next):
                self.anchor_cycle()
            if len(self.driver_steps[p]) < self.spec.steps:
                self.start_step(p)
            return
        peer.stepping = False
        peer.step_due = False
        peer.done = 0
        waiting, peer.waiting = peer.waiting, []
        for cb in waiting:
            cb()

    def dp_sync(self, p: int, step: int) -> None:
        """Peer ``p`` is ready for its DP sync after ``step``: wait for the stage's other replicas (at most
        ``dp_timeout_s``, then alone, as the averager's group of one), then exchange."""
        peer = self.peers[p]
        key = (peer.stage, step)
        state = self.dp_groups.setdefault(key, {"waiting": [], "left": set(), "formed": False})
        group = self.by_stage[peer.stage]
        state["waiting"].append(p)
        blocking = self.spec.dp_blocking

        def alone(q=p):
            if not state["formed"] and q in state["waiting"]:
                state["waiting"].remove(q)
                state["left"].add(q)
                if blocking:
                    self.open_gate(q)

        if len(state["waiting"]) + len(state["left"]) < len(group):
            self.at(self.now + self.spec.dp_timeout_s, alone)
            return
        members = list(state["waiting"])
        state["formed"] = True
        if len(members) < 2:
            for q in members:
                if blocking:
                    self.open_gate(q)
            return
        r = len(members)
        share = 2 * (r - 1) / r * self.spec.dp_bytes[peer.stage] / (r - 1)  # to each other member

        def exchange():
            pending = {q: r - 1 for q in members}

            def got(q):
                pending[q] -= 1
                if pending[q] == 0 and blocking:
                    self.open_gate(q)

            for a in members:
                for b in members:
                    if a != b:
                        self.send(a, b, share, lambda b=b: got(b))

        self.at(self.now + self.spec.dp_matchmaking_s, exchange)

    def anchor_cycle(self) -> None:
        """Fetch the stages' snapshots one after the other, run the pass, publish the priors; the next cycle
        starts ``anchor_period`` driver steps after the publication (the anchor runs one cycle at a time)."""
        a, spec = self.anchor, self.spec
        self.anchor_busy = True
        stages = len(self.by_stage)

        def fetch(s: int) -> None:
            if s == stages:
                self.compute(a, spec.anchor_compute_s, publish)
                return
            snap = spec.snapshot_bytes[s] if s < len(spec.snapshot_bytes) else 0.0
            self.send(self.by_stage[s][0], a, snap, lambda: fetch(s + 1))

        def publish() -> None:
            self.anchor_published.append(self.now)
            for s, ids in enumerate(self.by_stage):
                prior = spec.prior_bytes[s] if s < len(spec.prior_bytes) else 0.0
                if spec.prior_holders <= 0:
                    for q in ids:
                        self.send(a, q, prior, lambda: None)
                    continue
                others = [q for q in range(len(self.peers)) if q != a]
                holders = others if len(others) <= spec.prior_holders else \
                    [others[(s * 7 + i) % len(others)] for i in range(spec.prior_holders)]
                for q in holders:
                    self.send(a, q, prior, lambda: None)
                for i, q in enumerate(ids):
                    if q not in holders:
                        self.send(holders[i % len(holders)], q, prior, lambda: None)
            self.anchor_busy = False
            self.anchor_next = self.peers[self.by_stage[0][0]].opt_step + spec.anchor_period

        fetch(0)


def simulate(spec: SimSpec) -> SimResult:
    """Run the schedule for ``spec.steps`` driver steps; tokens/s over the steps after the warm-up."""
    sim = _Sim(spec)
    for d in sim.by_stage[0]:
        sim.start_step(d)
    sim.run(lambda: all(len(v) >= spec.steps for v in sim.driver_steps.values()))
    ends = sim.driver_steps
    if any(len(v) < spec.steps for v in ends.values()):
        raise RuntimeError("the simulated swarm stalled (a DP group or gate never completed)")
    t0 = max(v[spec.warmup_steps - 1] if spec.warmup_steps else 0.0 for v in ends.values())
    t1 = min(v[-1] for v in ends.values())
    steps = sum(sum(1 for t in v if t0 < t <= t1) for v in ends.values())
    window = max(t1 - t0, 1e-12)
    tokens = steps * spec.microbatches * spec.tokens_per_microbatch
    per_driver = [(v[-1] - v[spec.warmup_steps]) / (len(v) - 1 - spec.warmup_steps) for v in ends.values()]
    calls = [r for r in sim.mb_log if r["stage"] == 0 and t0 < r["t_call"] <= t1 and "t_back" in r]
    return SimResult(
        tokens_per_s=tokens / window,
        step_s=sum(per_driver) / len(per_driver),
        link_utilisation={p.name: p.sent / (sim.now * sim.cap) for p in sim.peers} if sim.now > 0 else {},
        busy_fraction={p.name: p.compute_s / sim.now for p in sim.peers} if sim.now > 0 else {},
        sim_time_s=sim.now,
        anchor_published=list(sim.anchor_published),
        message_s=call_timing(calls),
    )


def call_timing(calls: Sequence[dict]) -> dict[str, float]:
    """Medians over calls with ``t_call``, ``t_in``, ``t_out``, ``t_back`` (seconds; the benchmark's trace records
    have the same fields): ``fwd`` = t_in - t_call, ``serve`` = t_out - t_in, ``bwd`` = t_back - t_out, ``rtt``."""
    full = [c for c in calls if all(k in c for k in ("t_call", "t_in", "t_out", "t_back"))]
    if not full:
        return {}

    def med(xs: list[float]) -> float:
        xs = sorted(xs)
        n = len(xs)
        return xs[n // 2] if n % 2 else 0.5 * (xs[n // 2 - 1] + xs[n // 2])

    return {
        "fwd": med([c["t_in"] - c["t_call"] for c in full]),
        "serve": med([c["t_out"] - c["t_in"] for c in full]),
        "bwd": med([c["t_back"] - c["t_out"] for c in full]),
        "rtt": med([c["t_back"] - c["t_call"] for c in full]),
        "calls": float(len(full)),
    }


def simulate_with_background(spec: SimSpec, background_bps: float, iterations: int = 4) -> SimResult:
    """:func:`simulate` on links that also carry ``background_bps`` (same units as ``spec.bandwidth_bps``) of
    traffic unrelated to the pipeline, charged only for the share of time the link carries pipeline bytes.

    The capacity left to the pipeline is ``bandwidth - u * background``, with ``u`` the peers' mean link
    utilisation in the run at that capacity (a fixed point, iterated from the nominal link; floored at 5 % of
    the link). ``u = 1`` (a saturated link) takes the whole background off; an idle link pays nothing. The
    result lies between :func:`simulate` on the nominal link and on the link less the whole background."""
    result = simulate(spec)
    if background_bps <= 0:
        return result
    for _ in range(iterations):
        used = result.link_utilisation.values()
        u = min(1.0, sum(used) / len(used)) if used else 1.0
        bw = max(spec.bandwidth_bps - u * background_bps, 0.05 * spec.bandwidth_bps)
        result = simulate(replace(spec, bandwidth_bps=bw))
    return result


# ---------------------------------------------------------------------------------------------
# projection to GPUs: the same shapes as meshnode.perf.project, through the simulated schedule

PROJECT_VARIANTS = ("dense", "m95", "m95_ap_dp", "rotq2_dp")


def project(
    arch, stages: int = 8, replicas: int = 7, bandwidth: float = 200e6, *, latency: float = 0.02,
    microbatches: int = 4, tokens_per_microbatch: int = 4096, dp_inner_steps: int = 10, anchor_period: int = 20,
    steps: int = 16, **shape_kw,
) -> dict[str, SimResult]:
    """Simulated tokens/s of ``stages`` x ``replicas`` GPU peers (stage 0's are the drivers, ``microbatches`` each
    in flight), one anchor, every link ``bandwidth`` bit/s each way.

    Variants, all with :func:`meshnode.perf.projection_inputs`' sizes:

    - ``dense``: dense bf16 boundaries, dense bf16 DP all-reduce after every step, blocking (the paper's
      baseline, and what synchronous data parallelism does);
    - ``m95``: M95 boundaries, the same dense DP;
    - ``m95_ap_dp``: M95 boundaries, PowerSGD DP every ``dp_inner_steps`` overlapped with compute, anchor priors
      every ``anchor_period`` steps (the anchor's weight snapshot is taken from the DP all-reduce, not fetched);
    - ``rotq2_dp``: 2-bit rotated boundaries (``mask.codec = rotq``, H/4 + 4 bytes per token, plus the
      microbatch's channel means forward), with the same DP and no anchor.
    """
    from .perf import ARCH_PRESETS, projection_inputs

    arch = ARCH_PRESETS[arch] if isinstance(arch, str) else arch
    inp = projection_inputs(arch, stages, tokens_per_microbatch=tokens_per_microbatch, **shape_kw)
    rotq_bwd = tokens_per_microbatch * (arch.hidden // 4 + 4)
    rotq_fwd = rotq_bwd + arch.hidden * 2

    def spec(fwd: float, bwd: float, dp: list[float], h: int, blocking: bool, anchor: bool) -> SimSpec:
        st = [SimStage(c / 3, 2 * c / 3, fwd, bwd) for c in inp.computes]
        return SimSpec(
            stages=st, replicas=[replicas] * stages, microbatches=microbatches,
            tokens_per_microbatch=tokens_per_microbatch, bandwidth_bps=bandwidth, latency_s=latency,
            dp_inner_steps=h, dp_bytes=dp, dp_blocking=blocking, anchor_period=anchor_period if anchor else 0,
            snapshot_bytes=[0.0] * stages, prior_bytes=inp.prior, steps=steps, warmup_steps=3,
        )

    specs = {
        "dense": spec(inp.dense_pp, inp.dense_pp, inp.dense_dp, 1, True, False),
        "m95": spec(inp.masked_pp, inp.masked_pp, inp.dense_dp, 1, True, False),
        "m95_ap_dp": spec(inp.masked_pp, inp.masked_pp, inp.psgd_dp, dp_inner_steps, False, True),
        "rotq2_dp": spec(rotq_fwd, rotq_bwd, inp.psgd_dp, dp_inner_steps, False, False),
    }
    return {name: simulate(sp) for name, sp in specs.items()}


__all__ = ["PROJECT_VARIANTS", "SimResult", "SimSpec", "SimStage", "project", "simulate", "simulate_with_background"]
