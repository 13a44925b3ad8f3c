"""Swarm throughput on emulated links (issue 6, parts 2 and 4): measured tokens/s per variant vs the cost model.

One invocation builds ``Y x R`` fast peers (stage 0 peers are the drivers) plus one anchor peer, each in
its own network namespace (``scripts/netem.py``: tbf rate each way, NFQUEUE delay), and runs the same
swarm once per variant: ``dense``, ``m95``, ``m95_ap`` (+ anchor prior), ``m95_ap_dp`` (+ PowerSGD DP),
``topk`` and ``int8`` (boundary baselines). Every peer is a real ``python -m meshnode.cli join`` process
listening on its namespace address. Per variant it measures, over a steady-state window (warm-up skipped):
tokens/s (the drivers' per-step records), bytes per trained token by axis (every peer's counters), link
utilisation (bytes sent per second / link rate, per peer) and per-stage busy fraction (forward + backward
seconds / wall seconds), and compares tokens/s with :func:`meshnode.perf.predict_tokens_per_s` fed with
the stage compute time measured in that run and the payload sizes of the codecs.

Time-scaled links (``--time-scale auto``). A CPU stage computes a few hundred times slower than a GPU, so
on unscaled links communication looks cheap. We measure this machine's forward + backward time of each
stage per microbatch (1 thread, the peers' setting) and the GPU reference time of the same FLOPs
(``6 N + 12 L T d_attn`` per token, :func:`meshnode.perf.arch_flops_per_token`'s formula, at
``--gpu-tflops`` peak and ``--gpu-util`` utilisation: RTX 3090-class 71 TFLOP/s dense bf16 at 40 %, the
default of :func:`meshnode.perf.project`)::

    ratio          = cpu_s / gpu_s                  (slowest stage; both per microbatch)
    emulated_mbit  = bandwidth_mbit / ratio         (so bytes / compute matches a GPU on bandwidth_mbit)
    gpu_delay_ms   = delay_ms * ratio               (recorded; NOT applied, see below)

The delay is applied unscaled: ``delay_ms * ratio`` is seconds, beyond libp2p / DHT timeouts. The model
is evaluated with the delay actually applied, so predicted and measured stay comparable.

    sudo .venv/bin/python scripts/bench_throughput.py --bandwidth 200 --delay-ms 20 --time-scale auto \\
        --out docs/results/throughput.json

Peers are not pinned to cores by default: this machine has 2 cores shared with other jobs, and pinning a
peer to one core would make its compute depend on which job shares that core (``--pin`` pins peer i to
core ``i mod ncores`` with taskset, for machines with a core per peer).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

from meshnode import perf, perf_sim  # noqa: E402

logger = logging.getLogger("bench_throughput")

VARIANTS = ("dense", "m95", "m95_ap", "m95_ap_dp", "topk", "int8", "rotq2", "rotq4", "rotq4g1")
TCP_GOODPUT = 1448 / 1514  # payload share of an MTU frame that tbf counts (netem.md)
LABEL_BYTES = 2  # token ids travel with every forward payload as uint16 (byte-level vocabulary)
DHT_REPLICAS = 5  # hivemind DHTNode's num_replicas: a stored value goes to the 5 nodes nearest its key
DP_MATCHMAKING_S = 2.0  # node/dp.py: min_matchmaking_time of each of the 2 averaging rounds per sync

BENCH_TOML = """# scripts/bench_throughput.py: a random Llama-architecture model, byte-level tokens, a CPython slice.
name = "bench-tput"

[model]
source = "tiny"
tokenizer = "bytes"
stages = {stages}
tiny_layers = {layers}
tiny_hidden = {hidden}
tiny_heads = {heads}
tiny_kv_heads = {kv_heads}
tiny_intermediate = {intermediate}

[data]
source = "cpython"
max_docs = 150
seq_len = {seq_len}

[train]
batch_size = {batch}
microbatches = {microbatches}
steps = 100000
lr = 1e-3
warmup_steps = 5
eval_batches = 2
"""


# ---------------------------------------------------------------------------------------------
# Pure pieces (unit-tested in tests/test_bench_throughput.py)


@dataclass(frozen=True, slots=True)
class BenchModel:
    """The benchmark model and batch: one ``[model]``, ``[data]`` and ``[train]`` of BENCH_TOML."""

    stages: int = 2
    layers_per_stage: int = 2
    hidden: int = 256
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 640
    vocab: int = 260
    seq_len: int = 128
    batch: int = 2
    microbatches: int = 4  # per optimizer step; a driver sends them all at once (in flight)

    @property
    def tokens_per_microbatch(self) -> int:
        return self.batch * self.seq_len

    def toml(self) -> str:
        return BENCH_TOML.format(stages=self.stages, layers=self.stages * self.layers_per_stage, hidden=self.hidden,
                                 heads=self.heads, kv_heads=self.kv_heads, intermediate=self.intermediate,
                                 seq_len=self.seq_len, batch=self.batch, microbatches=self.microbatches)

    def stage_flops(self, stage: int) -> float:
        """Training FLOPs of one microbatch on ``stage`` (lm_head on the last; embedding lookups are free)."""
        per_token = perf.transformer_flops_per_token(
            self.layers_per_stage, self.hidden, self.intermediate, self.vocab, self.seq_len, n_heads=self.heads,
            n_kv_heads=self.kv_heads, include_lm_head=stage == self.stages - 1)
        return per_token * self.tokens_per_microbatch


@dataclass(frozen=True, slots=True)
class TimeScale:
    """How CPU compute maps to the GPU reference, and the link that keeps bytes / compute as on the GPU."""

    cpu_s: float  # forward + backward of the slowest stage per microbatch, here
    gpu_s: float  # the same FLOPs on the reference GPU
    ratio: float
    bandwidth_mbit: float  # the GPU peer's link
    delay_ms: float
    emulated_mbit: float
    gpu_delay_ms_scaled: float  # delay * ratio (what exact time scaling would need; not applied)


def time_scale(cpu_s: float, flops: float, bandwidth_mbit: float, delay_ms: float, *, gpu_flops: float = 71e12,
               utilisation: float = 0.4) -> TimeScale:
    """``ratio = cpu_s / gpu_s`` with ``gpu_s = flops / (gpu_flops * utilisation)``; bandwidth divided by it."""
    if cpu_s <= 0 or flops <= 0 or bandwidth_mbit <= 0:
        raise ValueError("cpu_s, flops and bandwidth_mbit must be > 0")
    gpu_s = perf.stage_compute_time(flops, gpu_flops, utilisation)
    ratio = cpu_s / gpu_s
    return TimeScale(cpu_s=cpu_s, gpu_s=gpu_s, ratio=ratio, bandwidth_mbit=bandwidth_mbit, delay_ms=delay_ms,
                     emulated_mbit=bandwidth_mbit / ratio, gpu_delay_ms_scaled=delay_ms * ratio)


def variant_overrides(variant: str, *, replicas: int, anchor_key: str, anchor_period: int = 10,
                      dp_inner_steps: int = 10, dp_rank: int = 4, spectral_rank: int = 8,
                      dp_overlap: bool = True, anchor_snapshot: str = "dp", priors: str = "rpc",
                      dp_matchmaking_s: float = DP_MATCHMAKING_S, dp_clock: str = "own") -> list[str]:
    """``--set`` overrides of one variant (the base config is BENCH_TOML)."""
    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r} (known: {', '.join(VARIANTS)})")
    out = [f"dp.replicas={replicas}"]
    out += {
        "dense": ["mask.ratio=0.0"], "m95": ["mask.ratio=0.95"], "m95_ap": ["mask.ratio=0.95"],
        "m95_ap_dp": ["mask.ratio=0.95"], "topk": ["mask.codec=\"topk\"", "mask.topk_ratio=0.1"],
        "int8": ["mask.codec=\"int8\""], "rotq2": ["mask.codec=\"rotq\"", "mask.bits=2"],
        "rotq4": ["mask.codec=\"rotq\"", "mask.bits=4"],
        "rotq4g1": ["mask.codec=\"rotq\"", "mask.bits=4", "mask.grad_bits=1"],
    }[variant]
    if variant in ("m95_ap", "m95_ap_dp"):
        out += ["anchor.enabled=true", f"anchor.period={anchor_period}", "anchor.max_staleness=30",
                f"spectral.rank={spectral_rank}", f"anchor.allowed_keys=[{json.dumps(anchor_key)}]",
                f"anchor.priors={json.dumps(priors)}"]
    if variant == "m95_ap_dp":
        out += ["dp.enabled=true", f"dp.inner_steps={dp_inner_steps}", f"dp.rank={dp_rank}",
                f"anchor.snapshot={json.dumps(anchor_snapshot)}", f"dp.matchmaking_time={dp_matchmaking_s}",
                f"dp.clock={json.dumps(dp_clock)}"]
        if dp_overlap:
            out += ["dp.overlap=true", f"dp.round_timeout={max(30.0, dp_matchmaking_s + 15.0)}"]
    return out


def driver_window(records: list[dict], warmup_s: float) -> dict[str, float] | None:
    """Steady-state rate of one driver: from its first step record after ``warmup_s`` (since its first record)
    to its last one. Returns t0, t1, tokens, tokens_per_s, steps, compute_s (deltas over the window)."""
    steps = sorted((r for r in records if "step" in r and "t" in r), key=lambda r: r["t"])
    if len(steps) < 2:
        return None
    start = next((r for r in steps if r["t"] - steps[0]["t"] >= warmup_s), None)
    if start is None or start is steps[-1]:
        start = steps[len(steps) // 2] if len(steps) >= 3 else steps[0]
    end = steps[-1]
    span = end["t"] - start["t"]
    if span <= 0:
        return None
    tokens = end["tokens"] - start["tokens"]
    return {"t0": start["t"], "t1": end["t"], "tokens": tokens, "tokens_per_s": tokens / span,
            "steps": end["step"] - start["step"], "compute_s": end.get("compute_s", 0.0) - start.get("compute_s", 0.0),
            "bytes": {k: end["bytes"].get(k, 0) - start["bytes"].get(k, 0) for k in perf.AXES}}


def interpolate(samples: list[dict], t: float, key) -> float:
    """Linear interpolation of ``key(sample)`` at time ``t`` over samples with a ``t`` field (clamped)."""
    pts = sorted(((s["t"], float(key(s))) for s in samples), key=lambda p: p[0])
    if not pts:
        return 0.0
    if t <= pts[0][0]:
        return pts[0][1]
    for (ta, va), (tb, vb) in zip(pts, pts[1:]):
        if ta <= t <= tb:
            return va if tb == ta else va + (vb - va) * (t - ta) / (tb - ta)
    return pts[-1][1]


def peer_window(samples: list[dict], t0: float, t1: float) -> dict[str, Any]:
    """Bytes per axis, compute seconds and tokens a peer added between ``t0`` and ``t1`` (interpolated)."""
    out: dict[str, Any] = {"bytes": {}}
    for axis in perf.AXES:
        out["bytes"][axis] = (interpolate(samples, t1, lambda s, a=axis: s["bytes"].get(a, 0))
                              - interpolate(samples, t0, lambda s, a=axis: s["bytes"].get(a, 0)))
    out["compute_s"] = (interpolate(samples, t1, lambda s: s.get("compute_s") or 0.0)
                        - interpolate(samples, t0, lambda s: s.get("compute_s") or 0.0))
    out["tokens"] = (interpolate(samples, t1, lambda s: s.get("tokens") or 0)
                     - interpolate(samples, t0, lambda s: s.get("tokens") or 0))
    return out


@dataclass(frozen=True, slots=True)
class WireSizes:
    """Bytes per microbatch (one replica) that the model needs, from the codecs and the stage shapes."""

    pp_fwd: float  # activation payload + header + labels
    pp_bwd: float  # gradient payload + header
    dp_per_sync: list[float] = field(default_factory=list)  # per stage: both PowerSGD rounds, float32 buffer
    prior_per_cycle: list[float] = field(default_factory=list)  # per stage: fp16 factors every fast peer reads
    snapshot_per_cycle: list[float] = field(default_factory=list)  # per stage: bf16 weights sent to the anchor
    dp_log_per_sync: list[float] = field(default_factory=list)  # per stage: one DP log entry (fp16 P and Q)

    def anchor_follows_dp(self, anchor_period: int, dp_inner_steps: int) -> WireSizes:
        """``anchor.snapshot = dp``: per cycle the anchor pulls the log entries of the syncs since the last one
        (one per ``dp_inner_steps`` steps) instead of the weights; the models take them as the snapshot."""
        per_cycle = [b * anchor_period / dp_inner_steps for b in self.dp_log_per_sync]
        return dataclasses.replace(self, snapshot_per_cycle=per_cycle)


def predict_variant(variant: str, bench: BenchModel, replicas: int, compute_s: list[float], sizes: WireSizes,
                    link_mbit: float, delay_ms: float, *, dp_inner_steps: int = 10, anchor_period: int = 10,
                    drivers: int | None = None) -> perf.Prediction:
    """The cost model for one variant of the benchmark swarm (see the module docstring of meshnode.perf).

    DP: the sync runs with the stage's gate closed (node/dp.py), so besides its bytes each sync stalls the
    replica for two matchmaking rounds (``2 * DP_MATCHMAKING_S``), added as compute time per microbatch.
    Anchor: every fast peer downloads the prior factors every cycle; one replica per stage serves the
    anchor's bf16 weight snapshot (``snapshot / R`` per replica on average, on the uplink).
    """
    m = bench.microbatches
    dp_on = variant == "m95_ap_dp"
    ap_on = variant in ("m95_ap", "m95_ap_dp")
    costs = []
    for s in range(bench.stages):
        c = compute_s[s]
        if dp_on:
            c += 2 * DP_MATCHMAKING_S / (dp_inner_steps * m)
        costs.append(perf.StageCost(
            compute_s=c, pp_fwd_bytes=sizes.pp_fwd, pp_bwd_bytes=sizes.pp_bwd,
            dp_bytes=sizes.dp_per_sync[s] if dp_on else 0.0,  # perf sends 2 (R-1)/R of it per sync, as the averager
            anchor_bytes=sizes.prior_per_cycle[s] if ap_on else 0.0,
            anchor_upload_bytes=sizes.snapshot_per_cycle[s] / replicas if ap_on else 0.0,
        ))
    shape = perf.SwarmShape(
        stages=bench.stages, replicas_per_stage=replicas, microbatches_in_flight=(drivers or replicas) * m,
        tokens_per_microbatch=bench.tokens_per_microbatch, dp_inner_steps=dp_inner_steps if dp_on else 1,
        microbatches_per_step=m, anchor_period_steps=anchor_period, step_barrier=True)
    link = perf.LinkSpec(link_mbit * 1e6 * TCP_GOODPUT, delay_ms / 1e3)
    pred = perf.predict_tokens_per_s(costs, shape, link)
    if ap_on:  # the anchor's own downlink paces its cycles: every stage's snapshot per cycle
        cycle_s = 8 * sum(sizes.snapshot_per_cycle) / link.bandwidth_bps
        for _ in range(5):
            steps_per_s = pred.microbatches_per_s / (m * (drivers or replicas))
            k_eff = max(anchor_period, math.ceil(cycle_s * steps_per_s))
            if k_eff == shape.anchor_period_steps:
                break
            shape = dataclasses.replace(shape, anchor_period_steps=k_eff)
            pred = perf.predict_tokens_per_s(costs, shape, link)
    return pred


def wave_tokens_per_s(pred: perf.Prediction, bench: BenchModel, drivers: int, delay_ms: float) -> float:
    """The other extreme of the step barrier: the ``m`` microbatches of a step share each link fairly, so they
    cross every hop together (a wave) and nothing pipelines: step = m T_rt minus the (m-1) extra latencies."""
    m = bench.microbatches
    step = m * pred.round_trip_s - (m - 1) * 2 * delay_ms / 1e3 * (bench.stages - 1)
    return drivers * m * bench.tokens_per_microbatch / step


FWD_SHARE = 1 / 3  # forward : backward compute = 1 : 2 (the backward computes two matmuls per forward one)


def holders_for(priors: str | None) -> int:
    """Where the event model sends each prior: straight to the stage's replicas (rpc: 0) or to DHT holders."""
    return 0 if priors == "rpc" else DHT_REPLICAS


def simulate_variant(variant: str, bench: BenchModel, replicas: int, compute_s: list[float], sizes: WireSizes,
                     link_mbit: float, delay_ms: float, *, dp_inner_steps: int = 10, anchor_period: int = 10,
                     dp_overlap: bool = True, steps: int = 30,
                     message_overhead_s: float = 0.0, prior_holders: int = DHT_REPLICAS,
                     background_bytes_per_s: float = 0.0,
                     dp_matchmaking_s: float = DP_MATCHMAKING_S, burst_bytes: float = 0.0) -> perf_sim.SimResult:
    """The event-level cost model (:mod:`meshnode.perf_sim`) of one variant of the benchmark swarm.

    Same inputs as :func:`predict_variant`. DP: a sync's two averaging rounds each take at least
    ``DP_MATCHMAKING_S`` of matchmaking; blocking unless the run used ``dp.overlap``. Priors reach the
    fast peers from the anchor itself (``prior_holders = 0``, ``anchor.priors = rpc``) or through the DHT,
    stored on ``prior_holders`` peers (``dht``; node/priors.py reads one holder's copy).
    ``background_bytes_per_s`` (wire bytes per peer, e.g. the idle swarm's): charged while links are busy
    (:func:`meshnode.perf_sim.simulate_with_background`). ``burst_bytes``: the links' tbf bucket (wire bytes).
    """
    dp_on = variant == "m95_ap_dp"
    ap_on = variant in ("m95_ap", "m95_ap_dp")
    stages = [perf_sim.SimStage(c * FWD_SHARE, c * (1 - FWD_SHARE), sizes.pp_fwd, sizes.pp_bwd) for c in compute_s]
    spec = perf_sim.SimSpec(
        stages=stages, replicas=[replicas] * bench.stages, microbatches=bench.microbatches,
        tokens_per_microbatch=bench.tokens_per_microbatch, bandwidth_bps=link_mbit * 1e6 * TCP_GOODPUT,
        latency_s=delay_ms / 1e3, dp_inner_steps=dp_inner_steps if dp_on else 0, dp_bytes=sizes.dp_per_sync,
        dp_blocking=not dp_overlap, dp_matchmaking_s=2 * dp_matchmaking_s,
        anchor_period=anchor_period if ap_on else 0, snapshot_bytes=sizes.snapshot_per_cycle,
        prior_bytes=sizes.prior_per_cycle, steps=steps, warmup_steps=4, message_overhead_s=message_overhead_s,
        prior_holders=prior_holders, burst_bytes=burst_bytes * TCP_GOODPUT,
    )
    if background_bytes_per_s > 0:
        return perf_sim.simulate_with_background(spec, background_bytes_per_s * 8 * TCP_GOODPUT)
    return perf_sim.simulate(spec)


def model_steps(measured: dict, least: int = 30) -> int:
    """Driver steps for the event model of a measured variant: its warm-up (4) plus as many steps as the
    measured window held, so slow anchor cycles land in the simulated window as they did in the measured one."""
    return max(least, 5 + max(measured.get("steps_in_window") or [0]))


def _sim_of(result: dict, variant: str, overhead_s: float, link_mbit: float | str | None = None,
            steps: int | None = None, charge_idle: bool = False) -> perf_sim.SimResult:
    """The event model of one recorded variant (its recorded inputs), with a given per-message overhead, on the
    nominal link, on ``link_mbit``, on the rate its run left the pipeline (``"available"``: less the idle
    swarm's traffic and the retransmissions), or (``"busy"``) on the link less the retransmissions with the idle
    traffic charged only while the link carries pipeline bytes; ``"run"``: as ``"busy"``, with the traffic the
    run itself put on the links beyond its payload (:func:`run_background`) in place of the idle swarm's.
    ``charge_idle`` with a numeric ``link_mbit``: that rate, charged as ``"busy"`` charges the recorded one (the
    plot's curves)."""
    r = result["variants"][variant]
    mi = r["model_inputs"]
    sz = WireSizes(mi["pp_fwd_bytes"], mi["pp_bwd_bytes"], mi["dp_per_sync"], mi["prior_per_cycle"],
                   mi["snapshot_per_cycle"])
    link = result["link"]
    burst = float(link.get("tbf", {}).get("burst_bytes", 0.0))  # runs before the buckets were recorded: none
    if link_mbit is None:
        link_mbit = link["rate_mbit_each_way"]
    elif not isinstance(link_mbit, str) and burst > 0:  # another rate: the bucket reshape_tbf would give it
        burst = tbf_burst_bytes(link_mbit)
    background = 0.0
    if link_mbit == "available":  # what the run left the pipeline: less idle traffic and retransmissions
        link_mbit = mi.get("link_mbit_available", link["rate_mbit_each_way"])
    elif link_mbit in ("busy", "run") or charge_idle:
        rate = link["rate_mbit_each_way"] if link_mbit in ("busy", "run") else link_mbit
        key = "run_background_bytes_per_s" if link_mbit == "run" else "background_bytes_per_s"
        link_mbit = available_link_mbit(rate, 0.0, mi.get("retrans_share", 0.0))
        background = mi.get(key, 0.0)
    return simulate_variant(variant, BenchModel(**result["model"]), result["swarm"]["replicas_per_stage"],
                            mi["compute_s_per_microbatch"], sz, link_mbit,
                            link["delay_ms_one_way"], dp_inner_steps=mi["dp_inner_steps"],
                            anchor_period=mi["anchor_period"], dp_overlap=mi.get("dp_overlap", False),
                            steps=model_steps(r) if steps is None else steps, message_overhead_s=overhead_s,
                            background_bytes_per_s=background,
                            prior_holders=holders_for(mi.get("priors")),
                            dp_matchmaking_s=mi.get("dp_matchmaking_s", DP_MATCHMAKING_S), burst_bytes=burst)


def fit_message_overhead(result: dict, variant: str, hi_s: float = 2.0) -> float:
    """The per-message overhead (seconds) at which the event model reproduces ``variant``'s measured tokens/s
    (bisection; the model's rate falls as the overhead grows). Fit on one run, check on the others."""
    target = result["variants"][variant]["tokens_per_s"]
    lo, hi = 0.0, hi_s
    if _sim_of(result, variant, 0.0).tokens_per_s <= target:
        return 0.0
    for _ in range(30):
        mid = (lo + hi) / 2
        if _sim_of(result, variant, mid).tokens_per_s > target:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


# ---------------------------------------------------------------------------------------------
# Calibration: this machine's stage compute, payload sizes


def calibrate(bench: BenchModel, reps: int = 5,
              spectral_rank: int = 8) -> tuple[list[float], WireSizes, dict[str, int]]:
    """Forward + backward seconds per microbatch of each stage (1 thread, median of ``reps`` after one warm-up),
    dense payload sizes, and per-stage parameter counts; in this process, with the peers' code."""
    import tomllib
    import torch

    from meshnode.compression import compressed_rank
    from meshnode.config import config_from_dict
    from meshnode.model import cut_model, load_model
    from meshnode.stage import MicrobatchId, StageWorker

    torch.set_num_threads(1)
    cfg = config_from_dict(tomllib.loads(bench.toml()))
    model, _ = load_model(cfg.model)
    mods = cut_model(model, bench.stages)
    workers = [StageWorker(mods[s], cfg) for s in range(bench.stages)]
    ids = torch.randint(0, 256, (bench.batch, bench.seq_len))
    times: list[list[float]] = [[] for _ in workers]
    for it in range(reps + 1):
        mb = MicrobatchId(it, 0)
        x, fwd = ids, []
        for w in workers:
            t0 = time.perf_counter()
            x = w.forward(mb, x, ids if w.is_last else None)
            fwd.append(time.perf_counter() - t0)
        g = None
        for s in reversed(range(len(workers))):
            t0 = time.perf_counter()
            g = workers[s].backward(mb, g)
            if it:
                times[s].append(fwd[s] + time.perf_counter() - t0)
    compute = [statistics.median(t) for t in times]
    params = {f"stage{s}": sum(p.numel() for p in workers[s].module.parameters()) for s in range(bench.stages)}
    dp, prior, snap, log = [], [], [], []
    for w in workers:
        p_sz = q_sz = 0
        for _, t in w.module.named_parameters():
            r = compressed_rank(t.shape, 4)
            if r == 0:
                p_sz += t.numel()
            else:
                p_sz += t.shape[0] * r
                q_sz += (t.numel() // t.shape[0]) * r
        dp.append(2 * max(p_sz, q_sz) * 4.0)  # two rounds of the averager's float32 buffer
        log.append((p_sz + q_sz) * 2.0)  # the same factors in fp16, as the anchor pulls them
        targets = [t for n, t in w.module.named_parameters()
                   if t.dim() == 2 and any(k in n for k in cfg.spectral.targets)]
        prior.append(sum(min(spectral_rank, *t.shape) * (t.shape[0] + t.shape[1] + 1) * 2.0 for t in targets))
        snap.append(sum(t.numel() * 2.0 for t in w.module.state_dict().values() if t.is_floating_point()))
    sizes = WireSizes(pp_fwd=0.0, pp_bwd=0.0, dp_per_sync=dp, prior_per_cycle=prior, snapshot_per_cycle=snap,
                      dp_log_per_sync=log)
    return compute, sizes, params


def codec_sizes(variant: str, bench: BenchModel) -> tuple[float, float]:
    """(pp_fwd, pp_bwd) bytes per microbatch on the wire: codec payload + header (+ labels forward)."""
    from meshnode.compression import HEADER_BYTES, make_codec
    from meshnode.config import MaskConfig

    kw = {"dense": {"ratio": 0.0}, "topk": {"codec": "topk", "topk_ratio": 0.1}, "int8": {"codec": "int8"},
          "rotq2": {"codec": "rotq", "bits": 2}, "rotq4": {"codec": "rotq", "bits": 4},
          "rotq4g1": {"codec": "rotq", "bits": 4, "grad_bits": 1}}
    codec = make_codec(MaskConfig(**kw.get(variant, {"ratio": 0.95})))
    b, t, h = bench.batch, bench.seq_len, bench.hidden
    fwd = codec.forward_nbytes(b, t, h) + HEADER_BYTES + LABEL_BYTES * b * t
    bwd = codec.backward_nbytes(b, t, h) + HEADER_BYTES
    return float(fwd), float(bwd)


# ---------------------------------------------------------------------------------------------
# Running the swarm in namespaces


@dataclass
class Peer:
    name: str
    ns_index: int
    proc: subprocess.Popen
    log: Path
    ready: Path
    metrics: Path
    role: str
    stage: int
    trace: Path | None = None

    def alive(self) -> bool:
        return self.proc.poll() is None

    def wait_ready(self, deadline: float) -> dict:
        while time.monotonic() < deadline:
            if self.ready.is_file():
                with contextlib.suppress(ValueError):
                    return json.loads(self.ready.read_text())
            if not self.alive():
                raise RuntimeError(f"peer {self.name} exited ({self.proc.returncode}): {_tail(self.log)}")
            time.sleep(0.3)  # polling a file a subprocess writes, with a deadline
        raise TimeoutError(f"peer {self.name} not ready: {_tail(self.log)}")

    def stop(self, timeout: float = 15.0) -> None:
        if self.alive():
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # its DHT process and p2pd (own session, by our pid)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(5)

    def records(self) -> list[dict]:
        return _json_lines(self.metrics)

    def traces(self) -> list[dict]:
        return _json_lines(self.trace) if self.trace is not None else []


def _json_lines(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(ValueError):
            out.append(json.loads(line))
    return out


def message_timing(peers: list[Peer], t0: float, t1: float) -> dict[str, float]:
    """Medians of the drivers' calls to stage 1 that started in [t0, t1], from the peers' trace records: forward
    transit (send to the server's handler), serving time, the gradient's transit and the round trip (seconds;
    every peer runs on this host's clock). Matched by (driver, step, microbatch) and time."""
    records = [r for p in peers for r in p.traces()]  # each peer's file read once
    serves: dict[tuple, list[dict]] = {}
    for r in records:
        if r.get("kind") == "serve" and r.get("stage") == 1:
            serves.setdefault((r["driver"], r["step"], r["mb"]), []).append(r)
    calls = []
    for c in records:
        if c.get("kind") != "call" or c.get("stage") != 0 or not t0 <= c["t_call"] <= t1:
            continue
        match = [s for s in serves.get((c["driver"], c["step"], c["mb"]), [])
                 if c["t_call"] <= s["t_in"] and s["t_out"] <= c["t_back"]]
        if match:
            calls.append({**c, "t_in": match[-1]["t_in"], "t_out": match[-1]["t_out"]})
    return perf_sim.call_timing(calls)


def _tail(path: Path, n: int = 12) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


def tbf_burst_bytes(rate_mbit: float, mtu: int = 1500) -> int:
    """The bucket :func:`reshape_tbf` gives a link: 2 ms of line rate, at least 4 MTU."""
    return int(max(rate_mbit * 1e6 / 8 * 0.002, 4 * mtu))


def reshape_tbf(net, rate_mbit: float, delay_ms: float, mtu: int = 1500) -> dict[str, int]:
    """Replace netem's tbf with a burst of 2 ms of line rate but at least 4 MTU (netem.py's floor is 16 KiB, which
    at sub-Mbit rates lets ~0.2 s of traffic through at once after every idle gap). Only our namespaces. Even
    4 MTU is 0.13 s of a 0.37 Mbit/s link, about one M95 microbatch: the event model includes the buckets."""
    rate_bytes = rate_mbit * 1e6 / 8
    burst = tbf_burst_bytes(rate_mbit, mtu)
    limit = int(max(rate_bytes * max(0.05, 2 * delay_ms / 1e3), 2 * burst))
    tbf = ["tbf", "rate", f"{rate_mbit}mbit", "burst", str(burst), "limit", str(limit)]
    for i in range(net.peers):
        subprocess.run(["tc", "-n", net.peer_ns(i), "qdisc", "replace", "dev", "eth0", "root", *tbf], check=True)
        subprocess.run(["tc", "-n", net.hub_ns(), "qdisc", "replace", "dev", f"p{i}", "root", *tbf], check=True)
    return {"burst_bytes": burst, "limit_bytes": limit}


def run_variant(net, variant: str, bench: BenchModel, replicas: int, workdir: Path, cache_dir: Path, *,
                warmup_s: float, window_s: float, pin: bool, anchor_period: int, dp_inner_steps: int,
                dp_overlap: bool = True, min_steps: int = 0, max_window_s: float | None = None,
                anchor_snapshot: str = "dp", spectral_rank: int = 8, priors: str = "rpc",
                dp_matchmaking_s: float = DP_MATCHMAKING_S, dp_clock: str = "own", idle_s: float = 0.0) -> dict:
    """One fresh swarm of ``variant``; measured over ``window_s`` after ``warmup_s``, extended (up to
    ``max_window_s``) until every driver has ``min_steps`` steps in its window.

    With ``idle_s > 0`` the drivers stop after 2 steps instead and the swarm's idle traffic (announcements,
    snapshot refreshes: the DHT) is measured over ``idle_s`` seconds once both have stopped; the result is
    then ``{"idle_s", "up_bytes_per_s", "down_bytes_per_s"}`` per peer."""
    from meshnode.protocol import keys

    vdir = workdir / (f"{variant}-idle" if idle_s > 0 else variant)  # the idle run keeps its own logs
    if vdir.exists():
        shutil.rmtree(vdir)
    vdir.mkdir(parents=True)
    base = vdir / "run.toml"
    base.write_text(bench.toml())
    anchor_identity = vdir / "anchor.key"
    anchor_key = keys.public_key_string(keys.load_or_create_identity(anchor_identity))
    overrides = variant_overrides(variant, replicas=replicas, anchor_key=anchor_key, anchor_period=anchor_period,
                                  dp_inner_steps=dp_inner_steps, dp_overlap=dp_overlap,
                                  anchor_snapshot=anchor_snapshot, spectral_rank=spectral_rank, priors=priors,
                                  dp_matchmaking_s=dp_matchmaking_s, dp_clock=dp_clock)
    if idle_s > 0:
        overrides.append(f"train.steps={IDLE_DRIVER_STEPS}")
    with_anchor = variant in ("m95_ap", "m95_ap_dp")
    ncores = os.cpu_count() or 1
    peers: list[Peer] = []

    def start(name: str, ns_index: int, role: str, stage: int, initial: list[str], extra: list[str]) -> Peer:
        log, ready, metrics = vdir / f"{name}.log", vdir / f"{name}.ready.json", vdir / f"{name}.metrics.jsonl"
        trace = vdir / f"{name}.trace.jsonl"
        argv = [sys.executable, "-m", "meshnode.cli", "-v", "join", "--config", str(base)]
        for o in overrides:
            argv += ["--set", o]
        for m in initial:
            argv += ["--initial-peers", m]
        argv += ["--host-maddrs", f"/ip4/{net.address(ns_index)}/tcp/0", "--ready-file", str(ready),
                 "--metrics-out", str(metrics), "--trace-out", str(trace), "--cache-dir", str(cache_dir),
                 "--threads", "1", *extra]
        if pin:
            argv = ["taskset", "-c", str(ns_index % ncores), *argv]
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
        with open(log, "wb") as out:
            proc = net.popen(ns_index, argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                             start_new_session=True, env=env)
        peer = Peer(name, ns_index, proc, log, ready, metrics, role, stage, trace)
        peers.append(peer)
        return peer

    started = time.monotonic()
    link_samples: list[dict] = []
    try:
        # namespaces: [stage Y-1 .. 1] x R, the anchor, then the R drivers (stage 0), as the demo orders them
        idx = 0
        bootstrap: list[str] = []
        late = []
        for s in range(bench.stages - 1, 0, -1):
            for r in range(replicas):
                p = start(f"stage{s}-{r}", idx, "fast", s, bootstrap, ["--stage", str(s)])
                idx += 1
                if not bootstrap:  # the first peer is its own bootstrap: its maddrs carry its namespace address
                    info = p.wait_ready(time.monotonic() + 180)
                    bootstrap = [m for m in info["maddrs"] if net.address(p.ns_index) in m][:1]
                else:
                    late.append(p)
        if with_anchor:
            late.append(start("anchor", idx, "anchor", -1, bootstrap,
                              ["--role", "anchor", "--identity", str(anchor_identity)]))
        idx = bench.stages * replicas - replicas + 1  # fixed slot for the anchor even when unused
        for p in late:
            p.wait_ready(time.monotonic() + 240)
        drivers = [start(f"driver-{r}", idx + r, "driver", 0, bootstrap, ["--stage", "0"]) for r in range(replicas)]
        for p in drivers:
            p.wait_ready(time.monotonic() + 240)
        ready_s = time.monotonic() - started
        logger.info("%s: %d peers ready after %.0fs; measuring %.0fs after %.0fs warm-up", variant, len(peers),
                    ready_s, window_s, warmup_s)
        if idle_s > 0:
            return measure_idle(net, variant, peers, drivers, idle_s)
        first = None
        longest = max(window_s, max_window_s or window_s)
        deadline = time.monotonic() + warmup_s + longest + 240
        while time.monotonic() < deadline:
            with contextlib.suppress(Exception):  # a failed read costs one sample, not the run
                link_samples.append({"t": time.time(), "links": net.link_bytes(),
                                     "tcp": {p.ns_index: net.tcp_counters(p.ns_index) for p in peers}})
            dead = [p.name for p in peers if not p.alive()]
            if dead:
                raise RuntimeError(f"{variant}: peer(s) {dead} exited: {_tail(vdir / (dead[0] + '.log'))}")
            if first is None and all(any("step" in r for r in d.records()) for d in drivers):
                first = time.monotonic()
            if first is not None and time.monotonic() - first >= warmup_s + window_s:
                wins = [driver_window(d.records(), warmup_s) for d in drivers]
                enough = all(w is not None and w["steps"] >= min_steps for w in wins)
                if enough or time.monotonic() - first >= warmup_s + longest:
                    break
            time.sleep(1.0)  # the benchmark's own pacing loop (not a test)
        else:
            raise TimeoutError(f"{variant}: drivers did not run for {warmup_s + window_s:.0f}s in time")
    finally:
        for p in reversed(peers):
            p.stop()
    return summarize(variant, peers, bench, replicas, warmup_s, ready_s, link_samples)


IDLE_DRIVER_STEPS = 2


def measure_idle(net, variant: str, peers: list[Peer], drivers: list[Peer], idle_s: float) -> dict:
    """Wait until every driver has finished its ``IDLE_DRIVER_STEPS`` steps, then read each peer's link counters
    ``idle_s`` apart: the bytes per second the swarm moves when nothing trains (the caller stops the peers)."""
    deadline = time.monotonic() + 600
    while sum(1 for r in (r for d in drivers for r in d.records()) if "step" in r) < IDLE_DRIVER_STEPS * len(drivers):
        dead = [p.name for p in peers if not p.alive()]
        if dead or time.monotonic() > deadline:
            raise RuntimeError(f"{variant} (idle): drivers did not finish their steps ({dead or 'timeout'})")
        time.sleep(1.0)  # the benchmark's own pacing loop (not a test)
    time.sleep(5.0)  # let the last replies and announcements drain (benchmark pacing, not synchronisation)
    t0, before = time.time(), net.link_bytes()
    time.sleep(idle_s)  # the measurement interval itself
    t1, after = time.time(), net.link_bytes()
    span = t1 - t0
    return {"idle_s": span, "variant": variant,
            "up_bytes_per_s": {p.name: (after[p.ns_index][0] - before[p.ns_index][0]) / span for p in peers},
            "down_bytes_per_s": {p.name: (after[p.ns_index][1] - before[p.ns_index][1]) / span for p in peers}}


def available_link_mbit(rate_mbit: float, background_bytes_per_s: float = 0.0, retrans_share: float = 0.0) -> float:
    """What a peer's link leaves the pipeline: the rate less retransmitted segments and less the swarm's
    background (idle) traffic, which competes whenever the link is busy. Floored at 5 % of the rate."""
    return max(rate_mbit * (1.0 - retrans_share) - background_bytes_per_s * 8 / 1e6, 0.05 * rate_mbit)


def swarm_kind(variant: str) -> str:
    """Which peers and background tasks a variant's swarm runs: the idle traffic is measured once per kind."""
    return {"m95_ap": "anchor", "m95_ap_dp": "anchor_dp"}.get(variant, "fast")


def run_background(r: dict, replicas: int) -> float | None:
    """Wire bytes per second that a recorded variant's fast peers uploaded beyond their counted payload, per
    peer, less the anchor's snapshot (or DP log) reads, which the event model already sends (the serving peer
    does not count them; the anchor does). ``None`` when the run recorded no link counters.

    Anchor cycles in the window: the anchor's counted bytes over what one cycle counts (every stage's snapshot,
    plus each prior once per replica with ``priors = rpc``, once with ``dht``)."""
    mi, peers = r.get("model_inputs", {}), r.get("peers", {})
    fast = [p for p in peers.values() if p.get("role") != "anchor" and "wire_up_bytes" in p]
    if not fast or not r.get("window_s"):
        return None
    span = r["window_s"]
    extra = sum(p["wire_up_bytes"] - sum(p["bytes_sent"].values()) for p in fast)
    anchor = [p for p in peers.values() if p.get("role") == "anchor"]
    snap = sum(mi.get("snapshot_per_cycle") or [0.0])
    if anchor and snap > 0:
        per_prior = replicas if mi.get("priors") == "rpc" else 1
        per_cycle = snap + per_prior * sum(mi.get("prior_per_cycle") or [0.0])
        extra -= snap * sum(p["bytes_sent"].get("anchor", 0.0) for p in anchor) / per_cycle
    return max(extra / span / len(fast), 0.0)


def summarize(variant: str, peers: list[Peer], bench: BenchModel, replicas: int, warmup_s: float,
              ready_s: float, link_samples: list[dict] | None = None) -> dict:
    drivers = [p for p in peers if p.role == "driver"]
    wins = [driver_window(p.records(), warmup_s) for p in drivers]
    if any(w is None for w in wins):
        raise RuntimeError(f"{variant}: a driver has fewer than 2 steps")
    t0, t1 = max(w["t0"] for w in wins), min(w["t1"] for w in wins)
    if t1 <= t0:
        t0, t1 = min(w["t0"] for w in wins), max(w["t1"] for w in wins)
    span = t1 - t0
    tokens_per_s = sum(w["tokens_per_s"] for w in wins)
    tokens = tokens_per_s * span
    per_peer = {}
    totals = dict.fromkeys(perf.AXES, 0.0)
    stage_busy: dict[int, list[float]] = {}
    stage_cmb: dict[int, list[float]] = {}
    tpm = bench.tokens_per_microbatch
    wire_total = 0.0
    for p in peers:
        recs = [r for r in p.records() if "t" in r]
        w = peer_window(recs, t0, t1)
        sent = sum(w["bytes"].values())
        per_peer[p.name] = {"role": p.role, "stage": p.stage, "bytes_sent": w["bytes"], "compute_s": w["compute_s"],
                            "sent_bytes_per_s": sent / span}
        if link_samples:  # what the peer's access link carried: every byte, counted or not
            up = [{"t": x["t"], "v": x["links"].get(p.ns_index, (0, 0))[0]} for x in link_samples]
            down = [{"t": x["t"], "v": x["links"].get(p.ns_index, (0, 0))[1]} for x in link_samples]
            wire_up = interpolate(up, t1, lambda x: x["v"]) - interpolate(up, t0, lambda x: x["v"])
            wire_down = interpolate(down, t1, lambda x: x["v"]) - interpolate(down, t0, lambda x: x["v"])
            per_peer[p.name].update(wire_up_bytes=wire_up, wire_down_bytes=wire_down,
                                    wire_up_over_counted=wire_up / sent if sent > 0 else None)
            wire_total += wire_up
            tcp = [x for x in link_samples if p.ns_index in x.get("tcp", {})]
            if len(tcp) >= 2:  # the peer's kernel TCP counters: how much of its uplink went to retransmission
                seg = {k: interpolate(tcp, t1, lambda x, k=k, i=p.ns_index: x["tcp"][i][k])
                       - interpolate(tcp, t0, lambda x, k=k, i=p.ns_index: x["tcp"][i][k])
                       for k in ("out_segs", "retrans_segs")}
                # Linux counts OutSegs only for segments with new data (or none): retransmissions are on top
                sent_segs = seg["out_segs"] + seg["retrans_segs"]
                per_peer[p.name].update(tcp_out_segs=seg["out_segs"], tcp_retrans_segs=seg["retrans_segs"],
                                        tcp_retrans_share=seg["retrans_segs"] / sent_segs if sent_segs > 0 else None)
        for a in perf.AXES:
            totals[a] += w["bytes"][a]
        if p.stage >= 0:
            stage_busy.setdefault(p.stage, []).append(w["compute_s"] / span)
            if w["tokens"] > 0:
                stage_cmb.setdefault(p.stage, []).append(w["compute_s"] / (w["tokens"] / tpm))
    bpt = {a: totals[a] / tokens for a in perf.AXES}
    bpt["total"] = sum(bpt[a] for a in perf.AXES)
    return {
        "tokens_per_s": tokens_per_s, "bytes_per_token": bpt, "window_s": span, "window_tokens": tokens,
        "driver_windows": wins, "peers": per_peer, "ready_s": ready_s,
        "busy_fraction": {f"stage{s}": statistics.mean(v) for s, v in sorted(stage_busy.items())},
        "compute_s_per_microbatch": {f"stage{s}": statistics.mean(v) for s, v in sorted(stage_cmb.items())},
        "steps_in_window": [w["steps"] for w in wins],
        "message_s": message_timing(peers, t0, t1),
        **({"wire_bytes_per_token": wire_total / tokens, "wire_over_counted": wire_total / (bpt["total"] * tokens)}
           if link_samples and bpt["total"] > 0 else {}),
    }


# ---------------------------------------------------------------------------------------------
# Projection and plot


def projections(bandwidth_mbit: float = 200.0) -> dict[str, Any]:
    """Part 3's projection, 8 stages x 7 fast replicas + 1 anchor, dense vs M95 + AP + DP: the closed form
    (meshnode.perf.project) and the event-level model (meshnode.perf_sim.project, the swarm's own schedule)."""
    out: dict[str, Any] = {}
    for arch in ("SmolLM2-135M", "Llama-3.2-1B"):
        pr = perf.project(arch, 8, 7, bandwidth_mbit * 1e6)
        out[arch] = {name: {"tokens_per_s": p.tokens_per_s, "bytes_per_token": p.total_bytes_per_token,
                            "bottleneck": p.bottleneck} for name, p in pr.variants.items()}
        out[arch]["speedup_m95_ap_dp_vs_dense"] = pr.speedup
        sim = perf_sim.project(arch, 8, 7, bandwidth_mbit * 1e6)
        out[arch]["simulated"] = {name: {"tokens_per_s": r.tokens_per_s, "step_s": r.step_s}
                                  for name, r in sim.items()}
        for name in ("m95_ap_dp", "rotq2_dp"):
            out[arch]["simulated"][f"speedup_{name}_vs_dense"] = sim[name].tokens_per_s / sim["dense"].tokens_per_s
    out["paper_llama_3.2_1b"] = {"dense_tokens_per_s": 1100, "m95_ap_tokens_per_s": 46500, "speedup": 42.3}
    return out


def repredict(result: dict, message_overhead_s: float | None = None) -> None:
    """Re-evaluate both cost models of every measured variant from its recorded inputs (after a model change).
    ``message_overhead_s`` (the event model's per-message cost) is recorded in the result."""
    if message_overhead_s is not None:
        result["message_overhead_s"] = message_overhead_s
    overhead = result.get("message_overhead_s", 0.0)
    bench = BenchModel(**result["model"])
    replicas = result["swarm"]["replicas_per_stage"]
    link = result["link"]
    for v, r in result["variants"].items():
        if "model_inputs" not in r:
            continue
        mi = r["model_inputs"]
        sz = WireSizes(mi["pp_fwd_bytes"], mi["pp_bwd_bytes"], mi["dp_per_sync"], mi["prior_per_cycle"],
                       mi["snapshot_per_cycle"])
        pred = predict_variant(v, bench, replicas, mi["compute_s_per_microbatch"], sz, link["rate_mbit_each_way"],
                               link["delay_ms_one_way"], dp_inner_steps=mi["dp_inner_steps"],
                               anchor_period=mi["anchor_period"])
        sim = _sim_of(result, v, overhead)
        measured_link = "link_mbit_available" in mi
        run_bg = run_background(r, replicas)
        if run_bg is not None:
            mi["run_background_bytes_per_s"] = run_bg
        record_predictions(r, sim, pred, wave_tokens_per_s(pred, bench, replicas, link["delay_ms_one_way"]),
                           _sim_of(result, v, overhead, "available") if measured_link else None,
                           _sim_of(result, v, overhead, "busy") if measured_link else None,
                           _sim_of(result, v, overhead, "run") if measured_link and run_bg is not None else None)


def record_predictions(r: dict, sim: perf_sim.SimResult, pred: perf.Prediction, wave: float,
                       sim_available: perf_sim.SimResult | None = None,
                       sim_busy: perf_sim.SimResult | None = None,
                       sim_run: perf_sim.SimResult | None = None) -> None:
    """The event-level model is the prediction: on the link less the run's retransmissions with the idle swarm's
    traffic charged for the link's busy share (``sim_busy``) when the run measured that traffic, else on the
    nominal link. Kept beside it: the event model on the nominal link, on the link less all the idle traffic
    (``sim_available``), the closed form and the wave bound; and (``sim_run``) the event model charged, in place of
    the idle swarm's traffic, with what the run itself sent beyond its payload: an account of the run, not a
    prediction, since that traffic is measured in the run it explains."""
    measured = r["tokens_per_s"]
    if sim_run is not None:
        r["accounted_tokens_per_s"] = sim_run.tokens_per_s
        r["accounted_error_pct"] = 100 * (sim_run.tokens_per_s - measured) / measured
    if sim_available is not None:
        r["predicted_available_link_tokens_per_s"] = sim_available.tokens_per_s
        r["available_link_error_pct"] = 100 * (sim_available.tokens_per_s - measured) / measured
    r["predicted_nominal_tokens_per_s"] = sim.tokens_per_s
    r["nominal_error_pct"] = 100 * (sim.tokens_per_s - measured) / measured
    primary = sim if sim_busy is None else sim_busy
    r["prediction_model"] = ("event model, nominal link" if sim_busy is None else
                             "event model, link less retransmissions, idle traffic charged by busy share")
    r["predicted_tokens_per_s"] = primary.tokens_per_s
    r["prediction_error_pct"] = 100 * (primary.tokens_per_s - measured) / measured
    r["predicted_link_utilisation"] = sim.link_utilisation
    r["predicted_message_s"] = primary.message_s
    r["predicted_closed_form_tokens_per_s"] = pred.tokens_per_s
    r["closed_form_error_pct"] = 100 * (pred.tokens_per_s - measured) / measured
    r["predicted_bottleneck"] = pred.bottleneck
    r["predicted_wave_tokens_per_s"] = wave


def bandwidth_mbit_of(result: dict) -> float:
    """The GPU peer's link of a result (the un-scaled bandwidth the projection was made for)."""
    return float(result.get("time_scale", {}).get("bandwidth_mbit", 200.0))


def plot(result: dict, png: Path) -> None:
    """Model curves of tokens/s vs the GPU peer's bandwidth (time-scaled benchmark swarm, and the projections),
    measured points on top. x and y of the benchmark panel are in GPU-equivalent units: the run at emulated
    rate ``r`` stands for bandwidth ``r * ratio`` and its tokens/s for ``tokens/s * ratio``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    ts = result["time_scale"]
    ratio = ts["ratio"] if result["time_scale"]["mode"] == "auto" else float(result["time_scale"]["mode"])
    link = result["link"]
    bench = BenchModel(**result["model"])
    replicas = result["swarm"]["replicas_per_stage"]
    xs = np.logspace(1, 4, 25)  # 10 Mbit/s .. 10 Gbit/s
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(13, 5))
    palette = plt.rcParams["axes.prop_cycle"].by_key()["color"] + ["#444444", "#bbbb00", "#00aaaa"]
    colors = dict(zip((*VARIANTS, "rotq2_dp"), palette))
    for v, r in result["variants"].items():
        if "model_inputs" not in r:
            continue
        ys = [_sim_of(result, v, result.get("message_overhead_s", 0.0), x / ratio, steps=16,
                      charge_idle=True).tokens_per_s * ratio for x in xs]
        ax.plot(xs, ys, color=colors.get(v), label=f"{v} (model)")
        ax.scatter([link["rate_mbit_each_way"] * ratio], [r["tokens_per_s"] * ratio], color=colors.get(v),
                   edgecolor="black", zorder=5, s=50)
    ax.set(xscale="log", yscale="log", xlabel="GPU peer link, Mbit/s each way (emulated = x / ratio)",
           ylabel="GPU-equivalent tokens/s (measured x ratio)",
           title=f"benchmark swarm {bench.stages} stages x {replicas} (+ anchor), H={bench.hidden}, "
                 f"time scale {ratio:.0f}x\nlines: event model (buckets, idle traffic charged); dots: measured")
    ax.axvline(200, color="grey", ls=":", lw=1)
    ax.legend(fontsize=8)
    for arch, ls in (("SmolLM2-135M", "--"), ("Llama-3.2-1B", "-")):
        for name in ("dense", "m95", "m95_ap_dp"):
            ys = [perf.project(arch, 8, 7, x * 1e6).variants[name].tokens_per_s for x in xs]
            ax2.plot(xs, ys, ls=ls, color=colors[name], label=f"{arch} {name}")
    ax2.scatter([200, 200], [1100, 46500], marker="*", s=120, color="black", zorder=5,
                label="paper, Llama-3.2-1B (1.1k / 46.5k)")
    for arch, marker in (("SmolLM2-135M", "x"), ("Llama-3.2-1B", "P")):
        sim = result.get("projection", {}).get(arch, {}).get("simulated", {})
        for name in ("dense", "m95_ap_dp", "rotq2_dp"):
            if name in sim:
                ax2.scatter([bandwidth_mbit_of(result)], [sim[name]["tokens_per_s"]], marker=marker, s=70, zorder=6,
                            color=colors.get(name, "black"), label=f"{arch} {name} (event-level model)")
    ax2.axvline(200, color="grey", ls=":", lw=1)
    ax2.set(xscale="log", yscale="log", xlabel="link, Mbit/s each way", ylabel="tokens/s",
            title="projection: 8 stages x 7 + 1 anchor, 71 TFLOP/s at 40 %, 20 ms\n"
                  "lines: closed form (perf.project); markers: perf_sim.project")
    ax2.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=110)


# ---------------------------------------------------------------------------------------------
# main


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bandwidth", type=float, default=200.0, help="Mbit/s per peer each way (the GPU peer's link)")
    ap.add_argument("--delay-ms", type=float, default=20.0, help="one-way delay applied on arrival at each peer")
    ap.add_argument("--time-scale", default="auto",
                    help="'auto' (divide the bandwidth by the measured CPU/GPU compute ratio), a number, or 1")
    ap.add_argument("--gpu-tflops", type=float, default=71.0, help="reference GPU dense bf16 peak (RTX 3090 class)")
    ap.add_argument("--gpu-util", type=float, default=0.4, help="reference GPU model-FLOPs utilisation")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--replicas", type=int, default=2, help="fast peers per stage (stage 0 peers are the drivers)")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--warmup-s", type=float, default=15.0)
    ap.add_argument("--window-s", type=float, default=60.0)
    ap.add_argument("--min-steps", type=int, default=0,
                    help="extend a variant's window until every driver has this many steps in it")
    ap.add_argument("--max-window-s", type=float, default=None, help="the longest a window is extended to")
    ap.add_argument("--window-s-anchor", type=float, default=None,
                    help="window of the variants with an anchor (long enough for whole anchor cycles to land in it)")
    ap.add_argument("--idle-s", type=float, default=30.0,
                    help="first measure the idle swarm's own traffic (DHT) for this long, once per kind of swarm "
                         "(no anchor; anchor; anchor + DP); the prediction charges it, and each variant's measured "
                         "retransmissions, to the link (0: skip)")
    ap.add_argument("--idle-only", action="store_true",
                    help="only measure the idle traffic of each kind of swarm the variants run, and write that")
    ap.add_argument("--anchor-period", type=int, default=10)
    ap.add_argument("--spectral-rank", type=int, default=8, help="rank of the anchor's published priors")
    ap.add_argument("--dp-matchmaking-s", type=float, default=DP_MATCHMAKING_S,
                    help="m95_ap_dp: dp.matchmaking_time, how long the first replica at a round waits for partners")
    ap.add_argument("--dp-clock", choices=("own", "driver"), default="own",
                    help="m95_ap_dp: dp.clock, what counts the inner steps between syncs")
    ap.add_argument("--priors", choices=("rpc", "dht"), default="rpc",
                    help="anchor.priors: the anchor serves its factors itself (rpc) or stores them in the DHT (dht)")
    ap.add_argument("--dp-inner-steps", type=int, default=10)
    ap.add_argument("--pin", action="store_true", help="taskset peer i to core i mod ncores")
    ap.add_argument("--anchor-snapshot", choices=("dp", "full"), default="dp",
                    help="m95_ap_dp: the anchor follows the DP log (dp) or fetches every stage's weights (full)")
    ap.add_argument("--dp-blocking", action="store_true",
                    help="m95_ap_dp syncs with the gate closed (dp.overlap = false), as before the overlap")
    ap.add_argument("--cache-dir", type=Path, default=Path.home() / ".cache" / "meshnode")
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--png", type=Path, default=None, help="also draw the plot here")
    ap.add_argument("--plot-only", action="store_true", help="redraw --png from an existing --out JSON")
    ap.add_argument("--message-overhead-ms", type=float, default=None,
                    help="per-message overhead of the event model (default: 0, or what the JSON records)")
    ap.add_argument("--fit-overhead", metavar="JSON:VARIANT", default=None,
                    help="with --plot-only: take the overhead at which the model reproduces VARIANT of another run")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    if args.plot_only:
        result = json.loads(args.out.read_text())
        bench = BenchModel(**result["model"])
        missing = [r for r in result["variants"].values() if "model_inputs" in r
                   and "dp_per_sync" not in r["model_inputs"]]
        if missing:  # results of an older version of this script: add the (timing-free) sizes
            _, sizes, _ = calibrate(bench, reps=1)
            for r in missing:
                r["model_inputs"].update(dp_per_sync=sizes.dp_per_sync, prior_per_cycle=sizes.prior_per_cycle,
                                         snapshot_per_cycle=sizes.snapshot_per_cycle,
                                         dp_inner_steps=args.dp_inner_steps, anchor_period=args.anchor_period)
        result["projection"] = projections(args.bandwidth)
        args.out.write_text(json.dumps(result, indent=1, default=str))
        overhead = None if args.message_overhead_ms is None else args.message_overhead_ms / 1e3
        if args.fit_overhead:
            path, _, variant = args.fit_overhead.rpartition(":")
            overhead = fit_message_overhead(json.loads(Path(path).read_text()), variant)
            result["message_overhead_fit"] = {"from": args.fit_overhead, "seconds": overhead}
            logger.info("per-message overhead fitted on %s: %.1f ms", args.fit_overhead, overhead * 1e3)
        repredict(result, overhead)
        args.out.write_text(json.dumps(result, indent=1, default=str))
        plot(result, args.png or args.out.with_suffix(".png"))
        return 0
    import netem

    # SIGTERM unwinds like Ctrl-C: the finally blocks stop the peers and remove the namespaces
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    bench = BenchModel(hidden=args.hidden, heads=max(1, args.hidden // 64), kv_heads=max(1, args.hidden // 128),
                       intermediate=int(args.hidden * 2.5) // 64 * 64)
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    compute, sizes, params = calibrate(bench, spectral_rank=args.spectral_rank)
    slowest = max(range(bench.stages), key=lambda s: compute[s])
    scale = time_scale(compute[slowest], bench.stage_flops(slowest), args.bandwidth, args.delay_ms,
                       gpu_flops=args.gpu_tflops * 1e12, utilisation=args.gpu_util)
    if args.time_scale == "auto":
        rate = scale.emulated_mbit
    else:
        rate = args.bandwidth / float(args.time_scale)
    logger.info("calibration: stage compute %s s per microbatch; GPU %.3g s; ratio %.0f -> link %.3f Mbit/s",
                [round(c, 4) for c in compute], scale.gpu_s, scale.ratio, rate)
    overhead = (args.message_overhead_ms or 0.0) / 1e3
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="bench-tput-"))
    workdir.mkdir(parents=True, exist_ok=True)
    n_ns = bench.stages * args.replicas + 1
    state = workdir / "netem.json"
    results: dict[str, Any] = {}
    with netem.emulated_network(netem.NetemConfig(peers=n_ns, rate_mbit=rate, delay_ms=args.delay_ms), state) as net:
        tbf = reshape_tbf(net, rate, args.delay_ms)
        cc = net.congestion_control(0)
        # the idle swarm's own traffic (DHT upkeep), once per kind of swarm the variants run: the anchor and the DP
        # averagers have background tasks of their own. The m95 swarm stands for every anchor-less variant.
        idle: dict[str, Any] = {}
        background: dict[str, float] = {}
        if args.idle_s > 0:
            kinds = {swarm_kind(v): v for v in variants if swarm_kind(v) != "fast"}
            if any(swarm_kind(v) == "fast" for v in variants):
                kinds["fast"] = "m95"  # stands for every anchor-less variant
            for kind, iv in sorted(kinds.items()):
                try:
                    idle[kind] = run_variant(net, iv, bench, args.replicas, workdir, args.cache_dir, warmup_s=0.0,
                                             window_s=0.0, pin=args.pin, anchor_period=args.anchor_period,
                                             dp_inner_steps=args.dp_inner_steps, dp_overlap=not args.dp_blocking,
                                             anchor_snapshot=args.anchor_snapshot, priors=args.priors,
                                             dp_matchmaking_s=args.dp_matchmaking_s, dp_clock=args.dp_clock,
                                             idle_s=args.idle_s)
                    fast = {k: b for k, b in idle[kind]["up_bytes_per_s"].items() if k != "anchor"}
                    background[kind] = statistics.mean(fast.values())
                    logger.info("idle %s swarm: %.1f kB/s per fast peer up (%s)", kind, background[kind] / 1e3,
                                ", ".join(f"{k} {b / 1e3:.1f}" for k, b in idle[kind]["up_bytes_per_s"].items()))
                except Exception as exc:
                    logger.error("idle measurement (%s) failed: %s", kind, exc)
                    idle[kind] = {"error": str(exc)}
        for v in variants if not args.idle_only else []:
            fwd, bwd = codec_sizes(v, bench)
            vs = WireSizes(fwd, bwd, sizes.dp_per_sync, sizes.prior_per_cycle, sizes.snapshot_per_cycle,
                           sizes.dp_log_per_sync)
            follows_dp = v == "m95_ap_dp" and args.anchor_snapshot == "dp"
            if follows_dp:
                vs = vs.anchor_follows_dp(args.anchor_period, args.dp_inner_steps)
            try:
                anchored = args.window_s_anchor and v in ("m95_ap", "m95_ap_dp")
                window = args.window_s_anchor if anchored else args.window_s
                res = run_variant(net, v, bench, args.replicas, workdir, args.cache_dir, warmup_s=args.warmup_s,
                                  window_s=window, pin=args.pin, anchor_period=args.anchor_period,
                                  dp_inner_steps=args.dp_inner_steps, dp_overlap=not args.dp_blocking,
                                  min_steps=args.min_steps, max_window_s=args.max_window_s,
                                  anchor_snapshot=args.anchor_snapshot, spectral_rank=args.spectral_rank,
                                  priors=args.priors, dp_matchmaking_s=args.dp_matchmaking_s,
                                  dp_clock=args.dp_clock)
            except Exception as exc:  # one failed variant must not lose the others
                logger.error("%s failed: %s", v, exc)
                results[v] = {"error": str(exc)}
                continue
            cmb = [res["compute_s_per_microbatch"].get(f"stage{s}", compute[s]) for s in range(bench.stages)]
            shares = [p["tcp_retrans_share"] for p in res["peers"].values() if p.get("tcp_retrans_share") is not None]
            retrans = statistics.mean(shares) if shares else 0.0
            kind = swarm_kind(v) if swarm_kind(v) in background else "fast"  # the m95 swarm's when not measured
            bg = background.get(kind, 0.0)
            avail = available_link_mbit(rate, bg, retrans)
            pred = predict_variant(v, bench, args.replicas, cmb, vs, rate, args.delay_ms,
                                   dp_inner_steps=args.dp_inner_steps, anchor_period=args.anchor_period)
            sim = simulate_variant(v, bench, args.replicas, cmb, vs, rate, args.delay_ms,
                                   dp_inner_steps=args.dp_inner_steps, anchor_period=args.anchor_period,
                                   dp_overlap=not args.dp_blocking, message_overhead_s=overhead,
                                   steps=model_steps(res), prior_holders=holders_for(args.priors),
                                   dp_matchmaking_s=args.dp_matchmaking_s,
                                   burst_bytes=tbf["burst_bytes"] if tbf else 0.0)
            record_predictions(res, sim, pred, wave_tokens_per_s(pred, bench, args.replicas, args.delay_ms))
            res["model_inputs"] = {"compute_s_per_microbatch": cmb, "pp_fwd_bytes": fwd, "pp_bwd_bytes": bwd,
                                   "dp_per_sync": vs.dp_per_sync, "prior_per_cycle": vs.prior_per_cycle,
                                   "snapshot_per_cycle": vs.snapshot_per_cycle, "dp_inner_steps": args.dp_inner_steps,
                                   "anchor_period": args.anchor_period, "dp_overlap": not args.dp_blocking,
                                   "background_bytes_per_s": bg, "background_swarm": kind, "retrans_share": retrans,
                                   "link_mbit_available": avail, "priors": args.priors if v in ("m95_ap", "m95_ap_dp")
                                   else None, "dp_matchmaking_s": args.dp_matchmaking_s, "dp_clock": args.dp_clock,
                                   "anchor_snapshot": "dp" if follows_dp else "full" if v in ("m95_ap", "m95_ap_dp")
                                   else None}
            res["link_utilisation"] = {
                name: p["sent_bytes_per_s"] * 8 / (rate * 1e6) for name, p in res["peers"].items()}
            results[v] = res
            logger.info("%s: %.1f tok/s (predicted %.1f, %+.0f%%), bytes/token %.1f", v, res["tokens_per_s"],
                        sim.tokens_per_s, res["prediction_error_pct"], res["bytes_per_token"]["total"])
            partial = {"variants": results}
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.with_suffix(".partial.json").write_text(json.dumps(partial, indent=1, default=str))
    dense = results.get("dense", {}).get("tokens_per_s")
    for r in results.values():
        if dense and "tokens_per_s" in r:
            r["speedup_vs_dense"] = r["tokens_per_s"] / dense
    out = {
        "command": "python scripts/bench_throughput.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "model": {f: getattr(bench, f) for f in bench.__dataclass_fields__},
        "params_per_stage": params,
        "swarm": {"stages": bench.stages, "replicas_per_stage": args.replicas, "drivers": args.replicas,
                  "anchor": "one peer holding every stage (ap variants only)", "namespaces": n_ns},
        "link": {"rate_mbit_each_way": rate, "delay_ms_one_way": args.delay_ms, "congestion_control": cc,
                 "tbf": tbf, "goodput_factor": TCP_GOODPUT},
        "time_scale": {"mode": args.time_scale, "calibration_compute_s_per_microbatch": compute,
                       "slowest_stage": slowest, "slowest_stage_flops": bench.stage_flops(slowest),
                       "gpu_tflops": args.gpu_tflops, "gpu_util": args.gpu_util,
                       **{f: getattr(scale, f) for f in scale.__dataclass_fields__},
                       "arithmetic": f"ratio = {scale.cpu_s:.4g} s / {scale.gpu_s:.4g} s = {scale.ratio:.1f}; "
                                     + (f"link = {args.bandwidth:g} Mbit/s / {scale.ratio:.1f} = {rate:.3f} Mbit/s"
                                        if args.time_scale == "auto" else
                                        f"scale pinned by --time-scale: link = {args.bandwidth:g} Mbit/s / "
                                        f"{float(args.time_scale):g} = {rate:.3f} Mbit/s")},
        "pinning": "taskset peer i -> core i mod ncores" if args.pin else "none (2 shared cores; see docstring)",
        "variants": results,
        "idle": idle,
        "message_overhead_s": overhead,
        "projection": projections(args.bandwidth),
    }
    repredict(out)  # adds the event model on the available link beside the prediction
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1, default=str))
    args.out.with_suffix(".partial.json").unlink(missing_ok=True)
    if args.png is not None:
        plot(out, args.png)
    logger.info("wrote %s (logs in %s)", args.out, workdir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
