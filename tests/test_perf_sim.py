"""The event-level cost model against schedules worked out by hand."""

from __future__ import annotations

import dataclasses

import pytest

from meshnode.perf_sim import SimSpec, SimStage, simulate, simulate_with_background

T = 100  # tokens per microbatch


def _spec(stages, replicas=None, **kw):
    kw.setdefault("bandwidth_bps", 8e3)  # 1000 bytes/s
    kw.setdefault("latency_s", 0.0)
    kw.setdefault("microbatches", 1)
    kw.setdefault("steps", 8)
    kw.setdefault("warmup_steps", 2)
    return SimSpec(stages=stages, replicas=replicas or [1] * len(stages), tokens_per_microbatch=T, **kw)


def test_comm_bound_one_microbatch():
    # 500 B forward at 1000 B/s, 250 B back: a step is 0.75 s
    r = simulate(_spec([SimStage(0, 0, 500, 0), SimStage(0, 0, 0, 250)]))
    assert r.step_s == pytest.approx(0.75)
    assert r.tokens_per_s == pytest.approx(T / 0.75)


def test_compute_bound_schedule():
    # driver: fwd 1, bwd 2 per microbatch; stage 1: fwd 1 + bwd 2. Two microbatches:
    # driver fwd 0-1, 1-2; stage 1 runs mb0 1-4, mb1 4-7; driver bwd mb0 4-6, mb1 7-9 -> step 9 s
    r = simulate(_spec([SimStage(1, 2, 0, 0), SimStage(1, 2, 0, 0)], microbatches=2))
    assert r.step_s == pytest.approx(9.0)
    assert r.tokens_per_s == pytest.approx(2 * T / 9.0)
    assert r.busy_fraction["s1r0"] == pytest.approx(6 / 9, rel=0.05)


def test_latency_bound():
    r = simulate(_spec([SimStage(0, 0, 0, 0)] * 3, latency_s=0.1, microbatches=4))
    assert r.step_s == pytest.approx(4 * 0.1)  # two hops down, two back; all 4 microbatches together
    assert r.tokens_per_s == pytest.approx(4 * T / 0.4)


def test_one_connection_is_first_in_first_out():
    # two 1000 B messages to the one stage-1 peer: they go one after the other (1 s, 2 s), so the
    # first microbatch's 1 s of stage-1 compute overlaps the second's transfer: step = 2 + 1 = 3 s
    r = simulate(_spec([SimStage(0, 0, 1000, 0), SimStage(0.5, 0.5, 0, 0)], microbatches=2))
    assert r.step_s == pytest.approx(3.0)


def test_two_connections_share_the_uplink_fairly():
    # the driver sends one microbatch to each of two stage-1 peers: 500 B/s each, both arrive at 2 s,
    # then 1 s of compute on each, in parallel
    r = simulate(_spec([SimStage(0, 0, 1000, 0), SimStage(0.5, 0.5, 0, 0)], replicas=[1, 2], microbatches=2))
    assert r.step_s == pytest.approx(3.0)
    assert r.link_utilisation["s0r0"] == pytest.approx(2 / 3, rel=0.05)


def test_dp_blocking_costs_the_matchmaking_and_overlap_does_not():
    stages = [SimStage(0.5, 0.5, 0, 0), SimStage(0.5, 0.5, 0, 0)]
    base = simulate(_spec(stages, replicas=[2, 2]))
    assert base.step_s == pytest.approx(2.0)
    kw = dict(replicas=[2, 2], dp_inner_steps=2, dp_bytes=[1000, 1000], dp_matchmaking_s=1.0)
    blocking = simulate(_spec(stages, dp_blocking=True, **kw))
    # every 2nd step each stage waits 1 s + 1000 B each way at 1000 B/s (and the stage-1 wait delays the driver)
    assert blocking.step_s > base.step_s + 0.9
    overlapped = simulate(_spec(stages, dp_blocking=False, **kw))
    assert overlapped.step_s == pytest.approx(base.step_s)  # no pipeline bytes compete here


@pytest.mark.parametrize("bw", [2e3, 8e3, 32e3])
def test_more_bandwidth_or_less_compute_never_slows_down(bw):
    def tps(bandwidth, c):
        stages = [SimStage(c, 2 * c, 300, 0), SimStage(c, 2 * c, 0, 300)]
        spec = _spec(stages, replicas=[2, 2], microbatches=4, bandwidth_bps=bandwidth, latency_s=0.02)
        return simulate(spec).tokens_per_s

    assert tps(2 * bw, 0.1) >= tps(bw, 0.1) * (1 - 1e-9)
    assert tps(bw, 0.05) >= tps(bw, 0.1) * (1 - 1e-9)


def test_bad_specs_are_refused():
    with pytest.raises(ValueError):
        _spec([SimStage(0, 0, 0, 0)], replicas=[0])
    with pytest.raises(ValueError):
        _spec([SimStage(0, 0, 0, 0)], bandwidth_bps=0)
    with pytest.raises(ValueError):
        _spec([SimStage(0, 0, 0, 0)], steps=2, warmup_steps=2)


def test_projection_compressed_variants_beat_dense_on_a_slow_link():
    from meshnode.perf_sim import PROJECT_VARIANTS, project

    res = project("SmolLM2-135M", stages=2, replicas=2, bandwidth=50e6, steps=8)
    assert set(res) == set(PROJECT_VARIANTS)
    dense = res["dense"].tokens_per_s
    assert res["m95"].tokens_per_s > dense  # smaller boundaries, same dense DP
    assert res["m95_ap_dp"].tokens_per_s > 5 * dense  # dense DP every step dominates the baseline
    assert res["rotq2_dp"].tokens_per_s > 5 * dense


def test_shared_cores_slow_compute_bound_swarms_down():
    # two drivers, one stage: each microbatch is 1 s of compute; with a core each a step is 1 s,
    # with one core shared by both it is 2 s
    stages = [SimStage(0.5, 0.5, 0, 0)]
    own = simulate(_spec(stages, replicas=[2]))
    shared = simulate(_spec(stages, replicas=[2], cores=1))
    assert own.step_s == pytest.approx(1.0)
    assert shared.step_s == pytest.approx(2.0)
    assert simulate(_spec(stages, replicas=[2], cores=2)).step_s == pytest.approx(1.0)


def test_message_overhead_adds_to_every_hop():
    base = simulate(_spec([SimStage(0, 0, 0, 0)] * 3, latency_s=0.1))
    slow = simulate(_spec([SimStage(0, 0, 0, 0)] * 3, latency_s=0.1, message_overhead_s=0.05))
    assert base.step_s == pytest.approx(0.4)
    assert slow.step_s == pytest.approx(0.4 + 4 * 0.05)  # four messages on the critical path


def test_anchor_cycle_fetches_stage_by_stage_then_publishes():
    # driver steps take 1 s (0.5 fwd + 0.5 bwd, no bytes); period 2: the cycle starts when step 2 ends (t = 2),
    # fetches stage 0 (1000 B at 1000 B/s: t = 3), then stage 1 (2000 B: t = 5), computes 0.5 s and publishes
    # at 5.5; driver 0 is then at step 5, so the next cycle starts at step 7 (t = 7) and publishes at 10.5
    kw = dict(anchor_period=2, snapshot_bytes=[1000, 2000], anchor_compute_s=0.5, steps=12, prior_bytes=[100, 300])
    stages = [SimStage(0.5, 0.5, 0, 0), SimStage(0, 0, 0, 0)]
    direct = simulate(_spec(stages, **kw))
    assert direct.anchor_published[:2] == pytest.approx([5.5, 10.5])
    assert direct.step_s == pytest.approx(1.0)  # the anchor has its own link: the chain does not notice
    # through the DHT (at most 5 holders, here both fast peers): each stage's prior goes to every peer
    dht = simulate(_spec(stages, prior_holders=5, **kw))
    sent = {name: r.link_utilisation["anchor"] * r.sim_time_s * 1000 for name, r in (("d", direct), ("h", dht))}
    assert sent["d"] == pytest.approx(2 * 400, rel=0.01)  # two cycles, 100 + 300 bytes each
    assert sent["h"] == pytest.approx(2 * 800, rel=0.01)


def test_background_traffic_costs_only_while_the_link_carries_pipeline_bytes():
    # comm-bound: 500 B down and 250 B back at 1000 B/s (step 0.75 s); each peer's uplink is busy while it
    # sends: 2/3 and 1/3 of the time, mean u = 1/2 at any capacity. 200 B/s of background -> the pipeline
    # keeps 1000 - 0.5 * 200 = 900 B/s: step 750 / 900 s (taking all 200 B/s off would give 750 / 800)
    comm = _spec([SimStage(0, 0, 500, 0), SimStage(0, 0, 0, 250)])
    r = simulate_with_background(comm, background_bps=1600)
    assert r.step_s == pytest.approx(750 / 900, rel=1e-3)
    assert simulate_with_background(comm, 0).step_s == pytest.approx(simulate(comm).step_s)
    # compute-bound with small messages: the links are nearly idle, so the background costs almost nothing,
    # where taking it off the link whole costs more
    busy = _spec([SimStage(1, 2, 50, 0), SimStage(1, 2, 0, 50)], microbatches=2, bandwidth_bps=800)
    nominal, bg = simulate(busy), 400
    elastic = simulate_with_background(busy, bg)
    whole = simulate(dataclasses.replace(busy, bandwidth_bps=busy.bandwidth_bps - bg))
    assert whole.tokens_per_s < elastic.tokens_per_s <= nominal.tokens_per_s
    assert elastic.tokens_per_s > 0.98 * nominal.tokens_per_s


def test_call_timings_split_the_round_trip_as_the_traces_do():
    # driver -> stage 1 (500 B at 1000 B/s, 0.1 s latency + 0.05 s overhead), stage 1 computes 0.2 + 0.3 s and the
    # 250 B gradient goes back: fwd 0.65, serve 0.5, bwd 0.4, round trip 1.55
    r = simulate(_spec([SimStage(0, 0, 500, 0), SimStage(0.2, 0.3, 0, 250)], latency_s=0.1, message_overhead_s=0.05))
    m = r.message_s
    assert (m["fwd"], m["serve"], m["bwd"], m["rtt"]) == pytest.approx((0.65, 0.5, 0.4, 1.55))
    assert m["calls"] >= 4
    # two microbatches sent at once queue on one connection: forward transits 0.5 and 1.0 s, serve 0.5 each
    # (the second arrives as the first is done), gradients 0.25 each, round trips 1.25 and 1.75 s
    two = simulate(_spec([SimStage(0, 0, 500, 0), SimStage(0.2, 0.3, 0, 250)], microbatches=2)).message_s
    assert (two["fwd"], two["serve"], two["bwd"], two["rtt"]) == pytest.approx((0.75, 0.5, 0.25, 1.5))


def test_token_buckets_let_short_messages_through_after_an_idle_gap():
    # 1000 B/s links with 300 B buckets; 500 B forward, 250 B back. The gradient finds the stage's uplink and
    # the driver's downlink idle for the whole forward transfer, so it goes at once; the forward's buckets are
    # empty each time (the driver's uplink never rests): a step is 0.5 s instead of 0.75
    stages = [SimStage(0, 0, 500, 0), SimStage(0, 0, 0, 250)]
    assert simulate(_spec(stages)).step_s == pytest.approx(0.75)
    r = simulate(_spec(stages, burst_bytes=300))
    assert r.step_s == pytest.approx(0.5)
    assert r.message_s["bwd"] == pytest.approx(0.0) and r.message_s["fwd"] == pytest.approx(0.5)
    # a bucket never adds capacity: a saturated link (back-to-back microbatches) runs at its rate either way
    heavy = [SimStage(0, 0, 5000, 0), SimStage(0, 0, 0, 0)]
    assert simulate(_spec(heavy, burst_bytes=300, steps=12)).step_s == pytest.approx(5.0, rel=0.07)
    with pytest.raises(ValueError, match="burst"):
        _spec(stages, burst_bytes=-1)
