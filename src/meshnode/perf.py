r"""Cost model: predicted training tokens/s of a pipelined, data-parallel swarm on slow links.

Pure arithmetic (no torch, no networking), so it can project results to hardware we do not have
(GPUs + 200 Mbit/s links) and be checked against runs on emulated links (``scripts/netem.py``).

Model
-----
Notation. ``Y`` stages ``s = 0..Y-1``; stage ``s`` has ``R_s`` replicas (peers). Per microbatch of
``T`` tokens, a replica of stage ``s`` computes for ``c_s`` seconds (forward + backward), sends
``f_s`` bytes forward to stage ``s+1`` (``pp_fwd``) and ``g_s`` bytes of gradient back to stage
``s-1`` (``pp_bwd``). Every peer has a full-duplex access link of ``B`` bit/s each way, and any two
peers are ``L`` seconds apart one way (:class:`LinkSpec`). An optimizer step takes ``m``
microbatches; DP syncs every ``H`` steps a payload of ``P_s`` bytes per replica (the compressed or
dense pseudo-gradient); every ``K`` steps each fast replica downloads ``A_s`` bytes of anchor prior.
``M`` microbatches are in flight in the whole swarm.

DP traffic per peer and microbatch, butterfly all-reduce (each peer sends and receives
``2 (R-1)/R`` of the payload; zero when a stage has one replica)::

    d_s = 2 (R_s - 1) / R_s * P_s / (H m)

What one replica of stage ``s`` moves per microbatch (ends of the pipeline have no neighbour there)::

    up_s   = [s < Y-1] f_s     + [s > 0] g_s         + d_s
    down_s = [s > 0]   f_{s-1} + [s < Y-1] g_{s+1}   + d_s + A_s / (K m)

Steady state (compute and transfers overlap; every resource of a peer works on a different
microbatch)::

    t_s     = max(c_s, 8 up_s / B, 8 down_s / B)     seconds per microbatch, one replica
    X_s     = R_s / t_s                              microbatches/s through stage s
    X_pipe  = min_s X_s

Latency (pipeline bubble). One microbatch needs a round trip through all stages and back::

    T_rt    = sum_s c_s + sum_{b=0}^{Y-2} (2 L + 8 (f_b + g_{b+1}) / B)
    X_lat   = M / T_rt                               (Little's law)

With ``step_barrier`` (the swarm's step clock: a driver waits for its ``m`` microbatches before the next
step), the pipeline fills and drains every step::

    X_lat   = min(M / T_rt, M / ((m - 1) max_s t_s + T_rt))

Prediction::

    X = min(X_pipe, X_lat),   tokens/s = T X

The bottleneck is the term that attains the minimum: a stage's compute, uplink or downlink, or
latency (too few microbatches in flight to cover the round trip; ``ceil(X_pipe T_rt)`` would).
Bytes per trained token by axis are counted once, at the sender: ``pp_fwd = sum_b f_b / T``,
``pp_bwd = sum_b g_{b+1} / T``, ``dp = sum_s d_s / T``, ``anchor = sum_s A_s / (K m T)``.

Properties (unit-tested): more bandwidth never lowers ``X``; more compute time never raises it;
more replicas never lower it once a stage has 2 or more (going from 1 to 2 replicas switches DP
traffic on, which can cost more than the second replica adds; the model reports that honestly).

Not modelled: DP and anchor latency (streamed and overlapped, off the critical path when
``H >= 10``), contention between peers of one stage for a shared neighbour (routing spreads load),
TCP dynamics (we assume the link's goodput; measure it with ``netem.py measure``), stragglers,
memory limits on ``M``.

FLOPs and projections
---------------------
:func:`transformer_flops_per_token` uses ``6 N + 12 n_layers T_seq d_attn`` for training (``N``
matmul parameters, PaLM's attention term without the causal halving) and ``2 N + 4 ...`` forward
only. :func:`project` builds stage costs for an architecture preset and compares dense training
with M95 masking, PowerSGD DP and the anchor prior; its ``notes`` list every assumption.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

AXES = ("pp_fwd", "pp_bwd", "dp", "anchor")


# ---------------------------------------------------------------------------------------------
# Inputs


@dataclass(frozen=True, slots=True)
class StageCost:
    """Cost of one microbatch on one replica of a stage.

    :param compute_s: forward + backward seconds per microbatch.
    :param pp_fwd_bytes: payload this stage sends to the next stage per microbatch (ignored on the last).
    :param pp_bwd_bytes: gradient payload this stage sends to the previous stage (ignored on the first).
    :param dp_bytes: DP payload of one replica per sync (all-reduce traffic is derived from it).
    :param anchor_bytes: anchor prior bytes one fast replica of this stage downloads per anchor cycle.
    :param anchor_upload_bytes: bytes one fast replica of this stage uploads per anchor cycle on average
        (e.g. the weight snapshot the anchor fetches from one of the stage's replicas, divided by R).
    """

    compute_s: float
    pp_fwd_bytes: float = 0.0
    pp_bwd_bytes: float = 0.0
    dp_bytes: float = 0.0
    anchor_bytes: float = 0.0
    anchor_upload_bytes: float = 0.0


@dataclass(frozen=True, slots=True)
class LinkSpec:
    """Every peer's access link: ``bandwidth_bps`` each direction (full duplex), one-way ``latency_s``."""

    bandwidth_bps: float
    latency_s: float = 0.0


@dataclass(frozen=True, slots=True)
class SwarmShape:
    """Mesh shape and schedule.

    :param stages: Y.
    :param replicas_per_stage: R (one int for all stages, or one per stage).
    :param microbatches_in_flight: M, in the whole swarm.
    :param tokens_per_microbatch: T.
    :param dp_inner_steps: H, optimizer steps between DP syncs (1 = every step).
    :param microbatches_per_step: m, microbatches per optimizer step of a replica.
    :param anchor_period_steps: K, steps between anchor priors.
    :param overlap: compute and transfers overlap (``False``: ``t_s = c_s + max(up, down)``).
    :param step_barrier: each driver sends its ``m`` microbatches, waits for all of them, then steps (the
        swarm's step clock): the pipeline fills and drains every step, ``X_bar = M / ((m-1) max_s t_s + T_rt)``.
    """

    stages: int
    replicas_per_stage: int | tuple[int, ...]
    microbatches_in_flight: int
    tokens_per_microbatch: int
    dp_inner_steps: int = 1
    microbatches_per_step: int = 1
    anchor_period_steps: int = 20
    overlap: bool = True
    step_barrier: bool = False

    def replicas(self) -> tuple[int, ...]:
        r = self.replicas_per_stage
        out = (r,) * self.stages if isinstance(r, int) else tuple(r)
        if len(out) != self.stages:
            raise ValueError(f"replicas_per_stage has {len(out)} entries for {self.stages} stages")
        return out


# ---------------------------------------------------------------------------------------------
# Outputs


@dataclass(frozen=True, slots=True)
class StageBreakdown:
    """One stage in the steady state."""

    stage: int
    replicas: int
    compute_s: float
    uplink_s: float  # per microbatch, one replica
    downlink_s: float
    time_per_microbatch_s: float  # t_s
    microbatches_per_s: float  # X_s = R_s / t_s
    limit: str  # compute | uplink | downlink
    uplink_bytes: dict[str, float]  # per microbatch, one replica, by axis
    downlink_bytes: dict[str, float]
    busy_fraction: float = 0.0  # share of time the GPU computes at the predicted rate


@dataclass(frozen=True, slots=True)
class Prediction:
    """What :func:`predict_tokens_per_s` returns."""

    tokens_per_s: float
    microbatches_per_s: float
    limit: str  # compute | uplink | downlink | latency
    bottleneck_stage: int | None  # None when latency-bound
    bottleneck: str  # one line for people
    steady_tokens_per_s: float  # T X_pipe (infinitely many microbatches in flight)
    latency_bound_tokens_per_s: float  # T X_lat
    round_trip_s: float
    in_flight_needed: int  # ceil(X_pipe T_rt): microbatches in flight that hide the latency
    stages: tuple[StageBreakdown, ...]
    bytes_per_token: dict[str, float] = field(default_factory=dict)

    @property
    def total_bytes_per_token(self) -> float:
        return sum(self.bytes_per_token.values())


# ---------------------------------------------------------------------------------------------
# The model


def _ceil(x: float) -> int:
    """``ceil`` that ignores float noise (10 * 0.7 is 7, not 8)."""
    return math.ceil(x * (1 - 1e-12))


def predict_tokens_per_s(stages: StageCost | Sequence[StageCost], shape: SwarmShape, link: LinkSpec) -> Prediction:
    """Predict training tokens/s of the swarm (see the module docstring for the equations)."""
    costs = (stages,) * shape.stages if isinstance(stages, StageCost) else tuple(stages)
    y = shape.stages
    if len(costs) != y or y < 1:
        raise ValueError(f"{len(costs)} stage costs for {y} stages")
    replicas = shape.replicas()
    if min(replicas) < 1 or shape.microbatches_in_flight < 1 or shape.tokens_per_microbatch < 1:
        raise ValueError("replicas, microbatches_in_flight and tokens_per_microbatch must be >= 1")
    if link.bandwidth_bps <= 0 or link.latency_s < 0:
        raise ValueError("bandwidth must be > 0 and latency >= 0")
    h, m, k = shape.dp_inner_steps, shape.microbatches_per_step, shape.anchor_period_steps
    if min(h, m, k) < 1:
        raise ValueError("dp_inner_steps, microbatches_per_step and anchor_period_steps must be >= 1")
    bw = link.bandwidth_bps

    breakdown: list[StageBreakdown] = []
    for s, (c, r) in enumerate(zip(costs, replicas, strict=True)):
        dp = 2.0 * (r - 1) / r * c.dp_bytes / (h * m)
        up = {
            "pp_fwd": c.pp_fwd_bytes if s < y - 1 else 0.0,
            "pp_bwd": c.pp_bwd_bytes if s > 0 else 0.0,
            "dp": dp,
            "anchor": c.anchor_upload_bytes / (k * m),
        }
        down = {
            "pp_fwd": costs[s - 1].pp_fwd_bytes if s > 0 else 0.0,
            "pp_bwd": costs[s + 1].pp_bwd_bytes if s < y - 1 else 0.0,
            "dp": dp,
            "anchor": c.anchor_bytes / (k * m),
        }
        up_s, down_s = 8 * sum(up.values()) / bw, 8 * sum(down.values()) / bw
        comm = max(up_s, down_s)
        t = max(c.compute_s, comm) if shape.overlap else c.compute_s + comm
        if t <= 0:
            raise ValueError(f"stage {s} takes no time per microbatch: give it compute or bytes")
        limit = "compute" if c.compute_s >= comm else ("uplink" if up_s >= down_s else "downlink")
        breakdown.append(StageBreakdown(s, r, c.compute_s, up_s, down_s, t, r / t, limit, up, down))

    x_pipe = min(b.microbatches_per_s for b in breakdown)
    round_trip = sum(c.compute_s for c in costs) + sum(
        2 * link.latency_s + 8 * (costs[b].pp_fwd_bytes + costs[b + 1].pp_bwd_bytes) / bw for b in range(y - 1)
    )
    x_lat = shape.microbatches_in_flight / round_trip if round_trip > 0 else math.inf
    if shape.step_barrier:  # fill + drain every step: (m - 1) bottleneck slots plus one round trip
        t_max = max(b.time_per_microbatch_s for b in breakdown)
        drain = (m - 1) * t_max + round_trip
        x_lat = min(x_lat, shape.microbatches_in_flight / drain) if drain > 0 else x_lat
    x = min(x_pipe, x_lat)
    tpm = shape.tokens_per_microbatch
    breakdown = [dataclasses.replace(b, busy_fraction=x * b.compute_s / b.replicas) for b in breakdown]

    if x_lat < x_pipe * (1 - 1e-12):  # ties (float noise) go to the steady-state bottleneck
        limit, stage = "latency", None
        text = (f"latency: {shape.microbatches_in_flight} microbatches in flight over a {round_trip * 1e3:.1f} ms "
                f"round trip; {_ceil(x_pipe * round_trip)} would reach the steady-state rate"
                + (" (step barrier: the pipeline drains every step)" if shape.step_barrier else ""))
    else:
        slow = min(breakdown, key=lambda b: b.microbatches_per_s)
        limit, stage = slow.limit, slow.stage
        axes = slow.uplink_bytes if slow.limit == "uplink" else slow.downlink_bytes
        detail = "" if slow.limit == "compute" else " (" + ", ".join(
            f"{a} {v / 1e6:.3g} MB" for a, v in axes.items() if v) + " per microbatch)"
        text = f"stage {stage} {slow.limit}: {slow.time_per_microbatch_s * 1e3:.1f} ms per microbatch{detail}"

    bytes_per_token = {
        "pp_fwd": sum(costs[b].pp_fwd_bytes for b in range(y - 1)) / tpm,
        "pp_bwd": sum(costs[b + 1].pp_bwd_bytes for b in range(y - 1)) / tpm,
        "dp": sum(b.uplink_bytes["dp"] for b in breakdown) / tpm,
        "anchor": sum(b.downlink_bytes["anchor"] + b.uplink_bytes["anchor"] for b in breakdown) / tpm,
    }
    return Prediction(
        tokens_per_s=x * tpm, microbatches_per_s=x, limit=limit, bottleneck_stage=stage, bottleneck=text,
        steady_tokens_per_s=x_pipe * tpm, latency_bound_tokens_per_s=x_lat * tpm, round_trip_s=round_trip,
        in_flight_needed=_ceil(x_pipe * round_trip) if math.isfinite(x_pipe) else 0,
        stages=tuple(breakdown), bytes_per_token=bytes_per_token,
    )


# ---------------------------------------------------------------------------------------------
# FLOPs from shapes


@dataclass(frozen=True, slots=True)
class ArchSpec:
    """Decoder-only transformer shape (Llama-style: gated MLP, grouped-query attention)."""

    name: str
    n_layers: int
    hidden: int
    intermediate: int
    n_heads: int
    n_kv_heads: int
    vocab: int
    tied_embeddings: bool = True
    head_dim: int | None = None  # None: hidden // n_heads

    @property
    def d_head(self) -> int:
        return self.head_dim or self.hidden // self.n_heads

    def layer_matrices(self) -> dict[str, tuple[int, int]]:
        """(out, in) of the 2-D matrices of one decoder layer."""
        q, kv = self.n_heads * self.d_head, self.n_kv_heads * self.d_head
        h, i = self.hidden, self.intermediate
        return {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q),
                "gate_proj": (i, h), "up_proj": (i, h), "down_proj": (h, i)}

    def layer_params(self) -> int:
        return sum(a * b for a, b in self.layer_matrices().values()) + 2 * self.hidden  # + 2 RMSNorms

    def params(self) -> int:
        emb = self.vocab * self.hidden
        return self.n_layers * self.layer_params() + emb * (1 if self.tied_embeddings else 2) + self.hidden


SMOLLM2_135M = ArchSpec(name="SmolLM2-135M", n_layers=30, hidden=576, intermediate=1536, n_heads=9, n_kv_heads=3,
                        vocab=49152)
LLAMA_3_2_1B = ArchSpec(name="Llama-3.2-1B", n_layers=16, hidden=2048, intermediate=8192, n_heads=32, n_kv_heads=8,
                        vocab=128256)
ARCH_PRESETS: dict[str, ArchSpec] = {a.name: a for a in (SMOLLM2_135M, LLAMA_3_2_1B)}


def transformer_flops_per_token(
    n_layers: int,
    hidden: int,
    intermediate: int,
    vocab: int,
    seq_len: int,
    *,
    n_heads: int | None = None,
    n_kv_heads: int | None = None,
    head_dim: int | None = None,
    include_lm_head: bool = True,
    training: bool = True,
) -> float:
    """FLOPs per token: ``6 N + 12 n_layers seq_len d_attn`` (training) or ``2 N + 4 ...`` (forward).

    ``N`` counts matmul parameters (attention with ``n_kv_heads`` key/value heads, gated MLP, and the
    lm_head if ``include_lm_head``); embedding lookups and norms are free. Heads default to
    ``hidden // 64`` (multi-head attention) when not given.
    """
    n_heads = n_heads or max(1, hidden // 64)
    arch = ArchSpec(name="", n_layers=n_layers, hidden=hidden, intermediate=intermediate, n_heads=n_heads,
                    n_kv_heads=n_kv_heads or n_heads, vocab=vocab, head_dim=head_dim)
    matmul = n_layers * sum(a * b for a, b in arch.layer_matrices().values())
    if include_lm_head:
        matmul += vocab * hidden
    mult, attn = (6, 12) if training else (2, 4)
    return mult * matmul + attn * n_layers * seq_len * n_heads * arch.d_head


def arch_flops_per_token(arch: ArchSpec, seq_len: int, *, n_layers: int | None = None, lm_head: bool = True,
                         training: bool = True) -> float:
    """:func:`transformer_flops_per_token` for a preset (``n_layers`` of its layers, e.g. one stage)."""
    return transformer_flops_per_token(
        arch.n_layers if n_layers is None else n_layers, arch.hidden, arch.intermediate, arch.vocab, seq_len,
        n_heads=arch.n_heads, n_kv_heads=arch.n_kv_heads, head_dim=arch.head_dim, include_lm_head=lm_head,
        training=training)


def stage_compute_time(flops: float, gpu_flops: float, utilisation: float = 0.4) -> float:
    """Seconds to do ``flops`` on a GPU with peak ``gpu_flops`` at model-FLOPs ``utilisation``."""
    if gpu_flops <= 0 or not 0 < utilisation <= 1:
        raise ValueError("gpu_flops must be > 0 and utilisation in (0, 1]")
    return flops / (gpu_flops * utilisation)


def split_layers(n_layers: int, stages: int) -> list[int]:
    """Layers per stage, as even as possible, earlier stages taking the remainder (30/8 -> 4,4,4,4,4,4,3,3)."""
    if not 1 <= stages <= n_layers:
        raise ValueError(f"cannot cut {n_layers} layers into {stages} stages")
    base, extra = divmod(n_layers, stages)
    return [base + (1 if s < extra else 0) for s in range(stages)]


# ---------------------------------------------------------------------------------------------
# Projection: dense vs M95 + anchor prior + compressed DP


@dataclass(frozen=True, slots=True)
class Projection:
    """Predictions of :func:`project` for one architecture, by variant, with the assumptions used."""

    arch: ArchSpec
    variants: dict[str, Prediction]
    notes: tuple[str, ...]

    @property
    def speedup(self) -> float:
        """``m95_ap_dp`` over ``dense`` tokens/s."""
        return self.variants["m95_ap_dp"].tokens_per_s / self.variants["dense"].tokens_per_s

    def table(self) -> str:
        """A markdown table, one row per variant."""
        rows = ["| variant | tok/s | bottleneck | B/token pp_fwd | pp_bwd | dp | anchor | total |",
                "|---|---|---|---|---|---|---|---|"]
        for name, p in self.variants.items():
            b = p.bytes_per_token
            rows.append(f"| {name} | {p.tokens_per_s:,.0f} | {p.bottleneck} | {b['pp_fwd']:,.0f} | "
                        f"{b['pp_bwd']:,.0f} | {b['dp']:,.0f} | {b['anchor']:,.0f} | {p.total_bytes_per_token:,.0f} |")
        return "\n".join(rows)


def _stage_param_shapes(arch: ArchSpec, layers: int, first: bool, last: bool) -> tuple[list[tuple[int, int]], int]:
    """2-D matrices and the count of 1-D parameters held by a stage (embedding first, norm + lm_head last)."""
    mats = [shape for _ in range(layers) for shape in arch.layer_matrices().values()]
    vec = layers * 2 * arch.hidden
    if first:
        mats.append((arch.vocab, arch.hidden))
    if last:
        mats.append((arch.vocab, arch.hidden))  # tied: a copy of the embedding; its gradient is synced too
        vec += arch.hidden
    return mats, vec


@dataclass(frozen=True, slots=True)
class ProjectionInputs:
    """Per-stage inputs of a projection: compute seconds and bytes per microbatch / sync / cycle."""

    layers: list[int]
    keep: int  # channels kept per token at the mask ratio
    computes: list[float]  # seconds per microbatch (forward + backward) per stage
    dense_pp: float  # boundary bytes per microbatch, dense
    masked_pp: float  # boundary bytes per microbatch, masked
    dense_dp: list[float]  # per stage: all parameters
    psgd_dp: list[float]  # per stage: PowerSGD factors + 1-D parameters
    prior: list[float]  # per stage: the anchor prior's factors


def projection_inputs(
    arch: ArchSpec, stages: int, *, gpu_flops: float = 71e12, utilisation: float = 0.4, seq_len: int = 1024,
    tokens_per_microbatch: int = 4096, mask_ratio: float = 0.95, wire_bytes: int = 2, dense_dp_bytes: int = 2,
    powersgd_rank: int = 64, powersgd_bytes: int = 2, anchor_rank: int = 32,
) -> ProjectionInputs:
    """What :func:`project` (and :func:`meshnode.perf_sim.project`) derive from an architecture's shapes."""
    layers = split_layers(arch.n_layers, stages)
    keep = round((1 - mask_ratio) * arch.hidden)
    computes, dense_dp, psgd_dp, prior = [], [], [], []
    for s, n in enumerate(layers):
        first, last = s == 0, s == stages - 1
        flops = arch_flops_per_token(arch, seq_len, n_layers=n, lm_head=last) * tokens_per_microbatch
        computes.append(stage_compute_time(flops, gpu_flops, utilisation))
        mats, vec = _stage_param_shapes(arch, n, first, last)
        dense_dp.append((sum(a * b for a, b in mats) + vec) * dense_dp_bytes)
        psgd_dp.append((sum(powersgd_rank * (a + b) for a, b in mats) + vec) * powersgd_bytes)
        targeted = [shape for _ in range(n) for shape in arch.layer_matrices().values()]
        prior.append(sum(min(anchor_rank, a, b) * (a + b + 1) for a, b in targeted) * 2)  # U, s, V in fp16
    return ProjectionInputs(
        layers=layers, keep=keep, computes=computes, dense_pp=arch.hidden * wire_bytes * tokens_per_microbatch,
        masked_pp=keep * wire_bytes * tokens_per_microbatch, dense_dp=dense_dp, psgd_dp=psgd_dp, prior=prior,
    )


def project(
    arch: ArchSpec | str,
    stages: int = 8,
    replicas: int = 7,
    bandwidth: float = 200e6,
    *,
    latency: float = 0.02,
    gpu_flops: float = 71e12,
    utilisation: float = 0.4,
    seq_len: int = 1024,
    tokens_per_microbatch: int = 4096,
    microbatches_per_step: int = 4,
    microbatches_in_flight: int | None = None,
    mask_ratio: float = 0.95,
    wire_bytes: int = 2,
    dense_dp_bytes: int = 2,
    powersgd_rank: int = 64,
    powersgd_bytes: int = 2,
    dp_inner_steps: int = 10,
    anchor_rank: int = 32,
    anchor_period: int = 20,
) -> Projection:
    """Dense training vs M95 masking (+ compressed DP, + anchor prior) on a ``stages`` x ``replicas`` mesh.

    Variants: ``dense`` (dense boundaries, dense DP all-reduce every step), ``m95`` (masked boundaries,
    dense DP), ``m95_dp`` (masked boundaries, PowerSGD DP every ``dp_inner_steps``), ``m95_ap_dp``
    (that plus anchor priors downloaded by every fast peer every ``anchor_period`` steps; the anchor
    pipeline's own dense traffic is added to the ``anchor`` bytes per token).
    """
    arch = ARCH_PRESETS[arch] if isinstance(arch, str) else arch
    in_flight = microbatches_in_flight or stages * replicas
    inp = projection_inputs(arch, stages, gpu_flops=gpu_flops, utilisation=utilisation, seq_len=seq_len,
                            tokens_per_microbatch=tokens_per_microbatch, mask_ratio=mask_ratio, wire_bytes=wire_bytes,
                            dense_dp_bytes=dense_dp_bytes, powersgd_rank=powersgd_rank,
                            powersgd_bytes=powersgd_bytes, anchor_rank=anchor_rank)
    layers, keep, dense_pp, masked_pp = inp.layers, inp.keep, inp.dense_pp, inp.masked_pp
    computes, dense_dp, psgd_dp, prior = inp.computes, inp.dense_dp, inp.psgd_dp, inp.prior

    def shape(h: int) -> SwarmShape:
        return SwarmShape(stages, replicas, in_flight, tokens_per_microbatch, dp_inner_steps=h,
                          microbatches_per_step=microbatches_per_step, anchor_period_steps=anchor_period)

    link = LinkSpec(bandwidth, latency)

    def costs(pp: float, dp: list[float], anchor: list[float] | None) -> list[StageCost]:
        return [StageCost(c, pp, pp, d, anchor[s] if anchor else 0.0)
                for s, (c, d) in enumerate(zip(computes, dp, strict=True))]

    variants = {
        "dense": predict_tokens_per_s(costs(dense_pp, dense_dp, None), shape(1), link),
        "m95": predict_tokens_per_s(costs(masked_pp, dense_dp, None), shape(1), link),
        "m95_dp": predict_tokens_per_s(costs(masked_pp, psgd_dp, None), shape(dp_inner_steps), link),
        "m95_ap_dp": predict_tokens_per_s(costs(masked_pp, psgd_dp, prior), shape(dp_inner_steps), link),
    }
    # The anchor pipeline (1 replica x Y stages, dense boundaries) runs one step's batch per cycle.
    anchor_tokens = microbatches_per_step * tokens_per_microbatch
    anchor_pp = (stages - 1) * 2 * arch.hidden * wire_bytes * anchor_tokens
    fast_tokens_per_cycle = anchor_period * replicas * anchor_tokens
    ap = variants["m95_ap_dp"]
    bpt = dict(ap.bytes_per_token)
    bpt["anchor"] += anchor_pp / fast_tokens_per_cycle
    variants["m95_ap_dp"] = dataclasses.replace(ap, bytes_per_token=bpt)
    anchor_pred = predict_tokens_per_s(
        [StageCost(c, dense_pp, dense_pp) for c in computes],
        SwarmShape(stages, 1, stages, tokens_per_microbatch), link)
    anchor_cycle_s = anchor_tokens / anchor_pred.tokens_per_s
    fast_cycle_s = fast_tokens_per_cycle / ap.tokens_per_s

    notes = (
        f"{arch.name}: {arch.params() / 1e6:.1f}M parameters, layers per stage {layers}, embedding on stage 0, "
        f"final norm + lm_head on stage {stages - 1} (tied weights counted on both for DP)",
        f"mesh {stages} stages x {replicas} replicas; every peer {bandwidth / 1e6:g} Mbit/s each way, "
        f"{latency * 1e3:g} ms one way; {in_flight} microbatches in flight",
        f"compute: {gpu_flops / 1e12:g} TFLOP/s peak at {utilisation:.0%} utilisation; training FLOPs "
        f"6N + 12 L T d_attn with seq_len {seq_len}; microbatch {tokens_per_microbatch} tokens, "
        f"{microbatches_per_step} microbatches per optimizer step",
        f"stage compute per microbatch (ms): {', '.join(f'{c * 1e3:.0f}' for c in computes)}",
        f"dense boundary payload: {arch.hidden} values x {wire_bytes} B per token each way; M{mask_ratio * 100:g}: "
        f"{keep} values per token (no indices, PRF-shared mask)",
        f"dense DP: all parameters of the stage, {dense_dp_bytes} B each, butterfly all-reduce every step",
        f"compressed DP: PowerSGD rank {powersgd_rank} (P and Q, {powersgd_bytes} B/value) on every 2-D matrix, "
        f"1-D parameters dense, every H={dp_inner_steps} steps; overlapped with compute",
        f"anchor prior: rank {anchor_rank} U, s, V in fp16 of q,k,v,o,gate,up,down per layer, downloaded by "
        f"every fast peer every {anchor_period} steps; the anchor pipeline's dense traffic adds "
        f"{anchor_pp / fast_tokens_per_cycle:.0f} B per fast token",
        f"anchor keeps up: one cycle ~{anchor_cycle_s:.1f} s vs {anchor_period} fast steps "
        f"~{fast_cycle_s:.1f} s" + ("" if anchor_cycle_s <= fast_cycle_s else " (too slow: priors come late)"),
        "not modelled: stragglers, churn, TCP dynamics, memory limits, DP/anchor latency",
    )
    return Projection(arch=arch, variants=variants, notes=notes)
