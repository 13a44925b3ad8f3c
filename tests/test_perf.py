"""meshnode.perf: hand-computed cost-model cases, monotonicity properties, FLOPs helpers, projections."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshnode import perf
from meshnode.perf import LinkSpec, StageCost, SwarmShape, predict_tokens_per_s

# ---------------------------------------------------------------------------------------------
# Hand-computed cases


def test_compute_bound():
    # 2 stages, 1 replica: transfers 8 ms (1 MB at 1 Gbit/s) < 100 ms compute.
    p = predict_tokens_per_s(StageCost(0.1, 1e6, 1e6), SwarmShape(2, 1, 4, 1000), LinkSpec(1e9, 0.0))
    assert p.limit == "compute"
    assert p.microbatches_per_s == pytest.approx(10.0)
    assert p.tokens_per_s == pytest.approx(10_000.0)
    assert p.round_trip_s == pytest.approx(0.2 + 8 * 2e6 / 1e9)  # 2 computes + one boundary both ways
    assert p.latency_bound_tokens_per_s == pytest.approx(4 * 1000 / 0.216)
    assert p.stages[0].uplink_s == pytest.approx(0.008)
    assert p.stages[0].busy_fraction == pytest.approx(1.0)
    assert p.bytes_per_token == pytest.approx({"pp_fwd": 1000.0, "pp_bwd": 1000.0, "dp": 0.0, "anchor": 0.0})


def test_comm_bound_middle_stage():
    # 3 stages x 2 replicas at 100 Mbit/s: the middle stage uploads fwd + bwd = 2 MB -> 160 ms per microbatch.
    p = predict_tokens_per_s(StageCost(0.01, 1e6, 1e6), SwarmShape(3, 2, 1000, 500), LinkSpec(100e6, 0.01))
    assert p.limit == "uplink" and p.bottleneck_stage == 1
    assert p.stages[0].time_per_microbatch_s == pytest.approx(0.08)  # ends move 1 MB each way
    assert p.stages[1].time_per_microbatch_s == pytest.approx(0.16)
    assert p.microbatches_per_s == pytest.approx(2 / 0.16)
    assert p.tokens_per_s == pytest.approx(500 * 2 / 0.16)
    assert "stage 1 uplink" in p.bottleneck


def test_latency_bound():
    # 4 stages, 100 ms compute each, 50 ms one way, one microbatch in flight: T_rt = 0.4 + 3 * 2 * 0.05 = 0.7 s.
    p = predict_tokens_per_s(StageCost(0.1), SwarmShape(4, 1, 1, 100), LinkSpec(1e9, 0.05))
    assert p.limit == "latency" and p.bottleneck_stage is None
    assert p.round_trip_s == pytest.approx(0.7)
    assert p.tokens_per_s == pytest.approx(100 / 0.7)
    assert p.steady_tokens_per_s == pytest.approx(1000.0)
    assert p.in_flight_needed == 7  # ceil(10 microbatches/s * 0.7 s)
    more = predict_tokens_per_s(StageCost(0.1), SwarmShape(4, 1, 7, 100), LinkSpec(1e9, 0.05))
    assert more.limit == "compute" and more.tokens_per_s == pytest.approx(1000.0)


def test_dp_traffic_spread_over_inner_steps():
    # 1 stage x 4 replicas; 1 MB payload all-reduced every H=10 steps of m=2 microbatches:
    # per peer and microbatch 2 * 3/4 * 1e6 / 20 = 75 kB each way.
    shape = SwarmShape(1, 4, 100, 1000, dp_inner_steps=10, microbatches_per_step=2)
    fast = predict_tokens_per_s(StageCost(0.01, dp_bytes=1e6), shape, LinkSpec(1e8))
    assert fast.stages[0].uplink_bytes["dp"] == pytest.approx(75_000)
    assert fast.limit == "compute"  # 6 ms of DP traffic < 10 ms compute
    assert fast.bytes_per_token["dp"] == pytest.approx(75.0)
    slow = predict_tokens_per_s(StageCost(0.01, dp_bytes=1e6), shape, LinkSpec(1e7))
    assert slow.limit == "uplink" and slow.microbatches_per_s == pytest.approx(4 / 0.06)
    alone = predict_tokens_per_s(StageCost(0.01, dp_bytes=1e6), dataclasses.replace(shape, replicas_per_stage=1),
                                 LinkSpec(1e7))
    assert alone.bytes_per_token["dp"] == 0.0  # one replica: nothing to synchronise


def test_anchor_prior_on_downlink():
    shape = SwarmShape(1, 1, 10, 1000, microbatches_per_step=5, anchor_period_steps=20)
    p = predict_tokens_per_s(StageCost(0.001, anchor_bytes=1e6), shape, LinkSpec(1e8))
    assert p.stages[0].downlink_bytes["anchor"] == pytest.approx(1e6 / 100)
    assert p.stages[0].downlink_s == pytest.approx(8e4 / 1e8)
    assert p.limit == "compute"  # 0.8 ms < 1 ms
    assert p.bytes_per_token["anchor"] == pytest.approx(10.0)


def test_no_overlap_adds_transfer_to_compute():
    shape = SwarmShape(2, 1, 100, 1, overlap=False)
    p = predict_tokens_per_s(StageCost(0.1, 1e6, 1e6), shape, LinkSpec(1e8))
    assert p.stages[0].time_per_microbatch_s == pytest.approx(0.18)


def test_heterogeneous_stages_and_validation():
    costs = [StageCost(0.1), StageCost(0.3), StageCost(0.1)]
    p = predict_tokens_per_s(costs, SwarmShape(3, (1, 3, 1), 100, 10), LinkSpec(1e9))
    assert p.microbatches_per_s == pytest.approx(10.0)  # stage 1: 3 replicas / 0.3 s = stages 0, 2
    with pytest.raises(ValueError):
        predict_tokens_per_s(costs, SwarmShape(2, 1, 1, 1), LinkSpec(1e9))
    with pytest.raises(ValueError):
        predict_tokens_per_s(costs, SwarmShape(3, (1, 2), 1, 1), LinkSpec(1e9))
    with pytest.raises(ValueError):
        predict_tokens_per_s(costs, SwarmShape(3, 1, 1, 1), LinkSpec(0.0))


# ---------------------------------------------------------------------------------------------
# Monotonicity

_bytes = st.floats(0, 1e8)
_stage = st.builds(StageCost, st.floats(1e-4, 10), _bytes, _bytes, _bytes, _bytes)


@st.composite
def _swarms(draw, min_replicas=1):
    y = draw(st.integers(1, 6))
    costs = draw(st.lists(_stage, min_size=y, max_size=y))
    replicas = tuple(draw(st.lists(st.integers(min_replicas, 8), min_size=y, max_size=y)))
    shape = SwarmShape(y, replicas, draw(st.integers(1, 64)), draw(st.integers(1, 8192)),
                       dp_inner_steps=draw(st.integers(1, 50)), microbatches_per_step=draw(st.integers(1, 8)),
                       anchor_period_steps=draw(st.integers(1, 50)), overlap=draw(st.booleans()))
    link = LinkSpec(draw(st.floats(1e5, 1e11)), draw(st.floats(0, 0.5)))
    return costs, shape, link


def _tps(costs, shape, link) -> float:
    return predict_tokens_per_s(costs, shape, link).tokens_per_s


def _no_less(a: float, b: float) -> bool:
    return a >= b * (1 - 1e-12)


@settings(max_examples=300, deadline=None)
@given(_swarms(), st.floats(1.0, 100.0))
def test_more_bandwidth_never_lowers(swarm, factor):
    costs, shape, link = swarm
    faster = dataclasses.replace(link, bandwidth_bps=link.bandwidth_bps * factor)
    assert _no_less(_tps(costs, shape, faster), _tps(costs, shape, link))


@settings(max_examples=300, deadline=None)
@given(_swarms(), st.floats(1.0, 100.0), st.integers(0, 5))
def test_more_compute_never_raises(swarm, factor, which):
    costs, shape, link = swarm
    s = which % len(costs)
    slower = list(costs)
    slower[s] = dataclasses.replace(costs[s], compute_s=costs[s].compute_s * factor)
    assert _no_less(_tps(costs, shape, link), _tps(slower, shape, link))


@settings(max_examples=300, deadline=None)
@given(_swarms(min_replicas=2), st.integers(1, 8), st.integers(0, 5))
def test_more_replicas_never_lowers(swarm, extra, which):
    costs, shape, link = swarm
    replicas = list(shape.replicas())
    replicas[which % len(replicas)] += extra
    more = dataclasses.replace(shape, replicas_per_stage=tuple(replicas))
    assert _no_less(_tps(costs, more, link), _tps(costs, shape, link))


@settings(max_examples=200, deadline=None)
@given(_swarms(), st.integers(1, 8), st.integers(0, 5))
def test_more_replicas_never_lowers_without_dp(swarm, extra, which):
    costs, shape, link = swarm
    costs = [dataclasses.replace(c, dp_bytes=0.0) for c in costs]
    replicas = list(shape.replicas())
    replicas[which % len(replicas)] += extra
    more = dataclasses.replace(shape, replicas_per_stage=tuple(replicas))
    assert _no_less(_tps(costs, more, link), _tps(costs, shape, link))


def test_second_replica_can_cost_more_than_it_adds():
    """From 1 to 2 replicas DP switches on: with huge DP payloads that is slower, and the model says so."""
    cost = StageCost(0.01, dp_bytes=1e9)
    one = _tps(cost, SwarmShape(1, 1, 10, 100), LinkSpec(1e8))
    two = _tps(cost, SwarmShape(1, 2, 10, 100), LinkSpec(1e8))
    assert two < one


@settings(max_examples=200, deadline=None)
@given(_swarms(), st.floats(0.0, 1.0))
def test_more_latency_never_raises(swarm, extra):
    costs, shape, link = swarm
    later = dataclasses.replace(link, latency_s=link.latency_s + extra)
    assert _no_less(_tps(costs, shape, link), _tps(costs, shape, later))


# ---------------------------------------------------------------------------------------------
# FLOPs and presets


def test_flops_per_token_by_hand():
    # 1 layer, hidden 4, 2 heads (head dim 2), intermediate 8, vocab 10, seq 3:
    # attention 4 * 16 + MLP 3 * 32 + lm_head 40 = 200 matmul parameters.
    kw = dict(n_layers=1, hidden=4, intermediate=8, vocab=10, seq_len=3, n_heads=2)
    assert perf.transformer_flops_per_token(**kw) == 6 * 200 + 12 * 1 * 3 * 4
    assert perf.transformer_flops_per_token(**kw, training=False) == 2 * 200 + 4 * 1 * 3 * 4
    assert perf.transformer_flops_per_token(**kw, include_lm_head=False) == 6 * 160 + 12 * 3 * 4
    # grouped-query attention: k, v shrink to 1 head of dim 2 -> 2 * (4 * 2) instead of 2 * 16
    assert perf.transformer_flops_per_token(**kw, n_kv_heads=1) == 6 * (200 - 32 + 16) + 12 * 3 * 4


def test_presets_match_published_sizes():
    assert perf.SMOLLM2_135M.params() == pytest.approx(134.5e6, rel=0.005)
    assert perf.LLAMA_3_2_1B.params() == pytest.approx(1.236e9, rel=0.005)
    assert perf.LLAMA_3_2_1B.d_head == 64 and perf.SMOLLM2_135M.d_head == 64
    assert set(perf.ARCH_PRESETS) == {"SmolLM2-135M", "Llama-3.2-1B"}


def test_stage_compute_time_and_split():
    assert perf.stage_compute_time(1e12, 1e12, 0.5) == pytest.approx(2.0)
    with pytest.raises(ValueError):
        perf.stage_compute_time(1.0, 1e12, 0.0)
    assert perf.split_layers(30, 8) == [4, 4, 4, 4, 4, 4, 3, 3]
    assert perf.split_layers(16, 8) == [2] * 8


@pytest.mark.parametrize("arch", ["SmolLM2-135M", "Llama-3.2-1B"])
def test_project_orders_variants(arch):
    proj = perf.project(arch)
    v = proj.variants
    assert set(v) == {"dense", "m95", "m95_dp", "m95_ap_dp"}
    assert v["dense"].tokens_per_s <= v["m95"].tokens_per_s <= v["m95_dp"].tokens_per_s
    assert v["m95_ap_dp"].tokens_per_s == pytest.approx(v["m95_dp"].tokens_per_s)  # the prior is off-path
    assert v["dense"].limit == "uplink"  # dense DP every step dominates at 200 Mbit/s
    m95 = v["m95"].bytes_per_token
    assert m95["pp_fwd"] == pytest.approx(v["dense"].bytes_per_token["pp_fwd"] * 0.05, rel=0.05)
    assert v["m95_ap_dp"].bytes_per_token["anchor"] > 0
    assert proj.speedup > 10
    assert len(proj.notes) >= 5 and "|" in proj.table()


def test_project_llama_bytes_per_token_under_a_fortieth_of_dense():
    v = perf.project(perf.LLAMA_3_2_1B).variants
    assert v["m95_ap_dp"].total_bytes_per_token < v["dense"].total_bytes_per_token / 40
